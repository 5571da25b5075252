"""A user's script training its own loop as replica groups (``cluster.replica = "node"``)
through ``moshray.fit`` on the embedded cluster, for tests/test_group_fit.py: ``python
tests/group_fit_scenario.py MODE RUN_DIR [CHECKPOINT_URI STEPS NODES]`` prints the summary
as one JSON line (MODE ``bad``: a loop with bad input, ``raise``: a loop that raises,
``machines``: node-local checkpoints on a cluster shown as two machines; the error as
JSON)."""

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


def bad_loop(session):
    """Bad input in every rank: a loss that is not a scalar."""
    model = torch.nn.Linear(8, 2)
    opt = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), state={"n": 0})
    for x, y in session.batches():
        opt.step()



def raising_loop(session):
    """A bug of the user's: the same exception in every rank."""
    model = torch.nn.Linear(8, 2)
    session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in session.batches():
        raise ValueError("my bug")


if __name__ == "__main__":
    mode, run_dir = sys.argv[1], sys.argv[2]
    if mode in ("bad", "raise", "machines"):  # the job ends at once, with one line
        config: dict = {"cluster": {"replica": "node"}}
        if mode == "machines":  # the cluster shows two machines; checkpoints on one's disk
            import moshray.jobs.controller.groups as groups

            groups._addresses = lambda: ["10.0.0.1", "10.0.0.2"]
            config["checkpoint"] = {"uri": run_dir + "/ckpt"}
        try:
            moshray.fit(bad_loop if mode == "bad" else loop if mode == "machines" else
                        raising_loop, moshray.data.by_step(batch), config=config,
                        max_steps=4, local_nodes=2, max_nodes=2, run_dir=run_dir)
        except Exception as exc:  # noqa: BLE001 - what the user sees
            print(json.dumps({"error": str(exc), "type": type(exc).__name__}))
        sys.exit(0)
    nodes, steps, uri = 2, 8, None
    if len(sys.argv) > 3:  # checkpoints under URI: a run of STEPS steps on NODES groups
        uri, steps, nodes = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    result = moshray.fit(loop, moshray.data.by_step(batch),
                         config={"cluster": {"replica": "node", "group_ranks": 2},
                                 "training": {"local_steps": 2},
                                 "checkpoint": {"uri": uri, "every_steps": 2,
                                                "run_id": "resumable"}},
                         mode=mode, max_steps=steps, local_nodes=nodes, max_nodes=nodes,
                         min_nodes=nodes, run_dir=run_dir)
    print(json.dumps(result.summary))

