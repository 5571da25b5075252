"""The pool policy: ``PoolSelector`` orders the pools to try for a launch.

Given the plain data it is asked about (``Observations``: the time now, recent
``PoolEvent``s, the on-demand nodes in use), ``decide`` returns a ``LaunchPlan``: spot pools
first, the most stable first, then on-demand pools within the ``OnDemandBudget``, with the
pools left out and why (``Skipped``: cooling down after a refused launch, or over budget);
``on_demand_to_release`` names an on-demand node to give back once spot is stable again.
The time constants are a ``SelectorConfig``. Pure: it calls no cloud and reads no clock;
the rules are listed in ``pools.py`` and tested in ``tests/test_pools.py``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from moshray.autoscaler.pools.budget import OnDemandBudget
from moshray.autoscaler.pools.records import EventKind, Market, Pool, PoolEvent


@dataclass(frozen=True)
class SelectorConfig:
    """Time constants of the policy, in seconds."""

    capacity_cooldown_s: float = 300.0
    max_cooldown_s: float = 3600.0
    preemption_window_s: float = 3600.0
    spot_stable_s: float = 900.0

    def __post_init__(self) -> None:
        for name in ("capacity_cooldown_s", "max_cooldown_s", "preemption_window_s",
                     "spot_stable_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.max_cooldown_s < self.capacity_cooldown_s:
            raise ValueError("max_cooldown_s must be >= capacity_cooldown_s")

    @property
    def horizon_s(self) -> float:
        """Events older than this never change a decision (a history may drop them)."""
        return max(self.max_cooldown_s, self.preemption_window_s, self.spot_stable_s)


@dataclass(frozen=True)
class Observations:
    """What the policy knows: the time now, recent pool events (any order; older than
    ``SelectorConfig.horizon_s`` may be dropped) and the instance types of the on-demand
    worker nodes in use now (one entry per node)."""

    now: float
    events: tuple[PoolEvent, ...] = ()
    on_demand_in_use: tuple[str, ...] = ()


@dataclass(frozen=True)
class PoolStats:
    """One pool's recent record, derived from Observations."""

    preemptions: int  # within preemption_window_s
    capacity_errors: int  # within preemption_window_s
    errors_in_a_row: int  # capacity errors since the last successful launch
    cooldown_until: float | None  # skipped until then (None: not cooling down)
    last_trouble_at: float | None  # latest preemption or capacity error, any age


class SkipReason(str, enum.Enum):
    COOLING_DOWN = "cooling_down"  # refused a launch recently
    OVER_BUDGET = "over_budget"  # on-demand, and the budget has no room for it


@dataclass(frozen=True)
class Candidate:
    """Try ``pool`` for at most ``max_count`` nodes."""

    pool: Pool
    max_count: int
    preemptions: int = 0


@dataclass(frozen=True)
class Skipped:
    pool: Pool
    reason: SkipReason
    until: float | None = None  # when a cool-down ends


