"""The expert registry: which experts are live, where, and on which host actor (pure).

This replaces the DHT of the original Decentralized Mixture-of-Experts: expert hosts register
the experts they serve with the Coordinator, heartbeat, and expire when they stop; clients look
experts up by uid prefix (a layer, or a layer plus leading grid coordinates). No Ray calls and
no torch here: the Coordinator actor holds one ``ExpertRegistry`` and delegates to it.

Expert uids name a cell of a grid: ``<layer>.<i>.<j>`` (any number of coordinates >= 1). The
layer name contains no dot; coordinates are non-negative integers.

A host is one incarnation of an expert-hosting actor: ``host_id`` is stable across re-spawns
(it names the shard of experts), ``instance`` names the process. A newer registration for a
``host_id`` supersedes the older one (that is how a re-spawned shard takes over), and a
heartbeat or unregister from a superseded instance is refused, so a dying old copy can never
overwrite its replacement.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ActorHandle = Any

__all__ = [
    "ExpertRegistry",
    "HeartbeatStatus",
    "HostRecord",
    "choose_node",
    "grid_uids",
    "make_uid",
    "parse_uid",
    "spread_shards",
    "uid_prefix",
]


# -- uids ---------------------------------------------------------------------------------


def make_uid(layer: str, coords: Sequence[int]) -> str:
    """``"ffn0", (3, 1) -> "ffn0.3.1"``; raises ``ValueError`` on a bad layer or coordinate."""
    _check_layer(layer)
    if len(coords) == 0:
        raise ValueError(f"expert uid needs at least one grid coordinate, got {tuple(coords)}")
    for c in coords:
        if not isinstance(c, int) or isinstance(c, bool) or c < 0:
            raise ValueError(f"grid coordinates must be non-negative integers, got {tuple(coords)}")
    return ".".join([layer, *map(str, coords)])


def uid_prefix(layer: str, coords: Sequence[int] = ()) -> str:
    """Prefix matching every uid of ``layer`` whose grid coordinates start with ``coords``.

    ``uid_prefix("ffn0") == "ffn0."``, ``uid_prefix("ffn0", (3,)) == "ffn0.3."`` (the trailing
    dot keeps ``ffn0.3.`` from matching ``ffn0.31``).
    """
    _check_layer(layer)
    return ".".join([layer, *map(str, coords)]) + "."


def parse_uid(uid: str) -> tuple[str, tuple[int, ...]]:
    """``"ffn0.3.1" -> ("ffn0", (3, 1))``; raises ``ValueError`` saying what is wrong."""
    if not isinstance(uid, str):
        raise ValueError(f"expert uid must be a string like 'ffn0.3.1', got {uid!r}")
    layer, *rest = uid.split(".")
    if not rest or not layer:
        raise ValueError(f"expert uid must look like '<layer>.<i>.<j>', got {uid!r}")
    try:
        coords = tuple(int(c) for c in rest)
    except ValueError:
        raise ValueError(f"expert uid {uid!r}: grid coordinates must be integers") from None
    if any(c < 0 for c in coords) or any(not c.isdigit() for c in rest):
        raise ValueError(f"expert uid {uid!r}: grid coordinates must be non-negative integers")
    return layer, coords


def grid_uids(layer: str, grid: Sequence[int]) -> tuple[str, ...]:
    """Every uid of a full ``grid`` for ``layer``, in row-major order."""
    if not grid or any(not isinstance(m, int) or m < 1 for m in grid):
        raise ValueError(f"grid must be a non-empty tuple of positive integers, got {tuple(grid)}")
    uids: list[str] = []
    total = math.prod(grid)
    for flat in range(total):
        coords, rest = [], flat
        for m in reversed(grid):
            coords.append(rest % m)
            rest //= m
        uids.append(make_uid(layer, tuple(reversed(coords))))
    return tuple(uids)


def _check_layer(layer: str) -> None:
    if not isinstance(layer, str) or not layer or "." in layer:
        raise ValueError(f"layer name must be a non-empty string without dots, got {layer!r}")


# -- registry -------------------------------------------------------------------------------


class HeartbeatStatus(str, enum.Enum):
    """Answer to a host's heartbeat."""

    OK = "ok"  # registration refreshed
    UNKNOWN = "unknown"  # expired or never registered: register again
    SUPERSEDED = "superseded"  # a newer instance serves this host_id: stop heartbeating


@dataclass(frozen=True)
class HostRecord:
    """One live host as a lookup returns it: the handle and the matching uids it serves."""

    host_id: str
    instance: str
    uids: tuple[str, ...]
    handle: ActorHandle = field(compare=False, repr=False)
    node_id: str = ""
    generation: int = 0  # increases each time this host_id is (re-)registered


@dataclass
class _Entry:
    record: HostRecord
    expires_at: float


