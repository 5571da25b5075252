"""The Coordinator's work per call does not grow with the swarm (pure: an injected clock,
``MemoryKV``, no Ray): a report reads no member list while a full batch waits, the
eligible peers' counts kept as they change agree with counting them over the members,
a call that changes nothing encodes and writes nothing, joins cost one write of the
members record per ``flush_s``, and a donor is found without a pass over the members (and
a burst of joiners spreads over the donors)."""

from __future__ import annotations

import random

import pytest

from moshray.cluster.coordinator import durable
from moshray.cluster.coordinator.core import CoordinatorCore
from moshray.cluster.coordinator.donors import PeerPool, spread_pick
from moshray.cluster.coordinator.durable import FLUSH_S, DurableState, MemoryKV
from moshray.cluster.coordinator.eligible import AtEpoch, EligibleTally
from moshray.cluster.coordinator.membership import Membership, MembershipConfig
from moshray.cluster.coordinator.progress import ProgressReport
from moshray.cluster.coordinator.shard_ledger import ShardService
from moshray.cluster.coordinator.step_samples import StepSamples
from moshray.cluster.messages import PeerInfo


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def swarm(n: int, target: int, store: DurableState | None = None):
    clock = Clock()
    core = CoordinatorCore(MembershipConfig(peer_ttl_s=30.0), clock=clock,
                           target_batch_size=target, store=store)
    for i in range(n):
        p = f"p{i:04d}"
        core.register(p, p, f"n-{p}")
        assert core.mark_ready(p, 0)
    return core, clock


def test_the_tally_counts_eligible_peers_per_epoch_and_a_watched_set_apart():
    t = EligibleTally()
    t.update("a", True, (3, 10, 2))
    t.update("b", True, (3, 5, 1))
    t.update("c", True, None)  # eligible, no report yet
    t.update("d", False, (3, 99, 9))  # not eligible: not counted
    assert t.count == 3 and t.at(3) == AtEpoch(2, 15, 3, 0)
    t.watch({"a", "d"})
    assert t.at(3).watched == 1
    t.update("a", True, (4, 0, 0))  # a moved on
    assert t.at(3) == AtEpoch(1, 5, 1, 0) and t.at(4) == AtEpoch(1, 0, 0, 1)
    t.update("b", False, (3, 5, 1))  # b is no longer eligible
    assert t.at(3) == AtEpoch() and t.count == 2 and not t.is_eligible("b")


def test_a_report_reads_no_member_list_while_a_full_batch_waits(monkeypatch):
    """A ready participant still applying the last step holds a full batch back for the
    grace: each report meanwhile costs O(1), not a pass over the members."""
    core, clock = swarm(200, target=200 * 4)
    for p in core.membership.members():
        core.report(ProgressReport(p, 0, 4))
    assert core.epoch == 1  # the first plan, over everyone
    reads = []
    for name in ("live", "present", "heard"):
        original = getattr(Membership, name)
        monkeypatch.setattr(Membership, name, lambda self, *a, _o=original, _n=name, **k:
                            reads.append(_n) or _o(self, *a, **k))
    slow = "p0199"  # still applying step 1
    for p in core.membership.members():
        if p != slow:
            assert core.report(ProgressReport(p, 1, 4)).plan is None
    for p in core.membership.members():  # the batch is full: everyone waits for the slow one
        if p != slow:
            assert core.report(ProgressReport(p, 1, 8)).plan is None
    assert reads == [] and core.epoch == 1
    clock.t += core.progress.grace_s + 0.1  # the grace is over: the plan is made, once
    core.report(ProgressReport("p0000", 1, 8))
    assert core.epoch == 2 and reads  # (the plan reads the live members)
    assert slow not in core.progress.plan.participants


