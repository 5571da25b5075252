"""`moshray bench goodput`, moshray's side: each run as its own driver process.

* :func:`run_moshray_driver`: ``python -m moshray.jobs.bench.goodput_moshray`` in a subprocess (its
  own embedded cluster replays the trace), as users run moshray (one driver per job) and as the
  bench runs Ray Train's driver; returns the summary, per-step records and peers per step.
* :func:`calibrate_moshray`: moshray's failure-free rate at each node count, each calibration
  a driver process of its own.
* :func:`moshray_history`: the run itself, in this process (what the driver process calls),
  ended early for a calibration by :func:`steady_stop` (``train.run``'s ``stop_when``).

Why a process per run: one bench runs eight calibrations and two trace runs, about half an
hour. moshray's trace run, done in the bench's own process after the calibrations, trained
6-8% fewer samples than the same run in a fresh process (its replicas slowed after a few
minutes), while Ray Train's driver always ran fresh. Each system now gets a fresh driver.

The driver process (``main``) reads a ``TrainConfig`` JSON file and writes one JSON object,
``{"summary": ..., "history": [[epoch, at_s, samples, loss, peers], ...]}``, to ``--out``.
Every wait of the parent is bounded: a driver still running ``finish_timeout_s`` after its
``training.max_seconds`` plus ``startup_timeout_s`` gets SIGTERM (the job stops as at its time
limit), then SIGKILL with its whole process group; a driver that ends without its result
raises ``BenchError`` naming its log.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from moshray.jobs.bench.goodput_curves import Progress
from moshray.jobs.bench.goodput_rates import BenchError, steady_elapsed, steady_rate

log = logging.getLogger("moshray.bench_goodput")

TERM_GRACE_S = 120.0  # from SIGTERM (stop as at the time limit) to SIGKILL


def _history_records(history: Sequence[Sequence]) -> list[Progress]:
    """Coordinator ``stats()["history"]`` rows ``(epoch, at_s, samples, loss, peers)``."""
    return [Progress(float(h[1]), int(h[0]), int(h[2]), None if h[3] is None else float(h[3]))
            for h in history]


def _split(summary: dict, history: Sequence[Sequence]
           ) -> tuple[dict, list[Progress], list[int]]:
    return summary, _history_records(history), [int(h[4]) for h in history]


def steady_stop(n: int, seconds: float):
    """A ``train.run`` ``stop_when``: True once the Coordinator's history shows ``seconds``
    since its first step with at least ``n`` participants (a calibration's window, as long
    as Ray Train's ``steady_seconds``)."""
    return lambda stats: steady_elapsed(stats.get("history", []), n) >= seconds


def moshray_history(config, steady: tuple[int, float] | None = None, links=None
                    ) -> tuple[dict, list[list]]:
    """Run ``moshray.jobs.train.run(config)`` in this process; returns its summary and the
    Coordinator's history rows ``[epoch, at_s, samples, loss, peers]``.

    ``links`` (a ``NodeLinks``; ``cluster.hosts = "netns"``): the embedded cluster's nodes
    get the links a link profile lays out (``run_embedded``), the job's driver the same as
    ``train.run``'s.

    ``steady = (n, seconds)``: end the job (as its time limit would) ``seconds`` after its
    first step with at least ``n`` participants (:func:`steady_stop`;
    ``config.training.max_seconds`` still bounds it).

    Step times are the Coordinator's (seconds since it started, which is when the trace replay
    starts). The summary's ``step_profile`` covers the steps from the first one with the most
    participants on. The history is the one the job wrote to ``<run_dir>/summary.json``;
    raises ``BenchError`` if that file is missing or unreadable.
    """
    from moshray.jobs import train as train_job

    stop_when = None if steady is None else steady_stop(*steady)
    if links is None:
        summary = train_job.run(config, stop_when=stop_when)
    else:
        from moshray.jobs.local.cloud import run_embedded

        summary = run_embedded(config, lambda address: train_job.run_job(
            config, address, stop_when=stop_when), links=links)
    saved = Path(config.run_dir).expanduser() / "summary.json"
    try:
        history = json.loads(saved.read_text())["history"]
    except (OSError, ValueError, KeyError) as exc:
        raise BenchError(f"the run's history is not in {saved}: {exc}") from None
    return summary, [list(h) for h in history]


def _driver_command(config_file: Path, out_file: Path,
                    steady: tuple[int, float] | None, links=None) -> list[str]:
    cmd = [sys.executable, "-m", "moshray.jobs.bench.goodput_moshray", "--config", str(config_file),
           "--out", str(out_file)]
    if links is not None:
        cmd += ["--links", links.to_json()]
    if steady is not None:
        cmd += ["--steady-nodes", str(steady[0]), "--steady-seconds", repr(steady[1])]
    return cmd


def run_moshray_driver(config, run_dir: Path, steady: tuple[int, float] | None = None,
                       startup_timeout_s: float = 300.0, finish_timeout_s: float = 240.0,
                       links=None) -> tuple[dict, list[Progress], list[int]]:
    """:func:`moshray_history` as a driver process of its own (``python -m
    moshray.jobs.bench.goodput_moshray``, its own embedded cluster, ``RAY_ADDRESS`` unset), with
    its config, result and log (``moshray-driver.log``: the job's progress and errors) under
    ``run_dir``, which is also the job's own ``run_dir`` (its ``summary.json`` and
    ``training.png``); ``links``: its cluster's shaped links (``moshray_history``). Bounded by ``training.max_seconds + startup_timeout_s + finish_timeout_s``,
    then SIGTERM and, ``TERM_GRACE_S`` later, SIGKILL of the driver's process group. Raises
    ``BenchError`` (one line naming the log) if the driver ends without a result."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = replace(config, run_dir=str(run_dir), name=run_dir.name)  # its checkpoints' run
    (run_dir / "summary.json").unlink(missing_ok=True)  # only this run's may be read back
    config_file, out_file = run_dir / "moshray-config.json", run_dir / "moshray-result.json"
    config_file.write_text(json.dumps(config.to_dict()))
    out_file.unlink(missing_ok=True)
    log_path = run_dir / "moshray-driver.log"
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)  # (its own cluster: the netns mode allows its addresses)
    bound = (config.training.max_seconds or 0.0) + startup_timeout_s + finish_timeout_s
    with open(log_path, "w") as driver_log:
        proc = subprocess.Popen(_driver_command(config_file, out_file, steady, links),
                                stdout=driver_log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            log.warning("moshray driver still running after %.0f s; stopping pid %d",
                        bound, proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        finally:
            _kill_group(proc)
    if not out_file.exists():
        raise BenchError(f"the moshray driver exited with status {proc.returncode} and no "
                         f"result; see {log_path}")
    result = json.loads(out_file.read_text())
    return _split(result["summary"], result["history"])


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the driver's process group (its session, started for it), then
    reap the driver. The group is the driver's own: nothing else is in it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        log.warning("moshray driver pid %d did not exit after SIGKILL", proc.pid)


def calibrate_moshray(config, counts: Sequence[int], seconds: float, out_dir: Path,
                      startup_timeout_s: float = 300.0, finish_timeout_s: float = 240.0,
                      links=None) -> dict[int, float]:
    """Failure-free moshray samples/s with each node count in ``counts``: n nodes, no trace,
    no checkpoints, training for ``seconds`` after the first step every node took part in
    (its start-up is not part of the window, as in ``calibrate_raytrain``); the rate over
    that window (``steady_rate``). Each count is a driver process of its own
    (:func:`run_moshray_driver`, files under ``out_dir/moshray-calib-<n>``), bounded by
    ``startup_timeout_s + seconds + finish_timeout_s``; ``links``: shaped links, as for a
    trace run."""
    from moshray.jobs.bench.goodput_runs import print_rate

    rates: dict[int, float] = {}
    for n in sorted(set(counts)):
        cfg = replace(config,
                      cluster=replace(config.cluster, trace=None, local_nodes=n),
                      training=replace(config.training, max_steps=None,
                                       max_seconds=startup_timeout_s + seconds),
                      checkpoint=replace(config.checkpoint, uri=None))
        run_dir = out_dir / f"moshray-calib-{n}"
        try:
            # the job's own max_seconds already holds the start-up bound
            _, records, peers = run_moshray_driver(cfg, run_dir, steady=(n, seconds),
                                                   startup_timeout_s=0.0,
                                                   finish_timeout_s=finish_timeout_s,
                                                   links=links)
            rates[n] = steady_rate(records, peers, n)
        except BenchError as exc:
            raise BenchError(f"moshray with {n} node(s): {exc}") from None
        print_rate("moshray", n, rates[n], len(records))
    return rates


def main(argv: Sequence[str] | None = None) -> int:
    """The driver process: run the job of ``--config`` and write its result to ``--out``."""
    from moshray.jobs.config import load_config
    from moshray.jobs.local.links import NodeLinks
    from moshray.jobs.train import stop_on_sigterm

    parser = argparse.ArgumentParser(prog="python -m moshray.jobs.bench.goodput_moshray")
    parser.add_argument("--config", required=True, help="TrainConfig JSON file")
    parser.add_argument("--out", required=True, help="where the result JSON goes")
    parser.add_argument("--steady-nodes", type=int, default=None)
    parser.add_argument("--steady-seconds", type=float, default=None)
    parser.add_argument("--links", default=None, help="NodeLinks JSON: shaped links")
    args = parser.parse_args(argv)
    if (args.steady_nodes is None) != (args.steady_seconds is None):
        parser.error("--steady-nodes and --steady-seconds go together")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = load_config(args.config)
    steady = None if args.steady_nodes is None else (args.steady_nodes, args.steady_seconds)
    stop_on_sigterm()
    links = None if args.links is None else NodeLinks.from_json(args.links)
    summary, history = moshray_history(config, steady, links)
    out = Path(args.out)
    partial = out.with_suffix(".partial")
    partial.write_text(json.dumps({"summary": summary, "history": history}))
    partial.replace(out)  # whole or absent
    return 0


if __name__ == "__main__":
    sys.exit(main())
