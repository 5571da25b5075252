"""Plans made ahead: the next step planned before its peers are at its epoch (pure).

After a preemption notice the staying peers must get a plan without the noticed node at
once, not after the step in flight and their next samples (``CoordinatorCore._replan``).
``ProgressTracker.plan_ahead`` then plans epoch ``e + 1`` right after the plan of the
current epoch ``e``, whether or not its participants have applied step ``e`` yet: over the
*staying* peers (``staying``), each of which holds step ``e`` or takes part in it. A replica
keeps a plan of ``state.epoch + 2`` until it has applied the step before, then runs it at
its next micro-batch (``StepManager``), so every participant runs step ``e + 1`` on the state
of step ``e`` with what it has accumulated since: no step is lost, repeated or skipped, and
the averaging keeps every replica bitwise identical. The noticed node's peers finish step
``e`` (they take part in it) and are in no plan after it.

``PlanAhead`` is the tracker's memory of such a plan:

- ``prior``: the plan of epoch ``e`` while it may still be in flight. Peers at ``e - 1`` in it
  are finishing a published step, not behind (``next_plan``); a member taking part in it
  blocks a fall-back below ``e`` (``ProgressTracker._may_fall_back``). At most one plan is
  made ahead of the steps in flight: another notice waits until ``prior`` is applied by every
  ready member that takes part in it (``settle``), then plans ahead of the next one.
- ``seen``: the newest report of each participant at epoch ``e``. A plan made ahead knows
  little of the samples it will average; its ``StepRecord`` is completed from these as they
  come (``count``), so metrics count the samples and loss the step was taken with.

Everything that forgets the plans (a fall-back, a restart's adoption, a checkpoint's
resume) forgets this too (``clear``). Failure behaviour is the one of any published plan:
a participant that dies before or inside the step is left out by the round's deadlines,
and one that does not apply step ``e`` reports behind it and is told to resync.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace

from .membership import Membership
from .messages import RoundPlan


@dataclass
class PlanAhead:
    """The tracker's memory of the latest plan while it is one made ahead (see above)."""

    prior: RoundPlan | None = None  # the plan in flight when the latest plan was made ahead
    epoch: int | None = None  # the epoch of the latest plan while it is one made ahead
    seen: dict = field(default_factory=dict)  # participant -> newest report at epoch - 1

    def clear(self) -> None:
        self.prior, self.epoch, self.seen = None, None, {}

    def plan(self, latest: RoundPlan | None, membership: Membership, ready: Collection[str],
             reports: Mapping, now: float) -> RoundPlan | None:
        """The plan of the epoch after ``latest`` (the plan of the current epoch) over the
        ``staying`` peers, made now (``membership.plan``: the epoch moves on). None, and
        nothing changes, without ``latest`` (a fresh or rebuilt swarm, whose peers are all
        at the current epoch: the caller plans at their first samples), while a plan made
        ahead before is still in flight (``settle``), or without a staying peer."""
        if latest is None or latest.epoch != membership.epoch or not self.settle(
                membership.is_member, ready, reports):
            return None
        live = {p.peer_id for p in membership.live(now)}
        peers = staying(latest, ready, live, reports)
        plan = membership.plan(now, peers) if peers else None
        if plan is not None:
            self.prior, self.epoch = latest, plan.epoch
            self.seen = {p: reports[p] for p in plan.participants
                         if p in reports and reports[p].epoch == latest.epoch}
        return plan

    def next_plan(self, latest: RoundPlan | None, peer_id: str, epoch: int) -> RoundPlan | None:
        """The published plan ``peer_id`` takes next when it holds ``epoch``: the one of
        ``epoch + 1`` it takes part in (the latest, or the one in flight before it)."""
        for plan in (latest, self.prior):
            if plan is not None and plan.epoch == epoch + 1 and peer_id in plan.participants:
                return plan
        return None

    def settle(self, is_member: Callable[[str], bool], ready: Collection[str],
               reports: Mapping) -> bool:
        """Forget ``prior`` once every ready member taking part in it reported its epoch
        (or a newer one); True if no plan is in flight before the latest any more."""
        prior = self.prior
        if prior is not None and all(
                not is_member(p) or p not in ready
                or (p in reports and reports[p].epoch >= prior.epoch)
                for p in prior.participants):
            self.prior = None
        return self.prior is None

    def count(self, r, history: list) -> None:
        """``r`` is a participant's report at the epoch before a plan made ahead: ``record``
        it."""
        if self.epoch is not None:
            self.seen[r.peer_id] = r
            self.record(history)

    def record(self, history: list) -> None:
        """Rewrite the plan made ahead's ``StepRecord`` (the newest in ``history``) with the
        samples and the mean loss of its participants' newest reports before it."""
        if self.epoch is None or not history or history[-1].epoch != self.epoch:
            return
        samples = sum(x.samples for x in self.seen.values())
        weighted = [(x.loss, x.samples) for x in self.seen.values()
                    if x.loss is not None and x.samples > 0]
        n = sum(s for _, s in weighted)
        loss = sum(v * s for v, s in weighted) / n if n else history[-1].loss
        history[-1] = replace(history[-1], samples=samples, loss=loss)


def staying(latest: RoundPlan, ready: Collection[str], live: Collection[str],
            reports: Mapping) -> tuple[str, ...]:
    """Who takes part in a plan made ahead of ``latest``: every ready, live (so not
    draining) peer that takes part in ``latest`` or already holds its epoch (a joiner that
    copied it), sorted."""
    return tuple(sorted(
        p for p in ready if p in live and (p in latest.participants or (
            p in reports and reports[p].epoch == latest.epoch))))
