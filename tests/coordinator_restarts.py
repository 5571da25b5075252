"""A training run whose Coordinator is killed 3 times, for tests/test_coordinator_restarts.py
(``python tests/coordinator_restarts.py TMP_DIR``, in its own process: it starts and stops
its own embedded cluster); prints one JSON line.

The embedded cluster replays a trace (its clock starts with the driver): three nodes,
node2 noticed at 30 s and gone 12 s later, node1 killed without a notice at 50 s, node3
joining at 53 s. From the driver's own end condition (``train.run``'s ``stop_when``, which
sees the Coordinator's stats at every poll) the Coordinator is killed with
``ray.kill(no_restart=False)`` (Ray restarts it): once the swarm stepped a few times, once
after the notice (while the node drains, unless the machine is slow), once after the hard
kill; the run ends a few steps after
the third restart came back, with node3's replica in. What was seen before each kill (and
after its restart) goes out with the summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

TRACE = ("0,add,node0\n0,add,node1\n0,add,node2\n"
         "42000,remove,node2\n50000,kill,node1\n53000,add,node3\n")
ARGS = [
    "--set", "model.n_layers=1", "--set", "model.d_model=32", "--set", "model.d_ff=64",
    "--set", "model.n_heads=2", "--set", "model.seq_len=32",
    "--set", "training.batch_size=4", "--set", "training.target_batch_size=16",
    "--set", "training.round_timeout_s=5", "--set", "cluster.notice_s=12",
    "--local-nodes", "3", "--max-nodes", "3", "--time-scale", "1", "--max-seconds", "180",
    "--json",
]
STEPS_AFTER = 6  # steps taken after a restart before the next kill (and before the end)


class Killer:
    """``stop_when``: kills the Coordinator on schedule, ends the run after the third."""

    def __init__(self) -> None:
        self.kills: list[dict] = []  # what the driver held just before each kill
        self.last: dict = {}
        self.started = time.monotonic()

    def _due(self, stats: dict) -> bool:
        if stats.get("restarts", 0) != len(self.kills):
            return False  # the last restart has not answered yet
        epoch, since = stats["epoch"], self.kills[-1]["epoch"] if self.kills else 0
        if epoch < since + STEPS_AFTER:
            return False
        if len(self.kills) == 0:
            return epoch >= 3
        if len(self.kills) == 1:
            return stats["notices"] >= 1  # after the notice (the node drains 12 s)
        return stats["preemptions"] >= 2  # after the hard kill

    def __call__(self, stats: dict) -> bool:
        import ray

        from moshray.cluster import placement

        self.last = stats
        if self.kills and stats.get("restarts") == len(self.kills):  # since the restart
            last = self.kills[-1]
            last["draining_after"] = max(last.get("draining_after", 0), stats["draining"])
            last["notices_after"] = stats["notices"]
        if len(self.kills) == 3:
            return stats.get("restarts") == 3 and stats["live"] >= 2 and \
                stats["epoch"] >= self.kills[-1]["epoch"] + STEPS_AFTER
        if self._due(stats):
            self.kills.append({
                "at_s": time.monotonic() - self.started, "epoch": stats["epoch"],
                "history": stats["history"], "notices": stats["notices"],
                "preemptions": stats["preemptions"], "quarantines": stats["quarantines"],
                "draining": stats["draining"], "committed": stats["committed"],
                "incarnation": stats["incarnation"]})
            coordinator = placement.sole_coordinator()
            ray.kill(coordinator, no_restart=False)
        return False


def main(tmp: Path) -> None:
    from moshray.jobs import train
    from moshray.jobs.config import add_config_arguments, config_from_args

    trace = tmp / "trace.csv"
    trace.write_text(TRACE)
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    config = config_from_args(parser.parse_args(
        [*ARGS, "--trace", str(trace), "--set", f"run_dir={tmp / 'run'}"]))
    killer = Killer()
    summary = train.run(config, stop_when=killer)
    saved = json.loads((tmp / "run" / "summary.json").read_text())
    keep = ("steps", "samples", "preemptions", "notices", "hard_losses", "rollbacks",
            "lost_steps", "replicas_consistent", "replicas", "rebalance_s_max")
    print(json.dumps({"summary": {k: summary[k] for k in keep}, "history": saved["history"],
                      "kills": killer.kills, "last": {k: killer.last.get(k) for k in (
                          "restarts", "incarnation", "notices", "preemptions", "epoch",
                          "draining", "live")}}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
