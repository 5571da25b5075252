"""``moshray watch``: run the spot-notice watcher of the node it is started on.

Contract: ``moshray watch`` (``--source auto``, the default: the node's cloud is detected
on the node, see ``clouds/detect.py``; or ``--source aws`` / ``gcp`` / another registered
cloud to name it) connects
with ``ray.init(address="auto")``, says on stderr the moshray build it runs, starts the
watcher actor on this node, says which source it listens to (and, for auto, how it was
found) and stays until the node's deadline has passed (or ``--max-seconds``); exit 2 on a
bad argument, 1 if its own watcher dies.

It owns the watcher it starts (stopped when it exits). If the node already has one (a
job's controller started it before ``moshray watch`` ran), it says so and uses that one,
never stopping it; when its owner removes it (the job ended), ``moshray watch`` starts the
node's own at once and goes on. A job that finds the node's watcher never stops it, so on
an ``infra/`` node, where ``moshray watch`` starts at boot, one watcher serves every job.
With ``--grace-s S`` its own SIGTERM is a termination notice due in S seconds (a Kubernetes
pod being deleted: ``infra/kuberay/`` runs it as a sidecar, the Ray container's preStop hook
keeping the node up meanwhile): every job's Coordinator is told and the node drained in Ray,
as for a cloud's notice; ``--source sigterm`` makes that SIGTERM the only source.
``add_arguments`` / ``main`` are what the ``moshray`` CLI calls (through
``moshray.autoscaler.watch``, which re-exports them).
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
import time
from dataclasses import asdict

import ray

from moshray.cluster import placement

from moshray.autoscaler.clouds.base import clouds
from moshray.autoscaler.clouds.detect import LINK_LOCAL_URL
from moshray.autoscaler.clouds.gcp.notices import GCP_NOTICE_S
from moshray.autoscaler.notices.message import SIGTERM
from moshray.autoscaler.notices.sources import source_names
from moshray.autoscaler.watch.config import WatcherConfig
from moshray.autoscaler.watch.drain import DrainOutcome, check_node_id
from moshray.autoscaler.watch.watcher import OpenedWatcher, open_watcher


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ", ".join(f"{c.metadata_url} for {c.name}" for c in clouds())
    named = " / ".join(c.identity.endpoint_env for c in clouds() if c.identity is not None)
    parser.add_argument("--source", choices=source_names(), default="auto",
                        help="where notices come from (default auto: the metadata service "
                             f"named in {named}, "
                             "else the cloud the DMI vendor strings name, else a short probe "
                             f"of {LINK_LOCAL_URL}; none, with a warning, if nothing answers); "
                             "a cloud's name names it; sigterm: only this process's SIGTERM "
                             "(with --grace-s: a pod that cannot reach the metadata service); "
                             "simulated and none are for tests")
    parser.add_argument("--metadata-url", default=None,
                        help=f"metadata server base URL (default {defaults}; for auto, where "
                             "a detected cloud's service is and where the probe looks, "
                             f"default {LINK_LOCAL_URL})")
    parser.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    parser.add_argument("--node-id", default=None, help="Ray node id to watch (default: this node)")
    parser.add_argument("--pool", default="",
                        help="capacity pool of this node, for metrics (default: none)")
    parser.add_argument("--poll-s", type=float, default=1.0, help="seconds per poll (default 1)")
    parser.add_argument("--gcp-notice-s", type=float, default=GCP_NOTICE_S,
                        help="seconds GCP gives between the notice and the stop (default 30)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop watching after this long (default: until the node is noticed "
                             "and its deadline has passed)")
    parser.add_argument("--coordinator-name", default=None,
                        help="tell only the Coordinator actor of this name (default: every "
                             "training job's Coordinator on the cluster)")
    parser.add_argument("--json", action="store_true", help="print each outcome as a JSON line")
    parser.add_argument("--grace-s", type=float, default=None,
                        help="this process's SIGTERM is a termination notice due in this many "
                             "seconds (a Kubernetes pod's grace period minus a margin: the "
                             "node termination handler, GKE's graceful node shutdown); "
                             "required by --source sigterm (default: SIGTERM just stops "
                             "watching)")


def _finite(x):
    """JSON has no infinity: a missing deadline becomes null."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _outcome_json(outcome: DrainOutcome) -> str:
    doc = asdict(outcome)
    doc["notice_to_draining_s"] = outcome.notice_to_draining_s
    return json.dumps(_finite(doc), allow_nan=False)


