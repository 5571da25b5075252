"""The training job: `python -m moshray.jobs.train` / `moshray train`.

Against a running cluster (``RAY_ADDRESS`` set, as under ``ray job submit``, or
``cluster.address``) it starts one ReplicaActor per spot slot; with no address it starts
the embedded local cluster (a head plus ``--local-nodes`` spot raylets on 127.0.0.1) and,
with ``--trace``, replays a spot trace onto it (a removal is a preemption of that node).

The driver only supervises: it keeps a replica on every live spot slot, prints one
progress line per global step, checkpoints every N steps through a live replica, stops
the replicas at ``max_steps`` / ``max_seconds`` and prints a summary (the last line is JSON
with ``--json``); it writes ``summary.json`` and ``training.png`` into ``run_dir``.
Replicas train and average on their own through the Coordinator, which serves Prometheus
metrics on ``metrics.port``. On the embedded cluster each spot node has a notice watcher;
a trace's removal arrives as a simulated spot notice ``cluster.notice_s`` ahead (drain,
rebalance, expert hand-off), a ``kill`` without one. With ``model.moe_layers`` (``--moe``)
an ExpertSupervisor keeps the DMoE experts served on the spot nodes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import sys
import threading
import time

from moshray.jobs.config import (
    ConfigError,
    TrainConfig,
    add_config_arguments,
    config_from_args,
    exit_on_config_error,
)

log = logging.getLogger("moshray.train")
POLL_S = 0.25


class ReplicaSupervisor:
    """Keeps one replica per live slot; a slot's replica dies with its node."""

    def __init__(self, config: TrainConfig, files: list[str], coordinator, init_state_ref):
        self.config, self.files, self.coordinator = config, files, coordinator
        self.init_state_ref = init_state_ref
        self.replicas: dict[int, tuple[str, object, object]] = {}  # slot -> (id, handle, run)
        self.generation = 0
        self.hard_losses = 0  # replicas lost without a notice (their node died under them)
        self.resources: dict[int, dict | None] = {}  # slot -> the resources it was started with
        self.lock = threading.Lock()

    def start(self, slot: int, resources: dict | None = None) -> None:
        from moshray.actors.replica import ReplicaActor

        with self.lock:
            self.resources[slot] = resources
            self.generation += 1
            peer_id = f"replica-{slot}-{self.generation}"
            options = {"num_cpus": 1, "resources": resources or {f"slot-{slot}": 0.01},
                       "max_concurrency": 16}
            handle = ReplicaActor.options(**options).remote(
                peer_id, self.config.to_dict(), self.files, slot, self.coordinator,
                self.init_state_ref)
            self.replicas[slot] = (peer_id, handle, handle.run.remote())

    def lost(self, slot: int, hard: bool = False) -> None:
        """``slot``'s replica is gone (``hard``: found dead, no notice came before)."""
        with self.lock:
            entry = self.replicas.pop(slot, None)
            self.hard_losses += int(hard and entry is not None)
        if entry is not None:
            self.coordinator.leave.remote(entry[0])
            self.coordinator.note_preemption.remote()

    def restart(self, slot: int) -> None:
        """Replace ``slot``'s replica (it failed while its node stayed up) with a fresh one."""
        import ray

        with self.lock:
            entry = self.replicas.pop(slot, None)
        if entry is not None:
            self.coordinator.leave.remote(entry[0])
            ray.kill(entry[1], no_restart=True)
        self.start(slot, self.resources.get(slot))

    def handles(self) -> list[tuple[str, object, object]]:
        with self.lock:
            return list(self.replicas.values())


BAR_WIDTH = 20


def run_fraction(epoch: int, elapsed: float, max_steps: int | None,
                 max_seconds: float | None) -> float | None:
    """How far the run is towards its bound (the nearer of steps and seconds), or None."""
    parts = []
    if max_steps:
        parts.append(epoch / max_steps)
    if max_seconds:
        parts.append(elapsed / max_seconds)
    return min(max(parts), 1.0) if parts else None


def progress_line(h, total_samples: int, elapsed: float, live: int, preemptions: int,
                  fraction: float | None = None) -> str:
    """One console line for a committed global step; with a bar when the run is bounded.

    ``h`` is a history row ``(epoch, at_s, samples, loss, peers)``.
    """
    epoch, _, samples, loss, peers = h
    loss_s = f"{loss:.4f}" if loss is not None else "  -   "
    rate = total_samples / elapsed if elapsed > 0 else 0.0
    bar = ""
    if fraction is not None:
        done = int(round(fraction * BAR_WIDTH))
        bar = f"[{'#' * done}{'.' * (BAR_WIDTH - done)}] {fraction * 100:3.0f}% | "
    return (f"step {epoch:5d} | {bar}loss {loss_s} | {rate:8.1f} samples/s | peers {peers} "
            f"(live {live}) | preemptions {preemptions}")


