"""Where to launch the next spot nodes: pool selection as a pure policy.

A *pool* is one place capacity comes from: a cloud, an instance (machine) type, a zone and a
market (spot or on-demand). Spot capacity runs out and comes back per pool, so the NodeProviders
(``aws_provider.py``, ``gcp_provider.py``) do not launch "an instance type": they ask a
:class:`PoolSelector` for an ordered list of pools, try the first, record what happened as a
:class:`PoolEvent`, and ask again. The selector reads only the plain data it is given (events
with timestamps, the current time, the on-demand nodes in use); it calls no cloud and reads no
clock, so every rule below is testable with plain data (``tests/test_pools.py``).

Rules:

* Spot pools come first, the most stable first: fewest preemptions within
  ``preemption_window_s``, then fewest capacity errors in that window, then the configured
  order (put the cheapest or most wanted pool first).
* A pool that just refused a launch (capacity, spot price or quota error) is skipped for a
  cool-down: ``capacity_cooldown_s`` after the first error, doubling with each further error
  in a row (no successful launch in between), capped at ``max_cooldown_s``.
* On-demand pools come after all spot pools and only within the :class:`OnDemandBudget`
  (nodes and/or USD per hour); a pool over budget is skipped with the reason.
* Back to spot: spot pools are always tried first again once their cool-down ends; and
  :meth:`PoolSelector.on_demand_to_release` names one on-demand node to give back when some
  spot pool has been free of trouble for ``spot_stable_s`` (at most one per ``spot_stable_s``,
  so a spot pool that fails again costs at most one node swap per period).

The pool *key* (:func:`encode_pool`) is the value of the ``moshray-pool`` tag/label
(:data:`moshray.autoscaler.tags.POOL_TAG`): valid as an AWS tag value and as a GCP label value
(lowercase letters, digits, ``-`` and ``_``, at most 63 characters), and reversible with
:func:`decode_pool`.
"""

from __future__ import annotations

import enum
import math
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

CLOUDS = ("aws", "gcp")
# Instance/machine types and zones: lowercase names with '.' and '-' inside.
# (AWS types carry a '.', e.g. "g4dn.xlarge"; GCP types and all zones use '-'.)
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$")
_KEY_SEP = "__"
LABEL_MAX = 63


class Market(str, enum.Enum):
    SPOT = "spot"
    ON_DEMAND = "on-demand"


@dataclass(frozen=True)
class Pool:
    """One source of capacity. ``subnet_id`` (AWS only) picks the subnet in ``zone``; it is
    launch detail, not identity, so it is not part of :attr:`key`."""

    cloud: str
    instance_type: str
    zone: str
    market: Market = Market.SPOT
    subnet_id: str | None = None

    def __post_init__(self) -> None:
        if self.cloud not in CLOUDS:
            raise ValueError(f"pool cloud must be one of {CLOUDS}, got {self.cloud!r}")
        for name, value in (("instance_type", self.instance_type), ("zone", self.zone)):
            if not isinstance(value, str) or not _NAME_RE.match(value) or ".." in value:
                raise ValueError(
                    f"pool {name} must be lowercase letters, digits, '.' and '-', got {value!r}"
                )
        try:
            object.__setattr__(self, "market", Market(self.market))
        except ValueError:
            raise ValueError(
                f"pool market must be 'spot' or 'on-demand', got {self.market!r}"
            ) from None
        key = encode_pool(self)
        if len(key) > LABEL_MAX:
            raise ValueError(f"pool key {key!r} is longer than {LABEL_MAX} characters")

    @property
    def key(self) -> str:
        return encode_pool(self)

    @property
    def is_spot(self) -> bool:
        return self.market is Market.SPOT

    def with_market(self, market: Market) -> Pool:
        return replace(self, market=Market(market))

    @classmethod
    def from_config(cls, cloud: str, entry: Mapping) -> Pool:
        """A pool from a provider-config entry: ``{instance_type|machine_type, zone,
        market?, subnet_id?}``. Raises ValueError saying which field to fix."""
        if not isinstance(entry, Mapping):
            raise ValueError(f"each pool must be a mapping, got {entry!r}")
        known = {"instance_type", "machine_type", "zone", "market", "subnet_id"}
        unknown = set(entry) - known
        if unknown:
            raise ValueError(f"unknown pool field(s) {sorted(unknown)}; allowed: {sorted(known)}")
        itype = entry.get("instance_type", entry.get("machine_type"))
        if itype is None or "zone" not in entry:
            raise ValueError(f"pool {dict(entry)} needs instance_type (or machine_type) and zone")
        return cls(
            cloud=cloud,
            instance_type=itype,
            zone=entry["zone"],
            market=entry.get("market", Market.SPOT),
            subnet_id=entry.get("subnet_id"),
        )


def encode_pool(pool: Pool) -> str:
    """``cloud__zone__type__market`` with the type's '.' as '_': e.g.
    ``aws__us-east-1a__g4dn_xlarge__spot``. No field holds '_', so the key is reversible."""
    return _KEY_SEP.join(
        (pool.cloud, pool.zone, pool.instance_type.replace(".", "_"), pool.market.value)
    )


def decode_pool(key: str) -> Pool:
    """Inverse of :func:`encode_pool` (``subnet_id`` is not in the key and comes back None)."""
    parts = key.split(_KEY_SEP)
    if len(parts) != 4:
        raise ValueError(f"not a pool key (cloud__zone__type__market): {key!r}")
    cloud, zone, itype, market = parts
    return Pool(cloud=cloud, instance_type=itype.replace("_", "."), zone=zone, market=market)


class EventKind(str, enum.Enum):
    LAUNCHED = "launched"  # a launch in the pool succeeded (ends a run of capacity errors)
    CAPACITY_ERROR = "capacity_error"  # no capacity, spot price too low, or a quota refused it
    PREEMPTED = "preempted"  # the cloud reclaimed a node of the pool
    RELEASED = "released"  # we gave an on-demand node of the pool back to move to spot


@dataclass(frozen=True)
class PoolEvent:
    """Something that happened in a pool at time ``at`` (the clock of Observations.now)."""

    pool: str  # Pool.key
    kind: EventKind
    at: float
    detail: str = ""  # e.g. the cloud's error code; for logs only


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
