"""Typed messages that cross actor boundaries in the collective.

Every message is a frozen dataclass with tuples, not lists, so that it is hashable, cheap
to pickle and cannot be mutated by the receiver. A ``Contribution`` or ``PartResult``
carries its tensor bytes one of two ways (a *payload*):

- a ``ray.ObjectRef`` nested in the message (Ray does not resolve nested refs, so only the
  reference crosses the actor call and the receiver fetches the bytes from the object store
  when it is ready to reduce them): large parts;
- ``Inline``: the encoded bytes in the message itself, so the actor call carries them
  straight to the receiver, with no object-store put, transfer or reference to count
  (small parts: ``round.INLINE_MAX_BYTES``); ``InBundle`` names one part of a tuple
  the sender put once (a small contribution's copies for re-reducing a dead owner's part,
  fetched only then).
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# A ray.ObjectRef; typed as Any so this module imports without Ray.
ObjectRef = Any
ActorHandle = Any


@dataclass(frozen=True)
class Inline:
    """A payload carried in the message itself (see module docstring)."""

    value: Any  # codecs.Encoded


@dataclass(frozen=True)
class InBundle:
    """Element ``index`` of the tuple behind ``ref`` (see module docstring)."""

    ref: ObjectRef
    index: int


Payload = Any  # ObjectRef | Inline | InBundle


class RejectReason(str, enum.Enum):
    """Why a contribution was left out of a part's weighted average."""

    SHAPE_MISMATCH = "shape_mismatch"  # part length differs from the receiver's layout
    DTYPE_MISMATCH = "dtype_mismatch"  # wire dtype differs from the round's codec
    STALE_EPOCH = "stale_epoch"  # belongs to a round that already finished here
    NON_FINITE = "non_finite"  # NaN or inf in the values
    BAD_WEIGHT = "bad_weight"  # negative or non-finite weight
    LATE = "late"  # arrived after the part was reduced
    UNKNOWN_SENDER = "unknown_sender"  # sender is not a member of the group
    FETCH_FAILED = "fetch_failed"  # the object could not be fetched (owner died)
    # above the bounds derived from the step (``partition.ContributionBounds``)
    VALUE_OUT_OF_BOUNDS = "value_out_of_bounds"  # |value| above the step's value bound
    WEIGHT_OUT_OF_BOUNDS = "weight_out_of_bounds"  # weight above the step's weight bound
    # no tag, or one that the job's key did not make for these fields (``collective/auth.py``);
    # a forger can claim any sender, so this never counts toward that sender's quarantine
    UNAUTHENTICATED = "unauthenticated"


@dataclass(frozen=True)
class Rejection:
    """One rejected contribution, as logged, counted and reported."""

    sender: str
    part: int
    reason: RejectReason
    detail: str = ""
    numel: int = -1  # the sender's whole-tensor length, for a shape mismatch (-1: unknown)


@dataclass(frozen=True)
class Group:
    """The peers averaging together in one round.

    ``members`` contribute (and own parts of the reduction in proportion to their
    share); ``receivers`` contribute nothing and only fetch the result. Receivers exist
    when the peer count has a large prime factor: see ``grid.plan_grid``.
    """

    members: tuple[str, ...]
    receivers: tuple[str, ...] = ()

    @property
    def everyone(self) -> tuple[str, ...]:
        return self.members + self.receivers


@dataclass(frozen=True)
class RoundSchedule:
    """Groups of one round (one grid dimension)."""

    groups: tuple[Group, ...]

    def group_of(self, peer: str) -> tuple[int, Group] | None:
        for index, group in enumerate(self.groups):
            if peer in group.members or peer in group.receivers:
                return index, group
        return None


@dataclass(frozen=True)
class GridPlan:
    """A pure description of a Moshpit grid over ``peers``.

    ``dims`` are the sizes of the full grid dimensions; ``extras`` are the peers beyond
    the full grid (joined to round 0 as members and to the last round as receivers).
    ``rounds[r]`` is the schedule of round r.
    """

    peers: tuple[str, ...]
    dims: tuple[int, ...]
    coords: tuple[tuple[str, tuple[int, ...]], ...]
    extras: tuple[str, ...]
    rounds: tuple[RoundSchedule, ...]
    # peer -> zone when the plan is zone-aware (``grid.plan_zoned``); empty otherwise
    zones: tuple[tuple[str, str], ...] = ()

    @property
    def max_group_size(self) -> int:
        return max((len(g.everyone) for r in self.rounds for g in r.groups), default=1)


