"""The training job: `python -m moshray.jobs.train` / `moshray train`.

Against a running cluster (``RAY_ADDRESS`` set, as under ``ray job submit``, or
``cluster.address``) it starts one ReplicaActor per spot slot; with no address it starts
the embedded local cluster (a head plus ``--local-nodes`` spot raylets on 127.0.0.1) and,
with ``--trace``, replays a spot trace onto it (a removal is a preemption of that node).

The driver only supervises: it keeps a replica on every live spot slot, prints one
progress line per global step, checkpoints every N steps through a live replica, stops
the replicas at ``max_steps`` / ``max_seconds`` and prints a summary (the last line is JSON
with ``--json``). Replicas train and average on their own through the Coordinator.
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
        self.lock = threading.Lock()

    def start(self, slot: int, resources: dict | None = None) -> None:
        from moshray.actors.replica import ReplicaActor

        with self.lock:
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
    from moshray.cluster import coordinator as coordinator_mod
    from moshray.cluster.membership import MembershipConfig
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
        name = f"moshray-coordinator-{os.getpid()}-{int(time.time())}"
        coordinator = coordinator_mod.get_or_create(
            MembershipConfig(compression=t.compression, peer_ttl_s=max(3.0, t.round_timeout_s)),
            target_batch_size=t.target_batch_size, name=name)
        supervisor = ReplicaSupervisor(config, files, coordinator, init_state_ref)
        pending: queue.Queue = queue.Queue()
        if local is not None:
            if config.cluster.trace:
                _match_initial_nodes(config, local)
                replay = _start_replay(config, pending)
            for slot in local.live_slots():
                supervisor.start(slot)
        else:
            spot = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("spot")]
            for i, node in enumerate(spot):
                supervisor.start(i, {"spot": 1})
        summary = _supervise(config, coordinator, supervisor, local, out, pending)
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


def _start_replay(config: TrainConfig, pending: queue.Queue):
    """Replay the trace in a thread; its events are queued for the main thread, which
    owns the cluster (Ray starts raylets only from the main thread)."""
    from moshray.autoscaler.trace import TraceReplayer, load_trace, schedule

    events = schedule(load_trace(config.cluster.trace), config.cluster.time_scale,
                      config.cluster.max_nodes)
    replay = TraceReplayer(events, lambda slot: pending.put(("add", slot)),
                           lambda slot: pending.put(("remove", slot)), skip_initial=True,
                           kill_node=lambda slot: pending.put(("kill", slot)))
    replay.start()
    return replay


def _apply_node_events(pending: queue.Queue, local, supervisor) -> None:
    while True:
        try:
            kind, slot = pending.get_nowait()
        except queue.Empty:
            return
        if kind == "add" and slot not in local.live_slots():
            local.add_node(slot)
            supervisor.start(slot)
        elif kind == "remove" and slot in local.live_slots():
            supervisor.lost(slot)
            local.remove_node(slot)
        elif kind == "kill" and slot in local.live_slots():
            # No notice and no word to the Coordinator: the swarm finds out by itself
            # (failed calls, round deadlines, Ray's node-death events seen below).
            local.remove_node(slot, hard=True)


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


def _supervise(config: TrainConfig, coordinator, supervisor, local, out,
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
        if local is not None:
            _apply_node_events(pending, local, supervisor)
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
                except ray.exceptions.RayError as exc:
                    log.warning("replica %s lost: %s", peer_id, type(exc).__name__)
                    supervisor.lost(slot, hard=True)
    ray.get(coordinator.request_stop.remote())
    statuses = []
    for peer_id, handle, run_ref in supervisor.handles():
        try:
            statuses.append(ray.get(run_ref, timeout=t.round_timeout_s * 3 + 30))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("replica %s did not finish: %s", peer_id, type(exc).__name__)
    wall = time.monotonic() - started
    if config.checkpoint.uri:
        _checkpoint(config, supervisor)
    top_epoch = max((s["epoch"] for s in statuses), default=0)
    finals = {s["checksum"] for s in statuses if s["epoch"] == top_epoch}
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
        "replicas_consistent": len(finals) == 1 and all(s["epoch"] == top_epoch for s in statuses),
        "rejected_contributions": sum(s["rejected"] for s in statuses),
        "notices": stats.get("notices", 0),
        "hard_losses": supervisor.hard_losses,
        # Committed global steps the final state skipped or went through twice (0 expected).
        "lost_steps": max((s["lost_steps"] + s["repeated_steps"] for s in statuses), default=0),
        "rebalance_s_max": max(stats.get("rebalance_s") or [0.0]),
    }
    print(f"done: {summary['steps']} steps, {summary['samples']} samples in "
          f"{wall:.1f} s ({summary['samples_per_s']:.1f} samples/s), "
          f"{summary['preemptions']} preemptions survived, loss "
          f"{summary['initial_loss']} -> {summary['final_loss']}, replicas consistent: "
          f"{summary['replicas_consistent']}", file=out, flush=True)
    return summary


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
