"""Collaborative steps take every ready peer: a short grace for peers finishing the last
step, plans pushed the moment they exist, and a notice that re-plans at once (pure)."""

from __future__ import annotations

from moshray.cluster.coordinator.core import CoordinatorCore
from moshray.cluster.coordinator.membership import MembershipConfig
from moshray.cluster.coordinator.progress import ProgressReport


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def swarm(peers=("a", "b", "c"), target=24, grace=0.5):
    clock = Clock()
    core = CoordinatorCore(MembershipConfig(peer_ttl_s=30.0), clock=clock,
                           target_batch_size=target)
    core.progress.grace_s = grace
    pushed = []
    core.push_plan = lambda plan, views: pushed.append(plan)
    for i, p in enumerate(peers):
        core.register(p, handle=p, node_id=f"node-{p}")
        assert core.mark_ready(p, 0)
    return core, clock, pushed


def report(core, peer, epoch, samples):
    return core.report(ProgressReport(peer, epoch, samples, 1.0, None))


def whole(core, view):
    """The whole plan behind ``view`` (a reply's ``PeerPlan``): the tracker's latest, of
    which ``view`` must be its peer's part."""
    plan = core.progress.plan
    assert view is not None and plan is not None and view == plan.view_of(view.peer)
    return plan


def test_every_ready_peer_at_the_epoch_takes_the_step_even_with_zero_samples():
    core, clock, pushed = swarm()
    report(core, "c", 0, 0)  # c has nothing yet: it still takes part, weight 0
    report(core, "a", 0, 12)
    reply = report(core, "b", 0, 12)
    assert whole(core, reply.plan).participants == ("a", "b", "c")
    assert pushed == [core.progress.plan]  # pushed to the participants the moment it exists


def test_a_peer_finishing_the_last_step_gets_a_grace_not_a_resync():
    core, clock, pushed = swarm(("a", "b"))
    report(core, "a", 0, 12)
    plan1 = report(core, "b", 0, 12).plan
    assert whole(core, plan1).participants == ("a", "b")
    report(core, "a", 1, 0)  # a applied step 1 at once; b is still applying it
    assert report(core, "a", 1, 24).plan is None  # full, but b is finishing: grace
    clock.t += 0.2
    reply = report(core, "b", 1, 0)  # b arrives within the grace
    assert not reply.resync
    plan2 = report(core, "a", 1, 30).plan
    assert whole(core, plan2).participants == ("a", "b")


def test_the_grace_is_bounded():
    core, clock, pushed = swarm(("a", "b"))
    report(core, "a", 0, 12)
    report(core, "b", 0, 12)
    report(core, "a", 1, 24)  # b never shows up at epoch 1
    clock.t += 0.6
    plan2 = report(core, "a", 1, 28).plan
    assert whole(core, plan2).participants == ("a",)


def test_a_notice_replans_at_once_without_the_node():
    core, clock, pushed = swarm(("a", "b", "c"), target=1000)
    for p in ("a", "b", "c"):
        report(core, p, 0, 10)
    assert core.note_notice("node-c", deadline_s=30.0) == ("c",)
    assert len(pushed) == 1 and pushed[0].participants == ("a", "b")
    assert core.notice_stats()["node-c"]["rebalance_s"] == 0.0


def test_a_notice_during_a_step_plans_the_next_step_right_after_it():
    core, clock, pushed = swarm(("a", "b"), target=20)
    report(core, "a", 0, 10)
    report(core, "b", 0, 10)  # step 1 planned over a and b, in flight
    assert len(pushed) == 1
    clock.t += 0.5
    core.note_notice("node-b", deadline_s=30.0, notice_age_s=0.25)
    assert len(pushed) == 1  # nothing while step 1 is in flight
    assert report(core, "b", 0, 12).plan == pushed[0].view_of("b")  # b finishes step 1 ...
    clock.t += 0.25
    # ... a's report right after step 1, with no sample yet, re-plans without b
    report(core, "a", 1, 0)
    assert len(pushed) == 2 and (pushed[1].epoch, pushed[1].participants) == (2, ("a",))
    assert core.notice_stats()["node-b"]["rebalance_s"] == 0.5  # its age + 0.25 s
    assert report(core, "b", 1, 0).stop  # b stops after its last step
    assert report(core, "a", 1, 4).plan == pushed[1].view_of("a")  # a takes step 2 next


