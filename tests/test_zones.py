"""Zone-aware Moshpit plans (cluster/collective/grid.py: ``plan_zoned``): exact averages,
only delegates' reduced tensors crossing zones, counted from the plan with plain data, and
one run of the real averagers over ``LocalNetwork`` (no Ray)."""

from __future__ import annotations

import asyncio
import math
import random

import numpy as np
import pytest

from moshray.cluster.collective.averager import Averager
from moshray.cluster.collective.grid import cross_zone_bytes, plan_grid, simulate
from moshray.cluster.collective.transport import LocalNetwork
from moshray.cluster.coordinator.membership import Membership, MembershipConfig
from moshray.cluster.messages import PeerInfo

NUMEL = 1 << 20


def _zones(sizes: tuple[int, ...]) -> dict[str, str]:
    """Peers ``z{k}p{i}`` in zones ``zone-k`` of the given sizes."""
    return {f"z{k}p{i:02d}": f"zone-{k}" for k, size in enumerate(sizes) for i in range(size)}


LAYOUTS = [(2, 2), (3, 5), (8, 8), (4, 4, 4), (16, 16), (1, 7), (20, 3, 1), (9, 9, 9, 9)]


@pytest.mark.parametrize("sizes", LAYOUTS, ids=str)
@pytest.mark.parametrize("max_group", [2, 4, 8])
def test_zoned_plan_gives_the_exact_weighted_average(sizes, max_group) -> None:
    zones = _zones(sizes)
    peers = list(zones)
    rng = random.Random(f"{sizes}:{max_group}")
    for epoch in range(3):
        plan = plan_grid(peers, max_group, epoch=epoch, zones=zones)
        assert dict(plan.zones) == zones
        values = {p: rng.gauss(0.0, 10.0) for p in peers}
        weights = {p: rng.uniform(0.1, 5.0) for p in peers}
        expected = sum(values[p] * weights[p] for p in peers) / sum(weights.values())
        out = simulate(plan, values, weights)
        for p in peers:
            assert math.isclose(out[p], expected, rel_tol=1e-12, abs_tol=1e-12), p
        for schedule in plan.rounds:  # a peer is in at most one group per round
            seen = [p for g in schedule.groups for p in g.everyone]
            assert len(seen) == len(set(seen))


@pytest.mark.parametrize("sizes", LAYOUTS, ids=str)
def test_first_round_groups_never_mix_zones(sizes) -> None:
    zones = _zones(sizes)
    plan = plan_grid(list(zones), 8, zones=zones)
    for group in plan.rounds[0].groups:
        assert len({zones[p] for p in group.everyone}) == 1, group


@pytest.mark.parametrize("sizes", [(8, 8), (4, 4, 4), (16, 16), (9, 9, 9, 9), (6, 6)], ids=str)
def test_cross_zone_bytes_fall_by_at_least_the_zone_size(sizes) -> None:
    """Bytes crossing zones per step, zone-aware against the zone-blind grid of the same
    peers (the blind one's best over 20 epochs, so a lucky shuffle cannot help it)."""
    zones = _zones(sizes)
    peers = list(zones)
    aware = [cross_zone_bytes(plan_grid(peers, 8, epoch=e, zones=zones), zones, NUMEL)
             for e in range(5)]
    blind = [cross_zone_bytes(plan_grid(peers, 8, epoch=e), zones, NUMEL) for e in range(20)]
    assert min(blind) >= min(sizes) * max(aware), (aware, min(blind))
    # only the delegates' reduced tensors cross: 2 * S per pair of zones (one group of
    # delegates when the zones are no more than max_group)
    nbytes = 4 * NUMEL
    n_zones = len(sizes)
    assert set(aware) == {2 * (n_zones - 1) * nbytes}


