"""What ``moshray bench recovery`` reads off the Coordinator's step timings: pure functions.

A step is ``(epoch, planned_at_s, committed_at_s | None, participants)``
(``CoordinatorCore.step_timings``); replica ids are ``replica-<slot>-<n>`` (the controller's).
Split from ``recovery_trials`` (the cloud side, which waits on these) by role.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

Step = Sequence  # (epoch, planned_at_s, committed_at_s | None, participants)


def first_commit_with(steps: Sequence[Step], peer: str) -> float | None:
    """Commit time of the first committed step ``peer`` took part in (None: none yet)."""
    times = [s[2] for s in steps if s[2] is not None and peer in s[3]]
    return min(times) if times else None


def first_commit_without(steps: Sequence[Step], peer: str, after_s: float) -> float | None:
    """Commit time of the first step without ``peer`` committed after ``after_s`` (or None)."""
    times = [s[2] for s in steps if s[2] is not None and s[2] > after_s and peer not in s[3]]
    return min(times) if times else None


def first_commit_after(steps: Sequence[Step], after_s: float) -> float | None:
    """Commit time of the first step committed after ``after_s``, whoever took part."""
    times = [s[2] for s in steps if s[2] is not None and s[2] > after_s]
    return min(times) if times else None


def all_contributed(steps: Sequence[Step], peers: Sequence[str]) -> bool:
    """True once every one of ``peers`` took part in some committed step."""
    return all(first_commit_with(steps, p) is not None for p in peers)


def median_step_s(steps: Sequence[Step]) -> float | None:
    """Median seconds between consecutive plans (None with fewer than two steps)."""
    times = sorted(s[1] for s in steps)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None


def replica_of(slot: int, members: Sequence[str]) -> str | None:
    """The newest replica (highest ``n``) on ``slot``'s node among ``members`` (or None)."""
    prefix = f"replica-{slot}-"
    found = [(int(m[len(prefix):]), m) for m in members
             if m.startswith(prefix) and m[len(prefix):].isdigit()]
    return max(found)[1] if found else None
