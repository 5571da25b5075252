"""The user's own loop in a replica group: ``LoopTask``, the rank's
compute thread that can lend itself to that loop (``ComputeQueue``), and what the loop holds
on a rank (``GroupSession``, ``GroupOptimizer``) with the rank side of the driver's commands
(``LoopHost``).

With ``cluster.replica = "node"`` every rank of a group runs ``loop(session)``, the same
function as with one replica per GPU::

    def loop(session):
        torch.manual_seed(0)                       # the same initial weights on every rank
        model = Net()
        opt = session.prepare(model, torch.optim.AdamW(model.parameters(), 1e-3), shard=True)
        for x, y in session.batches():             # this rank's rows of each step's batch
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()                             # the swarm decides; True: a step happened
            opt.zero_grad()
            session.report({"loss": loss})

``prepare(model, optimizer, shard=True)`` moves the model to the rank's device, makes every
rank start from rank 0's weights, and shards it over the group's ranks with FSDP2
(``fully_shard``; ``shard=False``: every rank holds all of it and the ranks' gradients are
all-reduced in ``opt.step()``, as DDP does). The optimizer is rebuilt over the sharded
parameters with the same class, parameter groups and settings (``opt.optimizer`` is the
one that steps: give it to learning-rate schedulers).

Inversion of control. The driver (``group_swarm.py``) decides every step; the loop is the
user's. The loop runs *in the rank's compute thread* (``ComputeQueue``), and parks at two
points, ``next(session.batches())`` and ``opt.step()``, where that thread runs the calls the
driver queued meanwhile (averaging, donating or loading shard state, the consistency read),
in order: so every torch operation of the rank still runs in one thread in call order (the
rule of ``GroupRank``). ``batches()`` yields when the driver asks for gradients of step
``s`` (``grads``: one batch, this rank's rows of the group's part of ``batch(s)``) or for a
local SGD round (``local``: ``count`` batches, each a local optimizer step in
``opt.step()``). In collaborative mode ``opt.step()`` hands the gradients to the driver and
parks until the group's vote on the averaged step (True when it was applied) or until the
driver moves on without it (False).

Failure behaviour. A loop that raises (or returns) fails the command in flight and every
later one with ``GroupError`` naming the rank and the exception, so the driver closes the
group (``group_swarm.py``: it is rebuilt, ``max_strikes`` times per node); a ``UserError``
(bad input: no rebuilt group gets past it) ends the job at once with it. ``UserError``
(one line) for misuse: ``prepare`` twice or after ``batches()``, ``batches()`` before
``prepare``, ``opt.step()`` outside a batch or twice for one batch, an extra state dict
(not carried by groups). Every park is bounded: ``GroupConfig.timeout_s`` x
``IDLE_FACTOR`` with no command from the driver ends the loop with ``GroupError``.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from moshray.actors.errors import UserError
from moshray.actors.replica.group_averaging import (
    BatchPart, GradReport, LocalReport, rank_rows,
)
from moshray.actors.replica.group_spec import GroupError, rank_slice
from moshray.actors.replica.session import SwarmOptimizer, _warn_epoch_once

if TYPE_CHECKING:
    from moshray.actors.replica.group_rank import GroupRank

IDLE_FACTOR = 10  # a parked loop waits at most timeout_s x this for the driver's next command
USER_ERROR_MARK = "the loop raised UserError: "  # in a GroupError: bad input, ends the job


LOOP_RAISED_MARK = "the loop raised "  # in a GroupError: the user's loop raised this


def loop_error_in(text: str) -> str | None:
    """What the user's loop raised, as a group failure's text reports it (``LoopHost``):
    ``"ValueError: ..."``, or None when the failure is not the loop's."""
    at = text.find(LOOP_RAISED_MARK)
    return " ".join(text[at + len(LOOP_RAISED_MARK):].split()) if at >= 0 else None


def user_error_in(text: str) -> UserError | None:
    """The ``UserError`` a group failure's text reports (``LoopHost``), or None: bad input
    that no rebuilt group would get past, so the job ends at once (``group_swarm.py``)."""
    at = text.find(USER_ERROR_MARK)
    if at < 0:
        return None
    what, _, message = text[at + len(USER_ERROR_MARK):].partition(": ")
    return UserError(what.strip() or "loop", message.splitlines()[0] if message else what)


@dataclass(frozen=True)
class LoopTask:
    """What a loop-driven group trains: ``loop(session)`` (the user's function, run by every
    rank) and ``batch(step)``, the *global* batch of ``step`` (a tuple of tensors whose first
    dimension divides among the groups x ranks of a step; ``moshray.data.by_step``). Both
    travel to the ranks by pickle."""

    loop: Callable[[Any], Any]
    batch: Callable[[int], tuple]

    def __post_init__(self) -> None:
        for name in ("loop", "batch"):
            if not callable(getattr(self, name)):
                raise UserError(name, f"expected a function, got "
                                f"{type(getattr(self, name)).__name__}")


