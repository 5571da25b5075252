"""ReplicaActor: one model replica on a spot node, running the user's training loop.

The actor hosts three things: the user's loop ``loop(session)`` (``actors/replica/session.py``),
run in a thread with torch seeded from the config; the ``StepManager`` on the actor's event
loop (``actors/replica/step_manager.py``: the Coordinator protocol and the global steps); and the
transport the collective and the Coordinator call (contributions, results, pushed plans,
``get_state`` for joiners). A ``UserError`` from the loop fails ``run()`` with that error,
which stops the job; the failure of another peer never raises here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
import torch

import moshray.cluster.collective.inline as inline
from moshray.cluster.messages import CheckpointRef, Contribution, PartResult, PeerPlan

from moshray.actors.replica.build_check import build_mismatch, installed_build
from moshray.actors.replica.checkpoint import SaveResult, job_run_id, save_to
from moshray.actors.replica.device import pick_device
from moshray.actors.replica.state import extra_digest
from moshray.actors.replica.session import Session
from moshray.actors.replica.step_manager import StepManager

log = logging.getLogger(__name__)

WARN_BLOCKING_GET_ENV = "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"  # ray._common.constants


@dataclass(frozen=True)
class Job:
    """What every replica runs: the user's ``loop(session)`` and the data source;
    ``return_state``: the driver fetches a staying replica's final state at the end."""

    loop: Callable[[Session], Any]
    data: Any  # a moshray.actors.replica.data_sources.DataSource
    return_state: bool = False


class _Move:
    """A checkpoint save in progress (``ReplicaActor.move_progress``)."""

    def __init__(self, started: float) -> None:
        self.started = self.moved_at = started
        self.done = self.total = 0


