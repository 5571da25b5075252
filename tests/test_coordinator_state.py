"""The Coordinator's services keep what a restart must not lose (pure: ``MemoryKV``, no Ray).

A Coordinator saves after every call (the actor does it before the reply leaves); a new one
built on the same store restores the step history, the newest step known committed,
rollbacks, quarantine records, draining marks, the stop flag, notices and the data
position, and keeps the history's name so the driver goes on from the rows it holds.
"""

from __future__ import annotations

import pytest

from moshray.cluster import metrics
from moshray.cluster.coordinator.core import CoordinatorCore
from moshray.cluster.coordinator.durable import DurableState, MemoryKV
from moshray.cluster.coordinator.membership import MembershipConfig
from moshray.cluster.coordinator.metrics_sink import MetricsSink
from moshray.cluster.coordinator.notices import NoticeBook
from moshray.cluster.coordinator.progress import ProgressReport, StepRecord
from moshray.cluster.coordinator.shard_ledger import ShardService
from moshray.cluster.coordinator.step_profile import StepPhases
from moshray.cluster.coordinator.steps import REBUILD_S, StepService
from moshray.cluster.messages import CheckpointRef


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def coordinator(kv: MemoryKV, clock: Clock, target: int = 16) -> CoordinatorCore:
    core = CoordinatorCore(MembershipConfig(peer_ttl_s=30.0), clock=clock,
                           target_batch_size=target, store=DurableState(kv, "job/1"))
    core.progress.grace_s = 0.0
    return core


def ready(core: CoordinatorCore, peers) -> None:
    """Register ``peers`` (each its own handle) ready at epoch 0."""
    for p in peers:
        core.register(p, p)
        core.mark_ready(p, 0)


def step(core: CoordinatorCore, clock: Clock, peers, epoch: int, samples: int = 8) -> None:
    """Every peer reports ``samples`` at ``epoch`` (the batch fills: a plan), then applies
    the step and reports at ``epoch + 1``, saving after each call as the actor does."""
    for p in peers:
        core.report(ProgressReport(p, epoch, samples, loss=2.0 - 0.1 * epoch))
        core.save()
    clock.t += 1.0
    for p in peers:
        core.report(ProgressReport(p, epoch + 1, 0, contributed=(epoch + 1, samples + 1)))
        core.save()


def test_a_restarted_coordinator_gets_back_everything_the_summary_and_plans_need():
    kv, clock = MemoryKV(), Clock()
    core = coordinator(kv, clock)
    for p in ("a", "b"):
        core.register(p, p, f"node-{p}")
        assert core.mark_ready(p, 0)
    core.register("c", "c", "node-c")
    core.save()
    for epoch in range(5):
        step(core, clock, ("a", "b"), epoch)
    assert core.grant_shards("a", 3) == (0, 1, 2)
    core.note_notice("node-c", deadline_s=60.0, notice_age_s=0.5)
    for epoch in (5, 6, 7):  # b keeps rejecting c's contributions: c is quarantined
        core.report(ProgressReport("b", 5, 0, saw_rejections=(("c", "non_finite", epoch),)))
    core.request_stop()
    core.save()
    before = core.stats()

    clock.t += 5.0
    again = coordinator(kv, clock)  # Ray restarted the actor: empty memory, same store
    after = again.stats()
    # five full steps, and the step planned at once without the noticed node's peer
    assert after["history"] == before["history"] and len(after["history"]) == 6
    assert [h[2] for h in after["history"][:5]] == [18] * 5  # the corrected sample counts
    assert after["incarnation"] == before["incarnation"] and after["restarts"] == 1
    assert after["committed"] == 5 and after["stopping"]
    assert after["notices"] == 1 and again.notice_stats() == core.notice_stats()
    assert after["quarantines"] == [("c", "non_finite")] == before["quarantines"]
    assert again.data_position() == 3
    assert again.grant_shards("a", 1) == ()  # a is not a member of the new one yet
    again.register("a", "a", "node-a")
    assert again.grant_shards("a", 1) == (3,)  # exact position: no window, no repeat
    again.register("c", "c", "node-c")  # a peer of the noticed node comes back: draining
    assert again.peer_view()["draining"] == ("c",)
    assert again.progress.rebuild_until is not None  # replicas rebuild the epoch


