"""The all-reduce's round logic, driven without Ray: averagers in one event loop joined by
``transport.LocalNetwork`` (the same ``Averager`` and ``GroupRound`` the replicas run, with
the transport swapped). Exact weighted averages over a one-group plan and a Moshpit grid,
a peer killed mid-step, a NaN contribution."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from moshray.cluster.collective.auth import new_job_key
from moshray.cluster.collective.averager import Averager
from moshray.cluster.collective.codecs import get_codec
from moshray.cluster.coordinator.membership import Membership, MembershipConfig
from moshray.cluster.messages import Contribution, PeerInfo
from moshray.cluster.collective.transport import LocalNetwork
from moshray.jobs.bench import scale as scale_bench

TIMEOUT = 2.0


def swarm(n: int, max_group: int = 16, min_part: int = 1, compression: str = "none",
          **averager_options):
    """``n`` averagers (``Averager(..., **averager_options)``) and their plan; ``min_part``
    1: every member owns a part (the product's default gives small tensors fewer owners:
    see the tests at the end)."""
    network = LocalNetwork()
    membership = Membership(MembershipConfig(max_group=max_group, min_part=min_part,
                                             compression=compression))
    averagers = {}
    for i in range(n):
        pid = f"p{i}"
        averagers[pid] = Averager(pid, transport=network.transport(pid), **averager_options)
        network.add(pid, averagers[pid])
        membership.register(PeerInfo(pid, pid), now=0.0)  # handles are peer ids here
    return network, averagers, membership.plan(now=0.0)


def inputs(n: int, size: int = 1000, seed: int = 0):
    rng = np.random.default_rng(seed)
    arrays = {f"p{i}": rng.standard_normal(size).astype(np.float32) for i in range(n)}
    weights = {f"p{i}": float(i + 1) for i in range(n)}
    return arrays, weights


def weighted(arrays, weights, who):
    total = sum(weights[p] for p in who)
    return sum(arrays[p].astype(np.float64) * weights[p] for p in who) / total


async def reduce_all(averagers, plan, arrays, weights, skip=()):
    async def one(pid):
        out, report = await averagers[pid].all_reduce([arrays[pid]], weights[pid], plan, TIMEOUT)
        return pid, out[0], report

    return dict((pid, (out, rep)) for pid, out, rep in await asyncio.gather(
        *(one(p) for p in averagers if p not in skip)))


@pytest.mark.parametrize("n,max_group", [(3, 16), (9, 3)], ids=["one-group", "grid-3x3"])
def test_every_peer_gets_the_exact_weighted_average_bitwise_equal(n, max_group):
    _, averagers, plan = swarm(n, max_group)
    assert len(plan.grid.rounds) == (1 if max_group >= n else 2)
    arrays, weights = inputs(n)
    results = asyncio.run(reduce_all(averagers, plan, arrays, weights))
    expected = weighted(arrays, weights, arrays)
    first = results["p0"][0]
    for pid, (out, report) in results.items():
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
        assert np.array_equal(out, first), pid  # bitwise identical everywhere
        # each peer lists whom it heard from in its own groups (all of them in one group)
        assert report.rejections == () and set(report.contributors) <= set(arrays)
        assert len(report.contributors) == min(n, 2 * max_group - 1)


def test_a_peer_that_dies_before_contributing_drops_out_and_the_rest_agree():
    network, averagers, plan = swarm(4)
    arrays, weights = inputs(4, seed=1)
    network.kill("p3")  # gone: calls to it fail, the others stop waiting for it
    results = asyncio.run(reduce_all(averagers, plan, arrays, weights, skip={"p3"}))
    survivors = ["p0", "p1", "p2"]
    first = results["p0"][0]
    for pid in survivors:
        out, report = results[pid]
        assert np.array_equal(out, first)
        assert "p3" not in report.contributors
        assert report.seconds < TIMEOUT * 1.25 + 1.0  # bounded by the round's deadlines
    # p3's part was re-reduced by the survivors; what they agree on covers no p3 value
    assert set(results["p0"][1].contributors) <= set(survivors)


def test_a_nan_contribution_is_rejected_with_its_reason_and_the_round_goes_on():
    _, averagers, plan = swarm(3)
    arrays, weights = inputs(3, seed=2)
    arrays["p1"] = arrays["p1"].copy()
    arrays["p1"][5] = np.nan
    results = asyncio.run(reduce_all(averagers, plan, arrays, weights))
    assert all(np.isfinite(out).all() for out, _ in results.values())
    rejections = [r for _, report in results.values() for r in report.rejections]
    assert any(r.sender == "p1" and r.reason.value == "non_finite" for r in rejections)


def test_fp16_with_measured_shares_is_bitwise_equal_and_meters_measure():
    """Uneven parts (shares from heartbeat throughputs) and the fp16 codec: every peer
    still holds the same bits, close to the exact average; each averager's meter has a
    throughput to report after the round, and feeding it back changes nothing of that."""
    network = LocalNetwork()
    membership = Membership(MembershipConfig(compression="fp16", min_part=1))
    averagers = {}
    for i in range(4):
        pid = f"p{i}"
        averagers[pid] = Averager(pid, transport=network.transport(pid))
        network.add(pid, averagers[pid])
        membership.register(PeerInfo(pid, pid), now=0.0)
        membership.heartbeat(pid, now=0.0, throughput=100.0 * (i + 1))
    plan = membership.plan(now=0.0)
    assert len(set(dict(plan.shares).values())) == 4  # four different part sizes
    arrays, weights = inputs(4, size=10_001, seed=3)
    results = asyncio.run(reduce_all(averagers, plan, arrays, weights))
    expected = weighted(arrays, weights, arrays)
    first = results["p0"][0]
    for pid, (out, report) in results.items():
        assert np.array_equal(out, first), pid
        assert report.rejections == ()
        np.testing.assert_allclose(out, expected, atol=2e-3)
        assert averagers[pid].meter.value is not None and averagers[pid].meter.value > 0
        membership.heartbeat(pid, now=1.0, throughput=averagers[pid].meter.value)
    assert membership.plan(now=1.0) is not None


def test_a_wrong_length_is_rejected_with_the_length_the_sender_sent():
    """The Coordinator settles length disputes by fact: the rejection carries the sender's
    length, the good peers' results stay the exact average of the good contributions."""
    _, averagers, plan = swarm(3)
    arrays, weights = inputs(3)
    arrays["p2"] = np.append(arrays["p2"], np.float32(0))  # one value too many
    results = asyncio.run(reduce_all(averagers, plan, arrays, weights))
    for pid in ("p0", "p1"):
        out, report = results[pid]
        shape = [r for r in report.rejections if r.sender == "p2"]
        assert shape and {r.reason.value for r in shape} == {"shape_mismatch"}
        assert {r.numel for r in shape} == {1001}
        np.testing.assert_allclose(out, weighted(arrays, weights, ("p0", "p1")), rtol=1e-5)


