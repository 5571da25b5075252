"""A participant's view of a plan (``messages.PeerPlan``): what the Coordinator sends each
peer instead of the whole ``RoundPlan``. A view holds exactly the peer's groups and its
group-mates' handles, shares and zones, agrees with the whole plan on everything a peer
reads, and averaging over views is bitwise the averaging over the whole plan (pure: the
in-process transport, no Ray)."""

from __future__ import annotations

import asyncio
import pickle

import numpy as np
import pytest

from moshray.cluster.collective.auth import new_job_key
from moshray.cluster.collective.averager import Averager
from moshray.cluster.collective.partition import group_part_sizes
from moshray.cluster.collective.transport import LocalNetwork
from moshray.cluster.coordinator.core import CoordinatorCore
from moshray.cluster.coordinator.membership import Membership, MembershipConfig
from moshray.cluster.coordinator.progress import ProgressReport
from moshray.cluster.messages import PeerInfo, RoundPlan


def plan_of(n: int, max_group: int = 4, zones: int = 0, min_part: int = 1,
            epoch: int = 0, id_handles: bool = False) -> RoundPlan:
    """A Coordinator's plan over ``n`` peers with distinct handles (``id_handles``: each
    peer's id, the in-process transport's address) and shares (and, with ``zones``, peers
    spread over that many zones, one in five declaring none)."""
    m = Membership(MembershipConfig(max_group=max_group, min_part=min_part,
                                    compression="fp16", seed=3))
    m.epoch = epoch
    for i in range(n):
        zone = f"z{i % zones}" if zones and i % 5 else ""
        pid = f"p{i:03d}"
        m.register(PeerInfo(pid, handle=pid if id_handles else ("handle", i),
                            capacity=1.0 + i % 3,
                            zone=zone), now=0.0)
    return m.plan(now=0.0, branch=2)


def groups_of(plan: RoundPlan, peer: str) -> list[tuple[int, int, tuple[str, ...]]]:
    """``(round, group, everyone)`` of each group ``peer`` is in, read off the whole plan."""
    return [(r, g, group.everyone) for r, schedule in enumerate(plan.grid.rounds)
            for g, group in enumerate(schedule.groups) if peer in group.everyone]


CASES = [(1, 4, 0), (2, 4, 0), (7, 4, 0), (13, 3, 0), (27, 3, 0), (50, 8, 0), (70, 4, 0),
         (24, 4, 3), (41, 4, 2)]


@pytest.mark.parametrize("n,max_group,zones", CASES)
def test_a_view_holds_exactly_its_groups_and_its_group_mates_handles(n, max_group, zones):
    plan = plan_of(n, max_group, zones)
    views = plan.views()
    assert sorted(views) == sorted(plan.participants)
    handles, shares, declared = dict(plan.handles), dict(plan.shares), dict(plan.zones)
    for peer, view in views.items():
        mine = groups_of(plan, peer)
        assert [(s.round_index, s.group_index, s.group.everyone) for s in view.seats] == mine
        mates = {p for _, _, everyone in mine for p in everyone} | {peer}
        assert {p for p, _ in view.handles} == mates  # exactly its group-mates, and itself
        assert dict(view.handles) == {p: handles[p] for p in mates}
        assert set(view.mates) == mates
        assert dict(view.shares) == {p: shares[p] for p in mates}
        assert dict(view.zones) == {p: declared[p] for p in mates if p in declared}
        # the facts about the whole plan
        assert (view.peer, view.epoch, view.branch, view.compression, view.min_part,
                view.peer_count) == (peer, plan.epoch, plan.branch, plan.compression,
                                     plan.min_part, len(plan.participants))
        assert view == plan.view_of(peer)  # one peer's view alone is the same


@pytest.mark.parametrize("n,max_group,zones", CASES)
def test_the_whole_plan_and_a_view_agree_on_everything_a_peer_reads(n, max_group, zones):
    plan = plan_of(n, max_group, zones, min_part=7, epoch=5)
    for peer, view in plan.views().items():
        for seat in view.seats:
            members = seat.group.members
            for numel in (0, 5, 64, 1000):  # part sizes: shares, min_part, owners by epoch
                assert group_part_sizes(view, members, numel) == \
                    group_part_sizes(plan, members, numel)
            for mate in seat.group.everyone:
                assert view.share_of(mate) == plan.share_of(mate)
                assert view.handle_of(mate) == plan.handle_of(mate)
        with pytest.raises(KeyError):
            view.handle_of("nobody")


def test_a_view_is_small_whatever_the_swarm_s_size():
    """A view's bytes follow its groups (rounds x group size), not the participant count:
    the Coordinator's pushes cost O(N) in all, not O(N^2)."""
    small, large = plan_of(64, 4), plan_of(1024, 4)
    whole = len(pickle.dumps(large))
    biggest = max(len(pickle.dumps(v)) for v in large.views().values())
    assert biggest < whole / 20
    assert biggest < 2 * max(len(pickle.dumps(v)) for v in small.views().values())


