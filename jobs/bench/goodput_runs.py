"""`moshray bench goodput`, Ray Train's runners and calibrations, and the held-out loss.

* :func:`run_raytrain`: a fresh ``LocalCluster`` with the schedule's initial nodes, the Ray
  Train driver (``moshray.jobs.bench.raytrain_baseline``) in a subprocess, the schedule's later node
  events applied from this (main) thread at their times after the driver's ``fit()`` start.
* :func:`calibrate_raytrain`: Ray Train's failure-free rate at each node count (the same
  model and batches, n nodes for the whole run, no node event, no checkpoint), as
  :func:`~moshray.jobs.bench.goodput_rates.steady_rate` measures it. moshray's counterparts, each
  run a driver process of its own too, are in ``goodput_moshray``.
* :func:`held_out_loss`: the final model's loss on held-out batches, the same for both.

Every wait is bounded; a calibration that cannot measure a rate raises ``BenchError`` (one
line naming the system and node count).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from moshray.jobs.bench.goodput_curves import Progress
from moshray.jobs.bench.goodput_rates import BenchError, steady_rate

log = logging.getLogger("moshray.bench_goodput")

CPUS_PER_NODE = 2  # what moshray.jobs.train gives each local spot node
EVAL_BATCH_PER_SHARD = 32
CALIB_NO_CHECKPOINT = 10**9  # a checkpoint interval no calibration run reaches


@dataclass(frozen=True)
class RayTrainOptions:
    """How the Ray Train baseline runs: ``max_workers`` (the elastic upper bound, or the fixed
    size with ``fixed``), the checkpoint interval in steps, the elastic resize interval, the
    bounds on the driver's start and on its end after the window, ``steady_seconds``
    (if set, workers stop that many seconds after their group's first step) and ``links``
    (a ``NodeLinks``: the cluster is on separate hosts with a link profile's shaped links,
    gloo on each node's ``eth0``; None: every node on loopback) and ``torchft`` (the run is
    Ray Train + torchft: a Manager quorum per step, failed replica groups replaced alone)."""

    max_workers: int
    checkpoint_every: int = 20
    resize_interval_s: float = 10.0
    fixed: bool = False
    startup_timeout_s: float = 300.0
    finish_timeout_s: float = 240.0
    steady_seconds: float | None = None
    links: object = None  # NodeLinks | None
    torchft: bool = False  # Ray Train + torchft (``raytrain_baseline --torchft``)


def calibrate_raytrain(config, counts: Sequence[int], seconds: float, options: RayTrainOptions,
                       out_dir: Path) -> dict[int, float]:
    """Failure-free Ray Train (DDP) samples/s with each node count in ``counts``: a fresh
    cluster of n nodes and no node events, ``num_workers=n`` fixed, no checkpoint during the
    run, training for ``seconds`` after the worker group's first step (its start-up, which
    takes 25-50 s on a loaded 2-core machine, is not part of the window); the rate from the
    first step with all n workers (``steady_rate``). The run is bounded by
    ``options.startup_timeout_s + seconds`` after ``fit()`` starts."""
    from moshray.autoscaler.traces import NodeEvent

    rates: dict[int, float] = {}
    for n in sorted(set(counts)):
        held = tuple(NodeEvent(0.0, "add", slot) for slot in range(n))
        opts = replace(options, max_workers=n, fixed=True, checkpoint_every=CALIB_NO_CHECKPOINT,
                       steady_seconds=seconds)
        run_dir = out_dir / f"raytrain-calib-{n}"
        run_dir.mkdir(parents=True, exist_ok=True)
        rt = run_raytrain(config, held, options.startup_timeout_s + seconds, opts, run_dir)
        try:
            if rt.error is not None:
                raise BenchError(f"the driver failed: {rt.error}")
            rates[n] = steady_rate(rt.records, rt.worlds, n)
        except BenchError as exc:
            raise BenchError(f"Ray Train with {n} node(s): {exc}; see "
                             f"{run_dir / 'raytrain-driver.log'}") from None
        print_rate("Ray Train", n, rates[n], len(rt.records))
    return rates


def print_rate(system: str, n: int, rate: float, steps: int) -> None:
    print(f"calibration: {system}, {n} node(s) failure-free: {rate:.1f} samples/s "
          f"({rate / n:.1f} per node, {steps} steps)", flush=True)


@dataclass(frozen=True)
class RayTrainRun:
    """Records of one baseline run, times relative to its ``fit()`` start."""

    records: tuple[Progress, ...]
    rewinds: tuple[tuple[float, int], ...]  # (t_s, resumed-from step) per worker group start
    checkpoint: str | None  # the final state file, else the newest persisted (``latest_persisted``)
    error: str | None
    node_log: tuple[tuple[float, str, int], ...]  # (t_s, add|remove|add-failed, slot)
    worlds: tuple[int, ...] = ()  # the worker group's size (torchft: participants) per record
    replica_starts: int = 0  # torchft: worker starts (the first group's included)
    discarded: int = 0  # torchft: replica steps the quorum did not commit
    fit_errors: tuple[str, ...] = ()  # each fit() that raised before the last attempt's end

    def to_json(self) -> dict:
        """The records as plain JSON (``raytrain-records.json`` next to the driver's log), so
        a run can be studied window by window after the bench, as moshray's history can."""
        return {"steps": [[r.t_s, r.step, r.samples, r.loss, w] for r, w in
                          zip(self.records, self.worlds or (None,) * len(self.records))],
                "rewinds": [list(r) for r in self.rewinds],
                "node_log": [list(e) for e in self.node_log], "error": self.error,
                "replica_starts": self.replica_starts, "discarded": self.discarded,
                "fit_errors": list(self.fit_errors)}


def _raytrain_command(duration_s: float, options: RayTrainOptions, address: str,
                      recorder: str, storage: str, config_file: str,
                      gloo_ifname: str) -> list[str]:
    cmd = [sys.executable, "-m", "moshray.jobs.bench.raytrain_baseline", "--address", address,
           "--config", config_file, "--duration", str(duration_s),
           "--max-workers", str(options.max_workers),
           "--checkpoint-every", str(options.checkpoint_every), "--storage-path", storage,
           "--cpus-per-worker", str(CPUS_PER_NODE),
           "--resize-interval", str(options.resize_interval_s), "--recorder", recorder,
           "--gloo-ifname", gloo_ifname]
    if options.steady_seconds is not None:
        cmd += ["--steady-seconds", str(options.steady_seconds)]
    return cmd + (["--fixed"] if options.fixed else []) + (["--torchft"] if options.torchft
                                                           else [])


def run_raytrain(config, events, duration_s: float, options: RayTrainOptions,
                 out_dir: Path) -> RayTrainRun:
    """Start a fresh local cluster with the trace's initial nodes, run the baseline driver in
    a subprocess, and apply the trace's later events to the cluster from this (main) thread
    at their times relative to the driver's ``fit()`` start. Every wait is bounded: the driver
    must report its start within ``options.startup_timeout_s`` and finish within
    ``options.finish_timeout_s`` seconds after the window; otherwise it is killed and the
    records are read from its recorder actor."""
    import uuid

    from moshray.autoscaler.traces import initial_slots
    from moshray.jobs.local.cluster import LocalCluster, LocalClusterConfig
    from moshray.jobs.bench.raytrain_baseline import read_recorder

    recorder = f"raytrain-recorder-{uuid.uuid4().hex[:8]}"
    storage = str(out_dir / "raytrain")
    config_file = out_dir / "raytrain-config.json"
    config_file.write_text(json.dumps(config.to_dict()))
    shaped = options.links
    local = LocalCluster(LocalClusterConfig(
        spot_nodes=0, cpus_per_node=CPUS_PER_NODE,
        **({} if shaped is None else dict(hosts="netns", **shaped.cluster_fields()))))
    node_log: list[tuple[float, str, int]] = []
    proc = None
    driver_log = open(out_dir / "raytrain-driver.log", "w")  # noqa: SIM115 - closed below
    try:
        for slot in initial_slots(events):
            local.add_node(slot)
        env = local.driver_env()
        env.pop("RAY_ADDRESS", None)  # (--address names it)
        # separate hosts: gloo on each node's side of its (shaped) link
        gloo_ifname = "lo" if shaped is None else "eth0"
        env["GLOO_SOCKET_IFNAME"] = gloo_ifname
        proc = subprocess.Popen(
            _raytrain_command(duration_s, options, local.address, recorder, storage,
                              str(config_file), gloo_ifname),
            stdout=subprocess.PIPE, stderr=driver_log, text=True, env=env)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)],
                         daemon=True, name="raytrain-stdout").start()
        started = _wait_for_event(lines, "started", options.startup_timeout_s)
        if started is None:
            raise RuntimeError(f"Ray Train driver did not start within {options.startup_timeout_s} s;"
                               f" see {out_dir / 'raytrain-driver.log'}")
        t0 = float(started["t0"])
        removals: dict[int, threading.Thread] = {}
        for ev in sorted((e for e in events if not (e.at_s == 0 and e.kind == "add")),
                         key=lambda e: e.at_s):
            if ev.at_s > duration_s:
                break
            delay = t0 + ev.at_s - time.time()
            if delay > 0:
                time.sleep(delay)
            if ev.kind == "add" and ev.slot not in local.live_slots():
                if ev.slot in removals:  # the slot's old raylet must be gone first
                    removals.pop(ev.slot).join(timeout=120)
                try:
                    local.add_node(ev.slot)  # raylets start only from the main thread
                except RuntimeError as exc:  # the node never came, as moshray's cloud
                    # records it (LocalCloud.add): `ray start` failed or never registered
                    node_log.append((time.time() - t0, "add-failed", ev.slot))
                    print(f"raytrain: add slot {ev.slot} failed at {node_log[-1][0]:.1f} s: "
                          f"{str(exc).splitlines()[0][:200]}", flush=True)
                    continue
            elif ev.kind in ("remove", "kill") and ev.slot in local.live_slots():
                # A removal happens at its deadline, with no notice to Ray Train; a kill is a
                # hard loss. Stopping a raylet can take seconds under load: do it aside so
                # later events keep their times.
                removals[ev.slot] = threading.Thread(
                    target=local.remove_node, args=(ev.slot,), kwargs={"hard": ev.kind == "kill"},
                    daemon=True, name=f"remove-{ev.slot}")
                removals[ev.slot].start()
            else:
                continue
            node_log.append((time.time() - t0, ev.kind, ev.slot))
            print(f"raytrain: {ev.kind} slot {ev.slot} at {node_log[-1][0]:.1f} s", flush=True)
        for thread in removals.values():
            thread.join(timeout=120)
        remaining = t0 + duration_s - time.time() + options.finish_timeout_s
        finished = _wait_for_event(lines, "finished", max(remaining, 1.0))
        if finished is None:
            if proc.poll() is None:
                log.warning("Ray Train driver did not finish in time; killing pid %d", proc.pid)
                proc.kill()
                error = "driver killed after --finish-timeout"
            else:
                error = f"driver exited with status {proc.returncode} without a summary"
            proc.wait(timeout=30)
            local.connect(namespace="moshray")
            raw = read_recorder(recorder)
            finished = {"records": raw, "checkpoint": None, "error": error}
        else:
            proc.wait(timeout=60)
        raw = finished["records"]
        checkpoint = finished.get("checkpoint") or latest_persisted(storage)
        run = RayTrainRun(
            records=tuple(Progress(s[0] - t0, int(s[1]), int(s[2]),
                                   None if s[3] is None else float(s[3]))
                          for s in raw["steps"]),
            rewinds=tuple((g[0] - t0, int(g[2])) for g in raw["groups"]),
            checkpoint=checkpoint, error=finished.get("error"),
            node_log=tuple(node_log), worlds=tuple(int(s[4]) for s in raw["steps"]),
            replica_starts=len(raw.get("replicas", ())), discarded=len(raw.get("discards", ())),
            fit_errors=tuple(finished.get("fit_errors") or ()))
        (out_dir / "raytrain-records.json").write_text(json.dumps(run.to_json()))
        return run
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        driver_log.close()
        local.shutdown()


