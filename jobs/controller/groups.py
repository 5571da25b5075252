"""The driver of a job whose replicas are replica groups (``cluster.replica = "node"``):
one group of ``group_ranks`` Ray actors on every spot node (``STRICT_PACK``, one GPU
each on GPU nodes), the model sharded inside by FSDP2 as the user's loop asks
(``session.prepare(..., shard=True)``), averaged by shard across groups
(``actors/replica/group_swarm.py`` carries all of that out).

What it does, in order: connects (``jobs/train.connect``), turns the ``TrainConfig`` into a
``SwarmConfig`` (``swarm_config``, pure, against the nodes it sees), asks Ray's autoscaler
for ``cluster.max_nodes`` nodes that each fit a group (``lease.request_capacity``), runs the
swarm until ``training.max_steps`` or ``training.max_seconds`` (then the swarm ends after
the step in flight, consistency checked), or a SIGTERM (``ray job stop``), and writes the
summary (``<run_dir>/summary.json``; ``moshray train --json`` prints it).

Failure behaviour. A setting groups cannot honour is a ``ConfigError`` (one line) before
anything starts. A swarm that cannot go on raises ``SwarmError`` (one line; the groups
closed); bad input in the user's loop (a ``UserError`` in a rank) ends the job at once with
that ``UserError``, the same exception from the loop on two nodes with a ``SwarmError``
naming it (a group whose loop raised is rebuilt up to ``max_strikes`` times per node). On
every exit path the capacity request is withdrawn and the groups' actors are gone (the
swarm closes them; they are the driver's, so a crashed driver takes them along). Every spot
node gets a notice watcher (``_Watchers``): a notice drains the node and its group leaves
before it goes. Checkpoints are sharded (``_Checkpoints``; local, shared or object
storage) and a job resumes on any number of groups. Their durability follows the machines
seen (``DurabilityGuard``, as with one replica per GPU): on several machines a node-local
location switches to the cluster's (``MOSHRAY_CHECKPOINT_URI``) or ends the job with one
line, checked at the start and each second after. The driver serves the job's Prometheus
metrics (``_Metrics``).
Not yet for groups: DMoE experts, ``session.report`` beyond the loss, the cost metrics
(no node prices are read), adoption by a resubmitted driver.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from moshray.actors.errors import UserError
from moshray.actors.replica.group_loop import LoopTask
from moshray.actors.replica.group_spec import GroupConfig, GroupError
from moshray.actors.replica.group_swarm import (
    GroupSwarm, SwarmConfig, SwarmError, SwarmProgress,
)
from moshray.cluster.placement import SPOT_RESOURCE
from moshray.jobs.config import ConfigError, TrainConfig
from moshray.jobs.controller.durability import CHECKPOINT_ENV, DurabilityGuard

log = logging.getLogger(__name__)

GROUP_MODES = ("collaborative", "local_sgd")
CPU_RANKS = 2  # ranks of a group on CPU nodes when cluster.group_ranks is 0
RANK_TIMEOUT_S = 120.0  # a group's start, join and step
UNBOUNDED_STEPS = 10**9  # max_seconds only: the swarm ends on the clock


def swarm_config(config: TrainConfig, nodes: Sequence[Mapping[str, float]],
                 node_labels: Mapping[str, Any] | None = None) -> SwarmConfig:
    """The swarm for ``config`` on a cluster whose alive spot nodes have ``nodes``'
    resources (pure). Ranks per group: ``cluster.group_ranks``, else the most GPUs of a
    spot node, else ``CPU_RANKS``; one GPU per rank where the nodes have GPUs. Local SGD
    rounds are ``training.local_steps`` long, with DiLoCo's outer Nesterov step on each
    shard where ``training.outer_optimizer = "nesterov"``. ``ConfigError`` (one line) for what groups
    cannot do: another mode, no step bound, an averaging deadline longer than a step's.
    ``node_labels``: only nodes with these labels hold groups (``SwarmConfig``)."""
    t, c = config.training, config.cluster
    if t.mode not in GROUP_MODES:
        raise ConfigError("training.mode", f"replica groups (cluster.replica = \"node\") train "
                          f"{' or '.join(GROUP_MODES)}, got {t.mode!r}")
    if t.max_steps is None and t.max_seconds is None:
        raise ConfigError("training.max_steps", "replica groups need max_steps or max_seconds "
                          "(their data is by step, without epochs)")
    gpus = max((int(n.get("GPU", 0)) for n in nodes), default=0)
    world = c.group_ranks or gpus or CPU_RANKS
    inner = t.local_steps if t.mode == "local_sgd" else 1
    steps = t.max_steps if t.max_steps is not None else UNBOUNDED_STEPS
    steps = -(-steps // inner) * inner  # whole local SGD rounds
    try:
        outer = t.mode == "local_sgd" and t.outer_optimizer == "nesterov"
        group = GroupConfig(world_size=world, gpus_per_rank=1.0 if gpus >= world else 0.0,
                            cpus_per_rank=1.0, timeout_s=RANK_TIMEOUT_S, name="g",
                            resources={SPOT_RESOURCE: 1}, round_timeout_s=t.round_timeout_s,
                            outer_lr=t.outer_lr if outer else None,
                            outer_momentum=t.outer_momentum)
        return SwarmConfig(group=group, mode=t.mode, steps=steps, inner_steps=inner,
                           max_groups=c.max_nodes, min_groups=c.min_nodes,
                           wait_s=c.wait_for_nodes_s, node_labels=node_labels or ())
    except ValueError as exc:
        field, _, why = str(exc).partition(": ")
        raise ConfigError(field, why or str(exc)) from None


def _addresses() -> list[str]:
    """The addresses of the alive nodes (machines, for ``DurabilityGuard``)."""
    import ray

    return [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]


def _spot_nodes() -> dict[str, dict[str, float]]:
    """Alive spot nodes: node id -> resources."""
    import ray

    return {n["NodeID"]: n["Resources"] for n in ray.nodes()
            if n["Alive"] and n.get("Resources", {}).get(SPOT_RESOURCE)}


class _Watchers:
    """A notice watcher on every spot node (the node's own where it has one, else started
    here and stopped at the end): a notice makes Ray drain the node, and the swarm's group
    there leaves before the node goes (``group_swarm.py``). There is no Coordinator to
    tell: the watcher tells Ray only."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.seen: set[str] = set()
        self.own: dict[str, Any] = {}

    def open_new(self) -> None:
        from moshray.autoscaler.watch.config import WatcherConfig
        from moshray.autoscaler.watch.watcher import open_watcher

        for node_id in set(_spot_nodes()) - self.seen:
            self.seen.add(node_id)
            try:
                opened = open_watcher(node_id, WatcherConfig(
                    source=self.config.cluster.notice_source, poll_s=0.25))
            except Exception as exc:  # noqa: BLE001 - a node gone meanwhile; logged
                log.warning("no notice watcher on node %s: %r", node_id[:12], exc)
                continue
            if opened.created:
                self.own[node_id] = opened.actor

    def close(self) -> None:
        from moshray.autoscaler.watch.watcher import close_watchers

        close_watchers(self.own)
        self.own.clear()


