"""The shared state-machine helper (``cluster/state_machine.py``) and the replica's protocol
built on it (``actors/replica/protocol.py``): its table and its one plan-acceptance rule,
``accept_plan``, with plain data. No Ray, no torch."""

from __future__ import annotations

import enum
import itertools
import pickle
from dataclasses import dataclass

import pytest

from moshray.actors.replica.protocol import (
    TRANSITIONS,
    Phase,
    PlanAction,
    PlanDecision,
    PlanRejection,
    ReplicaView,
    accept_plan,
)
from moshray.cluster.state_machine import (
    IllegalTransition,
    StateMachine,
    TransitionTable,
)


class Light(str, enum.Enum):
    RED = "red"
    GREEN = "green"
    YELLOW = "yellow"
    OFF = "off"


L = Light
LIGHTS = TransitionTable("light", {
    (L.RED, L.GREEN): "go", (L.GREEN, L.YELLOW): "slow", (L.YELLOW, L.RED): "stop",
    (L.RED, L.OFF): "night", (L.GREEN, L.OFF): "night", (L.YELLOW, L.OFF): "night"})


class FakeClock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_a_machine_takes_table_edges_and_keeps_a_timestamped_history():
    clock = FakeClock()
    m = StateMachine(LIGHTS, "corner", L.RED, clock)
    clock.now = 11.0
    m.to(L.GREEN)
    clock.now = 12.5
    t = m.to(L.YELLOW, "amber for 3 s")
    assert m.state is L.YELLOW and (t.src, t.dst, t.at_s, t.reason) == (
        L.GREEN, L.YELLOW, 12.5, "amber for 3 s")
    assert [(x.src, x.dst, x.at_s, x.reason) for x in m.history] == [
        (None, L.RED, 10.0, "created"), (L.RED, L.GREEN, 11.0, "go"),
        (L.GREEN, L.YELLOW, 12.5, "amber for 3 s")]
    assert m.can(L.RED) and not m.can(L.GREEN)


def test_an_illegal_edge_raises_a_clear_error_and_changes_nothing():
    m = StateMachine(LIGHTS, "corner", L.GREEN, FakeClock())
    with pytest.raises(IllegalTransition) as err:
        m.to(L.RED)
    assert str(err.value) == ("light corner: green -> red is not allowed "
                              "(from green: yellow, off)")
    assert m.state is L.GREEN and len(m.history) == 1
    m.to(L.OFF)
    with pytest.raises(IllegalTransition, match=r"none \(terminal\)"):
        m.to(L.RED)
    again = pickle.loads(pickle.dumps(err.value))  # crosses actor boundaries intact
    assert isinstance(again, IllegalTransition) and str(again) == str(err.value)


def test_times_are_clamped_to_the_history_and_must_be_finite():
    history: list = []
    LIGHTS.step("x", history, L.RED, L.GREEN, 5.0)
    t = LIGHTS.step("x", history, L.GREEN, L.YELLOW, 4.0)  # another process's clock
    assert t.at_s == 5.0
    with pytest.raises(ValueError, match="finite"):
        LIGHTS.step("x", history, L.YELLOW, L.RED, float("nan"))
    assert len(history) == 2


def test_a_bounded_history_keeps_the_newest_entries():
    clock = FakeClock()
    m = StateMachine(LIGHTS, "corner", L.RED, clock, keep=4)
    for dst in itertools.islice(itertools.cycle([L.GREEN, L.YELLOW, L.RED]), 9):
        clock.now += 1
        m.to(dst)
    assert len(m.history) == 4 and m.history[-1].dst is L.RED and m.history[-1].at_s == 19.0


def test_a_table_refuses_edges_without_a_reason_and_finds_paths():
    with pytest.raises(ValueError, match="needs a reason"):
        TransitionTable("light", {(L.RED, L.GREEN): ""})
    assert LIGHTS.path(L.RED, L.YELLOW) == (L.GREEN, L.YELLOW)
    assert LIGHTS.path(L.OFF, L.RED) == () and LIGHTS.path(L.RED, L.RED) == ()
    assert LIGHTS.allowed(L.RED) == (L.GREEN, L.OFF)


# -- the replica's protocol ---------------------------------------------------------------


def test_the_protocol_table_reaches_every_phase_and_closed_ends_it():
    reached = {Phase.JOINING} | {dst for (_, dst) in TRANSITIONS}
    assert reached == set(Phase)
    assert all(src is not Phase.CLOSED for (src, _) in TRANSITIONS)
    assert all((p, Phase.CLOSED) in TRANSITIONS for p in Phase if p is not Phase.CLOSED)
    assert all(reason for reason in TRANSITIONS.values())


@dataclass(frozen=True)
class Plan:
    epoch: int


STEP, OVERLAP = PlanDecision(PlanAction.STEP), PlanDecision(PlanAction.OVERLAP)


def _reject(reason: PlanRejection) -> PlanDecision:
    return PlanDecision(PlanAction.REJECT, reason)


@pytest.mark.parametrize("phase,epoch,overlap,plan_epoch,expected", [
    (Phase.TRAINING, 4, False, 5, STEP),  # the next step: run it
    (Phase.TRAINING, 4, True, 5, OVERLAP),  # ... in the background with an overlap
    (Phase.SYNCING, 4, False, 5, STEP),  # planned right after mark_ready: held
    (Phase.RESYNCING, 4, True, 5, OVERLAP),
    (Phase.TRAINING, 4, False, 4, _reject(PlanRejection.STALE)),  # a step already held
    (Phase.TRAINING, 4, False, 2, _reject(PlanRejection.STALE)),
    (Phase.TRAINING, 4, False, 6, _reject(PlanRejection.AHEAD)),  # skips step 5
    (Phase.STEPPING, 4, False, 5, _reject(PlanRejection.BUSY)),  # a duplicate push
    (Phase.OVERLAPPING, 4, True, 5, _reject(PlanRejection.BUSY)),
    (Phase.OVERLAPPING, 4, True, 6, _reject(PlanRejection.BUSY)),
    (Phase.JOINING, 0, False, 1, _reject(PlanRejection.NOT_JOINED)),
    (Phase.STOPPING, 4, False, 5, _reject(PlanRejection.ENDED)),
    (Phase.CLOSED, 4, False, 5, _reject(PlanRejection.ENDED)),
])
def test_accept_plan_is_one_rule_over_plain_data(phase, epoch, overlap, plan_epoch, expected):
    decision = accept_plan(ReplicaView(phase, epoch, overlap), Plan(plan_epoch))
    assert decision == expected
    assert decision.take is (expected.action is not PlanAction.REJECT)


def test_accept_plan_takes_exactly_the_next_step_in_a_phase_that_takes_plans():
    for phase, epoch, plan_epoch, overlap in itertools.product(
            Phase, range(3), range(5), (False, True)):
        decision = accept_plan(ReplicaView(phase, epoch, overlap), Plan(plan_epoch))
        takes = phase in (Phase.SYNCING, Phase.TRAINING, Phase.RESYNCING)
        assert decision.take is (takes and plan_epoch == epoch + 1)
        if decision.take:
            assert decision.action is (PlanAction.OVERLAP if overlap else PlanAction.STEP)
        else:
            assert decision.rejection is not None
