"""DMoE without Ray: routing math, waiting rule, the autograd function against local experts."""

from __future__ import annotations

import concurrent.futures
import itertools
import pickle
import threading

import numpy as np
import pytest
import torch

from moshray.actors.moe import (
    ExpertHostCore,
    ExpertInputError,
    ExpertRejectReason,
    ExpertSetConfig,
    ExpertSpec,
    build_expert,
    layout_shards,
)
from moshray.jobs.examples.lm.model import ModelConfig, build_model
from moshray.actors.moe import (
    LocalExpertBackend,
    MoEConfig,
    RemoteMixtureOfExperts,
    beam_search,
    gate_scores,
    gather_with_deadlines,
    load_balancing_loss,
    masked_gate_weights,
    plan_calls,
)

SPEC = ExpertSpec(d_model=8, d_hidden=16, lr=1e-2)


def brute_force_topk(dim_scores, alive, k):
    grid = alive.shape
    rows = dim_scores[0].shape[0]
    best = []
    for r in range(rows):
        cands = []
        for coords in itertools.product(*(range(m) for m in grid)):
            if alive[coords]:
                s = sum(float(dim_scores[t][r, c]) for t, c in enumerate(coords))
                flat = int(np.ravel_multi_index(coords, grid))
                cands.append((s, flat))
        cands.sort(key=lambda c: -c[0])
        best.append([f for _, f in cands[:k]])
    return best


@pytest.mark.parametrize("grid", [(4, 4), (3, 5), (2, 3, 4), (7,)])
@pytest.mark.parametrize("dead_fraction", [0.0, 0.3, 0.8])
def test_beam_search_exact_with_wide_beam(grid, dead_fraction):
    g = torch.Generator().manual_seed(hash((grid, dead_fraction)) % 1000)
    rows, k = 6, 3
    dim_scores = [torch.randn(rows, m, generator=g) for m in grid]
    alive = torch.rand(grid, generator=g) >= dead_fraction
    flat, valid = beam_search(dim_scores, alive, k, beam_size=int(np.prod(grid)))
    expected = brute_force_topk(dim_scores, alive, k)
    for r in range(rows):
        got = flat[r][valid[r]].tolist()
        assert got == expected[r]
        assert valid[r].sum() == min(k, int(alive.sum()))


def test_beam_search_narrow_beam_returns_live_distinct_sorted():
    g = torch.Generator().manual_seed(3)
    grid, rows, k = (8, 8), 32, 4
    dim_scores = [torch.randn(rows, m, generator=g) for m in grid]
    alive = torch.rand(grid, generator=g) > 0.5
    flat, valid = beam_search(dim_scores, alive, k, beam_size=k)
    assert bool(valid.all())
    assert bool(alive.reshape(-1)[flat].all())
    for r in range(rows):
        assert len(set(flat[r].tolist())) == k
    scores = gate_scores(dim_scores, flat, grid)
    assert bool((scores[:, :-1] >= scores[:, 1:]).all())  # best first


def test_beam_search_no_live_expert():
    flat, valid = beam_search([torch.zeros(2, 3), torch.zeros(2, 3)],
                              torch.zeros(3, 3, dtype=torch.bool), k=2)
    assert flat.shape == (2, 2) and not bool(valid.any())


def test_masked_gate_weights():
    scores = torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0], [0.0, 5.0, 1.0]], requires_grad=True)
    mask = torch.tensor([[True, False, True], [False, False, False], [True, True, True]])
    w = masked_gate_weights(scores, mask)
    assert torch.allclose(w[0], torch.tensor([1.0, 0.0, float(np.e ** 2)]) / (1 + np.e ** 2))
    assert torch.equal(w[1], torch.zeros(3))
    assert torch.allclose(w[2].sum(), torch.tensor(1.0))
    w.sum().backward()
    assert torch.isfinite(scores.grad).all()


def test_load_balancing_loss_is_one_when_even_and_larger_when_skewed():
    grid = (4, 4)
    rows = 16
    even_logits = [torch.zeros(rows, 4), torch.zeros(rows, 4)]
    flat = torch.arange(16).view(16, 1)
    valid = torch.ones(16, 1, dtype=torch.bool)
    assert load_balancing_loss(even_logits, flat, valid, grid).item() == pytest.approx(1.0)
    skewed = [torch.tensor([[5.0, 0, 0, 0]]).repeat(rows, 1), torch.zeros(rows, 4)]
    skewed = [s.requires_grad_() for s in skewed]
    all_zero = torch.zeros(16, 1, dtype=torch.long)
    loss = load_balancing_loss(skewed, all_zero, valid, grid)
    assert loss.item() > 1.5
    loss.backward()
    assert skewed[0].grad[:, 0].mean() > 0  # pushes the favoured coordinate's score down


