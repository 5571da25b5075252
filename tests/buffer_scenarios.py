"""A model with BatchNorm trained through ``moshray.fit`` on the embedded cluster, for
tests/test_buffers_cluster.py, in its own process (``python tests/buffer_scenarios.py MODE
TMP_DIR``, MODE a ``training.mode``); prints one JSON line.

Three nodes start; one is hard-killed at 9 s (a loss without notice) and another joins at
13 s. Each replica's data has its own mean and scale, so BatchNorm's running statistics
would drift apart without the per-step average. Right after every global step the loop
logs the digest of its buffers for that epoch (one file per replica, this one machine).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

import moshray


def shifted(shard: int, num_shards: int, seed: int):
    """Batches of 8: x drawn around a mean and scale of the shard's own; y = sum of x."""
    g = torch.Generator().manual_seed(seed * 100 + shard)
    for _ in range(64):
        x = torch.randn(8, 3, generator=g) * (1.0 + shard) + 2.0 * shard
        yield x, x.sum(dim=1, keepdim=True)


def buffer_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for b in model.buffers():
        if b.is_floating_point():
            h.update(b.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def make_loop(log_dir: Path):
    def loop(session):
        torch.manual_seed(session.seed)
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8),
                                    torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = session.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        with open(log_dir / f"{session.peer_id}.txt", "a") as log:
            for x, y in session.batches():
                if opt.step(torch.nn.functional.mse_loss(model(x), y)):  # a global step
                    log.write(f"{session.global_step} {buffer_digest(model)}\n")
                    log.flush()
    return loop


def run(mode: str, tmp: Path) -> dict:
    log_dir = tmp / "buffers"
    log_dir.mkdir()
    trace = tmp / "trace.csv"
    trace.write_text("0,add,node0\n0,add,node1\n0,add,node2\n9000,kill,node1\n"
                     "13000,add,node3\n")
    config = {"training": {"target_batch_size": 32, "round_timeout_s": 4.0,
                           "local_steps": 2}}
    result = moshray.fit(make_loop(log_dir), moshray.data.from_fn(shifted, num_shards=6),
                         config=config, mode=mode, local_nodes=3, max_nodes=3,
                         max_seconds=30, trace=str(trace), time_scale=1.0, json=True,
                         metrics_port=0, run_dir=str(tmp / "run"))
    logged = {f.stem: [line.split() for line in f.read_text().splitlines()]
              for f in sorted(log_dir.iterdir())}
    state = result.state["model"] if result.state else {}
    return {"summary": {k: result.summary.get(k) for k in
                        ("replicas", "replicas_consistent", "steps", "hard_losses",
                         "lost_steps", "repeated_steps", "diverged_steps")},
            "statuses": [{k: s.get(k) for k in ("peer", "epoch", "checksum")}
                         for s in result.statuses],
            "running_var": state["1.running_var"].tolist() if state else None,
            "logged": logged}


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], Path(sys.argv[2])), default=str))
