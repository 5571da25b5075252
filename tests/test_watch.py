"""Notice -> Coordinator excludes the node -> Ray drains it, on a real multi-node Ray cluster.

The Coordinator's notice bookkeeping is also tested as plain data (first part), the watcher
with the AWS source against a local IMDSv2 server and with the simulated source through
``WatcherFleet`` (second part). Every test leaves the shared cluster as it found it.
"""

from __future__ import annotations

import math
import time
import uuid

import pytest

from moshray.cluster.coordinator.core import CoordinatorCore
from moshray.cluster.coordinator.membership import MembershipConfig
from moshray.cluster.coordinator.progress import ProgressReport

# -- the Coordinator's side, as plain data ---------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _core() -> tuple[CoordinatorCore, FakeClock]:
    clock = FakeClock()
    core = CoordinatorCore(MembershipConfig(peer_ttl_s=1e6), clock=clock, target_batch_size=4)
    for peer, node in (("a", "n1"), ("b", "n2"), ("c", "n2"), ("d", "n3")):
        core.register(peer, None, node)
    return core, clock


def test_note_notice_excludes_at_once_and_times_the_first_plan_without_the_node():
    core, clock = _core()
    assert core.plan_round().participants == ("a", "b", "c", "d")
    clock.t += 5
    assert core.note_notice("n2", deadline_s=120, notice_age_s=0.25) == ("b", "c")
    stats = core.stats()
    assert (stats["notices"], stats["rebalance_s"], stats["rebalance_pending"]) == (1, [], 1)
    assert stats["draining"] == 2
    clock.t += 1.5
    plan = core.plan_round()
    assert plan.participants == ("a", "d")
    assert core.notice_stats() == {"n2": {"peers": ["b", "c"], "epoch": 1, "rebalance_s": 1.75}}
    clock.t += 10
    core.plan_round()  # later plans do not move the figure
    core.note_notice("n2", deadline_s=100)  # a repeated notice keeps the first record
    assert core.stats()["rebalance_s"] == [1.75]


def test_rebalance_timed_on_plans_made_by_collaborative_steps():
    core, clock = _core()
    for peer in "abcd":
        assert core.mark_ready(peer, 0)
    replies = [core.report(ProgressReport(peer, 0, 2)) for peer in "abcd"]
    first = next(r.plan for r in replies if r.plan is not None)
    assert first.epoch == 1 and "d" in core.progress.plan.participants  # step 1 in flight ...
    core.note_notice("n3", deadline_s=30)  # ... when d's node gets its notice
    clock.t += 0.5
    # The re-plan is made inside report(), at the first report that finds no step in
    # flight (each replica's report right after step 1), with no sample needed.
    replies = [core.report(ProgressReport(peer, 1, 0)) for peer in "abcd"]
    plan = core.progress.plan
    assert plan.epoch == 2 and "d" not in plan.participants
    assert replies[-1].stop  # d finished step 1 and stops
    assert core.notice_stats()["n3"]["rebalance_s"] == 0.5


def test_notice_for_a_node_without_peers_is_rebalanced_at_once():
    core, clock = _core()
    assert core.note_notice("n9", deadline_s=30, notice_age_s=0.1) == ()
    assert core.stats()["rebalance_s"] == [pytest.approx(0.1)]
    # a replica that was still starting there registers after the notice: it drains
    core.register("late", handle=None, node_id="n9")
    assert "late" in core.membership.draining()
    assert "late" not in core.plan_round().participants


# -- on the shared cluster ---------------------------------------------------------------------


ray = pytest.importorskip("ray")


@ray.remote(num_cpus=0)
class HandoffProbe:
    """Stands in for a replica: records the notices its watcher hands it."""

    def __init__(self) -> None:
        self.notices = []

    def on_notice(self, notice) -> str:
        self.notices.append(notice)
        return ray.get_runtime_context().get_node_id()

    def received(self):
        return list(self.notices)


