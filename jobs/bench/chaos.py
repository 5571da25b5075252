"""`moshray bench chaos`: one bounded run of the training job under a seeded storm of faults.

The schedule mixes five kinds of fault, all drawn from one seed:

- ``notice``: a spot notice, then the node's removal at its deadline;
- ``kill``: a spot raylet SIGKILLed, no notice;
- ``coordinator``: ``ray.kill(coordinator, no_restart=False)`` (Ray restarts it, the
  replicas rebuild it);
- ``nan``: one replica's gradients turn NaN until its peers get it quarantined;
- ``shape``: one replica sends contributions one element too long, likewise.

Node faults go through the embedded cluster's cloud exactly as a spot trace does: the
schedule's node events are written as a per-node trace (``jobs/bench/chaos_schedule.py``) that
``jobs/local_cloud.run_embedded`` replays while ``train.run_job`` (the elastic controller)
trains. The actor faults are injected by this harness from a thread, with Ray handles found
by name as a test would (the Coordinator by its well-known name, a replica through
``Coordinator.peer_handle``); a bad replica's fault is cleared once the Coordinator lists
it as quarantined (or after ``--timeout``), so it resyncs from a donor and rejoins.

Figures (one JSON line on stdout; the job's own lines go to stderr): faults injected by
kind, steps, lost and repeated committed steps (replica lineages), rollbacks (summed over
the Coordinator's lives), quarantines seen, seconds stalled (sum of the gaps between global
steps longer than ``STALL_S``), replicas at the end (staying, i.e. not noticed) and the
expected count, ``replicas_consistent``. Invariants: 0 lost, 0 repeated, 0 rollbacks, every
bad replica quarantined, the expected replica count, replicas bitwise identical; a failed
invariant exits 1 with one line on stderr (after the JSON line). Bad arguments exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from moshray.jobs.bench.chaos_schedule import write_trace
from moshray.jobs.bench.chaos_plan import (ACTOR_KINDS, SCHEDULES, ChaosPlan, draw_plan,
                                     invariant_failures, join_seconds, stall_causes,
                                     stalled_seconds)

log = logging.getLogger("moshray.bench_chaos")

BAD_WAIT_S = 30.0  # at most this long for the ready replicas, then for the quarantine
MIN_READY = 2  # ready replicas a bad-replica fault needs: the bad one and a good one
# The bench's model (small, so that a 2-core machine takes many steps); --set overrides.
DEFAULT_SET = ("model.n_layers=2", "model.d_model=64", "model.d_ff=128", "model.n_heads=2",
               "model.seq_len=64", "training.batch_size=8", "training.target_batch_size=32",
               "training.round_timeout_s=5")


# =========================================================================== the harness


class Injector:
    """Injects ``plan.actor_faults`` into the running job and watches its Coordinator (every
    ``poll_s``: epoch advances, rollbacks, quarantines). Runs in a thread sharing the
    driver's Ray connection; stops by ``end_at`` (monotonic) so that it is done before the
    job disconnects. Every Ray call is bounded by ``timeout_s``; failures are recorded in
    ``errors``, never raised."""

    def __init__(self, plan: ChaosPlan, timeout_s: float, log_fn, seed: int, poll_s: float = 0.5):
        self.plan, self.timeout_s, self.log, self.poll_s = plan, timeout_s, log_fn, poll_s
        self.rng = random.Random(seed)
        self.injected = {k: 0 for k in ACTOR_KINDS}
        self.bad: list[str] = []
        self.bad_lost: list[str] = []
        self.quarantined: dict[str, str] = {}  # peer -> reason, over every Coordinator life
        self.rollbacks_done = 0  # of the Coordinator's earlier lives
        self.rollbacks_life = 0
        self.top_epoch = 0
        self.advances: list[float] = []
        # (monotonic time, kind): faults injected here, node losses and joins seen
        self.events: list[tuple[float, str]] = []
        self._seen_losses = self._seen_members = None
        self.errors: list[str] = []
        self.end_at = float("inf")

    def _coordinator(self):
        import ray

        from moshray.cluster import placement

        return ray.get_actor(placement.COORDINATOR_NAME, namespace=placement.NAMESPACE)

    def _get(self, ref):
        import ray

        return ray.get(ref, timeout=self.timeout_s)

    def observe(self) -> dict | None:
        """One look at the Coordinator's stats (None if it did not answer)."""
        import ray

        try:
            stats = self._get(self._coordinator().stats.remote())
        except (ray.exceptions.RayError, TimeoutError, ValueError) as exc:
            self.errors.append(f"stats: {type(exc).__name__}")
            return None
        if stats["epoch"] > self.top_epoch:
            self.top_epoch = stats["epoch"]
            self.advances.append(time.monotonic())
        self.rollbacks_life = max(self.rollbacks_life, stats["rollbacks"])
        now = time.monotonic()
        losses = stats["preemptions"]  # a restarted Coordinator counts from 0 again
        if self._seen_losses is not None and losses > self._seen_losses:
            self.events.append((now, "node_loss"))
        live = stats["live"]
        if self._seen_members is not None and live > self._seen_members:
            self.events.append((now, "join"))
        self._seen_losses, self._seen_members = losses, live
        for peer, reason in stats["quarantines"]:
            self.quarantined.setdefault(peer, reason)
        return stats

    def _wait_until(self, at: float) -> bool:
        while time.monotonic() < min(at, self.end_at):
            self.observe()
            time.sleep(self.poll_s)
        return time.monotonic() < self.end_at

    def kill_coordinator(self) -> None:
        import ray

        self.observe()
        self.rollbacks_done += self.rollbacks_life
        self.rollbacks_life = 0
        ray.kill(self._coordinator(), no_restart=False)
        self.events.append((time.monotonic(), "coordinator"))
        self.injected["coordinator"] += 1
        self.log(f"chaos: Coordinator killed (#{self.injected['coordinator']})")

    def bad_replica(self, kind: str) -> None:
        """Make one ready replica send ``kind`` contributions until it is quarantined. It
        needs one good peer besides, who rejects them (a 1-vs-1 length dispute is settled
        by the swarm's layout: ``cluster/coordinator/quarantine.py``). A replica that dies as it is
        picked (its node went) is replaced by another pick."""
        import ray

        need = MIN_READY
        # Bounded well below --timeout: the schedule's later faults must not drift away.
        deadline = time.monotonic() + min(self.timeout_s, BAD_WAIT_S)
        while True:
            # Earlier bad replicas count: quarantined, they copied a donor's state and their
            # fault was cleared, so they are healthy replicas again.
            ready = list(self._get(self._coordinator().peer_view.remote())["ready"])
            if len(ready) >= need:
                peer = self.rng.choice(sorted(ready))
                try:
                    handle = self._get(self._coordinator().peer_handle.remote(peer))
                    self._get(handle.inject_fault.remote(kind))
                    break
                except ray.exceptions.RayActorError as exc:
                    self.log(f"chaos: {peer} is gone ({type(exc).__name__}); picking again")
            if time.monotonic() >= min(deadline, self.end_at):
                self.errors.append(f"{kind}: fewer than {need} ready replicas, none broken")
                return
            self._wait_until(time.monotonic() + self.poll_s)
        self.injected[kind] += 1
        self.events.append((time.monotonic(), kind))
        self.bad.append(peer)
        self.log(f"chaos: {peer} sends {kind} contributions")
        deadline = time.monotonic() + min(self.timeout_s, BAD_WAIT_S)
        while peer not in self.quarantined and time.monotonic() < min(deadline, self.end_at):
            time.sleep(self.poll_s)
            self.observe()
            if peer not in self._get(self._coordinator().peer_view.remote())["members"]:
                self.bad_lost.append(peer)  # its node went first
                return
        try:
            self._get(handle.inject_fault.remote(None))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            self.errors.append(f"clear {peer}: {type(exc).__name__}")

    def run(self) -> None:
        """Wait for the job's Coordinator, then inject each fault at its time."""
        import ray

        start = time.monotonic()
        while self.observe() is None:
            if time.monotonic() - start > self.timeout_s:
                self.errors.append("the job's Coordinator never answered")
                return
            time.sleep(self.poll_s)
        t0 = time.monotonic()
        for fault in self.plan.actor_faults:
            if not self._wait_until(t0 + fault.at_s):
                break
            try:
                self.kill_coordinator() if fault.kind == "coordinator" else \
                    self.bad_replica(fault.kind)
            except (ray.exceptions.RayError, TimeoutError, ValueError) as exc:
                self.errors.append(f"{fault.kind} at {fault.at_s:g} s: {type(exc).__name__}")
        self._wait_until(self.end_at)
        self.rollbacks_done += self.rollbacks_life
        self.rollbacks_life = 0


