"""The elastic controller's decisions and replica state machine, with plain data (no Ray)."""

from __future__ import annotations

import pytest

from moshray.jobs.controller.observations import (
    Market,
    Memory,
    NodeView,
    Observation,
    ReplicaError,
    ReplicaView,
    RunOutcome,
    node_view,
)
from moshray.jobs.controller.reconcile import (
    FailJob,
    NodeFailure,
    NodeJoined,
    NodeLost,
    Policy,
    ReplicaFailed,
    RequestCapacity,
    SetState,
    StartReplica,
    StopReplica,
    WaitForNodes,
    decide,
    replicas_wanted,
)
from moshray.jobs.controller.replica_states import (
    TRANSITIONS,
    IllegalTransition,
    ReplicaRecord,
    ReplicaState,
    path_between,
)

S = ReplicaState


def node(node_id: str, alive: bool = True, gpus: float = 0, draining: bool = False,
         worker: bool = True) -> NodeView:
    return NodeView(node_id, alive, worker, Market.SPOT, gpus, "127.0.0.1", draining)


class World:
    """A tiny driver of ``decide`` that applies its decisions to plain memory, as the
    controller's shell does (minus Ray)."""

    def __init__(self, policy: Policy = Policy()):
        self.policy = policy
        self.records: dict[str, ReplicaRecord] = {}
        self.known: dict[str, float] = {}
        self.failures: dict[str, tuple[int, float]] = {}
        self.requested: int | None = None
        self.count = 0
        self.lost: list[NodeLost] = []
        self.job_failures: list[tuple[str, str, ReplicaError]] = []
        self.checkpoint_failures = 0

    def memory(self) -> Memory:
        return Memory(
            tuple((r.replica_id, r.node_id, r.state.value, r.num_gpus)
                  for r in self.records.values() if not r.state.terminal),
            tuple(self.known.items()), dict(self.failures), self.requested,
            {r.replica_id: r.started_at_s for r in self.records.values()},
            tuple(self.job_failures), self.checkpoint_failures)

    def tick(self, now: float, nodes, views=(), noticed=()):
        obs = Observation(now, tuple(nodes), tuple(views), frozenset(noticed))
        d = decide(obs, self.memory(), self.policy)
        for a in d.actions:
            if isinstance(a, StartReplica):
                self.count += 1
                rid = f"r{self.count}"
                self.records[rid] = ReplicaRecord(rid, a.node_id, a.num_gpus, now)
            elif isinstance(a, SetState):
                self.records[a.replica_id].to(a.state, now, a.reason)
            elif isinstance(a, NodeJoined):
                self.known[a.node_id] = now
            elif isinstance(a, NodeLost):
                self.known.pop(a.node_id)
                self.lost.append(a)
            elif isinstance(a, NodeFailure):
                c, _ = self.failures.get(a.node_id, (0, 0.0))
                self.failures[a.node_id] = (c + 1, now)
            elif isinstance(a, RequestCapacity):
                self.requested = a.nodes
            elif isinstance(a, ReplicaFailed):
                self.job_failures.append((a.replica_id, a.node_id, a.error))
        return d

    def on(self, node_id: str, states=(S.STARTING, S.SYNCING, S.TRAINING)) -> list[str]:
        return [r.replica_id for r in self.records.values()
                if r.node_id == node_id and r.state in states]


def test_transition_table_rejects_illegal_edges_and_keeps_history():
    r = ReplicaRecord("r1", "n1", 0.0, 0.0)
    r.to(S.SYNCING, 1.0)
    r.to(S.TRAINING, 2.0)
    with pytest.raises(IllegalTransition, match="training -> starting"):
        r.to(S.STARTING, 3.0)
    r.to(S.GONE, 4.0, "node lost")
    with pytest.raises(IllegalTransition, match="terminal"):
        r.to(S.TRAINING, 5.0)
    assert [(t.src, t.dst, t.at_s) for t in r.history] == [
        (S.STARTING, S.SYNCING, 1.0), (S.SYNCING, S.TRAINING, 2.0), (S.TRAINING, S.GONE, 4.0)]
    assert all(reason for reason in TRANSITIONS.values())


