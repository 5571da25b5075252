"""The ``provider:`` section of a cluster YAML, validated once at start-up, and the identity
``bootstrap_config`` gives each node type.

Shared by both spot NodeProviders (``provider_api.SpotNodeProviderBase`` and its AWS / GCP
subclasses). Everything here is pure: a config in, a validated object or a new config out, and
a one-line ``ValueError`` naming the key to fix.

Identity (what Ray's own AWS/GCP bootstrap does that moshray needs): the head's autoscaler
calls the cloud with the head node's identity, and workers read and write the cluster's
bucket with theirs, so every node type must carry one::

    provider:
      head_instance_profile_arn: arn:aws:iam::123456789012:instance-profile/moshray-head
      worker_instance_profile_arn: arn:aws:iam::123456789012:instance-profile/moshray-worker
      # GCP: head_service_account / worker_service_account (service account emails)

:func:`bootstrap_identity` puts them into ``node_config`` (AWS ``IamInstanceProfile.Arn``,
GCP ``serviceAccounts[0].email`` with the ``cloud-platform`` scope). A node type whose
``node_config`` already names an identity (or, on AWS, a ``LaunchTemplate``, which carries
one) keeps it; one that names a different identity than the provider key is an error.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moshray.autoscaler.pools import OnDemandBudget, Pool, PoolSelector, SelectorConfig
from moshray.autoscaler.tags import PROVIDER_METRICS_PORT

# node_config key (ours, removed before the cloud call): this node type's own pool list.
NODE_POOLS_KEY = "moshray_pools"
_SELECTOR_KEYS = ("capacity_cooldown_s", "max_cooldown_s", "preemption_window_s",
                  "spot_stable_s")


@dataclass(frozen=True)
class PlacementConfig:
    """The placement part of a provider config, validated once at start-up.

    YAML (under ``provider:``)::

        pools: [{instance_type|machine_type: ..., zone: ..., market?: spot, subnet_id?: ...}]
        on_demand: {max_nodes?: 2, max_usd_per_hour?: 3.0, prices?: {g5.xlarge: 1.006}}
        capacity_cooldown_s: 300      # and max_cooldown_s, preemption_window_s, spot_stable_s
        return_to_spot: false         # release on-demand workers once spot is stable again
        visibility_grace_s: 120       # serve own launches until the listing shows them
    """

    pools: tuple[Pool, ...] = ()
    budget: OnDemandBudget = field(default_factory=OnDemandBudget)
    selector: SelectorConfig = field(default_factory=SelectorConfig)
    return_to_spot: bool = False
    visibility_grace_s: float = 120.0

    @classmethod
    def from_provider_config(cls, cloud: str, cfg: Mapping[str, Any]) -> PlacementConfig:
        raw_pools = cfg.get("pools") or ()
        if not isinstance(raw_pools, (list, tuple)):
            raise ValueError(f"provider.pools must be a list, got {raw_pools!r}")
        pools = tuple(Pool.from_config(cloud, entry) for entry in raw_pools)
        selector = SelectorConfig(**{k: cfg[k] for k in _SELECTOR_KEYS if k in cfg})
        budget = OnDemandBudget.from_config(cfg.get("on_demand"))
        if pools:
            PoolSelector(pools, budget, selector)  # validates duplicates, prices, ...
        return_to_spot = cfg.get("return_to_spot", False)
        if not isinstance(return_to_spot, bool):
            raise ValueError(f"provider.return_to_spot must be true or false, got {return_to_spot!r}")
        grace = cfg.get("visibility_grace_s", 120.0)
        if not isinstance(grace, (int, float)) or grace < 0:
            raise ValueError(f"provider.visibility_grace_s must be a number >= 0, got {grace!r}")
        return cls(pools, budget, selector, return_to_spot, float(grace))


def metrics_port(cfg: Mapping[str, Any]) -> int | None:
    """``provider.metrics_port``: the loopback port of the providers' Prometheus endpoint
    (default :data:`~moshray.autoscaler.tags.PROVIDER_METRICS_PORT`; ``null`` turns it off)."""
    port = cfg.get("metrics_port", PROVIDER_METRICS_PORT)
    if port is None:
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"provider.metrics_port must be a port number (or null), got {port!r}")
    return port


# ---------------------------------------------------------------------------- identity
_ARN_RE = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:instance-profile/[\w+=,.@/-]+$")
_EMAIL_RE = re.compile(r"^([^@\s]+@[^@\s]+\.[^@\s]+|default)$")  # GCE accepts "default"
GCP_SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)


def _aws_identity(node_config: Mapping[str, Any]) -> str | None:
    profile = node_config.get("IamInstanceProfile")
    if profile is None:
        return None
    if not isinstance(profile, Mapping) or not (profile.get("Arn") or profile.get("Name")):
        raise ValueError(f"IamInstanceProfile must be {{Arn: ...}} or {{Name: ...}}, "
                         f"got {profile!r}")
    return profile.get("Arn") or profile.get("Name")


def _gcp_identity(node_config: Mapping[str, Any]) -> str | None:
    accounts = node_config.get("serviceAccounts")
    if not accounts:
        return None
    if not isinstance(accounts, list) or not isinstance(accounts[0], Mapping) \
            or not accounts[0].get("email"):
        raise ValueError(f"serviceAccounts must be [{{email: ..., scopes: [...]}}], "
                         f"got {accounts!r}")
    return accounts[0]["email"]


def bootstrap_identity(cloud: str, cluster_config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``cluster_config`` in which every node type carries the head's or the
    workers' identity (see the module docstring). Pure; raises ValueError saying which
    provider key to set when a node type has none."""
    if cloud not in ("aws", "gcp"):
        raise ValueError(f"unknown cloud {cloud!r}")
    config = copy.deepcopy(dict(cluster_config))
    provider = config.get("provider") or {}
    head_type = config.get("head_node_type")
    suffix, what = (("instance_profile_arn", "an IAM instance profile ARN") if cloud == "aws"
                    else ("service_account", "a service account email (or default)"))
    for name, node_type in (config.get("available_node_types") or {}).items():
        role = "head" if name == head_type else "worker"
        key = f"{role}_{suffix}"
        wanted = provider.get(key)
        if wanted is not None:
            pattern = _ARN_RE if cloud == "aws" else _EMAIL_RE
            if not isinstance(wanted, str) or not pattern.match(wanted):
                raise ValueError(f"provider.{key} must be {what}, got {wanted!r}")
        node_config = node_type.setdefault("node_config", {})
        where = f"available_node_types.{name}.node_config"
        if cloud == "aws":
            own = _aws_identity(node_config)
            if own is None and "LaunchTemplate" in node_config and wanted is None:
                continue  # the launch template carries the instance profile
        else:
            own = _gcp_identity(node_config)
        if own is not None:
            if wanted is not None and own not in (wanted, wanted.rsplit("/", 1)[-1]):
                raise ValueError(f"{where} names identity {own!r} but provider.{key} is "
                                 f"{wanted!r}: set only one of them")
            continue
        if wanted is None:
            raise ValueError(f"provider.{key} is required: {what} for the {role} nodes "
                             f"(the Terraform output), or set one in {where}")
        if cloud == "aws":
            node_config["IamInstanceProfile"] = {"Arn": wanted}
        else:
            node_config["serviceAccounts"] = [{"email": wanted, "scopes": list(GCP_SCOPES)}]
    return config


def require(cfg: Mapping[str, Any], key: str, kind: type, where: str = "provider") -> Any:
    """``cfg[key]`` checked for type, with a one-line error saying what to fix."""
    if key not in cfg:
        raise ValueError(f"{where}.{key} is required")
    value = cfg[key]
    if not isinstance(value, kind):
        raise ValueError(f"{where}.{key} must be a {kind.__name__}, got {value!r}")
    return value


def optional(cfg: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any,
             where: str = "provider") -> Any:
    value = cfg.get(key, default)
    if value is not None and not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ValueError(f"{where}.{key} must be a {names}, got {value!r}")
    return value

