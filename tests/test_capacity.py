"""DeDLOC shares from measured throughput (cluster/collective/shares.py, Membership.plan)."""

import math

import pytest

from moshray.cluster.collective.shares import (
    MAX_SHARE, MIN_SHARE, ThroughputMeter, busy_seconds, relative_shares, round_throughput,
)
from moshray.cluster.collective.partition import part_sizes
from moshray.cluster.coordinator.membership import Membership, MembershipConfig
from moshray.cluster.messages import PeerInfo


def test_busy_seconds_counts_overlaps_once() -> None:
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert busy_seconds([(0.0, 5.0), (1.0, 2.0)]) == pytest.approx(5.0)  # nested


def test_round_throughput_adds_costs_per_byte() -> None:
    # 100 B fetched in 1 s (0.01 s/B) and 100 B reduced in 1 s (0.01 s/B): 50 B/s.
    assert round_throughput(100, 1.0, 100, 1.0) == pytest.approx(50.0)
    assert round_throughput(100, 1.0, 0, 0.0) == pytest.approx(100.0)
    assert round_throughput(0, 0.0, 0, 0.0) is None


def test_meter_smooths_and_ignores_junk() -> None:
    m = ThroughputMeter(alpha=0.5)
    assert m.value is None
    assert m.update(None) is None
    assert m.update(100.0) == 100.0  # the first measurement is taken as is
    assert m.update(200.0) == pytest.approx(150.0)
    for junk in (math.nan, math.inf, -1.0, 0.0, None):
        assert m.update(junk) == pytest.approx(150.0)
    with pytest.raises(ValueError):
        ThroughputMeter(alpha=0.0)


def test_relative_shares_default_median_and_clamp() -> None:
    assert relative_shares({}) == {}
    assert relative_shares({"a": None, "b": 5.0}) == {"a": 1.0, "b": 1.0}  # one measurement
    got = relative_shares({"a": 100.0, "b": 200.0, "c": 400.0, "d": None})
    assert got == {"a": 0.5, "b": 1.0, "c": 2.0, "d": 1.0}
    got = relative_shares({"a": 1.0, "b": 100.0, "c": 10_000.0, "e": math.nan})
    assert got == {"a": 0.0, "b": 1.0, "c": MAX_SHARE, "e": 1.0}
    # just at the cut-off a peer keeps a part; just below it owns none
    got = relative_shares({"a": MIN_SHARE * 100.0, "b": 100.0, "c": 100.0})
    assert got["a"] == pytest.approx(MIN_SHARE)
    got = relative_shares({"a": MIN_SHARE * 99.0, "b": 100.0, "c": 100.0})
    assert got["a"] == 0.0


@pytest.mark.parametrize("ratio,owns", [(1.0, 1.0), (2.0, 0.5), (10.0, 0.0), (100.0, 0.0)])
def test_slow_link_moves_reduction_away(ratio: float, owns: float) -> None:
    """Four peers; one fetches ``ratio`` times slower. Measured as ``round_throughput``
    (fetch plus reduction per byte), its share of a part follows its bandwidth and a 10x
    slower link owns nothing, so every part is reduced by a peer on a fast link."""
    fast_fetch, reduce_s = 1.0, 0.01  # seconds per 1e8 bytes fetched / reduced
    measured = {p: round_throughput(10**8, fast_fetch, 10**8, reduce_s) for p in "abc"}
    measured["slow"] = round_throughput(10**8, fast_fetch * ratio, 10**8, reduce_s)
    shares = relative_shares(measured)
    assert shares["slow"] == pytest.approx(owns, rel=0.02)
    sizes = part_sizes(1_000_000, [shares[p] for p in ("a", "b", "c", "slow")])
    assert sum(sizes) == 1_000_000
    assert sizes[3] <= sizes[0] * owns * 1.02 + 1
    if owns == 0.0:
        assert sizes == (333_334, 333_333, 333_333, 0)


def test_plan_shares_follow_heartbeat_throughput() -> None:
    m = Membership(MembershipConfig())
    for p, cap in (("a", 1.0), ("b", 1.0), ("c", 2.0)):
        m.register(PeerInfo(p, None, capacity=cap), now=0.0)
    assert dict(m.plan(now=0.0).shares) == {"a": 1.0, "b": 1.0, "c": 2.0}  # no data yet
    assert m.heartbeat("a", now=1.0, throughput=50.0)
    assert m.heartbeat("b", now=1.0, throughput=100.0)
    assert m.heartbeat("c", now=1.0)  # no measurement: keeps its declared capacity
    assert dict(m.plan(now=1.0).shares) == {"a": 0.5 / 0.75, "b": 1.0 / 0.75, "c": 2.0}
    assert m.heartbeat("c", now=1.5, throughput=200.0)  # declared x measured
    assert dict(m.plan(now=1.5).shares) == {"a": 0.5, "b": 1.0, "c": 4.0}
    m.register(PeerInfo("a", None), now=2.0)  # re-registering keeps the newest measurement
    assert dict(m.plan(now=2.0).shares)["a"] == 0.5
    assert m.heartbeat("a", now=3.0, throughput=400.0)  # the newest value wins
    assert dict(m.plan(now=3.0).shares) == {"a": 2.0, "b": 0.5, "c": 2.0}


def test_coordinator_heartbeat_carries_throughput() -> None:
    from moshray.cluster.coordinator.core import CoordinatorCore

    core = CoordinatorCore(MembershipConfig(), clock=lambda: 0.0)
    core.register("a", None)
    core.register("b", None)
    assert core.heartbeat("a", 100.0) and core.heartbeat("b", 300.0)
    assert core.heartbeat("a")  # a plain heartbeat keeps the newest measurement
    assert dict(core.membership.plan(now=0.0).shares) == {"a": 0.5, "b": 1.5}


def test_peak_rate_rates_the_best_large_fetch() -> None:
    from moshray.cluster.collective.shares import MIN_RATED_BYTES, peak_rate

    big = MIN_RATED_BYTES * 10
    # from a slow sender (10 s) and a fast one (1 s): our link is at least the fast rate
    assert peak_rate([(0.0, 10.0, big), (0.0, 1.0, big)]) == pytest.approx(big)
    assert peak_rate([(0.0, 0.001, 100)]) is None  # tiny: latency, not bandwidth
    assert peak_rate([(1.0, 1.0, big)]) is None  # no duration
    assert peak_rate([]) is None
