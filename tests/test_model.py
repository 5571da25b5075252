"""Tests for moshray.jobs.examples.lm.model: shapes, determinism, causality, learning."""

from __future__ import annotations

import pytest
import torch

from moshray.actors.replica.device import pick_device
from moshray.jobs.examples.lm.model import ByteTransformerLM, ModelConfig, build_model

TINY = ModelConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64)


def test_forward_shape_and_loss_is_scalar():
    model = build_model(TINY, seed=0)
    idx = torch.randint(0, 256, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, 256)
    loss = model.loss(idx, idx)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_shorter_sequences_are_accepted_and_longer_rejected():
    model = build_model(TINY, seed=0)
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 256)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_default_config_is_about_three_million_parameters():
    n = ByteTransformerLM(ModelConfig()).num_parameters()
    assert 2_500_000 <= n <= 4_000_000


def test_head_is_tied_to_token_embedding():
    model = build_model(TINY, seed=0)
    assert model.head.weight.data_ptr() == model.tok_emb.weight.data_ptr()


def test_same_seed_gives_bitwise_identical_parameters_and_leaves_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(TINY, seed=7)
    b = build_model(TINY, seed=7)
    c = build_model(TINY, seed=8)
    assert torch.equal(torch.rand(1), before)  # caller's RNG stream untouched
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_attention_is_causal():
    model = build_model(TINY, seed=0).eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)  # past unaffected by the future
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_loss_decreases_on_a_fixed_batch():
    model = build_model(TINY, seed=0)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (4, 17), generator=gen)
    x, y = data[:, :-1], data[:, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = model.loss(x, y).item()
    for _ in range(30):
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"d_model": 30, "n_heads": 4}, "d_model"),
        ({"n_layers": 0}, "n_layers"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"seq_len": 1.5}, "seq_len"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_invalid_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as info:
        ModelConfig(**kwargs)
    assert "\n" not in str(info.value)


def test_config_dict_round_trip():
    assert ModelConfig.from_dict(TINY.to_dict()) == TINY
    with pytest.raises(ValueError, match="unknown"):
        ModelConfig.from_dict({"d_modl": 3})


def test_pick_device_matches_cuda_availability():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device().type == expected
