"""Spot-trace replay: apply a schedule of ``NodeEvent``s at the right wall times.

Contract: ``TraceReplayer`` carries out each event of a schedule (see ``trace_schedule.py``)
through injected ``add_node(slot)`` / ``remove_node(slot)`` (and optional ``kill_node`` /
``notice_node``) callables and an injected clock, in the caller's thread or its own daemon
thread. A failing callable is logged and recorded (``ReplayError``), never raised.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from moshray.autoscaler.traces.schedule import NodeEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplayError:
    """A callable failed while applying ``event`` at wall ``wall_s`` (relative to replay start)."""

    wall_s: float
    event: NodeEvent
    error: str


class TraceReplayer:
    """Apply a schedule at its wall times through injected callables.

    ``add_node(slot)`` / ``remove_node(slot)`` carry out the events; ``clock``
    and ``sleep`` are injectable so tests can run on a fake clock. Time is
    measured from the moment :meth:`run` starts. Late events (the loop fell
    behind) are applied at once, in order.

    Failure behaviour: an exception from a callable is logged and recorded in
    :attr:`errors`; the replay continues with the next event. ``history`` lists
    every attempted event as ``(wall_s, event)``, failed ones included.
    """

    def __init__(
        self,
        events: Iterable[NodeEvent],
        add_node: Callable[[int], None],
        remove_node: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        *,
        skip_initial: bool = False,
        max_sleep_s: float = 0.25,
        kill_node: Callable[[int], None] | None = None,
        notice_node: Callable[[int], None] | None = None,
    ) -> None:
        """``skip_initial``: do not apply the ``at_s == 0`` adds (the caller already
        started those nodes, see :func:`initial_slots`). ``max_sleep_s`` bounds one
        sleep so a stop request is noticed within that time. ``kill_node`` carries out
        ``kill`` events (hard losses); without it they go to ``remove_node``. ``notice_node``
        carries out ``notice`` events (see :func:`with_notices`); without it they are skipped."""
        self.events: tuple[NodeEvent, ...] = tuple(sorted(events, key=lambda e: e.at_s))
        self._add = add_node
        self._remove = remove_node
        self._kill = kill_node or remove_node
        self._notice = notice_node or (lambda slot: None)
        self._clock = clock
        self._sleep = sleep
        self._skip_initial = skip_initial
        self._max_sleep_s = max_sleep_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._history: list[tuple[float, NodeEvent]] = []
        self._errors: list[ReplayError] = []

    @property
    def history(self) -> tuple[tuple[float, NodeEvent], ...]:
        """Attempted events as ``(wall seconds since run start, event)``, in order."""
        return tuple(self._history)

    @property
    def errors(self) -> tuple[ReplayError, ...]:
        """Events whose callable raised, with the error text."""
        return tuple(self._errors)

    def run(self, stop: threading.Event | None = None) -> None:
        """Apply every event at its time; return when done or when ``stop`` (or :meth:`stop`) is set.

        Never raises because of a callable; see the class docstring.
        """

        def stopped() -> bool:
            return self._stop.is_set() or (stop is not None and stop.is_set())

        t0 = self._clock()
        for ev in self.events:
            if self._skip_initial and ev.at_s == 0 and ev.kind == "add":
                log.info("trace replay: slot %d is initial, not applied", ev.slot)
                continue
            while True:
                if stopped():
                    log.info("trace replay stopped before event %s", ev)
                    return
                wait = ev.at_s - (self._clock() - t0)
                if wait <= 0:
                    break
                self._sleep(min(wait, self._max_sleep_s))
            now = self._clock() - t0
            self._history.append((now, ev))
            fn = {"add": self._add, "remove": self._remove, "kill": self._kill,
                  "notice": self._notice}[ev.kind]
            try:
                fn(ev.slot)
            except Exception as e:  # noqa: BLE001 - recorded, the replay must go on
                log.warning("trace replay: %s slot %d at %.2fs failed: %r", ev.kind, ev.slot, now, e)
                self._errors.append(ReplayError(now, ev, repr(e)))
            else:
                log.info(
                    "trace replay: %s slot %d at %.2fs (scheduled %.2fs)", ev.kind, ev.slot, now, ev.at_s
                )
        log.info("trace replay finished: %d events, %d errors", len(self._history), len(self._errors))

    def start(self) -> threading.Thread:
        """Run in a daemon thread; returns the thread. Raises RuntimeError if already started."""
        if self._thread is not None:
            raise RuntimeError("TraceReplayer already started")
        self._thread = threading.Thread(target=self.run, name="trace-replayer", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """Ask the loop to return before its next event (within ``max_sleep_s``)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread started by :meth:`start`; True if it has finished."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()
