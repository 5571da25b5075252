"""The Coordinator actor: ``CoordinatorCore`` (``cluster/coordinator/core.py``: the steps,
notices, data-shard and expert services) plus the metrics sink (``metrics_sink.py``), plan
pushes and the state kept in Ray's GCS (``durable.py``), on the head node.

A named, detached actor (``placement.coordinator_name(job)`` in namespace ``moshray``, one per
training job) that holds the ``Membership`` and publishes ``RoundPlan``s (each participant
is sent its own ``PeerPlan``, its part of the plan). Its metrics carry
``job=<name>`` and, when served, are announced to the head's Prometheus by a file-based
service-discovery target (``<MOSHRAY_PROMETHEUS_SD_DIR>/<job>.json``, default
``/tmp/moshray/prometheus``; ``infra/prometheus/prometheus.yml`` reads that directory). It keeps no tensors. It may die: Ray
restarts it (``max_restarts=-1``) with the same constructor arguments, among them the key
of its state in the GCS key-value store, from which it restores what the summary, the
plans and the quarantine need; the replicas rebuild membership and the epoch.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import threading
import uuid
import warnings
from collections.abc import Mapping

import ray

from moshray.cluster import metrics, placement
from moshray.cluster.coordinator.core import CoordinatorCore
from moshray.cluster.coordinator.durable import DurableState, GcsKV
from moshray.cluster.coordinator.membership import MembershipConfig
from moshray.cluster.coordinator.metrics_sink import MetricsSink
from moshray.cluster.coordinator.progress import ProgressReply, ProgressReport
from moshray.cluster.messages import PeerPlan, RoundPlan

log = logging.getLogger(__name__)
SD_DIR_ENV = "MOSHRAY_PROMETHEUS_SD_DIR"
SD_DIR = "/tmp/moshray/prometheus"


def sd_file(job: str) -> str:
    """Where job ``job``'s Coordinator announces its exporter to Prometheus (file_sd)."""
    return os.path.join(os.environ.get(SD_DIR_ENV, SD_DIR), f"{job}.json")


def write_sd_target(job: str, address: tuple[str, int]) -> str | None:
    """``[{"targets": ["host:port"], "labels": {"job": job}}]`` to ``sd_file(job)``,
    atomically (Prometheus may read it at any time); returns the path, or None (logged) if
    it cannot be written (metrics are still served)."""
    path = sd_file(job)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump([{"targets": [f"{address[0]}:{address[1]}"], "labels": {"job": job}}], f)
        os.replace(tmp, path)
        return path
    except OSError as exc:
        log.warning("Prometheus target of job %s not written (%s)", job, exc)
        return None


def remove_sd_target(job: str) -> None:
    try:
        os.unlink(sd_file(job))
    except OSError:
        pass


