"""A replica group: one model replica made of N Ray actors joined in a ``torch.distributed``
process group, the model sharded inside by FSDP2 or replicated by DDP (issue 47, item 1).

A group starts, trains a task for K steps and reports; groups also train together, averaged
by shard, and a group joins by shard from a donor (item 2, below), but not yet as peers of the
swarm (no Coordinator, no elastic controller). One rank per GPU (one per rank on CPU)::

    group = ReplicaGroup(GroupConfig(world_size=2, parallel="fsdp"))
    group.start()                      # actors placed, process group joined (bounded)
    report = group.train(task)         # GroupReport: the loss of each step, each rank's shard
    params = group.full_state()        # the unsharded parameters (CPU), gathered by every rank
    group.save_sharded(path)           # each rank its shard (DCP); see group_checkpoint.py
    group.close()                      # ranks stopped, placement group removed

    other = ReplicaGroup(GroupConfig(world_size=3)); other.start()
    step = other.load_sharded(path, task)  # resharded from 2 ranks to 3; train() goes on

    a, b, c = (ReplicaGroup(GroupConfig(name=n)) for n in "abc")   # each then start()ed
    steps = train_together([a, b], task, 2)  # rank r of a averages its shard with b's rank r
    c.join_from(a, task)                     # rank r copies a's rank r shard state
    train_together([a, b, c], task, 1)       # all three bitwise equal after each step

Averaging by shard (issue 47, item 2; group_averaging.py has the protocol and its pure
parts): each rank hosts an ``Averager``, the swarm's Moshpit peer ``"<name>/r<rank>"``, and
takes its transport calls; ``train_together`` runs each step's gradient phase and then its
average-and-apply phase on every rank of every group, rank ``r`` averaging its local shard
of the gradients with rank ``r`` of the other groups over ``rank_plan(epoch, groups, r)``; a
group applies a step only if all its ranks got the whole plan's average (a vote). How a rank
keeps its compute and the averaging apart: the threading rule in ``GroupRank``.

Placement (issue 47, item 4): ``start`` reserves one bundle per rank (its CPU/GPU request,
``rank_bundles``) in a Ray placement group with ``STRICT_PACK``: every rank on one node, so
the collectives stay on that node's links and a checkpoint directory is on one file system.
``GroupConfig.node_labels`` narrows the node by Ray node labels (``bundle_label_selector``;
``{"ray.io/node-id": <hex id>}`` pins one node). A group that cannot be placed within
``timeout_s`` raises ``GroupError`` naming what it needs and what the nodes have
(``placement_shortfall``); ``close`` removes the placement group, also after a failed start.

Rendezvous: rank 0 picks its address and a free port and returns them through a Ray call;
every rank then joins ``tcp://address:port``. Every wait is bounded by
``GroupConfig.timeout_s`` (the Ray calls, ``init_process_group`` and each collective); a
rank that dies or hangs makes the call raise ``GroupError`` (one line, the rank named), never
hang.

Backend (``choose_backend``, pure): NCCL when every rank has a GPU of its own, gloo on CPU
and when ranks share a GPU (NCCL refuses two ranks on one device). The data contract of a
``GroupTask``: ``batch(step)`` is the *global* batch of that step; rank ``r`` of ``W`` trains
on its ``r``-th contiguous slice (``torch.tensor_split`` of the first dimension, which must
divide evenly) and the gradients are averaged over ranks, so a step of the group equals a
single-process step on the whole batch (``reference_train``) up to float rounding. The ranks
keep their model, optimizer and step between calls: ``train`` goes on from there (from step
0 with the task's model on the first call), so a group resumed from a checkpoint at step s
trains the batches s, s+1, ... and equals one process that never stopped.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

import moshray.cluster.collective.inline as inline
from moshray.cluster.collective.averager import (
    FINAL_FRACTION, Averager, AveragingError, flatten, unflatten,
)
from moshray.cluster.messages import Contribution, PartResult, RoundPlan

from moshray.actors.replica.group_averaging import (
    BatchPart, GradReport, GroupFailure, GroupPeers, JoinAnswer, LocalReport, RankStep,
    ShardHandoff, StepTogether, averaged_tensors, fill_local_state, incomplete,
    layout_difference, local_part, local_state, parameter_tensors, rank_peer_id, rank_plan,
    rank_rows, shard_layout, state_digest, write_averaged,
)
from moshray.actors.replica.group_checkpoint import (
    CheckpointAnswer, CheckpointError, CheckpointManifest, first_difference, load_state,
    read_manifest, save_state, staging_path, state_shapes,
)

log = logging.getLogger(__name__)

PARALLEL = ("fsdp", "ddp")  # FSDP2 (fully_shard): each rank holds 1/W; DDP: every rank all
BACKENDS = ("auto", "gloo", "nccl")
NODE_ID_LABEL = "ray.io/node-id"  # Ray's own label: GroupConfig.node_labels pins one node
PLACE_POLL_S = 1.0  # a pinned placement checks this often that its node is still alive
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adamw": torch.optim.AdamW,
}


class GroupError(RuntimeError):
    """A group operation failed or timed out; ``str()`` is one line naming the rank."""


# -- messages and decisions (pure) ------------------------------------------------------------


@dataclass(frozen=True)
class GroupConfig:
    """How to build a group. ``parallel``: ``fsdp`` or ``ddp``. ``backend``: ``auto`` (see
    ``choose_backend``), ``gloo`` or ``nccl``. ``gpus_per_rank``: what Ray gives each rank
    (0: CPU ranks; 0.5: two ranks share one GPU); a rank must ask for some CPU or GPU (its
    placement bundle cannot be empty). ``timeout_s`` bounds every wait. ``node_labels``:
    Ray node labels the group's node must have (a mapping, kept as sorted pairs), e.g.
    ``{"ray.io/node-id": hex_id}``. Raises ``ValueError`` (one line, the field named) on a
    bad value."""

    world_size: int = 2
    parallel: str = "fsdp"
    backend: str = "auto"
    gpus_per_rank: float = 0.0
    cpus_per_rank: float = 1.0
    timeout_s: float = 120.0
    name: str = "group"
    node_labels: Mapping[str, str] | tuple[tuple[str, str], ...] = ()
    # Averaging with other groups (group_averaging.py): the longest one Moshpit round waits
    # (None: timeout_s / 2, so the round, its result fetch and the vote fit in the driver's
    # wait), and the job's key its ranks' averagers sign and check with (None: unsigned).
    round_timeout_s: float | None = None
    job_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        labels = self.node_labels.items() if isinstance(self.node_labels, Mapping) \
            else self.node_labels
        object.__setattr__(self, "node_labels", tuple(sorted((str(k), str(v))
                                                             for k, v in labels)))
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"GroupConfig.world_size: must be an integer >= 1, got "
                             f"{self.world_size!r}")
        if self.parallel not in PARALLEL:
            raise ValueError(f"GroupConfig.parallel: use one of {', '.join(PARALLEL)}, got "
                             f"{self.parallel!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"GroupConfig.backend: use one of {', '.join(BACKENDS)}, got "
                             f"{self.backend!r}")
        if not 0 <= self.gpus_per_rank <= 1:
            raise ValueError(f"GroupConfig.gpus_per_rank: must be in [0, 1] (one GPU per rank "
                             f"at most), got {self.gpus_per_rank!r}")
        if self.cpus_per_rank < 0:
            raise ValueError(f"GroupConfig.cpus_per_rank: must be >= 0, got "
                             f"{self.cpus_per_rank!r}")
        if self.cpus_per_rank == 0 and self.gpus_per_rank == 0:
            raise ValueError("GroupConfig.cpus_per_rank: a rank must ask for some CPU or GPU "
                             "(its placement bundle cannot be empty)")
        if not self.timeout_s > 0:
            raise ValueError(f"GroupConfig.timeout_s: must be > 0, got {self.timeout_s!r}")
        if self.round_timeout_s is not None and not (
                0 < FINAL_FRACTION * self.round_timeout_s < self.timeout_s):
            raise ValueError(f"GroupConfig.round_timeout_s: must be > 0 and below timeout_s / "
                             f"{FINAL_FRACTION:g} (a round may run that much longer), got "
                             f"{self.round_timeout_s!r}")
        if "/" in self.name or not self.name:
            raise ValueError(f"GroupConfig.name: must be non-empty without '/' (its ranks "
                             f"average as '<name>/r<rank>'), got {self.name!r}")

    @property
    def averaging_timeout_s(self) -> float:
        """The timeout of one averaging round (see ``round_timeout_s``)."""
        return self.round_timeout_s if self.round_timeout_s is not None \
            else self.timeout_s / 2


@dataclass(frozen=True)
class GroupTask:
    """What a group trains. ``build_model()`` must give the same weights on every call (seed
    it); ``batch(step)`` the global batch of ``step`` (a tuple of tensors, first dimension
    divisible by the world size); ``loss(model, batch)`` a scalar mean over the batch.
    ``amp``: bf16 autocast on the rank's device. The callables travel to the ranks by
    pickle: use module-level functions (or ``functools.partial`` of them).
    Raises ``ValueError`` (one line) on a bad value."""

    build_model: Callable[[], torch.nn.Module]
    batch: Callable[[int], tuple]
    loss: Callable[[torch.nn.Module, tuple], torch.Tensor]
    steps: int
    lr: float = 1e-3
    optimizer: str = "adamw"
    amp: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"GroupTask.steps: must be an integer >= 1, got {self.steps!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"GroupTask.optimizer: use one of {', '.join(OPTIMIZERS)}, got "
                             f"{self.optimizer!r}")
        if not self.lr > 0:
            raise ValueError(f"GroupTask.lr: must be > 0, got {self.lr!r}")


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: rank 0's address and a port it found free."""

    address: str
    port: int

    @property
    def url(self) -> str:
        return f"tcp://{self.address}:{self.port}"


