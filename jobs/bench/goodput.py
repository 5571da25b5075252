"""`moshray bench goodput`: goodput under a spot trace: moshray, Ray Train, Ray Train + torchft.

One invocation replays the same spot trace (any trace file, count or per-node format, or a
shipped trace's name; see ``moshray.autoscaler.traces``) onto a fresh embedded local cluster
per system and trains the same model on the same data for the same wall seconds, three ways
against an ideal:

1. **moshray**: ``moshray.jobs.train.run`` (collaborative DeDLOC steps, Moshpit averaging,
   replicas started and dropped as nodes come and go), driven as a separate driver process
   (``goodput_moshray``) with its own embedded cluster, which replays the trace.
2. **Ray Train**: ``moshray.jobs.bench.raytrain_baseline`` (``TorchTrainer``, DDP, elastic
   ``ScalingConfig(num_workers=(1, max_nodes))``, ``FailureConfig(max_failures=-1)``, a checkpoint
   every ``--checkpoint-every`` steps), driven as a separate driver process too; the trace's nodes
   are removed at their deadline and added at their time, with no help for Ray Train.
2b. **Ray Train + torchft** (``raytrain_torchft``; when torchft is installed, the ``bench``
   extra, unless ``--no-torchft``; else one line says why it did not run): the same driver with
   ``--torchft`` (``TorchftConfig``, torchft's ``Manager`` quorum per step with
   ``min_replica_size=1``, its DDP and optimizer wrappers, only failed replica groups replaced
   and healed from a live peer), the same trace, nodes, window and checkpoint interval.
   Reported: ``raytrain_torchft_samples`` (useful: a step number that falls back is a
   rollback), ``moshray_vs_raytrain_torchft``, ``raytrain_torchft_final_loss`` /
   ``_eval_loss`` / ``_stall_s``, ``raytrain_torchft_discarded_steps`` (replica steps its
   quorum did not commit) and ``raytrain_torchft_replica_restarts`` (worker starts beyond the
   first group). Its failure-free rate is not calibrated: the ideal stays the better of the
   other two.
3. **ideal**: the better system's failure-free throughput times the trace's live seconds. Both
   systems' failure-free rates are measured in the same invocation, at every node count the
   trace uses, by calibration runs with n nodes and no node event (no checkpoints), each
   system training for ``--calib-seconds`` after its first step with all n nodes (moshray:
   every replica took part; Ray Train: ``num_workers=n``), the rate over that window; start-up
   is left out of both. At each count the ideal takes the better of the two rates, so
   ``ideal = sum_n max(moshray(n), raytrain(n)) * seconds_at(n)`` (on a machine whose nodes
   share cores a single-node rate would overstate what n nodes can do). ``--calib-nodes N``
   measures both only with N nodes and scales the better per-node rate linearly.

Both systems use the same global batch (``training.target_batch_size``), micro-batch,
optimizer and learning rate; moshray also checkpoints every ``--checkpoint-every`` steps.

Reported per system: samples (useful samples: for Ray Train the steps lost to a rollback to the
last checkpoint are not counted; the raw count is ``raytrain_samples_processed``), goodput
(samples / duration), the training loss reached (mean of the last 10 steps inside the window),
the held-out loss of the final model (same held-out batches for both), and stall time (total
length of the gaps of at least ``--stall-gap`` seconds in which the useful sample count did not
reach a new high, including the start-up gap). From the calibrations (``goodput_rates``):
``moshray_rate_by_nodes`` and ``raytrain_rate_by_nodes`` (failure-free samples/s by node count),
``rate_by_nodes`` (the ideal's rate at each count the trace uses) with ``ideal_source_by_nodes``,
``steady_state_vs_raytrain`` (moshray's failure-free rate over Ray Train's at
``steady_state_nodes``, the trace's most common count: most seconds, ties -> the larger; with
``--calib-nodes``, that count), and ``moshray_scaling`` / ``raytrain_scaling`` (each system's
failure-free rate at the largest measured count over its rate at the smallest measured count
>= 2, the counts in ``scaling_nodes``; ``scaling_vs_raytrain`` = their ratio, >= 1 when
moshray's rate falls no more than DDP's as nodes are added). Where the gap to the ideal comes
from: ``moshray_failure_free_samples`` / ``raytrain_failure_free_samples`` (each system at its
own failure-free rates over the trace's seconds at each count), ``moshray_elasticity`` /
``raytrain_elasticity`` (samples under the trace over those: what the node events cost) and
``moshray_failure_free_vs_ideal`` (the most ``moshray_vs_ideal`` could be at moshray's measured
rates; ``moshray_vs_ideal`` = elasticity x that). When each system's shortfall against its own
rates happened: ``moshray_gap`` / ``raytrain_gap`` (``goodput_gap``: 20-s slices classed as
start-up, after node events or steady, each with the samples expected, gained and
``missing``), and what moshray's joins cost: ``moshray_replica_starts`` (replicas started,
trained, their seconds from start to training, and those gone before they trained, from the
controller's replica timelines), and how many took part in its steps: ``moshray_peers``
(participants per global step: ``mean``, ``max``, ``steps_by_peers``, and the shares of steps
and samples with more than one, ``multi_step_share`` / ``multi_sample_share``). Where the
machine's CPU went during each trace run: ``moshray_cpu`` / ``raytrain_cpu`` (``run_cpu``:
CPU seconds and average cores of the training processes, control actors, notice watchers,
Ray's daemons and the drivers; every node shares these cores here, so what node events cost
comes out of training). How far runs made at different times can be compared on this
machine: ``machine_step_ms`` (the model's bare training step on one core, read at the start,
after the calibrations, after moshray's trace run and at the end; ``machine_probe``) and
``machine_drift`` (the slowest reading over the fastest). ``--json``: the last stdout line is
one JSON object (``moshray_samples``, ``raytrain_samples``, ``ideal_samples``,
``moshray_vs_ideal``, ``moshray_vs_raytrain``, ``steady_state_vs_raytrain``,
``moshray_final_loss``, ``raytrain_final_loss``, ``moshray_peers`` and more); the same object
is written to ``<out>/goodput.json`` and the plot (live nodes over time, each system's
cumulative samples) to ``<out>/goodput.png``.

Modules: ``goodput_curves`` (one system's records -> figures), ``goodput_rates`` (node counts,
failure-free rates, the ideal, the comparisons), ``goodput_gap`` (when each system's samples
went missing), ``run_cpu`` (CPU by role), ``goodput_moshray`` and ``goodput_runs`` (the
runners and calibrations: every run of either system is a fresh driver process),
``goodput_report`` (plot and tables); this one parses the command and runs them.

``--links PROFILE`` (a profile of ``jobs/local/links.py``: ``slow``, ``straggler``, ``zones``,
``fast``) runs every cluster of the bench, both systems' calibrations and trace runs, in the
separate-hosts mode (``cluster.hosts = "netns"``: one network namespace per spot node) with
the profile's ``tc`` shaping, laid out as ``moshray bench links`` lays it out (the rates
follow from the model's fp16 gradient bytes and its measured step compute on
``--max-nodes`` nodes, ``bench links``' ``profile_links``): each slot's node gets its link
as it starts, a node the trace adds again included. Ray Train's gloo runs on each node's
shaped ``eth0``. The separate hosts have no durable store, so the moshray runs keep no
checkpoints (``checkpoint.optional``; a swarm that loses every replica starts over; its
held-out loss is its final model's, which the job saves on the driver's machine:
``save_model``), while Ray Train keeps checkpointing to this machine's disk, which its
workers share: an advantage to Ray Train. The JSON's ``links`` says the profile,
its rates and the model figures they follow from.

Bad arguments (missing or malformed trace, non-positive sizes, bad ``--set``, an unknown
``--links`` profile or separate hosts this machine cannot make) exit with status 2 and one
line on stderr.
"""

