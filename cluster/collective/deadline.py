"""Adaptive round deadlines: how long a group round waits, from how long rounds took.

A fixed ``training.round_timeout_s`` is either too short for a slow link (every step drops
the slow peer) or far too long for a dead one that probing misses (every survivor waits the
whole timeout). Hivemind's users asked for deadlines that follow the swarm (hivemind issue
#676). Here each ``Averager`` keeps, per round index of the plan, the durations of its
recent rounds (from the round's start until this peer held its result: the arrival of the
last contribution and result it waited for) and gives the next round::

    timeout = min(cap, max(floor_s, margin * quantile(recent durations, q)))

``cap`` is the configured ``round_timeout_s``: the adaptive deadline never waits longer than
the fixed one did. Until ``min_samples`` rounds were seen the cap is used. A round that ran
into its deadline records its full duration, so a deadline that was too tight widens by
``margin`` on the next rounds: it corrects itself upwards at once and downwards as the
window forgets. Pure code; time is the caller's.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DeadlinePolicy:
    """How the adaptive deadline is computed (see module docstring). Raises ValueError
    naming the field for a setting out of range."""

    quantile: float = 0.9
    margin: float = 3.0
    # A shorter wait buys little and would drop a peer merely descheduled for a moment.
    floor_s: float = 5.0
    window: int = 20  # recent rounds remembered per round index
    min_samples: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.quantile <= 1:
            raise ValueError(f"DeadlinePolicy.quantile must be in (0, 1], got {self.quantile}")
        if not self.margin >= 1:  # NaN fails too
            raise ValueError(f"DeadlinePolicy.margin must be >= 1, got {self.margin}")
        if not self.floor_s > 0:
            raise ValueError(f"DeadlinePolicy.floor_s must be > 0, got {self.floor_s}")
        if self.window < 1 or self.min_samples < 1 or self.min_samples > self.window:
            raise ValueError("DeadlinePolicy needs 1 <= min_samples <= window, got "
                             f"min_samples={self.min_samples} window={self.window}")


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear interpolation between order statistics).
    Raises ValueError for no values."""
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def adaptive_timeout(durations: Sequence[float], cap: float, policy: DeadlinePolicy) -> float:
    """The next round's timeout from recent round ``durations`` (seconds, newest last):
    ``cap`` while fewer than ``policy.min_samples``, else the module's formula over the
    newest ``policy.window``. Non-finite or negative durations are ignored. Never more
    than ``cap``; never less than ``min(cap, policy.floor_s)``."""
    clean = [d for d in durations if math.isfinite(d) and d >= 0][-policy.window:]
    if len(clean) < policy.min_samples:
        return cap
    return min(cap, max(policy.floor_s, policy.margin * quantile(clean, policy.quantile)))


class RoundTimes:
    """Recent round durations per round index, and the timeout they give
    (``adaptive_timeout``). ``policy`` None: always the cap (the fixed deadline)."""

    def __init__(self, policy: DeadlinePolicy | None = DeadlinePolicy()):
        self.policy = policy
        size = policy.window if policy else 1
        self._seen: dict[int, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=size))

    def record(self, round_index: int, seconds: float) -> None:
        self._seen[round_index].append(seconds)

    def timeout(self, round_index: int, cap: float) -> float:
        if self.policy is None:
            return cap
        return adaptive_timeout(list(self._seen.get(round_index, ())), cap, self.policy)