def _pinned(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


@pytest.fixture
def coordinator(local_cluster):
    import moshray.cluster.coordinator.actor as coordinator_mod
    name = f"test-watch-{uuid.uuid4().hex[:8]}"
    handle = coordinator_mod.get_or_create(MembershipConfig(peer_ttl_s=600), name=name)
    ray.get(handle.stats.remote(), timeout=60)
    yield name, handle
    ray.kill(handle, no_restart=True)


def _replace_node(cluster, slot: int) -> None:
    """Put a fresh spot node back in ``slot`` (a drained raylet cannot be un-drained)."""
    if slot in cluster.live_slots():
        cluster.remove_node(slot)
    cluster.add_node(slot)


def _wait(predicate, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.cluster
def test_aws_notice_drains_node_and_rebalances(local_cluster, coordinator):
    from metadata_servers import IMDSv2Server

    from moshray.autoscaler.watch.drain import draining_nodes
    from moshray.autoscaler.watch.lifecycle import NodeState
    from moshray.autoscaler.watch import WatcherConfig, get_watcher, start_watcher, wait_rebalanced

    name, coord = coordinator
    slot = 3
    node = local_cluster.node_id(slot)
    other = local_cluster.node_id(0)
    with IMDSv2Server() as imds:
        try:
            config = WatcherConfig(source="aws", metadata_url=imds.url, poll_s=0.2,
                                   aws_interval_s=0.1, coordinator_name=name)
            watcher = start_watcher(node, config)
            assert ray.get(watcher.ready.remote(), timeout=60) == node
            assert get_watcher(node) is not None
            probe = HandoffProbe.options(scheduling_strategy=_pinned(node)).remote()
            assert ray.get(probe.received.remote(), timeout=60) == []  # placed before the drain
            assert ray.get(watcher.register.remote(probe, "probe"), timeout=30) == 1
            ray.get([coord.register.remote("on-node", None, node),
                     coord.register.remote("elsewhere", None, other)], timeout=30)
            assert ray.get(coord.plan_round.remote(), timeout=30).participants == ("elsewhere", "on-node")
            # The watcher is polling IMDS with a token and seeing 404s.
            _wait(lambda: imds.seen("/latest/meta-data/spot/instance-action"), 30, "IMDS polls")
            assert node not in draining_nodes()

            deadline = math.floor(time.time()) + 90
            imds.interrupt("terminate", at_unix_s=deadline)
            outcome = ray.get(watcher.wait_outcome.remote(30), timeout=40)
            assert outcome is not None, "no outcome within 30 s of the notice"
            assert outcome.notice.node_id == node and outcome.notice.deadline_unix_s == deadline
            assert outcome.coordinator_ok and outcome.peers == ("on-node",)
            assert outcome.ray.accepted, outcome.ray.message
            # The Coordinator excludes the node's peers from the next plan at once.
            assert ray.get(coord.stats.remote(), timeout=30)["draining"] == 1
            assert ray.get(coord.plan_round.remote(), timeout=30).participants == ("elsewhere",)
            rebalance_s = wait_rebalanced(coord, node, timeout_s=10)
            assert rebalance_s is not None and 0 <= rebalance_s < 30
            # Ray reports the node as draining, with the notice's deadline.
            assert draining_nodes()[node] == pytest.approx(deadline, abs=0.01)
            # The hand-off reached the actor on that node.
            got = _wait(lambda: ray.get(probe.received.remote(), timeout=30), 30, "hand-off")
            assert got[0] == outcome.notice
            life = ray.get(watcher.lifecycle.remote(), timeout=30)
            assert [t.dst for t in life.history] == [NodeState.RUNNING, NodeState.NOTICED,
                                                     NodeState.DRAINING]
            assert 0 <= life.notice_to_draining_s < 30
            status = ray.get(watcher.status.remote(), timeout=30)
            assert (status["state"], status["notices"], status["errors"]) == ("draining", 1, [])
            assert status["handoffs_acked"] == 1
            # Ray schedules nothing new on the draining node: an actor pinned there is refused.
            late = HandoffProbe.options(scheduling_strategy=_pinned(node)).remote()
            with pytest.raises(ray.exceptions.ActorUnschedulableError):
                ray.get(late.received.remote(), timeout=30)
        finally:
            _replace_node(local_cluster, slot)
    assert slot in local_cluster.live_slots()


@pytest.mark.cluster
def test_fleet_simulated_notice_then_removal_and_a_hard_loss(local_cluster, coordinator):
    from moshray.autoscaler.watch.drain import draining_nodes
    from moshray.autoscaler.watch.lifecycle import NodeState
    from moshray.autoscaler.watch import WatcherConfig, WatcherFleet, spot_nodes

    name, coord = coordinator
    fleet = WatcherFleet(WatcherConfig(source="simulated", poll_s=0.2, coordinator_name=name))
    noticed_slot, killed_slot = 1, 2
    try:
        started = fleet.sync()
        assert set(started) == set(spot_nodes()) and len(started) == len(local_cluster.live_slots())
        assert fleet.sync() == ()  # one watcher per node, never two
        node = fleet.node_id(noticed_slot)
        assert node == local_cluster.node_id(noticed_slot)
        ray.get([coord.register.remote(f"p{s}", None, fleet.node_id(s))
                 for s in local_cluster.live_slots()], timeout=30)
        probe = HandoffProbe.options(scheduling_strategy=_pinned(node)).remote()
        assert ray.get(probe.received.remote(), timeout=60) == []
        fleet.register(noticed_slot, probe, "probe")

        removed = []
        outcome = fleet.preempt(noticed_slot, notice_s=3.0,
                                remove=lambda s: (removed.append((s, time.time(), draining_nodes())),
                                                  local_cluster.remove_node(s)))
        assert outcome.coordinator_ok and outcome.ray.accepted and outcome.peers == (f"p{noticed_slot}",)
        slot, removed_at, draining_then = removed[0]
        assert slot == noticed_slot and node in draining_then
        assert removed_at >= outcome.notice.deadline_unix_s - 0.05  # removed at its deadline
        plan = ray.get(coord.plan_round.remote(), timeout=30)
        assert f"p{noticed_slot}" not in plan.participants and f"p{killed_slot}" in plan.participants

        # A hard kill: no notice, the node is simply gone.
        killed = fleet.node_id(killed_slot)
        local_cluster.remove_node(killed_slot, hard=True)
        assert fleet.node_gone(killed_slot) is NodeState.LOST

        summary = fleet.summary(coord)
        lives = fleet.lifecycles()
        assert lives[node].state is NodeState.GONE and lives[node].left_with_notice
        assert lives[killed].lost_without_notice
        assert (summary.notices, summary.hard_losses, summary.gone_with_notice) == (1, 1, 1)
        assert summary.rebalance_s_max is not None and 0 <= summary.rebalance_s_max < 30
        assert summary.draining_s_max is not None and summary.draining_s_max < 30
        assert len(fleet.watched()) == len(local_cluster.live_slots())
        with pytest.raises(KeyError, match="slot 1"):
            fleet.node_id(noticed_slot)
    finally:
        fleet.stop()
        for slot in (noticed_slot, killed_slot):
            if slot not in local_cluster.live_slots():
                local_cluster.add_node(slot)
    # Replacement nodes get their own watchers.
    fleet2 = WatcherFleet(WatcherConfig(source="simulated", poll_s=0.2, coordinator_name=name))
    try:
        assert len(fleet2.sync(only=[noticed_slot])) == 1
    finally:
        fleet2.stop()


@pytest.mark.cluster
def test_watcher_config_and_cli_reject_bad_input(local_cluster):
    from moshray.autoscaler.watch import WatcherConfig, deliver_notice, start_watcher

    with pytest.raises(ValueError, match="source must be one of"):
        WatcherConfig(source="azure")
    with pytest.raises(ValueError, match="poll_s must be positive"):
        WatcherConfig(poll_s=0)
    with pytest.raises(ValueError, match="56 hex"):
        start_watcher("127.0.0.1:/tmp/ray/plasma_store")
    with pytest.raises(LookupError, match="has no watcher"):
        deliver_notice("ab" * 28, 10)


@pytest.mark.cluster
def test_moshray_watch_cli_on_a_node(local_cluster, coordinator):
    """``moshray watch --source gcp`` as a separate driver: notice -> JSON line -> exit 0."""
    import json
    import os
    import subprocess
    import sys

    import ray
    from metadata_servers import GCEMetadataServer

    from moshray.autoscaler.watch.drain import draining_nodes

    name, coord = coordinator
    slot = 0
    node = local_cluster.node_id(slot)
    # The CLI finds the Coordinator by name (default: the training job's); here, this test's.
    with GCEMetadataServer(max_wait_s=5) as gce:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moshray.autoscaler.watch", "--source", "gcp",
             "--metadata-url", gce.url, "--address", local_cluster.address, "--node-id", node,
             "--poll-s", "0.5", "--gcp-notice-s", "3", "--json", "--max-seconds", "120",
             "--coordinator-name", name],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
        try:
            _wait(lambda: any("wait_for_change" in r.path for r in gce.seen()) or proc.poll() is not None,
                  120, "the watcher's first long-poll")
            assert proc.poll() is None, proc.stderr.read()
            gce.preempt()
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err
            doc = json.loads(out.strip().splitlines()[-1])
            assert doc["notice"]["node_id"] == node and doc["notice"]["action"] == "preempt"
            assert doc["notice"]["deadline_unix_s"] == pytest.approx(doc["notice"]["received_unix_s"] + 3)
            assert doc["ray"]["accepted"] is True and doc["coordinator_ok"] is True
            assert node in ray.get(coord.notice_stats.remote(), timeout=30)
            assert f"watching node {node}" in err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            _replace_node(local_cluster, slot)


def test_a_sigterm_source_needs_its_grace_period():
    import subprocess
    import sys

    for args, says in ((["--source", "sigterm"], "--source sigterm needs --grace-s"),
                       (["--grace-s", "0"], "--grace-s must be positive")):
        proc = subprocess.run([sys.executable, "-m", "moshray.autoscaler.watch", *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.cluster
def test_moshray_watch_sigterm_is_a_notice_due_in_the_grace_period(local_cluster, tmp_path):
    """A pod's termination (``infra/kuberay/``): ``moshray watch --source sigterm --grace-s 3``
    gets SIGTERM; its node is noticed with the grace period as the deadline, every job's
    Coordinator on the cluster is told (two jobs here), Ray drains the node, and the command
    stays until the deadline, then exits 0."""
    import json
    import os
    import signal
    import subprocess
    import sys

    import moshray.cluster.coordinator.actor as coordinator_mod
    from moshray.cluster import placement

    jobs = [f"watch-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    coords = [coordinator_mod.get_or_create(MembershipConfig(peer_ttl_s=600),
                                            name=placement.coordinator_name(j)) for j in jobs]
    slot = 0
    node = local_cluster.node_id(slot)
    err_path = tmp_path / "watch.err"
    try:
        ray.get([c.stats.remote() for c in coords], timeout=60)
        with open(err_path, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moshray.autoscaler.watch", "--source", "sigterm",
                 "--grace-s", "3", "--address", local_cluster.address, "--node-id", node,
                 "--json", "--max-seconds", "120"],
                stdout=subprocess.PIPE, stderr=err, text=True, env=dict(os.environ))
        try:
            _wait(lambda: f"watching node {node}" in err_path.read_text()
                  or proc.poll() is not None, 120, "the watcher to start")
            assert proc.poll() is None, err_path.read_text()
            assert "sigterm (the watcher's SIGTERM is the notice)" in err_path.read_text()
            signaled = time.time()
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=90)
            ended = time.time()
            assert proc.returncode == 0, err_path.read_text()
            doc = json.loads(out.strip().splitlines()[-1])
            notice = doc["notice"]
            assert notice["node_id"] == node and notice["cloud"] == "sigterm"
            assert notice["action"] == "terminate" and notice["source"] == "SIGTERM"
            assert notice["deadline_unix_s"] == pytest.approx(notice["received_unix_s"] + 3)
            assert doc["ray"]["accepted"] is True and doc["coordinator_ok"] is True
            for c in coords:  # every job's Coordinator heard it
                assert node in ray.get(c.notice_stats.remote(), timeout=30)
            assert ended - signaled >= 2.5  # it stayed until the deadline
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            _replace_node(local_cluster, slot)
    finally:
        for c in coords:
            ray.kill(c, no_restart=True)


