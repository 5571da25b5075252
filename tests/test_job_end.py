"""A job that ends leaves nothing requested and no watcher of its own, on the shared Ray
cluster (tests/conftest.py): the capacity request is read back where Ray's autoscaler reads
it (``controller.capacity_requested``), during the run and after it, on the normal end, on
an error in supervision, on Ctrl-C and on ``ray job stop``'s SIGTERM; a watcher a node had
before the job (its own ``moshray watch``) still hears notices after it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from moshray.autoscaler.watch.watcher import deliver_notice, get_watcher, start_watcher
from moshray.autoscaler.watch.config import WatcherConfig
from moshray.cluster import placement
from moshray.cluster.placement import SPOT_RESOURCE
from moshray.jobs.controller.elastic import capacity_requested

pytestmark = pytest.mark.cluster
MAX_NODES = 2


def pairs(shard: int, num_shards: int, seed: int):
    """Batches of 4 samples of y = x1 + x2, a few per shard."""
    g = torch.Generator().manual_seed(seed * 100 + shard)
    for _ in range(50):
        x = torch.randn(4, 2, generator=g)
        yield x, x.sum(dim=1, keepdim=True)


def loop(session):
    model = torch.nn.Linear(2, 1)
    opt = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    for x, y in session.batches():
        opt.step(torch.nn.functional.mse_loss(model(x), y))


def _config(tmp_path: Path, **settings):
    from moshray.jobs.fit import build_config

    return build_config({"training": {"target_batch_size": 8, "round_timeout_s": 5.0}},
                        max_nodes=MAX_NODES, metrics_port=0, run_dir=str(tmp_path / "run"),
                        **settings)


def _job():
    from moshray.actors.replica.data_sources import from_fn
    from moshray.jobs.fit import _job

    return _job(loop, from_fn(pairs, num_shards=4), 4)


def _wait(predicate, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def _watched(cluster) -> dict[str, bool]:
    """Node id -> whether a watcher stands under its name, for every live spot node."""
    return {cluster.node_id(s): get_watcher(cluster.node_id(s)) is not None
            for s in cluster.live_slots()}


def _coordinator_gone() -> bool:
    return not placement.job_coordinators()


def _nothing_left(before: dict[str, bool]) -> None:
    """No capacity requested; the watchers the job started are gone (those that stood before
    it stay); its Coordinator is gone."""
    assert capacity_requested() == ()
    _wait(lambda: all(get_watcher(n) is None for n, had in before.items() if not had),
          30, "the job's own watchers to be removed")
    assert all(get_watcher(n) is not None for n, had in before.items() if had)
    _wait(_coordinator_gone, 30, "the job's Coordinator to be removed")


def test_a_job_ends_with_nothing_requested_and_the_nodes_own_watcher_watching(
        local_cluster, tmp_path: Path):
    from moshray.jobs.train import run_job

    node = local_cluster.node_id(local_cluster.live_slots()[0])
    own = start_watcher(node, WatcherConfig(source="simulated", poll_s=0.25))  # the node's
    ray.get(own.ready.remote(), timeout=60)
    before = _watched(local_cluster)
    seen: list[tuple[dict, ...]] = []

    def during(stats: dict) -> bool:
        seen.append(capacity_requested())
        return False

    try:
        summary = run_job(_config(tmp_path, max_steps=3, max_seconds=240),
                          local_cluster.address, _job(), during)
        assert summary["steps"] >= 3
        assert seen and seen[0] == ({SPOT_RESOURCE: 1000},) * MAX_NODES  # asked while it ran
        _nothing_left(before)
        # the node's own watcher was used by the job, not stopped: it still hears notices
        assert get_watcher(node) is not None
        deliver_notice(node, 30.0, action="rebalance")  # recorded only: no drain
        _wait(lambda: ray.get(own.status.remote(), timeout=30)["recommendations"] == 1, 30,
              "the node's own watcher to hear the recommendation")
    finally:
        ray.get(own.stop.remote(), timeout=30)
        ray.kill(own, no_restart=True)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_job_that_fails_in_supervision_leaves_nothing_requested(local_cluster,
                                                                  tmp_path: Path, error):
    from moshray.jobs.train import run_job

    before = _watched(local_cluster)
    seen: list[tuple[dict, ...]] = []

    def fail(stats: dict) -> bool:
        seen.append(capacity_requested())
        if stats.get("epoch", 0) >= 1:  # replicas are training when it fails
            raise error("the caller's end condition failed")
        return False

    with pytest.raises(error, match="end condition failed"):
        run_job(_config(tmp_path, max_seconds=240), local_cluster.address, _job(), fail)
    assert seen[0] == ({SPOT_RESOURCE: 1000},) * MAX_NODES
    _nothing_left(before)


def test_ray_job_stop_sigterm_withdraws_the_request(local_cluster, tmp_path: Path):
    """The driver as ``ray job submit`` runs it, stopped as ``ray job stop`` stops it (SIGTERM;
    Ray's SIGKILL a few seconds later is not sent here: the clean path is what is asserted)."""
    before = _watched(local_cluster)
    env = dict(os.environ, RAY_ADDRESS=local_cluster.address)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moshray.jobs.train", "--set", "model.n_layers=1",
         "--set", "model.d_model=32", "--set", "model.d_ff=64", "--set", "model.n_heads=2",
         "--set", "model.seq_len=32", "--set", "training.batch_size=4",
         "--set", "training.target_batch_size=8", "--set", "training.round_timeout_s=5",
         "--set", f"cluster.max_nodes={MAX_NODES}", "--max-seconds", "300",
         "--metrics-port", "0", "--set", f"run_dir={tmp_path / 'run'}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)
    try:
        _wait(lambda: capacity_requested() == ({SPOT_RESOURCE: 1000},) * MAX_NODES
              or proc.poll() is not None, 180, "the job to ask for capacity")
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, out[-3000:]
    _nothing_left(before)


def loop_with_a_bug(session):
    """Trains a few batches, then raises what a user's data bug raises."""
    model = torch.nn.Linear(2, 1)
    opt = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    for i, (x, y) in enumerate(session.batches()):
        if i == 3:
            raise KeyError("no column 'label' in this batch")
        opt.step(torch.nn.functional.mse_loss(model(x), y))


def _replica_actors_alive() -> list:
    """The job's replicas still standing (detached named actors, jobs/controller/lease.py),
    and its lease."""
    from moshray.jobs.controller.lease import LEASE_PREFIX, REPLICA_PREFIX

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith((REPLICA_PREFIX, LEASE_PREFIX))]


