"""The Coordinator actor: membership and round plans, on the head node.

A named, detached actor (``placement.COORDINATOR_NAME`` in namespace ``moshray``) that holds
the ``Membership`` and publishes ``RoundPlan``s. It keeps no tensors and does no I/O; its
methods are cheap and never block on a peer, so a dead peer can never stall it. Peers that
stop heartbeating are dropped after the TTL; draining peers are excluded from every plan
made after ``mark_draining`` returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

from . import placement
from .membership import Membership, MembershipConfig
from .messages import PeerInfo, RoundPlan


class CoordinatorCore:
    """The Coordinator's logic with an injected clock (the actor below is a thin shell)."""

    def __init__(self, config: MembershipConfig, clock: Callable[[], float] = time.monotonic):
        self.membership = Membership(config)
        self.clock = clock

    def register(self, peer_id: str, handle, node_id: str = "", capacity: float = 1.0) -> int:
        self.membership.register(PeerInfo(peer_id, handle, node_id, capacity), self.clock())
        return self.membership.epoch

    def heartbeat(self, peer_id: str) -> bool:
        return self.membership.heartbeat(peer_id, self.clock())

    def leave(self, peer_id: str) -> bool:
        return self.membership.leave(peer_id)

    def mark_draining(self, node_id: str, deadline_s: float) -> tuple[str, ...]:
        """Exclude ``node_id``'s peers from the next plans; ``deadline_s`` is seconds left."""
        return self.membership.mark_draining(node_id, self.clock() + deadline_s)

    def live_peers(self) -> tuple[str, ...]:
        now = self.clock()
        self.membership.expire(now)
        return tuple(p.peer_id for p in self.membership.live(now))

    def plan_round(self, peers: tuple[str, ...] | None = None) -> RoundPlan | None:
        now = self.clock()
        self.membership.expire(now)
        return self.membership.plan(now, peers)


@ray.remote
class Coordinator(CoordinatorCore):
    """Ray actor shell around ``CoordinatorCore``; create it with ``get_or_create``."""

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


def get_or_create(config: MembershipConfig | None = None) -> ray.actor.ActorHandle:
    """The cluster's Coordinator: created detached on the head node on first call."""
    return Coordinator.options(
        name=placement.COORDINATOR_NAME,
        namespace=placement.NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_concurrency=64,
        **placement.on_head(),
    ).remote(config or MembershipConfig())
