"""A spot preemption notice and the interface of every place one comes from.

``PreemptionNotice`` is the message: which node, which cloud, what action (AWS's
``terminate`` / ``stop`` / ``hibernate``, GCP's ``preempt``, AWS's ``rebalance`` warning),
the deadline and when it was received, both on the noticed node's wall clock.

``NoticeSource`` is the contract the sources implement (``notice_aws.py``,
``notice_gcp.py``, ``notice_local.py``): ``poll(timeout_s)`` returns the next *new* notice
(each is delivered once) or None when nothing new arrived within ``timeout_s``; it never
raises on transient trouble (it logs it, counts it in ``errors`` and returns None, so the
watcher loop simply polls again). Also the clouds' metadata addresses and notice lengths.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

AWS_METADATA_URL = "http://169.254.169.254"
GCP_METADATA_URL = "http://metadata.google.internal"

# Actions a notice may carry. AWS names its three; "preempt" is GCP's (always a stop or
# delete chosen by the instance's termination action, invisible from inside); "rebalance"
# is AWS's early warning that the instance is at elevated risk (no deadline).
AWS_ACTIONS = ("terminate", "stop", "hibernate")
PREEMPT = "preempt"
REBALANCE = "rebalance"
ACTIONS = AWS_ACTIONS + (PREEMPT, REBALANCE)
CLOUDS = ("aws", "gcp", "simulated")

AWS_NOTICE_S = 120.0  # AWS: the interruption happens two minutes after the notice
GCP_NOTICE_S = 30.0  # GCP: ~30 s between the preemption signal and the hard stop
IMDS_TOKEN_TTL_MAX_S = 21600  # IMDSv2 accepts a token TTL of 1..21600 seconds


@dataclass(frozen=True)
class PreemptionNotice:
    """A node was told it will be taken away (or, for ``action == "rebalance"``, that it is
    at elevated risk of it).

    ``node_id`` is the Ray node id (hex) of the node the notice is about.
    ``deadline_unix_s`` is when the cloud takes the node (``math.inf`` for a rebalance
    recommendation, which carries no deadline); ``received_unix_s`` is when this node's
    source saw the notice. Both are wall-clock seconds of the noticed node, so
    ``seconds_left`` is computed there, never across machines. ``source`` names where it
    came from (e.g. ``"aws-imds http://169.254.169.254"``); ``pool`` is the capacity pool
    the node was launched from when known (see autoscaler/pools/__init__.py), else "".
    """

    node_id: str
    cloud: str
    action: str
    deadline_unix_s: float
    received_unix_s: float
    source: str
    pool: str = ""

    def __post_init__(self) -> None:
        if self.cloud not in CLOUDS:
            raise ValueError(f"cloud must be one of {CLOUDS}, got {self.cloud!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {self.action!r}")
        if math.isnan(self.deadline_unix_s) or not math.isfinite(self.received_unix_s):
            raise ValueError("deadline_unix_s and received_unix_s must be numbers, got "
                             f"{self.deadline_unix_s!r}, {self.received_unix_s!r}")

    @property
    def is_rebalance(self) -> bool:
        """A rebalance recommendation: a warning, not a termination."""
        return self.action == REBALANCE

    @property
    def notice_s(self) -> float:
        """Seconds of notice the cloud gave (deadline - received); inf for a rebalance."""
        return self.deadline_unix_s - self.received_unix_s

    def seconds_left(self, now_unix_s: float) -> float:
        """Seconds until the deadline at ``now_unix_s`` (never negative)."""
        return max(0.0, self.deadline_unix_s - now_unix_s)


class NoticeSource(abc.ABC):
    """Where a node learns it is being preempted.

    Contract: ``poll(timeout_s)`` returns the next notice not returned before, waiting at
    most about ``timeout_s`` seconds (``0`` = check once), else None. It never raises on
    transient errors (network, HTTP 5xx, malformed bodies): it logs, increments ``errors``
    and returns None. ``close()`` releases what the source holds; polling after it returns
    None. Not safe to poll from two threads at once (one watcher loop per source).
    """

    cloud: str = ""
    errors: int = 0

    @abc.abstractmethod
    def poll(self, timeout_s: float) -> PreemptionNotice | None: ...

    def close(self) -> None:
        """Stop: later polls return None at once."""
        self._closed = True

    @property
    def closed(self) -> bool:
        return getattr(self, "_closed", False)

    def describe(self) -> str:
        return self.cloud
