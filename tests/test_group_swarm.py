"""A swarm of replica groups on real raylets (actors/replica/group_swarm.py): two
nodes of the session's cluster each get a group of 2 CPU ranks (FSDP2 over gloo) training the
example LM, collaboratively and by local SGD by shard, with the driver's task or with the
user's own loop in every rank (group_loop.py); a third node comes up and its group joins by
shard; one of the first nodes is killed (SIGKILL of its raylet and workers) and its group is
dropped while the others go on. No step is lost and every group's unsharded parameters end
bitwise equal. A spot notice drained in Ray (and, through the job's driver,
jobs/controller/groups.py, one heard on the node's metadata service) makes a group leave
first. The cloud is the example's (jobs/examples/sharded.py): it acts on the cluster from
this thread while the swarm trains in its own."""

from __future__ import annotations

import pytest
from cluster_slots import extra_slots

from moshray.actors.replica.group_loop import loop_of
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
    with extra_slots(local_cluster, FIRST, (LATE,)) as cluster:
        yield cluster


@pytest.mark.parametrize("mode,kind,outer", [
    ("collaborative", "task", None), ("local_sgd", "task", None),
    ("collaborative", "loop", None), ("local_sgd", "loop-replicated", None),
    ("local_sgd", "loop", 0.7)])
def test_groups_train_through_a_join_and_a_lost_node_without_losing_a_step(
        slots, mode, kind, outer):
    """``kind``: the driver's ``GroupTask``, or the user's own loop in every rank
    (group_loop.py: FSDP2 by ``session.prepare(shard=True)``, or replicated). ``outer``:
    DiLoCo's outer Nesterov step by shard (lr 0.7, momentum 0.9); the joiner copies the
    outer momentum with the shards, or its next outer step would differ."""
    config = SwarmConfig(
        group=GroupConfig(world_size=2, parallel="fsdp", name=f"{mode[0]}{kind[0]}",
                          timeout_s=60.0, round_timeout_s=15.0, outer_lr=outer),
        mode=mode, steps=8, inner_steps=2,
        node_labels={SLOT_LABEL: [str(s) for s in (*FIRST, LATE)]}, min_groups=2,
        settle_s=6.0)
    task = lm_task(MODEL, steps=config.steps, rows=ROWS, amp=False, lr=3e-3)
    run = task if kind == "task" else loop_of(task, shard=kind == "loop")
    cloud = Cloud(slots, join_at=2, kill_at=4, kill_slot=FIRST[0], add_slot=LATE)
    results = []

    def on_step(progress):
        results.append(progress.result)
        cloud.on_step(progress)

    stats = cloud.run(GroupSwarm(config, run, on_step=on_step))
    assert cloud.errors == [] and cloud.joined_at == 2 and cloud.killed_at is not None
    assert stats.steps == 8 and stats.lost_steps == 0
    assert stats.groups_max == 3 and stats.joins == 1  # the late node's group
    assert stats.leaves == 1 and stats.rebuilt == 0  # the killed node's: dropped, not rebuilt
    assert stats.groups_final == 2 and stats.consistent is True
    # every step's work was applied once: each swarm step moved the frontier by its size
    applied = [r for r in results if r.applied]
    assert [r.step for r in applied] == list(range(0, 8, config.step_size))
    assert max(len(r.applied) for r in applied) == 3
    assert applied[-1].loss < applied[0].loss
    numel = sum(p.numel() for p in task.build_model().parameters())
    if kind == "loop-replicated":  # every rank holds all of it
        assert min(applied[0].rank_numel) >= numel
    else:  # each rank averaged its own shard: about half the model
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
    assert stats.node_leaves == 1  # (with its node: a node lost to the metrics)
    assert stats.groups_final == 1 and stats.consistent is True


# -- the user's own loop in the groups (actors/replica/group_loop.py) and the job's driver
# (jobs/controller/groups.py) --------------------------------------------------------------


def test_a_group_job_hears_a_spot_notice_and_its_group_leaves_before_the_node_goes(
        slots, tmp_path):
    """The job's driver (jobs/controller/groups.py) puts a notice watcher on every spot node;
    the cloud's notice reaches the node's metadata service, the watcher drains the node in
    Ray, and the swarm's group there leaves before its next step: nothing lost."""
    import re
    import socket
    import threading
    import urllib.request

    from moshray.jobs.config import TrainConfig
    from moshray.jobs.controller.groups import run_groups

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    port = free_port()
    config = TrainConfig.from_dict({
        "cluster": {"replica": "node", "group_ranks": 2, "max_nodes": 2, "min_nodes": 2,
                    "notice_source": "auto"}, "metrics": {"port": port},
        "training": {"max_steps": 40, "mode": "collaborative", "round_timeout_s": 15.0},
        "run_dir": str(tmp_path / "run")})
    task = loop_of(lm_task(MODEL, steps=40, rows=ROWS, amp=False, lr=3e-3))
    noticed, staying, left = [], [], threading.Event()
    scraped = []

    def scrape():
        scraped.append(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                              timeout=10).read().decode())

    def on_step(progress):
        if progress.frontier == 2:
            scrape()
        if progress.frontier == 3 and not noticed:  # the node of the first group
            slot = {slots.node_id(s): s for s in slots.live_slots()}[progress.groups[0].node_id]
            staying.append(progress.groups[1].node_id)
            slots.notice(slot, notice_s=60.0)
            noticed.append(progress.frontier)
        if noticed and [g.node_id for g in progress.groups if g.state.value == "active"] \
                == [staying[0]]:  # the other's group left (another may be starting)
            if not left.is_set():
                scrape()
            left.set()

    summary = run_groups(config, slots.address, task, stop_when=left.is_set, on_step=on_step,
                         node_labels={SLOT_LABEL: [str(s) for s in FIRST]})
    assert noticed == [3] and left.is_set()
    assert summary["notice_leaves"] == 1 and summary["lost_steps"] == 0
    assert summary["replicas_consistent"] is True
    assert summary["steps"] < 40  # it ended once the group had left (stop_when)
    # the job's Prometheus metrics, served by its driver, as the head's Prometheus sees them
    before, after = scraped
    assert "moshray_global_step 2.0" in before
    assert 'moshray_replicas{state="training"} 2.0' in before
    assert 'moshray_replicas{state="training"} 1.0' in after
    assert re.search(r'moshray_nodes_lost_total\{notice="(true|True|yes)"\} 1\.0', after), after
