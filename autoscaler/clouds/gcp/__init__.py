"""GCP as a moshray cloud: this package builds the GCP ``Cloud`` bundle and registers it.

Its parts, one module each: ``notices.py`` (``GCPMetadataSource``, the GCE metadata server's
``instance/preempted``, long-polled), ``identity.py`` (how ``auto`` finds GCE, and a node's
pool from the metadata server), ``emulator.py`` (``GCEMetadataServer``, a local GCE metadata
server for the tests), ``prices.py`` (zone -> region; GCP has no live spot price API) and
``provider.py`` (``GCPSpotNodeProvider``, Ray's autoscaler NodeProvider; imported only when
asked for, as it needs the Google Cloud client). The watcher's ``gcp_notice_s`` is the
notice length the source assumes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moshray.autoscaler.clouds.base import Cloud, register_cloud
from moshray.autoscaler.clouds.gcp import identity, prices
from moshray.autoscaler.clouds.gcp.emulator import GCEMetadataServer
from moshray.autoscaler.clouds.gcp.notices import GCP_METADATA_URL, GCPMetadataSource
from moshray.autoscaler.tags import GCP_PROVIDER


def _notice_options(watcher_config: Any) -> Mapping[str, Any]:
    return {"notice_s": watcher_config.gcp_notice_s}


GCP = register_cloud(Cloud(
    name="gcp",
    metadata_url=GCP_METADATA_URL,
    notice_source=GCPMetadataSource,
    notice_options=_notice_options,
    identity=identity.IDENTITY,
    emulator=GCEMetadataServer,
    provider=GCP_PROVIDER,
    region=prices.region_of,
    read_pool=identity.read_pool,
))
