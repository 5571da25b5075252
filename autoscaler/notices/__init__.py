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

from moshray.autoscaler.notices.http import (  # noqa: F401 - re-exported
    _parse_utc,
    _Response,
    _TransientError,
    _validate_base_url,
)
from moshray.autoscaler.notices.local import SilentSource, SimulatedSource  # noqa: F401 - re-exported
from moshray.autoscaler.notices.message import (  # noqa: F401 - re-exported
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
