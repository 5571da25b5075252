"""Notice sources that need no cloud: ``SimulatedSource`` and ``SilentSource``.

``SimulatedSource`` is for local clusters, trace replay and tests: ``trigger()`` /
``deliver()`` put a notice in a thread-safe queue that ``poll`` returns (trace replay turns a
removal into one). ``SilentSource`` is a node with no notice source (``none``, or ``auto``
that found no cloud): its polls wait and never return a notice. Both follow the
``NoticeSource`` contract (``notices/message.py``).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from moshray.autoscaler.notices.message import REBALANCE, SIMULATED, NoticeSource, PreemptionNotice


class SimulatedSource(NoticeSource):
    """Notices delivered programmatically (local clusters, trace replay, tests).

    ``trigger(notice_s)`` builds a notice for this node due ``notice_s`` seconds from now;
    ``deliver(notice)`` queues a ready-made one. Thread-safe: any thread may deliver while
    the watcher loop polls.
    """

    cloud = SIMULATED

    def __init__(self, node_id: str, *, pool: str = "", clock: Callable[[], float] = time.time):
        self.node_id = node_id
        self.pool = pool
        self.clock = clock
        self.errors = 0
        self._queue: queue.Queue[PreemptionNotice] = queue.Queue()
        self._lock = threading.Lock()

    def describe(self) -> str:
        return SIMULATED

    def trigger(self, notice_s: float, action: str = "terminate") -> PreemptionNotice:
        """Queue a notice due in ``notice_s`` seconds (``action="rebalance"``: no deadline)."""
        if not notice_s >= 0:
            raise ValueError(f"notice_s must be >= 0, got {notice_s}")
        now = self.clock()
        deadline = math.inf if action == REBALANCE else now + notice_s
        notice = PreemptionNotice(self.node_id, SIMULATED, action, deadline, now,
                                  self.describe(), self.pool)
        self._queue.put(notice)
        return notice

    def deliver(self, notice: PreemptionNotice) -> PreemptionNotice:
        """Queue ``notice`` (re-addressed to this node, marked as simulated)."""
        notice = replace(notice, node_id=self.node_id, cloud=SIMULATED, source=self.describe())
        self._queue.put(notice)
        return notice

    def poll(self, timeout_s: float) -> PreemptionNotice | None:
        if self.closed:
            return None
        try:
            if timeout_s <= 0:
                return self._queue.get_nowait()
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None


class SilentSource(NoticeSource):
    """A node with no notice source: ``none``, or ``auto`` where detection found no cloud
    (no metadata service named in the environment, no cloud in the DMI vendor strings, no
    answer from the link-local probe; ``clouds/detect.py`` logs that line). Polls wait out
    their timeout and never return a notice; ``close`` ends a waiting poll at once."""

    cloud = "none"

    def __init__(self, node_id: str, *, pool: str = "", description: str = "none",
                 **_options):
        self.node_id, self.pool, self.errors = node_id, pool, 0
        self.description = description
        self._closed_event = threading.Event()

    def describe(self) -> str:
        return self.description

    def close(self) -> None:
        super().close()
        self._closed_event.set()

    def poll(self, timeout_s: float) -> PreemptionNotice | None:
        self._closed_event.wait(max(0.0, timeout_s))
        return None