def run(config: TrainConfig) -> dict:
    import ray

    from moshray.actors.checkpoint import CheckpointStore
    from moshray.actors.data import resolve_data
    from moshray.jobs.local_cluster import LocalCluster, LocalClusterConfig, pin_loopback

    t = config.training
    out = sys.stderr if config.json else sys.stdout
    address = config.cluster.address or os.environ.get("RAY_ADDRESS")
    local = None
    if address:
        ray.init(address=address, namespace="moshray", log_to_driver=False)
    else:
        pin_loopback()
        local = LocalCluster(LocalClusterConfig(spot_nodes=config.cluster.local_nodes,
                                                cpus_per_node=2))
        local.connect()
    replay = None
    try:
        files = resolve_data(list(config.data.paths) or None,
                             os.path.expanduser(config.data.cache_dir))
        init_state_ref = None
        if config.checkpoint.uri:
            found = CheckpointStore(config.checkpoint.uri).load_latest()
            if found is not None:
                step, state = found
                print(f"resuming from checkpoint at step {step}", file=out, flush=True)
                init_state_ref = [ray.put(state)]
        coordinator = _fresh_coordinator(config)
        address_shown = ray.get(coordinator.metrics_address.remote(), timeout=30)
        if address_shown:
            print(f"metrics: http://{address_shown}/metrics", file=out, flush=True)
        experts = _start_experts(config, coordinator) if config.model.moe else None
        supervisor = ReplicaSupervisor(config, files, coordinator, init_state_ref)
        pending: queue.Queue = queue.Queue()
        nodes = None
        if local is not None:
            if config.cluster.trace:
                _match_initial_nodes(config, local)
            nodes = LocalNodes(config, local, supervisor, coordinator, experts)
            if config.cluster.trace:
                replay = _start_replay(config, pending)
            for slot in local.live_slots():
                supervisor.start(slot)
        else:
            spot = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("spot")]
            for i, node in enumerate(spot):
                supervisor.start(i, {"spot": 1})
        summary = _supervise(config, coordinator, supervisor, nodes, out, pending)
        if experts is not None:
            summary["experts"] = _stop_experts(experts)
        ray.kill(coordinator)
        return summary
    finally:
        if replay is not None:
            replay.stop()
            replay.join(timeout=5)
        if local is not None:
            local.shutdown()
        elif ray.is_initialized():
            ray.shutdown()