def test_a_one_to_one_digest_split_resolves_to_the_smallest_peer():
    core, clock, pushed = swarm(("a", "b"), target=1000)
    core.report(ProgressReport("a", 0, 4, 1.0, "digest-a"))
    core.report(ProgressReport("b", 0, 4, 1.0, "digest-b"))
    assert core.report(ProgressReport("b", 0, 5, 1.0, "digest-b")).resync
    assert not core.report(ProgressReport("a", 0, 5, 1.0, "digest-a")).resync


def test_a_replica_whose_digest_loses_the_vote_is_resynced_and_counted():
    core, clock, pushed = swarm(("a", "b", "c"), target=1000)
    for peer, digest in (("a", "same"), ("b", "same"), ("c", "odd")):
        core.report(ProgressReport(peer, 0, 4, 1.0, digest))
    assert core.report(ProgressReport("c", 0, 5, 1.0, "odd")).resync
    counters = core.steps.counters(clock())
    assert counters["diverged"] == [["c", 0]]
    # A split seen only when the plan is made: the odd one takes no further step.
    core2, clock2, pushed2 = swarm(("a", "b", "c"), target=12)
    core2.report(ProgressReport("c", 0, 4, 1.0, "odd"))
    core2.report(ProgressReport("a", 0, 4, 1.0, "same"))
    core2.report(ProgressReport("b", 0, 4, 1.0, "same"))
    clock2.t += 5
    core2.report(ProgressReport("a", 0, 8, 1.0, "same"))
    assert pushed2 and "c" not in pushed2[-1].participants
    assert core2.steps.counters(clock2())["diverged"] == [["c", 0]]
    # ... and the count survives a Coordinator restart
    fresh, _, _ = swarm(("a", "b", "c"), target=1000)
    fresh.steps.restore(core.steps.snapshot())
    assert fresh.steps.counters(clock())["diverged"] == [["c", 0]]


def test_a_peer_others_keep_rejecting_is_quarantined_and_must_resync():
    core, clock, pushed = swarm(("a", "b", "c"), target=1000)
    core.progress.quarantine.threshold = 3
    for epoch, reporter in ((1, "a"), (1, "b"), (1, "a")):  # a's second one counts once
        core.report(ProgressReport(reporter, 0, 1, 1.0, None, 0, (("c", "non_finite", epoch),)))
    assert "c" in core.progress.ready
    core.report(ProgressReport("b", 0, 1, 1.0, None, 0, (("c", "late", 2),)))  # not c's fault
    assert "c" in core.progress.ready
    core.report(ProgressReport("a", 0, 1, 1.0, None, 0, (("c", "bad_weight", 2),)))
    assert "c" not in core.progress.ready
    assert core.stats()["quarantines"] == [("c", "bad_weight")]
    assert core.report(ProgressReport("c", 0, 1, 1.0, None)).resync
    assert core.mark_ready("c", 0)  # after the copy it is back, with a clean record


def test_a_restarted_coordinator_is_rebuilt_from_the_replicas_epochs():
    fresh, clock, pushed = swarm((), target=8)  # a Coordinator that lost its memory
    assert fresh.report(ProgressReport("a", 7, 4, 1.0, None)).unknown  # "rejoin, please"
    assert fresh.rejoin("b", "b", "node-b", 6) is True  # the first to come sets the epoch
    assert fresh.rejoin("a", "a", "node-a", 7) is True  # the newest step held wins
    assert fresh.membership.epoch == 7
    assert fresh.rejoin("c", "c", "node-c", 5) is False  # behind: resyncs from a donor
    assert fresh.report(ProgressReport("b", 6, 4, 1.0, None)).resync
    plan = fresh.report(ProgressReport("a", 7, 8, 1.0, None)).plan
    assert plan is not None and plan.epoch == 8


def test_a_step_finished_during_a_restart_is_adopted():
    core, clock, pushed = swarm(("a",), target=8)
    core.rejoin("a", "a", "node-a", 3)
    core.report(ProgressReport("a", 4, 0, None, None))  # its in-flight step 4 completed
    assert core.membership.epoch == 4


# -- committed steps held by live replicas are never rolled back ---------------------------


