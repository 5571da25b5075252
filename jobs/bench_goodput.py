"""`moshray bench goodput`: training goodput under a spot trace, moshray vs Ray Train vs the ideal.

One invocation replays the same spot trace (count or per-node format, see
``moshray.autoscaler.trace``) onto a fresh embedded local cluster per system and trains the same
model on the same data for the same wall seconds, three ways:

1. **moshray**: ``moshray.jobs.train.run`` (collaborative DeDLOC steps, Moshpit averaging,
   replicas started and dropped as nodes come and go).
2. **Ray Train**: ``moshray.jobs.raytrain_baseline`` (``TorchTrainer``, DDP, elastic
   ``ScalingConfig(num_workers=(1, max_nodes))``, ``FailureConfig(max_failures=-1)``, a checkpoint
   every ``--checkpoint-every`` steps), driven as a separate driver process; the trace's nodes
   are removed at their deadline and added at their time, with no help for Ray Train.
3. **ideal**: failure-free throughput times the trace's live node-seconds. The throughput is
   measured in the same invocation by short failure-free moshray runs (``--calib-seconds``
   each; the rate from the first step in which every node took part), one per node count
   the trace uses, so the ideal is ``sum_n rate(n) * seconds_at(n)``: per-node throughput x
   node-seconds at each count (on a machine whose nodes share cores a single-node rate would
   overstate what n nodes can do). ``--calib-nodes N`` measures only with N nodes and scales
   the per-node rate linearly.

Both systems use the same global batch (``training.target_batch_size``), micro-batch,
optimizer and learning rate; moshray also checkpoints every ``--checkpoint-every`` steps.

Reported per system: samples (useful samples: for Ray Train the steps lost to a rollback to the
last checkpoint are not counted; the raw count is ``raytrain_samples_processed``), goodput
(samples / duration), the training loss reached (mean of the last 10 steps inside the window),
the held-out loss of the final model (same held-out batches for both), and stall time (total
length of the gaps of at least ``--stall-gap`` seconds in which the useful sample count did not
reach a new high, including the start-up gap). ``--json``: the last stdout line is one JSON
object (``moshray_samples``, ``raytrain_samples``, ``ideal_samples``, ``moshray_vs_ideal``,
``moshray_vs_raytrain``, ``moshray_final_loss``, ``raytrain_final_loss`` and more); the same
object is written to ``<out>/goodput.json`` and the plot (live nodes over time, each system's
cumulative samples) to ``<out>/goodput.png``.

Bad arguments (missing or malformed trace, non-positive sizes, bad ``--set``) exit with status
2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

log = logging.getLogger("moshray.bench_goodput")

# A model that steps quickly on CPU (the README's small configuration).
BENCH_DEFAULTS: dict[str, str] = {
    "model.n_layers": "2",
    "model.d_model": "128",
    "model.d_ff": "256",
    "model.n_heads": "4",
    "model.seq_len": "64",
    "training.batch_size": "8",
    "training.target_batch_size": "32",
}
CPUS_PER_NODE = 2  # what moshray.jobs.train gives each local spot node
LAST_STEPS_FOR_LOSS = 10
EVAL_BATCH_PER_SHARD = 32


class BenchError(ValueError):
    """Bad benchmark input; the message is one line saying what to fix."""


# =========================================================================== pure logic


@dataclass(frozen=True)
class Progress:
    """One optimizer step of a system: ``t_s`` seconds after the window start, the step number,
    the global samples behind it, and its mean training loss (None if unknown)."""

    t_s: float
    step: int
    samples: int
    loss: float | None


@dataclass(frozen=True)
class SystemResult:
    """What the benchmark reports for one system over ``[0, duration_s]``."""

    name: str
    samples: int  # useful samples at the end of the window
    samples_processed: int  # every sample computed, rolled-back work included
    goodput: float  # samples / duration_s
    final_loss: float | None
    stall_s: float
    steps: int  # useful steps at the end of the window
    curve: tuple[tuple[float, int], ...]  # (t_s, useful cumulative samples), one point per event


def useful_curve(records: Sequence[Progress], rewinds: Sequence[tuple[float, int]] = (),
                 duration_s: float | None = None) -> tuple[tuple[float, int], ...]:
    """Cumulative useful samples over time, starting at ``(0, 0)``.

    ``records`` are steps in time order; ``rewinds`` are ``(t_s, step)`` moments at which the
    system restarted from the state after ``step`` (a rollback to a checkpoint; ``step = 0`` is
    a fresh start). A step number at or below the previous one also implies a rollback to the
    step before it. After a rollback to step ``k`` the count falls back to the samples of steps
    ``1..k`` of the surviving lineage; samples of the lost steps are not useful. Events after
    ``duration_s`` (if given) are ignored.
    """
    return _lineage(records, rewinds, duration_s)[0]


def _lineage(records: Sequence[Progress], rewinds: Sequence[tuple[float, int]],
             duration_s: float | None) -> tuple[tuple[tuple[float, int], ...], int]:
    """``(useful_curve, last useful step)``; see :func:`useful_curve`."""
    events: list[tuple[float, int, Progress | None, int]] = []  # (t, order, record, rewind)
    for r in records:
        events.append((r.t_s, 1, r, 0))
    for t, k in rewinds:
        events.append((t, 0, None, k))  # at equal times the rewind comes first
    events.sort(key=lambda e: (e[0], e[1]))
    cum_at: dict[int, int] = {0: 0}  # step -> cumulative useful samples after it (lineage)
    top = 0  # highest step in the current lineage
    curve: list[tuple[float, int]] = [(0.0, 0)]
    for t, _, record, rewind_to in events:
        if duration_s is not None and t > duration_s:
            break
        if record is None:
            top = _rewind(cum_at, min(rewind_to, top))
        else:
            if record.step <= top:
                top = _rewind(cum_at, record.step - 1)
            base = cum_at.get(record.step - 1, cum_at[top])
            cum_at[record.step] = base + record.samples
            top = record.step
        curve.append((max(t, 0.0), cum_at[top]))
    return tuple(curve), top


def _rewind(cum_at: dict[int, int], step: int) -> int:
    """Drop lineage entries after ``step``; returns the new top (the highest kept <= step)."""
    for s in [s for s in cum_at if s > step]:
        del cum_at[s]
    return max(cum_at)


def stall_seconds(curve: Sequence[tuple[float, int]], duration_s: float, gap_s: float) -> float:
    """Total length of the gaps >= ``gap_s`` between new highs of the useful sample count.

    The gaps from 0 to the first new high and from the last one to ``duration_s`` count too,
    so a system that never progresses stalls for the whole window. Work that only redoes lost
    steps is not a new high.
    """
    if gap_s <= 0:
        raise ValueError(f"gap_s must be > 0, got {gap_s}")
    highs = [0.0]
    best = 0
    for t, cum in curve:
        if t > duration_s:
            break
        if cum > best:
            best = cum
            highs.append(t)
    highs.append(duration_s)
    return sum(b - a for a, b in zip(highs, highs[1:]) if b - a >= gap_s)


def final_loss(records: Sequence[Progress], duration_s: float,
               last: int = LAST_STEPS_FOR_LOSS) -> float | None:
    """Mean training loss of the last ``last`` steps at or before ``duration_s`` (None if none)."""
    losses = [r.loss for r in records if r.t_s <= duration_s and r.loss is not None
              and math.isfinite(r.loss)]
    tail = losses[-last:]
    return sum(tail) / len(tail) if tail else None


def summarize(name: str, records: Sequence[Progress], duration_s: float, gap_s: float,
              rewinds: Sequence[tuple[float, int]] = ()) -> SystemResult:
    """Reduce one system's step records to the reported figures over ``[0, duration_s]``."""
    curve, steps = _lineage(records, rewinds, duration_s)
    inside = [r for r in records if r.t_s <= duration_s]
    samples = curve[-1][1]
    return SystemResult(
        name=name, samples=samples, samples_processed=sum(r.samples for r in inside),
        goodput=samples / duration_s if duration_s > 0 else 0.0,
        final_loss=final_loss(records, duration_s),
        stall_s=stall_seconds(curve, duration_s, gap_s), steps=steps, curve=curve)


