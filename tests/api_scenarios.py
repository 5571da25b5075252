"""Runs of the public API for tests/test_api_cluster.py, each in its own process (a user's
script: ``python tests/api_scenarios.py SCENARIO TMP_DIR``); prints one JSON line.

- ``extra-state``: a user model with extra state (a step counter and an EMA copy of the
  weights) and a data function that yields sample ids; a third node joins mid-run; then a
  second run resumes from the first one's checkpoint.
- ``bad-loss``: a loop whose loss is not a scalar (its data a torch ``Dataset`` of the
  script's own, which travels to the replicas and is read there through a ``DataLoader``).
- ``quickstart``: the README's example (jobs/examples/quickstart.py), 15 s.
- ``dataset``: data given as a Ray Dataset (made once the driver is connected).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import moshray


def sample_ids(shard: int, num_shards: int, seed: int):
    """Batches of 4 sample ids (x = features of the id, y = their sum); ids carry the data
    epoch's seed: ``seed * 10_000 + index``."""
    g = torch.Generator().manual_seed(seed * 100 + shard)
    index = torch.arange(shard, 96, num_shards)
    index = index[torch.randperm(len(index), generator=g)]
    for i in range(0, len(index), 4):
        ids = index[i : i + 4] + seed * 10_000
        x = torch.stack([ids.float().sin(), ids.float().cos()], dim=1)
        yield x, x.sum(dim=1, keepdim=True), ids


class SampleIds(torch.utils.data.Dataset):
    """The user's own torch Dataset: sample i is (features of i, their sum, i)."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int):
        x = torch.tensor([float(i)]).sin().repeat(2)
        return x, x.sum(dim=0, keepdim=True), i


def make_loop(seen_dir: Path, run: str):
    """A loop that logs the ids it trains on (one file per replica, this one machine) and
    keeps a step counter and an EMA model as extra state, updated at each global step."""
    def loop(session):
        model = torch.nn.Linear(2, 1)
        ema = torch.nn.Linear(2, 1)
        extra = {"steps": 0, "ema": ema}
        opt = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05), extra)
        with open(seen_dir / f"{run}-{session.peer_id}.txt", "a") as log:
            for x, y, ids in session.batches():
                log.write(" ".join(str(int(i)) for i in ids) + "\n")
                log.flush()
                if opt.step(torch.nn.functional.mse_loss(model(x), y)):  # a global step
                    extra["steps"] += 1
                    with torch.no_grad():
                        for e, p in zip(ema.parameters(), model.parameters()):
                            e.mul_(0.9).add_(p, alpha=0.1)
    return loop


def _statuses(result) -> list[dict]:
    return [{k: r.get(k) for k in ("peer", "epoch", "extra", "extra_digest", "data_position",
                                   "shards_opened")} for r in result.statuses]


def extra_state(tmp: Path) -> dict:
    seen_dir = tmp / "seen"
    seen_dir.mkdir()
    trace = tmp / "trace.csv"
    trace.write_text("0,add,node0\n0,add,node1\n12000,add,node2\n")  # node2 joins at 12 s
    settings = dict(config={"training": {"target_batch_size": 16, "round_timeout_s": 5.0}},
                    local_nodes=2, max_nodes=3, time_scale=1.0, json=True, metrics_port=0,
                    checkpoint_uri=str(tmp / "ckpt"), checkpoint_every=5,
                    run_dir=str(tmp / "run"), name="extra-state")  # the name resumes it
    data = moshray.data.from_fn(sample_ids, num_shards=6)
    first = moshray.fit(make_loop(seen_dir, "a"), data, max_seconds=30, trace=str(trace),
                        **settings)
    second = moshray.fit(make_loop(seen_dir, "b"), data, max_seconds=15, trace="off",
                         **settings)
    seen = [int(i) for f in sorted(seen_dir.iterdir()) for i in f.read_text().split()]
    return {"first": {"summary": first.summary, "statuses": _statuses(first),
                      "state_steps": first.state["extra"]["steps"]},
            "second": {"summary": second.summary, "statuses": _statuses(second)},
            "seen": seen}


def bad_loss(tmp: Path) -> dict:
    def loop(session):
        model = torch.nn.Linear(2, 3)
        opt = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, _, _ in session.batches():
            opt.step(model(x) - 1.0)  # not reduced to a scalar

    try:
        moshray.fit(loop, SampleIds(), batch_size=4, local_nodes=2, max_nodes=2,
                    max_seconds=60, run_dir=str(tmp / "run"), metrics_port=0)
    except moshray.UserError as exc:
        return {"error": str(exc), "type": type(exc).__name__}
    return {"error": None}


def quickstart(tmp: Path) -> dict:
    from moshray.jobs.examples import quickstart as q

    result = moshray.fit(q.loop, moshray.data.from_fn(q.batches), max_nodes=2, max_seconds=15,
                         run_dir=str(tmp / "run"), json=True, metrics_port=0)
    return result.summary


def dataset(tmp: Path) -> dict:
    import numpy as np

    def make():
        import ray.data

        x = np.random.default_rng(0).standard_normal((512, 2)).astype(np.float32)
        return ray.data.from_numpy(x).map_batches(
            lambda b: {"x": b["data"], "y": b["data"].sum(axis=1, keepdims=True)})

    def loop(session):
        model = torch.nn.Linear(2, 1)
        opt = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for batch in session.batches():  # {"x": (n, 2), "y": (n, 1)} tensors
            opt.step(torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]))

    result = moshray.fit(loop, make, max_nodes=2, max_seconds=15, batch_size=16, json=True,
                         metrics_port=0,
                         config={"training": {"target_batch_size": 32}},
                         run_dir=str(tmp / "run"))
    return {"summary": result.summary, "statuses": _statuses(result)}


if __name__ == "__main__":
    scenario, tmp_dir = sys.argv[1], Path(sys.argv[2])
    run = {"extra-state": extra_state, "bad-loss": bad_loss, "quickstart": quickstart,
           "dataset": dataset}[scenario]
    print(json.dumps(run(tmp_dir), default=str))