def _owner(plan) -> str:
    from moshray.cluster.collective.partition import group_part_sizes

    members = plan.grid.rounds[0].group_of("p0")[1].members
    sizes = group_part_sizes(plan, members, 1000)
    assert sum(s > 0 for s in sizes) == 1
    return members[sizes.index(max(sizes))]


def test_a_small_tensor_has_one_owner_and_the_others_move_only_its_part():
    _, averagers, plan = swarm(4, min_part=1000)  # 1000 values: one owner
    owner = _owner(plan)
    arrays, weights = inputs(4)
    results = asyncio.run(reduce_all(averagers, plan, arrays, weights))
    expected = weighted(arrays, weights, arrays)
    first = results["p0"][0]
    for pid, (out, report) in results.items():
        assert np.array_equal(out, first), pid
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
        assert set(report.contributors) == set(arrays) and report.rejections == ()
        # a non-owner sends its whole tensor to the owner, once; the owner sends the
        # result to each of the three others
        assert report.bytes_sent == (3 if pid == owner else 1) * 1000 * 4, pid


def test_a_small_tensors_owner_dies_and_the_others_re_reduce_it_alike():
    """The survivors own no part, so they were sent no contributions: each asks the other
    live members for the copy they held back (``CopyRequest``), then re-reduces."""
    from moshray.cluster.messages import Contribution, CopyRequest

    network, averagers, plan = swarm(4, min_part=1000)
    owner = _owner(plan)
    sent: list[tuple[str, str, str]] = []  # (sender, receiver, kind)
    for pid in averagers:
        transport = averagers[pid].transport
        original = transport.send

        def counting(handle, method, message, original=original, pid=pid):
            if isinstance(message, (Contribution, CopyRequest)):
                sent.append((pid, handle, type(message).__name__))
            return original(handle, method, message)

        transport.send = counting
    arrays, weights = inputs(4, seed=5)
    network.kill(owner)
    results = asyncio.run(reduce_all(averagers, plan, arrays, weights, skip={owner}))
    survivors = sorted(set(arrays) - {owner})
    pairs = sorted((p, q) for p in survivors for q in survivors if q != p)
    assert sorted((p, q) for p, q, kind in sent if kind == "CopyRequest") == pairs
    assert sorted((p, q) for p, q, kind in sent
                  if kind == "Contribution" and q != owner) == pairs  # each copy once
    expected = weighted(arrays, weights, survivors)
    first = results[survivors[0]][0]
    for pid in survivors:
        out, report = results[pid]
        assert np.array_equal(out, first), pid
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
        assert owner not in report.contributors


