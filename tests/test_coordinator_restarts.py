"""The Coordinator killed 3 times during a run loses nothing (a restart forgets).

``tests/coordinator_restarts.py`` runs the training job on its own embedded cluster with a
trace (a notice, a hard kill, a join) and kills the Coordinator three times: after a few
steps, while the noticed node drains, after the hard kill. The summary must match what
happened: the steps and their history (every row seen before a kill is still there, one
row per step), both node losses and the notice, and training that went on across each
restart with identical replicas.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(600)
def test_three_coordinator_kills_lose_no_step_count_or_history(tmp_path: Path):
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("coordinator_restarts.py")), str(tmp_path)],
        capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    summary, history, kills = out["summary"], out["history"], out["kills"]

    seen = [{k: v for k, v in kill.items() if k != "history"} for kill in kills]
    assert len(kills) == 3 and out["last"]["restarts"] == 3, (seen, out["last"])
    # each restart restored the state: the history kept its name
    assert {k["incarnation"] for k in kills} == {out["last"]["incarnation"]}
    # One row per step of the final lineage, none missing: the history before each
    # restart is still there.
    epochs = [h[0] for h in history]
    assert epochs == list(range(1, summary["steps"] + 1)), epochs
    assert summary["samples"] == sum(h[2] for h in history)
    final = {h[0]: h for h in history}
    for kill in kills:
        # every row the driver held before the kill, but a last plan nobody may have
        # applied (made again after the restart), is unchanged (samples only grow: a
        # participant's count corrects its row)
        for row in kill["history"][:-1]:
            kept = final[row[0]]
            assert (kept[1], kept[4]) == (row[1], row[4]) and kept[2] >= row[2], (row, kept, seen)
        assert summary["steps"] >= kill["epoch"] + 6  # training went on after each restart
    # Killed after the notice: it is still counted after the restart, and no plan made
    # after it took the noticed node's replica (three peers).
    assert kills[1]["notices"] == 1 and kills[1]["notices_after"] == 1, kills[1]
    assert all(h[4] <= 2 for h in history if kills[1]["epoch"] < h[0] <= kills[2]["epoch"])
    # The losses and the notice: counted once each, across the restarts.
    assert kills[2]["preemptions"] == 2
    assert summary["notices"] == 1 and out["last"]["notices"] == 1
    assert summary["preemptions"] == 2 and summary["hard_losses"] == 1
    assert out["last"]["preemptions"] == 2  # the Coordinator's count of the driver's events
    assert summary["lost_steps"] == 0 and summary["rollbacks"] == 0
    assert summary["replicas"] == 2 and summary["replicas_consistent"] is True
