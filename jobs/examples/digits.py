"""Handwritten digits, trained elastically through a spot notice and a hard kill.

    python -m moshray.jobs.examples.digits --json              # embedded cluster
    ray job submit -- python -m moshray.jobs.examples.digits --json   # a real one

A small MLP on scikit-learn's ``load_digits`` (1,797 real 8x8 images shipped with the
package: no download), written against the public API only. On the embedded cluster a
seeded schedule gives the run a preemption with notice and a hard kill (SIGKILL of a
raylet), each followed by a replacement node; ``--no-faults`` runs without them. A
quarter of the images is held out; the last stdout line is one JSON object with
``test_accuracy``, ``preemptions``, ``replicas_consistent`` and the run's figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import moshray

BATCH = 32
TEST_FRACTION = 0.25


def split(seed: int = 0):
    """``((x_train, y_train), (x_test, y_test))``: pixels scaled to [0, 1], a fixed split."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * TEST_FRACTION)
    x = (x / 16.0).astype(np.float32)
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def digit_batches(shard: int, num_shards: int, seed: int):
    """Every ``num_shards``-th training image from ``shard``, shuffled by ``seed``."""
    (x, y), _ = split()
    idx = np.arange(shard, len(x), num_shards)
    np.random.default_rng(seed).shuffle(idx)
    for i in range(0, len(idx), BATCH):
        b = idx[i : i + BATCH]
        yield torch.from_numpy(x[b]), torch.from_numpy(y[b])


def net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10))


def loop(session) -> None:
    model = net()
    opt = session.prepare(model, torch.optim.Adam(model.parameters(), lr=2e-3))
    for x, y in session.batches():
        opt.step(torch.nn.functional.cross_entropy(model(x), y))


def accuracy(model_state: dict) -> float:
    model = net()
    model.load_state_dict(model_state)
    _, (x, y) = split()
    with torch.no_grad():
        predicted = model(torch.from_numpy(x)).argmax(dim=1).numpy()
    return float((predicted == y).mean())


def fault_trace(path: Path) -> Path:
    """Three nodes; node1 is preempted with a notice at 20 s (node3 replaces it at 26 s),
    node2 is SIGKILLed at 34 s (node4 replaces it at 40 s)."""
    path.write_text("0,add,node0\n0,add,node1\n0,add,node2\n20000,remove,node1\n"
                    "26000,add,node3\n34000,kill,node2\n40000,add,node4\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    parser.add_argument("--max-seconds", type=float, default=70.0)
    parser.add_argument("--no-faults", action="store_true", help="no notice, no kill")
    parser.add_argument("--metrics-port", type=int, default=9450, help="0: any free port")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trace = "off" if args.no_faults else str(fault_trace(Path(tmp) / "trace.csv"))
        result = moshray.fit(
            loop, moshray.data.from_fn(digit_batches, num_shards=8),
            config={"training": {"target_batch_size": 128, "round_timeout_s": 5.0},
                    "cluster": {"notice_s": 3.0, "time_scale": 1.0}},
            local_nodes=3, max_nodes=3, max_seconds=args.max_seconds, trace=trace,
            json=args.json, run_dir=str(Path(tmp) / "run"), metrics_port=args.metrics_port)
    s = result.summary
    figures = {"test_accuracy": accuracy(result.model_state) if result.state else None,
               "preemptions": s["preemptions"], "hard_losses": s["hard_losses"],
               "notices": s["notices"], "replicas": s["replicas"],
               "replicas_consistent": s["replicas_consistent"], "steps": s["steps"],
               "lost_steps": s["lost_steps"], "rollbacks": s["rollbacks"],
               "samples_per_s": round(s["samples_per_s"], 1),
               "final_loss": s["final_loss"]}
    if args.json:
        print(json.dumps(figures))
    else:
        print(", ".join(f"{k} {v}" for k, v in figures.items()))
    return 0 if figures["test_accuracy"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
