"""What the metrics exporter reads besides events: node prices and the run's training state.

Contract: ``Prices`` (validated $/hour of a worker node on each market) turn node counts into
a cost per hour. ``TrainingState`` is what the Coordinator knows about the run at one
instant; ``training_state`` computes it, purely, from the Coordinator's step history. The
exporter (``metrics_exporter.py``) reads a ``TrainingState`` at scrape time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Prices", "RATE_WINDOW_S", "Rate", "TrainingState", "trailing_rate",
           "training_state"]

# The console's progress line and the training plot read the rate over this window: the
# same figure at the same instant (Prometheus' gauge takes a wider one, ``training_state``).
RATE_WINDOW_S = 10.0

# -- configuration and state ---------------------------------------------------------------


@dataclass(frozen=True)
class Prices:
    """The configured $/hour of one worker node on each market: the fallback for nodes whose
    price is not known otherwise (the controller prices each node from its labels first:
    the cloud's live spot price, then the shipped table; autoscaler/clouds/prices.py PriceBook).

    The defaults are an AWS g4dn.xlarge in us-east-1: its on-demand list price and an
    assumed spot price (metrics.spot_price_per_hour); set your own.
    """

    spot_per_hour: float = 0.16
    on_demand_per_hour: float = 0.526

    def __post_init__(self) -> None:
        for name in ("spot_per_hour", "on_demand_per_hour"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"prices.{name} must be a finite number >= 0, got {value!r}")

    def cost_per_hour(self, spot_nodes: int, on_demand_nodes: int) -> float:
        return spot_nodes * self.spot_per_hour + on_demand_nodes * self.on_demand_per_hour


@dataclass(frozen=True)
class TrainingState:
    """What the Coordinator knows about the run at one instant (read at scrape time)."""

    live_peers: int = 0
    draining_peers: int = 0
    global_step: int = 0
    samples_total: int = 0
    samples_per_s: float = 0.0
    loss: float | None = None
    preemptions: int = 0
    live_experts: int = 0


@dataclass(frozen=True)
class Rate:
    """Samples and global steps per second over a window (``trailing_rate``)."""

    samples_per_s: float
    steps_per_s: float


def trailing_rate(history: Sequence[tuple], at_s: float,
                  window_s: float = RATE_WINDOW_S) -> Rate:
    """Pure: the one definition of the training rate. What was committed in the window
    ending at ``at_s`` (``(at_s - span, at_s]``, span = ``min(window_s, at_s)``: near the
    start, the time since it), per second: samples and steps of the ``history`` rows
    ``(epoch, at_s, samples, ...)`` whose times fall in it. A window with no step is 0.0
    (the swarm committed nothing then); rows with times after ``at_s`` (a Coordinator that
    started over without its state kept an earlier clock's rows) are outside it. Raises
    ValueError for a window that is not positive."""
    if not window_s > 0:
        raise ValueError(f"window_s must be positive, got {window_s!r}")
    span = min(window_s, at_s)
    if not span > 0:
        return Rate(0.0, 0.0)
    samples = steps = 0
    for row in reversed(history):
        t = float(row[1])
        if t > at_s:
            continue
        if t <= at_s - span:
            break
        samples += int(row[2])
        steps += 1
    return Rate(samples / span, steps / span)


def training_state(
    history: Sequence[tuple],
    *,
    now_s: float,
    live: int,
    draining: int,
    epoch: int,
    preemptions: int = 0,
    live_experts: int = 0,
    window_s: float = 60.0,
) -> TrainingState:
    """Pure: a ``TrainingState`` from the Coordinator's step history.

    ``history`` rows are ``(epoch, at_s, samples, loss, peers)`` as in
    ``CoordinatorCore.stats()``, with ``at_s`` and ``now_s`` on the same clock (seconds since
    the Coordinator started). Samples per second is ``trailing_rate`` at ``now_s`` over
    ``window_s``.
    """
    samples_total = sum(int(row[2]) for row in history)
    loss = next((row[3] for row in reversed(history) if row[3] is not None), None)
    return TrainingState(
        live_peers=live,
        draining_peers=draining,
        global_step=epoch,
        samples_total=samples_total,
        samples_per_s=trailing_rate(history, now_s, window_s).samples_per_s,
        loss=loss,
        preemptions=preemptions,
        live_experts=live_experts,
    )
