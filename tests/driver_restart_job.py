"""The training job that tests/test_driver_restart.py submits with `ray job submit` twice.

``python driver_restart_job.py PID_FILE CHECKPOINT_URI MAX_STEPS RUN_DIR NAME``: writes this
driver's pid to PID_FILE (the test SIGKILLs it), trains a small regression with
``moshray.fit`` as job NAME on an in-memory data function, and prints one JSON line: the summary's
fields the test checks and the epochs of the step history (``RUN_DIR/summary.json``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import moshray


def pairs(shard: int, num_shards: int, seed: int):
    """Batches of 4 samples of y = x1 + x2."""
    g = torch.Generator().manual_seed(seed * 1000 + shard)
    for _ in range(200):
        x = torch.randn(4, 2, generator=g)
        yield x, x.sum(dim=1, keepdim=True)


def loop(session):
    model = torch.nn.Linear(2, 1)
    opt = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    for x, y in session.batches():
        time.sleep(0.25)  # a step of a real model: the test must catch the run mid-way
        opt.step(torch.nn.functional.mse_loss(model(x), y))


def main(pid_file: str, checkpoint: str, max_steps: int, run_dir: str, name: str) -> None:
    Path(pid_file).write_text(str(os.getpid()))
    result = moshray.fit(
        loop, moshray.data.from_fn(pairs, num_shards=8),
        config={"training": {"target_batch_size": 8, "round_timeout_s": 5.0},
                "checkpoint": {"uri": checkpoint, "every_steps": 5},
                "cluster": {"driver_lease_s": 120.0}},
        max_nodes=2, max_steps=max_steps, metrics_port=0, run_dir=run_dir, name=name)
    s = result.summary
    history = json.loads((Path(run_dir) / "summary.json").read_text())["history"]
    print(json.dumps({"steps": s["steps"], "lost_steps": s["lost_steps"],
                      "rollbacks": s["rollbacks"], "replicas": s["replicas"],
                      "replicas_consistent": s["replicas_consistent"],
                      "epochs": [row[0] for row in history]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
