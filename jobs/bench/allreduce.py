"""`moshray bench allreduce`: Moshpit All-Reduce versus torch.distributed gloo, one run.

Starts an embedded local cluster with one spot node per peer (all on 127.0.0.1). On each
node runs an ``AveragingPeer`` (moshray) and a ``GlooPeer`` (torch.distributed, gloo backend
over loopback TCP: the physical reference, a raw ring with no object store). Both average
the same deterministic vectors with the same weights; each repetition is timed inside the
actors (from the start of the collective until the peer holds the result; the slowest peer
counts) and medians are printed. With ``--kill-one`` a further moshray round runs in which
one peer's process exits mid-round (``die_mid_round``: after the others' calls to it have
succeeded, so only probing or a deadline can reveal it), and the survivors' time is reported.
The moshray peers sign and check every contribution and result with one job key, as a
training job's replicas do (``auth.py``); ``--no-auth`` runs them unsigned, to see what
authentication costs.

With ``--json`` the last line is one JSON object: peers, size_mb, compression, moshray_s,
gloo_s, ratio_vs_gloo (gloo_s / moshray_s, higher is better), auth (whether the peers signed),
max_rel_error, max_abs_error against the codec's documented error_bound (within_bound), the
1-minute load average, the slowest peer's phases (``auth``: seconds spent computing and
checking tags), and with --kill-one kill_one_s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from moshray.cluster.collective.codecs import codec_names, max_abs_error_bound
from moshray.jobs.bench.results import add_results_argument, save_result
from moshray.jobs.local.cluster import LocalCluster, LocalClusterConfig, free_ports, pin_loopback


def expected_sample(numel: int, weights: list[float], stride: int) -> np.ndarray:
    from moshray.cluster.collective.peer import synthetic

    idx = np.arange(0, numel, stride)
    total = sum(weights)
    acc = np.zeros(idx.size, dtype=np.float64)
    for i, w in enumerate(weights):
        acc += w * synthetic(numel, i)[idx]
    return acc / total


def _gloo_actor_class():
    import ray

    @ray.remote
    class GlooPeer:
        """One torch.distributed gloo rank (the baseline)."""

        def setup(self, rank: int, world: int, port: int) -> None:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
            )

        def run(self, numel: int, rank: int, weight: float, total: float, reps: int,
                stride: int):
            import torch
            import torch.distributed as dist

            from moshray.cluster.collective.peer import synthetic

            data = torch.from_numpy(synthetic(numel, rank))
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                x = data * weight  # weighted average = sum(w x) / sum(w)
                dist.all_reduce(x)
                x /= total
                times.append(time.perf_counter() - t0)
            return times, x.numpy()[::stride].copy()

        def close(self) -> None:
            import torch.distributed as dist

            dist.destroy_process_group()

    return GlooPeer


def run(args: argparse.Namespace) -> dict:
    pin_loopback()
    import ray

    from moshray.cluster.collective.auth import new_job_key
    from moshray.cluster.collective.peer import AveragingPeer
    from moshray.cluster.coordinator.membership import Membership, MembershipConfig
    from moshray.cluster.messages import PeerInfo

    numel = int(args.size_mb * 1024 * 1024 // 4)
    stride = max(numel // 20000, 1)
    store = max(200 * 1024 * 1024, int(args.size_mb * 1024 * 1024 * 6))
    weights = [1.0 + i for i in range(args.peers)]
    config = LocalClusterConfig(spot_nodes=args.peers, cpus_per_node=2,
                                object_store_bytes=store)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    with LocalCluster(config) as cluster:
        cluster.connect()
        where = [{"num_cpus": 0, "resources": {f"slot-{i}": 0.01}} for i in range(args.peers)]
        key = None if args.no_auth else new_job_key()  # one job's key, as in training
        peers = {f"peer-{i}": AveragingPeer.options(**where[i]).remote(f"peer-{i}", key)
                 for i in range(args.peers)}
        ray.get([p.node_id.remote() for p in peers.values()], timeout=120)
        membership = Membership(MembershipConfig(compression=args.compression))
        for pid, h in peers.items():
            membership.register(PeerInfo(pid, h), now=0.0)

        # Inputs are generated before the timed rounds (gloo's are too): a peer that starts
        # early would otherwise count the others' generation time as waiting.
        ray.get([h.prepare_synthetic.remote(numel, i) for i, h in enumerate(peers.values())],
                timeout=300)

        def moshray_round(fault_peer: str | None = None):
            plan = membership.plan(now=0.0)
            refs = {
                pid: h.all_reduce_synthetic.remote(
                    numel, i, weights[i], plan, args.timeout, stride,
                    "die_mid_round" if pid == fault_peer else None)
                for i, (pid, h) in enumerate(peers.items())
            }
            live = [p for p in refs if p != fault_peer]
            return dict(zip(live, ray.get([refs[p] for p in live], timeout=args.timeout * 4)))

        moshray_round()  # warm-up: worker imports, object store pages
        moshray_times, moshray_samples, moshray_phases = [], None, []
        for rep in range(args.reps):
            out = moshray_round()
            seconds = max(r.seconds for _, r in out.values())
            moshray_times.append(seconds)
            moshray_samples = [s for s, _ in out.values()]
            slowest = max(out.values(), key=lambda o: o[1].seconds)[1]
            moshray_phases.append(dict(slowest.phases))
            log(f"moshray rep {rep}: {seconds:.3f} s  (slowest peer: "
                + ", ".join(f"{k} {v:.3f}" for k, v in slowest.phases) + ")")

        Gloo = _gloo_actor_class()
        env = {"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}}
        gloo = [Gloo.options(runtime_env=env, **where[i]).remote() for i in range(args.peers)]
        port = free_ports(1)[0]
        ray.get([g.setup.remote(i, args.peers, port) for i, g in enumerate(gloo)], timeout=120)
        results = ray.get([g.run.remote(numel, i, weights[i], sum(weights), args.reps + 1, stride)
                           for i, g in enumerate(gloo)], timeout=600)
        gloo_times = [max(r[0][k] for r in results) for k in range(1, args.reps + 1)]
        for rep, s in enumerate(gloo_times):
            log(f"gloo    rep {rep}: {s:.3f} s")
        ray.get([g.close.remote() for g in gloo])

        expected = expected_sample(numel, weights, stride)
        scale = float(np.abs(expected).max())
        max_rel = max(float(np.abs(s - expected).max()) / scale for s in moshray_samples)
        gloo_rel = max(float(np.abs(r[1] - expected).max()) / scale for r in results)
        # The codec's documented bound (``Codec.error_bound``) for two encodings, the
        # contributions and the result, taken over the sampled values.
        from moshray.cluster.collective.peer import synthetic

        idx = np.arange(0, numel, stride)
        bound = max(max_abs_error_bound(synthetic(numel, i)[idx], args.compression)
                    for i in range(args.peers))
        bound += max_abs_error_bound(expected.astype(np.float32), args.compression)
        bound += scale * 2.0**-20  # float32 rounding of the weighted sums (codec none: all of it)
        max_abs = max(float(np.abs(s - expected).max()) for s in moshray_samples)

        summary = {
            "peers": args.peers,
            "size_mb": args.size_mb,
            "compression": args.compression,
            "reps": args.reps,
            "auth": not args.no_auth,
            "moshray_s": statistics.median(moshray_times),
            "gloo_s": statistics.median(gloo_times),
            "max_rel_error": max_rel,
            "gloo_max_rel_error": gloo_rel,
            "max_abs_error": max_abs,
            "error_bound": bound,
            "within_bound": max_abs <= bound,
            "load_average": os.getloadavg()[0],
            "moshray_phases_s": {k: statistics.median(p.get(k, 0.0) for p in moshray_phases)
                                 for k in moshray_phases[0]},
        }
        summary["ratio_vs_gloo"] = summary["gloo_s"] / summary["moshray_s"]
        if args.kill_one:
            victim = f"peer-{args.peers - 1}"
            t0 = time.monotonic()
            out = moshray_round(fault_peer=victim)
            summary["kill_one_s"] = max(r.seconds for _, r in out.values())
            summary["kill_one_wall_s"] = time.monotonic() - t0
            summary["kill_one_timeout_s"] = args.timeout
            log(f"kill-one: survivors done in {summary['kill_one_s']:.3f} s "
                f"(round deadline {args.timeout} s)")
    log(
        f"allreduce {args.peers} peers x {args.size_mb} MB ({args.compression}"
        f"{'' if summary['auth'] else ', unsigned'}): "
        f"moshray {summary['moshray_s']:.3f} s, gloo {summary['gloo_s']:.3f} s, "
        f"ratio_vs_gloo {summary['ratio_vs_gloo']:.2f}, max_rel_error {max_rel:.2e}"
    )
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", type=int, default=4,
                        help="peers averaging, one spot node each")
    parser.add_argument("--size-mb", type=float, default=100.0,
                        help="size of each peer's float32 tensor, in MiB")
    parser.add_argument("--compression", choices=codec_names(), default="none",
                        help="wire codec (the registered codecs)")
    parser.add_argument("--reps", type=int, default=5,
                        help="timed rounds of each method (the median is reported)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="moshray round deadline in seconds")
    parser.add_argument("--no-auth", action="store_true",
                        help="moshray peers neither sign nor check their messages (to measure "
                             "what authentication costs; a training job always signs)")
    parser.add_argument("--kill-one", action="store_true",
                        help="also time a round in which one peer dies mid-round")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    add_results_argument(parser)


def main(args: argparse.Namespace) -> int:
    if args.peers < 1 or args.size_mb <= 0 or args.reps < 1:
        print("moshray bench allreduce: --peers, --size-mb and --reps must be positive",
              file=sys.stderr)
        return 2
    summary = run(args)
    save_result("allreduce", args, summary)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module('moshray.jobs.bench.allreduce'))
