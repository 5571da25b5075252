"""The overlapped ("streaming") DiLoCo step of ``LocalSGD`` (``actors/replica/strategies.py``),
pure (plain torch, no Ray): rounds taken by hand on two simulated replicas the way the step
manager takes them (``contribution``, local steps while the round travels, the collective's
weighted mean, ``apply``, the commit's digest, ``resume``), the non-overlapped step it
reduces to without progress in between, what a replaced state drops, the loop's end, and
the config lines."""

from __future__ import annotations

import pytest
import torch
from test_strategies import _bn_model, _mean, _micro_batches

from moshray.actors.replica.state import TrainState, checksum
from moshray.actors.replica.strategies import LocalSGD, OuterNesterov, make_strategy
from moshray.jobs.config import ConfigError, load_config, parse_set

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def _replica(overlap: bool):
    """(model, inner optimizer, strategy, state) as ``Session.prepare`` wires them."""
    model = _bn_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    strategy = LocalSGD(0.0, OuterNesterov(model, OUTER_LR, OUTER_MOMENTUM), overlap=overlap)
    state = TrainState(model, opt, None, None, {})
    state.strategy_state = strategy.outer_state
    state.shared_optimizers = strategy.shared_optimizers(opt)
    return model, opt, strategy, state


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _equal(xs, ys) -> bool:
    return all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True))


def test_two_replicas_share_the_anchor_and_keep_their_own_progress():
    replicas = [_replica(overlap=True) for _ in range(2)]
    weights = [16.0, 24.0]
    for epoch in range(1, 4):
        # the round's inner steps, on each replica's own data
        for i, (m, o, s, _) in enumerate(replicas):
            _micro_batches(m, o, s, shift=float(10 * epoch + 3 * i), n=2 + i)
        sent = [_params(m) for m, *_ in replicas]
        contributions = [s.contribution(m, 2 + i) for i, (m, _, s, _) in enumerate(replicas)]
        # round `epoch` travels while the next round's inner steps run
        for i, (m, o, s, _) in enumerate(replicas):
            _micro_batches(m, o, s, shift=float(10 * epoch + 3 * i + 1), n=1 + i)
        assert not _equal(_params(replicas[0][0]), sent[0])  # they moved on
        averaged = _mean(contributions, weights)  # the collective's weighted mean
        now = [_params(m) for m, *_ in replicas]
        for m, o, s, state in replicas:
            s.apply(m, o, [x.clone() for x in averaged], sum(weights))
            state.commit(epoch)  # the step manager's commit: the digest, before resume
            assert _equal(_params(m), s.outer_state.anchor)  # (at the new anchor)
        (a, oa, sa, ta), (b, ob, sb, tb) = replicas
        # what the step's digest covers is equal on both: anchor, buffers, outer state
        assert ta.step_checksum == tb.step_checksum
        assert checksum(a, ta.shared_optimizers) == checksum(b, tb.shared_optimizers)
        assert _equal(sa.outer_state.anchor, sb.outer_state.anchor)
        assert torch.equal(a[1].running_mean, b[1].running_mean)
        momentum = [[sx.outer_state.optimizer.state[x]["momentum_buffer"]
                     for x in sx.outer_state.anchor] for sx in (sa, sb)]
        assert _equal(*momentum)
        for (m, _, s, _), p_now, p_sent in zip(replicas, now, sent):
            s.resume(m)  # p = new anchor + (p_now - p_sent)
            expected = [x + (y - z) for x, y, z in zip(s.outer_state.anchor, p_now, p_sent)]
            assert _equal(_params(m), expected)
        assert not _equal(_params(a), _params(b))  # each replica's own progress, kept
    # The loop's end: every replica holds the last anchor and the step's buffers.
    _micro_batches(a, oa, sa, shift=99.0, n=1)
    for m, _, s, state in replicas:
        s.settle(m)
    assert _equal(_params(a), _params(b)) and _equal(_params(a), sa.outer_state.anchor)
    assert ta.full_checksum() == tb.full_checksum()


def test_without_progress_in_between_it_is_the_non_overlapped_step_bitwise():
    pairs = [[_replica(overlap=over) for _ in range(2)] for over in (False, True)]
    for epoch in range(1, 4):  # rounds with the outer momentum in play
        for replicas in pairs:
            for i, (m, o, s, _) in enumerate(replicas):
                _micro_batches(m, o, s, shift=float(10 * epoch + 3 * i), n=2)
            averaged = _mean([s.contribution(m, 2) for m, _, s, _ in replicas], [8.0, 8.0])
            for m, o, s, state in replicas:
                s.apply(m, o, [x.clone() for x in averaged], 16.0)
                state.commit(epoch)
                s.resume(m)
        (plain, _, sp, tp), (over, _, so, to) = pairs[0][0], pairs[1][0]
        assert _equal(_params(plain), _params(over))
        assert _equal(sp.outer_state.anchor, so.outer_state.anchor)
        assert tp.step_checksum == to.step_checksum
        assert tp.full_checksum() == to.full_checksum()


