"""Splitting a flat tensor into parts and reducing parts: pure numpy, no Ray.

Inside a group of m members, a flat float32 vector of ``numel`` values is split into m
contiguous parts; member j owns part j and computes its weighted average. Part sizes are
proportional to each member's share, so a peer with less CPU or bandwidth reduces less
(DeDLOC's load balancing). A contribution is accepted only within the step's ``Limits``
(``ContributionBounds``, ``check_contribution``, ``check_weights``) and averaged by
``WeightedMean``, value by value: a contribution's weight may differ between segments of
its values (``messages.SegmentWeights``: after a member died mid-round, the previous
round's parts hold different weights), and each value's mean is weighted by the weights
the contributions hold at that value.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moshray.cluster.collective.codecs import max_abs
from moshray.cluster.messages import PeerPlan, RejectReason, RoundPlan, SegmentWeights


def part_sizes(numel: int, shares: Sequence[float]) -> tuple[int, ...]:
    """Sizes of the parts, proportional to ``shares``, summing to ``numel``.

    Uses the largest-remainder method so the result is deterministic and exact. Shares
    that are zero, negative or non-finite count as zero; if none is positive the split is
    even. Raises ValueError for an empty ``shares`` or a negative ``numel``.
    """
    if not shares:
        raise ValueError("need at least one share")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    clean = [s if np.isfinite(s) and s > 0 else 0.0 for s in shares]
    top = max(clean)
    clean = [s / top for s in clean] if top > 0 else clean  # no overflow for huge shares
    total = sum(clean)
    if total <= 0:
        clean, total = [1.0] * len(shares), float(len(shares))
    exact = [numel * s / total for s in clean]
    sizes = [int(x) for x in exact]
    leftover = numel - sum(sizes)
    # Hand the remaining elements to the largest fractional parts (ties: lowest index).
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[:leftover]:
        sizes[i] += 1
    return tuple(sizes)


# Fewest values worth a part of its own: below this, one more owner costs more in messages
# (a put, a call and a fetch per member, each way) than it saves in bytes per owner.
MIN_PART = 1 << 18


def owner_shares(numel: int, shares: Sequence[float], min_part: int = MIN_PART,
                 rotate: int = 0) -> list[float]:
    """``shares`` with parts for at most ``max(1, numel // min_part)`` owners; the others
    get zero (they contribute and receive but own nothing). The owners are taken in turn:
    the members with a positive share, in index order starting at ``rotate`` modulo their
    count (callers pass the plan's epoch). Taking turns spreads the reducing work over the
    group across steps, and it keeps every member's contributions checked by others: a
    single owner checks only its own contribution, so a fixed owner sending NaN would be
    rejected by nobody else (cluster/coordinator/quarantine.py counts only others' rejections).
    Shares that are zero, negative or non-finite count as zero; if none is positive every
    member counts as 1. Deterministic, so every peer of a group derives the same sizes from
    the same plan and tensor length."""
    clean = [float(s) if np.isfinite(s) and s > 0 else 0.0 for s in shares]
    if not any(clean):
        clean = [1.0] * len(clean)
    owners = max(1, numel // max(1, min_part))
    positive = [i for i, s in enumerate(clean) if s > 0]
    if owners >= len(positive):
        return clean
    start = rotate % len(positive)
    keep = {positive[(start + k) % len(positive)] for k in range(owners)}
    return [s if i in keep else 0.0 for i, s in enumerate(clean)]


def group_part_sizes(plan: PeerPlan | RoundPlan, members: Sequence[str],
                     numel: int) -> tuple[int, ...]:
    """Each member's part of a ``numel``-value tensor in a group round of ``plan`` (a whole
    plan or a view of one of ``members``: they hold the same shares): sized by
    the members' shares, with the plan's ``min_part`` and the owners taking turns by epoch
    (``owner_shares``). Every peer of the group derives the same sizes."""
    shares = owner_shares(numel, [plan.share_of(m) for m in members], plan.min_part,
                          rotate=plan.epoch)
    return part_sizes(numel, shares)


def part_slices(sizes: Sequence[int]) -> tuple[slice, ...]:
    """Contiguous slices for parts of the given sizes."""
    out, start = [], 0
    for size in sizes:
        out.append(slice(start, start + size))
        start += size
    return tuple(out)


@dataclass(frozen=True)
class Limits:
    """What one step accepts from a contribution: ``|value| <= value`` for every value and
    ``weight <= weight`` (``ContributionBounds.limits``)."""

    value: float = math.inf
    weight: float = math.inf


UNBOUNDED = Limits()


@dataclass(frozen=True)
class ContributionBounds:
    """How a peer derives its step's ``Limits`` from what it holds (a finite but poisoned
    value such as 3e38, or a weight such as 1e30, must not reach the mean).

    - values: ``min(max_value, max(value_floor, value_factor * scale))``, ``scale`` being
      the largest magnitude of this peer's own input to the step (a non-finite scale, i.e.
      our own input is broken and rejected anyway: ``max_value``, so others are not blamed
      for it);
    - weights: ``min(max_weight, max(weight_floor, weight_factor * participants *
      weight))``, ``weight`` being this peer's own weight for the step (its samples): a
      group's total after any grid round is at most ``participants`` such weights.

    The defaults leave healthy data six orders of magnitude of room (a gradient element
    of 1e5 beside ones of 0.1 passes) while ``max_value * max_weight * group size`` stays
    far below float32's 3.4e38, so an accepted set of contributions cannot overflow the
    weighted sum. Raises ``ValueError`` for a bound that is not positive (inf allowed)."""

    value_factor: float = 1e6
    value_floor: float = 1e6
    max_value: float = 1e20
    weight_factor: float = 1e3
    weight_floor: float = 1e6
    max_weight: float = 1e12

    def __post_init__(self) -> None:
        for name in ("value_factor", "value_floor", "max_value", "weight_factor",
                     "weight_floor", "max_weight"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):  # NaN fails too
                raise ValueError(f"ContributionBounds.{name} must be a positive number "
                                 f"(inf allowed), got {v!r}")

    def limits(self, scale: float, weight: float, participants: int) -> Limits:
        """The step's ``Limits`` for a peer whose own input has largest magnitude ``scale``
        and weight ``weight``, in a plan of ``participants`` peers (see class docstring)."""
        if math.isfinite(scale):
            value = min(self.max_value, max(self.value_floor, self.value_factor * scale))
        else:
            value = self.max_value
        own = weight if math.isfinite(weight) and weight > 0 else 0.0
        wcap = min(self.max_weight,
                   max(self.weight_floor, self.weight_factor * max(participants, 1) * own))
        return Limits(value, wcap)


def _check_weight(weight: float, limits: Limits) -> tuple[RejectReason, str] | None:
    if not np.isfinite(weight) or weight < 0:
        return RejectReason.BAD_WEIGHT, f"weight {weight!r}"
    if weight > limits.weight:
        return (RejectReason.WEIGHT_OUT_OF_BOUNDS,
                f"weight {weight:.3g} above the step's bound {limits.weight:.3g}")
    return None


def check_weights(weights: SegmentWeights, numel: int,
                  limits: Limits = UNBOUNDED) -> tuple[RejectReason, str] | None:
    """Why a contribution's weights for a ``numel``-value tensor must be rejected, or None.

    ``BAD_WEIGHT``: not a well-formed ``SegmentWeights`` for ``numel`` values (its
    ``problem``), or a segment's weight non-finite or negative; ``WEIGHT_OUT_OF_BOUNDS``: a
    segment's weight above ``limits.weight``. One pass over the segments (few)."""
    if not isinstance(weights, SegmentWeights):
        return RejectReason.BAD_WEIGHT, f"weights of type {type(weights).__name__}"
    problem = weights.problem(numel)
    if problem is not None:
        return RejectReason.BAD_WEIGHT, problem
    for w in weights.weights:
        problem = _check_weight(w, limits)
        if problem is not None:
            return problem
    return None


