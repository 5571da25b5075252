"""An elastic swarm of replica groups: one group per node, trained together while
nodes come and go.

Contract. ``GroupSwarm(config, task).run()`` keeps one ``ReplicaGroup`` of
``config.group.world_size`` ranks (STRICT_PACK, pinned to its node with
``{"ray.io/node-id": hex}``) on every alive node of the running Ray cluster that matches
``config.node_labels`` and has room for it, and trains ``task`` until the swarm holds step
``config.steps``, in one of two modes:

``collaborative``
    every swarm step is one ``step_together``: the groups' gradients averaged by shard
    (rank ``r`` of each group with rank ``r`` of the others), one optimizer step each;
``local_sgd`` (local SGD by shard)
    every round is one ``local_round``: each group trains ``inner_steps`` steps alone on
    its part of each step's batch with its own optimizer, then rank ``r`` of every group
    averages its *parameter* shard with rank ``r`` of the others; every group ends the
    round with bitwise the same parameters (the optimizer state stays each group's own).

Steps are counted as each group's optimizer steps in both modes (a local SGD round is
``inner_steps`` of them). It returns ``SwarmStats`` (steps, lost steps, the most groups in
one step, joins, leaves, rebuilds, the final loss, and whether every group's unsharded
parameters are bitwise equal at the end, read with ``full_state``). Every group it started
is closed when it returns or raises.

Membership, as the swarm sees Ray's node table between steps (``decide``, pure):

- a new node (alive, matching, with room, no group) gets a group; it is started in a
  background thread, so the others go on stepping, and once up it joins by shard
  (``join_from`` a group that holds the swarm's step) before the first step it takes part
  in (at step 0, before anything is trained, it starts from the task's model instead);
- a node that is gone or dead in the table takes its group with it: the group is closed
  (its ranks killed, its placement group removed);
- a node Ray drains (its watcher heard a spot notice and asked Ray to drain it) gets no
  group, and its group leaves before the next step (``notice_leaves``), unless it is the
  last holder of the swarm's newest step: then it steps on, a donor for joiners, until
  another group holds that step or the node is gone;
- a group whose rank failed or timed out while its node stays alive leaves as a whole
  (closed), and after ``settle_s`` (time for Ray's node table to show a lost node as
  dead) a new group with new actors is placed on the same node and joins by shard;
  ``max_strikes`` groups in a row that fail on one node before applying a step end that
  node's turn;
- a group left out of a step others applied (its round incomplete) joins again.

Failure behaviour. A step that a group left in the middle is finished by the others:
groups lost in the compute phase leave the step (their part of the batch with them) and the
rest still average and apply it; a round left incomplete by a death is voted down by every
group in it, which keep the state they had, and the step is tried again with the groups that
are left. So no step is lost while one group holding the swarm's state survives. A step
counts as lost only if progress was undone: when every group holding the newest step left
and only groups behind it remain (``lost_steps``). ``SwarmError`` (one line; everything
released; ``stats`` attached) when no group holding state is left after training began,
when no group can step for ``wait_s``, when ``max_failed_steps`` steps in a row were applied
by no group, or when no node can hold a group at all. Every wait is bounded: group starts,
joins and steps by ``config.group.timeout_s``, idling by ``wait_s``.

The swarm is a driver-side object (not thread-safe): ``decide`` turns plain observations
(``SwarmView``) into actions; ``GroupSwarm`` reads the node table and its groups into a
view, carries the actions out and records each group's life as an explicit state machine
(``TRANSITIONS``).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from moshray.actors.replica.group import ReplicaGroup
from moshray.actors.replica.group_loop import LoopTask, loop_error_in, user_error_in
from moshray.actors.replica.group_spec import (
    NODE_ID_LABEL, GroupConfig, GroupError, GroupTask, digest, rank_bundles,
)
from moshray.actors.replica.group_together import local_round, step_together
from moshray.actors.replica.group_averaging import StepTogether
from moshray.cluster.state_machine import StateMachine, TransitionTable

log = logging.getLogger(__name__)

MODES = ("collaborative", "local_sgd")


class SwarmError(RuntimeError):
    """The swarm cannot go on; ``str()`` is one line, ``stats`` what it did until then,
    ``user_error`` the bad input of a user's loop that ended it (``group_loop.py``)."""

    def __init__(self, message: str, stats: SwarmStats | None = None,
                 user_error: Exception | None = None):
        super().__init__(message)
        self.stats, self.user_error = stats, user_error

    def __reduce__(self):
        return type(self), (str(self), self.stats, self.user_error)


# -- configuration and messages --------------------------------------------------------------


