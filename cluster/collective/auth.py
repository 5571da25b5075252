"""Authenticated contributions and results: an HMAC-SHA256 with a per-job key (pure).

Threat model. Ray gives anyone who holds the cluster's token (or can reach an unsecured
cluster) the power to call any actor's methods and to run any code inside any actor
(``__ray_call__`` runs a function on the actor instance: the chaos bench uses it). Nothing
here defends against that: such a caller can read the key out of a replica. What the key
does stop is a process that can reach the replicas' transport methods or the object store
but does not hold the key (another job on the same cluster, a stray or buggy client, a
peer of an older run): it cannot make a replica accept a ``Contribution`` or a
``PartResult`` under any sender's name. Members of one job share the key and so trust each
other (a symmetric key cannot tell two holders apart; bounds and quarantine handle a
member that sends junk).

The key: ``new_job_key()`` (``secrets.token_bytes``), made by the driver for each job,
sent to the job's replicas as a constructor argument (``ReplicaSpec.job_key``), never
through an environment variable, a named actor or a key-value store.

What a tag covers. A contribution's tag binds its kind, epoch, round and group index,
sender, weights (every segment's weight and where the segments are cut:
``messages.SegmentWeights``, so a holder of the bytes cannot shift weight between values),
tensor length and the SHA-256 digest of each part's encoded bytes (``payload_digest``:
codec name, length, wire data, block metadata). The receiver checks the tag when the
message arrives (cheap: no payload), so a forged message never takes an honest sender's
place in a round, and checks a part's digest when it holds the part's bytes (hashing only
the part it reduces). A result's tag binds its epoch, round, group, part, owner, length,
total weights (per segment, as a contribution's), contributors and its bytes' digest.

Not authenticated: ``Probe`` (carries nothing and is ignored) and ``CopyRequest`` (answered
with a signed contribution, sent only to a member of the round's plan).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import numpy as np

__all__ = ["KEY_BYTES", "MIN_KEY_BYTES", "new_job_key", "payload_digest", "JobAuth"]

KEY_BYTES = 32
MIN_KEY_BYTES = 16


def new_job_key() -> bytes:
    """A fresh random key for one job (32 bytes from ``secrets``)."""
    return secrets.token_bytes(KEY_BYTES)


def payload_digest(enc) -> bytes:
    """SHA-256 of an encoded part (``codecs.Encoded``) as the receiver decodes it: codec
    name, value count, wire dtype and bytes, block metadata. ``None`` (no part): ``b""``.
    Anything else (not an ``Encoded``): a digest that matches no honest part."""
    if enc is None:
        return b""
    data, meta = getattr(enc, "data", None), getattr(enc, "meta", None)
    if not isinstance(data, np.ndarray) or not isinstance(meta, np.ndarray):
        return b"\0" * 32
    h = hashlib.sha256()
    h.update(f"{enc.codec}|{enc.numel}|{data.dtype.str}|{data.shape}|{meta.shape}|".encode())
    h.update(np.ascontiguousarray(data))  # a view when contiguous (the usual case)
    h.update(np.ascontiguousarray(meta))
    return h.digest()


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


class JobAuth:
    """Signs and checks one job's messages with its key (see module docstring).

    ``check_*`` return None for an authentic message, else a one-line reason (missing tag,
    wrong tag: a forged one, or a field changed after signing, e.g. another sender's name).
    Raises ``ValueError`` at construction for a key that is not bytes of at least
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

    # -- contributions -----------------------------------------------------------------

    @staticmethod
    def _contribution_body(epoch, round_index, group_index, sender, weights, numel,
                           digests) -> bytes:
        return _fields("contribution", int(epoch), int(round_index), int(group_index),
                       str(sender), _weights(weights), int(numel), tuple(digests))

    def contribution_tag(self, epoch: int, round_index: int, group_index: int, sender: str,
                         weights, numel: int, digests: tuple[bytes, ...]) -> bytes:
        """The tag of a contribution with these fields (``weights``: its
        ``SegmentWeights``)."""
        return self._mac(self._contribution_body(epoch, round_index, group_index, sender,
                                                 weights, numel, digests))

    def check_contribution(self, c) -> str | None:
        """Whether ``c`` (a ``Contribution``) was signed with this job's key as it is."""
        if not c.tag:
            return "no authentication tag"
        try:
            body = self._contribution_body(c.epoch, c.round_index, c.group_index, c.sender,
                                           c.weights, c.numel, c.digests)
        except (TypeError, ValueError) as exc:
            return f"malformed signed fields ({exc})"
        if not hmac.compare_digest(self._mac(body), bytes(c.tag)):
            return f"tag does not match the job key for sender {c.sender!r}"
        if len(c.digests) != len(c.part_refs):
            return f"{len(c.digests)} digests for {len(c.part_refs)} parts"
        return None

    # -- results -----------------------------------------------------------------------

    @staticmethod
    def _result_body(epoch, round_index, group_index, part, owner, numel, weights,
                     contributors, digest) -> bytes:
        return _fields("result", int(epoch), int(round_index), int(group_index), int(part),
                       str(owner), int(numel), _weights(weights),
                       tuple(str(x) for x in contributors), bytes(digest))

    def result_tag(self, epoch: int, round_index: int, group_index: int, part: int,
                   owner: str, numel: int, weights, contributors: tuple[str, ...],
                   digest: bytes) -> bytes:
        """The tag of a result with these fields (``weights``: the part's total
        ``SegmentWeights``)."""
        return self._mac(self._result_body(epoch, round_index, group_index, part, owner,
                                           numel, weights, contributors, digest))

    def check_result(self, r) -> str | None:
        """Whether ``r`` (a ``PartResult``) was signed with this job's key as it is."""
        if not r.tag:
            return "no authentication tag"
        try:
            body = self._result_body(r.epoch, r.round_index, r.group_index, r.part, r.owner,
                                     r.numel, r.weights, r.contributors, r.digest)
        except (TypeError, ValueError) as exc:
            return f"malformed signed fields ({exc})"
        if not hmac.compare_digest(self._mac(body), bytes(r.tag)):
            return f"tag does not match the job key for owner {r.owner!r}"
        return None

    @staticmethod
    def digest_matches(enc, digest: bytes) -> bool:
        """Whether the fetched ``enc`` is the part the signed ``digest`` names."""
        return hmac.compare_digest(payload_digest(enc), bytes(digest))