@dataclass(frozen=True)
class RankReport:
    """One rank after ``train``: its device, the backend, the group's mean loss of every
    step (the same on every rank), the digest and size of the parameters it holds (its shard
    under FSDP, the whole model under DDP), the digest of the unsharded parameters and the
    seconds of its steps (after the first, which includes warm-up)."""

    rank: int
    device: str
    backend: str
    losses: tuple[float, ...]
    shard_checksum: str
    shard_numel: int
    full_checksum: str
    step_seconds: tuple[float, ...]
    peak_memory_bytes: int | None = None  # CUDA only


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds now, in bytes of tensor storage: its parameters (its shard under
    FSDP2, the whole model under DDP), their gradients (held from ``compute_grads`` to the
    averaging) and the optimizer state (AdamW: two moments per parameter element held, and
    a step count per parameter); each the local part only. Not counted: DDP's reducer
    buckets (a second copy of the gradients), FSDP2's all-gathered parameters during forward
    and backward, activations. ``peak_rss``: the process's peak resident set
    (``ru_maxrss``), torch and Ray included."""

    rank: int
    params: int
    grads: int
    optimizer: int
    peak_rss: int

    @property
    def held(self) -> int:
        return self.params + self.grads + self.optimizer


def _nbytes(tensors) -> int:
    return sum(local_part(t).numel() * t.element_size() for t in tensors
               if isinstance(t, torch.Tensor))


@dataclass(frozen=True)
class GroupReport:
    """The group's ``train`` result: one ``RankReport`` per rank, in rank order."""

    parallel: str
    backend: str
    ranks: tuple[RankReport, ...]

    @property
    def losses(self) -> tuple[float, ...]:
        return self.ranks[0].losses

    @property
    def consistent(self) -> bool:
        """Every rank holds the same unsharded parameters and saw the same losses."""
        return len({(r.full_checksum, r.losses) for r in self.ranks}) == 1

    @property
    def steps_per_s(self) -> float | None:
        """Steps per second after the first step, the slowest rank's."""
        slowest = max(sum(r.step_seconds) for r in self.ranks)
        return len(self.ranks[0].step_seconds) / slowest if slowest > 0 else None

    def to_dict(self) -> dict:
        return {"parallel": self.parallel, "backend": self.backend, "losses": list(self.losses),
                "consistent": self.consistent, "steps_per_s": self.steps_per_s,
                "shard_checksums": [r.shard_checksum for r in self.ranks],
                "shard_numel": [r.shard_numel for r in self.ranks],
                "full_checksum": self.ranks[0].full_checksum,
                "devices": [r.device for r in self.ranks],
                "peak_memory_bytes": [r.peak_memory_bytes for r in self.ranks]}


