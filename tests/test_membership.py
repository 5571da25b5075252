"""Tests for moshray.cluster.coordinator.membership and CoordinatorCore with an injected clock."""

from __future__ import annotations

import dataclasses
import math

import pytest

from moshray.cluster.coordinator.core import CoordinatorCore
from moshray.cluster.collective.grid import DEFAULT_MAX_GROUP, plan_grid
from moshray.cluster.coordinator.membership import Membership, MembershipConfig
from moshray.cluster.messages import PeerInfo

TTL = 10.0


def _info(peer: str, node: str = "node-a", capacity: float = 1.0, handle=None) -> PeerInfo:
    return PeerInfo(peer, handle if handle is not None else object(), node, capacity)


def _membership(**config) -> Membership:
    return Membership(MembershipConfig(**{"peer_ttl_s": TTL, **config}))


def _ids(infos) -> tuple[str, ...]:
    return tuple(p.peer_id for p in infos)


# ---------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_group": 1},
        {"max_group": 0},
        {"max_group": -4},
        {"peer_ttl_s": 0.0},
        {"peer_ttl_s": -1.0},
        {"peer_ttl_s": float("-inf")},
    ],
    ids=str,
)
def test_config_rejects_invalid_values(kwargs) -> None:
    with pytest.raises(ValueError):
        MembershipConfig(**kwargs)


def test_config_rejects_nan_ttl() -> None:
    """A NaN TTL would make every peer non-live forever (every comparison is False)."""
    with pytest.raises(ValueError):
        MembershipConfig(peer_ttl_s=float("nan"))


def test_config_defaults_and_frozen() -> None:
    config = MembershipConfig()
    assert config.max_group == DEFAULT_MAX_GROUP == 8 and config.peer_ttl_s == 30.0
    assert config.compression == "none" and config.seed == 0
    assert MembershipConfig(max_group=2, peer_ttl_s=0.001).max_group == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_group = 4  # type: ignore[misc]


# ------------------------------------------------------------------ membership


def test_register_heartbeat_leave() -> None:
    m = _membership()
    assert m.live(0.0) == ()
    m.register(_info("b"), now=0.0)
    m.register(_info("a"), now=0.0)
    assert _ids(m.live(0.0)) == ("a", "b")  # sorted by id
    assert m.heartbeat("a", now=1.0) is True
    assert m.heartbeat("ghost", now=1.0) is False
    assert m.leave("a") is True
    assert m.leave("a") is False
    assert _ids(m.live(1.0)) == ("b",)
    assert m.heartbeat("a", now=2.0) is False  # must register again


def test_re_register_replaces_info() -> None:
    m = _membership()
    m.register(_info("a", capacity=1.0), now=0.0)
    m.register(_info("a", capacity=2.5, node="node-b"), now=1.0)
    (info,) = m.live(1.0)
    assert info.capacity == 2.5 and info.node_id == "node-b"


def test_ttl_boundary_and_heartbeat_refresh() -> None:
    m = _membership()
    m.register(_info("a"), now=100.0)
    m.register(_info("b"), now=100.0)
    assert _ids(m.live(100.0 + TTL)) == ("a", "b")  # exactly TTL old is still alive
    assert _ids(m.live(100.0 + TTL + 0.001)) == ()
    assert m.heartbeat("a", now=108.0)
    assert _ids(m.live(115.0)) == ("a",)
    assert _ids(m.live(118.0)) == ("a",)
    assert _ids(m.live(118.5)) == ()


def test_expire_drops_only_silent_peers() -> None:
    m = _membership()
    for peer in ("c", "a", "b"):
        m.register(_info(peer), now=0.0)
    m.heartbeat("b", now=5.0)
    assert m.expire(now=TTL) == ()  # nobody is older than the TTL yet
    assert m.expire(now=12.0) == ("a", "c")
    assert _ids(m.live(12.0)) == ("b",)
    assert m.heartbeat("a", now=12.0) is False  # expired peers are gone for good
    assert m.expire(now=12.0) == ()