def count_seconds(events: Iterable, duration_s: float) -> dict[int, float]:
    """Seconds the schedule spends at each live node count over ``[0, duration_s]``.

    ``events`` are ``NodeEvent``-like (``at_s``, ``kind``); the ``at_s == 0`` adds are the
    initial nodes. Counts held for zero seconds are left out.
    """
    out: dict[int, float] = {}
    live, prev = 0, 0.0
    for ev in sorted(events, key=lambda e: e.at_s):
        if ev.at_s > duration_s:
            break
        if ev.at_s > prev:
            out[live] = out.get(live, 0.0) + ev.at_s - prev
            prev = ev.at_s
        live += 1 if ev.kind == "add" else -1
    if duration_s > prev:
        out[live] = out.get(live, 0.0) + duration_s - prev
    return {n: s for n, s in out.items() if s > 0}


def steady_rate(records: Sequence[Progress], peers: Sequence[int] | None = None,
                want_peers: int | None = None) -> float:
    """Samples per second from the first step on which every node took part to the last step.

    With ``peers`` (the participants of each step) the measurement starts at the first step
    with at least ``want_peers`` participants (the ramp while replicas start is left out);
    without, at the first step. That step's own samples are not counted (they were computed
    before it). Raises BenchError if fewer than two steps remain.
    """
    if peers is not None and want_peers is not None:
        first = next((i for i, p in enumerate(peers) if p >= want_peers), len(records))
        records = records[first:]
    if len(records) < 2:
        raise BenchError(f"calibration recorded {len(records)} steps with every node taking "
                         "part; need at least 2: raise --calib-seconds or use a smaller model")
    span = records[-1].t_s - records[0].t_s
    if span <= 0:
        raise BenchError("calibration steps have no time span; raise --calib-seconds")
    return sum(r.samples for r in records[1:]) / span