def _serialized(cls):
    """Wrap every public method of ``cls`` in one lock, and save the state it changed
    (``Coordinator._after_call``) before its reply leaves.

    The actor runs with ``max_concurrency`` > 1 so that a slow caller never queues the others,
    but the core's state is plain Python data: one lock makes each call atomic. No method
    blocks on a peer, so holding the lock is always short.
    """

    def wrap(fn):
        @functools.wraps(fn)
        def locked(self, *args, **kwargs):
            # One lock per instance, made on first use (dict.setdefault is atomic), so the
            # class itself holds nothing unpicklable.
            lock = self.__dict__.setdefault("_call_lock", threading.RLock())
            with lock:
                outer = not self.__dict__.get("_in_call")  # a nested call saves nothing
                self._in_call = True
                try:
                    return fn(self, *args, **kwargs)
                finally:
                    if outer:
                        self._in_call = False
                        self._after_call()

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

    def _node_zone(self, node_id: str) -> str:
        """``node_id``'s zone label in Ray's node table (``placement.ZONE_LABEL``), read when
        an unknown node appears; "" when the node has none or the table cannot be read (the
        grid is then zone-blind for that peer, never wrong)."""
        if node_id not in self._zones:
            try:  # one read of the table caches every node in it (rejoins come in a burst)
                self._zones.update(
                    {n["NodeID"]: str((n.get("Labels") or {}).get(placement.ZONE_LABEL, ""))
                     for n in ray.nodes()})
            except Exception as exc:  # noqa: BLE001 - a zone is an optimisation
                log.warning("node table not read for zones: %r", exc)
                return ""
        return self._zones.get(node_id, "")

    def __init__(self, *args, metrics_port: int | None = None,
                 metrics_host: str = metrics.LOOPBACK, prices: metrics.Prices | None = None,
                 state_key: str | None = None, job: str | None = None, **kwargs):
        """``metrics_port`` None: events are counted but not served; 0: the OS picks.
        ``state_key``: where the state is kept in the GCS (None: nowhere, a restart
        forgets). ``job``: the training job's name (the ``job`` label of every series, and
        its Prometheus target file). Ray tells whether this process replaces one that died
        (``restarted``)."""
        with warnings.catch_warnings():  # Ray 2.60 warns about its own deprecated actor_id
            warnings.simplefilter("ignore")
            kwargs.setdefault("restarted",
                              ray.get_runtime_context().was_current_actor_reconstructed)
        if state_key:
            kwargs["store"] = DurableState(GcsKV(), state_key)
        super().__init__(*args, **kwargs)
        # (plan, its views) made during a call, pushed after its save
        self._plans: list[tuple[RoundPlan, Mapping[str, PeerPlan]]] = []
        self.push_plan = lambda plan, views: self._plans.append((plan, views))
        self._zones: dict[str, str] = {}
        self.zone_of = self._node_zone
        self.job = job
        self.sink = MetricsSink(prices or metrics.Prices(), self.metrics_state,
                                labels={"job": job} if job else None)
        if self.store is not None:
            snap = self.store.load_record("sink")
            if snap is not None:
                profiled = int((self.store.load_record("profile") or {}).get("profiled", 0))
                self.sink.restore({**snap, "profiled": profiled}, self.store.load_profile(
                    profiled, self.sink.profile.steps.maxlen))
        self._after_call()
        if metrics_port is not None:
            self.sink.serve(metrics_host, metrics_port)
            if job:
                write_sd_target(job, self.sink.address)

    def _after_call(self) -> None:
        """Save what the call changed, then push the plans it made: a plan never reaches a
        replica before the step it starts is on record."""
        if self.store is not None:
            self._in_call = True  # the methods called here save nothing themselves
            try:
                self.save()
                now = self.clock()
                self.store.save_record("sink", self.sink.snapshot())
                if self.store.sync_profile(self.sink.profile.steps, self.sink.profiled,
                                           self.sink.profile.steps.maxlen, now):
                    self.store.save_record("profile", {"profiled": self.sink.profiled})
            except Exception as exc:  # noqa: BLE001 - the GCS is away: keep serving, retry
                log.warning("Coordinator state not saved (%s): retried at the next call",
                            type(exc).__name__)
            finally:
                self._in_call = False
        plans, self._plans[:] = list(self._plans), []
        for plan, views in plans:
            self._push(plan, views)

    @staticmethod
    def _push(plan: RoundPlan, views: Mapping[str, PeerPlan]) -> None:
        """Send each participant its view of ``plan`` (its groups and their members'
        handles: O(N) bytes for the whole plan; fire-and-forget: a dead one is the round's
        problem, its deadline bounds it; the view also rides on report replies)."""
        for peer_id, handle in plan.handles:
            try:
                handle.receive_plan.remote(views[peer_id])
            except Exception:  # noqa: BLE001 - a handle of a dead actor; never block here
                pass

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def report(self, r: ProgressReport) -> ProgressReply:
        reply = super().report(r)
        self.sink.observe_quarantines(self.progress.quarantine.records)
        return reply

    def stats(self, since: int = 0) -> dict:
        """``CoordinatorCore.stats`` plus ``preemptions``: the node losses the driver
        reported (``NodeLostEvent``), kept over restarts; ``allreduce_sent_bytes`` and
        ``cross_zone_bytes``: what the replicas' averaging sent, all and to another zone
        (their ``RoundEvent``s). The driver's own count is the
        summary's. ``data_position``: every data shard below it was handed out (what
        ``training.max_epochs`` counts)."""
        return {**super().stats(since), "preemptions": self.sink.nodes_lost,
                "allreduce_sent_bytes": self.sink.sent_bytes,
                "cross_zone_bytes": self.sink.cross_zone_bytes,
                "data_position": self.shards.position()}

    # -- the metrics sink (cluster/coordinator/metrics_sink.py) -------------------------------

    def record(self, events: tuple) -> int:
        """Count metrics events (fire-and-forget); bad ones are logged and skipped. A
        replica's ``StepPhases`` go to the step profile."""
        self.sink.observe_rebalances(self.notices)
        return self.sink.record(events)

    def reported(self, since: int = 0) -> tuple[int, list]:
        """What training loops reported (``MetricsSink.reported``): ``(total, rows)`` after
        the first ``since`` rows, each ``(peer, name, step, value)``."""
        return self.sink.reported(since)

    def step_profile(self, since_epoch: int = 0) -> dict:
        """Where the replicas' time went per global step after ``since_epoch`` (see
        ``StepProfile.summary``)."""
        return self.sink.step_profile(since_epoch)

    def metrics_address(self) -> str | None:
        """``host:port`` where ``/metrics`` is served (None if not served)."""
        if self.sink.address is None:
            return None
        host, port = self.sink.address
        if host in ("", "0.0.0.0", "::"):
            host = ray.util.get_node_ip_address()
        return f"{host}:{port}"

    def metrics_state(self) -> metrics.TrainingState:
        """The run as the exporter sees it at scrape time (also observes rebalance delays).
        Called by the exporter's HTTP thread (under the call lock, as every method)."""
        self.sink.observe_rebalances(self.notices)
        s = self.stats()
        return metrics.training_state(
            s["history"], now_s=s["now_s"], live=s["live"], draining=s["draining"],
            epoch=s["epoch"], preemptions=s["preemptions"],
            live_experts=len(self.experts.locations()))

    def forget_state(self) -> None:
        """Delete the state kept in the GCS and the Prometheus target file (the job is over;
        a restart after this starts empty)."""
        if self.job:
            remove_sd_target(self.job)
        if self.store is not None:
            self.store.clear()
            self.store = None