def test_the_contribution_is_a_copy_the_loop_cannot_move():
    model, opt, strategy, _ = _replica(overlap=True)
    _micro_batches(model, opt, strategy, 1.0, 2)
    tensors = strategy.contribution(model, 2)
    kept = [t.clone() for t in tensors]
    _micro_batches(model, opt, strategy, 2.0, 2)  # parameters and BatchNorm buffers move
    assert _equal(tensors, kept)


def test_a_replaced_state_drops_the_round_in_flight():
    model, opt, strategy, _ = _replica(overlap=True)
    _micro_batches(model, opt, strategy, 1.0, 2)
    averaged = strategy.contribution(model, 2)
    _micro_batches(model, opt, strategy, 2.0, 2)
    strategy.discard_pending()  # a donor's state was loaded
    strategy.apply(model, opt, [a.clone() for a in averaged], 16.0)
    strategy.resume(model)  # nothing to put back: no progress is carried over
    assert _equal(_params(model), strategy.outer_state.anchor)
    assert strategy.sent is None and strategy.progress is None


def test_overlap_needs_the_outer_step():
    model = _bn_model()
    with pytest.raises(ValueError, match="needs the outer optimizer"):
        LocalSGD(0.0, None, overlap=True)
    non_overlapped = LocalSGD(0.0, OuterNesterov(model, OUTER_LR, OUTER_MOMENTUM))
    before = _params(model)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    non_overlapped.settle(model)  # (without overlap too the loop's end goes to the anchor)
    assert _equal(_params(model), before)


DILOCO = ["training.mode=local_sgd", "training.outer_optimizer=nesterov"]


def test_the_config_turns_it_on_only_with_the_outer_step():
    on = load_config(None, parse_set([*DILOCO, "training.overlap=on"])).training
    assert on.overlaps(cuda=False) and on.overlaps(cuda=True)
    strategy = make_strategy(on, _bn_model(), "cpu")
    assert isinstance(strategy, LocalSGD) and strategy.overlap
    # auto leaves the outer step synchronous, on a GPU too; collaborative's stays as it was
    auto = load_config(None, parse_set(DILOCO)).training
    assert auto.overlap == "auto" and not auto.overlaps(cuda=True)
    assert not make_strategy(auto, _bn_model(), "cpu").overlap
    assert load_config(None, {}).training.overlaps(cuda=True)
    off = load_config(None, parse_set([*DILOCO, "training.overlap=off"])).training
    assert not off.overlaps(cuda=False)
    with pytest.raises(ConfigError) as refused:
        load_config(None, parse_set(["training.mode=local_sgd", "training.overlap=on"]))
    line = str(refused.value)
    assert line.startswith("training.overlap: overlaps local_sgd steps only with the outer "
                           "step") and "\n" not in line
    assert 'training.outer_optimizer = "nesterov"' in line
    with pytest.raises(ConfigError, match='training.overlap: overlaps collaborative or '
                                          'local_sgd steps only'):
        load_config(None, parse_set(["training.mode=auto", "training.overlap=on"]))


def test_the_loops_end_leaves_a_non_overlapped_diloco_replica_at_the_anchor():
    """Without overlap too, the loop's end drops the local steps no round averaged: the
    model a run returns or saves (``save_model``) is the one every replica of the last
    step holds. Plain local SGD (no outer step, no anchor) keeps its own parameters."""
    replicas = [_replica(overlap=False) for _ in range(2)]
    for i, (m, o, s, _) in enumerate(replicas):
        _micro_batches(m, o, s, shift=float(3 * i), n=2)
    averaged = _mean([s.contribution(m, 2) for m, _, s, _ in replicas], [8.0, 8.0])
    for m, o, s, state in replicas:
        s.apply(m, o, [x.clone() for x in averaged], 16.0)
        state.commit(1)
    for i, (m, o, s, _) in enumerate(replicas):  # local steps after the last round
        _micro_batches(m, o, s, shift=float(50 + i), n=1)
    (a, _, sa, ta), (b, _, sb, tb) = replicas
    assert not _equal(_params(a), _params(b))
    for m, _, s, _ in replicas:
        s.settle(m)
    assert _equal(_params(a), _params(b)) and _equal(_params(a), sa.outer_state.anchor)
    model = _bn_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    plain = LocalSGD(0.0)
    _micro_batches(model, opt, plain, shift=1.0, n=1)
    before = _params(model)
    plain.settle(model)
    assert _equal(_params(model), before)
