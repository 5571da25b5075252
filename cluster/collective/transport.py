"""How the collective moves messages and bytes: one narrow interface, two implementations.

The round logic (``round.GroupRound``, ``averager.Averager``) is plain asyncio: it
calls a ``Transport`` for the four things that cross machines and never imports Ray.

- ``send(handle, method, message)``: a fire-and-forget call of ``method`` on the peer
  behind ``handle``; returns an awaitable that fails (with one of ``gone_errors``) if that
  peer is gone, and is otherwise only awaited to learn so. ``RayTransport`` sends the
  bytes of ``Inline`` payloads as extra call arguments (``inline.py``), so the receiving
  actor method takes ``(message, *chunks)``.
- ``put(value)``: a reference to ``value`` that other peers can fetch (the bytes stay with
  the putter until fetched; they are lost with it).
- ``fetch(ref)``: the value behind a reference (raises if it was lost).
- ``gone_errors``: the exceptions that mean "that peer is dead".

``RayTransport`` is the product's: actor calls and Ray's object store. ``LocalNetwork``
connects averagers in one process, for tests of the round logic without Ray: peers can be
killed, and a killed peer's calls fail and its objects are lost, as on a cluster.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

import moshray.cluster.collective.inline as inline


class Transport(Protocol):
    gone_errors: tuple[type[BaseException], ...]

    def send(self, handle: Any, method: str, message: object) -> Awaitable[Any]: ...

    def put(self, value: Any) -> Any: ...

    async def fetch(self, ref: Any) -> Any: ...


class RayTransport:
    """Ray actor calls and the object store (see module docstring)."""

    def __init__(self) -> None:
        import ray

        self._ray = ray
        self.gone_errors = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)

    def send(self, handle: Any, method: str, message: object) -> Awaitable[Any]:
        """``method(message, *chunks)`` on the peer: a small payload's bytes ride in the
        call as argument-sized chunks (``inline.split``; the receiver ``inline.join``s)."""
        skeleton, chunks = inline.split(message)
        return getattr(handle, method).remote(skeleton, *chunks)

    def put(self, value: Any) -> Any:
        return self._ray.put(value)

    async def fetch(self, ref: Any) -> Any:
        return await ref


class PeerGone(Exception):
    """A ``LocalNetwork`` peer was killed: its calls fail and its objects are lost."""


@dataclass(frozen=True)
class LocalRef:
    owner: str
    value: Any


class LocalNetwork:
    """In-process peers for tests: ``add(peer_id, averager)`` registers a peer (its
    ``receive_contribution`` / ``receive_result`` calls go to the averager's
    ``deliver_contribution`` / ``deliver_result``, as the replica actor forwards them);
    ``transport(peer_id)`` is that peer's view; ``kill(peer_id)`` makes it gone. Handles are
    peer ids."""

    def __init__(self) -> None:
        self.receivers: dict[str, Any] = {}
        self.dead: set[str] = set()

    def add(self, peer_id: str, receiver: Any) -> None:
        self.receivers[peer_id] = receiver

    def kill(self, peer_id: str) -> None:
        self.dead.add(peer_id)

    def transport(self, peer_id: str) -> "LocalTransport":
        return LocalTransport(self, peer_id)


class LocalTransport:
    """One peer's side of a ``LocalNetwork`` (see there)."""

    gone_errors = (PeerGone,)

    def __init__(self, network: LocalNetwork, me: str):
        self.network, self.me = network, me

    def send(self, handle: str, method: str, message: object) -> Awaitable[Any]:
        async def call() -> None:
            await asyncio.sleep(0)  # delivered later, as over a network
            if handle in self.network.dead or self.me in self.network.dead:
                raise PeerGone(handle)
            receiver = self.network.receivers[handle]
            deliver = {"receive_contribution": receiver.deliver_contribution,
                       "receive_result": receiver.deliver_result}[method]
            deliver(message)

        return asyncio.ensure_future(call())

    def put(self, value: Any) -> LocalRef:
        return LocalRef(self.me, value)

    async def fetch(self, ref: LocalRef) -> Any:
        await asyncio.sleep(0)
        if ref.owner in self.network.dead:
            raise PeerGone(f"object of {ref.owner} lost with it")
        return ref.value
