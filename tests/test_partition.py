"""Tests for moshray.cluster.collective.partition: part sizes, slices, validation, weighted mean."""

from __future__ import annotations


import numpy as np
import pytest

from moshray.cluster.messages import RejectReason, SegmentWeights
from moshray.cluster.collective.partition import (ContributionBounds, Limits, WeightedMean,
                                                  check_contribution, check_weights,
                                                  part_sizes, part_slices)

NAN, INF = float("nan"), float("inf")

SHARES = [
    [1.0],
    [1.0, 1.0, 1.0],
    [1.0, 2.0, 3.0, 4.0],
    [0.1, 0.2, 0.7],
    [1e-9, 1.0],
    [3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0],
    list(np.random.default_rng(0).uniform(0.01, 10.0, 16)),
    [1.0, 0.0, 2.0],
]
NUMELS = [0, 1, 7, 1000, 2**20 + 3, 10**9 + 7]


@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("shares", SHARES, ids=lambda s: f"{len(s)}shares")
def test_part_sizes_sum_and_proportional(numel: int, shares: list[float]) -> None:
    sizes = part_sizes(numel, shares)
    assert isinstance(sizes, tuple) and len(sizes) == len(shares)
    assert all(isinstance(s, int) and s >= 0 for s in sizes)
    assert sum(sizes) == numel
    total = sum(shares)
    for size, share in zip(sizes, shares):
        assert abs(size - numel * share / total) < 1.0


def test_part_sizes_largest_remainder_is_deterministic() -> None:
    assert part_sizes(10, [1, 1, 1]) == (4, 3, 3)  # ties go to the lowest index
    assert part_sizes(100, [1, 2]) == (33, 67)
    assert part_sizes(5, [1, 1, 1, 1, 1, 1, 1]) == (1, 1, 1, 1, 1, 0, 0)
    assert part_sizes(10, [1, 1, 1]) == part_sizes(10, (1.0, 1.0, 1.0))


@pytest.mark.parametrize("bad", [0.0, -1.0, -INF, NAN, INF])
def test_part_sizes_non_positive_or_non_finite_share_gets_nothing(bad: float) -> None:
    sizes = part_sizes(1000, [1.0, bad, 3.0])
    assert sizes == (250, 0, 750)


@pytest.mark.parametrize(
    "shares", [[0.0, 0.0, 0.0], [-1.0, NAN, 0.0], [-INF, -2.0, INF]], ids=str
)
@pytest.mark.parametrize("numel", [0, 2, 10, 1001])
def test_part_sizes_without_positive_share_splits_evenly(shares: list[float], numel: int) -> None:
    sizes = part_sizes(numel, shares)
    assert sum(sizes) == numel
    assert max(sizes) - min(sizes) <= 1
    assert sizes == tuple(sorted(sizes, reverse=True))  # extra elements go to low indices


def test_part_sizes_errors() -> None:
    with pytest.raises(ValueError):
        part_sizes(10, [])
    with pytest.raises(ValueError):
        part_sizes(-1, [1.0])


def test_part_sizes_huge_finite_shares() -> None:
    """Finite positive shares must split proportionally however large they are."""
    assert part_sizes(10, [1e308]) == (10,)
    assert part_sizes(10, [1e308, 1e308]) == (5, 5)


@pytest.mark.parametrize(
    "sizes", [(), (0,), (5,), (3, 0, 4), (1, 1, 1, 1), (2**20, 7, 0, 3)], ids=str
)
def test_part_slices_are_contiguous_and_cover(sizes: tuple[int, ...]) -> None:
    slices = part_slices(sizes)
    assert len(slices) == len(sizes)
    start = 0
    for sl, size in zip(slices, sizes):
        assert sl.start == start and sl.stop == start + size and sl.step is None
        start = sl.stop
    x = np.arange(sum(sizes))
    joined = np.concatenate([x[sl] for sl in slices]) if slices else np.zeros(0, x.dtype)
    np.testing.assert_array_equal(joined, x)


def test_part_slices_of_part_sizes_cover_the_vector() -> None:
    x = np.arange(12345, dtype=np.float32)
    slices = part_slices(part_sizes(x.size, [1.0, 0.5, 2.0, 0.0]))
    assert x[slices[3]].size == 0
    np.testing.assert_array_equal(np.concatenate([x[s] for s in slices]), x)


F32 = np.dtype(np.float32)


def _good(n: int = 5, dtype=np.float32) -> np.ndarray:
    return np.linspace(-1, 1, n).astype(dtype)


