"""The Moshpit averager a peer embeds: d group rounds over its part of a plan
(``messages.PeerPlan``, as the Coordinator sends it, or a whole ``RoundPlan``).

An ``Averager`` lives inside an async Ray actor (``AveragingPeer`` here, the replica actor
in training). The actor forwards two transport methods to it (``RayTransport`` sends a
small payload's bytes as extra arguments, ``inline.py``)::

    async def receive_contribution(self, c, *chunks):
        self.averager.deliver_contribution(inline.join(c, chunks))
    async def receive_result(self, r, *chunks):
        self.averager.deliver_result(inline.join(r, chunks))

and a training loop calls ``await averager.all_reduce(tensors, weight, plan, timeout)``.

Contract of ``all_reduce``:
- returns ``(averaged, report)`` where ``averaged`` has the same shapes, dtypes and
  devices as ``tensors`` (torch tensors or numpy arrays);
- with no failures every participant gets the exact weighted average (float32 rounding,
  plus the documented codec error when compression is on);
- with failures every participant still gets, value by value, the exact weighted mean of
  the contributions its result holds there (same rounding and codec error): a member that
  dies mid-round leaves its contribution in the parts the others own and out of its own,
  so the group's result holds different weights on different values; the weights travel
  per segment (``messages.SegmentWeights``) into the next round's contributions, where
  every value is weighed by exactly what it holds (``round.py``). The report's
  ``weights`` is the result's total weight per value, ``total_weight`` its mean over the
  values (the total itself when it is the same everywhere, always with no failure);
- each round waits at most ``timeout`` seconds, or less once rounds were observed: the
  adaptive deadline of ``deadline.py`` (from this peer's recent round durations, capped at
  ``timeout``); contributions for the first 60% of it, results until its end, plus at most
  25% more to finish fetching a result that came in
  time or to re-reduce the part of a dead owner locally; every fetch is bounded by those
  deadlines, and a dead member is noticed by probing (see ``round.py``) rather than by a
  deadline; it never raises because another peer failed, and never waits forever;
- with no failures, every participant ends with bitwise identical values, also after a
  multi-round grid (see ``round.py``: canonical member order);
- bad contributions (shape, dtype, stale epoch, non-finite, bad weight, a value or weight
  above the step's bounds: ``partition.ContributionBounds``, derived from this peer's own
  input and weight) are rejected, logged and counted in ``rejection_counts`` and in the
  report; every result is checked (finite, within the value bound) before it is used;
- with a job key (``job_key``), every contribution and result is signed and checked
  (``auth.py``): one with no tag, a tag the key did not make (a forger's, or a sender name
  changed after signing) or bytes that do not match their payload tag is rejected as
  ``UNAUTHENTICATED`` and counted like the other reasons, before it can take the claimed
  sender's place in a round; the Coordinator's quarantine does not count it against the
  claimed sender (a forger can name anyone);
- if a weighted mean still comes out non-finite (only possible with bounds loosened past
  float32's range), ``all_reduce`` raises ``AveragingError``: the step errored and its
  values must not be applied (none are returned).
Only one ``all_reduce`` runs at a time per averager.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from moshray.cluster.collective.auth import JobAuth
from moshray.cluster.collective.codecs import max_abs, warm_up
from moshray.cluster.collective.deadline import DeadlinePolicy, RoundTimes
from moshray.cluster.collective.mailbox import GroupMailbox, RoundKey
from moshray.cluster.collective.partition import ContributionBounds
from moshray.cluster.collective.round import Deadlines, GroupRound, off_loop
from moshray.cluster.collective.shares import ThroughputMeter
from moshray.cluster.messages import (
    AllReduceReport, Contribution, CopyRequest, PartResult, PeerPlan, Probe, Rejection,
    RejectReason, RoundPlan, SegmentWeights,
)
from moshray.cluster.collective.transport import RayTransport, Transport

log = logging.getLogger(__name__)

CONTRIBUTION_FRACTION = 0.6
FINAL_FRACTION = 1.25  # fetching a result in time, or re-reducing a dead owner's part


class AveragingError(RuntimeError):
    """The step's averaging errored (a non-finite weighted mean): nothing is applied.
    Pickles cleanly, so it crosses actor calls as itself."""

    def __init__(self, epoch: int, detail: str):
        self.epoch, self.detail = epoch, detail
        super().__init__(f"all-reduce of epoch {epoch} errored: {detail}")

    def __reduce__(self):
        return (type(self), (self.epoch, self.detail))


def flatten(tensors: Sequence[Any]) -> np.ndarray:
    """Concatenate tensors (torch or numpy) into one float32 vector on the CPU.

    A single float32 numpy array comes back as a flat view (no copy; the averager never
    writes to it, so a read-only buffer such as an object-store argument is fine)."""
    if len(tensors) == 1 and isinstance(tensors[0], np.ndarray) and tensors[0].dtype == np.float32:
        return tensors[0].reshape(-1)
    parts = []
    for t in tensors:
        if hasattr(t, "detach"):  # torch.Tensor; the object store needs CPU memory
            t = t.detach().to("cpu", dtype=_torch().float32).numpy()
        parts.append(np.asarray(t, dtype=np.float32).reshape(-1))
    if not parts:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate(parts)


def unflatten(flat: np.ndarray, like: Sequence[Any], owned: bool = False) -> list[Any]:
    """Split ``flat`` back into tensors shaped, typed and placed like ``like``.

    ``owned``: ``flat`` is a fresh, writable buffer nobody else holds, so the outputs may be
    views of it (no copy when dtype and device already match)."""
    out, offset = [], 0
    for t in like:
        n = int(np.prod(t.shape)) if len(t.shape) else 1
        chunk = flat[offset : offset + n].reshape(t.shape)
        offset += n
        if hasattr(t, "detach"):
            chunk = chunk if owned else np.array(chunk)
            out.append(_torch().from_numpy(chunk).to(device=t.device, dtype=t.dtype))
        else:
            out.append(chunk.astype(t.dtype, copy=not owned))
    return out


def _torch():
    import torch

    return torch


class Averager:
    """One peer's side of Moshpit All-Reduce (see module docstring).

    ``transport`` moves messages and bytes (``transport.Transport``; default: Ray actor
    calls and the object store, ``RayTransport``). ``clock`` is injectable for tests.
    ``bounds``: how each step's value and weight limits are derived (the defaults suit
    gradients and parameters; see ``ContributionBounds``). ``deadline``: how round
    deadlines adapt to observed round times (``deadline.DeadlinePolicy``; None: every
    round waits the ``timeout`` passed to ``all_reduce``). ``job_key``: the job's secret
    (``auth.new_job_key()``, the same for every peer of the job; see ``auth.py`` for what
    it protects against); None: messages are neither signed nor checked (single-process
    tests and benchmarks whose peers all start from one driver).
    """

    def __init__(
        self,
        peer_id: str,
        clock: Callable[[], float] = time.monotonic,
        transport: Transport | None = None,
        bounds: ContributionBounds = ContributionBounds(),
        deadline: DeadlinePolicy | None = DeadlinePolicy(),
        job_key: bytes | None = None,
    ):
        self.peer_id = peer_id
        self.auth = JobAuth(job_key) if job_key is not None else None
        self.clock = clock
        self.transport = transport or RayTransport()
        self.bounds = bounds
        warm_up()  # the codecs' torch import, before any round's deadline runs
        self._boxes: dict[RoundKey, GroupMailbox] = {}
        self._floor_epoch = -1  # contributions below this epoch are stale
        self._done: collections.deque[RoundKey] = collections.deque(maxlen=256)
        # contributions held back from members that own no part, sent on a CopyRequest;
        # kept for this epoch and the one before (a survivor may still be re-reducing)
        self._held: dict[RoundKey, dict[str, Callable[[], object]]] = {}
        # CopyRequests that came before we held anything for that peer (we were slower):
        # answered the moment we hold it
        self._asked: dict[RoundKey, set[str]] = {}
        self.rejection_counts: collections.Counter[str] = collections.Counter()
        self._pending_rejections: list[Rejection] = []
        self._lock = asyncio.Lock()
        # This peer's smoothed throughput (bytes/s), for its share of parts: the host sends
        # ``meter.value`` with its heartbeat (see shares.py)
        self.meter = ThroughputMeter()
        self.round_times = RoundTimes(deadline)  # durations of recent rounds, per index

    # -- transport entry points ----------------------------------------------------------

    def _box(self, key: RoundKey) -> GroupMailbox:
        box = self._boxes.get(key)
        if box is None:
            box = self._boxes[key] = GroupMailbox(key, fetch=self.transport.fetch)
        return box

    def deliver_contribution(self, c: Contribution | Probe | CopyRequest) -> None:
        if isinstance(c, Probe):
            return  # a member checking that we are alive: answering is the whole reply
        if isinstance(c, CopyRequest):  # send what we held back, or once we hold it
            key = (c.epoch, c.round_index, c.group_index)
            send = self._held.get(key, {}).get(c.requester)
            if send is not None:
                asyncio.ensure_future(_delivered(send(), c.requester))
            elif c.epoch >= self._floor_epoch - 1:
                self._asked.setdefault(key, set()).add(c.requester)
            return
        if self.auth is not None:  # first: only an authentic message names its sender
            problem = self.auth.check_contribution(c)
            if problem is not None:
                self._record(Rejection(c.sender, -1, RejectReason.UNAUTHENTICATED, problem))
                return
        key = (c.epoch, c.round_index, c.group_index)
        if c.epoch < self._floor_epoch:
            self._record(Rejection(c.sender, -1, RejectReason.STALE_EPOCH,
                                   f"epoch {c.epoch} < current {self._floor_epoch}"))
            return
        if key in self._done or (key in self._boxes and self._boxes[key].reduced):
            self._record(Rejection(c.sender, -1, RejectReason.LATE, f"round {key} already reduced"))
            return
        box = self._box(key)
        box.contributions.setdefault(c.sender, c)
        if box.own_part is not None:  # streaming: start moving our part's bytes now
            box.fetch_part(c.sender, box.own_part)
        box.notify()

    def deliver_result(self, r: PartResult) -> None:
        if self.auth is not None:  # a forged result must not take the owner's place
            problem = self.auth.check_result(r)
            if problem is not None:
                self._record(Rejection(r.owner, r.part, RejectReason.UNAUTHENTICATED,
                                       f"result: {problem}"))
                return
        key = (r.epoch, r.round_index, r.group_index)
        if r.epoch < self._floor_epoch or key in self._done:
            return  # a result nobody waits for any more
        box = self._box(key)
        box.results.setdefault(r.part, r)
        box.fetch_result(r.part)
        box.notify()

    def _record(self, rejection: Rejection) -> None:
        self.rejection_counts[rejection.reason.value] += 1
        self._pending_rejections.append(rejection)
        log.warning("rejected contribution from %s: %s (%s)", rejection.sender,
                    rejection.reason.value, rejection.detail)

    # -- the API a training loop calls ----------------------------------------------------

    async def all_reduce(
        self, tensors: Sequence[Any], weight: float, plan: PeerPlan | RoundPlan,
        timeout: float
    ) -> tuple[list[Any], AllReduceReport]:
        """Average ``tensors`` with the plan's participants, weighted by ``weight`` (one
        number for all their values; see the module docstring for the contract).
        ``plan``: this peer's ``PeerPlan`` (what the Coordinator sends), or a whole
        ``RoundPlan``, of which this peer's view is taken (the same result; a peer not in
        it averages with nobody). Raises ``ValueError`` for the view of another peer."""
        if isinstance(plan, RoundPlan):
            plan = plan.view_of(self.peer_id)
        elif plan.peer != self.peer_id:
            raise ValueError(f"{self.peer_id} was given the plan view of {plan.peer}")
        async with self._lock:
            return await self._all_reduce(tensors, weight, plan, timeout)

    async def _all_reduce(self, tensors, weight, plan: PeerPlan, timeout: float):
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        started = self.clock()
        self._advance_floor(plan.epoch)
        flat = flatten(tensors)
        given = flat
        handles = dict(plan.handles)
        # This step's bounds, from our own input and weight (one pass over the input).
        limits = self.bounds.limits(await off_loop(flat.nbytes, max_abs, flat), float(weight),
                                    plan.peer_count)

        def send(peer: str, method: str, message: object):
            return self.transport.send(handles[peer], method, message)

        rejections: list[Rejection] = []
        contributors: set[str] = set()
        partial: set[str] = set()
        failed: list[str] = []
        sent = received = cross_zone = 0
        zone_of = dict(plan.zones)
        my_zone = zone_of.get(self.peer_id, "")
        phases: collections.Counter[str] = collections.Counter()
        weights = SegmentWeights.uniform(float(weight))  # per value, carried round to round
        for seat in plan.seats:  # the groups we are in, in round order
            r, g, group = seat.round_index, seat.group_index, seat.group
            key = (plan.epoch, r, g)
            box = self._box(key)
            t0 = self.clock()
            limit = self.round_times.timeout(r, timeout)
            deadlines = Deadlines(t0 + CONTRIBUTION_FRACTION * limit, t0 + limit,
                                  t0 + FINAL_FRACTION * limit)
            runner = GroupRound(self.peer_id, plan, r, g, group, box, send, self.transport,
                                self.clock, hold=functools.partial(self._hold, key),
                                limits=limits, auth=self.auth)
            outcome = await runner.run(flat, weights, deadlines)
            self.round_times.record(r, self.clock() - t0)
            self._finish(key)
            for rej in outcome.rejections:
                self.rejection_counts[rej.reason.value] += 1
            if outcome.errored:
                raise AveragingError(plan.epoch, f"round {r}: {outcome.errored}")
            flat, weights = outcome.values, outcome.weights
            rejections += outcome.rejections
            contributors |= set(outcome.contributors)
            partial |= set(outcome.partial_contributors)
            failed += outcome.failed_owners
            sent += outcome.bytes_sent
            if my_zone:
                cross_zone += sum(n for peer, n in outcome.bytes_to.items()
                                  if zone_of.get(peer, my_zone) != my_zone)
            received += outcome.bytes_received
            phases.update(outcome.phases)
            self.meter.update(outcome.throughput)
        rejections += self._pending_rejections
        self._pending_rejections = []
        report = AllReduceReport(
            epoch=plan.epoch,
            peer=self.peer_id,
            contributors=tuple(sorted(contributors - partial)),
            partial_contributors=tuple(sorted(partial)),
            rejections=tuple(rejections),
            failed_owners=tuple(failed),
            bytes_sent=sent,
            bytes_received=received,
            seconds=self.clock() - started,
            total_weight=weights.mean(flat.size),
            phases=tuple(sorted(phases.items())),
            cross_zone_bytes=cross_zone,
            weights=weights,
            rounds=len(plan.seats),
        )
        return unflatten(flat, tensors, owned=flat is not given), report

    def _hold(self, key: RoundKey, peer: str, send: Callable[[], object]) -> None:
        """Keep ``send`` (a contribution held back from ``peer``) for its CopyRequest; if
        that came already, send now."""
        if peer in self._asked.get(key, ()):
            asyncio.ensure_future(_delivered(send(), peer))
        self._held.setdefault(key, {})[peer] = send

    def _finish(self, key: RoundKey) -> None:
        box = self._boxes.pop(key, None)
        self._done.append(key)
        if box is not None:
            for task in list(box.fetches.values()) + list(box.result_fetches.values()):
                task.cancel()

    def _advance_floor(self, epoch: int) -> None:
        """Forget rounds of older epochs; what they still held was never used (stale)."""
        self._floor_epoch = max(self._floor_epoch, epoch)
        for kept in (self._held, self._asked):
            for key in [k for k in kept if k[0] < self._floor_epoch - 1]:
                del kept[key]
        for key in [k for k in self._boxes if k[0] < self._floor_epoch]:
            box = self._boxes.pop(key)
            for sender in box.contributions:
                self._record(Rejection(sender, -1, RejectReason.STALE_EPOCH,
                                       f"epoch {key[0]} < current {self._floor_epoch}"))


async def _delivered(call, peer: str) -> None:
    """Await a fire-and-forget call (so its failure is not left unobserved); a requester
    that died meanwhile needs nothing."""
    try:
        await call
    except Exception as exc:  # noqa: BLE001 - any failure: the peer is gone or going
        log.info("held-back contribution for %s not delivered: %s", peer, type(exc).__name__)
