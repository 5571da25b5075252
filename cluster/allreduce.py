"""One butterfly all-reduce round inside one group, over Ray's object store.

Protocol (group of members M = (m_0..m_{k-1}) plus receivers):

1. Every member splits its flat float32 vector into k parts sized by the members'
   shares, encodes them with the round's codec and ``ray.put``s the k-1 parts it does
   not own. It sends one ``Contribution`` (the tuple of part refs, never the bytes) to
   every other member.
2. The owner of part j starts fetching part j of each contribution the moment it lands
   (streaming: no barrier), validates it, and adds it to a weighted mean. When all live
   members have been heard, or the contribution deadline passes, it encodes the mean,
   puts it, and sends a ``PartResult`` ref to everyone in the group.
3. Every peer fetches the results and writes them into its output vector.

Failures: every wait has a deadline. A member that misses the contribution deadline drops
out of that part's average. If a part's owner is dead (its actor call fails) or its result
misses the round deadline (or is malformed), each survivor re-reduces that part itself from
the contributions it received (plus its own), so the part is not lost. Receivers, who hold
no contributions, keep their local values for such a part.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import ray

from . import compression as comp
from .messages import Contribution, Group, PartResult, Rejection, RejectReason, RoundPlan
from .partition import WeightedMean, check_contribution, part_sizes, part_slices

log = logging.getLogger(__name__)

RoundKey = tuple[int, int, int]  # (epoch, round_index, group_index)


@dataclass
class GroupMailbox:
    """What has arrived for one group round: contributions, results and deaths.

    Filled by the transport (actor method calls) on the event loop; the round waits on
    ``changed``. Fetch tasks start as soon as the part index is known, so bytes move while
    the round is still encoding its own parts.
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

    def notify(self) -> None:
        self.version += 1
        self.changed.set()

    def fetch_part(self, sender: str, part: int) -> asyncio.Task:
        """Task fetching part ``part`` of ``sender``'s contribution (started once)."""
        task = self.fetches.get((sender, part))
        if task is None:
            ref = self.contributions[sender].part_refs[part]
            task = asyncio.ensure_future(_fetch(ref))
            self.fetches[(sender, part)] = task
        return task

    def fetch_result(self, part: int) -> asyncio.Task:
        task = self.result_fetches.get(part)
        if task is None:
            task = asyncio.ensure_future(_fetch(self.results[part].ref))
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
            # the version check above and the wait below.
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except asyncio.TimeoutError:
                return self.version != seen
        return True


async def _fetch(ref) -> comp.Encoded:
    return await ref


@dataclass
class RoundOutcome:
    """What one peer got out of one group round."""

    values: np.ndarray
    weight: float
    contributors: tuple[str, ...]
    partial_contributors: tuple[str, ...]
    rejections: list[Rejection]
    failed_owners: tuple[str, ...]
    bytes_sent: int
    bytes_received: int
    phases: dict[str, float]  # seconds spent in put / reduce / publish / gather


@dataclass(frozen=True)
class Deadlines:
    contributions: float  # owners stop waiting for contributions
    results: float  # peers stop waiting for results and re-reduce what is missing


