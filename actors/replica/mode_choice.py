"""``training.mode = "auto"``: choose collaborative steps or local SGD / DiLoCo from the
bandwidth the replicas measure, the bytes a global step moves and a step's compute time
(a pure decision; the job carries it out and prints ``ModeChoice.line``).

Collaborative steps (DeDLOC) exchange the fp16 gradient every global step; they cost
``exchange_s = 8 x wire_bytes / bandwidth_bit_s`` on top of ``compute_s``. When that is at
most ``SYNC_SHARE`` of the step (``exchange_s <= SYNC_SHARE / (1 - SYNC_SHARE) x
compute_s``) synchronous averaging is cheap and collaborative keeps DDP's sample
efficiency. Past it, local SGD with DiLoCo's outer Nesterov step amortises one exchange
over ``local_steps`` inner steps, chosen so the exchange costs at most ``AMORTISED_SHARE``
of the compute between two of them (between ``MIN_LOCAL_STEPS`` and ``MAX_LOCAL_STEPS``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SYNC_SHARE = 0.25  # collaborative while the exchange is at most a quarter of the step
AMORTISED_SHARE = 0.1  # local SGD: one exchange per local_steps costs at most a tenth
MIN_LOCAL_STEPS = 4
MAX_LOCAL_STEPS = 500  # DiLoCo's H


@dataclass(frozen=True)
class ModeChoice:
    """What ``choose_mode`` decided: the mode, ``local_steps`` (local SGD only, else None),
    the exchange's estimated seconds and its share of a synchronous step, and the reason."""

    mode: str
    local_steps: int | None
    exchange_s: float
    sync_share: float  # exchange_s / (exchange_s + compute_s)
    reason: str

    @property
    def line(self) -> str:
        """One line for the job's output: the choice and why."""
        steps = f" (local_steps={self.local_steps}, outer Nesterov)" if self.local_steps else ""
        return f"training.mode auto: {self.mode}{steps}: {self.reason}"


def choose_mode(bandwidth_bit_s: float, wire_bytes: float, compute_s: float) -> ModeChoice:
    """The mode for replicas that measured ``bandwidth_bit_s`` (the slowest replica's link),
    exchange ``wire_bytes`` per global step (fp16 gradients: 2 bytes per parameter) and
    compute one global step's share of the batch in ``compute_s`` seconds. Pure.
    ``ValueError`` (one line) for a non-positive or non-finite argument."""
    for what, value in (("bandwidth_bit_s", bandwidth_bit_s), ("wire_bytes", wire_bytes),
                        ("compute_s", compute_s)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    exchange_s = 8.0 * wire_bytes / bandwidth_bit_s
    share = exchange_s / (exchange_s + compute_s)
    figures = (f"an exchange of {wire_bytes / 1e6:.2f} MB at {bandwidth_bit_s / 1e6:.1f} "
               f"Mbit/s takes {exchange_s:.3f} s against {compute_s:.3f} s of compute "
               f"({share:.0%} of a synchronous step)")
    if share <= SYNC_SHARE:
        return ModeChoice("collaborative", None, exchange_s, share,
                          f"{figures}, at most {SYNC_SHARE:.0%}: links are fast enough")
    steps = math.ceil(exchange_s / (AMORTISED_SHARE * compute_s))
    steps = min(max(steps, MIN_LOCAL_STEPS), MAX_LOCAL_STEPS)
    return ModeChoice("local_sgd", steps, exchange_s, share,
                      f"{figures}, over {SYNC_SHARE:.0%}: synchronous averaging would be the "
                      f"bottleneck")
