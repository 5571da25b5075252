"""The default model: a small GPT-style byte-level causal language model.

Bytes are tokens (vocab 256), so no tokenizer and no downloaded vocabulary are
needed. The default configuration has about 3.3M parameters: small enough to
train on CPU in tests, big enough that averaging across replicas is visible in
the loss curve.

Layout follows nanoGPT: token + learned position embeddings, pre-LayerNorm
blocks (attention and MLP each behind a residual), a final LayerNorm and an
output head tied to the token embedding.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ByteTransformerLM",
    "ModelConfig",
    "build_model",
    "moe_layer_name",
]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a :class:`ByteTransformerLM`.

    Raises ``ValueError`` (one line, naming the field) from ``__post_init__``
    when a size is not a positive integer, ``d_model`` is not divisible by
    ``n_heads``, or ``dropout`` is outside ``[0, 1)``.
    """

    vocab_size: int = 256
    seq_len: int = 128  # longest sequence the position embedding covers
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 1024
    dropout: float = 0.0
    # Decentralized Mixture-of-Experts (off by default): the blocks listed in moe_layers get a
    # RemoteMixtureOfExperts (grid moe_grid, top moe_k experts of width d_ff) instead of
    # their MLP; moe_aux_weight scales the load-balancing term added by loss().
    moe_layers: tuple[int, ...] = ()
    moe_grid: tuple[int, ...] = (4, 4)
    moe_k: int = 4
    moe_aux_weight: float = 0.01

    def __post_init__(self) -> None:
        self._check_moe()
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, name)
            # bool is an int subclass; True as a layer count is a bug, not a 1.
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name}: must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"ModelConfig.d_model: must be divisible by n_heads ({self.n_heads}), "
                f"got {self.d_model}"
            )
        dropout = self.dropout
        if (
            not isinstance(dropout, (int, float))
            or isinstance(dropout, bool)
            or not 0.0 <= dropout < 1.0
        ):
            raise ValueError(f"ModelConfig.dropout: must be a number in [0, 1), got {dropout!r}")

    def _check_moe(self) -> None:
        # TOML and JSON give lists; keep the frozen config hashable with tuples.
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        object.__setattr__(self, "moe_grid", tuple(self.moe_grid))
        if len(set(self.moe_layers)) != len(self.moe_layers) or any(
            not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.n_layers
            for i in self.moe_layers
        ):
            raise ValueError(f"ModelConfig.moe_layers: must be distinct block indices in "
                             f"[0, n_layers={self.n_layers}), got {self.moe_layers!r}")
        if not self.moe_grid or any(
            not isinstance(m, int) or isinstance(m, bool) or m < 1 for m in self.moe_grid
        ):
            raise ValueError(f"ModelConfig.moe_grid: must be positive integers, "
                             f"got {self.moe_grid!r}")
        experts = math.prod(self.moe_grid)
        if not isinstance(self.moe_k, int) or isinstance(self.moe_k, bool) or \
                not 1 <= self.moe_k <= experts:
            raise ValueError(f"ModelConfig.moe_k: must be an integer in [1, {experts}] "
                             f"(the grid's expert count), got {self.moe_k!r}")
        w = self.moe_aux_weight
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0.0 <= w < math.inf:
            raise ValueError(f"ModelConfig.moe_aux_weight: must be a number >= 0, got {w!r}")

    def to_dict(self) -> dict[str, int | float]:
        """Plain dict of the fields (for checkpoints and for shipping to actors)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"ModelConfig: unknown keys {unknown}; valid keys: {', '.join(sorted(known))}"
            )
        return cls(**data)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on top of ``scaled_dot_product_attention``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape  # (batch, seq, d_model)
        head_dim = d_model // self.n_heads
        q, k, v = self.qkv(x).split(d_model, dim=2)  # each (batch, seq, d_model)
        # (batch, n_heads, seq, head_dim): the layout SDPA expects.
        q = q.view(batch, seq, self.n_heads, head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_heads, head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_heads, head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (batch, n_heads, seq, head_dim)
        y = y.transpose(1, 2).contiguous().view(batch, seq, d_model)  # (batch, seq, d_model)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: d_model -> d_ff -> d_model with GELU."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, config.d_ff)
        self.down = nn.Linear(config.d_ff, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (batch, seq, d_model) -> (batch, seq, d_ff) -> (batch, seq, d_model)
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))  # (batch, seq, d_model)
        x = x + self.mlp(self.ln_mlp(x))  # (batch, seq, d_model)
        return x


def moe_layer_name(block: int) -> str:
    """Expert uid prefix of block ``block``'s DMoE layer: experts are ``moe<block>.<i>.<j>``."""
    return f"moe{block}"


