"""ReplicaActor: one model replica and its local training loop on a spot node.

Collaborative mode (DeDLOC): the replica runs micro-batches at its own pace, accumulating
gradients, and reports progress to the Coordinator after each one. When the reply carries
a plan, it averages its mean gradient (weighted by the samples behind it) with the plan's
participants through the Moshpit ``Averager`` and applies one optimizer step; every
participant applies the same averaged gradient, so all replicas stay identical.

Local-SGD mode (Moshpit SGD): the replica takes optimizer steps on its own gradients and
reports samples; on a plan it averages parameters instead, optionally followed by a
DiLoCo-style outer Nesterov step on the averaged delta.

Joining: a replica with no state copies parameters, optimizer state and epoch from a live
donor through the object store (``get_state``), then asks the Coordinator to mark it
ready (accepted only if no newer plan exists; else it copies again). A replica told to
resync (its checksum disagrees with the majority, or it missed a step) does the same.
Failures of other peers never raise here: the averager's deadlines bound every round.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from moshray.cluster import metrics
from moshray.cluster.averager import Averager
from moshray.cluster.messages import Contribution, PartResult, RoundPlan
from moshray.cluster.progress import ProgressReport

from .checkpoint import CheckpointStore
from .data import ByteBatches
from .model import build_model, pick_device
from .moe import RayExpertBackend

log = logging.getLogger(__name__)

STATE_VERSION = 1
MAX_OWN_REJECTIONS = 3  # consecutive steps with our contribution rejected -> resync


def checksum(model: torch.nn.Module) -> str:
    """Digest of every parameter's bytes (equal digests = bitwise equal replicas)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


DIGEST_ELEMENTS = 1 << 16  # parameters sampled by the per-step digest