@pytest.mark.parametrize("weight", [0.0, 1.0, 123.5])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_check_contribution_accepts_good_input(weight: float, dtype) -> None:
    assert check_contribution(_good(5, dtype), 5, np.dtype(dtype), weight) is None
    assert check_contribution(np.zeros(0, np.float32), 0, F32, weight) is None


@pytest.mark.parametrize(
    "values,numel,dtype,weight,reason",
    [
        (_good(), 5, F32, -1.0, RejectReason.BAD_WEIGHT),
        (_good(), 5, F32, NAN, RejectReason.BAD_WEIGHT),
        (_good(), 5, F32, INF, RejectReason.BAD_WEIGHT),
        (_good(), 5, F32, -INF, RejectReason.BAD_WEIGHT),
        # the weight is checked first, even when everything else is wrong too
        (np.full(3, np.nan), 5, F32, -1.0, RejectReason.BAD_WEIGHT),
        (_good(5, np.float64), 5, F32, 1.0, RejectReason.DTYPE_MISMATCH),
        (_good(5, np.float16), 5, F32, 1.0, RejectReason.DTYPE_MISMATCH),
        (np.zeros(5, np.uint8), 5, F32, 1.0, RejectReason.DTYPE_MISMATCH),
        # dtype before shape
        (_good(4, np.float64), 5, F32, 1.0, RejectReason.DTYPE_MISMATCH),
        (_good(4), 5, F32, 1.0, RejectReason.SHAPE_MISMATCH),
        (_good(6), 5, F32, 1.0, RejectReason.SHAPE_MISMATCH),
        (_good(6).reshape(2, 3), 6, F32, 1.0, RejectReason.SHAPE_MISMATCH),
        (np.ones((), np.float32), 1, F32, 1.0, RejectReason.SHAPE_MISMATCH),
        # shape before finiteness
        (np.full(4, np.nan, np.float32), 5, F32, 1.0, RejectReason.SHAPE_MISMATCH),
        (np.array([0, np.nan, 1], np.float32), 3, F32, 1.0, RejectReason.NON_FINITE),
        (np.array([0, 1, np.inf], np.float32), 3, F32, 1.0, RejectReason.NON_FINITE),
        (np.array([-np.inf, 1, 2], np.float32), 3, F32, 0.0, RejectReason.NON_FINITE),
        (np.array([1, np.inf], np.float16), 2, np.dtype(np.float16), 1.0, RejectReason.NON_FINITE),
    ],
    ids=lambda v: v.value if isinstance(v, RejectReason) else None,
)
def test_check_contribution_rejects(values, numel, dtype, weight, reason) -> None:
    result = check_contribution(values, numel, dtype, weight)
    assert result is not None
    got, detail = result
    assert got is reason
    assert isinstance(detail, str) and detail


def _weighted(values: list[np.ndarray], weights: list[float]) -> np.ndarray:
    stack = np.stack([v.astype(np.float64) for v in values])
    return np.average(stack, axis=0, weights=np.asarray(weights, np.float64))


@pytest.mark.parametrize("numel", [1, 17, 4096, 2**20 + 12345, 2**21 + 1])
def test_weighted_mean_matches_numpy(numel: int) -> None:
    rng = np.random.default_rng(numel)
    values = [rng.standard_normal(numel).astype(np.float32) * 5 + 1 for _ in range(4)]
    weights = [0.5, 3.0, 1.25, 7.0]
    copies = [v.copy() for v in values]
    mean = WeightedMean(numel)
    for v, w in zip(values, weights):
        mean.add(v, w)
    result, total = mean.result()
    assert result.dtype == np.float32 and result.shape == (numel,)
    assert total.cuts == () and total.weights[0] == pytest.approx(sum(weights))
    assert mean.count == 4
    np.testing.assert_allclose(result, _weighted(values, weights), rtol=1e-5, atol=1e-5)
    for v, c in zip(values, copies):
        np.testing.assert_array_equal(v, c)  # inputs are not modified


