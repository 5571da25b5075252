"""Quarantine: a peer whose contributions others keep rejecting leaves the plans (pure).

Receivers report the contributions they rejected (``ProgressReport.saw_rejections``). Two
kinds of reason count against the sender, once per (receiver, epoch); lateness and failed
fetches never do (they are the network's or a dying node's), nor does an unauthenticated
message (``unauthenticated``: a forger without the job's key can name any sender, so it is
counted in the metrics under its own reason and never quarantines the sender it names):

- *faults* (``SENDER_FAULTS``: NaN/inf values, a bad weight, a value or weight above the
  step's bounds) are the sender's alone: each counts at once.
- *disputes* (``DISPUTES``: a wrong length or wire dtype) only say that receiver and sender
  disagree, and a broken peer rejects every good one as surely as they reject it. They
  are settled once their epoch is over (``settle``, called when the swarm's epoch moves
  past it). A length dispute whose report carries the length the sender's tensor had is
  settled by fact: it counts iff that length is not the swarm's layout (the length most
  ready replicas report for their own model), so a 1-vs-1 dispute is decided too.
  Otherwise, by votes: a receiver's accusation counts only if more peers accuse the
  sender than accuse the receiver at that epoch (one wrong-shape peer among three is
  accused by two and accuses two who are each accused by one: only it is counted); a tie
  counts for nobody, since quarantining a good peer is worse than stepping on with a
  rejected part. Late reports of a settled epoch are added to its votes (kept for
  ``window_s``) and re-settled.

A sender with ``threshold`` counted rejections within ``window_s`` is quarantined: the
caller drops it from the ready set, so it is in no further plan and must copy the state
from a donor before it rejoins, with a clean record. A resync for another reason (its
state diverged, as a broken peer's does after every round) keeps the record: it is about
the peer's contributions, not its state. Every quarantine is kept with its reason. Time
is injected.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Reasons that blame the sender (values of messages.RejectReason).
SENDER_FAULTS = frozenset({"non_finite", "bad_weight", "value_out_of_bounds",
                           "weight_out_of_bounds"})
# Reasons that say receiver and sender disagree: settled by votes per epoch.
DISPUTES = frozenset({"shape_mismatch", "dtype_mismatch"})


@dataclass(frozen=True)
class QuarantineRecord:
    peer_id: str
    at: float
    reason: str  # the reason of the rejection that tipped it over


@dataclass
class Quarantine:
    threshold: int = 3
    window_s: float = 60.0
    records: list[QuarantineRecord] = field(default_factory=list)
    _seen: dict[str, deque] = field(default_factory=dict)  # sender -> (at, reporter, epoch)
    # epoch -> {(reporter, sender): (reason, at, claimed length)}: disputes, kept for window_s
    _votes: dict[int, dict[tuple[str, str], tuple[str, float, int]]] = field(
        default_factory=dict)

    def __post_init__(self) -> None:
        if self.threshold < 1 or not self.window_s > 0:
            raise ValueError(f"need threshold >= 1 and window_s > 0, got {self.threshold}, "
                             f"{self.window_s}")

    def note(self, reporter: str, sender: str, reason: str, epoch: int, now: float,
             numel: int = -1) -> QuarantineRecord | None:
        """One rejection ``reporter`` saw of ``sender``'s contribution at ``epoch``
        (``numel``: the length the sender's tensor had, -1 if unknown). A fault counts at
        once: the record if it quarantines ``sender`` (the caller drops it from the ready
        set). A dispute is only recorded (None): see ``settle``."""
        if reporter == sender:
            return None
        if reason in DISPUTES:
            self._votes.setdefault(epoch, {}).setdefault((reporter, sender),
                                                         (reason, now, numel))
            return None
        if reason not in SENDER_FAULTS:
            return None
        return self._count(reporter, sender, reason, epoch, now)

    @property
    def disputed(self) -> bool:
        """Some rejection waits to be counted (``settle`` has something to do)."""
        return bool(self._votes)

    def settle(self, before_epoch: int, now: float, layout: int | None = None
               ) -> list[QuarantineRecord]:
        """Count the disputes of every epoch before ``before_epoch`` (``layout``: the swarm's
        tensor length, None if unknown; see the module docstring); returns the quarantines
        this makes, in order."""
        out: list[QuarantineRecord] = []
        for epoch in sorted(self._votes):
            votes = self._votes[epoch]
            if not votes or max(v[1] for v in votes.values()) < now - self.window_s:
                del self._votes[epoch]
                continue
            if epoch >= before_epoch:
                continue
            accusers: dict[str, set[str]] = {}
            for reporter, sender in votes:
                accusers.setdefault(sender, set()).add(reporter)
            for (reporter, sender), (reason, _, numel) in sorted(votes.items()):
                if any(q.peer_id == sender for q in out):
                    continue
                if layout is not None and numel >= 0:
                    guilty = numel != layout  # by fact: the sender's length is not the swarm's
                else:
                    guilty = len(accusers[sender]) > len(accusers.get(reporter, ()))
                if guilty:
                    record = self._count(reporter, sender, reason, epoch, now)
                    if record is not None:
                        out.append(record)
        for record in out:  # its votes are spent: a rejoin starts clean
            self._drop_votes(record.peer_id)
        return out

    def _count(self, reporter: str, sender: str, reason: str, epoch: int, now: float
               ) -> QuarantineRecord | None:
        seen = self._seen.setdefault(sender, deque())
        if any(r == reporter and e == epoch for _, r, e in seen):
            return None  # one count per receiver and round
        seen.append((now, reporter, epoch))
        while seen and now - seen[0][0] > self.window_s:
            seen.popleft()
        if len(seen) < self.threshold:
            return None
        record = QuarantineRecord(sender, now, reason)
        self.records.append(record)
        del self._seen[sender]
        return record

    def _drop_votes(self, peer_id: str) -> None:
        for votes in self._votes.values():
            for key in [k for k in votes if peer_id in k]:
                del votes[key]
