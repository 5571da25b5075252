"""Why peers of a multi-round grid end bitwise identical: pure numpy, no Ray.

The round adds its members' float32 values in the group's member order (grid coordinate
order). Replaying every plan's rounds that way, each group with ``WeightedMean`` exactly as
an owner does, every peer must hold the same bytes; adding in another order (as arrival
order would) generally does not.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from moshray.cluster.collective.grid import plan_grid
from moshray.cluster.collective.partition import WeightedMean


def _replay(plan, values, weights, order=None):
    value, weight = dict(values), dict(weights)
    for schedule in plan.rounds:
        for group in schedule.groups:
            members = list(group.members)
            if order is not None:
                order(members)
            mean = WeightedMean(next(iter(values.values())).size)
            for p in members:
                mean.add(value[p], weight[p])
            avg, total = mean.result()
            for p in group.members:
                value[p], weight[p] = avg, total
            for p in group.receivers:
                value[p] = avg
    return value


@pytest.mark.parametrize("n,max_group", [(9, 3), (11, 4), (16, 8), (27, 3), (40, 8), (8, 2)])
def test_member_order_gives_every_peer_the_same_bytes(n: int, max_group: int) -> None:
    peers = [f"p{i}" for i in range(n)]
    plan = plan_grid(peers, max_group, epoch=3)
    assert len(plan.rounds) >= 2
    rng = np.random.default_rng(n)
    values = {p: rng.normal(size=4096).astype(np.float32) for p in peers}
    weights = {p: float(rng.uniform(0.5, 4.0)) for p in peers}
    out = _replay(plan, values, weights)
    first = out[peers[0]]
    assert all(np.array_equal(first, v) for v in out.values())
    expected = sum(values[p].astype(np.float64) * weights[p] for p in peers) / sum(weights.values())
    np.testing.assert_allclose(first, expected, rtol=1e-5, atol=1e-5)


def test_arrival_order_would_break_bitwise_equality() -> None:
    peers = [f"p{i}" for i in range(16)]
    plan = plan_grid(peers, 4, epoch=1)
    rng = np.random.default_rng(0)
    values = {p: rng.normal(size=4096).astype(np.float32) for p in peers}
    weights = {p: float(rng.uniform(0.5, 4.0)) for p in peers}
    shuffle = random.Random(5).shuffle
    out = _replay(plan, values, weights, order=shuffle)
    first = out[peers[0]]
    assert not all(np.array_equal(first, v) for v in out.values())