@pytest.mark.parametrize("sizes", [(2, 2), (3, 3), (4, 4), (2, 1), (3, 2), (4, 2)], ids=str)
def test_small_layouts_fall_by_the_harmonic_mean_of_the_zone_sizes(sizes) -> None:
    """The bench's layouts (one group of at most 8): the zone-blind group moves
    ``2 S / n`` per pair of a part's owner and a member in the other zone, ``4 S a b / n``
    in all; the delegates move ``2 S``: the fall is ``2 a b / (a + b)``, the zone size for
    two equal zones (2 + 2: 2) and 4/3 for 2 + 1. Equal zones keep it
    when the slow zone's peers take small bandwidth shares (each part still has one owner
    per zone pair to cross to)."""
    zones = _zones(sizes)
    peers = list(zones)
    a, b = sizes
    expected = 2 * a * b / (a + b)
    aware = sum(cross_zone_bytes(plan_grid(peers, 8, epoch=e, zones=zones), zones, NUMEL)
                for e in range(10))
    blind = sum(cross_zone_bytes(plan_grid(peers, 8, epoch=e), zones, NUMEL)
                for e in range(10))
    assert blind / aware == pytest.approx(expected, rel=1e-4)
    if a == b:
        shares = {p: 1.0 if zones[p] == "zone-0" else 0.05 for p in peers}
        aware = sum(cross_zone_bytes(plan_grid(peers, 8, epoch=e, zones=zones), zones, NUMEL,
                                     shares) for e in range(10))
        blind = sum(cross_zone_bytes(plan_grid(peers, 8, epoch=e), zones, NUMEL, shares)
                    for e in range(10))
        assert blind / aware == pytest.approx(a, rel=1e-4)


def test_cross_zone_bytes_counts_the_butterfly() -> None:
    zones = {"a": "x", "b": "y"}
    plan = plan_grid(["a", "b"], 8)  # one group of two
    # each sends the other its half and gets the other's result back: 4 halves = 2 S
    assert cross_zone_bytes(plan, zones, 100) == 2 * 4 * 100
    # shares move the parts, not the bytes of a pair
    assert cross_zone_bytes(plan, zones, 100, shares={"a": 3.0, "b": 1.0}) == 800
    assert cross_zone_bytes(plan, {"a": "x", "b": "x"}, 100) == 0


def test_delegates_take_turns_and_plans_are_deterministic() -> None:
    zones = _zones((4, 4))
    peers = list(zones)
    fan_outs = [plan_grid(peers, 8, epoch=e, zones=zones).rounds[-1] for e in range(8)]
    delegates = [tuple(g.members[0] for g in f.groups) for f in fan_outs]
    assert len({d[0] for d in delegates}) == 4  # every peer of zone 0 serves in 4 epochs
    again = plan_grid(list(reversed(peers)), 8, epoch=3, zones=zones)
    assert again == plan_grid(peers, 8, epoch=3, zones=zones)


def test_zone_blind_cases_keep_the_plain_grid() -> None:
    peers = [f"p{i}" for i in range(9)]
    plain = plan_grid(peers, 3, epoch=2)
    assert plain.zones == ()
    assert plan_grid(peers, 3, epoch=2, zones={}) == plain
    assert plan_grid(peers, 3, epoch=2, zones={p: "one" for p in peers}) == plain
    assert plan_grid(peers, 3, epoch=2, zones={p: p for p in peers}) == plain  # all alone


def test_membership_plans_by_declared_zone() -> None:
    zones = _zones((3, 3))
    m = Membership(MembershipConfig())
    for p, z in zones.items():
        m.register(PeerInfo(p, None, zone=z), now=0.0)
    plan = m.plan(now=0.0)
    assert dict(plan.grid.zones) == zones
    blind = Membership(MembershipConfig(zone_aware=False))
    for p, z in zones.items():
        blind.register(PeerInfo(p, None, zone=z), now=0.0)
    assert blind.plan(now=0.0).grid.zones == ()


