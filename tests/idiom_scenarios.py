"""Runs of ``moshray.fit`` for tests/test_report.py, each in its own process (a user's
script: ``python tests/idiom_scenarios.py SCENARIO TMP_DIR``); prints one JSON line last.

- ``idiom``: torch's idiom on 2 replicas, micro-batches in turn: fp16 autocast with
  ``torch.amp.GradScaler`` (unscale, the user's clip at 0.5, ``scaler.step(opt)``), bf16
  autocast with the user's clip, and the old ``opt.step(loss)``; the loss reported every
  micro-batch, held-out evaluation every 2nd global step on the leader; no bound given but
  the default (``max_epochs=1``); ``on_report`` collects what the driver saw.
- ``double-backward``: ``loss.backward(); opt.step(loss)``.
- ``leader-loss``: each replica asks ``is_leader`` at every global step and logs the answer;
  the leader raises once at step 4 (its replica is lost and replaced).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import torch

import moshray


def batches(shard: int, num_shards: int, seed: int):
    """8 batches of 8 samples per shard."""
    g = torch.Generator().manual_seed(seed * 100 + shard)
    for x in torch.randn(8, 8, 8, generator=g):
        yield x, (x.sum(dim=1) > 0).long()


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))


def _norm(model) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                       for g in grads])))


LR_GAMMA = 0.97  # the idiom loop's StepLR: lr = 1e-2 * LR_GAMMA ** global_step


def idiom_loop(tmp: Path):
    def loop(session):
        model = _net()
        opt = session.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        # torch's scheduler on the optimizer prepare returns, stepped after every opt.step()
        # without looking at its value: it moves once per global step
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=LR_GAMMA)
        scaler = torch.amp.GradScaler(session.device.type)
        g = torch.Generator().manual_seed(12345)
        x_val = torch.randn(128, 8, generator=g)
        y_val = (x_val.sum(dim=1) > 0).long()
        counts = {"fp16_steps": 0, "fp16_skipped": 0, "bf16": 0, "old_form": 0,
                  "max_norm_after_clip": 0.0}
        for i, (x, y) in enumerate(session.batches()):
            kind = ("fp16", "bf16", "old")[i % 3]
            if kind == "fp16":
                with torch.autocast(session.device.type, dtype=torch.float16):
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                norm = _norm(model)
                stepped = scaler.step(opt)  # None: an inf was found, the step skipped
                scaler.update()
                counts["fp16_steps" if stepped is not None else "fp16_skipped"] += 1
            elif kind == "bf16":
                with session.autocast(enabled=True):  # bf16 on the replica's device
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                norm = _norm(model)
                stepped = opt.step()
                counts["bf16"] += 1
            else:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                stepped, norm = opt.step(loss), 0.0  # the older shorthand
                counts["old_form"] += 1
            opt.zero_grad()
            sched.step()
            if norm == norm and norm != float("inf"):
                counts["max_norm_after_clip"] = max(counts["max_norm_after_clip"], norm)
            session.report({"loss": loss.float()})
            if stepped and session.global_step % 2 == 0 and session.is_leader:
                with torch.no_grad():
                    logits = model(x_val)
                session.report({
                    "val_loss": torch.nn.functional.cross_entropy(logits, y_val),
                    "val_accuracy": (logits.argmax(1) == y_val).float().mean()})
                with open(tmp / f"eval-{session.peer_id}.txt", "a") as f:
                    f.write(f"{session.global_step}\n")
        counts["lr"], counts["global_step"] = opt.param_groups[0]["lr"], session.global_step
        (tmp / f"counts-{session.peer_id}.json").write_text(json.dumps(counts))
    return loop


def tb_tags(run_dir: Path) -> set[str]:
    """The scalar tags in the run's TensorBoard event files."""
    from tensorboardX.proto import event_pb2

    tags = set()
    for path in (run_dir / "tensorboard").glob("events.out.tfevents.*"):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            tags |= {v.tag for v in event.summary.value}
    return tags


def idiom(tmp: Path) -> dict:
    seen = []
    result = moshray.fit(idiom_loop(tmp), moshray.data.from_fn(batches, num_shards=6),
                         config={"training": {"target_batch_size": 32}}, local_nodes=2,
                         max_nodes=2, run_dir=str(tmp / "run"), metrics_port=0, json=True,
                         on_report=lambda step, m: seen.append((step, m)))
    counts = {p.stem[len("counts-"):]: json.loads(p.read_text())
              for p in tmp.glob("counts-*.json")}
    evaluators = sorted(p.stem[len("eval-"):] for p in tmp.glob("eval-*.txt"))
    evaluated = [(s, m) for s, m in seen if "val_loss" in m]
    return {"summary": result.summary, "counts": counts, "evaluators": evaluators,
            "hook_steps": [s for s, _ in evaluated], "hook_values": [m for _, m in evaluated],
            "tensorboard_tags": sorted(tb_tags(tmp / "run"))}


def double_backward(tmp: Path) -> dict:
    def loop(session):
        model = _net()
        opt = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in session.batches():
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step(loss)  # the mistake: a second backward pass

    try:
        moshray.fit(loop, moshray.data.from_fn(batches, num_shards=4), local_nodes=2,
                    max_nodes=2, max_seconds=60, run_dir=str(tmp / "run"), metrics_port=0)
    except moshray.UserError as exc:
        return {"error": str(exc), "type": type(exc).__name__}
    return {"error": None}


def leader_loss(tmp: Path) -> dict:
    marker = tmp / "lost.txt"

    def loop(session):
        model = _net()
        opt = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in session.batches():
            torch.nn.functional.cross_entropy(model(x), y).backward()
            stepped = opt.step()
            opt.zero_grad()
            if not stepped:
                continue
            lost = marker.exists()
            lead = session.is_leader
            with open(tmp / f"leader-{session.peer_id}.txt", "a") as f:
                f.write(f"{session.global_step} {int(lead)} {int(lost)}\n")
            if lead and session.global_step >= 4 and not lost:
                marker.write_text(session.peer_id)
                raise RuntimeError("the leader is lost")

    moshray.fit(loop, moshray.data.from_fn(batches, num_shards=6),
                config={"training": {"target_batch_size": 16}}, local_nodes=2, max_nodes=2,
                max_seconds=40, run_dir=str(tmp / "run"), metrics_port=0, json=True)
    claims = {"before": set(), "after": set()}
    for path in tmp.glob("leader-*.txt"):
        peer = path.stem[len("leader-"):]
        for line in path.read_text().split("\n"):
            if line:
                _, lead, lost = line.split()
                if lead == "1":
                    claims["after" if lost == "1" else "before"].add(peer)
    return {"lost": marker.read_text() if marker.exists() else None,
            "before": sorted(claims["before"]), "after": sorted(claims["after"])}


if __name__ == "__main__":
    scenario, tmp_dir = sys.argv[1], Path(sys.argv[2])
    run = {"idiom": idiom, "double-backward": double_backward,
           "leader-loss": leader_loss}[scenario]
    print(json.dumps(run(tmp_dir), default=str))
