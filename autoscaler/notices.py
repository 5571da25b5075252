"""Spot preemption notices: one message type and one small source interface.

A ``NoticeSource`` answers one question, "has this node been told it is going away?":
``poll(timeout_s)`` returns the next *new* ``PreemptionNotice`` (each notice is delivered
once) or None when nothing new arrived within ``timeout_s``. Sources never raise on
transient trouble (connection refused, timeouts, HTTP 5xx, a half-written body): they log
it, count it in ``errors`` and return None, so the watcher loop simply polls again.

Each role has its own module; this one re-exports their names (imports of
``moshray.autoscaler.notices`` keep working) and builds a node's source (``make_source``;
``AutoSource``, the source ``auto`` picked, which says how it was found):

* ``notice_message.py``: ``PreemptionNotice``, the ``NoticeSource`` interface, the actions,
  clouds, metadata addresses and notice lengths.
* ``notice_http.py``: the HTTP plumbing of the metadata sources (``MetadataConnection``,
  one kept-alive connection per source; ``_TransientError``).
* ``notice_aws.py``: ``AWSMetadataSource``, EC2 instance metadata through IMDSv2 (spot
  interruption notices and rebalance recommendations).
* ``notice_gcp.py``: ``GCPMetadataSource``, the GCE metadata server's ``instance/preempted``,
  long-polled; the deadline is ``received + notice_s`` (about 30 s on GCP).
* ``notice_local.py``: ``SimulatedSource`` (local clusters, trace replay: ``trigger()`` /
  ``deliver()`` queue a notice that ``poll`` returns) and ``SilentSource`` (no source).
* ``cloud_detect.py``: which cloud a node runs on, for ``notice_source = auto`` (the
  metadata service its environment names, its DMI vendor strings, a bounded probe of the
  link-local metadata service; ``node_metadata_service``, ``detect``).

Only the standard library is used (``http.client``), so the watcher runs on a bare node
image.
"""

from __future__ import annotations

from .cloud_detect import (  # noqa: F401 - re-exported
    AWS_ENDPOINT_ENV,
    GCP_HOST_ENV,
    Detection,
    node_metadata_service,
)
from .notice_aws import AWSMetadataSource  # noqa: F401 - re-exported
from .notice_gcp import GCPMetadataSource  # noqa: F401 - re-exported
from .notice_http import (  # noqa: F401 - re-exported
    _parse_utc,
    _Response,
    _TransientError,
    _validate_base_url,
)
from .notice_local import SilentSource, SimulatedSource  # noqa: F401 - re-exported
from .notice_message import (  # noqa: F401 - re-exported
    ACTIONS,
    AWS_ACTIONS,
    AWS_METADATA_URL,
    AWS_NOTICE_S,
    CLOUDS,
    GCP_METADATA_URL,
    GCP_NOTICE_S,
    IMDS_TOKEN_TTL_MAX_S,
    PREEMPT,
    REBALANCE,
    NoticeSource,
    PreemptionNotice,
)


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