def test_path_between_passes_every_edge_in_order():
    assert path_between(S.STARTING, S.TRAINING) == (S.SYNCING, S.TRAINING)
    assert path_between(S.TRAINING, S.TRAINING) == ()
    assert path_between(S.LEAVING, S.TRAINING) == ()  # leaving is one-way
    assert path_between(S.GONE, S.STARTING) == ()


@pytest.mark.parametrize("gpus,per_node,expected", [
    (0, 0, (1, 0.0)), (2, 0, (2, 1.0)), (4, 0, (4, 1.0)), (0.5, 0, (1, 0.0)),
    (0, 2, (2, 0.0)), (1, 2, (2, 0.5)), (4, 2, (2, 1.0)),
])
def test_replicas_wanted_per_node(gpus, per_node, expected):
    assert replicas_wanted(gpus, per_node) == expected


def test_node_view_reads_ray_rows():
    row = {"NodeID": "abc", "Alive": True, "NodeManagerAddress": "10.0.0.5",
           "Resources": {"CPU": 4.0, "GPU": 2.0, "spot": 1000.0},
           "Labels": {"moshray-slot": "3", "moshray-market": "on-demand"}}
    v = node_view(row, frozenset({"abc"}))
    assert (v.worker, v.gpus, v.market, v.slot, v.draining) == (True, 2.0, Market.ON_DEMAND,
                                                                 3, True)
    head = {"NodeID": "h", "Alive": True, "Resources": {"CPU": 1.0,
                                                        "node:__internal_head__": 1.0}}
    assert node_view(head).worker is False


@pytest.mark.parametrize("labels, market", [
    ({"ray.io/market-type": "on-demand"}, Market.ON_DEMAND),  # Ray's key and value
    ({"ray.io/market-type": "ON_DEMAND"}, Market.ON_DEMAND),  # other spellings of it
    ({"ray.io/market-type": "spot", "moshray-market": "on-demand"}, Market.SPOT),  # Ray's wins
    ({"moshray-market": "on-demand"}, Market.ON_DEMAND),  # the older key, as a fallback
    ({}, Market.SPOT),  # no label: spot
])
def test_node_view_reads_the_market_label(labels, market):
    row = {"NodeID": "n", "Alive": True, "Resources": {"spot": 1000.0},
           "Labels": {**labels, "moshray-instance-type": "g4dn.xlarge", "moshray-cloud": "aws",
                      "ray.io/availability-zone": "us-east-1a"}}
    v = node_view(row)
    assert (v.market, v.cloud, v.instance_type, v.zone) == (market, "aws", "g4dn.xlarge",
                                                            "us-east-1a")


def test_one_replica_per_node_gpu_each_and_capacity_requested_once():
    w = World(Policy(min_nodes=1, max_nodes=4))
    d = w.tick(0.0, [node("a"), node("g", gpus=2), node("head", worker=False)])
    starts = sorted((a.node_id, a.num_gpus) for a in d.of(StartReplica))
    assert starts == [("a", 0.0), ("g", 1.0), ("g", 1.0)]
    assert d.of(RequestCapacity) == (RequestCapacity(4),)
    assert {a.node_id for a in d.of(NodeJoined)} == {"a", "g"}
    d = w.tick(1.0, [node("a"), node("g", gpus=2)])
    assert d.of(StartReplica) == () and d.of(RequestCapacity) == ()


def test_joiner_follows_starting_syncing_training_and_late_node_gets_a_replica():
    w = World()
    w.tick(0.0, [node("a")])
    (rid,) = w.on("a")
    w.tick(1.0, [node("a")], [ReplicaView(rid, member=True)])
    assert w.records[rid].state is S.SYNCING
    w.tick(2.0, [node("a"), node("b")], [ReplicaView(rid, member=True, ready=True)])
    assert w.records[rid].state is S.TRAINING
    assert len(w.on("b")) == 1  # the node that joined later got a replica


def test_seen_two_edges_on_records_both_transitions():
    w = World()
    w.tick(0.0, [node("a")])
    (rid,) = w.on("a")
    w.tick(1.0, [node("a")], [ReplicaView(rid, member=True, ready=True)])
    assert [t.dst for t in w.records[rid].history] == [S.SYNCING, S.TRAINING]


