"""The spot-notice watcher's configuration: where notices come from and whom it tells.

Contract: ``WatcherConfig`` is validated once, at construction (a bad value raises
``ValueError``), and resolves the ``NoticeSource`` of a node on that node
(``make_source``; for ``auto`` that detects the node's cloud, see ``clouds/detect.py``);
``watcher_name`` names a node's watcher actor. The source names are the registered clouds'
(``autoscaler/clouds``) plus ``auto``, ``simulated`` and ``none`` (``notices/sources.py``
``source_names``), read when a config is made. No Ray calls.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


import moshray.autoscaler.clouds.detect as cloud_detect
from moshray.autoscaler.clouds.base import cloud_names, get_cloud
from moshray.autoscaler.clouds.detect import LINK_LOCAL_URL, DetectConfig, node_metadata_service
from moshray.autoscaler.clouds.gcp.notices import GCP_NOTICE_S
from moshray.autoscaler.notices.http import _validate_base_url
from moshray.autoscaler.notices.message import SIMULATED, NoticeSource
from moshray.autoscaler.notices.sources import AutoSource, make_source, source_names

WATCHER_PREFIX = "moshray-watcher-"
POOL_ENV = "MOSHRAY_POOL"  # a node's pool (instance type, zone, market), set by its setup


@dataclass(frozen=True)
class WatcherConfig:
    """How a watcher listens and whom it tells. Validated once, here.

    ``source``: a registered cloud (aws, gcp, ...), simulated, none, or auto: the node's
    cloud, detected on the node as the clouds' SDKs do (``clouds/detect.py``): the metadata
    service its environment names
    (``AWS_EC2_METADATA_SERVICE_ENDPOINT`` / ``GCE_METADATA_HOST``), else its DMI vendor
    strings, else a bounded probe of the link-local metadata service; none (a silent source,
    with a warning) when nothing answers. ``metadata_url`` overrides the cloud's link-local
    address: for a cloud, where that source polls; for auto, where the DMI-detected cloud is
    polled and where the probe looks (a service the environment names still wins). For a
    cloud without ``metadata_url``, a node that names its own service of that cloud is
    polled there (the embedded cluster's emulators; tests). ``detect`` bounds auto's probe
    and names the DMI directory. ``poll_s`` bounds one poll (and so how fast ``stop`` is
    noticed); ``aws_interval_s`` is the IMDS check period; ``gcp_notice_s`` is the notice
    GCP gives (each cloud's bundle picks its options, ``Cloud.notice_options``).
    ``rpc_timeout_s`` bounds each call to the Coordinator and the GCS.
    """

    source: str = "simulated"
    metadata_url: str | None = None
    pool: str = ""
    poll_s: float = 1.0
    aws_interval_s: float = 1.0
    gcp_notice_s: float = GCP_NOTICE_S
    rpc_timeout_s: float = 5.0
    coordinator_name: str | None = None  # None: every job's Coordinator on the cluster
    detect: DetectConfig = DetectConfig()

    def __post_init__(self) -> None:
        if self.source not in source_names():
            raise ValueError(f"source must be one of {', '.join(source_names())}, "
                             f"got {self.source!r}")
        if self.source == SIMULATED and self.metadata_url:
            raise ValueError("the simulated source takes no metadata URL")
        if self.metadata_url is not None:
            _validate_base_url(self.metadata_url)
        if not isinstance(self.detect, DetectConfig):
            raise ValueError(f"detect must be a DetectConfig, got {self.detect!r}")
        for name in ("poll_s", "aws_interval_s", "gcp_notice_s", "rpc_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")

    def make_source(self, node_id: str, environ: Mapping[str, str] | None = None
                    ) -> NoticeSource:
        """The source for ``node_id``, resolved on that node (``environ``: its environment,
        default ``os.environ``). For auto, runs the detection (a probe of at most about
        ``detect.budget_s`` seconds, one log line) and returns an ``AutoSource`` whose
        ``describe()`` says what was found and how."""
        kind, url = self.source, self.metadata_url
        environ = os.environ if environ is None else environ
        # The node's pool, as its setup names it (infra/ startup scripts export it).
        pool = self.pool or environ.get(POOL_ENV, "")
        detection = None
        if kind == "auto":
            detection = cloud_detect.detect(environ, base_url=url or LINK_LOCAL_URL,
                                            config=self.detect)
            kind, url = detection.cloud, detection.metadata_url
        else:
            named_kind, named_url = node_metadata_service(environ)
            if kind == named_kind and url is None:
                url = named_url
        options = dict(get_cloud(kind).notice_options(self)) if kind in cloud_names() else {}
        source = make_source(kind, node_id, metadata_url=url, pool=pool, **options)
        return source if detection is None else AutoSource(source, detection)


def watcher_name(node_id: str) -> str:
    return WATCHER_PREFIX + node_id