class _Checkpoints:
    """Sharded checkpoints of a group job (``actors/replica/group_checkpoint.py``) under
    ``<checkpoint.uri>/<run id>/groups/step-<step>``: one group holding the newest step
    writes one every ``checkpoint.every_steps`` steps and at the end; a job starts from the
    newest whole one of its run (else of ``checkpoint.resume_from``'s), resharded to
    however many groups and ranks it has. ``checkpoint.uri``: a local or shared file
    system path, or a URI pyarrow understands (``s3://``, ``gs://``): what a job on several
    machines needs, as ``run_groups``' ``DurabilityGuard`` holds it to (``retarget`` when it
    switches to the cluster's location). A failed save ends the job (``RuntimeError``, one
    line); an unreadable location at the start is a ``ConfigError``."""

    def __init__(self, config: TrainConfig):
        self.every = config.checkpoint.every_steps
        self.base = self.start = None
        self.last = 0
        self.retarget(config)

    def retarget(self, config: TrainConfig, read_start: bool = True) -> None:
        """Use ``config``'s checkpoint location from now on; with ``read_start`` (before the
        swarm starts) the start is read there: the newest whole checkpoint, or
        ``resume_from``'s."""
        from moshray.actors.replica.checkpoint import job_run_id
        from moshray.actors.replica.group_checkpoint import child, newest

        c = config.checkpoint
        if c.uri is None:
            self.base = None
            return
        self.base = child(c.uri, job_run_id(c, config.name), "groups")
        if not read_start:
            return
        self.start, self.last = None, 0
        try:
            self.start = newest(self.base)
            if self.start is None and c.resume_from:
                other = (c.resume_from if "://" in c.resume_from or os.sep in c.resume_from
                         else child(c.uri, c.resume_from))
                self.start = newest(child(other, "groups"))
        except (OSError, ValueError) as exc:
            raise ConfigError("checkpoint.uri", f"{c.uri!r} cannot be read: "
                              f"{' '.join(str(exc).split())[:200]}") from None
        if self.start is not None:
            self.last = int(self.start.partition("?")[0].rstrip("/").rsplit("step-", 1)[1])

    def maybe_save(self, swarm: GroupSwarm, final: bool = False) -> None:
        from moshray.actors.replica.group_checkpoint import child, is_remote

        if self.base is None or swarm.frontier <= self.last or not (
                final or swarm.frontier - self.last >= self.every):
            return
        path = child(self.base, f"step-{swarm.frontier:08d}")
        try:
            if not is_remote(self.base):
                os.makedirs(self.base.removeprefix("file://"), exist_ok=True)
            self.last = swarm.save(path)
        except (GroupError, OSError) as exc:
            raise RuntimeError(f"checkpoint: saving step {swarm.frontier} to {path} failed: "
                               f"{' '.join(str(exc).split())}") from None


