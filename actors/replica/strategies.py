"""Step strategies: what a micro-batch does locally and what a global step averages and
applies. A new strategy is one ``Strategy`` subclass with ``@register``; the config's
``training.mode`` names come from this registry (``strategy_names``).

- ``Collaborative`` (``"collaborative"``, DeDLOC): micro-batches only accumulate
  gradients; a global step averages every participant's mean gradient (weighted by its
  samples) and applies one optimizer step, the same on every replica, so the replicas stay
  bitwise identical (parameters, buffers and optimizer state).
- ``LocalSGD`` (``"local_sgd"``, Moshpit SGD / DiLoCo): every micro-batch is a local
  optimizer step; a global step averages the parameters, optionally followed by an outer
  Nesterov step on the averaged delta (``OuterNesterov``; with it the wire carries each
  replica's outer gradient ``anchor - params``, so an 8- or 4-bit codec quantises the small
  delta rather than the weights). The inner optimizers' state stays each replica's own
  (as in DiLoCo); the outer optimizer's is shared. With the outer step the loop's end
  leaves every replica at the last anchor (``settle``: the local steps no round averaged
  are dropped), so a run returns and saves the model the swarm agreed on; without it each
  replica keeps its own local steps since the last average. With the outer step it can overlap
  (``training.overlap = "on"``; ``auto`` leaves it off): Streaming DiLoCo's overlapped
  outer step (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication"),
  with the whole model as one fragment: round k's outer gradient travels while round
  k+1's inner steps run; when the average arrives the anchor takes the outer Nesterov
  step and the replica's parameters become ``new anchor + (p_now - p_sent)``, its own
  progress since it sent kept as a delta on the new anchor (where the paper mixes the
  local and the new global parameters, ``a * p_now + (1 - a) * new anchor``; with the
  delta each inner step counts once, in the next round's outer gradient, and a round
  whose replicas made no progress meanwhile is bitwise the non-overlapped one). The
  step's digest is taken with the parameters at the new anchor (``resume`` puts the
  progress back after the commit), so it covers what every replica of the step holds
  equal, and the loop's end leaves every replica at the anchor (``settle``).

Both average the model's floating-point buffers (BatchNorm running statistics, ...) in
every global step, weighted like the rest of the contribution (DDP broadcasts them from
rank 0 instead; an average is what a swarm without a fixed rank 0 can agree on). Integer
buffers (BatchNorm's ``num_batches_tracked``) are counters of this replica's own forward
passes: they are neither averaged (a wire codec such as fp16 cannot carry large integers)
nor part of the digests. Buffers go through the round's wire codec like the gradients.

A global step runs on the replica's event loop while the training loop's thread waits;
``after_backward`` runs in that thread, inside the loop's ``opt.step()``: the user has run
``loss.backward()`` and may have clipped, unscaled (``GradScaler``) or inspected the
gradients since. Strategies hold no fault-injection hook: the chaos bench corrupts what a
replica contributes by wrapping its averager (``jobs/bench/chaos_faults.py``).

Nothing is clipped and no learning rate is rescaled unless the config turns it on
(``training.grad_clip``, ``training.lr_scaling``: both off by default; their docstrings in
``jobs/config/sections.py`` give the evidence).

torch is imported where it is used, so that the config can read ``strategy_names``
without loading it (every process that runs a step has loaded it already).
"""

from __future__ import annotations

import abc
import contextlib
import math
from typing import TYPE_CHECKING, Any, ClassVar

from moshray.cluster.messages import PeerPlan

if TYPE_CHECKING:
    import torch

    from moshray.cluster.collective.averager import Averager


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
def scaled_lr(optimizer, factor: float):
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


def clip(model, max_norm: float) -> None:
    if max_norm > 0:
        import torch

        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def averaged_buffers(model) -> list:
    """The buffers a global step averages: the floating-point ones, in ``model.buffers()``
    order (the same on every replica of one model)."""
    return [b for b in model.buffers() if b.is_floating_point()]


