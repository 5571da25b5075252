"""DeDLOC load balancing: each peer's share of the reduction from what it measured.

Inside a group, part sizes are proportional to the members' shares (``partition``). A peer
that fetches or reduces slower than the others should own a smaller part, so the round does
not wait on it. Pure code, no Ray:

- ``ThroughputMeter`` (in each ``Averager``): after every group round it takes the bytes
  this peer fetched and the time its fetches were in flight (the union of their intervals,
  so parallel fetches are not double counted: the peer's inbound bandwidth), and the bytes
  it validated and added with the seconds that took (its reduction throughput). A part's
  cost per byte is the sum of both, so the peer's throughput is ``1 / (s/B fetched + s/B
  reduced)``, smoothed with an EMA over rounds. ``None`` until a round measured something.
- The replica sends the value with its heartbeat; ``Membership`` keeps the newest per peer.
- ``relative_shares`` turns the values of a plan's peers into shares: each relative to the
  median of the measured ones, clamped to ``[MIN_SHARE, MAX_SHARE]``; 1.0 for a peer
  without a measurement (and for everyone while fewer than two peers measured anything).
  Multiplied by the peer's declared ``PeerInfo.capacity``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping

MIN_SHARE = 0.25
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
    None)."""
    known = {p: v for p, v in throughputs.items()
             if v is not None and math.isfinite(v) and v > 0}
    if len(known) < 2:
        return {p: 1.0 for p in throughputs}
    ref = statistics.median(known.values())
    return {p: (min(max(known[p] / ref, MIN_SHARE), MAX_SHARE) if p in known else 1.0)
            for p in throughputs}