def check_contribution(
    values: np.ndarray, expected_numel: int, expected_dtype: np.dtype,
    weight: float | SegmentWeights, limits: Limits = UNBOUNDED,
) -> tuple[RejectReason, str] | None:
    """Why a decoded part must be rejected, or None if it is acceptable.

    Checks, in order: the weight (finite, >= 0, then at most ``limits.weight``; with
    ``SegmentWeights``, every segment's, and the profile's shape: ``check_weights``), the
    dtype of the wire values, the length against the receiver's own layout, finiteness of
    every value, then every magnitude against ``limits.value``. The values are scanned
    once (``codecs.max_abs``, no temporary array).
    """
    if isinstance(weight, SegmentWeights):
        problem = check_weights(weight, expected_numel, limits)
    else:
        problem = _check_weight(weight, limits)
    if problem is not None:
        return problem
    if values.dtype != expected_dtype:
        return RejectReason.DTYPE_MISMATCH, f"got {values.dtype}, expected {expected_dtype}"
    if values.ndim != 1 or values.shape[0] != expected_numel:
        return (RejectReason.SHAPE_MISMATCH,
                f"got shape {values.shape}, expected ({expected_numel},)")
    m = max_abs(values)
    if not math.isfinite(m):
        return RejectReason.NON_FINITE, "NaN or inf in values"
    if m > limits.value:
        return (RejectReason.VALUE_OUT_OF_BOUNDS,
                f"|value| up to {m:.3g} above the step's bound {limits.value:.3g}")
    return None


