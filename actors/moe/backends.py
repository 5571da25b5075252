"""How a DMoE layer finds and calls experts: the ``ExpertBackend`` protocol and its two backends.

Contract: ``live_experts(layer)`` gives ``{uid: host key}`` of the experts believed live;
``call_forward`` / ``call_backward`` return ``concurrent.futures.Future``s resolving to one
numpy array per uid (or failing with the host's exception); ``report_failure`` /
``report_late`` tell the backend which hosts to route around. ``RayExpertBackend`` looks
experts up in the Coordinator's registry (short-TTL cache, blacklist of hosts that just
failed or were late); ``LocalExpertBackend`` runs the same expert code in-process, no Ray.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from moshray.cluster.coordinator.expert_registry import uid_prefix

from moshray.actors.moe.expert_config import ExpertSetConfig, ExpertSpec, layout_shards
from moshray.actors.moe.expert_core import ExpertHostCore
from moshray.actors.moe.expert_errors import ExpertInputError

log = logging.getLogger(__name__)

__all__ = ["ExpertBackend", "LocalExpertBackend", "MAX_KEPT_CALLS", "RayExpertBackend"]


class ExpertBackend(Protocol):
    """How a DMoE layer finds and calls experts. Calls return ``concurrent.futures.Future``s
    that resolve to one numpy array per uid, or fail with the host's exception."""

    def live_experts(self, layer: str) -> Mapping[str, Hashable]:
        """``{uid: host key}`` of the experts of ``layer`` believed live now."""

    def call_forward(self, host: Hashable, uids: tuple[str, ...],
                     inputs: tuple[np.ndarray, ...]) -> concurrent.futures.Future: ...

    def call_backward(self, host: Hashable, uids: tuple[str, ...], inputs: tuple[np.ndarray, ...],
                      grads: tuple[np.ndarray, ...]) -> concurrent.futures.Future: ...

    def report_failure(self, host: Hashable, exc: BaseException) -> None:
        """A call to ``host`` raised ``exc`` (not a timeout)."""

    def report_late(self, host: Hashable) -> None:
        """A call to ``host`` missed its deadline."""


def _done(fn: Callable[[], Any]) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        future.set_result(fn())
    except Exception as exc:  # noqa: BLE001 - delivered through the future like a remote error
        future.set_exception(exc)
    return future


class LocalExpertBackend:
    """Experts computed in this process by ``ExpertHostCore``s (no Ray): the baseline and the
    reference. Calls run synchronously when made, so results are deterministic."""

    def __init__(self, hosts: Mapping[str, ExpertHostCore]):
        self.hosts = dict(hosts)
        self.failures: list[tuple[Hashable, str]] = []

    @classmethod
    def from_config(cls, config: ExpertSetConfig) -> LocalExpertBackend:
        """Fresh experts with the same layout and initial weights as the remote set."""
        return cls({h: ExpertHostCore(u, config.spec) for h, u in layout_shards(config).items()})

    @classmethod
    def from_states(cls, states: Mapping[str, dict], spec: ExpertSpec) -> LocalExpertBackend:
        """Experts restored from ``ExpertActor.snapshot()`` states, keyed by host id."""
        return cls({h: ExpertHostCore(s["uids"], spec, s) for h, s in states.items()})

    def live_experts(self, layer: str) -> dict[str, Hashable]:
        prefix = uid_prefix(layer)
        return {u: h for h, core in self.hosts.items() for u in core.uids if u.startswith(prefix)}

    def call_forward(self, host, uids, inputs):
        return _done(lambda: self.hosts[host].forward(uids, inputs))

    def call_backward(self, host, uids, inputs, grads):
        return _done(lambda: self.hosts[host].backward(uids, inputs, grads))

    def report_failure(self, host, exc) -> None:
        self.failures.append((host, type(exc).__name__))

    def report_late(self, host) -> None:
        self.failures.append((host, "late"))


class RayExpertBackend:
    """Experts found through the Coordinator's registry and called as Ray actors.

    Lookups are cached per layer for ``ttl_s`` (a failed lookup keeps the stale table). A host
    instance whose call raised (died, unreachable) is left out of routing for ``blacklist_s``
    or until the registry shows a new instance for it (a re-spawn); one that was late, for
    ``late_penalty_s`` (a node killed without notice hangs until Ray declares it dead, and
    without the penalty every step would wait out ``timeout_after_k_min_s`` for it).
    Thread-safe. Use it from a
    worker thread, not an async actor's event loop (lookups block).
    """

    def __init__(self, coordinator, ttl_s: float = 1.0, blacklist_s: float = 30.0,
                 late_penalty_s: float = 3.0, lookup_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.coordinator = coordinator
        self.ttl_s = ttl_s
        self.blacklist_s = blacklist_s
        self.late_penalty_s = late_penalty_s
        self.lookup_timeout_s = lookup_timeout_s
        self.clock = clock
        self._lock = threading.Lock()
        self._tables: dict[str, tuple[float, dict[str, tuple[str, str]]]] = {}
        self._handles: dict[tuple[str, str], Any] = {}
        self._dead: dict[tuple[str, str], float] = {}
        self._calls: list[tuple[str, float]] = []  # (outcome, seconds) not yet taken
        self.lookups = 0

    def live_experts(self, layer: str) -> dict[str, Hashable]:
        import ray

        now = self.clock()
        with self._lock:
            cached = self._tables.get(layer)
        if cached is None or cached[0] <= now:
            try:
                records = ray.get(self.coordinator.lookup_experts.remote(uid_prefix(layer)),
                                  timeout=self.lookup_timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                log.warning("expert lookup for %s failed (%s); using the cached table", layer,
                            type(exc).__name__)
                records = None
            with self._lock:
                self.lookups += 1
                if records is not None:
                    table = {}
                    for r in records:
                        key = (r.host_id, r.instance)
                        self._handles[key] = r.handle
                        table.update({u: key for u in r.uids})
                    cached = (now + self.ttl_s, table)
                    self._tables[layer] = cached
                elif cached is None:
                    return {}
        with self._lock:
            self._dead = {key: t for key, t in self._dead.items() if t > now}
            return {u: key for u, key in cached[1].items() if key not in self._dead}

    def call_forward(self, host, uids, inputs):
        return self._handles[host].forward.remote(uids, inputs).future()

    def call_backward(self, host, uids, inputs, grads):
        return self._handles[host].backward.remote(uids, inputs, grads).future()

    def report_failure(self, host, exc) -> None:
        if isinstance(exc, ExpertInputError):
            return  # our request was bad; the host is fine
        with self._lock:
            self._dead[host] = self.clock() + self.blacklist_s
            log.warning("expert host %s failed (%s); routing around it", host[0],
                        type(exc).__name__)

    def report_late(self, host) -> None:
        with self._lock:
            until = self.clock() + self.late_penalty_s
            self._dead[host] = max(self._dead.get(host, until), until)

    def record_calls(self, calls: Sequence[tuple[str, float]]) -> None:
        """Keep ``(outcome, seconds)`` of expert calls until :meth:`take_calls` (bounded)."""
        with self._lock:
            self._calls.extend(calls)
            del self._calls[:-MAX_KEPT_CALLS]

    def take_calls(self) -> list[tuple[str, float]]:
        """The calls recorded since the last take (for metrics), oldest first."""
        with self._lock:
            calls, self._calls = self._calls, []
        return calls


MAX_KEPT_CALLS = 10_000  # expert-call records a backend keeps between two takes