def test_mark_draining_excludes_at_once() -> None:
    m = _membership()
    m.register(_info("a1", node="node-a"), now=0.0)
    m.register(_info("a2", node="node-a"), now=0.0)
    m.register(_info("b1", node="node-b"), now=0.0)
    assert m.mark_draining("node-a", deadline=30.0) == ("a1", "a2")
    assert m.draining() == ("a1", "a2")
    assert _ids(m.live(0.0)) == ("b1",)
    plan = m.plan(0.0)
    assert plan is not None and plan.participants == ("b1",)
    # Heartbeats and re-registration keep a draining peer draining.
    assert m.heartbeat("a1", now=1.0)
    m.register(_info("a2", node="node-a"), now=1.0)
    assert _ids(m.live(1.0)) == ("b1",)
    assert m.draining() == ("a1", "a2")
    # Asking for a draining peer explicitly does not bring it back.
    plan = m.plan(1.0, peers=("a1", "b1"))
    assert plan is not None and plan.participants == ("b1",)


def test_a_peer_registering_on_a_draining_node_drains_from_the_start() -> None:
    # A replica still starting when its node got the notice registers afterwards: it must
    # not enter a plan (its node goes at the deadline), nor may other nodes be touched.
    m = _membership()
    m.register(_info("a1", node="node-a"), now=0.0)
    m.register(_info("b1", node="node-b"), now=0.0)
    assert m.mark_draining("node-a", deadline=30.0) == ("a1",)
    m.register(_info("a2", node="node-a"), now=1.0)  # after the notice
    m.register(_info("b2", node="node-b"), now=1.0)
    assert m.draining() == ("a1", "a2")
    assert _ids(m.live(1.0)) == ("b1", "b2")
    assert _ids(m.present(1.0)) == ("a1", "a2", "b1", "b2")  # still up, e.g. to donate
    plan = m.plan(1.0)
    assert plan is not None and plan.participants == ("b1", "b2")
    # a notice for a node with no peer yet holds for the peers that come later
    assert m.mark_draining("node-c", deadline=40.0) == ()
    m.register(_info("c1", node="node-c"), now=2.0)
    assert m.draining() == ("a1", "a2", "c1")
    # peers registered without a node id are never caught by another node's drain
    m.register(_info("x", node=""), now=2.0)
    assert "x" in _ids(m.live(2.0))


def test_mark_draining_unknown_node() -> None:
    m = _membership()
    m.register(_info("a", node="node-a"), now=0.0)
    assert m.mark_draining("node-z", deadline=5.0) == ()
    assert m.draining() == ()
    assert _ids(m.live(0.0)) == ("a",)


def test_plan_increments_epoch_and_none_when_empty() -> None:
    m = _membership()
    assert m.plan(0.0) is None
    assert m.epoch == 0  # no plan, no epoch
    m.register(_info("a"), now=0.0)
    m.register(_info("b"), now=0.0)
    epochs = [m.plan(1.0).epoch for _ in range(3)]
    assert epochs == [1, 2, 3]
    assert m.epoch == 3
    assert m.plan(100.0) is None  # everyone timed out
    assert m.epoch == 3


def test_plan_contents_pass_through() -> None:
    m = _membership(max_group=4, compression="blockwise8", seed=7)
    handles = {}
    for i in range(10):
        peer = f"p{i}"
        handles[peer] = object()
        m.register(_info(peer, capacity=1.0 + i, handle=handles[peer]), now=0.0)
    plan = m.plan(0.0)
    assert plan is not None
    assert plan.epoch == 1
    assert plan.compression == "blockwise8"
    assert plan.participants == tuple(sorted(handles))
    assert dict(plan.shares) == {f"p{i}": 1.0 + i for i in range(10)}
    assert plan.share_of("p3") == 4.0
    for peer, handle in handles.items():
        assert plan.handle_of(peer) is handle
    assert plan.grid == plan_grid(sorted(handles), 4, epoch=1, seed=7)
    assert plan.grid.max_group_size <= 5


def test_plan_honours_peer_subset() -> None:
    m = _membership()
    for peer in ("a", "b", "c", "d"):
        m.register(_info(peer, capacity=2.0), now=0.0)
    m.register(_info("old"), now=-50.0)  # registered long ago, never heard from since
    plan = m.plan(0.0, peers=("c", "a", "ghost", "old"))
    assert plan is not None
    assert plan.participants == ("a", "c")
    assert {p for p, _ in plan.shares} == {"a", "c"}
    assert {p for p, _ in plan.handles} == {"a", "c"}
    assert m.plan(0.0, peers=("ghost", "old")) is None
    assert m.plan(0.0, peers=()) is None
    assert m.epoch == 1