def test_weighted_mean_is_order_independent() -> None:
    rng = np.random.default_rng(3)
    numel = 2**20 + 5
    values = [rng.standard_normal(numel).astype(np.float32) for _ in range(3)]
    weights = [1.0, 2.0, 4.0]
    results = []
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        mean = WeightedMean(numel)
        for i in order:
            mean.add(values[i], weights[i])
        results.append(mean.result()[0])
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results[0], results[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("numel", [8, 2**20 + 9])
def test_weighted_mean_ignores_zero_weights_when_others_positive(numel: int) -> None:
    rng = np.random.default_rng(5)
    a = rng.standard_normal(numel).astype(np.float32)
    b = rng.standard_normal(numel).astype(np.float32)
    junk = np.full(numel, 1e6, np.float32)
    mean = WeightedMean(numel)
    mean.add(junk, 0.0)  # zero weight first ...
    mean.add(a, 1.0)
    mean.add(junk, 0.0)  # ... between ...
    mean.add(b, 3.0)
    mean.add(junk, 0.0)  # ... and last
    result, total = mean.result()
    assert total == SegmentWeights.uniform(4.0)
    assert mean.count == 5
    np.testing.assert_allclose(result, _weighted([a, b], [1.0, 3.0]), rtol=1e-5, atol=1e-6)


def test_weighted_mean_single_contribution_is_exact() -> None:
    x = np.random.default_rng(9).standard_normal(1000).astype(np.float32)
    mean = WeightedMean(x.size)
    mean.add(x, 2.0)  # x * 2 / 2 is exact in binary floating point
    result, total = mean.result()
    np.testing.assert_array_equal(result, x)
    assert total == SegmentWeights.uniform(2.0)


@pytest.mark.parametrize("count", [1, 2, 5])
def test_weighted_mean_all_zero_weights_is_plain_mean(count: int) -> None:
    rng = np.random.default_rng(count)
    values = [rng.standard_normal(100).astype(np.float32) for _ in range(count)]
    copies = [v.copy() for v in values]
    mean = WeightedMean(100)
    for v in values:
        mean.add(v, 0.0)
    result, total = mean.result()
    assert total == SegmentWeights.uniform(0.0)
    np.testing.assert_allclose(result, np.mean(np.stack(values), axis=0), rtol=1e-6, atol=1e-6)
    for v, c in zip(values, copies):
        np.testing.assert_array_equal(v, c)  # the plain sum never accumulates into an input


def test_weighted_mean_empty_raises() -> None:
    with pytest.raises(ValueError):
        WeightedMean(10).result()
    with pytest.raises(ValueError):
        WeightedMean(0).result()


def test_weighted_mean_zero_length_vectors() -> None:
    mean = WeightedMean(0)
    mean.add(np.zeros(0, np.float32), 2.0)
    result, total = mean.result()
    assert result.shape == (0,) and total == SegmentWeights.uniform(2.0)


def _old_weighted_mean(values, weights):
    """The reference arithmetic: fl(w * x) per block, added to a float32 accumulator."""
    acc, total, plain = None, 0.0, None
    for v, w in zip(values, weights):
        if w > 0:
            t = np.multiply(v, np.float32(w), dtype=np.float32)
            acc = t if acc is None else acc + t
            total += w
        elif total == 0:
            plain = v.astype(np.float32) if plain is None else plain + v
    if total > 0:
        return acc / np.float32(total)
    return plain / np.float32(len(values))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("weights", [[0.5, 3.0, 1.25, 7.0], [0.0, 1.0, 0.0, 3.0], [0.0, 0.0]])
def test_weighted_mean_terms_are_bitwise_the_reference(dtype, weights) -> None:
    """``term`` + ``add_term`` (owned, in place) and ``add`` give the same bits as the
    plain float32 arithmetic, for float16 wire values too."""
    rng = np.random.default_rng(len(weights))
    values = [(rng.standard_normal(50_001) * 3).astype(dtype) for _ in weights]
    expected = _old_weighted_mean(values, weights)
    mean, staged = WeightedMean(50_001), WeightedMean(50_001)
    for v, w in zip(values, weights):
        mean.add(v, w)
        staged.add_term(WeightedMean.term(v.astype(np.float32), w, owned=True), w)
    assert np.array_equal(mean.result()[0].view(np.uint32), expected.view(np.uint32))
    assert np.array_equal(staged.result()[0].view(np.uint32), expected.view(np.uint32))


# -- weights per segment ----------------------------------------------------------------------


def test_segment_weights_restrict_join_merge_and_average() -> None:
    w = SegmentWeights((13.0, 6.0, 13.0), (25, 50))  # (100 values)
    assert w.problem(100) is None and w.problem(50) is not None  # a cut at the end
    assert w.segments(100) == [(0, 25, 13.0), (25, 50, 6.0), (50, 100, 13.0)]
    assert w.within(0, 25) == SegmentWeights.uniform(13.0)
    assert w.within(10, 60) == SegmentWeights((13.0, 6.0, 13.0), (15, 40))
    assert w.within(25, 50) == SegmentWeights.uniform(6.0)
    assert w.within(30, 30) == SegmentWeights.uniform(6.0)  # no value: the one it is in
    # parts back together give the whole, wherever they are cut; equal neighbours merge
    for cut in (0, 10, 25, 37, 50, 99, 100):
        parts = [(cut, w.within(0, cut)), (0, SegmentWeights.uniform(9.0)),
                 (100 - cut, w.within(cut, 100))]
        assert SegmentWeights.joined(parts) == w, cut
    assert SegmentWeights.joined([(5, SegmentWeights.uniform(2.0))] * 3) == \
        SegmentWeights.uniform(2.0)
    assert SegmentWeights.merged([1.0, 1.0, 2.0, 2.0], [3, 5, 8]) == \
        SegmentWeights((1.0, 2.0), (5,))
    assert w.mean(100) == (25 * 13.0 + 25 * 6.0 + 50 * 13.0) / 100
    assert SegmentWeights.uniform(0.1).mean(3) == 0.1  # exact for one segment
    for bad in (SegmentWeights((1.0, 2.0)), SegmentWeights((1.0, 2.0), (0,)),
                SegmentWeights((1.0, 2.0, 3.0), (5, 5)), SegmentWeights((1.0, 2.0), (5.0,)),
                SegmentWeights([1.0]), SegmentWeights(("1",))):
        assert bad.problem(10) is not None, bad


def test_check_weights_rejects_malformed_non_finite_negative_and_out_of_bounds() -> None:
    limits = Limits(weight=50.0)
    assert check_weights(SegmentWeights((50.0, 0.0), (3,)), 10, limits) is None
    assert check_weights(SegmentWeights((1.0, 2.0), (10,)), 10)[0] is RejectReason.BAD_WEIGHT
    assert check_weights(7.0, 10)[0] is RejectReason.BAD_WEIGHT  # not a SegmentWeights
    for w in (NAN, INF, -1.0):
        got = check_weights(SegmentWeights((1.0, w), (3,)), 10, limits)
        assert got[0] is RejectReason.BAD_WEIGHT, w
    reason, detail = check_weights(SegmentWeights((1.0, 1e30), (3,)), 10, limits)
    assert reason is RejectReason.WEIGHT_OUT_OF_BOUNDS and "1e+30" in detail
    # a part's values with their weights: the same checks, then the values'
    reason, _ = check_contribution(_good(), 5, F32, SegmentWeights((1.0, 1e30), (3,)), limits)
    assert reason is RejectReason.WEIGHT_OUT_OF_BOUNDS
    assert check_contribution(_good(), 5, F32, SegmentWeights((1.0, 2.0), (3,))) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_weighted_mean_weighs_every_value_by_the_weights_it_holds(dtype) -> None:
    """Vectors whose weights differ between segments (some zero): every value is the
    weighted mean over the weights at that value (the plain mean where all are zero), the
    total per value is their sum, and in-place terms give the same bits."""
    numel = 1000
    rng = np.random.default_rng(7)
    profiles = [SegmentWeights((13.0, 6.0), (400,)), SegmentWeights.uniform(2.0),
                SegmentWeights((0.0, 3.0, 0.0), (100, 700)),
                SegmentWeights((1.0, 0.0), (950,))]
    values = [(rng.standard_normal(numel) * 3).astype(dtype) for _ in profiles]
    mean, staged = WeightedMean(numel), WeightedMean(numel)
    for v, w in zip(values, profiles):
        mean.add(v, w)
        staged.add_term(WeightedMean.term(v.astype(np.float32), w, owned=True), w)
    result, total = mean.result()
    w64 = np.stack([np.concatenate([np.full(b - a, x) for a, b, x in p.segments(numel)])
                    for p in profiles])
    x64 = np.stack([v.astype(np.float64) for v in values])
    expected = (w64 * x64).sum(axis=0) / w64.sum(axis=0)
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5)
    assert total == SegmentWeights((16.0, 19.0, 12.0, 9.0, 8.0), (100, 400, 700, 950))
    assert total == SegmentWeights.merged(list(w64.sum(axis=0)), list(range(1, numel)))
    assert np.array_equal(staged.result()[0].view(np.uint32), result.view(np.uint32))
    # every weight zero somewhere: the plain mean there, weight 0
    zero = WeightedMean(4)
    zero.add(np.float32([1, 2, 3, 4]), SegmentWeights((0.0, 1.0), (2,)))
    zero.add(np.float32([3, 4, 5, 6]), SegmentWeights((0.0, 3.0), (2,)))
    out, total = zero.result()
    np.testing.assert_allclose(out, [2.0, 3.0, 4.5, 5.5])
    assert total == SegmentWeights((0.0, 4.0), (2,))