class _Metrics:
    """The job's Prometheus metrics (``cluster/metrics``' exporter, the same names as with
    one replica per GPU), served by this driver on ``metrics.port`` of the head (127.0.0.1,
    where the head's Prometheus scrapes): ``moshray_peers{state="live"}`` (groups holding
    the newest step), ``moshray_global_step``, ``moshray_training_loss``,
    ``moshray_replicas{state}`` (groups starting, syncing, training), ``moshray_nodes_lost``
    and ``moshray_preemptions`` (groups that left with their node, a notice or not). A port
    in use is a warning: training goes on unserved."""

    def __init__(self, config: TrainConfig, out):
        from moshray.cluster import metrics

        m = config.metrics
        self.state = metrics.TrainingState()
        self.exporter = metrics.MetricsExporter(
            metrics.Prices(m.spot_price_per_hour, m.on_demand_price_per_hour),
            lambda: self.state)
        self.left = (0, 0)
        try:
            host, port = self.exporter.serve(metrics.LOOPBACK, m.port)
            print(f"metrics: http://{host}:{port}/metrics", file=out, flush=True)
        except OSError as exc:
            log.warning("metrics not served on port %s: %s", m.port, exc)

    def update(self, p: SwarmProgress, stats) -> None:
        from dataclasses import replace

        from moshray.cluster import metrics

        states = {"starting": 0, "syncing": 0, "training": 0, "leaving": 0}
        for g in p.groups:
            states[{"active": "training"}.get(g.state.value, g.state.value)] += 1
        self.exporter.apply(metrics.ReplicaStatesEvent(tuple(states.items())))
        # groups that left with their node (a group failing on a live node is no node loss)
        noticed, lost = stats.notice_leaves, stats.node_leaves - stats.notice_leaves
        for _ in range(noticed - self.left[0]):
            self.exporter.apply(metrics.NodeLostEvent(True))
        for _ in range(lost - self.left[1]):
            self.exporter.apply(metrics.NodeLostEvent(False))
        self.left = (noticed, lost)
        loss = p.result.loss if p.result.loss == p.result.loss else self.state.loss
        self.state = replace(self.state, live_peers=len(p.result.applied),
                             global_step=p.frontier, loss=loss,
                             preemptions=stats.leaves)

    def close(self) -> None:
        self.exporter.close()


