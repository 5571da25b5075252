"""Spot prices: per pool for the NodeProviders, per node for the controller's cost metrics.

Per pool (``SpotPrices``, the NodeProviders' ``moshray_provider_spot_price_dollars``): AWS
publishes spot prices per instance type and availability zone (EC2
``DescribeSpotPriceHistory``, ``clouds/aws/prices.py``); the AWS provider passes a fetch
function that asks for the pools' types and zones from *now* on, which EC2 answers with the
price in effect now (plus any change since). A fetch returns records in EC2's shape;
:func:`newest_prices` keeps the newest record per (type, zone). GCP has no
such API for Spot VMs (prices are in the Cloud Billing catalog, per region and SKU), so the
GCP provider uses the configured prices only.

YAML (under ``provider:``)::

    spot_prices: {g4dn.xlarge: 0.2158, g5.xlarge: 0.4}   # USD per hour, per instance type
    spot_price_ttl_s: 300                                # how long a fetched price is used

A pool's price is the API's for its (type, zone) when there is one, else the configured price
of its type, else it has none (its gauge is not set). A failed fetch keeps the prices of the
last good one and is tried again after the TTL; the error goes back to the caller (the
provider collects it). On-demand pools are not priced here (``on_demand.prices`` holds those).

Per node (``PriceBook``, below): the controller prices each live worker from its labels
(node_labels.py) with :func:`choose_price`: the live spot price of its cloud where the
cloud's bundle reads one (``Cloud.spot_price_fetch``: EC2's, "provider"), else the
shipped table ``price_table.json`` ("table": GCE prices and AWS on-demand list prices, with
their date and source pages), else the job's ``metrics.*_price_per_hour`` ("config").
"""

from __future__ import annotations

import datetime as dt
import enum
import importlib.resources
import json
import logging
import math
import threading
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moshray.autoscaler.pools import Market, Pool

log = logging.getLogger(__name__)

# (instance types, zones) -> EC2 SpotPriceHistory records
# ({InstanceType, AvailabilityZone, SpotPrice: str, Timestamp: datetime, ...}).
Fetch = Callable[[tuple[str, ...], tuple[str, ...]], Iterable[Mapping[str, Any]]]


@dataclass(frozen=True)
class PriceConfig:
    """Configured spot prices (instance type -> USD per hour) and the cache TTL."""

    spot_prices: Mapping[str, float] = field(default_factory=dict)
    ttl_s: float = 300.0

    def __post_init__(self) -> None:
        for itype, price in dict(self.spot_prices).items():
            if isinstance(price, bool) or not isinstance(price, (int, float)) \
                    or not math.isfinite(price) or price <= 0:
                raise ValueError(f"provider.spot_prices.{itype} must be a number > 0, "
                                 f"got {price!r}")
        if isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, (int, float)) \
                or not self.ttl_s >= 0:
            raise ValueError(f"provider.spot_price_ttl_s must be a number >= 0, got {self.ttl_s!r}")
        object.__setattr__(self, "spot_prices", types.MappingProxyType(dict(self.spot_prices)))

    @classmethod
    def from_provider_config(cls, cfg: Mapping[str, Any]) -> PriceConfig:
        prices = cfg.get("spot_prices") or {}
        if not isinstance(prices, Mapping):
            raise ValueError(f"provider.spot_prices must be a mapping of instance type to USD "
                             f"per hour, got {prices!r}")
        return cls(dict(prices), cfg.get("spot_price_ttl_s", 300.0))


def _timestamp(value: Any) -> float:
    if isinstance(value, dt.datetime):
        return value.timestamp()
    if isinstance(value, str):
        text = value.replace("Z", "+00:00")
        # EC2 may send nanoseconds; Python parses at most microseconds.
        head, dot, rest = text.partition(".")
        if dot:
            digits = "".join(ch for ch in rest if ch.isdigit())
            text = f"{head}.{digits[:6]}{rest[len(digits):]}"
        return dt.datetime.fromisoformat(text).timestamp()
    return 0.0


def newest_prices(history: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], float]:
    """(instance type, zone) -> the ``SpotPrice`` of the newest record for it. Pure; records
    without a parseable positive price are skipped."""
    best: dict[tuple[str, str], tuple[float, float]] = {}
    for record in history:
        try:
            key = (record["InstanceType"], record["AvailabilityZone"])
            price = float(record["SpotPrice"])
        except (KeyError, TypeError, ValueError):
            continue
        if not (math.isfinite(price) and price > 0):
            continue
        at = _timestamp(record.get("Timestamp"))
        if key not in best or at > best[key][0]:
            best[key] = (at, price)
    return {key: price for key, (_, price) in best.items()}


