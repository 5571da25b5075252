"""DMoE dispatch with deadlines: send one forward's rows to the chosen experts, settle, mask.

Contract: every row waits until ``k_min`` of its experts answered (or all it has, if fewer),
then at most ``timeout_after_k_min_s`` more; ``forward_timeout_s`` / ``backward_timeout_s`` cap
it all (``gather_with_deadlines``). Experts that fail or are late are masked out of the
forward *and* its backward; the backward sends the same rows with the output gradients to the
experts that answered, and a failed backward contributes no input gradient. ``_RemoteExperts``
is the autograd function ``RemoteMixtureOfExperts`` applies; ``call_outcomes`` turns a settled
batch into per-expert metrics records.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moshray.actors.moe.expert_errors import ExpertInputError
from moshray.actors.moe.backends import ExpertBackend
from moshray.actors.moe.config import MoEConfig
from moshray.actors.moe.routing import HostCall

log = logging.getLogger(__name__)

__all__ = ["CallOutcome", "call_outcomes", "gather_with_deadlines"]


@dataclass
class CallOutcome:
    """Which host calls of one forward or backward answered, failed, or were late."""

    results: dict[int, list[np.ndarray]] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    late: list[int] = field(default_factory=list)
    seconds: float = 0.0


def gather_with_deadlines(futures: Sequence[concurrent.futures.Future],
                          coverage: Sequence[torch.Tensor], need: torch.Tensor,
                          timeout_s: float, timeout_after_k_min_s: float,
                          clock: Callable[[], float] = time.monotonic) -> CallOutcome:
    """Wait for ``futures`` under the DMoE rule.

    ``coverage[i]`` ``(rows,)`` counts the slots of each row that call ``i`` serves; ``need``
    ``(rows,)`` is how many answered slots each row waits for. Once every row has them, wait at
    most ``timeout_after_k_min_s`` more; never longer than ``timeout_s`` overall. Futures not
    done by then are reported ``late`` (their calls are not cancelled; results are ignored).
    """
    start = clock()
    outcome = CallOutcome()
    index = {f: i for i, f in enumerate(futures)}
    pending = set(futures)
    have = torch.zeros_like(need)
    hard = start + timeout_s
    soft = start + timeout_after_k_min_s if bool((have >= need).all()) else None
    while pending:
        remaining = min(hard, soft if soft is not None else hard) - clock()
        if remaining <= 0:
            break
        done, pending = concurrent.futures.wait(
            pending, timeout=remaining, return_when=concurrent.futures.FIRST_COMPLETED)
        for f in done:
            i = index[f]
            exc = f.exception()
            if exc is None:
                outcome.results[i] = f.result()
                have = have + coverage[i]
            else:
                outcome.failed[i] = exc
        if soft is None and bool((have >= need).all()):
            soft = clock() + timeout_after_k_min_s
    outcome.late = sorted(index[f] for f in pending)
    outcome.seconds = clock() - start
    return outcome


def _to_wire(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).contiguous().numpy()


def _from_wire(a: np.ndarray) -> torch.Tensor:
    a = np.asarray(a)
    return torch.from_numpy(a if a.flags.writeable else a.copy())  # object-store arrays are
    # read-only views; torch wants writable memory


def call_outcomes(outcome: CallOutcome, experts_per_call: Sequence[int]
                  ) -> list[tuple[str, float]]:
    """Pure: ``(outcome, seconds)`` per expert called, outcome being ok, rejected (the host
    refused our input), failed (the host raised or died) or timeout (late). Latency is the
    wait for the whole batch of calls (calls are settled together)."""
    out: list[tuple[str, float]] = []
    for i, n in enumerate(experts_per_call):
        if i in outcome.results:
            kind = "ok"
        elif i in outcome.failed:
            kind = "rejected" if isinstance(outcome.failed[i], ExpertInputError) else "failed"
        else:
            kind = "timeout"
        out.extend([(kind, outcome.seconds)] * n)
    return out


class _Dispatch:
    """What one forward sent where, kept for its backward."""

    def __init__(self, backend: ExpertBackend, config: MoEConfig, calls: list[HostCall],
                 rows: int):
        self.backend = backend
        self.config = config
        self.calls = calls
        self.rows = rows
        self.inputs: list[tuple[np.ndarray, ...]] = []
        self.answered: list[int] = []
        self.stats: dict[str, Any] = {}

    def coverage(self, i: int) -> torch.Tensor:
        c = torch.zeros(self.rows, dtype=torch.long)
        for r in self.calls[i].rows:
            c.index_add_(0, r, torch.ones_like(r))
        return c

    def _settle(self, futures, indices, timeout_s, need) -> CallOutcome:
        outcome = gather_with_deadlines(futures, [self.coverage(i) for i in indices], need,
                                        timeout_s, self.config.timeout_after_k_min_s)
        for j, exc in outcome.failed.items():
            self.backend.report_failure(self.calls[indices[j]].host, exc)
        for j in outcome.late:
            self.backend.report_late(self.calls[indices[j]].host)
        record = getattr(self.backend, "record_calls", None)
        if record is not None:  # metrics: one (outcome, seconds) per expert call
            record(call_outcomes(outcome, [len(self.calls[i].uids) for i in indices]))
        return outcome

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out (rows, k, d), answered (rows, k) bool)`` for input rows ``x`` ``(rows, d)``."""
        k, d = valid.shape[1], x.shape[1]
        wire = x.detach().to("cpu", torch.float32)
        futures = []
        for call in self.calls:
            inputs = tuple(_to_wire(wire.index_select(0, r)) for r in call.rows)
            self.inputs.append(inputs)
            futures.append(self.backend.call_forward(call.host, call.uids, inputs))
        need = valid.sum(1).clamp(max=self.config.k_min).cpu()
        outcome = self._settle(futures, list(range(len(self.calls))),
                               self.config.forward_timeout_s, need)
        out = torch.zeros(self.rows * k, d, dtype=torch.float32)
        answered = torch.zeros(self.rows * k, dtype=torch.bool)
        for i, outputs in sorted(outcome.results.items()):
            for pos, o in zip(self.calls[i].positions, outputs):
                out[pos] = _from_wire(o)
                answered[pos] = True
            self.answered.append(i)
        self.stats = {"calls": len(self.calls), "answered": len(outcome.results),
                      "failed": len(outcome.failed), "late": len(outcome.late),
                      "forward_s": outcome.seconds,
                      "masked_uids": tuple(u for i in (*outcome.failed, *outcome.late)
                                           for u in self.calls[i].uids)}
        if outcome.failed or outcome.late:
            log.info("DMoE %s forward: %d of %d host calls masked (%d failed, %d late)",
                     self.config.layer, len(outcome.failed) + len(outcome.late),
                     len(self.calls), len(outcome.failed), len(outcome.late))
        return (out.view(self.rows, k, d).to(x.device, x.dtype),
                answered.view(self.rows, k).to(x.device))

    def backward(self, grad_out: torch.Tensor) -> torch.Tensor:
        """Input gradient ``(rows, d)`` from the answering experts' backward calls."""
        d = grad_out.shape[-1]
        grads = grad_out.detach().to("cpu", torch.float32).reshape(-1, d)
        futures = []
        for i in self.answered:
            call = self.calls[i]
            g = tuple(_to_wire(grads.index_select(0, p)) for p in call.positions)
            futures.append(self.backend.call_backward(call.host, call.uids, self.inputs[i], g))
        cover = torch.zeros(self.rows, dtype=torch.long)
        for i in self.answered:
            cover += self.coverage(i)
        need = cover.clamp(max=self.config.k_min)
        outcome = self._settle(futures, self.answered, self.config.backward_timeout_s, need)
        grad_x = torch.zeros(self.rows, d, dtype=torch.float32)
        for j, outputs in outcome.results.items():
            for r, gi in zip(self.calls[self.answered[j]].rows, outputs):
                grad_x.index_add_(0, r, _from_wire(gi))
        self.stats.update(backward_answered=len(outcome.results),
                          backward_failed=len(outcome.failed), backward_late=len(outcome.late),
                          backward_s=outcome.seconds)
        return grad_x.to(grad_out.device, grad_out.dtype)


class _RemoteExperts(torch.autograd.Function):
    """Forward: expert outputs ``(rows, k, d)`` and the answered mask; backward: input grads
    from the same experts (no gradient flows to the mask)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, valid: torch.Tensor, dispatch: _Dispatch):
        out, answered = dispatch.forward(x, valid)
        ctx.dispatch = dispatch
        ctx.mark_non_differentiable(answered)
        return out, answered

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _grad_answered):
        return ctx.dispatch.backward(grad_out), None, None
