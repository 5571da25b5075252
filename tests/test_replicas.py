"""Replicas training together on the shared multi-node cluster (no driver subprocess).

Each test starts its own Coordinator and ReplicaActors through the training job's own
``ReplicaSupervisor`` (the driver's code path), drives faults from outside — a NaN-injecting
replica, a raylet killed with SIGKILL — and stops the swarm at the end.
"""

from __future__ import annotations

import argparse
import itertools
import time

import pytest
import ray

import moshray.cluster.coordinator.actor as coordinator_mod
from moshray.cluster.coordinator.membership import MembershipConfig
from moshray.jobs.config import add_config_arguments, config_from_args
from replica_supervisor import ReplicaSupervisor
from moshray.jobs.bench.chaos_faults import set_replica_fault

pytestmark = pytest.mark.cluster

SMALL = [
    "--set", "model.n_layers=1", "--set", "model.d_model=32", "--set", "model.d_ff=64",
    "--set", "model.n_heads=2", "--set", "model.seq_len=32",
    "--set", "training.batch_size=4", "--set", "training.target_batch_size=16",
    "--set", "training.round_timeout_s=4",
]
_names = itertools.count()


def small_config(*extra: str):
    """The small LM's config, named as a job's driver names it (its checkpoints' run)."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args([*SMALL, *extra])).named()


class Swarm:
    """A Coordinator and one replica per slot, started as the training driver does."""

    def __init__(self, config, slots):
        from moshray.jobs.examples.lm.corpus import resolve_data

        t = config.training
        self.config = config
        self.coordinator = coordinator_mod.get_or_create(
            MembershipConfig(peer_ttl_s=max(3.0, t.round_timeout_s)),
            target_batch_size=t.target_batch_size, local_steps=t.averaging_local_steps,
            name=f"test-swarm-{next(_names)}")
        files = resolve_data(None, "~/.cache/moshray/corpus")
        self.supervisor = ReplicaSupervisor(config, files, self.coordinator, None)
        for slot in slots:
            self.supervisor.start(slot)

    def stats(self) -> dict:
        return ray.get(self.coordinator.stats.remote(), timeout=30)

    def wait_epoch(self, epoch: int, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.stats()
            if stats["epoch"] >= epoch:
                return stats
            time.sleep(0.2)
        raise TimeoutError(f"epoch {epoch} not reached in {timeout} s: {self.stats()}")

    def wait_ready(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(ray.get(self.coordinator.peer_view.remote(), timeout=30)["ready"]) < count:
            assert time.monotonic() < deadline, f"{count} replicas not ready in {timeout} s"
            time.sleep(0.2)

    def handle(self, slot: int):
        return self.supervisor.replicas[slot][1]

    def stop(self, timeout: float = 90) -> list[dict]:
        """Stop every replica; the finished replicas' statuses (lost ones are skipped)."""
        ray.get(self.coordinator.request_stop.remote(), timeout=30)
        statuses = []
        for _, _, run_ref in self.supervisor.handles():
            try:
                statuses.append(ray.get(run_ref, timeout=timeout))
            except ray.exceptions.RayError:
                pass
        for _, handle, _ in self.supervisor.handles():
            ray.kill(handle, no_restart=True)
        coordinator_mod.remove(self.coordinator)
        return statuses


def consistent(statuses: list[dict]) -> bool:
    top = max(s["epoch"] for s in statuses)
    return all(s["epoch"] == top for s in statuses) and len({s["checksum"] for s in statuses}) == 1


def test_nan_replica_is_rejected_and_counted_while_training_goes_on(local_cluster):
    swarm = Swarm(small_config(), slots=[0, 1, 2])
    try:
        swarm.wait_ready(3, timeout=180)  # every replica in (a loaded machine starts slowly)
        start = swarm.wait_epoch(2, timeout=180)["epoch"]
        set_replica_fault(swarm.handle(2), "nan")  # (no hook in the production actor)
        swarm.wait_epoch(start + 6, timeout=180)  # training goes on without the bad replica
        bad = ray.get(swarm.handle(2).status.remote(), timeout=30)
        good = ray.get(swarm.handle(0).status.remote(), timeout=30)
        assert bad["rejected"] >= 1  # its non-finite contributions were rejected and counted
        assert good["rejected"] == 0
        # ... by the peers that received them: which survivor owned a part the bad replica
        # sent to depends on the round's grid, so count over both.
        counts = [ray.get(swarm.handle(s).rejection_counts.remote(), timeout=30) for s in (0, 1)]
        assert sum(c.get("non_finite", 0) for c in counts) >= 1
        set_replica_fault(swarm.handle(2), None)
        now = swarm.stats()["epoch"]
        swarm.wait_epoch(now + 3, timeout=180)
    finally:
        statuses = swarm.stop()
    assert len(statuses) == 3
    assert consistent(statuses)  # the bad replica resynced from a donor


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_local_sgd_with_outer_nesterov_keeps_replicas_identical(local_cluster, overlap):
    """DiLoCo steps, and with ``overlap`` on Streaming DiLoCo's overlapped outer step (the
    loop's inner steps go on while the outer gradient is averaged): every replica ends at
    the same anchor."""
    config = small_config("--set", "training.mode=local_sgd",
                          "--set", "training.outer_optimizer=nesterov",
                          "--set", f"training.overlap={overlap}")
    swarm = Swarm(config, slots=[0, 1])
    try:
        swarm.wait_epoch(4, timeout=180)
        history = swarm.stats()["history"]
        # replicas send their metrics events in batches, at most a second apart
        deadline = time.monotonic() + 30
        while True:
            profile = ray.get(swarm.coordinator.step_profile.remote(), timeout=30)
            if profile["steps"] >= 4 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        statuses = swarm.stop()
    assert len(statuses) == 2 and consistent(statuses)
    assert all(h[4] == 2 for h in history[1:])  # both replicas took part in every average
    # each replica's steps reached the Coordinator's profile, split into their phases
    assert profile["steps"] >= 4
    med = profile["median_s"]
    assert med["compute_s"] > 0 and med["wall_s"] >= med["round_s"]
    # the loop waits for the round only without overlap (an overlapped round_s is 0)
    assert (med["round_s"] > 0) == (overlap == "off")
    assert "reduce" in profile["round_phases_median_s"]
    assert (profile["overlapped"] > 0) == (overlap == "on")  # steps averaged in the background


