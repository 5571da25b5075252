"""Spot prices per pool: from the cloud where an API gives them, else from the provider config.

AWS publishes spot prices per instance type and availability zone (EC2
``DescribeSpotPriceHistory``); the AWS provider passes a fetch function that asks for the
pools' types and zones from *now* on, which EC2 answers with the price in effect now (plus any
change since). :func:`newest_prices` keeps the newest record per (type, zone). GCP has no
such API for Spot VMs (prices are in the Cloud Billing catalog, per region and SKU), so the
GCP provider uses the configured prices only.

YAML (under ``provider:``)::

    spot_prices: {g4dn.xlarge: 0.2158, g5.xlarge: 0.4}   # USD per hour, per instance type
    spot_price_ttl_s: 300                                # how long a fetched price is used

A pool's price is the API's for its (type, zone) when there is one, else the configured price
of its type, else it has none (its gauge is not set). A failed fetch keeps the prices of the
last good one and is tried again after the TTL; the error goes back to the caller (the
provider collects it). On-demand pools are not priced here (``on_demand.prices`` holds those).
"""

from __future__ import annotations

import datetime as dt
import math
import threading
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moshray.autoscaler.pools import Pool

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
