"""The training job end to end, as a user runs it (subprocess, its own local cluster).

Each run starts an embedded cluster on 127.0.0.1 and stops it before exiting; every run is
bounded by --max-seconds / --max-steps and by a subprocess timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from raystart import free_port

SMALL = [
    "--set", "model.n_layers=2", "--set", "model.d_model=64", "--set", "model.d_ff=128",
    "--set", "model.n_heads=2", "--set", "model.seq_len=64",
    "--set", "training.batch_size=8", "--set", "training.target_batch_size=32",
    "--set", "training.round_timeout_s=5",
    "--trace", "off",  # nodes stay unless a test replays a trace (later --trace wins)
]


def train(*args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict | None]:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "moshray.jobs.train", *SMALL, "--json", *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    lines = [line for line in proc.stdout.strip().splitlines() if line.startswith("{")]
    return proc, (json.loads(lines[-1]) if lines else None)


def test_bad_config_exits_2_with_one_line():
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-m", "moshray.jobs.train", "--set", "training.lr=-1"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "training.lr" in lines[0]
    proc = subprocess.run(
        [sys.executable, "-m", "moshray.jobs.train",
         "--set", "training.mode=sometimes"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert proc.returncode == 2 and "training.mode" in proc.stderr




def _scrape(port: int) -> dict | None:
    """The job's metrics as ``{sample name + labels (but ``job``): value}``; None while it is
    not serving. Every sample must carry the ``job`` label."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    out = {}
    for family in text_string_to_metric_families(text):  # raises on bad exposition format
        for sample in family.samples:
            # every series of a job's exporter carries job=<its name>: keys leave it out
            assert sample.labels.get("job"), f"{sample.name} has no job label"
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if k != "job")
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


@pytest.mark.cluster
def test_trace_preempts_and_adds_nodes_while_training(tmp_path: Path):
    """A replayed trace with a notice, a removal and a join, watched through the job's own
    Prometheus exporter while it runs; the run's plot and summary land in run_dir."""
    # Per-node trace: three nodes; node2 is preempted at 20 s (notice 3 s ahead: its
    # watcher, started by the controller when the node joined, is up by then even on a
    # loaded machine), node3 arrives at 28 s.
    trace = tmp_path / "trace.csv"
    trace.write_text("0,add,node0\n0,add,node1\n0,add,node2\n"
                     "20000,remove,node2\n28000,add,node3\n")
    port = free_port()
    run_dir = tmp_path / "run"
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moshray.jobs.train", *SMALL, "--json", "--local-nodes", "3",
             "--max-nodes", "3", "--trace", str(trace), "--time-scale", "1",
             "--max-seconds", "55", "--metrics-port", str(port), "--set", "cluster.notice_s=3",
             "--set", f"run_dir={run_dir}", "--set", "save_model=true"],
            stdout=stdout, stderr=stderr, text=True, env=env)
        last = None
        try:
            deadline = time.monotonic() + 300
            while proc.poll() is None:
                assert time.monotonic() < deadline, "the training job did not end in 300 s"
                last = _scrape(port) or last
                time.sleep(1.0)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    assert proc.returncode == 0, err.read_text()[-3000:]
    lines = [line for line in out.read_text().splitlines() if line.startswith("{")]
    summary = json.loads(lines[-1])
    assert summary["preemptions"] >= 1
    assert summary["notices"] >= 1  # the removal came with a notice through the watcher
    assert summary["lost_steps"] == 0 and summary["rollbacks"] == 0
    # drained and excluded from a plan before the node died (3 s later)
    assert 0 <= summary["rebalance_s_max"] < 3
    assert summary["steps"] > 10
    assert summary["replicas"] == 3  # two survivors and the replica that joined
    assert summary["replicas_consistent"] is True
    assert summary["final_loss"] < summary["initial_loss"]
    # the step counter kept rising after the preemption: progress lines are increasing
    stderr_text = err.read_text()
    steps = [int(line.split()[1]) for line in stderr_text.splitlines() if line.startswith("step")]
    assert steps == sorted(steps) and steps[-1] == summary["steps"]
    assert f"metrics: http://127.0.0.1:{port}/metrics" in stderr_text
    # What the exporter showed late in the run (the last scrape before the job ended).
    assert last is not None, "the exporter never answered"
    assert last["moshray_global_step{}"] > 10
    assert last["moshray_samples_processed_total{}"] > 0
    assert last["moshray_allreduce_round_duration_seconds_count{}"] > 0
    assert last["moshray_allreduce_sent_bytes_total{}"] > 0
    assert last["moshray_preemption_notices_total{cloud=aws,pool=unknown}"] >= 1
    assert last["moshray_nodes_lost_total{notice=true}"] >= 1
    assert last["moshray_rebalance_seconds_count{}"] >= 1
    assert last["moshray_join_to_first_contribution_seconds_count{}"] >= 3  # incl. the joiner
    assert last["moshray_nodes{market=spot}"] == 3
    assert 0 < last["moshray_training_loss{}"] < 10
    assert (run_dir / "training.png").stat().st_size > 0
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["steps"] == summary["steps"] and len(saved["history"]) == summary["steps"]
    # the averaging's bytes (no zones here: none crossed one), and the trained model saved
    assert summary["allreduce_sent_bytes"] > 0 and summary["cross_zone_bytes"] == 0
    import torch

    model = torch.load(summary["model"], weights_only=True)
    assert summary["model"] == str(run_dir / "model.pt")
    assert model and all(torch.isfinite(t).all() for t in model.values() if t.is_floating_point())


