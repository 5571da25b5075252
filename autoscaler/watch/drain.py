"""Act on a preemption notice: tell the Coordinator, then ask Ray to drain the node.

Two side effects, in this order, because the first is what training waits on:

1. ``Coordinator.note_notice(node_id, deadline_s, notice_age_s)``: the node's peers are
   marked draining (every plan made after the call returns excludes them) and the
   Coordinator starts the notice -> rebalanced clock (``stats()["rebalance_s"]``).
2. Ray's ``DrainNode`` through the GCS client, with reason ``DRAIN_NODE_REASON_PREEMPTION``
   and the notice's deadline (unix ms): the raylet accepts no new work, the GCS reports the
   node as draining (``draining_nodes()``) and Ray's autoscaler counts it as going away.
   A preemption drain is never rejected by Ray; the node keeps running what it has until
   it is idle or killed (Ray itself never kills it at the deadline: the cloud does).

API used (ray 2.60, ``ray/scripts/scripts.py::drain_node`` and ``ray/_private/node.py``):
``GcsClient.drain_node(node_id_hex, reason, reason_message, deadline_timestamp_ms,
timeout=...) -> (accepted, rejection_message)``. The node id must be the 56-character hex
id: the GCS silently accepts a malformed id without draining anything, so it is checked here.

Failure behaviour: nothing here raises into the watcher loop for a cluster-side failure
(GCS unreachable, Coordinator missing or dead); each failure is logged and recorded in
the returned ``DrainOutcome``. Bad arguments (a malformed node id) raise ``ValueError``.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from moshray.cluster.metrics import NoticeEvent

from moshray.autoscaler.notices.message import PreemptionNotice

log = logging.getLogger(__name__)

_NODE_ID = re.compile(r"^[0-9a-f]{56}$")
_NIL = "f" * 56  # Ray's nil NodeID


def check_node_id(node_id: str) -> str:
    """``node_id`` if it is a Ray node id in hex (56 lowercase hex chars), else ValueError."""
    if not isinstance(node_id, str) or not _NODE_ID.match(node_id) or node_id == _NIL:
        raise ValueError(f"expected a Ray node id (56 hex characters, as "
                         f"ray.get_runtime_context().get_node_id() returns), got {node_id!r}")
    return node_id


@dataclass(frozen=True)
class RayDrain:
    """Ray's answer to one DrainNode request."""

    node_id: str
    accepted: bool
    message: str  # Ray's rejection message, or the error that prevented the request
    deadline_unix_s: float  # math.inf: no deadline
    requested_unix_s: float


@dataclass(frozen=True)
class DrainOutcome:
    """What the watcher did about one notice (crosses actor boundaries; pickles)."""

    notice: PreemptionNotice
    coordinator_ok: bool
    peers: tuple[str, ...]  # the peers the Coordinator marked draining
    ray: RayDrain
    draining_unix_s: float  # when both steps were done (wall clock of the noticed node)
    error: str = ""  # what went wrong with the Coordinator, if anything

    @property
    def notice_to_draining_s(self) -> float:
        return max(0.0, self.draining_unix_s - self.notice.received_unix_s)


def _gcs_client():
    import ray

    worker = ray._private.worker.global_worker
    client = getattr(worker, "gcs_client", None)
    if client is None:
        raise RuntimeError("not connected to a Ray cluster: call ray.init first")
    return client


