"""The node lifecycle state machine with plain data (no Ray, no cloud)."""

from __future__ import annotations

import pickle

import pytest

from moshray.autoscaler.watch.lifecycle import (
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    NodeLifecycle,
    NodeState,
    summarize,
)

S = NodeState


def _life(*steps: tuple[NodeState, float], node: str = "n1", start: float = 0.0) -> NodeLifecycle:
    life = NodeLifecycle.start(node, start)
    for dst, at in steps:
        life.to(dst, at)
    return life


def test_noticed_node_full_path_and_measurements():
    life = _life((S.RUNNING, 10), (S.NOTICED, 100), (S.DRAINING, 100.25), (S.GONE, 220))
    assert life.state is S.GONE and life.terminal
    assert [t.dst for t in life.history] == [S.REQUESTED, S.RUNNING, S.NOTICED, S.DRAINING, S.GONE]
    assert [t.src for t in life.history][1:] == [S.REQUESTED, S.RUNNING, S.NOTICED, S.DRAINING]
    assert life.history[2].reason == "preemption notice"
    assert life.notice_to_draining_s == pytest.approx(0.25)
    assert life.notice_to_gone_s == 120
    assert life.notice_to_rebalanced_s is None
    life.note_rebalanced(101.5)
    life.note_rebalanced(150)  # only the first plan without the node counts
    assert life.notice_to_rebalanced_s == pytest.approx(1.5)
    assert life.left_with_notice and not life.lost_without_notice


def test_hard_loss_is_lost_without_notice():
    life = _life((S.RUNNING, 1), (S.LOST, 5))
    assert life.lost_without_notice and not life.left_with_notice and not life.noticed
    assert life.notice_to_draining_s is None
    with pytest.raises(IllegalTransition, match="rebalanced without a notice"):
        life.note_rebalanced(6)


def test_every_edge_in_the_table_is_accepted_and_every_other_rejected():
    # Paths that reach each source state from the start.
    reach = {
        S.REQUESTED: [],
        S.RUNNING: [S.RUNNING],
        S.AT_RISK: [S.RUNNING, S.AT_RISK],
        S.NOTICED: [S.RUNNING, S.NOTICED],
        S.DRAINING: [S.RUNNING, S.NOTICED, S.DRAINING],
        S.GONE: [S.RUNNING, S.NOTICED, S.DRAINING, S.GONE],
        S.LOST: [S.RUNNING, S.LOST],
        S.LAUNCH_FAILED: [S.LAUNCH_FAILED],
    }
    assert set(reach) == set(NodeState)
    for src, path in reach.items():
        for dst in NodeState:
            life = _life(*[(s, i + 1.0) for i, s in enumerate(path)])
            assert life.state is src
            if (src, dst) in TRANSITIONS:
                t = life.to(dst, 100.0)
                assert (t.src, t.dst, t.reason) == (src, dst, TRANSITIONS[(src, dst)])
            else:
                with pytest.raises(IllegalTransition) as err:
                    life.to(dst, 100.0)
                assert f"{src.value} -> {dst.value} is not allowed" in str(err.value)
                assert life.state is src  # a rejected edge changes nothing
    # Terminal states have no way out.
    assert all(src not in TERMINAL for src, _ in TRANSITIONS)


def test_illegal_edge_message_names_the_node_and_what_is_allowed():
    life = _life((S.RUNNING, 1), node="node-7")
    with pytest.raises(IllegalTransition) as err:
        life.to(S.GONE, 2)
    msg = str(err.value)
    assert msg.startswith("node node-7: running -> gone is not allowed")
    assert "at_risk" in msg and "noticed" in msg and "lost" in msg
    done = _life((S.LAUNCH_FAILED, 1))
    with pytest.raises(IllegalTransition, match=r"none \(terminal\)"):
        done.to(S.RUNNING, 2)
    # Crosses actor boundaries intact.
    again = pickle.loads(pickle.dumps(err.value))
    assert isinstance(again, IllegalTransition) and str(again) == msg


def test_start_states_and_bad_input():
    running = NodeLifecycle.start("n", 5.0, S.RUNNING)
    assert running.state is S.RUNNING and running.history[0].src is None
    with pytest.raises(IllegalTransition, match="starts requested or running"):
        NodeLifecycle.start("n", 0.0, S.DRAINING)
    with pytest.raises(ValueError):
        running.to("exploded", 1.0)
    with pytest.raises(ValueError, match="finite"):
        running.to(S.NOTICED, float("nan"))
    assert running.to("noticed", 6.0).dst is S.NOTICED  # values accepted as strings


def test_history_stays_ordered_when_clocks_disagree():
    life = _life((S.RUNNING, 10), (S.NOTICED, 20))
    t = life.to(S.DRAINING, 19.99)  # another process's clock, a little behind
    assert t.at_s == 20 and life.notice_to_draining_s == 0


def test_rebalance_recommendation_then_notice_then_planned_drain():
    life = _life((S.RUNNING, 1), (S.AT_RISK, 2), (S.NOTICED, 3), (S.DRAINING, 3.5))
    assert life.entered(S.AT_RISK) == 2 and life.notice_to_draining_s == 0.5
    planned = _life((S.RUNNING, 1), (S.DRAINING, 4), (S.GONE, 9))
    assert not planned.noticed and planned.notice_to_draining_s is None
    planned.note_rebalanced(5)  # a planned drain rebalances too, without a notice
    assert planned.notice_to_rebalanced_s is None


def test_summary():
    a = _life((S.RUNNING, 0), (S.NOTICED, 10), (S.DRAINING, 10.5), (S.GONE, 40), node="a")
    a.note_rebalanced(12)
    b = _life((S.RUNNING, 0), (S.LOST, 7), node="b")
    c = _life((S.LAUNCH_FAILED, 3), node="c")
    d = _life((S.RUNNING, 0), (S.AT_RISK, 1), (S.NOTICED, 20), (S.DRAINING, 20.1), node="d")
    d.note_rebalanced(25)
    e = _life((S.RUNNING, 0), node="e")
    s = summarize([a, b, c, d, e])
    assert (s.nodes, s.notices, s.rebalance_recommendations) == (5, 2, 1)
    assert (s.gone_with_notice, s.hard_losses, s.launch_failures) == (1, 1, 1)
    assert s.notice_to_draining_s == pytest.approx((0.5, 0.1))
    assert s.notice_to_rebalanced_s == (2, 5) and s.rebalance_s_max == 5
    assert s.draining_s_max == pytest.approx(0.5)
    assert summarize([]).rebalance_s_max is None
