"""A cluster shared by a team. On a cluster started with the real `ray start`
CLI, two colleagues' jobs (`ray job submit`, `moshray.fit(name=...)`) train side by side to
their end: neither ends the other, each has its own Coordinator, lease and share of the
capacity request, `moshray jobs` lists both, a third submission of a running job's name is
refused in one line and touches nothing. Both checkpoint under one bucket; a later
submission of the first name resumes the first job's run (never the other's), and `moshray
stop NAME` ends it cleanly."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_driver_restart import _ray, _wait

pytestmark = pytest.mark.cluster
JOB = Path(__file__).resolve().parent / "driver_restart_job.py"
MAX_STEPS = 60  # ~1 step/s: both jobs, and a refused third, overlap


def _moshray(cluster, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moshray.jobs.cli", *args, "--address",
                           cluster.gcs_address], capture_output=True, text=True,
                          timeout=timeout, env=cluster.env)


def _capacity(cluster) -> list:
    """The bundles standing in Ray's autoscaler (read by a driver of its own)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import json, ray; ray.init(address='%s'); from "
         "moshray.jobs.controller.elastic import capacity_requested; "
         "print(json.dumps(capacity_requested()))" % cluster.gcs_address],
        capture_output=True, text=True, timeout=120, env=cluster.env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ended(cluster, submission: str) -> str | None:
    """``succeeded`` / ``failed`` once ``ray job status`` says the job ended, else None."""
    text = _ray(cluster, "status", submission).stdout.lower()
    return next((word for word in ("succeeded", "failed", "stopped") if word in text), None)


def _result(cluster, submission: str, timeout_s: float = 400) -> tuple[dict, str]:
    """The job's JSON line once it ended, and its log."""
    assert _wait(lambda: _ended(cluster, submission), timeout_s, f"{submission} to end",
                 3.0) == "succeeded", _ray(cluster, "logs", submission).stdout[-3000:]
    out = _ray(cluster, "logs", submission).stdout
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, out[-4000:]
    return json.loads(lines[-1]), out


@pytest.mark.timeout(1200)
def test_two_jobs_share_a_cluster_and_each_resumes_only_its_own_run(ray_start_cluster,
                                                                    tmp_path: Path):
    bucket = tmp_path / "bucket"  # one checkpoint location for the whole team

    def entry(submission: str, name: str, max_steps: int = MAX_STEPS,
              bucket_: Path = bucket) -> list[str]:
        return ["--submission-id", submission, "--no-wait", "--", "python", str(JOB),
                str(tmp_path / f"{submission}.pid"), str(bucket_), str(max_steps),
                str(tmp_path / submission), name]

    cluster = ray_start_cluster
    assert _ray(cluster, "submit", *entry("alice-1", "alice")).returncode == 0
    assert _ray(cluster, "submit", *entry("bob-1", "bob")).returncode == 0

    # both listed, each with its own Coordinator and share of the capacity request
    rows = _wait(lambda: (lambda p: [json.loads(r) for r in p.stdout.splitlines()]
                          if p.returncode == 0 and p.stdout.count("running") == 2
                          else None)(_moshray(cluster, "jobs", "--json")),
                 240, "moshray jobs to list both jobs running")
    assert sorted(r["name"] for r in rows) == ["alice", "bob"]
    assert len(_capacity(cluster)) == 4  # 2 nodes each, asked of Ray together
    table = _moshray(cluster, "jobs").stdout
    assert table.splitlines()[0].split() == ["NAME", "STATE", "STEP", "NODES",
                                              "REPLICAS", "DRIVER"], table

    # the name of a running job is refused in one line (another config: no wait for
    # its driver to die), and the running job goes on
    assert _ray(cluster, "submit", *entry("alice-again", "alice",
                                          bucket_=tmp_path / "other")).returncode == 0
    assert _wait(lambda: _ended(cluster, "alice-again"), 300,
                 "the second 'alice' to be refused", 3.0) == "failed"
    refused_log = _ray(cluster, "logs", "alice-again").stdout
    assert "a job named 'alice' is running" in refused_log, refused_log[-3000:]
    assert "moshray stop alice" in refused_log

    alice, alice_log = _result(cluster, "alice-1")
    bob, bob_log = _result(cluster, "bob-1")
    for result, log in ((alice, alice_log), (bob, bob_log)):
        assert result["steps"] >= MAX_STEPS and result["replicas"] == 2, log[-3000:]
        assert result["replicas_consistent"] is True, log[-3000:]
        assert result["lost_steps"] == 0 and result["rollbacks"] == 0, log[-3000:]
        assert "ending the" not in log and "resuming" not in log, log[-3000:]
    assert {d.name for d in bucket.iterdir() if d.is_dir()} >= {"alice", "bob"}
    _wait(lambda: _capacity(cluster) == [], 60, "no capacity asked once both ended")
    assert _moshray(cluster, "jobs").stdout.strip() == "no training jobs on this cluster"

    # alice again: her run resumes (bob's is never read); then `moshray stop alice`
    assert _ray(cluster, "submit", *entry("alice-2", "alice", 100_000)).returncode == 0
    _wait(lambda: "resuming from checkpoint" in _ray(cluster, "logs", "alice-2").stdout,
          300, "alice's second job to resume")
    log = _ray(cluster, "logs", "alice-2").stdout
    assert f"{bucket}/alice" in log and f"{bucket}/bob" not in log, log[-3000:]
    _wait(lambda: re.search(r"^\s*step \d+ of", _ray(cluster, "logs", "alice-2").stdout,
                            re.MULTILINE), 300, "alice's second job to train")
    stop = _moshray(cluster, "stop", "alice", timeout=400)
    assert stop.returncode == 0 and "job alice stopped" in stop.stdout, \
        stop.stdout + stop.stderr
    resumed, log = _result(cluster, "alice-2")
    assert "stopping: `moshray stop alice`" in log, log[-3000:]
    assert resumed["replicas_consistent"] is True and resumed["lost_steps"] == 0
    assert min(resumed["epochs"]) >= MAX_STEPS, resumed["epochs"]  # went on from it
    assert _moshray(cluster, "stop", "alice").returncode == 2  # no such job now
