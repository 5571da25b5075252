"""`moshray jobs` and `moshray stop NAME`: the training jobs of a shared cluster.

Several jobs run on one Ray cluster side by side, each under its own name
(``TrainConfig.name``; ``jobs/controller/lease.py`` keeps a record per name). ``moshray jobs``
lists them: name, state, global step, nodes and replicas, the driver's Ray job id.
``moshray stop NAME`` ends one cleanly: a job whose driver lives is asked to end as at its
time limit (its driver hears it at the next lease renewal, writes the final checkpoint and
summary, and releases everything); a job whose driver is gone is ended by its lease at once
(final checkpoint through a replica, replicas, Coordinator and capacity request removed).
Other jobs are not touched. Both connect to the cluster at ``--address`` (else
``RAY_ADDRESS``, else the local cluster ``ray start`` made). Exit codes: 0 done, 2 no such
job or no cluster at the address (one line), 1 the job did not end within ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

STEP_TIMEOUT_S = 10.0
PROBE_S = 5.0  # a head that does not accept a TCP connection in this long is not there


@dataclass(frozen=True)
class JobRow:
    """One line of ``moshray jobs``."""

    name: str
    state: str  # running | stopping | driver gone
    step: int | None  # the Coordinator's global step (None: it did not answer)
    nodes: int
    replicas: int
    driver: str  # the Ray job id of the driver holding the lease


def job_state(record, holder_alive: bool) -> str:
    """A record's state in words. Pure."""
    if record.stopping or record.stop_requested:
        return "stopping"
    return "running" if holder_alive else "driver gone"


class NoCluster(RuntimeError):
    """No Ray cluster answers at the address asked for (the message is the one line)."""


def _connect(address: str | None) -> None:
    """Connect to the cluster, or raise ``NoCluster`` within ``PROBE_S`` when none answers
    (Ray's own client would retry for a minute and end in a traceback)."""
    import logging
    import socket

    import ray
    from ray._private.services import canonicalize_bootstrap_address

    from moshray.cluster import placement

    asked = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        resolved = canonicalize_bootstrap_address(asked)
    except Exception as exc:  # Ray's own words for a malformed address
        raise NoCluster(f"Ray address {asked!r}: {exc}") from None
    if resolved is None:
        raise NoCluster("no Ray cluster is running here: start one (ray start --head) or "
                        "pass --address HOST:PORT")
    host, _, port = resolved.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_S).close()
    except (OSError, ValueError):
        raise NoCluster(f"no Ray cluster answers at {resolved} (from --address/RAY_ADDRESS "
                        f"or the last `ray start` here): pass the head's HOST:PORT") from None
    ray.init(address=resolved, namespace=placement.NAMESPACE, logging_level=logging.WARNING,
             log_to_driver=False)


def _connected(args: argparse.Namespace) -> bool:
    try:
        _connect(args.address)
    except NoCluster as exc:
        print(f"moshray: {exc}", file=sys.stderr)
        return False
    return True


def _step(name: str) -> int | None:
    import ray

    from moshray.cluster import placement

    try:
        coordinator = ray.get_actor(placement.coordinator_name(name),
                                    namespace=placement.NAMESPACE)
        stats = ray.get(coordinator.stats.remote(1 << 62), timeout=STEP_TIMEOUT_S)
        return int(stats["epoch"])
    except (ValueError, ray.exceptions.RayError, TimeoutError):
        return None


def job_rows() -> list[JobRow]:
    """Every job on the connected cluster, by name."""
    from moshray.jobs.controller import lease as leases

    rows = []
    for name, record in leases.list_jobs().items():
        rows.append(JobRow(name, job_state(record, leases.job_alive(record.holder)),
                           _step(name), len({node for _, node, _ in record.replicas}),
                           len(record.replicas), record.holder))
    return rows


def render(rows: list[JobRow]) -> str:
    """The table ``moshray jobs`` prints. Pure."""
    if not rows:
        return "no training jobs on this cluster"
    table = [("NAME", "STATE", "STEP", "NODES", "REPLICAS", "DRIVER")] + [
        (r.name, r.state, "?" if r.step is None else str(r.step), str(r.nodes),
         str(r.replicas), r.driver) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in table)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None,
                        help="the Ray cluster (default: RAY_ADDRESS, else the local one)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object per job")


def main(args: argparse.Namespace) -> int:
    if not _connected(args):
        return 2
    rows = job_rows()
    if args.json:
        for row in rows:
            print(json.dumps(row.__dict__))
    else:
        print(render(rows))
    return 0


def stop_add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the job's name (moshray jobs lists them)")
    _common(parser)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for the job to end (its final checkpoint "
                             "included)")


def stop_job(name: str, timeout_s: float, out=sys.stdout) -> int:
    """End job ``name`` on the connected cluster (see the module docstring); the exit code."""
    import ray

    from moshray.jobs.controller import lease as leases

    record = leases.list_jobs().get(name)
    lease = leases.find(name)
    if record is None or lease is None:
        print(f"moshray: no job named {name!r} on this cluster (moshray jobs lists them)",
              file=sys.stderr)
        return 2
    if leases.job_alive(record.holder):
        ray.get(lease.request_stop.remote(), timeout=30)
        print(f"asked job {name} to stop (its driver, Ray job {record.holder}, ends it)",
              file=out, flush=True)
    else:
        print(f"job {name}'s driver is gone: its lease ends it", file=out, flush=True)
        ray.get(lease.end.remote("stopped by moshray stop"), timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if name not in leases.list_jobs():
            print(f"job {name} stopped", file=out, flush=True)
            return 0
        time.sleep(0.5)
    print(f"moshray: job {name} did not end within {timeout_s:g} s", file=sys.stderr)
    return 1


def stop_main(args: argparse.Namespace) -> int:
    if not _connected(args):
        return 2
    return stop_job(args.name, args.timeout)
