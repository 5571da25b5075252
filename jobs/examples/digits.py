"""Handwritten digits, trained elastically through a spot notice and a hard kill.

    python -m moshray.jobs.examples.digits --json              # embedded cluster
    ray job submit -- python -m moshray.jobs.examples.digits --json   # a real one

A small MLP on scikit-learn's ``load_digits`` (1,797 real 8x8 images shipped with the
package: no download), written against the public API only. On the embedded cluster a
seeded schedule gives the run a preemption with notice and a hard kill (SIGKILL of a
raylet), each followed by a replacement node; ``--no-faults`` runs without them. A
quarter of the images is held out; the last stdout line is one JSON object with
``test_accuracy``, ``preemptions``, ``replicas_consistent`` and the run's figures.

scikit-learn is on no ``infra/`` node: on a cluster (``RAY_ADDRESS`` set) whose driver
lacks it, the driver connects with Ray's ``runtime_env`` ``{"pip": ["scikit-learn>=1.3"]}``,
so every replica's worker gets it, and scores the model in a task of that environment. (A
driver that has it is taken to run where the nodes have it too: the same image.)
A job submitted with its own packages (``ray job submit --runtime-env-json '{"pip": [...]}'``)
keeps them instead (Ray merges no two ``pip`` lists): list scikit-learn there.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import moshray

BATCH = 32
TEST_FRACTION = 0.25
# What the replicas need beyond a node's image, installed by Ray per job (runtime_env).
RUNTIME_ENV = {"pip": ["scikit-learn>=1.3"]}
PACKAGE_FIELDS = ("pip", "uv", "conda")


def runtime_env_to_add(job_runtime_env: dict | None, driver_has_sklearn: bool) -> dict | None:
    """The ``runtime_env`` this driver's ``ray.init`` adds: ``RUNTIME_ENV``, unless the
    driver has scikit-learn (its nodes then run the same install) or the submitted job's own
    environment already names packages (Ray refuses to merge two such fields; that list
    must then hold scikit-learn). Pure."""
    if driver_has_sklearn or (job_runtime_env
                              and any(f in job_runtime_env for f in PACKAGE_FIELDS)):
        return None
    return RUNTIME_ENV


def has_sklearn() -> bool:
    return importlib.util.find_spec("sklearn") is not None


def connect(address: str) -> None:
    """Join the cluster at ``address`` with scikit-learn for every worker (``RUNTIME_ENV``)."""
    import ray
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    from moshray.jobs.train import stop_on_sigterm

    submitted = json.loads(os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR, "{}"))
    ray.init(address=address, namespace="moshray", log_to_driver=True,
             runtime_env=runtime_env_to_add(submitted.get("runtime_env"), has_sklearn()))
    stop_on_sigterm()


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


def score(model_state: dict) -> float:
    """``accuracy`` here, or in a Ray task (the job's runtime_env has scikit-learn) when this
    driver has no scikit-learn of its own."""
    if has_sklearn():
        return accuracy(model_state)
    import ray

    return ray.get(ray.remote(num_cpus=0)(accuracy).remote(model_state), timeout=600)


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
    import ray

    address = os.environ.get("RAY_ADDRESS")
    owned = bool(address) and not ray.is_initialized()
    if owned:
        connect(address)
    try:
        return _train(args)
    finally:
        if owned:
            ray.shutdown()


def _train(args) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        trace = "off" if args.no_faults else str(fault_trace(Path(tmp) / "trace.csv"))
        result = moshray.fit(
            loop, moshray.data.from_fn(digit_batches, num_shards=8),
            config={"training": {"target_batch_size": 128, "round_timeout_s": 5.0},
                    "cluster": {"notice_s": 3.0, "time_scale": 1.0}},
            local_nodes=3, max_nodes=3, max_seconds=args.max_seconds, trace=trace,
            json=args.json, run_dir=str(Path(tmp) / "run"), metrics_port=args.metrics_port)
    s = result.summary
    figures = {"test_accuracy": score(result.model_state) if result.state else None,
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
