"""The training job: `python -m moshray.jobs.train` / `moshray train` / `ray job submit`.

Against a running cluster (``RAY_ADDRESS`` set, as under ``ray job submit``, or
``cluster.address``) the job connects to it; with no address it first starts the embedded
local cluster, which plays the cloud (``jobs/local/cloud.py``: raylets on 127.0.0.1 added,
noticed, removed or killed, by a replayed spot trace with ``--trace``). Either way the same
elastic controller (``jobs/controller/elastic.py``) then keeps one replica on every worker node Ray
has, up to ``cluster.max_nodes``, asks Ray's autoscaler for capacity, and waits (bounded by
``cluster.wait_for_nodes_s``) while there is none.

The driver shows the run's progress (``jobs/run_report.py``: one line redrawn in place on a
terminal, else a line every 10 s; Ray's own processes' lines kept off it), checkpoints
every N steps through a training replica, stops the replicas at ``max_steps`` /
``max_seconds`` and prints a summary (the last line is JSON with ``--json``); it writes
``summary.json`` and ``training.png`` into ``run_dir`` and names them on its end line. An
address that no cluster answers (or a job-submission ``http://`` address) is refused
within seconds (``jobs/ray_address.py``). Replicas train and average on their own through
the Coordinator, which serves Prometheus metrics on ``metrics.port``. With
``model.moe_layers`` (``--moe``) an ExpertSupervisor keeps the DMoE experts served on the
worker nodes.

Nodes are separate machines: the built-in corpus reaches replicas through the object store,
user data as URIs each replica opens itself. Durability follows the cluster
(``durability.py``): once the job has seen a second machine, a node-local or missing
``checkpoint.uri`` switches to the cluster's durable location (``MOSHRAY_CHECKPOINT_URI``) or
the job stops with one line, as it does for a node-local data path. Every exit path
(success, error, SIGTERM from ``ray job stop``, Ctrl-C) withdraws the job's capacity request,
stops the watchers it started and removes the replicas. A replica whose loop raises is
retried up to ``training.max_failures`` times (``jobs/controller/reconcile.py`` rule 6);
then the job fails with that error (``moshray train`` prints it and exits with status 4).
The replicas, the Coordinator and the job's state outlive a driver that dies without
running its exit path (SIGKILL, a crash): the same job submitted again adopts them, and
they stop by themselves after ``cluster.driver_lease_s`` without a driver
(``jobs/controller/lease.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

from moshray.cluster.coordinator.step_samples import KEEP_EPOCHS
from moshray.jobs.config import (
    ConfigError,
    TrainConfig,
    add_config_arguments,
    config_from_args,
    exit_on_config_error,
)
from moshray.jobs.controller.driver_calls import (
    MoveBounds,
    call_with_retries,
    checkpoint_through_replica,
    final_state,
)
from moshray.jobs.controller.durability import CHECKPOINT_ENV, DurabilityGuard
from moshray.jobs.controller.replica_states import replica_starts

log = logging.getLogger("moshray.train")
POLL_S = 0.5
CLAIM_WAIT_S = 30.0  # how long a new driver waits for the same job's old one to be dead
# A stopped driver's save must end before Ray's SIGKILL (RAY_JOB_STOP_WAIT_TIME_S, 3 s by
# default; a scheduler's grace may be longer): what it did not finish, the lease's does.
STOP_SAVE_S = 10.0
# Set by SIGTERM (`ray job stop`, a scheduler, a test): the run stops as at its time limit,
# with a checkpoint and a summary, instead of dying mid-step.
STOP = threading.Event()
# A caller's own end condition: given the Coordinator's stats (its whole step history rows
# ``(epoch, at_s, samples, loss, peers)`` included) at every supervision poll; True ends the
# run as its time limit would.
StopWhen = Callable[[dict], bool]


def run(config: TrainConfig, job=None, stop_when: StopWhen | None = None,
        on_report=None) -> dict:
    """Train ``job`` (``actors.replica.Job``: the user's loop and data; None: the built-in
    LM) on the cluster at ``cluster.address`` / ``RAY_ADDRESS``, else on the embedded local
    cluster (started and stopped here); returns the run's summary. ``stop_when`` (optional)
    ends the run early, as ``max_seconds`` would (replicas stopped, final checkpoint and
    summary); an exception it raises propagates and the replicas are killed, not stopped
    cleanly."""
    config = config.named()  # its name on the cluster: Coordinator, lease, run, run_dir
    address = config.cluster.address or os.environ.get("RAY_ADDRESS")
    driver = run_job
    if config.cluster.replica == "node":  # replica groups: their own driver
        from moshray.jobs.controller.groups import run_groups as driver
    if address:
        return driver(config, address, job, stop_when, on_report)
    from moshray.jobs.local.cloud import run_embedded

    return run_embedded(config, lambda addr: driver(config, addr, job, stop_when, on_report))


def stop_on_sigterm() -> None:
    """SIGTERM sets ``STOP`` (the run ends as at its time limit). Call after ``ray.init``,
    which installs Ray's own handler, from the main thread (elsewhere it does nothing)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: STOP.set())


