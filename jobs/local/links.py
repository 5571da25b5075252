"""Link profiles for the embedded cluster's separate-hosts mode: named shapes of the spot
nodes' links, scaled so this machine's small model sees the compute-to-communication ratio
of a real spot deployment (pure arithmetic; ``apply`` shapes a ``LocalCluster``).

The real case (the ``slow`` profile): a 1B-parameter model trained data-parallel on
g5.xlarge spot nodes (one A10G each) at the instance's baseline bandwidth.

- gradient bytes on the wire per exchange: 1e9 parameters x 2 bytes (fp16) = 2 GB = 16 Gbit;
- g5.xlarge: "up to 10 Gbit/s" burst, about 2.5 Gbit/s sustained baseline:
  16 Gbit / 2.5 Gbit/s = 6.4 s per gradient exchange;
- compute of one step on an A10G: 4 sequences x 1024 tokens = 4096 tokens per step,
  6 x 1e9 x 4096 = 2.5e13 FLOP; at about 35% of the A10G's ~70 TFLOP/s bf16
  (~25 TFLOP/s achieved) that is ~1.0 s;
- so one exchange costs ``REAL_RATIO`` = 6.4 s / 1.0 s = 6.4 steps of compute: synchronous
  DDP spends 6.4 / 7.4 = 86% of every step waiting on its links.

This machine's small model reproduces that ratio: with ``P`` parameters (fp16 gradients:
``2 P`` bytes) and a measured compute time ``c`` seconds per step (one node's share of the
global batch), the link rate that makes one exchange cost ``ratio`` steps is
``rate = 8 x 2 P / (ratio x c)`` bit/s (``mbit_for_ratio``). For example ``P`` = 100,000 and
``c`` = 0.05 s give 1.6 Mbit / 0.32 s = 5.0 Mbit/s for ``slow``.

Profiles (``PROFILES``; the ratio of each node's link, 0 = not shaped):

- ``fast``: no shaping (loopback-speed veths): where DDP is at its best;
- ``slow``: every node at ``REAL_RATIO`` (the g5.xlarge case above);
- ``straggler``: every node at a tenth of that ratio (10x the bandwidth), the last node at
  ``REAL_RATIO``: one link 10x slower than the rest;
- ``zones``: two zones, the head and every node but the last in zone A, the last node in
  zone B; no node's own link is shaped: zone B's nodes sit on a bridge of their own joined
  to zone A's by one link at ``REAL_RATIO`` (``NodeLinks.zone_links``,
  ``HostNetwork.add_zone``), so traffic inside either zone is fast and every byte between
  them crosses the slow link, however many nodes zone B holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

REAL_PARAMS = 1e9  # the 1B-parameter model
REAL_WIRE_BYTES = 2 * REAL_PARAMS  # fp16 gradients: 2 GB
REAL_BASELINE_BIT_S = 2.5e9  # g5.xlarge sustained baseline bandwidth
REAL_EXCHANGE_S = REAL_WIRE_BYTES * 8 / REAL_BASELINE_BIT_S  # 6.4 s
REAL_STEP_S = 1.0  # 6 x 1e9 x 4096 FLOP at ~25 TFLOP/s = 0.98 s, rounded
REAL_RATIO = REAL_EXCHANGE_S / REAL_STEP_S  # 6.4 exchange-seconds per compute-second
STRAGGLER_FACTOR = 10.0  # the straggler's link is this much slower than the others'
MIN_MBIT = 0.5  # below this a link cannot carry Ray's own control traffic in time


@dataclass(frozen=True)
class LinkProfile:
    """A named link shape: ``ratio`` is every node's communication-to-compute ratio (one
    exchange's seconds over one step's compute seconds; ``None``: not shaped), except the
    last node's, which is ``last`` when ``last_differs``."""

    name: str
    description: str
    ratio: float | None  # every node's link (None: not shaped)
    last: float | None = None  # the last node's link, if it differs (None: as ``ratio``)
    last_differs: bool = False
    zoned: bool = False  # the last node is zone "b", the others zone "a" (node labels)

    def node_ratios(self, nodes: int) -> tuple[float | None, ...]:
        """Each of ``nodes`` nodes' ratio (None: not shaped). ``ValueError`` for nodes < 1."""
        if not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"a link profile needs at least 1 node, got {nodes!r}")
        out = [self.ratio] * nodes
        if self.last_differs:
            out[-1] = self.last
        return tuple(out)

    def node_zones(self, nodes: int) -> tuple[tuple[int, str], ...]:
        """``(slot, zone)`` of each node for ``LocalClusterConfig.zones`` (empty unless
        ``zoned``): what the Coordinator's zone-aware grid groups peers by."""
        if not self.zoned:
            return ()
        return tuple((i, "a" if i < nodes - 1 else "b") for i in range(nodes))


PROFILES: dict[str, LinkProfile] = {p.name: p for p in (
    LinkProfile("fast", "no shaping", None),
    LinkProfile("slow", f"every node's exchange costs {REAL_RATIO:.1f} compute steps "
                        "(1B model, fp16 gradients, g5.xlarge at 2.5 Gbit/s)", REAL_RATIO),
    LinkProfile("straggler", f"every node at {REAL_RATIO / STRAGGLER_FACTOR:.2f}, the last "
                             f"{STRAGGLER_FACTOR:.0f}x slower ({REAL_RATIO:.1f})",
                REAL_RATIO / STRAGGLER_FACTOR, REAL_RATIO, True),
    LinkProfile("zones", f"zone A (head, all but the last node) not shaped; the last node "
                         f"alone in zone B behind a {REAL_RATIO:.1f} link", None, REAL_RATIO,
                True, zoned=True),
)}


