"""Who may take part in the next plan, and what they reported, counted as it changes (pure).

The tracker (``progress.ProgressTracker``) plans a step over every *eligible* peer (ready, a
member, not draining) whose latest report is at the current epoch, once their samples (or,
in local SGD, their micro-batches) are due; it gives a short grace while an eligible
participant of the latest plan still reports the epoch before it (it is applying that
step), and after a notice it re-plans only once every eligible peer reports the current
epoch (no step in flight). Counting those over the members at each report is O(N) per
report, O(N^2) per global step. ``EligibleTally`` keeps the counts instead: the tracker
calls ``update`` whenever one peer's eligibility or latest report changes, in O(1), and
reads each count in O(1). ``watch`` names the latest plan's participants (O(N), once per
plan), whose eligible peers are also counted apart per epoch.

Liveness by time (a member silent for the TTL but not yet expired) is not the tally's: the
tracker asks it only when every member was heard from within the TTL (``Membership.
within_ttl``, always true right after ``Membership.expire``).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass


@dataclass(frozen=True)
class AtEpoch:
    """The eligible peers whose latest report is at one epoch."""

    peers: int = 0
    samples: int = 0  # their samples since that epoch's step
    micro: int = 0  # their micro-batches (local steps) since it
    watched: int = 0  # of ``peers``, those ``watch`` named (the latest plan's participants)


_NONE = AtEpoch()


class EligibleTally:
    """Counts of the eligible peers (see the module docstring); not thread-safe."""

    def __init__(self) -> None:
        # eligible peer -> (epoch, samples, micro) of its latest report (None: no report)
        self._peers: dict[str, tuple[int, int, int] | None] = {}
        self._at: dict[int, list[int]] = {}  # epoch -> [peers, samples, micro, watched]
        self._watched: Container[str] = ()

    @property
    def count(self) -> int:
        """How many peers are eligible."""
        return len(self._peers)

    def is_eligible(self, peer: str) -> bool:
        return peer in self._peers

    def at(self, epoch: int) -> AtEpoch:
        """The eligible peers whose latest report is at ``epoch``."""
        row = self._at.get(epoch)
        return _NONE if row is None else AtEpoch(*row)

    def update(self, peer: str, eligible: bool,
               report: tuple[int, int, int] | None) -> None:
        """``peer`` is (or is no longer) ``eligible``, with ``report``: ``(epoch, samples,
        micro)`` of its latest report (None: none). O(1)."""
        if peer in self._peers:
            self._count(peer, self._peers.pop(peer), -1)
        if eligible:
            self._peers[peer] = report
            self._count(peer, report, 1)

    def watch(self, peers: Container[str]) -> None:
        """Count the eligible ones among ``peers`` apart (``AtEpoch.watched``) from now on
        (O(eligible peers))."""
        self._watched = peers
        for row in self._at.values():
            row[3] = 0
        for peer, report in self._peers.items():
            if report is not None and peer in peers:
                self._at[report[0]][3] += 1

    def _count(self, peer: str, report: tuple[int, int, int] | None, sign: int) -> None:
        if report is None:
            return
        epoch, samples, micro = report
        row = self._at.get(epoch)
        if row is None:
            row = self._at[epoch] = [0, 0, 0, 0]
        row[0] += sign
        row[1] += sign * samples
        row[2] += sign * micro
        if peer in self._watched:
            row[3] += sign
        if row[0] == 0:
            del self._at[epoch]