@dataclass(frozen=True)
class PeerInfo:
    """A registered participant, as the Coordinator knows it."""

    peer_id: str
    handle: ActorHandle = field(compare=False, repr=False)
    node_id: str = ""
    capacity: float = 1.0  # relative reduction throughput; sets the peer's share of parts
    zone: str = ""  # e.g. the node's ray.io/availability-zone label; "" = unknown


@dataclass(frozen=True)
class RoundPlan:
    """What the Coordinator publishes for one averaging step (epoch).

    ``grid`` holds the groups of each round. ``shares`` maps each peer to its relative
    share of the reduction work (parts are sized by it inside every group). ``handles``
    lets peers call each other without named-actor lookups.
    """

    epoch: int
    grid: GridPlan
    shares: tuple[tuple[str, float], ...]
    handles: tuple[tuple[str, ActorHandle], ...] = field(compare=False, repr=False)
    compression: str = "none"  # codec every member encodes with (a codecs.py name)
    # Fewest values a part's owner gets: a group splits a tensor among at most
    # ``numel // min_part`` members (``partition.owner_shares``); 1: every member owns one.
    min_part: int = 1
    # peer -> the zone it declared (``PeerInfo.zone``), for every participant that declared
    # one, zone-aware grid or not: what each peer counts its cross-zone bytes by
    zones: tuple[tuple[str, str], ...] = ()
    # the branch of the swarm's history this step extends (``ProgressTracker.branch``: one
    # more after every fall back); a replica keeps the branch of the last step it applied
    # and reports it, so a state from before a fall back is told apart from a newer step
    branch: int = 0

    @property
    def participants(self) -> tuple[str, ...]:
        return self.grid.peers

    def share_of(self, peer: str) -> float:
        return dict(self.shares).get(peer, 1.0)

    def handle_of(self, peer: str) -> ActorHandle:
        return dict(self.handles)[peer]

    def views(self) -> dict[str, "PeerPlan"]:
        """Every participant's ``PeerPlan``, by peer id, built in one pass over the grid:
        each group's seat (its members' shares, handles and zones) once, then each
        participant's view from its seats, O(participants x rounds) in all; so a
        Coordinator sends each participant its own part instead of the whole plan."""
        seats: dict[str, list[GroupSeat]] = {peer: [] for peer in self.participants}
        facts = _PlanFacts(self)
        for r, schedule in enumerate(self.grid.rounds):
            for g, group in enumerate(schedule.groups):
                seat = facts.seat(r, g, group)
                for peer in group.everyone:
                    seats[peer].append(seat)
        return {peer: facts.view(peer, tuple(own)) for peer, own in seats.items()}

    def view_of(self, peer: str) -> "PeerPlan":
        """``peer``'s ``PeerPlan`` alone (equal to ``views()[peer]``), in one pass over the
        grid: for a caller that holds the whole plan (a test, a locally built plan). A
        peer that is not a participant gets a view with no seats (it averages with
        nobody)."""
        facts = _PlanFacts(self)
        own = []
        for r, schedule in enumerate(self.grid.rounds):
            found = schedule.group_of(peer)
            if found is not None:
                own.append(facts.seat(r, *found))
        return facts.view(peer, tuple(own))


