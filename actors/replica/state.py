"""What a replica holds and hands on: the user's model, optimizer and extra state, the
data position, the RNG states and the step bookkeeping (epoch, lineage, digest, branch).

``TrainState.snapshot()`` is the dict that travels to a joiner (through the object store)
and into a checkpoint; ``load`` puts one back into the user's own objects, in place (a
training loop keeps holding the same model and optimizer). A donor's state whose model was
built with different initial parameters is refused with a ``UserError``; a state whose
tensors do not fit the model is refused with one too.
"""

from __future__ import annotations

import copy
import hashlib
import random
from dataclasses import dataclass

import numpy as np
import torch

from moshray.actors.errors import UserError
from moshray.actors.replica.checkpoint import fingerprint_mismatch, model_fingerprint

STATE_VERSION = 2


def consistent_tensors(model: torch.nn.Module, optimizers=()) -> list[torch.Tensor]:
    """What replicas that hold the same step hold equal, in a fixed order: the parameters,
    the floating-point buffers (``strategies.averaged_buffers``: integer ones count each
    replica's own forward passes) and the state of ``optimizers`` (each parameter's
    entries by name; a number such as a ``step`` count as a one-element tensor; other
    values are left out)."""
    tensors = [p.detach() for p in model.parameters()]
    tensors += [b.detach() for b in model.buffers() if b.is_floating_point()]
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                entry = optimizer.state.get(p, {})
                for key in sorted(entry, key=str):
                    v = entry[key]
                    if isinstance(v, torch.Tensor):
                        tensors.append(v.detach())
                    elif isinstance(v, (int, float)):
                        tensors.append(torch.tensor(float(v), dtype=torch.float64))
    return tensors


def checksum(model: torch.nn.Module, optimizers=()) -> str:
    """Digest of the bytes of every ``consistent_tensors`` entry (equal digests = bitwise
    equal parameters, buffers and optimizer state)."""
    h = hashlib.sha256()
    for t in consistent_tensors(model, optimizers):
        h.update(t.cpu().contiguous().reshape(-1).numpy().tobytes())
    return h.hexdigest()[:16]


DIGEST_ELEMENTS = 1 << 16  # values sampled by the per-step digest