def connect(config: TrainConfig, address: str) -> bool:
    """Connect this driver to the cluster at ``address`` unless it is connected already;
    True when this call connected (the caller then disconnects with ``ray.shutdown``).
    ``check_address`` fails in seconds, with one line, where nothing answers."""
    import ray

    from moshray.jobs import run_report

    owned = not ray.is_initialized()  # a caller's own connection stays up after the job
    if owned:
        from moshray.jobs.ray_address import check_address

        # seconds, not minutes of Ray's GCS retries, for an address where nothing answers
        check_address(address, "cluster.address" if config.cluster.address else "RAY_ADDRESS")
        if address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost"):
            # A loopback cluster (tests, one machine): stay on loopback; Ray would otherwise
            # swap 127.0.0.1 for this machine's network address.
            from moshray.jobs.local.cluster import pin_loopback

            pin_loopback()
        # Ray's own INFO lines (connecting, connected) stay off the console
        ray.init(address=address, namespace="moshray", log_to_driver=True,
                 logging_level=logging.WARNING)
        stop_on_sigterm()
    run_report.quiet_ray_logs()  # raylet / GCS lines stay in Ray's log files
    return owned


def run_job(config: TrainConfig, address: str, job=None,
            stop_when: StopWhen | None = None, on_report=None) -> dict:
    """The job's driver on the cluster at ``address``: the same on every cluster. ``job``
    may be a callable of the connected driver returning the ``Job`` (data sources that
    need Ray, such as a Ray Dataset's blocks, are made there)."""
    import ray

    from moshray.actors.replica.checkpoint import job_run_id, resume_point
    from moshray.jobs.examples.lm.corpus import resolve_data, ship_files
    from moshray.jobs.controller.elastic import ElasticController

    config = config.named()  # a caller of this driver itself (a bench, a test) may not have
    # The run's outputs go where the working directory is now: a directory Ray unpacked
    # for the job can be replaced under the driver while it runs (raylets of one machine
    # share it), and the relative path with it.
    if not os.path.isabs(os.path.expanduser(config.run_dir)):
        config = dataclasses.replace(config, run_dir=os.path.abspath(config.run_dir))

    from moshray.jobs.controller.lease import fingerprint as lease_fingerprint
    from moshray.jobs.controller.replica_launch import ReplicaSpec, adopted_job_key

    from moshray.jobs import run_report

    # The console: lines printed while the progress bar is up clear and redraw it.
    out = run_report.ConsoleStream(sys.stderr if config.json else sys.stdout)
    owned = connect(config, address)
    controller = coordinator = experts = lease = None
    try:
        # Durability follows the machines seen: decided now, again as new ones appear.
        guard = DurabilityGuard(config, os.environ.get(CHECKPOINT_ENV), out)
        config = guard.update(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
        if callable(job) and not hasattr(job, "loop"):
            job = job()
        builtin = job is None  # the built-in LM: its model is the config's
        if job is None:
            import moshray.jobs.examples.lm.example as lm
            if config.data.paths:
                files = resolve_data(list(config.data.paths), config.data.cache_dir)
            else:  # the built-in corpus, built on the driver, travels through the object store
                files = ship_files(resolve_data(None, os.path.expanduser(config.data.cache_dir)))
            job = lm.job(config, files)
        else:
            config = guard.add_data(getattr(getattr(job, "data", None), "uris", ()))
        if config.training.mode == "auto":  # measured on the spot nodes; one line printed
            from moshray.jobs.controller.mode_probe import resolve_auto

            config = resolve_auto(config, builtin, out)
        resume = None  # the replicas read it from the store; the driver reads manifests
        if config.checkpoint.uri:
            c = config.checkpoint
            found = resume_point(c.uri, job_run_id(c, config.name), c.resume_from,
                                 config.to_dict())
            if found is not None:
                resume, where = found
                print(f"resuming from checkpoint at step {resume.step} ({where})", file=out,
                      flush=True)
        # the job is named by its config as submitted, not as this driver's guard (or
        # training.mode auto) made it: a resubmission that sees more machines at its start
        # than the first driver did is still the same job, and adopts its swarm
        coordinator, lease, record, adopting = _claim_cluster(
            config, out, lease_fingerprint(guard.submitted.to_dict()))
        if adopting:
            config = guard.adopt_location(record.checkpoint_uri)
        address_shown = ray.get(coordinator.metrics_address.remote(), timeout=30)
        if address_shown:
            print(f"metrics: http://{address_shown}/metrics", file=out, flush=True)
        experts = _start_experts(config, coordinator) if config.model.moe else None
        spec = ReplicaSpec(config.to_dict(), job, coordinator, resume,
                           run_id=record.run_id)
        controller = ElasticController(config, spec, experts, out, lease=lease)
        if adopting:
            adopted = controller.adopt(record)
            # new replicas must sign with the running swarm's key (collective/auth.py)
            key = adopted_job_key(controller.runs[r][0] for r in adopted)
            if key is not None:
                controller.spec = dataclasses.replace(spec, job_key=key)
            print(f"adopting the running swarm of run {record.run_id}: {len(adopted)} "
                  f"replicas", file=out, flush=True)
        summary = _supervise(config, controller, out, stop_when, guard, on_report)
        if experts is not None:
            summary["experts"] = _stop_experts(experts)
            experts = None
        return summary
    except BaseException:  # an error, Ctrl-C: nothing of this job is left running
        run_report.close_open_consoles()  # the error's lines start below the progress bar
        _leave_nothing_running(controller, experts)
        raise
    finally:
        _end_job(controller, coordinator, lease)
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


def _end_job(controller, coordinator, lease=None) -> None:
    """Every exit path (success, error, ``ray job stop``'s SIGTERM, Ctrl-C): remove the
    replicas (detached: they would outlive the driver), withdraw the job's capacity request,
    stop the watchers it started (a node's own keep running), remove its Coordinator, and
    release and remove the job's lease. Each failure is logged, never raised. (Only a
    driver that dies without running this leaves the swarm to its lease.)"""
    import ray

    if controller is not None:
        controller.stop_replicas()
        controller.release_capacity()
        controller.stop_watchers()
    if coordinator is not None:
        from moshray.cluster.coordinator.actor import remove

        try:
            remove(coordinator)  # its state in the GCS too
        except ray.exceptions.RayError as exc:
            log.warning("Coordinator not removed: %r", exc)
    if controller is not None:
        controller.stop_renewing()  # renewed through every wait above; not after release
    if lease is not None:
        try:
            ray.get(lease.release.remote(), timeout=30)
            ray.kill(lease, no_restart=True)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("job lease not released: %r", exc)


def _claim_cluster(config: TrainConfig, out, fingerprint: str):
    """The Coordinator and the job's lease (``jobs/controller/lease.py``) for this driver:
    ``(coordinator, lease, record, adopting)``. Jobs of other names are not touched. The
    running swarm of this name whose driver is gone is adopted (its Coordinator and replicas
    go on); one whose driver lives refuses this submission (``ConfigError`` on ``name``,
    one line); one that was stopping or ran another config is ended first; then a fresh
    Coordinator and swarm id are made."""
    import uuid
    from dataclasses import replace

    import ray

    from moshray.cluster import placement
    from moshray.jobs.controller import lease as leases

    me = leases.current_job()
    lease = leases.get_or_create(config.name)
    record, holder_alive = ray.get(lease.get.remote(), timeout=60)
    if holder_alive and record.holder != me and record.fingerprint == fingerprint:
        # The same job's driver, maybe just killed: Ray declares a dead driver within
        # seconds; wait for that (bounded) rather than replace a swarm we could adopt.
        deadline = time.monotonic() + CLAIM_WAIT_S
        while holder_alive and time.monotonic() < deadline:
            time.sleep(1.0)
            holder_alive = leases.job_alive(record.holder)
    claim = leases.decide_claim(record, me, fingerprint, holder_alive)
    if isinstance(claim, leases.Refuse):
        raise ConfigError("name", claim.reason)
    if isinstance(claim, leases.Adopt):
        try:
            coordinator = ray.get_actor(placement.coordinator_name(config.name),
                                        namespace=placement.NAMESPACE)
            ray.get(coordinator.metrics_address.remote(), timeout=60)
        except (ValueError, ray.exceptions.RayError, TimeoutError) as exc:
            claim = leases.Replace(f"its Coordinator is gone ({type(exc).__name__})")
        else:
            record = replace(claim.record, holder=me, stopping=False,
                             lease_s=config.cluster.driver_lease_s)
            ray.get(lease.take.remote(record), timeout=60)
            return coordinator, lease, record, True
    if isinstance(claim, leases.Replace):
        print(f"ending the earlier swarm of job {config.name}: {claim.reason}", file=out,
              flush=True)
        ray.get(lease.end.remote(claim.reason), timeout=240)
    coordinator = _fresh_coordinator(config)
    record = leases.JobRecord(
        run_id=uuid.uuid4().hex[:8], fingerprint=fingerprint,
        holder=me, lease_s=config.cluster.driver_lease_s,
        checkpoint_uri=config.checkpoint.uri, name=config.name)
    ray.get(lease.take.remote(record), timeout=60)
    return coordinator, lease, record, False


def _fresh_coordinator(config: TrainConfig):
    """This job's Coordinator, named after the job (``placement.coordinator_name``; node
    watchers tell every job's). A Coordinator left by an earlier job of the same name is
    replaced; other jobs' are not touched. Its metrics carry ``job=<name>``."""
    import ray

    import moshray.cluster.coordinator.actor as coordinator_mod
    from moshray.cluster.metrics import Prices
    from moshray.cluster import placement
    from moshray.cluster.coordinator.membership import MembershipConfig

    t = config.training
    name = placement.coordinator_name(config.name)
    try:
        stale = ray.get_actor(name, namespace=placement.NAMESPACE)
    except ValueError:
        stale = None
    if stale is not None:
        log.warning("replacing the Coordinator of an earlier job (%s)", name)
        ray.kill(stale, no_restart=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=placement.NAMESPACE)
            except ValueError:
                break
            time.sleep(0.1)
        coordinator_mod.forget_saved_states(name)  # its saved state
    # The exporter listens on the head node's loopback: Prometheus runs there too.
    coordinator = coordinator_mod.get_or_create(
        MembershipConfig(compression=t.wire_codec, peer_ttl_s=max(3.0, t.round_timeout_s),
                         max_group=t.max_group, min_part=t.min_part,
                         zone_aware=t.zone_aware),
        target_batch_size=t.target_batch_size, name=name, job=config.name,
        metrics_port=config.metrics.port, step_grace_s=t.step_grace_s,
        local_steps=t.averaging_local_steps,
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
    ``stats(since)`` and ``last`` the previous answer.

    From the same Coordinator, only the rows a Coordinator may still rewrite are fetched
    again: the last ``KEEP_EPOCHS`` held (a plan nobody applied is replaced by a newer
    plan of its epoch; a participant's count corrects its row) and the new ones. If the
    first row fetched is not the one held at its place, rows before it changed too (a fall
    back of more steps than that) and the whole history is read. After a restart
    (``restarts``) or from a new Coordinator (a new ``incarnation``: the state was lost,
    the history started over) its history is read from its first row, and the rows held
    of the steps before its first are kept in front (``history_kept`` of them): no row is
    ever dropped; kept rows' times are on the earlier Coordinator's clock.

    A row of the same plan (its epoch and plan time) as one held keeps the larger sample
    count: counts only grow, and a restarted Coordinator may have lost a correction made
    just before it died (corrections are written behind, ``durable.FLUSH_S``)."""
    held = last["history"] if last.get("incarnation") else []
    kept = last.get("history_kept", 0) if held else 0
    tail = max(kept, len(held) - KEEP_EPOCHS)  # the first held row fetched again
    stats = fetch(tail - kept)
    if stats["incarnation"] == last.get("incarnation") and \
            stats.get("restarts") == last.get("restarts"):
        rows = stats["history"]
        if tail == len(held) or (rows and _plan(rows[0]) == _plan(held[tail])):
            stats["history"] = held[:tail] + _merged(held[tail:], rows)
            stats["history_kept"] = kept
            return stats
    # Another Coordinator than the rows held, a restarted one (its newest rows may differ
    # from those held: a plan nobody applied was made again), or rows before the tail
    # changed: its whole history is read.
    if held:
        if tail != kept:
            stats = fetch(0)
        rows = stats["history"]
        first = rows[0][0] if rows else float("inf")
        before = [h for h in held if h[0] < first]
        stats["history"] = before + _merged(held[len(before):], rows)
        stats["history_kept"] = len(before)
    return stats


def _plan(row) -> tuple:
    """Which plan a history row ``(epoch, at_s, samples, loss, peers)`` is of: its epoch and
    plan time (a plan made again for an epoch has a later one)."""
    return row[0], round(row[1], 6)


def _merged(held: list, rows: list) -> list:
    """``rows`` (the Coordinator's, in place of ``held``), each with the larger sample
    count of the held row of the same plan, if any."""
    seen = {_plan(h): h[2] for h in held}
    out = []
    for r in rows:
        old = seen.get(_plan(r))
        out.append(r if old is None or old <= r[2] else (r[0], r[1], old, *r[3:]))
    return out


def data_epochs(stats: dict, num_shards: int | None) -> float | None:
    """Passes over the data handed out so far (the Coordinator's ``data_position`` over the
    source's ``num_shards``; ``training.max_epochs`` counts these); None if unknown."""
    position = stats.get("data_position")
    if position is None or not num_shards:
        return None
    return position / num_shards


def _supervise(config: TrainConfig, controller, out, stop_when: StopWhen | None = None,
               guard: DurabilityGuard | None = None, on_report=None) -> dict:
    """Run the controller until ``max_steps`` / ``max_seconds`` / ``max_epochs`` /
    ``STOP`` / ``stop_when``; then withdraw the capacity request at once (``ray job stop``
    kills the driver a few seconds after its SIGTERM), stop the replicas and summarize. Each tick ``guard`` (if
    given) sees the machines the controller saw: checkpoints may switch to the cluster's
    durable location, or its ``ConfigError`` / ``UserError`` ends the run. What the
    loops report (``Session.report``) is read every tick (``jobs/reported.py``: TensorBoard
    files in ``run_dir``, ``on_report``, the summary's ``reported``)."""
    import ray

    from moshray.jobs import run_report
    from moshray.jobs.reported import ReportedLog

    t = config.training
    coordinator = controller.coordinator
    started = time.monotonic()
    console = run_report.Console(out, run_report.Bounds(t.max_steps, t.max_seconds,
                                                        getattr(t, "max_epochs", None)))
    last_ckpt = controller.last_checkpoint  # an adopted swarm's newest checkpoint
    committed = 0  # the newest step seen applied, across Coordinator restarts
    stats: dict = {"history": [], "epoch": 0}
    reported = ReportedLog(config.run_dir, on_report)
    bounds = MoveBounds()  # a checkpoint save's wait, bounded by the bytes that move
    num_shards = getattr(getattr(controller.spec.job, "data", None), "num_shards", None)

    def read_reported() -> None:
        try:
            reported.poll(lambda since: ray.get(coordinator.reported.remote(since), timeout=30))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("reported metrics not read (%s)", type(exc).__name__)

    while True:
        controller.step()
        if guard is not None:
            config = guard.update(controller.hosts)
            # the lease's final save goes there too: it hears so now, not a tick later
            controller.move_checkpoints(config.checkpoint.uri)
        try:
            stats = read_stats(
                lambda since: ray.get(coordinator.stats.remote(since), timeout=30), stats)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("Coordinator stats not read (%s)", type(exc).__name__)
        if stats.get("committed", committed) < committed:  # a restarted Coordinator:
            coordinator.note_committed.remote(committed)  # a fall back below is a rollback
        committed = max(committed, stats.get("committed", 0))
        stats["data_epochs"] = data_epochs(stats, num_shards)
        read_reported()
        elapsed = time.monotonic() - started
        console.show(stats, elapsed)
        epoch = stats["epoch"]
        if config.checkpoint.uri and epoch - last_ckpt >= config.checkpoint.every_steps:
            saved = checkpoint_through_replica(config.checkpoint.uri, controller, bounds)
            if saved.tried:  # a failure counts toward training.max_checkpoint_failures
                controller.checkpoint_saved(not saved.failed)
            if saved.rate:  # the next save is bounded by the rate this one measured
                bounds = dataclasses.replace(bounds, rate=saved.rate)
            last_ckpt = controller.last_checkpoint = epoch
        if (t.max_steps is not None and epoch >= t.max_steps) or \
                (t.max_seconds is not None and elapsed >= t.max_seconds) or STOP.is_set() \
                or (t.max_epochs is not None and stats["data_epochs"] is not None
                    and stats["data_epochs"] >= t.max_epochs) \
                or (stop_when is not None and stop_when(stats)) \
                or controller.stop_requested:
            if controller.stop_requested:
                print(f"stopping: `moshray stop {config.name}`", file=out, flush=True)
            break
        STOP.wait(POLL_S)
    if STOP.is_set():  # `ray job stop`: SIGKILL follows in seconds (RAY_JOB_STOP_WAIT_TIME_S)
        _stopping(config, controller, epoch > last_ckpt)
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
        saved = checkpoint_through_replica(config.checkpoint.uri, controller, bounds)
        if saved.tried:
            controller.checkpoint_saved(not saved.failed)
    final = call_with_retries(coordinator.stats, "read the final stats")
    if final is not None:  # the rows held are kept as every poll keeps them (read_stats)
        stats = read_stats(lambda since: {**final, "history": final["history"][since:]}, stats)
    stats["data_epochs"] = data_epochs(stats, num_shards)
    read_reported()
    reported.close()
    console.close(stats, wall)  # the last step's line
    summary = run_report.summarize(stats, statuses, controller.leaving(), wall,
                                   controller.hard_losses)
    summary["preemptions"] = controller.preemptions  # the driver counts its node losses
    # replica starts put off because the lease did not take them in its record (each
    # decided again at the next tick; see ElasticController._start)
    summary["launches_deferred"] = controller.launches_deferred
    summary["reported"] = reported.summary()  # the loops' own metrics: last value, step
    summary["data_epochs"] = stats["data_epochs"]
    summary["tensorboard"] = reported.tensorboard_dir
    try:  # where a replica's time went per step, at the swarm's largest
        summary["step_profile"] = ray.get(coordinator.step_profile.remote(
            run_report.full_size_epoch(stats["history"])), timeout=30)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        log.warning("step profile not read (%s)", type(exc).__name__)
    state = final_state(controller, summary["steps"]) \
        if controller.spec.job.return_state or config.save_model else None
    if config.save_model:
        summary["model"] = run_report.save_model(config.run_dir, state)
    summary["replica_lifecycle"] = controller.states()
    summary["replica_timelines"] = controller.timelines()
    summary["replica_starts"] = replica_starts(summary["replica_timelines"]).to_json()
    summary["nodes_joined"] = len(controller.joined_at)
    summary["replica_failures"] = len(controller.job_failures)  # loops that raised
    summary["checkpoint_failures"] = controller.checkpoint_failures_total
    summary["prices"] = controller.prices()  # what the worker nodes cost, and whence
    summary["plot"] = run_report.write_outputs(
        config.run_dir, stats["history"], summary,
        {"preemptions": controller.lost_at, "joins": controller.joined_at})
    print(run_report.done_line(summary, config.run_dir), file=out, flush=True)
    if controller.spec.job.return_state:  # for moshray.fit's Result (not printed)
        summary["final_state"], summary["statuses"] = state, statuses
    return summary


def _stopping(config: TrainConfig, controller, checkpoint: bool) -> None:
    """The first things a stopped driver does, before its grace period runs out: tell the
    lease (should the driver now be killed, the lease ends the swarm at once, with a final
    checkpoint) and, if ``checkpoint`` (steps since the last one), write the checkpoint
    before waiting for any replica to finish."""
    import ray

    if controller.lease is not None:
        try:
            ray.get(controller.lease.stopping.remote(), timeout=2)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("lease not told of the stop: %r", exc)
    if config.checkpoint.uri and checkpoint:
        saved = checkpoint_through_replica(config.checkpoint.uri, controller,
                                           MoveBounds(limit_s=STOP_SAVE_S))
        if saved.tried:
            controller.checkpoint_saved(not saved.failed)


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


def check_trace(config: TrainConfig) -> None:
    """Read ``cluster.trace`` (if set) before any cluster starts: a missing, unreadable or
    malformed trace is a ``ConfigError`` with one line naming the file (and line)."""
    if config.cluster.trace is None:
        return
    from moshray.autoscaler.traces import load_trace
    from moshray.autoscaler.traces.parse import TraceError

    try:
        load_trace(config.cluster.trace)
    except (TraceError, OSError) as exc:
        raise ConfigError("cluster.trace", str(exc).strip().splitlines()[0] if str(exc)
                          else type(exc).__name__) from None


@exit_on_config_error
def main(args: argparse.Namespace) -> int:
    from moshray.jobs.controller.elastic import JobFailed, NoCapacityError

    config = with_default_trace(config_from_args(args))
    check_trace(config)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ray").setLevel(logging.WARNING)  # Ray's INFO lines: not the user's
    stop_on_sigterm()
    try:
        summary = run(config)
    except NoCapacityError as exc:
        print(f"moshray: {exc}", file=sys.stderr)
        return 3
    except JobFailed as exc:  # the user's exception with its remote traceback, then why
        if exc.error is not None:
            print(str(exc.error).rstrip(), file=sys.stderr)
        print(f"moshray: the job failed: {exc.reason}", file=sys.stderr)
        return 4
    if config.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module('moshray.jobs.train'))
