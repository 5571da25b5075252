"""The collaborative step's learning-rate rule (``strategies.lr_scale``): pure decisions,
and one optimizer step through ``Collaborative.finish_step``."""

from __future__ import annotations

import pytest
import torch

from moshray.actors.replica.strategies import Collaborative, lr_scale, scaled_lr


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