def restarted(target=8, ttl=5.0):
    """A Coordinator that Ray restarted: empty memory, a rebuild window open."""
    clock = Clock()
    core = CoordinatorCore(MembershipConfig(peer_ttl_s=ttl), clock=clock,
                           target_batch_size=target, restarted=True)
    core.push_plan = lambda plan, views: None
    return core, clock


def test_after_a_restart_a_joiner_with_an_old_state_waits_for_the_holders_to_rejoin():
    core, clock = restarted()
    core.register("j", "j", "node-j")  # a joiner copying state: no donor is known yet
    assert core.donor("j") is None
    assert core.mark_ready("j", 0) is False  # the holders have not rejoined yet
    assert core.rejoin("a", "a", "node-a", 41) is True  # ready at once: it holds the newest
    assert core.epoch == 41
    assert core.donor("j") == ("a", "a")
    assert core.mark_ready("j", 41) is True
    assert core.progress.rollbacks == [] and core.progress.abandoned == []


def test_after_the_rebuild_window_an_old_state_is_still_refused_while_a_holder_is_up():
    core, clock = restarted()
    core.rejoin("a", "a", "node-a", 41)
    core.register("j", "j", "node-j")
    clock.t += 10.0  # window over; a reports, so it stays a member
    core.report(ProgressReport("a", 41, 1, 1.0, None))
    assert core.mark_ready("j", 0) is False
    assert core.progress.rollbacks == [] and core.epoch == 41


def test_heartbeat_and_report_both_rejoining_changes_nothing():
    core, clock = restarted(target=4)
    assert core.rejoin("a", "a", "node-a", 9) and core.rejoin("b", "b", "node-b", 9)
    plan = whole(core, core.report(ProgressReport("a", 9, 4, 1.0, None)).plan)
    assert plan.participants == ("a", "b")
    # b's heartbeat and one of its reports both heard "unknown": a second rejoin, still at 9
    assert core.rejoin("b", "b", "node-b", 9) is False  # epoch 10 is planned already
    assert "b" in core.progress.ready and core.epoch == 10
    # b still takes it
    assert core.report(ProgressReport("b", 9, 0, None, None)).plan == plan.view_of("b")
    assert core.progress.rollbacks == []


def test_a_live_peer_expired_by_late_heartbeats_blocks_a_rollback_and_rejoins_ready():
    core, clock = restarted(target=4, ttl=5.0)
    core.rejoin("a", "a", "node-a", 20)
    core.register("j", "j", "node-j")
    clock.t += 6.0  # a's event loop was busy: its heartbeats are late, it expires
    core.heartbeat("j")
    assert core.peer_view()["members"] == ("j",)
    assert core.mark_ready("j", 3) is False  # a was seen with epoch 20 within hold_s
    assert core.report(ProgressReport("a", 20, 1, 1.0, None)).unknown  # a is back
    assert core.rejoin("a", "a", "node-a", 20) is True
    assert core.epoch == 20 and core.progress.rollbacks == []


def test_a_quarantined_peer_that_is_the_only_holder_is_a_donor_not_a_rollback():
    core, clock, pushed = swarm(("a", "b"), target=1000)
    core.progress.quarantine.threshold = 1
    core.report(ProgressReport("b", 0, 1, 1.0, None, 0, (("a", "non_finite", 1),)))
    assert "a" not in core.progress.ready  # a is quarantined ...
    core.leave("b")  # ... and the only other peer leaves
    core.register("j", "j", "node-j")
    assert core.mark_ready("j", -1) is False  # no rollback past a's state
    assert core.donor("j") == ("a", "a")  # a's state is the swarm's: copy it
    assert core.mark_ready("j", 0) is True and core.progress.rollbacks == []


def test_a_plan_whose_participants_all_died_unapplied_is_abandoned_not_rolled_back():
    core, clock, pushed = swarm(("a", "b"), target=8)
    report(core, "a", 0, 8)  # epoch 1 planned over a and b
    assert core.epoch == 1
    core.register("j", "j", "node-j")
    assert core.mark_ready("j", 0) is False  # a and b may still apply epoch 1
    core.leave("a")
    core.leave("b")  # both died inside the round: nobody ever held epoch 1
    assert core.mark_ready("j", 0) is True
    assert core.epoch == 0 and core.progress.rollbacks == [] and core.progress.abandoned == [(1, 0)]