def job_config(config, plan: ChaosPlan, trace: Path, nodes: int, run_dir: str):
    """The ``TrainConfig`` of the job under test: the chaos trace replayed at wall time
    (notices 3 s ahead), room for ``nodes`` nodes, metrics on any free port, JSON mode."""
    return replace(
        config,
        training=replace(config.training, max_seconds=plan.duration_s + plan.settle_s,
                         max_steps=None),
        cluster=replace(config.cluster, address=None, trace=str(trace), time_scale=1.0,
                        notice_s=3.0, max_nodes=nodes, min_nodes=1),
        metrics=replace(config.metrics, port=0), run_dir=run_dir, json=True)


def run(args: argparse.Namespace, log_fn) -> dict:
    """The whole bench; returns its figures (see the module docstring)."""
    from moshray.jobs.config import load_config, parse_set
    from moshray.jobs.local.cloud import run_embedded
    from moshray.jobs.train import run_job

    schedule = SCHEDULES[args.schedule]
    seed = schedule.chaos.seed if args.seed is None else args.seed
    plan = draw_plan(schedule, seed)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    trace = write_trace(plan.node_events, out / "chaos.csv")
    config = load_config(args.config, parse_set(list(DEFAULT_SET) + list(args.set or [])))
    config = job_config(config, plan, trace, schedule.chaos.nodes, str(out / "job"))
    injector = Injector(plan, args.timeout, log_fn, seed)
    log_fn(f"chaos: {sum(plan.planned.values())} faults planned {plan.planned} over "
           f"{plan.duration_s:g} s")

    def job(address: str) -> dict:
        # The injector stops before the job's time limit: the job then disconnects Ray.
        injector.end_at = time.monotonic() + plan.duration_s + plan.settle_s - 10
        thread = threading.Thread(target=injector.run, name="chaos-injector", daemon=True)
        thread.start()
        try:
            return run_job(config, address)
        finally:
            injector.end_at = 0.0
            thread.join(timeout=args.timeout)

    started = time.monotonic()
    summary = run_embedded(config, job)
    return figures(plan, injector, summary, time.monotonic() - started)


