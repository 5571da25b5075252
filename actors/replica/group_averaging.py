"""Replica groups averaged with each other by shard, and joins by shard.

Several groups of the same world size and parallel mode train one model together. Each
collaborative step has two phases, which the driver runs one after the other on every rank
of every group (``group_together.step_together``):

1. *gradients*: each group computes the gradient of its own part of the step's global batch
   (``BatchPart``), all its ranks together; under FSDP2 each rank then holds the gradient of
   its own shard (the DTensor's local shard), under DDP every rank the whole gradient;
2. *average and apply*: rank ``r`` of every group takes part in one Moshpit round over the
   plan ``rank_plan(epoch, groups, r)``, whose peers are the rank-``r`` actors of the groups
   (``rank_peer_id``: ``"<group>/r<rank>"``), averaging its local gradients (plus persistent
   float buffers) weighted by the group's samples; then the ranks of each group vote, and
   every rank applies one optimizer step with the averaged gradient only if every rank of
   its group averaged with every group of the plan (``incomplete``). So rank ``r`` only
   ever moves its own shard (the replicate dimension of HSDP): no rank gathers the model.

Local SGD by shard has the same two phases per round: each group first trains ``H`` inner
steps on its own part of each step's batch with its own optimizer (``local_steps``), then
rank ``r`` of every group averages its *parameter* shard (``parameter_tensors``: the local
shards of the parameters, plus the float buffers) over the same ``rank_plan``, and the
group writes the average only if every rank got the whole plan's (the same vote). The
optimizer state stays each group's own (as DiLoCo's inner optimizers); a joining group
copies its donor's. After a complete round every group holds bitwise the same parameters.

Bitwise equality: the collective hands every member of a round the same bytes (canonical
member order, ``cluster/collective/round.py``), the groups start from the same state and
their optimizers are deterministic, so after a complete step every group holds bitwise the
same shards. ``rank_plan`` lays the groups out on the same grid positions for every rank
(group names contain no ``/``, so the peer ids of any rank sort like the group names), so
DDP ranks, whose inputs within a group are equal, also compute equal bytes.

A step that is not complete for some rank (a member of its round missed the deadline or
died, a contribution was rejected, the mean errored) is applied by no rank of that group:
its grads are dropped and its state stays that of the step before, whole and consistent.
The driver reports it (``GroupError``); such a group catches up by joining again.

A join by shard: rank ``r`` of a donor group puts its shard state (model and optimizer state
as the group shards it: local shards only, on the CPU) into the object store
(``local_state``, ``ShardHandoff``), and rank ``r`` of the joining group fetches it by
reference and copies it into its own shards (``fill_local_state``), after checking the
layouts match (``layout_difference``). Both sides digest what they hold (``state_digest``):
a join ends with the joiner holding exactly the donor's state, or fails.

This module holds the messages, the pure decisions and the rank-side tensor work (torch,
no Ray); the ``GroupRank`` actor (``group_rank.py``) calls it and moves the bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moshray.actors.replica.group_checkpoint import first_entry_difference
from moshray.cluster.collective.grid import DEFAULT_MAX_GROUP, plan_grid
from moshray.cluster.messages import AllReduceReport, RoundPlan

# -- messages ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupPeers:
    """One group as the plans see it: its name (no ``/``), parallel mode and its ranks'
    actor handles in rank order."""

    name: str
    parallel: str
    handles: tuple[Any, ...] = field(compare=False, repr=False)

    @property
    def world_size(self) -> int:
        return len(self.handles)


@dataclass(frozen=True)
class BatchPart:
    """The group's share of a step's global batch: contiguous slice ``index`` of ``count``
    (then each rank its slice of that: ``rank_rows``)."""

    index: int
    count: int


@dataclass(frozen=True)
class GradReport:
    """A rank after the gradient phase: the step, the group's mean loss on its part and the
    rows this rank trained (the group's weight is the sum over its ranks)."""

    rank: int
    step: int
    loss: float
    samples: int


@dataclass(frozen=True)
class RankStep:
    """A rank after the averaging phase: whether its group applied the step (every rank
    voted yes), why not (one line), the peers whose weight its average holds and how many
    values it averaged (FSDP2: its shard's; DDP: the whole model's)."""

    rank: int
    step: int
    applied: bool
    reason: str | None
    contributors: tuple[str, ...]
    numel: int
    seconds: float


@dataclass(frozen=True)
class ShardLayout:
    """What a rank's shard state is: ``entries`` the (path, local shape) of every tensor in
    it (``local_state``), compared before a join copies anything."""

    world_size: int
    parallel: str
    optimizer: str
    entries: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class ShardHandoff:
    """A donor rank's shard state at ``step``: its layout, its digest and a reference to the
    bytes in the object store (nested in a tuple: Ray hands the joiner the reference, and
    the joiner fetches the bytes straight from the donor's node)."""

    rank: int
    step: int
    layout: ShardLayout
    digest: str
    refs: tuple[Any, ...] = field(repr=False)


@dataclass(frozen=True)
class JoinAnswer:
    """A joining rank's answer: the step it now holds and the digest of its shard state, or
    why the group refused the join (nothing copied then)."""

    step: int | None
    digest: str | None
    refused: str | None = None


@dataclass(frozen=True)
class LocalReport:
    """A rank after the inner steps of a local SGD round (``local_steps``): the steps it
    trained (``first`` .. ``first + steps - 1``), the group's mean loss of the last one, the
    rows this rank trained over all of them (the group's weight is the sum over its ranks)
    and the seconds they took."""

    rank: int
    first: int
    steps: int
    loss: float
    samples: int
    seconds: float


@dataclass(frozen=True)
class GroupFailure:
    """A group that did not apply a step, and why (one line). ``broken``: a rank failed or
    timed out, so the group must be closed; otherwise its round was incomplete and the
    group is whole, holding the state it had before the step's averaging phase."""

    name: str
    broken: bool
    reason: str


@dataclass(frozen=True)
class StepTogether:
    """One collaborative step: the groups (in the order given), each group's mean loss on
    its part, the samples-weighted mean over groups, the values each rank averaged
    (``RankStep.numel`` by rank, the same in every group) and the driver's seconds for each
    phase."""

    step: int
    epoch: int
    groups: tuple[str, ...]
    losses: tuple[float, ...]
    loss: float
    rank_numel: tuple[int, ...]
    grad_seconds: float
    average_seconds: float
    # Which groups applied it, and the groups that did not (each with why). ``steps``: the
    # steps of each group the result covers (1; a local SGD round: its inner steps).
    applied: tuple[str, ...] = ()
    failures: tuple[GroupFailure, ...] = ()
    steps: int = 1


# -- pure decisions --------------------------------------------------------------------------


def rank_peer_id(group: str, rank: int) -> str:
    """The averaging peer id of rank ``rank`` of group ``group``."""
    return f"{group}/r{rank}"


def rank_plan(epoch: int, groups: Sequence[GroupPeers], rank: int, *,
              max_group: int = DEFAULT_MAX_GROUP, compression: str = "none",
              seed: int = 0) -> RoundPlan:
    """The plan rank ``rank`` of every group averages over in ``epoch``: a Moshpit grid
    (``grid.plan_grid``) whose peers are the rank-``rank`` actors of ``groups``, each with
    share 1. Every rank's plan puts each group on the same grid position (see module
    docstring). Raises ``ValueError`` (one line) for no groups, a repeated name or one with
    ``/``, groups of different world sizes or parallel modes (their shards differ), or a
    rank outside the groups."""
    if not groups:
        raise ValueError("rank_plan: no groups")
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"rank_plan: group names must be unique, got {names}")
    if any("/" in n or not n for n in names):
        raise ValueError(f"rank_plan: a group name must be non-empty without '/', got {names}")
    kinds = {(g.world_size, g.parallel) for g in groups}
    if len(kinds) != 1:
        seen = ", ".join(f"{g.name}: {g.world_size} x {g.parallel}" for g in groups)
        raise ValueError(f"rank_plan: groups average by shard only with the same world size "
                         f"and parallel mode ({seen})")
    world = groups[0].world_size
    if not 0 <= rank < world:
        raise ValueError(f"rank_plan: rank {rank} is not in groups of {world} ranks")
    ids = [rank_peer_id(n, rank) for n in names]
    return RoundPlan(epoch=epoch, grid=plan_grid(ids, max_group, epoch=epoch, seed=seed),
                     shares=tuple((p, 1.0) for p in ids),
                     handles=tuple((p, g.handles[rank]) for p, g in zip(ids, groups)),
                     compression=compression)