def _wait_for_event(lines: queue.Queue, event: str, timeout_s: float) -> dict | None:
    """Next JSON line with ``"event": event`` from the driver's stdout, or None on timeout/EOF."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            return None
        if line is None:
            return None
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if obj.get("event") == event:
            return obj


def held_out_loss(config, files: Sequence[str], model_state: dict | None) -> float | None:
    """Mean loss of ``model_state`` on the held-out batches of every data shard (None if no
    state). The same batches for every system: ``ByteBatches.held_out_batch`` is
    deterministic."""
    if model_state is None:
        return None
    import torch

    from moshray.jobs.examples.lm.corpus import ByteBatches
    from moshray.jobs.examples.lm.model import build_model

    model = build_model(config.model.to_model_config(), seed=0)
    model.load_state_dict(model_state)
    model.eval()
    shards = config.cluster.max_nodes
    losses = []
    with torch.no_grad():
        for shard in range(shards):
            data = ByteBatches(list(files), shard, shards, config.model.seq_len,
                               config.training.batch_size, config.training.seed)
            x, y = data.held_out_batch(EVAL_BATCH_PER_SHARD)
            losses.append(float(model.loss(x, y)))
    return sum(losses) / len(losses)


def moshray_final_state(config) -> dict | None:
    """The model the run saved at its end (``save_model``: ``<run_dir>/model.pt``), else
    the model state of its latest checkpoint, else None."""
    import torch

    saved = Path(config.run_dir).expanduser() / "model.pt"
    if saved.is_file():
        return torch.load(saved, weights_only=True)
    if not config.checkpoint.uri:
        return None
    from moshray.actors.replica.checkpoint import CheckpointStore, job_run_id

    run_id = job_run_id(config.checkpoint, config.name)
    found = CheckpointStore(config.checkpoint.uri, run_id=run_id).load_latest()
    return None if found is None else found[1]["model"]


def latest_persisted(storage: str) -> str | None:
    """The state file of the newest checkpoint Ray Train persisted under ``storage``
    (``<run>/checkpoint_<timestamp>/state.pt``; the timestamp orders them, and the newest is
    what a restarted group resumes from), or None. For a driver that never handed over its
    final checkpoint (killed after ``--finish-timeout``, mid-restart)."""
    from moshray.jobs.bench.raytrain_baseline import STATE_FILE

    found = sorted(Path(storage).glob(f"*/checkpoint_*/{STATE_FILE}"),
                   key=lambda path: path.parent.name)
    return str(found[-1]) if found else None


def raytrain_final_state(path: str | None) -> dict | None:
    """The model state in Ray Train's final checkpoint file ``path`` (None if none)."""
    if not path or not os.path.exists(path):
        return None
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)["model"]
