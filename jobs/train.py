"""The training job: `python -m moshray.jobs.train` / `moshray train` / `ray job submit`.

Against a running cluster (``RAY_ADDRESS`` set, as under ``ray job submit``, or
``cluster.address``) the job connects to it; with no address it first starts the embedded
local cluster, which plays the cloud (``jobs/local/cloud.py``: raylets on 127.0.0.1 added,
noticed, removed or killed, by a replayed spot trace with ``--trace``). Either way the same
elastic controller (``jobs/controller/elastic.py``) then keeps one replica on every worker node Ray
has, up to ``cluster.max_nodes``, asks Ray's autoscaler for capacity, and waits (bounded by
``cluster.wait_for_nodes_s``) while there is none.

The driver prints one progress line per global step, checkpoints every N steps through a
training replica, stops the replicas at ``max_steps`` / ``max_seconds`` and prints a summary
(the last line is JSON with ``--json``); it writes ``summary.json`` and ``training.png`` into
``run_dir``. Replicas train and average on their own through the Coordinator, which serves
Prometheus metrics on ``metrics.port``. With ``model.moe_layers`` (``--moe``) an
ExpertSupervisor keeps the DMoE experts served on the worker nodes.

Nodes are separate machines: the built-in corpus reaches replicas through the object store,
user data as URIs each replica opens itself. Durability follows the cluster
(``durability.py``): once the job has seen a second machine, a node-local or missing
``checkpoint.uri`` switches to the cluster's durable location (``MOSHRAY_CHECKPOINT_URI``) or
the job stops with one line, as it does for a node-local data path. Every exit path
(success, error, SIGTERM from ``ray job stop``, Ctrl-C) withdraws the job's capacity request
and stops the watchers it started; an error also kills the replicas.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

from moshray.jobs.config import (
    ConfigError,
    TrainConfig,
    add_config_arguments,
    config_from_args,
    exit_on_config_error,
)
from moshray.jobs.controller.driver_calls import call_with_retries, checkpoint_through_replica, final_state
from moshray.jobs.controller.durability import CHECKPOINT_ENV, DurabilityGuard

log = logging.getLogger("moshray.train")
POLL_S = 0.5
# Set by SIGTERM (`ray job stop`, a scheduler, a test): the run stops as at its time limit,
# with a checkpoint and a summary, instead of dying mid-step.
STOP = threading.Event()
# A caller's own end condition: given the Coordinator's stats (its whole step history rows
# ``(epoch, at_s, samples, loss, peers)`` included) at every supervision poll; True ends the
# run as its time limit would.
StopWhen = Callable[[dict], bool]


def run(config: TrainConfig, job=None, stop_when: StopWhen | None = None) -> dict:
    """Train ``job`` (``actors.replica.Job``: the user's loop and data; None: the built-in
    LM) on the cluster at ``cluster.address`` / ``RAY_ADDRESS``, else on the embedded local
    cluster (started and stopped here); returns the run's summary. ``stop_when`` (optional)
    ends the run early, as ``max_seconds`` would (replicas stopped, final checkpoint and
    summary); an exception it raises propagates and the replicas are killed, not stopped
    cleanly."""
    address = config.cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        return run_job(config, address, job, stop_when)
    from moshray.jobs.local.cloud import run_embedded

    return run_embedded(config, lambda addr: run_job(config, addr, job, stop_when))


def stop_on_sigterm() -> None:
    """SIGTERM sets ``STOP`` (the run ends as at its time limit). Call after ``ray.init``,
    which installs Ray's own handler, from the main thread (elsewhere it does nothing)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: STOP.set())


