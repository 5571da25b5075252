"""Replica groups through the public API (``cluster.replica = "node"``):
``moshray.fit`` runs the user's own loop as groups of 2 ranks on the embedded cluster
(``tests/group_fit_scenario.py``, a user's script in its own process), and the settings and
data groups cannot take are refused with one line before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import moshray
from moshray.jobs.config import ConfigError, TrainConfig
from moshray.jobs.controller.groups import step_rows, swarm_config

SPOT = [{"CPU": 2.0, "spot": 1000.0}]


def _config(**training) -> TrainConfig:
    return TrainConfig.from_dict({"cluster": {"replica": "node", "max_nodes": 3},
                                  "training": training})


def test_the_swarm_follows_the_settings_and_the_nodes():
    s = swarm_config(_config(max_steps=10, mode="local_sgd", local_steps=4), SPOT)
    assert (s.steps, s.inner_steps, s.group.world_size, s.group.gpus_per_rank) == (12, 4, 2, 0)
    assert s.max_groups == 3 and s.need == {"CPU": 2.0, "spot": 2.0}  # spot workers only
    gpu = swarm_config(_config(max_steps=5), [{"CPU": 16.0, "GPU": 8.0, "spot": 1000.0}])
    assert (gpu.group.world_size, gpu.group.gpus_per_rank, gpu.steps) == (8, 1.0, 5)
    assert step_rows(_config(max_steps=1), 2) == 24  # divides among 1, 2 and 3 groups of 2


def test_what_groups_cannot_do_is_refused_with_one_line():
    with pytest.raises(ConfigError, match="need max_steps or max_seconds"):
        swarm_config(_config(), SPOT)
    with pytest.raises(ConfigError, match="training.mode: replica groups"):
        swarm_config(TrainConfig.from_dict({"cluster": {"replica": "node"},
                                            "training": {"mode": "auto", "max_steps": 3}}),
                     SPOT)
    with pytest.raises(moshray.UserError, match="take moshray.data.by_step") as err:
        moshray.fit(lambda s: None, moshray.data.from_fn(lambda *a: iter(())),
                    config={"cluster": {"replica": "node"}}, max_steps=2)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="save_model: replica groups keep their model as "
                       "sharded checkpoints"):
        moshray.fit(lambda s: None, moshray.data.by_step(lambda step: ()),
                    config={"cluster": {"replica": "node"}, "save_model": True}, max_steps=2)
    with pytest.raises(moshray.UserError, match="by_step is for replica groups"):
        moshray.fit(lambda s: None, moshray.data.by_step(lambda step: ()), max_steps=2)
    with pytest.raises(moshray.UserError, match="one argument, the step"):
        moshray.data.by_step(lambda a, b: None)


@pytest.mark.cluster
@pytest.mark.parametrize("mode", ["collaborative", "local_sgd"])
def test_fit_trains_a_users_loop_as_replica_groups(tmp_path, mode):
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("group_fit_scenario.py")),
                           mode, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["replica"] == "node" and summary["mode"] == mode
    assert summary["ranks_per_group"] == 2 and summary["groups_max"] == 2
    assert summary["steps"] == 8 and summary["lost_steps"] == 0
    assert summary["replicas_consistent"] is True and summary["parallel"] == "loop"
    assert summary["final_loss"] < 0.69  # below chance on 2 classes: it learned
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 8
    assert "replica groups: 2 rank(s) each" in proc.stdout + proc.stderr


@pytest.mark.cluster
@pytest.mark.parametrize("scenario,kind,line", [
    ("bad", "UserError", "state: replica groups do not carry an extra state dict"),
    ("raise", "SwarmError", "group swarm: the loop raised the same error on 2 nodes: "
                            "ValueError: my bug"),
    ("machines", "ConfigError", "checkpoint.uri: '")])
def test_a_groups_loop_that_fails_ends_the_job_with_one_line(tmp_path, scenario, kind, line):
    """Bad input ends the job at the first failure; the same exception on two nodes ends it
    then (not after every node's strikes), naming the exception; checkpoints on one
    machine's disk with two machines in the cluster end it before any group starts
    (``DurabilityGuard``, as with one replica per GPU)."""
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("group_fit_scenario.py")),
                           scenario, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    error = json.loads(proc.stdout.strip().splitlines()[-1])
    assert error["type"] == kind and error["error"].startswith(line), error
    if scenario == "machines":
        assert "is on one machine's disk but this cluster has 2" in error["error"]
    assert "\n" not in error["error"]


@pytest.mark.cluster
def test_a_group_job_checkpoints_by_shard_and_resumes_on_more_groups(tmp_path):
    """Run 1: 2 groups x 2 ranks, 4 steps, a sharded checkpoint every 2 steps. Run 2 (same
    run id): 3 groups resume from step 4, resharded, and train to step 8."""
    script, uri = str(Path(__file__).with_name("group_fit_scenario.py")), str(tmp_path / "ck")
    summaries = []
    for run, steps, nodes in (("r1", 4, 2), ("r2", 8, 3)):
        proc = subprocess.run([sys.executable, script, "collaborative", str(tmp_path / run),
                               uri, str(steps), str(nodes)], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        summaries.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = summaries
    assert first["resumed_from"] is None and first["checkpoint"] == 4
    assert sorted(p.name for p in (tmp_path / "ck" / "resumable" / "groups").iterdir())[:2] \
        == ["step-00000002", "step-00000004"]
    assert second["resumed_from"].endswith("step-00000004") and second["steps"] == 8
    assert second["groups_max"] == 3 and second["lost_steps"] == 0
    assert second["replicas_consistent"] is True and second["checkpoint"] == 8
