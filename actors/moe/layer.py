"""RemoteMixtureOfExperts: the DMoE layer a replica runs, with experts living elsewhere.

For each input row (token) ``x`` of width ``d_model``:

1. the gating network scores every grid dimension (one linear map per dimension; an expert's
   score is the sum of its coordinates' scores);
2. beam search over the grid finds the ``k`` best *live* experts (dead grid prefixes are never
   expanded);
3. the rows are dispatched to the chosen experts in parallel, one call per expert host;
4. the outputs are combined with the softmax of the chosen experts' scores over those that
   answered.

Waiting: every row waits until ``k_min`` of its experts answered (or all it has, if fewer),
then the layer waits at most ``timeout_after_k_min_s`` more; ``forward_timeout_s`` caps it
all. Experts that fail or are late are masked out of this forward *and* its backward (they get
no gradient and weigh nothing). Backward sends the same rows with the output gradients to the
experts that answered (Learning@home: they return input gradients and update themselves);
the same waiting rule applies, and a failed backward contributes no input gradient.

Transport sits behind ``ExpertBackend``: ``RayExpertBackend`` (registry lookups through the
Coordinator with a short-TTL client cache, and a blacklist of hosts that just failed) and
``LocalExpertBackend`` (the same expert code in-process, no Ray). The routing math
(``beam_search``, ``gate_scores``, ``masked_gate_weights``, ``load_balancing_loss``,
``plan_calls``) is pure torch and tested without either.

This module holds the layer itself; the package's other modules hold one role each:
``config`` (``MoEConfig``), ``routing`` (the routing math), ``backends`` (``ExpertBackend``
and its two backends), ``dispatch`` (calls with deadlines and masking, the autograd
function). The package ``moshray.actors.moe`` declares the public names.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping
from typing import Any

import torch
from torch import nn

from moshray.cluster.coordinator.expert_registry import grid_uids

from moshray.actors.moe.backends import ExpertBackend
from moshray.actors.moe.config import MoEConfig
from moshray.actors.moe.dispatch import _Dispatch, _RemoteExperts
from moshray.actors.moe.routing import (beam_search, gate_scores, load_balancing_loss,
                                        masked_gate_weights, plan_calls)

log = logging.getLogger(__name__)



# -- the layer ------------------------------------------------------------------------------------


class RemoteMixtureOfExperts(nn.Module):
    """DMoE layer: ``(..., d_model) -> (..., d_model)``; see the module docstring.

    Its own parameters are only the gating network (one ``Linear(d_model, grid[t])`` per grid
    dimension); expert parameters live with the experts. After each forward, ``aux_loss`` holds
    the load-balancing term (add ``weight * aux_loss`` to the loss) and ``last_stats`` what
    happened (calls, failed, late, masked uids). A row whose experts all failed outputs zeros.
    """

    def __init__(self, config: MoEConfig, backend: ExpertBackend):
        super().__init__()
        self.config = config
        self.backend = backend
        self.gate = nn.ModuleList(nn.Linear(config.d_model, m) for m in config.grid)
        self.uids = grid_uids(config.layer, config.grid)  # flat index -> uid (row-major)
        self.index = {u: i for i, u in enumerate(self.uids)}
        self.aux_loss: torch.Tensor | None = None
        self.last_stats: dict[str, Any] = {}
        self.last_routing: tuple[torch.Tensor, torch.Tensor] | None = None  # (flat, mask)

    def alive(self, live: Mapping[str, Hashable]) -> torch.Tensor:
        """Bool tensor of shape ``grid``: which experts are live."""
        flags = torch.zeros(len(self.uids), dtype=torch.bool)
        for uid in live:
            i = self.index.get(uid)
            if i is not None:
                flags[i] = True
        return flags.view(self.config.grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if x.shape[-1] != cfg.d_model:
            raise ValueError(f"DMoE {cfg.layer}: input last dim must be d_model={cfg.d_model}, "
                             f"got {tuple(x.shape)}")
        shape = x.shape
        x2 = x.reshape(-1, cfg.d_model)  # (rows, d_model)
        live = self.backend.live_experts(cfg.layer)
        dim_logits = [g(x2) for g in self.gate]  # each (rows, grid[t])
        alive = self.alive(live)
        with torch.no_grad():
            flat, valid = beam_search(dim_logits, alive.to(x2.device), cfg.k, cfg.beam)
        self.aux_loss = load_balancing_loss(dim_logits, flat, valid, cfg.grid)
        if not bool(valid.any()):
            log.warning("DMoE %s: no live experts; the layer outputs zeros", cfg.layer)
            self.last_stats = {"calls": 0, "answered": 0, "failed": 0, "late": 0,
                               "masked_uids": ()}
            self.last_routing = flat, valid
            return x * 0.0  # zeros that stay in the graph
        calls = plan_calls(flat, valid, self.uids, live)
        dispatch = _Dispatch(self.backend, cfg, calls, x2.shape[0])
        out, answered = _RemoteExperts.apply(x2, valid, dispatch)  # (rows, k, d), (rows, k)
        mask = valid & answered
        weights = masked_gate_weights(gate_scores(dim_logits, flat, cfg.grid), mask)
        y = (weights.unsqueeze(-1).to(out.dtype) * out).sum(1)  # (rows, d_model)
        self.last_stats = dispatch.stats  # the backward adds its counts to the same dict
        self.last_routing = flat, mask
        return y.reshape(shape)
