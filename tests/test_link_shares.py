"""DeDLOC shares over a shaped link between separate hosts: three averaging peers, one on a
10x slower link (``link_scenarios.shares``, in a process of its own). The slow node ends
with a smaller share than every fast one, and every step completes within its deadlines
with the exact average. Skips, with the reason, where namespaces cannot be made (no root).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster


def _unavailable() -> str | None:
    from moshray.jobs.local.netns import unavailable

    return unavailable()


@pytest.mark.skipif(_unavailable() is not None, reason=_unavailable() or "netns available")
@pytest.mark.timeout(300)
def test_slow_link_gets_a_smaller_share_and_no_round_stalls(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("link_scenarios.py")), "shares",
         str(tmp_path)], capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, f"shares scenario failed:\n{done.stderr[-6000:]}"
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\nshares: {figures}")
    shares = figures["last_shares"]
    assert shares["node2"] < min(shares["node0"], shares["node1"])  # node2: the slow link
    assert len(figures["step_wall_s"]) == 6  # every step completed (asserted inside)
