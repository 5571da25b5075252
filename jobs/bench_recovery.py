"""`moshray bench recovery`: how fast the swarm recovers from the four events of spot life.

Starts an embedded local cluster (head + ``--nodes`` spot raylets on 127.0.0.1), one
training replica per spot node (the training job's ``ReplicaSupervisor``, the default model
unless ``--set`` says otherwise), a ``NoticeWatcher`` per spot node (``WatcherFleet``, the
simulated source) and a DMoE expert set (one ``ExpertSupervisor``, one shard of experts
per spot node, experts shaped ``model.d_model -> model.d_ff``). Then, ``--trials`` times:

1. **notice -> rebalanced** (``notice_to_rebalanced_s``): a simulated termination notice
   is delivered to a node hosting a replica and experts, through the watcher's own path
   (``deliver_notice`` -> ``drain_for_notice`` -> ``Coordinator.note_notice``); the figure is
   the Coordinator's ``notice_stats()[node]["rebalance_s"]`` (notice -> first plan without
   the node). The node is removed at the notice's deadline (``--notice-s``).
2. **expert respawn** (``expert_respawn_s``), same notice: the watcher hands the notice to the
   ``ExpertSupervisor``, which re-spawns that node's shards elsewhere. The figure is the
   notice's receipt -> the moment every uid of those shards is served again: the
   Coordinator's registry lists it on a new instance on another node and a forward call
   through that record's handle returns.
3. **join -> first contribution** (``join_to_contribution_s``): a replacement node is added
   and a replica started on it; from the node being up (``add_node`` returned; the raylet's
   own start is reported apart as ``node_start_s``) to the commit of the first global step
   the new replica took part in (``Coordinator.step_timings``: a step is committed when one
   of its participants reports having applied it).
4. **hard kill -> progress** (``hard_kill_to_progress_s``): another replica's node is killed
   with SIGKILL (``LocalCluster.remove_node(slot, hard=True)``), no notice; the figure is the
   kill -> the commit of the first global step without the dead replica (the swarm moved on
   without it; ``hard_kill_to_any_commit_s`` lists the kill -> the first commit of any step,
   which may be a round in flight finishing with or without the dead peer's part). A
   replacement node joins after it (a second join sample).

Before each event the swarm is steady (every live replica has contributed to a committed
step). Times of the Coordinator's clock are mapped onto this process's monotonic clock by
one round trip; wall clocks are compared only between processes of this one machine
(notice receipt -> expert served).

With ``--json`` the last stdout line is one JSON object: the four medians, their worst
cases (``_max`` suffix), every sample (``samples``), the targets and whether each median
meets it; the same object goes to ``<out>/recovery.json`` and a bar plot (median and worst
per measure) to ``<out>/recovery.png``. Targets (for the printout, default model):
notice -> rebalanced <= 1 s, hard kill -> progress <= 5 s, join -> first contribution <= 15 s.

Bad arguments exit with status 2 and one line on stderr; a recovery that does not happen
within ``--timeout`` seconds exits with status 1 and one line naming it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

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
# The targets, for the default model (no target for expert re-spawn).
TARGETS: dict[str, float] = {
    "notice_to_rebalanced_s": 1.0,
    "hard_kill_to_progress_s": 5.0,
    "join_to_contribution_s": 15.0,
}
EXPERTS_PER_HOST = 2
POLL_S = 0.05


class BenchError(ValueError):
    """Bad benchmark input; the message is one line saying what to fix (exit 2)."""


class RecoveryTimeout(RuntimeError):
    """A recovery did not happen within ``--timeout`` (exit 1, one line)."""


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


Step = Sequence  # (epoch, planned_at_s, committed_at_s | None, participants)


def first_commit_with(steps: Sequence[Step], peer: str) -> float | None:
    """Commit time of the first committed step ``peer`` took part in (None: none yet)."""
    times = [s[2] for s in steps if s[2] is not None and peer in s[3]]
    return min(times) if times else None


def first_commit_without(steps: Sequence[Step], peer: str, after_s: float) -> float | None:
    """Commit time of the first step without ``peer`` committed after ``after_s`` (or None)."""
    times = [s[2] for s in steps if s[2] is not None and s[2] > after_s and peer not in s[3]]
    return min(times) if times else None


def first_commit_after(steps: Sequence[Step], after_s: float) -> float | None:
    """Commit time of the first step committed after ``after_s``, whoever took part."""
    times = [s[2] for s in steps if s[2] is not None and s[2] > after_s]
    return min(times) if times else None


def all_contributed(steps: Sequence[Step], peers: Sequence[str]) -> bool:
    """True once every one of ``peers`` took part in some committed step."""
    return all(first_commit_with(steps, p) is not None for p in peers)


def median_step_s(steps: Sequence[Step]) -> float | None:
    """Median seconds between consecutive plans (None with fewer than two steps): the
    pace that bounds notice -> rebalanced, since a node is rebalanced at the next plan."""
    times = sorted(s[1] for s in steps)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None


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


def _wait(predicate, timeout_s: float, what: str, poll_s: float = POLL_S):
    """``predicate()``'s first truthy value, polled; ``RecoveryTimeout`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= end:
            raise RecoveryTimeout(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


# =========================================================================== the run


@dataclass
class _Samples:
    values: dict[str, list[float]]
    node_start_s: list[float]


class RecoveryBench:
    """The cluster-side half: owns the swarm on a connected local cluster, times each event.

    ``cluster`` is a connected ``LocalCluster``; ``config`` a ``TrainConfig``. Every wait is
    bounded by ``timeout_s``; ``close`` stops what this object started.
    """

    def __init__(self, cluster, config, timeout_s: float, notice_s: float, log_fn):
        import ray

        from moshray.actors.data import resolve_data
        from moshray.actors.expert import ExpertSetConfig, ExpertSpec, ExpertSupervisor
        from moshray.autoscaler.watch import WatcherConfig, WatcherFleet
        from moshray.cluster import coordinator as coordinator_mod
        from moshray.cluster import placement
        from moshray.cluster.membership import MembershipConfig
        from moshray.jobs.replica_launch import ReplicaSupervisor

        self.ray = ray
        self.cluster, self.config = cluster, config
        self.timeout_s, self.notice_s, self.log = timeout_s, notice_s, log_fn
        t = config.training
        self.name = f"moshray-coordinator-bench-recovery-{os.getpid()}"
        self.coordinator = coordinator_mod.get_or_create(
            MembershipConfig(compression=t.compression, peer_ttl_s=max(3.0, t.round_timeout_s)),
            target_batch_size=t.target_batch_size, name=self.name)
        ray.get(self.coordinator.stats.remote(), timeout=timeout_s)
        self.fleet = WatcherFleet(WatcherConfig(source="simulated", poll_s=0.1,
                                                rpc_timeout_s=30.0, coordinator_name=self.name))
        files = resolve_data(list(config.data.paths) or None,
                             os.path.expanduser(config.data.cache_dir))
        self.replicas = ReplicaSupervisor(config, files, self.coordinator, None)
        nodes = len(cluster.live_slots())
        m = config.model
        self.layer = "recovery"
        self.expert_config = ExpertSetConfig(
            layers=(self.layer,), grid=(nodes, EXPERTS_PER_HOST),
            spec=ExpertSpec(d_model=m.d_model, d_hidden=m.d_ff),
            experts_per_host=EXPERTS_PER_HOST, snapshot_interval_s=3600.0, num_cpus=0.25)
        self.experts = ExpertSupervisor.options(max_concurrency=1000, **placement.on_head()) \
            .remote(self.expert_config, self.coordinator)
        self.offset = 0.0
        self.any_commit_s: list[float] = []  # hard kill -> first commit of any step

    # -- helpers ---------------------------------------------------------------------------

    def _get(self, ref):
        return self.ray.get(ref, timeout=self.timeout_s)

    def _steps(self) -> list:
        return self._get(self.coordinator.step_timings.remote())["steps"]

    def _sync_clock(self) -> None:
        """``offset``: Coordinator time (seconds since it started) + offset = our monotonic."""
        best = None
        for _ in range(3):
            t0 = time.monotonic()
            now_s = self._get(self.coordinator.step_timings.remote(10**12))["now_s"]
            t1 = time.monotonic()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, (t0 + t1) / 2 - now_s)
        self.offset = best[1]

    def _peer(self, slot: int) -> str:
        return self.replicas.replicas[slot][0]

    def _shards_on(self, node_id: str) -> dict[str, dict]:
        hosts = self._get(self.experts.hosts.remote())
        return {h: info for h, info in hosts.items() if info["node_id"] == node_id}

    def _wait_steady(self, what: str) -> None:
        peers = [p for p, _, _ in self.replicas.handles()]
        _wait(lambda: all_contributed(self._steps(), peers), self.timeout_s,
              f"every replica to contribute ({what})", poll_s=0.2)

    def _watch(self, slot: int) -> None:
        """A watcher on ``slot``'s node that hands notices to the expert supervisor."""
        self.fleet.sync(timeout_s=self.timeout_s, only=[slot])
        self.fleet.register(slot, self.experts, "experts")

    # -- start ------------------------------------------------------------------------------

    def start(self) -> None:
        slots = self.cluster.live_slots()
        for slot in slots:
            self.replicas.start(slot)
        self._get(self.experts.start.remote())
        if not self._get(self.experts.wait_healthy.remote(self.timeout_s)):
            raise RecoveryTimeout(f"expert shards not all serving after {self.timeout_s:.0f} s")
        for slot in slots:
            self._watch(slot)
        self.log(f"{len(slots)} replicas and {len(slots)} expert shards started; waiting for "
                 "every replica's first contribution ...")
        t0 = time.monotonic()
        self._wait_steady("start-up")
        self._sync_clock()
        self.log(f"swarm steady after {time.monotonic() - t0:.1f} s more "
                 f"({len(self._steps())} global steps so far)")

    # -- the events ---------------------------------------------------------------------------

    def notice(self) -> tuple[float, float | None]:
        """Notice a node hosting a replica and experts; ``(rebalance_s, expert_respawn_s)``
        (the latter None if no expert shard was on the node).

        The node is removed at the notice's deadline (or once both are measured, if later).
        """
        hosts = self._get(self.experts.hosts.remote())
        per_node = {s: sum(1 for h in hosts.values() if h["node_id"] == self.cluster.node_id(s))
                    for s in self.replicas.replicas}
        slot = max(sorted(per_node), key=lambda s: per_node[s])
        node = self.cluster.node_id(slot)
        moving = self._shards_on(node)
        self.log(f"notice for spot node {slot} (replica {self._peer(slot)}, expert shards "
                 f"{sorted(moving) or 'none'})")
        outcome = self.fleet.notify(slot, self.notice_s, timeout_s=self.timeout_s)
        if not outcome.coordinator_ok:
            raise RecoveryTimeout(f"the watcher could not tell the Coordinator: {outcome.error}")
        received = outcome.notice.received_unix_s
        deadline_mono = time.monotonic() + outcome.notice.seconds_left(time.time())
        rebalance_s = respawn_s = None
        want_respawn = bool(moving)  # no shard on the node: only the rebalance is timed
        removed = False
        end = time.monotonic() + self.timeout_s + self.notice_s
        while rebalance_s is None or (want_respawn and respawn_s is None) or not removed:
            if rebalance_s is None:
                record = self._get(self.coordinator.notice_stats.remote()).get(node)
                if record is not None and record["rebalance_s"] is not None:
                    rebalance_s = float(record["rebalance_s"])
            if want_respawn and respawn_s is None and self._served_elsewhere(moving, node):
                respawn_s = time.time() - received
            if not removed and time.monotonic() >= deadline_mono:
                self.replicas.lost(slot)
                self.cluster.remove_node(slot)
                self.fleet.node_gone(slot)
                removed = True
            if time.monotonic() > end:
                what = "the first plan without the noticed node" if rebalance_s is None \
                    else "the noticed node's experts to be served again"
                raise RecoveryTimeout(f"timed out after {self.timeout_s:.0f} s waiting for {what}")
            time.sleep(POLL_S)
        return rebalance_s, respawn_s

    def _served_elsewhere(self, moving: Mapping[str, dict], node: str) -> bool:
        """Every uid of ``moving`` (host -> old info) registered on a new instance off
        ``node``, and a forward call through the registry's handle answers."""
        import numpy as np

        records = {r.host_id: r for r in self._get(
            self.coordinator.lookup_experts.remote(f"{self.layer}."))}
        d = self.expert_config.spec.d_model
        for host_id, old in moving.items():
            r = records.get(host_id)
            if r is None or r.node_id == node or r.instance == old["instance"] \
                    or set(r.uids) != set(old["uids"]):
                return False
        x = np.zeros((1, d), dtype=np.float32)
        try:
            for host_id in moving:
                r = records[host_id]
                self.ray.get(r.handle.forward.remote(r.uids, (x,) * len(r.uids)), timeout=10)
        except (self.ray.exceptions.RayError, TimeoutError):
            return False
        return True

    def join(self) -> tuple[float, float]:
        """Add a node and start a replica there; ``(node_start_s, join_to_contribution_s)``."""
        t0 = time.monotonic()
        slot = self.cluster.add_node()
        up = time.monotonic()
        self.replicas.start(slot)
        peer = self._peer(slot)
        self._watch(slot)
        committed = _wait(lambda: first_commit_with(self._steps(), peer), self.timeout_s,
                          f"the first contribution of {peer} on the new node {slot}")
        join_s = committed + self.offset - up
        self.log(f"node {slot} up in {up - t0:.1f} s; {peer}'s first contribution after "
                 f"{join_s:.2f} s")
        return up - t0, join_s

    def hard_kill(self) -> float:
        """SIGKILL a replica's node (one without experts if any); returns kill -> progress."""
        hosts = self._get(self.experts.hosts.remote())
        with_experts = {h["node_id"] for h in hosts.values()}
        slots = sorted(self.replicas.replicas)
        bare = [s for s in slots if self.cluster.node_id(s) not in with_experts]
        slot = (bare or slots)[0]
        peer = self._peer(slot)
        _, _, run_ref = self.replicas.replicas[slot]
        self.log(f"hard kill of spot node {slot} (replica {peer})")
        killed_at = time.monotonic()
        self.cluster.remove_node(slot, hard=True)
        after = killed_at - self.offset
        committed = _wait(lambda: first_commit_without(self._steps(), peer, after),
                          self.timeout_s, f"a committed step after the hard kill of {peer}")
        progress_s = committed + self.offset - killed_at
        # For reference: the first commit of any step (a round in flight may still commit,
        # with or without the dead peer's contribution, before the swarm has moved on).
        self.any_commit_s.append(first_commit_after(self._steps(), after) + self.offset
                                 - killed_at)
        self.log(f"  next step without {peer} committed after {progress_s:.2f} s (first "
                 f"commit of any step after {self.any_commit_s[-1]:.2f} s)")
        # The training driver's part: the replica's run() fails, the slot is forgotten.
        try:
            self.ray.get(run_ref, timeout=self.timeout_s)
        except (self.ray.exceptions.RayError, TimeoutError):
            pass
        self.replicas.lost(slot, hard=True)
        self.fleet.node_gone(slot)
        return progress_s

    def trial(self, samples: _Samples, index: int) -> None:
        """One trial: notice (+ expert re-spawn), a join, a hard kill, a join."""
        self.log(f"trial {index + 1}")
        rebalance_s, respawn_s = self.notice()
        samples.values["notice_to_rebalanced_s"].append(rebalance_s)
        if respawn_s is None:
            self.log(f"  notice -> rebalanced {rebalance_s:.2f} s (no expert shard moved)")
        else:
            self.log(f"  notice -> rebalanced {rebalance_s:.2f} s, expert shards served again "
                     f"after {respawn_s:.2f} s")
            samples.values["expert_respawn_s"].append(respawn_s)
        self._join(samples)
        self._wait_steady("before the hard kill")
        self._sync_clock()
        samples.values["hard_kill_to_progress_s"].append(self.hard_kill())
        self._join(samples)
        self._wait_steady("end of trial")

    def _join(self, samples: _Samples) -> None:
        self._sync_clock()
        start_s, join_s = self.join()
        samples.node_start_s.append(start_s)
        samples.values["join_to_contribution_s"].append(join_s)

    def close(self) -> None:
        """Stop replicas, experts, watchers and the Coordinator (each bounded)."""
        ray = self.ray
        try:
            ray.get(self.coordinator.request_stop.remote(), timeout=30)
            refs = [r for _, _, r in self.replicas.handles()]
            if refs:
                ray.wait(refs, num_returns=len(refs),
                         timeout=self.config.training.round_timeout_s * 3 + 30)
        except ray.exceptions.RayError as exc:
            log.warning("stopping the replicas: %s", type(exc).__name__)
        for _, handle, _ in self.replicas.handles():
            ray.kill(handle)
        try:
            ray.get(self.experts.stop.remote(), timeout=60)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("stopping the experts: %s", type(exc).__name__)
        ray.kill(self.experts)
        self.fleet.stop()
        ray.kill(self.coordinator, no_restart=True)


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark; returns the JSON-able summary (see the module docstring)."""
    from moshray.jobs.config import load_config, parse_set
    from moshray.jobs.local_cluster import LocalCluster, LocalClusterConfig, pin_loopback

    check_args(args)
    config = load_config(args.config, parse_set(args.set))
    log_fn = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else \
        (lambda *a: print(*a, flush=True))
    pin_loopback()
    samples = _Samples({m: [] for m in MEASURES}, [])
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    with LocalCluster(LocalClusterConfig(spot_nodes=args.nodes, cpus_per_node=2)) as cluster:
        cluster.connect()
        bench = RecoveryBench(cluster, config, args.timeout, args.notice_s, log_fn)
        try:
            bench.start()
            for i in range(args.trials):
                bench.trial(samples, i)
            step_s = median_step_s(bench._steps())
            any_commit_s = bench.any_commit_s
        finally:
            bench.close()
    m = config.model
    return summarize(samples.values, {
        "trials": args.trials, "nodes": args.nodes, "notice_s": args.notice_s,
        "model": m.to_dict(), "target_batch_size": config.training.target_batch_size,
        "batch_size": config.training.batch_size,
        "round_timeout_s": config.training.round_timeout_s,
        "experts_per_node": EXPERTS_PER_HOST, "median_step_s": step_s,
        "hard_kill_to_any_commit_s": any_commit_s,
        "node_start_s": samples.node_start_s, "wall_s": time.monotonic() - started,
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
    return plots._save(fig, path)


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
                        help="repetitions of notice, join, hard kill, join")
    parser.add_argument("--nodes", type=int, default=3, metavar="N",
                        help="spot nodes (one replica and one expert shard each)")
    parser.add_argument("--notice-s", type=float, default=5.0, metavar="S",
                        help="seconds between a notice and the node's removal")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S",
                        help="bound on every wait (start-up, each recovery)")
    parser.add_argument("--config", metavar="FILE", help="TrainConfig file (TOML or JSON)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=None,
                        help="override a TrainConfig setting, e.g. --set model.n_layers=1 "
                             "(default: the project's default model)")
    parser.add_argument("--out", default="runs/bench-recovery", metavar="DIR",
                        help="where recovery.json and recovery.png go")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")


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
    log_fn(_table(summary))
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module("moshray.jobs.bench_recovery"))