class LoopStopped(BaseException):
    """Raised inside a parked loop when its rank closes (not an ``Exception``: a loop's own
    ``except Exception`` does not swallow it)."""


class ComputeQueue:
    """A rank's one compute thread: ``submit(fn, *args)`` runs calls in order and returns a
    ``concurrent.futures.Future``. A long call (the user's loop) may park inside it with
    ``serve_until``, which runs the queued calls in that same thread until a condition
    holds. ``shutdown`` ends the thread after the calls before it (a parked loop gets
    ``LoopStopped``)."""

    _STOP = object()

    def __init__(self, name: str, initializer: Callable[[], Any] | None = None):
        self._q: queue.Queue = queue.Queue()
        self._initializer = initializer
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args: Any) -> Future:
        future: Future = Future()
        self._q.put((future, fn, args))
        return future

    def in_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while True:
            item = self._q.get()
            if item is self._STOP:
                return
            self._run(item)

    @staticmethod
    def _run(item) -> None:
        future, fn, args = item
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(exc)

    def serve_until(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Run queued calls here (the compute thread, parked) until ``done()``; ``GroupError``
        after ``timeout_s`` without it, ``LoopStopped`` at shutdown."""
        if not self.in_thread():
            raise RuntimeError("serve_until outside the compute thread")
        deadline = time.monotonic() + timeout_s
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise GroupError(f"{what}: no command from the driver within {timeout_s:g} s")
            try:
                item = self._q.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if item is self._STOP:
                self._q.put(self._STOP)  # the thread's own loop ends on it too
                raise LoopStopped()
            self._run(item)

    def shutdown(self) -> None:
        self._q.put(self._STOP)


@dataclass
class _Command:
    """One command of the driver to the loop, and the future its answer goes to."""

    kind: str  # "grads" | "local"
    step: int  # grads: the step; local: the first step of the round
    count: int  # local: the round's steps; grads: 1
    part: BatchPart
    reply: Future
    done: int = 0  # batches handed out
    stepped: int = 0  # opt.step() calls taken for them
    rows: int = 0
    t0: float = 0.0


class LoopHost:
    """The rank side of a loop-driven group (see module docstring). It lives in the
    ``GroupRank`` actor; every method but ``command`` runs in the compute thread."""

    def __init__(self, rank: GroupRank, task: LoopTask):
        self.rank, self.task = rank, task
        self.pending: _Command | None = None  # accepted, not yet handed to the loop
        self.current: _Command | None = None  # the loop is on it
        self.applied: bool | None = None  # the group's vote on the step opt.step() waits for
        self.ended: str | None = None  # why the loop is over (it raised or returned)
        self.last_loss = math.nan
        self.session = GroupSession(self)
        self.finished = rank._compute.submit(self._run_loop)

    @property
    def idle_s(self) -> float:
        return self.rank.settings.timeout_s * IDLE_FACTOR

    def _run_loop(self) -> None:
        try:
            self.task.loop(self.session)
            self.ended = f"rank {self.rank.rank}: the loop returned while the swarm trains"
        except LoopStopped:
            self.ended = f"rank {self.rank.rank}: closed"
        except UserError as exc:  # one line: the swarm ends the job with it (user_error_in)
            self.ended = f"rank {self.rank.rank}: {USER_ERROR_MARK}{exc}"
        except BaseException as exc:  # noqa: BLE001 - the driver hears it as a GroupError
            self.ended = f"rank {self.rank.rank}: the loop raised {type(exc).__name__}: {exc}"
        for cmd in (self.pending, self.current):
            if cmd is not None and not cmd.reply.done():
                cmd.reply.set_exception(GroupError(self.ended))
        self.pending = self.current = None

    def command(self, kind: str, step: int, count: int, part: BatchPart) -> Future:
        """Queue a command (from the actor's event loop); its future answers with a
        ``GradReport`` / ``LocalReport`` or fails with ``GroupError``."""
        cmd = _Command(kind, step, count, part, Future())
        self.rank._compute.submit(self._accept, cmd)
        return cmd.reply

    def _accept(self, cmd: _Command) -> None:
        if self.ended is not None:
            cmd.reply.set_exception(GroupError(self.ended))
            return
        held = self.rank.step
        if cmd.step != held:
            cmd.reply.set_exception(GroupError(
                f"rank {self.rank.rank}: asked for {cmd.kind} at step {cmd.step}, holds step "
                f"{held}"))
            return
        if self.current is not None:  # the driver moved on without averaging it
            self.current = None
        self.pending = cmd

    def park(self, done: Callable[[], bool], what: str) -> None:
        self.rank._compute.serve_until(done, self.idle_s, f"rank {self.rank.rank}: {what}")

    # -- what the session calls (in the loop) -----------------------------------------------

    def next_batch(self) -> tuple:
        """The next batch the driver asked for (parks until there is one)."""
        cmd = self.current
        if cmd is not None and cmd.stepped < cmd.done:
            raise UserError("loop", "session.batches() was asked for the next batch before "
                            "opt.step() of the last one: call loss.backward(); opt.step() "
                            "once per batch")
        if cmd is None or cmd.done >= cmd.count:
            self.current = None
            self.park(lambda: self.pending is not None, "waiting for the next step")
            cmd, self.pending, self.current = self.pending, None, self.pending
            cmd.t0 = time.perf_counter()
            if cmd.kind == "local":
                self.rank.round_start()
            if self.rank.opt is not None:
                self.rank.opt.zero_grad(set_to_none=True)
            self.rank.grads_of = None
        index, parts = rank_rows(cmd.part, self.rank.rank, self.rank.settings.world_size)
        batch = rank_slice(self.task.batch(cmd.step + cmd.done), index, parts)
        cmd.done += 1
        cmd.rows += int(batch[0].shape[0])
        return tuple(t.to(self.rank.device) for t in batch)

    def step(self, loss: Any = None) -> bool:
        """``opt.step()``: see ``GroupOptimizer.step``."""
        from moshray.actors.replica.session import _has_grad, check_loss

        cmd, rank = self.current, self.rank
        if cmd is None or cmd.stepped >= cmd.done:
            raise UserError("optimizer", "opt.step() outside a batch of session.batches() or "
                            "twice for one batch: call it once after each loss.backward()")
        if isinstance(loss, torch.Tensor):  # the shorthand, as Session's: backward here
            loss = check_loss(loss)
            if _has_grad(rank.model):
                raise UserError("optimizer", "loss.backward() was called and opt.step(loss) "
                                "would backpropagate again: write loss.backward(); "
                                "opt.step(); opt.zero_grad()")
            loss.backward()
        elif not _has_grad(rank.model):
            raise UserError("optimizer", "opt.step() found no gradients: call "
                            "loss.backward() before each opt.step()")
        if loss is not None:
            self.last_loss = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        if rank.settings.parallel == "ddp":  # every rank holds the model: mean the gradients
            import torch.distributed as dist

            world = rank.settings.world_size
            for p in rank.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
        cmd.stepped += 1
        if cmd.kind == "local":
            rank.opt.step()
            rank.opt.zero_grad(set_to_none=True)
            rank.step += 1
            if cmd.stepped == cmd.count:
                cmd.reply.set_result(LocalReport(rank.rank, cmd.step, cmd.count,
                                                 self.last_loss, cmd.rows,
                                                 time.perf_counter() - cmd.t0))
            return True
        rank.grads_of = cmd.step
        self.applied = None
        cmd.reply.set_result(GradReport(rank.rank, cmd.step, self.last_loss, cmd.rows))
        self.park(lambda: self.applied is not None or self.pending is not None,
                  "waiting for the averaged step")
        applied, self.applied = bool(self.applied), None
        self.current = None
        return applied

    def voted(self, applied: bool) -> None:
        """The group's vote on an averaging (``GroupRank._vote_then``)."""
        self.applied = applied


class GroupOptimizer(SwarmOptimizer):
    """What ``GroupSession.prepare`` returns: a ``torch.optim.Optimizer`` in torch's idiom
    (``session.SwarmOptimizer``: ``param_groups``, ``state_dict``, schedulers tied to the
    group's steps); ``optimizer`` is the rank's own optimizer over its shard."""

    def __init__(self, host: LoopHost):
        super().__init__()
        self._host = host

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._host.rank.opt

    def global_step(self) -> int:
        return self._host.rank.step

    def step(self, loss: torch.Tensor | float | None = None) -> bool:
        """After ``loss.backward()``. Collaborative: hand the gradients to the swarm and wait
        for the averaged step; True if the group applied it, False if the swarm went on
        without this group (the gradients are dropped). Local SGD: one local optimizer step
        (True). ``loss``: as ``ElasticOptimizer.step``'s shorthand, a loss tensor is
        backpropagated here (``UserError`` after the loop's own backward); a number is only
        recorded. The swarm's loss figures take it, else the last ``session.report``.
        ``UserError`` when there are no gradients."""
        self._opt_called = True
        return self._host.step(loss)


def rebuild_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str],
                      model: torch.nn.Module) -> torch.optim.Optimizer:
    """The same optimizer class, parameter groups and settings over ``model``'s parameters
    now (FSDP2 replaces them by sharded ones); ``names`` maps the old parameters' ids to
    their names. ``UserError`` when the class cannot be rebuilt that way."""
    now = dict(model.named_parameters())
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [now[names[id(p)]] for p in g["params"]]}
              for g in optimizer.param_groups]
    import inspect

    try:  # the settings its constructor takes (``defaults`` may hold more, e.g. AdamW's)
        takes = inspect.signature(type(optimizer)).parameters
        return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items()
                                          if k in takes})
    except (TypeError, ValueError) as exc:
        raise UserError("optimizer", f"{type(optimizer).__name__} cannot be rebuilt over the "
                        f"sharded parameters ({exc}); use a torch.optim optimizer") from None


