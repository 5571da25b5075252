"""A notice plans the next step at once, ahead of the step in flight or of the staying
peers' first samples, and every rule of progress.py still holds (pure, no Ray)."""

from __future__ import annotations

import pytest

from moshray.cluster.progress import ProgressReport
from test_progress import report, swarm


def in_flight(peers=("a", "b", "c"), target=30):
    """Step 1 planned over ``peers`` (10 samples each), nobody has applied it yet."""
    core, clock, pushed = swarm(peers, target=target)
    for p in peers:
        report(core, p, 0, 10)
    assert core.epoch == 1 and len(pushed) == 1
    return core, clock, pushed


def test_a_notice_right_after_a_step_plans_before_the_first_samples():
    """The step before was applied by everyone, nobody has a sample yet (the bench's case:
    the plan waited for a report with samples, two micro-batches)."""
    core, clock, pushed = in_flight()
    for p in ("a", "b", "c"):
        report(core, p, 1, 0)  # everyone applied step 1
    clock.t += 0.5
    assert core.note_notice("node-c", deadline_s=30.0) == ("c",)
    assert [(p.epoch, p.participants) for p in pushed[1:]] == [(2, ("a", "b"))]
    assert core.notice_stats()["node-c"]["rebalance_s"] == 0.0
    assert report(core, "c", 1, 16).stop  # the noticed peer stops
    assert report(core, "a", 1, 16).plan is pushed[1]


def test_the_noticed_peer_finishes_the_step_in_flight_and_is_in_no_plan_after():
    core, clock, pushed = in_flight()
    core.note_notice("node-c", deadline_s=30.0)
    ahead = pushed[1]
    assert (ahead.epoch, ahead.participants) == (2, ("a", "b"))
    for p in ("a", "b", "c"):  # still applying step 1: finishing, not behind
        reply = report(core, p, 0, 12)
        assert reply.plan is pushed[0] and not reply.resync and not reply.stop
    assert report(core, "c", 1, 0).stop  # applied step 1, then leaves
    assert report(core, "a", 1, 0).plan is ahead
    assert not report(core, "b", 0, 13).resync  # b is slower: still step 1
    assert report(core, "b", 1, 0).plan is ahead
    for p in ("a", "b"):
        report(core, p, 2, 0)
    assert core.progress.rollbacks == [] and core.progress.abandoned == []
    assert [t[3] for t in core.step_timings()["steps"]] == [("a", "b", "c"), ("a", "b")]
    assert all(t[2] is not None for t in core.step_timings()["steps"])  # both committed


def test_the_record_of_a_plan_made_ahead_counts_the_samples_it_was_taken_with():
    core, clock, pushed = in_flight()
    core.note_notice("node-c", deadline_s=30.0)
    assert core.progress.history[-1].samples == 0  # nobody holds step 1 yet
    core.report(ProgressReport("a", 1, 16, 2.0, None))
    core.report(ProgressReport("b", 1, 16, 4.0, None))
    core.report(ProgressReport("a", 1, 32, 3.0, None))  # a's newest report counts
    assert core.report(ProgressReport("c", 1, 16, 9.0, None)).stop  # c's samples do not
    record = core.progress.history[-1]
    assert (record.epoch, record.samples, record.peers) == (2, 48, 2)
    assert record.loss == pytest.approx((3.0 * 32 + 4.0 * 16) / 48)


def test_a_second_notice_waits_for_the_step_in_flight_then_plans_ahead_of_the_next():
    core, clock, pushed = in_flight(("a", "b", "c", "d"), target=40)
    core.note_notice("node-d", deadline_s=30.0)
    assert pushed[1].participants == ("a", "b", "c")
    core.note_notice("node-c", deadline_s=30.0)  # c is in step 2: only one plan ahead
    assert len(pushed) == 2 and core.notice_stats()["node-c"]["rebalance_s"] is None
    for p in ("a", "b", "c"):
        report(core, p, 1, 0)
    assert len(pushed) == 2  # d has not applied step 1 yet
    clock.t += 0.7
    assert report(core, "d", 1, 0).stop  # step 1 applied by all: plan 3 ahead of step 2
    assert [(p.epoch, p.participants) for p in pushed[2:]] == [(3, ("a", "b"))]
    assert core.notice_stats()["node-c"]["rebalance_s"] == pytest.approx(0.7)
    assert report(core, "c", 1, 5).plan is pushed[1]  # c finishes step 2 ...
    assert report(core, "c", 2, 0).stop  # ... then leaves
    assert report(core, "a", 2, 0).plan is pushed[2]


def test_no_older_state_is_accepted_while_a_peer_of_the_step_in_flight_lives():
    """Every staying peer died inside step 1: the noticed one may still apply it, so a
    joiner's state of epoch 0 waits; once it is gone too, the two plans are abandoned."""
    core, clock, pushed = in_flight()
    core.note_notice("node-c", deadline_s=30.0)
    core.leave("a")
    core.leave("b")
    core.register("j", "j", "node-j")
    assert core.mark_ready("j", 0) is False  # c takes part in step 1 and is up
    core.leave("c")
    assert core.mark_ready("j", 0) is True
    assert core.epoch == 0 and core.progress.abandoned == [(2, 0)]
    assert core.progress.rollbacks == [] and core.progress.ahead.prior is None