def test_plan_mixes_groups_between_epochs() -> None:
    m = _membership(max_group=4)
    for i in range(16):
        m.register(_info(f"p{i:02d}"), now=0.0)
    first, second = m.plan(0.0), m.plan(0.0)
    groups = [{frozenset(g.members) for g in p.grid.rounds[0].groups} for p in (first, second)]
    assert groups[0] != groups[1]


# ------------------------------------------------------------------ coordinator


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _core(**config) -> tuple[CoordinatorCore, FakeClock]:
    clock = FakeClock()
    return CoordinatorCore(MembershipConfig(**{"peer_ttl_s": TTL, **config}), clock=clock), clock


def test_core_register_heartbeat_leave() -> None:
    core, clock = _core()
    assert core.register("a", handle=None) == 0
    assert core.register("b", handle=object(), node_id="n1", capacity=3.0) == 0
    assert core.live_peers() == ("a", "b")
    assert core.heartbeat("a") is True
    assert core.heartbeat("ghost") is False
    assert core.leave("a") is True
    assert core.leave("a") is False
    assert core.live_peers() == ("b",)
    plan = core.plan_round()
    assert plan is not None and plan.epoch == 1
    assert core.register("c", handle=None) == 1  # register reports the current epoch


def test_core_ttl_with_fake_clock() -> None:
    core, clock = _core()
    core.register("a", handle=None)
    core.register("b", handle=None)
    clock.t += 8.0
    assert core.heartbeat("b")
    clock.t += 2.0
    assert core.live_peers() == ("a", "b")  # a is exactly TTL old
    clock.t += 0.5
    assert core.live_peers() == ("b",)
    assert core.heartbeat("a") is False  # live_peers expired it: it must register again
    clock.t += 7.0  # b was last heard 9.5 s ago
    plan = core.plan_round()
    assert plan is not None and plan.participants == ("b",)
    clock.t += 100.0
    assert core.plan_round() is None
    assert core.live_peers() == ()


def test_core_mark_draining() -> None:
    core, clock = _core()
    core.register("a1", handle=None, node_id="node-a")
    core.register("a2", handle=None, node_id="node-a")
    core.register("b1", handle=None, node_id="node-b")
    core.register("b2", handle=None, node_id="node-b")
    assert core.mark_draining("node-a", deadline_s=30.0) == ("a1", "a2")
    assert core.membership.draining() == ("a1", "a2")
    assert core.live_peers() == ("b1", "b2")
    plan = core.plan_round()
    assert plan is not None and plan.participants == ("b1", "b2")
    assert core.mark_draining("node-b", deadline_s=1.0) == ("b1", "b2")
    assert core.plan_round() is None


def test_core_plan_round_subset_and_pass_through() -> None:
    core, clock = _core(max_group=4, compression="fp16", seed=3)
    handle = object()
    for i in range(6):
        core.register(f"p{i}", handle=handle if i == 0 else None, capacity=0.5 * (i + 1))
    plan = core.plan_round(peers=("p0", "p2", "p4", "nobody"))
    assert plan is not None
    assert plan.epoch == 1
    assert plan.participants == ("p0", "p2", "p4")
    assert plan.compression == "fp16"
    assert dict(plan.shares) == {"p0": 0.5, "p2": 1.5, "p4": 2.5}
    assert plan.handle_of("p0") is handle
    assert plan.grid == plan_grid(["p0", "p2", "p4"], 4, epoch=1, seed=3)
    full = core.plan_round()
    assert full is not None and full.epoch == 2
    assert full.participants == tuple(f"p{i}" for i in range(6))
    assert math.isclose(sum(s for _, s in full.shares), 0.5 * 21)


def _report(core: CoordinatorCore, peer: str, epoch: int, samples: int = 8):
    from moshray.cluster.coordinator.progress import ProgressReport

    return core.report(ProgressReport(peer, epoch, samples))