def test_a_rollback_is_counted_only_when_every_holder_is_gone():
    core, clock, pushed = swarm(("a",), target=8)
    report(core, "a", 0, 8)
    report(core, "a", 1, 0)  # a applied epoch 1 (committed)
    core.leave("a")  # and left for good
    core.register("j", "j", "node-j")
    assert core.mark_ready("j", 0) is True and core.progress.rollbacks == [(1, 0)]


def test_a_full_batch_waits_for_a_joiner_copying_the_state_then_it_takes_the_step():
    core, clock, pushed = swarm(("a",), target=8)
    core.register("j", "j", "node-j")
    assert core.donor("j") == ("a", "a")  # j starts copying a's state of epoch 0
    assert report(core, "a", 0, 8).plan is None  # full, but j is about to be ready
    clock.t += 0.3
    assert core.mark_ready("j", 0) is True  # no plan came in between: accepted at once
    plan = report(core, "a", 0, 9).plan  # j counts at epoch 0 before its first report
    assert whole(core, plan).participants == ("a", "j")


def test_the_wait_for_a_joiner_is_bounded():
    core, clock, pushed = swarm(("a",), target=8)
    core.register("j", "j", "node-j")
    core.donor("j")
    assert report(core, "a", 0, 8).plan is None
    clock.t += core.progress.join_grace_s + 0.1  # j's copy is stuck
    plan = report(core, "a", 0, 9).plan
    assert whole(core, plan).participants == ("a",)


def test_a_donor_holding_the_current_epoch_is_preferred():
    core, clock = restarted()
    core.rejoin("a", "a", "node-a", 5)  # a rejoins first with an older state ...
    core.rejoin("b", "b", "node-b", 7)  # ... b holds the newest
    core.register("j", "j", "node-j")
    assert core.donor("j") == ("b", "b")


def test_a_syncing_peer_rejoins_as_a_holder_not_as_ready():
    core, clock = restarted()
    assert core.rejoin("q", "q", "node-q", 12, syncing=True) is False
    assert "q" not in core.progress.ready and core.epoch == 12  # the newest wins
    core.register("j", "j", "node-j")
    clock.t += 10.0
    core.heartbeat("q")
    assert core.mark_ready("j", 3) is False  # q holds epoch 12
    assert core.mark_ready("q", 12) is True  # its copy done (from no donor: its own state)


def test_a_first_rejoin_opens_the_rebuild_window_when_the_restart_went_unnoticed():
    core, clock, pushed = swarm((), target=8)  # restarted=False (the shell could not tell)
    core.rejoin("a", "a", "node-a", 30)
    core.leave("a")
    core.register("j", "j", "node-j")
    assert core.mark_ready("j", 0) is False  # inside the window
    clock.t += 10.0
    core.heartbeat("j")
    assert core.mark_ready("j", 0) is True and core.progress.rollbacks == [(30, 0)]


def test_a_non_member_is_never_ready():
    core, clock, pushed = swarm(("a",))
    assert core.mark_ready("ghost", 0) is False


def test_a_restarted_coordinator_told_of_a_committed_step_counts_the_fall_back_as_a_rollback():
    """Every holder of step 5 died while the Coordinator was away: the driver remembers
    that step 5 was committed, so resuming from the checkpoint's step 3 is a rollback."""
    core, clock, pushed = swarm((), target=8)
    core.progress.rebuild_until = clock.t + 3.0
    core.note_committed(5)
    core.register("j", "j", "node-j")
    assert core.resume_from(3) == 0  # holders of newer steps may still rejoin
    clock.t += 3.5
    assert core.resume_from(3) == 3 and core.mark_ready("j", 3) is True
    assert core.progress.rollbacks == [(5, 3)] and core.stats()["rollbacks"] == 1
    assert core.resume_from(4) == 3  # once only


def test_a_fresh_job_resumes_from_its_checkpoint_without_a_rollback():
    core, clock, pushed = swarm((), target=8)
    core.register("j", "j", "node-j")
    assert core.resume_from(3) == 3 and core.mark_ready("j", 3)
    assert core.progress.rollbacks == [] and core.stats()["committed"] == 3


