"""A notice plans the next step at once, ahead of the step in flight or of the staying
peers' first samples, and every rule of progress.py still holds (pure, no Ray)."""

from __future__ import annotations


# -- the replica's side: it keeps a plan made ahead until it applied the step before --------


def _plans(*epochs):
    from moshray.cluster.membership import Membership
    from moshray.cluster.messages import PeerInfo

    members = Membership()
    members.register(PeerInfo("a", "a", "node-a"), 0.0)
    out = {}
    for e in epochs:
        members.epoch = e - 1
        out[e] = members.plan(0.0)
    return out


def _replica():
    import torch

    from moshray.actors.replica_state import TrainState
    from moshray.actors.step_manager import StepManager

    manager = StepManager("a", None, None, "node-a", 5.0)
    model = torch.nn.Linear(2, 1)
    manager.state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), None,
                               None, {})
    return manager


def test_a_replica_runs_a_plan_made_ahead_right_after_the_step_before():
    plans = _plans(1, 2, 3)
    m = _replica()
    m.receive_plan(plans[2])  # ahead of step 1, which it has not even taken yet
    assert m._plan is None and m._ahead is plans[2]
    m.receive_plan(plans[3])  # not the next step nor the one after: ignored
    assert m._ahead is plans[2]
    m.receive_plan(plans[1])
    plan, m._plan = m._plan, None  # taken at a micro-batch, then applied
    assert plan is plans[1]
    m._commit(plan)
    assert m._plan is plans[2] and m._ahead is None and m.state.epoch == 1
    m._commit(m._plan)
    assert m.state.lineage.gaps == 0 and m.state.lineage.repeats == 0


def test_a_replica_that_reloads_its_state_drops_the_plan_made_ahead():
    import asyncio

    m = _replica()
    m.receive_plan(_plans(2)[2])
    snapshot = m.state.snapshot()
    asyncio.run(m._load(snapshot, from_donor=True))
    assert m._ahead is None
