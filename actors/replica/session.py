"""What the user's training loop holds inside each replica: ``Session`` and ``ElasticOptimizer``.

The loop is a plain function ``loop(session)`` that the replica runs in a thread, written
in torch's idiom::

    def loop(session):
        torch.manual_seed(session.seed)
        model = Net()
        opt = session.prepare(model, torch.optim.Adam(model.parameters(), 1e-3))
        for x, y in session.batches():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()                      # moshray decides when a global step happens
            opt.zero_grad()
            session.report({"loss": loss})  # the console, the summary, TensorBoard

``prepare`` moves the model to the replica's device, joins the swarm (the model, the
optimizer, the user's extra state dict, the data position and the RNG states are copied
from a live replica or the checkpoint) and returns the optimizer wrapper, a
``torch.optim.Optimizer`` (``SwarmOptimizer``): a learning-rate scheduler built on it moves
once per global step (``session.global_step``), however often the loop calls its ``step()``. ``batches()``
yields the batches of the shards this replica is handed, on its device, until the job
stops. Between ``loss.backward()`` and ``opt.step()`` the gradients are the user's:
clip them, unscale them (``torch.amp.GradScaler``: ``scaler.step(opt)`` works), inspect
them. ``opt.step()`` hands this micro-batch's gradient to the step strategy
(``strategies.py``: ``training.mode`` names one), which decides whether a global step
happens now (it returns True when one did); moshray itself clips nothing and rescales no
learning rate unless ``training.grad_clip`` / ``training.lr_scaling`` say so (off by
default). ``opt.step(loss)``, the older shorthand, still works: it runs
``loss.backward()`` first (and records the loss); after a ``loss.backward()`` of the
user's it raises ``UserError`` (that would backpropagate twice). ``opt.step()`` with no
gradient since the last one raises ``UserError`` too (a missing ``loss.backward()``).

``session.report(metrics)`` records the loop's own metrics at the current global step
(the run summary's ``reported``, Prometheus, TensorBoard, the ``fit(on_report=...)``
callback); ``session.is_leader`` is true on exactly one live replica at a time (the ready
replica with the lowest peer id, handed over when it leaves: ``leader_of``), for work that
must happen once, such as evaluation. Bad input raises a ``UserError`` naming what to fix,
which stops the job.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Iterable
from typing import Any

import ray
import torch

from moshray.actors.errors import UserError
from moshray.actors.replica.state import TrainState
from moshray.actors.replica.shard_feed import ShardFeed
from moshray.actors.replica.strategies import make_strategy

log = logging.getLogger(__name__)

LEADER_TIMEOUT_S = 30.0  # one membership read for ``is_leader`` (a restarting Coordinator)


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


def warn_early_scheduler(optimizer: torch.optim.Optimizer) -> None:
    """Log one line if a learning-rate scheduler was built on ``optimizer`` before
    ``prepare``: it would step each time it is called (per micro-batch), not per global
    step as one built on the optimizer ``prepare`` returns does."""
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        log.warning("a learning-rate scheduler was built on the optimizer before "
                    "session.prepare: it steps on every call; build it on the optimizer "
                    "prepare returns, which steps it once per global step")


def check_loss(loss: Any) -> torch.Tensor:
    """``loss`` if it is a scalar tensor that depends on the parameters; else ``UserError``."""
    if callable(loss):
        raise UserError("loss", "opt.step(closure) is not supported (a step averaged across "
                        "replicas cannot re-evaluate the loss): call loss.backward(); "
                        "opt.step()")
    if not isinstance(loss, torch.Tensor):
        raise UserError("loss", f"opt.step(loss) needs a tensor, got {type(loss).__name__}: "
                        f"write loss.backward(); opt.step()")
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


def _has_grad(model: torch.nn.Module) -> bool:
    return any(p.grad is not None for p in model.parameters())


_SCHEDULER_PATCH = "patch_track_step_called"  # torch's LRScheduler.__init__, wrapping opt.step


def _scheduler_being_built(depth: int = 2):
    """The ``torch.optim.lr_scheduler.LRScheduler`` whose constructor is wrapping an
    optimizer's ``step`` right now (torch does that in ``LRScheduler.__init__``, through a
    nested function whose ``self`` is the scheduler), read from the caller's caller's frame;
    None if that is not what is happening (another torch, or another caller)."""
    import sys

    frame = sys._getframe(depth)
    if frame.f_code.co_name != _SCHEDULER_PATCH:
        return None
    candidate = frame.f_locals.get("self")
    scheduler = getattr(torch.optim.lr_scheduler, "LRScheduler", None)
    return candidate if scheduler is not None and isinstance(candidate, scheduler) else None


class SwarmOptimizer(torch.optim.Optimizer):
    """What ``prepare`` returns (``ElasticOptimizer``, ``GroupOptimizer``): a
    ``torch.optim.Optimizer`` whose ``param_groups``, ``state``, ``defaults`` and
    ``state_dict`` are the wrapped optimizer's (``optimizer``), so ``lr_scheduler``s,
    ``GradScaler`` and ``clip_grad_norm_`` work on it as on any optimizer. ``step()``
    returns True when a global step happened.

    A learning-rate scheduler built on it steps once per global step of the swarm, whether
    the loop calls ``scheduler.step()`` after every ``opt.step()`` or only when it returned
    True: its position (``last_epoch``) is the swarm's global step, so every replica holds
    the same learning rate, a joiner (whose learning rate came with the swarm's state)
    continues from the step it joined at, and a rollback to a checkpoint rewinds it.
    ``scheduler.step(value)`` (ReduceLROnPlateau's metric, or an explicit epoch) is passed
    through unchanged. Subclasses give ``optimizer`` and ``global_step``."""

    def __init__(self) -> None:  # (not Optimizer's: the wrapped optimizer holds the state)
        self._opt_called = False  # (what torch's schedulers read to check the call order)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        raise NotImplementedError

    def global_step(self) -> int:
        """Global steps the swarm's state has taken (as this replica holds it)."""
        raise NotImplementedError

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        raise UserError("optimizer", "add_param_group after prepare(): every replica must "
                        "hold the same parameters; build the optimizer over all of them "
                        "before session.prepare")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad`` (after a step that took the gradients, it
        clears only what a step skipped, e.g. where ``GradScaler`` found an inf)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"

    def __setattr__(self, name: str, value) -> None:
        if name == "step" and getattr(value, "_wrapped_by_lr_sched", False):
            scheduler = _scheduler_being_built()
            if scheduler is None:
                log.warning("a learning-rate scheduler built on moshray's optimizer could not "
                            "be tied to global steps (torch %s): step it only when "
                            "opt.step() returns True", torch.__version__)
            else:
                self._follow(scheduler)
        object.__setattr__(self, name, value)

    def _follow(self, scheduler) -> None:
        """Tie ``scheduler.step()`` to the swarm's global steps (see the class docstring)."""
        own_step = scheduler.step

        def step(*args, **kwargs):
            if args or kwargs:
                return own_step(*args, **kwargs)
            at = self.global_step()
            if scheduler._step_count == 0:  # its first step, in its constructor
                if at == 0:
                    return own_step()
                # Built after joining at step ``at``: the learning rate came with the state.
                scheduler.last_epoch, scheduler._step_count = at, 1
                scheduler._last_lr = [group["lr"] for group in self.param_groups]
                return None
            if at == scheduler.last_epoch:
                return None  # no global step since its last one
            scheduler.last_epoch = at - 1  # (also back, after a rollback)
            return own_step()

        scheduler.step = step


class ElasticOptimizer(SwarmOptimizer):
    """Wraps the user's optimizer (see module docstring and ``SwarmOptimizer``):
    ``loss.backward(); opt.step(); opt.zero_grad()`` once per micro-batch; ``optimizer`` is
    the wrapped one itself."""

    def __init__(self, session: "Session", optimizer: torch.optim.Optimizer):
        super().__init__()
        self.session, self._wrapped = session, optimizer

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._wrapped

    def global_step(self) -> int:
        return self.session.global_step

    def step(self, loss: torch.Tensor | None = None, samples: int | None = None) -> bool:
        """Hand this micro-batch's gradients (as the loop left them) to the step strategy
        and, if the Coordinator planned one, take a global step; True if one happened.
        ``samples`` defaults to the size of the last batch. ``loss`` (the older shorthand):
        run ``loss.backward()`` here first. ``UserError`` if there is no gradient since the
        last step (no ``loss.backward()``), or if ``loss`` is given after the loop's own
        ``loss.backward()`` (a second backward pass)."""
        s = self.session
        model = s.state.model
        value = None
        if loss is not None:
            loss = check_loss(loss)
            if _has_grad(model):
                raise UserError("optimizer", "loss.backward() was called and opt.step(loss) "
                                "would backpropagate again: write loss.backward(); "
                                "opt.step(); opt.zero_grad()")
            loss.backward()
            value = float(loss.detach())
        elif not _has_grad(model):
            raise UserError("optimizer", "opt.step() found no gradients: call "
                            "loss.backward() before each opt.step()")
        self._opt_called = True
        s.strategy.after_backward(model, self.optimizer)
        n = samples if samples is not None else s.last_batch_size
        return s.call(s.manager.after_micro_batch(n, value))


_EPOCH_WARNED: list[bool] = []


def _warn_epoch_once() -> None:
    if not _EPOCH_WARNED:
        _EPOCH_WARNED.append(True)
        import warnings

        warnings.warn("session.epoch is renamed session.global_step: it counts global steps "
                      "(training.max_epochs counts passes over the data)", DeprecationWarning,
                      stacklevel=3)


def _natural_key(peer_id: str) -> tuple:
    """``replica-2`` before ``replica-10``: digits compare as numbers."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part)
                 for part in re.split(r"(\d+)", peer_id) if part)


def leader_of(ready: Iterable[str], leaving: Iterable[str] = ()) -> str | None:
    """The leader of a swarm: the ready peer with the lowest id (digits compared as
    numbers) among those not ``leaving`` (draining); None if there is none. Pure: every
    replica that reads the same membership picks the same one, and when the leader leaves
    the next lowest takes over."""
    gone = set(leaving)
    candidates = [p for p in ready if p not in gone]
    return min(candidates, key=_natural_key) if candidates else None


def metric_values(metrics: Any) -> tuple[tuple[str, float], ...]:
    """``session.report``'s argument as ``(name, value)`` pairs; ``UserError`` unless it is
    a dict of non-empty string names (at most ``REPORTED_NAME_MAX`` characters) to numbers
    or one-element tensors. Non-finite values are left out (logged): a NaN loss is a
    training problem, not a reason to stop the job."""
    from moshray.cluster.metrics import REPORTED_NAME_MAX

    if not isinstance(metrics, dict):
        raise UserError("report", f"expected a dict of name -> number, got "
                        f"{type(metrics).__name__}")
    values = []
    for name, value in metrics.items():
        if not (isinstance(name, str) and 0 < len(name) <= REPORTED_NAME_MAX):
            raise UserError("report", f"metric names must be strings of 1 to "
                            f"{REPORTED_NAME_MAX} characters, got {name!r}")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise UserError("report", f"{name!r} is a tensor of shape "
                                f"{tuple(value.shape)}: report a number (e.g. .mean())")
            value = value.detach().item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError("report", f"{name!r} must be a number, got {type(value).__name__}")
        value = float(value)
        if not math.isfinite(value):
            log.warning("report: %r is %s, left out", name, value)
            continue
        values.append((name, value))
    return tuple(values)


class Session:
    """One replica's view of the job, for the training loop (see module docstring).

    Attributes: ``peer_id``, ``config`` (the ``TrainConfig``), ``device`` (the GPU Ray
    gave this replica, else the CPU; ``prepare`` moves the model there, ``batches`` the
    data), ``seed``, ``coordinator`` (handle, for DMoE layers), ``global_step`` (global
    steps so far; ``epoch`` is its old name), ``is_leader``. ``report(metrics)``: the
    loop's own metrics. ``autocast()``:
    mixed precision on that device."""

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
    def global_step(self) -> int:
        """Global steps the swarm has taken (as this replica holds its state)."""
        return self.state.epoch if self.state is not None else 0

    @property
    def epoch(self) -> int:
        """The old name of ``global_step`` (it counts global steps, not passes over the
        data); warns once per process."""
        _warn_epoch_once()
        return self.global_step

    @property
    def should_stop(self) -> bool:
        return self.manager.stopping

    def call(self, coroutine) -> Any:
        """Run ``coroutine`` on the replica's event loop and wait for it (loop thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                state: dict | None = None, shard: bool = False) -> ElasticOptimizer:
        """Join the swarm with these objects (see module docstring). ``state``: the user's
        extra state dict (values: anything picklable, or objects with ``state_dict`` and
        ``load_state_dict``), kept equal across replicas and in checkpoints. ``shard``:
        for replica groups (``cluster.replica = "node"``, ``group_loop.GroupSession``),
        where it shards the model over the group's ranks; a replica of one GPU holds the
        whole model, so the same loop runs here unchanged."""
        if self.state is not None:
            raise UserError("session", "prepare() was called twice: call it once per replica")
        if not isinstance(model, torch.nn.Module):
            raise UserError("model", f"expected a torch.nn.Module, got {type(model).__name__}")
        if state is not None and not isinstance(state, dict):
            raise UserError("state", f"expected a dict, got {type(state).__name__}")
        check_optimizer(model, optimizer)
        warn_early_scheduler(optimizer)
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

    def report(self, metrics: dict) -> None:
        """Record the loop's own metrics (``{name: number or one-element tensor}``) at the
        current global step (``global_step``): the last value of each name per step reaches the
        run summary (``summary["reported"][name]`` = ``{"value", "step"}``, the newest
        step's), the Prometheus gauge ``moshray_reported{name=...}``, TensorBoard event
        files in the run directory and ``fit``'s ``on_report`` callback (on the driver).
        Every replica's reports are kept: report evaluation results where
        ``is_leader``. ``"loss"`` is also the loss the console and ``final_loss`` show
        (the mean of the values reported between two global steps). Fire-and-forget;
        ``UserError`` for a bad argument (see ``metric_values``)."""
        values = metric_values(metrics)
        if values:
            self._loop.call_soon_threadsafe(self.manager.note_reported, values, self.global_step)

    @property
    def is_leader(self) -> bool:
        """Whether this replica is the swarm's leader now (``leader_of`` the Coordinator's
        ready, not draining peers): true on one live replica at a time, handed over when
        it leaves (once the Coordinator sees it gone: a notice, or its heartbeats expire).
        One call to the Coordinator: ask where you act (every N steps), not per batch.
        False if the Coordinator cannot be read (it is restarting)."""
        try:
            view = self.coordinator.peer_view.remote().future().result(LEADER_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("is_leader: membership not read (%s)", type(exc).__name__)
            return False
        return leader_of(view["ready"], view["draining"]) == self.peer_id

    def record(self, events: tuple) -> None:
        """Metrics events (``moshray.cluster.metrics``) to the Coordinator, fire-and-forget."""
        self._loop.call_soon_threadsafe(self.manager.record, tuple(events))

    def autocast(self, enabled: bool | None = None, dtype: torch.dtype = torch.bfloat16):
        """``torch.autocast`` on this replica's device: the forward pass in ``dtype``
        (bf16) where it pays. ``enabled`` None: on for a CUDA device that supports bf16,
        off on the CPU; True forces it on (CPU autocast on a CPU replica). Use it around the
        forward pass and the loss, not around the backward pass or ``opt.step``::

            with session.autocast():
                loss = model.loss(x, y)
            loss.backward()
            opt.step()

        fp16 (``dtype=torch.float16``) wants a ``torch.amp.GradScaler``:
        ``scaler.scale(loss).backward(); scaler.unscale_(opt)`` (then clip if you like)
        ``; scaler.step(opt); scaler.update(); opt.zero_grad()``. Each replica scales its
        own micro-batches; ``opt.step()`` hands on the unscaled gradients, and a
        micro-batch whose gradients were not finite is skipped by the scaler (not
        counted)."""
        if enabled is None:
            enabled = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.autocast(self.device.type, dtype=dtype, enabled=bool(enabled))
