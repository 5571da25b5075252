"""`moshray bench moe`: a DMoE layer with remote experts versus the same experts in-process.

Starts an embedded local cluster (head + ``--nodes`` spot raylets on 127.0.0.1) and one
ExpertActor per spot node, each hosting ``experts / nodes`` experts of one ``--grid`` layer
(supervised from the head node, registered with a Coordinator). Then, in one run and on the
same batch of ``--tokens`` rows, it times training steps (forward + backward, which also
updates the experts) of a ``RemoteMixtureOfExperts``:

1. local: the same experts (same initial weights) computed in this process (``LocalExpertBackend``);
2. remote: the experts on the spot nodes (``RayExpertBackend``, one call per host);
3. with failure: one expert node is killed without notice (raylet SIGKILL) right before the
   steps; the layer masks its experts and routes around them while the supervisor re-spawns
   them elsewhere.

Prints tokens/s of each; ``ratio`` = remote / local (target >= 0.5). With ``--json`` the last
stdout line is one JSON object (also written to ``<out>/moe.json``, with a bar plot
``<out>/moe.png``).
"""

from __future__ import annotations

from moshray.jobs.bench.results import add_results_argument, save_result
import argparse
import json
import math
import sys
import time
from pathlib import Path

from moshray.jobs.local.cluster import LocalCluster, LocalClusterConfig, pin_loopback


class BenchError(ValueError):
    """Bad arguments (exit 2, one line)."""


def _grid(text: str) -> tuple[int, ...]:
    try:
        grid = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--grid must look like 4x4, got {text!r}") from None
    if not grid or any(m < 1 for m in grid):
        raise argparse.ArgumentTypeError(f"--grid sizes must be positive, got {text!r}")
    return grid


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grid", type=_grid, default=(4, 4), help="expert grid (4x4 = 16)")
    parser.add_argument("--tokens", type=int, default=512, help="rows per batch")
    parser.add_argument("--k", type=int, default=4, help="experts per token")
    parser.add_argument("--d-model", type=int, default=256, help="expert input/output width")
    parser.add_argument("--d-hidden", type=int, default=1024, help="expert hidden width")
    parser.add_argument("--nodes", type=int, default=4, help="spot nodes (one expert host each)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode")
    parser.add_argument("--timeout-after-k-min", type=float, default=1.0, metavar="S",
                        help="seconds a batch waits for its slower experts once k answered")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of the in-process baseline (0 = torch's default, "
                             "all cores); each expert actor uses 1")
    parser.add_argument("--out", default="runs/bench-moe", metavar="DIR",
                        help="where moe.json and moe.png go")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    add_results_argument(parser)


