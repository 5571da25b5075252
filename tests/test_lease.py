"""The job lease's pure decisions (jobs/controller/lease.py): who adopts a running swarm,
and when a swarm whose driver is gone ends by itself; and the driver's keeper thread, which
renews on schedule whatever the controller's loop is doing. No Ray."""

from __future__ import annotations

import threading
import time

import pytest

from moshray.jobs.config import TrainConfig
from moshray.jobs.controller.lease import (
    Adopt,
    Fresh,
    JobRecord,
    JobState,
    STOP_REQUESTED,
    LeaseKeeper,
    Refuse,
    Replace,
    decide_claim,
    fingerprint,
    reap_reason,
    renew_interval,
    renewed,
    replica_actor_name,
)

CONFIG = TrainConfig().to_dict()
RECORD = JobRecord(run_id="r1", fingerprint=fingerprint(CONFIG), holder="01000000",
                   lease_s=60.0, name="alice-lm")


def test_the_same_job_adopts_a_swarm_whose_driver_is_gone():
    assert decide_claim(RECORD, "02000000", RECORD.fingerprint, holder_alive=False) \
        == Adopt(RECORD)
    # the same driver (a second run in one process) adopts too
    assert decide_claim(RECORD, "01000000", RECORD.fingerprint, holder_alive=True) \
        == Adopt(RECORD)


def test_a_live_drivers_job_is_refused_never_ended():
    """Jobs of other names never meet (each name has its own record); a submission of a
    name whose driver lives is refused in one line naming the way out."""
    refused = decide_claim(RECORD, "02000000", RECORD.fingerprint, True)
    assert isinstance(refused, Refuse) and "\n" not in refused.reason
    assert "'alice-lm' is running" in refused.reason and "moshray stop alice-lm" in \
        refused.reason and "01000000" in refused.reason
    other = fingerprint({**CONFIG, "model": {**CONFIG["model"], "d_model": 32}})
    assert isinstance(decide_claim(RECORD, "02000000", other, True), Refuse)
    stopping = JobRecord(**{**RECORD.__dict__, "stopping": True})
    assert isinstance(decide_claim(stopping, "02000000", RECORD.fingerprint, True), Refuse)


def test_a_gone_drivers_swarm_of_another_config_or_stopping_is_replaced():
    assert decide_claim(None, "02000000", RECORD.fingerprint, False) == Fresh()
    other = fingerprint({**CONFIG, "model": {**CONFIG["model"], "d_model": 32}})
    assert decide_claim(RECORD, "02000000", other, False) == \
        Replace("the previous job of this name ran another config")
    stopping = JobRecord(**{**RECORD.__dict__, "stopping": True})
    assert decide_claim(stopping, "02000000", RECORD.fingerprint, False) == \
        Replace("the previous job of this name was stopping")


def test_a_stop_request_reaches_the_keeper():
    """``moshray stop``: the lease answers a renewal with STOP_REQUESTED; the keeper says
    so and goes on renewing (the driver ends the job as at its time limit)."""
    answers = iter([True, STOP_REQUESTED])
    keeper = LeaseKeeper(lambda state: next(answers, STOP_REQUESTED), interval_s=0.01)
    try:
        assert not keeper.stop_requested
        keeper.publish(JobState())
        deadline = time.monotonic() + 10
        while not keeper.stop_requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert keeper.stop_requested and not keeper.ended
    finally:
        keeper.stop()


def test_the_fingerprint_ignores_the_runs_bounds_and_outputs():
    longer = {**CONFIG, "training": {**CONFIG["training"], "max_steps": 500}, "json": True}
    assert fingerprint(longer) == fingerprint(CONFIG)
    assert fingerprint({**CONFIG, "run_dir": "another-run"}) != fingerprint(CONFIG)
    assert fingerprint({**CONFIG, "training": {**CONFIG["training"], "lr": 0.1}}) \
        != fingerprint(CONFIG)


def test_a_swarm_ends_when_the_lease_lapses_or_a_stopped_driver_is_gone():
    assert reap_reason(None, 1e9, False) is None
    assert reap_reason(RECORD, 59.0, holder_alive=False) is None  # within the lease
    assert "gone and did not renew the lease for 61 s" in reap_reason(RECORD, 61.0, False)
    stopping = JobRecord(**{**RECORD.__dict__, "stopping": True})
    assert reap_reason(stopping, 1.0, holder_alive=True) is None  # still finishing itself
    assert reap_reason(stopping, 1.0, holder_alive=False) == \
        "its driver was stopped and is gone"


def test_a_live_driver_is_never_reaped_however_long_since_it_renewed():
    """A save (or a drain, or the end of a run) longer than the lease must not end
    the job of a driver Ray lists as alive."""
    assert reap_reason(RECORD, 61.0, holder_alive=True) is None
    assert reap_reason(RECORD, 1e9, holder_alive=True) is None