class SpotPrices:
    """Spot price per pool, refreshed from ``fetch`` at most once per TTL (thread-safe).

    ``fetch=None``: configured prices only. ``clock`` is injectable (seconds).
    """

    def __init__(self, config: PriceConfig, fetch: Fetch | None,
                 clock: Callable[[], float]) -> None:
        self.config = config
        self._fetch = fetch
        self._clock = clock
        self._api: dict[tuple[str, str], float] = {}
        self._fetched_at: float | None = None
        self._fetched_for: frozenset[tuple[str, str]] = frozenset()
        self._lock = threading.Lock()

    def _stale(self, wanted: frozenset[tuple[str, str]], now: float) -> bool:
        return (self._fetched_at is None or now - self._fetched_at >= self.config.ttl_s
                or not wanted <= self._fetched_for)

    def current(self, pools: Sequence[Pool]) -> tuple[dict[str, float], Exception | None]:
        """(pool key -> USD per hour for each priced spot pool, the fetch error or None)."""
        spot = [p for p in pools if p.is_spot]
        wanted = frozenset((p.instance_type, p.zone) for p in spot)
        failure: Exception | None = None
        with self._lock:
            now = self._clock()
            if self._fetch is not None and spot and self._stale(wanted, now):
                self._fetched_at = now  # a failure is retried after the TTL, not every loop
                self._fetched_for = wanted
                itypes = tuple(sorted({t for t, _ in wanted}))
                zones = tuple(sorted({z for _, z in wanted}))
                try:
                    self._api.update(newest_prices(self._fetch(itypes, zones)))
                except Exception as exc:  # noqa: BLE001 - returned; the caller collects it
                    failure = exc
            api = dict(self._api)
        out = {}
        for pool in spot:
            price = api.get((pool.instance_type, pool.zone),
                            self.config.spot_prices.get(pool.instance_type))
            if price is not None:
                out[pool.key] = float(price)
        return out, failure


# -- what each node of the cluster costs (the controller's cost metrics) --------------------
#
# The controller prices every live worker node from its labels (node_labels.py): its cloud,
# market, instance type and zone. ``choose_price`` decides, purely, between what is known:
# the cloud's live spot price ("provider": EC2's spot price history), the shipped table
# (price_table.json: GCE spot and on-demand prices and AWS on-demand list prices, with the
# date and the pages they came from) and the configured price ("config": metrics.
# spot_price_per_hour / on_demand_price_per_hour), which is used only when neither knows
# the node. ``PriceBook`` holds the cache and the fetches.

PRICE_TABLE = "price_table.json"  # package data of moshray.autoscaler


class PriceSource(str, enum.Enum):
    PROVIDER = "provider"  # the cloud's live price (EC2 spot price history)
    TABLE = "table"  # price_table.json
    CONFIG = "config"  # metrics.*_price_per_hour: no price known for the node


@dataclass(frozen=True)
class NodePrice:
    """USD per hour of one node, and where the figure came from."""

    dollars_per_hour: float
    source: PriceSource


@dataclass(frozen=True)
class NodeKey:
    """What prices a node: its labels' cloud, market (spot / on-demand), type and zone.
    Empty strings where a label is missing (such a node gets the configured price)."""

    cloud: str = ""
    market: str = Market.SPOT.value
    instance_type: str = ""
    zone: str = ""

    @property
    def region(self) -> str:
        """The zone's region, as the node's cloud names it (``Cloud.region``: us-east-1a ->
        us-east-1 on AWS, us-central1-a -> us-central1 on GCP); "" if unknown."""
        from moshray.autoscaler.clouds.base import cloud_names, get_cloud

        if self.cloud not in cloud_names():
            return ""
        return get_cloud(self.cloud).region(self.zone)

    def pool(self) -> Pool | None:
        """The pool this node came from, or None if its labels do not name a valid one."""
        try:
            return Pool(self.cloud, self.instance_type, self.zone, Market(self.market))
        except ValueError:
            return None


def choose_price(provider: float | None, table: float | None, config: float) -> NodePrice:
    """The price to count a node at: the provider's if known, else the table's, else the
    configured one (pure)."""
    if provider is not None:
        return NodePrice(float(provider), PriceSource.PROVIDER)
    if table is not None:
        return NodePrice(float(table), PriceSource.TABLE)
    return NodePrice(float(config), PriceSource.CONFIG)