@dataclass(frozen=True)
class GroupSeat:
    """One group a peer averages in: group ``group_index`` of round ``round_index`` of a
    plan (the indices every message of that group round carries and signs), with what its
    peers need of the plan about each other: the ``shares``, ``handles`` and declared
    ``zones`` of everyone in ``group`` (those the plan has)."""

    round_index: int
    group_index: int
    group: Group
    shares: tuple[tuple[str, float], ...] = ()
    handles: tuple[tuple[str, ActorHandle], ...] = field(default=(), compare=False,
                                                          repr=False)
    zones: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class PeerPlan:
    """One participant's part of a ``RoundPlan``: what the Coordinator sends it (pushed,
    and in report replies) instead of the whole plan, so a step costs O(N) bytes in all,
    not O(N^2). ``RoundPlan.views`` builds every participant's at once.

    ``seats``: the groups ``peer`` is in, in round order (a round it sits out has none),
    each with its peers' shares, handles and zones: every peer it sends to or sizes a part
    for (its *mates*; ``shares``, ``handles`` and ``zones`` gather them). ``peer_count``
    is the plan's participant count (the weight bound of ``partition.ContributionBounds``);
    ``epoch``, ``compression``, ``min_part`` and ``branch`` are the plan's. The collective
    computes from a view exactly what it computes from the whole plan (the same groups,
    indices, shares and codec).
    """

    epoch: int
    peer: str
    peer_count: int
    seats: tuple[GroupSeat, ...]
    compression: str = "none"
    min_part: int = 1
    branch: int = 0

    @property
    def mates(self) -> tuple[str, ...]:
        """Everyone in ``peer``'s groups (``peer`` too), in order of first seat."""
        return tuple(dict.fromkeys(p for s in self.seats for p in s.group.everyone))

    @property
    def shares(self) -> tuple[tuple[str, float], ...]:
        """``(peer, share)`` of the mates the plan gave a share."""
        return self._gathered("shares")

    @property
    def handles(self) -> tuple[tuple[str, ActorHandle], ...]:
        """``(peer, handle)`` of every mate."""
        return self._gathered("handles")

    @property
    def zones(self) -> tuple[tuple[str, str], ...]:
        """``(peer, zone)`` of the mates that declared a zone."""
        return self._gathered("zones")

    def _gathered(self, name: str) -> tuple:
        return tuple(dict(itertools.chain.from_iterable(
            getattr(s, name) for s in self.seats)).items())

    def share_of(self, peer: str) -> float:
        """``peer``'s share (1.0 when the plan gave it none, as ``RoundPlan.share_of``)."""
        for seat in self.seats:
            for p, share in seat.shares:
                if p == peer:
                    return share
        return 1.0

    def handle_of(self, peer: str) -> ActorHandle:
        """``peer``'s handle; ``KeyError`` for a peer that is not a mate."""
        for seat in self.seats:
            for p, handle in seat.handles:
                if p == peer:
                    return handle
        raise KeyError(peer)


class _PlanFacts:
    """A plan's shares, handles and zones as dicts (built once per plan), its groups'
    seats, and a peer's view from its seats."""

    def __init__(self, plan: RoundPlan):
        self.plan = plan
        # peer -> the plan's own (peer, value) pair: the seats share them, not copies
        self.shares = {pair[0]: pair for pair in plan.shares}
        self.handles = {pair[0]: pair for pair in plan.handles}
        self.zones = {pair[0]: pair for pair in plan.zones}
        self.count = len(plan.participants)

    def seat(self, r: int, g: int, group: Group) -> GroupSeat:
        peers = group.everyone
        return GroupSeat(
            r, g, group,
            shares=tuple(self.shares[p] for p in peers if p in self.shares),
            handles=tuple(self.handles[p] for p in peers if p in self.handles),
            zones=tuple(self.zones[p] for p in peers if p in self.zones))

    def view(self, peer: str, seats: tuple[GroupSeat, ...]) -> PeerPlan:
        plan = self.plan
        return PeerPlan(plan.epoch, peer, self.count, seats, plan.compression,
                        plan.min_part, plan.branch)