def test_owner_shares_give_small_tensors_fewer_owners_in_turn() -> None:
    from moshray.cluster.collective.partition import owner_shares

    assert owner_shares(1000, [1, 3, 2, 3], min_part=1000) == [1, 0, 0, 0]
    assert owner_shares(1000, [1, 3, 2, 3], min_part=1000, rotate=1) == [0, 3, 0, 0]
    assert owner_shares(2500, [1, 3, 2, 3], min_part=1000, rotate=3) == [1, 0, 0, 3]
    assert owner_shares(10**6, [1, 3, 2, 3], min_part=1000) == [1, 3, 2, 3]  # big: everyone
    assert owner_shares(10, [0, float("nan")], min_part=1000) == [1.0, 0.0]  # none positive
    assert part_sizes(1000, owner_shares(1000, [1, 1, 1], min_part=1)) == (334, 333, 333)
    # members without a share never own; those with one take turns, one step each
    turns = [owner_shares(1000, [0, 2, 0, 5], min_part=1000, rotate=r) for r in range(4)]
    assert turns == [[0, 2, 0, 0], [0, 0, 0, 5], [0, 2, 0, 0], [0, 0, 0, 5]]
    owners = {owner_shares(1000, [1.0] * 5, min_part=1000, rotate=r).index(1.0)
              for r in range(5)}
    assert owners == set(range(5))