def test_no_nodes_waits_then_trains_when_one_comes():
    w = World(Policy(min_nodes=1, max_nodes=2))
    d = w.tick(0.0, [node("head", worker=False)])
    assert d.waiting == WaitForNodes(0, 1) and d.of(StartReplica) == ()
    assert d.of(RequestCapacity) == (RequestCapacity(2),)  # asked even with none yet
    d = w.tick(5.0, [node("head", worker=False), node("a")])
    assert d.waiting is None and len(d.of(StartReplica)) == 1


def test_more_nodes_than_max_nodes_uses_the_first_joined():
    w = World(Policy(min_nodes=1, max_nodes=2))
    w.tick(0.0, [node("c"), node("d")])
    d = w.tick(1.0, [node("a"), node("b"), node("c"), node("d")])  # a, b join later
    assert d.active_nodes == ("c", "d")
    assert sum(len(w.on(n)) for n in "ab") == 0
    # c is lost: the next node in join order takes its place
    w.tick(2.0, [node("a"), node("b"), node("d")])
    assert len(w.on("a")) == 1 and len(w.on("b")) == 0


def test_hard_kill_drops_the_replica_and_counts_a_loss_without_notice():
    w = World()
    w.tick(0.0, [node("a"), node("b")])
    (ra,) = w.on("a")
    w.tick(1.0, [node("a"), node("b")], [ReplicaView(ra, member=True, ready=True)])
    d = w.tick(2.0, [node("a", alive=False), node("b")],
               [ReplicaView(ra, outcome=RunOutcome.DIED)])
    assert d.of(NodeFailure) == ()  # the node is gone: not a failure on a live node
    assert w.records[ra].state is S.GONE
    assert d.of(NodeLost) == (NodeLost("a", with_notice=False),)
    assert d.of(StartReplica) == ()  # nowhere new to go


def test_notice_moves_replica_to_leaving_and_the_loss_counts_with_notice():
    w = World()
    w.tick(0.0, [node("a")])
    (ra,) = w.on("a")
    w.tick(1.0, [node("a")], [ReplicaView(ra, member=True, ready=True)])
    w.tick(2.0, [node("a")], [ReplicaView(ra, member=True, ready=True, draining=True)],
           noticed={"a"})
    assert w.records[ra].state is S.LEAVING
    d = w.tick(3.0, [node("a")], [ReplicaView(ra, member=True, ready=True)], noticed={"a"})
    assert d.of(StartReplica) == ()  # a noticed node gets no new replica
    d = w.tick(4.0, [], [ReplicaView(ra, outcome=RunOutcome.DIED)], noticed={"a"})
    assert w.records[ra].state is S.GONE
    assert d.of(NodeLost) == (NodeLost("a", with_notice=True),)


def test_a_replica_not_ready_when_its_node_is_noticed_is_stopped_at_once():
    w = World()
    w.tick(0.0, [node("a"), node("b"), node("c")])
    ra, rb, rc = w.on("a") + w.on("b") + w.on("c")
    w.tick(1.0, [node("a"), node("b"), node("c")],
           [ReplicaView(rb, member=True), ReplicaView(rc, member=True, ready=True)])
    # a's replica is still starting, b's syncing, c's ready when the notices come
    d = w.tick(2.0, [node("a"), node("b"), node("c", draining=True)],
               [ReplicaView(ra), ReplicaView(rb, member=True),
                ReplicaView(rc, member=True, ready=True)], noticed={"a", "b"})
    assert set(d.of(StopReplica)) == {
        StopReplica(ra, "node noticed before it was ready"),
        StopReplica(rb, "node noticed before it was ready")}
    assert w.records[ra].state is S.GONE and w.records[rb].state is S.GONE
    assert w.records[ra].history[-1].reason == "stopped: node noticed before it was ready"
    assert w.records[rc].state is S.LEAVING  # ready: it may be in the step in flight
    # a replica that became ready since the last look is not stopped either
    w2 = World()
    w2.tick(0.0, [node("a")])
    (r,) = w2.on("a")
    d = w2.tick(1.0, [node("a")], [ReplicaView(r, member=True, ready=True)], noticed={"a"})
    assert d.of(StopReplica) == () and w2.records[r].state is S.LEAVING
    # on a draining node (Ray's drain, no notice) as well
    w3 = World()
    w3.tick(0.0, [node("a")])
    (r,) = w3.on("a")
    d = w3.tick(1.0, [node("a", draining=True)], [ReplicaView(r)])
    assert d.of(StopReplica) == (StopReplica(r, "node draining before it was ready"),)
    assert d.of(StartReplica) == ()


