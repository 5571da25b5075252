"""The two step strategies: what a micro-batch does locally and what a global step does.

- ``Collaborative`` (DeDLOC): micro-batches only accumulate gradients; a global step
  averages every participant's mean gradient (weighted by its samples) and applies one
  optimizer step, the same on every replica, so the replicas stay bitwise identical.
- ``LocalSGD`` (Moshpit SGD / DiLoCo): every micro-batch is a local optimizer step; a global
  step averages the parameters, optionally followed by an outer Nesterov step on the
  averaged delta (``OuterNesterov``).

A collaborative step scales the optimizer's learning rates by ``lr_scale`` of the samples it
really averaged (``training.lr_scaling``), for that step only (``scaled_lr``).

Both run their global step on the replica's event loop while the training loop's thread
waits; ``after_backward`` runs in that thread. A fault injected for tests (``"nan"``,
``"shape"``) corrupts what this replica contributes; its peers reject it.
"""

from __future__ import annotations

import contextlib
import math

import torch

from moshray.cluster.collective.averager import Averager
from moshray.cluster.messages import RoundPlan


LR_SCALE_RANGE = (0.25, 2.0)  # a step far off the target moves at most 2x (1/4x) as far


def lr_scale(samples: float, target: int, rule: str) -> float:
    """The factor one collaborative step multiplies the learning rates by.

    ``"sqrt"``: ``sqrt(samples / target)``, the square-root rule for Adam-type optimizers
    (the configured rate is for a step of ``target`` samples), clipped to
    ``LR_SCALE_RANGE``; ``"none"``, or no samples: 1. Pure and exact for equal inputs:
    every replica of a step passes the same averaged ``total_weight`` (a sum of integer
    sample counts), so the replicas stay bitwise identical."""
    if rule == "none" or not samples > 0 or not target > 0:
        return 1.0
    low, high = LR_SCALE_RANGE
    return min(high, max(low, math.sqrt(samples / target)))


@contextlib.contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, factor: float):
    """Inside the block, every param group's ``lr`` times ``factor``; restored after (also
    on error), so a user's learning-rate scheduler keeps owning the rates."""
    if factor == 1.0:
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr


def clip(model: torch.nn.Module, max_norm: float) -> None:
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def corrupt_grads(model: torch.nn.Module, fault: str | None) -> None:
    if fault == "nan":
        for p in model.parameters():
            if p.grad is not None:
                p.grad.fill_(float("nan"))


def _with_fault(tensors: list[torch.Tensor], fault: str | None) -> list[torch.Tensor]:
    if fault == "shape":  # one element too many: peers reject it as a shape mismatch
        return tensors + [torch.zeros(1)]
    return tensors


