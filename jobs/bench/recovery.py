"""`moshray bench recovery`: how fast the real training job recovers from the four events of
spot life.

Starts an embedded local cluster (head + ``--nodes`` spot raylets, on 127.0.0.1 or, with
``--hosts netns``, each a separate host in a network namespace of its own with Ray's default
health checks; see ``jobs/local/cluster.py``) and runs the
training job's driver on it, ``moshray.jobs.train.run_job`` (the elastic controller, the
default model unless ``--set`` says otherwise), in a thread as ``moshray train`` does on the
embedded cluster. This process then only plays the cloud (``jobs/bench/recovery_trials.py``): it
adds nodes, publishes spot notices on a node's own metadata service, removes a noticed node
at its deadline, SIGKILLs a node. The job does the rest on its own, as on a real cluster:
its controller starts a replica and a notice watcher on every node that joins, its watchers
tell the Coordinator, its replicas sync and train. The figures are read from the job's
Coordinator and Ray's node table. Then, ``--trials`` times, each event from a steady swarm
(every node's replica has contributed to a committed step):

1. **notice -> rebalanced** (``notice_to_rebalanced_s``): a termination notice for a node,
   ``--notice-s`` ahead; the figure is the Coordinator's
   ``notice_stats()[node]["rebalance_s"]``: from the node's watcher receiving the notice to
   the first plan without the node's replica. The node is removed at the deadline.
2. **join -> first contribution** (``join_to_contribution_s``): a replacement node is added;
   from the node being alive in Ray's node table (its raylet's start is reported apart as
   ``node_start_s``) to the commit of the first global step its replica (``replica-<slot>-<n>``,
   started by the controller) took part in (``Coordinator.step_timings``).
3. **hard kill -> progress** (``hard_kill_to_progress_s``): another node is SIGKILLed, no
   notice; from the kill to the commit of the first step without its replica committed after
   the kill (``hard_kill_to_any_commit_s``: to the first commit of any step, which may be a
   round in flight). A replacement node joins after it (a second join sample).
4. **expert re-spawn** (``expert_respawn_s``): a second run of the job, with DMoE layers
   (the ``--moe`` default: every other block, ``model.moe_grid``), on the same cluster. A
   notice for the node hosting the most expert shards; the job's watcher hands it to the
   job's ExpertSupervisor, which re-spawns those shards elsewhere. From the notice's
   publication to every one of those shards listed in the Coordinator's registry on a new
   instance off the node, a forward call through it answering. The node is removed at the
   deadline and a replacement added.

Each job is bounded by ``training.max_seconds`` and ended by the bench once its trials are
done; the cluster is shut down at the end. Coordinator times are mapped onto this
process's monotonic clock by the best of three round trips.

With ``--json`` the last stdout line is one JSON object: the four medians, their worst
cases (``_max`` suffix), every sample (``samples``), the targets and whether each median
meets it, where each join's time and CPU went (``join_profiles``, ``jobs/bench/join_profile.py``:
node up -> replica registered -> ready -> committed, and the CPU seconds of the new node's
replica, watcher and daemons against the running replicas'), and the two jobs' own
figures (``job``, ``job_moe``); the same object goes to
``<out>/recovery.json`` and a bar plot (median and worst per measure) to
``<out>/recovery.png``; the jobs write their runs under ``<out>/job`` and ``<out>/job-moe``.
Targets (default model): notice -> rebalanced <= 1 s, hard kill -> progress <= 5 s,
join -> first contribution <= 15 s.

Bad arguments exit with status 2 and one line on stderr; a recovery that does not happen
within ``--timeout`` seconds exits with status 1 and one line naming it.
"""

from __future__ import annotations

from moshray.jobs.bench.results import add_results_argument, save_result
import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from moshray.jobs.bench.recovery_steps import median_step_s
from moshray.jobs.bench.recovery_trials import RecoveryTimeout

log = logging.getLogger("moshray.bench_recovery")