def test_a_small_tensors_owners_take_turns_so_others_reject_a_nan_sender():
    import dataclasses

    _, averagers, first = swarm(4, min_part=1000)
    seen_by_others = []
    for epoch in range(first.epoch, first.epoch + 4):
        plan = dataclasses.replace(first, epoch=epoch)
        arrays, weights = inputs(4, seed=epoch)
        arrays["p1"][7] = np.nan
        results = asyncio.run(reduce_all(averagers, plan, arrays, weights))
        owner = _owner(plan)
        expected = weighted(arrays, weights, ("p0", "p2", "p3"))
        for pid, (out, report) in results.items():
            np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
            assert "p1" not in report.contributors
        reporters = {pid for pid, (_, report) in results.items()
                     if any(r.sender == "p1" and r.reason.value == "non_finite"
                            for r in report.rejections)}
        assert reporters == {owner}  # only the owner sees the values
        seen_by_others.append(owner != "p1")
    assert seen_by_others.count(True) == 3  # every owner but p1's own turn


def test_a_sole_owner_sends_no_contribution_and_a_dead_member_is_still_dropped():
    """The sole owner's contribution would carry no part for anyone, so it sends none: the
    three others send theirs to the owner only (the copies for re-reducing a dead owner's
    part are held back until asked for). A member that dies without contributing is found
    by the owner's probes, not by that message."""
    from moshray.cluster.messages import Contribution

    network, averagers, plan = swarm(4, min_part=1000)
    owner = _owner(plan)
    sent: list[tuple[str, str]] = []
    for pid in averagers:
        transport = averagers[pid].transport
        original = transport.send

        def counting(handle, method, message, original=original, pid=pid):
            if isinstance(message, Contribution):
                sent.append((pid, handle))
            return original(handle, method, message)

        transport.send = counting
    arrays, weights = inputs(4, seed=2)
    results = asyncio.run(reduce_all(averagers, plan, arrays, weights))
    assert not [s for s in sent if s[0] == owner]
    assert sorted(sent) == sorted((p, owner) for p in averagers if p != owner)
    first = next(iter(results.values()))[0]
    assert all(np.array_equal(out, first) for out, _ in results.values())

    network, averagers, plan = swarm(4, min_part=1000)  # a fresh swarm, same owner
    dead = next(p for p in averagers if p != owner)
    network.kill(dead)
    arrays, weights = inputs(4, seed=3)
    results = asyncio.run(reduce_all(averagers, plan, arrays, weights, skip={dead}))
    survivors = sorted(set(arrays) - {dead})
    expected = weighted(arrays, weights, survivors)
    for pid in survivors:
        out, report = results[pid]
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
        assert dead not in report.contributors