@pytest.mark.timeout(300)
def test_a_loop_that_raises_ends_fit_with_its_error_and_leaves_nothing(local_cluster,
                                                                       tmp_path: Path):
    """The user's KeyError (not a UserError) is not retried forever: the same error
    from two nodes ends the job; ``fit`` raises it with the replica's traceback, and nothing
    is left requested or running."""
    from moshray.actors.replica.data_sources import from_fn
    from moshray.jobs.fit import fit

    before = _watched(local_cluster)
    with pytest.raises(KeyError, match="no column 'label' in this batch") as info:
        fit(loop_with_a_bug, from_fn(pairs, num_shards=4),
            config={"training": {"target_batch_size": 8, "round_timeout_s": 5.0}},
            address=local_cluster.address, max_nodes=MAX_NODES, metrics_port=0,
            max_seconds=240, run_dir=str(tmp_path / "run"))
    text = str(info.value)
    assert "in loop_with_a_bug" in text and "raise KeyError" in text  # the replica's traceback
    assert any("the same error on 2 nodes" in note for note in info.value.__notes__)
    _nothing_left(before)
    _wait(lambda: not _replica_actors_alive(), 30, "the replicas to be removed")


LEASE_S = 2.0
TABLE = 300_000  # floats: a checkpoint of ~1.2 MB, ~5 s to a store taking 256 KiB/s


def loop_with_a_table(session):
    """The regression of ``loop`` with a 1.2 MB buffer beside it: state that takes seconds
    to upload."""
    model = torch.nn.Linear(2, 1)
    model.register_buffer("table", torch.zeros(TABLE))
    opt = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    for x, y in session.batches():
        opt.step(torch.nn.functional.mse_loss(model(x), y))


@pytest.mark.timeout(300)
def test_a_checkpoint_save_slower_than_the_lease_does_not_end_the_job(local_cluster,
                                                                     tmp_path: Path):
    """With ``cluster.driver_lease_s`` = 2 s, a 25-s run saves a checkpoint every
    50 steps to a slow S3 (moto's, its uploads read at 256 KiB/s: each save takes ~5 s, over
    twice the lease). The driver's keeper thread renews the lease while the controller's loop
    waits on each save, and a driver that lives is never reaped: the job trains to its time
    limit with every checkpoint written. (Before, the lease ended the swarm under the
    running driver during the first save.)"""
    import threading

    from moshray.actors.replica.checkpoint import CheckpointStore
    from moshray.actors.replica.data_sources import from_fn
    from moshray.jobs.controller import lease as leases
    from moshray.jobs.fit import _job as make_job
    from moshray.jobs.fit import build_config
    from moshray.jobs.train import run_job
    from moto_s3 import running_s3, s3_uri

    before = _watched(local_cluster)
    uploads: list[tuple[str, str, int, float]] = []
    since_renewed: list[float] = []  # the lease's own clock, sampled while the job runs
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            names = list(leases.list_jobs())
            lease = leases.find(names[0]) if names else None
            try:
                status = ray.get(lease.status.remote(), timeout=10) if lease else None
            except (ray.exceptions.RayError, TimeoutError):
                continue
            if status and status["record"] is not None:
                since_renewed.append(status["since_renewed_s"])

    sampler = threading.Thread(target=sample, daemon=True)
    with running_s3(upload_bytes_per_s=256 * 1024, uploads=uploads) as endpoint:
        uri = s3_uri(endpoint, "slow-saves", credentials=True)
        config = build_config(
            {"training": {"target_batch_size": 8, "round_timeout_s": 5.0},
             "cluster": {"driver_lease_s": LEASE_S}},
            max_nodes=MAX_NODES, metrics_port=0, run_dir=str(tmp_path / "run"),
            max_seconds=25, checkpoint_uri=uri, checkpoint_every=50, name="run")
        sampler.start()
        try:
            summary = run_job(config, local_cluster.address,
                              make_job(loop_with_a_table, from_fn(pairs, num_shards=4), 4), None)
        finally:
            done.set()
            sampler.join(timeout=30)
        newest = CheckpointStore(uri, "run").load_latest()
    saves = [seconds for method, _, size, seconds in uploads if size > 1_000_000]
    assert len(saves) >= 2 and min(saves) > 2 * LEASE_S, uploads  # saves over twice the lease
    # renewed during every save: the longest gap the lease saw stayed under twice the lease
    assert since_renewed and max(since_renewed) < 2 * LEASE_S, max(since_renewed)
    assert summary["replicas_consistent"] is True and summary["checkpoint_failures"] == 0
    assert summary["wall_s"] >= 25 and summary["steps"] >= 100
    assert newest is not None and newest[0] >= summary["steps"] - 50
    _nothing_left(before)