def get_or_create(
    config: MembershipConfig | None = None, target_batch_size: int = 256, name: str | None = None,
    metrics_port: int | None = None, metrics_host: str = metrics.LOOPBACK,
    prices: metrics.Prices | None = None, step_grace_s: float = 2.0,
    local_steps: int | None = None, job: str | None = None,
) -> ray.actor.ActorHandle:
    """The cluster's Coordinator: created detached on the head node on first call.
    ``local_steps``: local SGD's local steps between averages (None: collaborative steps of
    ``target_batch_size`` samples; ``progress.step_due``).

    With ``metrics_port`` (0: any free port) it serves Prometheus metrics on
    ``metrics_host``; ``metrics_address.remote()`` tells where. Ignored if it exists already.
    """
    # Restarted by Ray if its process dies; calls made meanwhile are retried once it is back
    # (a service that can be briefly away). Its state is kept under ``state_key`` in the GCS
    # (a new key per Coordinator created: a new job starts empty; a restart reuses it).
    name = name or placement.COORDINATOR_NAME
    return Coordinator.options(
        name=name,
        namespace=placement.NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_concurrency=64,
        max_restarts=-1,
        max_task_retries=-1,
        **placement.on_head(),
    ).remote(config or MembershipConfig(), target_batch_size=target_batch_size,
             metrics_port=metrics_port, metrics_host=metrics_host, prices=prices,
             step_grace_s=step_grace_s, local_steps=local_steps, job=job,
             state_key=f"{name}/{uuid.uuid4().hex}")


def remove(coordinator, timeout_s: float = 10.0) -> None:
    """End ``coordinator`` for good: its state in the GCS is deleted first (a restart after
    this would start empty), then the actor is killed without restart. Raises what Ray
    raises if it cannot be killed; a state that could not be deleted is only logged."""
    try:
        ray.get(coordinator.forget_state.remote(), timeout=timeout_s)
    except (ray.exceptions.RayError, TimeoutError, AttributeError) as exc:
        log.warning("Coordinator state not deleted (%s)", type(exc).__name__)
    ray.kill(coordinator, no_restart=True)


def forget_saved_states(name: str = placement.COORDINATOR_NAME) -> None:
    """Delete every state saved by Coordinators named ``name`` (one job's left-overs, when a
    new job replaces an earlier one). Needs a connected driver."""
    GcsKV().delete_prefix(f"{name}/")