@dataclass(frozen=True)
class PriceTable:
    """Shipped prices: (cloud, region, instance type, market) -> USD per hour, with the date
    the figures are from (``as_of``) and the pages they came from (``sources``)."""

    as_of: str
    sources: Mapping[str, str]
    prices: Mapping[tuple[str, str, str, str], float]

    def price(self, key: NodeKey) -> float | None:
        return self.prices.get((key.cloud, key.region, key.instance_type, key.market))

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], where: str = PRICE_TABLE) -> PriceTable:
        """Raises ValueError naming the field to fix."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("as_of"), str) \
                or not isinstance(doc.get("sources"), Mapping) \
                or not isinstance(doc.get("prices"), Mapping):
            raise ValueError(f"{where} needs as_of (a date), sources and prices")
        prices = {}
        for cloud, regions in doc["prices"].items():
            for region, itypes in dict(regions).items():
                for itype, markets in dict(itypes).items():
                    for market, price in dict(markets).items():
                        path = f"{where}: prices.{cloud}.{region}.{itype}.{market}"
                        if market not in (Market.SPOT.value, Market.ON_DEMAND.value):
                            raise ValueError(f"{path}: market must be spot or on-demand")
                        if isinstance(price, bool) or not isinstance(price, (int, float)) \
                                or not math.isfinite(price) or price <= 0:
                            raise ValueError(f"{path} must be a number > 0, got {price!r}")
                        prices[(cloud, region, itype, market)] = float(price)
        return cls(doc["as_of"], types.MappingProxyType(dict(doc["sources"])),
                   types.MappingProxyType(prices))

    @classmethod
    def shipped(cls) -> PriceTable:
        """The table shipped in the package (price_table.json)."""
        text = importlib.resources.files("moshray.autoscaler").joinpath(PRICE_TABLE) \
            .read_text(encoding="utf-8")
        return cls.from_json(json.loads(text))


class PriceBook:
    """Prices of the cluster's nodes for the controller's cost metrics (thread-safe).

    ``fallback``: the configured USD per hour per market (``spot`` / ``on-demand``);
    ``fetches``: per cloud, the live spot price reader (``Cloud.spot_price_fetch``; AWS's
    is ``clouds/aws/prices.ec2_fetch``);
    ``table``: the shipped prices (None: no table). Live prices are fetched at most once per
    ``ttl_s`` on ``clock`` (and at once for a (type, zone) not fetched yet), so pricing every
    tick costs a dict lookup. Failure behaviour: a failed fetch is logged once per error kind
    and the node is priced from the last good fetch, the table or the config, never raised;
    a node priced from the config though its type is known is logged once.
    """

    def __init__(self, fallback: Mapping[str, float], fetches: Mapping[str, Fetch],
                 table: PriceTable | None, clock: Callable[[], float], ttl_s: float = 300.0):
        for market in (Market.SPOT.value, Market.ON_DEMAND.value):
            price = fallback.get(market)
            if isinstance(price, bool) or not isinstance(price, (int, float)) \
                    or not math.isfinite(price) or price < 0:
                raise ValueError(f"fallback price for {market} must be a number >= 0, "
                                 f"got {price!r}")
        self.fallback = dict(fallback)
        self.table = table
        self._spot = {cloud: SpotPrices(PriceConfig({}, ttl_s), fetch, clock)
                      for cloud, fetch in fetches.items()}
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def for_config(cls, metrics_config: Any, clock: Callable[[], float]) -> PriceBook:
        """The controller's book: the metrics section's prices (``metrics_config``: any object
        with ``spot_price_per_hour`` / ``on_demand_price_per_hour``, None: the defaults of
        ``cluster.metrics.state.Prices``) as the fallback, the live spot prices of every
        registered cloud that reads them (``Cloud.spot_price_fetch``: EC2's spot price
        history for AWS nodes), the shipped table (an unreadable table is logged once and
        left out)."""
        try:
            table: PriceTable | None = PriceTable.shipped()
        except (OSError, ValueError) as exc:
            log.warning("prices: the shipped price table is not usable (%s); "
                        "nodes without a live price get the configured one", exc)
            table = None
        from moshray.cluster.metrics.state import Prices

        default = Prices()  # a config without a metrics section: the documented defaults
        fallback = {Market.SPOT.value: getattr(metrics_config, "spot_price_per_hour",
                                               default.spot_per_hour),
                    Market.ON_DEMAND.value: getattr(metrics_config, "on_demand_price_per_hour",
                                                    default.on_demand_per_hour)}
        from moshray.autoscaler.clouds.base import clouds

        fetches = {c.name: c.spot_price_fetch() for c in clouds() if c.spot_price_fetch}
        return cls(fallback, fetches, table, clock)

    def _once(self, key: str, level: int, message: str, *args: Any) -> None:
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        log.log(level, message, *args)

    def prices(self, nodes: Sequence[NodeKey]) -> tuple[NodePrice, ...]:
        """One ``NodePrice`` per node, in order; never raises for a node or a fetch."""
        pools = [key.pool() for key in nodes]
        live: dict[str, float] = {}
        for cloud, spot in self._spot.items():
            wanted = tuple(p for p in pools if p is not None and p.cloud == cloud and p.is_spot)
            if not wanted:
                continue
            try:
                found, failure = spot.current(wanted)
            except Exception as exc:  # noqa: BLE001 - a price never stops training
                found, failure = {}, exc
            live.update(found)
            if failure is not None:
                self._once(f"fetch:{cloud}:{type(failure).__name__}", logging.WARNING,
                           "prices: %s spot prices not read (%s: %s); using the last good "
                           "ones, the table or the configured prices (logged once)", cloud,
                           type(failure).__name__, str(failure)[:200])
        out = []
        for key, pool in zip(nodes, pools):
            market = key.market if key.market == Market.ON_DEMAND.value else Market.SPOT.value
            price = choose_price(live.get(pool.key) if pool is not None else None,
                                 self.table.price(key) if self.table is not None else None,
                                 self.fallback[market])
            if price.source is PriceSource.CONFIG and key.instance_type:
                self._once(f"config:{key}", logging.INFO,
                           "prices: no price known for %s %s %s in %s; counted at the "
                           "configured $%.4f/h", key.cloud or "?", key.market,
                           key.instance_type, key.zone or "?", price.dollars_per_hour)
            out.append(price)
        return tuple(out)
