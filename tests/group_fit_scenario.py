"""A user's script training its own loop as replica groups (``cluster.replica = "node"``)
through ``moshray.fit`` on the embedded cluster, for tests/test_group_fit.py: ``python
tests/group_fit_scenario.py MODE RUN_DIR`` prints the summary as one JSON line."""

from __future__ import annotations

import json
import sys

import torch

import moshray


def batch(step: int):
    """The global batch of ``step``: 24 rows (they divide among 1 or 2 groups of 2 ranks)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(24, 8, generator=g)
    return x, (x[:, :4].sum(dim=1) > x[:, 4:].sum(dim=1)).long()


def loop(session):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = session.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), shard=True)
    for x, y in session.batches():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        session.report({"loss": loss})


if __name__ == "__main__":
    mode, run_dir = sys.argv[1], sys.argv[2]
    result = moshray.fit(loop, moshray.data.by_step(batch),
                         config={"cluster": {"replica": "node", "group_ranks": 2},
                                 "training": {"local_steps": 2}},
                         mode=mode, max_steps=8, local_nodes=2, max_nodes=2, min_nodes=2,
                         run_dir=run_dir)
    print(json.dumps(result.summary))