def test_group_part_sizes_follow_the_plans_shares_min_part_and_epoch() -> None:
    from types import SimpleNamespace

    from moshray.cluster.collective.partition import group_part_sizes

    plan = SimpleNamespace(min_part=1000, epoch=1, share_of={"a": 1, "b": 3, "c": 2}.get)
    assert group_part_sizes(plan, ["a", "b", "c"], 1000) == (0, 1000, 0)  # one owner, in turn
    assert sum(group_part_sizes(plan, ["a", "b", "c"], 6000)) == 6000  # big: everyone
    assert group_part_sizes(plan, ["a", "b", "c"], 6000) == (1000, 3000, 2000)


# -- bounds derived from the step -------------------------------------------------------------


def test_check_contribution_rejects_values_and_weights_beyond_the_steps_limits() -> None:
    limits = Limits(value=100.0, weight=50.0)
    assert check_contribution(_good(), 5, F32, 50.0, limits) is None
    x = _good()
    x[2] = 3e38  # finite, but poisoned
    reason, detail = check_contribution(x, 5, F32, 1.0, limits)
    assert reason is RejectReason.VALUE_OUT_OF_BOUNDS and "3e+38" in detail
    x[2] = -101.0
    assert check_contribution(x, 5, F32, 1.0, limits)[0] is RejectReason.VALUE_OUT_OF_BOUNDS
    reason, detail = check_contribution(_good(), 5, F32, 1e30, limits)
    assert reason is RejectReason.WEIGHT_OUT_OF_BOUNDS and "1e+30" in detail
    # NaN stays a non-finite rejection, not a bound's
    x[2] = np.nan
    assert check_contribution(x, 5, F32, 1.0, limits)[0] is RejectReason.NON_FINITE
    # unbounded by default: only finiteness
    assert check_contribution(np.float32([3e38, -3e38]), 2, F32, 1e30) is None


def test_bounds_derive_limits_from_the_peers_own_input_and_weight() -> None:
    bounds = ContributionBounds(value_factor=10.0, value_floor=5.0, max_value=1e4,
                                weight_factor=2.0, weight_floor=3.0, max_weight=1e3)
    assert bounds.limits(2.0, 4.0, 5) == Limits(value=20.0, weight=40.0)
    assert bounds.limits(0.1, 0.0, 5) == Limits(value=5.0, weight=3.0)  # the floors
    assert bounds.limits(1e9, 1e9, 5) == Limits(value=1e4, weight=1e3)  # the caps
    # our own input is broken (rejected anyway): nobody else is blamed for it
    assert bounds.limits(float("nan"), float("inf"), 5) == Limits(value=1e4, weight=3.0)
    d = ContributionBounds().limits(1.0, 16.0, 4)
    assert d.value >= 1e6 and d.weight >= 1e6
    assert d.value < 3e38 and d.weight < 1e30  # poisoned inputs (3e38, 1e30) are out


@pytest.mark.parametrize("field", ["value_factor", "value_floor", "max_value",
                                   "weight_factor", "weight_floor", "max_weight"])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_bounds_must_be_positive(field: str, bad: float) -> None:
    with pytest.raises(ValueError, match=f"ContributionBounds.{field} must be a positive"):
        ContributionBounds(**{field: bad})
