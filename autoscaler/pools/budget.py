"""How much on-demand capacity the spot fallback may use: ``OnDemandBudget``.

A cap in nodes and/or in USD per hour (on-demand prices per instance type), read from the
provider config's ``on_demand`` section (a missing section turns the fallback off).
``headroom(instance_type, in_use)`` says how many more on-demand nodes of a type fit beside
the ones in use; the selector (``selector.py``) skips an on-demand pool without room.
Pure: no cloud, no clock.
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class OnDemandBudget:
    """How much on-demand capacity the fallback may use (worker nodes only; the head is not
    counted). ``max_nodes=None`` / ``max_usd_per_hour=None`` mean no cap of that kind; the
    default, ``max_nodes=0``, turns on-demand fallback off. ``prices`` (instance type -> USD
    per hour, on-demand) is needed for every on-demand type when ``max_usd_per_hour`` is set."""

    max_nodes: int | None = 0
    max_usd_per_hour: float | None = None
    prices: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_nodes is not None and (
            not isinstance(self.max_nodes, int) or self.max_nodes < 0
        ):
            raise ValueError(f"on-demand max_nodes must be an int >= 0, got {self.max_nodes!r}")
        if self.max_usd_per_hour is not None and not (
            isinstance(self.max_usd_per_hour, (int, float))
            and math.isfinite(self.max_usd_per_hour)
            and self.max_usd_per_hour >= 0
        ):
            raise ValueError(
                f"on-demand max_usd_per_hour must be a number >= 0, got {self.max_usd_per_hour!r}"
            )
        for itype, price in dict(self.prices).items():
            if not (isinstance(price, (int, float)) and math.isfinite(price) and price > 0):
                raise ValueError(f"on-demand price of {itype!r} must be > 0, got {price!r}")
        object.__setattr__(self, "prices", types.MappingProxyType(dict(self.prices)))

    @classmethod
    def from_config(cls, entry: Mapping | None) -> OnDemandBudget:
        """From ``{max_nodes?, max_usd_per_hour?, prices?}``; a missing section means off."""
        if entry is None:
            return cls()
        if not isinstance(entry, Mapping):
            raise ValueError(f"on_demand must be a mapping, got {entry!r}")
        unknown = set(entry) - {"max_nodes", "max_usd_per_hour", "prices"}
        if unknown:
            raise ValueError(
                f"unknown on_demand field(s) {sorted(unknown)}; "
                "allowed: max_nodes, max_usd_per_hour, prices"
            )
        max_nodes = entry.get("max_nodes", None if "max_usd_per_hour" in entry else 0)
        return cls(
            max_nodes=max_nodes,
            max_usd_per_hour=entry.get("max_usd_per_hour"),
            prices=dict(entry.get("prices") or {}),
        )

    def headroom(self, instance_type: str, in_use: Sequence[str]) -> int:
        """How many more on-demand nodes of ``instance_type`` fit, given the instance types of
        the on-demand nodes in use (one entry per node)."""
        room = math.inf
        if self.max_nodes is not None:
            room = self.max_nodes - len(in_use)
        if self.max_usd_per_hour is not None:
            spent = sum(self.prices[t] for t in in_use if t in self.prices)
            # A tiny epsilon so that e.g. 3 x 0.1 fits a 0.3 budget despite float rounding.
            left = self.max_usd_per_hour - spent + 1e-9
            room = min(room, math.floor(left / self.prices[instance_type]))
        return int(max(0, room if room != math.inf else 1 << 30))
