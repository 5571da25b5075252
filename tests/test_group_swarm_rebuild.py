"""A rank killed inside a replica group of the swarm (actors/replica/group_swarm.py):
one rank's process of one group is SIGKILLed while its node stays up; that group leaves
the swarm as a whole, the other group goes on stepping alone meanwhile, and once the node
settled a new group (new actors) is placed on it and rejoins by shard. No step is lost and
both groups end bitwise equal."""

from __future__ import annotations

import os
import signal
import time

import pytest
from cluster_slots import extra_slots

from moshray.actors.replica.group_spec import GroupConfig
from moshray.actors.replica.group_swarm import GroupState, GroupSwarm, SwarmConfig
from moshray.cluster.placement import SLOT_LABEL
from moshray.jobs.examples.lm.tasks import lm_task

pytestmark = pytest.mark.cluster

MODEL = {"seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64}
SLOTS = (13, 14)
KILL_AT = 2


@pytest.fixture
def slots(local_cluster):
    with extra_slots(local_cluster, SLOTS) as cluster:
        yield cluster


def test_a_group_with_a_killed_rank_leaves_and_rejoins_while_the_other_goes_on(slots):
    config = SwarmConfig(
        group=GroupConfig(world_size=2, parallel="fsdp", name="r", timeout_s=60.0,
                          round_timeout_s=15.0),
        steps=24, node_labels={SLOT_LABEL: [str(s) for s in SLOTS]}, min_groups=2,
        settle_s=2.0)
    task = lm_task(MODEL, steps=config.steps, rows=8, amp=False, lr=3e-3)
    killed: dict = {}
    applied_by: list[tuple[int, tuple[str, ...]]] = []

    def on_step(progress):
        applied_by.append((progress.result.step, progress.result.applied))
        groups = {g.name: g for g in progress.groups}
        if not killed and progress.frontier >= KILL_AT:
            victim = groups["r1"]
            killed.update(name="r1", node=victim.node_id, pid=victim.pids[1])
            os.kill(victim.pids[1], signal.SIGKILL)  # rank 1's process: a crashed GPU worker
        elif any(g.state is GroupState.STARTING for g in groups.values()):
            assert swarm.wait_started(60.0)  # the rebuilt group then joins at the next step
        elif len(groups) < 2:
            time.sleep(0.3)  # the node settles: r0 steps alone meanwhile, but not too fast

    swarm = GroupSwarm(config, task, on_step=on_step)
    stats = swarm.run()
    assert killed and stats.steps == 24 and stats.lost_steps == 0
    assert stats.leaves == 1 and stats.rebuilt == 1 and stats.joins == 1
    assert stats.node_leaves == 0  # its node stayed: no node lost
    assert stats.groups_final == 2 and stats.consistent is True
    # the rebuilt group is a new one on the same node, with new actors
    back = [m for name, m in swarm.members.items() if name not in ("r0", "r1")]
    assert len(back) == 1 and back[0].node_id == killed["node"]
    assert killed["pid"] not in back[0].pids
    history = [t.dst for t in swarm.members["r1"].machine.history]
    assert history == [GroupState.STARTING, GroupState.ACTIVE, GroupState.GONE]
    # meanwhile r0 went on alone: steps applied by it only, after the kill
    alone = [step for step, names in applied_by if names == ("r0",)]
    assert alone and min(alone) >= KILL_AT
    assert applied_by[-1][1] == ("r0", back[0].group.config.name)