def rank_rows(part: BatchPart, rank: int, world: int) -> tuple[int, int]:
    """Which slice of the global batch rank ``rank`` of a ``world``-rank group trains when
    its group has ``part``: ``(index, count)`` for ``group.rank_slice``."""
    return part.index * world + rank, part.count * world


def incomplete(report: AllReduceReport, plan: RoundPlan) -> str | None:
    """Why an average is not the whole plan's (one line), or None when every participant's
    weight is in every part of it: such a step must not be applied."""
    missing = sorted(set(plan.participants) - set(report.contributors))
    if not missing and not report.partial_contributors and not report.rejections:
        return None
    what = [f"missing {', '.join(missing)}"] if missing else []
    if report.rejections:
        what.append("rejected " + ", ".join(sorted({f"{r.sender} ({r.reason.value})"
                                                    for r in report.rejections})))
    return (f"epoch {plan.epoch}: averaged {len(report.contributors)} of "
            f"{len(plan.participants)} peers ({'; '.join(what) or 'partial parts'})")


def layout_difference(donor: ShardLayout, mine: ShardLayout) -> str | None:
    """The first way a donor rank's shard state does not fit this rank's (one line), or
    None: the same world size, parallel mode, optimizer, and entries with equal local
    shapes, in the donor's order, then this rank's extra ones."""
    for what in ("world_size", "parallel", "optimizer"):
        if getattr(donor, what) != getattr(mine, what):
            return f"{what}: the donor has {getattr(donor, what)}, this group " \
                   f"{getattr(mine, what)}"
    return first_entry_difference(
        donor.entries, mine.entries,
        missing="{name} is in the donor's state, not in this rank's",
        extra="{name} is in this rank's state, not in the donor's",
        shape="{name} has local shape {theirs} at the donor, {ours} here")