@pytest.mark.parametrize("inline_max", [None, 0], ids=["small-inline", "large-refs"])
def test_small_parts_travel_inline_large_ones_as_refs_and_both_survive_a_dead_owner(
        inline_max, monkeypatch):
    """Small parts ride in the call (``Inline``, the other members' copies ``InBundle``:
    one put); with the threshold at 0 every part is an object ref. Either way the round
    is exact and bitwise equal, and a dead owner's part is re-reduced from the copies."""
    import moshray.cluster.collective.round as group_round
    from moshray.cluster.messages import Contribution, InBundle, Inline, PartResult
    from moshray.cluster.collective.transport import LocalRef

    if inline_max is not None:
        monkeypatch.setattr(group_round, "INLINE_MAX_BYTES", inline_max)
    network, averagers, plan = swarm(4)
    payloads: list[tuple[str, object]] = []  # (message kind, payload)
    for pid in averagers:
        transport = averagers[pid].transport
        original = transport.send

        def recording(handle, method, message, original=original):
            if isinstance(message, Contribution):
                payloads.extend(("contribution", p) for p in message.part_refs
                                if p is not None)
            elif isinstance(message, PartResult):
                payloads.append(("result", message.ref))
            return original(handle, method, message)

        transport.send = recording
    dead = "p3"  # owns a part (min_part 1): the others re-reduce it from their copies
    network.kill(dead)
    arrays, weights = inputs(4, seed=7)
    results = asyncio.run(reduce_all(averagers, plan, arrays, weights, skip={dead}))
    survivors = ["p0", "p1", "p2"]
    expected = weighted(arrays, weights, survivors)
    first = results["p0"][0]
    for pid in survivors:
        out, report = results[pid]
        assert np.array_equal(out, first), pid
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
        assert dead not in report.contributors
    kinds = {type(p) for _, p in payloads}
    if inline_max is None:
        assert kinds == {Inline, InBundle}
        assert all(isinstance(p, Inline) for kind, p in payloads if kind == "result")
        # each contribution carries exactly one part inline: the recipient's own
        inline = sum(isinstance(p, Inline) for kind, p in payloads if kind == "contribution")
        assert inline == 3 * 3  # three live senders, to each other member (dead or not)
    else:
        assert kinds == {LocalRef}


def test_held_back_copies_are_kept_one_epoch_back_and_a_late_request_gets_nothing():
    """A non-owner's held-back contribution can be asked for during its round and the
    next epoch's (a survivor may still be re-reducing); older ones are dropped, and a
    request for them is answered with nothing (the requester's wait is bounded)."""
    import dataclasses

    from moshray.cluster.messages import Contribution, CopyRequest

    network, averagers, first = swarm(4, min_part=1000)
    delivered: list[tuple[str, str, int]] = []  # (sender, receiver, epoch) of contributions
    for pid in averagers:
        transport = averagers[pid].transport
        original = transport.send

        def counting(handle, method, message, original=original, pid=pid):
            if isinstance(message, Contribution):
                delivered.append((pid, handle, message.epoch))
            return original(handle, method, message)

        transport.send = counting
    plans = [dataclasses.replace(first, epoch=first.epoch + k) for k in range(3)]
    for plan in plans:
        arrays, weights = inputs(4, seed=plan.epoch)
        asyncio.run(reduce_all(averagers, plan, arrays, weights))
    for pid, averager in averagers.items():  # this epoch and the one before, if any
        assert {key[0] for key in averager._held} <= {plans[1].epoch, plans[2].epoch}, pid

    async def ask(plan) -> list:
        """A non-owner of ``plan`` asks another non-owner for its copy."""
        owner = _owner(plan)
        sender, requester = [p for p in sorted(averagers) if p != owner][:2]
        before = len(delivered)
        averagers[sender].deliver_contribution(CopyRequest(plan.epoch, 0, 0, requester))
        for _ in range(5):
            await asyncio.sleep(0)
        return [(s, r, e) for s, r, e in delivered[before:]], sender, requester

    got, _, _ = asyncio.run(ask(plans[0]))
    assert got == []  # dropped
    got, sender, requester = asyncio.run(ask(plans[1]))
    assert got == [(sender, requester, plans[1].epoch)]