def step_digest(model: torch.nn.Module, epoch: int) -> str:
    """A cheap per-step digest: about ``DIGEST_ELEMENTS`` parameter values at a stride that
    rotates with ``epoch``, plus every tensor's sum (a step changes every element, so a
    replica that diverged differs in the sample and the sums). ``checksum`` is the full one
    (end of run, on demand)."""
    params = [p.detach().reshape(-1) for p in model.parameters()]
    total = sum(p.numel() for p in params)
    stride = max(1, total // DIGEST_ELEMENTS)
    h = hashlib.sha256()
    for p in params:
        start = epoch % stride if p.numel() > stride else 0
        h.update(p[start::stride].cpu().numpy().tobytes())
        h.update(p.sum(dtype=torch.float64).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class Lineage:
    """Which global steps the state this replica holds has gone through.

    Travels with the state (donor copies, checkpoints). Steps must be applied in order,
    once each: a step skipped is counted in ``gaps`` (lost), one applied again in
    ``repeats``; both stay 0 in a correct run.
    """

    last: int = 0
    gaps: int = 0
    repeats: int = 0

    def apply(self, epoch: int) -> None:
        if epoch <= self.last:
            self.repeats += 1
        else:
            self.gaps += epoch - self.last - 1
        self.last = max(self.last, epoch)

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.last, self.gaps, self.repeats)

    @classmethod
    def from_tuple(cls, t, epoch: int) -> "Lineage":
        """From ``as_tuple``; a state without one (older checkpoint) starts clean at ``epoch``."""
        return cls(*t) if t else cls(last=epoch)


@ray.remote
class ReplicaActor:
    """See module docstring. ``config`` is a ``TrainConfig.to_dict()`` dict."""

    def __init__(self, peer_id: str, config: dict, files: list[str], shard_index: int,
                 coordinator, init_state_ref: list | None = None):
        from moshray.jobs.config import TrainConfig

        torch.set_num_threads(1)
        self.peer_id = peer_id
        self.config = TrainConfig.from_dict(config)
        t = self.config.training
        # On a GPU node Ray gave this actor one GPU (CUDA_VISIBLE_DEVICES names it): train
        # there, with bf16 autocast where the device supports it; else on the CPU.
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        self.device = pick_device()
        self.amp = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        if self.gpu_ids and self.device.type != "cuda":
            log.warning("%s: Ray assigned GPU %s but torch sees no CUDA device; training on "
                        "the CPU", peer_id, ",".join(self.gpu_ids))
        # DMoE layers call the experts registered with the Coordinator (the ExpertActors the
        # job's ExpertSupervisor keeps alive); the experts train themselves on backward.
        self.experts = RayExpertBackend(coordinator) if self.config.model.moe else None
        self.model = build_model(self.config.model.to_model_config(), seed=t.seed,
                                 experts=self.experts).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr,
                                           weight_decay=t.weight_decay)
        self.outer = None
        self.anchor: list[torch.Tensor] | None = None
        if t.mode == "local_sgd" and t.outer_optimizer == "nesterov":
            self.anchor = [p.detach().clone() for p in self.model.parameters()]
            self.outer = torch.optim.SGD(self.anchor, lr=t.outer_lr, momentum=t.outer_momentum,
                                         nesterov=True)
        self.data = ByteBatches(files, shard_index, max(self.config.cluster.max_nodes, 1),
                                self.config.model.seq_len, t.batch_size, t.seed)
        self.coordinator = coordinator
        self.averager = Averager(peer_id)
        self.epoch = 0
        # Parameters right after the last global step: equal on every replica at the same
        # epoch in both modes (local SGD moves them on between averages, by design).
        self.step_checksum = step_digest(self.model, 0)
        self.lineage = Lineage()
        self.samples = 0
        self.micro = 0
        self.loss_sum = 0.0
        self.own_rejections = 0
        self.consecutive_bad = 0
        self.fault: str | None = None
        self._state_lock = asyncio.Lock()
        self._init_state_ref = init_state_ref
        self.node_id = ray.get_runtime_context().get_node_id()
        self.started_at = time.monotonic()  # join time is measured from here
        self.joined = False  # contributed to an averaged step yet?
        self._plan: RoundPlan | None = None  # pushed by the Coordinator, not yet taken
        self._inflight: list[tuple[int, asyncio.Future]] = []  # (epoch sent at, reply)
        self._saw_rejections: list[tuple[str, str, int]] = []  # others', for the Coordinator

    # -- transport --------------------------------------------------------------------------

    async def receive_contribution(self, c: Contribution) -> None:
        self.averager.deliver_contribution(c)

    async def receive_result(self, r: PartResult) -> None:
        self.averager.deliver_result(r)

    # -- state ------------------------------------------------------------------------------

    def _state(self) -> dict:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "lineage": self.lineage.as_tuple(),
            "step_checksum": self.step_checksum,
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "outer": self.outer.state_dict() if self.outer else None,
            "anchor": [a.cpu() for a in self.anchor] if self.anchor else None,
            "config": self.config.to_dict(),
        }

    def _load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.outer is not None and state.get("outer") is not None:
            for a, s in zip(self.anchor, state["anchor"]):
                a.data.copy_(s)
            self.outer.load_state_dict(state["outer"])
        self.epoch = int(state["epoch"])
        self.lineage = Lineage.from_tuple(state.get("lineage"), self.epoch)
        # Local SGD: a donor hands over its current (moved-on) parameters; the checksum
        # that identifies the step is the donor's, taken right after that step.
        self.step_checksum = state.get("step_checksum") or checksum(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        self.samples, self.micro, self.loss_sum = 0, 0, 0.0

    async def get_state(self) -> tuple[int, list]:
        """(epoch, [ref]) of this replica's state, taken between steps (never mid-step)."""
        async with self._state_lock:
            state = self._state()
        return state["epoch"], [ray.put(state)]

    async def save_checkpoint(self, uri: str) -> str:
        async with self._state_lock:
            state = self._state()
        return await asyncio.to_thread(CheckpointStore(uri).save, state, state["epoch"])

    def status(self) -> dict:
        # Collaborative replicas change parameters only in global steps: the full digest of
        # the current parameters is the step's. Local SGD moves them on between averages.
        full = self.config.training.mode == "collaborative"
        return {"peer": self.peer_id, "epoch": self.epoch,
                "checksum": checksum(self.model) if full else self.step_checksum,
                "current_checksum": checksum(self.model),
                "node": self.node_id, "rejected": self.own_rejections, "pid": os.getpid(),
                "device": str(self.device), "gpu_ids": self.gpu_ids, "amp": self.amp,
                "lost_steps": self.lineage.gaps, "repeated_steps": self.lineage.repeats}

    def rejection_counts(self) -> dict[str, int]:
        """Contributions this replica rejected so far, by reason (from its averager)."""
        return dict(self.averager.rejection_counts)

    def inject_fault(self, fault: str | None) -> None:
        """Test hook, until reset to None: ``"nan"`` makes every following gradient NaN;
        ``"shape"`` sends contributions with one element too many (peers reject both)."""
        if fault not in (None, "nan", "shape"):
            raise ValueError(f"unknown fault {fault!r}: use 'nan', 'shape' or None")
        self.fault = fault

    # -- joining ------------------------------------------------------------------------------

    async def _sync(self) -> None:
        """Copy state from a donor (or the initial checkpoint) and become ready."""
        for attempt in range(600):
            donor = await self.coordinator.donor.remote(self.peer_id)
            if donor is not None:
                try:
                    epoch, [ref] = await donor[1].get_state.remote()
                    state = await ref
                    async with self._state_lock:
                        self._load(state)
                except ray.exceptions.RayError as exc:
                    log.warning("%s: donor %s failed (%s); retrying", self.peer_id, donor[0],
                                type(exc).__name__)
                    await asyncio.sleep(0.2)
                    continue
            elif self._init_state_ref:
                state = await self._init_state_ref[0]
                async with self._state_lock:
                    self._load(state)
                await self.coordinator.resume_from.remote(self.epoch)
            if await self.coordinator.mark_ready.remote(self.peer_id, self.epoch):
                log.info("%s ready at epoch %d (attempt %d)", self.peer_id, self.epoch, attempt)
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.peer_id}: could not sync state after 600 attempts")

    # -- the loop -------------------------------------------------------------------------------

    def _micro_step(self) -> tuple[float, int]:
        x, y = self.data.next_batch()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16,
                            enabled=self.amp):
            loss = self.model.loss(x, y)
        loss.backward()
        if self.fault == "nan":
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        if self.config.training.mode == "local_sgd":
            self._clip()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()), x.shape[0]

    def _clip(self) -> None:
        if self.config.training.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.training.grad_clip)

    async def receive_plan(self, plan: RoundPlan) -> None:
        """The Coordinator pushes each plan this replica takes part in the moment it exists;
        the training loop takes it after its current micro-batch."""
        if plan.epoch == self.epoch + 1:
            self._plan = plan

    def _send_report(self, force: bool = False) -> None:
        """Progress to the Coordinator without waiting for the reply (the loop goes on
        computing); at most one routine report in flight, ``force`` sends anyway (right
        after a step, so the Coordinator sees the new epoch at once)."""
        if self._inflight and not force:
            return
        report = ProgressReport(self.peer_id, self.epoch, self.samples,
                                self.loss_sum / self.samples if self.samples else None,
                                self.step_checksum, self.own_rejections,
                                tuple(self._saw_rejections))
        self._saw_rejections.clear()
        self._inflight.append((self.epoch, asyncio.ensure_future(self._ask(report))))

    async def _ask(self, report: ProgressReport):
        return await self.coordinator.report.remote(report)

    def _replies(self) -> str | None:
        """Handle the replies that arrived: ``"stop"`` or ``"resync"`` (if still meant for
        this replica's epoch), a plan to take; None if nothing to do now."""
        verdict = None
        while self._inflight and self._inflight[0][1].done():
            sent_at, future = self._inflight.pop(0)
            try:
                reply = future.result()
            except ray.exceptions.RayError as exc:
                log.info("%s: report failed (%s)", self.peer_id, type(exc).__name__)
                continue
            if reply.unknown:
                verdict = verdict or "rejoin"
            elif reply.stop:
                verdict = "stop"
            elif reply.resync and sent_at == self.epoch and verdict is None:
                verdict = "resync"
            elif reply.plan is not None and reply.plan.epoch == self.epoch + 1:
                self._plan = reply.plan
        return verdict

    async def run(self) -> dict:
        """Train until the Coordinator says stop; returns this replica's final status."""
        await self.coordinator.register.remote(self.peer_id, self._self_handle(), self.node_id)
        await self._sync()
        heartbeat = asyncio.ensure_future(self._heartbeat())
        self._send_report(force=True)
        try:
            while True:
                verdict = self._replies()
                if verdict == "stop":
                    break
                if verdict == "resync":
                    await self._sync()
                    self._send_report(force=True)
                    continue
                if verdict == "rejoin":
                    await self._rejoin()
                    self._send_report(force=True)
                    continue
                plan, self._plan = self._plan, None
                if plan is not None and plan.epoch == self.epoch + 1:
                    await self._global_step(plan)
                    self._send_report(force=True)
                    continue
                loss, n = await asyncio.to_thread(self._micro_step)
                self.samples += n
                self.micro += 1
                self.loss_sum += loss * n
                if self.experts is not None:
                    self._report_expert_calls()
                self._send_report()
                await asyncio.sleep(0)  # let pushed plans and replies in
        finally:
            heartbeat.cancel()
            for _, future in self._inflight:
                future.cancel()
        return self.status()

    def _report_metrics(self, report) -> None:
        """Metrics events for one averaging round (fire-and-forget; see cluster/metrics.py):
        the round itself and, after this replica's first averaged step, its join time."""
        events: list = [metrics.RoundEvent.from_report(report)]
        if not self.joined and self.peer_id in report.contributors:
            self.joined = True
            events.append(metrics.JoinEvent(max(0.0, time.monotonic() - self.started_at)))
        try:
            self.coordinator.record.remote(tuple(events))
        except ray.exceptions.RayError as exc:  # the Coordinator is gone: nothing to tell
            log.info("%s: metrics not recorded (%s)", self.peer_id, type(exc).__name__)

    def _report_expert_calls(self) -> None:
        """The DMoE layers' expert calls since the last report, as metrics events."""
        events = tuple(metrics.ExpertCallEvent(kind, seconds)
                       for kind, seconds in self.experts.take_calls())
        if events:
            self.coordinator.record.remote(events)

    def _self_handle(self):
        return ray.get_runtime_context().current_actor

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                if not await self.coordinator.heartbeat.remote(self.peer_id):
                    await self._rejoin()
            except ray.exceptions.RayError:
                pass

    async def _rejoin(self) -> None:
        """The Coordinator restarted and forgot this replica: re-register with the epoch
        of the state held (it is ready at once if that is the newest)."""
        async with self._state_lock:
            epoch = self.epoch
        ready = await self.coordinator.rejoin.remote(self.peer_id, self._self_handle(),
                                                     self.node_id, epoch)
        log.warning("%s: rejoined a restarted Coordinator at epoch %d (%s)", self.peer_id,
                    epoch, "ready" if ready else "to resync")

    async def _global_step(self, plan: RoundPlan) -> None:
        t = self.config.training
        params = list(self.model.parameters())
        async with self._state_lock:
            if t.mode == "collaborative":
                grads = [(p.grad / max(self.micro, 1)) if p.grad is not None
                         else torch.zeros_like(p) for p in params]
                if self.fault == "shape":
                    grads.append(torch.zeros(1, device=self.device))
                averaged, report = await self.averager.all_reduce(
                    grads, self.samples, plan, t.round_timeout_s)
                for p, g in zip(params, averaged):
                    p.grad = g.to(p.device)
                self._clip()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            else:
                averaged, report = await self.averager.all_reduce(
                    [p.detach() for p in params], self.samples, plan, t.round_timeout_s)
                with torch.no_grad():
                    for p, a in zip(params, averaged):
                        p.copy_(a)
                    if self.outer is not None:
                        for anchor, p in zip(self.anchor, params):
                            anchor.grad = anchor - p  # outer gradient: the averaged delta
                        self.outer.step()
                        self.outer.zero_grad(set_to_none=True)
                        for anchor, p in zip(self.anchor, params):
                            p.copy_(anchor)
            self.lineage.apply(plan.epoch)
            self.step_checksum = step_digest(self.model, plan.epoch)
            self.epoch = plan.epoch
            self.samples, self.micro, self.loss_sum = 0, 0, 0.0
        self._report_metrics(report)
        self._saw_rejections.extend((r.sender, r.reason.value, plan.epoch)
                                    for r in report.rejections if r.sender != self.peer_id)
        mine = [r for r in report.rejections if r.sender == self.peer_id]
        if mine:
            self.own_rejections += 1
            self.consecutive_bad += 1
            log.warning("%s: own contribution rejected at epoch %d (%s)", self.peer_id,
                        plan.epoch, mine[0].reason.value)
            if self.consecutive_bad >= MAX_OWN_REJECTIONS:
                log.warning("%s: %d bad steps in a row; restarting from a donor", self.peer_id,
                            self.consecutive_bad)
                self.consecutive_bad = 0
                await self.coordinator.leave.remote(self.peer_id)
                await self.coordinator.register.remote(self.peer_id, self._self_handle(),
                                                       self.node_id)
                await self._sync()
        else:
            self.consecutive_bad = 0
