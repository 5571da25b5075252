"""The Ray Train baseline: the same model and data trained the way users run it today.

``ray.train.torch.TorchTrainer`` with DDP (gloo on CPU over loopback, NCCL on GPUs), an elastic
``ScalingConfig(num_workers=(1, max_workers))`` (Ray Train V2 supports elastic ranges in the
installed Ray: ``ray/train/v2/api/config.py`` and ``.../scaling_policy/elastic.py``), one worker
per spot node (each worker asks for the node's CPUs and the ``spot`` resource),
``FailureConfig(max_failures=-1)`` (retry forever) and a checkpoint every ``checkpoint_every``
steps through ``ray.train.report(checkpoint=...)`` to a local ``storage_path``.

The model, data and hyper-parameters come from the same :class:`~moshray.jobs.config.TrainConfig`
moshray trains with: ``build_model(ModelConfig, seed)``, ``ByteBatches`` shard ``rank`` of
``cluster.max_nodes``, AdamW(lr, weight_decay), gradient clipping, and the same global batch:
each step accumulates ``ceil(target_batch_size / (world * batch_size))`` micro-batches per worker
(the learning rate follows the same ``training.lr_scaling`` rule as moshray's steps, for the
group's step size).

What happens on a preemption is deliberately nothing special: the node disappears, a DDP
collective fails or the worker actor dies, Ray Train's controller tears the whole worker group
down and restarts it on the nodes that are left, from the latest checkpoint (the steps after it
are lost). New nodes are used when the elastic policy next resizes the group (another restart).

Per-step progress goes to a named, detached ``StepRecorder`` actor on the head node (rank 0
records ``(unix time, step, samples, loss, world)`` after every step, each new worker group
records its start and the step it resumed from), so a caller can rebuild cumulative samples
over time, the work lost to rollbacks and the stall time, even if this driver is killed.

**Ray Train + torchft** (``torchft=True``, ``--torchft``): the peer a Ray user picks for spot
capacity, as Ray's own example (``ray/train/v2/examples/pytorch/torchft_linear_example.py``)
runs it: ``TorchTrainer`` with ``TorchftConfig`` (a torchft Lighthouse actor on the head, each
worker its own replica group, only a failed group replaced and healed from a live peer through
``PGTransport``), torchft's ``Manager`` quorum per step, its ``DistributedDataParallel`` and
``Optimizer`` wrappers, on the same model, data and batch rule. Unlike the example (which
waits for every replica) the quorum goes on with the groups that are alive
(``min_replica_size=1``), as a user on spot nodes would run it. A global step is as close to
``target_batch_size`` as the quorum allows (``accum`` from the participants, the same
``lr_scaling`` rule as moshray's). The quorum's participating rank 0 records each committed
step and, every ``checkpoint_every`` steps, writes the state to
``<storage_path>/<name>/checkpoint_<step>/state.pt`` (weights-only loadable); a starting
worker loads the newest before its first quorum, so a whole-group restart (an elastic resize:
Ray Train replaces single groups only at an unchanged size) resumes there while a lone
replacement heals from its live peers. Every replica records its starts and the steps the
quorum discarded (``should_commit`` False).

Run as a driver against a running cluster (``ray job submit -- python -m
moshray.jobs.bench.raytrain_baseline ...`` or ``--address``); ``moshray bench goodput`` starts it in
a subprocess. Stdout: one ``{"event": "started", "t0": <unix>}`` line right before
``TorchTrainer.fit()``, a ``{"event": "fit_failed", ...}`` line per ``fit()`` that raised
and is called again (``fit_until_deadline``), and at the end one JSON summary line
(``fit_attempts``, ``fit_errors``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from moshray.cluster.placement import NAMESPACE, SPOT_RESOURCE, on_head
from moshray.jobs.config import TrainConfig, config_from_args, exit_on_config_error

STATE_FILE = "state.pt"
# DDP's communication hooks (torch.distributed.algorithms.ddp_comm_hooks): "fp16" casts the
# gradients to fp16 on the wire (fp16_compress_hook); "powersgd" sends a rank-2 PowerSGD
# approximation after 10 plain steps, with error feedback and warm start (PowerSGD's docs:
# start from rank 1-2 and raise it until accuracy is met; 1-4 is typical).
COMM_HOOKS = ("none", "fp16", "powersgd")
POWERSGD_RANK = 2
POWERSGD_START_ITER = 10
TORCHFT_MODES = ("ddp", "diloco", "streaming_diloco")
FIT_RETRY_MARGIN_S = 30.0  # fit() is called again only this far or more before the deadline
FIT_RETRY_MIN_S = 10.0  # a fit() that fails this soon is a bad setup: not retried


@dataclass(frozen=True)
class BaselineConfig:
    """One Ray Train baseline run.

    ``train`` is a ``TrainConfig.to_dict()``; ``deadline_unix`` is the wall time (``time.time()``)
    at which workers stop after their current step. ``cpus_per_worker`` should equal a spot node's
    CPUs so that exactly one worker lands on each node. ``elastic=False`` uses a fixed
    ``num_workers=max_workers`` (Ray versions without elastic ranges). ``steady_seconds``, if
    set, also stops the workers that many seconds after their group's first step (a
    failure-free measurement whose window should not depend on the group's start-up).
    """

    train: dict
    files: tuple[str, ...]
    max_workers: int
    deadline_unix: float
    storage_path: str
    recorder: str
    checkpoint_every: int = 20
    cpus_per_worker: float = 2.0
    use_gpu: bool = False
    elastic: bool = True
    resize_interval_s: float = 10.0
    name: str = "raytrain-baseline"
    steady_seconds: float | None = None
    gloo_ifname: str = "lo"  # the workers' interface (separate hosts: their "eth0")
    comm_hook: str = "none"  # DDP's gradient hook: none | fp16 | powersgd (COMM_HOOKS)
    torchft: bool = False  # Ray Train + torchft (TorchftConfig, Manager per replica group)
    torchft_mode: str = "ddp"  # torchft: ddp (a quorum per step) | diloco | streaming_diloco
    sync_every: int = 8  # torchft DiLoCo: inner steps per outer step
    outer_lr: float = 0.7  # torchft DiLoCo's outer Nesterov step (DiLoCo's own defaults)
    outer_momentum: float = 0.9
    lighthouse_host: str | None = None  # the head's address, which torchft's workers dial

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if not self.files:
            raise ValueError("files must name at least one data file")
        if self.steady_seconds is not None and not self.steady_seconds > 0:
            raise ValueError(f"steady_seconds must be > 0, got {self.steady_seconds}")
        if self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook must be one of {', '.join(COMM_HOOKS)}, got "
                             f"{self.comm_hook!r}")
        if self.torchft_mode not in TORCHFT_MODES:
            raise ValueError(f"torchft_mode must be one of {', '.join(TORCHFT_MODES)}, got "
                             f"{self.torchft_mode!r}")
        if self.torchft and self.comm_hook != "none":
            raise ValueError("comm_hook is for DDP runs; torchft's wrappers run their own")
        if self.sync_every < 2:
            raise ValueError(f"sync_every must be >= 2, got {self.sync_every}")


# --------------------------------------------------------------------------- recorder


def _recorder_class():
    import ray

    @ray.remote
    class StepRecorder:
        """Collects the baseline's per-step records; cheap calls, no I/O."""

        def __init__(self) -> None:
            self.steps: list[tuple] = []  # (unix_s, step, samples, loss, world)
            self.groups: list[tuple] = []  # (unix_s, world, resumed_from_step)
            self.replicas: list[tuple] = []  # torchft: (unix_s, rank, loaded_step) per start
            self.discards: list[tuple] = []  # torchft: (unix_s, rank, step) not committed

        def record_step(self, unix_s: float, step: int, samples: int, loss: float | None,
                        world: int) -> None:
            self.steps.append((unix_s, step, samples, loss, world))

        def record_group(self, unix_s: float, world: int, resumed_from: int) -> None:
            self.groups.append((unix_s, world, resumed_from))

        def record_replica(self, unix_s: float, rank: int, loaded_step: int) -> None:
            self.replicas.append((unix_s, rank, loaded_step))

        def record_discard(self, unix_s: float, rank: int, step: int) -> None:
            self.discards.append((unix_s, rank, step))

        def dump(self) -> dict:
            return {"steps": list(self.steps), "groups": list(self.groups),
                    "replicas": list(self.replicas), "discards": list(self.discards)}

    return StepRecorder