def drain_node(
    node_id: str,
    deadline_unix_s: float,
    reason_message: str,
    *,
    gcs_client=None,
    timeout_s: float = 5.0,
    clock: Callable[[], float] = time.time,
) -> RayDrain:
    """Ask the GCS to drain ``node_id`` for a preemption due at ``deadline_unix_s``.

    ``deadline_unix_s=math.inf`` sends no deadline. Returns ``RayDrain``; a GCS that cannot
    be reached within ``timeout_s`` gives ``accepted=False`` with the error as message.
    """
    import ray
    from ray.core.generated import autoscaler_pb2

    check_node_id(node_id)
    now = clock()
    deadline_ms = 0 if math.isinf(deadline_unix_s) else max(1, int(deadline_unix_s * 1000))
    try:
        accepted, message = (gcs_client or _gcs_client()).drain_node(
            node_id,
            autoscaler_pb2.DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION,
            reason_message,
            deadline_ms,
            timeout=timeout_s,
        )
    except (ray.exceptions.RayError, OSError, RuntimeError) as e:
        log.error("DrainNode %s failed: %s", node_id[:12], e)
        return RayDrain(node_id, False, f"{type(e).__name__}: {e}", deadline_unix_s, now)
    if not accepted:
        log.error("DrainNode %s rejected: %s", node_id[:12], message)
    return RayDrain(node_id, bool(accepted), str(message or ""), deadline_unix_s, now)


def draining_nodes() -> dict[str, float]:
    """Nodes the GCS reports as draining: hex id -> deadline (unix s; inf when none)."""
    import ray

    raw = ray._private.state.state.get_draining_nodes()
    return {node: (ts / 1000.0 if ts else math.inf) for node, ts in raw.items()}


def tell_coordinator(coordinator, notice: PreemptionNotice, *, timeout_s: float = 10.0,
                     clock: Callable[[], float] = time.time) -> tuple[bool, tuple[str, ...], str]:
    """``coordinator.note_notice`` for ``notice``; returns ``(ok, peers, error)``.

    Seconds left and the notice's age are computed here, on the noticed node, so the
    Coordinator never compares clocks of two machines.
    """
    import ray

    now = clock()
    try:
        peers = ray.get(coordinator.note_notice.remote(
            notice.node_id, notice.seconds_left(now), max(0.0, now - notice.received_unix_s)),
            timeout=timeout_s)
    except (ray.exceptions.RayError, AttributeError) as e:
        log.error("Coordinator could not be told about %s's notice: %s", notice.node_id[:12], e)
        return False, (), f"{type(e).__name__}: {e}"
    # Metrics (fire-and-forget): notices by cloud and pool.
    try:
        coordinator.record.remote((NoticeEvent(notice.cloud, notice.pool or "unknown"),))
    except (ray.exceptions.RayError, AttributeError) as e:  # an actor without metrics
        log.info("notice metric not recorded: %s", e)
    return True, tuple(peers), ""


def drain_for_notice(notice: PreemptionNotice, coordinators, *, gcs_client=None,
                     timeout_s: float = 5.0, clock: Callable[[], float] = time.time) -> DrainOutcome:
    """Both steps for a termination notice: every job's Coordinator first, then Ray's
    DrainNode.

    ``coordinators``: ``{job name: Coordinator}`` of the jobs on the cluster (a single
    handle counts as one job; None or empty: no training job runs, only Ray is told).
    ``coordinator_ok`` is True when every one was told; ``peers`` are all their draining
    peers; ``error`` names each that could not be told.
    """
    if notice.is_rebalance:
        raise ValueError("a rebalance recommendation is not drained; pass a termination notice")
    if coordinators is not None and not isinstance(coordinators, dict):
        coordinators = {"": coordinators}
    oks, peers, errors = [], [], []
    for job, coordinator in (coordinators or {}).items():
        ok, told, error = tell_coordinator(coordinator, notice, timeout_s=timeout_s, clock=clock)
        oks.append(ok)
        peers.extend(told)
        if error:
            errors.append(f"{job}: {error}" if job else error)
    error = "; ".join(errors) if oks else "no Coordinator"
    reason = f"spot {notice.action} notice from {notice.source}"
    ray_drain = drain_node(notice.node_id, notice.deadline_unix_s, reason,
                           gcs_client=gcs_client, timeout_s=timeout_s, clock=clock)
    return DrainOutcome(notice, bool(oks) and all(oks), tuple(peers), ray_drain, clock(), error)