def test_renewals_come_a_quarter_lease_apart_at_most_5_s():
    assert renew_interval(120.0) == 5.0
    assert renew_interval(8.0) == 2.0
    assert renew_interval(0.2) == 0.1


def test_the_keeper_renews_on_schedule_while_the_controller_is_blocked():
    """The controller publishes once and then blocks (a save longer than the lease): the
    keeper's thread goes on renewing with the state published, and stops when told."""
    renewed: list[tuple[float, JobState]] = []
    renew_lock = threading.Lock()

    def renew(state: JobState) -> bool:
        with renew_lock:
            renewed.append((time.monotonic(), state))
        return True

    keeper = LeaseKeeper(renew, interval_s=0.05)
    try:
        time.sleep(0.2)
        assert renewed == []  # nothing to renew before the first publish
        state = JobState((("replica-0-1", "node-a", 0.0),), 1, ("node-a",), 5)
        keeper.publish(state)
        time.sleep(0.6)  # "blocked": no tick publishes meanwhile
    finally:
        keeper.stop()
    count = len(renewed)
    assert count >= 5 and all(s == state for _, s in renewed)
    gaps = [b[0] - a[0] for a, b in zip(renewed, renewed[1:])]
    assert max(gaps) < 0.5
    time.sleep(0.2)
    assert len(renewed) == count and keeper.renewals == count  # stopped: no more renewals


def test_a_keeper_whose_lease_ended_stops_and_says_so():
    calls = []

    def renew(state: JobState) -> bool:
        calls.append(state)
        if len(calls) == 1:
            raise TimeoutError("the lease is restarting")  # a failed attempt: next time
        return False  # the reaper ended the swarm

    keeper = LeaseKeeper(renew, interval_s=0.02)
    keeper.publish(JobState())
    deadline = time.monotonic() + 10
    while not keeper.ended and time.monotonic() < deadline:
        time.sleep(0.01)
    keeper.stop()
    assert keeper.ended and len(calls) == 2


def test_a_renewal_carries_the_checkpoint_location_the_durability_guard_switched_to():
    """The lease's final checkpoint went to the location frozen at the claim; a
    renewal now carries where checkpoints go (and keeps it when a state names none)."""
    record = JobRecord(**{**RECORD.__dict__, "checkpoint_uri": "/tmp/node-local"})
    state = JobState((("replica-0-1", "n0", 0.0),), 1, (), 5, "s3://bucket/ckpt")
    after = renewed(record, state)
    assert after.checkpoint_uri == "s3://bucket/ckpt" and after.last_checkpoint == 5
    assert after.replicas == (("replica-0-1", "n0", 0.0),) and after.holder == record.holder
    assert renewed(record, JobState()).checkpoint_uri == "/tmp/node-local"


def test_a_replica_is_in_the_lease_before_it_is_launched(monkeypatch):
    """A replica launched in the driver's last tick was missing from the lease's
    record (never ended by ``end_swarm``, never adopted). The controller now renews with it
    before it launches it, in its own thread; a driver that dies after the launch leaves it
    in the record (``end_swarm`` and ``adopt`` find it by name, or skip it if it never
    came)."""
    from types import SimpleNamespace

    from moshray.jobs.config import TrainConfig
    from moshray.jobs.controller import elastic
    from moshray.jobs.controller.observations import NodeView
    from moshray.jobs.controller.reconcile import StartReplica

    renewals: list[JobState] = []
    keeper = LeaseKeeper(lambda state: renewals.append(state) or True, interval_s=3600)
    launched = []

    def launch(spec, replica_id, node_id, num_gpus):
        # whether a renewal done before the launch began carried the replica
        launched.append((replica_id, any(replica_id in [r[0] for r in state.replicas]
                                         for state in list(renewals))))
        return object(), object()

    monkeypatch.setattr(elastic, "launch_replica", launch)
    config = TrainConfig.from_dict({"checkpoint": {"uri": "/tmp/ckpt"}})
    controller = elastic.ElasticController(config, SimpleNamespace(coordinator=None),
                                           lease=object())
    controller.keeper = keeper
    try:
        keeper.publish(controller._job_state())
        obs = SimpleNamespace(node=lambda node_id: NodeView(node_id, True, True), now_s=1.0)
        controller._start(StartReplica("node-a", 0.0), obs)
    finally:
        keeper.stop()
    (replica_id, in_lease), = launched
    assert in_lease
    assert max(r.count for r in renewals) == 1
    assert {r.checkpoint_uri for r in renewals} == {"/tmp/ckpt"}


