"""Moshpit grid planning: pure functions, no Ray.

Peers are laid out on a d-dimensional grid. In round r, the peers that share every
coordinate except the r-th form a group and compute their weighted average (carrying the
group's total weight forward). With a full grid ``N = m0 * m1 * ... * m(d-1)`` every peer
holds the exact weighted average of all N contributions after d rounds.

Counts with a large prime factor (251, 2 * 131, ...) have no full grid with small groups.
For those the grid is "ragged" in its first dimension: the peers are split into R rows of
nearly equal size (``m0`` or ``m0 + 1``), R = m1 * ... * m(d-1). Round 0 averages each row
(extras included, with their full weight); rounds 1..d-1 run on the full ``m0 x R`` core;
each extra peer joins one group of the last round as a *receiver* (weight 0, it only fetches
the result). Every peer still ends with the exact average, and no group is larger than
``max_group`` plus a few receivers.

Between averaging steps the assignment of peers to coordinates is reshuffled with a
seed derived from the epoch, so that groups mix (Moshpit SGD); the plan is a deterministic
function of ``(peers, max_group, epoch, seed, zones)``.

Zones (``plan_zoned``, used by ``plan_grid`` when ``zones`` name two or more zones and some
zone holds two or more peers): links inside a zone are fast, links between zones slow and
billed. The plan then averages in three stages, each a run of ordinary rounds:

1. inside every zone, a Moshpit grid over the zone's peers (the zones' grids run side by
   side; a zone with fewer rounds skips the last ones): every peer holds its zone's average
   and the zone's total weight;
2. one delegate per zone (taking turns by epoch) averages with the other zones' delegates
   (a Moshpit grid over the delegates): each delegate holds the global average;
3. inside every zone, the delegate is the one member of a group whose receivers are the
   zone's other peers: they fetch the global average from it.

So only the delegates' reduced tensors cross zones: ``2 * S`` per pair of zones per step
(S: the tensor's bytes) against about ``2 * S`` per peer and round when groups ignore zones.
Failure behaviour is the rounds': if a delegate dies, its zone's peers keep their zone
average for that step (receivers keep their local values) and the next plan picks another.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence

from moshray.cluster.messages import GridPlan, Group, RoundSchedule

# Groups of at most 8: a swarm of 9+ peers averages over a multi-round grid (9 -> 3x3,
# 16 -> 4x4, 64 -> 8x8), so a peer exchanges parts with O(sqrt N) others per round instead
# of N-1 and a failure only disturbs its own group of that round. The price is bandwidth:
# each round moves 2(m-1)/m of the tensor per peer, so 16 peers as 4x4 move 3.0x the tensor
# against 1.9x in one group of 16. Every peer still ends bitwise identical (see round.py).
DEFAULT_MAX_GROUP = 8


def choose_dims(n: int, max_group: int = DEFAULT_MAX_GROUP) -> tuple[int, ...]:
    """Grid dimensions for ``n`` peers: ``(m0, m1, ..., m(d-1))``.

    ``m0`` is the *minimum* row size: rows hold ``m0`` or ``m0 + 1`` peers, and
    ``n - m0 * prod(m1..)`` rows hold one extra peer. The fewest rounds win; among those,
    the smallest largest group, then the fewest extras.

    Raises ValueError for ``n < 1`` or ``max_group < 2``.
    """
    if n < 1:
        raise ValueError(f"need at least one peer, got {n}")
    if max_group < 2:
        raise ValueError(f"max_group must be >= 2, got {max_group}")
    if n <= max_group:
        return (n,)
    for d in itertools.count(2):
        best: tuple[tuple[int, int, tuple[int, ...]], tuple[int, ...]] | None = None
        for tail in itertools.combinations_with_replacement(range(2, max_group + 1), d - 1):
            rows = math.prod(tail)
            if rows > n:
                continue
            m0, extras = divmod(n, rows)
            # m0 == 1 is allowed so that max_group == 2 terminates for any n.
            if m0 + (1 if extras else 0) > max_group:
                continue
            dims = (m0, *sorted(tail, reverse=True))
            score = (_largest_group(dims, extras), extras, dims)
            if best is None or score < best[0]:
                best = (score, dims)
        if best is not None:
            return best[1]
    raise AssertionError("unreachable")  # pragma: no cover


def _largest_group(dims: tuple[int, ...], extras: int) -> int:
    m0, last = dims[0], dims[-1]
    row = m0 + (1 if extras else 0)
    # Extras of the rows along the last dimension spread over m0 last-round groups.
    receivers = math.ceil(min(extras, last) / m0) if extras else 0
    return max(row, last + receivers, *dims[1:])


def _unravel(index: int, dims: Sequence[int]) -> tuple[int, ...]:
    coords = []
    for size in reversed(dims):
        index, c = divmod(index, size)
        coords.append(c)
    return tuple(reversed(coords))


def plan_grid(
    peers: Sequence[str],
    max_group: int = DEFAULT_MAX_GROUP,
    epoch: int = 0,
    seed: int = 0,
    zones: Mapping[str, str] | None = None,
) -> GridPlan:
    """Lay ``peers`` out on a Moshpit grid and list the groups of every round.

    Contract: for any weights, running the rounds in order (each group computing its
    weighted average and carrying its total weight forward; receivers taking the result
    with weight 0) leaves every peer with the exact weighted average of all peers. Peer ids
    must be unique. The order of ``peers`` does not matter. ``zones`` (peer -> zone name; a
    peer missing or with "" is a zone of its own) makes the plan zone-aware
    (``plan_zoned``) when it names at least two zones and one of them holds two peers.
    """
    if len(set(peers)) != len(peers):
        raise ValueError("peer ids must be unique")
    if zones:
        by_zone = zone_members(peers, zones)
        if len(by_zone) >= 2 and any(len(m) >= 2 for m in by_zone.values()):
            return plan_zoned(peers, zones, max_group, epoch, seed)
    order = sorted(peers)
    random.Random(f"{seed}:{epoch}").shuffle(order)
    n = len(order)
    dims = choose_dims(n, max_group)
    m0 = dims[0]
    rows = math.prod(dims[1:])
    core = order[: m0 * rows]
    extras = tuple(order[m0 * rows :])  # extra k sits in row k (k < rows)

    coords = {peer: _unravel(i, dims) for i, peer in enumerate(core)}
    by_coords = {c: p for p, c in coords.items()}
    row_coords = [_unravel(r, dims[1:]) for r in range(rows)]
    extra_of_row = {row_coords[k]: peer for k, peer in enumerate(extras)}

    rounds: list[RoundSchedule] = []
    for r in range(len(dims)):
        groups: list[Group] = []
        others = [range(s) for i, s in enumerate(dims) if i != r]
        for fixed in itertools.product(*others):
            members = []
            for c_r in range(dims[r]):
                c = list(fixed)
                c.insert(r, c_r)
                members.append(by_coords[tuple(c)])
            receivers: tuple[str, ...] = ()
            if r == 0 and len(dims) > 1:
                extra = extra_of_row.get(tuple(fixed))
                if extra is not None:
                    members.append(extra)
            if r == len(dims) - 1 and r > 0:
                k, rest = fixed[0], tuple(fixed[1:])
                receivers = tuple(
                    extra_of_row[rest + (c_last,)]
                    for c_last in range(dims[-1])
                    if rest + (c_last,) in extra_of_row
                    and _spread(rest + (c_last,), dims, m0) == k
                )
            groups.append(Group(members=tuple(members), receivers=receivers))
        rounds.append(RoundSchedule(groups=tuple(groups)))

    all_coords = dict(coords)
    for k, peer in enumerate(extras):
        all_coords[peer] = (m0, *row_coords[k])
    return GridPlan(
        peers=tuple(sorted(peers)),
        dims=dims,
        coords=tuple(sorted(all_coords.items())),
        extras=extras,
        rounds=tuple(rounds),
    )


def zone_members(peers: Sequence[str], zones: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Zone -> its peers (sorted); a peer without a zone ("" or missing) is alone in one
    named after itself."""
    out: dict[str, list[str]] = {}
    for p in sorted(peers):
        out.setdefault(zones.get(p) or f"\0{p}", []).append(p)
    return {z: tuple(m) for z, m in sorted(out.items())}