def test_a_copy_asked_for_before_it_was_held_goes_out_when_it_is():
    """A survivor may ask a slower member for its copy before that member has contributed:
    the request is remembered and the copy is sent the moment it is held back."""
    import dataclasses

    from moshray.cluster.messages import Contribution, CopyRequest

    network, averagers, first = swarm(4, min_part=1000)
    plan = dataclasses.replace(first, epoch=first.epoch + 5)
    owner = _owner(plan)
    sender, requester = [p for p in sorted(averagers) if p != owner][:2]
    delivered: list[tuple[str, str, int]] = []
    transport = averagers[sender].transport
    original = transport.send

    def counting(handle, method, message):
        if isinstance(message, Contribution):
            delivered.append((sender, handle, message.epoch))
        return original(handle, method, message)

    transport.send = counting
    averagers[sender].deliver_contribution(CopyRequest(plan.epoch, 0, 0, requester))
    assert delivered == []  # nothing held yet
    arrays, weights = inputs(4, seed=11)
    asyncio.run(reduce_all(averagers, plan, arrays, weights))
    assert (sender, requester, plan.epoch) in delivered


# -- deaths mid-round on a multi-round grid: exact per coordinate -----------------------------


def markers(n: int, blocks: int = 32):
    """Peer i's tensor: ``blocks`` blocks of ``n`` values, 1 at place i of each, and weight
    1..4: every result says which contributions each of its values holds (``bench scale``'s
    ``held_and_error`` reads them)."""
    arrays = {f"p{i}": scale_bench._tensor(i, n, blocks) for i in range(n)}
    weights = {f"p{i}": float(1 + i % 4) for i in range(n)}
    return arrays, weights


def by_index(weights: dict, n: int) -> np.ndarray:
    return np.array([weights[f"p{i}"] for i in range(n)])