def create_recorder(name: str):
    """Create the named detached recorder on the head node (namespace ``moshray``)."""
    return _recorder_class().options(name=name, namespace=NAMESPACE, lifetime="detached",
                                     **on_head()).remote()


def read_recorder(name: str, timeout_s: float = 30.0) -> dict:
    """``{"steps": [...], "groups": [...]}`` from the named recorder (needs ``ray.init``)."""
    import ray

    handle = ray.get_actor(name, namespace=NAMESPACE)
    return ray.get(handle.dump.remote(), timeout=timeout_s)


# --------------------------------------------------------------------------- worker loop


def _save_state(model, optimizer, step: int, directory: str) -> None:
    import torch

    module = getattr(model, "module", model)  # unwrap DDP
    torch.save({"model": {k: v.detach().cpu() for k, v in module.state_dict().items()},
                "optimizer": optimizer.state_dict(), "step": step},
               os.path.join(directory, STATE_FILE))


def train_loop_per_worker(loop_config: dict) -> None:
    """One Ray Train worker: DDP over the group, the moshray model and data.

    Resumes from ``ray.train.get_checkpoint()`` when the group was restarted. Stops after the
    step during which any rank saw the deadline pass, or ``steady_seconds`` pass since the
    group's first step (agreed through the per-step all-reduce, so no rank is left waiting in
    a collective), then reports a final checkpoint.
    """
    import ray
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    from moshray.jobs.examples.lm.corpus import ByteBatches
    from moshray.jobs.examples.lm.model import build_model
    from moshray.actors.replica.strategies import lr_scale

    cfg = BaselineConfig(**loop_config)
    tc = TrainConfig.from_dict(cfg.train)
    t = tc.training
    torch.set_num_threads(1)  # as a moshray replica does
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    recorder = ray.get_actor(cfg.recorder, namespace=NAMESPACE)

    model = build_model(tc.model.to_model_config(), seed=t.seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = torch.load(os.path.join(directory, STATE_FILE), map_location=device,
                               weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
    if rank == 0:
        ray.get(recorder.record_group.remote(time.time(), world, step), timeout=60)
    pending: list = []  # record_step refs, awaited at checkpoints and at the end
    model = ray.train.torch.prepare_model(model, move_to_device=False)  # DDP when world > 1
    if world > 1 and cfg.comm_hook != "none":
        _register_comm_hook(model, cfg.comm_hook)
    # A restarted group draws fresh batches (seed moves with the step it resumed from).
    data = ByteBatches(list(cfg.files), rank % cfg.max_workers, cfg.max_workers,
                       tc.model.seq_len, t.batch_size, t.seed + step)
    accum = max(1, math.ceil(t.target_batch_size / (world * t.batch_size)))
    # moshray's rate rule (``training.lr_scaling``): ``lr`` is for a step of the target
    # batch; this group's steps are world * accum * batch_size (after a checkpoint's load,
    # which brings back the rate of the group before).
    rate = t.lr * lr_scale(world * accum * t.batch_size, t.target_batch_size, t.lr_scaling)
    for group in optimizer.param_groups:
        group["lr"] = rate
    distributed = world > 1 and dist.is_available() and dist.is_initialized()
    steady_deadline = math.inf  # set after this group's first step when steady_seconds is

    while True:
        loss_sum, n = _micro_steps(model, data, accum, device)
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        now = time.time()
        if cfg.steady_seconds is not None and steady_deadline == math.inf:
            steady_deadline = now + cfg.steady_seconds
        past = now >= cfg.deadline_unix or now >= steady_deadline
        # (3,): loss * samples, samples, ranks past the deadline; summed over the group
        totals = torch.tensor([loss_sum, float(n), float(past)], dtype=torch.float64)
        if distributed:
            dist.all_reduce(totals)
        samples = int(totals[1].item())
        stop = totals[2].item() > 0
        if rank == 0:
            pending.append(recorder.record_step.remote(time.time(), step, samples,
                                                       totals[0].item() / max(samples, 1),
                                                       world))
        if stop or step % cfg.checkpoint_every == 0:
            if pending:  # a worker's queued calls die with it: flush before going on
                ray.get(pending, timeout=60)
                pending.clear()
            metrics = {"step": step, "loss": totals[0].item() / max(samples, 1)}
            if rank == 0:
                with tempfile.TemporaryDirectory() as directory:
                    _save_state(model, optimizer, step, directory)
                    ray.train.report(metrics,
                                     checkpoint=ray.train.Checkpoint.from_directory(directory))
            else:
                ray.train.report(metrics, checkpoint=None)
        if stop:
            return


def _register_comm_hook(model, hook: str) -> None:
    """DDP's gradient hook ``hook`` (see ``COMM_HOOKS``) on the DDP-wrapped ``model``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=POWERSGD_RANK,
            start_powerSGD_iter=POWERSGD_START_ITER, use_error_feedback=True, warm_start=True)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def _checkpoint_dirs(root: str) -> list[str]:
    """``checkpoint_<step>`` folders under ``root`` that hold a state file, oldest first."""
    if not os.path.isdir(root):
        return []
    found = [d for d in os.listdir(root)
             if d.startswith("checkpoint_") and os.path.isfile(os.path.join(root, d, STATE_FILE))]
    return [os.path.join(root, d) for d in sorted(found)]


def _write_checkpoint(root: str, model, optimizer, step: int, keep: int = 2) -> None:
    """The state after ``step`` to ``root/checkpoint_<step>/state.pt``, written aside and
    renamed (a reader never sees half a file); only the ``keep`` newest are kept."""
    import shutil

    final = os.path.join(root, f"checkpoint_{step:010d}")
    if os.path.isdir(final):
        return
    os.makedirs(root, exist_ok=True)
    partial = tempfile.mkdtemp(prefix=".partial-", dir=root)
    _save_state(model, optimizer, step, partial)
    os.replace(partial, final)
    for old in _checkpoint_dirs(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def torchft_loop_per_worker(loop_config: dict) -> None:
    """One Ray Train + torchft worker: a replica group of one rank (see the module docstring).

    ``torchft_mode="ddp"``: loads the newest checkpoint of ``<storage_path>/<name>`` (if
    any) before its first quorum (torchft heals it from a live peer that is ahead), then one
    quorum per step. ``"diloco"`` / ``"streaming_diloco"``: torchft's ``DiLoCo`` (the whole
    model, or two fragments synced at staggered steps with one step of delay), inner AdamW
    steps, an outer Nesterov step (``outer_lr``, ``outer_momentum``) every
    ``sync_every`` steps; these runs neither write nor read checkpoints and stop at an outer
    step. Stops once any participant saw the deadline (or ``steady_seconds`` after its first
    step) pass, agreed through an all-reduce; saves the final state (the first participant)
    and shuts its Manager down. A worker whose quorum or collective fails raises, and Ray
    Train replaces its group.
    """
    from datetime import timedelta

    import ray
    import ray.train
    import torch
    import ray.train.torch
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
    from torchft.checkpointing.pg_transport import PGTransport

    from moshray.jobs.examples.lm.corpus import ByteBatches
    from moshray.jobs.examples.lm.model import build_model

    cfg = BaselineConfig(**loop_config)
    tc = TrainConfig.from_dict(cfg.train)
    t = tc.training
    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()  # each worker is its own replica group
    device = ray.train.torch.get_device()  # CUDA on a GPU node (NCCL), else CPU (gloo)
    recorder = ray.get_actor(cfg.recorder, namespace=NAMESPACE)
    root = os.path.join(cfg.storage_path, cfg.name)
    diloco = cfg.torchft_mode != "ddp"

    module = build_model(tc.model.to_model_config(), seed=t.seed).to(device)
    inner = torch.optim.AdamW(module.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    loaded = 0
    newest = [] if diloco else _checkpoint_dirs(root)
    if newest:
        state = torch.load(os.path.join(newest[-1], STATE_FILE), map_location=device,
                           weights_only=True)
        module.load_state_dict(state["model"])
        inner.load_state_dict(state["optimizer"])
        loaded = int(state["step"])

    def load_state_dict(state: dict) -> None:  # a live peer's state, when healing
        module.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": module.state_dict(), "optim": inner.state_dict()}

    timeout = timedelta(seconds=30)
    pg = (ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else
          ProcessGroupGloo(timeout=timeout))
    lighthouse = os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if cfg.lighthouse_host and lighthouse:  # the actor names its host; dial the head's address
        lighthouse = f"http://{cfg.lighthouse_host}:{lighthouse.rsplit(':', 1)[1]}"
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
        world_size=1, rank=0, replica_id=f"{cfg.name}_{rank}", timeout=timedelta(seconds=60),
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=device),
        lighthouse_addr=lighthouse or None, hostname=ray.util.get_node_ip_address(),
        use_async_quorum=not diloco)
    if loaded:
        manager.load_state_dict({"step": loaded, "batches_committed": 0})
    ray.get(recorder.record_replica.remote(time.time(), rank, loaded), timeout=60)
    data = ByteBatches(list(cfg.files), rank % cfg.max_workers, cfg.max_workers,
                       tc.model.seq_len, t.batch_size, t.seed + loaded)
    run = _diloco_steps if diloco else _quorum_steps
    pending: list = []
    try:
        run(cfg, tc, manager, module, inner, data, device, recorder, rank, root, pending)
    finally:
        if pending:
            ray.get(pending, timeout=60)
        manager.shutdown(wait=False)


def _micro_steps(model, data, accum: int, device) -> tuple[float, int]:
    """``accum`` micro-batches through ``model`` on ``device``, each loss over ``accum``
    backward (a DDP wrapper all-reduces on the last only: ``no_sync`` before); returns
    ``(loss * samples, samples)``."""
    import torch.nn.functional as F

    loss_sum, n = 0.0, 0
    for i in range(accum):
        x, y = data.next_batch()
        x, y = x.to(device), y.to(device)  # (batch, seq_len)
        sync = contextlib.nullcontext()
        if i < accum - 1 and hasattr(model, "no_sync"):
            sync = model.no_sync()
        with sync:
            logits = model(x)  # (batch, seq_len, vocab)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            (loss / accum).backward()
        loss_sum += float(loss.detach()) * x.shape[0]
        n += x.shape[0]
    return loss_sum, n


def _quorum_steps(cfg, tc, manager, module, inner, data, device, recorder, rank, root,
                  pending) -> None:
    """torchft's per-step quorum: its DDP and optimizer wrappers; a global step is as close
    to ``target_batch_size`` as the participants allow."""
    import torch
    from torchft import DistributedDataParallel, Optimizer

    from moshray.actors.replica.strategies import lr_scale

    t = tc.training
    model = DistributedDataParallel(manager, module)
    optimizer = Optimizer(manager, inner)
    steady_deadline = math.inf
    while True:
        optimizer.zero_grad(set_to_none=True)  # starts the step's quorum
        participants = max(manager.num_participants(), 1)
        accum = max(1, math.ceil(t.target_batch_size / (participants * t.batch_size)))
        rate = t.lr * lr_scale(participants * accum * t.batch_size, t.target_batch_size,
                               t.lr_scaling)
        for group in inner.param_groups:
            group["lr"] = rate
        loss_sum, n = _micro_steps(model, data, accum, device)
        now = time.time()
        past = now >= min(cfg.deadline_unix, steady_deadline)
        # (3,): loss * samples, samples, past the deadline; averaged over the participants
        stats = torch.tensor([loss_sum, float(n), float(past)], dtype=torch.float32,
                             device=device)
        manager.allreduce(stats).wait()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(module.parameters(), t.grad_clip)
        before = manager.current_step()
        optimizer.step()  # commits only if every participant's step went through
        step = manager.current_step()
        now = time.time()
        if cfg.steady_seconds is not None and steady_deadline == math.inf:
            steady_deadline = now + cfg.steady_seconds
        first = manager.participating_rank() == 0
        if step == before:
            pending.append(recorder.record_discard.remote(now, rank, before + 1))
        elif first:
            mean = float(stats[0]) / max(float(stats[1]), 1e-9)
            pending.append(recorder.record_step.remote(
                now, step, int(round(float(stats[1]) * participants)), mean, participants))
            if step % cfg.checkpoint_every == 0:
                _write_checkpoint(root, module, inner, step)
        _flush(pending)
        if past or float(stats[2]) > 0:
            if first:
                _write_checkpoint(root, module, inner, step)
            return


def _diloco_steps(cfg, tc, manager, module, inner, data, device, recorder, rank, root,
                  pending) -> None:
    """torchft.local_sgd's DiLoCo (``streaming_diloco``: two fragments, a step of delay):
    every replica's own loss per inner step, recorded by the first; stops at an outer step."""
    import torch
    from torchft.local_sgd import DiLoCo

    t = tc.training
    streaming = cfg.torchft_mode == "streaming_diloco"
    fragments = _fragments(module) if streaming else [module]
    # one outer optimizer per fragment: a shared one would also step the other fragments'
    # parameters with the inner step's gradients still in their .grad
    outer = [torch.optim.SGD(f.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                             nesterov=True) for f in fragments]
    accum = max(1, math.ceil(t.target_batch_size / (cfg.max_workers * t.batch_size)))
    steady_deadline = math.inf
    participants = cfg.max_workers
    step = 0
    with DiLoCo(manager, fragments, inner, outer, sync_every=cfg.sync_every,
                fragment_sync_delay=1 if streaming else 0):
        while True:
            inner.zero_grad(set_to_none=True)
            loss_sum, n = _micro_steps(module, data, accum, device)
            if t.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(module.parameters(), t.grad_clip)
            inner.step()  # every sync_every-th: the outer step (DiLoCo's hook)
            step += 1
            now = time.time()
            if cfg.steady_seconds is not None and steady_deadline == math.inf:
                steady_deadline = now + cfg.steady_seconds
            if rank == 0:
                pending.append(recorder.record_step.remote(now, step, n * participants,
                                                           loss_sum / max(n, 1), participants))
            _flush(pending)
            if step % cfg.sync_every:
                continue
            participants = max(manager.num_participants(), 1)
            flag = torch.tensor([float(now >= min(cfg.deadline_unix, steady_deadline))],
                                device=device)
            manager.allreduce(flag).wait()
            if float(flag[0]) > 0:
                if rank == 0:
                    _write_checkpoint(root, module, inner, step)
                return


def _fragments(module) -> list:
    """Two fragments of the example LM for Streaming DiLoCo: the embeddings (the head is
    tied to them) with the first half of the blocks, and the rest with the final norm."""
    import torch.nn as nn

    blocks = list(module.blocks)
    half = max(1, len(blocks) // 2)
    first = nn.ModuleList([module.tok_emb, module.pos_emb, module.head, *blocks[:half]])
    second = nn.ModuleList([*blocks[half:], module.ln_f])
    return [first, second]


def _flush(pending: list, limit: int = 64) -> None:
    """Wait for the queued recorder calls once there are more than ``limit``."""
    import ray

    if len(pending) > limit:
        ray.get(pending, timeout=60)
        pending.clear()


# --------------------------------------------------------------------------- driver


def run_baseline(cfg: BaselineConfig):
    """Run ``TorchTrainer.fit()`` in this (connected) driver; returns the ``Result``.

    Raises whatever ``fit`` raises (``ray.train.TrainingFailedError`` only if the failure
    policy gives up, which ``max_failures=-1`` never does).
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    extra: dict[str, Any] = {}
    loop = train_loop_per_worker
    if cfg.torchft:
        from ray.train.v2.torch.torchft_config import TorchftConfig

        extra["torch_config"] = TorchftConfig(lighthouse_kwargs={"min_replicas": 1},
                                              backend="nccl" if cfg.use_gpu else "gloo")
        loop = torchft_loop_per_worker

    scaling = ScalingConfig(
        num_workers=(1, cfg.max_workers) if cfg.elastic else cfg.max_workers,
        use_gpu=cfg.use_gpu,
        resources_per_worker={"CPU": cfg.cpus_per_worker, SPOT_RESOURCE: 1,
                              **({"GPU": 1} if cfg.use_gpu else {})},
        **({"elastic_resize_monitor_interval_s": cfg.resize_interval_s} if cfg.elastic else {}),
    )
    run_config = RunConfig(
        name=cfg.name,
        storage_path=cfg.storage_path,
        failure_config=FailureConfig(max_failures=-1),
        checkpoint_config=CheckpointConfig(num_to_keep=2),
        worker_runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": cfg.gloo_ifname,
                                         "OMP_NUM_THREADS": "1"}},
    )
    trainer = TorchTrainer(loop, train_loop_config=asdict(cfg), scaling_config=scaling,
                           run_config=run_config, **extra)
    return trainer.fit()


def fit_until_deadline(cfg: BaselineConfig) -> tuple[str | None, list[str], str | None]:
    """``run_baseline(cfg)``, called again after a failure while the deadline is
    ``FIT_RETRY_MARGIN_S`` or more away, as a job-level retry would (``fit()`` raises
    ``ControllerError`` when Ray Train's controller fails, e.g. a worker's node gone while
    it replaces a torchft replica group; ``FailureConfig`` retries only worker failures).
    The same run name and storage: the next attempt resumes from the run's newest
    checkpoint. Returns ``(the last attempt's error or None, every failed attempt's
    error, the final checkpoint's state file or None)``; a fit that fails within
    ``FIT_RETRY_MIN_S`` of its start is not retried (a bad setup, not a lost node)."""
    errors: list[str] = []
    while True:
        started = time.time()
        try:
            result = run_baseline(cfg)
        except Exception as exc:  # noqa: BLE001 - reported in the summary; the records stand
            errors.append(f"{type(exc).__name__}: {exc}")
            print(json.dumps({"event": "fit_failed", "unix": time.time(),
                              "error": errors[-1].splitlines()[0][:300]}), flush=True)
            if (time.time() - started < FIT_RETRY_MIN_S
                    or cfg.deadline_unix - time.time() < FIT_RETRY_MARGIN_S):
                return errors[-1], errors, None
            continue
        path = (None if result.checkpoint is None else
                os.path.join(result.checkpoint.path, STATE_FILE))
        return None, errors, path


def _head_host(address: str) -> str | None:
    """The head's host in a ``host:port`` GCS address (the Lighthouse runs there), else
    None (``auto``, a ``ray://`` URL: torchft's workers then dial the name it advertises)."""
    if "://" in address or ":" not in address:
        return None
    return address.rsplit(":", 1)[0]


def gpus_in_cluster() -> bool:
    """True if the connected cluster has any GPU (``use_gpu`` auto)."""
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moshray.jobs.config import add_config_arguments

    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                        help="Ray cluster address (default: RAY_ADDRESS)")
    parser.add_argument("--duration", type=float, required=True,
                        help="wall seconds of training after fit() starts")
    parser.add_argument("--max-workers", type=int, default=None,
                        help="elastic upper bound (default: cluster.max_nodes)")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps")
    parser.add_argument("--storage-path", default=None,
                        help="Ray Train storage (default: <run_dir>/raytrain)")
    parser.add_argument("--cpus-per-worker", type=float, default=2.0,
                        help="CPUs each worker reserves (a spot node's CPUs: one worker/node)")
    parser.add_argument("--resize-interval", type=float, default=10.0,
                        help="ScalingConfig.elastic_resize_monitor_interval_s")
    parser.add_argument("--fixed", action="store_true",
                        help="fixed num_workers=max_workers instead of the elastic range")
    parser.add_argument("--recorder", default=None, help="name of the StepRecorder actor")
    parser.add_argument("--steady-seconds", type=float, default=None,
                        help="also stop this many seconds after the worker group's first step")
    parser.add_argument("--gloo-ifname", default="lo",
                        help="the workers' network interface for gloo (separate hosts: eth0)")
    parser.add_argument("--comm-hook", choices=COMM_HOOKS, default="none",
                        help="DDP's gradient communication hook (fp16: fp16_compress_hook; "
                             f"powersgd: powerSGD_hook, rank {POWERSGD_RANK})")
    parser.add_argument("--torchft", action="store_true",
                        help="Ray Train + torchft (TorchftConfig, a Manager quorum per step)")
    parser.add_argument("--torchft-mode", choices=TORCHFT_MODES, default="ddp",
                        help="with --torchft: a quorum per step (ddp), or torchft.local_sgd's "
                             "DiLoCo / Streaming DiLoCo")
    parser.add_argument("--sync-every", type=int, default=8,
                        help="torchft DiLoCo: inner steps per outer step")
    parser.add_argument("--outer-lr", type=float, default=0.7,
                        help="torchft DiLoCo: the outer Nesterov step's learning rate")
    parser.add_argument("--outer-momentum", type=float, default=0.9,
                        help="torchft DiLoCo: the outer Nesterov step's momentum")
    add_config_arguments(parser)


@exit_on_config_error
def main(args: argparse.Namespace) -> int:
    import ray

    from moshray.jobs.examples.lm.corpus import resolve_data
    from moshray.jobs.local.cluster import allow_cluster_addresses, pin_loopback

    config: TrainConfig = config_from_args(args)
    if not args.address:
        print("raytrain_baseline: no cluster: pass --address or set RAY_ADDRESS",
              file=sys.stderr)
        return 2
    if not args.duration > 0:
        print(f"raytrain_baseline: --duration must be > 0, got {args.duration}", file=sys.stderr)
        return 2
    if args.steady_seconds is not None and not args.steady_seconds > 0:
        print(f"raytrain_baseline: --steady-seconds must be > 0, got {args.steady_seconds}",
              file=sys.stderr)
        return 2
    if args.torchft:
        try:
            import torchft  # noqa: F401
        except ImportError:
            print("raytrain_baseline: --torchft needs torchft: pip install 'moshray[bench]'",
                  file=sys.stderr)
            return 2
        if args.comm_hook != "none":
            print("raytrain_baseline: --comm-hook is for DDP runs, not --torchft",
                  file=sys.stderr)
            return 2
    if args.address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost"):
        pin_loopback()  # a loopback cluster stays on loopback
    else:
        allow_cluster_addresses()  # separate hosts: the driver is reached on the bridge
    files = resolve_data(list(config.data.paths) or None,
                         os.path.expanduser(config.data.cache_dir))
    ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False,
             runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}})
    recorder = args.recorder or f"raytrain-recorder-{uuid.uuid4().hex[:8]}"
    try:
        ray.get_actor(recorder, namespace=NAMESPACE)
    except ValueError:
        create_recorder(recorder)
    t0 = time.time()
    cfg = BaselineConfig(
        train=config.to_dict(), files=tuple(files),
        max_workers=args.max_workers or config.cluster.max_nodes,
        deadline_unix=t0 + args.duration,
        storage_path=os.path.abspath(args.storage_path or os.path.join(config.run_dir,
                                                                       "raytrain")),
        recorder=recorder, checkpoint_every=args.checkpoint_every,
        cpus_per_worker=args.cpus_per_worker, use_gpu=gpus_in_cluster(),
        elastic=not args.fixed, resize_interval_s=args.resize_interval,
        name=f"raytrain-baseline-{uuid.uuid4().hex[:8]}", steady_seconds=args.steady_seconds,
        gloo_ifname=args.gloo_ifname, torchft=args.torchft, comm_hook=args.comm_hook,
        torchft_mode=args.torchft_mode, sync_every=args.sync_every,
        outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
        lighthouse_host=_head_host(args.address) if args.torchft else None)
    print(json.dumps({"event": "started", "t0": t0, "recorder": recorder}), flush=True)
    error, errors, checkpoint_path = fit_until_deadline(cfg)
    records = read_recorder(recorder)
    summary: dict[str, Any] = {
        "event": "finished", "t0": t0, "wall_s": time.time() - t0, "error": error,
        "fit_attempts": len(errors) + (error is None), "fit_errors": errors,
        "checkpoint": checkpoint_path, "steps": len(records["steps"]),
        "restarts": max(len(records["groups"]) - 1, 0), "records": records,
        "replica_starts": len(records.get("replicas", ())),
        "discarded_steps": len(records.get("discards", ())),
    }
    print(json.dumps(summary), flush=True)
    ray.shutdown()
    return 0 if error is None else 1


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m moshray.jobs.bench.raytrain_baseline",
                                      description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