def plan_zoned(
    peers: Sequence[str],
    zones: Mapping[str, str],
    max_group: int = DEFAULT_MAX_GROUP,
    epoch: int = 0,
    seed: int = 0,
) -> GridPlan:
    """The three-stage zone-aware plan (module docstring): same contract as ``plan_grid``.

    ``dims`` are the delegates' grid dims; ``coords`` give each peer ``(zone index, index in
    its zone)``; ``extras`` is empty; ``zones`` records the layout."""
    if len(set(peers)) != len(peers):
        raise ValueError("peer ids must be unique")
    by_zone = zone_members(peers, zones)
    inner = {z: plan_grid(m, max_group, epoch, seed) for z, m in by_zone.items()}
    delegates = {}
    for z, members in by_zone.items():  # taking turns by epoch, in a seeded order
        # not an extra of the zone's grid: a receiver there holds the zone's average but
        # (in ``simulate``'s semantics) not the zone's total weight
        order = [p for p in members if p not in inner[z].extras]
        random.Random(f"{seed}:{z}").shuffle(order)
        delegates[z] = order[epoch % len(order)]
    outer = plan_grid(list(delegates.values()), max_group, epoch, seed)

    rounds: list[RoundSchedule] = []
    for r in range(max(len(g.rounds) for g in inner.values())):
        groups = [grp for g in inner.values() if r < len(g.rounds)
                  for grp in g.rounds[r].groups if len(grp.everyone) > 1]
        if groups:
            rounds.append(RoundSchedule(groups=tuple(groups)))
    rounds += [sched for sched in outer.rounds]
    fan_out = tuple(Group(members=(delegates[z],),
                          receivers=tuple(p for p in m if p != delegates[z]))
                    for z, m in by_zone.items() if len(m) > 1)
    rounds.append(RoundSchedule(groups=fan_out))
    coords = [(p, (zi, i)) for zi, m in enumerate(by_zone.values()) for i, p in enumerate(m)]
    return GridPlan(
        peers=tuple(sorted(peers)),
        dims=outer.dims,
        coords=tuple(sorted(coords)),
        extras=(),
        rounds=tuple(rounds),
        zones=tuple(sorted((p, zones.get(p, "")) for p in peers)),
    )


