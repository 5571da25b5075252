"""What a replica group is: its settings (``GroupConfig``), what it trains
(``GroupTask``), the messages its ranks return, and the pure decisions about it (backend,
batch slices, placement bundles and the one-line shortfall, the single-process reference).
No Ray calls here; the rank actor is ``group_rank.py``, the driver's handle ``group.py``,
groups training together ``group_together.py``.

Backend (``choose_backend``): NCCL when every rank has a GPU of its own, gloo on CPU and when
ranks share a GPU (NCCL refuses two ranks on one device). The data contract of a
``GroupTask``: ``batch(step)`` is the *global* batch of that step; rank ``r`` of ``W`` trains
on its ``r``-th contiguous slice (``torch.tensor_split`` of the first dimension, which must
divide evenly) and the gradients are averaged over ranks, so a step of the group equals a
single-process step on the whole batch (``reference_train``) up to float rounding.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from moshray.cluster.collective.averager import FINAL_FRACTION

PARALLEL = ("fsdp", "ddp")  # FSDP2 (fully_shard): each rank holds 1/W; DDP: every rank all
BACKENDS = ("auto", "gloo", "nccl")
NODE_ID_LABEL = "ray.io/node-id"  # Ray's own label: GroupConfig.node_labels pins one node
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
    ``{"ray.io/node-id": hex_id}``. ``resources``: custom Ray resources each rank's bundle
    holds too (e.g. ``{"spot": 1}``: only spot workers hold groups). Raises ``ValueError`` (one line, the field named) on a
    bad value."""

    world_size: int = 2
    parallel: str = "fsdp"
    backend: str = "auto"
    gpus_per_rank: float = 0.0
    cpus_per_rank: float = 1.0
    timeout_s: float = 120.0
    name: str = "group"
    node_labels: Mapping[str, str] | tuple[tuple[str, str], ...] = ()
    resources: Mapping[str, float] | tuple[tuple[str, float], ...] = ()
    # Averaging with other groups (group_averaging.py): the longest one Moshpit round waits
    # (None: timeout_s / 2, so the round, its result fetch and the vote fit in the driver's
    # wait), and the job's key its ranks' averagers sign and check with (None: unsigned).
    round_timeout_s: float | None = None
    job_key: bytes | None = field(default=None, repr=False)
    # Local SGD: DiLoCo's outer Nesterov step on each rank's shard of every average (None:
    # the average is taken as it is). With lr 1 and momentum 0 it is the plain average.
    outer_lr: float | None = None
    outer_momentum: float = 0.9

    def __post_init__(self) -> None:
        labels = self.node_labels.items() if isinstance(self.node_labels, Mapping) \
            else self.node_labels
        object.__setattr__(self, "node_labels", tuple(sorted((str(k), str(v))
                                                             for k, v in labels)))
        extra = self.resources.items() if isinstance(self.resources, Mapping) \
            else self.resources
        object.__setattr__(self, "resources", tuple(sorted((str(k), float(v))
                                                           for k, v in extra)))
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
        if self.outer_lr is not None and not self.outer_lr > 0:
            raise ValueError(f"GroupConfig.outer_lr: must be None or > 0, got "
                             f"{self.outer_lr!r}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"GroupConfig.outer_momentum: must be in [0, 1), got "
                             f"{self.outer_momentum!r}")
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
                                        ("GPU", config.gpus_per_rank),
                                        *config.resources) if v}
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
