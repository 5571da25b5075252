"""Spot-availability traces: parse, scale onto a local cluster, replay.

Pure logic, no Ray. Three layers, each testable with plain data, each in its own module
(this module re-exports their names, so ``moshray.autoscaler.traces`` keeps working):

1. ``load_trace(path) -> Trace`` (trace_parse.py): parse a trace file into a step function
   of the live instance count (trace seconds, original counts), keeping per-node identity
   when the file has it. The accepted file formats are described there.
2. ``schedule(trace, ...) -> tuple[NodeEvent, ...]`` (trace_schedule.py): map trace time
   onto wall time, scale the count down to the slots one machine can host and emit
   add/remove events per slot.
3. ``TraceReplayer`` (trace_replay.py): apply a schedule at the right wall times through
   injected ``add_node(slot)`` / ``remove_node(slot)`` callables and an injected clock.
"""

from __future__ import annotations

from moshray.autoscaler.traces.parse import (  # noqa: F401 - re-exported
    DEFAULT_TRACE,
    SHIPPED_DIR,
    NodeKind,
    Trace,
    TraceError,
    TraceNodeEvent,
    load_trace,
    resolve_trace,
    shipped_traces,
)
from moshray.autoscaler.traces.replay import ReplayError, TraceReplayer  # noqa: F401 - re-exported
from moshray.autoscaler.traces.schedule import (  # noqa: F401 - re-exported
    NodeEvent,
    initial_slots,
    live_node_seconds,
    scale_count,
    schedule,
    with_notices,
)
