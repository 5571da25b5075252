"""`moshray bench step`: where the time of a failure-free global step goes, per node count.

For each node count, trains the goodput bench's small model (``bench goodput``'s defaults,
``--set`` overrides them) on the embedded cluster for ``--seconds`` with no failure and no
checkpoint (each count a driver process of its own, as in ``bench goodput``), and prints
the steady rate (``goodput_rates.steady_rate``: from the first step every node took part
in) next to the per-step profile the replicas sent the Coordinator
(``cluster/coordinator/step_profile.py``): the median wall time of one replica's step and its split into
compute (the training loop), control (reports and replies), round (the all-reduce) and apply
(optimizer step and commit), the plan's wait in the replica, the samples one replica put
into a step (``mine``, median) and the all-reduce's own phases.
This is the profile the steady-state targets (a step within reach of DDP's) are judged by; the DDP rate to compare
with is ``bench goodput``'s calibration.

One JSON line on stdout with ``--json``; bad arguments exit 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

from moshray.jobs.bench.results import add_results_argument, save_result
from moshray.jobs.cli import add_train_bench_arguments

PHASE_COLUMNS = ("wall_s", "compute_s", "control_s", "round_s", "apply_s", "plan_lag_s")


def parse_counts(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; ValueError naming the bad entry otherwise."""
    counts = []
    for part in text.split(","):
        try:
            n = int(part)
        except ValueError:
            raise ValueError(f"--nodes wants counts like 1,2,4; got {part!r}") from None
        if n < 1:
            raise ValueError(f"--nodes counts must be >= 1, got {n}")
        counts.append(n)
    return sorted(set(counts))


def run(args: argparse.Namespace) -> dict:
    from moshray.jobs.bench.goodput import BENCH_DEFAULTS
    from moshray.jobs.config import load_config, parse_set
    from moshray.jobs.bench.goodput_rates import BenchError, steady_rate
    from moshray.jobs.bench.goodput_moshray import run_moshray_driver

    out: dict = {"seconds": args.seconds, "counts": {}}
    for n in parse_counts(args.nodes):
        overrides = {**BENCH_DEFAULTS, **parse_set(args.set or [])}
        overrides.update({"cluster.local_nodes": str(n), "cluster.max_nodes": str(n),
                          "training.max_seconds": repr(args.seconds), "json": "true",
                          "run_dir": str(Path(args.out).expanduser() / f"nodes-{n}")})
        overrides.pop("training.max_steps", None)
        config = load_config(args.config, overrides)
        config = replace(config, cluster=replace(config.cluster, trace=None),
                         training=replace(config.training, max_steps=None),
                         checkpoint=replace(config.checkpoint, uri=None))
        print(f"step profile: {n} node(s), {args.seconds:g} s", file=sys.stderr, flush=True)
        summary, records, peers = run_moshray_driver(config, Path(config.run_dir))
        try:
            rate = steady_rate(records, peers, n)
        except BenchError as exc:
            rate = None
            print(f"  no steady rate with {n} node(s): {exc}", file=sys.stderr)
        steps = [r for r, p in zip(records, peers) if p >= n]
        out["counts"][str(n)] = {
            "samples_per_s": rate,
            "steps": len(steps),
            "samples_per_step": (sum(r.samples for r in steps) / len(steps)) if steps else None,
            "profile": summary.get("step_profile"),
        }
    return out


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(fig: dict) -> None:
    print(f"{'nodes':>5} {'samples/s':>10} {'/step':>6} {'mine':>5} " +
          " ".join(f"{c[:-2]:>8}" for c in PHASE_COLUMNS) + "  round phases (median s)")
    for n, f in fig["counts"].items():
        prof = f.get("profile") or {}
        med = prof.get("median_s", {})
        parts = ", ".join(f"{k} {v:.3f}" for k, v in prof.get("round_phases_median_s",
                                                               {}).items())
        print(f"{n:>5} {_fmt(f['samples_per_s'], '.1f'):>10} "
              f"{_fmt(f['samples_per_step'], '.1f'):>6} "
              f"{_fmt(prof.get('samples_median'), '.0f'):>5} " +
              " ".join(f"{_fmt(med.get(c)):>8}" for c in PHASE_COLUMNS) + f"  {parts}")
        share = prof.get("share", {})
        if share:
            print(f"{'':>23}share of wall: " +
                  ", ".join(f"{k[:-2]} {v:.0%}" for k, v in share.items()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", default="1,2,4", help="node counts, e.g. 1,2,4")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="length of each run (start-up included)")
    add_train_bench_arguments(parser, out="runs/bench-step", runs="every run")
    add_results_argument(parser)


def main(args: argparse.Namespace) -> int:
    from moshray.jobs.config import ConfigError, load_config, parse_set

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        parse_counts(args.nodes)
        if not args.seconds > 0:
            raise ValueError(f"--seconds must be > 0, got {args.seconds}")
        load_config(args.config, parse_set(list(args.set or [])))
    except (ValueError, ConfigError) as exc:
        print(f"moshray bench step: {exc}", file=sys.stderr)
        return 2
    fig = run(args)
    save_result("step", args, fig)
    if args.json:
        print(json.dumps(fig), flush=True)
    else:
        print_table(fig)
    return 0


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module("moshray.jobs.bench.step"))
