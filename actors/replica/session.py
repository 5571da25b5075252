"""What the user's training loop holds inside each replica: ``Session`` and ``ElasticOptimizer``.

The loop is a plain function ``loop(session)`` that the replica runs in a thread::

    def loop(session):
        torch.manual_seed(session.seed)
        model = Net()
        opt = session.prepare(model, torch.optim.Adam(model.parameters(), 1e-3))
        for x, y in session.batches():
            opt.step(F.cross_entropy(model(x), y))

``prepare`` moves the model to the replica's device, joins the swarm (the model, the
optimizer, the user's extra state dict, the data position and the RNG states are copied
from a live replica or the checkpoint) and returns the optimizer wrapper. ``batches()``
yields the batches of the shards this replica is handed, on its device, until the job
stops. ``opt.step(loss)`` runs the backward pass and lets the step strategy
(``strategies.py``: ``training.mode`` names one) decide whether a global step happens now
(it returns True when one did). Bad input raises a
``UserError`` naming what to fix, which stops the job.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from moshray.actors.errors import UserError
from moshray.actors.replica.state import TrainState
from moshray.actors.replica.shard_feed import ShardFeed
from moshray.actors.replica.strategies import make_strategy


def check_optimizer(model: torch.nn.Module, optimizer: Any) -> None:
    """``UserError`` unless ``optimizer`` is a first-order torch optimizer over exactly the
    model's trainable parameters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError("optimizer", f"expected a torch.optim.Optimizer over the model's "
                        f"parameters, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise UserError("optimizer", "LBFGS re-evaluates the loss through a closure, which a "
                        "step averaged across replicas cannot do: use a first-order optimizer "
                        "(SGD, Adam, AdamW, ...)")
    in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    every = {id(p) for p in model.parameters()}
    if in_opt - every:
        raise UserError("optimizer", f"it holds {len(in_opt - every)} tensor(s) that are not "
                        f"parameters of the model: build it from model.parameters()")
    if trainable - in_opt:
        raise UserError("optimizer", f"{len(trainable - in_opt)} of the model's "
                        f"{len(trainable)} trainable parameters are not in it: build it from "
                        f"model.parameters() (or set requires_grad=False on frozen ones)")


def check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise UserError("loss", f"opt.step(loss) needs a tensor, got {type(loss).__name__}")
    if loss.dim() != 0:
        raise UserError("loss", f"must be a scalar, got shape {tuple(loss.shape)}: reduce it "
                        f"(e.g. .mean())")
    if not loss.requires_grad:
        raise UserError("loss", "does not depend on the model's parameters (no gradient): "
                        "compute it from the model's output")
    return loss


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (1 if it has none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        return batch_size_of(next(iter(batch.values()), None))
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    return 1


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class ElasticOptimizer:
    """Wraps the user's optimizer; ``step(loss)`` once per micro-batch (see module doc)."""

    def __init__(self, session: "Session", optimizer: torch.optim.Optimizer):
        self.session, self.optimizer = session, optimizer

    def step(self, loss: torch.Tensor, samples: int | None = None) -> bool:
        """Backward, then the strategy's local part and, if the Coordinator planned one, a
        global step. ``samples`` defaults to the size of the last batch. True if a global
        step happened."""
        s = self.session
        check_loss(loss).backward()
        s.strategy.after_backward(s.state.model, self.optimizer, s.manager.fault)
        n = samples if samples is not None else s.last_batch_size
        return s.call(s.manager.after_micro_batch(n, float(loss.detach())))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """In collaborative mode gradients accumulate until the global step (which clears
        them): this does nothing then. In local SGD it clears them."""
        if self.session.strategy.zero_grad_allowed():
            self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()


class Session:
    """One replica's view of the job, for the training loop (see module docstring).

    Attributes: ``peer_id``, ``config`` (the ``TrainConfig``), ``device`` (the GPU Ray
    gave this replica, else the CPU; ``prepare`` moves the model there, ``batches`` the
    data), ``seed``, ``coordinator`` (handle, for DMoE layers), ``epoch`` (global steps so
    far). ``autocast()``: mixed precision on that device."""

    def __init__(self, peer_id: str, config, device: torch.device, manager, source,
                 loop: asyncio.AbstractEventLoop, coordinator):
        self.peer_id, self.config, self.device = peer_id, config, device
        self.manager, self.source, self.coordinator = manager, source, coordinator
        self.seed = config.training.seed
        self.state: TrainState | None = None
        self.strategy = None
        self.last_batch_size = 0
        self._loop = loop

    @property
    def epoch(self) -> int:
        return self.state.epoch if self.state is not None else 0

    @property
    def should_stop(self) -> bool:
        return self.manager.stopping

    def call(self, coroutine) -> Any:
        """Run ``coroutine`` on the replica's event loop and wait for it (loop thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                state: dict | None = None) -> ElasticOptimizer:
        """Join the swarm with these objects (see module docstring). ``state``: the user's
        extra state dict (values: anything picklable, or objects with ``state_dict`` and
        ``load_state_dict``), kept equal across replicas and in checkpoints."""
        if self.state is not None:
            raise UserError("session", "prepare() was called twice: call it once per replica")
        if not isinstance(model, torch.nn.Module):
            raise UserError("model", f"expected a torch.nn.Module, got {type(model).__name__}")
        if state is not None and not isinstance(state, dict):
            raise UserError("state", f"expected a dict, got {type(state).__name__}")
        check_optimizer(model, optimizer)
        model.to(self.device)  # in place: the optimizer keeps the same parameters
        coordinator, peer = self.coordinator, self.peer_id
        feed = ShardFeed(self.source, self.seed,
                         lambda floor: coordinator.grant_shards.remote(peer, 1, floor).future())
        self.strategy = make_strategy(self.config.training, model, self.device)
        self.state = TrainState(model, optimizer, state, feed, self.config.to_dict())
        self.state.strategy_state = self.strategy.outer_state
        self.state.shared_optimizers = self.strategy.shared_optimizers(optimizer)
        if not self.strategy.local_updates:  # the model changes only in global steps
            self.state.keep_step_buffers()
        self.call(self.manager.start(self.state, self.strategy))
        return ElasticOptimizer(self, optimizer)

    def batches(self):
        """The batches of this replica's shards, on its device, until the job stops."""
        if self.state is None:
            raise UserError("session", "call session.prepare(model, optimizer) before "
                            "session.batches()")
        feed = self.state.feed
        while not self.manager.stopping:
            batch = feed.next()
            self.last_batch_size = batch_size_of(batch)
            yield to_device(batch, self.device)

    def record(self, events: tuple) -> None:
        """Metrics events (``moshray.cluster.metrics``) to the Coordinator, fire-and-forget."""
        self._loop.call_soon_threadsafe(self.manager.record, tuple(events))

    def autocast(self, enabled: bool | None = None, dtype: torch.dtype = torch.bfloat16):
        """``torch.autocast`` on this replica's device: the forward pass in ``dtype``
        (bf16) where it pays. ``enabled`` None: on for a CUDA device that supports bf16,
        off on the CPU; True forces it on (CPU autocast on a CPU replica). Use it around the
        forward pass and the loss, not around ``opt.step``::

            with session.autocast():
                loss = model.loss(x, y)
            opt.step(loss)
        """
        if enabled is None:
            enabled = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.autocast(self.device.type, dtype=dtype, enabled=bool(enabled))