class ByteTransformerLM(nn.Module):
    """GPT-style causal LM over bytes.

    ``forward(idx)`` maps token ids ``(batch, seq)`` to logits
    ``(batch, seq, vocab_size)``; position ``t`` only sees tokens ``<= t``.
    Initialisation draws from torch's global RNG, so it is deterministic given
    ``torch.manual_seed``; use :func:`build_model` to get that without touching
    the caller's RNG state.

    With ``config.moe_layers``, pass ``experts`` (an ``ExpertBackend`` from
    ``moshray.actors.moe.layer``: ``RayExpertBackend`` or ``LocalExpertBackend``); those blocks'
    MLPs become ``RemoteMixtureOfExperts`` whose parameters here are only the gating
    network (the experts train themselves where they live). Without it, ``ValueError``.
    """

    def __init__(self, config: ModelConfig, experts=None) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one (vocab, d_model) matrix
        if config.moe_layers:
            if experts is None:
                raise ValueError("ModelConfig.moe_layers needs an expert backend: pass experts="
                                 "(moshray.actors.moe.layer.RayExpertBackend or LocalExpertBackend)")
            from moshray.actors.moe import RemoteMixtureOfExperts
            from moshray.actors.moe.config import MoEConfig

            for i in config.moe_layers:
                moe = MoEConfig(moe_layer_name(i), config.moe_grid, config.d_model, k=config.moe_k)
                self.blocks[i].mlp = RemoteMixtureOfExperts(moe, experts)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 init: N(0, 0.02) everywhere, zero biases, and the projections that
        # write into the residual stream scaled by 1/sqrt(2 * n_layers) so the
        # residual variance does not grow with depth.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=resid_std)
            if isinstance(block.mlp, MLP):  # a DMoE layer's experts initialise themselves
                nn.init.normal_(block.mlp.down.weight, mean=0.0, std=resid_std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq, vocab_size)`` for token ids ``idx`` ``(batch, seq)``.

        Raises ``ValueError`` if ``idx`` is not 2-D or ``seq`` exceeds
        ``config.seq_len``.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, seq), got {tuple(idx.shape)}")
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence length {seq} exceeds config.seq_len={self.config.seq_len}")
        pos = torch.arange(seq, device=idx.device)  # (seq,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (batch, seq, d_model)
        for block in self.blocks:
            x = block(x)  # (batch, seq, d_model)
        x = self.ln_f(x)  # (batch, seq, d_model)
        return self.head(x)  # (batch, seq, vocab_size)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (scalar); ``targets`` has the shape of ``idx``.

        With DMoE layers, plus ``moe_aux_weight`` times their mean load-balancing term.
        """
        logits = self(idx)  # (batch, seq, vocab_size)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        aux = [b.mlp.aux_loss for b in self.blocks if getattr(b.mlp, "aux_loss", None) is not None]
        if aux and self.config.moe_aux_weight:
            loss = loss + self.config.moe_aux_weight * torch.stack(aux).mean()
        return loss

    def num_parameters(self) -> int:
        """Number of distinct parameters (the tied head/embedding counted once)."""
        return sum(p.numel() for p in self.parameters())


def build_model(config: ModelConfig, seed: int, experts=None) -> ByteTransformerLM:
    """Build a :class:`ByteTransformerLM` whose initial weights depend only on ``seed``.

    Two calls with the same ``config`` and ``seed`` give bitwise-identical
    parameters. The caller's global torch RNG state is left untouched (the
    init runs inside ``torch.random.fork_rng``). The model is on CPU; move it
    with ``.to(device)`` (a replica's: ``session.device``).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ByteTransformerLM(config, experts)
