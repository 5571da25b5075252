"""`moshray bench overlap`: overlapped averaging (one step of delay) next to synchronous steps.

Runs the same failure-free training job twice on the embedded cluster, once with
``training.overlap = "off"`` (every replica waits while its gradients are averaged) and once
with ``"on"`` (the averaging of step k runs while the replica accumulates step k+1 on the
parameters of step k-1: delayed parameter updates), and prints, side by side:

- ``samples_per_s``: the steady rate, samples of the steps after the first over the time
  from the first step to the last (start-up excluded);
- ``loss_at_equal_samples``: the mean loss of the ``LOSS_WINDOW`` steps up to the moment
  each run had trained on the same number of samples (the smaller run's total), which is
  where the delay's effect on the loss shows;
- ``final_loss``, steps, samples, and whether the replicas ended bitwise identical.

One JSON line on stdout with ``--json`` (the jobs' own lines go to stderr then); bad
arguments exit 2 with one line.
"""

from __future__ import annotations

from moshray.jobs.bench.results import add_results_argument, save_result
import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from moshray.jobs.cli import add_train_bench_arguments

LOSS_WINDOW = 20  # steps averaged for a loss figure (fewer are too noisy with small batches)
MODES = ("off", "on")


# =========================================================================== pure logic


def steady_rate(history: Sequence[Sequence]) -> float | None:
    """Samples/s between the first and the last step (``history`` rows: epoch, at_s,
    samples, loss, peers); None with fewer than two steps or no time between them."""
    if len(history) < 2 or history[-1][1] <= history[0][1]:
        return None
    return sum(h[2] for h in history[1:]) / (history[-1][1] - history[0][1])


def loss_at(history: Sequence[Sequence], samples: float, window: int = LOSS_WINDOW
            ) -> float | None:
    """Mean loss of the last ``window`` steps (with a loss) committed by the time the run
    had trained on ``samples`` samples; None if no step had a loss by then."""
    seen, losses = 0, []
    for h in history:
        if seen >= samples:
            break
        seen += h[2]
        if h[3] is not None:
            losses.append(float(h[3]))
    tail = losses[-window:]
    return sum(tail) / len(tail) if tail else None


def compare(runs: dict[str, dict]) -> dict:
    """The bench's figures from each mode's ``{"summary", "history"}``."""
    common = min(sum(h[2] for h in r["history"]) for r in runs.values())
    out: dict = {"equal_samples": common}
    for mode, r in runs.items():
        h, s = r["history"], r["summary"]
        out[mode] = {"steps": s.get("steps"), "samples": s.get("samples"),
                     "samples_per_s": steady_rate(h),
                     "loss_at_equal_samples": loss_at(h, common),
                     "final_loss": loss_at(h, float("inf")),
                     "replicas_consistent": s.get("replicas_consistent")}
    off, on = out["off"], out["on"]
    out["speedup"] = (on["samples_per_s"] / off["samples_per_s"]
                      if on["samples_per_s"] and off["samples_per_s"] else None)
    out["loss_delta_at_equal_samples"] = (
        on["loss_at_equal_samples"] - off["loss_at_equal_samples"]
        if None not in (on["loss_at_equal_samples"], off["loss_at_equal_samples"]) else None)
    return out


# =========================================================================== the runs


def run(args: argparse.Namespace) -> dict:
    from moshray.jobs.config import load_config, parse_set
    from moshray.jobs.train import run as train

    runs = {}
    for mode in MODES:
        run_dir = Path(args.out).expanduser() / mode
        overrides = parse_set(list(args.set or []) + [
            f"training.overlap={mode}", f"cluster.local_nodes={args.nodes}",
            f"cluster.max_nodes={args.nodes}", f"training.max_seconds={args.seconds}",
            "metrics.port=0", "json=true", f"run_dir={run_dir}"])
        config = load_config(args.config, overrides)
        config = replace(config, cluster=replace(config.cluster, trace=None))  # no failures
        print(f"overlap {mode}: {args.seconds:g} s on {args.nodes} node(s)", file=sys.stderr,
              flush=True)
        summary = train(config)
        history = json.loads((run_dir / "summary.json").read_text())["history"]
        runs[mode] = {"summary": summary, "history": history}
    return compare(runs)


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="local nodes (one replica each)")
    parser.add_argument("--seconds", type=float, default=90.0, help="length of each run")
    add_train_bench_arguments(parser, out="runs/bench-overlap", runs="both runs")
    add_results_argument(parser)


def main(args: argparse.Namespace) -> int:
    from moshray.jobs.config import ConfigError, load_config, parse_set

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.nodes < 1 or not args.seconds > 0:
            raise ValueError(f"--nodes must be >= 1 and --seconds > 0, got {args.nodes}, "
                             f"{args.seconds}")
        load_config(args.config, parse_set(list(args.set or []) + ["training.overlap=on"]))
    except (ValueError, ConfigError) as exc:
        print(f"moshray bench overlap: {exc}", file=sys.stderr)
        return 2
    fig = run(args)
    save_result("overlap", args, fig)
    if args.json:
        print(json.dumps(fig), flush=True)
        return 0
    print(f"{'overlap':<8} {'samples/s':>10} {'loss@equal':>11} {'final loss':>11} "
          f"{'steps':>6} {'identical':>9}")
    for mode in MODES:
        f = fig[mode]
        print(f"{mode:<8} {_fmt(f['samples_per_s'], '.1f'):>10} "
              f"{_fmt(f['loss_at_equal_samples']):>11} {_fmt(f['final_loss']):>11} "
              f"{f['steps']:>6} {str(f['replicas_consistent']):>9}")
    print(f"speedup {_fmt(fig['speedup'])}, loss delta at {fig['equal_samples']} samples "
          f"{_fmt(fig['loss_delta_at_equal_samples'], '+.4f')}")
    return 0


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module("moshray.jobs.bench.overlap"))