def choose_backend(requested: str, devices: list[str], gpu_ids: list[tuple[str, ...]],
                   parallel: str = "ddp") -> str:
    """The process-group backend for ranks on ``devices`` (``"cpu"`` / ``"cuda..."``) holding
    the Ray GPU ids ``gpu_ids``. ``auto``: NCCL when every rank is on CUDA with a GPU no other
    rank holds, else gloo. Raises ``ValueError`` (one line) for NCCL on CPU ranks or on ranks
    that share a GPU (NCCL refuses two ranks on one device), and for FSDP over gloo on CUDA
    ranks: gloo has no CUDA reduce-scatter / all-gather, and FSDP2 there crashed the rank
    process with SIGSEGV (torch 2.11, H200, seen by ``moshray bench gpu``)."""
    on_cuda = all(d.startswith("cuda") for d in devices)
    flat = [g for ids in gpu_ids for g in ids]
    distinct = on_cuda and all(gpu_ids) and len(flat) == len(set(flat))
    backend = requested
    if requested == "auto":
        backend = "nccl" if distinct else "gloo"
    elif requested == "nccl" and not distinct:
        raise ValueError("GroupConfig.backend: nccl needs one GPU of its own per rank (ranks "
                         f"on {devices}, GPUs {gpu_ids}); use gloo or auto")
    if parallel == "fsdp" and backend == "gloo" and any(d.startswith("cuda") for d in devices):
        raise ValueError("GroupConfig.parallel: fsdp on CUDA ranks needs nccl (one GPU per "
                         "rank); gloo has no CUDA reduce-scatter. Use ddp on a shared GPU, or "
                         "CPU ranks")
    return backend


def rank_slice(batch: tuple, rank: int, world: int) -> tuple:
    """Rank ``rank``'s contiguous share of the global ``batch`` (see module docstring);
    ``ValueError`` unless the first dimension divides by ``world``."""
    rows = int(batch[0].shape[0])
    if rows % world:
        raise ValueError(f"GroupTask.batch: {rows} rows do not divide among {world} ranks; "
                         f"use a multiple of {world}")
    return tuple(t.tensor_split(world)[rank] for t in batch)


def rank_bundles(config: GroupConfig) -> tuple[dict[str, float], ...]:
    """One placement bundle per rank: the CPU and GPU that rank's actor asks for (the zero
    ones left out; ``GroupConfig`` refuses a rank that asks for neither)."""
    bundle = {k: float(v) for k, v in (("CPU", config.cpus_per_rank),
                                        ("GPU", config.gpus_per_rank)) if v}
    return tuple(dict(bundle) for _ in range(config.world_size))


def _resources(res: Mapping[str, float]) -> str:
    return " ".join(f"{k}={v:g}" for k, v in sorted(res.items())) or "nothing"


def placement_shortfall(bundles: tuple[dict[str, float], ...],
                        nodes: list[Mapping[str, float]],
                        labels: tuple[tuple[str, str], ...] = ()) -> str:
    """Why a ``STRICT_PACK`` placement of ``bundles`` may not have happened, in one line:
    the total it needs on one node and either the most any alive node has (``nodes``: each
    alive node's total resources) or, when some node is big enough, that those have it in use
    (or, with ``labels``, lack the labels)."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for k, v in bundle.items():
            need[k] = need.get(k, 0.0) + v
    text = (f"needs {_resources(need)} on one node ({len(bundles)} ranks of "
            f"{_resources(bundles[0]) if bundles else 'nothing'}, STRICT_PACK)")
    room = [n for n in nodes if all(n.get(k, 0.0) >= v for k, v in need.items())]
    if room:
        label_text = (" or lack the labels " + ",".join(f"{k}={v}" for k, v in labels)) \
            if labels else ""
        return f"{text}; {len(room)} node(s) are big enough but have it in use{label_text}"
    most = {k: max((n.get(k, 0.0) for n in nodes), default=0.0) for k in need}
    return f"{text}; no node has that (the most on one node: {_resources(most)})"


def digest(tensors) -> str:
    """sha256 (16 hex digits) of the tensors' bytes, in order (bitwise equality test)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous().reshape(-1)  # 0-d tensors cannot be viewed as bytes
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def reference_train(task: GroupTask, device: str = "cpu") -> tuple[list[float], dict]:
    """The same task in one process on whole batches: ``(losses, state_dict on CPU)``; what
    a group's unsharded parameters are compared with."""
    model = task.build_model().to(device)
    opt = OPTIMIZERS[task.optimizer](model.parameters(), lr=task.lr)
    losses = []
    for step in range(task.steps):
        batch = tuple(t.to(device) for t in task.batch(step))
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=task.amp):
            loss = task.loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().cpu() for k, v in model.named_parameters()}