def _selector(labels: Mapping[str, Any] | tuple) -> tuple[tuple[str, tuple[str, ...]], ...]:
    items = labels.items() if isinstance(labels, Mapping) else labels
    out = []
    for key, values in items:
        if values is None:
            values = ()
        elif isinstance(values, str):
            values = (values,)
        out.append((str(key), tuple(sorted(str(v) for v in values))))
    return tuple(sorted(out))


@dataclass(frozen=True)
class SwarmConfig:
    """How the swarm runs (see module docstring). ``group``: every group's settings (its
    ``name`` is the prefix of the groups' names, its ``node_labels`` are set per group).
    ``node_labels``: the nodes that may hold a group, as label -> allowed values (a value
    or a sequence; None or empty: the label must be present); no entries: every node.
    ``max_groups``: at most that many groups (None: one per node). Raises ``ValueError``
    (one line, the field named) on a bad value."""

    group: GroupConfig = field(default_factory=GroupConfig)
    mode: str = "collaborative"
    steps: int = 10
    inner_steps: int = 4  # local_sgd: each group's steps between averages
    node_labels: Mapping[str, Any] | tuple = ()
    max_groups: int | None = None
    min_groups: int = 1  # the first step waits (at most wait_s) for this many groups
    settle_s: float = 10.0  # after a rank failed on a live node, before a group is rebuilt there
    max_strikes: int = 3  # groups in a row that fail on one node before it gets no more
    max_failed_steps: int = 5  # steps in a row no group applied, then SwarmError
    wait_s: float | None = None  # the longest with no group able to step (None: 2 x timeout)
    poll_s: float = 0.2  # how often the swarm looks while it waits

    def __post_init__(self) -> None:
        object.__setattr__(self, "node_labels", _selector(self.node_labels))
        if self.mode not in MODES:
            raise ValueError(f"SwarmConfig.mode: use one of {', '.join(MODES)}, got "
                             f"{self.mode!r}")
        for name in ("steps", "inner_steps", "max_strikes", "max_failed_steps", "min_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SwarmConfig.{name}: must be an integer >= 1, got {value!r}")
        if self.mode == "local_sgd" and self.steps % self.inner_steps:
            raise ValueError(f"SwarmConfig.steps: {self.steps} is not a whole number of local "
                             f"SGD rounds of {self.inner_steps} inner steps; use a multiple "
                             f"of {self.inner_steps}")
        if self.max_groups is not None and (not isinstance(self.max_groups, int)
                                            or self.max_groups < 1):
            raise ValueError(f"SwarmConfig.max_groups: must be None or an integer >= 1, got "
                             f"{self.max_groups!r}")
        for name in ("settle_s", "poll_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"SwarmConfig.{name}: must be >= 0, got "
                                 f"{getattr(self, name)!r}")
        if self.wait_s is not None and not self.wait_s > 0:
            raise ValueError(f"SwarmConfig.wait_s: must be None or > 0, got {self.wait_s!r}")

    @property
    def step_size(self) -> int:
        """The steps one swarm step moves every group by: 1, or a local SGD round's."""
        return self.inner_steps if self.mode == "local_sgd" else 1

    @property
    def idle_limit_s(self) -> float:
        return self.wait_s if self.wait_s is not None else 2 * self.group.timeout_s

    @property
    def need(self) -> dict[str, float]:
        """What one group needs on one node (the sum of its ranks' bundles)."""
        total: dict[str, float] = {}
        for bundle in rank_bundles(self.group):
            for k, v in bundle.items():
                total[k] = total.get(k, 0.0) + v
        return total


class GroupState(str, enum.Enum):
    STARTING = "starting"  # placed on its node; ranks starting in the background
    SYNCING = "syncing"  # up, holds no state of the swarm: joins by shard from a donor
    ACTIVE = "active"  # holds the swarm's state (or is behind it by steps): trains
    GONE = "gone"  # closed: ranks stopped, placement group removed

    @property
    def terminal(self) -> bool:
        return self is GroupState.GONE


G = GroupState
TRANSITIONS = {
    # Started before anything was trained: the task's model is the swarm's state.
    (G.STARTING, G.ACTIVE): "started at step 0",
    # Started while the swarm holds trained state: it copies it first.
    (G.STARTING, G.SYNCING): "started; joins by shard",
    # Could not be placed or started, or its node left while it started.
    (G.STARTING, G.GONE): "failed to start",
    # Copied a donor's shards: in the next step.
    (G.SYNCING, G.ACTIVE): "joined by shard",
    # The copy failed on its side, or its node left.
    (G.SYNCING, G.GONE): "lost while joining",
    # Left out of a step others applied (its round incomplete): joins again.
    (G.ACTIVE, G.SYNCING): "behind the swarm",
    # A rank failed or timed out, or its node left: the group leaves as a whole.
    (G.ACTIVE, G.GONE): "left",
}
TABLE = TransitionTable("group", TRANSITIONS)