class Collaborative:
    """DeDLOC steps (see module docstring).

    A global step is ``take_gradients`` (out of the parameters), ``average`` and
    ``finish_step`` (one optimizer step with the average). With
    ``overlap`` the replica's step manager runs the averaging in the background while the
    loop accumulates the next step's gradients on the parameters of the step before (one
    step of delay, as in hivemind's delayed parameter updates); ``finish_step`` then puts
    the new accumulation back after the optimizer step. Every replica applies the same
    average to the same parameters, so they stay bitwise identical either way."""

    outer_state = None

    def __init__(self, grad_clip: float, overlap: bool = False, lr_scaling: str = "none",
                 target_batch_size: int = 1):
        self.grad_clip = grad_clip
        self.overlap = overlap
        self.lr_scaling, self.target_batch_size = lr_scaling, target_batch_size

    def after_backward(self, model, optimizer, fault: str | None) -> None:
        corrupt_grads(model, fault)

    @staticmethod
    def zero_grad_allowed() -> bool:
        """Gradients accumulate until the global step: the loop's ``zero_grad`` waits."""
        return False

    @staticmethod
    def take_gradients(model, micro: int) -> list[torch.Tensor]:
        """This replica's mean gradient over ``micro`` micro-batches, taken out of the
        parameters (their ``grad`` is None after), so that the loop may accumulate again.
        Call at a sync point of the loop."""
        params = list(model.parameters())
        grads = [(p.grad / max(micro, 1)) if p.grad is not None else torch.zeros_like(p)
                 for p in params]
        for p in params:
            p.grad = None
        return grads

    @staticmethod
    async def average(averager: Averager, grads: list[torch.Tensor], plan: RoundPlan,
                      samples: int, timeout_s: float, fault: str | None):
        """``(averaged, report)``: ``grads`` averaged over ``plan`` (weighted by samples)."""
        return await averager.all_reduce(_with_fault(grads, fault), samples, plan, timeout_s)

    def finish_step(self, model, optimizer, averaged: list[torch.Tensor],
                    samples: float = 0.0) -> None:
        """One optimizer step with ``averaged`` (the mean over ``samples``, the report's
        ``total_weight``: it scales the rates, see ``lr_scale``); gradients accumulated
        since ``take_gradients`` are kept for the next step. Call at a sync point of the
        loop."""
        params = list(model.parameters())
        pending = [p.grad for p in params]
        for p, g in zip(params, averaged):
            p.grad = g.to(p.device)
        clip(model, self.grad_clip)
        with scaled_lr(optimizer, lr_scale(samples, self.target_batch_size, self.lr_scaling)):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for p, g in zip(params, pending):
            p.grad = g

    async def global_step(self, model, optimizer, averager: Averager, plan: RoundPlan,
                          samples: int, micro: int, timeout_s: float, fault: str | None):
        grads = self.take_gradients(model, micro)
        averaged, report = await self.average(averager, grads, plan, samples, timeout_s, fault)
        self.finish_step(model, optimizer, averaged, report.total_weight)
        return report


class OuterNesterov:
    """DiLoCo's outer step: Nesterov SGD on the averaged delta from the last anchor."""

    def __init__(self, model: torch.nn.Module, lr: float, momentum: float):
        self.anchor = [p.detach().clone() for p in model.parameters()]
        self.optimizer = torch.optim.SGD(self.anchor, lr=lr, momentum=momentum, nesterov=True)

    @torch.no_grad()
    def step(self, params: list[torch.Tensor]) -> None:
        for anchor, p in zip(self.anchor, params):
            anchor.grad = anchor - p  # outer gradient: the averaged delta
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for anchor, p in zip(self.anchor, params):
            p.copy_(anchor)

    def state_dict(self) -> dict:
        return {"anchor": [a.detach().cpu() for a in self.anchor],
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for a, s in zip(self.anchor, state["anchor"]):
                a.copy_(s)
        self.optimizer.load_state_dict(state["optimizer"])


class LocalSGD:
    """Moshpit SGD / DiLoCo steps (see module docstring)."""

    def __init__(self, grad_clip: float, outer: OuterNesterov | None = None):
        self.grad_clip = grad_clip
        self.outer_state = outer

    def after_backward(self, model, optimizer, fault: str | None) -> None:
        corrupt_grads(model, fault)
        clip(model, self.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @staticmethod
    def zero_grad_allowed() -> bool:
        return True

    async def global_step(self, model, optimizer, averager: Averager, plan: RoundPlan,
                          samples: int, micro: int, timeout_s: float, fault: str | None):
        params = list(model.parameters())
        averaged, report = await averager.all_reduce(
            _with_fault([p.detach() for p in params], fault), samples, plan, timeout_s)
        with torch.no_grad():
            for p, a in zip(params, averaged):
                p.copy_(a)
            if self.outer_state is not None:
                self.outer_state.step(params)
        return report


def make_strategy(training, model: torch.nn.Module, device: torch.device | None = None):
    """The strategy the config's ``training`` section names (``overlap`` resolved for the
    replica's ``device``: see ``TrainingSection.overlaps``)."""
    if training.mode == "local_sgd":
        outer = (OuterNesterov(model, training.outer_lr, training.outer_momentum)
                 if training.outer_optimizer == "nesterov" else None)
        return LocalSGD(training.grad_clip, outer)
    cuda = device is not None and torch.device(device).type == "cuda"
    return Collaborative(training.grad_clip, training.overlaps(cuda), training.lr_scaling,
                         training.target_batch_size)
