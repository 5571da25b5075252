"""The torch core of DMoE experts (no Ray): one shard's experts with their own optimizers.

Contract (Learning@home): ``ExpertHostCore.forward`` returns the experts' outputs;
``backward`` gets the same inputs again with the gradient of the loss with respect to the
outputs, recomputes the forward, returns the gradient with respect to the inputs and applies
one optimizer step. Nothing is kept between the two calls. Requests are validated before
anything is computed (``ExpertInputError`` otherwise); ``state()`` / ``load()`` snapshot and
restore a shard. Initial weights depend only on ``(spec.seed, uid)`` (``build_expert``).
In-process backends (``moe_backends.LocalExpertBackend``) and ``ExpertActor`` both use it.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from torch import nn

from moshray.cluster.coordinator.expert_registry import parse_uid

from moshray.actors.moe.expert_config import ExpertSpec
from moshray.actors.moe.expert_errors import ExpertInputError, ExpertRejectReason

STATE_VERSION = 1

__all__ = ["Array", "ExpertFFN", "ExpertHostCore", "STATE_VERSION", "build_expert"]


class ExpertFFN(nn.Module):
    """``(rows, d_model) -> (rows, d_model)``: Linear, GELU, Linear (GPT-2 style init)."""

    def __init__(self, spec: ExpertSpec) -> None:
        super().__init__()
        self.up = nn.Linear(spec.d_model, spec.d_hidden)
        self.down = nn.Linear(spec.d_hidden, spec.d_model)
        for lin in (self.up, self.down):
            nn.init.normal_(lin.weight, mean=0.0, std=0.02)
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def build_expert(spec: ExpertSpec, uid: str) -> ExpertFFN:
    """The expert ``uid`` with weights that depend only on ``(spec.seed, uid)``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed * 1_000_003 + zlib.crc32(uid.encode()))
        return ExpertFFN(spec)


Array = np.ndarray | torch.Tensor


