"""A replica group: one model replica made of N Ray actors joined in a ``torch.distributed``
process group, the model sharded inside by FSDP2 or replicated by DDP.

The driver's handle on one group (``ReplicaGroup``); a group starts, trains a task for K
steps and reports, saves and loads sharded checkpoints, and joins by shard from a donor. One
rank per GPU (one per rank on CPU)::

    group = ReplicaGroup(GroupConfig(world_size=2, parallel="fsdp"))
    group.start()                      # actors placed, process group joined (bounded)
    report = group.train(task)         # GroupReport: the loss of each step, each rank's shard
    params = group.full_state()        # the unsharded parameters (CPU), gathered by every rank
    group.save_sharded(path)           # each rank its shard (DCP); see group_checkpoint.py
    group.close()                      # ranks stopped, placement group removed

    other = ReplicaGroup(GroupConfig(world_size=3)); other.start()
    step = other.load_sharded(path, task)  # resharded from 2 ranks to 3; train() goes on

    a, b, c = (ReplicaGroup(GroupConfig(name=n)) for n in "abc")   # each then start()ed
    steps = train_together([a, b], task, 2)  # group_together.py: averaged by shard
    c.join_from(a, task)                     # rank r copies a's rank r shard state
    train_together([a, b, c], task, 1)       # all three bitwise equal after each step

Placement: ``start`` reserves one bundle per rank (its CPU/GPU request,
``rank_bundles``) in a Ray placement group with ``STRICT_PACK``: every rank on one node, so
the collectives stay on that node's links and a checkpoint directory is on one file system.
``GroupConfig.node_labels`` narrows the node by Ray node labels (``bundle_label_selector``;
``{"ray.io/node-id": <hex id>}`` pins one node). A group that cannot be placed within
``timeout_s`` raises ``GroupError`` naming what it needs and what the nodes have
(``placement_shortfall``), at once when the node it is pinned to is no longer alive;
``close`` removes the placement group, also after a failed start.

Rendezvous: rank 0 picks its address and a free port and returns them through a Ray call;
every rank then joins ``tcp://address:port``. Every wait is bounded by
``GroupConfig.timeout_s`` (the Ray calls, ``init_process_group`` and each collective); a
rank that dies or hangs makes the call raise ``GroupError`` (one line, the rank named), never
hang.

Where the rest is: the settings, task, messages and pure decisions in group_spec.py (the
backend, the data contract of a ``GroupTask``), the rank actor in group_rank.py, groups
training together (``train_together``, ``step_together``, ``local_round``) in
group_together.py, the elastic swarm of groups in group_swarm.py.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from moshray.actors.replica.group_averaging import GroupPeers
from moshray.actors.replica.group_checkpoint import staging_path
from moshray.actors.replica.group_rank import GroupRank
from moshray.actors.replica.group_spec import (
    NODE_ID_LABEL, GroupConfig, GroupError, GroupReport, GroupTask, choose_backend,
    placement_shortfall, rank_bundles,
)

log = logging.getLogger(__name__)

PLACE_POLL_S = 1.0  # a pinned placement checks this often that its node is still alive


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
