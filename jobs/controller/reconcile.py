"""The elastic controller's policy: ``decide(observation, memory, policy) -> Decision``. Pure.

No Ray calls, no clock: everything comes in as plain data (``jobs/controller/observations.py``) and
goes out as typed actions that the controller's shell (``jobs/controller/elastic.py``) carries out.
Modelled on Ray autoscaler v2's reconciler: what *is* (Ray's node table, the Coordinator's
membership, the replicas' run refs) is compared with what *should be* (one replica per
worker node, or one per GPU, on at most ``max_nodes`` nodes; a watcher on every worker
node; Ray's autoscaler asked for ``max_nodes`` spot nodes), and the difference becomes
actions.

Rules, in order:

1. Nodes. A worker node seen alive for the first time is *joined*: it gets a watcher. A
   known node that is gone from the table or dead is *lost* (with notice if the Coordinator
   got a notice for it or Ray was draining it), once.
2. Replicas. Each live replica's state follows what is observed (``replica_states.py``):
   its run ended -> gone (a failure while its node is up is counted against the node);
   its node gone -> gone; its node noticed or draining -> leaving (stopped at once if it
   is not ready yet: starting or syncing); ready -> training; a member not ready ->
   syncing. A replica stuck starting past ``start_timeout_s`` is stopped. A replica on a
   node beyond ``max_nodes`` is stopped (leaving).
3. Placement. Eligible nodes are alive, worker, not draining nor noticed; the first
   ``max_nodes`` of them in the order they joined are *active*. Each active node gets
   ``replicas_per_node`` replicas (0: one per whole GPU on a GPU node, one on a CPU
   node), each with one GPU on a GPU node (a share of them if more replicas than GPUs).
   A node whose replicas failed (raised, or died while the node was still listed alive)
   ``max_failures_per_node`` times gets no more; after any failure it waits
   ``failure_backoff_s`` (long enough for Ray to declare a dying node dead).
4. Capacity. Ray's autoscaler is asked for ``max_nodes`` worker nodes (once; again only
   if the number changes). The shell withdraws the request when the job ends.
5. Waiting. With fewer than ``min_nodes`` active nodes and no replica training, the
   decision says it waits for nodes (the shell bounds the wait).
6. Failures (Ray Train's ``FailureConfig(max_failures)``, made elastic). A replica whose
   ``run()`` raised (anything but a ``UserError``, which the shell raises at once) is a
   job failure (``ReplicaFailed``); a replica that *died* (its node or process killed) is
   the elasticity's business and is not. The job fails (``FailJob``, and nothing new is
   started or asked for) when: the same error (class and message) came from
   ``same_failure_nodes`` distinct nodes (the code or the data is wrong, not a machine:
   fail fast); or more than ``max_failures`` replicas raised across the job; or
   ``max_checkpoint_failures`` checkpoint saves failed in a row; or no replica is left and
   every active node reached ``max_failures_per_node`` (the job would otherwise idle, its
   nodes paid for, forever).
"""

from __future__ import annotations

from dataclasses import dataclass

from moshray.jobs.controller.observations import Memory, Observation, ReplicaError, RunOutcome
from moshray.jobs.controller.replica_states import ReplicaState, path_between

S = ReplicaState


@dataclass(frozen=True)
class Policy:
    """The settings ``decide`` follows (from ``cluster.*`` of the job's config)."""

    min_nodes: int = 1
    max_nodes: int = 4
    replicas_per_node: int = 0  # 0: one per GPU (GPU node) or one (CPU node)
    max_failures_per_node: int = 3
    failure_backoff_s: float = 15.0
    start_timeout_s: float = 600.0
    max_failures: int = 3  # replicas that raised, across the job, before it fails
    same_failure_nodes: int = 2  # the same error from this many nodes fails the job at once
    max_checkpoint_failures: int = 3  # failed saves in a row before the job fails

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"need 1 <= min_nodes <= max_nodes, got {self.min_nodes}, "
                             f"{self.max_nodes}")
        if self.replicas_per_node < 0:
            raise ValueError(f"replicas_per_node must be >= 0, got {self.replicas_per_node}")
        if self.max_failures < 0:
            raise ValueError(f"max_failures must be >= 0, got {self.max_failures}")
        if self.same_failure_nodes < 1 or self.max_checkpoint_failures < 1:
            raise ValueError(f"same_failure_nodes and max_checkpoint_failures must be >= 1, "
                             f"got {self.same_failure_nodes}, {self.max_checkpoint_failures}")


# -- actions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartReplica:
    """Start a replica pinned to ``node_id`` (node affinity, not soft) with ``num_gpus``."""

    node_id: str
    num_gpus: float


@dataclass(frozen=True)
class StopReplica:
    replica_id: str
    reason: str


@dataclass(frozen=True)
class SetState:
    """Record ``replica_id``'s transition to ``state`` (one edge of the table)."""

    replica_id: str
    state: ReplicaState
    reason: str


