"""How many samples a global step really averaged (pure bookkeeping for the tracker).

A plan is made when the samples the ready peers reported reach the target batch, but the
peers keep computing while the plan reaches them (DeDLOC: the target is a minimum), and
each averages everything it accumulated up to its step. The plan-time count is a lower
bound; each participant then reports what it put into the step (``ProgressReport.
contributed``), and a step's samples are, per participant, the larger of the two. A
participant whose report never comes (it died) keeps its plan-time count. The totals are
kept as the reports come (O(1) each), not summed over the participants again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

KEEP_EPOCHS = 64  # steps whose counts may still be corrected (reports come right after)


@dataclass
class StepSamples:
    _planned: dict[int, dict[str, int]] = field(default_factory=dict)
    _contributed: dict[int, dict[str, int]] = field(default_factory=dict)
    _totals: dict[int, int] = field(default_factory=dict)  # epoch -> ``total(epoch)``

    def planned(self, epoch: int, per_peer: dict[str, int]) -> None:
        """The plan of ``epoch`` was made over ``per_peer`` (peer -> samples reported)."""
        self._planned[epoch] = dict(per_peer)
        self._contributed.pop(epoch, None)
        self._totals[epoch] = sum(max(n, 0) for n in per_peer.values())
        for old in [e for e in self._planned if e <= epoch - KEEP_EPOCHS]:
            self._planned.pop(old, None)
            self._contributed.pop(old, None)
            self._totals.pop(old, None)

    def contributed(self, epoch: int, peer: str, samples: int) -> int | None:
        """``peer`` put ``samples`` into step ``epoch``: that step's corrected count, or
        None if the step is unknown (too old, or ``peer`` was not planned in it)."""
        planned = self._planned.get(epoch)
        if planned is None or peer not in planned or samples < 0:
            return None
        mine = self._contributed.setdefault(epoch, {})
        before = max(planned[peer], mine.get(peer, 0))
        mine[peer] = max(mine.get(peer, 0), int(samples))  # (a count told again: no less)
        self._totals[epoch] += max(before, int(samples)) - before
        return self._totals[epoch]

    def total(self, epoch: int) -> int:
        """Step ``epoch``'s samples: per participant, the larger of its plan-time count and
        what it reported putting in (0 for a step not kept)."""
        return self._totals.get(epoch, 0)

    def correct(self, history: list, peer: str, epoch: int, samples: int) -> None:
        """``peer`` reported putting ``samples`` into step ``epoch``: rewrite that step's
        record in ``history`` (``StepRecord``s, newest last) with the corrected count."""
        total = self.contributed(epoch, peer, samples)
        if total is None:
            return
        for i in range(len(history) - 1, max(-1, len(history) - KEEP_EPOCHS - 1), -1):
            if history[i].epoch == epoch:
                history[i] = replace(history[i], samples=total)
                return