@dataclass(frozen=True)
class NodeInfo:
    """One row of Ray's node table, as the swarm reads it."""

    node_id: str
    alive: bool
    labels: tuple[tuple[str, str], ...] = ()
    resources: tuple[tuple[str, float], ...] = ()
    draining: bool = False  # Ray drains it: a spot notice (the node's watcher asked)


def node_info(row: Mapping[str, Any], draining: bool = False) -> NodeInfo:
    """A ``NodeInfo`` of one ``ray.nodes()`` row (``draining``: the GCS drains it)."""
    return NodeInfo(str(row["NodeID"]), bool(row.get("Alive")),
                    tuple(sorted((str(k), str(v)) for k, v in (row.get("Labels") or {}).items())),
                    tuple(sorted((str(k), float(v))
                                 for k, v in (row.get("Resources") or {}).items())),
                    draining)


@dataclass(frozen=True)
class GroupView:
    """One group the swarm holds. ``step``: the swarm step whose state it holds (None: none,
    it must join); ``up``: its start finished well (STARTING); ``failure``: why it must
    leave (a rank failed or timed out, its start or join failed), else None."""

    name: str
    node_id: str
    state: GroupState
    step: int | None = None
    up: bool = False
    failure: str | None = None


@dataclass(frozen=True)
class NodeMemory:
    """What the swarm remembers of a node: how many groups it placed there, how many failed
    in a row before they applied a step (``strikes``), and when the last one left while the
    node stayed (``left_at_s``, the swarm's clock)."""

    node_id: str
    groups: int = 0
    strikes: int = 0
    left_at_s: float | None = None


@dataclass(frozen=True)
class SwarmView:
    """Everything ``decide`` looks at, taken at ``now_s`` (the swarm's clock). ``frontier``:
    the newest step the swarm holds; ``failed_in_row``: steps in a row no group applied;
    ``idle_s``: how long no group could step (0 while one can)."""

    now_s: float
    nodes: tuple[NodeInfo, ...]
    groups: tuple[GroupView, ...]
    memory: tuple[NodeMemory, ...] = ()
    frontier: int = 0
    failed_in_row: int = 0
    idle_s: float = 0.0


# -- actions ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Close:
    """Close group ``name`` (``node_lost``: its node left or is draining after a spot
    notice, ``notice``; else it failed on a live node)."""

    name: str
    reason: str
    node_lost: bool = False
    notice: bool = False


@dataclass(frozen=True)
class Place:
    """Start a group on ``node_id`` (``rebuild``: a group of the swarm was there before)."""

    node_id: str
    rebuild: bool = False


@dataclass(frozen=True)
class Activate:
    """Group ``name`` started before anything was trained: it takes part as it is."""

    name: str


@dataclass(frozen=True)
class Join:
    """Group ``name`` copies the shards of ``donor``, which holds the swarm's step."""

    name: str
    donor: str


@dataclass(frozen=True)
class Step:
    """One swarm step (``step``, the first of it) with the groups ``names`` (in order)."""

    names: tuple[str, ...]
    step: int


@dataclass(frozen=True)
class Wait:
    """Nothing can step now; look again after ``poll_s``."""

    reason: str


@dataclass(frozen=True)
class Finish:
    """The swarm holds step ``config.steps``."""


@dataclass(frozen=True)
class Fail:
    """The swarm cannot go on (one line)."""

    reason: str


Action = Close | Place | Activate | Join | Step | Wait | Finish | Fail


@dataclass(frozen=True)
class Decision:
    """The actions to carry out, in order, and the frontier after the closes (``lost``:
    steps it moved back: every group holding the newest step left)."""

    actions: tuple[Action, ...]
    frontier: int
    lost: int = 0


# -- the decisions (pure) --------------------------------------------------------------------


def eligible(node: NodeInfo, config: SwarmConfig) -> str | None:
    """Why ``node`` cannot hold a group (one line), or None when it can: alive, with every
    label of ``config.node_labels`` (one of its values where some are given) and at least
    one group's resources in total."""
    if not node.alive:
        return "not alive"
    if node.draining:
        return "draining (a spot notice)"
    labels = dict(node.labels)
    for key, values in config.node_labels:
        if key not in labels or (values and labels[key] not in values):
            return f"label {key}={labels.get(key, '(none)')} not selected"
    have = dict(node.resources)
    short = [k for k, v in config.need.items() if have.get(k, 0.0) < v]
    return f"no room ({', '.join(short)})" if short else None