def test_draining_peer_finishes_its_published_step_then_stops_and_can_still_donate() -> None:
    core, clock = _core()
    core.progress.target_batch_size = 16
    for peer, node in (("a", "node-a"), ("b", "node-b")):
        core.register(peer, handle=peer, node_id=node)
        assert core.mark_ready(peer, 0)
    assert _report(core, "a", 0).plan is None
    plan = _report(core, "b", 0).plan  # 16 samples: the plan of epoch 1 over a and b
    assert plan == core.progress.plan.view_of("b")
    assert core.progress.plan.participants == ("a", "b")
    core.mark_draining("node-a", deadline_s=5.0)
    # a is in the published plan: it finishes that step (nobody waits for it) ...
    assert _report(core, "a", 0).plan == core.progress.plan.view_of("a")
    # ... then, leaving, it is told to stop rather than to resync or join the next plan.
    reply = _report(core, "a", 1)
    assert reply.stop and reply.plan is None and not reply.resync
    assert core.donor("c") == ("b", "b")  # a live donor first
    core.leave("b")
    assert core.donor("c") == ("a", "a")  # else the draining one that is still up


def test_epoch_rolls_back_when_every_holder_of_the_newest_step_is_gone() -> None:
    core, clock = _core()
    core.progress.target_batch_size = 8
    core.register("a", handle=None)
    core.register("b", handle=None)
    assert core.mark_ready("a", 0) and core.mark_ready("b", 0)
    assert _report(core, "a", 0).plan is not None  # epoch 1 planned over a alone
    core.leave("b")
    # a applied epoch 1; b's loss re-plans at once (a steps with its next micro-batch)
    _report(core, "a", 1, samples=0)
    assert core.progress.plan.epoch == 2
    assert core.mark_ready("c", 0) is False  # a holds epoch 1: c must copy it
    core.leave("a")  # a dies with epoch 1; no ready peer is left
    core.register("c", handle=None)
    assert core.mark_ready("c", 0) is True  # go on from the newest state still held
    # from the newest committed step (1; the plan of 2 was abandoned) back to 0
    assert core.membership.epoch == 0 and core.progress.rollbacks == [(1, 0)]
    assert core.stats()["rollbacks"] == 1
    assert core.mark_ready("d", 1) is False  # a state from the future is never accepted


def test_a_silent_holder_expires_so_a_joiner_is_not_stuck_when_nobody_reports() -> None:
    core, clock = _core()
    core.progress.target_batch_size = 8
    core.register("a", handle=None)
    assert core.mark_ready("a", 0)
    assert _report(core, "a", 0).plan is not None  # epoch 1 planned over a alone
    _report(core, "a", 1, samples=0)  # a applied epoch 1, then dies silently
    core.register("j", handle=None)
    assert core.mark_ready("j", 0) is False  # a may still be up: copy from it
    clock.t += TTL + 1  # no report arrives (j is syncing); a's silence outlives the TTL
    core.heartbeat("j")
    assert core.donor("j") is None
    # Expired is not gone: a peer whose heartbeats were late comes back, so its epoch
    # still blocks a rollback until it has been silent for hold_s (2 x TTL).
    assert core.mark_ready("j", 0) is False
    clock.t += TTL
    core.heartbeat("j")
    assert core.mark_ready("j", 0) is True and core.progress.rollbacks == [(1, 0)]


def test_at_stop_a_peer_that_fell_behind_resyncs_before_it_stops() -> None:
    core, clock = _core()
    core.progress.target_batch_size = 8
    for peer in ("a", "b"):
        core.register(peer, handle=None)
        assert core.mark_ready(peer, 0)
    assert _report(core, "a", 0).plan is not None  # epoch 1 over a and b (b: 0 samples)
    assert _report(core, "a", 1).plan is None  # b is slow to apply epoch 1: a grace ...
    clock.t += core.progress.grace_s + 1
    assert _report(core, "a", 1).plan.epoch == 2  # ... then epoch 2 without b
    assert core.progress.plan.participants == ("a",)
    _report(core, "a", 2, samples=0)
    core.request_stop()
    assert _report(core, "a", 2, samples=0).stop  # up to date: stops
    reply = _report(core, "b", 0, samples=0)  # b missed epoch 2: copy it first
    assert reply.resync and not reply.stop
    assert core.mark_ready("b", 2)
    assert _report(core, "b", 2, samples=0).stop
