"""Contributions and results are signed with the job's key (``collective/auth.py``): a tag
over their fields and a MAC of each part's encoded bytes. Honest rounds with a key give the
same bits as without, each part's bytes are MACed once by its sender and once by each
receiver, and a forged, unsigned, renamed or tampered message is rejected as
``UNAUTHENTICATED``, counted, and leaves the honest peers' result as it would be without it. Driven without Ray (``transport.LocalNetwork``), as
``test_allreduce_local.py``."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from moshray.cluster.collective.auth import JobAuth, new_job_key
from moshray.cluster.collective.codecs import Encoded, encode, get_codec
from moshray.cluster.collective.transport import LocalTransport
from moshray.cluster.coordinator.quarantine import Quarantine
from moshray.cluster.messages import (Contribution, Inline, PartResult, RejectReason,
                                      SegmentWeights)
from tests.test_allreduce_local import inputs, reduce_all, swarm, weighted

KEY = new_job_key()
UNAUTH = RejectReason.UNAUTHENTICATED
ONE = SegmentWeights.uniform(1.0)


def _unauth(report) -> list:
    return [r for r in report.rejections if r.reason is UNAUTH]


@pytest.mark.parametrize("n,max_group,compression,size", [
    (3, 16, "none", 1000), (9, 3, "none", 1000), (4, 16, "fp16", 1000),
    (3, 16, "none", 300_000),  # parts over INLINE_MAX_BYTES travel as refs
], ids=["one-group", "grid-3x3", "fp16", "refs"])
def test_a_signed_round_gives_the_same_bits_as_an_unsigned_one(n, max_group, compression,
                                                                size):
    arrays, weights = inputs(n, size=size)
    _, plain, plan = swarm(n, max_group, compression=compression)
    _, signed, signed_plan = swarm(n, max_group, compression=compression, job_key=KEY)
    want = asyncio.run(reduce_all(plain, plan, arrays, weights))
    got = asyncio.run(reduce_all(signed, signed_plan, arrays, weights))
    for pid, (out, report) in got.items():
        assert np.array_equal(out, want[pid][0]), pid
        assert np.array_equal(out, got["p0"][0]), pid
        assert report.rejections == () and report.complete
    if compression == "none":
        np.testing.assert_allclose(got["p0"][0], weighted(arrays, weights, arrays),
                                   rtol=1e-5, atol=1e-6)


def _forgeries(plan, arrays, weights) -> list[Contribution]:
    """Contributions naming p1 (a member) for epoch ``plan.epoch``, round 0, group 0, with
    the right shape and weight: unsigned, signed with another key, and p2's genuine
    signature with the sender renamed to p1."""
    codec = get_codec(plan.compression)
    enc = encode(np.full(arrays["p1"].size, 1e3, dtype=np.float32), codec)
    parts = (Inline(enc),) * len(plan.participants)
    weight = SegmentWeights.uniform(weights["p1"])
    base = Contribution(plan.epoch, 0, 0, "p1", weight, enc.numel, parts)

    def signed(auth: JobAuth, sender: str) -> Contribution:
        nonce, payload_tags, tag = auth.sign_contribution(
            plan.epoch, 0, 0, sender, weight, enc.numel, (enc,) * len(parts))
        return dataclasses.replace(base, nonce=nonce, payload_tags=payload_tags, tag=tag)

    return [
        base,  # no tag
        signed(JobAuth(new_job_key()), "p1"),  # wrong key
        dataclasses.replace(signed(JobAuth(KEY), "p2"), sender="p1"),  # p2 signed it
    ]


def test_forged_contributions_are_rejected_counted_and_change_nothing():
    n = 4
    arrays, weights = inputs(n, seed=3)
    _, plain, plan = swarm(n)
    want = asyncio.run(reduce_all(plain, plan, arrays, weights))
    _, averagers, signed_plan = swarm(n, job_key=KEY)
    forged = _forgeries(signed_plan, arrays, weights)

    async def attack_then_reduce():
        for pid in ("p0", "p2", "p3"):  # before p1's honest one: it must not be blocked
            for c in forged:
                averagers[pid].deliver_contribution(c)
        return await reduce_all(averagers, signed_plan, arrays, weights)

    got = asyncio.run(attack_then_reduce())
    for pid, (out, report) in got.items():
        assert np.array_equal(out, want[pid][0]), pid  # as if nothing had been sent
        assert report.contributors == tuple(sorted(arrays)), pid
        if pid == "p1":
            assert _unauth(report) == []
            continue
        bad = _unauth(report)
        assert [r.sender for r in bad] == ["p1"] * 3, pid
        assert {r.detail for r in bad} >= {"no authentication tag"}
        assert averagers[pid].rejection_counts[UNAUTH.value] == 3


def test_a_member_with_the_wrong_key_is_left_out_and_the_others_agree():
    n = 4
    arrays, weights = inputs(n, seed=4)
    network, averagers, plan = swarm(n, job_key=KEY)
    outsider = type(averagers["p3"])("p3", transport=network.transport("p3"),
                                     job_key=new_job_key())
    averagers["p3"] = outsider
    network.add("p3", outsider)
    got = asyncio.run(reduce_all(averagers, plan, arrays, weights))
    honest = ["p0", "p1", "p2"]
    first = got["p0"][0]
    np.testing.assert_allclose(first, weighted(arrays, weights, honest), rtol=1e-5, atol=1e-6)
    for pid in honest:
        out, report = got[pid]
        assert np.array_equal(out, first), pid
        assert "p3" not in report.contributors
        senders = {r.sender for r in _unauth(report)}
        assert senders == {"p3"}, pid  # its contribution and its part's result
        assert report.failed_owners == ("p3",)  # its part was re-reduced by the honest


class TamperingTransport(LocalTransport):
    """Flips one value in every inline part a peer sends, after it was signed (what a
    man in the middle without the key could do)."""

    def send(self, handle, method, message):
        if isinstance(message, Contribution):
            def flip(p):
                if not isinstance(p, Inline):
                    return p
                data = p.value.data.copy()
                data[0] += 1
                return Inline(dataclasses.replace(p.value, data=data))
            message = dataclasses.replace(message,
                                          part_refs=tuple(map(flip, message.part_refs)))
        return super().send(handle, method, message)


def test_bytes_changed_after_signing_are_rejected_by_their_payload_tag():
    n = 3
    arrays, weights = inputs(n, seed=5)
    network, averagers, plan = swarm(n, job_key=KEY)
    averagers["p1"].transport = TamperingTransport(network, "p1")
    got = asyncio.run(reduce_all(averagers, plan, arrays, weights))
    for pid in ("p0", "p2"):
        out, report = got[pid]
        bad = _unauth(report)
        assert [r.sender for r in bad] == ["p1"], pid
        assert "payload tag" in bad[0].detail
        assert np.array_equal(out, got["p0"][0])
    assert np.array_equal(got["p1"][0], got["p0"][0])  # everyone applies the same bits


def test_a_forged_result_is_rejected_and_does_not_block_the_owners():
    n = 3
    arrays, weights = inputs(n, seed=6)
    _, plain, plan = swarm(n)
    want = asyncio.run(reduce_all(plain, plan, arrays, weights))
    _, averagers, signed_plan = swarm(n, job_key=KEY)
    enc = encode(np.zeros(arrays["p0"].size // n + 1, dtype=np.float32), get_codec("none"))
    fake = PartResult(signed_plan.epoch, 0, 0, 1, "p1", arrays["p0"].size, ONE, ("p1",),
                      Inline(enc))
    nonce, payload_tag, tag = JobAuth(new_job_key()).sign_result(
        signed_plan.epoch, 0, 0, 1, "p1", fake.numel, ONE, ("p1",), enc)

    async def attack_then_reduce():
        averagers["p0"].deliver_result(fake)  # unsigned
        averagers["p0"].deliver_result(dataclasses.replace(  # another key's
            fake, nonce=nonce, payload_tag=payload_tag, tag=tag))
        return await reduce_all(averagers, signed_plan, arrays, weights)

    got = asyncio.run(attack_then_reduce())
    assert np.array_equal(got["p0"][0], want["p0"][0])
    assert got["p0"][1].failed_owners == ()
    assert [(r.sender, r.part) for r in _unauth(got["p0"][1])] == [("p1", 1)] * 2
    assert averagers["p0"].rejection_counts[UNAUTH.value] == 2


def test_the_tags_bind_every_segment_weight_and_where_the_segments_are_cut():
    """A signed contribution or result whose weights are moved between values (a cut
    shifted, a segment's weight changed, segments merged) no longer matches its tag; a
    weights field that is not ``SegmentWeights`` is reported malformed, not raised."""
    auth = JobAuth(KEY)
    weights = SegmentWeights((13.0, 6.0), (40,))
    nonce, tags = b"n" * 16, (b"t0", b"t1")
    c = Contribution(2, 1, 0, "p1", weights, 100, ("r0", "r1"), nonce, tags,
                     auth.contribution_tag(2, 1, 0, "p1", weights, 100, nonce, tags))
    r = PartResult(2, 0, 0, 1, "p1", 100, weights, ("p0", "p1"), "ref", nonce, b"t",
                   auth.result_tag(2, 0, 0, 1, "p1", 100, weights, ("p0", "p1"), nonce, b"t"))
    assert auth.check_contribution(c) is None and auth.check_result(r) is None
    for changed in (SegmentWeights((13.0, 6.0), (41,)), SegmentWeights((13.0, 7.0), (40,)),
                    SegmentWeights.uniform(13.0)):
        assert "does not match" in auth.check_contribution(
            dataclasses.replace(c, weights=changed))
        assert "does not match" in auth.check_result(dataclasses.replace(r, weights=changed))
    assert "malformed" in auth.check_contribution(dataclasses.replace(c, weights=13.0))
    assert "malformed" in auth.check_result(dataclasses.replace(r, weights=None))
    # the nonce and the payload tags are signed fields too; an int is not read as bytes
    for changed in ({"nonce": b"m" * 16}, {"payload_tags": (b"t0", b"t2")}):
        assert "does not match" in auth.check_contribution(dataclasses.replace(c, **changed))
    assert "does not match" in auth.check_result(dataclasses.replace(r, payload_tag=b"u"))
    assert "malformed" in auth.check_contribution(dataclasses.replace(c, nonce=1 << 40))
    assert "malformed" in auth.check_result(dataclasses.replace(r, payload_tag=1 << 40))


def test_unauthenticated_rejections_never_quarantine_the_named_sender():
    q = Quarantine(threshold=1)
    for reporter in ("p0", "p2", "p3"):
        assert q.note(reporter, "p1", UNAUTH.value, epoch=5, now=1.0) is None
    assert q.records == []
    assert q.note("p0", "p1", RejectReason.NON_FINITE.value, epoch=5, now=1.0) is not None


@pytest.mark.parametrize("key", [b"short", "a string key of enough length", None])
def test_a_bad_key_is_refused_with_what_to_use(key):
    with pytest.raises(ValueError, match="new_job_key"):
        JobAuth(key)


def _signed_contribution(auth: JobAuth, encs, sender="p1", round_index=0) -> Contribution:
    weights = SegmentWeights.uniform(2.0)
    numel = sum(e.numel for e in encs)
    nonce, payload_tags, tag = auth.sign_contribution(7, round_index, 0, sender, weights,
                                                      numel, encs)
    return Contribution(7, round_index, 0, sender, weights, numel, ("ref",) * len(encs),
                        nonce, payload_tags, tag)


@pytest.mark.parametrize("codec", ["none", "fp16", "blockwise8", "blockwise4"])
def test_a_payload_tag_binds_every_encoded_byte_its_part_and_its_message(codec):
    """A part matches its payload tag as sent and nowhere else: one flipped bit in its data
    or block metadata, another part's bytes, the same bytes under another round's or
    sender's fields, or something that is not an ``Encoded`` are all refused."""
    auth = JobAuth(KEY)
    rng = np.random.default_rng(9)
    values = rng.standard_normal(3000).astype(np.float32)
    values[:1000] *= 1e6  # fp16 scales this part (its meta holds the scale)
    encs = tuple(encode(values[j * 1000:(j + 1) * 1000], codec) for j in range(3))
    c = _signed_contribution(auth, encs)
    assert auth.check_contribution(c) is None
    assert [auth.part_matches(c, j, e) for j, e in enumerate(encs)] == [True] * 3

    def flipped(enc: Encoded, field: str, index: int) -> Encoded:
        raw = getattr(enc, field).copy()
        raw.reshape(-1).view(np.uint8)[index] ^= 1
        return dataclasses.replace(enc, **{field: raw})

    for j, enc in enumerate(encs):
        for index in (0, enc.data.nbytes // 2, enc.data.nbytes - 1):
            assert not auth.part_matches(c, j, flipped(enc, "data", index)), (j, index)
        if enc.meta.size:
            assert not auth.part_matches(c, j, flipped(enc, "meta", enc.meta.nbytes - 1))
        assert not auth.part_matches(c, j, encs[(j + 1) % 3])  # another part's bytes
        assert not auth.part_matches(c, j, dataclasses.replace(enc, numel=enc.numel - 1))
        assert not auth.part_matches(c, j, enc.data)  # not an Encoded
    # a replay of these bytes and tags under other fields: the part keys differ
    for changed in ({"round_index": 1}, {"sender": "p2"}):
        assert not auth.part_matches(dataclasses.replace(c, **changed), 1, encs[1])
    # every signature draws a fresh nonce, so no one-time key is used twice
    again = _signed_contribution(auth, encs)
    assert again.nonce != c.nonce and set(again.payload_tags).isdisjoint(c.payload_tags)


def test_a_result_whose_bytes_change_after_signing_is_re_reduced():
    """An owner's result with one value changed in transit fails its payload tag at every
    receiver: rejected as ``UNAUTHENTICATED`` and re-reduced from the contributions held,
    the same way by every receiver."""

    class TamperingResults(LocalTransport):
        def send(self, handle, method, message):
            if isinstance(message, PartResult) and isinstance(message.ref, Inline):
                data = message.ref.value.data.copy()
                data[-1] += 1
                message = dataclasses.replace(
                    message, ref=Inline(dataclasses.replace(message.ref.value, data=data)))
            return super().send(handle, method, message)

    n = 3
    arrays, weights = inputs(n, seed=8)
    network, averagers, plan = swarm(n, job_key=KEY)
    averagers["p1"].transport = TamperingResults(network, "p1")
    got = asyncio.run(reduce_all(averagers, plan, arrays, weights))
    for pid in ("p0", "p2"):
        out, report = got[pid]
        bad = _unauth(report)
        assert [r.sender for r in bad] == ["p1"], pid  # for the part p1 owns
        assert "result's bytes" in bad[0].detail and "payload tag" in bad[0].detail
        assert report.failed_owners == ("p1",), pid
        assert np.array_equal(out, got["p0"][0]), pid


def test_each_part_is_maced_once_by_its_sender_and_once_by_each_receiver(monkeypatch):
    """The payload MAC is the only pass authentication makes over the bytes: in a
    one-group round of k members, each member tags the k - 1 parts it sends and its
    result, each owner checks the k - 1 parts it reduces and every member the k - 1
    results it applies; each pass covers one part."""
    passes = []
    tag_of = JobAuth._payload_tag

    def counted(self, identity, nonce, part, enc):
        if enc is not None:  # a part not sent (the sender's own) is tagged b"" unread
            passes.append(identity[0])
        return tag_of(self, identity, nonce, part, enc)

    monkeypatch.setattr(JobAuth, "_payload_tag", counted)
    k = 4
    arrays, weights = inputs(k, size=4000)
    _, averagers, plan = swarm(k, job_key=KEY)
    got = asyncio.run(reduce_all(averagers, plan, arrays, weights))
    assert all(report.rejections == () for _, report in got.values())
    assert passes.count("contribution") == 2 * k * (k - 1)
    assert passes.count("result") == k + k * (k - 1)