def _check(args: argparse.Namespace) -> None:
    experts = math.prod(args.grid)
    for name in ("tokens", "k", "d_model", "d_hidden", "nodes", "steps"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be a positive integer")
    if args.warmup < 0 or args.threads < 0:
        raise BenchError("--warmup and --threads must be >= 0")
    if args.k > experts:
        raise BenchError(f"--k {args.k} exceeds the grid's {experts} experts")
    if experts % args.nodes:
        raise BenchError(f"--nodes {args.nodes} must divide the {experts} experts evenly")
    if args.nodes < 2:
        raise BenchError("--nodes must be >= 2 (one node is killed in the failure run)")


def _time_steps(moe, x, target, steps: int, warmup: int, log) -> tuple[float, float, list]:
    """(tokens/s of forward+backward, tokens/s of the forward alone, per-step stats)."""
    import torch

    for _ in range(warmup):
        x.grad = None
        (moe(x) * target).sum().backward()
    fwd_s = total_s = 0.0
    stats = []
    for _ in range(steps):
        x.grad = None
        t0 = time.perf_counter()
        y = moe(x)
        t1 = time.perf_counter()
        (y * target).sum().backward()
        t2 = time.perf_counter()
        fwd_s += t1 - t0
        total_s += t2 - t0
        s = moe.last_stats
        stats.append({k: s.get(k) for k in ("calls", "answered", "failed", "late",
                                             "backward_failed", "backward_late")})
        if s.get("failed") or s.get("late") or s.get("backward_failed"):
            log(f"  step masked {s.get('failed', 0)} failed, {s.get('late', 0)} late host "
                f"calls ({t2 - t0:.2f} s)")
    assert torch.isfinite(x.grad).all()
    rows = x.shape[0]
    return rows * steps / total_s, rows * steps / fwd_s, stats


def run(args: argparse.Namespace) -> dict:
    pin_loopback()
    import ray
    import torch

    from moshray.actors.moe.expert_config import ExpertSetConfig, ExpertSpec
    from moshray.actors.moe.expert_supervisor import spawn_expert_set
    from moshray.actors.moe import RemoteMixtureOfExperts
    from moshray.actors.moe.backends import LocalExpertBackend, RayExpertBackend
    from moshray.actors.moe.config import MoEConfig
    import moshray.cluster.coordinator.actor as coordinator_mod
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    if args.threads:
        torch.set_num_threads(args.threads)
    experts = math.prod(args.grid)
    spec = ExpertSpec(d_model=args.d_model, d_hidden=args.d_hidden, lr=1e-4)
    config = ExpertSetConfig(layers=("bench",), grid=args.grid, spec=spec,
                             experts_per_host=experts // args.nodes, snapshot_interval_s=3600.0,
                             num_cpus=1.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.d_model, generator=g).requires_grad_(True)
    target = torch.randn(args.tokens, args.d_model, generator=g)
    cluster_config = LocalClusterConfig(spot_nodes=args.nodes, cpus_per_node=2)
    with LocalCluster(cluster_config) as cluster:
        cluster.connect()
        coordinator = coordinator_mod.get_or_create(name="moshray-coordinator-bench-moe")
        supervisor = None
        try:
            log(f"starting {args.nodes} expert hosts x {experts // args.nodes} experts ...")
            supervisor = spawn_expert_set(config, coordinator, timeout_s=300)

            def layer(backend):
                torch.manual_seed(1)  # the same gate for every mode
                cfg = MoEConfig("bench", args.grid, args.d_model, k=args.k,
                                timeout_after_k_min_s=args.timeout_after_k_min)
                return RemoteMixtureOfExperts(cfg, backend)

            local_tps, local_fwd, _ = _time_steps(layer(LocalExpertBackend.from_config(config)),
                                                  x, target, args.steps, args.warmup, log)
            log(f"local : {local_tps:9.0f} tokens/s (forward alone {local_fwd:.0f})")
            remote = layer(RayExpertBackend(coordinator))
            remote_tps, remote_fwd, _ = _time_steps(remote, x, target, args.steps,
                                                    args.warmup, log)
            log(f"remote: {remote_tps:9.0f} tokens/s (forward alone {remote_fwd:.0f}), "
                f"ratio {remote_tps / local_tps:.2f}")

            hosts = ray.get(supervisor.hosts.remote(), timeout=60)
            victim_host, victim = sorted(hosts.items())[-1]
            slot = next(s for s in cluster.live_slots()
                        if cluster.node_id(s) == victim["node_id"])
            log(f"killing spot node {slot} (expert host {victim_host}: "
                f"{len(victim['uids'])} of {experts} experts)")
            cluster.remove_node(slot, hard=True)
            fail_tps, fail_fwd, fail_stats = _time_steps(remote, x, target, args.steps, 0, log)
            log(f"with one node killed: {fail_tps:9.0f} tokens/s (forward alone {fail_fwd:.0f})")
            events = ray.get(supervisor.events.remote(), timeout=60)
        finally:
            if supervisor is not None:
                try:
                    ray.get(supervisor.stop.remote(), timeout=60)
                except ray.exceptions.RayError:
                    pass
                ray.kill(supervisor)
            ray.kill(coordinator)
    return {
        "tokens": args.tokens, "experts": experts, "grid": list(args.grid), "k": args.k,
        "d_model": args.d_model, "d_hidden": args.d_hidden, "nodes": args.nodes,
        "steps": args.steps, "driver_threads": torch.get_num_threads(), "mode": "forward+backward (experts update themselves)",
        "local_tokens_per_s": local_tps, "remote_tokens_per_s": remote_tps,
        "ratio": remote_tps / local_tps, "with_failure_tokens_per_s": fail_tps,
        "local_forward_tokens_per_s": local_fwd, "remote_forward_tokens_per_s": remote_fwd,
        "with_failure_forward_tokens_per_s": fail_fwd,
        "with_failure_masked_calls": sum((s["failed"] or 0) + (s["late"] or 0)
                                         for s in fail_stats),
        "killed_experts": len(victim["uids"]),
        "respawn_events": [e for e in events if e[2] in ("lost", "respawned")],
    }


def write_outputs(summary: dict, out_dir: str, log) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "moe.json"
    from moshray.jobs import plots

    png = plots.plot_bars(
        plots.plot_path_for(json_path), ["in-process", "remote", "remote, 1 node killed"],
        [summary["local_tokens_per_s"], summary["remote_tokens_per_s"],
         summary["with_failure_tokens_per_s"]],
        ylabel="tokens/s (forward+backward)",
        title=f"DMoE layer, {summary['experts']} experts, k={summary['k']}, "
              f"{summary['tokens']} tokens/batch; ratio {summary['ratio']:.2f}")
    summary = summary | {"json": str(json_path), "plot": str(png)}
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    log(f"wrote {json_path} and {png}")
    return summary


def main(args: argparse.Namespace) -> int:
    try:
        _check(args)
    except BenchError as exc:
        print(f"moshray bench moe: {exc}", file=sys.stderr)
        return 2
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    summary = write_outputs(run(args), args.out, log)
    save_result("moe", args, summary)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module("moshray.jobs.bench.moe"))
