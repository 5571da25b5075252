"""Spot preemption notices: one message type and one small source interface.

A ``NoticeSource`` answers one question, "has this node been told it is going away?":
``poll(timeout_s)`` returns the next *new* ``PreemptionNotice`` (each notice is delivered
once) or None when nothing new arrived within ``timeout_s``. Sources never raise on
transient trouble (connection refused, timeouts, HTTP 5xx, a half-written body): they log
it, count it in ``errors`` and return None, so the watcher loop simply polls again.

Each role has its own module; the package's public names are declared here:

* ``message.py``: ``PreemptionNotice``, the ``NoticeSource`` interface, the actions and the
  clouds a notice may name (``notice_clouds``: the registered clouds and ``simulated``).
* ``http.py``: the HTTP plumbing of the metadata sources (``MetadataConnection``, one
  kept-alive connection per source).
* ``local.py``: ``SimulatedSource`` (local clusters, trace replay: ``trigger()`` /
  ``deliver()`` queue a notice that ``poll`` returns) and ``SilentSource`` (no source).
* ``sources.py``: ``make_source``, a node's source by name (a registered cloud's, through
  its bundle, or ``simulated`` / ``none``), ``source_names`` and ``AutoSource``.

The clouds' own sources live with their clouds (``autoscaler/clouds/aws/notices.py``,
``autoscaler/clouds/gcp/notices.py``), as does ``auto``'s detection
(``autoscaler/clouds/detect.py``). This package does not import ``autoscaler/clouds`` when
it is imported (the clouds import it); ``sources.py`` does, when it is.

Only the standard library is used (``http.client``), so the watcher runs on a bare node
image.
"""

from __future__ import annotations

from moshray.autoscaler.notices.http import MetadataConnection
from moshray.autoscaler.notices.local import SilentSource, SimulatedSource
from moshray.autoscaler.notices.message import (
    ACTIONS,
    AWS_ACTIONS,
    PREEMPT,
    REBALANCE,
    SIMULATED,
    NoticeSource,
    PreemptionNotice,
    notice_clouds,
)

__all__ = ["ACTIONS", "AWS_ACTIONS", "PREEMPT", "REBALANCE", "SIMULATED", "MetadataConnection",
           "NoticeSource", "PreemptionNotice", "SilentSource", "SimulatedSource",
           "notice_clouds"]