def test_a_joiner_holding_the_step_in_flight_waits_for_the_plan_made_ahead():
    core, clock, pushed = in_flight(("a", "b", "c"))
    core.note_notice("node-c", deadline_s=30.0)
    report(core, "a", 1, 0)  # a applied step 1; j copies it
    core.register("j", "j", "node-j")
    assert core.donor("j") == ("a", "a")
    assert core.mark_ready("j", 1) is False  # step 2 (without j) is in flight
    report(core, "a", 2, 0)
    assert core.mark_ready("j", 2) is True and core.progress.rollbacks == []


def test_a_joiner_ready_at_the_step_in_flight_takes_part_in_the_plan_made_ahead():
    core, clock, pushed = in_flight(("a", "b", "c"))
    report(core, "a", 1, 0)  # a applied step 1 ...
    core.register("j", "j", "node-j")
    assert core.mark_ready("j", 1) is True  # ... and j copied it
    core.note_notice("node-c", deadline_s=30.0)
    assert pushed[1].participants == ("a", "b", "j")


def test_a_peer_behind_every_published_plan_is_still_told_to_resync():
    core, clock, pushed = in_flight(("a", "b", "c"))
    core.note_notice("node-c", deadline_s=30.0)
    assert report(core, "b", -1, 3).resync  # not at the epoch before any plan it is in


def test_a_stop_lets_the_participants_finish_both_published_steps():
    core, clock, pushed = in_flight(("a", "b", "c"))
    core.note_notice("node-c", deadline_s=30.0)
    core.request_stop()
    assert report(core, "a", 0, 12).plan is pushed[0]
    assert report(core, "a", 1, 0).plan is pushed[1]
    assert report(core, "c", 1, 0).stop
    assert report(core, "a", 2, 0).stop


def test_a_restart_forgets_the_plans_and_adopts_the_newest_step_held():
    core, clock, pushed = in_flight(("a", "b", "c"))
    core.note_notice("node-c", deadline_s=30.0)
    report(core, "a", 1, 0)
    core.progress.rejoin("a", 3, clock.t)  # (as after a restart: a newer step was made)
    assert core.epoch == 3 and core.progress.plan is None
    assert core.progress.ahead.prior is None and core.progress.ahead.epoch is None


def test_without_a_plan_of_the_current_epoch_the_notice_waits_for_samples():
    core, clock, pushed = swarm(("a", "b", "c"), target=100)  # a fresh swarm
    core.note_notice("node-c", deadline_s=30.0)
    assert pushed == []
    clock.t += 1.0
    report(core, "a", 0, 16)
    assert [(p.epoch, p.participants) for p in pushed] == [(1, ("a", "b"))]
    assert core.progress.history[-1].samples == 16
    assert core.notice_stats()["node-c"]["rebalance_s"] == 1.0


def test_a_lost_peer_still_waits_for_the_step_in_flight():
    core, clock, pushed = in_flight(("a", "b", "c"))
    core.leave("c")
    assert len(pushed) == 1  # only a notice plans ahead


# -- the replica's side: it keeps a plan made ahead until it applied the step before --------


def _plans(*epochs):
    from moshray.cluster.membership import Membership
    from moshray.cluster.messages import PeerInfo

    members = Membership()
    members.register(PeerInfo("a", "a", "node-a"), 0.0)
    out = {}
    for e in epochs:
        members.epoch = e - 1
        out[e] = members.plan(0.0)
    return out


def _replica():
    import torch

    from moshray.actors.replica_state import TrainState
    from moshray.actors.step_manager import StepManager

    manager = StepManager("a", None, None, "node-a", 5.0)
    model = torch.nn.Linear(2, 1)
    manager.state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), None,
                               None, {})
    return manager


def test_a_replica_runs_a_plan_made_ahead_right_after_the_step_before():
    plans = _plans(1, 2, 3)
    m = _replica()
    m.receive_plan(plans[2])  # ahead of step 1, which it has not even taken yet
    assert m._plan is None and m._ahead is plans[2]
    m.receive_plan(plans[3])  # not the next step nor the one after: ignored
    assert m._ahead is plans[2]
    m.receive_plan(plans[1])
    plan, m._plan = m._plan, None  # taken at a micro-batch, then applied
    assert plan is plans[1]
    m._commit(plan)
    assert m._plan is plans[2] and m._ahead is None and m.state.epoch == 1
    m._commit(m._plan)
    assert m.state.lineage.gaps == 0 and m.state.lineage.repeats == 0


def test_a_replica_that_reloads_its_state_drops_the_plan_made_ahead():
    import asyncio

    m = _replica()
    m.receive_plan(_plans(2)[2])
    snapshot = m.state.snapshot()
    asyncio.run(m._load(snapshot, from_donor=True))
    assert m._ahead is None