def _swarm(zones: dict[str, str], zone_aware: bool = True):
    """(averagers by peer, the first plan) of peers in ``zones`` over ``LocalNetwork``."""
    network = LocalNetwork()
    membership = Membership(MembershipConfig(max_group=8, zone_aware=zone_aware))
    averagers = {}
    for pid, zone in zones.items():
        averagers[pid] = Averager(pid, transport=network.transport(pid))
        network.add(pid, averagers[pid])
        membership.register(PeerInfo(pid, pid, zone=zone), now=0.0)
    return averagers, membership.plan(now=0.0)


def test_averagers_run_a_zoned_plan_to_the_exact_bitwise_equal_average() -> None:
    zones = _zones((3, 4))
    averagers, plan = _swarm(zones)
    assert len(plan.grid.rounds) == 3  # inside zones, delegates, fan-out
    rng = np.random.default_rng(0)
    arrays = {p: rng.standard_normal(5000).astype(np.float32) for p in zones}
    weights = {p: float(i + 1) for i, p in enumerate(zones)}

    async def run():
        async def one(pid):
            out, report = await averagers[pid].all_reduce([arrays[pid]], weights[pid], plan,
                                                          10.0)
            return pid, out[0], report
        return await asyncio.gather(*(one(p) for p in zones))

    results = asyncio.run(run())
    total = sum(weights.values())
    expected = sum(arrays[p].astype(np.float64) * weights[p] for p in zones) / total
    first = results[0][1]
    for pid, out, report in results:
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
        assert np.array_equal(out, first), pid
        assert report.rejections == () and report.failed_owners == ()
        assert report.total_weight == pytest.approx(total)


def test_averagers_count_the_bytes_they_send_across_zones_as_the_plan_predicts() -> None:
    """Each peer counts the bytes it sent to a peer of another zone
    (``AllReduceReport.cross_zone_bytes``, from the plan's declared zones, zone-aware grid
    or not); summed over the swarm they are what ``cross_zone_bytes`` predicts, and the
    zone-aware plan sends the zone size's factor fewer (2 + 2 peers: 2)."""
    zones = _zones((2, 2))
    numel = 6000
    totals = {}
    for aware in (True, False):
        averagers, plan = _swarm(zones, aware)
        assert dict(plan.zones) == zones  # declared zones travel with every plan

        async def run():
            return await asyncio.gather(*(
                averagers[p].all_reduce([np.ones(numel, np.float32)], 1.0, plan, 10.0)
                for p in zones))

        reports = [r for _, r in asyncio.run(run())]
        counted = sum(r.cross_zone_bytes for r in reports)
        assert counted == cross_zone_bytes(plan.grid, zones, numel)
        assert all(r.cross_zone_bytes <= r.bytes_sent for r in reports)
        totals[aware] = counted
    assert totals[False] == 2 * totals[True] > 0


def test_the_coordinator_takes_each_peers_zone_from_its_node() -> None:
    from moshray.cluster.coordinator.core import CoordinatorCore
    from moshray.jobs.local.cluster import LocalClusterConfig

    core = CoordinatorCore(MembershipConfig(max_group=2), clock=lambda: 0.0)
    node_zones = {"n0": "a", "n1": "a", "n2": "b", "n3": "b"}
    core.zone_of = node_zones.__getitem__  # the actor shell reads Ray's node labels
    for i in range(4):
        core.register(f"p{i}", handle=None, node_id=f"n{i}")
    core.register("p4", handle=None)  # no node: no zone, never looked up
    zones = {p.peer_id: p.zone for p in core.steps.membership.present(now=0.0)}
    assert zones == {"p0": "a", "p1": "a", "p2": "b", "p3": "b", "p4": ""}
    # the embedded cluster labels its nodes as a cloud node's setup does
    config = LocalClusterConfig(zones=((0, "a"), (1, "b")))
    assert config.labels(1) == {"moshray-slot": "1", "ray.io/availability-zone": "b"}
    assert config.labels(2) == {"moshray-slot": "2"}
