"""Which progress reports a replica sends per micro-batch (actors/replica/step_manager.py), with a
fake Coordinator that records them: no Ray, no averaging (the global step is replaced by
one that only advances the epoch)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from moshray.actors.replica.protocol import Phase
from moshray.actors.replica.step_manager import StepManager, Tally
from moshray.cluster.coordinator.progress import ProgressReply


class FakeCoordinator:
    """``report.remote`` records the report and answers at once with ``reply``."""

    def __init__(self) -> None:
        self.reports: list = []
        self.reply = ProgressReply(plan=None)
        self.report = SimpleNamespace(remote=self._report)

    def _report(self, report):
        self.reports.append(report)
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.reply)
        return future


def _manager(coordinator: FakeCoordinator, overlap: bool = False) -> StepManager:
    manager = StepManager("p0", coordinator, handle=None, node_id="n0", round_timeout_s=5.0)
    manager.state = SimpleNamespace(epoch=0, step_checksum=None, model=torch.nn.Linear(2, 2),
                                    feed=None, branch=0)
    manager.strategy = SimpleNamespace(overlap=overlap, numel=lambda model: 6)
    manager.protocol.to(Phase.SYNCING)  # (``start`` without its Coordinator calls)
    manager.protocol.to(Phase.TRAINING)
    steps: list[int] = []

    async def global_step(plan) -> None:  # the averaging is not under test here
        steps.append(plan.epoch)
        manager.state.epoch = plan.epoch
        manager.tally = Tally()

    manager.global_step = global_step
    manager.steps = steps
    return manager


def _run(coroutine):
    return asyncio.run(coroutine)


def test_a_replica_reports_its_count_until_a_plan_comes_and_again_right_after_the_step():
    async def scenario():
        coordinator = FakeCoordinator()
        manager = _manager(coordinator)
        for _ in range(2):  # no plan yet: the counts go to the Coordinator, at most one
            # routine report in flight (a reply is taken after the micro-batch's report)
            assert await manager.after_micro_batch(8, 1.0) is False
            for _ in range(3):
                await asyncio.sleep(0)  # the reply arrives
        # the second micro-batch's report waited for the first one's reply
        assert [(r.epoch, r.samples) for r in coordinator.reports] == [(0, 8)]
        manager.receive_plan(SimpleNamespace(epoch=1))  # pushed while the loop computes
        assert await manager.after_micro_batch(8, 1.0) is True
        # The micro-batch that takes the plan sends no routine report (its count is not
        # needed any more); the report right after the step says the new epoch.
        assert manager.steps == [1]
        assert [(r.epoch, r.samples) for r in coordinator.reports] == [(0, 8), (1, 0)]

    _run(scenario())


def test_what_a_skipped_report_would_carry_goes_with_the_report_after_the_step():
    async def scenario():
        coordinator = FakeCoordinator()
        manager = _manager(coordinator)
        manager._saw_rejections.append(("p9", "non_finite", 0, 4))
        manager._contributed = (0, 24)
        manager.receive_plan(SimpleNamespace(epoch=1))
        assert await manager.after_micro_batch(8, 1.0) is True
        [report] = coordinator.reports
        assert (report.epoch, report.samples) == (1, 0)
        assert report.saw_rejections == (("p9", "non_finite", 0, 4),)
        assert report.contributed == (0, 24)

    _run(scenario())


def test_a_stale_plan_or_an_overlapped_step_keeps_the_routine_report():
    async def scenario(plan_epoch: int, overlap: bool) -> list:
        coordinator = FakeCoordinator()
        manager = _manager(coordinator, overlap=overlap)
        if overlap:  # the overlapped path starts an averaging task; keep it out of the way
            manager._begin_overlapped = lambda plan: None
        manager.receive_plan(SimpleNamespace(epoch=plan_epoch))
        await manager.after_micro_batch(8, 1.0)
        return [(r.epoch, r.samples) for r in coordinator.reports]

    assert _run(scenario(plan_epoch=3, overlap=False)) == [(0, 8)]  # not the next step's
    assert _run(scenario(plan_epoch=1, overlap=True)) == [(0, 8)]


def test_a_report_carries_the_branch_of_the_state_it_holds():
    async def scenario():
        coordinator = FakeCoordinator()
        manager = _manager(coordinator)
        manager.state.branch = 2  # its last step was planned on the swarm's branch 2
        await manager.after_micro_batch(8, 1.0)
        assert [(r.epoch, r.branch) for r in coordinator.reports] == [(0, 2)]

    _run(scenario())
