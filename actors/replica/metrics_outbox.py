"""A replica's metrics events on their way to the Coordinator, in batches.

Contract: ``add`` never blocks and never raises. Events are sent fire-and-forget in one
``coordinator.record`` call at most every ``every_s`` (or at once with ``flush``: a
heartbeat, the training loop's end, the replica's ``close``); until then they wait here, in
order. A batch is lost only if the Coordinator is gone when it is sent (logged); the
Coordinator counts what it receives (``cluster/metrics/__init__.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import ray

log = logging.getLogger(__name__)

RECORD_EVERY_S = 1.0  # metrics events go to the Coordinator in batches, at most this often


class MetricsOutbox:
    """Batches one replica's (``peer_id``) events for ``coordinator.record``."""

    def __init__(self, peer_id: str, coordinator, every_s: float = RECORD_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.peer_id, self.coordinator = peer_id, coordinator
        self.every_s, self.clock = every_s, clock
        self.events: list = []  # not sent yet
        self.sent_at = clock()

    def add(self, events: tuple, flush: bool = False) -> None:
        """Queue ``events``; send the queue if ``flush`` or ``every_s`` passed since the last
        batch (nothing is sent while the queue is empty)."""
        self.events.extend(events)
        now = self.clock()
        if not self.events or not (flush or now - self.sent_at >= self.every_s):
            return
        batch, self.events, self.sent_at = tuple(self.events), [], now
        try:
            self.coordinator.record.remote(batch)
        except ray.exceptions.RayError as exc:
            log.info("%s: metrics not recorded (%s)", self.peer_id, type(exc).__name__)