def test_a_fall_back_below_a_step_committed_before_the_restart_is_a_rollback():
    kv, clock = MemoryKV(), Clock()
    core = coordinator(kv, clock)
    ready(core, ("a", "b"))
    for epoch in range(3):
        step(core, clock, ("a", "b"), epoch)
    core.save()
    clock.t += 1.0
    again = coordinator(kv, clock)
    clock.t += 100.0  # every holder of step 3 died before rejoining; the window is over
    again.register("z", "z")  # a joiner with the checkpoint of step 1
    assert not again.mark_ready("z", 1)  # step 1 is not the swarm's: it resumes from it
    assert again.resume_from(1) == 1 and again.mark_ready("z", 1)
    assert again.stats()["rollbacks"] == 1 and again.progress.rollbacks == [(3, 1)]
    assert len(again.stats()["history"]) == 3  # the steps before the restart stay


def test_the_newest_checkpoint_survives_a_restart_and_counts_the_steps_it_rolls_back():
    """A swarm that lost every replica resumes from the newest checkpoint noted by the
    replica that saved it; the steps between it and the newest committed one are counted."""
    kv, clock = MemoryKV(), Clock()
    core = coordinator(kv, clock)
    ready(core, ("a", "b"))
    for epoch in range(4):
        step(core, clock, ("a", "b"), epoch)
        if epoch == 1:
            core.note_checkpoint(CheckpointRef("/ckpt", "run-1", 2))
            core.save()
    core.note_checkpoint(CheckpointRef("/ckpt", "run-1", 1))  # an older save noted late
    core.save()
    assert core.latest_checkpoint() == CheckpointRef("/ckpt", "run-1", 2)
    clock.t += 1.0
    again = coordinator(kv, clock)
    assert again.latest_checkpoint() == CheckpointRef("/ckpt", "run-1", 2)
    clock.t += 100.0  # every holder of step 4 died; a new replica loads the checkpoint
    again.register("z", "z")
    assert again.resume_from(2) == 2 and again.mark_ready("z", 2)
    stats = again.stats()
    assert stats["rollbacks"] == 1 and stats["rolled_back_steps"] == 2


def test_replicas_known_before_a_restart_must_rejoin_or_be_declared_gone_before_an_older_state():
    """Every holder of step 3 dies with the Coordinator: a joiner that finds no donor
    (epoch 0) or an older checkpoint is refused while a and b, known before the restart
    (also across a second restart), may still rejoin; once they were silent for hold_s
    the fall back is a counted rollback."""
    kv, clock = MemoryKV(), Clock()
    core = coordinator(kv, clock)
    ready(core, ("a", "b"))
    for epoch in range(3):
        step(core, clock, ("a", "b"), epoch)
    core.save()
    clock.t += 1.0
    again = coordinator(kv, clock)
    again.register("z", "z")
    clock.t += REBUILD_S + 1.0
    assert not again.mark_ready("z", 0) and again.resume_from(1) == 0
    again.save()
    third = coordinator(kv, clock)  # restarted again before anyone rejoined
    third.register("z", "z")
    clock.t += REBUILD_S + 1.0
    assert not third.mark_ready("z", 0) and third.resume_from(1) == 0
    for _ in range(6):  # a and b silent for hold_s (60 s) since the restart: gone
        clock.t += 10.0
        third.heartbeat("z")
    assert third.resume_from(1) == 1 and third.mark_ready("z", 1)
    assert third.progress.rollbacks == [(3, 1)] and third.stats()["rolled_back_steps"] == 2


