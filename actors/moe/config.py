"""MoEConfig: one DMoE layer's uid prefix, expert grid and routing/waiting rule.

Contract: a frozen dataclass that validates on construction and raises ``ValueError`` naming
the bad field; ``beam`` is the beam width the layer's beam search keeps (pure, no torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moshray.cluster.coordinator.expert_registry import grid_uids

__all__ = ["MoEConfig"]


@dataclass(frozen=True)
class MoEConfig:
    """One DMoE layer: its uid prefix ``layer``, its ``grid`` and the routing rule.

    ``beam_size`` (default ``k``) is the beam width kept at intermediate grid dimensions.
    Raises ``ValueError`` naming the field.
    """

    layer: str
    grid: tuple[int, ...]
    d_model: int
    k: int = 4
    k_min: int = 1
    beam_size: int = 0  # 0 = k
    forward_timeout_s: float = 10.0
    backward_timeout_s: float = 10.0
    timeout_after_k_min_s: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", tuple(self.grid))
        grid_uids(self.layer, self.grid)  # validates layer and grid
        for name in ("d_model", "k", "k_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoEConfig.{name}: must be a positive integer, got {value!r}")
        if self.k_min > self.k:
            raise ValueError(f"MoEConfig.k_min: must be <= k ({self.k}), got {self.k_min}")
        if self.k > math.prod(self.grid):
            raise ValueError(f"MoEConfig.k: must be <= the number of experts "
                             f"({math.prod(self.grid)}), got {self.k}")
        if not isinstance(self.beam_size, int) or self.beam_size < 0:
            raise ValueError(f"MoEConfig.beam_size: must be >= 0, got {self.beam_size!r}")
        for name in ("forward_timeout_s", "backward_timeout_s", "timeout_after_k_min_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"MoEConfig.{name}: must be a number >= 0, got {value!r}")

    @property
    def beam(self) -> int:
        return max(self.beam_size or self.k, self.k)
