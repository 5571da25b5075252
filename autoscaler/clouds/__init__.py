"""The clouds moshray runs on, as plug-ins: one ``Cloud`` bundle per cloud, registered by name.

``base.py`` defines the bundle (``Cloud``, ``Identity``) and the registry
(``register_cloud``, ``get_cloud``, ``cloud_names``, ``clouds``); each cloud's package
(``aws/``, ``gcp/``) builds its bundle from its modules and registers it when imported,
which importing this package does, in the order ``auto`` searches them. The shared parts
the bundles plug into: ``detect.py`` (``notice_source = auto``), ``metadata_emulator.py``
(the local metadata servers' base), ``prices.py`` (spot prices per pool and per node) and
``node_labels.py`` (a node's Ray labels).

Adding a cloud: a package ``clouds/<name>/`` whose ``__init__`` registers its ``Cloud``
(notice source, identity, emulator, NodeProvider path, prices), one import line below, and
its Terraform under ``infra/``.
"""

from __future__ import annotations

from moshray.autoscaler.clouds import aws, gcp  # noqa: F401 - registers the built-in clouds
from moshray.autoscaler.clouds.base import (
    Cloud,
    Identity,
    cloud_names,
    clouds,
    get_cloud,
    register_cloud,
    unregister_cloud,
)

__all__ = ["Cloud", "Identity", "cloud_names", "clouds", "get_cloud", "register_cloud",
           "unregister_cloud"]
