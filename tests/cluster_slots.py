"""Extra slots of the session's cluster (tests/conftest.py's ``local_cluster``) for a test."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def extra_slots(cluster, up, later=()):
    """Slots ``up`` of the session's cluster added (connected first), and every one of
    ``up`` and ``later`` (slots the test adds itself) that is still live removed after."""
    cluster.connect()
    try:
        for slot in up:
            cluster.add_node(slot)
        yield cluster
    finally:
        for slot in (*up, *later):
            if slot in cluster.live_slots():
                cluster.remove_node(slot)
