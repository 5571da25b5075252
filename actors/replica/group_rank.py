"""The rank actor of a replica group: ``GroupRank``, one process of the group's
``torch.distributed`` process group holding its shard of the model (FSDP2) or all of it
(DDP), and the averaging peer ``"<group>/r<rank>"`` of the same rank of other groups
(group_averaging.py). The driver reaches it through ``ReplicaGroup`` (group.py) and the
functions of group_together.py; its threading rule is in the class docstring.

Rendezvous: rank 0 picks its address and a free port and returns them through a Ray call
(``rendezvous``); every rank then joins ``tcp://address:port`` (``join``), bounded by
``GroupConfig.timeout_s``, as is each collective. The ranks keep their model, optimizer and
step between calls: ``train`` goes on from there (from step 0 with the task's model on the
first call), so a group resumed from a checkpoint at step s trains the batches s, s+1, ...
and equals one process that never stopped.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import time
from collections.abc import Callable
import dataclasses
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

import moshray.cluster.collective.inline as inline
from moshray.cluster.collective.averager import Averager, AveragingError, flatten, unflatten
from moshray.cluster.messages import Contribution, PartResult, RoundPlan

from moshray.actors.replica.group_averaging import (
    BatchPart, GradReport, JoinAnswer, LocalReport, RankStep, ShardHandoff, averaged_tensors,
    fill_local_state, incomplete, layout_difference, local_part, local_state,
    parameter_tensors, rank_peer_id, rank_rows, shard_layout, state_digest, write_averaged,
)
from moshray.actors.replica.group_loop import ComputeQueue, LoopHost, LoopTask
from moshray.actors.replica.group_checkpoint import (
    CheckpointAnswer, CheckpointError, CheckpointManifest, exists as checkpoint_exists, fetch,
    first_difference, is_remote, load_state, local_staging, read_manifest, save_state,
    state_shapes, verify_files,
)
from moshray.actors.replica.group_spec import (
    OPTIMIZERS, GroupConfig, GroupError, GroupTask, RankMemory, RankReport, Rendezvous,
    digest, rank_slice,
)

_local = local_part  # the part of a parameter this rank holds


def _nbytes(tensors) -> int:
    return sum(local_part(t).numel() * t.element_size() for t in tensors
               if isinstance(t, torch.Tensor))


def _full(t: torch.Tensor) -> torch.Tensor:
    """The unsharded value (a collective for a DTensor: every rank must call in order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def shard_model(model: torch.nn.Module, parallel: str, device: torch.device):
    """``model`` (on ``device``) wrapped for the process group: FSDP2 shards every child of
    each ``nn.ModuleList`` (the transformer blocks) and then the root, so tied parameters
    (embedding and head) stay together in the root's group; DDP replicates. Returns the
    module to call (the DDP wrapper, or the model itself under FSDP2)."""
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index or 0] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    from torch.distributed.device_mesh import init_device_mesh

    # The rank's own device type: without a mesh FSDP2 picks CUDA whenever it is visible,
    # and would move a CPU rank's shards onto a GPU Ray never gave it.
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for child in module:
                if any(True for _ in child.parameters()):
                    fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@ray.remote
