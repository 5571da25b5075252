"""DeDLOC shares from measured throughput (cluster/collective/shares.py, Membership.plan)."""

import math

import pytest

from moshray.cluster.collective.shares import (
    MAX_SHARE, MIN_SHARE, ThroughputMeter, busy_seconds, relative_shares, round_throughput,
)
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
    assert got == {"a": MIN_SHARE, "b": 1.0, "c": MAX_SHARE, "e": 1.0}


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
