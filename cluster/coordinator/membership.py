"""Who takes part in the next round: pure membership logic behind the Coordinator.

Peers register, heartbeat, leave, or are marked draining (a preemption notice for their
node). A peer not heard from for ``peer_ttl_s`` is considered dead. ``plan`` turns the live,
non-draining peers into a ``RoundPlan`` for the next epoch. Time is injected (``now``
arguments) so all of this is testable with plain data.

Shares (DeDLOC load balancing): a heartbeat may carry the peer's measured throughput
(``shares.ThroughputMeter``); the newest value per peer is kept, and a plan's share of a
peer is its declared ``PeerInfo.capacity`` times ``shares.relative_shares`` of the
chosen peers' measurements (1.0 without one).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from moshray.cluster.collective.shares import relative_shares
from moshray.cluster.collective.grid import DEFAULT_MAX_GROUP, plan_grid
from moshray.cluster.messages import PeerInfo, RoundPlan

# How often a replica heartbeats the Coordinator (``StepManager._beat``); it also reports
# after every micro-batch, and either call counts as heard from.
HEARTBEAT_S = 1.0
# A node marked draining is remembered (its later peers drain too) until this long past its
# deadline: it is gone by then, and the marks of a long run's nodes do not pile up.
DRAINED_KEEP_S = 60.0


@dataclass(frozen=True)
class MembershipConfig:
    max_group: int = DEFAULT_MAX_GROUP
    peer_ttl_s: float = 30.0
    compression: str = "none"
    seed: int = 0
    min_part: int = 1  # see RoundPlan.min_part (partition.MIN_PART: small tensors, one owner)
    zone_aware: bool = True  # see grid.plan_zoned (only peers that declare a zone count)

    def __post_init__(self) -> None:
        if self.max_group < 2:
            raise ValueError(f"max_group must be >= 2, got {self.max_group}")
        if not self.peer_ttl_s > 0:  # also rejects NaN
            raise ValueError(f"peer_ttl_s must be positive, got {self.peer_ttl_s}")
        if self.min_part < 1:
            raise ValueError(f"min_part must be >= 1, got {self.min_part}")


@dataclass
class _Member:
    info: PeerInfo
    last_seen: float
    draining_deadline: float | None = None
    throughput: float | None = None  # newest measured bytes/s (see shares.py)


@dataclass
class Membership:
    config: MembershipConfig = field(default_factory=MembershipConfig)
    epoch: int = 0
    _members: dict[str, _Member] = field(default_factory=dict)
    # node id -> the draining deadline of the latest notice or drain for it: peers that
    # register there later (a replica still starting when the notice came) drain too
    _draining_nodes: dict[str, float] = field(default_factory=dict)
    _draining_record: list | None = field(default=None, repr=False, compare=False)
    # the members' ids in order, a new list when one joins or goes (``ordered``)
    _sorted: list[str] | None = field(default=None, repr=False, compare=False)
    # node id -> the members on it (``mark_draining`` reads one node's, not every member)
    _by_node: dict[str, list[str]] = field(default_factory=dict, repr=False, compare=False)
    # no member was last seen before this (a lower bound: heartbeats only raise it), so
    # ``expire`` has nothing to drop before ``_seen_floor + peer_ttl_s``
    _seen_floor: float = field(default=float("-inf"), repr=False, compare=False)
    # called with a peer's id after it registers, leaves, expires or starts draining (what
    # decides whether it may be in a plan): ``ProgressTracker`` keeps its counts with it
    on_change: Callable[[str], None] | None = field(default=None, repr=False, compare=False)

    def _changed(self, peer_id: str) -> None:
        if self.on_change is not None:
            self.on_change(peer_id)

    def register(self, info: PeerInfo, now: float) -> None:
        """Add or refresh a peer (re-registering clears nothing but its liveness). A peer
        on a node already marked draining (``mark_draining``) is draining from the start:
        it never enters a plan, however late it registers before the node goes."""
        old = self._members.get(info.peer_id)
        if old is None:
            self._reorder(info.peer_id, add=True)
        elif old.info.node_id != info.node_id:
            self._unplace(old.info)
        on_node = self._by_node.setdefault(info.node_id, [])
        if info.peer_id not in on_node:  # (a node holds a few peers: lists are small)
            on_node.append(info.peer_id)
        self._seen_floor = min(self._seen_floor, now) if self._members else now
        draining = old.draining_deadline if old else None
        if draining is None and info.node_id:
            draining = self._draining_nodes.get(info.node_id)
        self._members[info.peer_id] = _Member(
            info, now, draining, old.throughput if old else None
        )
        self._changed(info.peer_id)

    def heartbeat(self, peer_id: str, now: float, throughput: float | None = None) -> bool:
        """Refresh a peer (and its measured ``throughput``, if given); False if it is
        unknown (it should register again)."""
        member = self._members.get(peer_id)
        if member is None:
            return False
        member.last_seen = now
        if throughput is not None:
            member.throughput = float(throughput)
        return True

    def leave(self, peer_id: str) -> bool:
        member = self._members.pop(peer_id, None)
        if member is None:
            return False
        self._unplace(member.info)
        self._reorder(peer_id, add=False)
        self._changed(peer_id)
        return True

    def _unplace(self, info: PeerInfo) -> None:
        on_node = self._by_node.get(info.node_id)
        if on_node is not None and info.peer_id in on_node:
            on_node.remove(info.peer_id)
            if not on_node:
                del self._by_node[info.node_id]

    def _reorder(self, peer_id: str, add: bool) -> None:
        """``ordered`` after ``peer_id`` joined (``add``) or went: a new list, copied with
        one id put in or taken out (a memory copy, not a sort)."""
        if self._sorted is None:
            return
        order = list(self._sorted)
        at = bisect.bisect_left(order, peer_id)
        if add:
            order.insert(at, peer_id)
        elif at < len(order) and order[at] == peer_id:
            del order[at]
        self._sorted = order

    def ordered(self) -> list[str]:
        """The members' ids, sorted: the same list object until one joins or goes (O(1) per
        call; a caller may compare it by identity to know nothing changed). Do not mutate
        it."""
        if self._sorted is None:
            self._sorted = sorted(self._members)
        return self._sorted

    def is_draining(self, peer_id: str) -> bool:
        """``peer_id`` is a member marked draining (O(1); ``draining`` lists them all)."""
        member = self._members.get(peer_id)
        return member is not None and member.draining_deadline is not None

    def mark_draining(self, node_id: str, deadline: float,
                      now: float | None = None) -> tuple[str, ...]:
        """Mark every peer on ``node_id`` draining, and those that register there later
        (until ``DRAINED_KEEP_S`` past ``deadline``); returns the affected peer ids (of
        those registered now). With ``now``, first forgets the nodes past that keep
        (O(nodes marked))."""
        if now is not None:
            for old in [n for n, d in self._draining_nodes.items() if d + DRAINED_KEEP_S < now]:
                del self._draining_nodes[old]
                self._draining_record = None
        if node_id:
            self._draining_nodes[node_id] = deadline
            self._draining_record = None
        hit = sorted(self._by_node.get(node_id, ()))
        for peer_id in hit:
            self._members[peer_id].draining_deadline = deadline
        for peer_id in hit:
            self._changed(peer_id)
        return tuple(hit)

    def expire(self, now: float) -> tuple[str, ...]:
        """Drop peers silent for longer than the TTL; returns who was dropped. Looks at the
        members only when the longest-silent one may be over the TTL (``_seen_floor``), so
        a call is O(1) between such moments."""
        if now - self._seen_floor <= self.config.peer_ttl_s:
            return ()
        gone = [p for p, m in self._members.items() if now - m.last_seen > self.config.peer_ttl_s]
        for p in gone:
            self._unplace(self._members.pop(p).info)
        if gone:
            self._sorted = None
        self._seen_floor = min((m.last_seen for m in self._members.values()), default=now)
        for p in gone:
            self._changed(p)
        return tuple(sorted(gone))

    def within_ttl(self, now: float) -> bool:
        """Every member was heard from within the TTL at ``now`` (O(1); always true right
        after ``expire(now)``): the live peers are then the members not draining."""
        return now - self._seen_floor <= self.config.peer_ttl_s

    def live(self, now: float) -> tuple[PeerInfo, ...]:
        """Peers that may take part in the next round (alive and not draining)."""
        return tuple(self.heard(now, draining=False))

    def present(self, now: float) -> tuple[PeerInfo, ...]:
        """Peers heard from within the TTL, draining ones included (they are still up until
        their deadline, e.g. to hand their state to a joiner)."""
        return tuple(self.heard(now))

    def heard(self, now: float, draining: bool = True) -> Iterator[PeerInfo]:
        """``present`` (or, without ``draining`` peers, ``live``) one peer at a time, in
        id order: a caller that stops at the first it wants pays for what it read."""
        members, ttl = self._members, self.config.peer_ttl_s
        for p in self.ordered():
            m = members[p]
            if now - m.last_seen <= ttl and (draining or m.draining_deadline is None):
                yield m.info

    def draining_nodes(self) -> list[list]:
        """``[[node id, deadline], ...]`` of every node marked draining, sorted (a record
        for a restart: ``mark_draining`` each again). The same list until one is marked;
        do not mutate it."""
        if self._draining_record is None:
            self._draining_record = sorted([n, d] for n, d in self._draining_nodes.items())
        return self._draining_record

    def is_up(self, peer_id: str, now: float, draining: bool = True) -> bool:
        """``peer_id`` is a member heard from within the TTL at ``now`` (one of ``present``;
        without ``draining``, one of ``live``). O(1)."""
        m = self._members.get(peer_id)
        return m is not None and now - m.last_seen <= self.config.peer_ttl_s and \
            (draining or m.draining_deadline is None)

    def info(self, peer_id: str) -> PeerInfo | None:
        """What ``peer_id`` registered with (None if it is not a member)."""
        m = self._members.get(peer_id)
        return None if m is None else m.info

    def is_member(self, peer_id: str) -> bool:
        """Registered and not yet left or expired (draining or not)."""
        return peer_id in self._members

    def members(self) -> tuple[str, ...]:
        """Registered peers not yet left or expired (draining or not), sorted."""
        return tuple(self.ordered())

    def draining(self) -> tuple[str, ...]:
        return tuple(sorted(p for p, m in self._members.items() if m.draining_deadline is not None))

    def plan(self, now: float, peers: tuple[str, ...] | None = None,
             branch: int = 0) -> RoundPlan | None:
        """The plan of the next epoch over the live peers (or the given subset of them), on
        the history's ``branch`` (see ``RoundPlan.branch``).

        Returns None when no live peer is left. Increments the epoch.
        """
        live = {p.peer_id: p for p in self.live(now)}
        chosen = [live[p] for p in (peers if peers is not None else live) if p in live]
        if not chosen:
            return None
        self.epoch += 1
        ids = [p.peer_id for p in chosen]
        # peers that declared a zone (PeerInfo.zone) average inside it first (grid.py)
        declared = {p.peer_id: p.zone for p in chosen if p.zone}
        grid = plan_grid(ids, self.config.max_group, epoch=self.epoch, seed=self.config.seed,
                         zones=declared if self.config.zone_aware else {})
        measured = relative_shares({p: self._members[p].throughput for p in ids})
        return RoundPlan(
            epoch=self.epoch,
            grid=grid,
            shares=tuple((p.peer_id, p.capacity * measured[p.peer_id]) for p in chosen),
            handles=tuple((p.peer_id, p.handle) for p in chosen),
            compression=self.config.compression,
            min_part=self.config.min_part,
            zones=tuple(sorted(declared.items())),
            branch=branch,
        )