# -- the rank actor -------------------------------------------------------------------------


_local = local_part  # the part of a parameter this rank holds


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
        self._compute = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"rank{rank}-compute",
            initializer=torch.cuda.set_device if cuda else None,
            initargs=(self.device,) if cuda else ())
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

    async def _run(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` in the compute thread (see the class docstring)."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    def _hold(self, task: GroupTask, model: torch.nn.Module) -> None:
        """Shard ``model`` (built from ``task``, on this rank's device) and keep it with a
        fresh optimizer at step 0."""
        self.module = shard_model(model, self.settings.parallel, self.device)
        self.model = model
        self.opt = OPTIMIZERS[task.optimizer](model.parameters(), lr=task.lr)
        self.optimizer_name, self.step = task.optimizer, 0

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
        return await self._run(self._train, task)

    def _own_steps(self, task: GroupTask, count: int, part: BatchPart
                   ) -> tuple[list[float], list[float], int]:
        """``count`` optimizer steps of this group alone from the step held, on this rank's
        rows of the group's ``part`` of each step's batch (a model built from ``task`` at
        step 0 when none is held). Returns the losses, the seconds of every step after the
        first (which pays for warm-up: allocations, kernels, connections) and the rows
        trained."""
        if self.model is None:
            self._hold(task, task.build_model().to(self.device))
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
        held. ``GroupError`` when the rank holds another step. Every rank calls this."""
        return await self._run(self._compute_grads, task, step, part)

    def _compute_grads(self, task: GroupTask, step: int, part: BatchPart) -> GradReport:
        if self.model is None:
            self._hold(task, task.build_model().to(self.device))
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
        step than ``first``. Every rank calls this."""
        return await self._run(self._local_steps, task, first, count, part)

    def _local_steps(self, task: GroupTask, first: int, count: int,
                     part: BatchPart) -> LocalReport:
        if first != (self.step if self.model is not None else 0):
            raise GroupError(f"rank {self.rank}: asked for local steps from step {first}, "
                             f"holds step {self.step}")
        t0 = time.perf_counter()
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

    def _write_params(self, averaged: Any, reason: str | None) -> tuple[bool, str | None]:
        def write() -> None:
            targets = parameter_tensors(self.model)
            write_averaged(self.model, unflatten(averaged, targets), targets)

        return self._vote_then(averaged, reason, write)

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
        return ShardHandoff(self.rank, self.step, layout, state_digest(state),
                            (ray.put(state),))

    async def load_shard_state(self, handoff: ShardHandoff, task: GroupTask) -> JoinAnswer:
        """Copy the donor rank's shard state behind ``handoff`` into this rank's shards (a
        model built from ``task`` when none is held) and take its step. The bytes are
        fetched from the object store within ``timeout_s``. Every rank checks the layouts
        (``layout_difference``) and the ranks vote before any copies, so a refused join
        (or a failed fetch) copies nothing; the answer then says why."""
        state, why = None, None
        try:
            state = await asyncio.wait_for(asyncio.wrap_future(handoff.refs[0].future()),
                                           self.settings.timeout_s)
        except asyncio.TimeoutError:
            why = f"the donor's shard state did not arrive within {self.settings.timeout_s:g} s"
        except ray.exceptions.RayError as exc:
            why = f"the donor's shard state is lost ({type(exc).__name__})"
        return await self._run(self._load_shard_state, handoff, state, why, task)

    def _load_shard_state(self, handoff: ShardHandoff, state: dict | None, why: str | None,
                          task: GroupTask) -> JoinAnswer:
        if self.model is None:
            self._hold(task, task.build_model().to(self.device))
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
        return JoinAnswer(self.step, state_digest(local_state(self.model, self.opt)))

    async def save_sharded(self, staging: str, final: str) -> CheckpointAnswer:
        """Write this rank's shard to ``staging``; rank 0 publishes it as ``final`` (see
        group_checkpoint.py). Rank 0 decides whether to write at all (``final`` must not
        exist) and tells the others, so all enter the save or none does."""
        return await self._run(self._save_sharded, staging, final)

    def _save_sharded(self, staging: str, final: str) -> CheckpointAnswer:
        self._held("save_sharded")
        refused = [f"{final}: exists; not replaced"
                   if self.rank == 0 and os.path.exists(final) else None]
        dist.broadcast_object_list(refused, src=0)
        if refused[0] is None:
            head = CheckpointManifest(self.step, self.settings.world_size,
                                      self.settings.parallel, self.optimizer_name, ())
            refused[0] = save_state(self.model, self.opt, staging, final, head, self.rank)
        return CheckpointAnswer(self.step, refused[0])

    async def load_sharded(self, path: str, task: GroupTask) -> CheckpointAnswer:
        """Load the checkpoint at ``path`` into the model held, or into one built from
        ``task`` when none is held, resharded to this group. Rank 0 reads the manifest and
        compares it with the model (``first_difference``) and tells the others, so on a
        refusal no rank loads anything and the model held (if any) is unchanged."""
        return await self._run(self._load_sharded, path, task)

    def _load_sharded(self, path: str, task: GroupTask) -> CheckpointAnswer:
        model = self.model if self.model is not None else task.build_model().to(self.device)
        optimizer = self.optimizer_name if self.model is not None else task.optimizer
        verdict: list = [None, None]  # (step, why refused)
        if self.rank == 0:
            try:
                manifest = read_manifest(path)
                verdict = [manifest.step, first_difference(
                    manifest, state_shapes(model.state_dict()), optimizer)]
                if verdict[1]:
                    verdict[1] = f"{path} does not fit the model: {verdict[1]}"
            except CheckpointError as exc:
                verdict = [None, str(exc)]
        dist.broadcast_object_list(verdict, src=0)
        step, refused = verdict
        if refused:
            return CheckpointAnswer(None, refused)
        if self.model is None:
            self._hold(task, model)
        load_state(self.model, self.opt, path)
        self.step, self.grads_of = step, None
        return CheckpointAnswer(step)

    async def close(self) -> None:
        """Leave the process group; the compute thread ends after it."""
        try:
            await self._run(self._close)
        finally:
            self._compute.shutdown(wait=False)

    def _close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


# -- the driver's handle ----------------------------------------------------------------------


@dataclass
class ReplicaGroup:
    """The driver's handle on one group (see module docstring). Not thread-safe."""

    config: GroupConfig
    ranks: list = field(default_factory=list)
    backend: str | None = None
    broken: bool = False  # a call failed or timed out since start()
    placement: Any = None  # the Ray placement group holding the ranks' bundles
    step: int | None = None  # the next step the ranks train; None until train / load
    epoch: int = -1  # the last averaging epoch the ranks took part in (train_together)

    def _get(self, refs: list, what: str, deadline: float | None = None) -> list:
        """The results of one call per rank, in rank order, within ``timeout_s`` (or by
        ``deadline``, a ``time.monotonic()`` value). The first rank to fail raises
        ``GroupError`` at once (the others may be waiting for it inside a collective); at
        the deadline ``GroupError`` names the ranks still busy. Either way the group is
        marked broken (``close`` then kills without asking)."""
        if deadline is None:
            deadline = time.monotonic() + self.config.timeout_s
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        out: dict[int, Any] = {}
        pending = list(refs)
        name = self.config.name
        while pending:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.broken = True
                busy = ", ".join(str(rank_of[r]) for r in pending)
                raise GroupError(f"group {name}: rank(s) {busy} did not finish {what} within "
                                 f"{self.config.timeout_s:g} s")
            for ref in ready:
                try:
                    out[rank_of[ref]] = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    self.broken = True
                    cause = " ".join(str(exc).split())[-400:]
                    raise GroupError(f"group {name}: rank {rank_of[ref]} failed in {what}: "
                                     f"{cause}") from None
        return [out[rank] for rank in range(len(refs))]

    def _place(self) -> None:
        """Reserve the ranks' bundles on one node (see module docstring), within
        ``timeout_s``; ``GroupError`` naming the resources if that does not happen."""
        from ray.util.placement_group import placement_group

        c = self.config
        bundles = rank_bundles(c)
        selector = [dict(c.node_labels) for _ in bundles] if c.node_labels else None
        self.placement = placement_group(list(bundles), strategy="STRICT_PACK",
                                         name=f"moshray-group-{c.name}-{uuid.uuid4().hex[:6]}",
                                         bundle_label_selector=selector)
        pinned = dict(c.node_labels).get(NODE_ID_LABEL)
        deadline = time.monotonic() + c.timeout_s
        while not self.placement.wait(timeout_seconds=min(PLACE_POLL_S, max(
                0.0, deadline - time.monotonic()))):
            rows = ray.nodes()
            if pinned and not any(n["NodeID"] == pinned and n.get("Alive") for n in rows):
                raise GroupError(f"group {c.name}: not placed: node {pinned[:12]} it is "
                                 f"pinned to is not alive")
            if time.monotonic() >= deadline:
                nodes = [n["Resources"] for n in rows if n.get("Alive")]
                raise GroupError(f"group {c.name}: not placed within {c.timeout_s:g} s: "
                                 f"{placement_shortfall(bundles, nodes, c.node_labels)}")

    def start(self, **actor_options: Any) -> list[dict]:
        """Place the ranks on one node (``_place``), start them (extra Ray
        ``actor_options``; not a scheduling strategy, which is the placement group's), meet
        at rank 0's address and join the process group. Returns each rank's ``describe()``.
        On failure the ranks started are killed, the placement group removed and
        ``GroupError`` is raised."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c = self.config
        if "scheduling_strategy" in actor_options:
            raise ValueError("ReplicaGroup.start: the ranks go to the group's placement group; "
                             "narrow the node with GroupConfig.node_labels instead")
        try:
            self._place()
            self.ranks = [GroupRank.options(
                num_cpus=c.cpus_per_rank, num_gpus=c.gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement, placement_group_bundle_index=r),
                **actor_options).remote(r, c) for r in range(c.world_size)]
            described = self._get([r.describe.remote() for r in self.ranks], "start")
            where = self._get([self.ranks[0].rendezvous.remote()], "rendezvous")[0]
            try:
                backend = choose_backend(c.backend, [d["device"] for d in described],
                                         [tuple(d["gpu_ids"]) for d in described],
                                         c.parallel)
            except ValueError as exc:
                raise GroupError(f"group {c.name}: {exc}") from None
            self._get([r.join.remote(where, backend) for r in self.ranks], "join")
        except BaseException:
            self.close()
            raise
        self.backend = backend
        log.info("group %s: %d ranks joined (%s, %s) at %s", c.name, c.world_size, backend,
                 c.parallel, where.url)
        return described

    def train(self, task: GroupTask) -> GroupReport:
        """Train ``task.steps`` steps on every rank, going on from the step the ranks hold
        (see module docstring); ``GroupError`` if a rank fails or times out."""
        self._started("train")
        reports = self._get([r.train.remote(task) for r in self.ranks], "train")
        self.step = (self.step or 0) + task.steps
        return GroupReport(self.config.parallel, self.backend or "?", tuple(reports))

    def full_state(self) -> dict[str, torch.Tensor]:
        """The unsharded parameters (CPU tensors by name), gathered on every rank; rank 0's."""
        return self._get([r.full_state.remote() for r in self.ranks], "full_state")[0]

    def save_sharded(self, path: str) -> int:
        """Save the model and optimizer state the ranks hold as a sharded checkpoint at
        ``path`` (a directory that must not exist yet; every rank must reach it: the group
        is on one node, else use a shared file system) and return the step it records.
        Visible only when whole: written to ``<path>.partial-<nonce>`` and renamed by rank 0
        once every shard and the manifest are on disk (group_checkpoint.py). Bounded by
        ``timeout_s``; ``GroupError`` (one line) when ``path`` exists (nothing written, the
        group sound) or a rank fails or times out (a ``.partial-*`` may stay behind)."""
        self._started("save_sharded")
        if self.step is None:
            raise GroupError(f"group {self.config.name}: save_sharded() before train() or "
                             f"load_sharded()")
        staging = staging_path(path, uuid.uuid4().hex[:8])
        answer = self._get([r.save_sharded.remote(staging, path) for r in self.ranks],
                           "save_sharded")[0]
        if answer.refused:
            raise GroupError(f"group {self.config.name}: save_sharded: {answer.refused}")
        log.info("group %s: step %d saved to %s (%d shards)", self.config.name, answer.step,
                 path, self.config.world_size)
        return answer.step

    def load_sharded(self, path: str, task: GroupTask) -> int:
        """Load the checkpoint at ``path`` (written by a group of any size and either
        ``parallel``) into the ranks, resharded to this group, and return its step; the next
        ``train`` goes on from it. Into the model the ranks hold, else one built from
        ``task``. Bounded by ``timeout_s``. ``GroupError`` (one line) when ``path`` is no
        whole checkpoint or its state does not fit the model (the first difference named;
        nothing loaded, the group sound), or when a rank fails or times out."""
        self._started("load_sharded")
        answer = self._get([r.load_sharded.remote(path, task) for r in self.ranks],
                           "load_sharded")[0]
        if answer.refused:
            raise GroupError(f"group {self.config.name}: load_sharded: {answer.refused}")
        self.step = answer.step
        return answer.step

    def peers(self) -> GroupPeers:
        """This group as the averaging plans see it (``group_averaging.rank_plan``)."""
        return GroupPeers(self.config.name, self.config.parallel, tuple(self.ranks))

    def join_from(self, donor: ReplicaGroup, task: GroupTask) -> int:
        """Join by shard: rank ``r`` copies the shard state (model and optimizer, local
        shards) of rank ``r`` of ``donor`` through the object store (the donor puts it, the
        joiner fetches it by reference: no rank and not the driver sees the whole model),
        into the model the ranks hold or one built from ``task``; the group then holds
        exactly the donor's state, step and averaging epoch, checked by digest. ``donor``
        must be a started group of the same world size and parallel mode that trained (or
        loaded) something; the optimizer must be the same. Bounded by each group's
        ``timeout_s``. ``GroupError`` (one line) when the layouts differ (nothing copied,
        the group sound), a rank fails or times out, or the digests differ. Returns the
        step now held."""
        self._started("join_from")
        donor._started("join_from")
        mine, theirs = self.config, donor.config
        if donor.step is None:
            raise GroupError(f"group {mine.name}: join_from({theirs.name}): the donor holds "
                             f"no state yet")
        if (mine.world_size, mine.parallel) != (theirs.world_size, theirs.parallel):
            raise GroupError(f"group {mine.name}: join_from({theirs.name}): shards differ "
                             f"({mine.world_size} x {mine.parallel} here, {theirs.world_size} "
                             f"x {theirs.parallel} at the donor)")
        handoffs = donor._get([r.shard_state.remote() for r in donor.ranks], "shard_state")
        answers = self._get([r.load_shard_state.remote(h, task)
                             for r, h in zip(self.ranks, handoffs)], "load_shard_state")
        for rank, (h, a) in enumerate(zip(handoffs, answers)):
            if a.refused:
                raise GroupError(f"group {mine.name}: join_from({theirs.name}) refused: "
                                 f"{a.refused}")
            if a.digest != h.digest:
                self.broken = True
                raise GroupError(f"group {mine.name}: join_from({theirs.name}): rank {rank} "
                                 f"holds state {a.digest}, the donor's is {h.digest}")
        self.step, self.epoch = handoffs[0].step, max(self.epoch, donor.epoch)
        log.info("group %s: joined from %s at step %d (%d shards)", mine.name, theirs.name,
                 self.step, mine.world_size)
        return self.step

    def _started(self, what: str) -> None:
        if not self.ranks:
            raise GroupError(f"group {self.config.name}: {what}() before start()")

    def close(self) -> None:
        """Leave the process group and stop the ranks: politely (bounded) when the group is
        sound, by ``ray.kill`` at once when a call failed or timed out (a rank may be stuck
        in a collective and would never take the call). Then remove the placement group.
        Safe to call twice and after a failed ``start``."""
        ranks, self.ranks = self.ranks, []
        if ranks and not self.broken:
            try:
                ray.get([r.close.remote() for r in ranks],
                        timeout=min(30.0, self.config.timeout_s))
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
                log.warning("group %s: close: %s", self.config.name, type(exc).__name__)
        for r in ranks:
            ray.kill(r)
        placement, self.placement = self.placement, None
        if placement is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(placement)
            except ray.exceptions.RayError as exc:  # the driver lost the cluster: gone anyway
                log.warning("group %s: remove placement group: %s", self.config.name,
                            type(exc).__name__)
        self.broken, self.step, self.epoch = False, None, -1


# -- groups that train together ------------------------------------------------------------


def _checked(groups: Sequence[ReplicaGroup], what: str) -> list[GroupPeers]:
    """The groups as the plans see them; ``GroupError`` (one line) when there are none, one
    is not started, or their shards differ (``rank_plan``'s checks)."""
    if not groups:
        raise GroupError(f"{what}: no groups")
    for g in groups:
        g._started(what)
    try:
        peers = [g.peers() for g in groups]
        rank_plan(0, peers, 0)  # the checks: names, world sizes, parallel modes
    except ValueError as exc:
        raise GroupError(f"{what}: {exc}") from None
    return peers


def _gather(groups: Sequence[ReplicaGroup], calls: Sequence[list], what: str
            ) -> tuple[dict[str, list], list[GroupFailure]]:
    """The results of calls already made on every rank of every group (``calls[i]``: group
    ``i``'s refs in rank order), by name, within one deadline (the longest ``timeout_s``);
    a group whose rank failed or timed out is a broken ``GroupFailure`` instead."""
    deadline = time.monotonic() + max(g.config.timeout_s for g in groups)
    results: dict[str, list] = {}
    failures: list[GroupFailure] = []
    for g, refs in zip(groups, calls):
        try:
            results[g.config.name] = g._get(refs, what, deadline)
        except GroupError as exc:
            failures.append(GroupFailure(g.config.name, True, str(exc)))
    return results, failures


def average_phase(groups: Sequence[ReplicaGroup], weights: Sequence[float], method: str,
                  step: int) -> tuple[int, list[ReplicaGroup], list[list[RankStep]],
                                      list[GroupFailure]]:
    """Rank ``r`` of every group averages over ``rank_plan(epoch, groups, r)`` (a fresh
    epoch above every group's last) with the rank method ``method`` (``average_and_apply``:
    the gradients, then the step; ``average_params``: the parameters), each group weighted
    by ``weights[i]``, and the ranks of each group vote. Returns the epoch, the groups that
    applied it, their ranks' outcomes and a ``GroupFailure`` for each other group (broken:
    a rank failed or timed out; not broken: its round was incomplete). Never raises for a
    group's failure; bounded by the longest ``timeout_s``."""
    peers = [g.peers() for g in groups]
    epoch = max(g.epoch for g in groups) + 1
    plans = [rank_plan(epoch, peers, r) for r in range(groups[0].config.world_size)]
    calls = []
    for g, weight in zip(groups, weights):
        g.epoch = epoch
        calls.append([getattr(r, method).remote(plans[rank], weight)
                      for rank, r in enumerate(g.ranks)])
    outcomes, failures = _gather(groups, calls, f"{method} (step {step})")
    applied, ranks = [], []
    for g in groups:
        mine = outcomes.get(g.config.name)
        if mine is None:
            continue
        if all(o.applied for o in mine):
            applied.append(g)
            ranks.append(mine)
        else:
            first = next(o for o in mine if o.reason)
            failures.append(GroupFailure(g.config.name, False,
                                         f"{g.config.name} (rank {first.rank}: {first.reason})"))
    return epoch, applied, ranks, failures


def step_together(groups: Sequence[ReplicaGroup], task: GroupTask) -> StepTogether:
    """One collaborative step of ``groups`` (started, one world size and parallel mode,
    unique names, all holding the same step or none), averaged by shard; never raises for
    a group's failure. The gradient phase runs on every rank of every group at once (the
    global batch of the step split into ``len(groups)`` parts, group ``i`` part ``i``);
    a group whose rank fails or times out there leaves the step (its part with it) and the
    others average without it, so they still apply the step. Then ``average_phase``. A
    group that applied it holds the next step; the others stay at this one (their
    gradients dropped), and the result's ``failures`` name each (broken: close it).
    ``GroupError`` only for groups that cannot step together (see ``_checked``)."""
    _checked(groups, "step_together")
    at = {g.config.name: g.step or 0 for g in groups}
    if len(set(at.values())) != 1:
        raise GroupError(f"step_together: the groups hold different steps ({at}); a group "
                         f"behind joins from one ahead first (join_from)")
    step = groups[0].step or 0
    t0 = time.perf_counter()
    calls = [[r.compute_grads.remote(task, step, BatchPart(i, len(groups))) for r in g.ranks]
             for i, g in enumerate(groups)]
    grads, failures = _gather(groups, calls, f"compute_grads (step {step})")
    live = [g for g in groups if g.config.name in grads]
    t1 = time.perf_counter()
    if not live:
        return StepTogether(step, max(g.epoch for g in groups), (), (), float("nan"), (),
                            t1 - t0, 0.0, (), tuple(failures))
    weights = [float(sum(r.samples for r in grads[g.config.name])) for g in live]
    epoch, applied, ranks, more = average_phase(live, weights, "average_and_apply", step)
    for g in applied:
        g.step = step + 1
    losses = tuple(grads[g.config.name][0].loss for g in live)
    mean = sum(w * x for w, x in zip(weights, losses)) / sum(weights)
    log.info("groups %s: step %d averaged by shard (epoch %d, loss %.4f, %d applied)",
             ",".join(at), step, epoch, mean, len(applied))
    return StepTogether(step, epoch, tuple(g.config.name for g in live), losses, mean,
                        tuple(o.numel for o in ranks[0]) if ranks else (), t1 - t0,
                        time.perf_counter() - t1, tuple(g.config.name for g in applied),
                        tuple(failures + more))


def local_round(groups: Sequence[ReplicaGroup], task: GroupTask, inner_steps: int,
                average_tries: int = 2) -> StepTogether:
    """One local SGD round by shard (group_averaging.py) of ``groups`` (as for
    ``step_together``); never raises for a group's failure. First every group trains
    ``inner_steps`` steps alone (``local_steps``; group ``i`` on part ``i`` of
    ``len(groups)`` of each step's batch); a group whose rank fails or times out leaves
    the round. Then rank ``r`` of every group averages its parameter shard
    (``average_phase`` with ``average_params``). A round none applied is averaged again
    with the groups still whole (a fresh epoch), up to ``average_tries`` times; if still
    none applied, the first whole group keeps its own inner steps as the round's result
    (a plan of one: complete by itself), so the round's work survives while one group
    does. The groups that applied hold step ``first + inner_steps``; the others are in
    ``failures`` and hold no state of the swarm (their parameters are their own inner
    steps'): they join again before they step. ``GroupError`` only as ``step_together``."""
    _checked(groups, "local_round")
    at = {g.config.name: g.step or 0 for g in groups}
    if len(set(at.values())) != 1:
        raise GroupError(f"local_round: the groups hold different steps ({at}); a group "
                         f"behind joins from one ahead first (join_from)")
    if not isinstance(inner_steps, int) or inner_steps < 1:
        raise GroupError(f"local_round: inner_steps must be an integer >= 1, got "
                         f"{inner_steps!r}")
    first = groups[0].step or 0
    t0 = time.perf_counter()
    calls = [[r.local_steps.remote(task, first, inner_steps, BatchPart(i, len(groups)))
              for r in g.ranks] for i, g in enumerate(groups)]
    inner, failures = _gather(groups, calls, f"local_steps (steps {first}+{inner_steps})")
    live = [g for g in groups if g.config.name in inner]
    for g in live:
        g.step = first + inner_steps  # what the ranks hold now (averaged or not)
    t1 = time.perf_counter()
    weights = {g.config.name: float(sum(r.samples for r in inner[g.config.name]))
               for g in live}
    applied: list[ReplicaGroup] = []
    ranks: list[list[RankStep]] = []
    epoch = max(g.epoch for g in groups)
    pending, why = list(live), {}
    for attempt in range(average_tries + 1):
        if not pending:
            break
        if attempt == average_tries:  # the last resort: one group's own round
            pending = pending[:1]
        epoch, applied, ranks, more = average_phase(
            pending, [weights[g.config.name] for g in pending], "average_params", first)
        failures += [f for f in more if f.broken]
        why.update((f.name, f.reason) for f in more if not f.broken)
        if applied:
            break
        pending = [g for g in pending if g.config.name not in {f.name for f in more
                                                               if f.broken}]
    done = {g.config.name for g in applied}
    failed = {f.name for f in failures}
    failures += [GroupFailure(g.config.name, False, why.get(
        g.config.name, f"{g.config.name}: left out of the round's average"))
                 for g in live if g.config.name not in done | failed]
    losses = tuple(inner[g.config.name][0].loss for g in live)
    total = sum(weights.values())
    mean = sum(weights[g.config.name] * x for g, x in zip(live, losses)) / total if total \
        else float("nan")
    log.info("groups %s: steps %d-%d by local SGD, parameters averaged by shard (epoch %d, "
             "loss %.4f, %d applied)", ",".join(at), first, first + inner_steps - 1, epoch,
             mean, len(applied))
    return StepTogether(first, epoch, tuple(g.config.name for g in live), losses, mean,
                        tuple(o.numel for o in ranks[0]) if ranks else (), t1 - t0,
                        time.perf_counter() - t1, tuple(sorted(done)), tuple(failures),
                        inner_steps)


def train_together(groups: Sequence[ReplicaGroup], task: GroupTask,
                   steps: int | None = None) -> list[StepTogether]:
    """Train ``steps`` (default ``task.steps``) collaborative steps with ``groups``, averaged
    by shard (group_averaging.py), one ``step_together`` after the other. The groups must
    be started, of one world size and parallel mode, with unique names, and hold the same
    step (or none: step 0, models built from ``task``). Data: the global batch of step
    ``s`` (``task.batch(s)``) is split into ``len(groups)`` contiguous equal parts, group
    ``g`` (in the order given) training part ``g`` and each of its ranks its slice of that
    (the rows must divide by groups x ranks); a group's weight is its rows. So with no
    failures a step equals one process on the whole batch, and every group holds bitwise
    the same state after it.

    Each phase is bounded by the groups' ``timeout_s``. ``GroupError`` (one line) after a
    step some group did not apply: a rank failed or timed out (the group and rank named;
    that group is marked broken), or its round was incomplete (the reason named). Groups
    that applied it moved on to the next step, the others stay at it."""
    steps = task.steps if steps is None else steps
    done: list[StepTogether] = []
    for _ in range(steps):
        result = step_together(groups, task)
        if result.failures:
            raise GroupError(f"train_together: step {result.step} not applied by group(s) "
                             f"{'; '.join(f.reason for f in result.failures)}")
        done.append(result)
    return done