from __future__ import annotations

from moshray.jobs.bench.results import add_results_argument, save_result
import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from moshray.jobs.bench.goodput_curves import participation, summarize
from moshray.jobs.bench.goodput_gap import GAP_WINDOW_S, gap_split
from moshray.jobs.controller.replica_states import replica_starts
from moshray.jobs.bench.goodput_rates import (
    MOSHRAY, RAYTRAIN, RAYTRAIN_TORCHFT, BenchError, compare_rates, count_seconds, ideal_curve,
    live_timeline, ratio)
from moshray.jobs.bench.run_cpu import CpuSampler

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


# =========================================================================== command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, metavar="FILE",
                        help="spot trace file (count or per-node format) or a shipped "
                             "trace's name")
    parser.add_argument("--time-scale", type=float, default=None, metavar="X",
                        help="trace seconds per wall second (default: fit the trace into "
                             "--duration)")
    parser.add_argument("--max-nodes", type=int, default=4, metavar="N",
                        help="local spot node slots; the trace's peak maps to N")
    parser.add_argument("--duration", type=float, default=600.0, metavar="S",
                        help="wall seconds each system trains")
    parser.add_argument("--calib-seconds", type=float, default=60.0, metavar="S",
                        help="seconds each failure-free calibration run trains after its "
                             "first step with all nodes (start-up left out, both systems); "
                             "it measures each system's rate at a node count")
    parser.add_argument("--calib-nodes", type=int, default=None, metavar="N",
                        help="measure both systems' failure-free rates only with N nodes and "
                             "scale the better per-node rate linearly (default: measure every "
                             "node count the trace uses)")
    parser.add_argument("--checkpoint-every", type=int, default=20, metavar="STEPS",
                        help="checkpoint interval of both systems")
    parser.add_argument("--stall-gap", type=float, default=2.0, metavar="S",
                        help="a gap this long without a new high of useful samples is a stall")
    parser.add_argument("--raytrain-resize-interval", type=float, default=10.0, metavar="S",
                        help="Ray Train ScalingConfig.elastic_resize_monitor_interval_s")
    parser.add_argument("--raytrain-fixed", action="store_true",
                        help="Ray Train with fixed num_workers=max_nodes, not (1, max_nodes)")
    parser.add_argument("--no-torchft", action="store_true",
                        help="leave Ray Train + torchft out (it runs when torchft is installed)")
    parser.add_argument("--startup-timeout", type=float, default=300.0, metavar="S",
                        help="bound on each driver's start (both systems)")
    parser.add_argument("--finish-timeout", type=float, default=240.0, metavar="S",
                        help="bound on each driver's end after its window (both systems)")
    parser.add_argument("--out", default="runs/bench-goodput", metavar="DIR",
                        help="where goodput.json, goodput.png and the run files go")
    parser.add_argument("--config", metavar="FILE", help="TrainConfig file (TOML or JSON)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=None,
                        help="override a TrainConfig setting, e.g. --set model.n_layers=4 "
                             "(defaults: the small model " + " ".join(
                                 f"{k}={v}" for k, v in BENCH_DEFAULTS.items()) + ")")
    parser.add_argument("--links", metavar="PROFILE", default=None,
                        help="run both systems on separate hosts with this link profile's "
                             "shaped links (jobs/local/links.py: slow, straggler, zones, fast)")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    add_results_argument(parser)