def ideal_samples(rates: dict[int, float], seconds: dict[int, float]) -> float:
    """``sum_n rates[n] * seconds[n]`` (count 0 contributes nothing).

    Raises BenchError if a count with time has no measured rate.
    """
    missing = sorted(n for n in seconds if n > 0 and n not in rates)
    if missing:
        raise BenchError(f"no failure-free rate measured for node counts {missing}")
    return sum(rates[n] * s for n, s in seconds.items() if n > 0)


def linear_rates(per_node: float, counts: Iterable[int]) -> dict[int, float]:
    """``{n: per_node * n}``: the ideal when nodes do not share hardware."""
    return {n: per_node * n for n in counts}


def ideal_curve(events: Iterable, rates: dict[int, float], duration_s: float
                ) -> tuple[tuple[float, float], ...]:
    """Piecewise-linear cumulative ideal samples: ``(t, samples)`` at each count change."""
    curve = [(0.0, 0.0)]
    live, prev, total = 0, 0.0, 0.0
    for ev in sorted(events, key=lambda e: e.at_s):
        if ev.at_s > duration_s:
            break
        if ev.at_s > prev:
            total += rates.get(live, 0.0) * (ev.at_s - prev)
            curve.append((ev.at_s, total))
            prev = ev.at_s
        live += 1 if ev.kind == "add" else -1
    total += rates.get(live, 0.0) * max(duration_s - prev, 0.0)
    curve.append((duration_s, total))
    return tuple(curve)


def live_timeline(events: Iterable, duration_s: float) -> tuple[tuple[float, int], ...]:
    """``(t, live count)`` after each batch of events, starting at t = 0 (for the plot)."""
    out: list[tuple[float, int]] = []
    live = 0
    for ev in sorted(events, key=lambda e: e.at_s):
        if ev.at_s > duration_s:
            break
        live += 1 if ev.kind == "add" else -1
        if out and out[-1][0] == ev.at_s:
            out[-1] = (ev.at_s, live)
        else:
            out.append((ev.at_s, live))
    if not out or out[0][0] > 0:
        out.insert(0, (0.0, 0))
    out.append((duration_s, out[-1][1]))
    return tuple(out)