@dataclass(frozen=True)
class SegmentWeights:
    """A weight that is constant on each of a few contiguous segments of a flat tensor.

    Segment 0 covers ``[0, cuts[0])``, segment i ``[cuts[i-1], cuts[i])``, the last one
    ``[cuts[-1], numel)``; ``weights[i]`` is segment i's weight. Why a tensor has more than
    one: a group round's result holds, in each part, the weight of the contributions that
    part's reduction took in, and when a member dies mid-round the parts the others own
    still hold its contribution while the dead member's own part, re-reduced by the
    survivors, does not (see ``round.py``). A contribution to the next round carries that
    weight per coordinate, so the next owner weighs each value by exactly what it holds.
    With no failure every part holds the same weight: one segment.

    A well-formed value has ``len(weights) == len(cuts) + 1`` numbers and integer ``cuts``
    strictly increasing inside ``(0, numel)`` (``problem`` says what is wrong with another,
    e.g. one that came over the wire). The ones the collective makes (``merged``,
    ``joined``, ``within``) also never have two equal neighbours, so equal profiles compare
    equal and a failure-free step has one segment.
    """

    weights: tuple[float, ...]
    cuts: tuple[int, ...] = ()

    @classmethod
    def uniform(cls, weight: float) -> "SegmentWeights":
        """One weight for the whole tensor."""
        return cls((float(weight),))

    def problem(self, numel: int) -> str | None:
        """Why this is not a well-formed profile for a tensor of ``numel`` values (None if
        it is); the weights' values are not judged here (``partition.check_weights``)."""
        weights, cuts = self.weights, self.cuts
        if not (isinstance(weights, tuple) and isinstance(cuts, tuple)):
            return "segment weights and cuts must be tuples"
        if len(weights) != len(cuts) + 1:
            return f"{len(weights)} segment weights for {len(cuts)} cuts"
        if not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights):
            return "a segment weight that is not a number"
        previous = 0
        for cut in cuts:
            if not isinstance(cut, int) or isinstance(cut, bool) or not previous < cut < numel:
                return f"segment cuts {cuts[:8]} not strictly increasing inside (0, {numel})"
            previous = cut
        return None

    def segments(self, numel: int) -> list[tuple[int, int, float]]:
        """``(start, stop, weight)`` of every segment of a ``numel``-value tensor (one
        empty segment for ``numel == 0``)."""
        bounds = (0, *self.cuts, numel)
        return [(bounds[i], bounds[i + 1], w) for i, w in enumerate(self.weights)]

    def within(self, start: int, stop: int) -> "SegmentWeights":
        """The profile of the values ``[start, stop)``, counted from ``start`` (a part's)."""
        first = bisect.bisect_right(self.cuts, start)
        last = max(first, bisect.bisect_left(self.cuts, stop))
        return SegmentWeights(self.weights[first:last + 1],
                              tuple(c - start for c in self.cuts[first:last]))

    @classmethod
    def merged(cls, weights: Sequence[float], cuts: Sequence[int]) -> "SegmentWeights":
        """``weights`` on the segments ``cuts`` bound, equal neighbours merged into one."""
        kept_weights, kept_cuts = [float(weights[0])], []
        for cut, w in zip(cuts, weights[1:]):
            if w != kept_weights[-1]:
                kept_cuts.append(int(cut))
                kept_weights.append(float(w))
        return cls(tuple(kept_weights), tuple(kept_cuts))

    @classmethod
    def joined(cls, parts: "Sequence[tuple[int, SegmentWeights]]") -> "SegmentWeights":
        """The profile of consecutive parts, each ``(size, its profile)``, equal
        neighbours merged. Empty parts are skipped; with no values at all it is the first
        part's profile."""
        weights: list[float] = []
        cuts: list[int] = []
        offset = 0
        for size, part in parts:
            if size <= 0:
                continue
            for start, _, w in part.segments(size):
                if weights:
                    cuts.append(offset + start)
                weights.append(w)
            offset += size
        if not weights:
            return parts[0][1] if parts else cls((0.0,))
        return cls.merged(weights, cuts)

    def mean(self, numel: int) -> float:
        """The weight averaged over the ``numel`` values: one figure for the whole tensor
        (exactly the weight when there is one segment)."""
        if len(self.weights) == 1 or numel <= 0:
            return float(self.weights[0])
        return sum((b - a) * w for a, b, w in self.segments(numel)) / numel


