"""Small payloads inside actor calls, under Ray's inline-argument limit.

Ray passes a call argument inside the call itself only up to ``max_direct_call_object_size``
(100 KiB by default, a cluster setting); a larger one is put into the object store, which
costs several times the bytes' copy (see ``messages.Inline``). Each argument is judged on its
own, so ``split`` moves the encoded data of every ``Inline`` payload of a message out into
argument-sized chunks (``CHUNK_BYTES``), leaving a ``Chunked`` placeholder, and ``join`` puts
it back on the receiving side. Pure code (numpy only); ``transport.RayTransport`` and the
replica's transport methods use it, ``LocalTransport`` has no need to.

Contract: ``join(*split(message))`` equals ``message`` (same values, fresh arrays). ``join``
raises ``ValueError`` if the chunks do not match the placeholders (a malformed call).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from moshray.cluster.collective.codecs import Encoded
from moshray.cluster.messages import Contribution, Inline, PartResult

CHUNK_BYTES = 90 * 1024  # under Ray's 100 KiB default, with room for the pickle framing


@dataclass(frozen=True)
class Chunked:
    """An ``Inline`` payload whose data are call arguments ``first .. first + count - 1``
    (after the message), in order."""

    codec: str  # the codec's registered name
    numel: int
    meta: np.ndarray
    first: int
    count: int


def _out(payload, chunks: list):
    if not isinstance(payload, Inline):
        return payload
    enc: Encoded = payload.value
    flat = np.ascontiguousarray(enc.data).reshape(-1)
    step = max(1, CHUNK_BYTES // max(flat.itemsize, 1))
    pieces = [flat[i:i + step] for i in range(0, flat.size, step)] or [flat]
    first = len(chunks)
    chunks.extend(pieces)
    return Chunked(enc.codec, enc.numel, enc.meta, first, len(pieces))


def _in(payload, chunks: tuple):
    if not isinstance(payload, Chunked):
        return payload
    if payload.first < 0 or payload.count < 1 or payload.first + payload.count > len(chunks):
        last = payload.first + payload.count - 1
        raise ValueError(f"a payload names chunks {payload.first}..{last}"
                         f" but the call carried {len(chunks)}")
    parts = chunks[payload.first:payload.first + payload.count]
    data = parts[0].copy() if len(parts) == 1 else np.concatenate(parts)
    return Inline(Encoded(payload.codec, payload.numel, data, payload.meta))


def split(message) -> tuple[object, tuple[np.ndarray, ...]]:
    """``(message with Chunked placeholders, chunks)``; other messages pass unchanged."""
    chunks: list = []
    if isinstance(message, Contribution):
        message = dataclasses.replace(
            message, part_refs=tuple(_out(p, chunks) for p in message.part_refs))
    elif isinstance(message, PartResult):
        message = dataclasses.replace(message, ref=_out(message.ref, chunks))
    return message, tuple(chunks)


def join(message, chunks: tuple = ()):
    """The message ``split`` took apart, from its placeholders and ``chunks``."""
    if isinstance(message, Contribution):
        return dataclasses.replace(
            message, part_refs=tuple(_in(p, chunks) for p in message.part_refs))
    if isinstance(message, PartResult):
        return dataclasses.replace(message, ref=_in(message.ref, chunks))
    return message
