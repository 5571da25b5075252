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
"""

from __future__ import annotations

from dataclasses import dataclass

from moshray.jobs.controller.observations import Memory, Observation, RunOutcome
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

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"need 1 <= min_nodes <= max_nodes, got {self.min_nodes}, "
                             f"{self.max_nodes}")
        if self.replicas_per_node < 0:
            raise ValueError(f"replicas_per_node must be >= 0, got {self.replicas_per_node}")


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


Action = (StartReplica | StopReplica | SetState | NodeJoined | NodeLost | NodeFailure
          | RequestCapacity | WaitForNodes)


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
    return Decision(tuple(actions), active)
