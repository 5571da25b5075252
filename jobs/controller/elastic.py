"""The elastic controller: the training job's driver, the same on every Ray cluster.

Each tick it *observes* (Ray's node table and drain state, the Coordinator's membership, the
replicas' run refs) into plain data, lets ``reconcile.decide`` compute the actions, and
*acts*: starts replicas pinned to their nodes (with a GPU where the node has them), stops
the ones to drop, records every replica's state transitions (``replica_states.py``), starts
a notice watcher on each worker node that joins (or uses the one the node already has),
asks Ray's autoscaler for capacity (``ray.autoscaler.sdk.request_resources``), and reports
nodes, losses, joins and replica states as metrics. At the end of the job the driver calls
``release_capacity`` (the request withdrawn) and ``stop_watchers`` (only the watchers this
controller started: a node's own ``moshray watch`` keeps watching for the next job). It
never asks whether the cluster is local: nodes come from outside (Ray's autoscaler and the
cloud, or the embedded cluster playing the cloud).

Failure behaviour: a failed call to Ray or the Coordinator during a tick is logged and the
tick is skipped (the next one observes again); with fewer than ``cluster.min_nodes`` nodes
and nothing training it prints one line and waits at most ``cluster.wait_for_nodes_s``,
then raises ``NoCapacityError``. A replica's ``UserError`` is raised at once; other errors
its loop raises are counted (``reconcile.py`` rule 6, ``training.max_failures``) and when
the policy fails the job ``step`` raises ``JobFailed`` carrying the user's exception with
its remote traceback; failed checkpoint saves are reported through ``checkpoint_saved``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

import ray

from moshray.actors.errors import find_user_error
from moshray.cluster import metrics

from moshray.jobs.controller.observations import (
    Memory,
    Observation,
    ReplicaError,
    ReplicaView,
    RunOutcome,
    node_view,
)
from moshray.jobs.controller.reconcile import (
    Decision,
    FailJob,
    NodeFailure,
    NodeJoined,
    NodeLost,
    Policy,
    ReplicaFailed,
    RequestCapacity,
    SetState,
    StartReplica,
    StopReplica,
    decide,
)
from moshray.jobs.controller.lease import (
    mark_job_watcher,
    release_watchers,
    request_capacity,
    withdraw_capacity,
)
from moshray.jobs.controller.replica_launch import ReplicaSpec, launch_replica
from moshray.jobs.controller.replica_states import ReplicaRecord, ReplicaState, end_line

log = logging.getLogger("moshray.controller")
RPC_TIMEOUT_S = 30.0


class NoCapacityError(RuntimeError):
    """No worker node came within ``cluster.wait_for_nodes_s``."""


class JobFailed(RuntimeError):
    """The failure policy ended the job (``reconcile.FailJob``). ``reason``: one line;
    ``error``: the exception the user's loop raised, as ``ray.get`` gave it (an instance of
    the user's exception class whose ``str()`` holds the remote traceback), or None when no
    replica error caused it (checkpoints failing). ``moshray.fit`` re-raises ``error``."""

    def __init__(self, reason: str, error: BaseException | None = None):
        super().__init__(reason)
        self.reason, self.error = reason, error

    def __reduce__(self):
        return (type(self), (self.reason, self.error))


def replica_error(exc: BaseException) -> ReplicaError:
    """The ``ReplicaError`` of what a replica's ``run()`` raised (``ray.get``'s
    ``RayTaskError``, whose ``cause`` is the user's exception when it unpickled)."""
    cause = getattr(exc, "cause", None) or exc
    message = " ".join(str(cause).split())
    return ReplicaError(type(cause).__name__, message[:500], str(exc))

