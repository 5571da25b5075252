"""One butterfly all-reduce round inside one group, over a ``Transport`` (Ray's object
store in the product, ``transport.RayTransport``; plain asyncio, no Ray, here).

``GroupRound`` is the whole round, one object: the sending side (a member's contribution
to the part owners, an owner's result to everyone), the owner's reduction of its part and
the gathering of the others' results. It reads what the transport delivered from its
``GroupMailbox`` (``mailbox.py``), which the ``Averager`` fills; nothing else touches its
counters.

Protocol (group of members M = (m_0..m_{k-1}) plus receivers):

1. Every member splits its flat float32 vector into k parts sized by the members'
   shares and encodes them with the round's codec. Large parts (any over
   ``INLINE_MAX_BYTES``): it ``put``s the k-1 parts it does not own and sends one
   ``Contribution`` (the tuple of part refs, never the bytes) to every other member. Small
   parts: each member's ``Contribution`` carries its own part ``Inline`` (the actor call
   moves the bytes, no object store) and the others ``InBundle``: one put of all of them,
   fetched only to re-reduce a dead owner's part. None is sent if there is nothing for
   anyone (a sole owner's parts all stay with it). A member that owns no part (small
   tensors have fewer owners than members) is not sent contributions: each is held back
   (``hold``) and sent only if that member asks for it (``CopyRequest``) to re-reduce a
   dead owner's part. So a failure-free round moves 2(k-1) messages per owner, not k(k-1).
2. The owner of part j starts fetching part j of each contribution the moment it lands
   (streaming: no barrier, all fetches in flight at once), validates it against the
   step's ``Limits`` (``partition.check_contribution``: shape, dtype, finiteness, value and
   weight bounds), and adds it to a weighted mean *in the group's member order* (a value
   waits until the members before it are settled), each value weighted by the weight its
   contribution carries there (see "Weights per value"). When all live members have been
   heard, or the contribution deadline passes, it checks the mean is finite, encodes it and
   sends it to everyone in a ``PartResult`` with the part's total weight per value (inline
   if small, else as a ref to one put).
3. Every peer fetches the results, writes them straight into its output vector and checks
   them (finite, within its value bound; total weights well formed and within the bound
   times the group's size); a result that fails is re-reduced like a dead owner's. The
   results' total weights, part after part, are the weights of this peer's values for the
   next round.

With a job key (``auth.py``) every ``Contribution`` and ``PartResult`` is signed (a tag
over its fields, and a MAC of each part's encoded bytes: one pass over them here at the
sender, one at each receiver); the ``Averager`` drops a message whose tag is missing or
wrong on arrival, and here an owner rejects a part whose bytes do not match the payload tag
its sender signed (``UNAUTHENTICATED``), and a peer re-reduces a result whose bytes do not
match its owner's.

The numeric work is staged so that the event loop only ever waits: as soon as a
contribution's bytes arrive, a worker thread validates them and turns them into their term
of the mean (``WeightedMean.term``: widened from the wire format into a float32 buffer of
our own, checked, scaled in place); when its turn in member order comes, the term is added
(one float32 pass). So a slow sender delays only the adds after it.

Bitwise equality: every member's value enters the mean exactly as the others receive it
(its own part goes through the codec too), in member order, which ``grid.plan_grid`` lays
out by grid coordinate. So every group of a round whose inputs are equal computes equal
bytes whichever member owns which part, and after a multi-round Moshpit grid every peer
holds bitwise identical values (no failures), not only the members of one last-round group.

Weights per value: a member that dies after sending its contribution leaves it in the parts
whose live owners fetched it, and out of the parts the survivors re-reduce for dead owners:
its own part of its value was never sent (it reduces that itself), and the copies of its
other parts live in its object store, lost with it. So the group's result holds, say,
weight 13 on two parts and 6 on the other two. With one weight per contribution the next
round would weigh all of that aggregate's values alike and be off by a few percent wherever
the weights differ. Instead every contribution carries its weight per segment of values
(``messages.SegmentWeights``: the caller's one weight in a step's first round; after it the
previous round's parts, equal neighbours merged: one segment with no failure, a few after
one); the owner computes, at every value c of its part,
``sum_k W_k(c) x_k(c) / sum_k W_k(c)`` (``WeightedMean``) and publishes that total weight
``sum_k W_k(c)``, per segment of its part; the segments are signed with the contribution or
result (``auth.py``) and checked against the step's weight bound like one weight. So every
peer's result is, value by value, the exact weighted mean of the contributions it holds
there. It costs no message and no round trip: the weights ride in the calls the round makes
anyway, and with no failure they are one number and the arithmetic is the same float32
steps as with a scalar weight (bitwise equal results). The alternative, dropping a member
missing from any part from every part of its group, would need the owners to agree on who
that is (one more exchange per round) and throw live contributions away. What no weighting
recovers: a dead member's contribution stays missing from the parts it did not reach (its
reports name it partial), and a member that dies before a later round takes its group's
aggregate out of that round's group.

Failures: every wait has a deadline, each fetch included. While a peer waits it probes the
other members (a ``Probe`` call every ``PROBE_S``): a call to a dead actor fails as soon as
Ray knows (process exit: about a second; a lost node: its health checks), and the waiter
stops waiting for that peer then instead of at the deadline. A member that misses the
contribution deadline drops out of that part's average. If a part's owner is dead or its
result misses the round deadline (or is malformed, non-finite or out of bounds), each
surviving member re-reduces that part itself from the contributions it received (plus its
own; first asking the live members for the contributions they held back) in member order,
so all survivors compute the same bytes; receivers keep their local values (and weights)
for such a part.
An owner with no valid value at all (its own was NaN or misshapen, none arrived) publishes
an empty result: it keeps zeros, and the members re-reduce the part as a dead owner's, so
junk never spreads. A weighted mean that comes out non-finite (accepted values that still
overflow: only with bounds loosened past float32's range) is treated the same way and
marks the round ``errored``: the ``Averager`` then fails the step instead of returning it.
The round never raises for another peer's failure.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import moshray.cluster.collective.codecs as comp
from moshray.cluster.collective.auth import JobAuth
from moshray.cluster.collective.mailbox import GroupMailbox
from moshray.cluster.collective.partition import (UNBOUNDED, Limits, WeightedMean,
                                                  check_contribution, check_weights,
                                                  group_part_sizes, part_slices)
from moshray.cluster.collective.shares import busy_seconds, peak_rate, round_throughput
from moshray.cluster.collective.transport import Transport
from moshray.cluster.messages import (Contribution, CopyRequest, Group, InBundle, Inline,
                                      PartResult, PeerPlan, Probe, Rejection, RejectReason,
                                      SegmentWeights)

log = logging.getLogger(__name__)

__all__ = ["Deadlines", "GroupRound", "RoundOutcome", "INLINE_BYTES", "INLINE_MAX_BYTES",
           "PROBE_S", "off_loop"]

PROBE_S = 0.5  # how often a waiting peer checks that the members it waits on are alive
# Parts up to this many encoded bytes travel inside the actor calls (``Inline``, as chunks
# under Ray's inline-argument limit: ``inline.py``): for them the object store's put, pull
# and reference counting cost several times the bytes' copy.
INLINE_MAX_BYTES = 1 << 20
# Numeric work on fewer bytes than this runs on the event loop itself: a hop to a worker
# thread and back costs more than it (and, on a loaded machine, waits for a core twice).
INLINE_BYTES = 2 << 20
F32 = np.dtype(np.float32)


async def off_loop(nbytes: int, fn, *args):
    """``fn(*args)``: in a worker thread when it touches at least ``INLINE_BYTES``, else
    right here on the loop."""
    if nbytes < INLINE_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


@dataclass
class RoundOutcome:
    """What one peer got out of one group round. ``weights``: the total weight each value
    of ``values`` holds (the next round's contribution carries it). ``errored``: why the
    round's values must not be applied (a non-finite weighted mean), empty if they may."""

    values: np.ndarray
    weights: SegmentWeights
    contributors: tuple[str, ...]
    partial_contributors: tuple[str, ...]
    rejections: list[Rejection]
    failed_owners: tuple[str, ...]
    bytes_sent: int
    bytes_received: int
    phases: dict[str, float]  # seconds spent in put / reduce / publish / gather
    throughput: float | None = None  # bytes/s through fetch + reduction (shares.py)
    errored: str = ""
    bytes_to: dict[str, int] = field(default_factory=dict)  # of bytes_sent, by receiver


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
    ``CopyRequest`` from that peer (None: such contributions are sent at once); ``limits``:
    what a contribution or result may hold (``ContributionBounds.limits``; default:
    unbounded, finiteness only). ``auth``: the job's key (``auth.JobAuth``): our messages
    are signed with it and every part or result whose bytes do not match its sender's
    payload tag is rejected (``UNAUTHENTICATED``) or re-reduced; the ``Averager`` checks
    the tags on arrival. None: nothing is signed or checked. The round never raises for
    another peer's failure; it returns a ``RoundOutcome``. One object per round: ``run``
    once.
    """

    def __init__(
        self,
        me: str,
        plan: PeerPlan,
        round_index: int,
        group_index: int,
        group: Group,
        box: GroupMailbox,
        transport_send: Callable[[str, str, object], object],
        transport: Transport,
        clock: Callable[[], float] = time.monotonic,
        hold: Callable[[str, Callable[[], object]], None] | None = None,
        limits: Limits = UNBOUNDED,
        auth: JobAuth | None = None,
    ):
        self.me, self.plan, self.group, self.box = me, plan, group, box
        self.auth = auth
        self.hold = hold
        self.round_index, self.group_index = round_index, group_index
        self.send, self.transport, self.clock = transport_send, transport, clock
        self.codec = comp.get_codec(plan.compression)
        self.limits = limits
        self.rejections: list[Rejection] = []
        self.bytes_sent = 0
        self.bytes_to: collections.Counter[str] = collections.Counter()  # by receiver
        self.bytes_received = 0
        self.numel = 0
        self.cpu_seconds = 0.0  # validating, scaling, adding (see ``_reduce_part``): wall time
        self.cpu_used = 0.0  # the CPU time of that (far less on a contended machine)
        self.auth_seconds = 0.0  # signing and checking (``_authed``): wall time
        self.auth_used = 0.0  # the CPU time of that
        self.reduced_bytes = 0  # float32 bytes of the terms added
        self.errored = ""  # set when a part's mean came out non-finite
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

    def _timed(self, fn, *args, auth: bool = False):
        """``fn(*args)``, adding its wall time and its thread's CPU time to the round's
        numeric work, or with ``auth`` to its signing and checking (``_authed``; a check
        made inside numeric work counts in both)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        finally:
            wall, used = time.perf_counter() - t0, time.thread_time() - c0
            if auth:
                self.auth_seconds += wall
                self.auth_used += used
            else:
                self.cpu_seconds += wall
                self.cpu_used += used

    _authed = functools.partialmethod(_timed, auth=True)

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

    async def run(self, flat: np.ndarray, weights: SegmentWeights,
                  deadlines: Deadlines) -> RoundOutcome:
        """Average ``flat`` (float32, this peer's values) with the group; ``weights``: the
        weight of each of its values (the caller's weight, one segment, in a step's first
        round; the previous round's ``RoundOutcome.weights`` after it)."""
        prober = asyncio.ensure_future(self._probe_members())
        try:
            return await self._run(flat, weights, deadlines)
        finally:
            prober.cancel()

    async def _run(self, flat: np.ndarray, weights: SegmentWeights,
                   deadlines: Deadlines) -> RoundOutcome:
        members = self.group.members
        self.numel = flat.size
        # Small tensors have fewer owners than members (``owner_shares``): a member whose
        # part is empty contributes and receives but reduces and publishes nothing.
        sizes = self.sizes = group_part_sizes(self.plan, members, flat.size)
        slices = part_slices(sizes)
        out = np.empty(flat.size, dtype=np.float32)  # every part is written exactly once
        per_part: dict[int, tuple[str, ...]] = {}
        failed: list[str] = []
        totals: dict[int, SegmentWeights] = {}  # each part's total weight, per value

        def ours(j: int) -> SegmentWeights:  # our own weights on part j
            return weights.within(slices[j].start, slices[j].stop)

        phases: dict[str, float] = {}
        mark = self.clock()

        def lap(name: str) -> None:
            nonlocal mark
            now = self.clock()
            phases[name] = phases.get(name, 0.0) + now - mark
            mark = now

        if self.me in members and sizes[members.index(self.me)] == 0:
            own = members.index(self.me)
            await self._contribute(flat, weights, slices, own)
            per_part[own], totals[own] = (), ours(own)
            lap("put")
        elif self.me in members:
            own = members.index(self.me)
            self.box.own_part = own
            for sender in self.box.contributions:  # arrived before our round started
                self.box.fetch_part(sender, own)
            await self._contribute(flat, weights, slices, own)
            lap("put")
            values, total, contributors = await self._reduce_part(
                own, flat[slices[own]], ours(own), sizes[own], deadlines.contributions,
                deadlines.contributions,
            )
            self.box.reduced = True
            lap("reduce")
            await self._publish(own, values, total, contributors, out[slices[own]])
            per_part[own], totals[own] = contributors, total
            lap("publish")

        for j, owner in enumerate(members):
            if j in per_part:
                continue
            if sizes[j] == 0:  # nothing to receive
                per_part[j], totals[j] = (), ours(j)
                continue
            result = await self._await_result(j, owner, sizes[j], out[slices[j]], deadlines)
            if result is not None:
                per_part[j], totals[j] = result.contributors, result.weights
                continue
            failed.append(owner)
            if self.me in members:  # re-reduce from the contributions we hold
                await self._gather_copies(owner, (self.clock() + deadlines.final) / 2)
                values, total, contributors = await self._reduce_part(
                    j, flat[slices[j]], ours(j), sizes[j], deadlines.contributions,
                    deadlines.final, exclude=owner,
                )
                out[slices[j]] = values
                per_part[j], totals[j] = contributors, total
            else:  # a receiver keeps its local value for the part, with its weights
                out[slices[j]] = flat[slices[j]]
                per_part[j], totals[j] = (), ours(j)

        lap("gather")
        log_ = self.box.fetch_log
        fetched = sum(n for _, _, n in log_)
        peak = peak_rate(log_)  # our inbound link's rate (shares.py)
        throughput = round_throughput(fetched, fetched / peak if peak else 0.0,
                                      self.reduced_bytes, self.cpu_seconds)
        phases["cpu"] = self.cpu_seconds  # reduce's numeric steps, wall time in threads
        phases["cpu_used"] = self.cpu_used  # their CPU time
        phases["auth"] = self.auth_seconds  # signing and checking, wall time
        phases["auth_used"] = self.auth_used  # its CPU time
        phases["fetch"] = busy_seconds((a, b) for a, b, _ in log_)  # parts in flight
        everyone = [set(c) for j, c in per_part.items() if sizes[j] > 0] or [set()]
        full = set.intersection(*everyone)
        partial = set.union(*everyone) - full
        # each value keeps exactly the weight its part's reduction summed (no average over
        # parts: after a failure the parts hold different weights, see module docstring)
        new_weights = SegmentWeights.joined([(sizes[j], totals[j]) for j in range(len(sizes))])
        return RoundOutcome(
            values=out,
            weights=new_weights if flat.size else weights,
            contributors=tuple(sorted(full)),
            partial_contributors=tuple(sorted(partial)),
            rejections=self.rejections,
            failed_owners=tuple(failed),
            bytes_sent=self.bytes_sent,
            bytes_to=dict(self.bytes_to),
            bytes_received=self.bytes_received,
            phases=phases,
            throughput=throughput,
            errored=self.errored,
        )

    # -- sending: our contribution, our part's result -------------------------------------

    async def _contribute(self, flat: np.ndarray, weights: SegmentWeights, slices,
                          own: int) -> None:
        """Send ``flat``'s parts (``slices``; ``own`` is ours), with their ``weights``
        (signed with them when there is a key), to the part owners: inline
        and one lazily made put (``InBundle``) for small parts, refs for large ones. What a
        member that owns nothing would get is handed to ``hold`` (sent on a
        ``CopyRequest``). Every call is watched: a failed one marks that peer dead."""
        members = self.group.members

        def encode_parts() -> list:
            encs = []
            for j, s in enumerate(slices):
                if j == own or s.stop == s.start:  # ours, or a member that owns nothing
                    encs.append(None)
                    continue
                enc = comp.encode(flat[s], self.codec)  # none: a view, put copies it once
                self.bytes_sent += enc.nbytes
                self.bytes_to[members[j]] += enc.nbytes
                encs.append(enc)
            # one MAC pass over each part; each receiver checks only the part it reduces
            signed = (b"", (), b"") if self.auth is None else self._authed(
                self.auth.sign_contribution, self.plan.epoch, self.round_index,
                self.group_index, self.me, weights, flat.size, encs)
            return encs, signed

        encs, (nonce, payload_tags, tag) = await off_loop(flat.nbytes, encode_parts)
        if all(enc is None for enc in encs):
            # Nothing for anyone (the sole owner: its own part stays here): the others
            # would only keep it for re-reducing a part we own, and that dies with us.
            # The members still waiting on us probe us (``_probe_members``).
            return
        if max(enc.nbytes for enc in encs if enc is not None) <= INLINE_MAX_BYTES:
            bundle: list = []  # one put of all parts, made when a message first needs it

            def in_bundle(k: int) -> InBundle:  # fetched only if an owner dies
                if not bundle:
                    bundle.append(self.transport.put(tuple(encs)))
                return InBundle(bundle[0], k)

            def payloads(j: int) -> tuple:
                return tuple(None if enc is None else Inline(enc) if k == j else
                             in_bundle(k) for k, enc in enumerate(encs))
        else:
            refs = await off_loop(flat.nbytes, lambda: tuple(
                None if enc is None else self.transport.put(enc) for enc in encs))

            def payloads(j: int) -> tuple:
                return refs

        def message(j: int) -> Contribution:
            return Contribution(epoch=self.plan.epoch, round_index=self.round_index,
                                group_index=self.group_index, sender=self.me,
                                weights=weights, numel=flat.size, part_refs=payloads(j),
                                nonce=nonce, payload_tags=payload_tags, tag=tag)

        for j, peer in enumerate(members):
            if peer == self.me:
                continue
            if self.hold is not None and slices[j].stop == slices[j].start:
                # owns nothing: sent (and its bundle put) only on request. ``encs`` are
                # our own arrays or views of the round's input, which nobody writes.
                self.hold(peer, lambda p=peer, j=j: self.send(p, "receive_contribution",
                                                              message(j)))
                continue
            self.watch_call(peer, self.send(peer, "receive_contribution", message(j)))

    async def _publish(self, part: int, values: np.ndarray, total: SegmentWeights,
                       contributors, dest: np.ndarray) -> None:
        """Write our reduced ``part`` into ``dest`` exactly as the others will decode it,
        and send it with its total weight per value (``total``) to every other peer of the
        group (inline if small, else as one put)."""
        enc = await off_loop(values.nbytes, comp.encode, values, self.codec)
        # Keep exactly what the others will decode, so every peer holds equal values.
        await off_loop(values.nbytes, comp.decode_into, enc, dest)
        others = [peer for peer in self.group.everyone if peer != self.me]
        if not others:
            return  # a group of one (a single replica): nobody to send the result to
        ref = Inline(enc) if enc.nbytes <= INLINE_MAX_BYTES else \
            await off_loop(values.nbytes, self.transport.put, enc)
        nonce = payload_tag = tag = b""
        if self.auth is not None:
            nonce, payload_tag, tag = await off_loop(
                values.nbytes, self._authed, self.auth.sign_result, self.plan.epoch,
                self.round_index, self.group_index, part, self.me, self.numel, total,
                tuple(contributors), enc)
        result = PartResult(
            epoch=self.plan.epoch,
            round_index=self.round_index,
            group_index=self.group_index,
            part=part,
            owner=self.me,
            numel=self.numel,
            weights=total,
            contributors=tuple(contributors),
            ref=ref,
            nonce=nonce,
            payload_tag=payload_tag,
            tag=tag,
        )
        for peer in others:
            self.bytes_sent += enc.nbytes
            self.bytes_to[peer] += enc.nbytes
            self.watch_call(peer, self.send(peer, "receive_result", result))

    # -- reducing a part ------------------------------------------------------------------

    def _own_term(self, local: np.ndarray, size: int, weights: SegmentWeights):
        """Our own value of a part as the others will see it (through the codec), as a term
        of the mean; or the reason it is rejected (NaN, wrong shape, bad weight, bounds)."""
        return self._term(comp.encode(local, self.codec), size, weights)

    def _accept(self, enc: comp.Encoded, size: int, weights: SegmentWeights,
                authentic: Callable[[object], bool] | None):
        """A fetched part as a term of the mean, or a ``(reason, detail)`` rejection.
        ``weights``: its sender's weights on the part; ``authentic(enc)``: whether the bytes
        are the ones its sender tagged (``JobAuth.part_matches``; None: no key, nothing to
        check)."""
        codec = self.codec
        if authentic is not None and not self._authed(authentic, enc):
            return (RejectReason.UNAUTHENTICATED,
                    "the part's bytes do not match the payload tag its sender signed")
        if not isinstance(enc, comp.Encoded):
            return RejectReason.DTYPE_MISMATCH, f"payload of type {type(enc).__name__}"
        if enc.data.dtype != codec.wire_dtype or enc.codec != codec.name:
            return (RejectReason.DTYPE_MISMATCH,
                    f"got {enc.codec}/{enc.data.dtype}, expected {codec.name}/"
                    f"{codec.wire_dtype}")
        try:
            return self._term(enc, size, weights)
        except (ValueError, TypeError, IndexError) as exc:  # e.g. 8-bit meta of another layout
            return RejectReason.SHAPE_MISMATCH, f"undecodable payload: {exc}"

    def _term(self, enc: comp.Encoded, size: int, weights: SegmentWeights):
        data = enc.data
        if data.ndim != 1 or data.shape[0] != self.codec.wire_length(size) or enc.numel != size:
            return check_contribution(data, size, data.dtype, weights, self.limits) or (
                RejectReason.SHAPE_MISMATCH, f"payload of {enc.numel} values, expected {size}")
        values = self.codec.decode(enc)
        # a fresh float32 buffer of ours, unless the codec hands back the wire buffer
        owned = values is not data and values.flags.writeable
        problem = check_contribution(values, size, F32, weights, self.limits)
        if problem is not None:
            return problem
        return WeightedMean.term(values, weights, owned=owned)

    async def _reduce_part(
        self,
        part: int,
        local: np.ndarray,
        weights: SegmentWeights,
        size: int,
        arrive_by: float,
        fetch_by: float,
        exclude: str | None = None,
    ) -> tuple[np.ndarray, SegmentWeights, tuple[str, ...]]:
        """Weighted mean of part ``part`` over our own value (``local``, with our
        ``weights`` on the part) and the contributions that arrive before ``arrive_by`` and
        are fetched before ``fetch_by`` (``exclude``: a dead owner whose part we re-reduce
        after the contribution deadline: then exactly the contributions that had arrived
        count, and only their fetches are waited for), and its total weight per value.

        Each value is weighted by the weight its contribution carries there
        (``Contribution.weights``), so a part whose contributions hold different weights
        on different values (after a failure in an earlier round) is still the exact
        weighted mean, value by value. A contribution whose weights are malformed, negative,
        non-finite or above the step's bound is rejected as a whole. All fetches run at
        once; values enter the mean in the group's member order, each as soon as every
        member before it is settled (added, rejected or known absent), so any peer reducing
        the same inputs computes bitwise identical results. No valid value at all, or a
        non-finite mean (then ``errored`` is set): zeros, weight 0, no contributors.
        """
        box, clock, timed = self.box, self.clock, self._timed
        order = [m for m in self.group.members if m != exclude]
        mean = WeightedMean(size)
        held: dict[str, tuple[np.ndarray, SegmentWeights]] = {}
        settled: set[str] = {self.me}
        preparing: dict[str, asyncio.Future] = {}  # validation + scaling, in worker threads
        start = sum(self.sizes[:part])  # our part's first value in the whole tensor

        def on_part(c: Contribution) -> SegmentWeights:  # a sender's weights on our part
            return c.weights.within(start, start + size)

        nbytes = size * F32.itemsize
        got = await off_loop(nbytes, timed, self._own_term, local, size, weights)
        if isinstance(got, tuple):
            self.reject(self.me, part, *got)
        else:
            held[self.me] = (got, weights)
        fetching: dict[str, asyncio.Task] = {}
        contributors: list[str] = []
        added = 0  # members of ``order`` whose turn has passed
        while True:
            seen = box.version  # arrivals during the awaits below wake the wait at once
            closed = clock() >= arrive_by  # no more waiting for absent contributions
            for sender in order:
                if sender in settled or sender in fetching or sender in preparing:
                    continue
                c = box.contributions.get(sender)
                if c is None:
                    if closed or sender in box.dead:
                        settled.add(sender)
                elif c.numel != self.numel:
                    self.reject(sender, part, RejectReason.SHAPE_MISMATCH,
                                f"tensor of {c.numel} values", c.numel)
                    settled.add(sender)
                elif (problem := check_weights(c.weights, self.numel, self.limits)):
                    self.reject(sender, part, *problem)
                    settled.add(sender)
                else:
                    fetching[sender] = box.fetch_part(sender, part)
            for sender, task in list(fetching.items()):
                if not task.done():
                    continue
                del fetching[sender]
                try:
                    enc = task.result()
                except Exception as exc:  # noqa: BLE001 - object lost with its owner
                    self.reject(sender, part, RejectReason.FETCH_FAILED, type(exc).__name__)
                    settled.add(sender)
                    continue
                self.bytes_received += getattr(enc, "nbytes", 0)
                weights_of = on_part(box.contributions[sender])
                authentic = None if self.auth is None else functools.partial(
                    self.auth.part_matches, box.contributions[sender], part)
                future = asyncio.ensure_future(
                    off_loop(nbytes, timed, self._accept, enc, size, weights_of, authentic))
                future.add_done_callback(lambda _: box.notify())
                preparing[sender] = future
            for sender, future in list(preparing.items()):
                if not future.done():
                    continue
                del preparing[sender]
                settled.add(sender)
                got = future.result()
                if isinstance(got, tuple):
                    self.reject(sender, part, *got)
                else:
                    held[sender] = (got, on_part(box.contributions[sender]))
            while added < len(order) and order[added] in settled:
                member = order[added]
                added += 1
                if member in held:
                    await off_loop(nbytes, timed, mean.add_term, *held.pop(member))
                    contributors.append(member)
            if added == len(order):
                break
            if not await box.wait_changed(seen, fetch_by if closed else arrive_by, clock) \
                    and closed:
                break  # fetch deadline: whoever has not been fetched drops out of this part
        for member in order[added:]:  # past the deadline: what did arrive, in order
            if member in held:
                await off_loop(nbytes, timed, mean.add_term, *held.pop(member))
                contributors.append(member)
        for future in preparing.values():  # late: their threads finish on their own
            future.cancel()
        if mean.count == 0:
            # Nothing valid, not even our own value (NaN, wrong shape): never hand junk on.
            # Zeros for ourselves (a NaN gradient must not reach our parameters, nor through
            # us as a donor everyone's); a published empty result makes the receivers
            # re-reduce the part from what they hold (see ``_await_result``).
            return np.zeros(size, dtype=np.float32), SegmentWeights.uniform(0.0), ()
        values, total = await off_loop(nbytes, timed, mean.result)
        self.reduced_bytes += values.nbytes * mean.count
        if not math.isfinite(await off_loop(nbytes, timed, comp.max_abs, values)):
            # Accepted values that still overflowed (bounds loosened past float32): the
            # same as no valid value, and the step must not be applied.
            self.errored = f"part {part}: the weighted mean is not finite"
            log.error("epoch %d round %d: %s", self.plan.epoch, self.round_index, self.errored)
            return np.zeros(size, dtype=np.float32), SegmentWeights.uniform(0.0), ()
        return values, total, tuple(sorted(contributors))

    # -- receiving the others' results ----------------------------------------------------

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
        """Write the owner's result for ``part`` into ``dest``; None if the owner died, is
        late or sent junk (malformed, total weights that are malformed for the part,
        negative, non-finite or above our bound times the group's size, a value that is
        non-finite or above our bound: ``dest`` may then hold it, and the caller overwrites
        it)."""
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
        bound = Limits(weight=self.limits.weight * len(self.group.members))
        problem = check_weights(result.weights, size, bound)
        if problem is not None:
            log.warning("result of part %d from %s has bad total weights (%s; bound %.3g "
                        "per member); re-reducing", part, owner, problem[1],
                        self.limits.weight)
            return None
        try:  # a result that came in time may still be fetched until the final deadline
            task = self.box.fetch_result(part)
            enc = await self.box.await_fetch(task, owner, deadlines.final, self.clock)
        except Exception as exc:  # noqa: BLE001 - result lost or too slow: re-reduce
            log.warning("result of part %d from %s could not be fetched: %r", part, owner, exc)
            return None
        self.bytes_received += getattr(enc, "nbytes", 0)
        if self.auth is not None and not await off_loop(
                dest.nbytes, self._authed, self.auth.result_matches, result, enc):
            self.reject(owner, part, RejectReason.UNAUTHENTICATED,
                        "the result's bytes do not match the payload tag its owner signed")
            return None
        if not isinstance(enc, comp.Encoded) or enc.codec != self.codec.name \
                or enc.numel != size or enc.data.shape != (self.codec.wire_length(size),):
            log.warning("result of part %d from %s is malformed (%s, %s values); "
                        "re-reducing", part, owner, getattr(enc, "codec", type(enc).__name__),
                        getattr(enc, "numel", "?"))
            return None
        try:
            await off_loop(dest.nbytes, comp.decode_into, enc, dest)
        except (ValueError, TypeError, IndexError) as exc:
            log.warning("result of part %d from %s is undecodable (%s); re-reducing",
                        part, owner, exc)
            return None
        peak = await off_loop(dest.nbytes, comp.max_abs, dest)
        if not peak <= self.limits.value:  # NaN fails too
            log.warning("epoch %d round %d: result of part %d from %s holds |value| %.3g "
                        "(bound %.3g); re-reducing", self.plan.epoch, self.round_index, part,
                        owner, peak, self.limits.value)
            return None
        return result