def test_plan_calls_groups_by_expert_then_host():
    flat = torch.tensor([[0, 1], [1, 3], [2, 0]])
    valid = torch.tensor([[True, True], [True, False], [True, True]])
    uids = ("a.0", "a.1", "a.2", "a.3")
    calls = plan_calls(flat, valid, uids, {"a.0": "h0", "a.1": "h0", "a.2": "h1", "a.3": "h1"})
    by_host = {c.host: c for c in calls}
    assert by_host["h0"].uids == ("a.0", "a.1")
    assert [p.tolist() for p in by_host["h0"].positions] == [[0, 5], [1, 2]]
    assert [r.tolist() for r in by_host["h0"].rows] == [[0, 2], [0, 1]]
    assert by_host["h1"].uids == ("a.2",)  # a.3 was only chosen in an invalid slot
    assert [r.tolist() for r in by_host["h1"].rows] == [[2]]


def _future_after(delay: float, value=None, exc: Exception | None = None):
    f: concurrent.futures.Future = concurrent.futures.Future()

    def finish():
        f.set_exception(exc) if exc else f.set_result(value)

    timer = threading.Timer(delay, finish)
    timer.daemon = True
    timer.start()
    return f


def test_gather_waits_for_k_min_then_bounded_extra():
    need = torch.tensor([1, 1])
    cover = [torch.tensor([1, 0]), torch.tensor([0, 1]), torch.tensor([1, 1])]
    futures = [_future_after(0.01, "a"), _future_after(0.15, "b"), _future_after(5.0, "late")]
    out = gather_with_deadlines(futures, cover, need, timeout_s=10.0, timeout_after_k_min_s=0.3)
    assert out.results == {0: "a", 1: "b"} and out.late == [2]
    assert out.seconds < 1.5  # 0.15 s to reach k_min + 0.3 s, far from the 5 s straggler


def test_gather_failure_does_not_count_and_hard_timeout_caps():
    need = torch.tensor([1])
    futures = [_future_after(0.01, exc=RuntimeError("dead")), concurrent.futures.Future()]
    out = gather_with_deadlines(futures, [torch.tensor([1]), torch.tensor([1])], need,
                                timeout_s=0.3, timeout_after_k_min_s=0.05)
    assert isinstance(out.failed[0], RuntimeError) and out.late == [1] and out.results == {}
    assert out.seconds < 1.0


# -- experts --------------------------------------------------------------------------------


def test_core_rejects_bad_inputs_with_typed_errors():
    core = ExpertHostCore(("a.0", "a.1"), SPEC)
    good = np.zeros((3, 8), np.float32)
    cases = {
        ExpertRejectReason.UNKNOWN_EXPERT: (("a.9",), (good,)),
        ExpertRejectReason.BAD_SHAPE: (("a.0",), (np.zeros((3, 7), np.float32),)),
        ExpertRejectReason.BAD_DTYPE: (("a.0",), (np.zeros((3, 8), np.float64),)),
        ExpertRejectReason.NON_FINITE: (("a.0",), (np.full((3, 8), np.nan, np.float32),)),
        ExpertRejectReason.BAD_REQUEST: (("a.0", "a.1"), (good,)),
    }
    for reason, (uids, inputs) in cases.items():
        with pytest.raises(ExpertInputError) as info:
            core.forward(uids, inputs)
        assert info.value.reason is reason
        clone = pickle.loads(pickle.dumps(info.value))
        assert (clone.reason, clone.uid, str(clone)) == (reason, info.value.uid, str(info.value))
    with pytest.raises(ExpertInputError, match="grads shape"):
        core.backward(("a.0",), (good,), (np.zeros((2, 8), np.float32),))
    assert core.forward(("a.0",), (good,))[0].shape == (3, 8)  # still serving


