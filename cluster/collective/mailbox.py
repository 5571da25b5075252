"""What has arrived for one group round: contributions, results, deaths (see round.py).

The inbox of one ``GroupRound``: the ``Averager`` fills it from the transport's calls
(actor methods) on the event loop, possibly before the round starts; the round reads it and
waits on it. It never imports the round.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import moshray.cluster.collective.codecs as comp
from moshray.cluster.messages import Contribution, InBundle, Inline, PartResult

RoundKey = tuple[int, int, int]  # (epoch, round_index, group_index)


class FetchAbandoned(Exception):
    """A fetch missed the round's deadline, or the peer holding the bytes died."""


@dataclass
class GroupMailbox:
    """What has arrived for one group round: contributions, results and deaths.

    Fetch tasks start as soon as the part index is known, so bytes move while the round is
    still encoding its own parts. ``changed`` wakes waiters; ``version`` tells them whether
    anything arrived since they last looked.
    """

    key: RoundKey
    contributions: dict[str, Contribution] = field(default_factory=dict)
    results: dict[int, PartResult] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    own_part: int | None = None  # set when this peer's round starts (None: receiver)
    reduced: bool = False  # own part published: later contributions are late
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    version: int = 0  # bumped by every notify: waiters compare it with what they last saw
    fetches: dict[tuple[str, int], asyncio.Task] = field(default_factory=dict)
    result_fetches: dict[int, asyncio.Task] = field(default_factory=dict)
    # (start, end, bytes) of every part or result fetch that succeeded (inline ones move
    # nothing and are not logged): this peer's inbound bandwidth
    # for the throughput it reports (see shares.py)
    fetch_log: list[tuple[float, float, int]] = field(default_factory=list)
    fetch: Callable[[object], Awaitable[comp.Encoded]] = field(default=None)  # the transport's

    def __post_init__(self) -> None:
        if self.fetch is None:
            self.fetch = _await_ref

    def notify(self) -> None:
        self.version += 1
        self.changed.set()

    def mark_dead(self, peer: str) -> None:
        if peer not in self.dead:
            self.dead.add(peer)
            self.notify()

    def fetch_part(self, sender: str, part: int) -> asyncio.Task:
        """Task fetching part ``part`` of ``sender``'s contribution (started once)."""
        task = self.fetches.get((sender, part))
        if task is None:
            ref = self.contributions[sender].part_refs[part]
            task = asyncio.ensure_future(self._timed_fetch(ref))
            task.add_done_callback(lambda _: self.notify())
            self.fetches[(sender, part)] = task
        return task

    async def _timed_fetch(self, ref) -> comp.Encoded:
        if isinstance(ref, Inline):  # came with the message: nothing moved, nothing to time
            return ref.value
        start = time.perf_counter()
        enc = await self.resolve(ref)
        self.fetch_log.append((start, time.perf_counter(), getattr(enc, "nbytes", 0)))
        return enc

    async def resolve(self, payload) -> comp.Encoded:
        """The encoded bytes behind a message's payload (``messages.Payload``): an
        ``Inline`` value as is, an ``InBundle`` element from its fetched tuple, else the
        transport's fetch of the ref. Raises what the fetch raises (e.g. the object was lost
        with its owner)."""
        if isinstance(payload, Inline):
            return payload.value
        if isinstance(payload, InBundle):
            return (await self.fetch(payload.ref))[payload.index]
        return await self.fetch(payload)

    def fetch_result(self, part: int) -> asyncio.Task:
        task = self.result_fetches.get(part)
        if task is None:
            # timed like a contribution's part: a member that owns no part measures its
            # inbound bandwidth from results alone (shares.py)
            task = asyncio.ensure_future(self._timed_fetch(self.results[part].ref))
            task.add_done_callback(lambda _: self.notify())
            self.result_fetches[part] = task
        return task

    async def wait_changed(self, seen: int, deadline: float, clock: Callable[[], float]) -> bool:
        """Wait until something arrived after the caller saw ``version == seen``.

        Returns True at once if anything arrived since (even while the caller was busy
        awaiting a fetch, so no wake-up is lost), False when ``deadline`` passes first.
        """
        while self.version == seen:
            remaining = deadline - clock()
            if remaining <= 0:
                return False
            # Safe to clear: notify runs on this event loop, so nothing can arrive between
            # the version check above and the wait below (and set() has already woken every
            # waiter of an earlier notify, so clearing cannot lose another waiter's wake-up).
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except asyncio.TimeoutError:
                return self.version != seen
        return True

    async def await_fetch(
        self, task: asyncio.Task, holder: str, deadline: float, clock: Callable[[], float]
    ) -> comp.Encoded:
        """The fetched payload, waiting no later than ``deadline`` and no longer than
        ``holder`` (the peer whose object it is) is alive.

        Raises ``FetchAbandoned`` on either, or the fetch's own error (e.g. the object was
        lost with its owner).
        """
        while not task.done():
            if holder in self.dead:
                raise FetchAbandoned(f"{holder} died")
            if not await self.wait_changed(self.version, deadline, clock):
                if not task.done():
                    raise FetchAbandoned("deadline")
        return task.result()


async def _await_ref(ref) -> comp.Encoded:
    return await ref