class ExpertRegistry:
    """Live expert hosts with expiry. Not thread-safe (the Coordinator serializes calls).

    ``clock`` returns seconds (monotonic); ``ttl_s`` is how long a registration or heartbeat
    keeps a host live. Every method expires stale hosts first, so a lookup never returns a
    host whose last heartbeat is older than ``ttl_s``. Bad arguments raise ``ValueError``.
    """

    def __init__(self, ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        if not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or ttl_s <= 0:
            raise ValueError(f"expert registry ttl_s must be a positive number, got {ttl_s!r}")
        self.ttl_s = float(ttl_s)
        self.clock = clock
        self._hosts: dict[str, _Entry] = {}
        self._owner: dict[str, str] = {}  # uid -> host_id serving it
        self._generation = 0

    # -- writes ----------------------------------------------------------------------------

    def register(self, host_id: str, uids: Iterable[str], handle: ActorHandle,
                 node_id: str = "", instance: str = "") -> int:
        """Register (or re-register) ``host_id`` serving ``uids``; returns its generation.

        A uid already served by another host moves to this one (the newest registration
        wins). Raises ``ValueError`` on an empty host id, no uids, or a malformed uid.
        """
        if not isinstance(host_id, str) or not host_id:
            raise ValueError(f"host_id must be a non-empty string, got {host_id!r}")
        uids = tuple(uids)
        if not uids:
            raise ValueError(f"host {host_id!r} registers no experts")
        for uid in uids:
            parse_uid(uid)
        now = self.clock()
        self._expire(now)
        self._drop(host_id)
        for uid in uids:
            previous = self._owner.get(uid)
            if previous is not None and previous in self._hosts:
                entry = self._hosts[previous]
                left = tuple(u for u in entry.record.uids if u != uid)
                if left:
                    entry.record = _replace_uids(entry.record, left)
                else:
                    self._drop(previous)
            self._owner[uid] = host_id
        self._generation += 1
        record = HostRecord(host_id, instance, uids, handle, node_id, self._generation)
        self._hosts[host_id] = _Entry(record, now + self.ttl_s)
        return self._generation

    def heartbeat(self, host_id: str, instance: str = "") -> HeartbeatStatus:
        """Refresh ``host_id``'s expiry if ``instance`` is the one registered."""
        now = self.clock()
        self._expire(now)
        entry = self._hosts.get(host_id)
        if entry is None:
            return HeartbeatStatus.UNKNOWN
        if entry.record.instance != instance:
            return HeartbeatStatus.SUPERSEDED
        entry.expires_at = now + self.ttl_s
        return HeartbeatStatus.OK

    def unregister(self, host_id: str, instance: str = "") -> bool:
        """Remove ``host_id`` if ``instance`` is the registered one; True if removed."""
        self._expire(self.clock())
        entry = self._hosts.get(host_id)
        if entry is None or entry.record.instance != instance:
            return False
        self._drop(host_id)
        return True

    def drop_node(self, node_id: str) -> tuple[str, ...]:
        """Forget every host on ``node_id`` (the node is gone); returns their host ids."""
        gone = tuple(h for h, e in self._hosts.items() if e.record.node_id == node_id)
        for host_id in gone:
            self._drop(host_id)
        return gone

    # -- reads -------------------------------------------------------------------------------

    def lookup(self, prefix: str = "") -> tuple[HostRecord, ...]:
        """Live hosts serving a uid that starts with ``prefix``, each with only those uids.

        Sorted by host id, uids in registration order. ``""`` matches everything.
        """
        self._expire(self.clock())
        out = []
        for host_id in sorted(self._hosts):
            record = self._hosts[host_id].record
            uids = tuple(u for u in record.uids if u.startswith(prefix))
            if uids:
                out.append(record if uids == record.uids else _replace_uids(record, uids))
        return tuple(out)

    def lookup_grid(self, layer: str, coords: Sequence[int] = ()) -> tuple[HostRecord, ...]:
        """Live hosts serving experts of ``layer`` whose coordinates start with ``coords``."""
        return self.lookup(uid_prefix(layer, coords))

    def locations(self) -> dict[str, tuple[str, str]]:
        """A snapshot of where every live expert is: ``{uid: (host_id, node_id)}``."""
        self._expire(self.clock())
        return {
            uid: (host_id, entry.record.node_id)
            for host_id, entry in self._hosts.items()
            for uid in entry.record.uids
        }

    def expire(self) -> tuple[str, ...]:
        """Drop hosts whose heartbeat is older than the TTL; returns their host ids."""
        return self._expire(self.clock())

    # -- internals ------------------------------------------------------------------------------

    def _expire(self, now: float) -> tuple[str, ...]:
        stale = tuple(h for h, e in self._hosts.items() if e.expires_at < now)
        for host_id in stale:
            self._drop(host_id)
        return stale

    def _drop(self, host_id: str) -> None:
        entry = self._hosts.pop(host_id, None)
        if entry is None:
            return
        for uid in entry.record.uids:
            if self._owner.get(uid) == host_id:
                del self._owner[uid]


def _replace_uids(record: HostRecord, uids: tuple[str, ...]) -> HostRecord:
    return HostRecord(record.host_id, record.instance, uids, record.handle, record.node_id,
                      record.generation)


# -- placement (pure) ---------------------------------------------------------------------------


def spread_shards(shards: Sequence[str], nodes: Sequence[str],
                  load: Mapping[str, int] | None = None) -> dict[str, str]:
    """Assign each shard to a node, least loaded first, so shards spread over nodes.

    ``load`` counts shards already on each node. Ties go to the earlier node in ``nodes``.
    Raises ``ValueError`` when there are shards but no nodes.
    """
    if shards and not nodes:
        raise ValueError("no spot node to place experts on")
    counts = {n: (load or {}).get(n, 0) for n in nodes}
    order = {n: i for i, n in enumerate(nodes)}
    placed = {}
    for shard in shards:
        node = min(nodes, key=lambda n: (counts[n], order[n]))
        placed[shard] = node
        counts[node] += 1
    return placed


def choose_node(nodes: Sequence[str], load: Mapping[str, int],
                avoid: Collection[str] = ()) -> str | None:
    """The least-loaded node not in ``avoid`` (ties: earlier in ``nodes``), or None."""
    candidates = [n for n in nodes if n not in avoid]
    if not candidates:
        return None
    order = {n: i for i, n in enumerate(nodes)}
    return min(candidates, key=lambda n: (load.get(n, 0), order[n]))