MEASURES: tuple[str, ...] = (
    "notice_to_rebalanced_s",
    "hard_kill_to_progress_s",
    "join_to_contribution_s",
    "expert_respawn_s",
)
LABELS = {
    "notice_to_rebalanced_s": "notice -> rebalanced",
    "hard_kill_to_progress_s": "hard kill -> progress",
    "join_to_contribution_s": "join -> 1st contribution",
    "expert_respawn_s": "expert node -> served again",
}
# The recovery targets (seconds), for the default model (no target for expert re-spawn).
TARGETS: dict[str, float] = {
    "notice_to_rebalanced_s": 1.0,
    "hard_kill_to_progress_s": 5.0,
    "join_to_contribution_s": 15.0,
}


class BenchError(ValueError):
    """Bad benchmark input; the message is one line saying what to fix (exit 2)."""


# =========================================================================== pure logic


def aggregate(samples: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """``{measure: median, measure_max: worst}`` for every measure of ``MEASURES``.

    Raises ``ValueError`` if a measure has no sample or a non-finite or negative one.
    """
    out: dict[str, float] = {}
    for m in MEASURES:
        values = [float(v) for v in samples.get(m, ())]
        if not values:
            raise ValueError(f"no sample of {m}")
        bad = [v for v in values if not math.isfinite(v) or v < 0]
        if bad:
            raise ValueError(f"{m}: samples must be finite and >= 0, got {bad}")
        out[m] = statistics.median(values)
        out[f"{m}_max"] = max(values)
    return out


def summarize(samples: Mapping[str, Sequence[float]], meta: Mapping | None = None) -> dict:
    """The JSON object: the eight figures of ``aggregate``, ``samples`` (every value per
    measure), ``targets`` and ``meets_targets`` (median <= target), then ``meta``."""
    figures = aggregate(samples)
    return {
        **figures,
        "samples": {m: [float(v) for v in samples[m]] for m in MEASURES},
        "targets": dict(TARGETS),
        "meets_targets": {m: figures[m] <= t for m, t in TARGETS.items()},
        **(meta or {}),
    }



def check_args(args: argparse.Namespace) -> None:
    """Raise ``BenchError`` (one line naming the flag) for out-of-range arguments."""
    if args.trials < 1:
        raise BenchError(f"--trials must be >= 1, got {args.trials}")
    if args.nodes < 2:
        raise BenchError(f"--nodes must be >= 2 (one node is noticed or killed while the "
                         f"others train), got {args.nodes}")
    for name in ("notice_s", "timeout"):
        value = getattr(args, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise BenchError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.hosts == "netns":
        from moshray.jobs.local.netns import unavailable

        why = unavailable()
        if why:
            raise BenchError(f"--hosts netns: {why}")


# =========================================================================== the run


def job_config(config, nodes: int, bound_s: float, run_dir: str, moe: bool = False):
    """The ``TrainConfig`` of one job under test: ``config`` with room for ``nodes`` nodes,
    ``training.max_seconds = bound_s`` (a safety net; the bench ends the job sooner),
    metrics on any free port, the job's lines on stderr, checkpoints optional (nothing here
    outlives the bench), and DMoE layers if ``moe``."""
    from dataclasses import replace

    return replace(
        config,
        model=config.model.with_default_moe() if moe else config.model,
        training=replace(config.training, max_seconds=bound_s),
        cluster=replace(config.cluster, address=None, min_nodes=1,
                        max_nodes=max(config.cluster.max_nodes, nodes)),
        checkpoint=replace(config.checkpoint, optional=True),
        metrics=replace(config.metrics, port=0), run_dir=run_dir, json=True)


def _job_figures(summary: Mapping | None) -> dict | None:
    """The scalar figures of a job's summary (steps, samples, losses, ...) for the JSON."""
    if summary is None:
        return None
    return {k: v for k, v in summary.items()
            if isinstance(v, (int, float, str, bool)) or v is None}


def _run_job(cluster, config, args, log_fn, body) -> tuple[object, dict | None]:
    """Start the job, ``body(trials)`` while it trains, end it; ``(body's value, the job's
    figures)``. Ray is connected on entry (``run_job`` disconnects this process when done)."""
    from moshray.jobs.bench.recovery_trials import CloudTrials, JobThread

    cluster.connect()
    previous = _current_coordinator()
    job = JobThread(config, cluster.address)
    value, summary = None, None
    try:
        trials = CloudTrials(cluster, job, args.timeout, args.notice_s, log_fn, previous)
        value = body(trials)
    finally:
        t = config.training
        summary = job.end(t.round_timeout_s * 3 * (args.nodes + 1) + 120)
    return value, _job_figures(summary)


def _current_coordinator():
    """The Coordinator left on the cluster (None), so a new job's is told apart from it."""
    from moshray.cluster import placement

    try:
        return placement.sole_coordinator()
    except ValueError:
        return None


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark; returns the JSON-able summary (see the module docstring)."""
    from moshray.jobs.config import load_config, parse_set
    from moshray.jobs.local.cluster import LocalCluster, LocalClusterConfig, pin_loopback

    check_args(args)
    config = load_config(args.config, parse_set(args.set))
    log_fn = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else \
        (lambda *a: print(*a, flush=True))
    if args.hosts == "loopback":
        pin_loopback()
    values: dict[str, list[float]] = {m: [] for m in MEASURES}
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    out = Path(args.out).expanduser()
    bound = args.timeout * (3 + 6 * args.trials) + args.notice_s * args.trials
    dense = job_config(config, args.nodes, bound, str(out / "job"))
    moe = job_config(config, args.nodes, bound, str(out / "job-moe"), moe=True)
    meta: dict = {}
    cluster = LocalCluster(LocalClusterConfig(spot_nodes=0, cpus_per_node=2, hosts=args.hosts))
    try:
        for slot in range(args.nodes):
            cluster.add_node(slot)

        def dense_trials(trials) -> dict:
            log_fn(f"training job on {args.nodes} spot nodes; waiting for every node's "
                   "replica to contribute ...")
            t0 = time.monotonic()
            trials.wait_steady("start-up")
            log_fn(f"swarm steady after {time.monotonic() - t0:.1f} s")
            for i in range(args.trials):
                log_fn(f"trial {i + 1}")
                trials.trial(values)
            return {"median_step_s": median_step_s(trials.steps()),
                    "hard_kill_to_any_commit_s": trials.any_commit_s,
                    "node_start_s": trials.node_start_s,
                    "join_profiles": [p.to_json() for p in trials.join_profiles]}

        found, meta["job"] = _run_job(cluster, dense, args, log_fn, dense_trials)
        meta.update(found)

        def expert_trials(trials) -> list[int]:
            log_fn(f"training job with DMoE layers {list(moe.model.moe_layers)} "
                   f"(grid {list(moe.model.moe_grid)}); waiting for its experts ...")
            moved = []
            for i in range(args.trials):
                respawn_s, experts = trials.expert_notice(moe.model.d_model)
                values["expert_respawn_s"].append(respawn_s)
                moved.append(experts)
            return moved

        meta["experts_moved"], meta["job_moe"] = _run_job(cluster, moe, args, log_fn,
                                                          expert_trials)
    finally:
        cluster.shutdown()
    m = config.model
    return summarize(values, {
        "trials": args.trials, "nodes": args.nodes, "notice_s": args.notice_s,
        "hosts": args.hosts,
        "model": m.to_dict(), "target_batch_size": config.training.target_batch_size,
        "batch_size": config.training.batch_size,
        "round_timeout_s": config.training.round_timeout_s,
        "moe_layers": list(moe.model.moe_layers), "moe_grid": list(moe.model.moe_grid),
        "experts_per_node": statistics.mean(meta["experts_moved"]),
        **meta, "wall_s": time.monotonic() - started,
        # 1-minute load average of the machine at the start and the end (cores are shared)
        "load_avg": [load_before, os.getloadavg()[0]], "cpus": os.cpu_count(),
    })


# =========================================================================== outputs


def write_outputs(summary: dict, out_dir: str, log_fn) -> dict:
    """``<out>/recovery.json`` and the bar plot ``<out>/recovery.png``; returns the summary
    with their paths added."""
    from moshray.jobs import plots

    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "recovery.json"
    png = plots.plot_path_for(json_path)
    plot(png, summary)
    summary = summary | {"json": str(json_path), "plot": str(png)}
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    log_fn(f"wrote {json_path} and {png}")
    return summary


def plot(path: Path, summary: Mapping) -> Path:
    """Grouped bars: median and worst seconds per measure, targets as dashed red lines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from moshray.jobs import plots

    fig = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    xs = list(range(len(MEASURES)))
    width = 0.38
    for shift, key, label in ((-width / 2, "", "median"), (width / 2, "_max", "worst")):
        bars = ax.bar([x + shift for x in xs], [float(summary[m + key]) for m in MEASURES],
                      width, label=label)
        ax.bar_label(bars, fmt="%.2f", padding=2, fontsize=8)
    for x, m in zip(xs, MEASURES):
        if m in TARGETS:
            ax.hlines(TARGETS[m], x - 0.45, x + 0.45, colors=plots.PREEMPTION_COLOR,
                      linestyles="--", label="target" if x == 0 else None)
    ax.set_xticks(xs)
    ax.set_xticklabels([LABELS[m] for m in MEASURES], fontsize=8)
    ax.margins(y=0.12)
    ax.set_ylabel("seconds")
    ax.set_title(f"recovery: {summary.get('trials', '?')} trials, "
                 f"{summary.get('nodes', '?')} local spot nodes")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return plots.save_png(fig, path)


def _table(summary: Mapping) -> str:
    lines = [f"{'measure':<28} {'median':>8} {'worst':>8} {'target':>8}"]
    for m in MEASURES:
        target = f"{TARGETS[m]:.1f}" if m in TARGETS else "-"
        ok = "" if m not in TARGETS else ("  ok" if summary["meets_targets"][m] else "  MISSED")
        lines.append(f"{LABELS[m]:<28} {summary[m]:>8.2f} {summary[m + '_max']:>8.2f} "
                     f"{target:>8}{ok}")
    return "\n".join(lines)


# =========================================================================== command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trials", type=int, default=3, metavar="N",
                        help="repetitions of notice, join, hard kill, join; and of "
                             "the expert notice")
    parser.add_argument("--nodes", type=int, default=3, metavar="N",
                        help="spot nodes (the job keeps one replica on each)")
    parser.add_argument("--notice-s", type=float, default=5.0, metavar="S",
                        help="seconds between a notice and the node's removal")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S",
                        help="bound on every wait (start-up, each recovery)")
    parser.add_argument("--hosts", choices=("loopback", "netns"), default="loopback",
                        help="spot nodes on 127.0.0.1 (default), or each a separate host in "
                             "a network namespace of its own (root)")
    parser.add_argument("--config", metavar="FILE", help="TrainConfig file (TOML or JSON)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=None,
                        help="override a TrainConfig setting, e.g. --set model.n_layers=1 "
                             "(default: the project's default model)")
    parser.add_argument("--out", default="runs/bench-recovery", metavar="DIR",
                        help="where recovery.json and recovery.png go")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    add_results_argument(parser)


def main(args: argparse.Namespace) -> int:
    from moshray.jobs.config import ConfigError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log_fn = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    try:
        check_args(args)
        from moshray.jobs.config import load_config, parse_set

        load_config(args.config, parse_set(args.set))  # reject bad settings before Ray starts
    except (BenchError, ConfigError) as exc:
        prefix = "config error: " if isinstance(exc, ConfigError) else ""
        print(f"moshray bench recovery: {prefix}{exc}", file=sys.stderr)
        return 2
    try:
        summary = run(args)
    except RecoveryTimeout as exc:
        print(f"moshray bench recovery: {exc}", file=sys.stderr)
        return 1
    summary = write_outputs(summary, args.out, log_fn)
    save_result("recovery", args, summary)
    log_fn(_table(summary))
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module("moshray.jobs.bench.recovery"))