class GroupSession:
    """One rank's view of a loop-driven group (see module docstring). Attributes: ``rank``,
    ``world_size``, ``device``, ``global_step`` (the group's optimizer steps so far;
    ``epoch`` is its old name)."""

    def __init__(self, host: LoopHost):
        self._host = host
        self.rank = host.rank.rank
        self.world_size = host.rank.settings.world_size
        self.device = host.rank.device
        self._started = False

    @property
    def global_step(self) -> int:
        """The group's optimizer steps so far."""
        return self._host.rank.step

    @property
    def epoch(self) -> int:
        """The old name of ``global_step``; warns once per process."""
        _warn_epoch_once()
        return self.global_step

    @property
    def is_leader(self) -> bool:
        """Rank 0 of every group (groups hold the same model after each averaged step)."""
        return self.rank == 0

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                state: dict | None = None, shard: bool = True) -> GroupOptimizer:
        """Move ``model`` to the rank's device, start every rank from rank 0's weights and
        shard it (``shard``) or replicate it over the group; returns the optimizer wrapper
        (see module docstring)."""
        from moshray.actors.replica.group_rank import shard_model
        from moshray.actors.replica.session import check_optimizer, warn_early_scheduler
        import torch.distributed as dist

        rank = self._host.rank
        if rank.model is not None or self._started:
            raise UserError("session", "prepare() was called twice or after batches(): call "
                            "it once, before session.batches()")
        if state is not None:
            raise UserError("state", "replica groups do not carry an extra state dict: keep "
                            "such values in the model (buffers) or use one replica per GPU")
        if not isinstance(model, torch.nn.Module):
            raise UserError("model", f"expected a torch.nn.Module, got {type(model).__name__}")
        check_optimizer(model, optimizer)
        warn_early_scheduler(optimizer)
        names = {id(p): n for n, p in model.named_parameters()}
        model.to(rank.device)
        with torch.no_grad():
            for t in model.state_dict().values():
                dist.broadcast(t, src=0)
        parallel = "fsdp" if shard else "ddp"
        rank.use_parallel(parallel)
        if shard:
            rank.module = shard_model(model, parallel, rank.device)
            optimizer = rebuild_optimizer(optimizer, names, model)
        else:
            rank.module = model
        rank.model, rank.opt = model, optimizer
        rank.optimizer_name, rank.step = type(optimizer).__name__.lower(), 0
        return GroupOptimizer(self._host)

    def batches(self):
        """This rank's rows of every batch the swarm asks the group for (see module
        docstring), on the rank's device, until the rank closes."""
        if self._host.rank.model is None:
            raise UserError("session", "call session.prepare(model, optimizer) before "
                            "session.batches()")
        self._started = True
        while True:
            yield self._host.next_batch()

    def report(self, metrics: dict) -> None:
        """Record the loop's metrics; ``"loss"`` is the loss the swarm's figures show."""
        from moshray.actors.replica.session import metric_values

        for name, value in metric_values(metrics):
            if name == "loss":
                self._host.last_loss = float(value)

    def autocast(self, enabled: bool | None = None, dtype: torch.dtype = torch.bfloat16):
        """``torch.autocast`` on the rank's device (on for CUDA with bf16 when None)."""
        if enabled is None:
            enabled = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.autocast(self.device.type, dtype=dtype, enabled=bool(enabled))


def _task_loop(task, shard: bool, session: GroupSession) -> None:
    from moshray.actors.replica.group_spec import OPTIMIZERS

    model = task.build_model()
    opt = session.prepare(model, OPTIMIZERS[task.optimizer](model.parameters(), lr=task.lr),
                          shard=shard)
    for batch in session.batches():
        with session.autocast(task.amp):
            loss = task.loss(model, batch)
        opt.step(loss)  # backward here, and the loss for the swarm's figures
        opt.zero_grad()


def loop_of(task, shard: bool = True) -> LoopTask:
    """A ``GroupTask``'s model, loss and optimizer as a loop (``moshray train`` with
    ``cluster.replica = "node"`` trains the built-in LM this way)."""
    import functools

    return LoopTask(functools.partial(_task_loop, task, shard), task.batch)
