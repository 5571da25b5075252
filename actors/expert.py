"""DMoE experts: the torch core, the ExpertActor that serves it, and the supervisor that keeps
every shard of experts alive on spot nodes.

Learning@home semantics: an expert is a small feed-forward network with its *own* optimizer.
``forward`` returns its outputs; ``backward`` gets the same inputs again with the gradient of
the loss with respect to its outputs, recomputes the forward, returns the gradient with respect
to the inputs, and applies one optimizer step to its own parameters. Nothing is kept between
the two calls, so an expert can die, or be re-spawned from a snapshot, between any two calls.

Layers of this module:

- ``ExpertHostCore`` (torch, no Ray): the experts of one shard, validation, forward/backward,
  ``state()`` / ``load()``. In-process backends and the actor both use it.
- ``ExpertActor`` (async Ray actor on a spot node): batches concurrent requests per expert up to
  ``BatchConfig.max_rows`` rows or ``max_wait_s`` seconds, computes on one worker thread (so
  updates of one expert never race), registers its experts with the Coordinator and
  heartbeats, snapshots on request, and on a preemption notice hands its shard over.
- ``ExpertSupervisor`` (async Ray actor on the head node): places shards over spot nodes, takes
  periodic snapshots (kept in the object store, owned by the supervisor on the head node, and
  written durably by each expert through ``CheckpointStore``), and re-spawns a lost shard on
  another node from its latest snapshot.

Bad requests (unknown expert, wrong shape or dtype, NaN/inf) raise ``ExpertInputError`` with a
``ExpertRejectReason``; it pickles cleanly, so the caller gets the typed error and the actor
keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import math
import time
import zlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import ray
import torch
from torch import nn

from moshray.cluster import placement
from moshray.cluster.registry import (
    HeartbeatStatus,
    choose_node,
    grid_uids,
    parse_uid,
    spread_shards,
)

from .checkpoint import CheckpointStore

log = logging.getLogger(__name__)

STATE_VERSION = 1

__all__ = [
    "BatchConfig",
    "ExpertActor",
    "ExpertFFN",
    "ExpertHostCore",
    "ExpertInputError",
    "ExpertRejectReason",
    "ExpertSetConfig",
    "ExpertSpec",
    "ExpertSupervisor",
    "layout_shards",
    "spawn_expert_set",
]


# -- configuration ------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertSpec:
    """Shape and optimizer of every expert: ``d_model -> d_hidden -> d_model`` with GELU.

    Initial weights depend only on ``(seed, uid)``, so the same expert built in two
    processes is bitwise identical. Raises ``ValueError`` naming the bad field.
    """

    d_model: int = 256
    d_hidden: int = 1024
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("d_model", "d_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ExpertSpec.{name}: must be a positive integer, got {value!r}")
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"ExpertSpec.{name}: must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class BatchConfig:
    """How an ExpertActor batches concurrent requests for the same expert.

    After the first queued request it takes every request already queued and waits up to
    ``max_wait_s`` for more, until the batch holds ``max_rows`` rows (one request larger than
    that runs alone, never split).
    """

    max_rows: int = 8192
    max_wait_s: float = 0.001

    def __post_init__(self) -> None:
        if not isinstance(self.max_rows, int) or self.max_rows < 1:
            raise ValueError(f"BatchConfig.max_rows: must be a positive integer, "
                             f"got {self.max_rows!r}")
        if not math.isfinite(self.max_wait_s) or self.max_wait_s < 0:
            raise ValueError(f"BatchConfig.max_wait_s: must be >= 0, got {self.max_wait_s!r}")


@dataclass(frozen=True)
class ExpertSetConfig:
    """Every expert of a model's DMoE layers, how they are sharded, and how they recover.

    ``layers`` x ``grid`` give the uids (``<layer>.<i>.<j>``); they are cut into shards of
    ``experts_per_host`` experts (one ExpertActor each), unless ``shards`` lists the layout
    explicitly as ``((host_id, (uid, ...)), ...)``. ``snapshot_uri`` ("" = none) is the durable
    snapshot location (local dir, ``file://``, ``s3://``, ``gs://``); snapshots are taken every
    ``snapshot_interval_s``.
    """

    layers: tuple[str, ...] = ("moe0",)
    grid: tuple[int, ...] = (4, 4)
    spec: ExpertSpec = ExpertSpec()
    experts_per_host: int = 4
    shards: tuple[tuple[str, tuple[str, ...]], ...] = ()
    batch: BatchConfig = BatchConfig()
    snapshot_uri: str = ""
    snapshot_interval_s: float = 30.0
    heartbeat_s: float = 1.0
    check_interval_s: float = 0.5
    spawn_timeout_s: float = 120.0
    num_cpus: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "grid", tuple(self.grid))
        object.__setattr__(self, "shards", tuple((h, tuple(u)) for h, u in self.shards))
        if not self.layers:
            raise ValueError("ExpertSetConfig.layers: needs at least one layer name")
        grid_uids(self.layers[0], self.grid)  # validates the grid
        if not isinstance(self.experts_per_host, int) or self.experts_per_host < 1:
            raise ValueError(f"ExpertSetConfig.experts_per_host: must be a positive integer, "
                             f"got {self.experts_per_host!r}")
        for name in ("snapshot_interval_s", "heartbeat_s", "check_interval_s", "spawn_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"ExpertSetConfig.{name}: must be a positive number, "
                                 f"got {value!r}")
        if self.num_cpus < 0:
            raise ValueError(f"ExpertSetConfig.num_cpus: must be >= 0, got {self.num_cpus!r}")
        seen: set[str] = set()
        for host_id, uids in self.shards:
            for uid in uids:
                parse_uid(uid)
                if uid in seen:
                    raise ValueError(f"ExpertSetConfig.shards: expert {uid} is in two shards")
                seen.add(uid)


def layout_shards(config: ExpertSetConfig) -> dict[str, tuple[str, ...]]:
    """``{host_id: uids}``: the explicit ``shards``, else each layer's grid cut in order."""
    if config.shards:
        return dict(config.shards)
    out: dict[str, tuple[str, ...]] = {}
    for layer in config.layers:
        uids = grid_uids(layer, config.grid)
        n = config.experts_per_host
        for start in range(0, len(uids), n):
            out[f"{layer}-h{start // n}"] = uids[start:start + n]
    return out


# -- errors -----------------------------------------------------------------------------------


class ExpertRejectReason(str, enum.Enum):
    """Why an expert refused a request."""

    BAD_REQUEST = "bad_request"  # malformed call: lengths differ, not an array, ...
    UNKNOWN_EXPERT = "unknown_expert"  # this host does not serve the uid
    BAD_SHAPE = "bad_shape"  # not (rows, d_model), or grads shaped unlike inputs
    BAD_DTYPE = "bad_dtype"  # not float32
    NON_FINITE = "non_finite"  # NaN or inf in inputs or grads


class ExpertInputError(ValueError):
    """A request an expert refused; ``reason``, ``uid`` and ``detail`` say what to fix.

    Pickles with its fields, so a Ray caller can read ``exc.reason`` (Ray re-raises it as a
    ``RayTaskError`` subclass that is also an ``ExpertInputError``).
    """

    def __init__(self, reason: ExpertRejectReason, uid: str, detail: str):
        self.reason = ExpertRejectReason(reason)
        self.uid = uid
        self.detail = detail
        super().__init__(f"expert {uid}: {self.reason.value}: {detail}")

    def __reduce__(self):
        return (type(self), (self.reason, self.uid, self.detail))


# -- the torch core -----------------------------------------------------------------------------


class ExpertFFN(nn.Module):
    """``(rows, d_model) -> (rows, d_model)``: Linear, GELU, Linear (GPT-2 style init)."""

    def __init__(self, spec: ExpertSpec) -> None:
        super().__init__()
        self.up = nn.Linear(spec.d_model, spec.d_hidden)
        self.down = nn.Linear(spec.d_hidden, spec.d_model)
        for lin in (self.up, self.down):
            nn.init.normal_(lin.weight, mean=0.0, std=0.02)
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def build_expert(spec: ExpertSpec, uid: str) -> ExpertFFN:
    """The expert ``uid`` with weights that depend only on ``(spec.seed, uid)``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed * 1_000_003 + zlib.crc32(uid.encode()))
        return ExpertFFN(spec)


Array = np.ndarray | torch.Tensor


class ExpertHostCore:
    """The experts of one shard with their optimizers (Adam); no Ray, not thread-safe.

    ``forward(uids, inputs)`` and ``backward(uids, inputs, grads)`` take one float32 array of
    shape ``(rows, d_model)`` per uid (numpy or torch) and return one numpy array per uid.
    Both validate everything before computing anything and raise ``ExpertInputError``.
    """

    def __init__(self, uids: Sequence[str], spec: ExpertSpec, state: dict | None = None):
        if not uids:
            raise ValueError("an expert host needs at least one expert uid")
        for uid in uids:
            parse_uid(uid)
        self.spec = spec
        self.uids = tuple(uids)
        self.experts = {uid: build_expert(spec, uid) for uid in self.uids}
        self.optimizers = {
            uid: torch.optim.AdamW(m.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
            for uid, m in self.experts.items()
        }
        self.updates = {uid: 0 for uid in self.uids}
        self.step = 0  # snapshot counter, continued across re-spawns
        if state is not None:
            self.load(state)

    # -- validation ---------------------------------------------------------------------------

    def check(self, uid: Any, x: Any, grad: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(x, grad)`` as CPU float32 tensors, or ``ExpertInputError`` saying what is wrong."""
        if not isinstance(uid, str) or uid not in self.experts:
            raise ExpertInputError(ExpertRejectReason.UNKNOWN_EXPERT, str(uid),
                                   f"this host serves {', '.join(self.uids)}")
        x = self._tensor(uid, x, "inputs")
        if grad is not None:
            grad = self._tensor(uid, grad, "grads")
            if grad.shape != x.shape:
                raise ExpertInputError(ExpertRejectReason.BAD_SHAPE, uid,
                                       f"grads shape {tuple(grad.shape)} differs from inputs "
                                       f"shape {tuple(x.shape)}")
        return x, grad

    def _tensor(self, uid: str, a: Any, what: str) -> torch.Tensor:
        if isinstance(a, np.ndarray):
            if a.dtype != np.float32:
                raise ExpertInputError(ExpertRejectReason.BAD_DTYPE, uid,
                                       f"{what} must be float32, got {a.dtype}")
            t = torch.from_numpy(a if a.flags.writeable else a.copy())
        elif isinstance(a, torch.Tensor):
            if a.dtype != torch.float32:
                raise ExpertInputError(ExpertRejectReason.BAD_DTYPE, uid,
                                       f"{what} must be float32, got {a.dtype}")
            t = a.detach().cpu()
        else:
            raise ExpertInputError(ExpertRejectReason.BAD_REQUEST, uid,
                                   f"{what} must be a float32 array, got {type(a).__name__}")
        if t.dim() != 2 or t.shape[1] != self.spec.d_model:
            raise ExpertInputError(ExpertRejectReason.BAD_SHAPE, uid,
                                   f"{what} must have shape (rows, {self.spec.d_model}), "
                                   f"got {tuple(t.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise ExpertInputError(ExpertRejectReason.NON_FINITE, uid,
                                   f"{what} contain NaN or inf")
        return t

    def check_request(self, uids: Any, inputs: Any, grads: Any = None
                      ) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
        """Validate a whole multi-expert request; returns ``[(uid, x, grad), ...]``."""
        if not isinstance(uids, (tuple, list)) or not isinstance(inputs, (tuple, list)):
            raise ExpertInputError(ExpertRejectReason.BAD_REQUEST, "?",
                                   "uids and inputs must be tuples (one input per uid)")
        if len(uids) != len(inputs) or (grads is not None and len(grads) != len(uids)):
            raise ExpertInputError(ExpertRejectReason.BAD_REQUEST, "?",
                                   f"got {len(uids)} uids but {len(inputs)} inputs"
                                   + ("" if grads is None else f" and {len(grads)} grads"))
        if grads is None:
            return [(u, *self.check(u, x)) for u, x in zip(uids, inputs)]
        return [(u, *self.check(u, x, g)) for u, x, g in zip(uids, inputs, grads)]

    # -- compute --------------------------------------------------------------------------------

    def forward_one(self, uid: str, x: torch.Tensor) -> torch.Tensor:
        """Expert output for validated ``x`` ``(rows, d_model)``; no autograd state kept."""
        with torch.no_grad():
            return self.experts[uid](x)

    def backward_one(self, uid: str, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Input gradient for validated ``x`` and ``grad``; applies one optimizer step."""
        expert, optimizer = self.experts[uid], self.optimizers[uid]
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = expert(x)  # (rows, d_model)
            out.backward(grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.updates[uid] += 1
        return x.grad

    def forward(self, uids: Sequence[str], inputs: Sequence[Array]) -> list[np.ndarray]:
        return [self.forward_one(u, x).numpy() for u, x, _ in self.check_request(uids, inputs)]

    def backward(self, uids: Sequence[str], inputs: Sequence[Array],
                 grads: Sequence[Array]) -> list[np.ndarray]:
        return [self.backward_one(u, x, g).numpy()
                for u, x, g in self.check_request(uids, inputs, grads)]

    # -- state ------------------------------------------------------------------------------------

    def state(self) -> dict:
        """A self-describing copy of every expert and optimizer (CPU tensors)."""
        return {
            "version": STATE_VERSION,
            "uids": self.uids,
            "spec": asdict(self.spec),
            "step": self.step,
            "updates": dict(self.updates),
            "experts": {u: {k: v.detach().clone() for k, v in m.state_dict().items()}
                        for u, m in self.experts.items()},
            "optimizers": {u: o.state_dict() for u, o in self.optimizers.items()},
        }

    def load(self, state: dict) -> None:
        """Restore from :meth:`state`; raises ``ValueError`` if it is not for these experts."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"expert state version {state.get('version')!r} is not "
                             f"{STATE_VERSION}")
        if set(state["experts"]) != set(self.uids):
            raise ValueError(f"expert state holds {sorted(state['experts'])}, "
                             f"this host serves {sorted(self.uids)}")
        if state["spec"]["d_model"] != self.spec.d_model or \
                state["spec"]["d_hidden"] != self.spec.d_hidden:
            raise ValueError(f"expert state shape {state['spec']} does not match {self.spec}")
        for uid in self.uids:
            self.experts[uid].load_state_dict(state["experts"][uid])
            self.optimizers[uid].load_state_dict(state["optimizers"][uid])
        self.updates = dict(state["updates"])
        self.step = int(state["step"])


# -- the actor --------------------------------------------------------------------------------


@dataclass
class _Job:
    """One expert's slice of one request, waiting in the batching queue."""

    kind: str  # "forward" | "backward"
    uid: str
    x: torch.Tensor
    grad: torch.Tensor | None
    future: asyncio.Future


def _durable_store(uri: str, host_id: str) -> CheckpointStore:
    return CheckpointStore(f"{uri.rstrip('/')}/{host_id}", keep=2)


@ray.remote
class ExpertActor:
    """Serves one shard of experts on a spot node; see the module docstring.

    Create with the supervisor (``ExpertSupervisor``), or directly followed by ``start()``.
    ``state`` (a dict from ``snapshot``) restores the experts; without it, the latest durable
    snapshot under ``snapshot_uri/host_id`` is loaded if there is one, else fresh experts.
    """

    def __init__(self, host_id: str, uids: tuple[str, ...], spec: ExpertSpec,
                 coordinator=None, supervisor=None, state: dict | None = None,
                 snapshot_uri: str = "", heartbeat_s: float = 1.0,
                 batch: BatchConfig = BatchConfig()):
        torch.set_num_threads(1)  # one core per expert host; the machine's cores are shared
        self.host_id = host_id
        self.snapshot_uri = snapshot_uri
        restored_from = "fresh"
        if state is None and snapshot_uri:
            latest = _durable_store(snapshot_uri, host_id).load_latest()
            if latest is not None:
                state, restored_from = latest[1], f"durable step {latest[0]}"
        elif state is not None:
            restored_from = f"object store step {state.get('step')}"
        self.core = ExpertHostCore(uids, spec, state)
        self.restored_from = restored_from
        self.coordinator = coordinator
        self.supervisor = supervisor
        self.heartbeat_s = heartbeat_s
        self.batch = batch
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.instance = ctx.get_actor_id()
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="expert")
        self.queue: asyncio.Queue[_Job] | None = None
        self.tasks: list[asyncio.Task] = []
        self.retired = False
        self.delay_s = 0.0
        self.stats_ = {"requests": 0, "batches": 0, "forward_rows": 0, "backward_rows": 0,
                       "max_requests_per_batch": 0, "rejected": defaultdict(int)}

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> dict:
        """Start batching and heartbeats and register with the Coordinator; idempotent."""
        self._ensure_loop()
        if self.coordinator is not None and not any(t.get_name() == "hb" for t in self.tasks):
            await self._register()
            self.tasks.append(asyncio.create_task(self._heartbeat(), name="hb"))
        return self.info()

    def info(self) -> dict:
        return {"host_id": self.host_id, "instance": self.instance, "node_id": self.node_id,
                "uids": self.core.uids, "restored_from": self.restored_from,
                "step": self.core.step}

    def _ensure_loop(self) -> None:
        if self.queue is None:
            self.queue = asyncio.Queue()
            self.tasks.append(asyncio.create_task(self._batch_loop(), name="batch"))

    async def _register(self) -> None:
        me = ray.get_runtime_context().current_actor
        await self.coordinator.register_experts.remote(
            self.host_id, self.core.uids, me, self.node_id, self.instance)

    async def _heartbeat(self) -> None:
        while not self.retired:
            await asyncio.sleep(self.heartbeat_s)
            try:
                status = await self.coordinator.heartbeat_experts.remote(
                    self.host_id, self.instance)
                if status == HeartbeatStatus.UNKNOWN:
                    await self._register()
                elif status == HeartbeatStatus.SUPERSEDED:
                    log.info("%s: superseded by a newer instance; stop heartbeating",
                             self.host_id)
                    return
            except ray.exceptions.RayError as exc:  # Coordinator restarting: try again later
                log.warning("%s: heartbeat failed (%s)", self.host_id, type(exc).__name__)

    async def retire(self) -> bool:
        """Stop heartbeating and leave the registry (a replacement took over); keeps serving
        calls already routed here until the process ends."""
        self.retired = True
        if self.coordinator is None:
            return False
        return await self.coordinator.unregister_experts.remote(self.host_id, self.instance)

    def ping(self) -> str:
        return self.instance

    def stats(self) -> dict:
        s = dict(self.stats_)
        s["rejected"] = dict(s["rejected"])
        s["updates"] = dict(self.core.updates)
        return s | self.info()

    def set_delay(self, seconds: float) -> None:
        """Test hook: every following request waits ``seconds`` before it is queued."""
        self.delay_s = float(seconds)

    # -- serving ----------------------------------------------------------------------------------

    async def forward(self, uids: tuple[str, ...], inputs: tuple[Array, ...]
                      ) -> tuple[np.ndarray, ...]:
        """Outputs of ``uids[i]`` on ``inputs[i]`` ``(rows, d_model)`` float32, one per uid."""
        return await self._serve("forward", uids, inputs, None)

    async def backward(self, uids: tuple[str, ...], inputs: tuple[Array, ...],
                       grads: tuple[Array, ...]) -> tuple[np.ndarray, ...]:
        """Input grads of ``uids[i]``; each expert applies one optimizer step per batch."""
        return await self._serve("backward", uids, inputs, grads)

    async def _serve(self, kind: str, uids, inputs, grads) -> tuple[np.ndarray, ...]:
        self._ensure_loop()
        self.stats_["requests"] += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        try:
            checked = self.core.check_request(uids, inputs, grads)
        except ExpertInputError as exc:
            self.stats_["rejected"][exc.reason.value] += 1
            log.warning("%s: rejected %s request: %s", self.host_id, kind, exc)
            raise
        loop = asyncio.get_running_loop()
        jobs = [_Job(kind, u, x, g, loop.create_future()) for u, x, g in checked]
        for job in jobs:
            self.queue.put_nowait(job)
        outs = await asyncio.gather(*(j.future for j in jobs))
        return tuple(o.numpy() for o in outs)

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self.queue.get()]
            rows = jobs[0].x.shape[0]
            deadline = loop.time() + self.batch.max_wait_s
            while rows < self.batch.max_rows:
                try:
                    job = self.queue.get_nowait()
                except asyncio.QueueEmpty:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    try:
                        job = await asyncio.wait_for(self.queue.get(), remaining)
                    except asyncio.TimeoutError:
                        break
                jobs.append(job)
                rows += job.x.shape[0]
            results = await loop.run_in_executor(self.executor, self._execute, jobs)
            for job, result in zip(jobs, results):
                if job.future.done():
                    continue
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)

    def _execute(self, jobs: list[_Job]) -> list[torch.Tensor | BaseException]:
        """Run a batch on the worker thread: one torch call per (kind, expert)."""
        groups: dict[tuple[str, str], list[int]] = defaultdict(list)
        for i, job in enumerate(jobs):
            groups[(job.kind, job.uid)].append(i)
        results: list[Any] = [None] * len(jobs)
        for (kind, uid), idx in groups.items():
            sizes = [jobs[i].x.shape[0] for i in idx]
            x = torch.cat([jobs[i].x for i in idx]) if len(idx) > 1 else jobs[idx[0]].x
            try:
                if kind == "forward":
                    out = self.core.forward_one(uid, x)
                    self.stats_["forward_rows"] += x.shape[0]
                else:
                    g = torch.cat([jobs[i].grad for i in idx]) if len(idx) > 1 \
                        else jobs[idx[0]].grad
                    out = self.core.backward_one(uid, x, g)
                    self.stats_["backward_rows"] += x.shape[0]
                for i, part in zip(idx, out.split(sizes)):
                    results[i] = part
            except Exception as exc:  # noqa: BLE001 - reported to exactly these callers
                log.exception("%s: %s of %s failed", self.host_id, kind, uid)
                for i in idx:
                    results[i] = exc
        self.stats_["batches"] += 1
        self.stats_["max_requests_per_batch"] = max(self.stats_["max_requests_per_batch"],
                                                    len(jobs))
        return results

    # -- snapshots and notices ---------------------------------------------------------------

    async def snapshot(self, durable: bool = True) -> dict:
        """The shard's state (between batches, never mid-update); with ``durable`` and a
        ``snapshot_uri`` also written there. Returned to the caller, who owns the object."""
        loop = asyncio.get_running_loop()

        def take() -> dict:
            self.core.step += 1
            state = self.core.state()
            state["host_id"] = self.host_id
            if durable and self.snapshot_uri:
                _durable_store(self.snapshot_uri, self.host_id).save(state, state["step"])
            return state

        return await loop.run_in_executor(self.executor, take)

    async def on_notice(self, notice: Any = None) -> dict:
        """Preemption notice for this node: snapshot now, and have the supervisor re-spawn the
        shard on another node from it (returns once the replacement serves), then retire."""
        state = await self.snapshot(durable=True)
        result = {"host_id": self.host_id, "step": state["step"], "replacement": None}
        if self.supervisor is not None:
            result["replacement"] = await self.supervisor.handoff.remote(
                self.host_id, self.instance, self.node_id, state)
        return result