def test_hard_killed_node_training_resumes_within_a_round_deadline(local_cluster):
    slot = local_cluster.add_node()
    config = small_config()
    swarm = Swarm(config, slots=[0, 1, slot])
    killed = False
    try:
        swarm.wait_epoch(3, timeout=180)
        local_cluster.remove_node(slot, hard=True)  # SIGKILL: no notice, no goodbye
        killed = True
        at_kill = swarm.stats()["epoch"]
        # Progress resumes after at most one round deadline (plus scheduling slack).
        swarm.wait_epoch(at_kill + 2, timeout=3 * config.training.round_timeout_s + 60)
        # ... and the two survivors step together (a survivor that missed a step under load
        # resyncs from the other first, so the step right after may have only one of them).
        deadline = time.monotonic() + 120
        while not any(h[0] > at_kill + 1 and h[4] == 2 for h in swarm.stats()["history"]):
            assert time.monotonic() < deadline, f"no two-survivor step: {swarm.stats()}"
            time.sleep(0.2)
    finally:
        statuses = swarm.stop()
        if not killed:
            local_cluster.remove_node(slot)
    assert len(statuses) == 2 and consistent(statuses)


def test_coordinator_killed_mid_run_is_rebuilt_by_the_replicas(local_cluster):
    """``ray.kill(coordinator, no_restart=False)``: Ray restarts it with empty memory, the
    replicas rejoin with their epochs, and training goes on from the newest step they hold:
    no committed step lost or repeated, replicas identical."""
    swarm = Swarm(small_config(), slots=[0, 1, 2])
    try:
        swarm.wait_epoch(5, timeout=180)
        for _ in range(2):  # twice, a few steps apart
            before = swarm.stats()["epoch"]
            ray.kill(swarm.coordinator, no_restart=False)
            after = swarm.wait_epoch(before + 5, timeout=180)
            assert after["epoch"] >= before + 5  # the epoch went on, it did not restart at 0
    finally:
        statuses = swarm.stop()
    assert len(statuses) == 3 and consistent(statuses)
    assert all(s["lost_steps"] == 0 and s["repeated_steps"] == 0 for s in statuses)


def test_a_swarm_that_loses_every_replica_resumes_from_its_newest_checkpoint(
        local_cluster, tmp_path):
    """Both replicas die after a checkpoint was saved: the next replica finds no donor and
    loads the run's newest checkpoint (which its saver noted at the Coordinator), not the
    initial weights; the steps after it are a counted rollback, and training goes on."""
    swarm = Swarm(small_config(), slots=[0, 1])
    try:
        swarm.wait_ready(2, timeout=180)
        swarm.wait_epoch(3, timeout=180)
        saved = ray.get(swarm.handle(0).save_checkpoint.remote(str(tmp_path)), timeout=60)
        assert saved.ok, saved
        swarm.wait_epoch(saved.step + 3, timeout=180)
        for slot in (0, 1):
            ray.kill(swarm.handle(slot), no_restart=True)
            swarm.supervisor.lost(slot, hard=True)
        committed = swarm.stats()["committed"]
        assert committed >= saved.step + 3
        swarm.supervisor.start(2)
        deadline = time.monotonic() + 180
        while swarm.stats()["rollbacks"] == 0:
            assert time.monotonic() < deadline, swarm.stats()
            time.sleep(0.5)
        stats = swarm.stats()
        # fell back to the checkpoint's step, not to the initial state's 0
        assert stats["rolled_back_steps"] == committed - saved.step, (stats, saved)
        swarm.wait_epoch(saved.step + 2, timeout=180)
        status = ray.get(swarm.handle(2).status.remote(), timeout=30)
        assert status["epoch"] > saved.step and status["lost_steps"] == 0
    finally:
        statuses = swarm.stop()
    assert len(statuses) == 1