def test_a_lost_ready_peer_makes_the_staying_ones_step_at_once():
    core, clock, pushed = swarm(("a", "b", "c"), target=1000)
    for p in ("a", "b", "c"):
        report(core, p, 0, 10)
    core.leave("c")  # its node died (the controller saw it in Ray's node table)
    assert len(pushed) == 1 and pushed[0].participants == ("a", "b")


def test_a_peer_lost_during_a_step_is_replanned_around_right_after_it():
    core, clock, pushed = swarm(("a", "b", "c"), target=30)
    for p in ("a", "b", "c"):
        report(core, p, 0, 10)  # step 1 over a, b and c, in flight
    core.leave("c")
    assert len(pushed) == 1
    report(core, "a", 1, 0)
    report(core, "b", 1, 4)  # a and b finished step 1 (c's part re-reduced by them)
    assert len(pushed) == 2 and pushed[1].participants == ("a", "b")
    report(core, "a", 1, 4)
    assert len(pushed) == 2  # once: then full batches again


def test_no_replan_once_the_job_stops():
    core, clock, pushed = swarm(("a", "b"), target=1000)
    report(core, "a", 0, 10)
    report(core, "b", 0, 10)
    core.request_stop()
    core.leave("b")
    assert pushed == []


def test_a_broken_peer_that_resyncs_after_every_round_is_still_quarantined():
    """A wrong-shape peer ends every round with other parameters than the swarm (it
    averaged alone), so it is told to resync each time: its record must survive that."""
    core, clock, pushed = swarm(("a", "b", "c"), target=30)
    for epoch in range(1, 4):
        for p in ("a", "b"):
            core.report(ProgressReport(p, epoch - 1, 10, 1.0, None, 0,
                                       (("c", "shape_mismatch", epoch - 1, 101),), numel=100))
        core.progress.ready.discard("c")  # c diverged: resync ...
        assert core.mark_ready("c", core.epoch)  # ... and back
        core.report(ProgressReport("c", core.epoch, 10, 1.0, None, 0, (), numel=100))
        clock.t += 1
    assert [q.peer_id for q in core.progress.quarantine.records] == ["c"]


def test_a_step_counts_the_samples_its_participants_really_averaged():
    """Peers go on computing while a plan reaches them: a step's history count becomes,
    per participant, the larger of what it had at plan time and what it put in."""
    core, clock, pushed = swarm(("a", "b", "c"))
    report(core, "a", 0, 8)
    report(core, "b", 0, 8)
    plan = report(core, "c", 0, 8).plan
    assert plan is not None and core.stats()["history"][-1][2] == 24
    core.report(ProgressReport("a", 1, 0, None, None, contributed=(1, 16)))
    core.report(ProgressReport("b", 1, 0, None, None, contributed=(1, 24)))
    assert core.stats()["history"][-1][2] == 16 + 24 + 8  # c (no report yet): plan time
    core.report(ProgressReport("c", 1, 0, None, None, contributed=(1, 4)))  # below: kept 8
    assert core.stats()["history"][-1][2] == 48
    core.report(ProgressReport("a", 1, 0, None, None, contributed=(7, 99)))  # unknown step
    assert [h[2] for h in core.stats()["history"]] == [48]


def test_step_samples_forget_old_steps_and_unplanned_peers():
    from moshray.cluster.coordinator.step_samples import KEEP_EPOCHS, StepSamples

    s = StepSamples()
    s.planned(1, {"a": 8})
    assert s.contributed(1, "z", 50) is None  # not in the plan
    assert s.contributed(1, "a", 12) == 12
    s.planned(1 + KEEP_EPOCHS, {"a": 8})
    assert s.contributed(1, "a", 20) is None  # too old to correct


def test_a_count_told_again_never_lowers_a_steps_samples():
    from moshray.cluster.coordinator.step_samples import StepSamples

    s = StepSamples()
    s.planned(3, {"a": 8, "b": 8})
    assert s.contributed(3, "a", 12) == 20
    assert s.contributed(3, "a", 10) == 20  # a smaller count for the same step: kept
    assert s.contributed(3, "a", 14) == 22 and s.total(3) == 22


