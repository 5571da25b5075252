"""ExpertActor: the async Ray actor that serves one shard of experts on a spot node.

Contract: ``forward`` / ``backward`` take one float32 ``(rows, d_model)`` array per uid and
return one per uid (see ``expert_core``). Concurrent requests for the same expert are batched
up to ``BatchConfig.max_rows`` rows or ``max_wait_s`` seconds and computed on one worker
thread (so updates of one expert never race). The actor registers its experts with the
Coordinator and heartbeats, snapshots on request (durably through ``CheckpointStore`` when it
has a ``snapshot_uri``), and on a preemption notice hands its shard over to the supervisor.
Bad requests raise ``ExpertInputError``; the actor keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from moshray.cluster.coordinator.expert_registry import HeartbeatStatus

from moshray.actors.replica.checkpoint import CheckpointStore
from moshray.actors.moe.expert_config import BatchConfig, ExpertSpec
from moshray.actors.moe.expert_core import Array, ExpertHostCore
from moshray.actors.moe.expert_errors import ExpertInputError

log = logging.getLogger(__name__)

__all__ = ["ExpertActor"]


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
