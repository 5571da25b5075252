"""A bounded check of the Ray cluster address a driver is about to join.

``ray.init(address=...)`` on an address where no cluster answers retries for minutes,
printing Ray's GCS warnings; an ``http://host:8265`` address (the job-submission API, which
``ray job submit --address`` wants) is not a cluster address at all. :func:`check_address`
says so in one line within ``timeout_s`` instead, as a :class:`ConfigError` naming where
the address came from (``RAY_ADDRESS`` or ``cluster.address``), which ``moshray train``
turns into exit status 2.
"""

from __future__ import annotations

import socket
from typing import Callable

from moshray.jobs.config.fields import ConfigError

CONNECT_S = 5.0
_WHAT_TO_CHECK = ("check that `ray start --head` runs there and that this is its GCS port "
                  "(6379 unless --port said otherwise), open to this machine; "
                  "http://...:8265 is the job-submission address (for `ray job submit "
                  "--address`), not a GCS address")


def split_address(address: str) -> tuple[str, int] | None:
    """``host:port`` (optionally ``ray://host:port``) as ``(host, port)``; None for the
    addresses Ray resolves itself (``auto``, ``local``). Raises ``ValueError`` saying what
    is wrong with any other form."""
    text = address.strip()
    if text in ("auto", "local"):
        return None
    if text.startswith(("http://", "https://")):
        raise ValueError(f"{address} is the job-submission (dashboard) address, not the "
                         "cluster's GCS address: use host:6379 (what `ray start --head` "
                         "printed), or submit with `ray job submit --address "
                         f"{address} -- moshray train ...`")
    if text.startswith("ray://"):
        text = text[len("ray://"):]
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port (e.g. 10.0.0.5:6379), got {address!r}")
    return host.strip("[]"), int(port)


def check_address(address: str, source: str, timeout_s: float = CONNECT_S,
                  connect: Callable[..., socket.socket] = socket.create_connection) -> None:
    """Return if something accepts TCP connections at ``address`` within ``timeout_s``
    (or Ray resolves the address itself: ``auto``); else raise :class:`ConfigError`
    (``source``: the setting it came from) with one line saying what to check. A port
    that accepts connections is trusted to be the GCS: this check does not speak gRPC."""
    try:
        where = split_address(address)
    except ValueError as exc:
        raise ConfigError(source, str(exc)) from None
    if where is None:
        return
    try:
        connect(where, timeout=timeout_s).close()
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else \
            (exc.strerror or type(exc).__name__)
        raise ConfigError(source, f"no Ray cluster answers at {address} within "
                                  f"{timeout_s:g} s ({reason}): {_WHAT_TO_CHECK}") from None
