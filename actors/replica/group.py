"""A replica group: one model replica made of N Ray actors joined in a ``torch.distributed``
process group, the model sharded inside by FSDP2 or replicated by DDP (issue 47, item 1).

This is the first, standalone piece of replica groups: a group that starts, trains a task for
K steps and reports; it is not yet a peer of the swarm (no Coordinator, no averaging across
groups). One rank per GPU (one per rank on CPU)::

    group = ReplicaGroup(GroupConfig(world_size=2, parallel="fsdp"))
    group.start()                      # actors placed, process group joined (bounded)
    report = group.train(task)         # GroupReport: the loss of each step, each rank's shard
    params = group.full_state()        # the unsharded parameters (CPU), gathered by every rank
    group.save_sharded(path)           # each rank its shard (DCP); see group_checkpoint.py
    group.close()                      # ranks stopped, placement group removed

    other = ReplicaGroup(GroupConfig(world_size=3)); other.start()
    step = other.load_sharded(path, task)  # resharded from 2 ranks to 3; train() goes on

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

import hashlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from moshray.actors.replica.group_checkpoint import (
    CheckpointAnswer, CheckpointError, CheckpointManifest, first_difference, load_state,
    read_manifest, save_state, staging_path, state_shapes,
)

log = logging.getLogger(__name__)

PARALLEL = ("fsdp", "ddp")  # FSDP2 (fully_shard): each rank holds 1/W; DDP: every rank all
BACKENDS = ("auto", "gloo", "nccl")
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


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds (a DTensor's local shard, else itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


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
    process group. Its device is the GPU Ray gave it (``cuda``), else the CPU."""

    def __init__(self, rank: int, config: GroupConfig):
        # Not ``self.config``: cloudpickle ships this class by value and would take a method
        # naming both ``dist`` and ``config`` for a use of torch.distributed.config.
        self.rank, self.settings = rank, config
        self.gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
        cuda = bool(self.gpu_ids) and torch.cuda.is_available()
        self.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        self.backend: str | None = None
        # What the rank holds between calls (train, full_state, save/load_sharded): the
        # model (sharded in place under FSDP2), the module to call (the DDP wrapper or the
        # model), its optimizer and the next step to train.
        self.model: torch.nn.Module | None = None
        self.module = None
        self.opt: torch.optim.Optimizer | None = None
        self.optimizer_name = ""
        self.step = 0

    def _hold(self, task: GroupTask, model: torch.nn.Module) -> None:
        """Shard ``model`` (built from ``task``, on this rank's device) and keep it with a
        fresh optimizer at step 0."""
        self.module = shard_model(model, self.settings.parallel, self.device)
        self.model = model
        self.opt = OPTIMIZERS[task.optimizer](model.parameters(), lr=task.lr)
        self.optimizer_name, self.step = task.optimizer, 0

    def describe(self) -> dict:
        return {"rank": self.rank, "device": str(self.device), "gpu_ids": self.gpu_ids,
                "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    def rendezvous(self) -> Rendezvous:
        """Rank 0: this node's address and a port free on it now."""
        address = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((address, 0))
            return Rendezvous(address, sock.getsockname()[1])

    def join(self, where: Rendezvous, backend: str) -> str:
        """Join the process group (bounded by ``timeout_s``); returns the backend."""
        if where.address.startswith("127."):  # gloo would pick the host's first interface
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(max(1, int(self.settings.cpus_per_rank)))
        dist.init_process_group(
            backend, init_method=where.url, rank=self.rank, world_size=self.settings.world_size,
            timeout=timedelta(seconds=self.settings.timeout_s),
            device_id=self.device if backend == "nccl" else None)
        self.backend = backend
        return backend

    def train(self, task: GroupTask) -> RankReport:
        """Train ``task.steps`` steps on this rank's share of every batch, from the model,
        optimizer and step held (built from ``task`` at step 0 when none is held; the task's
        model, optimizer and lr are not used otherwise). Every rank calls this."""
        world = self.settings.world_size
        if self.model is None:
            self._hold(task, task.build_model().to(self.device))
        model, module, opt, first = self.model, self.module, self.opt, self.step
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        losses, seconds = [], []
        for step in range(first, first + task.steps):
            t0 = time.perf_counter()
            batch = tuple(t.to(self.device) for t in rank_slice(task.batch(step), self.rank,
                                                                  world))
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=task.amp):
                loss = task.loss(module, batch)
            loss.backward()  # FSDP2 reduce-scatters, DDP all-reduces: the mean over ranks
            opt.step()
            opt.zero_grad(set_to_none=True)
            mean = loss.detach().float().reshape(1) / world  # the global batch's mean loss
            dist.all_reduce(mean)
            losses.append(float(mean))
            if step > first:  # the first pays for warm-up (allocations, kernels, connections)
                seconds.append(time.perf_counter() - t0)
            self.step = step + 1
        held = [_local(p) for p in model.parameters()]
        full = self._full_params()
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" \
            else None
        return RankReport(self.rank, str(self.device), self.backend or "?", tuple(losses),
                          digest(held), sum(t.numel() for t in held),
                          digest(full.values()), tuple(seconds), peak)

    def _full_params(self) -> dict[str, torch.Tensor]:
        return {k: _full(p.detach()).cpu() for k, p in self.model.named_parameters()}

    def full_state(self) -> dict[str, torch.Tensor]:
        """The unsharded parameters on CPU (a collective: every rank calls this)."""
        if self.model is None:
            raise GroupError(f"rank {self.rank}: full_state() before train() or "
                             f"load_sharded()")
        return self._full_params()

    def save_sharded(self, staging: str, final: str) -> CheckpointAnswer:
        """Write this rank's shard to ``staging``; rank 0 publishes it as ``final`` (see
        group_checkpoint.py). Rank 0 decides whether to write at all (``final`` must not
        exist) and tells the others, so all enter the save or none does."""
        if self.model is None:
            raise GroupError(f"rank {self.rank}: save_sharded() before train() or "
                             f"load_sharded()")
        refused = [f"{final}: exists; not replaced"
                   if self.rank == 0 and os.path.exists(final) else None]
        dist.broadcast_object_list(refused, src=0)
        if refused[0] is None:
            head = CheckpointManifest(self.step, self.settings.world_size,
                                      self.settings.parallel, self.optimizer_name, ())
            refused[0] = save_state(self.model, self.opt, staging, final, head, self.rank)
        return CheckpointAnswer(self.step, refused[0])

    def load_sharded(self, path: str, task: GroupTask) -> CheckpointAnswer:
        """Load the checkpoint at ``path`` into the model held, or into one built from
        ``task`` when none is held, resharded to this group. Rank 0 reads the manifest and
        compares it with the model (``first_difference``) and tells the others, so on a
        refusal no rank loads anything and the model held (if any) is unchanged."""
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
        self.step = step
        return CheckpointAnswer(step)

    def close(self) -> None:
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

    def _get(self, refs: list, what: str) -> list:
        """The results of one call per rank, in rank order, within ``timeout_s``. The first
        rank to fail raises ``GroupError`` at once (the others may be waiting for it inside
        a collective); at the deadline ``GroupError`` names the ranks still busy. Either way
        the group is marked broken (``close`` then kills without asking)."""
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
        if not self.placement.wait(timeout_seconds=c.timeout_s):
            nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
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
        self.broken, self.step = False, None