@dataclass(frozen=True)
class NodeJoined:
    """A worker node seen for the first time: start its notice watcher."""

    node_id: str


@dataclass(frozen=True)
class NodeLost:
    node_id: str
    with_notice: bool


@dataclass(frozen=True)
class NodeFailure:
    """A replica failed on ``node_id`` while the node stayed up (counted for backoff)."""

    node_id: str


@dataclass(frozen=True)
class RequestCapacity:
    """Ask Ray's autoscaler for ``nodes`` worker nodes (``request_resources``)."""

    nodes: int


@dataclass(frozen=True)
class WaitForNodes:
    """Not enough nodes to train: ``active`` of the ``needed`` minimum."""

    active: int
    needed: int


@dataclass(frozen=True)
class ReplicaFailed:
    """``replica_id``'s ``run()`` raised ``error`` on ``node_id``: one job failure
    (the shell remembers it in ``Memory.job_failures``)."""

    replica_id: str
    node_id: str
    error: ReplicaError


@dataclass(frozen=True)
class FailJob:
    """The job ends: ``reason`` says why in one line; ``replica_id`` is the replica whose
    error the driver re-raises (None: no replica error, e.g. checkpoints failing)."""

    reason: str
    replica_id: str | None = None


Action = (StartReplica | StopReplica | SetState | NodeJoined | NodeLost | NodeFailure
          | RequestCapacity | WaitForNodes | ReplicaFailed | FailJob)


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    active_nodes: tuple[str, ...]  # nodes that should hold replicas, in join order

    def of(self, kind: type) -> tuple:
        return tuple(a for a in self.actions if isinstance(a, kind))

    @property
    def waiting(self) -> WaitForNodes | None:
        found = self.of(WaitForNodes)
        return found[0] if found else None

    @property
    def failed(self) -> FailJob | None:
        found = self.of(FailJob)
        return found[0] if found else None


# -- the decision ----------------------------------------------------------------------------


def replicas_wanted(gpus: float, replicas_per_node: int) -> tuple[int, float]:
    """``(replicas, gpus each)`` for a node with ``gpus`` GPUs."""
    whole = int(gpus)
    if replicas_per_node == 0:
        return (whole, 1.0) if whole >= 1 else (1, 0.0)
    if whole >= 1:
        return replicas_per_node, min(1.0, gpus / replicas_per_node)
    return replicas_per_node, 0.0


def _nodes(obs: Observation, memory: Memory) -> tuple[list, set[str]]:
    """Node join/loss actions, and the set of known nodes that are still alive."""
    actions: list = []
    known = dict(memory.known_nodes)
    alive_workers = {n.node_id for n in obs.nodes if n.alive and n.worker}
    for node_id in sorted(known):
        if node_id not in alive_workers:
            view = obs.node(node_id)
            noticed = node_id in obs.noticed_nodes or (view is not None and view.draining)
            actions.append(NodeLost(node_id, with_notice=noticed))
    for n in obs.nodes:
        if n.alive and n.worker and n.node_id not in known:
            actions.append(NodeJoined(n.node_id))
    return actions, alive_workers


def _active(obs: Observation, memory: Memory, policy: Policy) -> tuple[str, ...]:
    """Eligible nodes in the order they joined (new ones last, by id), the first max_nodes."""
    first_seen = dict(memory.known_nodes)
    eligible = [n for n in obs.nodes if n.alive and n.worker and not n.draining
                and n.node_id not in obs.noticed_nodes]
    eligible.sort(key=lambda n: (first_seen.get(n.node_id, obs.now_s), n.node_id))
    return tuple(n.node_id for n in eligible[:policy.max_nodes])


def _replica_target(view, node, noticed: bool) -> tuple[ReplicaState, str]:
    """The state a replica should be in, from its run ref, its node and the Coordinator."""
    if view is not None and view.outcome is not RunOutcome.RUNNING:
        return S.GONE, f"run {view.outcome.value}"
    if node is None or not node.alive:
        return S.GONE, "node lost"
    if noticed or node.draining or (view is not None and view.draining):
        return S.LEAVING, "node noticed" if noticed else "node draining"
    if view is not None and view.ready:
        return S.TRAINING, "ready"
    if view is not None and view.member:
        return S.SYNCING, "syncing"
    return S.STARTING, "starting"