def frontier_after(frontier: int, held: Sequence[int]) -> tuple[int, int]:
    """The swarm's newest step once only groups holding ``held`` steps remain, and the steps
    lost (progress undone: every group holding a newer one left). With no group left the
    frontier is 0 and everything is lost. A group holding a newer step than the frontier
    (resumed from a checkpoint) moves the frontier there."""
    top = max(held, default=0)
    return (top, frontier - top) if top < frontier else (top, 0)


def decide(view: SwarmView, config: SwarmConfig) -> Decision:
    """The actions for ``view`` (see module docstring), in order: closes, places,
    activations and joins, then one of Step, Wait, Finish or Fail. Pure."""
    actions: list[Action] = []
    alive = {n.node_id for n in view.nodes if n.alive}
    draining = {n.node_id for n in view.nodes if n.alive and n.draining}
    staying, noticed, left = [], [], set()
    for g in view.groups:
        if g.state.terminal:
            continue
        if g.node_id not in alive:
            actions.append(Close(g.name, f"node {g.node_id[:12]} left the cluster", True))
        elif g.failure:
            actions.append(Close(g.name, g.failure))
            left.add(g.node_id)  # settles before a group is placed there again
        elif g.node_id in draining:
            noticed.append(g)
        else:
            staying.append(g)
    # A spot notice: the group leaves before the next step, as a replica leaves the next
    # plan, unless it is the last holder of the swarm's newest step (then it steps on, and
    # donates to a joiner, until another group holds that step or its node is gone).
    newest = max((g.step for g in staying + noticed
                  if g.state is G.ACTIVE and g.step is not None), default=None)
    safe = any(g.state is G.ACTIVE and g.step == newest for g in staying)
    for g in noticed:
        if safe or g.state is not G.ACTIVE:
            actions.append(Close(g.name, f"node {g.node_id[:12]} got a spot notice "
                                         f"(draining)", True, notice=True))
        else:
            staying.append(g)
    held = [g.step for g in staying if g.state is G.ACTIVE and g.step is not None]
    frontier, lost = frontier_after(view.frontier, held)
    if view.frontier > 0 and not held:
        return Decision(tuple(actions) + (Fail(
            f"no group left holding the swarm's state (step {view.frontier}): every group "
            f"was lost; {view.frontier} step(s) lost"),), 0, view.frontier)
    if frontier >= config.steps:
        return Decision(tuple(actions) + (Finish(),), frontier, lost)
    if view.failed_in_row >= config.max_failed_steps:
        return Decision(tuple(actions) + (Fail(
            f"{view.failed_in_row} steps in a row were applied by no group (step "
            f"{frontier}); see the log for each group's reason"),), frontier, lost)

    # Places: one group per eligible node without one.
    memory = {m.node_id: m for m in view.memory}
    occupied = {g.node_id for g in staying}
    count, settling, why_not = len(staying), 0, []
    for node in sorted(view.nodes, key=lambda n: n.node_id):
        why = eligible(node, config)
        if why or node.node_id in occupied:
            if why and node.alive:
                why_not.append(f"{node.node_id[:12]}: {why}")
            continue
        mem = memory.get(node.node_id, NodeMemory(node.node_id))
        if mem.strikes >= config.max_strikes:
            why_not.append(f"{node.node_id[:12]}: {mem.strikes} groups failed there")
            continue
        if node.node_id in left or (mem.left_at_s is not None
                                    and view.now_s - mem.left_at_s < config.settle_s):
            settling += 1
            continue
        if config.max_groups is not None and count >= config.max_groups:
            break
        actions.append(Place(node.node_id, rebuild=mem.groups > 0))
        count += 1

    # Groups up or behind: at step 0 they take part as they are, else they join.
    donors = sorted(g.name for g in staying if g.state is G.ACTIVE and g.step == frontier)
    stepping = list(donors)
    for g in sorted(staying, key=lambda g: g.name):
        fresh = g.state is G.STARTING and g.up
        behind = g.state is G.SYNCING or (g.state is G.ACTIVE and g.step != frontier)
        if fresh and frontier == 0:
            actions.append(Activate(g.name))
            stepping.append(g.name)
        elif (fresh or behind) and frontier > 0:
            actions.append(Join(g.name, donors[0]))
            stepping.append(g.name)
        elif behind:  # at step 0 with no state of the swarm: nobody to copy it from
            actions.append(Close(g.name, "holds no state of the swarm and none to copy"))
    pending = sum(g.state is G.STARTING and not g.up for g in staying)
    placing = any(isinstance(a, Place) for a in actions)
    quorum = frontier > 0 or len(stepping) >= config.min_groups or not (pending or placing) \
        or view.idle_s > config.idle_limit_s
    if stepping and quorum:
        return Decision(tuple(actions) + (Step(tuple(sorted(stepping)), frontier),),
                        frontier, lost)
    if not (stepping or pending or settling or placing):
        return Decision(tuple(actions) + (Fail(
            f"no node can hold a group of {config.group.world_size} ranks (needs "
            f"{' '.join(f'{k}={v:g}' for k, v in sorted(config.need.items()))} on one node): "
            f"{'; '.join(why_not) or 'no alive nodes'}"),), frontier, lost)
    if view.idle_s > config.idle_limit_s:
        return Decision(tuple(actions) + (Fail(
            f"no group could step for {view.idle_s:.0f} s (limit {config.idle_limit_s:g} s): "
            f"{pending} starting, {settling} node(s) settling"),), frontier, lost)
    wait = Wait(f"{len(stepping)} group(s) ready, {pending} starting, {settling} node(s) "
                f"settling")
    return Decision(tuple(actions) + (wait,), frontier, lost)


