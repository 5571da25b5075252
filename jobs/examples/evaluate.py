"""Evaluation every N global steps on held-out data, once per swarm (on the leader).

    python -m moshray.jobs.examples.evaluate            # 2 epochs on the embedded cluster

Every replica trains and reports its training loss; after every ``EVAL_EVERY``-th global
step the leader (``session.is_leader``: one live replica at a time, the next one takes
over when it leaves) computes the loss and accuracy on a held-out set that no training
shard contains and reports them as ``val_loss`` / ``val_accuracy``. They reach the run
summary (``result.summary["reported"]``), the Prometheus gauge ``moshray_reported``,
TensorBoard (``tensorboard --logdir runs/<name>/tensorboard``) and ``on_report`` (here: a
print; ``mlflow.log_metrics`` or ``wandb.log`` fit there the same way).
"""

from __future__ import annotations

import torch

import moshray

EVAL_EVERY = 5  # global steps between evaluations
FEATURES = 16


def _labelled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x, (x[:, : FEATURES // 2].sum(dim=1) > x[:, FEATURES // 2 :].sum(dim=1)).long()


def batches(shard: int, num_shards: int, seed: int):
    """Training data: 20 batches of 32 samples per shard (seeds >= 0)."""
    g = torch.Generator().manual_seed(seed * 1000 + shard)
    for x in torch.randn(20, 32, FEATURES, generator=g):
        yield _labelled(x)


def held_out() -> tuple[torch.Tensor, torch.Tensor]:
    """512 samples from a generator seed no training shard uses (those are seed * 1000 +
    shard, far below it)."""
    g = torch.Generator().manual_seed(2**31 - 1)
    return _labelled(torch.randn(512, FEATURES, generator=g))


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    model.eval()
    logits = model(x)
    model.train()
    return {"val_loss": torch.nn.functional.cross_entropy(logits, y),
            "val_accuracy": (logits.argmax(dim=1) == y).float().mean()}


def loop(session) -> None:
    torch.manual_seed(session.seed)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 2))
    opt = session.prepare(model, torch.optim.Adam(model.parameters(), lr=3e-3))
    x_val, y_val = (t.to(session.device) for t in held_out())
    for x, y in session.batches():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        stepped = opt.step()  # True when a global step was applied
        opt.zero_grad()
        session.report({"loss": loss})
        if stepped and session.global_step % EVAL_EVERY == 0 and session.is_leader:
            session.report(evaluate(model, x_val, y_val))


def show(step: int, metrics: dict) -> None:
    """``fit``'s ``on_report`` hook (on the driver): print each evaluation."""
    if "val_loss" in metrics:
        print(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())))


def main(**settings) -> moshray.Result:
    """Two epochs on two nodes; ``settings``: more of ``fit``'s keyword arguments."""
    settings = {"max_epochs": 2, "max_nodes": 2, **settings}
    result = moshray.fit(loop, moshray.data.from_fn(batches, num_shards=8),
                         config={"training": {"target_batch_size": 128}}, on_report=show,
                         **settings)
    reported = result.summary["reported"]
    print(f"{result.summary['steps']} global steps; held-out accuracy "
          f"{reported['val_accuracy']['value']:.3f} at step {reported['val_accuracy']['step']}")
    return result


if __name__ == "__main__":
    main()