# -- the rank side (torch; the GroupRank's compute thread calls these) ------------------------


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds (a DTensor's local shard, else itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def averaged_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers a step averages: persistent floating-point ones (running statistics),
    whole on every rank (FSDP2 does not shard buffers)."""
    persistent = set(model.state_dict().keys())
    return [b for name, b in model.named_buffers()
            if name in persistent and torch.is_floating_point(b)]


def averaged_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What rank ``r`` averages, in a fixed order: the local shard of every parameter's
    gradient (a parameter without one gets zeros), then ``averaged_buffers``."""
    grads = []
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(local_part(p.grad))
    return grads + averaged_buffers(model)


def parameter_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What rank ``r`` averages in a local SGD round, in a fixed order: the local shard of
    every parameter (not its gradient), then ``averaged_buffers``."""
    return [local_part(p.detach()) for p in model.parameters()] + averaged_buffers(model)


def write_averaged(model: torch.nn.Module, values: Sequence[torch.Tensor],
                   targets: Sequence[torch.Tensor] | None = None) -> None:
    """Put the averaged ``values`` in place of ``targets`` (default
    ``averaged_tensors(model)``; ``parameter_tensors(model)`` for a local SGD round)."""
    targets = averaged_tensors(model) if targets is None else targets
    if len(targets) != len(values):
        raise ValueError(f"{len(values)} averaged tensors for {len(targets)} places")
    with torch.no_grad():
        for target, value in zip(targets, values):
            target.copy_(value)


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any, Any]]:
    """(path, container, key, value) of every leaf of nested dicts and lists."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in items:
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, (dict, list)):
            yield from _leaves(value, path)
        else:
            yield path, tree, key, value


def _state_tree(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The model and optimizer state as this group shards it (``get_state_dict``: FSDP2
    DTensor shards, DDP whole tensors; a fresh optimizer gets its zero state here)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def local_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shard state, flat by path: every tensor as its local shard on the CPU,
    the other leaves (hyperparameters, parameter names) as they are."""
    return {path: local_part(v).detach().cpu() if isinstance(v, torch.Tensor) else v
            for path, _, _, v in _leaves(_state_tree(model, opt))}


def shard_layout(state: dict[str, Any], world_size: int, parallel: str,
                 optimizer: str) -> ShardLayout:
    return ShardLayout(world_size, parallel, optimizer,
                       tuple((p, tuple(v.shape)) for p, v in state.items()
                             if isinstance(v, torch.Tensor)))


def fill_local_state(model: torch.nn.Module, opt: torch.optim.Optimizer,
                     donor: dict[str, Any]) -> None:
    """Copy a donor rank's ``local_state`` into this rank's shards (in place) and hand the
    optimizer its state. The layouts must match (``layout_difference``)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    tree = _state_tree(model, opt)
    with torch.no_grad():
        for path, container, key, value in _leaves(tree):
            if isinstance(value, torch.Tensor):
                local_part(value).copy_(donor[path])
            else:
                container[key] = donor[path]
    set_state_dict(model, opt, model_state_dict=tree["model"], optim_state_dict=tree["optim"])


def state_digest(state: dict[str, Any]) -> str:
    """sha256 (16 hex digits) of a ``local_state``: paths, tensor bytes, other leaves'
    ``repr`` (equal digests: bitwise the same state)."""
    h = hashlib.sha256()
    for path in sorted(state):
        value = state[path]
        h.update(path.encode())
        if isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            h.update(str(value.dtype).encode() + flat.view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()[:16]