# -- results ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupInfo:
    """One group as the ``on_step`` hook sees it: its ranks' process ids on its node."""

    name: str
    node_id: str
    state: GroupState
    step: int | None
    pids: tuple[int, ...]


@dataclass(frozen=True)
class SwarmProgress:
    """What ``on_step`` gets after every swarm step: the step's result and the groups."""

    frontier: int
    result: StepTogether
    groups: tuple[GroupInfo, ...]


@dataclass(frozen=True)
class SwarmStats:
    """What a swarm did. ``steps``: the newest step held (each group's optimizer steps);
    ``lost_steps``: steps undone (see module docstring); ``groups_max``: the most groups in
    one step; ``joins``: joins by shard; ``leaves``: groups that left after taking part
    (``notice_leaves`` of them after a spot notice, ``node_leaves`` with their node gone or
    draining, a notice or not; the others failed on a live node);
    ``rebuilt``: groups placed again on a node whose group left while it stayed, that
    joined; ``retried``: swarm steps no group applied (tried again); ``consistent``: every
    group's unsharded parameters bitwise equal at the end (None: not checked)."""

    mode: str
    ranks_per_group: int
    parallel: str
    steps: int = 0
    lost_steps: int = 0
    groups_max: int = 0
    joins: int = 0
    leaves: int = 0
    rebuilt: int = 0
    retried: int = 0
    notice_leaves: int = 0  # leaves after a spot notice (their node drained), among leaves
    node_leaves: int = 0  # leaves with their node (lost or drained), among leaves
    groups_final: int = 0
    final_loss: float | None = None
    consistent: bool | None = None
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        return {"mode": self.mode, "ranks_per_group": self.ranks_per_group,
                "parallel": self.parallel, "steps": self.steps,
                "lost_steps": self.lost_steps, "groups_max": self.groups_max,
                "joins": self.joins, "leaves": self.leaves,
                "notice_leaves": self.notice_leaves, "node_leaves": self.node_leaves,
                "rebuilt": self.rebuilt,
                "retried": self.retried, "groups_final": self.groups_final,
                "final_loss": self.final_loss, "replicas_consistent": self.consistent,
                "wall_s": round(self.wall_s, 2)}


# -- the shell ----------------------------------------------------------------------------------


@dataclass
class _Member:
    """One group the swarm started, with its life (``machine``)."""

    group: ReplicaGroup
    node_id: str
    machine: StateMachine[GroupState]
    start: Future | None = None
    up: bool = False
    step: int | None = None
    failure: str | None = None
    pids: tuple[int, ...] = ()
    rebuild: bool = False  # placed where a group of the swarm left while the node stayed
    applied: bool = False  # applied a step (its node's strikes start again)

    @property
    def state(self) -> GroupState:
        return self.machine.state


def read_nodes() -> tuple[NodeInfo, ...]:
    """Ray's node table (the connected driver's), draining nodes marked (the GCS's list: a
    node whose watcher heard a spot notice asked for it; unreadable: none marked)."""
    import ray

    from moshray.autoscaler.watch.drain import draining_nodes

    try:
        drains = draining_nodes()
    except (ray.exceptions.RayError, OSError, RuntimeError, AttributeError) as exc:
        log.warning("swarm: draining nodes not readable (%s)", type(exc).__name__)
        drains = {}
    return tuple(node_info(row, str(row["NodeID"]) in drains) for row in ray.nodes())


