"""The replica's stream of batches: the shards the Coordinator grants, opened in turn.

Runs in the thread of the user's training loop. ``grant(floor)`` asks the Coordinator for
the next shard number (a ``concurrent.futures.Future``; the replica passes Ray's
``ObjectRef.future()``); the next grant is asked for as soon as a shard is opened, so the
loop does not wait for the Coordinator between shards. ``position`` is the data position
this replica knows (every shard below it was handed out); it travels with the state and
is the floor of every grant, so a restarted Coordinator or a resumed run never hands out a
shard twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from moshray.cluster.coordinator.shard_ledger import shard_of

from moshray.actors.replica.data_sources import DataSource
from moshray.actors.errors import UserError

log = logging.getLogger(__name__)

GRANT_TIMEOUT_S = 30.0  # one grant request (the Coordinator may be restarting)
GRANT_PATIENCE_S = 120.0  # no grant within this long: the feed gives up


class ShardFeed:
    """Batches from granted shards (see module docstring). ``next()`` raises ``UserError``
    for a shard that yields nothing and ``RuntimeError`` if no grant came within
    ``GRANT_PATIENCE_S``."""

    def __init__(self, source: DataSource, seed: int, grant: Callable[[int], Future],
                 position: int = 0):
        self.source, self.seed, self.grant = source, seed, grant
        self.position = position
        self.shard_number: int | None = None  # the open shard's number
        self.taken = 0  # batches taken from it
        self.shards_opened = 0
        self._iter: Iterator[Any] | None = None
        self._pending: Future | None = None

    def next(self) -> Any:
        while True:
            if self._iter is None:
                self._open_next()
            try:
                batch = next(self._iter)
            except StopIteration:
                self._iter = None
                if self.taken == 0:
                    shard, seed = shard_of(self.shard_number, self.source.num_shards, self.seed)
                    raise UserError("data", f"shard {shard} of {self.source.num_shards} (seed "
                                    f"{seed}) yielded no batches: every shard must yield at "
                                    f"least one (use fewer shards or check the data "
                                    f"function)") from None
                continue
            self.taken += 1
            return batch

    def _take_grant(self) -> int:
        """The next granted shard number; an empty grant (the Coordinator is learning the
        position after a restart) or a failed one is asked again, for at most
        ``GRANT_PATIENCE_S``."""
        deadline = time.monotonic() + GRANT_PATIENCE_S
        attempt = 0
        while time.monotonic() < deadline:
            future, self._pending = self._pending or self.grant(self.position), None
            try:
                ids = future.result(timeout=GRANT_TIMEOUT_S)
                if ids:
                    return ids[0]
            except Exception as exc:  # noqa: BLE001 - a Coordinator away: ask again
                log.warning("data shard grant failed (attempt %d: %s)", attempt + 1,
                            type(exc).__name__)
            attempt += 1
            time.sleep(min(1.0, 0.05 * 2 ** attempt))
        raise RuntimeError(f"no data shard granted in {GRANT_PATIENCE_S:.0f} s")

    def _open_next(self) -> None:
        number = self._take_grant()
        self.position = max(self.position, number + 1)
        self._pending = self.grant(self.position)  # the next one, while this one is read
        shard, seed = shard_of(number, self.source.num_shards, self.seed)
        self._iter = iter(self.source.open(shard, seed))
        self.shard_number, self.taken = number, 0
        self.shards_opened += 1

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Adopt a donor's or checkpoint's position (never moves back)."""
        self.position = max(self.position, int(state.get("position", 0)))
