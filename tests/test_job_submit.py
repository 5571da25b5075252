"""`ray job submit` of the training job to a cluster started with the real `ray start` CLI.

The cluster is a head (dashboard and job server) plus two spot nodes on 127.0.0.1; the job
is submitted with the real CLI and a short TOML config, exactly as a user would.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from raystart import ray_env

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]

CONFIG = """
[model]
n_layers = 2
d_model = 64
d_ff = 128
n_heads = 2
seq_len = 64

[training]
batch_size = 8
target_batch_size = 32
round_timeout_s = 5
max_steps = 6
"""


@pytest.mark.timeout(900)
def test_ray_job_submit_runs_training_to_completion(ray_start_cluster, tmp_path: Path):
    config = tmp_path / "train.toml"
    config.write_text(CONFIG)
    cluster = ray_start_cluster
    # -X faulthandler: should a driver crash (a segfault once ended the digits run after
    # its summary), its Python stacks are in the job's logs, which the asserts show.
    proc = subprocess.run(
        ["ray", "job", "submit", "--address", cluster.dashboard_url,
         "--working-dir", str(REPO), "--",
         "python", "-X", "faulthandler", "-m", "moshray.jobs.train", "--config",
         str(config), "--json"],
        capture_output=True, text=True, timeout=600, env=cluster.env,
    )
    # The public API's example, submitted the same way: moshray.fit runs on this
    # cluster (RAY_ADDRESS is set by the job server), not on an embedded one.
    digits = subprocess.run(
        ["ray", "job", "submit", "--address", cluster.dashboard_url, "--",
         "python", "-X", "faulthandler", "-m", "moshray.jobs.examples.digits", "--json",
         "--max-seconds", "20"],
        capture_output=True, text=True, timeout=600, env=cluster.env,
    )
    # Replica groups (cluster.replica = "node"): the built-in LM as one group of 2 CPU
    # ranks per spot node, its model sharded by FSDP2, averaged by shard.
    groups = subprocess.run(
        ["ray", "job", "submit", "--address", cluster.dashboard_url, "--",
         "python", "-X", "faulthandler", "-m", "moshray.jobs.train", "--config",
         str(config), "--set", "cluster.replica=node", "--json"],
        capture_output=True, text=True, timeout=600, env=cluster.env,
    )
    groups_out = groups.stdout + groups.stderr
    assert groups.returncode == 0, groups_out[-4000:]
    grouped = json.loads([line for line in groups_out.splitlines() if line.startswith("{")][-1])
    assert grouped["replica"] == "node" and grouped["groups_max"] == 2
    assert grouped["ranks_per_group"] == 2 and grouped["steps"] == 6
    assert grouped["lost_steps"] == 0 and grouped["replicas_consistent"] is True
    digits_out = digits.stdout + digits.stderr
    assert digits.returncode == 0, digits_out[-4000:]
    result = json.loads([line for line in digits_out.splitlines() if line.startswith("{")][-1])
    assert result["replicas"] == 2 and result["replicas_consistent"] is True
    assert result["steps"] > 5 and result["test_accuracy"] > 0.5
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "succeeded" in out
    # the replicas' data fetches run in the loop's own thread, not on the actor's event loop
    assert "blocking ray.get" not in out, out[-4000:]
    # off a terminal: a progress line every 10 s and one for the last step, not one per step
    steps = [line for line in out.splitlines() if line.lstrip().startswith("step ")]
    assert 1 <= len(steps) <= 6, out[-4000:]
    summary = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert summary["steps"] >= 6
    assert summary["replicas"] == 2  # one replica per spot node, none on the head
    assert summary["replicas_consistent"] is True

