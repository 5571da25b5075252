"""AveragingPeer: a Ray actor that hosts an ``Averager`` on its own (benchmarks, tests).

Training replicas embed an ``Averager`` the same way; this actor is the minimal host: the
two transport methods, ``all_reduce`` on arrays it is given or generates itself (so that a
benchmark never ships 100 MB through the driver), and fault injection through
``faults.apply`` (a wrapper that corrupts inputs or kills the process, never a change to
the averager's code path). ``job_key``: the key its ``Averager`` signs and checks messages
with (``auth.py``; the same for every peer of one run), None: unsigned.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import ray

import moshray.cluster.collective.faults as faults
import moshray.cluster.collective.inline as inline
from moshray.cluster.collective.averager import Averager
from moshray.cluster.messages import (AllReduceReport, Contribution, PartResult, PeerPlan,
                                      RoundPlan)


def synthetic(numel: int, peer_index: int) -> np.ndarray:
    """Deterministic test vector: element k of peer i is ``sin(0.001 k (i + 1) + i)``.

    Any element can be recomputed cheaply by the checker without the whole vector.
    """
    k = np.arange(numel, dtype=np.float64)
    return np.sin(0.001 * k * (peer_index + 1) + peer_index).astype(np.float32)


@ray.remote
class AveragingPeer:
    def __init__(self, peer_id: str, job_key: bytes | None = None):
        self.peer_id = peer_id
        self.averager = Averager(peer_id, job_key=job_key)
        self._synthetic: dict[tuple[int, int], np.ndarray] = {}

    async def receive_contribution(self, c: Contribution, *chunks) -> None:
        self.averager.deliver_contribution(inline.join(c, chunks))

    async def receive_result(self, r: PartResult, *chunks) -> None:
        self.averager.deliver_result(inline.join(r, chunks))

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()

    async def all_reduce(
        self,
        arrays: list[np.ndarray],
        weight: float,
        plan: PeerPlan | RoundPlan,
        timeout: float,
        fault: str | None = None,
    ) -> tuple[list[np.ndarray], AllReduceReport]:
        arrays, weight, plan = await faults.apply(fault, arrays, weight, plan)
        return await self.averager.all_reduce(arrays, weight, plan, timeout)

    async def prepare_synthetic(self, numel: int, peer_index: int) -> None:
        """Generate (and keep) the ``synthetic`` vector, so that a timed round that follows
        measures the collective, not the peers' skew in generating their inputs."""
        key = (numel, peer_index)
        if key not in self._synthetic:
            self._synthetic = {key: await asyncio.to_thread(synthetic, numel, peer_index)}

    async def all_reduce_synthetic(
        self,
        numel: int,
        peer_index: int,
        weight: float,
        plan: PeerPlan | RoundPlan,
        timeout: float,
        sample_stride: int,
        fault: str | None = None,
    ) -> tuple[np.ndarray, AllReduceReport]:
        """All-reduce a ``synthetic`` vector; returns every ``sample_stride``-th value."""
        await self.prepare_synthetic(numel, peer_index)
        data = self._synthetic[(numel, peer_index)]
        arrays, weight, plan = await faults.apply(fault, [data], weight, plan)
        out, report = await self.averager.all_reduce(arrays, weight, plan, timeout)
        return out[0][::sample_stride].copy(), report

    def rejection_counts(self) -> dict[str, int]:
        return dict(self.averager.rejection_counts)

    def throughput(self) -> float | None:
        """This peer's smoothed fetch + reduction throughput (bytes/s; None before a round
        measured one): what a replica sends with its heartbeat (``shares.py``)."""
        return self.averager.meter.value