class _Progress:
    """A console line every ``every`` swarm steps (and the first)."""

    def __init__(self, out, every: int = 10):
        self.out, self.every, self.count = out, every, 0

    def __call__(self, p: SwarmProgress) -> None:
        self.count += 1
        if self.count == 1 or self.count % self.every == 0:
            r = p.result
            loss = f"{r.loss:.4f}" if r.loss is not None and r.loss == r.loss else "-"
            print(f"step {p.frontier}: {len(p.groups)} group(s), loss {loss}",
                  file=self.out, flush=True)


def run_groups(config: TrainConfig, address: str, job: Any = None, stop_when=None,
               on_report=None, *, on_step=None,
               node_labels: Mapping[str, Any] | None = None) -> dict:
    """The job's driver for replica groups (see module docstring); returns the summary.
    ``job``: a ``LoopTask`` (``moshray.fit``), or None for the built-in LM (its model,
    sharded). ``stop_when``: as ``run_job``'s; ``on_report``: not for groups yet
    (``ConfigError``). ``on_step(SwarmProgress)``: after every swarm step, on this
    thread. ``node_labels``: see ``swarm_config`` (a harness sharing a cluster)."""
    import ray

    from moshray.jobs.controller.lease import request_capacity, withdraw_capacity
    from moshray.jobs.train import STOP, connect

    if on_report is not None:
        raise ConfigError("cluster.replica", "replica groups do not forward session.report() "
                          "to on_report yet; use one replica per GPU for it")
    if job is not None and not isinstance(job, LoopTask):
        raise ConfigError("cluster.replica", "replica groups take a loop and data by step: "
                          "moshray.fit(loop, moshray.data.by_step(fn), ...)")
    config = config.named()  # its name: checkpoint run, run_dir, capacity share
    out = sys.stderr if config.json else sys.stdout
    checkpoints = _Checkpoints(config)  # a bad checkpoint setting: before anything starts
    owned = connect(config, address)
    asked, timer, swarm, tending, served = False, None, None, None, None
    watchers = _Watchers(config)
    done = threading.Event()
    stopped: list[ConfigError] = []  # a durability Stop seen by the tending thread
    try:
        # Durability follows the machines seen (durability.py), as with one replica per GPU.
        guard = DurabilityGuard(config, os.environ.get(CHECKPOINT_ENV), out)
        durable = guard.update(_addresses())
        if durable.checkpoint.uri != config.checkpoint.uri:
            checkpoints.retarget(durable)
        config = durable
        deadline = time.monotonic() + config.cluster.wait_for_nodes_s
        nodes = _spot_nodes()
        while not nodes and time.monotonic() < deadline and not STOP.is_set():
            time.sleep(0.5)
            nodes = _spot_nodes()
        swarm_cfg = swarm_config(config, list(nodes.values()), node_labels)
        if job is None:
            job = _builtin_lm(config, swarm_cfg.group.world_size)
        request_capacity(config.name, [swarm_cfg.need] * config.cluster.max_nodes)
        asked = True
        print(f"replica groups: {swarm_cfg.group.world_size} rank(s) each, up to "
              f"{config.cluster.max_nodes} group(s), {swarm_cfg.mode}", file=out, flush=True)
        progress, served = _Progress(out), _Metrics(config, out)
        if checkpoints.start is not None:
            print(f"resuming from checkpoint at step {checkpoints.last} "
                  f"({checkpoints.start})", file=out, flush=True)

        def stepped(p: SwarmProgress) -> None:
            progress(p)
            served.update(p, swarm.stats)
            checkpoints.maybe_save(swarm)
            if on_step is not None:
                on_step(p)

        swarm = GroupSwarm(swarm_cfg, job, on_step=stepped, resume=checkpoints.start,
                           on_finish=lambda s: checkpoints.maybe_save(s, final=True))
        if config.training.max_seconds is not None:
            timer = threading.Timer(config.training.max_seconds, swarm.finish)
            timer.daemon = True
            timer.start()

        watchers.open_new()

        def tend() -> None:
            """Watchers on new nodes; ``ray job stop`` (SIGTERM) or ``stop_when``: end after
            the step in flight."""
            uri = config.checkpoint.uri
            while not done.wait(1.0):
                if STOP.is_set() or (stop_when is not None and stop_when()):
                    swarm.finish()
                watchers.open_new()
                try:
                    now = guard.update(_addresses())
                except (ConfigError, UserError) as exc:  # a machine its checkpoints miss
                    stopped.append(exc)
                    swarm.finish()
                    continue
                if now.checkpoint.uri != uri:
                    uri = now.checkpoint.uri
                    checkpoints.retarget(now, read_start=False)

        tending = threading.Thread(target=tend, daemon=True, name="groups-tend")
        tending.start()
        try:
            stats = swarm.run()
        except SwarmError as exc:  # bad input in the loop: the user's one line, as fit's
            if exc.user_error is not None:
                raise exc.user_error from None
            raise
        if stopped:
            raise stopped[0]
    finally:
        done.set()
        if tending is not None:
            tending.join(timeout=30)
        watchers.close()
        if served is not None:
            served.close()
        if timer is not None:
            timer.cancel()
        if asked:
            try:
                withdraw_capacity(config.name)
            except Exception as exc:  # noqa: BLE001 - never hide the error being handled
                log.warning("capacity request not withdrawn: %r", exc)
        if owned:
            ray.shutdown()
    summary = {"replica": "node", **stats.to_dict(), "groups": stats.groups_max,
               "final_loss": stats.final_loss, "resumed_from": checkpoints.start,
               "checkpoint": checkpoints.last if checkpoints.base else None}
    os.makedirs(config.run_dir, exist_ok=True)
    with open(os.path.join(config.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if not config.json:  # with json the caller prints the summary (``moshray train``)
        print(f"done: {stats.steps} steps by up to {stats.groups_max} group(s) of "
              f"{stats.ranks_per_group}, {stats.lost_steps} lost, groups consistent: "
              f"{stats.consistent}", file=out, flush=True)
    return summary


def _builtin_lm(config: TrainConfig, world: int) -> LoopTask:
    """The built-in LM (``moshray train``) as a loop, its model sharded over the ranks."""
    from moshray.actors.replica.group_loop import loop_of
    from moshray.jobs.examples.lm.tasks import lm_task

    m = config.model
    model = {"seq_len": m.seq_len, "d_model": m.d_model, "n_layers": m.n_layers,
             "n_heads": m.n_heads, "d_ff": m.d_ff}
    steps = config.training.max_steps or UNBOUNDED_STEPS
    return loop_of(lm_task(model, steps=steps, rows=step_rows(config, world), amp=False,
                           lr=config.training.lr))


def step_rows(config: TrainConfig, world: int | None = None) -> int:
    """Rows of the built-in LM's global batch: at least ``training.batch_size`` and a
    multiple of groups x ranks for every group count up to ``cluster.max_nodes`` (a step's
    rows divide evenly among the groups and ranks that train it)."""
    import math

    world = world or config.cluster.group_ranks or CPU_RANKS
    unit = math.lcm(*(g * world for g in range(1, config.cluster.max_nodes + 1)))
    return -(-config.training.batch_size // unit) * unit
