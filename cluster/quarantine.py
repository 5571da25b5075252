"""Quarantine: a peer whose contributions others keep rejecting leaves the plans (pure).

Receivers report the contributions they rejected (``ProgressReport.saw_rejections``). A
rejection for a reason that says the *sender* is broken (wrong shape or dtype, NaN/inf
values, a bad weight) counts against the sender, once per (receiver, epoch); lateness and
failed fetches do not (they are the network's or a dying node's). A sender with
``threshold`` counted rejections within ``window_s`` is quarantined: the tracker drops it
from the ready set, so it is in no further plan and must copy the state from a donor
before it rejoins (which clears its record). Every quarantine is kept with its reason.
Time is injected.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Reasons that blame the sender (values of messages.RejectReason).
SENDER_FAULTS = frozenset({"shape_mismatch", "dtype_mismatch", "non_finite", "bad_weight"})


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

    def __post_init__(self) -> None:
        if self.threshold < 1 or not self.window_s > 0:
            raise ValueError(f"need threshold >= 1 and window_s > 0, got {self.threshold}, "
                             f"{self.window_s}")

    def note(self, reporter: str, sender: str, reason: str, epoch: int, now: float) -> bool:
        """Count one rejection ``reporter`` saw of ``sender``'s contribution at ``epoch``.
        True if this quarantines ``sender`` (the caller drops it from the ready set)."""
        if reason not in SENDER_FAULTS or reporter == sender:
            return False
        seen = self._seen.setdefault(sender, deque())
        if any(r == reporter and e == epoch for _, r, e in seen):
            return False  # one count per receiver and round
        seen.append((now, reporter, epoch))
        while seen and now - seen[0][0] > self.window_s:
            seen.popleft()
        if len(seen) < self.threshold:
            return False
        self.records.append(QuarantineRecord(sender, now, reason))
        del self._seen[sender]
        return True

    def clear(self, peer_id: str) -> None:
        """``peer_id`` copied a donor's state: it starts with a clean record."""
        self._seen.pop(peer_id, None)
