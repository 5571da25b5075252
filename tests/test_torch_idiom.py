"""The user's loop in torch's idiom, without a cluster: the collaborative
strategy sums each micro-batch's gradient as the loop left it (so the user's clipping acts
per micro-batch), the wrapper's one-line errors (a second backward pass through the old
``opt.step(loss)``, a missing ``loss.backward()``, a closure), nothing clipped or rescaled
by default, and a step whose averaging errored (``AveragingError``) skipped, counted and
survived. The same on a real cluster, with fp16 ``GradScaler`` and bf16 autocast:
``tests/test_report.py`` (``idiom_scenarios.py``)."""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

import pytest
import torch

from moshray.actors.errors import UserError
from moshray.actors.replica.session import ElasticOptimizer
from moshray.actors.replica.state import TrainState
from moshray.actors.replica.step_manager import StepManager
from moshray.actors.replica.strategies import Collaborative
from moshray.cluster.collective.averager import AveragingError
from moshray.cluster.messages import RoundPlan
from moshray.jobs.config import TrainConfig


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _loss(model, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 4, generator=g) * scale
    return torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True) * scale)


def test_defaults_clip_nothing_and_rescale_no_rate():
    training = TrainConfig().training
    assert training.grad_clip == 0.0 and training.lr_scaling == "none"
    strategy = Collaborative.from_config(training, _model())
    assert strategy.grad_clip == 0.0 and strategy.lr_scaling == "none"


def test_user_clipping_acts_on_each_micro_batch_and_the_step_averages_them():
    model = _model()
    strategy = Collaborative(grad_clip=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clipped = []
    for seed, scale in ((1, 1.0), (2, 30.0)):  # the second micro-batch's gradient is huge
        _loss(model, seed, scale).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the user's clip
        assert norm > 0
        clipped.append([p.grad.clone() for p in model.parameters()])
        strategy.after_backward(model, opt)
        assert all(p.grad is None for p in model.parameters())  # taken into the step's sum
    mean = strategy.take_gradients(model, 2)
    for i, g in enumerate(mean):
        assert torch.allclose(g, (clipped[0][i] + clipped[1][i]) / 2)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in mean]))
    assert total <= 1.0 + 1e-5  # a mean of gradients of norm <= 1
    assert strategy.accum is None  # the next step starts a new sum


def test_a_step_skipped_by_the_scaler_leaves_nothing_in_the_sum():
    """GradScaler found an inf and did not call opt.step(): the loop's zero_grad clears it."""
    model = _model()
    strategy = Collaborative(grad_clip=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = ElasticOptimizer(SimpleNamespace(), opt)
    _loss(model, 1).backward()
    for p in model.parameters():
        p.grad.fill_(float("inf"))
    wrapped.zero_grad()  # (no step: the scaler skipped it)
    assert all(p.grad is None for p in model.parameters())
    _loss(model, 2).backward()
    strategy.after_backward(model, opt)
    assert all(torch.isfinite(g).all() for g in strategy.take_gradients(model, 1))


def _session(model) -> SimpleNamespace:
    """What ``ElasticOptimizer.step`` reads before it hands anything on (it raises there)."""
    return SimpleNamespace(state=SimpleNamespace(model=model))


def test_the_old_step_loss_after_a_backward_is_a_one_line_error():
    model = _model()
    opt = ElasticOptimizer(_session(model), torch.optim.SGD(model.parameters(), lr=0.1))
    loss = _loss(model, 1)
    loss.backward()
    with pytest.raises(UserError) as err:
        opt.step(loss)  # would backpropagate a second time
    assert str(err.value) == ("optimizer: loss.backward() was called and opt.step(loss) "
                              "would backpropagate again: write loss.backward(); "
                              "opt.step(); opt.zero_grad()")


def test_step_without_a_backward_and_a_closure_are_one_line_errors():
    model = _model()
    opt = ElasticOptimizer(_session(model), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(UserError, match=r"^optimizer: opt.step\(\) found no gradients: call "
                                        r"loss.backward\(\) before each opt.step\(\)$"):
        opt.step()
    with pytest.raises(UserError, match=r"^loss: opt.step\(closure\) is not supported"):
        opt.step(lambda: _loss(model, 1))
    with pytest.raises(UserError, match=r"^loss: must be a scalar"):
        opt.step(model(torch.zeros(3, 4)))
    assert "\n" not in str(err_of(lambda: opt.step(3.0)))


def err_of(fn) -> Exception:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return exc
    raise AssertionError("no error")


def test_the_wrapper_is_what_grad_scaler_expects():
    """``scaler.unscale_(opt)`` and ``scaler.step(opt)`` read ``param_groups`` and call
    ``step()`` with no argument."""
    assert "param_groups" in dir(ElasticOptimizer)
    params = inspect.signature(ElasticOptimizer.step).parameters
    assert all(p.default is None for name, p in params.items() if name != "self")


def _stepping(global_step: int = 0):
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    session = SimpleNamespace(global_step=global_step)
    return session, inner, ElasticOptimizer(session, inner)


def test_the_wrapper_is_a_torch_optimizer_over_the_wrapped_ones_state():
    session, inner, opt = _stepping()
    assert isinstance(opt, torch.optim.Optimizer) and opt.optimizer is inner
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    assert opt.defaults is inner.defaults and opt.state_dict() == inner.state_dict()
    with pytest.raises(UserError, match="add_param_group after prepare"):
        opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})


