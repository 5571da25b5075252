"""Adaptive round deadlines (cluster/collective/deadline.py) and the averager's use of them."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from moshray.cluster.collective.averager import Averager
from moshray.cluster.collective.deadline import (DeadlinePolicy, RoundTimes, adaptive_timeout,
                                                 quantile)
from moshray.cluster.collective.transport import LocalNetwork
from moshray.cluster.coordinator.membership import Membership, MembershipConfig
from moshray.cluster.messages import PeerInfo

POLICY = DeadlinePolicy(quantile=0.9, margin=2.0, floor_s=0.5, window=10, min_samples=3)


def test_quantile_interpolates() -> None:
    assert quantile([3.0], 0.9) == 3.0
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert quantile([5.0, 1.0, 3.0, 2.0, 4.0], 1.0) == 5.0
    assert quantile([0.0, 10.0], 0.9) == pytest.approx(9.0)
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_cap_until_enough_samples_then_margin_times_quantile() -> None:
    assert adaptive_timeout([], 10.0, POLICY) == 10.0
    assert adaptive_timeout([1.0, 1.0], 10.0, POLICY) == 10.0  # fewer than min_samples
    assert adaptive_timeout([1.0, 1.0, 1.0], 10.0, POLICY) == pytest.approx(2.0)
    # a high quantile: one slow round in ten lifts the deadline (p90 of 1..1,3 = 1.2)
    got = adaptive_timeout([1.0] * 9 + [3.0], 10.0, POLICY)
    assert got == pytest.approx(2.0 * quantile([1.0] * 9 + [3.0], 0.9))
    assert got > 2.0


def test_clamped_between_floor_and_cap() -> None:
    assert adaptive_timeout([0.01] * 5, 10.0, POLICY) == POLICY.floor_s
    assert adaptive_timeout([30.0] * 5, 10.0, POLICY) == 10.0
    assert adaptive_timeout([0.01] * 5, 0.2, POLICY) == 0.2  # the cap wins over the floor


def test_only_the_window_counts_and_junk_is_ignored() -> None:
    old_slow = [9.0] * 10
    assert adaptive_timeout(old_slow + [1.0] * 10, 100.0, POLICY) == pytest.approx(2.0)
    junk = [math.nan, math.inf, -1.0]
    assert adaptive_timeout(junk + [1.0] * 3, 100.0, POLICY) == pytest.approx(2.0)
    assert adaptive_timeout(junk, 100.0, POLICY) == 100.0


def test_a_round_that_hit_its_deadline_widens_the_next() -> None:
    times = RoundTimes(POLICY)
    for _ in range(5):
        times.record(0, 0.5)
    tight = times.timeout(0, 60.0)
    assert tight == pytest.approx(1.0)
    for _ in range(2):  # the link slowed: two rounds ran into the deadline
        times.record(0, tight)
    assert times.timeout(0, 60.0) > tight
    assert times.timeout(1, 60.0) == 60.0  # another round index: nothing seen yet
    assert RoundTimes(None).timeout(0, 7.0) == 7.0


@pytest.mark.parametrize("kwargs,field", [
    ({"quantile": 0.0}, "quantile"), ({"quantile": 1.5}, "quantile"),
    ({"margin": 0.5}, "margin"), ({"margin": math.nan}, "margin"),
    ({"floor_s": 0.0}, "floor_s"), ({"min_samples": 30}, "min_samples"),
    ({"window": 0}, "window"),
])
def test_bad_policy_names_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        DeadlinePolicy(**kwargs)


def test_averager_adapts_after_observed_rounds() -> None:
    """Four averagers over ``LocalNetwork``: after ``min_samples`` steps the deadline each
    uses is the floor (in-process rounds take milliseconds; floor 5 s, margin 1), not the
    60 s cap, and every step still gives every peer the exact average."""
    policy = DeadlinePolicy(margin=1.0, floor_s=5.0, min_samples=3)
    network = LocalNetwork()
    membership = Membership(MembershipConfig())
    averagers = {}
    for i in range(4):
        pid = f"p{i}"
        averagers[pid] = Averager(pid, transport=network.transport(pid), deadline=policy)
        network.add(pid, averagers[pid])
        membership.register(PeerInfo(pid, pid), now=0.0)
    arrays = {p: np.full(1000, float(i), np.float32) for i, p in enumerate(averagers)}

    async def steps():
        for k in range(4):
            expected = 60.0 if k < policy.min_samples else policy.floor_s
            assert {a.round_times.timeout(0, 60.0) for a in averagers.values()} == {expected}
            plan = membership.plan(now=0.0)
            outs = await asyncio.gather(*(a.all_reduce([arrays[p]], 1.0, plan, 60.0)
                                          for p, a in averagers.items()))
            for out, report in outs:
                np.testing.assert_allclose(out[0], 1.5)
                assert report.complete

    asyncio.run(steps())
