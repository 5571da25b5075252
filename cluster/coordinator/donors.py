"""Which peer a joiner copies the swarm's state from: spread over the candidates (pure).

Taking the first candidate in id order sends every joiner of a burst to the same peer (its
uplink carries every copy, and it falls behind the swarm while it serves them), and reads
the members up to it (O(N) right after a plan, when nobody holds the new epoch yet).
Instead the candidates live in ``PeerPool``s (a list with an index: add, remove and the
i-th in O(1)), the tracker's ready peers and each epoch's holders, and ``spread_pick``
starts at a place given by a hash of the request (the joiner and a count of requests), so
a burst of joiners spreads over the donors; it reads on until the first usable one (O(1)
expected while most are usable, O(pool) when none is). Deterministic: the same requests in
the same order get the same donors.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator


class PeerPool:
    """A set of peer ids that also gives its i-th member in O(1) (the order is arbitrary:
    a removal moves the last member into the hole). Not thread-safe."""

    def __init__(self) -> None:
        self._peers: list[str] = []
        self._at: dict[str, int] = {}  # peer -> its place in ``_peers``

    def add(self, peer: str) -> None:
        if peer not in self._at:
            self._at[peer] = len(self._peers)
            self._peers.append(peer)

    def discard(self, peer: str) -> None:
        i = self._at.pop(peer, None)
        if i is None:
            return
        last = self._peers.pop()
        if i < len(self._peers):
            self._peers[i] = last
            self._at[last] = i

    def __contains__(self, peer: object) -> bool:
        return peer in self._at

    def __len__(self) -> int:
        return len(self._peers)

    def __getitem__(self, i: int) -> str:
        return self._peers[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._peers)


EMPTY = PeerPool()  # (never added to)


def spread_pick(pool: PeerPool, key: str, usable: Callable[[str], bool]) -> str | None:
    """The first ``usable`` peer of ``pool`` from the place ``key`` hashes to (CRC-32, the
    same in every process), wrapping around; None if none is usable."""
    n = len(pool)
    if n == 0:
        return None
    start = zlib.crc32(key.encode()) % n
    for i in range(n):
        peer = pool[(start + i) % n]
        if usable(peer):
            return peer
    return None
