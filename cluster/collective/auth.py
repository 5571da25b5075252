"""Authenticated contributions and results: a per-job key, one MAC pass over each part (pure).

Threat model. Ray gives anyone who holds the cluster's token (or can reach an unsecured
cluster) the power to call any actor's methods and to run any code inside any actor
(``__ray_call__`` runs a function on the actor instance: the chaos bench uses it). Nothing
here defends against that: such a caller can read the key out of a replica. What the key
does stop is a process that can reach the replicas' transport methods or the object store
but does not hold the key (another job on the same cluster, a stray or buggy client, a
peer of an older run): it cannot make a replica accept a ``Contribution`` or a
``PartResult`` under any sender's name, nor bytes other than the ones that sender signed.
Members of one job share the key and so trust each other (a symmetric key cannot tell two
holders apart; bounds and quarantine handle a member that sends junk).

The key: ``new_job_key()`` (``secrets.token_bytes``), made by the driver for each job,
sent to the job's replicas as a constructor argument (``ReplicaSpec.job_key``), never
through an environment variable, a named actor or a key-value store.

What a message carries. Its signer draws a fresh random ``nonce`` for it and sends:

- a ``payload tag`` per part: Poly1305 of the part's encoded bytes as the receiver decodes
  them (codec name, value count, wire dtype and shape, data, block metadata) under a
  one-time key derived from the job key, the message's identity (kind, epoch, round, group,
  signer), its nonce and the part's index (HMAC-SHA256);
- a ``tag``: HMAC-SHA256 with the job key over the message's fields: for a contribution
  its kind, epoch, round and group index, sender, weights (every segment's weight and where
  the segments are cut: ``messages.SegmentWeights``, so a holder of the bytes cannot shift
  weight between values), tensor length, nonce and payload tags; for a result its epoch,
  round, group, part, owner, length, total weights (per segment), contributors, nonce and
  payload tag.

The receiver checks the tag when the message arrives (no payload: microseconds), so a
forged or renamed message never takes an honest sender's place in a round, and checks a
part's payload tag when it holds the part's bytes. So each part's bytes take one MAC pass
at their sender and one at each peer that reduces or applies them, and nothing else reads
them for authentication. A replayed message is bound to its epoch, round and group, so it
is stale anywhere else, and a duplicate in its own round is dropped as one.

Why Poly1305 rather than a keyed hash: the pass over the payload is the whole cost (a
100 MB tensor in fp16 is about 2.5 x 50 MB of MAC input per peer per round). On one core
of the machines measured (x86 with SHA extensions), Poly1305 runs at about 5 GB/s, SHA-256
at about 1.5 GB/s and keyed BLAKE2b at about 0.8 GB/s. Poly1305 is a one-time MAC: a key
must never authenticate two different messages, which the per-message nonce guarantees (a
message sent again, e.g. on a ``CopyRequest``, is the same message); a forger who sees one
tag still succeeds with probability about 2**-80 per try at 100 MB. It comes from the
``cryptography`` package (OpenSSL), which holds the GIL while it runs: the bytes go in
slices of ``MAC_SLICE_BYTES`` so other threads get their turn.

Not authenticated: ``Probe`` (carries nothing and is ignored) and ``CopyRequest`` (answered
with a signed contribution, sent only to a member of the round's plan).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import numpy as np
from cryptography.hazmat.primitives.poly1305 import Poly1305

__all__ = ["KEY_BYTES", "MIN_KEY_BYTES", "NONCE_BYTES", "new_job_key", "JobAuth"]

KEY_BYTES = 32
MIN_KEY_BYTES = 16
NONCE_BYTES = 16
MAC_SLICE_BYTES = 8 << 20  # bytes per Poly1305 update (the GIL is held during one)


def new_job_key() -> bytes:
    """A fresh random key for one job (32 bytes from ``secrets``)."""
    return secrets.token_bytes(KEY_BYTES)


def _fields(*values) -> bytes:
    # repr is exact for str, int, bytes, tuples and floats (round-trip repr), and a
    # str's repr quotes it, so no two field lists encode alike.
    return repr(values).encode()


def _weights(weights) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """A ``SegmentWeights`` as signed fields; raises TypeError or ValueError for anything
    else (reported as malformed)."""
    try:
        return (tuple(float(w) for w in weights.weights),
                tuple(int(c) for c in weights.cuts))
    except AttributeError:
        raise TypeError(f"weights of type {type(weights).__name__}") from None


def _raw(value) -> bytes:
    """A signed bytes field as is; TypeError (reported as malformed) for anything else, so
    that e.g. an int is never turned into that many zero bytes."""
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"a bytes field of type {type(value).__name__}")
    return bytes(value)


def _wire(enc) -> tuple[bytes, np.ndarray, np.ndarray] | None:
    """An encoded part (``codecs.Encoded``) as MAC input: a header (codec, value count,
    dtypes and shapes, so the bytes that follow have one reading) and the data and meta
    bytes (views when contiguous, the usual case). None for anything that is not an
    ``Encoded`` of plain arrays: it matches no tag."""
    data, meta = getattr(enc, "data", None), getattr(enc, "meta", None)
    if not isinstance(data, np.ndarray) or not isinstance(meta, np.ndarray):
        return None
    try:
        header = _fields(str(enc.codec), int(enc.numel), data.dtype.str, data.shape,
                         meta.dtype.str, meta.shape)
        return (header, np.ascontiguousarray(data).reshape(-1).view(np.uint8),
                np.ascontiguousarray(meta).reshape(-1).view(np.uint8))
    except (TypeError, ValueError, AttributeError):  # e.g. an object array
        return None


class JobAuth:
    """Signs and checks one job's messages with its key (see module docstring).

    ``sign_*`` return what a message carries: ``(nonce, payload tags, tag)``. ``check_*``
    return None for a message whose fields are authentic, else a one-line reason (missing
    tag, wrong tag: a forged one, or a field changed after signing, e.g. another sender's
    name); ``*_matches`` say whether fetched bytes are the ones its signer tagged. Raises
    ``ValueError`` at construction for a key that is not bytes of at least
    ``MIN_KEY_BYTES``."""

    def __init__(self, key: bytes):
        if not isinstance(key, (bytes, bytearray)) or len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the job key must be at least {MIN_KEY_BYTES} random bytes "
                             f"(auth.new_job_key()), got {type(key).__name__}")
        self._key = bytes(key)

    def __repr__(self) -> str:  # never print the key
        return "JobAuth(<key>)"

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest()

    # -- payloads: one Poly1305 pass per part ------------------------------------------

    def _payload_tag(self, identity: tuple, nonce: bytes, part: int, enc) -> bytes:
        """Poly1305 of ``enc``'s wire bytes under the one-time key of (``identity``,
        ``nonce``, ``part``); b"" for no part (None) or one that is not an ``Encoded``."""
        wire = None if enc is None else _wire(enc)
        if wire is None:
            return b""
        header, data, meta = wire
        mac = Poly1305(self._mac(_fields("payload key", *identity, _raw(nonce), int(part))))
        mac.update(len(header).to_bytes(8, "little") + header)
        for start in range(0, data.size, MAC_SLICE_BYTES):
            mac.update(data[start:start + MAC_SLICE_BYTES])
        mac.update(meta)
        return mac.finalize()

    def _payload_matches(self, identity: tuple, nonce, part: int, enc, tag) -> bool:
        if not isinstance(tag, bytes) or not tag or not isinstance(nonce, bytes):
            return False
        return hmac.compare_digest(self._payload_tag(identity, nonce, part, enc), tag)

    # -- contributions -----------------------------------------------------------------

    @staticmethod
    def _contribution_identity(epoch, round_index, group_index, sender) -> tuple:
        return "contribution", int(epoch), int(round_index), int(group_index), str(sender)

    def contribution_tag(self, epoch: int, round_index: int, group_index: int, sender: str,
                         weights, numel: int, nonce: bytes,
                         payload_tags: tuple[bytes, ...]) -> bytes:
        """The tag of a contribution with these fields (``weights``: its
        ``SegmentWeights``)."""
        return self._mac(_fields(
            *self._contribution_identity(epoch, round_index, group_index, sender),
            _weights(weights), int(numel), _raw(nonce), tuple(_raw(t) for t in payload_tags)))

    def sign_contribution(self, epoch: int, round_index: int, group_index: int, sender: str,
                          weights, numel: int, encs) -> tuple[bytes, tuple[bytes, ...], bytes]:
        """``(nonce, payload_tags, tag)`` of a contribution whose part j is ``encs[j]``
        (None: not sent, tagged b""): one MAC pass over each part's bytes."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        identity = self._contribution_identity(epoch, round_index, group_index, sender)
        payload_tags = tuple(self._payload_tag(identity, nonce, j, enc)
                             for j, enc in enumerate(encs))
        tag = self.contribution_tag(epoch, round_index, group_index, sender, weights, numel,
                                    nonce, payload_tags)
        return nonce, payload_tags, tag

    def check_contribution(self, c) -> str | None:
        """Whether ``c`` (a ``Contribution``) was signed with this job's key as it is (its
        fields; its parts' bytes: ``part_matches``)."""
        if not c.tag:
            return "no authentication tag"
        try:
            want = self.contribution_tag(c.epoch, c.round_index, c.group_index, c.sender,
                                         c.weights, c.numel, c.nonce, c.payload_tags)
        except (TypeError, ValueError) as exc:
            return f"malformed signed fields ({exc})"
        if not isinstance(c.tag, bytes) or not hmac.compare_digest(want, c.tag):
            return f"tag does not match the job key for sender {c.sender!r}"
        if len(c.payload_tags) != len(c.part_refs):
            return f"{len(c.payload_tags)} payload tags for {len(c.part_refs)} parts"
        return None

    def part_matches(self, c, part: int, enc) -> bool:
        """Whether ``enc`` is part ``part`` of the checked contribution ``c`` as its sender
        tagged it (one MAC pass over its bytes)."""
        identity = self._contribution_identity(c.epoch, c.round_index, c.group_index,
                                               c.sender)
        return self._payload_matches(identity, c.nonce, part, enc, c.payload_tags[part])

    # -- results -----------------------------------------------------------------------

    @staticmethod
    def _result_identity(epoch, round_index, group_index, owner) -> tuple:
        return "result", int(epoch), int(round_index), int(group_index), str(owner)

    def result_tag(self, epoch: int, round_index: int, group_index: int, part: int,
                   owner: str, numel: int, weights, contributors: tuple[str, ...],
                   nonce: bytes, payload_tag: bytes) -> bytes:
        """The tag of a result with these fields (``weights``: the part's total
        ``SegmentWeights``)."""
        return self._mac(_fields(
            *self._result_identity(epoch, round_index, group_index, owner), int(part),
            int(numel), _weights(weights), tuple(str(x) for x in contributors),
            _raw(nonce), _raw(payload_tag)))

    def sign_result(self, epoch: int, round_index: int, group_index: int, part: int,
                    owner: str, numel: int, weights, contributors: tuple[str, ...],
                    enc) -> tuple[bytes, bytes, bytes]:
        """``(nonce, payload_tag, tag)`` of a result whose encoded bytes are ``enc``: one
        MAC pass over them."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        identity = self._result_identity(epoch, round_index, group_index, owner)
        payload_tag = self._payload_tag(identity, nonce, part, enc)
        tag = self.result_tag(epoch, round_index, group_index, part, owner, numel, weights,
                              contributors, nonce, payload_tag)
        return nonce, payload_tag, tag

    def check_result(self, r) -> str | None:
        """Whether ``r`` (a ``PartResult``) was signed with this job's key as it is (its
        fields; its bytes: ``result_matches``)."""
        if not r.tag:
            return "no authentication tag"
        try:
            want = self.result_tag(r.epoch, r.round_index, r.group_index, r.part, r.owner,
                                   r.numel, r.weights, r.contributors, r.nonce, r.payload_tag)
        except (TypeError, ValueError) as exc:
            return f"malformed signed fields ({exc})"
        if not isinstance(r.tag, bytes) or not hmac.compare_digest(want, r.tag):
            return f"tag does not match the job key for owner {r.owner!r}"
        return None

    def result_matches(self, r, enc) -> bool:
        """Whether ``enc`` is the checked result ``r``'s bytes as its owner tagged them."""
        identity = self._result_identity(r.epoch, r.round_index, r.group_index, r.owner)
        return self._payload_matches(identity, r.nonce, r.part, enc, r.payload_tag)