class ExpertHostCore:
    """The experts of one shard with their optimizers (Adam); no Ray, not thread-safe.

    ``forward(uids, inputs)`` and ``backward(uids, inputs, grads)`` take one float32 array of
    shape ``(rows, d_model)`` per uid (numpy or torch) and return one numpy array per uid.
    Both validate everything before computing anything and raise ``ExpertInputError``.
    ``device``: where the experts and their optimizer state live and compute (``cuda`` on a
    GPU host); requests and answers stay host arrays either way.
    """

    def __init__(self, uids: Sequence[str], spec: ExpertSpec, state: dict | None = None,
                 device: str | torch.device = "cpu"):
        if not uids:
            raise ValueError("an expert host needs at least one expert uid")
        for uid in uids:
            parse_uid(uid)
        self.spec = spec
        self.uids = tuple(uids)
        self.device = torch.device(device)
        self.experts = {uid: build_expert(spec, uid).to(self.device) for uid in self.uids}
        self.optimizers = {
            uid: torch.optim.AdamW(m.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
            for uid, m in self.experts.items()
        }
        self.updates = {uid: 0 for uid in self.uids}
        self.step = 0  # snapshot counter, continued across re-spawns
        if state is not None:
            self.load(state)

    # -- validation ---------------------------------------------------------------------------

    def check(self, uid: Any, x: Any, grad: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(x, grad)`` as float32 tensors on the experts' device, or ``ExpertInputError``
        saying what is wrong."""
        if not isinstance(uid, str) or uid not in self.experts:
            raise ExpertInputError(ExpertRejectReason.UNKNOWN_EXPERT, str(uid),
                                   f"this host serves {', '.join(self.uids)}")
        x = self._tensor(uid, x, "inputs")
        if grad is not None:
            grad = self._tensor(uid, grad, "grads")
            if grad.shape != x.shape:
                raise ExpertInputError(ExpertRejectReason.BAD_SHAPE, uid,
                                       f"grads shape {tuple(grad.shape)} differs from inputs "
                                       f"shape {tuple(x.shape)}")
        return x, grad

    def _tensor(self, uid: str, a: Any, what: str) -> torch.Tensor:
        if isinstance(a, np.ndarray):
            if a.dtype != np.float32:
                raise ExpertInputError(ExpertRejectReason.BAD_DTYPE, uid,
                                       f"{what} must be float32, got {a.dtype}")
            t = torch.from_numpy(a if a.flags.writeable else a.copy())
        elif isinstance(a, torch.Tensor):
            if a.dtype != torch.float32:
                raise ExpertInputError(ExpertRejectReason.BAD_DTYPE, uid,
                                       f"{what} must be float32, got {a.dtype}")
            t = a.detach().cpu()
        else:
            raise ExpertInputError(ExpertRejectReason.BAD_REQUEST, uid,
                                   f"{what} must be a float32 array, got {type(a).__name__}")
        if t.dim() != 2 or t.shape[1] != self.spec.d_model:
            raise ExpertInputError(ExpertRejectReason.BAD_SHAPE, uid,
                                   f"{what} must have shape (rows, {self.spec.d_model}), "
                                   f"got {tuple(t.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise ExpertInputError(ExpertRejectReason.NON_FINITE, uid,
                                   f"{what} contain NaN or inf")
        return t.to(self.device)

    def check_request(self, uids: Any, inputs: Any, grads: Any = None
                      ) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
        """Validate a whole multi-expert request; returns ``[(uid, x, grad), ...]``."""
        if not isinstance(uids, (tuple, list)) or not isinstance(inputs, (tuple, list)):
            raise ExpertInputError(ExpertRejectReason.BAD_REQUEST, "?",
                                   "uids and inputs must be tuples (one input per uid)")
        if len(uids) != len(inputs) or (grads is not None and len(grads) != len(uids)):
            raise ExpertInputError(ExpertRejectReason.BAD_REQUEST, "?",
                                   f"got {len(uids)} uids but {len(inputs)} inputs"
                                   + ("" if grads is None else f" and {len(grads)} grads"))
        if grads is None:
            return [(u, *self.check(u, x)) for u, x in zip(uids, inputs)]
        return [(u, *self.check(u, x, g)) for u, x, g in zip(uids, inputs, grads)]

    # -- compute --------------------------------------------------------------------------------

    def forward_one(self, uid: str, x: torch.Tensor) -> torch.Tensor:
        """Expert output for validated ``x`` ``(rows, d_model)``; no autograd state kept."""
        with torch.no_grad():
            return self.experts[uid](x)

    def backward_one(self, uid: str, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Input gradient for validated ``x`` and ``grad``; applies one optimizer step."""
        expert, optimizer = self.experts[uid], self.optimizers[uid]
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = expert(x)  # (rows, d_model)
            out.backward(grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.updates[uid] += 1
        return x.grad

    def forward(self, uids: Sequence[str], inputs: Sequence[Array]) -> list[np.ndarray]:
        return [self.forward_one(u, x).cpu().numpy()
                for u, x, _ in self.check_request(uids, inputs)]

    def backward(self, uids: Sequence[str], inputs: Sequence[Array],
                 grads: Sequence[Array]) -> list[np.ndarray]:
        return [self.backward_one(u, x, g).cpu().numpy()
                for u, x, g in self.check_request(uids, inputs, grads)]

    # -- state ------------------------------------------------------------------------------------

    def state(self) -> dict:
        """A self-describing copy of every expert (CPU tensors) and optimizer (its state on
        the experts' device; ``load`` moves it to the loading host's)."""
        return {
            "version": STATE_VERSION,
            "uids": self.uids,
            "spec": asdict(self.spec),
            "step": self.step,
            "updates": dict(self.updates),
            "experts": {u: {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
                        for u, m in self.experts.items()},
            "optimizers": {u: o.state_dict() for u, o in self.optimizers.items()},
        }

    def load(self, state: dict) -> None:
        """Restore from :meth:`state`; raises ``ValueError`` if it is not for these experts."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"expert state version {state.get('version')!r} is not "
                             f"{STATE_VERSION}")
        if set(state["experts"]) != set(self.uids):
            raise ValueError(f"expert state holds {sorted(state['experts'])}, "
                             f"this host serves {sorted(self.uids)}")
        if state["spec"]["d_model"] != self.spec.d_model or \
                state["spec"]["d_hidden"] != self.spec.d_hidden:
            raise ValueError(f"expert state shape {state['spec']} does not match {self.spec}")
        for uid in self.uids:
            self.experts[uid].load_state_dict(state["experts"][uid])
            self.optimizers[uid].load_state_dict(state["optimizers"][uid])
        self.updates = dict(state["updates"])
        self.step = int(state["step"])
