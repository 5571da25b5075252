"""``training.mode = "auto"``'s outer step: pure tests of ``mode_choice`` (no Ray)."""

from __future__ import annotations

import pytest

from moshray.actors.replica.mode_choice import (
    DILOCO_OUTER, GENTLE_BELOW_STEPS, GENTLE_OUTER, choose_mode, outer_step, resolve_training)
from moshray.jobs.config import TrainConfig


def training(**over):
    return TrainConfig.from_dict({"training": {"mode": "auto", **over}}).training


def test_the_outer_step_is_gentler_for_few_local_steps() -> None:
    assert outer_step(16) == GENTLE_OUTER == (0.4, 0.7)  # the sweep's best at H = 16
    assert outer_step(GENTLE_BELOW_STEPS - 1) == GENTLE_OUTER
    assert outer_step(GENTLE_BELOW_STEPS) == DILOCO_OUTER == (0.7, 0.9)
    assert outer_step(500) == DILOCO_OUTER  # DiLoCo's own H


def test_a_local_sgd_choice_carries_its_outer_step() -> None:
    slow = choose_mode(2.5e9, 2e9, 1.0)  # the real case: H = 64
    assert (slow.local_steps, slow.outer_lr, slow.outer_momentum) == (64, 0.4, 0.7)
    assert "lr 0.4 momentum 0.7" in slow.line
    slower = choose_mode(1e6, 2e9, 0.01)  # H = 500
    assert (slower.outer_lr, slower.outer_momentum) == DILOCO_OUTER
    fast = choose_mode(10e9, 2e5, 0.05)
    assert fast.mode == "collaborative" and fast.outer_lr is None and fast.outer_momentum is None


def test_resolving_sets_the_outer_step_only_over_the_defaults() -> None:
    slow = choose_mode(2.5e9, 2e9, 1.0)
    got = resolve_training(training(), slow)
    assert (got.mode, got.local_steps, got.outer_optimizer) == ("local_sgd", 64, "nesterov")
    assert (got.outer_lr, got.outer_momentum) == (0.4, 0.7)
    own = resolve_training(training(outer_lr=0.5), slow)  # the user's own outer step stays
    assert (own.outer_lr, own.outer_momentum) == (0.5, 0.9)
    own = resolve_training(training(outer_momentum=0.8), slow)
    assert (own.outer_lr, own.outer_momentum) == (0.7, 0.8)


def test_resolving_collaborative_leaves_the_outer_step() -> None:
    got = resolve_training(training(), choose_mode(10e9, 2e5, 0.05))
    assert got.mode == "collaborative"
    assert (got.outer_lr, got.outer_momentum, got.outer_optimizer) == (0.7, 0.9, "none")


@pytest.mark.parametrize("bad", [0, -1, float("nan")])
def test_choose_mode_refuses_bad_input(bad) -> None:
    with pytest.raises(ValueError):
        choose_mode(bad, 1.0, 1.0)
