"""DeDLOC load balancing: each peer's share of the reduction from what it measured.

Inside a group, part sizes are proportional to the members' shares (``partition``). A peer
that fetches or reduces slower than the others should own a smaller part, so the round does
not wait on it. Pure code, no Ray:

- ``ThroughputMeter`` (in each ``Averager``): after every group round it takes this peer's
  inbound bandwidth, the best rate of one fetch in that round (``peak_rate``: a fetch moves
  at most at the slower of the sender's and this peer's link, so the best one is the
  nearest to our own link; the union of all fetches' intervals would charge a fast peer
  for a slow sender's link), and the bytes it validated and added with the seconds that
  took (its reduction throughput). A part's cost per byte is the sum of both, so the
  peer's throughput is ``1 / (s/B fetched + s/B reduced)``, smoothed with an EMA over
  rounds. ``None`` until a round measured something. (A peer whose every fetch in a round
  came from slow senders under-reports that round; the EMA and the next groups mend it.)
- The replica sends the value with its heartbeat; ``Membership`` keeps the newest per peer.
- ``relative_shares`` turns the values of a plan's peers into shares: each in proportion to
  its throughput relative to the median of the measured ones (so a part costs every owner
  about the same time), capped at ``MAX_SHARE``; a peer below ``MIN_SHARE`` of the median
  (e.g. on a 10x slower link) gets 0: it still sends its contribution and fetches the
  results, but owns no part, so no part's reduction waits on its link. 1.0 for a peer
  without a measurement (and for everyone while fewer than two peers measured anything).
  Multiplied by the peer's declared ``PeerInfo.capacity``. A peer that owns nothing keeps
  measuring its inbound bandwidth from the results it fetches (where those travel inline
  it measures nothing and keeps its last value), so a healed link wins its share back.

Why zero rather than a small share: in a group of m members a member with share s moves
``s * (m - 1)`` of the tensor in (contributions to its part) plus ``2 * (1 - s)`` (its other
parts out, their results in), so for m > 3 its own traffic is smallest at s = 0 and the
round's time is set by the slowest owner's ``s * (m - 1) / bandwidth``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping

MIN_SHARE = 0.25  # below this fraction of the median throughput a peer owns no part
MAX_SHARE = 4.0
EMA_ALPHA = 0.3  # weight of the newest round in the smoothed throughput


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (overlaps counted once)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


# Fetches smaller than this are dominated by latency, not bandwidth: not rated.
MIN_RATED_BYTES = 64 * 1024


def peak_rate(fetches: Iterable[tuple[float, float, int]]) -> float | None:
    """Best bytes/s of one ``(start, end, bytes)`` fetch of at least ``MIN_RATED_BYTES``;
    None if there is none."""
    rates = [n / (end - start) for start, end, n in fetches
             if n >= MIN_RATED_BYTES and end > start]
    return max(rates) if rates else None


def round_throughput(fetched_bytes: int, fetch_busy_s: float, reduced_bytes: int,
                     reduce_s: float) -> float | None:
    """Bytes per second one peer moved a part through fetch plus reduction in one round;
    None if the round measured neither (e.g. a receiver, or a group of one)."""
    cost = 0.0
    if fetched_bytes > 0 and fetch_busy_s > 0:
        cost += fetch_busy_s / fetched_bytes
    if reduced_bytes > 0 and reduce_s > 0:
        cost += reduce_s / reduced_bytes
    return 1.0 / cost if cost > 0 else None


class ThroughputMeter:
    """EMA of ``round_throughput`` over the rounds that measured something."""

    def __init__(self, alpha: float = EMA_ALPHA):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.value: float | None = None

    def update(self, throughput: float | None) -> float | None:
        if throughput is not None and math.isfinite(throughput) and throughput > 0:
            self.value = throughput if self.value is None else (
                self.alpha * throughput + (1 - self.alpha) * self.value)
        return self.value


def relative_shares(throughputs: Mapping[str, float | None]) -> dict[str, float]:
    """Shares (see module docstring) of the peers in ``throughputs`` (peer -> bytes/s or
    None): ``t / median`` capped at ``MAX_SHARE``, 0.0 below ``MIN_SHARE``, 1.0 unmeasured.
    Pure; never raises for junk values (NaN, inf, <= 0 count as unmeasured)."""
    known = {p: v for p, v in throughputs.items()
             if v is not None and math.isfinite(v) and v > 0}
    if len(known) < 2:
        return {p: 1.0 for p in throughputs}
    ref = statistics.median(known.values())
    return {p: (_share(known[p] / ref) if p in known else 1.0) for p in throughputs}


def _share(relative: float) -> float:
    return 0.0 if relative < MIN_SHARE else min(relative, MAX_SHARE)