class GroupSwarm:
    """The driver's swarm of replica groups (see module docstring). ``on_step`` is called
    on this thread after every swarm step with a ``SwarmProgress`` (a chaos schedule, a
    progress line, ``save``); ``on_finish(swarm)`` after the last step, before the final
    consistency check (a final checkpoint); ``resume``: a sharded checkpoint the first
    groups load instead of starting from the task's model; ``clock`` and ``nodes`` may be
    injected."""

    def __init__(self, config: SwarmConfig, task: GroupTask | LoopTask, *,
                 on_step: Callable[[SwarmProgress], None] | None = None,
                 resume: str | None = None,
                 on_finish: Callable[[GroupSwarm], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 nodes: Callable[[], tuple[NodeInfo, ...]] = read_nodes):
        self.config, self.task, self.on_step = config, task, on_step
        # A sharded checkpoint (group_checkpoint.py) the first groups start from instead of
        # the task's model: each loads it, resharded to its ranks, and holds its step.
        self.resume = resume
        self.on_finish = on_finish  # after the last step, before the consistency check
        self.clock, self.nodes = clock, nodes
        self.members: dict[str, _Member] = {}
        self.memory: dict[str, NodeMemory] = {}
        self.frontier, self.failed_in_row = 0, 0
        # a loop chooses FSDP2 or replication itself (session.prepare's shard)
        parallel = "loop" if isinstance(task, LoopTask) else config.group.parallel
        self.stats = SwarmStats(config.mode, config.group.world_size, parallel)
        self._count = 0
        self._idle_since: float | None = None
        self._starter = ThreadPoolExecutor(max_workers=4, thread_name_prefix="swarm-start")
        self._last: StepTogether | None = None
        self._stop = threading.Event()
        self._finish = threading.Event()
        self._loop_errors: dict[str, set[str]] = {}  # what loops raised -> on which nodes
        self._last_failure: str | None = None

    def stop(self) -> None:
        """Ask ``run`` (on another thread) to stop after the action it is carrying out: it
        raises ``SwarmError`` ("stopped") once every group is closed. Thread-safe."""
        self._stop.set()

    def finish(self) -> None:
        """Ask ``run`` (on another thread) to end after the step it is carrying out, as if
        that were the last (a time limit): the final consistency check runs and ``run``
        returns the stats. Before the first step, as ``stop``. Thread-safe."""
        self._finish.set()

    # -- observe --------------------------------------------------------------------------

    def _settle_starts(self) -> None:
        """Take the result of every start that ended: up (holding the task's model at step
        0) or a failure; a group closed while it started is closed now."""
        for m in self.members.values():
            if m.start is None or not m.start.done():
                continue
            future, m.start = m.start, None
            try:
                described = future.result()
            except Exception as exc:  # noqa: BLE001 - GroupError or a Ray error: one line
                m.failure = f"failed to start: {' '.join(str(exc).split())[:300]}"
                continue
            if m.state.terminal:
                m.group.close()
                continue
            m.up, m.step = True, 0
            m.pids = tuple(int(d["pid"]) for d in described)

    def view(self) -> SwarmView:
        """The swarm as ``decide`` sees it now."""
        self._settle_starts()
        now = self.clock()
        groups = tuple(GroupView(name, m.node_id, m.state, m.step, m.up, m.failure)
                       for name, m in self.members.items() if not m.state.terminal)
        return SwarmView(now, self.nodes(), groups, tuple(self.memory.values()),
                         self.frontier, self.failed_in_row,
                         0.0 if self._idle_since is None else now - self._idle_since)

    # -- act --------------------------------------------------------------------------------

    def _to(self, m: _Member, state: GroupState, reason: str = "") -> None:
        m.machine.to(state, reason)
        log.info("swarm: group %s %s -> %s%s", m.group.config.name,
                 m.machine.history[-2].dst.value, state.value, f" ({reason})" if reason else "")

    def _node(self, node_id: str, **changes: Any) -> None:
        self.memory[node_id] = replace(self.memory.get(node_id, NodeMemory(node_id)),
                                       **changes)

    def _close(self, action: Close) -> None:
        m = self.members[action.name]
        if m.start is not None:  # still starting: the thread owns the group until it ends
            self._to(m, G.GONE, action.reason)
            return
        m.group.broken = True  # a rank may be stuck in a collective: kill, do not ask
        m.group.close()
        self._to(m, G.GONE, action.reason)
        if any(t.dst is G.ACTIVE for t in m.machine.history):  # it had taken part
            self.stats = replace(self.stats, leaves=self.stats.leaves + 1,
                                 notice_leaves=self.stats.notice_leaves + action.notice,
                                 node_leaves=self.stats.node_leaves + action.node_lost)
        mem = self.memory.get(m.node_id, NodeMemory(m.node_id))
        if not action.node_lost:
            self._node(m.node_id, left_at_s=self.clock(),
                       strikes=0 if m.applied else mem.strikes + 1)
        log.warning("swarm: group %s left: %s", action.name, action.reason)

    def _place(self, action: Place) -> None:
        c = self.config.group
        name = f"{c.name}{self._count}"
        self._count += 1
        group = ReplicaGroup(replace(c, name=name, node_labels={NODE_ID_LABEL: action.node_id}))
        machine = StateMachine(TABLE, name, G.STARTING, self.clock, reason="placed")
        m = _Member(group, action.node_id, machine, rebuild=action.rebuild)
        m.start = self._starter.submit(group.start)
        self.members[name] = m
        mem = self.memory.get(action.node_id, NodeMemory(action.node_id))
        self._node(action.node_id, groups=mem.groups + 1)
        log.info("swarm: group %s placed on node %s%s", name, action.node_id[:12],
                 " (rebuilt)" if action.rebuild else "")

    def _join(self, action: Join) -> bool:
        m, donor = self.members[action.name], self.members[action.donor]
        if m.state is not G.SYNCING:
            self._to(m, G.SYNCING)
        try:
            m.group.join_from(donor.group, self.task)
        except GroupError as exc:
            self._loop_failed(str(exc), m.node_id)
            if donor.group.broken:
                donor.failure = f"failed as a donor: {exc}"
            if m.group.broken or not donor.group.broken:
                m.failure = f"join failed: {exc}"
            return False
        m.step = self.frontier
        self.stats = replace(self.stats, joins=self.stats.joins + 1)
        self._activate(m, "joined by shard")
        return True

    def _start_from(self, m: _Member) -> None:
        """A group up before anything was trained: it holds the task's model at step 0,
        or, with ``resume``, loads that checkpoint and holds its step (the swarm's frontier
        moves there at the next ``decide``). A refused or failed load is the group's
        failure (it is closed; a checkpoint that does not fit the model fails every group,
        and the swarm ends with the reason)."""
        if self.resume is not None:
            try:
                m.step = m.group.load_sharded(self.resume, self.task)
            except GroupError as exc:
                m.failure = f"resume from {self.resume}: {' '.join(str(exc).split())[:300]}"
                self._last_failure = m.failure
                return
            self._activate(m, f"resumed at step {m.step}")
            return
        self._activate(m, "started at step 0")

    def save(self, path: str) -> int:
        """Write a sharded checkpoint of the swarm's newest step to ``path`` (one group
        holding it writes; ``ReplicaGroup.save_sharded``) and return its step. For an
        ``on_step`` hook (this thread). ``GroupError`` (one line) when no group holds the
        newest step or the write fails."""
        holders = [m for m in self.members.values() if m.state is G.ACTIVE
                   and m.step == self.frontier and not m.failure]
        if not holders:
            raise GroupError(f"no group holds step {self.frontier} to save")
        return holders[0].group.save_sharded(path)

    def _loop_failed(self, reason: str, node_id: str) -> None:
        """A group failure's ``reason``: bad input in the user's loop (a ``UserError``: no
        rebuild gets past it) or the same exception from the loop on two nodes ends the
        swarm at once (``SwarmError``, one line; as the elastic controller does for one
        replica per GPU); any other is kept for the message of a later ``SwarmError``."""
        if (bad := user_error_in(reason)) is not None:
            raise SwarmError(f"group swarm: {bad}", user_error=bad)
        raised = loop_error_in(reason)
        if raised is None:
            return
        self._last_failure = raised
        nodes = self._loop_errors.setdefault(raised, set())
        nodes.add(node_id)
        if len(nodes) >= 2:
            raise SwarmError(f"group swarm: the loop raised the same error on {len(nodes)} "
                             f"nodes: {raised}")

    def _activate(self, m: _Member, reason: str) -> None:
        self._to(m, G.ACTIVE, reason)
        self.stats = replace(self.stats, rebuilt=self.stats.rebuilt + int(m.rebuild))
        m.rebuild = False

    def _step(self, action: Step) -> None:
        names = [n for n in action.names if self.members[n].state is G.ACTIVE
                 and self.members[n].step == action.step and not self.members[n].failure]
        if not names:
            return
        groups = [self.members[n].group for n in names]
        if self.config.mode == "local_sgd":
            result = local_round(groups, self.task, self.config.inner_steps)
        else:
            result = step_together(groups, self.task)
        failures = {f.name: f for f in result.failures}
        for f in result.failures:
            self._loop_failed(f.reason or "", self.members[f.name].node_id)
        for n in names:
            m = self.members[n]
            if n in result.applied:
                m.step, m.applied = action.step + result.steps, True
                self._node(m.node_id, strikes=0)
            elif failures.get(n) is not None and failures[n].broken:
                m.failure = failures[n].reason
            elif self.config.mode == "local_sgd":
                m.step = None  # its parameters are its own inner steps': it joins again
            log.info("swarm: step %d: group %s %s", action.step, n,
                     "applied" if n in result.applied else f"did not apply: "
                     f"{failures[n].reason if n in failures else '?'}")
        if result.applied:
            self.frontier = action.step + result.steps
            self.failed_in_row = 0
            self._last = result
        else:
            self.failed_in_row += 1
        self.stats = replace(self.stats, steps=self.frontier,
                             groups_max=max(self.stats.groups_max, len(result.applied)),
                             retried=self.stats.retried + int(not result.applied),
                             final_loss=self._last.loss if self._last else None)
        if self.on_step is not None:
            self.on_step(SwarmProgress(self.frontier, result, self.groups()))

    def wait_started(self, timeout_s: float) -> bool:
        """Wait until every group start under way has ended (up or failed), at most
        ``timeout_s``; True when none is left. For an ``on_step`` hook (this thread) that
        wants the groups starting now to take part in the next steps: a demo's or a
        test's pacing (a swarm never waits for a start by itself)."""
        pending = [m.start for m in self.members.values() if m.start is not None]
        return not futures.wait(pending, timeout=timeout_s).not_done

    def groups(self) -> tuple[GroupInfo, ...]:
        """The groups not yet gone."""
        return tuple(GroupInfo(n, m.node_id, m.state, m.step, m.pids)
                     for n, m in self.members.items() if not m.state.terminal)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> SwarmStats:
        """Train until the swarm holds ``config.steps`` (see module docstring); every group
        is closed on the way out. ``SwarmError`` (one line, ``stats`` attached) when the
        swarm cannot go on."""
        t0 = self.clock()
        try:
            while True:
                if self._finish.is_set() and self.frontier > 0:
                    break
                if self._stop.is_set() or self._finish.is_set():
                    raise SwarmError(f"group swarm: stopped at step {self.frontier}")
                decision = decide(self.view(), self.config)
                if decision.lost:
                    log.warning("swarm: %d step(s) lost (back to step %d)", decision.lost,
                                decision.frontier)
                self.frontier = decision.frontier
                self.stats = replace(self.stats, steps=self.frontier,
                                     lost_steps=self.stats.lost_steps + decision.lost)
                done = self._carry_out(decision.actions)
                if done:
                    break
            if self.on_finish is not None:
                self.on_finish(self)
            consistent = self._consistent()
            self.stats = replace(self.stats, consistent=consistent)
        except SwarmError as exc:
            self.stats = replace(self.stats, wall_s=self.clock() - t0)
            raise SwarmError(str(exc), self.stats, exc.user_error) from None
        finally:
            self.close()
        self.stats = replace(self.stats, wall_s=self.clock() - t0)
        return self.stats

    def _carry_out(self, actions: Sequence[Action]) -> bool:
        """Carry ``actions`` out in order; True once finished."""
        for action in actions:
            if isinstance(action, Close):
                self._close(action)
            elif isinstance(action, Place):
                self._place(action)
            elif isinstance(action, Activate):
                self._start_from(self.members[action.name])
            elif isinstance(action, Join):
                self._join(action)
            elif isinstance(action, Step):
                self._idle_since = None
                self._step(action)
            elif isinstance(action, Wait):
                if self._idle_since is None:
                    self._idle_since = self.clock()
                time.sleep(self.config.poll_s)
            elif isinstance(action, Finish):
                return True
            elif isinstance(action, Fail):
                last = f"; the loop last raised {self._last_failure}" if self._last_failure \
                    else ""
                raise SwarmError(f"group swarm: {action.reason}{last}")
        return False

    def _consistent(self) -> bool:
        """Every group holding the final step has bitwise the same unsharded parameters."""
        holders = [m for m in self.members.values() if m.state is G.ACTIVE
                   and m.step == self.frontier and not m.failure]
        self.stats = replace(self.stats, groups_final=len(holders))
        digests = set()
        for m in holders:
            try:
                digests.add(digest(m.group.full_state().values()))
            except GroupError as exc:
                log.warning("swarm: group %s: full_state: %s", m.group.config.name, exc)
                return False
        return len(digests) == 1

    def close(self) -> None:
        """Close every group (politely when sound), waiting for starts still running
        (each bounded by the group's ``timeout_s``). Safe to call twice."""
        for m in self.members.values():
            if m.start is not None:
                try:
                    m.start.result(timeout=self.config.group.timeout_s + 30)
                except Exception:  # noqa: BLE001 - it closed itself
                    pass
                m.start = None
            m.group.close()
            if not m.state.terminal:
                self._to(m, G.GONE, "swarm closed")
        self._starter.shutdown(wait=True)
