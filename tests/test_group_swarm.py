"""A swarm of replica groups on real raylets (actors/replica/group_swarm.py, issue 47): two
nodes of the session's cluster each get a group of 2 CPU ranks (FSDP2 over gloo) training the
example LM, collaboratively and by local SGD by shard; a third node comes up and its group
joins by shard; one of the first nodes is killed (SIGKILL of its raylet and workers) and its
group is dropped while the others go on. No step is lost and every group's unsharded
parameters end bitwise equal. The cloud is the example's (jobs/examples/sharded.py): it acts
on the cluster from this thread while the swarm trains in its own."""

from __future__ import annotations

import pytest

from moshray.actors.replica.group_spec import GroupConfig
from moshray.actors.replica.group_swarm import GroupSwarm, SwarmConfig
from moshray.cluster.placement import SLOT_LABEL
from moshray.jobs.examples.lm.tasks import lm_task
from moshray.jobs.examples.sharded import Cloud

pytestmark = pytest.mark.cluster

MODEL = {"seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64}
ROWS = 12  # divides among 2 and 3 groups of 2 ranks
FIRST, LATE = (10, 11), 12


@pytest.fixture
def slots(local_cluster):
    """Slots 10 and 11 of the session's cluster up (12 comes later); all removed after."""
    local_cluster.connect()
    try:
        for slot in FIRST:
            local_cluster.add_node(slot)
        yield local_cluster
    finally:
        for slot in (*FIRST, LATE):
            if slot in local_cluster.live_slots():
                local_cluster.remove_node(slot)


@pytest.mark.parametrize("mode", ["collaborative", "local_sgd"])
def test_groups_train_through_a_join_and_a_lost_node_without_losing_a_step(slots, mode):
    config = SwarmConfig(
        group=GroupConfig(world_size=2, parallel="fsdp", name=mode[0], timeout_s=60.0,
                          round_timeout_s=15.0),
        mode=mode, steps=12, inner_steps=2,
        node_labels={SLOT_LABEL: [str(s) for s in (*FIRST, LATE)]}, min_groups=2,
        settle_s=6.0)
    task = lm_task(MODEL, steps=config.steps, rows=ROWS, amp=False, lr=3e-3)
    cloud = Cloud(slots, join_at=2, kill_at=4, kill_slot=FIRST[0], add_slot=LATE)
    results = []

    def on_step(progress):
        results.append(progress.result)
        cloud.on_step(progress)

    stats = cloud.run(GroupSwarm(config, task, on_step=on_step))
    assert cloud.errors == [] and cloud.joined_at == 2 and cloud.killed_at is not None
    assert stats.steps == 12 and stats.lost_steps == 0
    assert stats.groups_max == 3 and stats.joins == 1  # the late node's group
    assert stats.leaves == 1 and stats.rebuilt == 0  # the killed node's: dropped, not rebuilt
    assert stats.groups_final == 2 and stats.consistent is True
    # every step's work was applied once: each swarm step moved the frontier by its size
    applied = [r for r in results if r.applied]
    assert [r.step for r in applied] == list(range(0, 12, config.step_size))
    assert max(len(r.applied) for r in applied) == 3
    assert applied[-1].loss < applied[0].loss
    if mode == "collaborative":  # each rank averaged its own shard: about half the model
        numel = sum(p.numel() for p in task.build_model().parameters())
        assert max(applied[0].rank_numel) < numel <= sum(applied[0].rank_numel)


def test_a_spot_notice_makes_a_group_leave_before_its_node_goes_without_losing_a_step(slots):
    import time

    from moshray.autoscaler.watch.drain import drain_node

    config = SwarmConfig(
        group=GroupConfig(world_size=2, parallel="fsdp", name="n", timeout_s=60.0,
                          round_timeout_s=15.0),
        steps=8, node_labels={SLOT_LABEL: [str(s) for s in FIRST]}, min_groups=2)
    task = lm_task(MODEL, steps=config.steps, rows=ROWS, amp=False, lr=3e-3)
    drained = []

    def on_step(progress):  # the node's watcher heard a notice: it asks Ray to drain
        if progress.frontier == 3 and not drained:
            answer = drain_node(slots.node_id(FIRST[0]), time.time() + 120, "spot notice")
            drained.append(answer.accepted)

    stats = GroupSwarm(config, task, on_step=on_step).run()
    assert drained == [True]
    assert stats.steps == 8 and stats.lost_steps == 0 and stats.groups_max == 2
    assert stats.leaves == 1 and stats.notice_leaves == 1 and stats.rebuilt == 0
    assert stats.groups_final == 1 and stats.consistent is True
