"""Replica groups that train together, averaged by shard (the protocol
and its pure parts are group_averaging.py): the driver runs each step's compute phase and
then its averaging phase on every rank of every group. Each rank hosts an ``Averager``, the
swarm's Moshpit peer ``"<name>/r<rank>"``; rank ``r`` averages its local shard (of the
gradients in a collaborative step, of the parameters in a local SGD round) with rank ``r`` of
the other groups over ``rank_plan(epoch, groups, r)``; a group applies the result only if
all its ranks got the whole plan's average (a vote).

``step_together`` and ``local_round`` take one step (one round) and never raise for a
group's failure: the result names the groups that applied it and why the others did not
(``GroupFailure``), for a caller that keeps going without them (group_swarm.py);
``train_together`` takes several steps and raises at the first failure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from moshray.actors.replica.group import ReplicaGroup
from moshray.actors.replica.group_averaging import (
    BatchPart, GroupFailure, GroupPeers, RankStep, StepTogether, rank_plan,
)
from moshray.actors.replica.group_spec import GroupError, GroupTask

log = logging.getLogger(__name__)


def _checked(groups: Sequence[ReplicaGroup], what: str) -> list[GroupPeers]:
    """The groups as the plans see them; ``GroupError`` (one line) when there are none, one
    is not started, or their shards differ (``rank_plan``'s checks)."""
    if not groups:
        raise GroupError(f"{what}: no groups")
    for g in groups:
        g._started(what)
    try:
        peers = [g.peers() for g in groups]
        rank_plan(0, peers, 0)  # the checks: names, world sizes, parallel modes
    except ValueError as exc:
        raise GroupError(f"{what}: {exc}") from None
    return peers


def _gather(groups: Sequence[ReplicaGroup], calls: Sequence[list], what: str
            ) -> tuple[dict[str, list], list[GroupFailure]]:
    """The results of calls already made on every rank of every group (``calls[i]``: group
    ``i``'s refs in rank order), by name, within one deadline (the longest ``timeout_s``);
    a group whose rank failed or timed out is a broken ``GroupFailure`` instead."""
    deadline = time.monotonic() + max(g.config.timeout_s for g in groups)
    results: dict[str, list] = {}
    failures: list[GroupFailure] = []
    for g, refs in zip(groups, calls):
        try:
            results[g.config.name] = g._get(refs, what, deadline)
        except GroupError as exc:
            failures.append(GroupFailure(g.config.name, True, str(exc)))
    return results, failures


def average_phase(groups: Sequence[ReplicaGroup], weights: Sequence[float], method: str,
                  step: int) -> tuple[int, list[ReplicaGroup], list[list[RankStep]],
                                      list[GroupFailure]]:
    """Rank ``r`` of every group averages over ``rank_plan(epoch, groups, r)`` (a fresh
    epoch above every group's last) with the rank method ``method`` (``average_and_apply``:
    the gradients, then the step; ``average_params``: the parameters), each group weighted
    by ``weights[i]``, and the ranks of each group vote. Returns the epoch, the groups that
    applied it, their ranks' outcomes and a ``GroupFailure`` for each other group (broken:
    a rank failed or timed out; not broken: its round was incomplete). Never raises for a
    group's failure; bounded by the longest ``timeout_s``."""
    peers = [g.peers() for g in groups]
    epoch = max(g.epoch for g in groups) + 1
    plans = [rank_plan(epoch, peers, r) for r in range(groups[0].config.world_size)]
    calls = []
    for g, weight in zip(groups, weights):
        g.epoch = epoch
        calls.append([getattr(r, method).remote(plans[rank], weight)
                      for rank, r in enumerate(g.ranks)])
    outcomes, failures = _gather(groups, calls, f"{method} (step {step})")
    applied, ranks = [], []
    for g in groups:
        mine = outcomes.get(g.config.name)
        if mine is None:
            continue
        if all(o.applied for o in mine):
            applied.append(g)
            ranks.append(mine)
        else:
            first = next(o for o in mine if o.reason)
            failures.append(GroupFailure(g.config.name, False,
                                         f"{g.config.name} (rank {first.rank}: {first.reason})"))
    return epoch, applied, ranks, failures


def step_together(groups: Sequence[ReplicaGroup], task: GroupTask) -> StepTogether:
    """One collaborative step of ``groups`` (started, one world size and parallel mode,
    unique names, all holding the same step or none), averaged by shard; never raises for
    a group's failure. The gradient phase runs on every rank of every group at once (the
    global batch of the step split into ``len(groups)`` parts, group ``i`` part ``i``);
    a group whose rank fails or times out there leaves the step (its part with it) and the
    others average without it, so they still apply the step. Then ``average_phase``. A
    group that applied it holds the next step; the others stay at this one (their
    gradients dropped), and the result's ``failures`` name each (broken: close it).
    ``GroupError`` only for groups that cannot step together (see ``_checked``)."""
    _checked(groups, "step_together")
    at = {g.config.name: g.step or 0 for g in groups}
    if len(set(at.values())) != 1:
        raise GroupError(f"step_together: the groups hold different steps ({at}); a group "
                         f"behind joins from one ahead first (join_from)")
    step = groups[0].step or 0
    t0 = time.perf_counter()
    calls = [[r.compute_grads.remote(task, step, BatchPart(i, len(groups))) for r in g.ranks]
             for i, g in enumerate(groups)]
    grads, failures = _gather(groups, calls, f"compute_grads (step {step})")
    live = [g for g in groups if g.config.name in grads]
    t1 = time.perf_counter()
    if not live:
        return StepTogether(step, max(g.epoch for g in groups), (), (), float("nan"), (),
                            t1 - t0, 0.0, (), tuple(failures))
    weights = [float(sum(r.samples for r in grads[g.config.name])) for g in live]
    epoch, applied, ranks, more = average_phase(live, weights, "average_and_apply", step)
    for g in applied:
        g.step = step + 1
    losses = tuple(grads[g.config.name][0].loss for g in live)
    mean = sum(w * x for w, x in zip(weights, losses)) / sum(weights)
    log.info("groups %s: step %d averaged by shard (epoch %d, loss %.4f, %d applied)",
             ",".join(at), step, epoch, mean, len(applied))
    return StepTogether(step, epoch, tuple(g.config.name for g in live), losses, mean,
                        tuple(o.numel for o in ranks[0]) if ranks else (), t1 - t0,
                        time.perf_counter() - t1, tuple(g.config.name for g in applied),
                        tuple(failures + more))


def local_round(groups: Sequence[ReplicaGroup], task: GroupTask, inner_steps: int,
                average_tries: int = 2) -> StepTogether:
    """One local SGD round by shard (group_averaging.py) of ``groups`` (as for
    ``step_together``); never raises for a group's failure. First every group trains
    ``inner_steps`` steps alone (``local_steps``; group ``i`` on part ``i`` of
    ``len(groups)`` of each step's batch); a group whose rank fails or times out leaves
    the round. Then rank ``r`` of every group averages its parameter shard
    (``average_phase`` with ``average_params``). A round none applied is averaged again
    with the groups still whole (a fresh epoch), up to ``average_tries`` times; if still
    none applied, the first whole group keeps its own inner steps as the round's result
    (a plan of one: complete by itself), so the round's work survives while one group
    does. The groups that applied hold step ``first + inner_steps``; the others are in
    ``failures`` and hold no state of the swarm (their parameters are their own inner
    steps'): they join again before they step. ``GroupError`` only as ``step_together``."""
    _checked(groups, "local_round")
    at = {g.config.name: g.step or 0 for g in groups}
    if len(set(at.values())) != 1:
        raise GroupError(f"local_round: the groups hold different steps ({at}); a group "
                         f"behind joins from one ahead first (join_from)")
    if not isinstance(inner_steps, int) or inner_steps < 1:
        raise GroupError(f"local_round: inner_steps must be an integer >= 1, got "
                         f"{inner_steps!r}")
    first = groups[0].step or 0
    t0 = time.perf_counter()
    calls = [[r.local_steps.remote(task, first, inner_steps, BatchPart(i, len(groups)))
              for r in g.ranks] for i, g in enumerate(groups)]
    inner, failures = _gather(groups, calls, f"local_steps (steps {first}+{inner_steps})")
    live = [g for g in groups if g.config.name in inner]
    for g in live:
        g.step = first + inner_steps  # what the ranks hold now (averaged or not)
    t1 = time.perf_counter()
    weights = {g.config.name: float(sum(r.samples for r in inner[g.config.name]))
               for g in live}
    applied: list[ReplicaGroup] = []
    ranks: list[list[RankStep]] = []
    epoch = max(g.epoch for g in groups)
    pending, why = list(live), {}
    for attempt in range(average_tries + 1):
        if not pending:
            break
        if attempt == average_tries:  # the last resort: one group's own round
            pending = pending[:1]
        epoch, applied, ranks, more = average_phase(
            pending, [weights[g.config.name] for g in pending], "average_params", first)
        failures += [f for f in more if f.broken]
        why.update((f.name, f.reason) for f in more if not f.broken)
        if applied:
            break
        pending = [g for g in pending if g.config.name not in {f.name for f in more
                                                               if f.broken}]
    done = {g.config.name for g in applied}
    failed = {f.name for f in failures}
    failures += [GroupFailure(g.config.name, False, why.get(
        g.config.name, f"{g.config.name}: left out of the round's average"))
                 for g in live if g.config.name not in done | failed]
    losses = tuple(inner[g.config.name][0].loss for g in live)
    total = sum(weights.values())
    mean = sum(weights[g.config.name] * x for g, x in zip(live, losses)) / total if total \
        else float("nan")
    log.info("groups %s: steps %d-%d by local SGD, parameters averaged by shard (epoch %d, "
             "loss %.4f, %d applied)", ",".join(at), first, first + inner_steps - 1, epoch,
             mean, len(applied))
    return StepTogether(first, epoch, tuple(g.config.name for g in live), losses, mean,
                        tuple(o.numel for o in ranks[0]) if ranks else (), t1 - t0,
                        time.perf_counter() - t1, tuple(sorted(done)), tuple(failures),
                        inner_steps)


def train_together(groups: Sequence[ReplicaGroup], task: GroupTask,
                   steps: int | None = None) -> list[StepTogether]:
    """Train ``steps`` (default ``task.steps``) collaborative steps with ``groups``, averaged
    by shard (group_averaging.py), one ``step_together`` after the other. The groups must
    be started, of one world size and parallel mode, with unique names, and hold the same
    step (or none: step 0, models built from ``task``). Data: the global batch of step
    ``s`` (``task.batch(s)``) is split into ``len(groups)`` contiguous equal parts, group
    ``g`` (in the order given) training part ``g`` and each of its ranks its slice of that
    (the rows must divide by groups x ranks); a group's weight is its rows. So with no
    failures a step equals one process on the whole batch, and every group holds bitwise
    the same state after it.

    Each phase is bounded by the groups' ``timeout_s``. ``GroupError`` (one line) after a
    step some group did not apply: a rank failed or timed out (the group and rank named;
    that group is marked broken), or its round was incomplete (the reason named). Groups
    that applied it moved on to the next step, the others stay at it."""
    steps = task.steps if steps is None else steps
    done: list[StepTogether] = []
    for _ in range(steps):
        result = step_together(groups, task)
        if result.failures:
            raise GroupError(f"train_together: step {result.step} not applied by group(s) "
                             f"{'; '.join(f.reason for f in result.failures)}")
        done.append(result)
    return done