@dataclass(frozen=True)
class LaunchPlan:
    """Pools to try, in order (spot first), and the pools left out with the reason."""

    candidates: tuple[Candidate, ...]
    skipped: tuple[Skipped, ...] = ()

    @property
    def first(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None


@dataclass(frozen=True)
class RunningNode:
    """An on-demand worker node in use, for :meth:`PoolSelector.on_demand_to_release`."""

    node_id: str
    pool: str  # Pool.key
    launched_at: float


class PoolSelector:
    """Orders pools for a launch. Pure: every method is a function of its arguments and the
    pools/budget/config given at construction.

    ``pools`` lists the spot pools in order of preference; on-demand pools may be listed too
    (market ``on-demand``). Without any, the on-demand fallback uses the on-demand counterpart
    of each spot pool, in the same order. All pools belong to one cloud.
    """

    def __init__(
        self,
        pools: Sequence[Pool],
        budget: OnDemandBudget | None = None,
        config: SelectorConfig | None = None,
    ) -> None:
        pools = tuple(pools)
        if not pools:
            raise ValueError("at least one pool is needed")
        if len({p.cloud for p in pools}) != 1:
            raise ValueError("all pools of one provider must be in the same cloud")
        keys = [p.key for p in pools]
        if len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"duplicate pools: {dup}")
        self.budget = budget if budget is not None else OnDemandBudget()
        self.config = config if config is not None else SelectorConfig()
        self.spot_pools = tuple(p for p in pools if p.is_spot)
        explicit = tuple(p for p in pools if not p.is_spot)
        self.on_demand_pools = explicit or tuple(
            p.with_market(Market.ON_DEMAND) for p in self.spot_pools
        )
        if self.budget.max_usd_per_hour is not None:
            missing = sorted(
                {p.instance_type for p in self.on_demand_pools} - set(self.budget.prices)
            )
            if missing:
                raise ValueError(
                    f"on_demand.max_usd_per_hour is set but prices lack {missing}; "
                    "add them under on_demand.prices"
                )
        self._order = {p.key: i for i, p in enumerate(self.spot_pools + self.on_demand_pools)}

    @property
    def pools(self) -> tuple[Pool, ...]:
        return self.spot_pools + self.on_demand_pools

    def stats(self, obs: Observations) -> dict[str, PoolStats]:
        """Each known pool's record at ``obs.now`` (events of unknown pools are ignored)."""
        cfg = self.config
        by_pool: dict[str, list[PoolEvent]] = {p.key: [] for p in self.pools}
        for event in obs.events:
            if event.pool in by_pool and event.at <= obs.now:
                by_pool[event.pool].append(event)
        out = {}
        for key, events in by_pool.items():
            events.sort(key=lambda e: e.at)
            recent = [e for e in events if obs.now - e.at <= cfg.preemption_window_s]
            in_a_row = 0
            last_error_at = None
            for e in events:
                if e.kind is EventKind.LAUNCHED:
                    in_a_row = 0
                elif e.kind is EventKind.CAPACITY_ERROR:
                    in_a_row += 1
                    last_error_at = e.at
            cooldown_until = None
            if in_a_row and last_error_at is not None:
                span = min(cfg.capacity_cooldown_s * 2 ** (in_a_row - 1), cfg.max_cooldown_s)
                if obs.now < last_error_at + span:
                    cooldown_until = last_error_at + span
            trouble = [e.at for e in events
                       if e.kind in (EventKind.PREEMPTED, EventKind.CAPACITY_ERROR)]
            out[key] = PoolStats(
                preemptions=sum(e.kind is EventKind.PREEMPTED for e in recent),
                capacity_errors=sum(e.kind is EventKind.CAPACITY_ERROR for e in recent),
                errors_in_a_row=in_a_row,
                cooldown_until=cooldown_until,
                last_trouble_at=max(trouble) if trouble else None,
            )
        return out

    def decide(self, obs: Observations, count: int) -> LaunchPlan:
        """The pools to try for ``count`` nodes now, in order. An empty ``candidates`` means
        nothing may be launched now (all cooling down / over budget; see ``skipped``)."""
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an int >= 1, got {count!r}")
        stats = self.stats(obs)
        skipped: list[Skipped] = []
        spot: list[Candidate] = []
        for pool in self.spot_pools:
            s = stats[pool.key]
            if s.cooldown_until is not None:
                skipped.append(Skipped(pool, SkipReason.COOLING_DOWN, s.cooldown_until))
            else:
                spot.append(Candidate(pool, count, s.preemptions))
        spot.sort(key=lambda c: (stats[c.pool.key].preemptions,
                                 stats[c.pool.key].capacity_errors,
                                 self._order[c.pool.key]))
        on_demand: list[Candidate] = []
        for pool in self.on_demand_pools:
            s = stats[pool.key]
            if s.cooldown_until is not None:
                skipped.append(Skipped(pool, SkipReason.COOLING_DOWN, s.cooldown_until))
                continue
            room = self.budget.headroom(pool.instance_type, obs.on_demand_in_use)
            if room < 1:
                skipped.append(Skipped(pool, SkipReason.OVER_BUDGET))
            else:
                on_demand.append(Candidate(pool, min(count, room), s.preemptions))
        return LaunchPlan(tuple(spot + on_demand), tuple(skipped))

    def spot_is_back(self, obs: Observations) -> bool:
        """Some spot pool is out of cool-down and had no preemption or capacity error within
        ``spot_stable_s``."""
        stats = self.stats(obs)
        for pool in self.spot_pools:
            s = stats[pool.key]
            if s.cooldown_until is None and (
                s.last_trouble_at is None
                or obs.now - s.last_trouble_at >= self.config.spot_stable_s
            ):
                return True
        return False

    def on_demand_to_release(
        self, obs: Observations, on_demand_nodes: Sequence[RunningNode]
    ) -> tuple[str, ...]:
        """At most one on-demand node to give back so that its replacement goes to spot:
        the longest-running one, when spot is back (:meth:`spot_is_back`) and no node was
        released within ``spot_stable_s``. Empty tuple: keep them all."""
        if not on_demand_nodes or not self.spot_is_back(obs):
            return ()
        released = [e.at for e in obs.events
                    if e.kind is EventKind.RELEASED and e.at <= obs.now]
        if released and obs.now - max(released) < self.config.spot_stable_s:
            return ()
        oldest = min(on_demand_nodes, key=lambda n: (n.launched_at, n.node_id))
        return (oldest.node_id,)
