"""`moshray bench groups`: replica groups on CPU, one JSON line.

On the embedded cluster (4 spot nodes of 2 CPUs, loopback), the example LM trains with the
same global batch, collaborative steps averaged by shard (``step_together``), in three
layouts, each rank one process with one CPU thread:

- ``groups_2x2_fsdp``: 2 groups of 2 ranks (FSDP2 over gloo inside each group), one group
  per node;
- ``groups_2x2_ddp``: the same with DDP inside each group (every rank the whole model);
- ``single_4x1``: 4 groups of 1 rank (``world_size=1``), one per node: the replicas of the
  plain swarm, every one the whole model.

Figures: each layout's step time (median over ``--steps`` timed steps after ``--warmup``;
a step is the compute phase plus the averaging phase, as the driver times them) and what a
rank holds in memory, read on every rank after a gradient phase (``GroupRank.memory``: the
bytes of the parameters, gradients and optimizer state it holds, local parts only; and the
process's peak RSS, which includes torch and Ray). The groups of each layout must end with
bitwise equal unsharded parameters (``consistent``). On a 2-core machine the four rank
processes of every layout share 2 cores, so step times compare the layouts' overheads
(collectives inside a group, averaging rounds across groups), not a speed-up. Exit codes:
0 when every layout ran and stayed consistent, 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import ray

from moshray.actors.replica.group import ReplicaGroup
from moshray.actors.replica.group_spec import NODE_ID_LABEL, GroupConfig, GroupTask, digest
from moshray.actors.replica.group_together import step_together
from moshray.actors.replica.group_averaging import BatchPart
from moshray.jobs.bench.results import add_results_argument, save_result

NODES = 4
LAYOUTS = {  # name -> (groups, ranks per group, parallel inside a group)
    "groups_2x2_fsdp": (2, 2, "fsdp"),
    "groups_2x2_ddp": (2, 2, "ddp"),
    "single_4x1": (4, 1, "fsdp"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=8, help="timed steps of each layout")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--rows", type=int, default=16,
                        help="the global batch (sequences); must divide by 4")
    parser.add_argument("--d-model", type=int, default=256, help="the LM's width")
    parser.add_argument("--layers", type=int, default=4, help="the LM's transformer blocks")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per training window")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="bounds each group start and each phase")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    add_results_argument(parser)


def bad_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with ``args`` (one line), or None."""
    for name in ("steps", "rows", "d_model", "layers", "seq_len"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if args.warmup < 0:
        return "--warmup must be >= 0"
    if args.rows % NODES:
        return f"--rows {args.rows} must divide by {NODES} (2 x 2 and 4 x 1 ranks)"
    if args.d_model % 4:
        return f"--d-model {args.d_model} must divide by 4 (4 heads)"
    return None


def model_config(args: argparse.Namespace) -> dict:
    return {"seq_len": args.seq_len, "d_model": args.d_model, "n_layers": args.layers,
            "n_heads": 4, "d_ff": 4 * args.d_model}


def run_layout(name: str, task: GroupTask, nodes: list[str], args: argparse.Namespace,
               log) -> dict:
    """One layout's figures; every group closed on the way out."""
    count, world, parallel = LAYOUTS[name]
    groups = [ReplicaGroup(GroupConfig(world_size=world, parallel=parallel, name=f"{name}-{i}",
                                       timeout_s=args.timeout_s,
                                       node_labels={NODE_ID_LABEL: nodes[i]}))
              for i in range(count)]
    try:
        for g in groups:
            g.start()
        seconds = []
        for i in range(args.warmup + args.steps):
            result = step_together(groups, task)
            if result.failures:
                raise RuntimeError(f"{name}: step {result.step}: "
                                   f"{'; '.join(f.reason for f in result.failures)}")
            if i >= args.warmup:
                seconds.append(result.grad_seconds + result.average_seconds)
            log(f"{name}: step {result.step} loss {result.loss:.4f} "
                f"{result.grad_seconds + result.average_seconds:.2f} s")
        step = groups[0].step
        ray.get([r.compute_grads.remote(task, step, BatchPart(i, count))
                 for i, g in enumerate(groups) for r in g.ranks], timeout=args.timeout_s)
        memory = ray.get([r.memory.remote() for g in groups for r in g.ranks],
                         timeout=args.timeout_s)
        digests = {digest(g.full_state().values()) for g in groups}
    finally:
        for g in groups:
            g.close()
    return {"groups": count, "ranks_per_group": world, "parallel": parallel,
            "step_s_median": round(statistics.median(seconds), 4),
            "step_s_min": round(min(seconds), 4),
            "rank_held_bytes": max(m.held for m in memory),
            "rank_param_bytes": max(m.params for m in memory),
            "rank_grad_bytes": max(m.grads for m in memory),
            "rank_optimizer_bytes": max(m.optimizer for m in memory),
            "rank_peak_rss_bytes": max(m.peak_rss for m in memory),
            "consistent": len(digests) == 1, "final_loss": round(result.loss, 4)}


def run(args: argparse.Namespace) -> dict:
    from moshray.jobs.examples.lm.tasks import lm_task
    from moshray.jobs.local.cluster import LocalCluster, LocalClusterConfig

    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    config = model_config(args)
    task = lm_task(config, steps=1, rows=args.rows, amp=False)
    params = sum(p.numel() for p in task.build_model().parameters())
    t0 = time.monotonic()
    with LocalCluster(LocalClusterConfig(spot_nodes=NODES, cpus_per_node=2,
                                         head_cpus=1)) as cluster:
        cluster.connect()
        nodes = [cluster.node_id(s) for s in range(NODES)]
        layouts = {name: run_layout(name, task, nodes, args, log) for name in LAYOUTS}
    fsdp, ddp = layouts["groups_2x2_fsdp"], layouts["groups_2x2_ddp"]
    single = layouts["single_4x1"]
    return {
        "model": config, "params": params, "rows": args.rows, "steps": args.steps,
        "warmup": args.warmup, "optimizer": task.optimizer, "layouts": layouts,
        "step_time_2x2_fsdp_over_4x1": round(fsdp["step_s_median"] / single["step_s_median"],
                                             3),
        "held_per_rank_fsdp_over_ddp": round(fsdp["rank_held_bytes"] / ddp["rank_held_bytes"],
                                             3),
        "memory_measured": "bytes of the parameters, gradients and AdamW state each rank "
                           "holds after a gradient phase (local parts; DDP buckets, FSDP "
                           "all-gathers and activations not counted), and peak RSS",
        "consistent": all(v["consistent"] for v in layouts.values()),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def main(args: argparse.Namespace) -> int:
    wrong = bad_arguments(args)
    if wrong:
        print(f"moshray bench groups: {wrong}", file=sys.stderr)
        return 2
    summary = run(args)
    save_result("groups", args, summary)
    if args.json:
        print(json.dumps(summary))
    else:
        print(json.dumps(summary, indent=1))
    return 0 if summary["consistent"] else 1


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module("moshray.jobs.bench.groups"))
