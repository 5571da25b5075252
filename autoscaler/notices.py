"""Spot preemption notices: one message type and one small source interface.

A ``NoticeSource`` answers one question, "has this node been told it is going away?":
``poll(timeout_s)`` returns the next *new* ``PreemptionNotice`` (each notice is delivered
once) or None when nothing new arrived within ``timeout_s``. Sources never raise on
transient trouble (connection refused, timeouts, HTTP 5xx, a half-written body): they log
it, count it in ``errors`` and return None, so the watcher loop simply polls again.

Each role has its own module; this one re-exports their names (imports of
``moshray.autoscaler.notices`` keep working) and picks a node's source (``make_source``,
``node_metadata_service``):

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

Only the standard library is used (``http.client``), so the watcher runs on a bare node
image.
"""

from __future__ import annotations

from collections.abc import Mapping

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

# How a node names its metadata service: the variables the clouds' own SDKs honour (boto's
# IMDS endpoint override; google-auth's metadata host). Set by the node's setup, never by
# the job: the embedded cluster sets them to its local emulators (metadata_emulator.py).
AWS_ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
GCP_HOST_ENV = "GCE_METADATA_HOST"


def node_metadata_service(environ: Mapping[str, str]) -> tuple[str, str | None]:
    """``(cloud, metadata_url)`` a node names in its environment: ``("aws", url)``,
    ``("gcp", url)``, or ``("none", None)`` when it names none. Pure."""
    aws = environ.get(AWS_ENDPOINT_ENV, "").strip()
    if aws:
        return "aws", aws.rstrip("/")
    gcp = environ.get(GCP_HOST_ENV, "").strip()
    if gcp:
        return "gcp", gcp.rstrip("/") if "://" in gcp else f"http://{gcp}"
    return "none", None


def make_source(kind: str, node_id: str, *, metadata_url: str | None = None, pool: str = "",
                **options) -> NoticeSource:
    """The source named ``kind`` ("aws", "gcp" or "simulated") for ``node_id``.

    ``metadata_url`` overrides the cloud's link-local metadata address; ``options`` go to
    the source's constructor (e.g. ``interval_s`` for AWS, ``notice_s`` for GCP).
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
