"""Collaborative steps take every ready peer: a short grace for peers finishing the last
step, plans pushed the moment they exist, and a notice that re-plans at once (pure)."""

from __future__ import annotations

from moshray.cluster.coordinator import CoordinatorCore
from moshray.cluster.membership import MembershipConfig
from moshray.cluster.progress import ProgressReport


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
    core.push_plan = pushed.append
    for i, p in enumerate(peers):
        core.register(p, handle=p, node_id=f"node-{p}")
        assert core.mark_ready(p, 0)
    return core, clock, pushed


def report(core, peer, epoch, samples):
    return core.report(ProgressReport(peer, epoch, samples, 1.0, None))


def test_every_ready_peer_at_the_epoch_takes_the_step_even_with_zero_samples():
    core, clock, pushed = swarm()
    report(core, "c", 0, 0)  # c has nothing yet: it still takes part, weight 0
    report(core, "a", 0, 12)
    reply = report(core, "b", 0, 12)
    assert reply.plan is not None and reply.plan.participants == ("a", "b", "c")
    assert pushed == [reply.plan]  # pushed to the participants the moment it exists


def test_a_peer_finishing_the_last_step_gets_a_grace_not_a_resync():
    core, clock, pushed = swarm(("a", "b"))
    report(core, "a", 0, 12)
    plan1 = report(core, "b", 0, 12).plan
    assert plan1.participants == ("a", "b")
    report(core, "a", 1, 0)  # a applied step 1 at once; b is still applying it
    assert report(core, "a", 1, 24).plan is None  # full, but b is finishing: grace
    clock.t += 0.2
    reply = report(core, "b", 1, 0)  # b arrives within the grace
    assert not reply.resync
    plan2 = report(core, "a", 1, 30).plan
    assert plan2 is not None and plan2.participants == ("a", "b")


def test_the_grace_is_bounded():
    core, clock, pushed = swarm(("a", "b"))
    report(core, "a", 0, 12)
    report(core, "b", 0, 12)
    report(core, "a", 1, 24)  # b never shows up at epoch 1
    clock.t += 0.6
    plan2 = report(core, "a", 1, 28).plan
    assert plan2 is not None and plan2.participants == ("a",)


def test_a_notice_replans_at_once_without_the_node():
    core, clock, pushed = swarm(("a", "b", "c"), target=1000)
    for p in ("a", "b", "c"):
        report(core, p, 0, 10)
    assert core.note_notice("node-c", deadline_s=30.0) == ("c",)
    assert len(pushed) == 1 and pushed[0].participants == ("a", "b")
    assert core.notice_stats()["node-c"]["rebalance_s"] == 0.0


def test_a_notice_during_a_step_waits_for_it():
    core, clock, pushed = swarm(("a", "b"), target=20)
    report(core, "a", 0, 10)
    report(core, "b", 0, 10)  # step 1 planned over a and b, in flight
    assert len(pushed) == 1
    core.note_notice("node-b", deadline_s=30.0)
    assert len(pushed) == 1  # no second plan while step 1 runs
    assert core.notice_stats()["node-b"]["rebalance_s"] is None


def test_a_one_to_one_digest_split_resolves_to_the_smallest_peer():
    core, clock, pushed = swarm(("a", "b"), target=1000)
    core.report(ProgressReport("a", 0, 4, 1.0, "digest-a"))
    core.report(ProgressReport("b", 0, 4, 1.0, "digest-b"))
    assert core.report(ProgressReport("b", 0, 5, 1.0, "digest-b")).resync
    assert not core.report(ProgressReport("a", 0, 5, 1.0, "digest-a")).resync


def test_a_peer_others_keep_rejecting_is_quarantined_and_must_resync():
    core, clock, pushed = swarm(("a", "b", "c"), target=1000)
    core.progress.quarantine.threshold = 3
    for epoch, reporter in ((1, "a"), (1, "b"), (1, "a")):  # a's second one counts once
        core.report(ProgressReport(reporter, 0, 1, 1.0, None, 0, (("c", "non_finite", epoch),)))
    assert "c" in core.progress.ready
    core.report(ProgressReport("b", 0, 1, 1.0, None, 0, (("c", "late", 2),)))  # not c's fault
    assert "c" in core.progress.ready
    core.report(ProgressReport("a", 0, 1, 1.0, None, 0, (("c", "shape_mismatch", 2),)))
    assert "c" not in core.progress.ready
    assert core.stats()["quarantines"] == [("c", "shape_mismatch")]
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
