"""The sending side of one group round (see ``allreduce`` for the protocol): a member's
contribution to the part owners, and an owner's result to everyone.

Split from ``allreduce`` by role, like ``part_reduce`` (the owner's reduction); both take
the ``GroupRound`` whose state they use. Neither raises for another peer's failure: every
call is watched (``GroupRound.watch_call``), and a failed one marks that peer dead in the
round's mailbox.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

import moshray.cluster.collective.codecs as comp
from moshray.cluster.messages import Contribution, InBundle, Inline, PartResult
from moshray.cluster.collective.part_reduce import off_loop

if TYPE_CHECKING:  # pragma: no cover
    from moshray.cluster.collective.round import GroupRound

# Parts up to this many encoded bytes travel inside the actor calls (``Inline``, as chunks
# under Ray's inline-argument limit: ``inline.py``): for them the object store's put, pull
# and reference counting cost several times the bytes' copy.
INLINE_MAX_BYTES = 1 << 20


async def contribute(rnd: "GroupRound", flat: np.ndarray, weight: float, slices,
                     own: int) -> None:
    """Send ``flat``'s parts (``slices``; ``own`` is ours) to the part owners: inline and
    one lazily made put (``InBundle``) for small parts, refs for large ones. What a member
    that owns nothing would get is handed to ``rnd.hold`` (sent on a ``CopyRequest``)."""
    members = rnd.group.members

    def encode_parts() -> list:
        encs = []
        for j, s in enumerate(slices):
            if j == own or s.stop == s.start:  # ours, or a member that owns nothing
                encs.append(None)
                continue
            enc = comp.encode(flat[s], rnd.codec)  # none: a view, put copies it once
            rnd.bytes_sent += enc.nbytes
            encs.append(enc)
        return encs

    encs = await off_loop(flat.nbytes, encode_parts)
    if all(enc is None for enc in encs):
        # Nothing for anyone (the sole owner: its own part stays here): the others
        # would only keep it for re-reducing a part we own, and that dies with us.
        # The members still waiting on us probe us (``GroupRound._probe_members``).
        return
    if max(enc.nbytes for enc in encs if enc is not None) <= INLINE_MAX_BYTES:
        bundle: list = []  # one put of all parts, made when a message first needs it

        def in_bundle(k: int) -> InBundle:  # fetched only if an owner dies
            if not bundle:
                bundle.append(rnd.transport.put(tuple(encs)))
            return InBundle(bundle[0], k)

        def payloads(j: int) -> tuple:
            return tuple(None if enc is None else Inline(enc) if k == j else
                         in_bundle(k) for k, enc in enumerate(encs))
    else:
        refs = await off_loop(flat.nbytes, lambda: tuple(
            None if enc is None else rnd.transport.put(enc) for enc in encs))

        def payloads(j: int) -> tuple:
            return refs

    def message(j: int) -> Contribution:
        return Contribution(epoch=rnd.plan.epoch, round_index=rnd.round_index,
                            group_index=rnd.group_index, sender=rnd.me,
                            weight=float(weight), numel=flat.size, part_refs=payloads(j))

    for j, peer in enumerate(members):
        if peer == rnd.me:
            continue
        if rnd.hold is not None and slices[j].stop == slices[j].start:
            # owns nothing: sent (and its bundle put) only on request. ``encs`` are
            # our own arrays or views of the round's input, which nobody writes.
            rnd.hold(peer, lambda p=peer, j=j: rnd.send(p, "receive_contribution",
                                                          message(j)))
            continue
        rnd.watch_call(peer, rnd.send(peer, "receive_contribution", message(j)))


async def publish(rnd: "GroupRound", part: int, values: np.ndarray, total: float,
                  contributors, dest: np.ndarray) -> None:
    """Write our reduced ``part`` into ``dest`` exactly as the others will decode it, and
    send it to every other peer of the group (inline if small, else as one put)."""
    enc = await off_loop(values.nbytes, comp.encode, values, rnd.codec)
    # Keep exactly what the others will decode, so every peer holds equal values.
    await off_loop(values.nbytes, comp.decode_into, enc, dest)
    others = [peer for peer in rnd.group.everyone if peer != rnd.me]
    if not others:
        return  # a group of one (a single replica): nobody to send the result to
    ref = Inline(enc) if enc.nbytes <= INLINE_MAX_BYTES else \
        await off_loop(values.nbytes, rnd.transport.put, enc)
    result = PartResult(
        epoch=rnd.plan.epoch,
        round_index=rnd.round_index,
        group_index=rnd.group_index,
        part=part,
        owner=rnd.me,
        numel=rnd.numel,
        total_weight=total,
        contributors=tuple(contributors),
        ref=ref,
    )
    for peer in others:
        rnd.bytes_sent += enc.nbytes
        rnd.watch_call(peer, rnd.send(peer, "receive_result", result))