def step_digest(model: torch.nn.Module, epoch: int, optimizers=()) -> str:
    """A cheap per-step digest of ``consistent_tensors``: about ``DIGEST_ELEMENTS`` values
    at a stride that rotates with ``epoch``, plus every tensor's sum (a step changes every
    element, so a replica that diverged differs in the sample and the sums). ``checksum``
    is the full one (end of run, on demand)."""
    tensors = [t.reshape(-1) for t in consistent_tensors(model, optimizers)]
    total = sum(t.numel() for t in tensors)
    stride = max(1, total // DIGEST_ELEMENTS)
    h = hashlib.sha256()
    for t in tensors:
        start = epoch % stride if t.numel() > stride else 0
        h.update(t[start::stride].cpu().contiguous().numpy().tobytes())
        h.update(t.sum(dtype=torch.float64).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class Lineage:
    """Which global steps the state this replica holds has gone through.

    Travels with the state (donor copies, checkpoints). Steps must be applied in order,
    once each: a step skipped is counted in ``gaps`` (lost), one applied again in
    ``repeats``; both stay 0 in a correct run.
    """

    last: int = 0
    gaps: int = 0
    repeats: int = 0

    def apply(self, epoch: int) -> None:
        if epoch <= self.last:
            self.repeats += 1
        else:
            self.gaps += epoch - self.last - 1
        self.last = max(self.last, epoch)

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.last, self.gaps, self.repeats)

    @classmethod
    def from_tuple(cls, t, epoch: int) -> "Lineage":
        """From ``as_tuple``; a state without one (older checkpoint) starts clean at ``epoch``."""
        return cls(*t) if t else cls(last=epoch)


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _extra_snapshot(extra: dict) -> dict:
    return {k: (v.state_dict() if hasattr(v, "load_state_dict") else copy.deepcopy(v))
            for k, v in extra.items()}


def _extra_load(extra: dict, saved: dict) -> None:
    """Into the user's dict, in place: objects with ``load_state_dict`` load theirs."""
    for k, v in saved.items():
        if hasattr(extra.get(k), "load_state_dict"):
            extra[k].load_state_dict(v)
        else:
            extra[k] = copy.deepcopy(v)


def extra_digest(extra: dict) -> str:
    """Digest of the user's extra state (tensors by their bytes): equal on every replica
    that holds the same step."""
    h = hashlib.sha256()

    def visit(value) -> None:
        if isinstance(value, torch.Tensor):
            h.update(value.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                h.update(str(k).encode())
                visit(value[k])
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        else:
            h.update(repr(value).encode())

    visit(_extra_snapshot(extra))
    return h.hexdigest()[:16]


class TrainState:
    """The user's objects plus the step bookkeeping of one replica (see module docstring).

    ``strategy_state`` is the step strategy's own (e.g. the outer optimizer of local SGD):
    an object with ``state_dict``/``load_state_dict``, or None; ``feed`` the data feed;
    ``shared_optimizers`` the optimizers whose state every replica holds equal after a
    step (``Strategy.shared_optimizers``): the digests cover their state.

    ``step_buffers`` (after ``keep_step_buffers``, for a strategy whose model changes only
    in global steps): the floating-point buffers as of the last step. Forward passes move
    the model's buffers between steps; a snapshot (a joiner's copy, a checkpoint) carries
    these instead, and ``restore_step_buffers`` puts them back when the loop ends, so a
    replica hands on and ends with the state every replica of its step holds."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 extra: dict | None, feed, config: dict):
        self.model, self.optimizer, self.feed, self.config = model, optimizer, feed, config
        self.extra = extra if extra is not None else {}
        self.strategy_state = None
        self.shared_optimizers: tuple = ()
        self.step_buffers: dict[str, torch.Tensor] | None = None
        self.epoch = 0
        self.lineage = Lineage()
        # the branch of the swarm's history of the step ``epoch`` (``RoundPlan.branch``): the
        # Coordinator tells a state from before a fall back by it
        self.branch = 0
        # the model (parameters and buffers) as the user's code built it
        self.init_digest = step_digest(model, 0)
        self.step_checksum = self.init_digest

    def digest(self, epoch: int) -> str:
        """The per-step digest of this state (``step_digest``) for step ``epoch``."""
        return step_digest(self.model, epoch, self.shared_optimizers)

    def full_checksum(self) -> str:
        """The full digest of this state (``checksum``): parameters, floating-point
        buffers and the shared optimizers' state."""
        return checksum(self.model, self.shared_optimizers)

    def keep_step_buffers(self) -> None:
        """From now on, keep the floating-point buffers as of each step (these, now)."""
        self.step_buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()
                             if b.is_floating_point()}

    def restore_step_buffers(self) -> None:
        """Put the buffers as of the last step back into the model (if kept)."""
        if self.step_buffers is None:
            return
        with torch.no_grad():
            for name, b in self.model.named_buffers():
                if name in self.step_buffers:
                    b.copy_(self.step_buffers[name])

    def commit(self, epoch: int, branch: int | None = None) -> None:
        """The global step ``epoch`` (of ``branch``, its plan's; None: unchanged) was
        applied: its lineage, digest, epoch and branch (and the buffers as of it, if
        kept)."""
        self.lineage.apply(epoch)
        self.step_checksum = self.digest(epoch)
        self.epoch = epoch
        if branch is not None:
            self.branch = branch
        if self.step_buffers is not None:
            self.keep_step_buffers()

    def snapshot(self) -> dict:
        model = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        for name, b in (self.step_buffers or {}).items():
            if name in model:  # (a non-persistent buffer is not in the state dict)
                model[name] = b.cpu()
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "lineage": self.lineage.as_tuple(),
            "branch": self.branch,
            "step_checksum": self.step_checksum,
            "init_digest": self.init_digest,
            "model": model,
            "optimizer": self.optimizer.state_dict(),
            "strategy": self.strategy_state.state_dict() if self.strategy_state else None,
            "extra": _extra_snapshot(self.extra),
            "data": self.feed.state_dict() if self.feed is not None else {},
            "rng": _rng_state(),
            "config": self.config,
        }

    def load(self, state: dict, from_donor: bool) -> None:
        """Put ``state`` (a ``snapshot``) into the user's objects. Refuses (``UserError``, one
        line, nothing copied in) a state of another model: a tensor only one side has, or
        of another shape or dtype (``fingerprint_mismatch``: the first difference).
        ``from_donor``: also refuse a model built with other initial parameters (the
        replicas would train different models; a checkpoint may come from other code and
        is not checked for that)."""
        loaded = state.get("model")
        if isinstance(loaded, dict):  # before any tensor is copied: the model stays as built
            diff = fingerprint_mismatch(model_fingerprint(loaded),
                                        model_fingerprint(self.model.state_dict()))
            if diff and from_donor:
                raise UserError("model", f"the donor's model is not this one: {diff} (every "
                                f"replica must build the same model: the same code and "
                                f"settings on every node)")
            if diff:
                raise UserError("model", f"the checkpoint's model is not this one: {diff} "
                                f"(train the model it was saved from, or start a new run: "
                                f"another checkpoint.run_id)")
        if from_donor and state.get("init_digest") not in (None, self.init_digest):
            raise UserError("model", "its initial parameters differ between replicas "
                            f"({self.init_digest} here, {state['init_digest']} on the donor): "
                            "build it deterministically, e.g. torch.manual_seed(session.seed) "
                            "before creating it")
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise UserError("model", f"the state to load does not fit this model or "
                            f"optimizer ({str(exc).splitlines()[0][:200]})") from None
        if self.strategy_state is not None and state.get("strategy") is not None:
            self.strategy_state.load_state_dict(state["strategy"])
        _extra_load(self.extra, state.get("extra") or {})
        if self.feed is not None:
            self.feed.load_state_dict(state.get("data") or {})
        if state.get("rng"):
            _set_rng_state(state["rng"])
        self.epoch = int(state["epoch"])
        self.lineage = Lineage.from_tuple(state.get("lineage"), self.epoch)
        self.branch = int(state.get("branch", 0))  # (a state saved without one: the first)
        # Local SGD: a donor hands over its current (moved-on) parameters; the checksum
        # that identifies the step is the donor's, taken right after that step.
        self.step_checksum = state.get("step_checksum") or self.full_checksum()
        if self.step_buffers is not None:
            self.keep_step_buffers()  # (a snapshot carries the buffers as of its step)
        self.optimizer.zero_grad(set_to_none=True)