def _fresh_coordinator(config: TrainConfig):
    """This job's Coordinator, under the cluster's well-known name (node watchers started
    with the nodes, ``moshray watch``, find it by that name). A Coordinator left by an
    earlier job on the same cluster is replaced: one training job per cluster."""
    import ray

    from moshray.cluster import coordinator as coordinator_mod
    from moshray.cluster import placement
    from moshray.cluster.membership import MembershipConfig

    t = config.training
    try:
        stale = ray.get_actor(placement.COORDINATOR_NAME, namespace=placement.NAMESPACE)
    except ValueError:
        stale = None
    if stale is not None:
        log.warning("replacing the Coordinator of an earlier job (%s)", placement.COORDINATOR_NAME)
        ray.kill(stale, no_restart=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                ray.get_actor(placement.COORDINATOR_NAME, namespace=placement.NAMESPACE)
            except ValueError:
                break
            time.sleep(0.1)
    # The exporter listens on the head node's loopback: Prometheus runs there too.
    coordinator = coordinator_mod.get_or_create(
        MembershipConfig(compression=t.compression, peer_ttl_s=max(3.0, t.round_timeout_s)),
        target_batch_size=t.target_batch_size, name=placement.COORDINATOR_NAME,
        metrics_port=config.metrics.port)
    try:
        ray.get(coordinator.metrics_address.remote(), timeout=60)
    except ray.exceptions.RayActorError:
        raise ConfigError("metrics.port", f"cannot serve metrics on 127.0.0.1:"
                          f"{config.metrics.port} (in use?); choose another with "
                          f"--metrics-port (0 = any free port)") from None
    return coordinator


def _start_experts(config: TrainConfig, coordinator):
    """The DMoE experts of ``config.model``: an ExpertSupervisor on the head node keeping
    every shard served on the spot nodes (snapshots under ``<checkpoint.uri>/experts``)."""
    from moshray.actors.expert import ExpertSetConfig, ExpertSpec, spawn_expert_set
    from moshray.actors.model import moe_layer_name

    m, t = config.model, config.training
    snapshot = f"{config.checkpoint.uri.rstrip('/')}/experts" if config.checkpoint.uri else ""
    expert_set = ExpertSetConfig(
        layers=tuple(moe_layer_name(i) for i in m.moe_layers), grid=m.moe_grid,
        spec=ExpertSpec(d_model=m.d_model, d_hidden=m.d_ff, lr=t.lr,
                        weight_decay=t.weight_decay, seed=t.seed),
        snapshot_uri=snapshot, num_cpus=0.25)
    return spawn_expert_set(expert_set, coordinator, timeout_s=300)


def _stop_experts(experts) -> dict:
    """Stop the expert set; returns ``{"respawns": n, "events": n}`` from its history."""
    import ray

    summary = {"respawns": 0, "events": 0}
    try:
        events = ray.get(experts.events.remote(), timeout=30)
        spawns = sum(1 for e in events if e[2] == "spawned")
        summary = {"respawns": max(0, spawns - len(ray.get(experts.hosts.remote(), timeout=30))),
                   "events": len(events)}
        ray.get(experts.stop.remote(), timeout=60)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        log.warning("expert set did not stop cleanly: %s", type(exc).__name__)
    ray.kill(experts)
    return summary


class LocalNodes:
    """Node events on the embedded cluster, as a cloud would deliver them.

    ``notice``: the node's watcher gets a simulated spot notice (Coordinator marks its peers
    draining, Ray drains the node, the expert shards there hand off); ``remove``: the node
    goes at its deadline; ``kill``: it dies with no notice; ``add``: new capacity, with a
    watcher and a replica. Every call comes from the main thread (Ray starts raylets only
    from there) except the notice delivery, which runs aside so the loop keeps its pace.
    Metrics events go to the Coordinator: lost nodes with/without notice, spot capacity.
    """

    def __init__(self, config: TrainConfig, local, supervisor, coordinator, experts):
        from moshray.autoscaler.watch import WatcherConfig, WatcherFleet
        from moshray.cluster import placement

        self.config, self.local, self.supervisor = config, local, supervisor
        self.coordinator, self.experts = coordinator, experts
        # rpc_timeout_s bounds each call to a watcher (and the watcher's to the Coordinator
        # and the GCS); 5 s is too short on a loaded 2-core machine.
        self.fleet = WatcherFleet(WatcherConfig(source="simulated", poll_s=0.25,
                                                rpc_timeout_s=30.0,
                                                coordinator_name=placement.COORDINATOR_NAME))
        self.t0 = time.monotonic()
        self.preempted_at: list[float] = []  # seconds since start of each lost node
        self.joined_at: list[float] = []
        self.noticed: set[int] = set()
        self._watch(self.local.live_slots())

    def _watch(self, slots) -> None:
        try:
            # By node id: a slot's previous raylet may still be listed alive for a moment.
            self.fleet.sync(only=[self.local.node_id(slot) for slot in slots])
            if self.experts is not None:
                for slot in slots:
                    self.fleet.register(slot, self.experts, "experts")
        except Exception as exc:  # noqa: BLE001 - a watcher is an aid; training goes on
            log.warning("watchers for slots %s not started: %r", list(slots), exc)
        self._capacity()

    def _capacity(self) -> None:
        from moshray.cluster import metrics

        self.coordinator.record.remote((metrics.CapacityEvent(len(self.local.live_slots()), 0),))

    def _lost(self, slot: int, with_notice: bool) -> None:
        from moshray.cluster import metrics

        self.preempted_at.append(time.monotonic() - self.t0)
        self.coordinator.record.remote((metrics.NodeLostEvent(with_notice),))
        try:
            self.fleet.node_gone(slot)
        except KeyError:
            pass
        self._capacity()

    def notice(self, slot: int) -> None:
        """The spot notice for ``slot``: handed to its watcher, which acts on it (Coordinator,
        Ray drain, hand-off) while this loop goes on; one call, no wait, since the notice
        is short on a compressed trace."""
        if slot not in self.local.live_slots():
            return
        self.noticed.add(slot)
        try:
            self.fleet.watcher(slot).deliver.remote(max(self.config.cluster.wall_notice_s, 0.1))
        except Exception as exc:  # noqa: BLE001 - the removal still comes at its time
            log.warning("notice to slot %d not delivered: %r", slot, exc)

    def apply(self, kind: str, slot: int) -> None:
        live = slot in self.local.live_slots()
        if kind == "notice":
            self.notice(slot)
        elif kind == "add" and not live:
            self.local.add_node(slot)
            self.joined_at.append(time.monotonic() - self.t0)
            self._watch([slot])
            self.supervisor.start(slot)
        elif kind == "remove" and live:
            self.supervisor.lost(slot)
            self.local.remove_node(slot)
            self._lost(slot, with_notice=slot in self.noticed)
        elif kind == "kill" and live:
            # No notice and no word to the Coordinator: the swarm finds out by itself
            # (failed calls, round deadlines, Ray's node-death events seen below).
            self.local.remove_node(slot, hard=True)
            self._lost(slot, with_notice=False)
        if kind in ("remove", "kill"):
            self.noticed.discard(slot)

    def drain(self, pending: queue.Queue) -> None:
        """Apply every queued ``(kind, slot)`` event."""
        while True:
            try:
                kind, slot = pending.get_nowait()
            except queue.Empty:
                return
            self.apply(kind, slot)

    def stop(self) -> None:
        for node in self.fleet.watched():
            try:
                self.fleet.node_gone(node)
            except Exception as exc:  # noqa: BLE001 - shutting down anyway
                log.info("watcher of %s not stopped: %r", node, exc)


def _start_replay(config: TrainConfig, pending: queue.Queue):
    """Replay the trace in a thread; its events are queued for the main thread, which
    owns the cluster (Ray starts raylets only from the main thread). Each removal is
    preceded by a spot notice ``cluster.notice_s`` trace seconds earlier."""
    from moshray.autoscaler.trace import TraceReplayer, load_trace, schedule, with_notices

    events = with_notices(schedule(load_trace(config.cluster.trace), config.cluster.time_scale,
                                   config.cluster.max_nodes), config.cluster.wall_notice_s)
    replay = TraceReplayer(events, lambda slot: pending.put(("add", slot)),
                           lambda slot: pending.put(("remove", slot)), skip_initial=True,
                           kill_node=lambda slot: pending.put(("kill", slot)),
                           notice_node=lambda slot: pending.put(("notice", slot)))
    replay.start()
    return replay


def _match_initial_nodes(config: TrainConfig, local) -> None:
    """Start exactly the slots the trace has live at its start."""
    from moshray.autoscaler.trace import initial_slots, load_trace, schedule

    events = schedule(load_trace(config.cluster.trace), config.cluster.time_scale,
                      config.cluster.max_nodes)
    wanted = set(initial_slots(events))
    for slot in local.live_slots():
        if slot not in wanted:
            local.remove_node(slot)
    for slot in sorted(wanted - set(local.live_slots())):
        local.add_node(slot)


def _supervise(config: TrainConfig, coordinator, supervisor, nodes: LocalNodes | None, out,
               pending: queue.Queue) -> dict:
    import ray

    t = config.training
    started = time.monotonic()
    printed = 0
    samples = 0
    last_ckpt = 0
    history: list = []
    stats: dict = {}
    while True:
        time.sleep(POLL_S)
        if nodes is not None:
            nodes.drain(pending)
        stats = ray.get(coordinator.stats.remote(), timeout=30)
        history = stats["history"]
        elapsed = time.monotonic() - started
        fraction = run_fraction(stats["epoch"], elapsed, t.max_steps, t.max_seconds)
        for h in history[printed:]:
            samples += h[2]
            print(progress_line(h, samples, elapsed, stats["live"], stats["preemptions"],
                                fraction), file=out, flush=True)
        printed = len(history)
        epoch = stats["epoch"]
        if config.checkpoint.uri and epoch - last_ckpt >= config.checkpoint.every_steps:
            _checkpoint(config, supervisor)
            last_ckpt = epoch
        if (t.max_steps is not None and epoch >= t.max_steps) or \
                (t.max_seconds is not None and elapsed >= t.max_seconds):
            break
        for slot, (peer_id, _, run_ref) in list(supervisor.replicas.items()):
            ready, _ = ray.wait([run_ref], timeout=0)
            if ready:  # the replica ended on its own: its node died without notice
                try:
                    ray.get(run_ref)
                except ray.exceptions.RayTaskError as exc:
                    # The replica raised but its actor and node are up: replace it (it
                    # syncs from a donor like any joiner).
                    cause = str(exc).strip().splitlines()[-1:] or [""]
                    log.warning("replica %s failed (%s); restarting it", peer_id, cause[0][:300])
                    supervisor.restart(slot)
                except ray.exceptions.RayError as exc:
                    log.warning("replica %s lost: %s", peer_id, type(exc).__name__)
                    supervisor.lost(slot, hard=True)
    ray.get(coordinator.request_stop.remote())
    statuses = []
    for peer_id, handle, run_ref in supervisor.handles():
        try:
            statuses.append(ray.get(run_ref, timeout=t.round_timeout_s * 3 + 30))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            cause = str(exc).strip().splitlines()[-1:] or [""]
            log.warning("replica %s did not finish: %s %s", peer_id, type(exc).__name__,
                        cause[0][:300])
    wall = time.monotonic() - started
    if config.checkpoint.uri:
        _checkpoint(config, supervisor)
    # A replica on a node that got its notice has left the averaging (its node is going):
    # it is reported but not held to the consistency of the staying ones.
    leaving = set() if nodes is None else \
        {supervisor.replicas[s][0] for s in nodes.noticed if s in supervisor.replicas}
    staying = [s for s in statuses if s["peer"] not in leaving]
    top_epoch = max((s["epoch"] for s in staying), default=0)
    finals = {s["checksum"] for s in staying if s["epoch"] == top_epoch}
    losses = [h[3] for h in history if h[3] is not None]
    summary = {
        "steps": stats.get("epoch", 0),
        "samples": sum(h[2] for h in history),
        "wall_s": wall,
        "samples_per_s": sum(h[2] for h in history) / wall if wall > 0 else 0.0,
        "preemptions": stats.get("preemptions", 0),
        "initial_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "replicas": len(statuses),
        "replicas_consistent": len(finals) == 1 and all(s["epoch"] == top_epoch for s in staying),
        "leaving_replicas": len(statuses) - len(staying),
        "replica_states": [[s["peer"], s["epoch"], s["checksum"]] for s in statuses],
        "rejected_contributions": sum(s["rejected"] for s in statuses),
        "notices": stats.get("notices", 0),
        "hard_losses": supervisor.hard_losses,
        # Committed global steps the final state skipped or went through twice (0 expected).
        "rollbacks": stats.get("rollbacks", 0),  # steps lost with every peer holding them
        "lost_steps": max((s["lost_steps"] + s["repeated_steps"] for s in statuses), default=0),
        "rebalance_s_max": max(stats.get("rebalance_s") or [0.0]),
    }
    summary["plot"] = _write_outputs(config, history, summary, nodes)
    if nodes is not None:
        nodes.stop()
    print(f"done: {summary['steps']} steps, {summary['samples']} samples in "
          f"{wall:.1f} s ({summary['samples_per_s']:.1f} samples/s), "
          f"{summary['preemptions']} preemptions survived, loss "
          f"{summary['initial_loss']} -> {summary['final_loss']}, replicas consistent: "
          f"{summary['replicas_consistent']}", file=out, flush=True)
    return summary


def _write_outputs(config: TrainConfig, history: list, summary: dict,
                   nodes: LocalNodes | None) -> str | None:
    """``<run_dir>/summary.json`` and ``<run_dir>/training.png`` (loss, samples/s and peers
    over time, lost nodes and joins marked); returns the plot's path, None if it failed."""
    from pathlib import Path

    from moshray.jobs import plots

    run_dir = Path(config.run_dir).expanduser()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps({**summary, "history": history}) + "\n")
        tmp.replace(run_dir / "summary.json")
        marks = {} if nodes is None else {"preemptions": nodes.preempted_at,
                                          "joins": nodes.joined_at}
        return str(plots.plot_training_run(history, run_dir / "training.png", **marks))
    except (OSError, ValueError) as exc:
        log.warning("run outputs not written to %s: %s", run_dir, exc)
        return None


def _checkpoint(config: TrainConfig, supervisor) -> None:
    import ray

    for peer_id, handle, _ in supervisor.handles():
        try:
            path = ray.get(handle.save_checkpoint.remote(config.checkpoint.uri), timeout=60)
            log.info("checkpoint %s written by %s", path, peer_id)
            return
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("checkpoint through %s failed: %s", peer_id, type(exc).__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


@exit_on_config_error
def main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    summary = run(config)
    if config.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module('moshray.jobs.train'))
