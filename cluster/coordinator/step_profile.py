"""Where a replica's time goes between two global steps: ``StepPhases`` (one replica, one
step, sent to the Coordinator with the step's metrics events) and ``StepProfile`` (the
Coordinator's bounded record of them, summarized per phase).

The phases of one replica's step, in seconds of its wall clock (they add up to ``wall_s``):

* ``compute_s``: in the training loop's thread between micro-batches (forward, backward,
  the data feed, the thread hop to the replica's event loop and back);
* ``control_s``: in ``after_micro_batch`` outside the step (reports, replies, snapshots);
* ``round_s``: the all-reduce (the loop waits for it; 0 for an overlapped step, whose
  round ran in the background: ``overlapped``);
* ``apply_s``: the optimizer step, the commit and its digest.

``plan_lag_s`` is how long the plan waited in the replica before the step began (the rest
of the micro-batch in flight when it arrived); ``round_phases`` the averager's own split of
``round_s`` (put, reduce, publish, gather, fetch, cpu). Pure data, no Ray.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass

PHASES = ("compute_s", "control_s", "round_s", "apply_s")


@dataclass(frozen=True)
class StepPhases:
    """One replica's time between its previous global step and the end of ``epoch``."""

    epoch: int
    wall_s: float
    compute_s: float
    control_s: float
    round_s: float
    apply_s: float
    plan_lag_s: float
    samples: int
    micro: int
    overlapped: bool = False
    round_phases: tuple[tuple[str, float], ...] = ()
    rounds: int = 0  # the Moshpit rounds of the step's all-reduce (``AllReduceReport.rounds``)

    def __post_init__(self) -> None:
        for name in ("wall_s", "plan_lag_s") + PHASES:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name} must be a non-negative number of seconds, "
                                 f"got {value!r}")


class StepProfile:
    """The last ``keep`` ``StepPhases`` the replicas sent; ``summary`` gives, per phase, the
    median over steps and the share of the summed wall time. Steps before ``since_epoch``
    (start-up, a resync) can be left out of a summary."""

    def __init__(self, keep: int = 4000):
        self.steps: collections.deque[StepPhases] = collections.deque(maxlen=keep)

    def add(self, phases: StepPhases) -> None:
        self.steps.append(phases)

    def summary(self, since_epoch: int = 0) -> dict:
        """``{"steps": n, "median_s": {phase: s}, "share": {phase: fraction of wall},
        "round_phases_median_s": {...}, "samples_median", "micro_median", "overlapped",
        "rounds_max"}`` (``rounds_max``: the most Moshpit rounds a step's all-reduce took);
        ``steps`` 0 and empty dicts when nothing was recorded."""
        rows = [s for s in self.steps if s.epoch > since_epoch]
        if not rows:
            return {"steps": 0, "median_s": {}, "share": {}, "round_phases_median_s": {}}
        wall = sum(r.wall_s for r in rows) or 1.0
        names = ("wall_s", "plan_lag_s") + PHASES
        median = {n: statistics.median(getattr(r, n) for r in rows) for n in names}
        share = {n: sum(getattr(r, n) for r in rows) / wall for n in PHASES}
        parts: dict[str, list[float]] = collections.defaultdict(list)
        for r in rows:
            for name, seconds in r.round_phases:
                parts[name].append(seconds)
        return {
            "steps": len(rows),
            "median_s": median,
            "share": share,
            "round_phases_median_s": {n: statistics.median(v) for n, v in sorted(parts.items())},
            "samples_median": statistics.median(r.samples for r in rows),
            "micro_median": statistics.median(r.micro for r in rows),
            "overlapped": sum(r.overlapped for r in rows),
            "rounds_max": max(r.rounds for r in rows),
        }


class PhaseClock:
    """Splits one replica's wall time into the phases above as its step manager hands
    control back and forth: ``enter`` (the loop calls in after a micro-batch), ``plan_arrived``,
    ``step_begins``, ``step_ends`` (returns the step's ``StepPhases``) and ``leave`` (back to
    the loop). ``clock`` is injected (``time.monotonic``)."""

    def __init__(self, clock):
        self.clock = clock
        self._mark: float | None = None  # the last hand-over
        self._since: float | None = None  # the end of the previous step
        self._compute = self._control = 0.0
        self._plan_at: float | None = None
        self._began: float | None = None
        self._lag = 0.0

    def _lap(self) -> float:
        now = self.clock()
        spent = 0.0 if self._mark is None else now - self._mark
        self._mark = now
        if self._since is None:
            self._since = now
        return spent

    def enter(self) -> None:
        self._compute += self._lap()

    def leave(self) -> None:
        self._control += self._lap()

    def plan_arrived(self) -> None:
        if self._plan_at is None:
            self._plan_at = self.clock()

    def step_begins(self) -> None:
        self._control += self._lap()
        self._began = self._mark
        self._lag = 0.0 if self._plan_at is None else max(0.0, self._mark - self._plan_at)

    def step_ends(self, epoch: int, round_s: float, samples: int, micro: int,
                  overlapped: bool = False,
                  round_phases: tuple[tuple[str, float], ...] = (),
                  rounds: int = 0) -> StepPhases:
        if self._began is None:  # step_begins was not called: the step starts now
            self.step_begins()
        took = self._lap()
        round_s = 0.0 if overlapped else min(max(0.0, round_s), took)
        phases = StepPhases(
            epoch=epoch, wall_s=max(0.0, self._mark - self._since), compute_s=self._compute,
            control_s=self._control, round_s=round_s, apply_s=took - round_s,
            plan_lag_s=self._lag, samples=samples, micro=micro, overlapped=overlapped,
            round_phases=round_phases, rounds=rounds)
        self._since, self._began, self._plan_at = self._mark, None, None
        self._compute = self._control = 0.0
        return phases
