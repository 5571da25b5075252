"""The notices service of the Coordinator: preemption notices and their rebalance clock
(pure: times are passed in, no Ray).

A notice for a node (``autoscaler/watch/drain.py`` reports it) is kept once per node with
the epoch of the plans made before it; the node counts as rebalanced at the first plan
published after the notice (every such plan leaves its peers out), a node without peers at
once. ``snapshot`` / ``restore`` carry the records across a Coordinator restart.

State stays bounded however long the run: a record whose clock is closed is kept until
``KEEP_S`` past its node's deadline (its watcher and the benches look it up before then;
the node is gone by then), and at most ``KEEP_RECORDS`` of them (the oldest go first); a
record whose clock still runs is kept until it closes (at the next plan). What the run's
summary needs is counted instead: the notices ever noted (``total``), the clocks ever
closed (``closed``), the longest delay and the latest ``RECENT`` delays.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

KEEP_S = 60.0  # a closed record is kept this long past its node's deadline
KEEP_RECORDS = 1024  # ... and at most this many closed records (the oldest are dropped)
RECENT = 100  # rebalance delays kept for ``summary`` (the newest)
PRUNE_EVERY_S = 1.0  # how often ``note`` looks for records to drop (O(records kept))


@dataclass
class NoticeRecord:
    """A preemption notice as the Coordinator saw it (see ``CoordinatorCore.note_notice``)."""

    noticed_at: float  # Coordinator clock: when the node received the notice
    epoch: int  # plans up to this epoch were made before the node was excluded
    peers: tuple[str, ...]  # the node's peers marked draining
    rebalance_s: float | None = None  # notice -> first plan without the node (None: no plan yet)
    deadline: float = math.inf  # Coordinator clock: when the node goes (inf: not told)

    def row(self) -> dict:
        """The record as JSON-able fields (``deadline`` as None when not told)."""
        return {"noticed_at": self.noticed_at, "epoch": self.epoch, "peers": list(self.peers),
                "rebalance_s": self.rebalance_s,
                "deadline": None if math.isinf(self.deadline) else self.deadline}


class NoticeBook:
    """Per noticed node its first ``NoticeRecord`` (a window: see the module docstring);
    not thread-safe (the actor serializes)."""

    def __init__(self) -> None:
        self.records: dict[str, NoticeRecord] = {}  # node id -> its first notice, oldest first
        self.total = 0  # notices ever noted (one per node and record)
        self.closed = 0  # rebalance clocks ever closed
        self.rebalance_max: float | None = None  # the longest delay ever closed
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT)
        self._rows: dict[str, dict] = {}  # node id -> ``NoticeRecord.row`` (for ``snapshot``)
        self._snapshot: dict | None = None  # ``snapshot``'s, until a record changes
        self._pending: set[str] = set()  # nodes whose rebalance clock still runs
        self._pruned_at = -math.inf

    def note(self, node_id: str, now: float, notice_age_s: float, epoch: int,
             peers: tuple[str, ...], deadline: float = math.inf) -> None:
        """A notice for ``node_id`` whose peers ``peers`` were just marked draining at
        ``epoch``; ``notice_age_s`` is how long ago the node received it, ``deadline`` when
        the node goes (Coordinator clock). A second notice for the same node keeps the
        first record (while it is kept). Drops the records past their keep (O(records
        kept), at most once per ``PRUNE_EVERY_S``)."""
        self._prune(now)
        if node_id in self.records:
            return
        self._snapshot = None
        self.total += 1
        noticed_at = now - max(0.0, notice_age_s)
        self.records[node_id] = NoticeRecord(noticed_at, epoch, tuple(peers), None,
                                             float(deadline))
        if peers:
            self._pending.add(node_id)
        else:
            self._close(node_id, now)
        self._rows[node_id] = self.records[node_id].row()

    def pending(self) -> bool:
        """A notice for a node with peers is waiting for the plan that leaves them out
        (O(1): the Coordinator asks at every report)."""
        return bool(self._pending)

    def rebalanced(self, epoch: int, now: float) -> None:
        """The swarm is at ``epoch``: close the clock of every notice older than its plan
        (O(notices still pending): the Coordinator calls it at every report)."""
        for node_id in [n for n in self._pending if epoch > self.records[n].epoch]:
            self._close(node_id, now)
            self._pending.discard(node_id)
            self._rows[node_id] = self.records[node_id].row()
            self._snapshot = None

    def _close(self, node_id: str, now: float) -> None:
        r = self.records[node_id]
        r.rebalance_s = max(0.0, now - r.noticed_at)
        self.closed += 1
        self._recent.append(r.rebalance_s)
        self.rebalance_max = max(self.rebalance_max or 0.0, r.rebalance_s)

    def _prune(self, now: float) -> None:
        """Drop closed records past ``KEEP_S`` after their deadline, then the oldest closed
        ones beyond ``KEEP_RECORDS``."""
        if now - self._pruned_at < PRUNE_EVERY_S and \
                len(self.records) - len(self._pending) <= KEEP_RECORDS:
            return
        self._pruned_at = now
        closed = [n for n in self.records if n not in self._pending]
        kept = [n for n in closed if self.records[n].deadline + KEEP_S >= now]
        drop = set(closed).difference(kept)  # past their keep
        drop.update(kept[:max(0, len(kept) - KEEP_RECORDS)])  # the oldest beyond the cap
        for node_id in drop:
            del self.records[node_id]
            del self._rows[node_id]
        if drop:
            self._snapshot = None

    def closed_since(self, seen: int) -> list[float]:
        """The rebalance delays closed after the first ``seen`` ever, oldest first (those
        still among the latest ``RECENT``): a reader passes the ``closed`` it last got."""
        new = self.closed - seen
        return list(self._recent)[-new:] if new > 0 else []

    def nodes(self) -> tuple[str, ...]:
        """The nodes whose notice record is kept, sorted."""
        return tuple(sorted(self.records))

    def stats(self) -> dict[str, dict]:
        """Per node kept: ``{"peers": [...], "epoch": e, "rebalance_s": s or None}``."""
        return {node: {"peers": list(r.peers), "epoch": r.epoch, "rebalance_s": r.rebalance_s}
                for node, r in self.records.items()}

    def summary(self) -> dict:
        """``notices`` ever noted, the latest ``RECENT`` delays (``rebalance_s``), the
        longest ever (``rebalance_s_max``, None before the first) and the clocks that still
        run (``rebalance_pending``)."""
        return {"notices": self.total, "rebalance_s": list(self._recent),
                "rebalance_s_max": self.rebalance_max, "rebalance_pending": len(self._pending)}

    def snapshot(self) -> dict:
        """The records kept and the counters, JSON-able (built again only after a record
        was added, closed or dropped: the Coordinator saves after every call). Do not
        mutate it."""
        if self._snapshot is None:
            self._snapshot = {"records": dict(self._rows), "total": self.total,
                              "closed": self.closed, "rebalance_max": self.rebalance_max,
                              "recent": list(self._recent)}
        return self._snapshot

    def restore(self, snap: dict) -> None:
        """Take back a ``snapshot`` (or the older form: the records alone, by node)."""
        rows = snap["records"] if "records" in snap else snap
        self._snapshot = None
        self.records = {
            node: NoticeRecord(float(r["noticed_at"]), int(r["epoch"]), tuple(r["peers"]),
                               r["rebalance_s"],
                               math.inf if r.get("deadline") is None else float(r["deadline"]))
            for node, r in rows.items()}
        self._rows = {node: r.row() for node, r in self.records.items()}
        self._pending = {node for node, r in self.records.items() if r.rebalance_s is None}
        done = [r.rebalance_s for r in self.records.values() if r.rebalance_s is not None]
        self.total = int(snap.get("total", len(self.records)))
        self.closed = int(snap.get("closed", len(done)))
        self._recent.clear()
        self._recent.extend(snap.get("recent", done))
        self.rebalance_max = snap.get("rebalance_max", max(done, default=None))