def main(args: argparse.Namespace) -> int:
    try:
        config = WatcherConfig(source=args.source, metadata_url=args.metadata_url, pool=args.pool,
                               poll_s=args.poll_s, gcp_notice_s=args.gcp_notice_s,
                               coordinator_name=args.coordinator_name)
        if args.node_id is not None:
            check_node_id(args.node_id)
        if args.max_seconds is not None and not args.max_seconds > 0:
            raise ValueError(f"--max-seconds must be positive, got {args.max_seconds}")
        if args.grace_s is not None and not args.grace_s > 0:
            raise ValueError(f"--grace-s must be positive, got {args.grace_s}")
        if args.source == SIGTERM and args.grace_s is None:
            raise ValueError("--source sigterm needs --grace-s (the seconds a SIGTERM leaves "
                             "before the node goes)")
    except ValueError as e:
        print(f"moshray watch: {e}", file=sys.stderr)
        return 2
    from moshray import __version__

    ray.init(address=args.address, namespace=placement.NAMESPACE, log_to_driver=False)
    node_id = args.node_id or ray.get_runtime_context().get_node_id()
    print(f"moshray watch: moshray {__version__}", file=sys.stderr, flush=True)
    opened = _open(node_id, config)
    end = math.inf if args.max_seconds is None else time.monotonic() + args.max_seconds
    seen = 0
    terminated = _notice_on_sigterm(args.grace_s)
    try:
        while time.monotonic() < end:
            if terminated is not None and terminated.is_set():
                terminated.clear()  # one notice; the outcome is awaited below
                notice = ray.get(opened.actor.notify.remote(args.grace_s), timeout=60)
                print(f"SIGTERM: termination notice due in {args.grace_s:g} s for node "
                      f"{notice.node_id}", file=sys.stderr, flush=True)
            try:
                outcome = ray.get(opened.actor.wait_outcome.remote(
                    1.0 if terminated is not None else min(config.poll_s * 5, 10.0), seen))
            except ray.exceptions.RayActorError as exc:
                if opened.created:
                    print(f"moshray watch: the watcher of node {node_id} died ({exc!r:.200})",
                          file=sys.stderr, flush=True)
                    return 1
                # The watcher we found was removed by its owner (its job ended): the node
                # must not go unwatched, so start its own (or use whichever took the name).
                opened, seen = _open(node_id, config), 0
                continue
            if outcome is None:
                continue
            seen += 1
            if args.json:
                print(_outcome_json(outcome), flush=True)
            else:
                drain = ("accepted" if outcome.ray.accepted
                         else "FAILED: " + outcome.ray.message)
                print(f"{outcome.notice.action} notice: {len(outcome.peers)} peers draining, "
                      f"Ray drain {drain}, {outcome.notice_to_draining_s:.3f} s after the "
                      f"notice", flush=True)
            # Stay until the deadline so in-flight hand-offs (owned by the watcher) finish.
            left = outcome.notice.seconds_left(time.time())
            time.sleep(min(left, max(0.0, end - time.monotonic())))
            return 0
    finally:
        if opened.created:  # one found on the node is its owner's to stop
            try:
                ray.get(opened.actor.stop.remote(), timeout=config.poll_s + 10)
            except ray.exceptions.RayError:
                pass  # the node (and its watcher) may already be gone
    return 0


def _notice_on_sigterm(grace_s: float | None) -> threading.Event | None:
    """With ``grace_s``: SIGTERM sets the returned event (the watch loop turns it into a
    notice due in ``grace_s`` seconds, then stays until that deadline); else None and
    SIGTERM keeps its default (the process ends)."""
    if grace_s is None:
        return None
    event = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: event.set())
    return event


def _open(node_id: str, config: WatcherConfig, budget_s: float = 30.0) -> OpenedWatcher:
    """The node's watcher, running (``open_watcher``: started here, or found and used), with
    one stderr line naming its source and who started it. A found watcher that dies before
    it answers (its owner removed it; Ray frees the name shortly after) is looked for again
    for up to ``budget_s`` seconds; then, or if the one started here dies, the actor error
    is raised."""
    end = time.monotonic() + budget_s
    while True:
        opened = open_watcher(node_id, config)
        try:
            ray.get(opened.actor.ready.remote(), timeout=120)
            source = ray.get(opened.actor.status.remote(), timeout=60)["source"]
        except ray.exceptions.RayActorError:
            if opened.created or time.monotonic() > end:
                raise
            time.sleep(0.5)
            continue
        whose = ("its own watcher" if opened.created else
                 "the watcher another driver (a job) started there, its source; this command "
                 "starts the node's own when that driver removes it")
        print(f"watching node {node_id} ({source}) with {whose}", file=sys.stderr, flush=True)
        return opened
