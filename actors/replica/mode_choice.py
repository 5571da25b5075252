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

The outer Nesterov step follows ``local_steps`` (``outer_step``): DiLoCo's lr 0.7 / momentum
0.9 were tuned with H = 500 inner steps (8 replicas); at H = 16 they overshoot, and a sweep
on this project's short LM (2 replicas, 50 outer rounds, docs/performance.md "Time to a loss
over slow links") found lr 0.4 / momentum 0.7 best (mean loss of the last 8 steps 2.09
against 2.43; effective outer step lr / (1 - momentum) 1.3 against 7). Below
``GENTLE_BELOW_STEPS`` auto takes the gentler step, from it on DiLoCo's. Between H = 16 and
H = 500 nothing was measured: the threshold is their geometric middle (sqrt(16 x 500) = 89),
rounded to 100. ``resolve_training`` applies a choice to a training section and sets the
outer step only where the user left both at the section's defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

SYNC_SHARE = 0.25  # collaborative while the exchange is at most a quarter of the step
AMORTISED_SHARE = 0.1  # local SGD: one exchange per local_steps costs at most a tenth
MIN_LOCAL_STEPS = 4
MAX_LOCAL_STEPS = 500  # DiLoCo's H
DILOCO_OUTER = (0.7, 0.9)  # DiLoCo's outer (lr, momentum), tuned at H = 500
GENTLE_OUTER = (0.4, 0.7)  # the sweep's best at H = 16 (module docstring)
GENTLE_BELOW_STEPS = 100  # local_steps below this take GENTLE_OUTER


def outer_step(local_steps: int) -> tuple[float, float]:
    """The outer Nesterov ``(lr, momentum)`` for ``local_steps`` inner steps per exchange:
    ``GENTLE_OUTER`` below ``GENTLE_BELOW_STEPS``, else ``DILOCO_OUTER``. Pure."""
    return GENTLE_OUTER if local_steps < GENTLE_BELOW_STEPS else DILOCO_OUTER


@dataclass(frozen=True)
class ModeChoice:
    """What ``choose_mode`` decided: the mode, ``local_steps`` and the outer Nesterov step
    (``outer_lr``, ``outer_momentum``; local SGD only, else None), the exchange's estimated
    seconds and its share of a synchronous step, and the reason."""

    mode: str
    local_steps: int | None
    exchange_s: float
    sync_share: float  # exchange_s / (exchange_s + compute_s)
    reason: str
    outer_lr: float | None = None
    outer_momentum: float | None = None

    @property
    def line(self) -> str:
        """One line for the job's output: the choice and why."""
        steps = (f" (local_steps={self.local_steps}, outer Nesterov lr {self.outer_lr} "
                 f"momentum {self.outer_momentum})" if self.local_steps else "")
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
    lr, momentum = outer_step(steps)
    return ModeChoice("local_sgd", steps, exchange_s, share,
                      f"{figures}, over {SYNC_SHARE:.0%}: synchronous averaging would be the "
                      f"bottleneck", lr, momentum)


def resolve_training(training, choice: ModeChoice):
    """``training`` (a frozen ``TrainingSection`` dataclass) with ``choice`` applied: the
    mode; for local SGD also ``local_steps``, ``outer_optimizer = "nesterov"`` and the
    choice's outer lr and momentum, the last two only if both still hold the section's
    defaults (a user's own outer step is kept: an explicit value equal to the default reads
    as the default). Pure (``dataclasses.replace``)."""
    if choice.mode != "local_sgd":
        return replace(training, mode=choice.mode)
    changes = dict(mode="local_sgd", local_steps=choice.local_steps, outer_optimizer="nesterov")
    defaults = {f.name: f.default for f in fields(training)}
    if (choice.outer_lr is not None and training.outer_lr == defaults.get("outer_lr")
            and training.outer_momentum == defaults.get("outer_momentum")):
        changes.update(outer_lr=choice.outer_lr, outer_momentum=choice.outer_momentum)
    return replace(training, **changes)