def get_profile(name: str) -> LinkProfile:
    """The profile named ``name``; ``ValueError`` naming the choices for any other."""
    found = PROFILES.get(name)
    if found is None:
        raise ValueError(f"unknown link profile {name!r}; choose one of {', '.join(PROFILES)}")
    return found


def mbit_for_ratio(wire_bytes: float, step_compute_s: float, ratio: float) -> float:
    """The link rate (Mbit/s) at which sending ``wire_bytes`` takes ``ratio`` times
    ``step_compute_s``: ``8 wire_bytes / (ratio step_compute_s) / 1e6``, at least
    ``MIN_MBIT``. ``ValueError`` for a non-positive argument."""
    for what, value in (("wire_bytes", wire_bytes), ("step_compute_s", step_compute_s),
                        ("ratio", ratio)):
        if not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{what} must be a positive number, got {value!r}")
    return max(8.0 * wire_bytes / (ratio * step_compute_s) / 1e6, MIN_MBIT)


def node_rates(profile: LinkProfile, nodes: int, wire_bytes: float,
               step_compute_s: float) -> tuple[float | None, ...]:
    """Each node's link rate in Mbit/s (None: not shaped) for ``profile`` with a model whose
    exchange is ``wire_bytes`` (fp16 gradients: 2 bytes per parameter) and whose step takes
    ``step_compute_s`` of compute on one node."""
    return tuple(None if r is None else round(mbit_for_ratio(wire_bytes, step_compute_s, r), 3)
                 for r in profile.node_ratios(nodes))


@dataclass(frozen=True)
class NodeLinks:
    """A profile laid onto a cluster's node slots: slot ``i``'s link at ``mbit[i]`` Mbit/s
    (None: not shaped) and the zone labels the profile gives (``LinkProfile.node_zones``).
    Crosses process boundaries as JSON (``to_json`` / ``from_json``): a bench hands it to
    the driver process that starts its own embedded cluster."""

    profile: str
    mbit: tuple[float | None, ...]
    zones: tuple[tuple[int, str], ...] = ()
    # (zone, Mbit/s): the zone's nodes on a bridge of their own, joined to the head's by
    # one link at that rate (LocalClusterConfig.zone_links)
    zone_links: tuple[tuple[str, float], ...] = ()

    @property
    def slowest(self) -> float | None:
        """The slowest shaped link's Mbit/s, a node's or a zone's (None: none shaped)."""
        return min([r for r in self.mbit if r is not None]
                   + [r for _, r in self.zone_links if r is not None], default=None)

    def cluster_fields(self) -> dict:
        """The ``LocalClusterConfig`` fields that lay these links out (with
        ``hosts="netns"``): every node the cluster starts in a listed slot, at the start or
        later, gets its link and zone."""
        return {"link_mbit": tuple((i, r) for i, r in enumerate(self.mbit) if r is not None),
                "zones": self.zones, "zone_links": self.zone_links}

    def to_json(self) -> str:
        return json.dumps({"profile": self.profile, "mbit": list(self.mbit),
                           "zones": [list(z) for z in self.zones],
                           "zone_links": [list(z) for z in self.zone_links]})

    @classmethod
    def from_json(cls, text: str) -> "NodeLinks":
        """The inverse of ``to_json``; ``ValueError`` for anything else."""
        try:
            raw = json.loads(text)
            return cls(str(raw["profile"]), tuple(None if r is None else float(r)
                                                  for r in raw["mbit"]),
                       tuple((int(s), str(z)) for s, z in raw.get("zones", ())),
                       tuple((str(z), float(r)) for z, r in raw.get("zone_links", ())))
        except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a NodeLinks JSON object: {exc}") from None


# What a baseline layout's job runs with, beside the layout (``baseline``).
BASELINE_SETS: dict[str, tuple[str, ...]] = {"zone_blind": ("training.zone_aware=false",)}


def baseline(laid: NodeLinks) -> tuple[str, NodeLinks]:
    """What a profile's one uneven thing is measured against, and its name: ``zone_blind``
    (the same links and zone labels; the job runs with ``training.zone_aware = false``, so
    the grid ignores the zones: ``BASELINE_SETS``) for a zoned profile; ``even``
    (every node at the first node's rate) for one whose links differ (``straggler``).
    ``ValueError`` for a profile with neither (``fast``, ``slow``)."""
    if laid.zones:
        return "zone_blind", laid
    if len(set(laid.mbit)) > 1:
        return "even", NodeLinks(laid.profile, (laid.mbit[0],) * len(laid.mbit))
    raise ValueError(f"link profile {laid.profile!r} has every link alike and no zones: "
                     f"nothing to compare it against (straggler and zones have)")


def lay_out(profile: LinkProfile, nodes: int, wire_bytes: float,
            step_compute_s: float) -> NodeLinks:
    """``profile`` on ``nodes`` node slots for a model whose exchange is ``wire_bytes`` and
    whose step takes ``step_compute_s`` on one node (``node_rates``). A zoned profile's
    last node's rate is zone B's link (``zone_links``), its own link not shaped."""
    rates = node_rates(profile, nodes, wire_bytes, step_compute_s)
    if not profile.zoned:
        return NodeLinks(profile.name, rates)
    return NodeLinks(profile.name, rates[:-1] + (None,), profile.node_zones(nodes),
                     (("b", rates[-1]),))


def apply(cluster, rates: tuple[float | None, ...]) -> None:
    """Shape slot i of ``cluster`` (a ``LocalCluster`` with ``hosts="netns"``) to
    ``rates[i]`` Mbit/s (None: lift any limit). Raises what ``LocalCluster.shape`` raises
    (``ValueError`` on a loopback cluster)."""
    for slot, mbit in enumerate(rates):
        cluster.shape(slot, mbit)