def ratio(a: float, b: float) -> float | None:
    """``a / b``, or None when ``b`` is 0 (JSON has no infinity)."""
    return a / b if b else None


# =========================================================================== runs


def _history_records(history: Sequence[Sequence]) -> list[Progress]:
    """Coordinator ``stats()["history"]`` rows ``(epoch, at_s, samples, loss, peers)``."""
    return [Progress(float(h[1]), int(h[0]), int(h[2]), None if h[3] is None else float(h[3]))
            for h in history]


def run_moshray(config) -> tuple[dict, list[Progress], list[int]]:
    """Run ``moshray.jobs.train.run(config)``; returns its summary, per-step records and the
    number of peers in each step.

    Step times are the Coordinator's (seconds since it started, which is when the trace replay
    starts). If the summary carries no ``history``, the Coordinator's history is read right
    after the job's supervision loop ends (by wrapping ``train._supervise`` for this call).
    """
    import ray

    from moshray.jobs import train as train_job

    captured: dict = {}
    original = train_job._supervise

    def supervise_and_capture(cfg, controller, *rest):
        summary = original(cfg, controller, *rest)
        try:
            captured["stats"] = ray.get(controller.coordinator.stats.remote(), timeout=30)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("could not read the coordinator's history: %s", type(exc).__name__)
        return summary

    train_job._supervise = supervise_and_capture
    try:
        summary = train_job.run(config)
    finally:
        train_job._supervise = original
    history = summary.get("history")
    if history is None:
        history = captured.get("stats", {}).get("history", [])
    return summary, _history_records(history), [int(h[4]) for h in history]


def calibrate(config, counts: Sequence[int], seconds: float) -> dict[int, float]:
    """Failure-free moshray samples/s with each node count in ``counts`` (no trace): a run of
    ``seconds`` (start-up included), rate from the first step every node took part in."""
    from dataclasses import replace

    rates: dict[int, float] = {}
    for n in sorted(set(counts)):
        cfg = replace(config,
                      cluster=replace(config.cluster, trace=None, local_nodes=n),
                      training=replace(config.training, max_steps=None, max_seconds=seconds),
                      checkpoint=replace(config.checkpoint, uri=None))
        _, records, peers = run_moshray(cfg)
        rates[n] = steady_rate(records, peers, n)
        print(f"calibration: {n} node(s) failure-free: {rates[n]:.1f} samples/s "
              f"({rates[n] / n:.1f} per node, {len(records)} steps)", flush=True)
    return rates


@dataclass(frozen=True)
class RayTrainRun:
    """Records of one baseline run, times relative to its ``fit()`` start."""

    records: tuple[Progress, ...]
    rewinds: tuple[tuple[float, int], ...]  # (t_s, resumed-from step) per worker group start
    checkpoint: str | None
    error: str | None
    node_log: tuple[tuple[float, str, int], ...]  # (t_s, add|remove, slot) as applied


def _raytrain_command(config, duration_s: float, args: argparse.Namespace, address: str,
                      recorder: str, storage: str, config_file: str) -> list[str]:
    cmd = [sys.executable, "-m", "moshray.jobs.raytrain_baseline", "--address", address,
           "--config", config_file, "--duration", str(duration_s),
           "--max-workers", str(config.cluster.max_nodes),
           "--checkpoint-every", str(args.checkpoint_every), "--storage-path", storage,
           "--cpus-per-worker", str(CPUS_PER_NODE),
           "--resize-interval", str(args.raytrain_resize_interval), "--recorder", recorder]
    return cmd + (["--fixed"] if args.raytrain_fixed else [])