def test_a_fall_back_survives_a_restart_and_a_stale_holder_is_told_from_a_step_done_meanwhile():
    """a, b, c hold step 3; c is cut off, a and b die; z resumes from step 1 (rollback,
    branch 1) and y copies it; they train to 2, plan 3 and the Coordinator restarts. z's
    step 3 (branch 1, done during the restart) is the swarm's; c's step 3 (branch 0) is not."""
    kv, clock = MemoryKV(), Clock()
    core = coordinator(kv, clock, target=2)
    ready(core, ("a", "b", "c"))
    for epoch in range(3):
        step(core, clock, ("a", "b", "c"), epoch, samples=1)
    clock.t += 31.0  # c is cut off (it expires) ...
    core.heartbeat("a")
    core.heartbeat("b")
    assert core.peer_view()["members"] == ("a", "b")
    clock.t += core.progress.hold_s + 1.0  # ... then a's and b's nodes die
    core.register("z", "z")
    assert core.mark_ready("z", 1) and core.progress.rollbacks == [(3, 1)]
    core.register("y", "y")
    assert core.donor("y") == ("z", "z") and core.mark_ready("y", 1)
    for p in ("z", "y"):
        core.report(ProgressReport(p, 1, 1, branch=0))
    for p in ("z", "y"):
        core.report(ProgressReport(p, 2, 1, branch=1))  # step 2 applied, 3 planned
    assert core.epoch == 3 and core.progress.branch == 1
    core.save()
    clock.t += 1.0
    again = coordinator(kv, clock, target=2)
    assert again.rejoin("z", "z", "", 2, branch=1) and again.rejoin("y", "y", "", 2, branch=1)
    again.report(ProgressReport("z", 3, 0, branch=1))  # step 3 completed among z and y
    assert again.epoch == 3
    assert again.rejoin("c", "c", "", 3, branch=0) is False  # the old branch's step 3
    assert again.report(ProgressReport("c", 3, 1, branch=0)).resync
    assert again.epoch == 3 and again.stats()["stale_returns"] == 1
    again.save()
    assert coordinator(kv, clock, target=2).stats()["stale_returns"] == 1


def test_a_store_without_state_starts_empty_and_a_second_restart_counts_again():
    kv, clock = MemoryKV(), Clock()
    first = coordinator(kv, clock)
    assert first.stats()["restarts"] == 0 and first.progress.rebuild_until is None
    first.save()
    second = coordinator(kv, clock)
    second.save()
    third = coordinator(kv, clock)
    assert third.stats()["restarts"] == 2
    assert third.stats()["incarnation"] == first.stats()["incarnation"]


def test_history_writes_are_bounded_per_step_and_corrections_rewrite_their_chunk():
    kv = MemoryKV()
    store = DurableState(kv, "job/h", history_chunk=4)
    rows = [StepRecord(e, float(e), 8, 1.0, 2) for e in range(1, 11)]
    assert store.sync_history(rows, now=0.0) == 3  # chunks 0, 1, 2
    assert store.sync_history(rows, now=5.0) == 0  # nothing changed: nothing written
    puts = kv.puts
    rows.append(StepRecord(11, 11.0, 8, 1.0, 2))
    assert store.sync_history(rows, now=5.1) == 1 and kv.puts == puts + 1  # a step: a chunk
    rows[10] = StepRecord(11, 11.0, 12, 1.0, 2)  # a participant's count corrected it:
    assert store.sync_history(rows, now=5.2) == 0  # written behind, ...
    assert DurableState(kv, "job/h", history_chunk=4).load_history()[10].samples == 8
    rows[7] = StepRecord(8, 8.0, 12, 1.0, 2)  # (chunk 1; row 10 is in chunk 2)
    assert store.sync_history(rows, now=6.2) == 2  # ... at most FLUSH_S later
    assert DurableState(kv, "job/h", history_chunk=4).load_history() == rows
    rows.append(StepRecord(12, 12.0, 8, 1.0, 2))
    rows[10] = StepRecord(11, 11.0, 16, 1.0, 2)
    assert store.sync_history(rows, now=6.3) == 1  # a new row takes the correction along
    assert DurableState(kv, "job/h", history_chunk=4).load_history() == rows