def figures(plan: ChaosPlan, injector: Injector, summary: dict, wall_s: float) -> dict:
    """The bench's JSON object from the plan, what the injector saw and the job's summary."""
    injected = {k: v for k, v in plan.planned.items() if k in ("notice", "kill")}
    injected.update(injector.injected)
    return {
        "faults": sum(injected.values()), "faults_by_kind": injected,
        "faults_planned": plan.planned,
        "steps": summary["steps"], "lost": summary.get("skipped_steps", 0),
        "repeated": summary.get("repeated_steps", 0),
        "rollbacks": injector.rollbacks_done + summary.get("rollbacks", 0),
        "quarantines": len(injector.quarantined), "quarantined": sorted(injector.quarantined),
        "quarantine_reasons": sorted(set(injector.quarantined.values())),
        "bad_replicas": injector.bad, "bad_lost": injector.bad_lost,
        "stalled_s": round(stalled_seconds(injector.advances), 2),
        "stalled_by_cause": stall_causes(injector.advances, injector.events),
        "join_to_training_s": _spread(join_seconds(summary.get("replica_timelines", {}))),
        "replicas_at_end": summary["replicas"] - summary["leaving_replicas"],
        "expected_replicas": plan.nodes_at_end,
        "replicas_consistent": summary["replicas_consistent"],
        "hard_losses_seen": summary["hard_losses"], "nodes_joined": summary["nodes_joined"],
        "samples": summary["samples"], "final_loss": summary["final_loss"],
        "wall_s": round(wall_s, 1), "harness_errors": injector.errors[-5:],
    }


def _spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "median": xs[len(xs) // 2] if xs else None,
            "max": xs[-1] if xs else None}


# =========================================================================== command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="long",
                        help="long: 52 faults over ~5 min; short: 7 faults, ~2 min")
    parser.add_argument("--seed", type=int, default=None, help="override the schedule's seed")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="bound on every wait of the harness")
    parser.add_argument("--config", metavar="FILE", help="TrainConfig file (TOML or JSON)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=None,
                        help="override a TrainConfig setting (default: a small model)")
    parser.add_argument("--out", default="runs/bench-chaos", metavar="DIR",
                        help="where the chaos trace and the job's run go")


def main(args: argparse.Namespace) -> int:
    from moshray.jobs.config import ConfigError, load_config, parse_set

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    started = time.monotonic()

    def log_fn(*a):
        print(f"[{time.monotonic() - started:6.1f} s]", *a, file=sys.stderr, flush=True)

    try:
        if not args.timeout > 0:
            raise ValueError(f"--timeout must be > 0, got {args.timeout}")
        load_config(args.config, parse_set(list(DEFAULT_SET) + list(args.set or [])))
        draw_plan(SCHEDULES[args.schedule], args.seed)
    except (ValueError, ConfigError) as exc:
        print(f"moshray bench chaos: {exc}", file=sys.stderr)
        return 2
    fig = run(args, log_fn)
    print(json.dumps(fig), flush=True)
    failures = invariant_failures(fig)
    if failures:
        print(f"moshray bench chaos: invariant failed: {'; '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module("moshray.jobs.bench.chaos"))
