"""`moshray bench goodput`, pure part 1: one system's step records -> its reported figures.

No Ray, no I/O. A system reports :class:`Progress` rows (one per optimizer step, times in
seconds after the window start) and the moments it restarted from a checkpoint; from them
:func:`summarize` derives the useful cumulative-sample curve (rolled-back work is not useful),
the stall time, the training loss reached and the step count over ``[0, duration]``;
:func:`participation` says how many replicas took part in moshray's steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

LAST_STEPS_FOR_LOSS = 10


@dataclass(frozen=True)
class Progress:
    """One optimizer step of a system: ``t_s`` seconds after the window start, the step number,
    the global samples behind it, and its mean training loss (None if unknown)."""

    t_s: float
    step: int
    samples: int
    loss: float | None


@dataclass(frozen=True)
class SystemResult:
    """What the benchmark reports for one system over ``[0, duration_s]``."""

    name: str
    samples: int  # useful samples at the end of the window
    samples_processed: int  # every sample computed, rolled-back work included
    goodput: float  # samples / duration_s
    final_loss: float | None
    stall_s: float
    steps: int  # useful steps at the end of the window
    curve: tuple[tuple[float, int], ...]  # (t_s, useful cumulative samples), one point per event


def useful_curve(records: Sequence[Progress], rewinds: Sequence[tuple[float, int]] = (),
                 duration_s: float | None = None) -> tuple[tuple[float, int], ...]:
    """Cumulative useful samples over time, starting at ``(0, 0)``.

    ``records`` are steps in time order; ``rewinds`` are ``(t_s, step)`` moments at which the
    system restarted from the state after ``step`` (a rollback to a checkpoint; ``step = 0`` is
    a fresh start). A step number at or below the previous one also implies a rollback to the
    step before it. After a rollback to step ``k`` the count falls back to the samples of steps
    ``1..k`` of the surviving lineage; samples of the lost steps are not useful. Events after
    ``duration_s`` (if given) are ignored.
    """
    return _lineage(records, rewinds, duration_s)[0]


def _lineage(records: Sequence[Progress], rewinds: Sequence[tuple[float, int]],
             duration_s: float | None) -> tuple[tuple[tuple[float, int], ...], int]:
    """``(useful_curve, last useful step)``; see :func:`useful_curve`."""
    events: list[tuple[float, int, Progress | None, int]] = []  # (t, order, record, rewind)
    for r in records:
        events.append((r.t_s, 1, r, 0))
    for t, k in rewinds:
        events.append((t, 0, None, k))  # at equal times the rewind comes first
    events.sort(key=lambda e: (e[0], e[1]))
    cum_at: dict[int, int] = {0: 0}  # step -> cumulative useful samples after it (lineage)
    top = 0  # highest step in the current lineage
    curve: list[tuple[float, int]] = [(0.0, 0)]
    for t, _, record, rewind_to in events:
        if duration_s is not None and t > duration_s:
            break
        if record is None:
            top = _rewind(cum_at, min(rewind_to, top))
        else:
            if record.step <= top:
                top = _rewind(cum_at, record.step - 1)
            base = cum_at.get(record.step - 1, cum_at[top])
            cum_at[record.step] = base + record.samples
            top = record.step
        curve.append((max(t, 0.0), cum_at[top]))
    return tuple(curve), top


def _rewind(cum_at: dict[int, int], step: int) -> int:
    """Drop lineage entries after ``step``; returns the new top (the highest kept <= step)."""
    for s in [s for s in cum_at if s > step]:
        del cum_at[s]
    return max(cum_at)


def stall_seconds(curve: Sequence[tuple[float, int]], duration_s: float, gap_s: float) -> float:
    """Total length of the gaps >= ``gap_s`` between new highs of the useful sample count.

    The gaps from 0 to the first new high and from the last one to ``duration_s`` count too,
    so a system that never progresses stalls for the whole window. Work that only redoes lost
    steps is not a new high.
    """
    if gap_s <= 0:
        raise ValueError(f"gap_s must be > 0, got {gap_s}")
    highs = [0.0]
    best = 0
    for t, cum in curve:
        if t > duration_s:
            break
        if cum > best:
            best = cum
            highs.append(t)
    highs.append(duration_s)
    return sum(b - a for a, b in zip(highs, highs[1:]) if b - a >= gap_s)


def final_loss(records: Sequence[Progress], duration_s: float,
               last: int = LAST_STEPS_FOR_LOSS) -> float | None:
    """Mean training loss of the last ``last`` steps at or before ``duration_s`` (None if none)."""
    losses = [r.loss for r in records if r.t_s <= duration_s and r.loss is not None
              and math.isfinite(r.loss)]
    tail = losses[-last:]
    return sum(tail) / len(tail) if tail else None


def summarize(name: str, records: Sequence[Progress], duration_s: float, gap_s: float,
              rewinds: Sequence[tuple[float, int]] = ()) -> SystemResult:
    """Reduce one system's step records to the reported figures over ``[0, duration_s]``."""
    curve, steps = _lineage(records, rewinds, duration_s)
    inside = [r for r in records if r.t_s <= duration_s]
    samples = curve[-1][1]
    return SystemResult(
        name=name, samples=samples, samples_processed=sum(r.samples for r in inside),
        goodput=samples / duration_s if duration_s > 0 else 0.0,
        final_loss=final_loss(records, duration_s),
        stall_s=stall_seconds(curve, duration_s, gap_s), steps=steps, curve=curve)


def participation(records: Sequence[Progress], peers: Sequence[int], duration_s: float
                  ) -> dict:
    """How many replicas took part in each of moshray's global steps inside ``[0,
    duration_s]`` (``records`` and ``peers`` row by row, the Coordinator's history): the mean
    and largest count per step, the steps at each count, and the shares of steps and of
    samples that had more than one participant (a swarm of one never averages, so a goodput
    figure from such steps says nothing about its links). ``mean``/``max`` are None without
    steps."""
    if len(records) != len(peers):
        raise ValueError(f"{len(records)} records but {len(peers)} peer counts")
    rows = [(r, int(p)) for r, p in zip(records, peers) if r.t_s <= duration_s]
    by_count: dict[str, int] = {}
    for _, p in rows:
        by_count[str(p)] = by_count.get(str(p), 0) + 1
    samples = sum(r.samples for r, _ in rows)
    multi = [(r, p) for r, p in rows if p > 1]
    return {
        "steps": len(rows),
        "mean": sum(p for _, p in rows) / len(rows) if rows else None,
        "max": max((p for _, p in rows), default=None),
        "steps_by_peers": dict(sorted(by_count.items(), key=lambda kv: int(kv[0]))),
        "multi_step_share": len(multi) / len(rows) if rows else None,
        "multi_sample_share": sum(r.samples for r, _ in multi) / samples if samples else None,
    }