def test_a_missing_history_chunk_restores_the_rows_before_the_gap():
    kv = MemoryKV()
    store = DurableState(kv, "job/h", history_chunk=2)
    rows = [StepRecord(e, float(e), 8, None, 1) for e in range(1, 6)]
    store.sync_history(rows)
    kv.delete("job/h/history/1")
    assert DurableState(kv, "job/h", history_chunk=2).load_history() == rows[:2]


def phases(epoch: int) -> StepPhases:
    return StepPhases(epoch, 1.0, 0.5, 0.1, 0.3, 0.1, 0.0, 8, 2,
                      round_phases=(("reduce", 0.2),))


def test_the_step_profile_log_keeps_its_window_and_deletes_older_chunks():
    kv = MemoryKV()
    store = DurableState(kv, "job/p", profile_chunk=4)
    sink = MetricsSink(metrics.Prices(), lambda: metrics.TrainingState(), profile_keep=6)
    for e in range(1, 11):
        sink.record((phases(e), metrics.NodeLostEvent(True),
                     metrics.RoundEvent(0.1, 500, cross_zone_bytes=200))
                    if e == 3 else (phases(e),))
        store.sync_profile(sink.profile.steps, sink.profiled, 6, now=float(e))
    assert sorted(k for k in kv.data if "/profile/" in k) == ["job/p/profile/1",
                                                              "job/p/profile/2"]
    restored = MetricsSink(metrics.Prices(), lambda: metrics.TrainingState(), profile_keep=6)
    rows = DurableState(kv, "job/p", profile_chunk=4).load_profile(sink.profiled, 6)
    restored.restore({**sink.snapshot(), "profiled": sink.profiled}, rows)
    assert list(restored.profile.steps) == list(sink.profile.steps)
    assert [p.epoch for p in restored.profile.steps] == [5, 6, 7, 8, 9, 10]
    assert restored.nodes_lost == 1 and restored.profiled == 10
    assert (restored.sent_bytes, restored.cross_zone_bytes) == (500, 200)
    assert restored.step_profile() == sink.step_profile()
    store.sync_profile(sink.profile.steps, sink.profiled + 0, 6, now=10.5)  # nothing new
    sink.record((phases(11),))
    assert store.sync_profile(sink.profile.steps, sink.profiled, 6, now=10.6) == 0  # behind
    assert store.sync_profile(sink.profile.steps, sink.profiled, 6, now=11.0) == 1


def test_each_service_round_trips_its_snapshot():
    book = NoticeBook()
    book.note("n1", 10.0, 1.0, 4, ("p1",))
    book.note("n2", 11.0, 0.0, 4, ())
    book.rebalanced(5, 12.5)
    other = NoticeBook()
    other.restore(book.snapshot())
    assert other.stats() == book.stats() and other.summary() == book.summary()

    shards = ShardService()
    shards.grant("a", 2, 0, 0.0, member=True)
    back = ShardService()
    back.restore(shards.snapshot())
    back.rejoined(0, 0.0)  # restored: no window
    assert back.grant("a", 1, 0, 0.0, member=True) == (2,)
    fresh = ShardService()
    fresh.rejoined(5, 0.0)  # not restored: a window while positions are heard
    assert fresh.grant("a", 1, 0, 1.0, member=True) == ()
    assert fresh.grant("a", 1, 0, 10.0, member=True) == (5,)

    steps = StepService(MembershipConfig())
    steps.mark_draining("n1", 99.0)
    steps.request_stop()
    steps.progress.note_committed(7)
    copy = StepService(MembershipConfig())
    copy.restore(steps.snapshot())
    assert copy.snapshot() == steps.snapshot()


def test_a_bad_store_prefix_is_refused_with_what_to_fix():
    with pytest.raises(ValueError, match="prefix"):
        DurableState(MemoryKV(), "")