def test_the_driver_reads_only_new_history_rows_and_keeps_them_over_a_lost_state():
    from moshray.jobs.train import read_stats

    core, _, _ = swarm(target=24)
    coordinators, asked = [core], []

    def fetch(since):
        asked.append(since)
        return coordinators[-1].stats(since)

    stats = read_stats(fetch, {"history": [], "epoch": 0})
    assert stats["history"] == [] and asked == [0]
    for peer in ("a", "b", "c"):
        report(core, peer, 0, 8)  # a full batch: the step's plan is in the history
    stats = read_stats(fetch, stats)
    full = core.stats()["history"]
    assert len(full) == 1 and stats["history"] == full and asked[-1] == 0
    again = read_stats(fetch, stats)
    assert again["history"] == full and asked[-1] == 0  # the rows it may rewrite: again
    clock = Clock()
    coordinators.append(CoordinatorCore(MembershipConfig(), clock=clock, target_batch_size=24,
                                        restarted=True))
    restarted = read_stats(fetch, again)  # a Coordinator that lost its state (no store)
    assert asked[-1] == 0  # read again from row 0
    assert restarted["history"] == full and restarted["history_kept"] == 1  # nothing dropped
    assert restarted["incarnation"] != again["incarnation"]
    newest = coordinators[-1]
    for peer in ("a", "b", "c"):
        newest.rejoin(peer, None, "", 1)
    clock.t += 10.0  # after the rebuild window
    for peer in ("a", "b", "c"):
        newest.report(ProgressReport(peer, 1, 8))
    later = read_stats(fetch, restarted)
    assert [h[0] for h in later["history"]] == [1, 2] and asked[-1] == 0  # its row 0 is new


def test_the_driver_sees_rows_the_coordinator_rewrote_and_keeps_corrections_over_a_restart():
    # A plan nobody applied is replaced by a newer plan of its epoch (same row count), a
    # participant corrects a row's count; a restarted Coordinator may have lost a
    # correction made just before it died. The driver's rows follow the Coordinator's.
    from moshray.cluster.coordinator.step_samples import KEEP_EPOCHS
    from moshray.jobs.train import read_stats

    coordinator = {"incarnation": "x", "restarts": 0,
                   "history": [(e, float(e), 16, 5.0, 3) for e in range(1, 9)]}
    asked = []

    def fetch(since):
        asked.append(since)
        return {**coordinator, "history": list(coordinator["history"][since:])}

    stats = read_stats(fetch, {"history": [], "epoch": 0})
    assert len(stats["history"]) == 8
    coordinator["history"][-2:] = [(7, 7.0, 20, 5.0, 3), (8, 9.5, 40, 5.0, 2)]  # 7 corrected,
    stats = read_stats(fetch, stats)  # 8 planned again without a peer
    assert stats["history"][-2:] == [(7, 7.0, 20, 5.0, 3), (8, 9.5, 40, 5.0, 2)]
    # restarted: its copy of row 7 predates the correction; row 8 is the same plan
    coordinator.update(restarts=1, history=[*coordinator["history"][:6], (7, 7.0, 16, 5.0, 3),
                                            (8, 9.5, 40, 5.0, 2), (9, 10.0, 16, 5.0, 2)])
    stats = read_stats(fetch, stats)
    assert [h[2] for h in stats["history"]] == [16] * 6 + [20, 40, 16]
    assert stats["history_kept"] == 0
    again = read_stats(fetch, stats)  # a later poll of the same Coordinator keeps it too
    assert [h[2] for h in again["history"]] == [16] * 6 + [20, 40, 16]
    # a long history: only the last KEEP_EPOCHS rows are read again; a change before them
    # (a fall back of more steps) is seen at the first of them and the whole is read
    coordinator["history"] = [(e, float(e), 16, 5.0, 3) for e in range(1, 3 * KEEP_EPOCHS)]
    stats = read_stats(fetch, {"history": [], "epoch": 0})
    n = len(coordinator["history"])
    stats = read_stats(fetch, stats)
    assert asked[-1] == n - KEEP_EPOCHS and len(stats["history"]) == n
    coordinator["history"][KEEP_EPOCHS:] = [(e, e + 0.5, 8, 5.0, 2)
                                            for e in range(KEEP_EPOCHS + 1, 3 * KEEP_EPOCHS)]
    stats = read_stats(fetch, stats)
    assert asked[-2:] == [n - KEEP_EPOCHS, 0]
    assert stats["history"] == coordinator["history"]


