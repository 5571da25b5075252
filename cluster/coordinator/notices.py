"""The notices service of the Coordinator: preemption notices and their rebalance clock
(pure: times are passed in, no Ray).

A notice for a node (``autoscaler/watch/drain.py`` reports it) is kept once per node with
the epoch of the plans made before it; the node counts as rebalanced at the first plan
published after the notice (every such plan leaves its peers out), a node without peers at
once. ``snapshot`` / ``restore`` carry the records across a Coordinator restart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class NoticeRecord:
    """A preemption notice as the Coordinator saw it (see ``CoordinatorCore.note_notice``)."""

    noticed_at: float  # Coordinator clock: when the node received the notice
    epoch: int  # plans up to this epoch were made before the node was excluded
    peers: tuple[str, ...]  # the node's peers marked draining
    rebalance_s: float | None = None  # notice -> first plan without the node (None: no plan yet)


class NoticeBook:
    """Per noticed node its first ``NoticeRecord``; not thread-safe (the actor serializes)."""

    def __init__(self) -> None:
        self.records: dict[str, NoticeRecord] = {}  # node id -> its first notice
        self._snapshot: dict | None = None  # ``snapshot``'s, until a record changes
        self._pending: set[str] = set()  # nodes whose rebalance clock still runs

    def note(self, node_id: str, now: float, notice_age_s: float, epoch: int,
             peers: tuple[str, ...]) -> None:
        """A notice for ``node_id`` whose peers ``peers`` were just marked draining at
        ``epoch``; ``notice_age_s`` is how long ago the node received it. A second notice
        for the same node keeps the first record."""
        if node_id not in self.records:
            self._snapshot = None
            noticed_at = now - max(0.0, notice_age_s)
            self.records[node_id] = NoticeRecord(noticed_at, epoch, tuple(peers),
                                                 None if peers else now - noticed_at)
            if peers:
                self._pending.add(node_id)

    def pending(self) -> bool:
        """A notice for a node with peers is waiting for the plan that leaves them out
        (O(1): the Coordinator asks at every report)."""
        return bool(self._pending)

    def rebalanced(self, epoch: int, now: float) -> None:
        """The swarm is at ``epoch``: close the clock of every notice older than its plan
        (O(notices still pending): the Coordinator calls it at every report)."""
        for node_id in [n for n in self._pending if epoch > self.records[n].epoch]:
            r = self.records[node_id]
            r.rebalance_s = max(0.0, now - r.noticed_at)
            self._pending.discard(node_id)
            self._snapshot = None

    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted(self.records))

    def stats(self) -> dict[str, dict]:
        """Per noticed node: ``{"peers": [...], "epoch": e, "rebalance_s": s or None}``."""
        return {node: {"peers": list(r.peers), "epoch": r.epoch, "rebalance_s": r.rebalance_s}
                for node, r in self.records.items()}

    def summary(self) -> dict:
        done = [r.rebalance_s for r in self.records.values() if r.rebalance_s is not None]
        return {"notices": len(self.records), "rebalance_s": done,
                "rebalance_pending": len(self.records) - len(done)}

    def snapshot(self) -> dict:
        """The records, JSON-able (built again only after ``note`` or ``rebalanced``
        changed one: the Coordinator saves after every call). Do not mutate it."""
        if self._snapshot is None:
            self._snapshot = {node: asdict(r) for node, r in sorted(self.records.items())}
        return self._snapshot

    def restore(self, snap: dict) -> None:
        self._snapshot = None
        self.records = {node: NoticeRecord(float(r["noticed_at"]), int(r["epoch"]),
                                           tuple(r["peers"]), r["rebalance_s"])
                        for node, r in snap.items()}
        self._pending = {node for node, r in self.records.items() if r.rebalance_s is None}