def run_raytrain(config, events, duration_s: float, args: argparse.Namespace,
                 out_dir: Path) -> RayTrainRun:
    """Start a fresh local cluster with the trace's initial nodes, run the baseline driver in
    a subprocess, and apply the trace's later events to the cluster from this (main) thread
    at their times relative to the driver's ``fit()`` start. Every wait is bounded: the driver
    must report its start within ``--startup-timeout`` and finish within
    ``--finish-timeout`` seconds after the window; otherwise it is killed and the records
    are read from its recorder actor."""
    import uuid

    from moshray.autoscaler.trace import initial_slots
    from moshray.jobs.local_cluster import LocalCluster, LocalClusterConfig
    from moshray.jobs.raytrain_baseline import read_recorder

    recorder = f"raytrain-recorder-{uuid.uuid4().hex[:8]}"
    storage = str(out_dir / "raytrain")
    config_file = out_dir / "raytrain-config.json"
    config_file.write_text(json.dumps(config.to_dict()))
    local = LocalCluster(LocalClusterConfig(spot_nodes=0, cpus_per_node=CPUS_PER_NODE))
    node_log: list[tuple[float, str, int]] = []
    proc = None
    driver_log = open(out_dir / "raytrain-driver.log", "w")  # noqa: SIM115 - closed below
    try:
        for slot in initial_slots(events):
            local.add_node(slot)
        env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", GLOO_SOCKET_IFNAME="lo")
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.Popen(
            _raytrain_command(config, duration_s, args, local.address, recorder, storage,
                              str(config_file)),
            stdout=subprocess.PIPE, stderr=driver_log, text=True, env=env)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)],
                         daemon=True, name="raytrain-stdout").start()
        started = _wait_for_event(lines, "started", args.startup_timeout)
        if started is None:
            raise RuntimeError(f"Ray Train driver did not start within {args.startup_timeout} s;"
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
                local.add_node(ev.slot)  # raylets start only from the main thread
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
        remaining = t0 + duration_s - time.time() + args.finish_timeout
        finished = _wait_for_event(lines, "finished", max(remaining, 1.0))
        if finished is None:
            if proc.poll() is None:
                log.warning("Ray Train driver did not finish in time; killing pid %d", proc.pid)
                proc.kill()
                error = "driver killed after --finish-timeout"
            else:
                error = f"driver exited with status {proc.returncode} without a summary"
            proc.wait(timeout=30)
            import ray

            ray.init(address=local.address, namespace="moshray", log_to_driver=False)
            raw = read_recorder(recorder)
            finished = {"records": raw, "checkpoint": None, "error": error}
        else:
            proc.wait(timeout=60)
        raw = finished["records"]
        return RayTrainRun(
            records=tuple(Progress(s[0] - t0, int(s[1]), int(s[2]),
                                   None if s[3] is None else float(s[3]))
                          for s in raw["steps"]),
            rewinds=tuple((g[0] - t0, int(g[2])) for g in raw["groups"]),
            checkpoint=finished.get("checkpoint"), error=finished.get("error"),
            node_log=tuple(node_log))
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

    from moshray.actors.data import ByteBatches
    from moshray.actors.model import build_model

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


def _moshray_final_state(uri: str | None) -> dict | None:
    if not uri:
        return None
    from moshray.actors.checkpoint import CheckpointStore

    found = CheckpointStore(uri).load_latest()
    return None if found is None else found[1]["model"]


def _raytrain_final_state(path: str | None) -> dict | None:
    if not path or not os.path.exists(path):
        return None
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)["model"]


# =========================================================================== report