class GroupRound:
    """Runs this peer's side of one group round (see module docstring).

    ``transport_send(peer, method, message)`` performs a fire-and-forget actor call and
    returns its ObjectRef (awaited only to learn that the callee died). The round never
    raises for another peer's failure; it returns a ``RoundOutcome``.
    """

    def __init__(
        self,
        me: str,
        plan: RoundPlan,
        round_index: int,
        group_index: int,
        group: Group,
        box: GroupMailbox,
        transport_send: Callable[[str, str, object], object],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.me, self.plan, self.group, self.box = me, plan, group, box
        self.round_index, self.group_index = round_index, group_index
        self.send, self.clock = transport_send, clock
        self.codec = comp.Compression(plan.compression)
        self.rejections: list[Rejection] = []
        self.bytes_sent = 0
        self.bytes_received = 0
        self.numel = 0

    # -- helpers -----------------------------------------------------------------------

    def _reject(self, sender: str, part: int, reason: RejectReason, detail: str) -> None:
        self.rejections.append(Rejection(sender, part, reason, detail))
        log.warning(
            "epoch %d round %d: rejected %s's part %d: %s (%s)",
            self.plan.epoch, self.round_index, sender, part, reason.value, detail,
        )

    def _watch_call(self, peer: str, call_ref) -> None:
        """Mark ``peer`` dead in the mailbox if the call to it fails."""

        async def watch() -> None:
            try:
                await call_ref
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                self.box.dead.add(peer)
                self.box.notify()
            except Exception as exc:  # noqa: BLE001 - any failed delivery means "not heard"
                log.warning("call to %s failed: %s", peer, exc)
                self.box.dead.add(peer)
                self.box.notify()

        asyncio.ensure_future(watch())

    # -- the round -----------------------------------------------------------------------

    async def run(self, flat: np.ndarray, weight: float, deadlines: Deadlines) -> RoundOutcome:
        members = self.group.members
        self.numel = flat.size
        sizes = part_sizes(flat.size, [self.plan.share_of(m) for m in members])
        slices = part_slices(sizes)
        out = np.array(flat, dtype=np.float32, copy=True)
        per_part: dict[int, tuple[str, ...]] = {}
        failed: list[str] = []
        weights: dict[int, float] = {}

        phases: dict[str, float] = {}
        mark = self.clock()

        def lap(name: str) -> None:
            nonlocal mark
            now = self.clock()
            phases[name] = phases.get(name, 0.0) + now - mark
            mark = now

        if self.me in members:
            own = members.index(self.me)
            self.box.own_part = own
            await self._contribute(flat, weight, slices, own)
            lap("put")
            values, total, contributors = await self._reduce_part(
                own, flat[slices[own]], weight, sizes[own], deadlines.contributions
            )
            self.box.reduced = True
            lap("reduce")
            await self._publish(own, values, total, contributors)
            out[slices[own]] = values
            per_part[own], weights[own] = contributors, total
            lap("publish")

        for j, owner in enumerate(members):
            if j in per_part:
                continue
            got = await self._await_result(j, owner, sizes[j], deadlines.results)
            if got is None:
                failed.append(owner)
                if self.me in members:  # re-reduce from the contributions we hold
                    values, total, contributors = await self._reduce_part(
                        j, flat[slices[j]], weight, sizes[j], deadlines.contributions,
                        exclude=owner,
                    )
                    out[slices[j]] = values
                    per_part[j], weights[j] = contributors, total
                else:  # a receiver keeps its local value for the part
                    per_part[j], weights[j] = (), weight
            else:
                values, result = got
                out[slices[j]] = values
                per_part[j], weights[j] = result.contributors, result.total_weight

        lap("gather")
        everyone = [set(c) for j, c in per_part.items() if sizes[j] > 0] or [set()]
        full = set.intersection(*everyone)
        partial = set.union(*everyone) - full
        new_weight = (
            sum(weights[j] * sizes[j] for j in weights) / max(flat.size, 1) if flat.size else weight
        )
        return RoundOutcome(
            values=out,
            weight=float(new_weight),
            contributors=tuple(sorted(full)),
            partial_contributors=tuple(sorted(partial)),
            rejections=self.rejections,
            failed_owners=tuple(failed),
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            phases=phases,
        )

    async def _contribute(self, flat: np.ndarray, weight: float, slices, own: int) -> None:
        members = self.group.members

        def put_parts() -> list:
            refs = []
            for j, s in enumerate(slices):
                if j == own:
                    refs.append(None)
                    continue
                enc = comp.encode(flat[s], self.codec)
                self.bytes_sent += enc.nbytes
                refs.append(ray.put(enc))
            return refs

        refs = await asyncio.to_thread(put_parts)
        message = Contribution(
            epoch=self.plan.epoch,
            round_index=self.round_index,
            group_index=self.group_index,
            sender=self.me,
            weight=float(weight),
            numel=flat.size,
            part_refs=tuple(refs),
        )
        for peer in members:
            if peer != self.me:
                self._watch_call(peer, self.send(peer, "receive_contribution", message))

    async def _reduce_part(
        self,
        part: int,
        local: np.ndarray,
        weight: float,
        size: int,
        deadline: float,
        exclude: str | None = None,
    ) -> tuple[np.ndarray, float, tuple[str, ...]]:
        """Weighted mean of part ``part`` over our own value and the contributions that
        arrive before ``deadline``.

        The owner adds contributions as they are fetched (streaming). A re-reduction of a
        dead owner's part (``exclude`` set) runs on every survivor at once: it adds the
        values in the group's member order, so survivors holding the same contributions
        compute bitwise identical results.
        """
        expected = comp.WIRE_DTYPE[self.codec]
        mean = WeightedMean(size)
        contributors: list[str] = []
        held: dict[str, tuple[np.ndarray, float]] = {}  # re-reduction: added at the end
        problem = check_contribution(local, size, np.dtype(np.float32), weight)
        if problem is None:
            if exclude is None:
                mean.add(local, weight)
            else:
                held[self.me] = (local, weight)
            contributors.append(self.me)
        else:
            self._reject(self.me, part, *problem)

        others = [m for m in self.group.members if m not in (self.me, exclude)]
        done: set[str] = set()
        while True:
            seen = self.box.version  # arrivals during the awaits below wake the wait at once
            for sender in others:
                if sender in done or sender not in self.box.contributions:
                    continue
                done.add(sender)
                c = self.box.contributions[sender]
                if c.numel != self.numel:
                    self._reject(sender, part, RejectReason.SHAPE_MISMATCH,
                                 f"tensor of {c.numel} values")
                    continue
                try:
                    enc = await self.box.fetch_part(sender, part)
                except Exception as exc:  # noqa: BLE001 - object lost with its owner
                    self._reject(sender, part, RejectReason.FETCH_FAILED, type(exc).__name__)
                    continue
                self.bytes_received += enc.nbytes
                if enc.data.dtype != expected or enc.codec is not self.codec:
                    self._reject(sender, part, RejectReason.DTYPE_MISMATCH,
                                 f"got {enc.codec.value}/{enc.data.dtype}, expected "
                                 f"{self.codec.value}/{expected}")
                    continue
                values = await asyncio.to_thread(comp.decode, enc)
                problem = await asyncio.to_thread(
                    check_contribution, values, size, np.dtype(np.float32), c.weight
                )
                if problem is not None:
                    self._reject(sender, part, *problem)
                    continue
                if exclude is None:
                    await asyncio.to_thread(mean.add, values, c.weight)
                else:
                    held[sender] = (values, c.weight)
                contributors.append(sender)
            waiting = [s for s in others if s not in done and s not in self.box.dead]
            if not waiting:
                break
            if not await self.box.wait_changed(seen, deadline, self.clock):
                break  # deadline: whoever has not contributed yet drops out of this part
        for member in self.group.members:
            if member in held:
                await asyncio.to_thread(mean.add, *held[member])
        if mean.count == 0:  # nothing valid, not even our own value: keep it as is
            return np.array(local, dtype=np.float32), 0.0, ()
        values, total = await asyncio.to_thread(mean.result)
        return values, total, tuple(sorted(contributors))

    async def _publish(self, part: int, values: np.ndarray, total: float, contributors) -> None:
        enc = await asyncio.to_thread(comp.encode, values, self.codec)
        if self.codec is not comp.Compression.NONE:
            # Keep exactly what the others will decode, so every peer holds equal values.
            values[:] = await asyncio.to_thread(comp.decode, enc)
        ref = await asyncio.to_thread(ray.put, enc)
        result = PartResult(
            epoch=self.plan.epoch,
            round_index=self.round_index,
            group_index=self.group_index,
            part=part,
            owner=self.me,
            numel=self.numel,
            total_weight=total,
            contributors=tuple(contributors),
            ref=ref,
        )
        for peer in self.group.everyone:
            if peer != self.me:
                self.bytes_sent += enc.nbytes
                self._watch_call(peer, self.send(peer, "receive_result", result))

    async def _await_result(
        self, part: int, owner: str, size: int, deadline: float
    ) -> tuple[np.ndarray, PartResult] | None:
        """The owner's result for ``part``; None if the owner died, is late or sent junk."""
        while part not in self.box.results:
            if owner in self.box.dead:
                return None
            if not await self.box.wait_changed(self.box.version, deadline, self.clock):
                log.warning("epoch %d round %d: no result for part %d from %s by the "
                            "deadline", self.plan.epoch, self.round_index, part, owner)
                return None
        result = self.box.results[part]
        if result.numel != self.numel:
            log.warning("result of part %d from %s is for a tensor of %d values, not %d; "
                        "re-reducing", part, owner, result.numel, self.numel)
            return None
        try:
            remaining = max(deadline - self.clock(), 0.0) + 1.0
            enc = await asyncio.wait_for(asyncio.shield(self.box.fetch_result(part)), remaining)
        except Exception as exc:  # noqa: BLE001 - result lost or too slow: re-reduce
            log.warning("result of part %d from %s could not be fetched: %r", part, owner, exc)
            return None
        self.bytes_received += enc.nbytes
        if enc.codec is not self.codec:
            log.warning("result of part %d from %s has codec %s", part, owner, enc.codec.value)
            return None
        values = await asyncio.to_thread(comp.decode, enc)
        if check_contribution(values, size, np.dtype(np.float32), result.total_weight) is not None:
            log.warning("result of part %d from %s is malformed; re-reducing", part, owner)
            return None
        return values, result
