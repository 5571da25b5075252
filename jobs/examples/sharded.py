"""The example LM trained as replica groups: each node one group of ranks sharding the model.

    python -m moshray.jobs.examples.sharded --json
    python -m moshray.jobs.examples.sharded --mode local_sgd --steps 12 --json

Starts the embedded cluster (a head and 2 spot nodes of 2 CPUs each) and trains the
example byte-level LM (``jobs/examples/lm``) as a swarm of replica groups
(``actors/replica/group_swarm.py``): one group of 2 ranks per node (FSDP2 over gloo on the
CPU), averaged by shard across groups, collaboratively (every step's gradients) or by local
SGD (``--inner-steps`` steps alone, then the parameters). The embedded cluster plays the
cloud on a schedule keyed to the swarm's progress: after ``--join-at`` steps a third node
comes up (its group joins by shard), and after ``--kill-at`` steps, once three groups
train, one of the first two nodes is killed (SIGKILL of its raylet and workers, the
cluster's ``remove_node(slot, hard=True)``); the cloud never calls into the trainer.

The last stdout line is one JSON object (``--json``) with ``groups_max``,
``ranks_per_group``, ``steps``, ``lost_steps``, ``replicas_consistent`` (every group's
unsharded parameters bitwise equal at the end), ``mode``, ``joins``, ``leaves``,
``final_loss``, ``wall_s`` and the steps at which the cloud acted. Exit codes: 0 when the
run ended with 0 lost steps and consistent groups, 1 otherwise or when the swarm failed
(one line on stderr), 2 on bad arguments (one line). The cluster is stopped on every
way out.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import sys
import threading
import time

from moshray.actors.replica.group_spec import GroupConfig
from moshray.actors.replica.group_swarm import (
    MODES, GroupState, GroupSwarm, SwarmConfig, SwarmError, SwarmProgress, SwarmStats,
)
from moshray.cluster.placement import SLOT_LABEL
from moshray.jobs.cli import Parser

MODEL = {"seq_len": 32, "d_model": 64, "n_layers": 2, "n_heads": 2, "d_ff": 128}
ROWS = 24  # the global batch: divides among 2 and 3 groups of 2 ranks
RANKS = 2
FIRST_NODES = 2


class Cloud:
    """The embedded cluster as the cloud: after step ``join_at`` it adds a node (slot
    ``add_slot``; None: the next free one), and after step ``kill_at``, once more than
    ``kill_when`` groups train, it kills slot ``kill_slot``'s node (SIGKILL of its raylet
    and workers). Nodes start and stop on this process's main thread (``serve``: Ray's
    loopback raylets install signal handlers as they start, which only the main thread may
    do) while the swarm trains in a thread of its own (``run``). The swarm's ``on_step``
    hook reports its progress and waits (bounded by ``timeout_s``) for the action it asked
    for, so each action lands between two steps; while a group is starting it also waits
    for that start (``GroupSwarm.wait_started``: a step of this small model takes a
    fraction of a second, a group's start seconds), so the new group takes part in the
    steps that follow and the run shows the join before the kill, whatever the load."""

    def __init__(self, cluster, join_at: int, kill_at: int, *, kill_slot: int = 0,
                 add_slot: int | None = None, kill_when: int = 2, timeout_s: float = 180.0):
        self.cluster, self.join_at, self.kill_at = cluster, join_at, kill_at
        self.kill_slot, self.add_slot, self.kill_when = kill_slot, add_slot, kill_when
        self.timeout_s = timeout_s
        self.joined_at: int | None = None
        self.killed_at: int | None = None
        self.errors: list[str] = []
        self.swarm: GroupSwarm | None = None
        self._asks: queue.Queue = queue.Queue()

    def _ask(self, action: str) -> None:
        """Have the main thread carry ``action`` out; wait for it (bounded)."""
        done = threading.Event()
        self._asks.put((action, done))
        if not done.wait(self.timeout_s):
            self.errors.append(f"{action}: not done within {self.timeout_s:g} s")

    def on_step(self, progress: SwarmProgress) -> None:
        """The swarm's hook (its thread)."""
        active = sum(g.state is GroupState.ACTIVE for g in progress.groups)
        if self.joined_at is None and progress.frontier >= self.join_at:
            self.joined_at = progress.frontier
            self._ask("add")
        elif self.killed_at is None and progress.frontier >= self.kill_at \
                and active > self.kill_when:
            self.killed_at = progress.frontier
            self._ask("kill")
        elif active < len(progress.groups) and self.swarm is not None:
            if not self.swarm.wait_started(self.timeout_s):
                self.errors.append(f"a group did not start within {self.timeout_s:g} s")

    def serve(self, swarm_thread: threading.Thread) -> None:
        """Carry out what the hook asks until the swarm's thread ends (main thread)."""
        while swarm_thread.is_alive():
            try:
                action, done = self._asks.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                if action == "add":
                    self.cluster.add_node(self.add_slot)
                else:
                    self.cluster.remove_node(self.kill_slot, hard=True)
            except Exception as exc:  # noqa: BLE001 - reported with the figures
                self.errors.append(f"{action}: {exc}")
            finally:
                done.set()

    def run(self, swarm: GroupSwarm) -> SwarmStats:
        """``swarm.run()`` in a thread while this thread serves the cloud's actions."""
        self.swarm = swarm
        outcome: dict = {}

        def train() -> None:
            try:
                outcome["stats"] = swarm.run()
            except BaseException as exc:  # noqa: BLE001 - raised again on this thread
                outcome["error"] = exc

        thread = threading.Thread(target=train, name="swarm", daemon=True)
        thread.start()
        try:
            self.serve(thread)
        except BaseException:  # Ctrl-C or a cloud that broke: the swarm stops too
            swarm.stop()
            raise
        finally:
            thread.join()  # every wait of the swarm is bounded; it closes its groups
        if "error" in outcome:
            raise outcome["error"]
        return outcome["stats"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(prog="python -m moshray.jobs.examples.sharded",
                    description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    parser.add_argument("--mode", choices=MODES, default="collaborative")
    parser.add_argument("--steps", type=int, default=None,
                        help="each group's optimizer steps (default 30; local_sgd 36)")
    parser.add_argument("--inner-steps", type=int, default=3,
                        help="local_sgd: each group's steps between averages")
    parser.add_argument("--parallel", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--join-at", type=int, default=None,
                        help="the step after which a third node comes up (default: steps/6)")
    parser.add_argument("--kill-at", type=int, default=None,
                        help="the step after which a first node is killed, once three "
                             "groups train (default: steps/2)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log the swarm's decisions on stderr")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="bounds each group start, join and step")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 36 if args.mode == "local_sgd" else 30
    args.join_at = args.steps // 6 if args.join_at is None else args.join_at
    args.kill_at = args.steps // 2 if args.kill_at is None else args.kill_at
    if not 0 <= args.join_at <= args.kill_at:
        parser.error(f"--join-at {args.join_at} and --kill-at {args.kill_at}: need "
                     f"0 <= join-at <= kill-at")
    try:
        args.config = SwarmConfig(
            group=GroupConfig(world_size=RANKS, parallel=args.parallel, name="g",
                              timeout_s=args.timeout_s, round_timeout_s=args.timeout_s / 4),
            mode=args.mode, steps=args.steps, inner_steps=args.inner_steps,
            node_labels={SLOT_LABEL: None}, min_groups=FIRST_NODES, settle_s=6.0)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def run(args: argparse.Namespace) -> dict:
    """Start the embedded cluster, train, stop it; the figures."""
    from moshray.jobs.examples.lm.tasks import lm_task
    from moshray.jobs.local.cluster import LocalCluster, LocalClusterConfig

    task = lm_task(MODEL, steps=args.steps, rows=ROWS, amp=False, lr=3e-3)
    t0 = time.monotonic()
    with LocalCluster(LocalClusterConfig(spot_nodes=FIRST_NODES, cpus_per_node=RANKS,
                                         head_cpus=1)) as cluster:
        cluster.connect()
        cloud = Cloud(cluster, args.join_at, args.kill_at)
        stats = cloud.run(GroupSwarm(args.config, task, on_step=cloud.on_step))
    figures = stats.to_dict()
    figures.update(wall_s=round(time.monotonic() - t0, 1), node_joined_at=cloud.joined_at,
                   node_killed_at=cloud.killed_at, cloud_errors=cloud.errors)
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        figures = run(args)
    except SwarmError as exc:
        print(f"sharded: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(figures))
    else:
        print(", ".join(f"{k} {v}" for k, v in figures.items()))
    ok = figures["lost_steps"] == 0 and figures["replicas_consistent"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