def _check_args(args: argparse.Namespace) -> Path:
    """Validate the arguments; returns the trace file (``--trace`` may name a shipped one)."""
    from moshray.autoscaler.traces import TraceError, resolve_trace

    try:
        trace_path = resolve_trace(args.trace)
    except TraceError:
        raise BenchError(f"--trace {args.trace}: no such file or shipped trace") from None
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
    if args.links is not None:
        from moshray.jobs.local.links import get_profile
        from moshray.jobs.local.netns import unavailable

        try:
            get_profile(args.links)
        except ValueError as exc:
            raise BenchError(f"--links: {exc}") from None
        why = unavailable()
        if why:
            raise BenchError(f"--links needs separate hosts (network namespaces): {why}")
    return trace_path


def _overrides(args: argparse.Namespace) -> dict[str, str]:
    from moshray.jobs.config import parse_set

    return {**BENCH_DEFAULTS, **parse_set(args.set)}


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark; returns the JSON-able result (see module docstring)."""
    from dataclasses import replace

    from moshray.jobs.examples.lm.corpus import resolve_data
    from moshray.autoscaler.traces import (
        TraceError, initial_slots, live_node_seconds, load_trace, schedule)
    import moshray.jobs.bench.machine_probe as machine_probe
    from moshray.jobs.config import load_config
    from moshray.jobs.bench.goodput_report import fmt, plot, rates_table, table, to_end
    from moshray.jobs.bench.goodput_moshray import calibrate_moshray, run_moshray_driver
    from moshray.jobs.bench.goodput_runs import (
        RayTrainOptions, calibrate_raytrain, held_out_loss, moshray_final_state,
        raytrain_final_state, run_raytrain)
    from moshray.jobs.plots import plot_path_for

    trace_path = _check_args(args)
    try:
        trace = load_trace(trace_path)
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
    trace_copy = out_dir / f"trace{trace_path.suffix or '.csv'}"
    trace_copy.write_bytes(trace_path.read_bytes())

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
    if args.links is not None:  # separate hosts: no durable store for moshray's checkpoints
        overrides.update({"cluster.hosts": "netns", "checkpoint.optional": "true"})
        del overrides["checkpoint.uri"]
    config = load_config(args.config, overrides)
    config = replace(config, training=replace(config.training, max_steps=None))
    files = resolve_data(list(config.data.paths) or None,
                         os.path.expanduser(config.data.cache_dir))
    seconds_at = count_seconds(events, duration)
    node_seconds = live_node_seconds(events, duration)
    print(f"trace {trace.name}: time scale {time_scale:.2f}, {len(events)} node events in "
          f"{duration:.0f} s, {node_seconds:.0f} live node-seconds, counts "
          f"{ {n: round(s, 1) for n, s in sorted(seconds_at.items())} }", flush=True)
    links = shaped = None
    if args.links is not None:
        from moshray.jobs.bench.links import LinksBenchError, profile_links

        try:
            links, wire_bytes, compute_s = profile_links(args.links, config, args.max_nodes)
        except LinksBenchError as exc:
            raise BenchError(str(exc)) from None
        shaped = {"profile": links.profile, "link_mbit": list(links.mbit),
                  "zones": dict(links.zones), "zone_links": dict(links.zone_links),
                  "gradient_bytes_fp16": wire_bytes,
                  "step_compute_s": round(compute_s, 4)}
    options = RayTrainOptions(
        max_workers=args.max_nodes, checkpoint_every=args.checkpoint_every,
        resize_interval_s=args.raytrain_resize_interval, fixed=args.raytrain_fixed,
        startup_timeout_s=args.startup_timeout, finish_timeout_s=args.finish_timeout,
        links=links)

    # The machine's speed before, between and after the runs (machine_probe.py).
    machine: dict[str, float | None] = {}

    def probe(label: str) -> None:
        machine[label] = machine_probe.probe(config.model.to_model_config(),
                                             config.training.batch_size)

    probe("start")
    # 3. the ideal: both systems' failure-free rates at each node count the trace uses
    counts = sorted(n for n in seconds_at if n > 0)
    calib_counts = counts if args.calib_nodes is None else [args.calib_nodes]
    # Count by count, the two systems back to back: the shared machine's speed drifts over
    # the minutes a calibration takes, and a pair measured together shares the drift.
    m_rates: dict[int, float] = {}
    rt_rates: dict[int, float] = {}
    for n in calib_counts:
        m_rates.update(calibrate_moshray(config, [n], args.calib_seconds,
                                         out_dir / f"moshray-calib-{stamp}",
                                         args.startup_timeout, args.finish_timeout, links))
        rt_rates.update(calibrate_raytrain(config, [n], args.calib_seconds, options,
                                           out_dir / f"raytrain-calib-{stamp}"))
    rates = compare_rates(m_rates, rt_rates, seconds_at, args.calib_nodes)
    ideal = rates.ideal_total
    probe("after_calibrations")

    # 1. moshray under the trace
    m_dir = out_dir / f"moshray-{stamp}"
    print(f"moshray: {duration:.0f} s under the trace (its driver's log: "
          f"{m_dir / 'moshray-driver.log'})", flush=True)
    with CpuSampler() as m_cpu:  # where the machine's CPU went, by role
        m_summary, m_records, m_peers = run_moshray_driver(
            replace(config, save_model=True), m_dir, startup_timeout_s=args.startup_timeout,
            finish_timeout_s=args.finish_timeout, links=links)
    moshray = summarize("moshray", m_records, duration, args.stall_gap)
    # (the driver ran with run_dir=m_dir: its saved model and checkpoints are that run's)
    m_state = moshray_final_state(replace(config, run_dir=str(m_dir), name=m_dir.name))
    moshray_eval = held_out_loss(config, files, m_state)
    probe("after_moshray")

    # 2. Ray Train under the same trace
    print(f"raytrain: {duration:.0f} s under the trace", flush=True)
    rt_dir = out_dir / f"raytrain-{stamp}"
    rt_dir.mkdir(parents=True, exist_ok=True)
    with CpuSampler() as rt_cpu:
        rt = run_raytrain(config, events, duration, options, rt_dir)
    raytrain = summarize("raytrain", rt.records, duration, args.stall_gap, rt.rewinds)
    raytrain_eval = held_out_loss(config, files, raytrain_final_state(rt.checkpoint))

    # 3. Ray Train + torchft under the same trace (only failed replica groups restart)
    ft = ft_result = ft_eval = ft_cpu = None
    ft_missing = torchft_missing() if not args.no_torchft else "left out (--no-torchft)"
    if ft_missing is None:
        print(f"raytrain_torchft: {duration:.0f} s under the trace", flush=True)
        ft_dir = out_dir / f"raytrain-torchft-{stamp}"
        ft_dir.mkdir(parents=True, exist_ok=True)
        with CpuSampler() as ft_cpu:
            ft = run_raytrain(config, events, duration, replace(options, torchft=True), ft_dir)
        ft_result = summarize(RAYTRAIN_TORCHFT, ft.records, duration, args.stall_gap)
        ft_eval = held_out_loss(config, files, raytrain_final_state(ft.checkpoint))
    else:
        print(f"Ray Train + torchft: not run: {ft_missing}", flush=True)
    probe("end")
    # when each system's samples went missing against its own failure-free rates
    gaps = {name: gap_split(system.curve, events, rates.own[name], duration)
            for name, system in ((MOSHRAY, moshray), (RAYTRAIN, raytrain))}
    starts = replica_starts(m_summary.get("replica_timelines") or {})

    json_path = out_dir / "goodput.json"
    curves = {"moshray": to_end(moshray.curve, duration),
              "Ray Train": to_end(raytrain.curve, duration)}
    if ft_result is not None:
        curves["Ray Train + torchft"] = to_end(ft_result.curve, duration)
    curves["ideal"] = ideal_curve(events, rates.ideal, duration)
    plot_path = plot(plot_path_for(json_path), live_timeline(events, duration), curves,
                     f"{trace.name}, {args.max_nodes} nodes, time scale {time_scale:.0f}x"
                     + (f", links {links.profile}" if links else ""))
    result = {
        "trace": str(args.trace), "time_scale": time_scale, "max_nodes": args.max_nodes,
        "links": shaped,  # None: every node on loopback
        "duration_s": duration, "live_node_seconds": node_seconds,
        "node_events": sum(1 for e in events if e.at_s > 0),
        "seconds_by_nodes": {str(n): s for n, s in sorted(seconds_at.items())},
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
        "raytrain_fit_errors": [e.splitlines()[0][:200] for e in rt.fit_errors],
        "raytrain_error": rt.error,
        "moshray_preemptions": m_summary.get("preemptions"),
        "moshray_replicas_consistent": m_summary.get("replicas_consistent"),
        "calib_seconds": args.calib_seconds, "calib_nodes": args.calib_nodes,
        **rates.to_json(),
        # the share of its own failure-free samples each system kept through the node events
        "moshray_elasticity": rates.elasticity(MOSHRAY, moshray.samples),
        "raytrain_elasticity": rates.elasticity(RAYTRAIN, raytrain.samples),
        "moshray_gap": gaps[MOSHRAY].to_json(), "raytrain_gap": gaps[RAYTRAIN].to_json(),
        "moshray_replica_starts": starts.to_json(),
        # replicas per global step: a goodput made by a swarm of one says nothing of links
        "moshray_peers": participation(m_records, m_peers, duration),
        "moshray_cpu": m_cpu.result and m_cpu.result.to_json(),
        "raytrain_cpu": rt_cpu.result and rt_cpu.result.to_json(),
        "stall_gap_s": args.stall_gap, "checkpoint_every": args.checkpoint_every,
        "machine_step_ms": machine, "machine_drift": machine_probe.drift(list(machine.values())),
        "plot": str(plot_path),
        **torchft_figures(moshray, ft_result, ft, ft_eval, ft_cpu, ft_missing),
    }
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    print(rates_table(rates))
    rows = [("moshray", moshray, moshray_eval), ("Ray Train", raytrain, raytrain_eval)]
    if ft_result is not None:
        rows.append(("Ray Train + torchft", ft_result, ft_eval))
    print(table(rows))
    print(f"{'ideal':<20} {ideal:>9.0f} {ideal / duration:>10.1f}")
    if links is not None:  # the two systems side by side on the same shaped links
        print(f"links {links.profile} ({links.mbit} Mbit/s): moshray {moshray.samples} "
              f"samples, Ray Train {raytrain.samples}: moshray / Ray Train "
              f"{fmt(result['moshray_vs_raytrain'])}", flush=True)
    print(f"moshray / ideal {fmt(result['moshray_vs_ideal'])}, moshray / Ray Train "
          f"{fmt(result['moshray_vs_raytrain'])}; Ray Train restarts "
          f"{result['raytrain_restarts']}, lost samples "
          f"{raytrain.samples_processed - raytrain.samples}; plot {plot_path}", flush=True)
    print(f"elasticity (samples under the trace / the same system's failure-free samples on "
          f"the trace's node counts): moshray {fmt(result['moshray_elasticity'])}, Ray Train "
          f"{fmt(result['raytrain_elasticity'])}; moshray failure-free / ideal "
          f"{fmt(result['moshray_failure_free_vs_ideal'])} (the most moshray / ideal could be "
          "at its measured rates)", flush=True)
    print(f"samples missing against each system's own rates, by {GAP_WINDOW_S:.0f}-s slice: "
          f"moshray {gaps[MOSHRAY].line()}; Ray Train {gaps[RAYTRAIN].line()}", flush=True)
    print(f"moshray's worst slices: {gaps[MOSHRAY].worst_line()}", flush=True)
    print(f"moshray's joins: {starts.line()}", flush=True)
    peers = result["moshray_peers"]
    print(f"moshray's participants per step: mean {fmt(peers['mean'])}, max {peers['max']}, "
          f"steps by count {peers['steps_by_peers']}, samples from steps with more than one "
          f"{fmt(peers['multi_sample_share'])}", flush=True)
    if ft_result is not None:
        print(f"moshray / Ray Train + torchft {fmt(result['moshray_vs_raytrain_torchft'])}; "
              f"torchft replica starts {ft.replica_starts} (restarts "
              f"{result['raytrain_torchft_replica_restarts']}), steps the quorum discarded "
              f"{ft.discarded}, fit() called again after {len(ft.fit_errors)} failure(s), "
              f"lost samples "
              f"{ft_result.samples_processed - ft_result.samples}", flush=True)
    for name, cpu in (("moshray", m_cpu.result), ("Ray Train", rt_cpu.result),
                      ("Ray Train + torchft", ft_cpu and ft_cpu.result)):
        if cpu is not None:
            print(f"CPU by role over {name}'s trace run ({cpu.wall_s:.0f} s from its driver's "
                  f"start to its end, {cpu.cpus} cores): {cpu.line()}", flush=True)
    print(machine_probe.report_line(machine), flush=True)
    return result


def torchft_missing() -> str | None:
    """None when torchft can be imported, else one line saying how to install it."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        return "torchft is not installed (pip install 'moshray[bench]')"
    return None


