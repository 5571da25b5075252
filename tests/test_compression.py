"""Tests for moshray.cluster.collective.codecs: round-trip error bounds, payload sizes,
non-finite input, fp16 scaling beyond its range, the registry's built-ins."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moshray.cluster.collective.codecs import (
    BLOCK,
    Encoded,
    codec_names,
    decode,
    encode,
    get_codec,
    max_abs,
    max_abs_error_bound,
)
from moshray.cluster.messages import RejectReason
from moshray.cluster.collective.partition import check_contribution

BUILT_INS = ("none", "fp16", "uint8", "blockwise8")
CODECS = list(BUILT_INS)
EIGHT_BIT = ["uint8", "blockwise8"]


def _normal(n: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def _with_outlier(n: int, value: float = 1000.0) -> np.ndarray:
    x = _normal(n, seed=1)
    x[n // 3] = value
    return x


DATA = {
    "normal": _normal(10_000),
    "normal-small-scale": _normal(10_000, seed=2, scale=1e-3),
    "normal-large-scale": _normal(10_000, seed=3, scale=300.0),
    "offset": _normal(5_000, seed=4) + np.float32(250.0),
    "outlier": _with_outlier(3 * BLOCK),
    "negative-outlier": _with_outlier(2 * BLOCK + 5, -5000.0),
    "constant": np.full(5_000, 3.1, np.float32),
    "constant-zero": np.zeros(BLOCK + 3, np.float32),
    "constant-negative": np.full(7, -0.7, np.float32),
    "empty": np.zeros(0, np.float32),
    "one": np.array([2.5], np.float32),
    "block-minus-1": _normal(BLOCK - 1, seed=5),
    "block": _normal(BLOCK, seed=6),
    "block-plus-1": _normal(BLOCK + 1, seed=7),
    "ragged-tail": _normal(3 * BLOCK + 17, seed=8),
    "tail-outlier": np.concatenate([_normal(BLOCK + 2, seed=9), np.float32([80.0])]),
}


def _max_err(x: np.ndarray, y: np.ndarray) -> float:
    if x.size == 0:
        return 0.0
    return float(np.abs(y.astype(np.float64) - x.astype(np.float64)).max())


@pytest.mark.parametrize("name", DATA)
@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_within_bound(codec: str, name: str) -> None:
    x = DATA[name]
    before = x.copy()
    enc = encode(x, codec)
    y = decode(enc)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert enc.numel == x.size
    bound = max_abs_error_bound(x, codec)
    assert _max_err(x, y) <= bound, (_max_err(x, y), bound)
    np.testing.assert_array_equal(x, before)  # the input is never modified


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, ">f4"])
def test_max_abs_is_the_largest_magnitude_in_one_pass_or_two(dtype) -> None:
    """``max_abs`` (one torch pass for contiguous native floats, numpy's two reductions
    otherwise) gives numpy's answer exactly: read-only, strided and reversed arrays,
    NaN anywhere, an infinity, an empty vector."""
    x = _normal(10_001, seed=4, scale=3.0).astype(dtype)
    want = float(max(x.max(), -x.min()))
    readonly = x.copy()
    readonly.flags.writeable = False
    for view in (x, readonly, x[::3], x[::-1], x.reshape(73, 137)):
        assert max_abs(view) == float(max(view.max(), -view.min()))
    assert max_abs(x) == want
    for where in (0, 5_000, 10_000):
        for bad in (np.nan, -np.inf):
            y = x.copy()
            y[where] = bad
            got = max_abs(y)
            assert math.isnan(got) if np.isnan(bad) else got == math.inf, (where, bad)
    assert max_abs(x[:0]) == 0.0


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_accepts_codec_names_and_objects(codec: str) -> None:
    x = DATA["normal"]
    by_name = encode(x, codec)
    assert by_name.codec == codec
    np.testing.assert_array_equal(decode(by_name), decode(encode(x, get_codec(codec))))


def test_none_is_exact() -> None:
    for x in DATA.values():
        np.testing.assert_array_equal(decode(encode(x, "none")), x)
        assert max_abs_error_bound(x, "none") == 0.0


@pytest.mark.parametrize("codec", EIGHT_BIT)
@pytest.mark.parametrize("name", ["constant", "constant-zero", "constant-negative", "one"])
def test_eight_bit_codecs_are_exact_on_constants(codec: str, name: str) -> None:
    x = DATA[name]
    np.testing.assert_array_equal(decode(encode(x, codec)), x)


@pytest.mark.parametrize("codec", CODECS)
def test_empty_vector(codec: str) -> None:
    enc = encode(np.zeros(0, np.float32), codec)
    assert enc.numel == 0 and enc.nbytes == 0
    out = decode(enc)
    assert out.shape == (0,) and out.dtype == np.float32
    assert max_abs_error_bound(np.zeros(0, np.float32), codec) == 0.0


def test_fp16_error_is_relative() -> None:
    x = DATA["normal-large-scale"]
    y = decode(encode(x, "fp16"))
    rel = np.abs(y.astype(np.float64) - x) / np.maximum(np.abs(x.astype(np.float64)), 6.1e-5)
    assert rel.max() <= 2.0**-11


@pytest.mark.parametrize("codec", EIGHT_BIT)
def test_eight_bit_bound_holds_at_a_quantisation_midpoint(codec: str) -> None:
    """A value next to the midpoint between two levels: the documented worst case.

    lo = -0.28538051, hi = 0.2736237, x = 0.25937462 (step 0.0021921741, x rounds to
    level 248). Half a step plus float32 rounding of ``q * scale + lo`` must stay within
    ``max_abs_error_bound``.
    """
    x = np.array([3197246821, 1049368680, 1048890560], np.uint32).view(np.float32)
    err = _max_err(x, decode(encode(x, codec)))
    assert err <= max_abs_error_bound(x, codec), (err, max_abs_error_bound(x, codec))


def test_blockwise_isolates_a_huge_outlier() -> None:
    x = _normal(16 * BLOCK, seed=11)
    x[5] = 1e4  # in block 0
    err_u8 = np.abs(decode(encode(x, "uint8")).astype(np.float64) - x)
    err_bw = np.abs(decode(encode(x, "blockwise8")).astype(np.float64) - x)
    # Outside the outlier's block, blockwise error is set by the normal data only.
    assert err_bw[BLOCK:].max() < 0.01 * err_u8[BLOCK:].max()
    assert err_bw.mean() < 0.1 * err_u8.mean()
    assert err_bw.max() <= max_abs_error_bound(x, "blockwise8")
    assert err_u8.max() <= max_abs_error_bound(x, "uint8")
    assert max_abs_error_bound(x, "blockwise8") <= max_abs_error_bound(x, "uint8")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", [0, 1234, BLOCK + 1])
@pytest.mark.parametrize("codec", CODECS)
def test_non_finite_input_decodes_non_finite(codec: str, where: int, bad: float) -> None:
    x = _normal(2 * BLOCK, seed=12)
    x[where] = bad
    with np.errstate(invalid="ignore", over="ignore"):
        y = decode(encode(x, codec))
    assert not np.isfinite(y).all()
    # ... so the receiver's validation rejects the contribution.
    problem = check_contribution(y, x.size, np.dtype(np.float32), 1.0)
    assert problem is not None and problem[0] is RejectReason.NON_FINITE


@pytest.mark.parametrize("big", [65505.0, 70000.0, 1e6, -1e6, 3e38])
def test_fp16_scales_a_part_beyond_its_range_instead_of_overflowing(big: float) -> None:
    """A healthy element over 65504 would be inf in half precision: the part is sent
    scaled by a power of two (in ``meta``) and round-trips within the documented bound."""
    x = _normal(1000, seed=15)
    x[17] = big
    enc = encode(x, "fp16")
    assert enc.data.dtype == np.float16 and enc.meta.shape == (1, 2)
    scale = float(enc.meta[0, 1])
    assert scale > 1 and math.log2(scale).is_integer() and abs(big) / scale <= 65504
    y = decode(enc)
    assert np.isfinite(y).all()
    assert _max_err(x, y) <= max_abs_error_bound(x, "fp16")
    assert abs(float(y[17]) - big) <= abs(big) * 2.0**-11
    out = np.empty(x.size, np.float32)
    from moshray.cluster.collective.codecs import decode_into, received_values

    decode_into(enc, out)
    assert np.array_equal(out, y) and np.array_equal(received_values(enc), y)


def test_fp16_in_range_parts_are_sent_unscaled() -> None:
    x = np.array([1.0, -65504.0, 3.5], np.float32)
    enc = encode(x, "fp16")
    assert enc.meta.shape == (0, 2)
    np.testing.assert_array_equal(decode(enc), x)


@pytest.mark.parametrize("numel", [1, BLOCK - 1, BLOCK, 100_000, 10 * BLOCK + 1])
def test_encoded_nbytes(numel: int) -> None:
    x = _normal(numel, seed=13)
    blocks = math.ceil(numel / BLOCK)
    sizes = {c: encode(x, c).nbytes for c in CODECS}
    assert sizes["none"] == 4 * numel
    assert sizes["fp16"] == 2 * numel
    assert sizes["uint8"] == numel + 8  # one (offset, scale) float32 pair
    assert sizes["blockwise8"] == numel + 8 * blocks
    if numel >= BLOCK:
        assert sizes["blockwise8"] <= 1.01 * numel


@pytest.mark.parametrize("codec", CODECS)
def test_wire_dtypes_and_meta_layout(codec: str) -> None:
    x = _normal(2 * BLOCK + 3, seed=14)
    enc = encode(x, codec)
    assert isinstance(enc, Encoded)
    assert enc.data.dtype == get_codec(codec).wire_dtype
    assert enc.data.shape == (x.size,)
    assert enc.meta.dtype == np.float32 and enc.meta.ndim == 2 and enc.meta.shape[1] == 2
    expected_blocks = {"none": 0, "fp16": 0, "uint8": 1, "blockwise8": 3}[codec]
    assert enc.meta.shape[0] == expected_blocks


def test_unknown_codec_raises_naming_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="unknown codec 'int4'; choose one of none, fp16"):
        encode(np.zeros(3, np.float32), "int4")
    with pytest.raises(ValueError):
        max_abs_error_bound(np.zeros(3, np.float32), "int4")
    with pytest.raises(ValueError):
        decode(Encoded("int4", 3, np.zeros(3, np.uint8), np.zeros((0, 2), np.float32)))


def test_the_built_ins_are_registered_first_with_their_documented_bounds() -> None:
    assert codec_names()[:4] == BUILT_INS
    for name in BUILT_INS:
        codec = get_codec(name)
        assert codec.name == name and codec.error and isinstance(codec.wire_dtype, np.dtype)
        assert get_codec(codec) is codec


@pytest.mark.parametrize("codec", CODECS)
def test_received_values_and_decode_into_match_decode(codec: str) -> None:
    """The zero-copy paths the all-reduce uses give exactly ``decode``'s values."""
    from moshray.cluster.collective.codecs import decode_into, received_values, round_trip

    values = np.random.default_rng(4).normal(size=10_001).astype(np.float32)
    enc = encode(values, codec)
    expected = decode(enc)
    got = received_values(enc)
    assert np.array_equal(got.astype(np.float32), expected)
    assert np.array_equal(round_trip(values, codec).astype(np.float32), expected)
    if codec == "none":
        assert np.shares_memory(got, values)  # no copy on the wire path
    out = np.full(values.size, np.nan, np.float32)
    decode_into(enc, out)
    assert np.array_equal(out, expected)
    with pytest.raises(ValueError):
        decode_into(enc, np.empty(values.size + 1, np.float32))