@pytest.mark.cluster
def test_resume_from_checkpoint_skips_corrupt_file(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    run = ("--name", "resume-test",  # the run id: the job's name
           "--set", f"run_dir={tmp_path / 'resume-test'}")
    proc, first = train("--local-nodes", "2", "--checkpoint", str(ckpt), *run,
                        "--set", "checkpoint.every_steps=5", "--max-steps", "10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = sorted((ckpt / "resume-test").glob("ckpt-*.manifest.json"))
    assert saved, "no checkpoint written"
    newest_valid = int(saved[-1].name.split("-")[1])
    assert newest_valid >= 10
    torn = ckpt / "resume-test" / "ckpt-999999999-0123456789ab.manifest.json"
    torn.write_text('{"format": "moshray-checkpoint", "ver')  # a torn write
    proc, second = train("--local-nodes", "2", "--checkpoint", str(ckpt), *run,
                         "--max-steps", str(newest_valid + 5))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "corrupt" in proc.stderr and torn.name in proc.stderr
    assert f"resuming from checkpoint at step {newest_valid}" in proc.stderr
    assert second["steps"] >= newest_valid + 5
    assert second["replicas_consistent"] is True
    # it continued from the checkpoint rather than from scratch: the loss starts lower
    assert second["initial_loss"] < first["initial_loss"]


def test_the_step_profile_covers_the_steps_at_the_swarms_largest():
    from moshray.jobs.run_report import full_size_epoch

    rows = [(1, 0.5, 8, 3.0, 1), (2, 1.0, 16, 2.9, 2), (3, 1.5, 24, 2.8, 3),
            (4, 2.0, 16, 2.7, 2), (5, 2.5, 24, 2.6, 3)]
    assert full_size_epoch(rows) == 3  # the first step with 3 peers
    assert full_size_epoch(rows[:2]) == 2
    assert full_size_epoch([]) == 0


@pytest.mark.cluster
def test_declared_gpus_get_one_replica_each_with_cpu_fallback():
    """A node that declares 2 GPUs runs two replicas, each given one GPU by Ray (its own
    device id); this machine has no CUDA, so they train on the CPU and stay consistent."""
    proc, summary = train("--local-nodes", "1", "--set", "cluster.local_gpus=2",
                          "--max-steps", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary["replicas"] == 2
    assert sorted(map(tuple, summary["replica_gpus"])) == [("0",), ("1",)]
    assert summary["devices"] == ["cpu"] and summary["replicas_consistent"] is True
    assert "torch sees no CUDA device" in proc.stderr  # the fallback is said, not silent


@pytest.mark.cluster
def test_overlapped_steps_keep_the_replicas_identical():
    """With ``training.overlap=on`` each replica averages step k while it accumulates step
    k+1; every replica still applies the same averages: identical at the end, no step lost."""
    proc, summary = train("--local-nodes", "2", "--set", "training.overlap=on",
                          "--max-steps", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary["steps"] >= 8 and summary["replicas"] == 2
    assert summary["replicas_consistent"] is True and summary["lost_steps"] == 0
    assert summary["final_loss"] < summary["initial_loss"]
    from moshray.jobs.config import load_config

    # local raylets carry no market or instance labels: both priced from the config
    spot = load_config(None).metrics.spot_price_per_hour
    assert summary["prices"] == {"dollars_per_hour": pytest.approx(2 * spot),
                                 "sources": {"config": 2}}


def test_refuses_node_local_checkpoint_on_several_machines():
    from moshray.jobs.config import ConfigError, load_config
    from moshray.jobs.controller.durability import Keep, Stop, decide_durability, durability_warning

    config = load_config(None, {"checkpoint.uri": "/tmp/ckpt"})
    assert decide_durability(config, 1, None) == Keep()  # one machine: its disk is everyone's
    refused = decide_durability(config, 3, None)
    assert isinstance(refused, Stop) and isinstance(refused.error, ConfigError)
    assert refused.error.field_path == "checkpoint.uri" and "durable storage" in refused.message
    assert decide_durability(load_config(None, {"checkpoint.uri": "s3://bucket/run"}), 3,
                             None) == Keep()
    refused = decide_durability(load_config(None, {"data.paths": '["/data/x.parquet"]'}), 2,
                                "s3://b/run")
    assert isinstance(refused, Stop) and refused.error.field_path == "data.paths"

    assert "checkpoint.uri" in durability_warning(load_config(None), machines=2)
    assert durability_warning(load_config(None), machines=1) is None
    assert durability_warning(load_config(None, {"checkpoint.uri": "s3://b/r"}), 4) is None


def test_checkpoints_are_on_by_default_on_several_machines():
    from moshray.jobs.config import ConfigError, load_config
    from moshray.jobs.controller.durability import Keep, Stop, Switch, decide_durability

    bare = load_config(None)
    assert decide_durability(bare, 1, "s3://b/run") == Keep()  # one machine: off
    # the cluster's default location
    assert decide_durability(bare, 3, "s3://b/run") == Switch("s3://b/run")
    given = load_config(None, {"checkpoint.uri": "gs://mine/x"})
    assert decide_durability(given, 3, "s3://b/run") == Keep()  # the user's wins
    for default, words in ((None, "MOSHRAY_CHECKPOINT_URI"), ("", "--checkpoint")):
        refused = decide_durability(bare, 3 if default is None else 2, default)
        # refused, one line saying how to set it
        assert isinstance(refused, Stop) and isinstance(refused.error, ConfigError)
        assert refused.error.field_path == "checkpoint.uri" and words in refused.message
        assert "\n" not in refused.message
    optional = load_config(None, {"checkpoint.optional": "true"})
    assert decide_durability(optional, 3, None) == Keep()


def test_the_default_run_replays_the_shipped_trace():
    from moshray.autoscaler.traces import DEFAULT_TRACE, load_trace, shipped_traces
    from moshray.jobs.config import load_config
    from moshray.jobs.train import with_default_trace

    assert {DEFAULT_TRACE, DEFAULT_TRACE + "-nodes"} <= set(shipped_traces())
    count, nodes = load_trace(DEFAULT_TRACE), load_trace(DEFAULT_TRACE + "-nodes")
    assert not count.per_node and nodes.per_node
    assert count.max_count == nodes.max_count == 12
    assert all(count.live_at(t) == nodes.live_at(t) for t in range(0, 88000, 600))
    assert with_default_trace(load_config(None)).cluster.trace == DEFAULT_TRACE
    assert with_default_trace(load_config(None, {"cluster.trace": "off"})).cluster.trace is None
    assert with_default_trace(load_config(None, {"cluster.address": "auto"})).cluster.trace is None