def decide(obs: Observation, memory: Memory, policy: Policy) -> Decision:
    """See the module docstring. Pure: same inputs, same decision."""
    actions, _ = _nodes(obs, memory)
    active = _active(obs, memory, policy)
    failures = dict(memory.failures)
    holding: dict[str, list[float]] = {}  # node -> gpus of its live replicas
    for replica_id, node_id, state_name, num_gpus in memory.replicas:
        state = S(state_name)
        if state.terminal:
            continue
        view = obs.replica(replica_id)
        node = obs.node(node_id)
        target, reason = _replica_target(view, node, node_id in obs.noticed_nodes)
        if target is S.STARTING and state is S.TRAINING:
            target, reason = S.SYNCING, "resync"  # left the ready set: copying state again
        started = memory.started_at_s.get(replica_id, obs.now_s)
        if (target is S.STARTING and state is S.STARTING
                and obs.now_s - started > policy.start_timeout_s):
            actions.append(StopReplica(replica_id, "did not start in time"))
            target, reason = S.GONE, "did not start in time"
        elif (target is S.LEAVING and state in (S.STARTING, S.SYNCING)
              and not (view is not None and view.ready)):
            # Not ready: it holds none of the swarm's progress and is in no plan; it would
            # only take a donor's time until its node goes. (A ready one may be in the
            # step in flight: it leaves the way training replicas do.)
            actions.append(StopReplica(replica_id, f"{reason} before it was ready"))
            target, reason = S.GONE, f"stopped: {reason} before it was ready"
        elif target not in (S.GONE, S.LEAVING) and node_id not in active:
            actions.append(StopReplica(replica_id, "node beyond max_nodes"))
            target, reason = S.LEAVING, "dropped: node beyond max_nodes"
        if state is S.LEAVING and target is not S.GONE:
            target = S.LEAVING  # leaving is one-way
        for step in path_between(state, target):
            actions.append(SetState(replica_id, step, reason))
        if target is S.GONE and view is not None and node is not None and node.alive \
                and view.outcome in (RunOutcome.RAISED, RunOutcome.DIED):
            # Raised, or died while Ray still lists its node (often a node that is dying
            # and not yet declared dead): back off before placing another replica there.
            actions.append(NodeFailure(node_id))
            count, _ = failures.get(node_id, (0, 0.0))
            failures[node_id] = (count + 1, obs.now_s)
        if target is S.GONE and view is not None and view.outcome is RunOutcome.RAISED:
            error = view.error or ReplicaError("Exception", "")
            actions.append(ReplicaFailed(replica_id, node_id, error))
        if target not in (S.GONE, S.LEAVING):
            holding.setdefault(node_id, []).append(num_gpus)
    for node_id in active:
        node = obs.node(node_id)
        count, last = failures.get(node_id, (0, -float("inf")))
        if count >= policy.max_failures_per_node or obs.now_s - last < policy.failure_backoff_s:
            continue
        want, gpus_each = replicas_wanted(node.gpus, policy.replicas_per_node)
        for _ in range(want - len(holding.get(node_id, []))):
            actions.append(StartReplica(node_id, gpus_each))
    if memory.requested_nodes != policy.max_nodes:
        actions.append(RequestCapacity(policy.max_nodes))
    training = any(S(state) is S.TRAINING for _, _, state, _ in memory.replicas)
    if len(active) < policy.min_nodes and not training:
        actions.append(WaitForNodes(len(active), policy.min_nodes))
    failed = _job_failure(memory, tuple(actions), active, holding, failures, policy)
    if failed is not None:  # nothing new is started or asked for: the job ends
        actions = [a for a in actions if not isinstance(a, (StartReplica, RequestCapacity))]
        actions.append(failed)
    return Decision(tuple(actions), active)


def _job_failure(memory: Memory, actions: tuple, active: tuple[str, ...],
                 holding: dict[str, list[float]], failures: dict[str, tuple[int, float]],
                 policy: Policy) -> FailJob | None:
    """Rule 6: whether the job fails now, and with which replica's error."""
    seen = list(memory.job_failures) + [(a.replica_id, a.node_id, a.error)
                                        for a in actions if isinstance(a, ReplicaFailed)]
    nodes_by_error: dict[tuple[str, str], set[str]] = {}
    for replica_id, node_id, error in seen:
        nodes_by_error.setdefault(error.signature, set()).add(node_id)
        if len(nodes_by_error[error.signature]) >= policy.same_failure_nodes:
            return FailJob(f"the same error on {len(nodes_by_error[error.signature])} nodes: "
                           f"{_short(error)}", replica_id)
    if len(seen) > policy.max_failures:
        replica_id, _, error = seen[-1]
        return FailJob(f"replicas failed {len(seen)} times, more than training.max_failures="
                       f"{policy.max_failures}; the last: {_short(error)}", replica_id)
    if memory.checkpoint_failures >= policy.max_checkpoint_failures:
        return FailJob(f"{memory.checkpoint_failures} checkpoint saves failed in a row "
                       f"(training.max_checkpoint_failures={policy.max_checkpoint_failures})")
    exhausted = [n for n in active
                 if failures.get(n, (0, 0.0))[0] >= policy.max_failures_per_node]
    if active and len(exhausted) == len(active) and not any(holding.values()):
        last = seen[-1] if seen else None
        return FailJob(f"no replica left and each of the {len(active)} nodes had "
                       f"{policy.max_failures_per_node} replicas fail"
                       + (f"; the last: {_short(last[2])}" if last else ""),
                       last[0] if last else None)
    return None


def _short(error: ReplicaError) -> str:
    text = str(error)
    return text if len(text) <= 200 else text[:197] + "..."