@ray.remote
class ReplicaActor:
    """See module docstring. ``config`` is a ``TrainConfig.to_dict()`` dict."""

    def __init__(self, peer_id: str, config: dict, job: Job, coordinator,
                 resume: CheckpointRef | None = None, build: str | None = None,
                 job_key: bytes | None = None):
        # ``job_key``: the job's secret its averager signs and checks contributions with
        # (``cluster/collective/auth.py``; ``ReplicaSpec.job_key``); None: unsigned (tests).
        from moshray.jobs.config import TrainConfig

        torch.set_num_threads(1)
        # The user's loop runs in a thread of its own (``_loop_thread``), where a blocking
        # ray.get (a data shard, an expert's output) is right. Ray's "blocking ray.get inside
        # async actor" warning looks only at whether the actor is async, not at the thread,
        # so it would report every replica's first data fetch as blocking the event loop.
        os.environ.setdefault(WARN_BLOCKING_GET_ENV, "0")
        self.peer_id = peer_id
        self.config = TrainConfig.from_dict(config)
        self.job = job
        self.coordinator = coordinator
        # On a GPU node Ray gave this actor one GPU (CUDA_VISIBLE_DEVICES names it): train
        # there; else on the CPU.
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        self.device = pick_device(self.gpu_ids)
        if self.gpu_ids and self.device.type != "cuda":
            log.warning("%s: Ray assigned GPU %s but torch sees no CUDA device; training on "
                        "the CPU", peer_id, ",".join(self.gpu_ids))
        self.node_id = ray.get_runtime_context().get_node_id()
        handle = ray.get_runtime_context().current_actor
        self.manager = StepManager(peer_id, coordinator, handle, self.node_id,
                                   self.config.training.round_timeout_s, resume,
                                   config=config, job_key=job_key,
                                   deadline=self.config.training.deadline_policy())
        self.session: Session | None = None
        self._run_task: asyncio.Task | None = None  # run()'s, once it started
        self._move: _Move | None = None  # the checkpoint save in progress
        # The driver's build against this node's (``build_check.py``): ``run()`` raises the
        # mismatch before the replica joins, and that UserError stops the job.
        self.refusal = build_mismatch(build, installed_build(), ray.util.get_node_ip_address())
        if self.refusal is not None:
            log.error("%s: %s", peer_id, self.refusal)

    # -- transport ---------------------------------------------------------------------------

    async def receive_contribution(self, c: Contribution, *chunks) -> None:
        """A member's contribution; ``chunks``: its inline bytes (``cluster/collective/inline.py``)."""
        self.manager.averager.deliver_contribution(inline.join(c, chunks))

    async def receive_result(self, r: PartResult, *chunks) -> None:
        """A part's result; ``chunks``: its inline bytes (``cluster/collective/inline.py``)."""
        self.manager.averager.deliver_result(inline.join(r, chunks))

    async def receive_plan(self, plan: PeerPlan) -> None:
        """The Coordinator pushes each plan this replica takes part in the moment it exists;
        the loop takes it after its current micro-batch."""
        self.manager.receive_plan(plan)

    # -- state -------------------------------------------------------------------------------

    async def get_state(self) -> tuple[int, list]:
        """(epoch, [ref]) of this replica's state, taken between steps (never mid-step)."""
        state = await self.manager.snapshot()
        return state["epoch"], [ray.put(state)]

    async def save_checkpoint(self, uri: str) -> SaveResult:
        """Write the state into this run's directory under ``uri`` (``checkpoint.run_id``,
        else ``run_dir``'s name); its data position is the Coordinator's at this moment
        (every shard handed out so far counts as seen, so a resumed run repeats none).
        A saved checkpoint is noted at the Coordinator (``note_checkpoint``). A failed save (full disk, storage error, unstorable state) is returned as a
        ``SaveResult`` with ``ok`` False, never raised."""
        state = await self.manager.snapshot()
        floor = state["data"].get("position", 0)
        state["data"] = {**state["data"],
                         "position": await self.coordinator.data_position.remote(floor)}
        run_id = job_run_id(self.config.checkpoint, self.config.name)
        moving = _Move(time.monotonic())
        self._move = moving

        def progress(done: int, total: int) -> None:  # from the saving thread
            moving.total = total
            if done > moving.done:
                moving.done, moving.moved_at = done, time.monotonic()

        try:
            result = await asyncio.to_thread(save_to, uri, run_id, state, state["epoch"],
                                             progress)
        finally:
            self._move = None
        if result.ok:  # a swarm that loses every replica resumes from it (``_sync``)
            try:
                await self.coordinator.note_checkpoint.remote(
                    CheckpointRef(uri, run_id, result.step))
            except ray.exceptions.RayError as exc:  # the save itself stands
                log.warning("%s: checkpoint %s not noted at the Coordinator (%s)",
                            self.peer_id, result.location, type(exc).__name__)
        return result

    def move_progress(self) -> dict | None:
        """How the checkpoint save in progress is going (None: none is): ``done`` and
        ``total`` bytes (``total`` 0 while the state is serialized), seconds since it began
        (``since_s``) and since a byte last moved (``idle_s``). The driver bounds its wait by
        these (``driver_calls.move_verdict``)."""
        move = self._move
        if move is None:
            return None
        now = time.monotonic()
        return {"done": move.done, "total": move.total, "since_s": now - move.started,
                "idle_s": now - move.moved_at}

    def status(self) -> dict:
        s = self.session.state if self.session is not None else None
        if s is None:
            return {"peer": self.peer_id, "epoch": 0, "checksum": None, "node": self.node_id,
                    "pid": os.getpid(), "device": str(self.device), "gpu_ids": self.gpu_ids}
        # Collaborative replicas change parameters only in global steps (and put back the
        # step's buffers when the loop ends): the full digest of the current state is the
        # step's. Local SGD moves them on between averages.
        current = s.full_checksum()
        full = not self.session.strategy.local_updates
        return {"peer": self.peer_id, "epoch": s.epoch,
                "checksum": current if full else s.step_checksum, "current_checksum": current,
                "node": self.node_id, "rejected": self.manager.own_rejections,
                "pid": os.getpid(), "device": str(self.device), "gpu_ids": self.gpu_ids,
                "lost_steps": s.lineage.gaps, "repeated_steps": s.lineage.repeats,
                "data_position": s.feed.position, "shards_opened": s.feed.shards_opened,
                "extra": {k: v for k, v in s.extra.items() if isinstance(v, (int, float, str))},
                "extra_digest": extra_digest(s.extra)}

    def rejection_counts(self) -> dict[str, int]:
        """Contributions this replica rejected so far, by reason (from its averager)."""
        return dict(self.manager.averager.rejection_counts)

    # -- the loop ------------------------------------------------------------------------------

    async def wait_run(self) -> dict:
        """What ``run()`` returns or raises, for a driver that did not start it (a detached
        replica adopted by a resubmitted driver: the first driver's run ref died with it,
        the run itself did not). Raises ``RuntimeError`` if ``run()`` never started."""
        if self._run_task is None:
            raise RuntimeError(f"{self.peer_id}: run() was never started")
        return await asyncio.shield(self._run_task)

    async def run(self) -> dict:
        """Run the user's loop until the Coordinator says stop; returns the final status.
        Raises the build mismatch (a ``UserError``) first, without joining, if there is one."""
        self._run_task = asyncio.current_task()  # for wait_run (a later driver's view)
        if self.refusal is not None:
            raise self.refusal
        self.session = Session(self.peer_id, self.config, self.device, self.manager,
                               self.job.data, asyncio.get_running_loop(), self.coordinator)
        try:
            await asyncio.to_thread(self._loop_thread)
        finally:
            await self.manager.loop_ended()
            self.manager.close()
        return self.status()

    def _loop_thread(self) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(self.config.training.seed)  # the same initial model everywhere
        self.job.loop(self.session)
