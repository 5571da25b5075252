"""Averaging over shaped links between separate hosts (``LocalCluster(hosts="netns")``), in
a process of its own (``python tests/link_scenarios.py NAME DIR``; the last stdout line is a
JSON object of figures), as ``netns_scenarios.py`` does for the training job.

An ``AveragingPeer`` on each of three spot nodes; the driver plans each step with a
``Membership`` as the Coordinator does and passes each peer's measured throughput back as
its heartbeat would (``shares.py``), so the plan's shares follow the links.

- ``shares``: every link at ``FAST_MBIT``, one node's at a tenth of that; asserts the slow
  node's share falls below every fast node's, every step completes (no failed owner, no
  partial contribution) within its deadlines, and the values are the exact average.
- ``measure``: step time of the swarm without and with the slow link, shares on and off
  (a figure, not a test: ``python tests/link_scenarios.py measure /tmp/links``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

FAST_MBIT = 200.0
SLOW_MBIT = 20.0
NUMEL = 1 << 20  # 4 MiB of float32: parts over INLINE_MAX_BYTES travel by object ref
CAP_S = 30.0  # the fixed round_timeout_s the adaptive deadline is capped at
SLOTS = (0, 1, 2)
SLOW_SLOT = 2


def _swarm(cluster):
    """One AveragingPeer per spot node; their ``Membership`` and handles."""
    import ray

    from moshray.cluster.collective.peer import AveragingPeer
    from moshray.cluster.coordinator.membership import Membership, MembershipConfig
    from moshray.cluster.messages import PeerInfo

    membership = Membership(MembershipConfig(max_group=8))
    peers = {}
    for slot in SLOTS:
        pid = f"node{slot}"
        peers[pid] = AveragingPeer.options(num_cpus=0, resources={f"slot-{slot}": 0.01}).remote(pid)
    nodes = dict(zip(peers, ray.get([p.node_id.remote() for p in peers.values()], timeout=120)))
    for slot, pid in zip(SLOTS, peers):
        assert nodes[pid] == cluster.node_id(slot), (pid, nodes[pid])
        membership.register(PeerInfo(pid, peers[pid], node_id=nodes[pid]), now=0.0)
    return membership, peers


def _steps(membership, peers, n: int, shares: bool, now: list[float]) -> list[dict]:
    """``n`` averaging steps; each step's wall time, shares and reports."""
    import ray

    from moshray.cluster.collective.averager import FINAL_FRACTION
    from moshray.cluster.collective.peer import synthetic

    stride = 4099
    index = {pid: i for i, pid in enumerate(peers)}
    expected = np.mean([synthetic(NUMEL, i)[::stride] for i in index.values()], axis=0)
    ray.get([p.prepare_synthetic.remote(NUMEL, index[pid]) for pid, p in peers.items()],
            timeout=120)
    out = []
    for _ in range(n):
        plan = membership.plan(now=now[0])
        t0 = time.perf_counter()
        got = ray.get([p.all_reduce_synthetic.remote(NUMEL, index[pid], 1.0, plan, CAP_S,
                                                     stride)
                       for pid, p in peers.items()], timeout=CAP_S * 4)
        wall = time.perf_counter() - t0
        for values, report in got:
            np.testing.assert_allclose(values, expected, rtol=1e-5, atol=1e-5)
            assert report.complete, report
            # nothing waited past its deadlines (each round: at most 1.25 x its limit)
            assert report.seconds <= FINAL_FRACTION * CAP_S * len(plan.grid.rounds), report
        now[0] += 1.0
        if shares:
            for pid, value in zip(peers, ray.get([p.throughput.remote() for p in peers.values()],
                                                 timeout=60)):
                membership.heartbeat(pid, now=now[0], throughput=value)
        else:
            for pid in peers:
                membership.heartbeat(pid, now=now[0])
        out.append({"wall_s": wall, "shares": dict(plan.shares),
                    "seconds": {r.peer: r.seconds for _, r in got}})
    return out


def _cluster():
    from moshray.jobs.local.cluster import LocalCluster, LocalClusterConfig

    return LocalCluster(LocalClusterConfig(spot_nodes=len(SLOTS), hosts="netns",
                                           cpus_per_node=1, head_cpus=0,
                                           object_store_bytes=100 * 1024 * 1024))


def shares(tmp_path: Path) -> dict:
    import ray

    started = time.monotonic()
    cluster = _cluster()
    try:
        for slot in SLOTS:
            cluster.shape(slot, SLOW_MBIT if slot == SLOW_SLOT else FAST_MBIT)
        cluster.connect()
        membership, peers = _swarm(cluster)
        steps = _steps(membership, peers, 6, shares=True, now=[0.0])
        ray.shutdown()
    finally:
        cluster.shutdown()
    slow = f"node{SLOW_SLOT}"
    last = steps[-1]["shares"]
    assert last[slow] < min(v for p, v in last.items() if p != slow), last
    return {"last_shares": last, "step_wall_s": [round(s["wall_s"], 2) for s in steps],
            "elapsed_s": round(time.monotonic() - started, 1)}


def measure(tmp_path: Path) -> dict:
    """Median step time (the last 6 of 8 steps) unshaped-equal links vs one slow link,
    shares on and off; a fresh swarm for each (its meters start empty)."""
    import ray

    cluster = _cluster()
    figures = {}
    try:
        cluster.connect()
        for label, slow, use_shares in (("equal_links", False, False),
                                        ("slow_link_shares_off", True, False),
                                        ("slow_link_shares_on", True, True)):
            for slot in SLOTS:
                cluster.shape(slot, SLOW_MBIT if slow and slot == SLOW_SLOT else FAST_MBIT)
            membership, peers = _swarm(cluster)
            steps = _steps(membership, peers, 8, shares=use_shares, now=[0.0])
            walls = sorted(s["wall_s"] for s in steps[2:])
            figures[label] = {"median_step_s": round(walls[len(walls) // 2], 3),
                              "last_shares": steps[-1]["shares"]}
            for p in peers.values():
                ray.kill(p)
        ray.shutdown()
    finally:
        cluster.shutdown()
    return figures


SCENARIOS = {"shares": shares, "measure": measure}

if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]](Path(sys.argv[2]))
    print(json.dumps(result), flush=True)