def _remove(watcher, node: str) -> None:
    """Stop and kill ``watcher`` as its owner would, and wait until its name is free."""
    from moshray.autoscaler.watch import get_watcher

    try:
        ray.get(watcher.stop.remote(), timeout=30)
    except ray.exceptions.RayError:
        pass  # already gone
    ray.kill(watcher, no_restart=True)
    _wait(lambda: get_watcher(node) is None, 60, "the watcher's name to be free")


@pytest.mark.cluster
def test_fleet_uses_a_watcher_it_found_and_never_removes_it(local_cluster):
    from moshray.autoscaler.watch.watcher import open_watcher
    from moshray.autoscaler.watch import WatcherConfig, WatcherFleet, get_watcher

    config = WatcherConfig(source="simulated", poll_s=0.2)
    node = local_cluster.node_id(3)
    own = open_watcher(node, config)  # the node's own, as its `moshray watch` starts it
    assert own.created
    ray.get(own.actor.ready.remote(), timeout=60)
    fleet = WatcherFleet(config)
    try:
        assert node in fleet.sync()
        assert fleet.watcher(node)._actor_id == own.actor._actor_id  # used, not a second one
        fleet.node_gone(node)  # forgotten by the fleet ...
        fleet.stop()  # ... and the fleet's own watchers stopped
        found = get_watcher(node)  # the node's is still there and serving
        assert found is not None and found._actor_id == own.actor._actor_id
        assert ray.get(found.ready.remote(), timeout=30) == node
        others = [n for s, n in ((s, local_cluster.node_id(s)) for s in local_cluster.live_slots())
                  if n != node]
        _wait(lambda: all(get_watcher(n) is None for n in others), 60,
              "the fleet's own watchers to be removed")
    finally:
        fleet.stop()
        _remove(own.actor, node)


