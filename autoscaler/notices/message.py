"""A spot preemption notice and the interface of every place one comes from.

``PreemptionNotice`` is the message: which node, which cloud, what action (AWS's
``terminate`` / ``stop`` / ``hibernate``, GCP's ``preempt``, AWS's ``rebalance`` warning),
the deadline and when it was received, both on the noticed node's wall clock.

``NoticeSource`` is the contract the sources implement (each cloud's, e.g.
``clouds/aws/notices.py``, ``clouds/gcp/notices.py``; and ``notices/local.py``):
``poll(timeout_s)`` returns the next *new* notice (each is delivered once) or None when
nothing new arrived within ``timeout_s``; it never raises on transient trouble (it logs it,
counts it in ``errors`` and returns None, so the watcher loop simply polls again). A
notice's ``cloud`` is a registered cloud (``clouds/base.py``) or ``simulated``.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

# Actions a notice may carry: the watcher's vocabulary. AWS names its three; "preempt" is
# GCP's (always a stop or delete chosen by the instance's termination action, invisible from
# inside); "rebalance" is AWS's early warning that the instance is at elevated risk (no
# deadline). A new cloud maps its signal onto these.
AWS_ACTIONS = ("terminate", "stop", "hibernate")
PREEMPT = "preempt"
REBALANCE = "rebalance"
ACTIONS = AWS_ACTIONS + (PREEMPT, REBALANCE)
SIMULATED = "simulated"  # the cloud of a notice that SimulatedSource delivered
SIGTERM = "sigterm"  # a notice from the watcher process's SIGTERM (a pod's grace period)


def notice_clouds() -> tuple[str, ...]:
    """The clouds a notice may name: every registered cloud (``autoscaler/clouds``),
    ``simulated`` and ``sigterm`` (the watcher's SIGTERM: a Kubernetes pod's termination,
    whatever the cloud). Read from the registry when called (the clouds import this
    module)."""
    from moshray.autoscaler.clouds.base import cloud_names

    return (*cloud_names(), SIMULATED, SIGTERM)


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
        if self.cloud not in notice_clouds():
            raise ValueError(f"cloud must be one of {', '.join(notice_clouds())}, "
                             f"got {self.cloud!r}")
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