def test_a_joiner_whose_copies_take_longer_than_a_step_is_waited_for_until_it_catches_up():
    # a copy over a slow link takes 3 s; a step, far less: with a fixed 2 s grace from the
    # first ask the swarm stepped on during every copy and the joiner never got in
    core, clock, pushed = swarm(("a",), target=8)
    core.register("j", "j", "node-j")
    core.donor("j")  # first copy of epoch 0
    clock.t += core.progress.join_grace_s + 1.0  # 3 s: the grace ran out, a step happens
    assert report(core, "a", 0, 8).plan is not None
    report(core, "a", 1, 0)  # a applied epoch 1
    assert core.mark_ready("j", 0) is False  # j's copy is of epoch 0: too late
    core.donor("j")  # j copies again; its last attempt took 3 s
    clock.t += 3.0  # within 1.5 x 3 s: full batches wait
    assert report(core, "a", 1, 8).plan is None
    assert core.mark_ready("j", 1) is True
    plan = report(core, "a", 1, 9).plan
    assert whole(core, plan).participants == ("a", "j")


def test_the_stretched_wait_for_a_joiner_is_capped():
    from moshray.cluster.coordinator.progress import JoinWait, join_wait

    assert join_wait(JoinWait(0.0, 0.0), 1.9, grace_s=2.0, cap_s=30.0)
    assert not join_wait(JoinWait(0.0, 0.0), 2.1, grace_s=2.0, cap_s=30.0)
    assert join_wait(JoinWait(0.0, 10.0, 4.0), 15.9, grace_s=2.0, cap_s=30.0)  # 1.5 x 4 s
    assert not join_wait(JoinWait(0.0, 10.0, 4.0), 16.1, grace_s=2.0, cap_s=30.0)
    assert not join_wait(JoinWait(0.0, 29.0, 10.0), 30.5, grace_s=2.0, cap_s=30.0)  # capped


# -- a restart during a long step: older states wait for every replica that may hold newer -


def test_after_a_restart_during_a_long_step_a_donorless_joiner_waits_for_the_replicas_heard():
    """The Coordinator restarts while a and b are inside a step far longer than REBUILD_S:
    their heartbeats come (answered "unknown"), their rejoins only once the step is
    applied. A joiner that finds no donor holds epoch 0, older than the committed step 5:
    it is not accepted (nor an older checkpoint) while a and b are heard from."""
    core, clock = restarted(ttl=5.0)
    core.note_committed(5)  # the driver saw step 5 committed
    core.register("j", "j", "node-j")
    for _ in range(20):  # 20 s of step 6, far past REBUILD_S and the TTL
        clock.t += 1.0
        assert core.heartbeat("a") is False and core.heartbeat("b") is False
        core.heartbeat("j")
        assert core.donor("j") is None
        assert core.mark_ready("j", 0) is False
        assert core.resume_from(2) == 0
    assert core.rejoin("a", "a", "node-a", 6) is True  # step 6 applied: they rejoin
    assert core.rejoin("b", "b", "node-b", 6) is True
    assert core.epoch == 6 and core.donor("j")[0] in ("a", "b")
    assert core.mark_ready("j", 6) is True
    assert core.progress.rollbacks == [] and core.progress.history == []


def test_a_rejoined_replica_older_than_the_committed_step_waits_then_its_fall_back_is_counted():
    """a rejoins a restarted Coordinator holding step 4 while step 5 is known committed:
    it is not ready while b, still heard from, may hold step 5 (and is not told to resync:
    it holds the newest state there is); once b is silent for hold_s, a's step 4 is the
    swarm's again, a counted rollback."""
    core, clock = restarted(target=4, ttl=5.0)
    core.note_committed(5)
    clock.t += 1.0
    assert core.heartbeat("b") is False  # b is up but has not rejoined yet
    assert core.rejoin("a", "a", "node-a", 4) is False
    assert core.epoch == 4 and "a" not in core.progress.ready
    for _ in range(int(core.progress.hold_s) + 1):  # b died without rejoining
        reply = core.report(ProgressReport("a", 4, 1, 1.0, None))
        assert not reply.resync and reply.plan is None  # a waits, holding its state
        assert "a" not in core.progress.ready
        clock.t += 1.0
    reply = core.report(ProgressReport("a", 4, 4, 1.0, None))  # b silent for hold_s: gone
    assert "a" in core.progress.ready and reply.plan is not None and reply.plan.epoch == 5
    assert core.progress.rollbacks == [(5, 4)] and core.stats()["rollbacks"] == 1


