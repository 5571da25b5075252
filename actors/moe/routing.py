"""DMoE routing math (pure torch, no transport): beam search, gating, masking, balance, plan.

Contract: ``beam_search`` finds the ``k`` best *live* experts per row over the grid (dead grid
prefixes are never expanded); ``gate_scores`` gives their differentiable scores;
``masked_gate_weights`` is the softmax over the slots that answered; ``load_balancing_loss``
is the Switch-style auxiliary term; ``plan_calls`` groups the chosen slots into one
``HostCall`` per expert host. Tested without any backend.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["HostCall", "beam_search", "gate_scores", "load_balancing_loss",
           "masked_gate_weights", "plan_calls"]


def _unravel(flat: torch.Tensor, grid: Sequence[int]) -> list[torch.Tensor]:
    """Row-major flat expert indices -> one coordinate tensor per grid dimension."""
    coords, rest = [], flat
    for m in reversed(grid):
        coords.append(rest % m)
        rest = torch.div(rest, m, rounding_mode="floor")
    return coords[::-1]


def beam_search(dim_scores: Sequence[torch.Tensor], alive: torch.Tensor, k: int,
                beam_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best live experts per row by beam search over the grid.

    ``dim_scores[t]`` is ``(rows, grid[t])``; an expert's score is the sum over dimensions of
    its coordinates' scores. ``alive`` is a bool tensor of shape ``grid``. At each dimension
    only prefixes that lead to a live expert are kept (``beam_size`` of them, default ``k``).
    Returns ``(flat, valid)``, both ``(rows, k)``: row-major expert indices, best first, and
    whether the slot holds a live expert (False when fewer than ``k`` are live; then ``flat``
    is meaningless there). Exact top-k when ``beam_size`` >= the number of prefixes.
    """
    grid = tuple(alive.shape)
    if len(dim_scores) != len(grid):
        raise ValueError(f"need one score tensor per grid dimension ({len(grid)}), "
                         f"got {len(dim_scores)}")
    width = max(beam_size or k, k)
    rows = dim_scores[0].shape[0]
    device = dim_scores[0].device
    # prefix_alive[t][p]: some live expert has its first t+1 coordinates equal to prefix p.
    prefix_alive, a = [], alive.to(device)
    for t in reversed(range(len(grid))):
        prefix_alive.append(a.reshape(-1))
        a = a.any(dim=-1)
    prefix_alive.reverse()
    beam_idx = torch.zeros(rows, 1, dtype=torch.long, device=device)
    beam_score = torch.zeros(rows, 1, device=device)
    beam_ok = torch.ones(rows, 1, dtype=torch.bool, device=device)
    for t, m in enumerate(grid):
        cand_idx = beam_idx[:, :, None] * m + torch.arange(m, device=device)  # (rows, w, m)
        cand_ok = beam_ok[:, :, None] & prefix_alive[t][cand_idx]
        cand_score = (beam_score[:, :, None] + dim_scores[t].detach().float()[:, None, :])
        cand_score = cand_score.masked_fill(~cand_ok, float("-inf")).reshape(rows, -1)
        keep = min(k if t == len(grid) - 1 else width, cand_score.shape[1])
        beam_score, pos = cand_score.topk(keep, dim=1)  # (rows, keep), best first
        beam_idx = cand_idx.reshape(rows, -1).gather(1, pos)
        beam_ok = cand_ok.reshape(rows, -1).gather(1, pos)
    if beam_idx.shape[1] < k:  # fewer grid cells than k: pad with invalid slots
        pad = k - beam_idx.shape[1]
        beam_idx = torch.cat([beam_idx, beam_idx.new_zeros(rows, pad)], 1)
        beam_ok = torch.cat([beam_ok, beam_ok.new_zeros(rows, pad)], 1)
    return beam_idx, beam_ok


def gate_scores(dim_logits: Sequence[torch.Tensor], flat: torch.Tensor,
                grid: Sequence[int]) -> torch.Tensor:
    """Differentiable scores ``(rows, k)`` of the experts ``flat`` ``(rows, k)``."""
    coords = _unravel(flat, grid)
    return sum(logits.gather(1, c) for logits, c in zip(dim_logits, coords))


def masked_gate_weights(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax of ``scores`` over the slots where ``mask`` is True; 0 elsewhere and on rows
    with no True slot. ``(rows, k)``; gradients are finite everywhere."""
    filled = scores.masked_fill(~mask, -1e9)  # exp underflows to 0; no NaN on empty rows
    return torch.softmax(filled, dim=-1) * mask


def load_balancing_loss(dim_logits: Sequence[torch.Tensor], flat: torch.Tensor,
                        valid: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
    """Switch-style balance term, averaged over grid dimensions; 1.0 when perfectly even.

    For dimension t: ``m_t * sum_c f_t[c] * P_t[c]`` where ``f_t[c]`` is the fraction of chosen
    (valid) slots whose coordinate t is c (no gradient) and ``P_t[c]`` the mean gate
    probability of coordinate c. Minimising it spreads rows over the grid.
    """
    coords = _unravel(flat, grid)
    terms = []
    chosen = valid.sum().clamp(min=1)
    for logits, c, m in zip(dim_logits, coords, grid):
        counts = torch.zeros(m, device=logits.device)
        counts.index_add_(0, c[valid], torch.ones_like(c[valid], dtype=counts.dtype))
        frac = counts / chosen
        prob = torch.softmax(logits.float(), dim=-1).mean(0)
        terms.append(m * (frac * prob).sum())
    return torch.stack(terms).mean()


@dataclass(frozen=True)
class HostCall:
    """The slice of one forward that goes to one expert host.

    ``positions[i]`` are the flat ``row * k + slot`` positions served by ``uids[i]``;
    ``rows[i] = positions[i] // k`` index the input rows.
    """

    host: Hashable
    uids: tuple[str, ...]
    positions: tuple[torch.Tensor, ...]
    rows: tuple[torch.Tensor, ...]


def plan_calls(flat: torch.Tensor, valid: torch.Tensor, uid_of: Sequence[str],
               host_of: Mapping[str, Hashable]) -> list[HostCall]:
    """Group the chosen ``(rows, k)`` slots by expert, then by host (one call per host)."""
    k = flat.shape[1]
    flat_cpu, valid_cpu = flat.reshape(-1).cpu(), valid.reshape(-1).cpu()
    positions = torch.nonzero(valid_cpu, as_tuple=True)[0]
    experts = flat_cpu[positions]
    order = torch.argsort(experts, stable=True)
    experts, positions = experts[order], positions[order]
    unique, counts = torch.unique_consecutive(experts, return_counts=True)
    by_host: dict[Hashable, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for e, chunk in zip(unique.tolist(), positions.split(counts.tolist())):
        uid = uid_of[e]
        by_host[host_of[uid]].append((uid, chunk))
    return [HostCall(host, tuple(u for u, _ in items), tuple(p for _, p in items),
                     tuple(torch.div(p, k, rounding_mode="floor") for _, p in items))
            for host, items in by_host.items()]