def cross_zone_bytes(plan: GridPlan, zones: Mapping[str, str], numel: int,
                     shares: Mapping[str, float] | None = None, itemsize: int = 4) -> int:
    """Bytes that cross between zones in one step of ``plan`` with no failures: inside
    every group, each member sends the owner of part j its part j, and each owner sends
    its result to every other member and receiver (``round.py``); a pair counts when its
    zones differ (a peer without a zone is in a zone of its own). Parts are sized as
    ``partition.part_sizes`` sizes them from ``shares`` (default: even). Pure."""
    from moshray.cluster.collective.partition import part_sizes

    def zone(p: str) -> str:
        return zones.get(p) or f"\0{p}"

    total = 0
    for schedule in plan.rounds:
        for group in schedule.groups:
            members = group.members
            sizes = part_sizes(numel, [(shares or {}).get(m, 1.0) for m in members])
            for j, owner in enumerate(members):
                for other in members:
                    if other != owner and zone(other) != zone(owner):
                        total += sizes[j] * itemsize  # contribution in
                for other in group.everyone:
                    if other != owner and zone(other) != zone(owner):
                        total += sizes[j] * itemsize  # result out
    return total


def _spread(row: tuple[int, ...], dims: tuple[int, ...], m0: int) -> int:
    """Which core index k of the last round an extra in ``row`` joins (spreads receivers)."""
    return row[-1] % m0


def simulate(plan: GridPlan, values: dict[str, float],
             weights: dict[str, float]) -> dict[str, float]:
    """Run the plan's rounds on scalars (reference semantics used by tests and docs).

    Each group computes ``sum(w * v) / sum(w)`` over its members; members take the result
    and the group's total weight; receivers take the result and keep their weight.
    """
    value, weight = dict(values), dict(weights)
    for schedule in plan.rounds:
        for group in schedule.groups:
            total = sum(weight[p] for p in group.members)
            if total > 0:
                avg = sum(weight[p] * value[p] for p in group.members) / total
            else:
                avg = sum(value[p] for p in group.members) / len(group.members)
            for p in group.members:
                value[p], weight[p] = avg, total
            for p in group.receivers:
                value[p] = avg
    return value