def test_core_state_round_trip_and_seeded_init():
    core = ExpertHostCore(("a.0", "a.1"), SPEC)
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    core.backward(("a.0",), (x,), (np.ones_like(x),))
    clone = ExpertHostCore(("a.0", "a.1"), SPEC, core.state())
    for uid in ("a.0", "a.1"):
        np.testing.assert_array_equal(clone.forward((uid,), (x,))[0], core.forward((uid,), (x,))[0])
    assert clone.updates == {"a.0": 1, "a.1": 0}
    fresh = ExpertHostCore(("a.1",), SPEC)  # same uid, same seed: identical weights
    np.testing.assert_array_equal(fresh.forward(("a.1",), (x,))[0],
                                  core.forward(("a.1",), (x,))[0])
    with pytest.raises(ValueError, match="serves"):
        ExpertHostCore(("a.0",), SPEC, core.state())


def test_layout_shards():
    config = ExpertSetConfig(layers=("m0", "m1"), grid=(2, 3), spec=SPEC, experts_per_host=4)
    shards = layout_shards(config)
    assert shards == {"m0-h0": ("m0.0.0", "m0.0.1", "m0.0.2", "m0.1.0"),
                      "m0-h1": ("m0.1.1", "m0.1.2"),
                      "m1-h0": ("m1.0.0", "m1.0.1", "m1.0.2", "m1.1.0"),
                      "m1-h1": ("m1.1.1", "m1.1.2")}
    with pytest.raises(ValueError, match="two shards"):
        ExpertSetConfig(shards=(("a", ("m0.0.0",)), ("b", ("m0.0.0",))))


# -- the layer against a dense reference -----------------------------------------------------


class FaultyBackend(LocalExpertBackend):
    """Local experts where some hosts fail (raise) or never answer."""

    def __init__(self, hosts, dead=(), hung=()):
        super().__init__(hosts)
        self.dead, self.hung = set(dead), set(hung)
        self.backward_hosts: list = []

    def _fault(self, host):
        if host in self.hung:
            return concurrent.futures.Future()  # never completes
        if host in self.dead:
            f = concurrent.futures.Future()
            f.set_exception(RuntimeError(f"{host} died"))
            return f
        return None

    def call_forward(self, host, uids, inputs):
        return self._fault(host) or super().call_forward(host, uids, inputs)

    def call_backward(self, host, uids, inputs, grads):
        self.backward_hosts.append(host)
        return self._fault(host) or super().call_backward(host, uids, inputs, grads)


def reference(moe: RemoteMixtureOfExperts, x, flat, mask, experts):
    """Dense autograd computation of the same mixture with ordinary torch modules."""
    cfg = moe.config
    weights = masked_gate_weights(gate_scores([g(x) for g in moe.gate], flat, cfg.grid), mask)
    outs = []
    for r in range(x.shape[0]):
        slots = []
        for s in range(cfg.k):
            if mask[r, s]:
                slots.append(experts[moe.uids[flat[r, s]]](x[r:r + 1])[0])
            else:
                slots.append(torch.zeros(cfg.d_model))
        outs.append(torch.stack(slots))
    return (weights.unsqueeze(-1) * torch.stack(outs)).sum(1)


def make_layer(backend, k=3, k_min=1, timeout_after=0.2):
    torch.manual_seed(0)
    cfg = MoEConfig("m0", (3, 4), d_model=8, k=k, k_min=k_min, forward_timeout_s=2.0,
                    backward_timeout_s=2.0, timeout_after_k_min_s=timeout_after)
    return RemoteMixtureOfExperts(cfg, backend)