def torchft_figures(moshray, ft, run, eval_loss, cpu, missing: str | None) -> dict:
    """The ``raytrain_torchft_*`` keys of the result (None where it did not run) and
    ``moshray_vs_raytrain_torchft``. Restarts are replica starts beyond the first group's
    (every worker of a group that started whole counts once)."""
    if ft is None:
        keys = ("samples", "goodput", "final_loss", "eval_loss", "stall_s", "steps",
                "first_step_s", "samples_processed", "replica_starts", "replica_restarts",
                "discarded_steps", "error", "fit_errors", "cpu")
        return {"moshray_vs_raytrain_torchft": None, "raytrain_torchft_missing": missing,
                **{f"raytrain_torchft_{k}": None for k in keys}}
    first_world = run.worlds[0] if run.worlds else 0
    return {
        "moshray_vs_raytrain_torchft": ratio(moshray.samples, ft.samples),
        "raytrain_torchft_missing": None,
        "raytrain_torchft_samples": ft.samples, "raytrain_torchft_goodput": ft.goodput,
        "raytrain_torchft_final_loss": ft.final_loss, "raytrain_torchft_eval_loss": eval_loss,
        "raytrain_torchft_stall_s": ft.stall_s, "raytrain_torchft_steps": ft.steps,
        "raytrain_torchft_first_step_s": run.records[0].t_s if run.records else None,
        "raytrain_torchft_samples_processed": ft.samples_processed,
        "raytrain_torchft_replica_starts": run.replica_starts,
        "raytrain_torchft_replica_restarts": max(run.replica_starts - first_world, 0),
        "raytrain_torchft_discarded_steps": run.discarded,
        "raytrain_torchft_error": run.error,
        # fit() calls that raised and were called again (ControllerError: a node lost while
        # Ray Train replaced a replica group), each first line
        "raytrain_torchft_fit_errors": [e.splitlines()[0][:200] for e in run.fit_errors],
        "raytrain_torchft_cpu": cpu.result and cpu.result.to_json(),
    }


def main(args: argparse.Namespace) -> int:
    from moshray.jobs.config import ConfigError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        result = run(args)
        save_result("goodput", args, result)
    except (BenchError, ConfigError) as exc:
        prefix = "config error: " if isinstance(exc, ConfigError) else ""
        print(f"moshray bench goodput: {prefix}{exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module("moshray.jobs.bench.goodput"))
