"""The owner's side of one part in a group round: fetch, validate, add in member order.

Split from ``allreduce`` (the round's flow) by role; see that module's docstring for the
protocol. The numeric work is staged so that the event loop only ever waits:

- as soon as a contribution's bytes arrive, a worker thread validates them and turns them
  into their term of the mean (``WeightedMean.term``: widened from the wire format into a
  float32 buffer of our own, checked, scaled in place);
- when its turn in the group's member order comes, the term is added (one float32 pass).

So a slow sender delays only the adds after it, and every peer reducing the same inputs
computes the same bits.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import numpy as np

import moshray.cluster.collective.codecs as comp
from moshray.cluster.messages import RejectReason
from moshray.cluster.collective.partition import WeightedMean, check_contribution

if TYPE_CHECKING:  # pragma: no cover
    from moshray.cluster.collective.round import GroupRound

F32 = np.dtype(np.float32)
# Numeric work on fewer bytes than this runs on the event loop itself: a hop to a worker
# thread and back costs more than it (and, on a loaded machine, waits for a core twice).
INLINE_BYTES = 2 << 20


async def off_loop(nbytes: int, fn, *args):
    """``fn(*args)``: in a worker thread when it touches at least ``INLINE_BYTES``, else
    right here on the loop."""
    if nbytes < INLINE_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def own_term(codec: comp.Compression, local: np.ndarray, size: int, weight: float):
    """Our own value of a part as the others will see it (through the codec), as a term of
    the mean; or the reason it is rejected (NaN, wrong shape, bad weight)."""
    enc = comp.encode(local, codec)
    return _term(enc, size, weight)


def accept(codec: comp.Compression, enc: comp.Encoded, size: int, weight: float):
    """A fetched part as a term of the mean, or a ``(reason, detail)`` rejection."""
    expected = comp.WIRE_DTYPE[codec]
    if not isinstance(enc, comp.Encoded):
        return RejectReason.DTYPE_MISMATCH, f"payload of type {type(enc).__name__}"
    if enc.data.dtype != expected or enc.codec is not codec:
        return (RejectReason.DTYPE_MISMATCH,
                f"got {enc.codec.value}/{enc.data.dtype}, expected {codec.value}/{expected}")
    try:
        return _term(enc, size, weight)
    except (ValueError, TypeError, IndexError) as exc:  # e.g. 8-bit meta of another layout
        return RejectReason.SHAPE_MISMATCH, f"undecodable payload: {exc}"


def _term(enc: comp.Encoded, size: int, weight: float):
    data = enc.data
    if data.ndim != 1 or data.shape[0] != size or enc.numel != size:
        return check_contribution(data, size, data.dtype, weight) or (
            RejectReason.SHAPE_MISMATCH, f"payload of {enc.numel} values, expected {size}")
    if enc.codec is comp.Compression.NONE:
        values, owned = data, False  # the (read-only) wire buffer itself
    else:
        values, owned = comp.decode(enc), True  # a fresh float32 buffer of ours
        if values is data:
            owned = False
    problem = check_contribution(values, size, F32, weight)
    if problem is not None:
        return problem
    return WeightedMean.term(values, weight, owned=owned)


async def reduce_part(
    rnd: "GroupRound",
    part: int,
    local: np.ndarray,
    weight: float,
    size: int,
    arrive_by: float,
    fetch_by: float,
    exclude: str | None = None,
) -> tuple[np.ndarray, float, tuple[str, ...]]:
    """Weighted mean of part ``part`` over our own value and the contributions that
    arrive before ``arrive_by`` and are fetched before ``fetch_by`` (``exclude``: a dead
    owner whose part we re-reduce after the contribution deadline: then exactly the
    contributions that had arrived count, and only their fetches are waited for).

    All fetches run at once; values enter the mean in the group's member order, each
    as soon as every member before it is settled (added, rejected or known absent), so
    any peer reducing the same inputs computes bitwise identical results.
    """
    box, codec, clock = rnd.box, rnd.codec, rnd.clock
    order = [m for m in rnd.group.members if m != exclude]
    mean = WeightedMean(size)
    held: dict[str, tuple[np.ndarray, float]] = {}
    settled: set[str] = {rnd.me}
    preparing: dict[str, asyncio.Future] = {}  # validation + scaling, in worker threads

    def timed(fn, *args):  # wall time in the worker thread, and its CPU time
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        finally:
            rnd.cpu_seconds += time.perf_counter() - t0
            rnd.cpu_used += time.thread_time() - c0

    nbytes = size * F32.itemsize
    got = await off_loop(nbytes, timed, own_term, codec, local, size, weight)
    if isinstance(got, tuple):
        rnd.reject(rnd.me, part, *got)
    else:
        held[rnd.me] = (got, weight)
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
            elif c.numel != rnd.numel:
                rnd.reject(sender, part, RejectReason.SHAPE_MISMATCH,
                           f"tensor of {c.numel} values", c.numel)
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
                rnd.reject(sender, part, RejectReason.FETCH_FAILED, type(exc).__name__)
                settled.add(sender)
                continue
            rnd.bytes_received += getattr(enc, "nbytes", 0)
            weight_of = box.contributions[sender].weight
            future = asyncio.ensure_future(
                off_loop(nbytes, timed, accept, codec, enc, size, weight_of))
            future.add_done_callback(lambda _: box.notify())
            preparing[sender] = future
        for sender, future in list(preparing.items()):
            if not future.done():
                continue
            del preparing[sender]
            settled.add(sender)
            got = future.result()
            if isinstance(got, tuple):
                rnd.reject(sender, part, *got)
            else:
                held[sender] = (got, box.contributions[sender].weight)
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
        # re-reduce the part from what they hold (see ``GroupRound._await_result``).
        return np.zeros(size, dtype=np.float32), 0.0, ()
    values, total = await off_loop(nbytes, timed, mean.result)
    rnd.reduced_bytes += values.nbytes * mean.count
    return values, total, tuple(sorted(contributors))