def run_job(config: TrainConfig, address: str, job=None,
            stop_when: StopWhen | None = None) -> dict:
    """The job's driver on the cluster at ``address``: the same on every cluster. ``job``
    may be a callable of the connected driver returning the ``Job`` (data sources that
    need Ray, such as a Ray Dataset's blocks, are made there)."""
    import ray

    from moshray.actors.replica.checkpoint import CheckpointStore
    from moshray.jobs.examples.lm.corpus import resolve_data, ship_files
    from moshray.jobs.controller.elastic import ElasticController
    from moshray.jobs.controller.replica_launch import ReplicaSpec

    out = sys.stderr if config.json else sys.stdout
    owned = not ray.is_initialized()  # a caller's own connection stays up after the job
    if owned:
        if address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost"):
            # A loopback cluster (tests, one machine): stay on loopback; Ray would otherwise
            # swap 127.0.0.1 for this machine's network address.
            from moshray.jobs.local.cluster import pin_loopback

            pin_loopback()
        ray.init(address=address, namespace="moshray", log_to_driver=True)
        stop_on_sigterm()
    controller = coordinator = experts = None
    try:
        # Durability follows the machines seen: decided now, again as new ones appear.
        guard = DurabilityGuard(config, os.environ.get(CHECKPOINT_ENV), out)
        config = guard.update(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
        if callable(job) and not hasattr(job, "loop"):
            job = job()
        if job is None:
            import moshray.jobs.examples.lm.example as lm
            if config.data.paths:
                files = resolve_data(list(config.data.paths), config.data.cache_dir)
            else:  # the built-in corpus, built on the driver, travels through the object store
                files = ship_files(resolve_data(None, os.path.expanduser(config.data.cache_dir)))
            job = lm.job(config, files)
        else:
            config = guard.add_data(getattr(getattr(job, "data", None), "uris", ()))
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
        spec = ReplicaSpec(config.to_dict(), job, coordinator, init_state_ref)
        controller = ElasticController(config, spec, experts, out)
        summary = _supervise(config, controller, out, stop_when, guard)
        if experts is not None:
            summary["experts"] = _stop_experts(experts)
            experts = None
        return summary
    except BaseException:  # an error, Ctrl-C: nothing of this job is left running
        _leave_nothing_running(controller, experts)
        raise
    finally:
        _end_job(controller, coordinator)
        if owned:
            ray.shutdown()


def _leave_nothing_running(controller, experts) -> None:
    """The error path: kill the replicas and the expert set (no graceful stop, no final
    checkpoint). Each failure is logged, never raised over the error being handled."""
    import ray

    if controller is not None:
        controller.stop_replicas()
    if experts is not None:
        try:
            ray.kill(experts)
        except ray.exceptions.RayError as exc:
            log.warning("expert set not killed: %r", exc)


def _end_job(controller, coordinator) -> None:
    """Every exit path (success, error, ``ray job stop``'s SIGTERM, Ctrl-C): withdraw the
    job's capacity request, stop the watchers it started (a node's own keep running),
    remove its Coordinator. Each failure is logged, never raised."""
    import ray

    if controller is not None:
        controller.release_capacity()
        controller.stop_watchers()
    if coordinator is not None:
        try:
            ray.kill(coordinator)
        except ray.exceptions.RayError as exc:
            log.warning("Coordinator not removed: %r", exc)


def _fresh_coordinator(config: TrainConfig):
    """This job's Coordinator, under the cluster's well-known name (node watchers started
    with the nodes, ``moshray watch``, find it by that name). A Coordinator left by an
    earlier job on the same cluster is replaced: one training job per cluster."""
    import ray

    import moshray.cluster.coordinator.actor as coordinator_mod
    from moshray.cluster.metrics import Prices
    from moshray.cluster import placement
    from moshray.cluster.coordinator.membership import MembershipConfig

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
        MembershipConfig(compression=t.wire_codec, peer_ttl_s=max(3.0, t.round_timeout_s),
                         max_group=t.max_group, min_part=t.min_part),
        target_batch_size=t.target_batch_size, name=placement.COORDINATOR_NAME,
        metrics_port=config.metrics.port, step_grace_s=t.step_grace_s,
        prices=Prices(config.metrics.spot_price_per_hour, config.metrics.on_demand_price_per_hour))
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
    from moshray.actors.moe.expert_config import ExpertSetConfig, ExpertSpec
    from moshray.actors.moe.expert_supervisor import spawn_expert_set
    from moshray.jobs.examples.lm.model import moe_layer_name

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


def read_stats(fetch, last: dict) -> dict:
    """The Coordinator's stats with its whole step history; ``fetch(since)`` is its
    ``stats(since)`` and ``last`` the previous answer. Only the rows after those held are
    fetched from the same Coordinator; a restarted one (a new ``incarnation``) is read from
    its first row, as its history starts over."""
    held = last["history"] if last.get("incarnation") else []
    stats = fetch(len(held))
    if stats["incarnation"] != last.get("incarnation"):
        if held:  # another Coordinator than the rows held: read its history from the start
            stats = fetch(0)
        return stats
    stats["history"] = held + stats["history"]
    return stats