def _controller_with(keeper, monkeypatch, launch):
    from types import SimpleNamespace

    from moshray.jobs.config import TrainConfig
    from moshray.jobs.controller import elastic

    monkeypatch.setattr(elastic, "launch_replica", launch)
    controller = elastic.ElasticController(TrainConfig.from_dict({}),
                                           SimpleNamespace(coordinator=None), lease=object())
    controller.keeper = keeper
    keeper.publish(controller._job_state())
    return controller


def _start_on(controller, node_id: str) -> None:
    from types import SimpleNamespace

    from moshray.jobs.controller.observations import NodeView
    from moshray.jobs.controller.reconcile import StartReplica

    obs = SimpleNamespace(node=lambda n: NodeView(n, True, True), now_s=1.0)
    controller._start(StartReplica(node_id, 0.0), obs)


def test_a_replica_the_lease_did_not_record_is_not_launched(monkeypatch):
    """A renewal that fails before a launch (the lease restarting, a timeout) left the
    replica launched but out of the record: a driver dying then leaked it. It is not
    launched now, the record goes back to the replicas that exist, the deferral is counted,
    and the next start (the next tick's decision) launches once a renewal takes it."""
    failing = threading.Event()
    renewals: list[JobState] = []

    def renew(state: JobState) -> bool:
        if failing.is_set():
            raise TimeoutError("the lease is restarting")
        renewals.append(state)
        return True

    launched = []
    keeper = LeaseKeeper(renew, interval_s=3600)
    try:
        controller = _controller_with(keeper, monkeypatch, lambda spec, rid, node, gpus: (
            launched.append(rid) or (object(), object())))
        failing.set()
        _start_on(controller, "node-a")
        assert launched == [] and controller.launches_deferred == 1
        assert controller.runs == {} and keeper._state.replicas == ()  # none published
        failing.clear()
        _start_on(controller, "node-a")
    finally:
        keeper.stop()
    assert len(launched) == 1 and launched[0] in controller.runs
    assert launched[0] in [r[0] for r in renewals[-1].replicas]


def test_a_launch_that_raises_leaves_no_replica_in_the_published_state(monkeypatch):
    def launch(spec, replica_id, node_id, num_gpus):
        raise RuntimeError("the node went away")

    keeper = LeaseKeeper(lambda state: True, interval_s=3600)
    try:
        controller = _controller_with(keeper, monkeypatch, launch)
        with pytest.raises(RuntimeError):
            _start_on(controller, "node-a")
        assert keeper._state.replicas == () and controller.runs == {}
    finally:
        keeper.stop()


def test_an_older_state_never_lands_after_a_newer_renewal():
    """The keeper's thread read the state, then the controller published a newer one (a
    replica about to be launched) and renewed it at once: the thread's renewal with the
    older state then landed last, and the record lost the replica. Renewals now go one at
    a time, each with the state published last."""
    landed: list[JobState] = []
    in_renewal = threading.Event()
    release = threading.Event()

    def renew(state: JobState) -> bool:
        if not landed and not in_renewal.is_set():
            in_renewal.set()  # the thread's renewal is slow (a restarting lease)
            release.wait(10)
        landed.append(state)
        return True

    keeper = LeaseKeeper(renew, interval_s=3600)
    old, new = JobState(count=1), JobState((("replica-0-2", "node-a", 0.0),), 2)
    try:
        keeper.publish(old)
        assert in_renewal.wait(10)
        keeper.publish(new)
        done = threading.Thread(target=keeper.renew_now)
        done.start()
        time.sleep(0.1)
        release.set()
        done.join(10)
    finally:
        keeper.stop()
    assert landed[-1] == new and landed == [old, new]


def test_a_switched_checkpoint_location_reaches_the_lease_at_once(monkeypatch):
    """The durability guard's new location reached the lease's record only with the next
    tick's renewal: a driver dying in between left the lease to save its final checkpoint
    on one machine's disk. The controller renews with it at once."""
    renewals: list[JobState] = []
    keeper = LeaseKeeper(lambda state: renewals.append(state) or True, interval_s=3600)
    try:
        controller = _controller_with(keeper, monkeypatch, None)
        deadline = time.monotonic() + 10
        while not renewals and time.monotonic() < deadline:  # the first publish's renewal
            time.sleep(0.01)
        controller.move_checkpoints("s3://cluster/ckpt")
        assert renewals[-1].checkpoint_uri == "s3://cluster/ckpt"
        count = len(renewals)
        controller.move_checkpoints("s3://cluster/ckpt")  # unchanged: no renewal
        assert len(renewals) == count
    finally:
        keeper.stop()


def test_replica_names_carry_the_run():
    assert replica_actor_name("r1", "replica-0-3") == "moshray-replica:r1:replica-0-3"
