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
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from moshray.cluster.registry import grid_uids, uid_prefix

from .expert import ExpertHostCore, ExpertInputError, ExpertSetConfig, ExpertSpec, layout_shards

log = logging.getLogger(__name__)

__all__ = [
    "ExpertBackend",
    "LocalExpertBackend",
    "MoEConfig",
    "RayExpertBackend",
    "RemoteMixtureOfExperts",
    "beam_search",
    "gate_scores",
    "load_balancing_loss",
    "masked_gate_weights",
    "plan_calls",
]


# -- configuration ------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEConfig:
    """One DMoE layer: its uid prefix ``layer``, its ``grid`` and the routing rule.

    ``beam_size`` (default ``k``) is the beam width kept at intermediate grid dimensions.
    Raises ``ValueError`` naming the field.
    """

    layer: str
    grid: tuple[int, ...]
    d_model: int
    k: int = 4
    k_min: int = 1
    beam_size: int = 0  # 0 = k
    forward_timeout_s: float = 10.0
    backward_timeout_s: float = 10.0
    timeout_after_k_min_s: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", tuple(self.grid))
        grid_uids(self.layer, self.grid)  # validates layer and grid
        for name in ("d_model", "k", "k_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoEConfig.{name}: must be a positive integer, got {value!r}")
        if self.k_min > self.k:
            raise ValueError(f"MoEConfig.k_min: must be <= k ({self.k}), got {self.k_min}")
        if self.k > math.prod(self.grid):
            raise ValueError(f"MoEConfig.k: must be <= the number of experts "
                             f"({math.prod(self.grid)}), got {self.k}")
        if not isinstance(self.beam_size, int) or self.beam_size < 0:
            raise ValueError(f"MoEConfig.beam_size: must be >= 0, got {self.beam_size!r}")
        for name in ("forward_timeout_s", "backward_timeout_s", "timeout_after_k_min_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"MoEConfig.{name}: must be a number >= 0, got {value!r}")

    @property
    def beam(self) -> int:
        return max(self.beam_size or self.k, self.k)


# -- routing math (pure) --------------------------------------------------------------------------


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


# -- backends -----------------------------------------------------------------------------------


class ExpertBackend(Protocol):
    """How a DMoE layer finds and calls experts. Calls return ``concurrent.futures.Future``s
    that resolve to one numpy array per uid, or fail with the host's exception."""

    def live_experts(self, layer: str) -> Mapping[str, Hashable]:
        """``{uid: host key}`` of the experts of ``layer`` believed live now."""

    def call_forward(self, host: Hashable, uids: tuple[str, ...],
                     inputs: tuple[np.ndarray, ...]) -> concurrent.futures.Future: ...

    def call_backward(self, host: Hashable, uids: tuple[str, ...], inputs: tuple[np.ndarray, ...],
                      grads: tuple[np.ndarray, ...]) -> concurrent.futures.Future: ...

    def report_failure(self, host: Hashable, exc: BaseException) -> None:
        """A call to ``host`` raised ``exc`` (not a timeout)."""

    def report_late(self, host: Hashable) -> None:
        """A call to ``host`` missed its deadline."""


def _done(fn: Callable[[], Any]) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        future.set_result(fn())
    except Exception as exc:  # noqa: BLE001 - delivered through the future like a remote error
        future.set_exception(exc)
    return future


class LocalExpertBackend:
    """Experts computed in this process by ``ExpertHostCore``s (no Ray): the baseline and the
    reference. Calls run synchronously when made, so results are deterministic."""

    def __init__(self, hosts: Mapping[str, ExpertHostCore]):
        self.hosts = dict(hosts)
        self.failures: list[tuple[Hashable, str]] = []

    @classmethod
    def from_config(cls, config: ExpertSetConfig) -> LocalExpertBackend:
        """Fresh experts with the same layout and initial weights as the remote set."""
        return cls({h: ExpertHostCore(u, config.spec) for h, u in layout_shards(config).items()})

    @classmethod
    def from_states(cls, states: Mapping[str, dict], spec: ExpertSpec) -> LocalExpertBackend:
        """Experts restored from ``ExpertActor.snapshot()`` states, keyed by host id."""
        return cls({h: ExpertHostCore(s["uids"], spec, s) for h, s in states.items()})

    def live_experts(self, layer: str) -> dict[str, Hashable]:
        prefix = uid_prefix(layer)
        return {u: h for h, core in self.hosts.items() for u in core.uids if u.startswith(prefix)}

    def call_forward(self, host, uids, inputs):
        return _done(lambda: self.hosts[host].forward(uids, inputs))

    def call_backward(self, host, uids, inputs, grads):
        return _done(lambda: self.hosts[host].backward(uids, inputs, grads))

    def report_failure(self, host, exc) -> None:
        self.failures.append((host, type(exc).__name__))

    def report_late(self, host) -> None:
        self.failures.append((host, "late"))


class RayExpertBackend:
    """Experts found through the Coordinator's registry and called as Ray actors.

    Lookups are cached per layer for ``ttl_s`` (a failed lookup keeps the stale table). A host
    instance whose call raised (died, unreachable) is left out of routing for ``blacklist_s``
    or until the registry shows a new instance for it (a re-spawn); one that was late, for
    ``late_penalty_s`` (a node killed without notice hangs until Ray declares it dead, and
    without the penalty every step would wait out ``timeout_after_k_min_s`` for it).
    Thread-safe. Use it from a
    worker thread, not an async actor's event loop (lookups block).
    """

    def __init__(self, coordinator, ttl_s: float = 1.0, blacklist_s: float = 30.0,
                 late_penalty_s: float = 3.0, lookup_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.coordinator = coordinator
        self.ttl_s = ttl_s
        self.blacklist_s = blacklist_s
        self.late_penalty_s = late_penalty_s
        self.lookup_timeout_s = lookup_timeout_s
        self.clock = clock
        self._lock = threading.Lock()
        self._tables: dict[str, tuple[float, dict[str, tuple[str, str]]]] = {}
        self._handles: dict[tuple[str, str], Any] = {}
        self._dead: dict[tuple[str, str], float] = {}
        self._calls: list[tuple[str, float]] = []  # (outcome, seconds) not yet taken
        self.lookups = 0

    def live_experts(self, layer: str) -> dict[str, Hashable]:
        import ray

        now = self.clock()
        with self._lock:
            cached = self._tables.get(layer)
        if cached is None or cached[0] <= now:
            try:
                records = ray.get(self.coordinator.lookup_experts.remote(uid_prefix(layer)),
                                  timeout=self.lookup_timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                log.warning("expert lookup for %s failed (%s); using the cached table", layer,
                            type(exc).__name__)
                records = None
            with self._lock:
                self.lookups += 1
                if records is not None:
                    table = {}
                    for r in records:
                        key = (r.host_id, r.instance)
                        self._handles[key] = r.handle
                        table.update({u: key for u in r.uids})
                    cached = (now + self.ttl_s, table)
                    self._tables[layer] = cached
                elif cached is None:
                    return {}
        with self._lock:
            self._dead = {key: t for key, t in self._dead.items() if t > now}
            return {u: key for u, key in cached[1].items() if key not in self._dead}

    def call_forward(self, host, uids, inputs):
        return self._handles[host].forward.remote(uids, inputs).future()

    def call_backward(self, host, uids, inputs, grads):
        return self._handles[host].backward.remote(uids, inputs, grads).future()

    def report_failure(self, host, exc) -> None:
        if isinstance(exc, ExpertInputError):
            return  # our request was bad; the host is fine
        with self._lock:
            self._dead[host] = self.clock() + self.blacklist_s
            log.warning("expert host %s failed (%s); routing around it", host[0],
                        type(exc).__name__)

    def report_late(self, host) -> None:
        with self._lock:
            until = self.clock() + self.late_penalty_s
            self._dead[host] = max(self._dead.get(host, until), until)

    def record_calls(self, calls: Sequence[tuple[str, float]]) -> None:
        """Keep ``(outcome, seconds)`` of expert calls until :meth:`take_calls` (bounded)."""
        with self._lock:
            self._calls.extend(calls)
            del self._calls[:-MAX_KEPT_CALLS]

    def take_calls(self) -> list[tuple[str, float]]:
        """The calls recorded since the last take (for metrics), oldest first."""
        with self._lock:
            calls, self._calls = self._calls, []
        return calls


MAX_KEPT_CALLS = 10_000  # expert-call records a backend keeps between two takes


# -- dispatch with deadlines ----------------------------------------------------------------------


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