class WeightedMean:
    """Streaming weighted mean of equally long float32 vectors, value by value.

    Each vector comes with its weights (``SegmentWeights``, or one float for all its
    values). ``result`` returns, at every value c, ``sum_k w_k(c) x_k(c) / sum_k w_k(c)``
    over the vectors added (the plain mean over all of them where every weight at c is
    zero), and the total weight at every value (``SegmentWeights``). Every operation is
    one correctly rounded float32 step (``fl(w * x)``, then ``fl(acc + that)``, then
    ``fl(acc / sum(w))``), so equal inputs added in equal order give equal bits on any
    machine; with one weight per vector (no failure upstream) these are exactly the steps
    of a mean with one scalar weight each.

    The all-reduce splits ``add`` in two: ``term`` (the scaled contribution, computed in a
    worker thread as soon as the bytes arrive, in place in a buffer it owns) and
    ``add_term`` (one float32 add, when the contribution's turn in member order comes).
    The mean keeps the running total weight as pieces (the union of the segments added,
    equal neighbours merged): a few numpy calls per piece, not per value.
    """

    def __init__(self, numel: int):
        self.numel = numel
        # sum of w * x where the piece's total is > 0, else the plain sum of the values
        # (adopts the first term's buffer)
        self._acc: np.ndarray | None = None
        self._cuts: tuple[int, ...] = ()  # where piece 1, 2, ... start
        self._totals: tuple[float, ...] = (0.0,)  # per piece: the sum of its weights
        self.count = 0

    @staticmethod
    def _profile(weights: float | SegmentWeights) -> SegmentWeights:
        if isinstance(weights, SegmentWeights):
            return weights
        return SegmentWeights.uniform(weights)

    @staticmethod
    def term(values: np.ndarray, weights: float | SegmentWeights,
             owned: bool = False) -> np.ndarray:
        """What ``values`` adds to the mean: ``float32(w) * values`` in float32 on each
        segment of weight w (the values as float32 where w is zero). ``owned``: ``values``
        is a float32 buffer nobody else holds, scaled in place (no allocation). ``weights``
        must be well formed for ``values.size`` (``check_weights``)."""
        profile = WeightedMean._profile(weights)
        in_place = owned and values.dtype == np.float32 and values.flags.writeable
        if len(profile.weights) == 1:
            weight = profile.weights[0]
            if in_place:
                if weight > 0:
                    np.multiply(values, np.float32(weight), out=values)
                return values
            if weight > 0:
                return np.multiply(values, np.float32(weight), dtype=np.float32)
            return values.astype(np.float32)
        out = values if in_place else np.empty(values.size, dtype=np.float32)
        for start, stop, weight in profile.segments(values.size):
            if weight > 0:
                np.multiply(values[start:stop], np.float32(weight), out=out[start:stop],
                            dtype=np.float32)
            elif out is not values:
                out[start:stop] = values[start:stop]
        return out

    def add_term(self, term: np.ndarray, weights: float | SegmentWeights) -> None:
        """Add a ``term(values, weights)``; the mean takes over its buffer."""
        profile = self._profile(weights)
        self.count += 1
        if self._acc is None:
            self._acc = term
            self._cuts = profile.cuts
            self._totals = tuple(float(w) if w > 0 else 0.0 for w in profile.weights)
            return
        cuts = tuple(sorted(set(self._cuts) | set(profile.cuts)))
        totals: list[float] = []
        for start, stop, _ in SegmentWeights((0.0,) * (len(cuts) + 1), cuts).segments(
                self.numel):
            total = self._totals[bisect.bisect_right(self._cuts, start)]
            weight = profile.weights[bisect.bisect_right(profile.cuts, start)]
            if weight > 0:
                if total == 0:  # only zero weights so far: their plain sum gives way
                    self._acc[start:stop] = term[start:stop]
                else:
                    np.add(self._acc[start:stop], term[start:stop],
                           out=self._acc[start:stop])
                total += float(weight)
            elif total == 0:  # kept only in case every weight here stays zero
                np.add(self._acc[start:stop], term[start:stop], out=self._acc[start:stop])
            totals.append(total)
        merged = SegmentWeights.merged(totals, cuts)
        self._cuts, self._totals = merged.cuts, merged.weights

    def add(self, values: np.ndarray, weights: float | SegmentWeights) -> None:
        self.add_term(self.term(values, weights), weights)

    def result(self) -> tuple[np.ndarray, SegmentWeights]:
        """The mean and the total weight at every value, computed in place: the mean is
        used up (call once). Raises ValueError if nothing was added."""
        if self.count == 0:
            raise ValueError("no contribution to average")
        acc = self._acc
        totals = SegmentWeights(self._totals, self._cuts)
        for start, stop, total in totals.segments(self.numel):
            divisor = np.float32(total) if total > 0 else np.float32(self.count)
            np.divide(acc[start:stop], divisor, out=acc[start:stop])
        return acc, totals
