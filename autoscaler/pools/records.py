"""A capacity pool and what happens in it: the plain records the pool policy works on.

``Pool`` is one place capacity comes from (a registered cloud, ``autoscaler/clouds``; an
instance/machine type, a zone and a ``Market``: spot or on-demand); ``Pool.from_config``
reads a provider-config entry.
``encode_pool`` gives its *key*, the value of the ``moshray-pool`` tag/label (valid as an AWS
tag value and as a GCP label value: lowercase letters, digits, ``-`` and ``_``, at most 63
characters), and ``decode_pool`` reverses it. ``PoolEvent`` (of an ``EventKind``: launched,
capacity error, preempted, released) is what a NodeProvider records for the selector
(``pools/selector.py``). Pure data, validated on construction (ValueError says what to fix).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

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
        # The registered clouds (autoscaler/clouds), read when a pool is made: the clouds'
        # modules import this one, so the registry is not imported with it.
        from moshray.autoscaler.clouds.base import cloud_names

        if self.cloud not in cloud_names():
            raise ValueError(f"pool cloud must be one of {', '.join(cloud_names())}, "
                             f"got {self.cloud!r}")
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
