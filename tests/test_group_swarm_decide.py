"""The swarm of replica groups decides from plain data (actors/replica/group_swarm.py): one
group per alive node with room, joins by shard for groups that start after step 0, a lost
node's group closed, a group whose rank failed closed and rebuilt on its node once the node
settled, lost steps counted only when progress is undone, and a one-line failure when no
group is left. No Ray here."""

from __future__ import annotations

import pytest

from moshray.actors.replica.group_spec import GroupConfig
from moshray.actors.replica.group_swarm import (
    TABLE, Activate, Close, Fail, Finish, GroupState, GroupView, Join, NodeInfo, NodeMemory,
    Place, Step, SwarmConfig, SwarmView, Wait, decide, eligible, frontier_after, node_info,
)
from moshray.cluster.state_machine import IllegalTransition

A, S, G = GroupState.ACTIVE, GroupState.STARTING, GroupState.SYNCING
CONFIG = SwarmConfig(group=GroupConfig(world_size=2, name="g"), steps=10, settle_s=5.0,
                     node_labels={"moshray-slot": None})


def node(i: int, alive: bool = True, cpus: float = 2.0, slot: str | None = None) -> NodeInfo:
    labels = (("moshray-slot", slot if slot is not None else str(i)),)
    return NodeInfo(f"n{i}", alive, labels, (("CPU", cpus),))


def view(nodes, groups=(), frontier=0, **kw) -> SwarmView:
    return SwarmView(100.0, tuple(nodes), tuple(groups), frontier=frontier, **kw)


def kinds(decision) -> list[str]:
    return [type(a).__name__ for a in decision.actions]


def test_a_group_per_node_with_room_and_the_selected_labels():
    head = NodeInfo("n9", True, (), (("CPU", 8.0),))  # no slot label: not selected
    small = node(3, cpus=1.0)  # 2 ranks of 1 CPU do not fit
    d = decide(view([node(1), node(2), head, small]), CONFIG)
    assert d.actions == (Place("n1"), Place("n2"),
                         Wait("0 group(s) ready, 0 starting, 0 node(s) settling"))
    assert eligible(head, CONFIG) == "label moshray-slot=(none) not selected"
    assert eligible(small, CONFIG) == "no room (CPU)"
    only = SwarmConfig(group=CONFIG.group, node_labels={"moshray-slot": ("2",)})
    assert [a for a in decide(view([node(1), node(2)]), only).actions
            if isinstance(a, Place)] == [Place("n2")]
    capped = SwarmConfig(group=CONFIG.group, max_groups=1)
    assert kinds(decide(view([node(1), node(2)]), capped)) == ["Place", "Wait"]


def test_groups_up_at_step_0_start_as_they_are_and_later_ones_join_by_shard():
    up = [GroupView("g0", "n1", S, 0, up=True), GroupView("g1", "n2", S, 0, up=True)]
    d = decide(view([node(1), node(2)], up), CONFIG)
    assert d.actions == (Activate("g0"), Activate("g1"), Step(("g0", "g1"), 0))
    later = [GroupView("g0", "n1", A, 4), GroupView("g1", "n2", A, 4),
             GroupView("g2", "n3", S, 0, up=True)]
    d = decide(view([node(1), node(2), node(3)], later, frontier=4), CONFIG)
    assert d.actions == (Join("g2", "g0"), Step(("g0", "g1", "g2"), 4))
    # still starting: the others go on without it
    starting = later[:2] + [GroupView("g2", "n3", S)]
    assert decide(view([node(1), node(2), node(3)], starting, frontier=4), CONFIG).actions \
        == (Step(("g0", "g1"), 4),)


def test_the_first_step_waits_for_min_groups_within_the_idle_limit():
    config = SwarmConfig(group=CONFIG.group, min_groups=2)
    groups = [GroupView("g0", "n1", A, 0), GroupView("g1", "n2", S)]
    assert kinds(decide(view([node(1), node(2)], groups), config)) == ["Wait"]
    late = view([node(1), node(2)], groups, idle_s=config.idle_limit_s + 1)
    assert decide(late, config).actions == (Step(("g0",), 0),)


