"""What the spot NodeProviders record: cloud-neutral node records, errors and pool history.

Contract: ``NodeRecord`` is one instance as a provider sees it (its pool, market and role
read from the moshray-* tags); ``LaunchError`` is what a cloud's launch hook raises
(``capacity=True``: another pool may work); ``ProviderError`` is one error a provider
collected instead of raising it; ``PoolHistory`` is the thread-safe store of recent pool
events the ``PoolSelector`` decides from. Plain data, no cloud calls.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

from moshray.autoscaler.pools import EventKind, PoolEvent
from moshray.autoscaler.tags import MARKET_TAG, POOL_TAG, ROLE_TAG


@dataclass(frozen=True)
class NodeRecord:
    """One instance as this provider sees it (cloud-neutral)."""

    node_id: str
    live: bool  # pending or running (Ray's "non-terminated")
    running: bool
    tags: Mapping[str, str]  # Ray's tags plus the moshray-* tags
    internal_ip: str | None = None
    external_ip: str | None = None
    launched_at: float = 0.0
    # The cloud itself ended the instance (AWS state reason "Server.*", a stopped GCE spot VM).
    reclaimed: bool = False
    state_reason: str = ""
    zone: str | None = None

    @property
    def pool(self) -> str | None:
        return self.tags.get(POOL_TAG)

    @property
    def market(self) -> str | None:
        return self.tags.get(MARKET_TAG)

    @property
    def role(self) -> str | None:
        return self.tags.get(ROLE_TAG)


class LaunchError(Exception):
    """A launch attempt in one pool failed. ``capacity=True``: the pool (its capacity, spot
    price or quota) refused, so another pool may work; otherwise the request itself is bad and
    no pool will take it. ``created`` holds nodes that did start before the failure."""

    def __init__(self, code: str, message: str, capacity: bool,
                 created: tuple[NodeRecord, ...] = ()) -> None:
        super().__init__(code, message, capacity, created)
        self.code = code
        self.message = message
        self.capacity = capacity
        self.created = created

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@dataclass(frozen=True)
class ProviderError:
    """One error the provider collected instead of raising it."""

    at: float
    operation: str  # "launch" | "list" | "terminate" | "set_tags" | "fetch" | "prices"
    code: str
    message: str
    pool: str | None = None


class PoolHistory:
    """Thread-safe store of recent pool events (older than ``horizon_s`` are dropped)."""

    def __init__(self, horizon_s: float) -> None:
        self._horizon = horizon_s
        self._events: list[PoolEvent] = []
        self._lock = threading.Lock()

    def record(self, pool: str, kind: EventKind, at: float, detail: str = "") -> PoolEvent:
        event = PoolEvent(pool, EventKind(kind), at, detail)
        with self._lock:
            self._events.append(event)
            cutoff = at - self._horizon
            self._events = [e for e in self._events if e.at >= cutoff]
        return event

    def snapshot(self) -> tuple[PoolEvent, ...]:
        with self._lock:
            return tuple(self._events)