def test_the_driver_keeps_every_row_over_a_restart_and_takes_the_restored_history():
    from moshray.jobs.train import read_stats

    kv, clock = MemoryKV(), Clock()
    live = [coordinator(kv, clock)]
    for p in ("a", "b"):
        live[0].register(p, p)
        live[0].mark_ready(p, 0)
    asked = []

    def fetch(since):
        asked.append(since)
        return live[-1].stats(since)

    for epoch in range(3):
        step(live[0], clock, ("a", "b"), epoch)
    held = read_stats(fetch, {"history": [], "epoch": 0})
    for p in ("a", "b"):  # the plan of step 4 is made (its row written), nobody applies it
        live[0].report(ProgressReport(p, 3, 8))
        live[0].save()
    held = read_stats(fetch, held)
    # the rows a Coordinator may still rewrite (the last KEEP_EPOCHS) are read again
    assert [h[0] for h in held["history"]] == [1, 2, 3, 4] and asked[-1] == 0
    clock.t += 1.0
    live.append(coordinator(kv, clock))  # restarted: the replicas rejoin holding step 3
    for p in ("a", "b"):
        live[-1].rejoin(p, p, "", 3)
    clock.t += 10.0
    step(live[-1], clock, ("a", "b"), 3)  # step 4 planned again, and applied
    after = read_stats(fetch, held)
    assert asked[-1] == 0  # a restart: the whole history is read once
    assert after["history"] == live[-1].stats()["history"]
    assert [h[0] for h in after["history"]] == [1, 2, 3, 4]  # one row per step
    assert after["history"][:3] == held["history"][:3]  # the rows before the restart
    assert after["history"][3][1] > held["history"][3][1]  # step 4's row: the new plan's
    assert read_stats(fetch, after)["history"] == after["history"] and asked[-1] == 0


# --------------------------------------------------------------------------- the step trigger


def test_step_due_counts_samples_for_collaborative_steps_and_local_steps_for_local_sgd():
    from moshray.cluster.coordinator.progress import step_due

    a, b = ProgressReport("a", 3, 48, micro=3), ProgressReport("b", 3, 80, micro=5)
    assert step_due([a, b], 2, target_batch_size=128)  # 128 samples: a collaborative step
    assert not step_due([a, b], 2, target_batch_size=129)
    # local SGD: 8 local steps between averages, 2 eligible peers: 16 micro-batches needed,
    # whatever the samples (the old trigger fired after 128 samples, i.e. 8 steps together)
    assert step_due([a, b], 2, target_batch_size=128, local_steps=4)
    assert not step_due([a, b], 2, target_batch_size=128, local_steps=8)
    assert step_due([ProgressReport("a", 3, 1000, micro=10), ProgressReport("b", 3, 900, micro=6)],
                    2, target_batch_size=1, local_steps=8)
    # an eligible peer that has not reported at this epoch counts as zero local steps
    assert not step_due([ProgressReport("a", 3, 1000, micro=10)], 2, 1, local_steps=8)
    assert not step_due([ProgressReport("a", 3, 0, micro=0)], 1, 1, local_steps=0)


def test_a_local_sgd_coordinator_plans_after_local_steps_not_after_target_samples():
    core = CoordinatorCore(MembershipConfig(peer_ttl_s=30.0), clock=Clock(),
                           target_batch_size=16, local_steps=4)
    core.progress.grace_s = 0.0
    ready(core, ["a", "b"])
    # 3 local steps of 16 samples each: far past target_batch_size, but no step yet
    for p in ("a", "b"):
        assert core.report(ProgressReport(p, 0, 48, micro=3)).plan is None
    assert core.epoch == 0
    core.report(ProgressReport("a", 0, 64, micro=4))
    assert core.epoch == 0  # 7 of the 8 local steps the two peers owe
    reply = core.report(ProgressReport("b", 0, 64, micro=4))
    assert core.epoch == 1 and reply.plan is not None and dict(reply.plan.shares).keys() == {"a", "b"}