def test_node_dies_while_its_replica_syncs():
    w = World()
    w.tick(0.0, [node("a")])
    (ra,) = w.on("a")
    w.tick(1.0, [node("a")], [ReplicaView(ra, member=True)])
    w.tick(2.0, [], [ReplicaView(ra, member=True)])
    assert [t.dst for t in w.records[ra].history] == [S.SYNCING, S.GONE]
    assert w.lost == [NodeLost("a", with_notice=False)]


def test_flapping_nodes_each_incarnation_gets_its_own_replica():
    w = World()
    for i in range(4):  # a node id never comes back: each flap is a fresh raylet
        w.tick(2.0 * i, [node(f"n{i}")])
        w.tick(2.0 * i + 1, [])
    assert len(w.lost) == 4 and all(not lost.with_notice for lost in w.lost)
    assert all(r.state is S.GONE for r in w.records.values()) and len(w.records) == 4


def test_replica_that_keeps_failing_backs_off_then_gives_up_on_the_node():
    w = World(Policy(max_failures_per_node=2, failure_backoff_s=5.0))
    w.tick(0.0, [node("a")])
    (r1,) = w.on("a")
    d = w.tick(1.0, [node("a")], [ReplicaView(r1, outcome=RunOutcome.RAISED)])
    assert d.of(NodeFailure) == (NodeFailure("a"),) and d.of(StartReplica) == ()  # backoff
    d = w.tick(7.0, [node("a")])
    (r2,) = w.on("a")
    w.tick(8.0, [node("a")], [ReplicaView(r2, outcome=RunOutcome.RAISED)])
    d = w.tick(20.0, [node("a")])
    assert d.of(StartReplica) == ()  # two failures: no more replicas on this node


def test_replica_stuck_starting_is_stopped():
    w = World(Policy(start_timeout_s=10.0))
    w.tick(0.0, [node("a")])
    (ra,) = w.on("a")
    d = w.tick(11.0, [node("a")], [ReplicaView(ra)])
    assert StopReplica(ra, "did not start in time") in d.actions
    assert w.records[ra].state is S.GONE


def test_training_replica_told_to_resync_goes_back_to_syncing():
    w = World()
    w.tick(0.0, [node("a")])
    (ra,) = w.on("a")
    w.tick(1.0, [node("a")], [ReplicaView(ra, member=True, ready=True)])
    w.tick(2.0, [node("a")], [ReplicaView(ra, member=True, ready=False)])
    assert w.records[ra].state is S.SYNCING


def test_decide_is_pure():
    w = World()
    obs = Observation(0.0, (node("a"), node("b", gpus=1)))
    assert decide(obs, w.memory(), w.policy) == decide(obs, w.memory(), w.policy)


def test_policy_rejects_bad_bounds():
    with pytest.raises(ValueError, match="min_nodes"):
        Policy(min_nodes=3, max_nodes=2)


def test_replica_dead_on_a_node_ray_still_lists_backs_off_before_a_replacement():
    w = World(Policy(failure_backoff_s=15.0))
    w.tick(0.0, [node("a")])
    (ra,) = w.on("a")
    d = w.tick(1.0, [node("a")], [ReplicaView(ra, outcome=RunOutcome.DIED)])
    assert d.of(NodeFailure) == (NodeFailure("a"),) and d.of(StartReplica) == ()
    assert w.tick(10.0, [node("a")]).of(StartReplica) == ()  # still backing off
    assert len(w.tick(17.0, [node("a")]).of(StartReplica)) == 1


