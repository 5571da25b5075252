"""How many samples a global step really averaged (pure bookkeeping for the tracker).

A plan is made when the samples the ready peers reported reach the target batch, but the
peers keep computing while the plan reaches them (DeDLOC: the target is a minimum), and
each averages everything it accumulated up to its step. The plan-time count is a lower
bound; each participant then reports what it put into the step (``ProgressReport.
contributed``), and a step's samples are, per participant, the larger of the two. A
participant whose report never comes (it died) keeps its plan-time count.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

KEEP_EPOCHS = 64  # steps whose counts may still be corrected (reports come right after)


@dataclass
class StepSamples:
    _planned: dict[int, dict[str, int]] = field(default_factory=dict)
    _contributed: dict[int, dict[str, int]] = field(default_factory=dict)

    def planned(self, epoch: int, per_peer: dict[str, int]) -> None:
        """The plan of ``epoch`` was made over ``per_peer`` (peer -> samples reported)."""
        self._planned[epoch] = dict(per_peer)
        self._contributed.pop(epoch, None)
        for old in [e for e in self._planned if e <= epoch - KEEP_EPOCHS]:
            self._planned.pop(old, None)
            self._contributed.pop(old, None)

    def contributed(self, epoch: int, peer: str, samples: int) -> int | None:
        """``peer`` put ``samples`` into step ``epoch``: that step's corrected count, or
        None if the step is unknown (too old, or ``peer`` was not planned in it)."""
        planned = self._planned.get(epoch)
        if planned is None or peer not in planned or samples < 0:
            return None
        self._contributed.setdefault(epoch, {})[peer] = int(samples)
        return self.total(epoch)

    def total(self, epoch: int) -> int:
        mine = self._contributed.get(epoch, {})
        return sum(max(n, mine.get(p, 0)) for p, n in self._planned.get(epoch, {}).items())

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
