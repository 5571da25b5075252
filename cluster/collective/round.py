"""One butterfly all-reduce round inside one group, over a ``Transport`` (Ray's object
store in the product, ``transport.RayTransport``; plain asyncio, no Ray, here).

Protocol (group of members M = (m_0..m_{k-1}) plus receivers):

1. Every member splits its flat float32 vector into k parts sized by the members'
   shares and encodes them with the round's codec. Large parts (any over
   ``round_send.INLINE_MAX_BYTES``): it ``put``s the k-1 parts it does not own and sends one
   ``Contribution`` (the tuple of part refs, never the bytes) to every other member. Small
   parts: each member's ``Contribution`` carries its own part ``Inline`` (the actor call
   moves the bytes, no object store) and the others ``InBundle``: one put of all of them,
   fetched only to re-reduce a dead owner's part. None is sent if there is nothing for
   anyone (a sole owner's parts all stay with it). A member that owns no part (small
   tensors have fewer owners than members) is not sent contributions: each is held back
   (``hold``) and sent only if that member asks for it (``CopyRequest``) to re-reduce a
   dead owner's part. So a failure-free round moves 2(k-1) messages per owner, not k(k-1).
2. The owner of part j starts fetching part j of each contribution the moment it lands
   (streaming: no barrier, all fetches in flight at once), validates it, and adds it to a
   weighted mean *in the group's member order* (a value waits until the members before it
   are settled). When all live members have been heard, or the contribution deadline
   passes, it encodes the mean and sends it to everyone in a ``PartResult`` (inline if
   small, else as a ref to one put).
3. Every peer fetches the results and writes them straight into its output vector.

Bitwise equality: every member's value enters the mean exactly as the others receive it
(its own part goes through the codec too), in member order, which ``grid.plan_grid`` lays
out by grid coordinate. So every group of a round whose inputs are equal computes equal
bytes whichever member owns which part, and after a multi-round Moshpit grid every peer
holds bitwise identical values (no failures), not only the members of one last-round group.

Failures: every wait has a deadline, each fetch included. While a peer waits it probes the
other members (a ``Probe`` call every ``PROBE_S``): a call to a dead actor fails as soon as
Ray knows (process exit: about a second; a lost node: its health checks), and the waiter
stops waiting for that peer then instead of at the deadline. A member that misses the
contribution deadline drops out of that part's average. If a part's owner is dead or its
result misses the round deadline (or is malformed), each surviving member re-reduces that
part itself from the contributions it received (plus its own; first asking the live
members for the contributions they held back) in member order, so all survivors compute
the same bytes; receivers keep their local values for such a part.
Values of a result are trusted as its owner validated every input (no second pass). An owner
with no valid value at all (its own was NaN or misshapen, none arrived) publishes an empty
result: it keeps zeros, and the members re-reduce the part as a dead owner's, so junk never
spreads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import moshray.cluster.collective.codecs as comp
from moshray.cluster.collective.shares import busy_seconds, round_throughput
from moshray.cluster.collective.mailbox import GroupMailbox, RoundKey
from moshray.cluster.messages import (CopyRequest, Group, PartResult, Probe, Rejection, RejectReason,
                       RoundPlan)
from moshray.cluster.collective.part_reduce import off_loop, reduce_part
from moshray.cluster.collective.round_send import contribute, publish
from moshray.cluster.collective.partition import group_part_sizes, part_slices
from moshray.cluster.collective.transport import Transport

log = logging.getLogger(__name__)

__all__ = ["Deadlines", "GroupMailbox", "GroupRound", "RoundKey", "RoundOutcome", "PROBE_S"]

PROBE_S = 0.5  # how often a waiting peer checks that the members it waits on are alive


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
    throughput: float | None = None  # bytes/s through fetch + reduction (capacity.py)


@dataclass(frozen=True)
class Deadlines:
    contributions: float  # owners stop waiting for contributions
    results: float  # peers stop waiting for results and re-reduce what is missing
    final: float  # fetching a result or re-reducing a dead owner's part ends here

    def __post_init__(self) -> None:
        if not self.contributions <= self.results <= self.final:
            raise ValueError(f"deadlines out of order: {self}")


class GroupRound:
    """Runs this peer's side of one group round (see module docstring).

    ``transport_send(peer, method, message)`` performs a fire-and-forget call and returns
    an awaitable (awaited only to learn that the callee died); ``transport`` puts this
    peer's parts and results and names the errors that mean a peer is gone; ``hold(peer,
    send)`` keeps ``send`` (a contribution's delivery to a member that owns no part) for a
    ``CopyRequest`` from that peer (None: such contributions are sent at once). The round
    never raises for another peer's failure; it returns a ``RoundOutcome``.
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
        transport: Transport,
        clock: Callable[[], float] = time.monotonic,
        hold: Callable[[str, Callable[[], object]], None] | None = None,
    ):
        self.me, self.plan, self.group, self.box = me, plan, group, box
        self.hold = hold
        self.round_index, self.group_index = round_index, group_index
        self.send, self.transport, self.clock = transport_send, transport, clock
        self.codec = comp.Compression(plan.compression)
        self.rejections: list[Rejection] = []
        self.bytes_sent = 0
        self.bytes_received = 0
        self.numel = 0
        self.cpu_seconds = 0.0  # validating, scaling, adding (see part_reduce): wall time
        self.cpu_used = 0.0  # the CPU time of that (far less on a contended machine)
        self.reduced_bytes = 0  # float32 bytes of the terms added
        self._probing: set[str] = set()  # peers with a probe in flight
        self.sizes: tuple[int, ...] | None = None  # each member's part (set by ``_run``)

    # -- helpers -----------------------------------------------------------------------

    def reject(self, sender: str, part: int, reason: RejectReason, detail: str,
               numel: int = -1) -> None:
        self.rejections.append(Rejection(sender, part, reason, detail, numel))
        log.warning(
            "epoch %d round %d: rejected %s's part %d: %s (%s)",
            self.plan.epoch, self.round_index, sender, part, reason.value, detail,
        )

    def watch_call(self, peer: str, call_ref, done: Callable[[], None] | None = None) -> None:
        """Mark ``peer`` dead in the mailbox if the call to it fails."""

        async def watch() -> None:
            try:
                await call_ref
            except self.transport.gone_errors:
                self.box.mark_dead(peer)
            except Exception as exc:  # noqa: BLE001 - any failed delivery means "not heard"
                log.warning("call to %s failed: %s", peer, exc)
                self.box.mark_dead(peer)
            finally:
                if done is not None:
                    done()

        asyncio.ensure_future(watch())

    async def _probe_members(self) -> None:
        """Until cancelled: one probe in flight to each other member we still wait on
        (its contribution, if we are a member, or its part's result) and not known dead."""
        probe = Probe(self.plan.epoch, self.round_index, self.group_index, self.me)
        members = self.group.members
        member = self.me in members
        while True:
            await asyncio.sleep(PROBE_S)
            sizes = self.sizes or (1,) * len(members)
            own = sizes[members.index(self.me)] if member else 0
            for j, peer in enumerate(members):
                if peer == self.me or peer in self.box.dead or peer in self._probing:
                    continue
                result_due = sizes[j] > 0 and j not in self.box.results
                contribution_due = own > 0 and peer not in self.box.contributions
                if not (result_due or contribution_due):
                    continue  # nothing more to wait for from this peer
                self._probing.add(peer)
                ref = self.send(peer, "receive_contribution", probe)
                self.watch_call(peer, ref, done=lambda p=peer: self._probing.discard(p))

    # -- the round -----------------------------------------------------------------------

    async def run(self, flat: np.ndarray, weight: float, deadlines: Deadlines) -> RoundOutcome:
        prober = asyncio.ensure_future(self._probe_members())
        try:
            return await self._run(flat, weight, deadlines)
        finally:
            prober.cancel()

    async def _run(self, flat: np.ndarray, weight: float, deadlines: Deadlines) -> RoundOutcome:
        members = self.group.members
        self.numel = flat.size
        # Small tensors have fewer owners than members (``owner_shares``): a member whose
        # part is empty contributes and receives but reduces and publishes nothing.
        sizes = self.sizes = group_part_sizes(self.plan, members, flat.size)
        slices = part_slices(sizes)
        out = np.empty(flat.size, dtype=np.float32)  # every part is written exactly once
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

        if self.me in members and sizes[members.index(self.me)] == 0:
            own = members.index(self.me)
            await contribute(self, flat, weight, slices, own)
            per_part[own], weights[own] = (), weight
            lap("put")
        elif self.me in members:
            own = members.index(self.me)
            self.box.own_part = own
            for sender in self.box.contributions:  # arrived before our round started
                self.box.fetch_part(sender, own)
            await contribute(self, flat, weight, slices, own)
            lap("put")
            values, total, contributors = await reduce_part(
                self, own, flat[slices[own]], weight, sizes[own], deadlines.contributions,
                deadlines.contributions,
            )
            self.box.reduced = True
            lap("reduce")
            await publish(self, own, values, total, contributors, out[slices[own]])
            per_part[own], weights[own] = contributors, total
            lap("publish")

        for j, owner in enumerate(members):
            if j in per_part:
                continue
            if sizes[j] == 0:  # nothing to receive
                per_part[j], weights[j] = (), weight
                continue
            result = await self._await_result(j, owner, sizes[j], out[slices[j]], deadlines)
            if result is not None:
                per_part[j], weights[j] = result.contributors, result.total_weight
                continue
            failed.append(owner)
            if self.me in members:  # re-reduce from the contributions we hold
                await self._gather_copies(owner, (self.clock() + deadlines.final) / 2)
                values, total, contributors = await reduce_part(
                    self, j, flat[slices[j]], weight, sizes[j], deadlines.contributions,
                    deadlines.final, exclude=owner,
                )
                out[slices[j]] = values
                per_part[j], weights[j] = contributors, total
            else:  # a receiver keeps its local value for the part
                out[slices[j]] = flat[slices[j]]
                per_part[j], weights[j] = (), weight

        lap("gather")
        log_ = self.box.fetch_log
        fetched = sum(n for _, _, n in log_)
        throughput = round_throughput(fetched, busy_seconds((a, b) for a, b, _ in log_),
                                      self.reduced_bytes, self.cpu_seconds)
        phases["cpu"] = self.cpu_seconds  # reduce's numeric steps, wall time in threads
        phases["cpu_used"] = self.cpu_used  # their CPU time
        phases["fetch"] = busy_seconds((a, b) for a, b, _ in log_)  # parts in flight
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
            throughput=throughput,
        )

    async def _gather_copies(self, dead_owner: str, until: float) -> None:
        """Before re-reducing ``dead_owner``'s part: ask every live member whose
        contribution we lack for the one it held back, and wait for them until ``until``
        (a member that died meanwhile is dropped by its failed call)."""
        want = [m for m in self.group.members if m not in (self.me, dead_owner)
                and m not in self.box.contributions and m not in self.box.dead]
        request = CopyRequest(self.plan.epoch, self.round_index, self.group_index, self.me)
        for peer in want:
            self.watch_call(peer, self.send(peer, "receive_contribution", request))
        while any(m not in self.box.contributions and m not in self.box.dead for m in want):
            if not await self.box.wait_changed(self.box.version, until, self.clock):
                return

    async def _await_result(
        self, part: int, owner: str, size: int, dest: np.ndarray, deadlines: Deadlines
    ) -> PartResult | None:
        """Write the owner's result for ``part`` into ``dest``; None (``dest`` untouched)
        if the owner died, is late or sent junk."""
        while part not in self.box.results:
            if owner in self.box.dead:
                return None
            if not await self.box.wait_changed(self.box.version, deadlines.results, self.clock):
                log.warning("epoch %d round %d: no result for part %d from %s by the "
                            "deadline", self.plan.epoch, self.round_index, part, owner)
                return None
        result = self.box.results[part]
        if not result.contributors:
            log.warning("epoch %d round %d: %s had no valid value for part %d; re-reducing",
                        self.plan.epoch, self.round_index, owner, part)
            return None
        if result.numel != self.numel:
            log.warning("result of part %d from %s is for a tensor of %d values, not %d; "
                        "re-reducing", part, owner, result.numel, self.numel)
            return None
        try:  # a result that came in time may still be fetched until the final deadline
            task = self.box.fetch_result(part)
            enc = await self.box.await_fetch(task, owner, deadlines.final, self.clock)
        except Exception as exc:  # noqa: BLE001 - result lost or too slow: re-reduce
            log.warning("result of part %d from %s could not be fetched: %r", part, owner, exc)
            return None
        self.bytes_received += enc.nbytes
        if enc.codec is not self.codec or enc.numel != size or enc.data.shape != (size,):
            log.warning("result of part %d from %s is malformed (%s, %d values); "
                        "re-reducing", part, owner, enc.codec.value, enc.numel)
            return None
        await off_loop(dest.nbytes, comp.decode_into, enc, dest)
        return result
