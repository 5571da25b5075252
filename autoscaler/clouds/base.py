"""A cloud as a plug-in: one ``Cloud`` bundle per cloud, registered by name.

A ``Cloud`` holds everything moshray knows about one cloud, each part the module of that
cloud's package provides (``autoscaler/clouds/aws/``, ``autoscaler/clouds/gcp/``; each
package's ``__init__`` builds its bundle and calls ``register_cloud``):

* ``notice_source``: builds the node's ``NoticeSource`` (``make_source``, the watcher);
  ``notice_options`` picks that source's options from a ``WatcherConfig``;
* ``identity``: how ``notice_source = auto`` finds the cloud (``detect.py``): the variable
  that names its metadata service, the SDK's opt-out, its DMI vendor prefixes and a bounded
  probe of the link-local metadata service;
* ``emulator``: a local metadata server speaking the cloud's protocol
  (``metadata_emulator.MetadataServer``), for the embedded cluster and the tests;
* ``provider``: the dotted path of its Ray autoscaler ``NodeProvider`` class (Ray's
  ``provider: {type: external, module: ...}``), imported only when asked for, so that
  reading the registry never needs the cloud's SDK;
* prices: ``region`` (zone -> region, for the shipped price table) and ``spot_price_fetch``
  (a live spot price reader, ``prices.Fetch``; None where the cloud has no such API);
* labels: ``read_pool``, the node's own pool (type, zone, market) from its metadata
  service (``node_labels.py``). Tag and label *keys* are shared by every cloud
  (``autoscaler/tags.py``); a cloud's name is part of the pool key, the value of the
  ``moshray-pool`` tag/label, so it must be a lowercase name without ``_``.

Every list of cloud names (the notice sources ``make_source`` and the watcher accept,
``PreemptionNotice.cloud``, ``Pool.cloud``, the config's ``cluster.notice_source``, what
``auto`` searches) is read from this registry when it is used, never copied.

Importing ``moshray.autoscaler.clouds`` (any module under it) registers AWS and GCP. Adding
a cloud: one package ``autoscaler/clouds/<name>/`` whose ``__init__`` registers its bundle,
imported from ``autoscaler/clouds/__init__.py`` (plus its Terraform under ``infra/``).
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the clouds' modules import these; only type names are needed here
    from moshray.autoscaler.clouds.detect import ProbeAnswer
    from moshray.autoscaler.clouds.metadata_emulator import MetadataServer
    from moshray.autoscaler.clouds.prices import Fetch
    from moshray.autoscaler.notices.message import NoticeSource
    from moshray.autoscaler.pools.records import Pool

# Names that mean something else wherever a notice source is named.
RESERVED = ("auto", "none", "simulated")
_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,15}$")

# (base URL of the metadata service, seconds left for one socket wait) -> the answer.
Probe = Callable[[str, Callable[[], float]], "ProbeAnswer"]


@dataclass(frozen=True)
class Identity:
    """How ``auto`` finds a cloud from inside one of its nodes (``detect.py``).

    ``endpoint_env``: the variable the cloud's SDK reads for a non-default metadata service
    (a URL, or ``host[:port]`` read as ``http://host[:port]``); a node that sets it is on
    this cloud, no probe. ``opt_out_env``: the SDK's opt-out; ``true`` there takes the
    cloud out of the DMI check and the probe. ``dmi_prefixes``: how the cloud's machines
    start their DMI ``sys_vendor`` / ``product_name``. ``probe``: asks the metadata service
    at a base URL whether it is this cloud's; it must bound every socket wait by the
    seconds its second argument returns and never raise on network trouble (the answer's
    ``detail`` says what happened). None: the cloud is found only by env or DMI.
    """

    endpoint_env: str
    opt_out_env: str
    dmi_prefixes: tuple[str, ...] = ()
    probe: Probe | None = None

    def __post_init__(self) -> None:
        for name in ("endpoint_env", "opt_out_env"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"identity {name} must name an environment variable, "
                                 f"got {getattr(self, name)!r}")
        object.__setattr__(self, "dmi_prefixes", tuple(self.dmi_prefixes))
        if not all(isinstance(p, str) and p for p in self.dmi_prefixes):
            raise ValueError(f"identity dmi_prefixes must be non-empty strings, "
                             f"got {self.dmi_prefixes!r}")
        if self.probe is not None and not callable(self.probe):
            raise ValueError(f"identity probe must be callable or None, got {self.probe!r}")


def _no_options(_config: Any) -> Mapping[str, Any]:
    return {}


def _no_region(_zone: str) -> str:
    return ""


@dataclass(frozen=True)
class Cloud:
    """One cloud's bundle (module docstring). Validated on construction: a bad field raises
    ``ValueError`` naming it.

    ``notice_source(node_id, metadata_url, *, pool, **options)`` returns the node's
    ``NoticeSource`` polling ``metadata_url`` (``metadata_url`` is this cloud's link-local
    address when the caller names none); ``notice_options(watcher_config)`` the options the
    watcher passes it. ``emulator(instance_id=...)`` starts a ``MetadataServer`` of the
    cloud's protocol on 127.0.0.1. ``region(zone)`` is "" when the zone is not the cloud's.
    """

    name: str
    metadata_url: str
    notice_source: Callable[..., NoticeSource]
    notice_options: Callable[[Any], Mapping[str, Any]] = _no_options
    identity: Identity | None = None
    emulator: Callable[..., MetadataServer] | None = None
    provider: str = ""
    region: Callable[[str], str] = _no_region
    spot_price_fetch: Callable[[], Fetch] | None = None
    read_pool: Callable[[str, float], Pool] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(f"cloud name must be 1-16 lowercase letters, digits or '-' "
                             f"starting with a letter, got {self.name!r}")
        if self.name in RESERVED:
            raise ValueError(f"cloud name {self.name!r} is reserved ({', '.join(RESERVED)})")
        if not isinstance(self.metadata_url, str) or "://" not in self.metadata_url:
            raise ValueError(f"cloud {self.name}: metadata_url must be http://host[:port], "
                             f"got {self.metadata_url!r}")
        for name in ("notice_source", "notice_options", "region"):
            if not callable(getattr(self, name)):
                raise ValueError(f"cloud {self.name}: {name} must be callable")
        for name in ("emulator", "spot_price_fetch", "read_pool"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ValueError(f"cloud {self.name}: {name} must be callable or None")
        if self.identity is not None and not isinstance(self.identity, Identity):
            raise ValueError(f"cloud {self.name}: identity must be an Identity or None")
        if not isinstance(self.provider, str) or (self.provider and "." not in self.provider):
            raise ValueError(f"cloud {self.name}: provider must be a dotted module.Class path "
                             f"or '', got {self.provider!r}")

    def provider_class(self) -> type:
        """The cloud's NodeProvider class, imported now (this may import the cloud's SDK).
        Raises ``ValueError`` when the cloud has none, ``ImportError`` when it cannot be
        imported."""
        if not self.provider:
            raise ValueError(f"cloud {self.name} has no NodeProvider")
        module, _, cls = self.provider.rpartition(".")
        return getattr(importlib.import_module(module), cls)


_REGISTRY: dict[str, Cloud] = {}
_LOCK = threading.Lock()


def register_cloud(cloud: Cloud, *, replace: bool = False) -> Cloud:
    """Register ``cloud`` under ``cloud.name`` (after those registered before it: ``auto``
    checks the clouds in this order). Raises ``ValueError`` if the name is taken, unless
    ``replace``. Returns ``cloud``."""
    if not isinstance(cloud, Cloud):
        raise ValueError(f"register_cloud takes a Cloud, got {cloud!r}")
    with _LOCK:
        if cloud.name in _REGISTRY and not replace:
            raise ValueError(f"cloud {cloud.name!r} is already registered")
        _REGISTRY[cloud.name] = cloud
    return cloud


def unregister_cloud(name: str) -> None:
    """Remove the cloud registered as ``name`` (tests that register a toy one); no-op if
    none is."""
    with _LOCK:
        _REGISTRY.pop(name, None)


def get_cloud(name: str) -> Cloud:
    """The cloud registered as ``name``; ``ValueError`` naming the registered ones if none."""
    with _LOCK:
        cloud = _REGISTRY.get(name)
        if cloud is None:
            raise ValueError(f"unknown cloud {name!r}; registered: "
                             f"{', '.join(_REGISTRY) or 'none'}")
    return cloud


def cloud_names() -> tuple[str, ...]:
    """The registered clouds' names, in registration order."""
    with _LOCK:
        return tuple(_REGISTRY)


def clouds() -> tuple[Cloud, ...]:
    """The registered clouds, in registration order."""
    with _LOCK:
        return tuple(_REGISTRY.values())
