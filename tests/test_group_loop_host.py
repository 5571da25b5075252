"""The rank side of a loop-driven group without Ray (actors/replica/group_loop.py): the
compute thread that lends itself to the user's loop (``ComputeQueue``), and ``LoopHost``
carrying the driver's commands into a real loop on a stand-in rank (one process, world 1):
what ``batches()`` yields, what ``opt.step()`` answers, and the misuse it refuses."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from moshray.actors.errors import UserError
from moshray.actors.replica.group_averaging import BatchPart, GradReport, LocalReport
from moshray.actors.replica.group_loop import ComputeQueue, LoopHost, LoopStopped, LoopTask
from moshray.actors.replica.group_spec import GroupConfig, GroupError

WAIT = 10.0


def test_a_parked_call_runs_the_queued_calls_in_its_own_thread_in_order():
    q = ComputeQueue("test")
    seen, release = [], threading.Event()

    def long_call():
        seen.append(("long", threading.current_thread().name))
        q.serve_until(release.is_set, WAIT, "parked")
        return "long done"

    first = q.submit(long_call)
    others = [q.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
              for i in range(3)]
    for f in others:
        f.result(WAIT)  # served while the long call is parked
    assert not first.done()
    release.set()
    assert first.result(WAIT) == "long done"
    assert seen == [("long", "test"), (0, "test"), (1, "test"), (2, "test")]
    q.shutdown()


def test_a_park_is_bounded_and_ends_at_shutdown():
    q = ComputeQueue("test")
    timed = q.submit(lambda: q.serve_until(lambda: False, 0.2, "rank 0: waiting"))
    with pytest.raises(GroupError, match="rank 0: waiting: no command from the driver"):
        timed.result(WAIT)
    stopped = q.submit(lambda: q.serve_until(lambda: False, WAIT, "parked"))
    q.shutdown()
    with pytest.raises(LoopStopped):
        stopped.result(WAIT)
    with pytest.raises(RuntimeError, match="outside the compute thread"):
        q.serve_until(lambda: True, 1.0, "here")


def batch(step):
    x = torch.arange(8 * 2, dtype=torch.float32).reshape(8, 2) + step
    return x, x.sum(dim=1, keepdim=True)


def _rank(timeout_s: float = 5.0):
    """What LoopHost uses of a GroupRank: world 1, CPU, the step and model it holds."""
    return SimpleNamespace(rank=0, settings=GroupConfig(world_size=1, timeout_s=timeout_s),
                           device=torch.device("cpu"), _compute=ComputeQueue("rank0"),
                           model=None, module=None, opt=None, optimizer_name="", step=0,
                           grads_of=None, use_parallel=lambda parallel: None,
                           round_start=lambda: None)


def _prepare_plain(session, model, opt):
    """prepare() without torch.distributed (world 1): what GroupSession.prepare holds."""
    rank = session._host.rank
    rank.model, rank.module, rank.opt = model, model, opt
    from moshray.actors.replica.group_loop import GroupOptimizer

    return GroupOptimizer(session._host)


def test_the_loop_takes_the_drivers_batches_and_waits_for_the_vote():
    rank, rows = _rank(), []

    def loop(session):
        model = torch.nn.Linear(2, 1)
        opt = _prepare_plain(session, model, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in session.batches():
            rows.append(int(x.shape[0]))
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            session.report({"loss": loss})
            rows.append(opt.step())

    host = LoopHost(rank, LoopTask(loop, batch))
    # a collaborative step: the gradients of step 0 on half of the batch (part 1 of 2)
    report = host.command("grads", 0, 1, BatchPart(1, 2)).result(WAIT)
    assert isinstance(report, GradReport) and (report.step, report.samples) == (0, 4)
    assert rank.grads_of == 0  # held for the averaging
    rank._compute.submit(lambda: (setattr(rank, "step", 1), host.voted(True))).result(WAIT)
    # a local SGD round of 2 steps: two batches, each a local optimizer step
    local = host.command("local", 1, 2, BatchPart(0, 1)).result(WAIT)
    assert isinstance(local, LocalReport) and (local.first, local.steps, local.samples) == \
        (1, 2, 16)
    assert rank.step == 3 and rows == [4, True, 8, True, 8, True]
    # a command for a step the rank does not hold fails, the loop goes on
    with pytest.raises(GroupError, match="asked for grads at step 7, holds step 3"):
        host.command("grads", 7, 1, BatchPart(0, 1)).result(WAIT)
    # the driver moves on without averaging: opt.step() answers False
    host.command("grads", 3, 1, BatchPart(0, 1)).result(WAIT)
    host.command("grads", 3, 1, BatchPart(0, 1))  # the step again, without the first's vote
    for _ in range(100):  # the second command's batch reached the loop (bounded)
        if rows[-2:] == [False, 8]:
            break
        threading.Event().wait(0.05)
    assert rows[-2:] == [False, 8]
    rank._compute.shutdown()
    host.finished.result(WAIT)
    assert host.ended == "rank 0: closed"


def test_a_loop_that_raises_fails_every_command_with_its_error():
    rank = _rank()

    def loop(session):
        raise ValueError("my bug")

    host = LoopHost(rank, LoopTask(loop, batch))
    with pytest.raises(GroupError, match="rank 0: the loop raised ValueError: my bug"):
        host.command("grads", 0, 1, BatchPart(0, 1)).result(WAIT)
    rank._compute.shutdown()


def test_misuse_is_refused_with_one_line():
    rank = _rank()

    def loop(session):
        model = torch.nn.Linear(2, 1)
        opt = _prepare_plain(session, model, torch.optim.SGD(model.parameters(), lr=0.1))
        opt.step()  # before any batch

    host = LoopHost(rank, LoopTask(loop, batch))
    with pytest.raises(GroupError, match="UserError: optimizer: opt.step\\(\\) outside a batch"):
        host.command("grads", 0, 1, BatchPart(0, 1)).result(WAIT)
    rank._compute.shutdown()
    with pytest.raises(UserError, match="batch: expected a function, got str"):
        LoopTask(loop, "not a function")