def oracle(core, now):
    """``(eligible, AtEpoch at the current epoch, finishing)`` counted over the members."""
    p, m = core.progress, core.membership
    live = {i.peer_id for i in m.live(now)}
    eligible = [x for x in p.ready if x in live]
    cur = [p.reports[x] for x in eligible if x in p.reports and p.reports[x].epoch == p.epoch]
    plan = p.plan
    finishing = plan is not None and any(
        x in p.reports and p.reports[x].epoch == plan.epoch - 1 and x in plan.participants
        for x in eligible)
    return len(eligible), (len(cur), sum(r.samples for r in cur),
                           sum(r.micro for r in cur)), finishing


@pytest.mark.parametrize("seed", range(4))
def test_the_counts_kept_as_they_change_agree_with_counting_over_the_members(seed):
    rng = random.Random(seed)
    core, clock = swarm(30, target=10**6)
    peers = list(core.membership.members())
    serial = 30
    for _ in range(600):
        clock.t += 0.05
        op = rng.random()
        p = rng.choice(peers)
        if op < 0.5:
            epoch = core.epoch - (rng.random() < 0.2)
            core.report(ProgressReport(p, epoch, rng.randint(0, 9), micro=rng.randint(0, 2)))
        elif op < 0.6:
            core.progress.ready.discard(p)
        elif op < 0.7:
            core.mark_ready(p, core.epoch)
        elif op < 0.75:
            core.mark_draining(f"n-{p}", 30.0)
        elif op < 0.8:
            core.leave(p)
            peers.remove(p)
        elif op < 0.85:
            new = f"q{serial:04d}"
            serial += 1
            core.register(new, new, f"n-{new}")
            peers.append(new)
        elif op < 0.9:
            core.plan_round()
            core.progress.plan = core.membership.plan(clock()) or core.progress.plan
        else:
            clock.t += rng.choice((0.0, 31.0))  # some go silent past the TTL
            for q in rng.sample(peers, k=len(peers) // 2):
                core.heartbeat(q)
            # before they expire, the counts are taken over the members (the slow path)
            eligible, at, finishing = core.progress._standing(clock())
            assert (eligible, (at.peers, at.samples, at.micro), finishing) == \
                oracle(core, clock())
            core.steps.expire(clock())
        now = clock()
        eligible, at, finishing = core.progress._standing(now)
        assert (eligible, (at.peers, at.samples, at.micro), finishing) == oracle(core, now)
        held = core.progress._held  # the donors' pools follow what each peer was seen holding
        for e in {e for e, _ in held.values()} | {core.epoch}:
            assert set(core.progress.holders(e)) == {q for q, (x, _) in held.items() if x == e}


def test_a_call_that_changes_nothing_encodes_and_writes_nothing(monkeypatch):
    kv = MemoryKV()
    core, clock = swarm(50, target=10**6, store=DurableState(kv, "job/1"))
    core.save()
    clock.t += 5 * FLUSH_S
    core.save()
    core.report(ProgressReport("p0001", 0, 1))
    core.save()  # settles what the report changed (the lazy records come due)
    dumps = []
    monkeypatch.setattr(durable, "_dump", lambda obj: dumps.append(obj) or b"")
    puts = kv.puts
    for _ in range(20):
        core.heartbeat("p0002")
        assert core.save() == 0
    assert dumps == [] and kv.puts == puts


def test_joins_cost_one_write_of_the_members_record_per_flush():
    kv = MemoryKV()
    core, clock = swarm(10, target=10**6, store=DurableState(kv, "job/1"))
    core.save()
    puts = kv.puts
    for i in range(40):  # 40 joins within one flush_s: not one write each
        clock.t += FLUSH_S / 50
        core.register(f"j{i:02d}", None, f"n-j{i}")
        core.save()
    assert kv.puts - puts <= 1
    clock.t += FLUSH_S
    core.save()  # due: the members written behind
    again = CoordinatorCore(MembershipConfig(), clock=clock,
                            store=DurableState(kv, "job/1"))
    assert {f"j{i:02d}" for i in range(40)} <= set(again.progress.awaited)


def test_draining_a_node_reads_only_its_peers_and_follows_a_peer_that_moved():
    m = Membership(MembershipConfig())
    m.register(PeerInfo("a", None, node_id="n1"), 0.0)
    m.register(PeerInfo("b", None, node_id="n1"), 0.0)
    m.register(PeerInfo("b", None, node_id="n2"), 0.0)  # b re-registered on another node
    assert m.mark_draining("n1", 9.0) == ("a",)
    assert m.mark_draining("n2", 9.0) == ("b",)
    m.leave("b")
    assert m.mark_draining("n2", 9.0) == () and m.members() == ("a",)


def test_step_samples_kept_totals_equal_the_sum_over_the_participants():
    rng = random.Random(1)
    s = StepSamples()
    planned = {f"p{i}": rng.randint(0, 20) for i in range(30)}
    s.planned(5, planned)
    best = dict(planned)
    for _ in range(200):
        p, n = rng.choice(list(planned)), rng.randint(0, 40)
        total = s.contributed(5, p, n)
        best[p] = max(best[p], n)  # the plan's count or the largest told: never less
        assert total == sum(best.values()) == s.total(5)


def test_the_shards_record_is_built_again_only_after_the_ledger_changed():
    shards = ShardService()
    first = shards.snapshot()
    assert shards.snapshot() is first  # saved after every call: no rebuild, no encoding
    shards.grant("p", 2, 0, 0.0, member=True)
    granted = shards.snapshot()
    assert granted is not first and granted == {"next": 2}
    shards.position(1)  # below the position: nothing changes
    assert shards.snapshot() is granted
    shards.position(5)
    assert shards.snapshot() == {"next": 5}


def test_a_burst_of_joiners_copies_from_different_donors_read_in_o1(monkeypatch):
    core, clock = swarm(64, target=64 * 4)
    for p in core.membership.members():
        core.report(ProgressReport(p, 0, 4))
    assert core.epoch == 1  # right after a plan: nobody holds epoch 1 yet
    reads = []
    for name in ("live", "present", "heard", "members"):
        original = getattr(Membership, name)
        monkeypatch.setattr(Membership, name, lambda self, *a, _o=original, _n=name, **k:
                            reads.append(_n) or _o(self, *a, **k))
    donors = []
    for i in range(16):
        joiner = f"j{i:02d}"
        core.register(joiner, joiner, f"n-{joiner}")
        donors.append(core.donor(joiner)[0])
    assert reads == []  # no pass over the members
    assert len(set(donors)) >= 8 and not set(donors) & {f"j{i:02d}" for i in range(16)}
    for p in list(core.membership.members())[:32]:  # half the swarm applied step 1
        if p.startswith("p"):
            core.report(ProgressReport(p, 1, 0))
    holders = set(core.progress.holders(1))
    picked = [core.donor(f"j{i:02d}")[0] for i in range(16)]
    assert set(picked) <= holders and len(set(picked)) >= 8  # holders of the epoch first


def test_the_peer_pool_is_a_set_with_o1_picks():
    rng = random.Random(0)
    pool, mirror = PeerPool(), set()
    for _ in range(2000):
        p = f"p{rng.randrange(50)}"
        if rng.random() < 0.5:
            pool.add(p)
            mirror.add(p)
        else:
            pool.discard(p)
            mirror.discard(p)
        assert len(pool) == len(mirror) and set(pool) == mirror
        assert {pool[i] for i in range(len(pool))} == mirror
    assert spread_pick(pool, "k", lambda q: False) is None
    assert spread_pick(PeerPool(), "k", lambda q: True) is None
    only = sorted(mirror)[0]
    assert spread_pick(pool, "any key", lambda q: q == only) == only  # reads on, wrapping


def test_the_steps_record_is_built_again_only_after_it_changed():
    core, clock = swarm(4, target=10**6)
    first = core.steps.snapshot()
    core.report(ProgressReport("p0001", 0, 1))
    assert core.steps.snapshot() is first  # a report changes nothing in it: no rebuild
    core.mark_draining("n-p0002", 30.0)
    drained = core.steps.snapshot()
    assert drained is not first and drained["draining_nodes"][0][0] == "n-p0002"
    core.request_stop()
    assert core.steps.snapshot()["stop"] is True