def plot(path: Path, live: Sequence[tuple[float, int]],
         curves: dict[str, Sequence[tuple[float, float]]], title: str) -> Path:
    """Live nodes over time (top) and each system's cumulative useful samples (bottom), as a
    PNG at ``path``; written to a temporary name and renamed. Like ``moshray.jobs.plots`` it
    builds a ``Figure`` on the Agg canvas (no pyplot, no process-wide backend switch); that
    module has no two-panel time plot with a separate x per series, hence this function."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 6.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 3]})
    fig.suptitle(title)
    top.step([t for t, _ in live], [n for _, n in live], where="post", color="black")
    top.set_ylabel("live nodes")
    top.set_ylim(0, max([n for _, n in live] + [1]) + 0.5)
    top.yaxis.get_major_locator().set_params(integer=True)
    top.grid(True, alpha=0.3)
    # measured curves change at steps (and drop at rollbacks); the ideal is piecewise linear
    styles = {"ideal": {"linestyle": "--", "color": "gray"}}
    step_style = {"drawstyle": "steps-post"}
    for name, curve in curves.items():
        bottom.plot([t for t, _ in curve], [c for _, c in curve], label=name, linewidth=1.4,
                    **styles.get(name, step_style))
    bottom.set_xlabel("wall seconds")
    bottom.set_ylabel("cumulative samples (useful)")
    bottom.set_xlim(0, live[-1][0] if live else None)
    bottom.set_ylim(bottom=0)
    bottom.legend(loc="upper left")
    bottom.grid(True, alpha=0.3)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _to_end(curve: Sequence[tuple[float, int]], duration_s: float) -> list[tuple[float, int]]:
    """The curve held flat from its last point to the end of the window (for the plot)."""
    return [*curve, (duration_s, curve[-1][1])] if curve and curve[-1][0] < duration_s else \
        list(curve)


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _table(rows: list[tuple[str, SystemResult, float | None]]) -> str:
    out = [f"{'system':<10} {'samples':>9} {'goodput/s':>10} {'final loss':>10} "
           f"{'eval loss':>9} {'stall s':>8}"]
    for name, r, eval_loss in rows:
        out.append(f"{name:<10} {r.samples:>9d} {r.goodput:>10.1f} {_fmt(r.final_loss):>10} "
                   f"{_fmt(eval_loss):>9} {r.stall_s:>8.1f}")
    return "\n".join(out)


# =========================================================================== command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, metavar="FILE",
                        help="spot trace (count or per-node format)")
    parser.add_argument("--time-scale", type=float, default=None, metavar="X",
                        help="trace seconds per wall second (default: fit the trace into "
                             "--duration)")
    parser.add_argument("--max-nodes", type=int, default=4, metavar="N",
                        help="local spot node slots; the trace's peak maps to N")
    parser.add_argument("--duration", type=float, default=600.0, metavar="S",
                        help="wall seconds each system trains")
    parser.add_argument("--calib-seconds", type=float, default=60.0, metavar="S",
                        help="length of each failure-free moshray run (start-up included) "
                             "that measures the ideal's throughput")
    parser.add_argument("--calib-nodes", type=int, default=None, metavar="N",
                        help="measure the failure-free rate only with N nodes and scale the "
                             "per-node rate linearly (default: measure every node count the "
                             "trace uses)")
    parser.add_argument("--checkpoint-every", type=int, default=20, metavar="STEPS",
                        help="checkpoint interval of both systems")
    parser.add_argument("--stall-gap", type=float, default=2.0, metavar="S",
                        help="a gap this long without a new high of useful samples is a stall")
    parser.add_argument("--raytrain-resize-interval", type=float, default=10.0, metavar="S",
                        help="Ray Train ScalingConfig.elastic_resize_monitor_interval_s")
    parser.add_argument("--raytrain-fixed", action="store_true",
                        help="Ray Train with fixed num_workers=max_nodes, not (1, max_nodes)")
    parser.add_argument("--startup-timeout", type=float, default=300.0, metavar="S",
                        help="bound on the Ray Train driver's start")
    parser.add_argument("--finish-timeout", type=float, default=240.0, metavar="S",
                        help="bound on the Ray Train driver's end after the window")
    parser.add_argument("--out", default="runs/bench-goodput", metavar="DIR",
                        help="where goodput.json, goodput.png and the run files go")
    parser.add_argument("--config", metavar="FILE", help="TrainConfig file (TOML or JSON)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=None,
                        help="override a TrainConfig setting, e.g. --set model.n_layers=4 "
                             "(defaults: the small model " + " ".join(
                                 f"{k}={v}" for k, v in BENCH_DEFAULTS.items()) + ")")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")


def _check_args(args: argparse.Namespace) -> None:
    if not os.path.isfile(args.trace):
        raise BenchError(f"--trace {args.trace}: no such file")
    if args.time_scale is not None and not args.time_scale > 0:
        raise BenchError(f"--time-scale must be > 0, got {args.time_scale}")
    if args.max_nodes < 1:
        raise BenchError(f"--max-nodes must be >= 1, got {args.max_nodes}")
    if args.calib_nodes is not None and not 1 <= args.calib_nodes <= args.max_nodes:
        raise BenchError(f"--calib-nodes must be in [1, --max-nodes={args.max_nodes}], got "
                         f"{args.calib_nodes}")
    for name in ("duration", "calib_seconds", "stall_gap", "startup_timeout",
                 "finish_timeout"):
        if not getattr(args, name) > 0:
            raise BenchError(f"--{name.replace('_', '-')} must be > 0, got "
                             f"{getattr(args, name)}")
    if args.raytrain_resize_interval < 0:
        raise BenchError("--raytrain-resize-interval must be >= 0")
    if args.checkpoint_every < 1:
        raise BenchError(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")


def _overrides(args: argparse.Namespace) -> dict[str, str]:
    from moshray.jobs.config import parse_set

    return {**BENCH_DEFAULTS, **parse_set(args.set)}


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark; returns the JSON-able result (see module docstring)."""
    from dataclasses import replace

    from moshray.actors.data import resolve_data
    from moshray.autoscaler.trace import (
        TraceError, initial_slots, live_node_seconds, load_trace, schedule)
    from moshray.jobs.config import load_config

    _check_args(args)
    try:
        trace = load_trace(args.trace)
    except TraceError as exc:
        raise BenchError(str(exc)) from None
    time_scale = args.time_scale
    if time_scale is None:
        span = trace.duration_s - trace.first_nonzero_s()
        if span <= 0:
            raise BenchError(f"--trace {args.trace}: no time span after capacity appears; "
                             "pass --time-scale")
        time_scale = span / args.duration
    events = schedule(trace, time_scale, args.max_nodes, duration_s=args.duration)
    initial = initial_slots(events)
    duration = args.duration
    out_dir = Path(args.out).expanduser().resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    trace_copy = out_dir / f"trace{Path(args.trace).suffix or '.csv'}"
    trace_copy.write_bytes(Path(args.trace).read_bytes())

    overrides = _overrides(args)
    overrides.update({
        "cluster.trace": str(trace_copy),
        "cluster.time_scale": repr(time_scale),
        "cluster.max_nodes": str(args.max_nodes),
        "cluster.local_nodes": str(max(len(initial), 1)),
        "training.max_seconds": repr(duration),
        "checkpoint.uri": str(out_dir / f"moshray-ckpt-{stamp}"),
        "checkpoint.every_steps": str(args.checkpoint_every),
        "metrics.port": "0",
        "json": "true",  # moshray's progress lines go to stderr
        "run_dir": str(out_dir),
    })
    overrides.pop("training.max_steps", None)
    config = load_config(args.config, overrides)
    config = replace(config, training=replace(config.training, max_steps=None))
    files = resolve_data(list(config.data.paths) or None,
                         os.path.expanduser(config.data.cache_dir))
    seconds_at = count_seconds(events, duration)
    node_seconds = live_node_seconds(events, duration)
    print(f"trace {trace.name}: time scale {time_scale:.2f}, {len(events)} node events in "
          f"{duration:.0f} s, {node_seconds:.0f} live node-seconds, counts "
          f"{ {n: round(s, 1) for n, s in sorted(seconds_at.items())} }", flush=True)

    # 3. the ideal: failure-free rate at each node count the trace uses
    counts = sorted(n for n in seconds_at if n > 0)
    if args.calib_nodes is None:
        rates = calibrate(config, counts, args.calib_seconds)
    else:  # one measurement, per-node rate scaled linearly to every count
        measured = calibrate(config, [args.calib_nodes], args.calib_seconds)
        rates = linear_rates(measured[args.calib_nodes] / args.calib_nodes, counts)
    ideal = ideal_samples(rates, seconds_at)

    # 1. moshray under the trace
    print(f"moshray: {duration:.0f} s under the trace", flush=True)
    m_summary, m_records, _ = run_moshray(config)
    moshray = summarize("moshray", m_records, duration, args.stall_gap)
    moshray_eval = held_out_loss(config, files, _moshray_final_state(config.checkpoint.uri))

    # 2. Ray Train under the same trace
    print(f"raytrain: {duration:.0f} s under the trace", flush=True)
    rt_dir = out_dir / f"raytrain-{stamp}"
    rt_dir.mkdir(parents=True, exist_ok=True)
    rt = run_raytrain(config, events, duration, args, rt_dir)
    raytrain = summarize("raytrain", rt.records, duration, args.stall_gap, rt.rewinds)
    raytrain_eval = held_out_loss(config, files, _raytrain_final_state(rt.checkpoint))

    ideal_c = ideal_curve(events, rates, duration)
    from moshray.jobs.plots import plot_path_for

    json_path = out_dir / "goodput.json"
    plot_path = plot(plot_path_for(json_path), live_timeline(events, duration),
                     {"moshray": _to_end(moshray.curve, duration),
                      "Ray Train": _to_end(raytrain.curve, duration), "ideal": ideal_c},
                     f"{trace.name}, {args.max_nodes} nodes, time scale {time_scale:.0f}x")
    result = {
        "trace": str(args.trace), "time_scale": time_scale, "max_nodes": args.max_nodes,
        "duration_s": duration, "live_node_seconds": node_seconds,
        "node_events": sum(1 for e in events if e.at_s > 0),
        "model": config.model.to_dict(), "target_batch_size": config.training.target_batch_size,
        "batch_size": config.training.batch_size,
        "moshray_samples": moshray.samples, "raytrain_samples": raytrain.samples,
        "ideal_samples": ideal,
        "moshray_vs_ideal": ratio(moshray.samples, ideal),
        "moshray_vs_raytrain": ratio(moshray.samples, raytrain.samples),
        "moshray_goodput": moshray.goodput, "raytrain_goodput": raytrain.goodput,
        "ideal_goodput": ideal / duration,
        "moshray_final_loss": moshray.final_loss, "raytrain_final_loss": raytrain.final_loss,
        "moshray_eval_loss": moshray_eval, "raytrain_eval_loss": raytrain_eval,
        "moshray_stall_s": moshray.stall_s, "raytrain_stall_s": raytrain.stall_s,
        "moshray_steps": moshray.steps, "raytrain_steps": raytrain.steps,
        # start-up: seconds from the job's start to its first committed step
        "moshray_first_step_s": m_records[0].t_s if m_records else None,
        "raytrain_first_step_s": rt.records[0].t_s if rt.records else None,
        "raytrain_samples_processed": raytrain.samples_processed,
        "raytrain_restarts": max(len(rt.rewinds) - 1, 0),
        "raytrain_error": rt.error,
        "moshray_preemptions": m_summary.get("preemptions"),
        "moshray_replicas_consistent": m_summary.get("replicas_consistent"),
        "rate_by_nodes": {str(n): r for n, r in sorted(rates.items())},
        "per_node_samples_per_s": {str(n): r / n for n, r in sorted(rates.items())},
        "stall_gap_s": args.stall_gap, "checkpoint_every": args.checkpoint_every,
        "plot": str(plot_path),
    }
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    print(_table([("moshray", moshray, moshray_eval), ("Ray Train", raytrain, raytrain_eval)]))
    print(f"{'ideal':<10} {ideal:>9.0f} {ideal / duration:>10.1f}")
    print(f"moshray / ideal {_fmt(result['moshray_vs_ideal'])}, moshray / Ray Train "
          f"{_fmt(result['moshray_vs_raytrain'])}; Ray Train restarts "
          f"{result['raytrain_restarts']}, lost samples "
          f"{raytrain.samples_processed - raytrain.samples}; plot {plot_path}", flush=True)
    return result


def main(args: argparse.Namespace) -> int:
    from moshray.jobs.config import ConfigError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        result = run(args)
    except (BenchError, ConfigError) as exc:
        prefix = "config error: " if isinstance(exc, ConfigError) else ""
        print(f"moshray bench goodput: {prefix}{exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module("moshray.jobs.bench_goodput"))
