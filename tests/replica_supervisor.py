"""Replicas by embedded-cluster slot, for tests that drive them directly (the training job
uses the elastic controller): ``slot_node_id`` and ``ReplicaSupervisor`` around the job's own
``launch_replica``."""

from __future__ import annotations

import threading

from moshray.cluster.placement import SLOT_LABEL
from moshray.jobs.controller.replica_launch import ReplicaSpec, launch_replica


def slot_node_id(slot: int) -> str:
    """The node id of the embedded cluster's ``slot`` (by its ``moshray-slot`` label)."""
    import ray

    for n in ray.nodes():
        if n.get("Alive") and (n.get("Labels") or {}).get(SLOT_LABEL) == str(slot):
            return n["NodeID"]
    raise LookupError(f"no live node carries {SLOT_LABEL}={slot}")


class ReplicaSupervisor:
    """One replica per embedded-cluster slot (tests and benchmarks that place replicas
    themselves; the training job uses the elastic controller instead)."""

    def __init__(self, config, files, coordinator, resume):
        import moshray.jobs.examples.lm.example as lm
        self.spec = ReplicaSpec(config.to_dict(), lm.job(config, files), coordinator,
                                resume)
        self.coordinator = coordinator
        self.replicas: dict[int, tuple[str, object, object]] = {}  # slot -> (id, handle, run)
        self.generation = 0
        self.hard_losses = 0
        self.preemptions = 0  # replicas lost (``lost``): the driver counts them
        self.lock = threading.Lock()

    def start(self, slot: int, node_id: str | None = None) -> None:
        node_id = node_id or slot_node_id(slot)
        with self.lock:
            self.generation += 1
            peer_id = f"replica-{slot}-{self.generation}"
            handle, run = launch_replica(self.spec, peer_id, node_id, 0)
            self.replicas[slot] = (peer_id, handle, run)

    def lost(self, slot: int, hard: bool = False) -> None:
        """``slot``'s replica is gone (``hard``: found dead, no notice came before)."""
        with self.lock:
            entry = self.replicas.pop(slot, None)
            self.hard_losses += int(hard and entry is not None)
        if entry is not None:
            self.coordinator.leave.remote(entry[0])
            self.preemptions += 1

    def handles(self) -> list[tuple[str, object, object]]:
        with self.lock:
            return list(self.replicas.values())
