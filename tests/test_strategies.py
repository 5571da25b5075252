"""The step strategies (``actors/replica/strategies.py``): the collaborative step's
learning-rate rule (``lr_scale``, pure) and one optimizer step through
``Collaborative.finish_step``; the whole state after a step (parameters, buffers, the
shared optimizer state) equal on two replicas and covered by the digests; the registry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moshray.actors.replica.state import TrainState, checksum, step_digest
from moshray.actors.replica.strategies import (
    STRATEGIES,
    Collaborative,
    LocalSGD,
    OuterNesterov,
    Strategy,
    averaged_buffers,
    lr_scale,
    make_strategy,
    register,
    scaled_lr,
    strategy_names,
)


@pytest.mark.parametrize("samples,target,rule,expected", [
    (32, 32, "sqrt", 1.0),
    (72, 32, "sqrt", 1.5),  # 2.25x the target batch: 1.5x the rate
    (8, 32, "sqrt", 0.5),
    (1000, 32, "sqrt", 2.0),  # clipped: a step after a stall moves at most twice as far
    (1, 32, "sqrt", 0.25),
    (0, 32, "sqrt", 1.0),  # nothing averaged: the rate is left alone
    (72, 32, "none", 1.0),
])
def test_lr_scale_is_the_square_root_rule_within_its_range(samples, target, rule, expected):
    assert lr_scale(samples, target, rule) == pytest.approx(expected)


def test_scaled_lr_restores_the_rates_even_when_the_step_fails():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(RuntimeError):
        with scaled_lr(opt, 1.5):
            assert opt.param_groups[0]["lr"] == pytest.approx(0.15)
            raise RuntimeError("boom")
    assert opt.param_groups[0]["lr"] == 0.1


def test_a_step_that_averaged_more_samples_moves_further_and_keeps_the_rate():
    def step(rule: str, samples: float) -> torch.Tensor:
        model = torch.nn.Linear(3, 1, bias=False)
        torch.nn.init.ones_(model.weight)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        strategy = Collaborative(grad_clip=0.0, lr_scaling=rule, target_batch_size=32)
        strategy.finish_step(model, opt, [torch.full((1, 3), 2.0)], samples)
        assert opt.param_groups[0]["lr"] == 0.1  # the user's rate (and scheduler) untouched
        return model.weight.detach().clone()

    plain = step("none", 128)
    scaled = step("sqrt", 128)  # 4x the target: twice the rate
    assert torch.allclose(plain, torch.full((1, 3), 1.0 - 0.1 * 2.0))
    assert torch.allclose(scaled, torch.full((1, 3), 1.0 - 0.2 * 2.0))


# -- the whole state: parameters, buffers, optimizer state ---------------

def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                               torch.nn.Linear(4, 1))


def _micro_batches(model, opt, strategy, shift: float, n: int) -> None:
    g = torch.Generator().manual_seed(int(shift))
    for _ in range(n):
        x = torch.randn(8, 3, generator=g) * (1 + shift) + shift
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        strategy.after_backward(model, opt)


def _mean(contributions: list[list[torch.Tensor]], weights: list[float]) -> list:
    """The weighted mean the collective computes, element by element."""
    total = sum(weights)
    return [sum(c[i].float() * w for c, w in zip(contributions, weights)) / total
            for i in range(len(contributions[0]))]


def _two_replicas_step(strategy_of, optimizer_of):
    models = [_bn_model(), _bn_model()]
    opts = [optimizer_of(m) for m in models]
    strategies = [strategy_of(m) for m in models]
    for i, (m, o, s) in enumerate(zip(models, opts, strategies)):
        _micro_batches(m, o, s, shift=float(i * 3), n=2 + i)  # different data, counts
    assert not torch.equal(models[0][1].running_mean, models[1][1].running_mean)
    contributions = [s.contribution(m, 2 + i)
                     for i, (m, s) in enumerate(zip(models, strategies))]
    averaged = _mean(contributions, [16.0, 24.0])
    for m, o, s in zip(models, opts, strategies):
        s.apply(m, o, [a.clone() for a in averaged], 40.0)
    return models, opts, strategies


@pytest.mark.parametrize("mode", ["collaborative", "local_sgd"])
def test_a_step_leaves_equal_parameters_buffers_and_shared_optimizer_state(mode):
    if mode == "collaborative":
        strategy_of = lambda m: Collaborative(grad_clip=1.0)  # noqa: E731
    else:
        strategy_of = lambda m: LocalSGD(1.0, OuterNesterov(m, 0.7, 0.9))  # noqa: E731
    models, opts, strategies = _two_replicas_step(
        strategy_of, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))
    shared = [s.shared_optimizers(o) for s, o in zip(strategies, opts)]
    a, b = models
    assert torch.equal(a[1].running_mean, b[1].running_mean)
    assert torch.equal(a[1].running_var, b[1].running_var)
    assert checksum(a, shared[0]) == checksum(b, shared[1])
    assert step_digest(a, 7, shared[0]) == step_digest(b, 7, shared[1])
    # The integer counter counts each replica's own forward passes: not compared.
    assert a[1].num_batches_tracked != b[1].num_batches_tracked
    # A buffer perturbed on one replica: both digests see it.
    with torch.no_grad():
        b[1].running_var[0] += 1e-3
    assert checksum(a, shared[0]) != checksum(b, shared[1])
    assert step_digest(a, 7, shared[0]) != step_digest(b, 7, shared[1])


def test_the_checksum_covers_the_shared_optimizer_state():
    models, opts, strategies = _two_replicas_step(
        lambda m: Collaborative(grad_clip=1.0),
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))
    (a, b), (oa, ob) = models, opts
    assert checksum(a, (oa,)) == checksum(b, (ob,))
    with torch.no_grad():
        ob.state[next(b.parameters())]["exp_avg_sq"].mul_(1.5)
    assert checksum(a, (oa,)) != checksum(b, (ob,))
    assert step_digest(a, 3, (oa,)) != step_digest(b, 3, (ob,))
    assert checksum(a) == checksum(b)  # (the parameters and buffers alone still agree)


def test_a_snapshot_and_the_loops_end_carry_the_buffers_as_of_the_last_step():
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = Collaborative(grad_clip=0.0)
    state = TrainState(model, opt, None, None, {})
    state.keep_step_buffers()
    _micro_batches(model, opt, strategy, 1.0, 2)
    strategy.apply(model, opt, strategy.contribution(model, 2), 16.0)
    state.commit(1)
    at_step = [b.clone() for b in averaged_buffers(model)]
    digest_at_step = state.full_checksum()
    _micro_batches(model, opt, strategy, 5.0, 3)  # forward passes after the last step
    assert not torch.equal(averaged_buffers(model)[0], at_step[0])
    # A joiner gets the step's buffers, so its state is the step's to the last bit.
    joiner_model = _bn_model()
    joiner = TrainState(joiner_model, torch.optim.SGD(joiner_model.parameters(), lr=0.1),
                        None, None, {})
    joiner.keep_step_buffers()
    joiner.load(state.snapshot(), from_donor=True)
    assert joiner.full_checksum() == digest_at_step and joiner.epoch == 1
    state.restore_step_buffers()  # the loop's end
    assert all(torch.equal(x, y) for x, y in zip(averaged_buffers(model), at_step))
    assert state.full_checksum() == digest_at_step


def test_the_branch_of_the_last_step_travels_with_the_state():
    """A step's branch (its plan's) is the state's until a step of another branch; a donor's
    copy and a checkpoint carry it; a state saved without one is of the first branch."""
    model = torch.nn.Linear(2, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), None, None, {})
    state.commit(3, branch=2)
    state.commit(4)  # (a caller that does not tell: unchanged)
    assert (state.epoch, state.branch) == (4, 2)
    other = torch.nn.Linear(2, 2)
    joiner = TrainState(other, torch.optim.SGD(other.parameters(), lr=0.1), None, None, {})
    joiner.load(state.snapshot(), from_donor=False)
    assert (joiner.epoch, joiner.branch) == (4, 2)
    older = {k: v for k, v in state.snapshot().items() if k != "branch"}
    joiner.load(older, from_donor=False)
    assert joiner.branch == 0


def test_a_new_strategy_is_one_registered_class():
    from typing import get_args

    from moshray.jobs.config import ConfigError, TrainConfig
    from moshray.jobs.config.sections import Mode

    assert strategy_names()[:2] == ("collaborative", "local_sgd")
    # the config reads the registry, plus "auto" (the job picks one: mode_choice.py)
    assert set(get_args(Mode)) == {*strategy_names(), "auto"}
    with pytest.raises(ConfigError, match="training.mode: must be one of 'collaborative'"):
        TrainConfig.from_dict({"training": {"mode": "sgd"}})

    class Frozen(Strategy):  # never averages anything it trains
        name = "frozen-test"

        @classmethod
        def from_config(cls, training, model, device=None):
            return cls()

        def after_backward(self, model, optimizer):
            optimizer.zero_grad()

        def zero_grad_allowed(self):
            return True

        def contribution(self, model, micro):
            return []

        def apply(self, model, optimizer, averaged, total_weight):
            pass

    try:
        register(Frozen)
        training = SimpleNamespace(mode="frozen-test")
        assert isinstance(make_strategy(training, _bn_model()), Frozen)
        with pytest.raises(ValueError, match="registered twice"):
            register(type("Other", (Frozen,), {}))
    finally:
        STRATEGIES.pop("frozen-test", None)
    with pytest.raises(ValueError, match="use one of collaborative, local_sgd"):
        make_strategy(training, _bn_model())