def capacity_requested() -> tuple[dict, ...]:
    """The bundles standing in Ray's autoscaler from ``request_resources`` (any driver's; one
    dict per bundle), read back where Ray keeps them: the GCS's cluster resource constraint
    under autoscaler v2, the internal KV key the v1 monitor reads otherwise. Needs a
    connected driver; raises what Ray raises if the GCS does not answer."""
    import json

    from ray.autoscaler.v2.utils import is_autoscaler_v2

    if is_autoscaler_v2():
        from ray.autoscaler.v2.sdk import get_cluster_resource_state
        from ray.experimental.internal_kv import internal_kv_get_gcs_client

        cluster = get_cluster_resource_state(internal_kv_get_gcs_client())
        return tuple(dict(r.request.resources_bundle)
                     for c in cluster.cluster_resource_constraints
                     for r in c.resource_requests for _ in range(r.count))
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return tuple(json.loads(raw)) if raw else ()


class ElasticController:
    """Keeps replicas on the worker nodes Ray has; see the module docstring.

    ``spec`` is what every replica shares; ``experts`` (optional) is the ExpertSupervisor,
    registered with each node's watcher for the hand-off on a notice. ``clock`` is injected.
    ``lease`` (optional, ``jobs/controller/lease.py``): its keeper thread renews it with the
    job's state each tick publishes, so that the swarm outlives this driver and a later one
    can ``adopt`` it.
    """

    def __init__(self, config, spec: ReplicaSpec, experts=None, out=sys.stdout,
                 clock: Callable[[], float] = time.monotonic, lease=None):
        c = config.cluster
        self.config, self.spec, self.experts, self.out = config, spec, experts, out
        self.job = config.name or "unnamed"  # the job's name on the cluster
        self.coordinator = spec.coordinator
        t = config.training
        self.policy = Policy(c.min_nodes, c.max_nodes, c.replicas_per_node,
                             max_failures=t.max_failures,
                             max_checkpoint_failures=t.max_checkpoint_failures)
        self.clock = clock
        self.t0 = clock()
        self.records: dict[str, ReplicaRecord] = {}
        self.runs: dict[str, tuple[object, object]] = {}  # id -> (handle, run)
        self.outcomes: dict[str, RunOutcome] = {}
        self.known_nodes: dict[str, float] = {}
        self.failures: dict[str, tuple[int, float]] = {}
        self.errors: dict[str, tuple[ReplicaError, BaseException]] = {}  # replica -> its error
        self.job_failures: list[tuple[str, str, ReplicaError]] = []
        self.checkpoint_failures = 0  # in a row (the policy's bound)
        self.checkpoint_failures_total = 0
        self.requested: int | None = None
        self._asked = False  # a capacity request of this job may stand in Ray's autoscaler
        self.watchers: dict[str, object] = {}
        self.own_watchers: set[str] = set()  # nodes whose watcher this controller started
        self.hosts: set[str] = set()  # every machine (node address) seen alive
        # seconds since start of each node lost: the run's preemptions are counted here,
        # by the driver (``preemptions``), not by the Coordinator
        self.lost_at: list[float] = []
        self.joined_at: list[float] = []
        self.hard_losses = 0
        self.launches_deferred = 0  # replica starts put off: the lease did not record them
        self.waiting_since: float | None = None
        self._waiting_shown: tuple | None = None
        self._reported: tuple | None = None
        self.price_book = None  # autoscaler/clouds/prices.py PriceBook, made by the first _report
        self._cost_shown: tuple | None = None
        self._count = 0
        self._ticks = 0
        self.lease = lease
        self.last_checkpoint = 0  # the newest checkpoint's step (the driver sets it)
        # where checkpoints go now (the driver sets it when its durability guard switches)
        self.checkpoint_uri = config.checkpoint.uri
        self.keeper = None  # lease.LeaseKeeper, started by the first renew_lease

    # -- a swarm that outlives its driver (jobs/controller/lease.py) ----------------------------

    def adopt(self, record) -> list[str]:
        """Take over the replicas of ``record`` (a ``JobRecord`` whose driver is gone): each
        one still standing is watched through ``wait_run`` and re-enters the state machine
        at ``starting`` (the first tick moves it on to where it is); replica ids go on from
        the record's count. Returns the ids adopted."""
        from moshray.cluster.placement import NAMESPACE
        from moshray.jobs.controller.lease import replica_actor_name

        self._count = max(self._count, record.count)
        self.last_checkpoint = record.last_checkpoint
        adopted = []
        for replica_id, node_id, num_gpus in record.replicas:
            try:
                handle = ray.get_actor(replica_actor_name(record.run_id, replica_id),
                                       namespace=NAMESPACE)
            except ValueError:
                continue  # gone with its node meanwhile
            self.runs[replica_id] = (handle, handle.wait_run.remote())
            self.records[replica_id] = ReplicaRecord(replica_id, node_id, num_gpus,
                                                     self.clock() - self.t0)
            adopted.append(replica_id)
        self.own_watchers.update(record.own_watchers)
        return adopted

    def renew_lease(self) -> None:
        """Publish the job's state to the lease's keeper (``lease.LeaseKeeper``: its own
        thread renews the lease on schedule, whatever this loop is doing; started by the
        first call); raises ``JobFailed`` if a renewal found the lease ended (its reaper
        ended the swarm)."""
        if self.lease is None:
            return
        from moshray.jobs.controller import lease as leases

        if self.keeper is None:
            self.keeper = leases.LeaseKeeper(
                leases.ray_renewal(self.lease, RPC_TIMEOUT_S),
                leases.renew_interval(self.config.cluster.driver_lease_s))
        if self.keeper.ended:
            raise JobFailed("the job's lease ended (the swarm was stopped)")
        self.keeper.publish(self._job_state())

    def _job_state(self, launching: tuple = ()):
        """The lease's ``JobState``: the replicas not gone, plus ``launching`` ones."""
        from moshray.jobs.controller.lease import JobState

        replicas = tuple((r.replica_id, r.node_id, r.num_gpus)
                         for r in self.records.values() if not r.state.terminal)
        return JobState(replicas + tuple(launching), self._count,
                        tuple(sorted(self.own_watchers)), self.last_checkpoint,
                        self.checkpoint_uri)

    def move_checkpoints(self, uri: str | None) -> None:
        """Checkpoints go to ``uri`` from now on (the durability guard switched them): the
        lease's record says so at once (a renewal in this thread), so a lease that ends the
        swarm after this driver dies saves its final checkpoint there."""
        if uri == self.checkpoint_uri:
            return
        self.checkpoint_uri = uri
        if self.keeper is not None:
            self.keeper.renew_now(self._job_state())

    @property
    def stop_requested(self) -> bool:
        """``moshray stop`` asked this job to end (heard at a lease renewal)."""
        return self.keeper is not None and self.keeper.stop_requested

    def stop_renewing(self) -> None:
        """End the lease's keeper (before the driver releases the lease). Idempotent."""
        if self.keeper is not None:
            self.keeper.stop()

    # -- observe -----------------------------------------------------------------------------

    def _outcome(self, replica_id: str, run_ref) -> RunOutcome:
        if replica_id in self.outcomes:
            return self.outcomes[replica_id]
        ready, _ = ray.wait([run_ref], timeout=0)
        if not ready:
            return RunOutcome.RUNNING
        try:
            ray.get(run_ref, timeout=RPC_TIMEOUT_S)
            outcome = RunOutcome.FINISHED
        except ray.exceptions.RayTaskError as exc:
            user_error = find_user_error(exc)
            if user_error is not None:  # the same code fails on every node: stop the job
                raise user_error from None
            self.errors[replica_id] = (replica_error(exc), exc)
            log.warning("replica %s failed: %s", replica_id, self.errors[replica_id][0])
            outcome = RunOutcome.RAISED
        except ray.exceptions.RayError as exc:  # said once when it is gone (``end_line``)
            log.debug("replica %s lost: %s", replica_id, type(exc).__name__)
            outcome = RunOutcome.DIED
        self.outcomes[replica_id] = outcome
        return outcome

    def observe(self) -> Observation:
        from moshray.autoscaler.watch.drain import draining_nodes

        try:
            draining = frozenset(draining_nodes())
        except Exception as exc:  # noqa: BLE001 - drain state is an aid, the table decides
            log.info("drain state not read: %r", exc)
            draining = frozenset()
        nodes = tuple(node_view(row, draining) for row in ray.nodes())
        view = ray.get(self.coordinator.peer_view.remote(), timeout=RPC_TIMEOUT_S)
        members, ready = set(view["members"]), set(view["ready"])
        draining_peers = set(view["draining"])
        replicas = tuple(
            ReplicaView(rid, self._outcome(rid, run), rid in members, rid in ready,
                        rid in draining_peers, self.errors.get(rid, (None,))[0])
            for rid, (_, run) in self.runs.items())
        return Observation(self.clock() - self.t0, nodes, replicas,
                           frozenset(view["noticed_nodes"]))

    def memory(self) -> Memory:
        return Memory(
            replicas=tuple((r.replica_id, r.node_id, r.state.value, r.num_gpus)
                           for r in self.records.values() if not r.state.terminal),
            known_nodes=tuple(self.known_nodes.items()), failures=dict(self.failures),
            requested_nodes=self.requested,
            started_at_s={r.replica_id: r.started_at_s for r in self.records.values()},
            job_failures=tuple(self.job_failures),
            checkpoint_failures=self.checkpoint_failures)

    # -- act ---------------------------------------------------------------------------------

    def act(self, decision: Decision, obs: Observation) -> None:
        for action in decision.actions:
            try:
                self._apply(action, obs)
            except Exception as exc:  # noqa: BLE001 - one action's failure never stops the loop
                log.warning("controller action %r failed: %r", action, exc)
        self._report(obs)

    def _apply(self, action, obs: Observation) -> None:
        if isinstance(action, StartReplica):
            self._start(action, obs)
        elif isinstance(action, SetState):
            record = self.records[action.replica_id]
            record.to(action.state, obs.now_s, action.reason)
            if action.state is ReplicaState.GONE:
                log.info("%s", end_line(record))  # the replica's end, once, in the run's words
                self.coordinator.leave.remote(action.replica_id)
                handle = self.runs.pop(action.replica_id, (None,))[0]
                if handle is not None:  # a run that ended leaves its actor idle: remove it
                    ray.kill(handle, no_restart=True)
        elif isinstance(action, StopReplica):
            handle = self.runs.get(action.replica_id, (None,))[0]
            log.info("stopping replica %s: %s", action.replica_id, action.reason)
            self.coordinator.leave.remote(action.replica_id)
            if handle is not None:
                ray.kill(handle, no_restart=True)
        elif isinstance(action, NodeJoined):
            self._joined(action.node_id, obs)
        elif isinstance(action, NodeLost):
            self._lost(action, obs)
        elif isinstance(action, ReplicaFailed):
            self.job_failures.append((action.replica_id, action.node_id, action.error))
            self.coordinator.record.remote((metrics.JobFailureEvent("replica"),))
            print(f"replica {action.replica_id} failed (failure {len(self.job_failures)} of "
                  f"the job; training.max_failures={self.policy.max_failures}): "
                  f"{action.error}", file=self.out, flush=True)
        elif isinstance(action, FailJob):
            pass  # raised by step() once every other action is carried out
        elif isinstance(action, NodeFailure):
            count, _ = self.failures.get(action.node_id, (0, 0.0))
            self.failures[action.node_id] = (count + 1, obs.now_s)
        elif isinstance(action, RequestCapacity):
            from moshray.cluster.placement import SPOT_RESOURCE

            # One bundle per wanted worker node: every worker declares the spot market
            # resource (1000 units), so no two bundles fit on one node. Ray is asked for
            # every job's bundles together (request_capacity).
            self._asked = True  # withdrawn at the end (release_capacity), even if this fails
            request_capacity(self.job, [{SPOT_RESOURCE: 1000}] * action.nodes)
            self.requested = action.nodes

    def _start(self, action: StartReplica, obs: Observation) -> None:
        self._count += 1
        node = obs.node(action.node_id)
        label = node.slot if node is not None and node.slot is not None else action.node_id[:8]
        replica_id = f"replica-{label}-{self._count}"
        if self.keeper is not None:  # in the lease's record before it exists: a driver that
            # dies right after the launch leaves it to the lease (ended or adopted by name)
            if not self.keeper.renew_now(self._job_state(
                    ((replica_id, action.node_id, action.num_gpus),))):
                # Not on record: launched now, it could outlive this driver unseen by the
                # lease (never ended, never adopted). The next tick decides again (a lease
                # that ended raises JobFailed there).
                self.keeper.publish(self._job_state())
                self.launches_deferred += 1
                log.warning("replica %s not launched on node %s: the lease did not take it "
                            "in its record (%d launch(es) deferred so far)", replica_id,
                            action.node_id[:12], self.launches_deferred)
                return
        try:
            handle, run = launch_replica(self.spec, replica_id, action.node_id,
                                         action.num_gpus)
        except Exception:
            if self.keeper is not None:  # not launched: not in the record either
                self.keeper.publish(self._job_state())
            raise
        self.runs[replica_id] = (handle, run)
        self.records[replica_id] = ReplicaRecord(replica_id, action.node_id, action.num_gpus,
                                                 obs.now_s)
        log.info("replica %s starting on node %s (%s GPU)", replica_id, action.node_id[:12],
                 action.num_gpus)

    def _joined(self, node_id: str, obs: Observation) -> None:
        from moshray.autoscaler.watch.watcher import open_watcher
        from moshray.autoscaler.watch.config import WatcherConfig

        self.known_nodes[node_id] = obs.now_s
        if self._ticks > 0:  # nodes there at the first look are the start, not joins
            self.joined_at.append(obs.now_s)
        node = obs.node(node_id)
        market = "on_demand" if node is not None and node.market.value == "on-demand" \
            else "spot"
        self.coordinator.record.remote((metrics.NodeJoinedEvent(market),))
        # A node may have its own watcher already (`moshray watch` on an infra/ node, or a
        # watcher fleet's): it is used, never stopped by this job (see stop_watchers).
        opened = open_watcher(node_id, WatcherConfig(
            source=self.config.cluster.notice_source, poll_s=0.25,
            rpc_timeout_s=RPC_TIMEOUT_S))
        watcher = opened.actor
        self.watchers[node_id] = watcher
        if opened.created:
            self.own_watchers.add(node_id)
            if self.lease is not None:
                mark_job_watcher(node_id)
        if self.experts is not None:
            watcher.register.remote(self.experts, "experts")

    def _lost(self, action: NodeLost, obs: Observation) -> None:
        self.known_nodes.pop(action.node_id, None)
        self.watchers.pop(action.node_id, None)
        self.own_watchers.discard(action.node_id)
        self.lost_at.append(obs.now_s)
        self.hard_losses += int(not action.with_notice)
        self.coordinator.record.remote((metrics.NodeLostEvent(action.with_notice),))
        log.info("node %s lost (%s notice)", action.node_id[:12],
                 "with" if action.with_notice else "without")

    def _report(self, obs: Observation) -> None:
        """Capacity (with each live worker's price) and replica states as metrics events,
        when they change; a log line when the cost or its sources change.

        Prices come from ``self.price_book`` (made from ``config.metrics`` on first use, or
        injected): per node from its labels, the cloud's live price, the shipped table or
        the configured price; it reads the cloud at most once per TTL and never raises for
        a price (a failure falls back and is logged once)."""
        from moshray.autoscaler.clouds.prices import NodeKey, PriceBook

        workers = [n for n in obs.nodes if n.alive and n.worker]
        spot = sum(1 for n in workers if n.market.value == "spot")
        counts = tuple((s.value, sum(1 for r in self.records.values() if r.state is s))
                       for s in ReplicaState if not s.terminal)
        if self.price_book is None:
            self.price_book = PriceBook.for_config(getattr(self.config, "metrics", None),
                                                   self.clock)
        priced = self.price_book.prices([NodeKey(n.cloud, n.market.value, n.instance_type,
                                                 n.zone) for n in workers])
        node_prices = tuple(("spot" if n.market.value == "spot" else "on_demand",
                             p.dollars_per_hour, p.source.value)
                            for n, p in zip(workers, priced))
        now = (spot, len(workers) - spot, counts, node_prices)
        if now != self._reported:
            self._reported = now
            self.coordinator.record.remote((
                metrics.CapacityEvent(spot, len(workers) - spot, node_prices),
                metrics.ReplicaStatesEvent(counts)))
        sources = tuple(sorted({(p.source.value, sum(1 for q in priced if q.source is p.source))
                                for p in priced}))
        cost = (round(sum(p.dollars_per_hour for p in priced), 4), sources)
        if workers and cost != self._cost_shown:
            self._cost_shown = cost
            log.info("cost: %d worker nodes at $%.4f/h (prices from %s)", len(workers), cost[0],
                     ", ".join(f"{source}: {n}" for source, n in sources))

    # -- the loop ----------------------------------------------------------------------------

    def step(self) -> Decision | None:
        """One observe -> decide -> act tick (the lease renewed first); None if the
        observation failed."""
        self.renew_lease()
        try:
            obs = self.observe()
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("controller: observation failed (%s); next tick", type(exc).__name__)
            return None
        self.hosts.update(n.address for n in obs.nodes if n.alive and n.address)
        decision = decide(obs, self.memory(), self.policy)
        self.act(decision, obs)
        self._ticks += 1
        if decision.failed is not None:
            failed = decision.failed
            error = self.errors.get(failed.replica_id or "", (None, None))[1]
            raise JobFailed(failed.reason, error)
        self._wait_bound(decision, obs)
        return decision

    def _wait_bound(self, decision: Decision, obs: Observation) -> None:
        waiting = decision.waiting
        if waiting is None:
            self.waiting_since = None
            self._waiting_shown = None
            return
        if self.waiting_since is None:
            self.waiting_since = obs.now_s
        shown = (waiting.active, waiting.needed)
        if shown != self._waiting_shown:
            self._waiting_shown = shown
            print(f"waiting for worker nodes: {waiting.active} of at least {waiting.needed} "
                  f"(asked Ray's autoscaler for {self.policy.max_nodes}; giving up after "
                  f"{self.config.cluster.wait_for_nodes_s:.0f} s)", file=self.out, flush=True)
        if obs.now_s - self.waiting_since > self.config.cluster.wait_for_nodes_s:
            raise NoCapacityError(
                f"no worker node came within cluster.wait_for_nodes_s="
                f"{self.config.cluster.wait_for_nodes_s:g} s ({waiting.active} of at least "
                f"{waiting.needed}); check the autoscaler's logs (ray status) or start nodes "
                f"with the 'spot' resource")

    def checkpoint_saved(self, ok: bool) -> None:
        """Count one checkpoint save (``ok``: it was written); a failure is a metrics event
        and counts toward ``training.max_checkpoint_failures`` in a row (the next ``step``
        fails the job at the bound)."""
        if ok:
            self.checkpoint_failures = 0
            return
        self.checkpoint_failures += 1
        self.checkpoint_failures_total += 1
        try:
            self.coordinator.record.remote((metrics.JobFailureEvent("checkpoint"),))
        except Exception as exc:  # noqa: BLE001 - a metric never stops the job
            log.info("checkpoint failure not recorded: %r", exc)

    def prices(self) -> dict | None:
        """The cost at the last report that had worker nodes, for the run's summary:
        ``{"dollars_per_hour": the nodes' total, "sources": {price source: nodes}}``
        (``autoscaler/clouds/prices.py`` PriceSource: ``provider``, the cloud's live price;
        ``table``, the shipped table; ``config``, the configured price); None if no worker
        node was ever priced."""
        if self._cost_shown is None:
            return None
        total, sources = self._cost_shown
        return {"dollars_per_hour": total, "sources": dict(sources)}

    def live(self) -> list[tuple[str, object, object]]:
        """``(replica_id, handle, run_ref)`` of every replica not gone."""
        return [(rid, h, run) for rid, (h, run) in self.runs.items()]

    @property
    def preemptions(self) -> int:
        """Worker nodes lost so far (with a notice or without): the summary's count."""
        return len(self.lost_at)

    def leaving(self) -> set[str]:
        return {r.replica_id for r in self.records.values()
                if r.state is ReplicaState.LEAVING}

    def states(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records.values():
            out[r.state.value] = out.get(r.state.value, 0) + 1
        return out

    def timelines(self) -> dict[str, list[tuple[str, float]]]:
        """Per replica: ``(state, seconds since the controller started)`` from its start
        through each transition (for run reports and benchmarks)."""
        return {r.replica_id: [(ReplicaState.STARTING.value, round(r.started_at_s, 2))]
                + [(t.dst.value, round(t.at_s, 2)) for t in r.history]
                for r in self.records.values()}

    # -- the end of the job: nothing left running, nothing requested ----------------------------

    def stop_watchers(self, timeout_s: float = 10.0) -> None:
        """Stop and remove the watchers this controller started (their names are free for
        the next job) unless another job runs (with a lease, jobs share them:
        ``lease.release_watchers``); a watcher it found on a node (the node's own ``moshray
        watch``, an earlier or other driver's) keeps running. Bounded by ``timeout_s``; each failure is
        logged."""
        from moshray.autoscaler.watch.watcher import close_watchers

        own = {n: w for n, w in self.watchers.items() if n in self.own_watchers}
        if self.lease is None:
            close_watchers(own, timeout_s)
        else:  # jobs share the watchers they start: the last job to end removes them
            try:
                release_watchers(self.job, own, timeout_s)
            except Exception as exc:  # noqa: BLE001 - on every exit path: logged
                log.warning("watchers not released: %r", exc)
        for node_id in own:
            self.watchers.pop(node_id, None)
        self.own_watchers.clear()

    def release_capacity(self) -> None:
        """Withdraw this job's share of the request to Ray's autoscaler (Ray is asked for the
        other jobs' bundles only, ``withdraw_capacity``), so Ray keeps no node for a job that
        ended. Does nothing if this controller never asked; idempotent. A failure is logged,
        never raised (it runs on every exit path, errors included)."""
        if not self._asked:
            return
        try:
            withdraw_capacity(self.job)
        except Exception as exc:  # noqa: BLE001 - on an error path: never hide the first error
            log.warning("capacity request not withdrawn (%r); Ray's autoscaler may keep up to "
                        "%s nodes until the next job asks", exc, self.requested)
            return
        self._asked = False
        self.requested = 0
        log.info("capacity request withdrawn")

    def stop_replicas(self) -> None:
        """Kill every replica not yet gone, without the graceful stop (the job's error path:
        nothing is left running). Each failure is logged."""
        for replica_id, (handle, _) in list(self.runs.items()):
            try:
                ray.kill(handle, no_restart=True)
            except ray.exceptions.RayError as exc:
                log.info("replica %s not killed: %r", replica_id, exc)
        self.runs.clear()
