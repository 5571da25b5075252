"""The spot-notice watcher's configuration: where notices come from and whom it tells.

Contract: ``WatcherConfig`` is validated once, at construction (a bad value raises
``ValueError``), and resolves the ``NoticeSource`` of a node on that node
(``make_source``); ``watcher_name`` names a node's watcher actor. No Ray calls.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from moshray.cluster import placement

from .notices import GCP_NOTICE_S, NoticeSource, make_source, node_metadata_service

WATCHER_PREFIX = "moshray-watcher-"
POOL_ENV = "MOSHRAY_POOL"  # a node's pool (instance type, zone, market), set by its setup
SOURCES = ("auto", "aws", "gcp", "simulated", "none")


@dataclass(frozen=True)
class WatcherConfig:
    """How a watcher listens and whom it tells. Validated once, here.

    ``source``: aws, gcp, simulated, none, or auto (the metadata service the node names in
    its environment, see ``notices.node_metadata_service``; none if it names none).
    ``metadata_url`` overrides the cloud's link-local address; without it a node that
    names its own service (``AWS_EC2_METADATA_SERVICE_ENDPOINT`` / ``GCE_METADATA_HOST``)
    is polled there (the embedded cluster's emulators; tests). ``poll_s`` bounds one poll (and so how fast
    ``stop`` is noticed); ``aws_interval_s`` is the IMDS check period; ``gcp_notice_s`` is
    the notice GCP gives. ``rpc_timeout_s`` bounds each call to the Coordinator and the GCS.
    """

    source: str = "simulated"
    metadata_url: str | None = None
    pool: str = ""
    poll_s: float = 1.0
    aws_interval_s: float = 1.0
    gcp_notice_s: float = GCP_NOTICE_S
    rpc_timeout_s: float = 5.0
    coordinator_name: str = placement.COORDINATOR_NAME

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.source == "simulated" and self.metadata_url:
            raise ValueError("the simulated source takes no metadata URL")
        for name in ("poll_s", "aws_interval_s", "gcp_notice_s", "rpc_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")

    def make_source(self, node_id: str, environ: Mapping[str, str] | None = None
                    ) -> NoticeSource:
        """The source for ``node_id``, resolved on that node (``environ``: its environment)."""
        kind, url = self.source, self.metadata_url
        environ = os.environ if environ is None else environ
        named_kind, named_url = node_metadata_service(environ)
        # The node's pool, as its setup names it (infra/ startup scripts export it).
        pool = self.pool or environ.get(POOL_ENV, "")
        if kind == "auto":
            kind, url = named_kind, named_url
        elif kind == named_kind and url is None:
            url = named_url
        options = {}
        if kind == "aws":
            options["interval_s"] = self.aws_interval_s
        elif kind == "gcp":
            options["notice_s"] = self.gcp_notice_s
        return make_source(kind, node_id, metadata_url=url, pool=pool, **options)


def watcher_name(node_id: str) -> str:
    return WATCHER_PREFIX + node_id