def load_buffers(model, averaged: list) -> None:
    """Copy ``averaged`` (``averaged_buffers`` order) into the model's buffers, in place."""
    import torch

    with torch.no_grad():
        for b, a in zip(averaged_buffers(model), averaged):
            b.copy_(a.to(device=b.device, dtype=b.dtype))


# ------------------------------------------------------------------------ the interface


class Strategy(abc.ABC):
    """One way of taking global steps. Subclasses set ``name`` and ``@register``.

    A global step has three parts, which the replica's step manager calls at the
    training loop's sync points (the loop's thread waits meanwhile): ``contribution``
    (what this replica averages, taken out of its model), ``average`` (one round of the
    collective over the plan, weighted by samples) and ``apply`` (the average into the
    model, optimizer and buffers). ``global_step`` runs the three in a row; with
    ``overlap`` the manager runs ``average`` in the background while the loop computes
    the next micro-batches and calls ``apply`` at a later sync point.

    After ``apply`` every replica of the step holds the same parameters, floating-point
    buffers and ``shared_optimizers`` state (the per-step digest covers exactly those).
    Errors: a strategy never raises for a peer's failure (the averager's deadlines bound
    the round and its report names who was missing)."""

    name: ClassVar[str]
    can_overlap: ClassVar[bool] = False  # ``training.overlap`` may turn ``overlap`` on
    overlap_auto: ClassVar[bool] = False  # ``overlap = "auto"`` turns it on on a GPU
    default_codec: ClassVar[str] = "none"  # the wire codec ``compression = "auto"`` means
    # The model moves between global steps (local optimizer steps): the step's digest, not
    # the current state's, identifies the step a replica holds.
    local_updates: ClassVar[bool] = False
    overlap: bool = False  # ``average`` may run while the loop goes on
    outer_state: Any = None  # state of its own that travels with the model (or None)

    @classmethod
    @abc.abstractmethod
    def from_config(cls, training, model, device=None) -> "Strategy":
        """The strategy for the config's ``training`` section, on ``device``."""

    @classmethod
    def overlap_refusal(cls, training) -> str | None:
        """Why this strategy cannot overlap its steps with the other settings of
        ``training`` (one line, for the config's error), or None. Pure."""
        return None

    @abc.abstractmethod
    def after_backward(self, model, optimizer) -> None:
        """The local part of a micro-batch (loop thread, in the loop's ``opt.step()``): the
        parameters' ``grad`` holds this micro-batch's gradient as the user left it (clipped,
        unscaled, ...). It leaves no gradient behind that a later micro-batch would add to,
        so the loop's ``opt.zero_grad()`` is the user's own (it clears what a step skipped
        by ``GradScaler`` left)."""

    def discard_pending(self) -> None:
        """Forget what was accumulated toward the next step (the state was replaced by a
        donor's or a checkpoint's)."""

    def resume(self, model) -> None:
        """After ``apply`` and the step's commit (its digest is taken in between): put back
        into the model what the loop did while the step was averaged, if ``apply`` left it
        out. Nothing here: ``apply`` leaves the model as it goes on."""

    def settle(self, model) -> None:
        """The loop ended (after its last step was applied): leave the model as every
        replica of that step holds it. Nothing here: the model is that already."""

    @abc.abstractmethod
    def contribution(self, model, micro: int) -> list:
        """The tensors this replica averages for a step after ``micro`` micro-batches;
        their order and shapes are the same on every replica of the model."""

    @abc.abstractmethod
    def apply(self, model, optimizer, averaged: list, total_weight: float) -> None:
        """Put ``averaged`` (``contribution``'s layout; the mean over ``total_weight``
        samples) into the model, its buffers and the optimizer state."""

    def shared_optimizers(self, optimizer) -> tuple:
        """The optimizers whose state every replica holds equal after a step."""
        return (optimizer,)

    def numel(self, model) -> int:
        """The length of the flattened tensor this replica averages."""
        return (sum(p.numel() for p in model.parameters())
                + sum(b.numel() for b in averaged_buffers(model)))

    @staticmethod
    async def average(averager: "Averager", tensors: list, plan: PeerPlan, samples: int,
                      timeout_s: float):
        """``(averaged, report)``: ``tensors`` averaged over ``plan``, weighted by samples."""
        return await averager.all_reduce(tensors, samples, plan, timeout_s)

    async def global_step(self, model, optimizer, averager: "Averager", plan: PeerPlan,
                          samples: int, micro: int, timeout_s: float):
        """One whole global step; returns the round's report."""
        averaged, report = await self.average(
            averager, self.contribution(model, micro), plan, samples, timeout_s)
        self.apply(model, optimizer, averaged, report.total_weight)
        self.resume(model)  # (nothing moved meanwhile: the loop waited)
        return report