def _supervise(config: TrainConfig, controller, out, stop_when: StopWhen | None = None,
               guard: DurabilityGuard | None = None) -> dict:
    """Run the controller until ``max_steps`` / ``max_seconds`` / ``STOP`` / ``stop_when``;
    then withdraw the capacity request at once (``ray job stop`` kills the driver a few
    seconds after its SIGTERM), stop the replicas and summarize. Each tick ``guard`` (if
    given) sees the machines the controller saw: checkpoints may switch to the cluster's
    durable location, or its ``ConfigError`` / ``UserError`` ends the run."""
    import ray

    from moshray.jobs import run_report

    t = config.training
    coordinator = controller.coordinator
    started = time.monotonic()
    console = run_report.Console(out)
    last_ckpt = 0
    committed = 0  # the newest step seen applied, across Coordinator restarts
    stats: dict = {"history": [], "epoch": 0}
    while True:
        controller.step()
        if guard is not None:
            config = guard.update(controller.hosts)
        try:
            stats = read_stats(
                lambda since: ray.get(coordinator.stats.remote(since), timeout=30), stats)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("Coordinator stats not read (%s)", type(exc).__name__)
        if stats.get("committed", committed) < committed:  # a restarted Coordinator:
            coordinator.note_committed.remote(committed)  # a fall back below is a rollback
        committed = max(committed, stats.get("committed", 0))
        elapsed = time.monotonic() - started
        fraction = run_report.run_fraction(stats["epoch"], elapsed, t.max_steps, t.max_seconds)
        console.show(stats, elapsed, fraction)
        epoch = stats["epoch"]
        if config.checkpoint.uri and epoch - last_ckpt >= config.checkpoint.every_steps:
            checkpoint_through_replica(config.checkpoint.uri, controller)
            last_ckpt = epoch
        if (t.max_steps is not None and epoch >= t.max_steps) or \
                (t.max_seconds is not None and elapsed >= t.max_seconds) or STOP.is_set() \
                or (stop_when is not None and stop_when(stats)):
            break
        STOP.wait(POLL_S)
    controller.release_capacity()
    call_with_retries(coordinator.request_stop, "stop the replicas")
    statuses = []
    for peer_id, _, run_ref in controller.live():
        try:
            statuses.append(ray.get(run_ref, timeout=t.round_timeout_s * 3 + 30))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            cause = str(exc).strip().splitlines()[-1:] or [""]
            log.warning("replica %s did not finish: %s %s", peer_id, type(exc).__name__,
                        cause[0][:300])
    wall = time.monotonic() - started
    if config.checkpoint.uri:
        checkpoint_through_replica(config.checkpoint.uri, controller)
    stats = call_with_retries(coordinator.stats, "read the final stats") or stats
    console.show(stats, wall, 1.0 if (t.max_steps or t.max_seconds) else None)  # the last ones
    summary = run_report.summarize(stats, statuses, controller.leaving(), wall,
                                   controller.hard_losses)
    try:  # where a replica's time went per step, at the swarm's largest
        summary["step_profile"] = ray.get(coordinator.step_profile.remote(
            run_report.full_size_epoch(stats["history"])), timeout=30)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        log.warning("step profile not read (%s)", type(exc).__name__)
    state = final_state(controller, summary["steps"]) if controller.spec.job.return_state \
        else None
    summary["replica_lifecycle"] = controller.states()
    summary["replica_timelines"] = controller.timelines()
    summary["nodes_joined"] = len(controller.joined_at)
    summary["prices"] = controller.prices()  # what the worker nodes cost, and whence
    summary["plot"] = run_report.write_outputs(
        config.run_dir, stats["history"], summary,
        {"preemptions": controller.lost_at, "joins": controller.joined_at})
    print(run_report.done_line(summary), file=out, flush=True)
    if controller.spec.job.return_state:  # for moshray.fit's Result (not printed)
        summary["final_state"], summary["statuses"] = state, statuses
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def with_default_trace(config: TrainConfig) -> TrainConfig:
    """``moshray train`` on the embedded cluster replays the shipped spot trace unless told
    otherwise (``--trace FILE|NAME``, or ``--trace off`` for nodes that never go), so a
    first run shows preemptions survived. A cluster address leaves the trace unset."""
    from dataclasses import replace

    from moshray.autoscaler.traces import DEFAULT_TRACE

    c = config.cluster
    if c.trace == "off":
        return replace(config, cluster=replace(c, trace=None))
    if c.trace is None and not (c.address or os.environ.get("RAY_ADDRESS")):
        return replace(config, cluster=replace(c, trace=DEFAULT_TRACE))
    return config


@exit_on_config_error
def main(args: argparse.Namespace) -> int:
    from moshray.jobs.controller.elastic import NoCapacityError

    config = with_default_trace(config_from_args(args))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    stop_on_sigterm()
    try:
        summary = run(config)
    except NoCapacityError as exc:
        print(f"moshray: {exc}", file=sys.stderr)
        return 3
    if config.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module('moshray.jobs.train'))