def test_a_lost_node_takes_its_group_and_the_others_step_on():
    groups = [GroupView("g0", "n1", A, 6), GroupView("g1", "n2", A, 6)]
    d = decide(view([node(1), node(2, alive=False)], groups, frontier=6), CONFIG)
    assert d.actions == (Close("g1", "node n2 left the cluster", node_lost=True),
                         Step(("g0",), 6))
    assert d.frontier == 6 and d.lost == 0
    gone = decide(view([node(1)], groups, frontier=6), CONFIG)  # left the table altogether
    assert gone.actions[0] == Close("g1", "node n2 left the cluster", node_lost=True)


def test_a_group_whose_rank_failed_is_closed_and_rebuilt_after_the_node_settled():
    groups = [GroupView("g0", "n1", A, 6), GroupView("g1", "n2", A, 6, failure="rank 1 died")]
    d = decide(view([node(1), node(2)], groups, frontier=6), CONFIG)
    assert d.actions == (Close("g1", "rank 1 died"), Step(("g0",), 6))  # n2 settles first
    g0 = [GroupView("g0", "n1", A, 7)]
    memory = (NodeMemory("n2", groups=1, strikes=1, left_at_s=97.0),)
    settling = decide(view([node(1), node(2)], g0, frontier=7, memory=memory), CONFIG)
    assert settling.actions == (Step(("g0",), 7),)
    memory = (NodeMemory("n2", groups=1, strikes=1, left_at_s=90.0),)
    d = decide(view([node(1), node(2)], g0, frontier=7, memory=memory), CONFIG)
    assert d.actions == (Place("n2", rebuild=True), Step(("g0",), 7))
    struck = (NodeMemory("n2", groups=3, strikes=3, left_at_s=0.0),)
    assert decide(view([node(1), node(2)], g0, frontier=7, memory=struck),
                  CONFIG).actions == (Step(("g0",), 7),)


def test_a_group_left_behind_joins_again():
    groups = [GroupView("g0", "n1", A, 5), GroupView("g1", "n2", A, 4),
              GroupView("g2", "n3", A, None)]  # local SGD: left out of the round's average
    d = decide(view([node(1), node(2), node(3)], groups, frontier=5), CONFIG)
    assert d.actions == (Join("g1", "g0"), Join("g2", "g0"), Step(("g0", "g1", "g2"), 5))


def test_steps_are_lost_only_when_every_group_holding_the_newest_left():
    assert frontier_after(8, [8, 7]) == (8, 0)
    assert frontier_after(8, [7, 6]) == (7, 1)
    assert frontier_after(8, []) == (0, 8)
    assert frontier_after(0, [5, 5]) == (5, 0)  # groups resumed from a checkpoint at 5
    groups = [GroupView("g0", "n1", A, 8), GroupView("g1", "n2", A, 7)]
    d = decide(view([node(1, alive=False), node(2)], groups, frontier=8), CONFIG)
    assert (d.frontier, d.lost) == (7, 1)
    assert d.actions == (Close("g0", "node n1 left the cluster", node_lost=True),
                         Step(("g1",), 7))


def test_no_group_left_is_a_one_line_failure():
    groups = [GroupView("g0", "n1", A, 6, failure="rank 0 died")]
    d = decide(view([node(1)], groups, frontier=6), CONFIG)
    assert isinstance(d.actions[-1], Fail) and d.lost == 6
    assert d.actions[-1].reason == ("no group left holding the swarm's state (step 6): every "
                                    "group was lost; 6 step(s) lost")
    nothing = decide(view([node(1, cpus=1.0)]), CONFIG)
    assert nothing.actions == (Fail("no node can hold a group of 2 ranks (needs CPU=2 on one "
                                    "node): n1: no room (CPU)"),)
    idle = decide(view([node(1)], [GroupView("g0", "n1", S)], idle_s=500.0), CONFIG)
    assert isinstance(idle.actions[-1], Fail) and "no group could step for 500 s" in \
        idle.actions[-1].reason
    stuck = decide(view([node(1)], [GroupView("g0", "n1", A, 3)], frontier=3,
                        failed_in_row=5), CONFIG)
    assert isinstance(stuck.actions[-1], Fail) and "5 steps in a row" in stuck.actions[-1].reason


