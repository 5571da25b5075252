"""Which data shards have been handed out: the job's data position, one counter.

A job's data is a sequence of shards (``moshray.actors.replica.data_sources``); data epoch ``e``
is shards ``e * num_shards ... (e + 1) * num_shards - 1`` of one endless numbering, in an
order shuffled per epoch. Replicas ask the Coordinator for the next shard when they need
one, so the work follows the live replicas as they come and go: a fast replica takes more
shards, a joiner takes the next free one, a dead replica's shard is not handed out again
(skipped, never repeated).

The position is ``next``: every shard below it was handed out. It travels with the model
state (donor copies, checkpoints), so a restarted Coordinator or a resumed run continues
the numbering instead of replaying it: ``raise_floor`` only ever moves ``next`` forward.
``ShardService`` is the Coordinator's data-shard service around the ledger: it also keeps
the ledger's snapshot for a restart and, when no snapshot came back, holds grants while
the replicas tell their positions. Pure: no Ray; times are passed in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ShardLedger:
    """The counter behind ``Coordinator.grant_shards`` (see module docstring)."""

    next: int = 0
    version: int = 0  # one more at every change (``ShardService.snapshot`` keys on it)

    def raise_floor(self, floor: int) -> int:
        """Never hand out a shard below ``floor`` (a position some replica's state holds,
        or a checkpoint's); returns the new position."""
        if int(floor) > self.next:
            self.next = int(floor)
            self.version += 1
        return self.next

    def grant(self, peer_id: str, count: int = 1, floor: int = 0) -> tuple[int, ...]:
        """The next ``count`` shard numbers for ``peer_id`` (after ``raise_floor(floor)``);
        each number is handed out once (who got which is not kept: the position alone
        makes a restart exact). ``count`` < 1 grants nothing."""
        self.raise_floor(floor)
        ids = tuple(range(self.next, self.next + max(0, int(count))))
        self.next += len(ids)
        self.version += 1
        return ids


REJOIN_GRACE_S = 2.5  # after a restart, positions are heard before shards are granted


class ShardService:
    """The Coordinator's data shards: ``grant``, ``position``, and what a restart needs.

    After a restart whose ledger was not restored, the first ``rejoined`` opens a window of
    ``REJOIN_GRACE_S`` in which no shard is granted, so that every live replica (they
    heartbeat every second) has told its position first: no shard is repeated. A restored
    ledger (``restore``) is exact (every grant is saved before its reply leaves), so it
    needs no window.
    """

    def __init__(self) -> None:
        self.ledger = ShardLedger()
        self._grants_after: float | None = None
        self._restored = False
        self._snapshot: tuple[int, dict] = (-1, {})  # (the ledger's version, its record)

    def rejoined(self, data_position: int, now: float) -> None:
        """A replica rejoined a restarted Coordinator holding ``data_position``."""
        self.ledger.raise_floor(data_position)
        if self._grants_after is None and not self._restored:
            self._grants_after = now + REJOIN_GRACE_S

    def grant(self, peer_id: str, count: int, floor: int, now: float,
              member: bool) -> tuple[int, ...]:
        """The next ``count`` shard numbers for ``peer_id``; nothing (ask again) for a
        non-``member`` or while positions are being heard after a restart."""
        self.ledger.raise_floor(floor)
        if not member or (self._grants_after is not None and now < self._grants_after):
            return ()
        return self.ledger.grant(peer_id, count, floor)

    def position(self, floor: int = 0) -> int:
        """Every data shard below this number has been handed out."""
        return self.ledger.raise_floor(floor)

    def snapshot(self) -> dict:
        """The ledger as a record (JSON-able, ``{"next": n}``): built again only after it
        changed (the Coordinator saves after every call); do not mutate it."""
        ledger = self.ledger
        if self._snapshot[0] != ledger.version:
            self._snapshot = (ledger.version, {"next": ledger.next})
        return self._snapshot[1]

    def restore(self, snap: dict) -> None:
        """Take back a ``snapshot`` (an older one's per-peer ``granted`` counts are
        ignored: nothing read them)."""
        self.ledger.raise_floor(int(snap.get("next", 0)))
        self.ledger.version += 1
        self._restored = True


def shard_of(number: int, num_shards: int, seed: int) -> tuple[int, int]:
    """``(shard, epoch_seed)`` for shard ``number`` of the endless numbering: the data
    epoch's shuffled order (seeded by ``seed`` and the epoch) picks the shard, and the seed
    the shard is opened with changes with the epoch (so a source reshuffles inside it)."""
    import random

    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    epoch, index = divmod(int(number), num_shards)
    order = list(range(num_shards))
    random.Random(f"{seed}/{epoch}").shuffle(order)
    return order[index], seed + epoch