# -- a holder that comes back after its peers fell back holds a stale state ----------------


def fell_back(ttl: float = 5.0):
    """p1, p2, p3 reach epoch 10 (branch 0); p3 is cut off (it expires), then p1's and p2's
    nodes die; after hold_s p4, holding a checkpoint's step 7, is accepted (rollback 10 ->
    7, branch 1 from step 7) and p5 copies it; p4 and p5 train on to epoch 9."""
    clock = Clock()
    core = CoordinatorCore(MembershipConfig(peer_ttl_s=ttl), clock=clock, target_batch_size=2)
    core.progress.grace_s = 0.0
    pushed = []
    core.push_plan = lambda plan, views: pushed.append(plan)
    old = ("p1", "p2", "p3")
    for p in old:
        core.register(p, p, f"node-{p}")
        assert core.mark_ready(p, 0)
    for epoch in range(10):
        for p in old:
            core.report(ProgressReport(p, epoch, 1, 1.0, None, branch=0))
    for p in old:
        core.report(ProgressReport(p, 10, 0, None, None, branch=0))
    assert core.epoch == 10 and pushed[-1].branch == 0
    clock.t += ttl + 1.0  # p3's link is cut: it expires while p1 and p2 go on
    core.heartbeat("p1")
    core.heartbeat("p2")
    assert core.peer_view()["members"] == ("p1", "p2")
    clock.t += core.progress.hold_s + 1.0  # then p1's and p2's nodes die
    core.register("p4", "p4", "node-p4")
    assert core.mark_ready("p4", 7) is True
    assert core.epoch == 7 and core.progress.rollbacks == [(10, 7)]
    core.register("p5", "p5", "node-p5")
    assert core.donor("p5") == ("p4", "p4") and core.mark_ready("p5", 7)
    for epoch in (7, 8):  # (step 7 is the checkpoint's, of branch 0; 8 and 9 are branch 1's)
        for p in ("p4", "p5"):
            core.report(ProgressReport(p, epoch, 1, 1.0, None, branch=0 if epoch == 7 else 1))
    for p in ("p4", "p5"):
        core.report(ProgressReport(p, 9, 0, None, None, branch=1))
    assert core.epoch == 9 and pushed[-1].branch == 1
    return core, clock, pushed


def test_a_holder_that_returns_after_its_peers_fell_back_is_stale_and_resyncs():
    core, clock, pushed = fell_back()
    assert core.report(ProgressReport("p3", 10, 3, 1.0, None, branch=0)).unknown
    assert core.rejoin("p3", "p3", "node-p3", 10, branch=0) is False
    assert core.epoch == 9 and "p3" not in core.progress.ready  # steps 8 and 9 stay
    assert core.report(ProgressReport("p3", 10, 3, 1.0, None, branch=0)).resync
    assert core.epoch == 9
    assert core.progress.stale_returns == [("p3", 10, 0)]  # counted once, named
    stats = core.stats()
    assert stats["stale_returns"] == 1 and stats["rollbacks"] == 1 and stats["committed"] == 9
    assert core.donor("p3")[0] in ("p4", "p5") and core.mark_ready("p3", 9) is True
    plan = core.report(ProgressReport("p4", 9, 4, 1.0, None, branch=1)).plan
    assert plan is not None and plan.epoch == 10 and plan.branch == 1
    assert "p3" in whole(core, plan).participants


def test_a_stale_holder_at_the_swarm_s_own_epoch_is_not_ready_either():
    """p3 was partitioned at epoch 9 of the old branch: the same epoch number as the
    swarm's, other parameters."""
    core, clock, pushed = fell_back()
    assert core.rejoin("p3", "p3", "node-p3", 9, branch=0) is False
    assert "p3" not in core.progress.ready and core.progress.stale_returns == [("p3", 9, 0)]
    # a holder of the swarm's own branch (or one that predates every fall back) is not stale
    assert core.rejoin("p4", "p4", "node-p4", 9, branch=1) is True
    core.register("p6", "p6", "node-p6")
    assert core.rejoin("p6", "p6", "node-p6", 7, branch=0) is False  # behind: resyncs
    assert core.progress.stale_returns == [("p3", 9, 0)]