def test_fp16_gradient_like_error_within_bound() -> None:
    """Gradient-like values (heavy tails, many tiny ones) averaged as the all-reduce does:
    each peer's value encoded, the mean of the decoded values encoded again. The error
    stays within the sum of the two documented bounds (what the cluster test asserts)."""
    rng = np.random.default_rng(11)
    grads = [(rng.standard_t(3, size=200_000) * 1e-3).astype(np.float32) for _ in range(4)]
    exact = np.mean([g.astype(np.float64) for g in grads], axis=0)
    mean = np.mean([decode(encode(g, "fp16")) for g in grads], axis=0, dtype=np.float32)
    got = decode(encode(mean, "fp16"))
    bound = max(max_abs_error_bound(g, "fp16") for g in grads)
    bound += max_abs_error_bound(exact.astype(np.float32), "fp16")
    assert np.abs(got - exact).max() <= bound


def test_half_conversions_match_numpy_bit_for_bit() -> None:
    """The vectorized conversions (torch when present) equal numpy's ``astype``: every
    float16 value widened, and float32 values narrowed across the whole bit range (normal,
    subnormal, overflowing, ties), NaN staying NaN."""
    from moshray.cluster.collective.codecs import to_float, to_half

    every = np.arange(65536, dtype=np.uint16).view(np.float16)
    wide = to_float(every)
    ref = every.astype(np.float32)
    assert np.array_equal(np.isnan(wide), np.isnan(ref))
    ok = ~np.isnan(ref)
    assert np.array_equal(wide[ok].view(np.uint32), ref[ok].view(np.uint32))
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32)
    ties = (every[ok].astype(np.float32).view(np.uint32) + np.uint32(1 << 12))  # halfway
    small = (rng.standard_normal(200_000) * 1e-6).astype(np.float32).view(np.uint32)
    for pattern in (bits, ties, small):
        x = pattern.view(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            ref16 = x.astype(np.float16)
        out = np.full(x.size, 7, np.float16)
        got = to_half(x, out)
        assert got is out
        assert np.array_equal(np.isnan(got), np.isnan(ref16))
        ok16 = ~np.isnan(ref16)
        assert np.array_equal(got[ok16].view(np.uint16), ref16[ok16].view(np.uint16))
    readonly = every[ok].copy()
    readonly.flags.writeable = False  # an object-store buffer: read, never written
    assert np.array_equal(to_float(readonly), readonly.astype(np.float32))