# -- the supervisor -----------------------------------------------------------------------------


@dataclass
class _Shard:
    host_id: str
    uids: tuple[str, ...]
    handle: Any = None
    instance: str = ""
    node_id: str = ""
    snapshot: list = field(default_factory=list)  # [ObjectRef] of the latest state, or []
    step: int = -1
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def notice_node_id(notice: Any) -> str:
    """The node a preemption notice is about: ``notice.node_id``, ``notice["node_id"]`` or
    the string itself; raises ``ValueError`` otherwise."""
    node_id = getattr(notice, "node_id", None)
    if node_id is None and isinstance(notice, Mapping):
        node_id = notice.get("node_id")
    if node_id is None and isinstance(notice, str):
        node_id = notice
    if not isinstance(node_id, str) or not node_id:
        raise ValueError(f"a notice must name its node (node_id), got {notice!r}")
    return node_id


def spot_nodes() -> list[str]:
    """Node ids of the live nodes carrying the spot resource, sorted."""
    return sorted(n["NodeID"] for n in ray.nodes()
                  if n.get("Alive") and n.get("Resources", {}).get(placement.SPOT_RESOURCE, 0) > 0)


@ray.remote
class ExpertSupervisor:
    """Keeps every shard of an ``ExpertSetConfig`` served by one live ExpertActor.

    Policy (pure helpers in ``moshray.cluster.registry``): shards spread over spot nodes, least
    loaded first; a replacement never goes to the node it is replacing nor to a node that
    sent a notice. Detection: a shard whose actor raises ``ActorDiedError`` on ping is re-spawned
    from its latest snapshot (object store; else the actor loads the durable one; else fresh).
    ``events()`` is the history: ``(t, host_id, event, node_id, detail)``.
    """

    def __init__(self, config: ExpertSetConfig, coordinator):
        self.config = config
        self.coordinator = coordinator
        self.shards = {h: _Shard(h, u) for h, u in layout_shards(config).items()}
        self.avoid: set[str] = set()  # nodes that sent a notice or died
        self.history: list[tuple[float, str, str, str, str]] = []
        self.t0 = time.monotonic()
        self.monitor: asyncio.Task | None = None
        self.last_snapshot = time.monotonic()

    def _event(self, host_id: str, event: str, node_id: str = "", detail: str = "") -> None:
        self.history.append((time.monotonic() - self.t0, host_id, event, node_id, detail))
        log.info("expert shard %s: %s on %s %s", host_id, event, node_id[:8], detail)

    async def start(self) -> dict[str, str]:
        """Spawn every shard (spread over spot nodes) and start monitoring; ``{host: node}``."""
        nodes = spot_nodes()
        placed = spread_shards(list(self.shards), nodes)
        await asyncio.gather(*(self._spawn(self.shards[h], prefer=n)
                               for h, n in placed.items()))
        if self.monitor is None:
            self.monitor = asyncio.create_task(self._monitor())
        return {h: s.node_id for h, s in self.shards.items()}

    def hosts(self) -> dict[str, dict]:
        """``{host_id: {uids, node_id, instance, handle, step}}`` for every shard."""
        return {h: {"uids": s.uids, "node_id": s.node_id, "instance": s.instance,
                    "handle": s.handle, "step": s.step} for h, s in self.shards.items()}

    def events(self) -> list[tuple[float, str, str, str, str]]:
        return list(self.history)

    async def wait_healthy(self, timeout_s: float = 60.0) -> bool:
        """True once every shard has a started actor (False after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(s.handle is not None for s in self.shards.values()):
                return True
            await asyncio.sleep(0.1)
        return False

    async def snapshot_all(self) -> dict[str, int]:
        """Snapshot every shard now (object store + durable); ``{host_id: step}``."""
        await asyncio.gather(*(self._snapshot(s) for s in self.shards.values()))
        self.last_snapshot = time.monotonic()
        return {h: s.step for h, s in self.shards.items()}

    async def handoff(self, host_id: str, instance: str, node_id: str, state: dict) -> str:
        """Called by an ExpertActor on notice: re-spawn its shard elsewhere from ``state``."""
        shard = self.shards[host_id]
        self.avoid.add(node_id)
        async with shard.lock:
            if shard.instance != instance:
                return shard.node_id  # already replaced
            self._keep(shard, state)
            old = shard.handle
            self._event(host_id, "notice", node_id, f"snapshot step {shard.step}")
            await self._spawn_locked(shard)
        try:
            await asyncio.wait_for(old.retire.remote(), 5.0)
        except (ray.exceptions.RayError, asyncio.TimeoutError):
            pass  # the old copy is gone already; the registry has the new one
        return shard.node_id

    async def on_notice(self, notice: Any) -> list[str]:
        """A node-level notice: hand off every shard on that node; returns their host ids.

        ``notice`` names the node by a ``node_id`` attribute or key, or is the node id itself.
        """
        node_id = notice_node_id(notice)
        self.avoid.add(node_id)
        moved = []
        for shard in list(self.shards.values()):
            if shard.node_id == node_id and shard.handle is not None:
                try:
                    await asyncio.wait_for(shard.handle.on_notice.remote(notice),
                                           self.config.spawn_timeout_s)
                    moved.append(shard.host_id)
                except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
                    self._event(shard.host_id, "notice_failed", node_id, type(exc).__name__)
        return moved

    async def stop(self) -> None:
        """Stop monitoring and kill every expert actor."""
        if self.monitor is not None:
            self.monitor.cancel()
        for shard in self.shards.values():
            if shard.handle is not None:
                try:
                    await asyncio.wait_for(shard.handle.retire.remote(), 5.0)
                except (ray.exceptions.RayError, asyncio.TimeoutError):
                    pass
                ray.kill(shard.handle)
                shard.handle = None

    # -- internals ---------------------------------------------------------------------------------

    def _keep(self, shard: _Shard, state: dict) -> None:
        if state["step"] > shard.step:
            shard.snapshot = [ray.put(state)]  # owned here, stored on the head node
            shard.step = state["step"]

    async def _snapshot(self, shard: _Shard) -> None:
        handle = shard.handle
        if handle is None:
            return
        try:
            state = await asyncio.wait_for(
                handle.snapshot.remote(durable=bool(self.config.snapshot_uri)),
                self.config.spawn_timeout_s)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
            self._event(shard.host_id, "snapshot_failed", shard.node_id, type(exc).__name__)
            return
        self._keep(shard, state)

    async def _spawn(self, shard: _Shard, prefer: str | None = None) -> None:
        async with shard.lock:
            await self._spawn_locked(shard, prefer)

    async def _spawn_locked(self, shard: _Shard, prefer: str | None = None) -> None:
        """Start a new actor for ``shard`` from its latest snapshot; retries other nodes."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        me = ray.get_runtime_context().current_actor
        tried: set[str] = set()
        for attempt in range(5):
            nodes = spot_nodes()
            load: dict[str, int] = defaultdict(int)
            for other in self.shards.values():
                if other is not shard and other.handle is not None:
                    load[other.node_id] += 1
            avoid = self.avoid | tried | ({shard.node_id} if shard.handle else set())
            node = prefer if prefer in nodes and prefer not in avoid else \
                choose_node(nodes, load, avoid)
            prefer = None
            options = placement.on_spot(self.config.num_cpus)
            if node is not None:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
            args = (shard.host_id, shard.uids, self.config.spec, self.coordinator, me)
            kwargs = dict(snapshot_uri=self.config.snapshot_uri,
                          heartbeat_s=self.config.heartbeat_s, batch=self.config.batch)
            state = shard.snapshot[0] if shard.snapshot else None
            handle = ExpertActor.options(max_concurrency=1000, **options).remote(
                *args, state=state, **kwargs)
            try:
                info = await asyncio.wait_for(handle.start.remote(), self.config.spawn_timeout_s)
            except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
                self._event(shard.host_id, "spawn_failed", node or "", type(exc).__name__)
                ray.kill(handle)
                tried.add(node or "")
                await asyncio.sleep(0.5 * (attempt + 1))
                continue
            shard.handle, shard.instance, shard.node_id = handle, info["instance"], \
                info["node_id"]
            self._event(shard.host_id, "spawned", shard.node_id, info["restored_from"])
            return
        shard.handle = None
        self._event(shard.host_id, "unplaced", "", "no node accepted the shard")

    async def _check(self, shard: _Shard) -> None:
        handle, instance = shard.handle, shard.instance
        if handle is None:
            await self._spawn(shard)
            return
        try:
            await asyncio.wait_for(handle.ping.remote(), 10.0)
            return
        except ray.exceptions.ActorDiedError as exc:
            cause = type(exc).__name__
        except (ray.exceptions.ActorUnavailableError, asyncio.TimeoutError):
            return  # busy or restarting: not proof of death
        except ray.exceptions.RayError as exc:
            cause = type(exc).__name__
        async with shard.lock:
            if shard.instance != instance:
                return  # replaced meanwhile (handoff)
            lost_at = time.monotonic()
            self._event(shard.host_id, "lost", shard.node_id, cause)
            await self._spawn_locked(shard)  # not on the node it died on
            self._event(shard.host_id, "respawned", shard.node_id,
                        f"{time.monotonic() - lost_at:.2f}s from snapshot step {shard.step}")

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(self.config.check_interval_s)
            try:
                await asyncio.gather(*(self._check(s) for s in self.shards.values()))
                if time.monotonic() - self.last_snapshot >= self.config.snapshot_interval_s:
                    await self.snapshot_all()
            except Exception:  # noqa: BLE001 - the monitor must outlive any one failure
                log.exception("expert supervisor: monitor tick failed")


def spawn_expert_set(config: ExpertSetConfig, coordinator, timeout_s: float = 120.0):
    """Start an ``ExpertSupervisor`` on the head node and all its shards; returns its handle.

    Blocks until every shard serves (raises ``TimeoutError`` after ``timeout_s``).
    """
    supervisor = ExpertSupervisor.options(max_concurrency=1000, **placement.on_head()).remote(
        config, coordinator)
    ray.get(supervisor.start.remote(), timeout=timeout_s)
    if not ray.get(supervisor.wait_healthy.remote(timeout_s), timeout=timeout_s + 10):
        raise TimeoutError(f"expert shards not all serving after {timeout_s} s")
    return supervisor


def uids_of(hosts: Mapping[str, dict]) -> dict[str, str]:
    """``{uid: host_id}`` from ``ExpertSupervisor.hosts()``."""
    return {u: h for h, info in hosts.items() for u in info["uids"]}