# -- rule 6: the failure policy -----------------------------------------------------------------


def raised(rid: str, message: str, kind: str = "KeyError") -> ReplicaView:
    return ReplicaView(rid, outcome=RunOutcome.RAISED, error=ReplicaError(kind, message))


def test_the_same_error_on_two_nodes_fails_the_job_at_once():
    w = World(Policy(max_failures=10, failure_backoff_s=0.0))
    w.tick(0.0, [node("a"), node("b")])
    (ra,), (rb,) = w.on("a"), w.on("b")
    d = w.tick(1.0, [node("a"), node("b")], [raised(ra, "'label'")])
    assert d.of(ReplicaFailed) == (ReplicaFailed(ra, "a", ReplicaError("KeyError", "'label'")),)
    assert d.failed is None and len(d.of(StartReplica)) == 1  # one failure: retried
    (ra2,) = w.on("a")
    d = w.tick(2.0, [node("a"), node("b")], [raised(ra2, "'label'"), raised(rb, "'label'")])
    assert d.failed == FailJob("the same error on 2 nodes: KeyError: 'label'", rb)
    assert d.of(StartReplica) == () and d.of(RequestCapacity) == ()


def test_different_errors_are_retried_up_to_max_failures_then_the_job_fails():
    w = World(Policy(max_failures=2, failure_backoff_s=0.0, max_failures_per_node=10))
    w.tick(0.0, [node("a")])
    for i in range(2):  # two failures: each replaced
        (r,) = w.on("a")
        d = w.tick(1.0 + i, [node("a")], [raised(r, f"bad batch {i}", "RuntimeError")])
        assert d.failed is None and len(d.of(StartReplica)) == 1
    (r,) = w.on("a")
    d = w.tick(5.0, [node("a")], [raised(r, "bad batch 2", "RuntimeError")])
    assert d.failed == FailJob("replicas failed 3 times, more than training.max_failures=2; "
                               "the last: RuntimeError: bad batch 2", r)
    assert d.of(StartReplica) == ()


def test_max_failures_zero_fails_on_the_first_error_and_deaths_never_count():
    w = World(Policy(max_failures=0, failure_backoff_s=0.0))
    w.tick(0.0, [node("a"), node("b")])
    (ra,), (rb,) = w.on("a"), w.on("b")
    d = w.tick(1.0, [node("a"), node("b")], [ReplicaView(ra, outcome=RunOutcome.DIED)])
    assert d.failed is None and d.of(ReplicaFailed) == ()  # a killed process: elasticity
    d = w.tick(2.0, [node("a"), node("b")], [raised(rb, "boom", "ValueError")])
    assert d.failed is not None and d.failed.replica_id == rb


def test_checkpoint_saves_failing_in_a_row_fail_the_job():
    w = World(Policy(max_checkpoint_failures=2))
    w.tick(0.0, [node("a")])
    w.checkpoint_failures = 1
    assert w.tick(1.0, [node("a")]).failed is None
    w.checkpoint_failures = 2
    d = w.tick(2.0, [node("a")])
    assert d.failed == FailJob("2 checkpoint saves failed in a row "
                               "(training.max_checkpoint_failures=2)")


def test_every_node_exhausted_and_no_replica_left_fails_instead_of_idling():
    w = World(Policy(max_failures=10, max_failures_per_node=1, failure_backoff_s=0.0))
    w.tick(0.0, [node("a"), node("b")])
    (ra,), (rb,) = w.on("a"), w.on("b")
    d = w.tick(1.0, [node("a"), node("b")], [ReplicaView(ra, outcome=RunOutcome.DIED)])
    assert d.failed is None  # b still trains
    d = w.tick(2.0, [node("a"), node("b")], [ReplicaView(rb, outcome=RunOutcome.DIED)])
    assert d.failed is not None and "each of the 2 nodes had 1 replicas fail" in d.failed.reason


def test_policy_rejects_bad_failure_bounds():
    with pytest.raises(ValueError, match="max_failures"):
        Policy(max_failures=-1)
    with pytest.raises(ValueError, match="same_failure_nodes"):
        Policy(same_failure_nodes=0)