def test_the_swarm_finishes_at_its_steps():
    groups = [GroupView("g0", "n1", A, 10), GroupView("g1", "n2", S)]
    assert decide(view([node(1), node(2)], groups, frontier=10), CONFIG).actions == (Finish(),)


def test_a_groups_life_takes_only_the_edges_of_its_table():
    assert TABLE.path(S, A) == (A,) and TABLE.path(S, GroupState.GONE) == (GroupState.GONE,)
    with pytest.raises(IllegalTransition, match="group g0: gone -> active is not allowed"):
        TABLE.reason("g0", GroupState.GONE, A)
    with pytest.raises(IllegalTransition):
        TABLE.reason("g0", G, S)


def test_node_rows_and_bad_settings():
    row = {"NodeID": "ab", "Alive": True, "Labels": {"moshray-slot": "3"},
           "Resources": {"CPU": 2, "spot": 1000}}
    assert node_info(row) == NodeInfo("ab", True, (("moshray-slot", "3"),),
                                      (("CPU", 2.0), ("spot", 1000.0)))
    with pytest.raises(ValueError, match="SwarmConfig.mode: use one of collaborative, "
                                         "local_sgd"):
        SwarmConfig(mode="gossip")
    with pytest.raises(ValueError, match="SwarmConfig.steps: 10 is not a whole number of local "
                                         "SGD rounds of 4 inner steps; use a multiple of 4"):
        SwarmConfig(mode="local_sgd", steps=10, inner_steps=4)
    with pytest.raises(ValueError, match="SwarmConfig.max_groups"):
        SwarmConfig(max_groups=0)


@pytest.mark.parametrize("argv,message", [
    (["--mode", "gossip"], "argument --mode: invalid choice: 'gossip'"),
    (["--mode", "local_sgd", "--steps", "10"], "10 is not a whole number of local SGD rounds"),
    (["--join-at", "5", "--kill-at", "2"], "need 0 <= join-at <= kill-at"),
])
def test_the_example_refuses_bad_input_in_one_line_before_starting_anything(argv, message,
                                                                            capsys):
    from moshray.jobs.examples import sharded

    with pytest.raises(SystemExit) as exit_:
        sharded.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1


def draining(i: int) -> NodeInfo:
    n = node(i)
    return NodeInfo(n.node_id, True, n.labels, n.resources, draining=True)


def test_a_spot_notice_makes_its_group_leave_before_the_next_step_and_the_node_gets_none():
    groups = [GroupView("g0", "n1", A, 6), GroupView("g1", "n2", A, 6)]
    d = decide(view([node(1), draining(2)], groups, frontier=6), CONFIG)
    assert d.actions == (Close("g1", "node n2 got a spot notice (draining)", node_lost=True,
                               notice=True), Step(("g0",), 6))
    assert d.lost == 0
    assert eligible(draining(3), CONFIG) == "draining (a spot notice)"
    assert not any(isinstance(a, Place) for a in decide(view([draining(3)]), CONFIG).actions)


def test_the_last_holder_of_the_newest_step_steps_on_through_its_notice_until_a_join():
    # g1 (on the draining node) is the only group at step 6; g2 is still starting
    groups = [GroupView("g1", "n2", A, 6), GroupView("g2", "n3", S, None, up=True)]
    d = decide(view([draining(2), node(3)], groups, frontier=6), CONFIG)
    assert d.actions == (Join("g2", "g1"), Step(("g1", "g2"), 6))
    # once g2 holds the step too, g1 leaves
    joined = [GroupView("g1", "n2", A, 7), GroupView("g2", "n3", A, 7)]
    d = decide(view([draining(2), node(3)], joined, frontier=7), CONFIG)
    assert d.actions[0] == Close("g1", "node n2 got a spot notice (draining)", node_lost=True,
                                 notice=True)
    assert d.actions[-1] == Step(("g2",), 7) and d.lost == 0


def test_a_draining_row_is_read_from_the_gcs_list():
    row = {"NodeID": "ab", "Alive": True, "Labels": {}, "Resources": {"CPU": 1.0}}
    assert node_info(row, draining=True).draining and not node_info(row).draining