async def reduce_with_deaths(network, averagers, plan, arrays, weights, victims):
    """Every averager averages; ``victims`` (members of one first-round group) die once each
    other member of that group has received their first-round contributions: the others
    then hold those contributions in the parts they own, while the victims' own parts are
    re-reduced without them. A victim's calls fail and its objects are lost from then on
    (``LocalNetwork.kill``); its own averager runs on, cut off, and its result is dropped.
    Returns {peer: (result, report)} of the survivors."""
    _, group = plan.grid.rounds[0].group_of(next(iter(victims)))
    assert set(victims) <= set(group.members)
    pending = {(v, m) for v in victims for m in group.members if m not in victims}

    def watching(member):
        averager = averagers[member]

        def deliver_contribution(c):
            averager.deliver_contribution(c)
            if isinstance(c, Contribution) and c.round_index == 0:
                pending.discard((c.sender, member))
                if not pending and not network.dead:
                    for victim in victims:
                        network.kill(victim)

        return SimpleNamespace(deliver_contribution=deliver_contribution,
                               deliver_result=averager.deliver_result)

    for member in group.members:
        if member not in victims:
            network.add(member, watching(member))

    async def one(pid):
        out, report = await averagers[pid].all_reduce([arrays[pid]], weights[pid], plan,
                                                      TIMEOUT)
        return out[0], report

    results = dict(zip(averagers, await asyncio.gather(*(one(p) for p in averagers))))
    assert set(network.dead) == set(victims)
    return {pid: got for pid, got in results.items() if pid not in victims}


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_deaths_mid_round_leave_every_survivor_the_exact_mean_of_what_it_holds(compression):
    """A 4 x 4 grid; two members of one first-round group die after sending their
    contributions. The parts the other two own hold the victims' weight, the victims' parts
    (re-reduced by the survivors) do not: the group's aggregate has a different weight on
    different coordinates, and the second round must weigh each coordinate by its own. Every
    survivor's result is then the exact weighted mean of the contributions it holds, value by
    value (fp16: within the codec's bound for two rounds of two encodings), and it holds
    every live contribution but those whose first-round aggregate died with a victim."""
    n = 16
    network, averagers, plan = swarm(n, max_group=4, compression=compression,
                                     job_key=new_job_key())
    assert [len(g.members) for r in plan.grid.rounds for g in r.groups] == [4] * 8
    row = plan.grid.rounds[0].group_of("p0")[1].members
    victims = set(row[1:3])
    arrays, weights = markers(n)
    results = asyncio.run(reduce_with_deaths(network, averagers, plan, arrays, weights,
                                             victims))
    assert sorted(results) == sorted(set(arrays) - victims)
    w = by_index(weights, n)
    live = {f"p{i}" for i in range(n)} - victims
    codec_bound = 0.0 if compression == "none" else \
        2 * len(plan.grid.rounds) * get_codec(compression).error_bound(np.float32([1.0]))
    for pid, (out, report) in sorted(results.items()):
        held, error = scale_bench.held_and_error(out, n, w)
        assert error <= scale_bench.EXACT + codec_bound, \
            f"{pid}: off by {error:.3g} from the weighted mean of what it holds"
        holds = {f"p{i}" for i in range(n) if held[i]}
        r1 = plan.grid.rounds[1].group_of(pid)[1].members
        lost = set(row) - victims if victims & set(r1) else set()
        assert holds & live == live - lost, pid
        # the figure for the whole tensor: the total weight where it is the same everywhere
        assert report.total_weight == pytest.approx(report.weights.mean(out.size))
    survivor = next(p for p in row if p not in victims)
    assert results[survivor][1].failed_owners  # the victims' parts were re-reduced


def test_failure_free_rounds_stay_bitwise_the_plain_weighted_mean():
    """No failures, a 4 x 4 grid: every peer ends with the same bits, the exact weighted
    mean of all sixteen, one weight for the whole tensor (the sum of all weights), and the
    bits are those of the float32 arithmetic a one-scalar-weight mean does in member order
    (``test_allreduce_order``'s replay)."""
    n = 16
    _, averagers, plan = swarm(n, max_group=4, job_key=new_job_key())
    arrays, weights = inputs(n, size=4099, seed=4)
    results = asyncio.run(reduce_all(averagers, plan, arrays, weights))
    value = {p: arrays[p] for p in arrays}
    weight = dict(weights)
    for schedule in plan.grid.rounds:  # the reference: one scalar weight per peer
        for group in schedule.groups:
            acc, total = None, 0.0
            for p in group.members:
                term = np.multiply(value[p], np.float32(weight[p]), dtype=np.float32)
                acc = term if acc is None else acc + term
                total += weight[p]
            for p in group.members:
                value[p], weight[p] = acc / np.float32(total), total
    reference = value["p0"]
    expected = weighted(arrays, weights, arrays)
    for pid, (out, report) in results.items():
        assert np.array_equal(out.view(np.uint32), reference.view(np.uint32)), pid
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
        assert report.complete and report.total_weight == sum(weights.values())
        assert report.weights.cuts == ()
        assert report.rounds == 2  # the 4 x 4 grid: a row, then a column