def test_a_peer_out_of_the_plan_is_in_no_group_and_averages_with_nobody():
    plan = plan_of(5, id_handles=True)
    assert "p999" not in plan.views()
    view = plan.view_of("p999")
    assert view.seats == () and view.handles == () and view.peer_count == 5
    averager = Averager("p999", transport=LocalNetwork().transport("p999"))
    mine = np.arange(4, dtype=np.float32)
    out, report = asyncio.run(averager.all_reduce([mine], 1.0, plan, 1.0))
    assert np.array_equal(out[0], mine) and report.contributors == ()


def test_the_coordinator_pushes_and_replies_each_participant_its_own_view():
    pushed = []
    core = CoordinatorCore(MembershipConfig(max_group=2), clock=lambda: 0.0,
                           target_batch_size=8)
    core.push_plan = lambda plan, views: pushed.append((plan, views))
    peers = [f"p{i}" for i in range(8)]
    for p in peers:
        core.register(p, handle=f"handle-{p}", node_id=f"n-{p}")
        assert core.mark_ready(p, 0)
    replies = {p: core.report(ProgressReport(p, 0, 1)) for p in peers}
    (plan, views), = pushed
    assert sorted(views) == sorted(plan.participants) == peers
    for p in peers:
        assert views[p] == plan.view_of(p)
        assert len(views[p].handles) < len(peers)  # its group-mates only (2 x 2 x 2 grid)
    # each report after the plan is answered with the reporter's own view
    late = [p for p in peers if replies[p].plan is None]
    assert late  # the plan came at the last report: the others learn of it now
    for p in peers:
        assert core.report(ProgressReport(p, 0, 1)).plan == views[p]


def averagers(plan: RoundPlan, key: bytes):
    network = LocalNetwork()
    out = {}
    for pid in plan.participants:
        out[pid] = Averager(pid, transport=network.transport(pid), job_key=key)
        network.add(pid, out[pid])
    return network, out


async def reduce_all(avs, plans, arrays, network=None, kill=()):
    """Every averager's ``all_reduce`` over ``plans[peer]``; ``kill`` die after their
    first-round contributions are out."""
    async def one(pid):
        out, report = await avs[pid].all_reduce([arrays[pid]], 1.0 + int(pid[1:]) % 4,
                                                plans[pid], 2.0)
        return out[0], report

    tasks = {p: asyncio.ensure_future(one(p)) for p in avs}
    if kill:
        for _ in range(3):
            await asyncio.sleep(0)
        for p in kill:
            network.kill(p)
            tasks[p].cancel()
    done = {}
    for p, task in tasks.items():
        if p not in kill:
            done[p] = await task
    await asyncio.gather(*(tasks[p] for p in kill), return_exceptions=True)
    return done


@pytest.mark.parametrize("kill", [(), ("p002", "p011")], ids=["no-failure", "two-die"])
def test_averaging_over_views_is_bitwise_the_averaging_over_the_whole_plan(kill):
    plan = plan_of(27, 3, zones=2, min_part=16, id_handles=True)
    key = new_job_key()
    rng = np.random.default_rng(0)
    arrays = {p: rng.standard_normal(600).astype(np.float32) for p in plan.participants}
    results = []
    for plans in ({p: plan for p in plan.participants}, plan.views()):
        network, avs = averagers(plan, key)
        results.append(asyncio.run(reduce_all(avs, plans, arrays, network, kill)))
    whole, viewed = results
    assert whole.keys() == viewed.keys()
    for p in whole:
        (a, ra), (b, rb) = whole[p], viewed[p]
        assert np.array_equal(a, b), p
        assert (ra.contributors, ra.partial_contributors, ra.failed_owners, ra.bytes_sent,
                ra.cross_zone_bytes, ra.weights) == \
            (rb.contributors, rb.partial_contributors, rb.failed_owners, rb.bytes_sent,
             rb.cross_zone_bytes, rb.weights)
    if kill:  # the deaths took parts with them: re-reduced from copies, weights per segment
        assert any(r.failed_owners and len(r.weights.weights) > 1 for _, r in viewed.values())
    else:
        first = next(iter(viewed.values()))[0]
        assert all(np.array_equal(out, first) for out, _ in viewed.values())


def test_an_averager_refuses_another_peer_s_view():
    plan = plan_of(4, id_handles=True)
    _, avs = averagers(plan, new_job_key())
    with pytest.raises(ValueError, match="p001"):
        asyncio.run(avs["p000"].all_reduce([np.zeros(4, np.float32)], 1.0,
                                           plan.view_of("p001"), 1.0))