@pytest.mark.parametrize("dead,hung", [((), ()), (("m0-h1",), ()), ((), ("m0-h0",))])
def test_layer_matches_dense_reference_forward_backward_and_update(dead, hung):
    config = ExpertSetConfig(layers=("m0",), grid=(3, 4), spec=SPEC, experts_per_host=4)
    backend = FaultyBackend(LocalExpertBackend.from_config(config).hosts, dead, hung)
    moe = make_layer(backend)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    target = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))

    y = moe(x)
    (y * target).sum().backward()
    flat, mask = moe.last_routing
    lost = {u for h in (*dead, *hung) for u in layout_shards(config)[h]}
    chosen = {moe.uids[int(f)] for f in flat[mask]}
    assert chosen and not (chosen & lost)
    assert moe.last_stats["failed"] == len(dead) and moe.last_stats["late"] == len(hung)
    assert set(backend.backward_hosts).isdisjoint(set(dead) | set(hung))

    ref_experts = {u: build_expert(SPEC, u) for u in moe.uids}
    xr = x.detach().clone().requires_grad_(True)
    gate_grads = [p.grad.clone() for p in moe.gate.parameters()]
    moe.zero_grad()
    y_ref = reference(moe, xr.view(-1, 8), flat, mask, ref_experts).view_as(y)
    (y_ref * target).sum().backward()
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-6, rtol=1e-5)
    for g, p in zip(gate_grads, moe.gate.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=1e-5)
    # Learning@home: each used expert took one AdamW step on its own gradient.
    served = {u: core for core in backend.hosts.values() for u in core.uids}
    for uid in chosen:
        ref = ref_experts[uid]
        torch.optim.AdamW(ref.parameters(), lr=SPEC.lr, weight_decay=0.0).step()
        for a, b in zip(served[uid].experts[uid].parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        assert served[uid].updates[uid] == 1


def test_layer_input_validation_and_empty_registry():
    moe = make_layer(LocalExpertBackend({}))
    with pytest.raises(ValueError, match="d_model=8"):
        moe(torch.zeros(3, 7))
    x = torch.randn(4, 8, requires_grad=True)
    y = moe(x)
    assert torch.equal(y, torch.zeros(4, 8))


@pytest.mark.parametrize("kwargs,field", [
    (dict(k=0), "k"), (dict(k=2, k_min=3), "k_min"), (dict(k=13), "k"),
    (dict(timeout_after_k_min_s=-1.0), "timeout_after_k_min_s")])
def test_moe_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"MoEConfig.{field}"):
        MoEConfig("m0", (3, 4), d_model=8, **kwargs)


# -- the default model with DMoE blocks ---------------------------------------------------------


TINY_MOE = ModelConfig(seq_len=16, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                       moe_layers=(1,), moe_grid=(2, 3), moe_k=2)


def test_model_with_local_experts_trains_and_adds_aux_loss():
    config = ExpertSetConfig(layers=("moe1",), grid=(2, 3), experts_per_host=3,
                             spec=ExpertSpec(d_model=16, d_hidden=32, lr=3e-3))
    backend = LocalExpertBackend.from_config(config)
    model = build_model(TINY_MOE, seed=0, experts=backend)
    assert type(model.blocks[1].mlp).__name__ == "RemoteMixtureOfExperts"
    assert all("moe1" not in n or "gate" in n for n, _ in model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.tensor(list(b"abcdefghijklmnopq" * 4)).view(4, 17)
    x, y = data[:, :-1], data[:, 1:]
    losses = []
    for _ in range(40):
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert sum(core.updates[u] for core in backend.hosts.values() for u in core.uids) > 0
    aux = model.blocks[1].mlp.aux_loss
    assert aux is not None and aux.item() > 0


def test_model_moe_config_validation():
    with pytest.raises(ValueError, match="expert backend"):
        build_model(TINY_MOE, seed=0)
    with pytest.raises(ValueError, match="moe_layers"):
        ModelConfig(n_layers=2, moe_layers=(2,))
    with pytest.raises(ValueError, match="moe_k"):
        ModelConfig(moe_grid=(2, 2), moe_k=5)
    assert ModelConfig(moe_layers=[0, 1], moe_grid=[2, 2]).moe_layers == (0, 1)
    assert ModelConfig.from_dict(TINY_MOE.to_dict()) == TINY_MOE


def test_call_outcomes_classify_every_expert_called():
    from moshray.actors.moe import ExpertInputError, ExpertRejectReason
    from moshray.actors.moe import CallOutcome, RayExpertBackend, call_outcomes

    bad = ExpertInputError(ExpertRejectReason.BAD_SHAPE, "moe0.0.0", "wrong shape")
    outcome = CallOutcome(results={0: []}, failed={1: bad, 2: RuntimeError("died")}, late=[3],
                          seconds=0.25)
    calls = call_outcomes(outcome, [2, 1, 1, 3])
    assert calls == [("ok", 0.25)] * 2 + [("rejected", 0.25), ("failed", 0.25)] + \
        [("timeout", 0.25)] * 3
    backend = RayExpertBackend(coordinator=None)  # no Ray call until a lookup
    backend.record_calls(calls)
    assert backend.take_calls() == calls and backend.take_calls() == []