def test_a_scheduler_built_on_it_steps_once_per_global_step():
    """StepLR on the optimizer prepare returns, stepped after every ``opt.step()`` without
    checking its value (3 micro-batches per global step): once per global step."""
    session, inner, opt = _stepping()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    opt._opt_called = True  # (as after the loop's first opt.step())
    lrs = []
    for micro in range(12):
        if micro % 3 == 2:
            session.global_step += 1  # this opt.step() took a global step
        sched.step()
        lrs.append(inner.param_groups[0]["lr"])
    assert lrs == [1, 1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.25]
    assert sched.last_epoch == 4 == session.global_step
    # a rollback to the checkpoint of step 1 (its learning rate came back with its state)
    session.global_step, inner.param_groups[0]["lr"] = 1, 1.0
    sched.step()
    assert inner.param_groups[0]["lr"] == 1.0  # nothing new since the state it holds
    session.global_step = 2
    sched.step()
    assert inner.param_groups[0]["lr"] == 0.5 and sched.last_epoch == 2


@pytest.mark.parametrize("kind", ["step", "lambda"])
def test_a_joiners_scheduler_continues_from_the_step_it_joined_at(kind):
    """A replica joining at global step 7 holds the swarm's learning rate (it came with the
    optimizer's state); the scheduler it builds after prepare keeps it and steps on from 7,
    to the learning rate of a replica that ran from the start."""
    def build(opt):
        if kind == "step":
            return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (1 + k))

    session, inner, opt = _stepping()
    first = build(opt)
    opt._opt_called = True
    for _ in range(8):
        session.global_step += 1
        first.step()
    expected = inner.param_groups[0]["lr"]
    joiner_session, joiner_inner, joiner = _stepping(global_step=7)
    donor = {**inner.state_dict()}
    joiner_inner.load_state_dict(donor)  # (the optimizer's state as of step 8 ...)
    joiner_inner.param_groups[0]["lr"] = ({"step": 0.125, "lambda": 1 / 8})[kind]  # (... of 7)
    sched = build(joiner)
    assert joiner_inner.param_groups[0]["lr"] == ({"step": 0.125, "lambda": 1 / 8})[kind]
    assert sched.last_epoch == 7
    joiner._opt_called = True
    joiner_session.global_step = 8
    sched.step()
    assert joiner_inner.param_groups[0]["lr"] == pytest.approx(expected)


def test_session_epoch_is_global_step_under_its_old_name(caplog):
    from moshray.actors.replica import session as session_module
    from moshray.actors.replica.session import Session

    session = Session("p0", TrainConfig(), torch.device("cpu"), None, None, None, None)
    session.state = SimpleNamespace(epoch=3)
    assert session.global_step == 3
    session_module._EPOCH_WARNED.clear()
    with pytest.warns(DeprecationWarning, match="renamed session.global_step"):
        assert session.epoch == 3
    # a scheduler built on the raw optimizer before prepare: one line says so
    model = _model()
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(raw, 1)
    session_module.warn_early_scheduler(raw)
    assert "before session.prepare" in caplog.text


class _ErroringCollaborative(Collaborative):
    """Collaborative steps whose averaging errors (a fault wrapper around the real one)."""

    @staticmethod
    async def average(averager, tensors, plan, samples, timeout_s):
        raise AveragingError(plan.epoch, "round 0: the weighted mean is not finite")


class _Recorder:
    """A Coordinator's ``record.remote``: keeps what the replica sent."""

    def __init__(self):
        self.batches = []
        self.record = SimpleNamespace(remote=self.batches.append)


def test_an_errored_averaging_is_skipped_counted_and_training_goes_on():
    async def run() -> tuple[StepManager, list, list]:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        strategy = _ErroringCollaborative(grad_clip=0.0)
        coordinator = _Recorder()
        manager = StepManager("p0", coordinator, None, "node", round_timeout_s=1.0)
        manager.state = TrainState(model, opt, None, None, TrainConfig().to_dict())
        manager.strategy = strategy
        from moshray.actors.replica.protocol import Phase

        manager.protocol.to(Phase.SYNCING)
        manager.protocol.to(Phase.TRAINING)
        before = [p.detach().clone() for p in model.parameters()]
        _loss(model, 1).backward()
        strategy.after_backward(model, opt)
        manager.tally.add(16)
        manager.note_reported((("loss", 0.5),), 0)
        plan = RoundPlan(1, None, (), ())
        await manager.global_step(plan)
        after = [p.detach().clone() for p in model.parameters()]
        return manager, before, after

    manager, before, after = asyncio.run(run())
    assert manager.errored_steps == 1
    assert manager.state.epoch == 1  # committed, with nothing applied
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert manager.phase.value == "training"
    assert manager.tally.samples == 0 and manager.strategy.accum is None
