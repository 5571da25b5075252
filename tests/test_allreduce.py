"""Moshpit All-Reduce on a real multi-node Ray cluster on 127.0.0.1.

Peers are AveragingPeer actors spread over the spot nodes; plans come from the real
Membership / Coordinator. Failures are real: a peer process that exits, a raylet removed.
Every peer signs and checks with one job key (``collective/auth.py``), as replicas do; an
outsider with another key is rejected as unauthenticated.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import ray

import moshray.cluster.coordinator.actor as coordinator_mod
from moshray.cluster.collective.auth import new_job_key
from moshray.cluster.collective.averager import CONTRIBUTION_FRACTION
from moshray.cluster.collective.codecs import max_abs_error_bound
from moshray.cluster.coordinator.membership import Membership, MembershipConfig
from moshray.cluster.messages import PeerInfo, RejectReason
from moshray.cluster.collective.peer import AveragingPeer

pytestmark = pytest.mark.cluster

TIMEOUT = 15.0
MARGIN = 4.0  # re-reduction and scheduling slack on a loaded 2-core machine
JOB_KEY = new_job_key()  # every peer's, unless a test gives one another


def spawn(n: int, prefix: str, slots=None, job_key: bytes = JOB_KEY):
    """n fresh peers round-robin over the given node slots, signing with ``job_key``."""
    slots = slots or [0, 1, 2, 3]
    peers = {}
    for i in range(n):
        slot = slots[i % len(slots)]
        peers[f"{prefix}{i}"] = AveragingPeer.options(
            num_cpus=0, resources={f"slot-{slot}": 0.01}
        ).remote(f"{prefix}{i}", job_key)
    ray.get([p.node_id.remote() for p in peers.values()], timeout=120)
    return peers


def make_plan(peers: dict, max_group: int = 16, compression: str = "none", epoch: int = 0):
    membership = Membership(MembershipConfig(max_group=max_group, compression=compression))
    membership.epoch = epoch
    for pid, handle in peers.items():
        membership.register(PeerInfo(pid, handle), now=0.0)
    return membership.plan(now=0.0)


def run(peers, plan, arrays, weights, faults=None, timeout=TIMEOUT):
    faults = faults or {}
    refs = {
        pid: h.all_reduce.remote([arrays[pid]], weights[pid], plan, timeout, faults.get(pid))
        for pid, h in peers.items()
    }
    return refs


def weighted(arrays, weights, who):
    total = sum(weights[p] for p in who)
    return sum(arrays[p].astype(np.float64) * weights[p] for p in who) / total


def kill_all(peers):
    for h in peers.values():
        ray.kill(h, no_restart=True)


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster


POOL_SIZE = 16  # a 4 x 4 grid of real peers (the multi-round grid from 9 peers on)
_epochs = itertools.count(100, 10)  # every round on the pool gets a fresh, higher epoch


@pytest.fixture(scope="module")
def pool(cluster):
    """Peers shared by the fault-free tests (a peer process costs ~2 s to start on a loaded
    2-core machine): each test averages over the first n in a round of its own epoch. Tests
    that kill or stall peers spawn their own; the one whose peers send bad contributions
    (a fault changes only what a peer sends) uses the pool last."""
    peers = spawn(POOL_SIZE, "p")
    yield peers
    kill_all(peers)


def take(pool: dict, n: int) -> dict:
    return dict(list(pool.items())[:n])


@pytest.mark.parametrize(
    "n,max_group",
    [(1, 16), (2, 16), (5, 16), (4, 2), (6, 4), (8, 2), (9, 3), (11, 4), (16, 4),
     (16, 8)],
)
def test_exact_weighted_average(pool, n, max_group):
    peers = take(pool, n)
    rng = np.random.default_rng(n * 100 + max_group)
    arrays = {p: rng.normal(size=5000).astype(np.float32) for p in peers}
    weights = {p: float(rng.uniform(0.5, 4.0)) for p in peers}
    plan = make_plan(peers, max_group, epoch=next(_epochs))
    if n > max_group:
        assert len(plan.grid.rounds) >= 2
    results = ray.get(list(run(peers, plan, arrays, weights).values()), timeout=60)
    expected = weighted(arrays, weights, peers)
    for (out, report), pid in zip(results, peers):
        np.testing.assert_allclose(out[0], expected, rtol=1e-5, atol=1e-5)
        assert report.rejections == () and report.failed_owners == ()
        assert report.total_weight == pytest.approx(sum(weights.values()), rel=1e-6)
    # Every participant holds bitwise identical values, also across the groups of a
    # multi-round grid (each group adds its members' values in grid-coordinate order).
    first = results[0][0][0]
    assert all(np.array_equal(first, out[0]) for out, _ in results)


def test_load_balanced_shares_change_part_sizes(pool):
    peers = take(pool, 3)
    plan = make_plan(peers, epoch=next(_epochs))
    shares = {p: s for p, s in zip(peers, (1.0, 2.0, 5.0))}
    plan = type(plan)(plan.epoch, plan.grid, tuple(shares.items()), plan.handles)
    arrays = {p: np.full(8000, float(i), np.float32) for i, p in enumerate(peers)}
    weights = {p: 1.0 for p in peers}
    results = dict(zip(peers, ray.get(list(run(peers, plan, arrays, weights).values()),
                                      timeout=60)))
    expected = weighted(arrays, weights, peers)
    for out, report in results.values():
        np.testing.assert_allclose(out[0], expected, rtol=1e-6)
    # The 5x peer reduced 5/8 of the vector: it received the most bytes.
    received = [results[p][1].bytes_received for p in peers]
    assert received[2] > received[1] > received[0]


@pytest.mark.parametrize("codec", ["fp16", "uint8", "blockwise8"])
def test_compression_error_within_documented_bound(pool, codec):
    peers = take(pool, 4)
    rng = np.random.default_rng(7)
    arrays = {p: rng.normal(size=20000).astype(np.float32) for p in peers}
    weights = {p: 1.0 for p in peers}
    plan = make_plan(peers, compression=codec, epoch=next(_epochs))
    results = ray.get(list(run(peers, plan, arrays, weights).values()), timeout=60)
    expected = weighted(arrays, weights, peers)
    # Two encodings per value: contributions (bound over inputs) and the result.
    bound = max(max_abs_error_bound(a, codec) for a in arrays.values())
    bound += max_abs_error_bound(expected.astype(np.float32), codec)
    first = results[0][0][0]
    for out, _ in results:
        assert np.abs(out[0] - expected).max() <= bound
        assert np.array_equal(out[0], first)  # all peers hold the same decoded values


@pytest.mark.parametrize("fault", ["die", "die_mid_round"])
def test_peer_killed_mid_round(cluster, fault):
    peers = spawn(4, "kill-")
    try:
        rng = np.random.default_rng(1)
        arrays = {p: rng.normal(size=40000).astype(np.float32) for p in peers}
        weights = {p: float(i + 1) for i, p in enumerate(peers)}
        plan = make_plan(peers)
        t0 = time.monotonic()
        refs = run(peers, plan, arrays, weights, faults={"kill-3": fault})
        survivors = ["kill-0", "kill-1", "kill-2"]
        results = dict(zip(survivors, ray.get([refs[p] for p in survivors], timeout=60)))
        elapsed = time.monotonic() - t0
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(refs["kill-3"], timeout=30)
        expected = weighted(arrays, weights, survivors)
        for pid, (out, report) in results.items():
            np.testing.assert_allclose(out[0], expected, rtol=1e-5, atol=1e-6)
            assert report.contributors == tuple(survivors)
            assert "kill-3" in report.failed_owners
            # The dead peer is found by probing, not by waiting out the contribution deadline.
            assert report.seconds < CONTRIBUTION_FRACTION * TIMEOUT
        # Survivors hold bitwise equal values (the dead owner's part re-reduced in order).
        assert all(np.array_equal(results["kill-0"][0][0], out[0]) for out, _ in results.values())
        assert elapsed < TIMEOUT + MARGIN
    finally:
        kill_all(peers)


def test_a_small_tensors_dead_owner_is_re_reduced_from_copies_asked_for(cluster):
    """One owner (a small tensor): the other members were sent no contributions, so when
    the owner dies mid-round each survivor asks the others for their held-back copies
    (``CopyRequest`` through the real actor calls) and they re-reduce alike."""
    from moshray.cluster.collective.partition import group_part_sizes

    peers = spawn(4, "copy-")
    try:
        rng = np.random.default_rng(3)
        arrays = {p: rng.normal(size=40000).astype(np.float32) for p in peers}
        weights = {p: float(i + 1) for i, p in enumerate(peers)}
        membership = Membership(MembershipConfig(min_part=1 << 18))
        for pid, handle in peers.items():
            membership.register(PeerInfo(pid, handle), now=0.0)
        plan = membership.plan(now=0.0)
        members = plan.grid.rounds[0].group_of("copy-0")[1].members
        sizes = group_part_sizes(plan, members, 40000)
        owner = members[sizes.index(max(sizes))]
        refs = run(peers, plan, arrays, weights, faults={owner: "die_mid_round"})
        survivors = sorted(p for p in peers if p != owner)
        results = dict(zip(survivors, ray.get([refs[p] for p in survivors], timeout=60)))
        expected = weighted(arrays, weights, survivors)
        for pid, (out, report) in results.items():
            np.testing.assert_allclose(out[0], expected, rtol=1e-5, atol=1e-6)
            assert report.contributors == tuple(survivors) and owner in report.failed_owners
        assert all(np.array_equal(results[survivors[0]][0][0], out[0])
                   for out, _ in results.values())
    finally:
        kill_all(peers)


def test_node_removed_mid_round(cluster):
    slot = cluster.add_node()
    try:
        peers = spawn(3, "node-", slots=[0, 1])
        peers.update(spawn(1, "node-gone-", slots=[slot]))
        rng = np.random.default_rng(2)
        arrays = {p: rng.normal(size=40000).astype(np.float32) for p in peers}
        weights = {p: 1.0 + i for i, p in enumerate(peers)}
        plan = make_plan(peers)
        t0 = time.monotonic()
        refs = run(peers, plan, arrays, weights, faults={"node-gone-0": "stall"})
        time.sleep(1.0)  # the round is under way; the stalled peer's node goes away
        cluster.remove_node(slot, hard=True)
        slot = None
        survivors = ["node-0", "node-1", "node-2"]
        results = ray.get([refs[p] for p in survivors], timeout=60)
        elapsed = time.monotonic() - t0
        expected = weighted(arrays, weights, survivors)
        for out, report in results:
            np.testing.assert_allclose(out[0], expected, rtol=1e-5, atol=1e-6)
            assert report.contributors == tuple(survivors)
        assert elapsed < TIMEOUT + MARGIN
    finally:
        if slot is not None:
            cluster.remove_node(slot)
        kill_all(peers)


def test_bad_contributions_rejected_with_reason(pool):
    # The faults below only change what the bad peers send: the pool stays whole for the
    # group death at the end of this module, its last user.
    peers = take(pool, 8)
    names = list(peers)
    outsider = spawn(1, "outsider-", job_key=new_job_key())  # not of this job: another key
    rng = np.random.default_rng(3)
    arrays = {p: rng.normal(size=12000).astype(np.float32) for p in peers}
    weights = {p: 1.0 + i for i, p in enumerate(peers)}
    # A first clean round moves every peer to its epoch, so labels 1000 epochs older are stale.
    warm = make_plan(peers, epoch=next(_epochs))
    ray.get(list(run(peers, warm, arrays, weights).values()), timeout=60)
    plan = make_plan(peers | outsider, epoch=next(_epochs))
    arrays["outsider-0"], weights["outsider-0"] = arrays[names[0]] * 10, 1.0
    refs = run(outsider, plan, arrays, weights, timeout=8.0)
    faults = {names[2]: "nan", names[3]: "wrong_shape", names[4]: "wrong_dtype",
              names[5]: "stale_epoch", names[6]: "huge_values", names[7]: "huge_weight"}
    refs |= run(peers, plan, arrays, weights, faults=faults, timeout=8.0)
    good = names[:2]
    results = ray.get([refs[p] for p in good], timeout=60)
    ray.get([refs[p] for p in [*faults, *outsider]], timeout=60)  # the bad ones finish too
    kill_all(outsider)
    expected = weighted(arrays, weights, good)
    reasons = {}
    for out, report in results:
        np.testing.assert_allclose(out[0], expected, rtol=1e-5, atol=1e-6)
        for rej in report.rejections:
            reasons.setdefault(rej.sender, set()).add(rej.reason)
    assert RejectReason.NON_FINITE in reasons[names[2]]
    assert RejectReason.SHAPE_MISMATCH in reasons[names[3]]
    assert RejectReason.DTYPE_MISMATCH in reasons[names[4]]
    assert RejectReason.STALE_EPOCH in reasons[names[5]]
    assert RejectReason.VALUE_OUT_OF_BOUNDS in reasons[names[6]]  # 3e38: finite, poisoned
    assert RejectReason.WEIGHT_OUT_OF_BOUNDS in reasons[names[7]]  # weight 1e30
    assert reasons["outsider-0"] == {RejectReason.UNAUTHENTICATED}  # a forger's, any part
    counts = ray.get(peers[names[0]].rejection_counts.remote(), timeout=30)
    assert counts["non_finite"] >= 1 and counts["stale_epoch"] >= 1
    assert counts["value_out_of_bounds"] >= 1 and counts["weight_out_of_bounds"] >= 1
    assert counts["unauthenticated"] >= 1


def test_an_owner_with_nothing_valid_hands_on_no_junk(cluster):
    """A lone peer whose own value is NaN (no one else to average with) ends with zeros,
    never NaN: its parameters, and every joiner copying them, stay finite."""
    peers = spawn(1, "lone-")
    try:
        arrays = {"lone-0": np.ones(1000, dtype=np.float32)}
        plan = make_plan(peers, epoch=3)
        ref = run(peers, plan, arrays, {"lone-0": 1.0}, faults={"lone-0": "nan"},
                  timeout=5.0)["lone-0"]
        out, report = ray.get(ref, timeout=60)
        assert np.isfinite(out[0]).all() and not out[0].any()
        assert [r.reason for r in report.rejections] == [RejectReason.NON_FINITE]
        assert report.contributors == ()
    finally:
        kill_all(peers)


def test_coordinator_on_head_plans_without_draining_nodes(cluster):
    coord = coordinator_mod.get_or_create(MembershipConfig(max_group=2))
    head = cluster.head_node_id
    assert ray.get(coord.node_id.remote()) == head
    peers = spawn(4, "coord-")
    try:
        nodes = dict(zip(peers, ray.get([h.node_id.remote() for h in peers.values()])))
        for pid, h in peers.items():
            ray.get(coord.register.remote(pid, h, nodes[pid], 1.0))
        plan = ray.get(coord.plan_round.remote())
        assert set(plan.participants) >= set(peers)
        drained = ray.get(coord.mark_draining.remote(nodes["coord-1"], 30.0))
        assert "coord-1" in drained
        plan2 = ray.get(coord.plan_round.remote(tuple(peers)))
        assert "coord-1" not in plan2.participants and plan2.epoch == plan.epoch + 1
        arrays = {p: np.full(100, i, np.float32) for i, p in enumerate(peers)}
        weights = {p: 1.0 for p in peers}
        live = {p: h for p, h in peers.items() if p in plan2.participants}
        results = ray.get(list(run(live, plan2, arrays, weights).values()), timeout=60)
        expected = weighted(arrays, weights, list(live))
        for out, _ in results:
            np.testing.assert_allclose(out[0], expected, rtol=1e-6)
    finally:
        for pid in peers:
            ray.get(coord.leave.remote(pid))
        kill_all(peers)


def test_a_groups_death_mid_round_costs_only_that_group(pool):
    """Sixteen real peers (four per spot node) on a 4 x 4 grid: every member of one
    first-round group dies mid-round (each answers the transport for a second, then its
    process exits without contributing). That group's four contributions are lost and
    nothing else: the twelve survivors, each in a second-round group with one dead member,
    all end with the exact weighted mean of the twelve live contributions, bitwise
    identical, within two round deadlines plus slack, naming the dead as failed owners.
    The last user of the pool: it kills four of its peers."""
    peers = take(pool, 16)
    plan = make_plan(peers, max_group=4, epoch=next(_epochs))
    assert [len(g.members) for r in plan.grid.rounds for g in r.groups] == [4] * 8
    victims = set(plan.grid.rounds[0].groups[0].members)
    survivors = [p for p in peers if p not in victims]
    rng = np.random.default_rng(16)
    arrays = {p: rng.normal(size=20000).astype(np.float32) for p in peers}
    weights = {p: float(rng.uniform(0.5, 4.0)) for p in peers}
    t0 = time.monotonic()
    refs = run(peers, plan, arrays, weights, faults={v: "die_mid_round" for v in victims})
    results = dict(zip(survivors, ray.get([refs[p] for p in survivors], timeout=120)))
    elapsed = time.monotonic() - t0
    for victim in victims:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(refs[victim], timeout=30)
    expected = weighted(arrays, weights, survivors)
    for pid, (out, report) in results.items():
        np.testing.assert_allclose(out[0], expected, rtol=1e-5, atol=1e-6, err_msg=pid)
        # whom it heard from: its own groups' live members (a row, then a column)
        heard = {m for r in plan.grid.rounds for m in r.group_of(pid)[1].members}
        assert set(report.contributors) == heard - victims, pid
        assert set(report.failed_owners) <= victims and report.failed_owners, pid
        assert report.total_weight == pytest.approx(sum(weights[p] for p in survivors))
    first = results[survivors[0]][0][0]
    assert all(np.array_equal(first, out[0]) for out, _ in results.values())
    assert elapsed < 2 * TIMEOUT + MARGIN  # two rounds, each bounded by its deadline
