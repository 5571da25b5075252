"""Building a node's notice source by name (``make_source``) and ``AutoSource``, the source
``auto`` picked, which says how its cloud was found."""
from __future__ import annotations

from moshray.autoscaler.clouds.aws.notices import AWSMetadataSource
from moshray.autoscaler.clouds.detect import Detection
from moshray.autoscaler.clouds.gcp.notices import GCPMetadataSource
from moshray.autoscaler.notices.local import SilentSource, SimulatedSource
from moshray.autoscaler.notices.message import (AWS_METADATA_URL, GCP_METADATA_URL, NoticeSource,
                                                PreemptionNotice)


class AutoSource(NoticeSource):
    """The source ``auto`` picked (``WatcherConfig.make_source``): ``inner`` does the work,
    ``detection`` says how its cloud was found.

    Polls, ``close``, ``errors`` and ``cloud`` are the inner source's; other attributes
    (``node_id``, ``pool``, ``base_url``...) are read through. ``describe()`` is the inner
    source's followed by ``(auto: <how>)``, so a watcher's ``status()["source"]`` shows it;
    notices keep the inner source's own description.
    """

    def __init__(self, inner: NoticeSource, detection: Detection) -> None:
        self.inner = inner
        self.detection = detection

    @property
    def cloud(self) -> str:
        return self.inner.cloud

    @property
    def errors(self) -> int:
        return self.inner.errors

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def poll(self, timeout_s: float) -> PreemptionNotice | None:
        return self.inner.poll(timeout_s)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return f"{self.inner.describe()} (auto: {self.detection.how})"

    def __getattr__(self, name: str):
        if name in ("inner", "detection"):  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)


def make_source(kind: str, node_id: str, *, metadata_url: str | None = None, pool: str = "",
                **options) -> NoticeSource:
    """The source named ``kind`` ("aws", "gcp", "simulated" or "none") for ``node_id``.

    ``metadata_url`` overrides the cloud's link-local metadata address; ``options`` go to
    the source's constructor (e.g. ``interval_s`` for AWS, ``notice_s`` for GCP). ``auto``
    is not a kind here: ``WatcherConfig.make_source`` detects the cloud, then calls this.
    Raises ``ValueError`` for an unknown kind.
    """
    if kind == "aws":
        return AWSMetadataSource(node_id, metadata_url or AWS_METADATA_URL, pool=pool, **options)
    if kind == "gcp":
        return GCPMetadataSource(node_id, metadata_url or GCP_METADATA_URL, pool=pool, **options)
    if kind == "none":
        return SilentSource(node_id, pool=pool)
    if kind == "simulated":
        if metadata_url:
            raise ValueError("the simulated source takes no metadata URL")
        return SimulatedSource(node_id, pool=pool, **options)
    raise ValueError(f"notice source must be aws, gcp, simulated or none, got {kind!r}")