class GroupRank:
    """One rank of a ``ReplicaGroup``: a process of the group's ``torch.distributed``
    process group, and the averaging peer ``"<group>/r<rank>"`` of the same rank of other
    groups (group_averaging.py). Its device is the GPU Ray gave it (``cuda``), else the CPU.

    Threading rule. The actor is asyncio: Ray runs every call on its event loop, and the
    loop only ever waits. It runs the ``Averager`` (a Moshpit round with the same rank of
    the other groups) and takes its transport calls (``receive_contribution``,
    ``receive_result``, the probes among them), and it awaits object refs. Every torch
    operation (building and sharding the model, forward and backward, the process group's
    collectives, the optimizer, state dicts) runs in the rank's one compute thread
    (``_compute``), one call after the other in the order the calls came. So:

    - a rank blocked in a collective of its own group (a slow or dead rank beside it) still
      takes other groups' contributions and answers their probes: their rounds go on, and
      fail over only if this rank never contributes, within their deadline;
    - a round never waits behind compute, and compute never behind a round: the averaging
      phase hands the compute thread a flat copy of the gradients and takes the average
      back;
    - the group's collectives are issued from one thread, in call order, which the driver
      keeps the same on every rank; the averager's state is touched only on the loop.
    """

    def __init__(self, rank: int, config: GroupConfig):
        # Not ``self.config``: cloudpickle ships this class by value and would take a method
        # naming both ``dist`` and ``config`` for a use of torch.distributed.config.
        self.rank, self.settings = rank, config
        self.gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
        cuda = bool(self.gpu_ids) and torch.cuda.is_available()
        self.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        # The current CUDA device is per thread: the compute thread sets its own.
        self._compute = ComputeQueue(
            f"rank{rank}-compute",
            initializer=(lambda: torch.cuda.set_device(self.device)) if cuda else None)
        self.averager = Averager(rank_peer_id(config.name, rank), job_key=config.job_key)
        self.backend: str | None = None
        # What the rank holds between calls (train, full_state, save/load_sharded): the
        # model (sharded in place under FSDP2), the module to call (the DDP wrapper or the
        # model), its optimizer and the next step to train; ``grads_of``: the step whose
        # gradients the model holds for averaging (None: none).
        self.model: torch.nn.Module | None = None
        self.module = None
        self.opt: torch.optim.Optimizer | None = None
        self.optimizer_name = ""
        self.step = 0
        self.grads_of: int | None = None
        # DiLoCo's outer step (``GroupConfig.outer_lr``): the parameter shards at the start
        # of the local SGD round (the last average) and the outer momentum, per parameter.
        self.anchor: list[torch.Tensor] | None = None
        self.outer_m: list[torch.Tensor] | None = None
        # A loop-driven group (group_loop.py): the user's loop, run in the compute thread
        # from the first command of a ``LoopTask`` on.
        self.host: LoopHost | None = None

    async def _run(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` in the compute thread (see the class docstring); with a loop
        running there, at its next park (group_loop.py)."""
        return await asyncio.wrap_future(self._compute.submit(fn, *args))

    def _host(self, task: LoopTask) -> LoopHost:
        """The loop of ``task``, started in the compute thread on first use."""
        if self.host is None:
            self.host = LoopHost(self, task)
        return self.host

    async def _command(self, task: LoopTask, kind: str, step: int, count: int,
                       part: BatchPart):
        """A loop-driven group's gradient phase (``grads``) or inner steps (``local``),
        carried out by the user's loop (group_loop.py)."""
        return await asyncio.wrap_future(self._host(task).command(kind, step, count, part))

    def use_parallel(self, parallel: str) -> None:
        """The loop chose FSDP2 or replication in ``session.prepare`` (compute thread)."""
        self.settings = dataclasses.replace(self.settings, parallel=parallel)

    def _hold(self, task: GroupTask, model: torch.nn.Module) -> None:
        """Shard ``model`` (built from ``task``, on this rank's device) and keep it with a
        fresh optimizer at step 0."""
        self.module = shard_model(model, self.settings.parallel, self.device)
        self.model = model
        self.opt = OPTIMIZERS[task.optimizer](model.parameters(), lr=task.lr)
        self.optimizer_name, self.step = task.optimizer, 0

    def _build(self, task: GroupTask | LoopTask) -> None:
        """Hold the task's model (built at step 0) if none is held; a loop builds its own
        in ``session.prepare``, which it must have called by now."""
        if self.model is not None:
            return
        if isinstance(task, LoopTask):
            why = self.host.ended if self.host is not None and self.host.ended else \
                "the loop has not called session.prepare(model, optimizer)"
            raise GroupError(f"rank {self.rank}: no model: {why}")
        self._hold(task, task.build_model().to(self.device))

    def _held(self, what: str) -> None:
        if self.model is None:
            raise GroupError(f"rank {self.rank}: {what}() before train() or load_sharded()")

    def describe(self) -> dict:
        return {"rank": self.rank, "device": str(self.device), "gpu_ids": self.gpu_ids,
                "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "peer": self.averager.peer_id}

    def rendezvous(self) -> Rendezvous:
        """Rank 0: this node's address and a port free on it now."""
        address = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((address, 0))
            return Rendezvous(address, sock.getsockname()[1])

    # -- transport of the averaging (on the loop) ------------------------------------------

    async def receive_contribution(self, c: Contribution, *chunks) -> None:
        """A member's contribution; ``chunks``: its inline bytes (``collective/inline.py``)."""
        self.averager.deliver_contribution(inline.join(c, chunks))

    async def receive_result(self, r: PartResult, *chunks) -> None:
        """A part's result; ``chunks``: its inline bytes (``collective/inline.py``)."""
        self.averager.deliver_result(inline.join(r, chunks))

    # -- the process group and training (in the compute thread) ----------------------------

    async def join(self, where: Rendezvous, backend: str) -> str:
        """Join the process group (bounded by ``timeout_s``); returns the backend."""
        return await self._run(self._join, where, backend)

    def _join(self, where: Rendezvous, backend: str) -> str:
        if where.address.startswith("127."):  # gloo would pick the host's first interface
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(max(1, int(self.settings.cpus_per_rank)))
        dist.init_process_group(
            backend, init_method=where.url, rank=self.rank, world_size=self.settings.world_size,
            timeout=timedelta(seconds=self.settings.timeout_s),
            device_id=self.device if backend == "nccl" else None)
        self.backend = backend
        return backend

    def _forward_backward(self, task: GroupTask, batch: tuple) -> float:
        """Forward and backward on this rank's ``batch``; the mean loss over the group's
        ranks (a collective). FSDP2 reduce-scatters the gradients, DDP all-reduces them:
        each rank holds the mean over the group's rows of its shard's (DDP: all) gradients."""
        batch = tuple(t.to(self.device) for t in batch)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=task.amp):
            loss = task.loss(self.module, batch)
        loss.backward()
        mean = loss.detach().float().reshape(1) / self.settings.world_size
        dist.all_reduce(mean)
        return float(mean)

    async def train(self, task: GroupTask) -> RankReport:
        """Train ``task.steps`` steps on this rank's share of every batch, from the model,
        optimizer and step held (built from ``task`` at step 0 when none is held; the task's
        model, optimizer and lr are not used otherwise). Every rank calls this."""
        if isinstance(task, LoopTask):
            raise GroupError(f"rank {self.rank}: train() runs a GroupTask; a loop trains "
                             f"under the swarm (group_swarm.py)")
        return await self._run(self._train, task)

    def _own_steps(self, task: GroupTask, count: int, part: BatchPart
                   ) -> tuple[list[float], list[float], int]:
        """``count`` optimizer steps of this group alone from the step held, on this rank's
        rows of the group's ``part`` of each step's batch (a model built from ``task`` at
        step 0 when none is held). Returns the losses, the seconds of every step after the
        first (which pays for warm-up: allocations, kernels, connections) and the rows
        trained."""
        self._build(task)
        opt, first = self.opt, self.step
        losses, seconds, rows = [], [], 0
        opt.zero_grad(set_to_none=True)  # gradients a collaborative step left are not ours
        self.grads_of = None
        index, parts = rank_rows(part, self.rank, self.settings.world_size)
        for step in range(first, first + count):
            t0 = time.perf_counter()
            batch = rank_slice(task.batch(step), index, parts)
            losses.append(self._forward_backward(task, batch))
            rows += int(batch[0].shape[0])
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step > first:
                seconds.append(time.perf_counter() - t0)
            self.step = step + 1
        return losses, seconds, rows

    def _train(self, task: GroupTask) -> RankReport:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        losses, seconds, _ = self._own_steps(task, task.steps, BatchPart(0, 1))
        model = self.model
        held = [_local(p) for p in model.parameters()]
        full = self._full_params()
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" \
            else None
        return RankReport(self.rank, str(self.device), self.backend or "?", tuple(losses),
                          digest(held), sum(t.numel() for t in held),
                          digest(full.values()), tuple(seconds), peak)

    # -- a collaborative step with other groups (group_averaging.py) -----------------------

    async def compute_grads(self, task: GroupTask, step: int, part: BatchPart) -> GradReport:
        """The gradient phase of collaborative step ``step``: forward and backward on this
        rank's rows of the group's ``part`` of ``task.batch(step)``, keeping the gradients
        for ``average_and_apply``. Builds the model from ``task`` at step 0 when none is
        held. ``GroupError`` when the rank holds another step. Every rank calls this. A
        ``LoopTask``: the user's loop computes them (group_loop.py)."""
        if isinstance(task, LoopTask):
            return await self._command(task, "grads", step, 1, part)
        return await self._run(self._compute_grads, task, step, part)

    def _compute_grads(self, task: GroupTask, step: int, part: BatchPart) -> GradReport:
        self._build(task)
        if step != self.step:
            raise GroupError(f"rank {self.rank}: asked for the gradients of step {step}, "
                             f"holds step {self.step}")
        self.opt.zero_grad(set_to_none=True)  # a step that was not applied leaves some
        self.grads_of = None
        index, count = rank_rows(part, self.rank, self.settings.world_size)
        batch = rank_slice(task.batch(step), index, count)
        loss = self._forward_backward(task, batch)
        self.grads_of = step
        return GradReport(self.rank, step, loss, int(batch[0].shape[0]))

    async def average_and_apply(self, plan: RoundPlan, weight: float) -> RankStep:
        """The averaging phase: average this rank's local gradients (and float buffers) with
        the plan's peers (the same rank of the other groups), weighted by ``weight`` (the
        group's samples), within the round timeout; then the group's ranks vote, and each
        applies one optimizer step with the averaged gradient only if every rank of the
        group got the whole plan's average (``incomplete``). Either way the gradients are
        dropped. A rank that holds no gradients of its step (no ``compute_grads`` since)
        votes no without averaging; an averaging that raises is voted down, then raised:
        the other ranks are never left waiting in the vote."""
        return await self._average(plan, weight, self._flat_grads, self._apply_averaged)

    async def _average(self, plan: RoundPlan, weight: float, take: Callable,
                       put: Callable) -> RankStep:
        """One averaging phase: ``take()`` (compute thread) gives ``(step, flat values)``
        or ``(step, None)`` when there is nothing to average; the Averager averages them
        over ``plan`` on the loop; ``put(averaged or None, reason)`` (compute thread) runs
        the group's vote and writes only on a yes. An averaging that raises is voted down
        first, then raised: the other ranks are never left waiting in the vote."""
        t0 = time.perf_counter()
        step, flat = await self._run(take)
        averaged, contributors, failure = None, (), None
        reason = None if flat is not None else \
            f"rank {self.rank}: nothing of step {step} to average (no model, or no " \
            f"gradients held: compute_grads first)"
        try:
            if flat is not None:
                (averaged,), report = await self.averager.all_reduce(
                    [flat], weight, plan, self.settings.averaging_timeout_s)
                reason, contributors = incomplete(report, plan), report.contributors
        except AveragingError as exc:  # the step errored: nothing of it is applied
            reason = str(exc)
        except Exception as exc:  # noqa: BLE001 - voted down first, raised below
            reason, failure = f"{type(exc).__name__}: {exc}", exc
        applied, reason = await self._run(put, averaged if reason is None else None, reason)
        if failure is not None:
            raise failure
        return RankStep(self.rank, step, applied, reason, tuple(contributors),
                        0 if flat is None else int(flat.size), time.perf_counter() - t0)

    # -- a local SGD round with other groups (group_averaging.py) ---------------------------

    async def local_steps(self, task: GroupTask, first: int, count: int,
                          part: BatchPart) -> LocalReport:
        """The inner phase of a local SGD round: ``count`` steps of this group alone, with
        its own optimizer, on this rank's rows of the group's ``part`` of the batches of
        steps ``first`` .. ``first + count - 1``. ``GroupError`` when the rank holds another
        step than ``first``. Every rank calls this. A ``LoopTask``: the user's loop takes
        the steps (group_loop.py)."""
        if isinstance(task, LoopTask):
            return await self._command(task, "local", first, count, part)
        return await self._run(self._local_steps, task, first, count, part)

    def _local_steps(self, task: GroupTask, first: int, count: int,
                     part: BatchPart) -> LocalReport:
        if first != (self.step if self.model is not None else 0):
            raise GroupError(f"rank {self.rank}: asked for local steps from step {first}, "
                             f"holds step {self.step}")
        t0 = time.perf_counter()
        self.round_start()
        losses, _, rows = self._own_steps(task, count, part)
        return LocalReport(self.rank, first, count, losses[-1], rows, time.perf_counter() - t0)

    async def average_params(self, plan: RoundPlan, weight: float) -> RankStep:
        """The averaging phase of a local SGD round: average this rank's parameter shard
        (and float buffers; ``parameter_tensors``) with the plan's peers, weighted by
        ``weight``; the group's ranks vote and write the average only if every rank got
        the whole plan's (as ``average_and_apply``). The optimizer state is left as it is.
        Not written, the parameters stay those of the inner steps, so a round whose
        average failed may be averaged again (a fresh epoch) with fewer groups."""
        return await self._average(plan, weight, self._flat_params, self._write_params)

    def _flat_params(self) -> tuple[int, Any]:
        if self.model is None:
            return self.step, None
        return self.step, flatten(parameter_tensors(self.model))

    def round_start(self) -> None:
        """A local SGD round begins (compute thread): with an outer step, keep the shards
        it starts from (the last average) unless they are kept already."""
        if self.settings.outer_lr is not None and self.anchor is None \
                and self.model is not None:
            self.anchor = [_local(p.detach()).clone() for p in self.model.parameters()]

    def _write_params(self, averaged: Any, reason: str | None) -> tuple[bool, str | None]:
        def write() -> None:
            targets = parameter_tensors(self.model)
            values = unflatten(averaged, targets)
            if self.settings.outer_lr is not None and self.anchor is not None:
                values = self._outer_step(values)
            write_averaged(self.model, values, targets)
            if self.settings.outer_lr is not None:  # the next round starts from here
                self.anchor = [_local(p.detach()).clone() for p in self.model.parameters()]

        return self._vote_then(averaged, reason, write)

    def _outer_step(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """DiLoCo's outer Nesterov step on this rank's shards: the outer gradient is the
        round's start minus the average, ``m = mu m + g``, ``start - lr (g + mu m)``. Every
        group holds the same start, average and momentum, so all stay bitwise equal. Buffers
        (after the parameters in ``values``) take the average as it is."""
        lr, mu = self.settings.outer_lr, self.settings.outer_momentum
        n = len(self.anchor)
        if self.outer_m is None:
            self.outer_m = [torch.zeros_like(a) for a in self.anchor]
        out = []
        for start, avg, m in zip(self.anchor, values[:n], self.outer_m):
            g = start - avg.to(start.dtype)
            m.mul_(mu).add_(g)
            out.append(start - lr * (g + mu * m))
        return out + list(values[n:])

    def _outer_state(self) -> dict[str, Any] | None:
        return None if self.outer_m is None else {"m": [t.clone() for t in self.outer_m]}

    def _flat_grads(self) -> tuple[int, Any]:
        """(step, the values to average as one float32 vector), or (step, None) when the
        model holds no gradients of this rank's step."""
        if self.model is None or self.grads_of != self.step:
            return self.step, None
        return self.step, flatten(averaged_tensors(self.model))

    def _apply_averaged(self, averaged: Any, reason: str | None) -> tuple[bool, str | None]:
        """The group's vote, then the step with the averaged gradients on a yes."""
        def step() -> None:
            write_averaged(self.model, unflatten(averaged, averaged_tensors(self.model)))
            self.opt.step()
            self.step += 1

        return self._vote_then(averaged, reason, step)

    def _vote_then(self, averaged: Any, reason: str | None,
                   write: Callable[[], None]) -> tuple[bool, str | None]:
        """The group's vote (a collective: yes when this rank holds the whole average),
        then ``write()`` if every rank voted yes; the gradients are dropped either way."""
        votes = torch.tensor([0 if averaged is None else 1], device=self.device)
        dist.all_reduce(votes, op=dist.ReduceOp.MIN)
        applied = bool(votes.item())
        if applied:
            write()
        elif reason is None:
            reason = "another rank of the group did not get the whole average"
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)
        self.grads_of = None
        if self.host is not None:
            self.host.voted(applied)
        return applied, reason

    # -- state ------------------------------------------------------------------------------

    def _full_params(self) -> dict[str, torch.Tensor]:
        return {k: _full(p.detach()).cpu() for k, p in self.model.named_parameters()}

    async def memory(self) -> RankMemory:
        """What this rank holds now (see ``RankMemory``); not a collective."""
        return await self._run(self._memory)

    def _memory(self) -> RankMemory:
        import resource

        self._held("memory")
        params = list(self.model.parameters())
        state = [t for per_param in self.opt.state.values() for t in per_param.values()]
        return RankMemory(self.rank, _nbytes(params),
                          _nbytes(p.grad for p in params if p.grad is not None),
                          _nbytes(state), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                          * 1024)

    async def full_state(self) -> dict[str, torch.Tensor]:
        """The unsharded parameters on CPU (a collective: every rank calls this)."""
        return await self._run(self._full_state)

    def _full_state(self) -> dict[str, torch.Tensor]:
        self._held("full_state")
        return self._full_params()

    async def shard_state(self) -> ShardHandoff:
        """This rank's shard state (model and optimizer, local shards, CPU) put into the
        object store, for the same rank of a joining group; taken between steps (the
        compute thread runs one call at a time)."""
        return await self._run(self._shard_state)

    def _shard_state(self) -> ShardHandoff:
        self._held("shard_state")
        state = local_state(self.model, self.opt)
        layout = shard_layout(state, self.settings.world_size, self.settings.parallel,
                              self.optimizer_name)
        refs = (ray.put(state),) + ((ray.put(self._outer_state()),)
                                    if self.outer_m is not None else ())
        return ShardHandoff(self.rank, self.step, layout, state_digest(state), refs)

    async def load_shard_state(self, handoff: ShardHandoff, task: GroupTask) -> JoinAnswer:
        """Copy the donor rank's shard state behind ``handoff`` into this rank's shards (a
        model built from ``task`` when none is held) and take its step. The bytes are
        fetched from the object store within ``timeout_s``. Every rank checks the layouts
        (``layout_difference``) and the ranks vote before any copies, so a refused join
        (or a failed fetch) copies nothing; the answer then says why."""
        state, why, outer = None, None, None
        try:
            state = await asyncio.wait_for(asyncio.wrap_future(handoff.refs[0].future()),
                                           self.settings.timeout_s)
            if len(handoff.refs) > 1:  # the donor's outer momentum (DiLoCo)
                outer = await asyncio.wait_for(asyncio.wrap_future(handoff.refs[1].future()),
                                               self.settings.timeout_s)
        except asyncio.TimeoutError:
            why = f"the donor's shard state did not arrive within {self.settings.timeout_s:g} s"
        except ray.exceptions.RayError as exc:
            why = f"the donor's shard state is lost ({type(exc).__name__})"
        if isinstance(task, LoopTask):
            self._host(task)  # its prepare() builds the model before the load runs
        return await self._run(self._load_shard_state, handoff, state, why, task, outer)

    def _load_shard_state(self, handoff: ShardHandoff, state: dict | None, why: str | None,
                          task: GroupTask, outer: dict | None = None) -> JoinAnswer:
        self._build(task)
        if why is None:
            mine = shard_layout(local_state(self.model, self.opt), self.settings.world_size,
                                self.settings.parallel, self.optimizer_name)
            difference = layout_difference(handoff.layout, mine)
            why = f"rank {self.rank}: {difference}" if difference else None
        votes = torch.tensor([0 if why else 1], device=self.device)
        dist.all_reduce(votes, op=dist.ReduceOp.MIN)
        if not votes.item():
            return JoinAnswer(None, None, why or "another rank of the group refused")
        fill_local_state(self.model, self.opt, state)
        self.step, self.grads_of = handoff.step, None
        # the donor's round start is its last average, which the state just copied holds
        self.anchor = None
        self.outer_m = [t.to(self.device) for t in outer["m"]] if outer else None
        self.round_start()
        return JoinAnswer(self.step, state_digest(local_state(self.model, self.opt)))

    async def save_sharded(self, staging: str, final: str) -> CheckpointAnswer:
        """Write this rank's shard to ``staging``; rank 0 publishes it as ``final`` (see
        group_checkpoint.py). Rank 0 decides whether to write at all (``final`` must not
        exist) and tells the others, so all enter the save or none does."""
        return await self._run(self._save_sharded, staging, final)

    def _save_sharded(self, staging: str, final: str) -> CheckpointAnswer:
        self._held("save_sharded")
        refused = [f"{final}: exists; not replaced"
                   if self.rank == 0 and checkpoint_exists(final) else None]
        dist.broadcast_object_list(refused, src=0)
        if refused[0] is None:
            head = CheckpointManifest(self.step, self.settings.world_size,
                                      self.settings.parallel, self.optimizer_name, ())
            refused[0] = save_state(self.model, self.opt, staging, final, head, self.rank)
        return CheckpointAnswer(self.step, refused[0])

    async def load_sharded(self, path: str, task: GroupTask) -> CheckpointAnswer:
        """Load the checkpoint at ``path`` into the model held, or into one built from
        ``task`` when none is held, resharded to this group. Rank 0 reads the manifest,
        compares it with the model (``first_difference``), checks every file's hash and the
        index (``verify_files``; a remote checkpoint is fetched to this node and checked
        there) and tells the others, so on a refusal no rank loads anything and the model
        held (if any) is unchanged."""
        if isinstance(task, LoopTask):
            self._host(task)  # its prepare() builds the model before the load runs
        return await self._run(self._load_sharded, path, task)

    def _load_sharded(self, path: str, task: GroupTask) -> CheckpointAnswer:
        if isinstance(task, LoopTask):
            self._build(task)
        model = self.model if self.model is not None else task.build_model().to(self.device)
        optimizer = self.optimizer_name if self.model is not None else task.optimizer
        # (step, why refused, where the files are here, the manifest they were checked with)
        verdict: list = [None, None, path, None]
        if self.rank == 0:
            try:
                manifest = read_manifest(path)
                verdict = [manifest.step, first_difference(
                    manifest, state_shapes(model.state_dict()), optimizer), path, manifest]
                if verdict[1]:
                    verdict[1] = f"{path} does not fit the model: {verdict[1]}"
                elif is_remote(path):  # onto this node's disk, for every rank here
                    verdict[2] = fetch(path, local_staging(os.urandom(4).hex()), manifest)
                else:
                    verify_files(path, manifest)
            except (CheckpointError, OSError) as exc:
                verdict = [None, f"{type(exc).__name__}: {exc}"
                           if isinstance(exc, OSError) else str(exc), path, None]
        dist.broadcast_object_list(verdict, src=0)
        step, refused, local, manifest = verdict
        if refused:
            return CheckpointAnswer(None, refused)
        if self.model is None:
            self._hold(task, model)
        try:
            load_state(self.model, self.opt, local, manifest)
        finally:
            if local != path:  # a fetched copy: gone once every rank has read it
                dist.barrier()
                if self.rank == 0:
                    shutil.rmtree(local, ignore_errors=True)
        self.step, self.grads_of = step, None
        return CheckpointAnswer(step)

    async def close(self) -> None:
        """Leave the process group; the compute thread ends after it."""
        try:
            await self._run(self._close)
        finally:
            self._compute.shutdown()

    def _close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