STRATEGIES: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` the strategy of ``training.mode = cls.name``. Raises
    ``ValueError`` for a name already taken by another class."""
    other = STRATEGIES.get(cls.name)
    if other is not None and other is not cls:
        raise ValueError(f"strategy {cls.name!r} is registered twice ({other.__name__}, "
                         f"{cls.__name__}): give the new one another name")
    STRATEGIES[cls.name] = cls
    return cls


def strategy_class(name: str) -> type[Strategy]:
    """The strategy registered as ``name``; ``ValueError`` naming the choices if none."""
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ValueError(f"training.mode {name!r} names no strategy: use one of "
                         f"{', '.join(STRATEGIES)}")
    return cls


def strategy_names() -> tuple[str, ...]:
    """The registered names, in registration order (the config's ``training.mode``)."""
    return tuple(STRATEGIES)


def make_strategy(training, model, device=None) -> Strategy:
    """The strategy the config's ``training`` section names (``overlap`` resolved for the
    replica's ``device``: see ``TrainingSection.overlaps``). ``ValueError`` for a mode no
    strategy is registered under."""
    return strategy_class(training.mode).from_config(training, model, device)


# ------------------------------------------------------------------------ the strategies


@register
class Collaborative(Strategy):
    """DeDLOC steps (see module docstring).

    Each micro-batch's gradient is added to a sum the strategy holds (``accum``: the
    loop's ``opt.step()`` moves it there, so the user's clipping or unscaling acts on one
    micro-batch, as in torch); ``contribution`` takes the mean gradient out of that sum
    (and the buffers); ``apply`` is one optimizer step with the average. With ``overlap``
    the replica's step manager runs the averaging in the background while the loop
    accumulates the next step's gradients on the parameters of the step before (one step
    of delay, as in hivemind's delayed parameter updates), and the buffers' average (taken
    when the step began) replaces what the forward passes in between changed. Every
    replica applies the same average to the same parameters, so they stay bitwise
    identical either way (the buffers as of the last step travel and end the loop:
    ``TrainState.step_buffers``)."""

    name = "collaborative"
    can_overlap = True
    overlap_auto = True  # the same update, one step later: on wherever it pays
    default_codec = "fp16"  # gradients within the bound documented in codecs.py

    def __init__(self, grad_clip: float, overlap: bool = False, lr_scaling: str = "none",
                 target_batch_size: int = 1):
        self.grad_clip = grad_clip
        self.overlap = overlap
        self.lr_scaling, self.target_batch_size = lr_scaling, target_batch_size
        self.accum: list | None = None  # the micro-batches' gradient sum, per parameter

    @classmethod
    def from_config(cls, training, model, device=None) -> "Collaborative":
        import torch

        cuda = device is not None and torch.device(device).type == "cuda"
        return cls(training.grad_clip, training.overlaps(cuda), training.lr_scaling,
                   training.target_batch_size)

    def after_backward(self, model, optimizer) -> None:
        """Add the micro-batch's gradient (as the user left it) to the step's sum and take
        it out of the parameters (their ``grad`` is None after)."""
        params = list(model.parameters())
        if self.accum is None:
            self.accum = [None] * len(params)
        for i, p in enumerate(params):
            if p.grad is None:
                continue
            if self.accum[i] is None:
                self.accum[i] = p.grad
            else:
                self.accum[i].add_(p.grad)
            p.grad = None

    def discard_pending(self) -> None:
        self.accum = None

    def take_gradients(self, model, micro: int) -> list:
        """This replica's mean gradient over ``micro`` micro-batches (zeros for a parameter
        that got none); the sum starts over. Call at a sync point of the loop."""
        params = list(model.parameters())
        accum, self.accum = self.accum or [None] * len(params), None
        return [(a / max(micro, 1)) if a is not None else p.detach().new_zeros(p.shape)
                for p, a in zip(params, accum)]

    def contribution(self, model, micro: int) -> list:
        buffers = [b.detach().clone() for b in averaged_buffers(model)]
        return self.take_gradients(model, micro) + buffers

    def apply(self, model, optimizer, averaged: list, total_weight: float) -> None:
        n = len(list(model.parameters()))
        self.finish_step(model, optimizer, averaged[:n], total_weight)
        load_buffers(model, averaged[n:])

    def finish_step(self, model, optimizer, averaged: list, samples: float = 0.0) -> None:
        """One optimizer step with ``averaged`` gradients (the mean over ``samples``, the
        report's ``total_weight``: it scales the rates if ``lr_scaling`` says so, see
        ``lr_scale``); clipped to ``grad_clip`` if that is on. The sum accumulated since
        ``take_gradients`` (an overlapped step's) is untouched; a gradient the loop left
        on a parameter is put back after. Call at a sync point of the loop."""
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


class OuterNesterov:
    """DiLoCo's outer step: Nesterov SGD on the averaged delta from the last anchor."""

    def __init__(self, model, lr: float, momentum: float):
        import torch

        self.anchor = [p.detach().clone() for p in model.parameters()]
        self.optimizer = torch.optim.SGD(self.anchor, lr=lr, momentum=momentum, nesterov=True)

    def step(self, params: list) -> None:
        import torch

        with torch.no_grad():
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
        import torch

        with torch.no_grad():
            for a, s in zip(self.anchor, state["anchor"]):
                a.copy_(s)
        self.optimizer.load_state_dict(state["optimizer"])


@register
class LocalSGD(Strategy):
    """Moshpit SGD / DiLoCo steps (see module docstring).

    With ``overlap`` (only with the outer step: ``overlap_refusal``) a step has four
    parts. ``contribution`` keeps a copy of the parameters it was taken from (``sent``)
    and sends ``anchor - p_sent``; the loop goes on with local steps while the round runs.
    ``apply`` computes the loop's progress since (``p_now - p_sent``, into ``sent``'s
    storage), takes the outer step exactly as without overlap (the parameters end at the
    new anchor, the same on every replica) and keeps the progress; the step manager
    commits (the digest covers the parameters at the anchor, the averaged buffers and the
    outer optimizer's state: all equal across the step's replicas); ``resume`` adds the
    progress back: ``p = new anchor + (p_now - p_sent)``. The buffers take the average
    sent (taken when the step began), as in ``Collaborative``. With no progress in between
    the step is bitwise the non-overlapped one. ``settle`` (the loop's end) puts the last
    anchor and its buffers back, dropping the local steps no round averaged, so every
    replica ends with the same model. Memory: one more copy of the parameters (``sent``)
    and of the floating-point buffers. ``ValueError`` for ``overlap`` without ``outer``
    (the config refuses that first)."""

    name = "local_sgd"
    local_updates = True
    can_overlap = True  # with the outer step (``overlap_refusal``); ``auto`` leaves it off:
    # the overlapped outer step changes the optimisation (one round of staleness)

    def __init__(self, grad_clip: float, outer: OuterNesterov | None = None,
                 overlap: bool = False):
        if overlap and outer is None:
            raise ValueError("an overlapped local_sgd step needs the outer optimizer: "
                             "its anchor is what every replica merges its progress onto")
        self.grad_clip = grad_clip
        self.outer_state = outer
        self.overlap = overlap
        self.sent: list | None = None  # overlap: the parameters the contribution was taken from
        self.progress: list | None = None  # overlap: p_now - p_sent, from apply to resume
        self.step_buffers: list | None = None  # overlap: the buffers as of the last step

    @classmethod
    def from_config(cls, training, model, device=None) -> "LocalSGD":
        import torch

        outer = (OuterNesterov(model, training.outer_lr, training.outer_momentum)
                 if training.outer_optimizer == "nesterov" else None)
        cuda = device is not None and torch.device(device).type == "cuda"
        return cls(training.grad_clip, outer, training.overlaps(cuda))

    @classmethod
    def overlap_refusal(cls, training) -> str | None:
        """Overlap needs the outer step: its anchor, the same on every replica, is what each
        replica's own progress is merged onto (a plain average has none)."""
        if training.outer_optimizer != "nesterov":
            return ("overlaps local_sgd steps only with the outer step (its anchor is what "
                    "each replica merges its progress onto): set training.outer_optimizer = "
                    "\"nesterov\" or overlap = \"off\"")
        return None

    def after_backward(self, model, optimizer) -> None:
        """One local optimizer step with the micro-batch's gradient (clipped to
        ``grad_clip`` if that is on); the gradients are cleared after."""
        clip(model, self.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def discard_pending(self) -> None:
        """Drop the round in flight (its progress, the buffers of the step before): the
        state was replaced."""
        self.sent = self.progress = self.step_buffers = None

    def shared_optimizers(self, optimizer) -> tuple:
        """Only the outer optimizer: the inner ones step on each replica's own batches."""
        return (self.outer_state.optimizer,) if self.outer_state is not None else ()

    def contribution(self, model, micro: int) -> list:
        """The parameters, or with the outer step DiLoCo's outer gradient ``anchor - p``
        (the anchor is the same on every replica, so averaging it is averaging the
        parameters; a lossy wire codec then quantises small deltas, not whole weights),
        then the floating-point buffers. With ``overlap`` the tensors are copies (the loop
        moves the model while they are averaged) and ``p`` is kept as ``sent``."""
        params = [p.detach() for p in model.parameters()]
        buffers = averaged_buffers(model)
        if self.overlap:
            self.sent = [p.clone() for p in params]
            buffers = [b.detach().clone() for b in buffers]
        if self.outer_state is not None:
            params = [a - p for a, p in zip(self.outer_state.anchor, params)]
        return [t.detach() for t in params + buffers]

    def apply(self, model, optimizer, averaged: list, total_weight: float) -> None:
        """The average into the model: without the outer step the parameters become the
        averaged ones; with it the anchor takes the outer step on the averaged delta and
        the parameters become the new anchor. With ``overlap`` the loop's progress since
        ``contribution`` is kept for ``resume`` (none if the round was dropped:
        ``discard_pending``)."""
        import torch

        params = list(model.parameters())
        with torch.no_grad():
            if self.overlap and self.sent is not None:  # p_now - p_sent, in sent's storage
                self.progress = [torch.sub(p, s, out=s) for p, s in zip(params, self.sent)]
            self.sent = None
            if self.outer_state is None:
                for p, a in zip(params, averaged):
                    p.copy_(a)
            else:  # averaged outer gradient: p = anchor - delta, then the Nesterov step
                for p, anchor, delta in zip(params, self.outer_state.anchor, averaged):
                    p.copy_(anchor - delta)
                self.outer_state.step(params)
        load_buffers(model, averaged[len(params):])
        if self.overlap:
            self.step_buffers = [b.detach().clone() for b in averaged_buffers(model)]

    def resume(self, model) -> None:
        """``p = new anchor + (p_now - p_sent)``: the progress ``apply`` kept, added back."""
        import torch

        progress, self.progress = self.progress, None
        if progress is None:
            return
        with torch.no_grad():
            for p, d in zip(model.parameters(), progress):
                p.add_(d)

    def settle(self, model) -> None:
        """With the outer step: the parameters as of the last step (the anchor, the model
        every replica of that step holds; with ``overlap`` also that step's averaged
        buffers); the local steps since, never averaged, are dropped. Without it the
        parameters stay this replica's own (its local steps since the last average)."""
        import torch

        if self.outer_state is None:
            return
        self.sent = self.progress = None
        with torch.no_grad():
            for p, anchor in zip(model.parameters(), self.outer_state.anchor):
                p.copy_(anchor)
        if self.step_buffers is not None:
            load_buffers(model, self.step_buffers)
