"""The Coordinator actor: ``CoordinatorCore`` (``cluster/coordinator/core.py``) on the head
node, plus plan pushes and Prometheus metrics.

A named, detached actor (``placement.COORDINATOR_NAME`` in namespace ``moshray``) that holds
the ``Membership`` and publishes ``RoundPlan``s. It keeps no tensors and does no I/O. It may
die: Ray restarts it (``max_restarts``) with empty memory, and the replicas rebuild it.
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings

import ray

from moshray.cluster import metrics, placement
from moshray.cluster.coordinator.core import CoordinatorCore
from moshray.cluster.coordinator.membership import MembershipConfig
from moshray.cluster.messages import RoundPlan
from moshray.cluster.coordinator.progress import ProgressReply, ProgressReport
from moshray.cluster.coordinator.step_profile import StepPhases, StepProfile


def _serialized(cls):
    """Wrap every public method of ``cls`` in one lock.

    The actor runs with ``max_concurrency`` > 1 so that a slow caller never queues the others,
    but the core's state is plain Python data: one lock makes each call atomic. No method
    blocks on a peer, so holding the lock is always short.
    """

    def wrap(fn):
        @functools.wraps(fn)
        def locked(self, *args, **kwargs):
            # One lock per instance, made on first use (dict.setdefault is atomic), so the
            # class itself holds nothing unpicklable.
            with self.__dict__.setdefault("_call_lock", threading.RLock()):
                return fn(self, *args, **kwargs)

        return locked

    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if not name.startswith("_"):
            setattr(cls, name, wrap(fn))
    return cls


@ray.remote
@_serialized
class Coordinator(CoordinatorCore):
    """Ray actor shell around ``CoordinatorCore``; create it with ``get_or_create``.

    Calls are serialized by one lock (see ``_serialized``).
    """

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    # -- metrics (see cluster/metrics/__init__.py) ---------------------------------------------------

    def __init__(self, *args, metrics_port: int | None = None,
                 metrics_host: str = metrics.LOOPBACK, prices: metrics.Prices | None = None,
                 **kwargs):
        """``metrics_port`` None: events are counted but not served; 0: the OS picks.
        Ray tells whether this process replaces one that died (``restarted``)."""
        with warnings.catch_warnings():  # Ray 2.60 warns about its own deprecated actor_id
            warnings.simplefilter("ignore")
            kwargs.setdefault("restarted",
                              ray.get_runtime_context().was_current_actor_reconstructed)
        super().__init__(*args, **kwargs)
        self.push_plan = self._push_plan
        self._rebalances_seen: set[str] = set()  # noticed nodes already in the histogram
        self.metrics = metrics.MetricsExporter(prices or metrics.Prices(), self.metrics_state)
        self.profile = StepProfile()  # the replicas' StepPhases (cluster/coordinator/step_profile.py)
        if metrics_port is not None:
            self.metrics.serve(metrics_host, metrics_port)

    @staticmethod
    def _push_plan(plan: RoundPlan) -> None:
        """Send ``plan`` to each participant (fire-and-forget: a dead one is the round's
        problem, its deadline bounds it; the plan also rides on report replies)."""
        for peer_id, handle in plan.handles:
            try:
                handle.receive_plan.remote(plan)
            except Exception:  # noqa: BLE001 - a handle of a dead actor; never block here
                pass

    def report(self, r: ProgressReport) -> ProgressReply:
        seen = len(self.progress.quarantine.records)
        reply = super().report(r)
        for q in self.progress.quarantine.records[seen:]:
            self.metrics.apply(metrics.QuarantineEvent(q.reason))
        return reply

    def record(self, events: tuple) -> int:
        """Count metrics events (fire-and-forget); bad ones are logged and skipped. A
        replica's ``StepPhases`` go to the step profile."""
        self._resolve_rebalances()
        phases = [e for e in events if isinstance(e, StepPhases)]
        for p in phases:
            self.profile.add(p)
        return len(phases) + self.metrics.apply_all(
            e for e in events if not isinstance(e, StepPhases))

    def step_profile(self, since_epoch: int = 0) -> dict:
        """Where the replicas' time went per global step after ``since_epoch`` (see
        ``StepProfile.summary``)."""
        return self.profile.summary(since_epoch)

    def metrics_address(self) -> str | None:
        """``host:port`` where ``/metrics`` is served (None if not served)."""
        if self.metrics.address is None:
            return None
        host, port = self.metrics.address
        if host in ("", "0.0.0.0", "::"):
            host = ray.util.get_node_ip_address()
        return f"{host}:{port}"

    def metrics_state(self) -> metrics.TrainingState:
        """The run as the exporter sees it at scrape time (also observes rebalance delays)."""
        self._resolve_rebalances()
        s = self.stats()
        return metrics.training_state(
            s["history"], now_s=self.clock() - self.started, live=s["live"],
            draining=s["draining"], epoch=s["epoch"], preemptions=s["preemptions"],
            live_experts=len(self.experts.locations()))

    def _resolve_rebalances(self) -> None:
        """Observe each notice's rebalance delay (``note_notice`` records) once."""
        for node_id, r in self.notices.items():
            if r.rebalance_s is not None and node_id not in self._rebalances_seen:
                self._rebalances_seen.add(node_id)
                self.metrics.apply(metrics.RebalanceEvent(r.rebalance_s))


def get_or_create(
    config: MembershipConfig | None = None, target_batch_size: int = 256, name: str | None = None,
    metrics_port: int | None = None, metrics_host: str = metrics.LOOPBACK,
    prices: metrics.Prices | None = None, step_grace_s: float = 2.0,
) -> ray.actor.ActorHandle:
    """The cluster's Coordinator: created detached on the head node on first call.

    With ``metrics_port`` (0: any free port) it serves Prometheus metrics on
    ``metrics_host``; ``metrics_address.remote()`` tells where. Ignored if it exists already.
    """
    # Restarted by Ray if its process dies; calls made meanwhile are retried once it is back
    # (a service that can be briefly away). It keeps nothing the replicas cannot rebuild:
    # they rejoin with their epoch (``rejoin``), experts re-register on an unknown heartbeat.
    return Coordinator.options(
        name=name or placement.COORDINATOR_NAME,
        namespace=placement.NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_concurrency=64,
        max_restarts=-1,
        max_task_retries=-1,
        **placement.on_head(),
    ).remote(config or MembershipConfig(), target_batch_size=target_batch_size,
             metrics_port=metrics_port, metrics_host=metrics_host, prices=prices,
             step_grace_s=step_grace_s)
