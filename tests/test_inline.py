"""``cluster/collective/inline.py``: small payloads split into call-argument chunks and
joined back."""

from __future__ import annotations

import numpy as np
import pytest

import moshray.cluster.collective.codecs as comp
import moshray.cluster.collective.inline as inline
from moshray.cluster.messages import (Contribution, InBundle, Inline, PartResult, Probe,
                                      SegmentWeights)

W8, W16, W1 = (SegmentWeights.uniform(w) for w in (8.0, 16.0, 1.0))


def _enc(n: int, codec: str = "fp16", seed: int = 0) -> comp.Encoded:
    values = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    return comp.encode(values, codec)


def _same(a: comp.Encoded, b: comp.Encoded) -> bool:
    return (a.codec == b.codec and a.numel == b.numel and np.array_equal(a.data, b.data)
            and np.array_equal(a.meta, b.meta))


@pytest.mark.parametrize("codec", comp.codec_names())
def test_a_contribution_round_trips_with_every_chunk_under_the_limit(codec):
    big, small = _enc(200_000, codec, 1), _enc(10, codec, 2)
    c = Contribution(3, 0, 0, "a", W8, 200_010,
                     (Inline(big), None, InBundle("ref", 2), Inline(small)))
    skeleton, chunks = inline.split(c)
    assert all(chunk.nbytes <= inline.CHUNK_BYTES for chunk in chunks)
    assert len(chunks) == -(-big.data.nbytes // inline.CHUNK_BYTES) + 1
    assert not any(isinstance(p, Inline) for p in skeleton.part_refs)  # bytes moved out
    back = inline.join(skeleton, chunks)
    assert back.part_refs[1] is None and back.part_refs[2] == InBundle("ref", 2)
    assert _same(back.part_refs[0].value, big) and _same(back.part_refs[3].value, small)
    assert back.sender == "a" and back.weights == W8


def test_a_result_round_trips_and_other_messages_pass_unchanged():
    enc = _enc(50_000)
    r = PartResult(1, 0, 0, 2, "b", 200_000, W16, ("a", "b"), Inline(enc))
    skeleton, chunks = inline.split(r)
    assert _same(inline.join(skeleton, chunks).ref.value, enc)
    as_ref = PartResult(1, 0, 0, 2, "b", 200_000, W16, ("a",), "an object ref")
    assert inline.split(as_ref) == (as_ref, ())
    probe = Probe(1, 0, 0, "a")
    assert inline.split(probe) == (probe, ()) and inline.join(probe) is probe


def test_chunks_that_do_not_match_the_placeholders_are_a_clear_error():
    skeleton, chunks = inline.split(
        PartResult(1, 0, 0, 0, "b", 10, W1, ("b",), Inline(_enc(100_000))))
    with pytest.raises(ValueError, match="carried 1"):
        inline.join(skeleton, chunks[:1])