@pytest.mark.cluster
def test_moshray_watch_uses_a_jobs_watcher_then_starts_the_nodes_own(local_cluster, tmp_path):
    """``moshray watch`` on a node where a job's watcher runs: it uses that one, never
    stopping it; when the job removes it, the command starts the node's own at once."""
    import subprocess
    import sys

    import moshray
    from moshray.autoscaler.watch.watcher import open_watcher
    from moshray.autoscaler.watch import WatcherConfig, get_watcher

    node = local_cluster.node_id(3)
    job = open_watcher(node, WatcherConfig(source="simulated", poll_s=0.2))  # the job's
    assert job.created
    ray.get(job.actor.ready.remote(), timeout=60)
    err_path = tmp_path / "watch.err"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moshray.autoscaler.watch", "--source", "simulated",
             "--address", local_cluster.address, "--node-id", node, "--poll-s", "0.2",
             "--max-seconds", "300"], stdout=subprocess.DEVNULL, stderr=err, text=True)
    try:
        _wait(lambda: "started there" in err_path.read_text() or proc.poll() is not None,
              120, "moshray watch to find the job's watcher")
        assert proc.poll() is None, err_path.read_text()
        assert f"moshray watch: moshray {moshray.__version__}" in err_path.read_text()
        assert ray.get(job.actor.ready.remote(), timeout=30) == node  # used, not replaced

        _remove(job.actor, node)  # the job ends and removes its watcher
        _wait(lambda: "with its own watcher" in err_path.read_text() or proc.poll() is not None,
              120, "moshray watch to start the node's own watcher")
        assert proc.poll() is None, err_path.read_text()
        own = _wait(lambda: get_watcher(node), 60, "the node's own watcher")
        assert own._actor_id != job.actor._actor_id
        assert ray.get(own.ready.remote(), timeout=30) == node
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
    # the node's own watcher belongs to the command: gone with it
    _wait(lambda: get_watcher(node) is None, 60, "moshray watch's watcher to go with it")


def test_cli_rejects_bad_arguments_with_exit_2():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "moshray.autoscaler.watch", "--source", "aws",
                          "--node-id", "not-a-node"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "56 hex" in run.stderr and run.stderr.count("\n") == 1
    run = subprocess.run([sys.executable, "-m", "moshray.autoscaler.watch", "--source", "simulated",
                          "--metadata-url", "http://127.0.0.1:1"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "simulated source takes no metadata URL" in run.stderr