@dataclass(frozen=True)
class Contribution:
    """One member's tensor for one group, split into parts, as payloads.

    ``part_refs[j]`` is the encoded slice the owner of part j reduces. Every member of
    the group receives the whole tuple, so a survivor can re-reduce a part whose owner
    died. A small contribution gives each member its own part ``Inline`` and the others
    ``InBundle`` (one put for all of them); a large one gives object refs throughout.
    ``weights``: the weight of each value (the caller's weight in a step's first round,
    the previous round's totals after it: see ``SegmentWeights``).
    """

    epoch: int
    round_index: int
    group_index: int
    sender: str
    weights: SegmentWeights
    numel: int
    part_refs: tuple[Payload, ...]
    # signed with the job's key (``collective/auth.py``): the signer's fresh nonce, a MAC
    # of each part's encoded bytes (b"" for a part not sent) and a tag over the fields
    # above, the nonce and the payload tags; empty when the averager has no key
    nonce: bytes = b""
    payload_tags: tuple[bytes, ...] = ()
    tag: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class PartResult:
    """The reduced value of one part, published by its owner to every group member."""

    epoch: int
    round_index: int
    group_index: int
    part: int
    owner: str
    numel: int  # the owner's whole-tensor length; a mismatch means a different layout
    # the total weight of the contributions reduced, per value of the part (counted from
    # the part's start): the sum of the contributors' ``Contribution.weights`` there
    weights: SegmentWeights
    contributors: tuple[str, ...]
    ref: Payload  # an ObjectRef, or Inline for a small part
    # signed with the job's key (``collective/auth.py``), as a contribution: a fresh
    # nonce, a MAC of the encoded result and a tag over the fields; b"": no key
    nonce: bytes = b""
    payload_tag: bytes = b""
    tag: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class AllReduceReport:
    """What one peer saw in one ``all_reduce`` call."""

    epoch: int
    peer: str
    contributors: tuple[str, ...]  # peers whose weight is in this peer's result (all parts)
    partial_contributors: tuple[str, ...]  # peers present in some parts only
    rejections: tuple[Rejection, ...]
    failed_owners: tuple[str, ...]  # owners whose parts were re-reduced or kept local
    bytes_sent: int
    bytes_received: int
    seconds: float
    # the result's total weight as one figure: its mean over the values (``weights.mean``),
    # which is the total itself when every value holds the same (always, with no failure)
    total_weight: float
    phases: tuple[tuple[str, float], ...] = ()  # seconds per phase, summed over rounds
    # of ``bytes_sent``, those sent to peers of another zone (``RoundPlan.zones``; 0 when
    # this peer or none of its receivers declared a zone)
    cross_zone_bytes: int = 0
    # the result's total weight per value: after a failure mid-round, values the dead
    # member's contribution reached hold more weight than those it did not (None: a
    # report not made by ``Averager.all_reduce``)
    weights: SegmentWeights | None = None
    # the Moshpit rounds this peer averaged in (one group per round: a 4 x 4 grid has 2)
    rounds: int = 0

    @property
    def complete(self) -> bool:
        return not self.rejections and not self.failed_owners and not self.partial_contributors


@dataclass(frozen=True)
class Probe:
    """A liveness check between members of one group round, sent through the transport's
    ``receive_contribution`` (so hosts forward it with no change); the callee ignores it.

    A peer waiting on another sends one while it waits: if the call fails (Ray reports the
    actor or its node dead), the waiter stops waiting for that peer at once instead of at
    the round's deadline.
    """

    epoch: int
    round_index: int
    group_index: int
    sender: str


@dataclass(frozen=True)
class CopyRequest:
    """A member re-reducing a dead owner's part asks another member for the contribution
    it held back (a member that owns no part is sent contributions only then), through
    ``receive_contribution`` like a ``Probe``; the callee answers with that
    ``Contribution`` if it still holds it, else not at all."""

    epoch: int
    round_index: int
    group_index: int
    requester: str


@dataclass(frozen=True)
class CheckpointRef:
    """Where the run's newest checkpoint is: ``CheckpointStore(uri, run_id)`` holds the
    step ``step`` (replica -> Coordinator after a save, Coordinator -> a replica that finds
    no donor to copy from: ``StepManager._sync``)."""

    uri: str
    run_id: str
    step: int
