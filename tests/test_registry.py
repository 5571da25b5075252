"""The expert registry (pure): uids, registration, heartbeats, expiry, lookups, placement."""

from __future__ import annotations

import pytest

from moshray.cluster.coordinator.core import CoordinatorCore
from moshray.cluster.coordinator.membership import MembershipConfig
from moshray.cluster.coordinator.expert_registry import (
    ExpertRegistry,
    HeartbeatStatus,
    choose_node,
    grid_uids,
    make_uid,
    parse_uid,
    spread_shards,
    uid_prefix,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_uid_round_trip_and_prefix():
    assert make_uid("ffn0", (3, 1)) == "ffn0.3.1"
    assert parse_uid("ffn0.3.1") == ("ffn0", (3, 1))
    assert parse_uid("l.0") == ("l", (0,))
    assert uid_prefix("ffn0") == "ffn0."
    assert uid_prefix("ffn0", (3,)) == "ffn0.3."
    assert grid_uids("a", (2, 3)) == ("a.0.0", "a.0.1", "a.0.2", "a.1.0", "a.1.1", "a.1.2")


@pytest.mark.parametrize("bad", ["ffn0", "ffn0.x.1", ".1.2", "ffn0.-1.2", "ffn0.+1", 7, "a.1."])
def test_parse_uid_rejects_malformed(bad):
    with pytest.raises(ValueError, match="uid"):
        parse_uid(bad)


@pytest.mark.parametrize("layer,coords", [("a.b", (1,)), ("", (1,)), ("a", ()), ("a", (-1,)),
                                          ("a", (True,))])
def test_make_uid_rejects_bad_parts(layer, coords):
    with pytest.raises(ValueError):
        make_uid(layer, coords)


def test_register_lookup_by_prefix_and_grid():
    clock = Clock()
    reg = ExpertRegistry(ttl_s=5.0, clock=clock)
    g1 = reg.register("h0", ("ffn0.0.0", "ffn0.0.1", "ffn1.0.0"), "H0", "n0", "i0")
    g2 = reg.register("h1", ("ffn0.1.0", "ffn0.10.0"), "H1", "n1", "i1")
    assert g2 > g1
    layer0 = reg.lookup("ffn0.")
    assert [(r.host_id, r.uids) for r in layer0] == [
        ("h0", ("ffn0.0.0", "ffn0.0.1")), ("h1", ("ffn0.1.0", "ffn0.10.0"))]
    # "ffn0.1." must not match "ffn0.10.0"
    assert [(r.host_id, r.uids) for r in reg.lookup_grid("ffn0", (1,))] == [("h1", ("ffn0.1.0",))]
    assert reg.lookup_grid("ffn0", (1,))[0].handle == "H1"
    assert reg.locations() == {"ffn0.0.0": ("h0", "n0"), "ffn0.0.1": ("h0", "n0"),
                               "ffn1.0.0": ("h0", "n0"), "ffn0.1.0": ("h1", "n1"),
                               "ffn0.10.0": ("h1", "n1")}


def test_heartbeat_keeps_alive_and_expiry_drops():
    clock = Clock()
    reg = ExpertRegistry(ttl_s=5.0, clock=clock)
    reg.register("h0", ("a.0",), "H0", instance="i0")
    reg.register("h1", ("a.1",), "H1", instance="i1")
    clock.t += 4.0
    assert reg.heartbeat("h0", "i0") is HeartbeatStatus.OK
    clock.t += 4.0  # h1 is now 8 s old, h0 4 s
    assert [r.host_id for r in reg.lookup("a.")] == ["h0"]
    assert reg.heartbeat("h1", "i1") is HeartbeatStatus.UNKNOWN
    clock.t += 5.5
    assert reg.lookup() == ()
    assert reg.locations() == {}


def test_respawn_supersedes_old_instance():
    clock = Clock()
    reg = ExpertRegistry(ttl_s=5.0, clock=clock)
    reg.register("h0", ("a.0", "a.1"), "old", "n0", "i-old")
    reg.register("h0", ("a.0", "a.1"), "new", "n1", "i-new")
    assert reg.heartbeat("h0", "i-old") is HeartbeatStatus.SUPERSEDED
    assert reg.unregister("h0", "i-old") is False  # the dying copy cannot remove its successor
    [record] = reg.lookup("a.")
    assert (record.handle, record.node_id, record.instance) == ("new", "n1", "i-new")
    assert reg.unregister("h0", "i-new") is True
    assert reg.lookup() == ()


def test_uid_moves_to_newest_host_and_drop_node():
    reg = ExpertRegistry(ttl_s=5.0, clock=Clock())
    reg.register("h0", ("a.0", "a.1"), "H0", "n0")
    reg.register("h1", ("a.1",), "H1", "n1")
    assert {r.host_id: r.uids for r in reg.lookup()} == {"h0": ("a.0",), "h1": ("a.1",)}
    reg.register("h2", ("a.0",), "H2", "n1")
    assert {r.host_id: r.uids for r in reg.lookup()} == {"h1": ("a.1",), "h2": ("a.0",)}
    assert reg.drop_node("n1") == ("h1", "h2")
    assert reg.lookup() == ()


@pytest.mark.parametrize("host,uids", [("", ("a.0",)), ("h", ()), ("h", ("bad",))])
def test_register_rejects_bad_arguments(host, uids):
    with pytest.raises(ValueError):
        ExpertRegistry(clock=Clock()).register(host, uids, None)


def test_ttl_must_be_positive():
    with pytest.raises(ValueError, match="ttl_s"):
        ExpertRegistry(ttl_s=0)


def test_coordinator_core_delegates():
    clock = Clock()
    core = CoordinatorCore(MembershipConfig(), clock=clock)
    core.register_experts("h0", ("ffn0.0.0", "ffn0.0.1"), "H0", "n0", "i0")
    assert core.heartbeat_experts("h0", "i0") is HeartbeatStatus.OK
    assert [r.uids for r in core.lookup_experts("ffn0.0.")] == [("ffn0.0.0", "ffn0.0.1")]
    assert core.expert_locations()["ffn0.0.1"] == ("h0", "n0")
    assert core.unregister_experts("h0", "i0") is True
    assert core.lookup_experts() == ()


def test_spread_and_choose_node():
    assert spread_shards(["s0", "s1", "s2", "s3", "s4"], ["a", "b", "c"]) == {
        "s0": "a", "s1": "b", "s2": "c", "s3": "a", "s4": "b"}
    assert spread_shards(["s0", "s1"], ["a", "b"], load={"a": 2}) == {"s0": "b", "s1": "b"}
    with pytest.raises(ValueError, match="no spot node"):
        spread_shards(["s0"], [])
    assert spread_shards([], []) == {}
    assert choose_node(["a", "b", "c"], {"a": 0, "b": 1}, avoid={"a"}) == "c"
    assert choose_node(["a"], {}, avoid={"a"}) is None
