"""`moshray bench links`: time to a loss over shaped links, moshray's modes against the
baselines a user would run instead (Ray Train DDP, with torch's fp16 and PowerSGD hooks, and
torchft's DiLoCo and Streaming DiLoCo) on the same links.

One embedded cluster in the separate-hosts mode (``LocalCluster(hosts="netns")``: one
network namespace per spot node), its links shaped by a profile of
``moshray.jobs.local.links`` (the rates follow from the model's fp16 gradient bytes and
its step compute time measured here, so the compute-to-communication ratio is the real
case's; the module docstring there gives the arithmetic). On that one cluster, one after
another, each system trains the same model (the example LM, small) on the same data for
the same wall time, each as a driver process of its own:

- ``ddp``: Ray Train ``TorchTrainer`` (``jobs/bench/raytrain_baseline.py``), one worker per
  spot node, so its gloo all-reduce runs inside the namespaces, on the shaped links
  (``GLOO_SOCKET_IFNAME=eth0``, the namespace's side of its link);
- ``ddp_fp16`` / ``ddp_powersgd``: the same with DDP's communication hook
  ``fp16_compress_hook`` / ``powerSGD_hook`` (rank 2 after 10 plain steps, error feedback);
- ``torchft_diloco`` / ``torchft_streaming_diloco``: Ray Train + torchft
  (``TorchftConfig``), ``torchft.local_sgd.DiLoCo`` over the whole model / two fragments
  synced at staggered steps with one step of delay, ``--local-steps`` inner steps and the
  outer step of moshray's DiLoCo modes (``OUTER_LR``, ``OUTER_MOMENTUM``); not run (one
  line in ``failed``) when torchft is not installed;
- ``collaborative``: moshray's collaborative steps, fp16 gradients on the wire;
- ``diloco8`` / ``diloco4``: local SGD with DiLoCo's outer Nesterov step every
  ``--local-steps`` inner steps, outer gradients (the averaged parameter delta) in
  ``blockwise8`` / ``blockwise4``;
- ``diloco_overlap`` (only when ``--systems`` names it: one more run of ``--seconds``
  plus its start-up, a fifth of the bench again): ``diloco8`` with ``training.overlap =
  "on"``, Streaming DiLoCo's overlapped outer step (round k's outer gradient travels while
  round k+1's inner steps run; ``LocalSGD`` in ``actors/replica/strategies.py``);
- ``auto`` (only when ``--systems`` names it): ``training.mode = "auto"``, which measures
  the links at start-up and prints its choice in the run's ``driver.log``.

The JSON's ``not_run`` names the systems this bench can run that ``--systems`` left out.

Figures (pure functions below, tested with plain data): each run's loss curve is the mean
training loss of each step's samples against seconds since its first step (start-up, which
differs between the systems, is left out), smoothed over ``SMOOTH`` steps; its held-out
points are ``(t_s, loss)`` evaluations of one fixed set of held-out batches
(``goodput_runs.held_out_loss``: ``EVAL_BATCH_PER_SHARD`` windows from the held-out 5% at
the end of each of the corpus's ``--nodes`` regions, which no training batch of either
system draws from). This bench evaluates each run's final model only, once the runs are
over, so a run has at most one held-out point, at its last step's time: DDP's model from
the checkpoint Ray Train reports at its stop, moshray's from the model its job saved at its
end (``save_model``: the model every replica of the last global step holds, for DiLoCo the
outer anchor; ``final_moshray_model``). The held-out check (``held_out_check``; skipped
with ``--held-out-fraction 0``): the best mode runs once more, stopped after the steps it
took in half the best baseline's wall time, and its final model's held-out loss is set
against that baseline's final model's: "reaches the best baseline's final held-out loss in
<= 1/2 of its time", on held-out data rather than on the training curve.

The target is the best baseline's final smoothed training loss (``best_baseline``: the
lowest of the baselines run; ``time_to_target_vs_best_baseline`` is the best mode's time to
it over that baseline's, ``time_to_target_vs_ddp`` over DDP's; ``held_out_loss`` /
``best_baseline_held_out_loss`` their final models'). In a run this short no batch is seen
twice, so each step's training loss is measured on data the model has not yet trained on:
a held-out estimate at every step, which is what gives times to the target their
resolution (a final-model evaluation can only say whether a run got there by its end). A
run's ``time_to_target_s`` is when its smoothed curve first reaches the target (None: never
within the run). For DiLoCo the curve is each replica's loss between outer steps, not the
averaged model's, so the final models' ``held_out_loss`` (each run's, and DDP's in
``ddp_held_out_loss``) checks that a mode's lower training loss is a better model.
``loss_at_equal_time`` compares every run's smoothed training loss at the shortest run's
last time. Bytes sent per node are read from the host side of each node's link
(``/sys/class/net/<veth>/statistics/rx_bytes``: everything the node sent, Ray's own
traffic included) over the run, and prorated to the target by the steps up to it.

Prints one JSON line (``--json``; else a short table and the JSON) and writes
``links-<profile>.png`` (loss against wall time, one line per run) and
``links-<profile>.json`` under ``--out`` (and, with ``--results DIR``, a result file).

``--compare`` measures what one uneven thing of a profile costs, against its baseline
(``jobs/local/links.baseline``), each layout on a fresh cluster, the same systems on both:

- ``straggler`` against ``even`` (every node at the fast nodes' rate): ``ddp`` and
  ``collaborative`` (moshray with its bandwidth shares and adaptive deadlines);
  ``step_time_rise`` per system is its median step time with the straggler over its median
  on even links, minus 1 (the target: <= 0.25 for moshray, DDP's near the link's
  ratio);
- ``zones`` against ``zone_blind`` (the same links and zone labels, the job run with
  ``training.zone_aware = false``, so the Coordinator's grid ignores zones):
  ``collaborative``; ``averaged_cross_zone_bytes_fall`` is the averaging's own bytes per
  step sent between the zones (the replicas count each byte they send by the receiver's
  zone: the job's ``cross_zone_bytes``), zone-blind over zone-aware;
  ``cross_zone_bytes_fall`` is the same for every frame on the wire (``ZoneBytes``: the
  counters of the one link between zone B's bridge and zone A's, Ray's control traffic
  included, which crosses the zones too and does not shrink with the grid); both beside
  ``grid_cross_zone_fall``, what the grid's plans predict for these zone sizes (2 + 1
  nodes: 4/3; 2 + 2: 2, the zone size; in general the harmonic mean of the two zones'
  sizes); ``--zone-b N`` puts the last N nodes in zone B (fast links among them, the slow
  one to zone A). ``last_link_bytes_fall`` is the same on the last node's own link both
  ways (``LinkBytes``: with one node in zone B, the crossing bytes).

Bytes per step are a run's bytes (start-up and Ray's own traffic included) over its steps;
step times are medians of the gaps between consecutive steps. Writes
``links-<profile>-compare.json`` under ``--out``. Every wait is bounded: each driver gets its
duration plus ``STARTUP_S`` and ``FINISH_S``, then is killed with its process group.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from moshray.jobs.bench.results import add_results_argument, save_result

SMOOTH = 5  # steps in the moving mean of a loss curve
# the held-out check: the best mode's run of this much of the best baseline's time
HELD_OUT_FRACTION = 1 / 2
STARTUP_S = 240.0  # a driver's start-up bound (Ray Train's worker group takes 25-50 s here)
FINISH_S = 120.0
MOSHRAY_STARTUP_S = 20.0  # added to a moshray run's max_seconds for its replicas' start-up
# What a user would run instead, at its best settings, each a Ray Train driver
# (jobs/bench/raytrain_baseline.py) with these arguments: DDP in fp32, DDP with torch's
# fp16_compress_hook and with PowerSGD (rank 2), torchft's DiLoCo and Streaming DiLoCo
# (Ray Train + torchft, the same H and outer step as moshray's DiLoCo modes).
BASELINES: dict[str, tuple[str, ...]] = {
    "ddp": (),
    "ddp_fp16": ("--comm-hook", "fp16"),
    "ddp_powersgd": ("--comm-hook", "powersgd"),
    "torchft_diloco": ("--torchft", "--torchft-mode", "diloco"),
    "torchft_streaming_diloco": ("--torchft", "--torchft-mode", "streaming_diloco"),
}
SYSTEMS = (*BASELINES, "collaborative", "diloco8", "diloco4")
# run only when --systems names them: diloco_overlap costs a whole run more; auto's
# training.mode = "auto" prints its choice in its driver.log
OPTIONAL = ("diloco_overlap", "auto")
# --compare: what each profile's one uneven thing is measured on (jobs/local/links.baseline)
# straggler: DiLoCo too (one exchange per --local-steps steps), the mode slow links call for
COMPARE_SYSTEMS = {"straggler": ("ddp", "collaborative", "diloco8"), "zones": ("collaborative",)}
COMPARE_CHOICES = ("ddp", "collaborative", "diloco8")
SHORT_MODEL = (
    "model.n_layers=2", "model.d_model=64", "model.d_ff=128", "model.n_heads=2",
    "model.seq_len=64", "training.batch_size=8", "training.target_batch_size=32",
    "training.round_timeout_s=20", "training.lr=3e-3",
)
FULL_MODEL = (
    "model.n_layers=4", "model.d_model=128", "model.d_ff=512", "model.n_heads=4",
    "model.seq_len=128", "training.batch_size=8", "training.target_batch_size=64",
    "training.round_timeout_s=30", "training.lr=1e-3",
)


class LinksBenchError(RuntimeError):
    """A run of the bench could not produce its figures (one line: which run, which log)."""


# --------------------------------------------------------------------------- pure figures


@dataclass(frozen=True)
class Curve:
    """One run's training loss against seconds since its first step (``points``: ``(t_s,
    loss)`` per step, in time order), the bytes each node sent during the run, and its
    ``held_out`` evaluations (``(t_s, loss)`` on the fixed held-out batches, in time order;
    empty where none was made); ``bytes_by_node``: what ``LinkBytes`` counted on each
    node's link over the run, in slot order; ``peers``: how many took part in each step
    (DDP's worker group, moshray's contributors); ``cross_zone_bytes``: the bytes that
    crossed between zone B and the rest during the run (``ZoneBytes``; None: not counted),
    all traffic, Ray's own too; ``averaged_cross_zone_bytes``: of those, what moshray's
    averaging sent to a peer of another zone, as the replicas counted it (the job's
    ``cross_zone_bytes``; None: not a moshray run)."""

    name: str
    points: tuple[tuple[float, float], ...]
    bytes_per_node: float = 0.0
    held_out: tuple[tuple[float, float], ...] = ()
    bytes_by_node: tuple[float, ...] = ()  # each node's link over the run (LinkBytes)
    peers: tuple[int, ...] = ()  # nodes that took part in each step (as ``points``)
    cross_zone_bytes: float | None = None  # between zone B and the rest (ZoneBytes)
    averaged_cross_zone_bytes: float | None = None  # the averaging's own (the job's count)


def smoothed(points: Sequence[tuple[float, float]], window: int = SMOOTH
             ) -> list[tuple[float, float]]:
    """The moving mean of the last ``window`` losses at each point (fewer at the start).
    ``ValueError`` for a window < 1."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, acc = [], []
    for t, loss in points:
        acc.append(loss)
        if len(acc) > window:
            acc.pop(0)
        out.append((t, sum(acc) / len(acc)))
    return out


def time_to_target(points: Sequence[tuple[float, float]], target: float,
                   window: int = SMOOTH) -> float | None:
    """Seconds at which the smoothed curve first reaches ``target`` (<=), or None."""
    for t, loss in smoothed(points, window):
        if loss <= target:
            return t
    return None


def steps_to_target(points: Sequence[tuple[float, float]], target: float,
                    window: int = SMOOTH) -> int | None:
    """How many points up to and including the first at which the smoothed curve reaches
    ``target``, or None."""
    for i, (_, loss) in enumerate(smoothed(points, window)):
        if loss <= target:
            return i + 1
    return None


def loss_at(points: Sequence[tuple[float, float]], t_s: float,
            window: int = SMOOTH) -> float | None:
    """The smoothed loss at the last point at or before ``t_s`` (None if none)."""
    found = None
    for t, loss in smoothed(points, window):
        if t > t_s:
            break
        found = loss
    return found


def final_loss(points: Sequence[tuple[float, float]], window: int = SMOOTH) -> float | None:
    """The smoothed loss at the last point (None for an empty curve)."""
    curve = smoothed(points, window)
    return curve[-1][1] if curve else None


def figures(profile: str, curves: dict[str, Curve], rates: Sequence[float | None],
            window: int = SMOOTH) -> dict:
    """The bench's JSON object from its runs' curves (``curves["ddp"]`` required): the
    best baseline (of ``BASELINES`` run: the lowest final smoothed training loss) and the
    target, its final smoothed training loss (see the module docstring); each run's time
    and bytes to it, its final model's held-out loss (None without one), loss at the
    shortest run's end; the best moshray mode and its time over the best baseline's
    (``time_to_target_vs_best_baseline``) and over DDP's (``time_to_target_vs_ddp``; lower
    is better; None where that baseline or every moshray mode missed the target; with no
    mode reaching it the best is the lowest loss at equal time). ``ValueError`` without a
    DDP curve with points."""
    ddp = curves.get("ddp")
    if ddp is None or not ddp.points:
        raise ValueError("the DDP run recorded no step: no target to measure against")
    finals = {n: final_loss(c.points, window) for n, c in curves.items()
              if n in BASELINES and c.points}
    best_baseline = min(finals, key=finals.get)
    target = finals[best_baseline]
    equal_t = min(c.points[-1][0] for c in curves.values() if c.points)
    modes: dict[str, dict] = {}
    for name, c in curves.items():
        tt = time_to_target(c.points, target, window)
        steps = steps_to_target(c.points, target, window)
        modes[name] = {
            "time_to_target_s": None if tt is None else round(tt, 2),
            "bytes_per_node_to_target": (None if steps is None or not c.points else
                                         int(c.bytes_per_node * steps / len(c.points))),
            "bytes_per_node": int(c.bytes_per_node),
            "steps": len(c.points),
            "wall_s": round(c.points[-1][0], 2) if c.points else 0.0,
            "final_loss": None if not c.points else _round(final_loss(c.points, window)),
            "held_out_loss": _round(c.held_out[-1][1]) if c.held_out else None,
            "loss_at_equal_time": (None if not c.points else
                                   _round(loss_at(c.points, equal_t, window))),
        }
    ddp_t = modes["ddp"]["time_to_target_s"]
    base_t = modes[best_baseline]["time_to_target_s"]
    reached = {n: m["time_to_target_s"] for n, m in modes.items()
               if n not in BASELINES and m["time_to_target_s"] is not None}
    best = min(reached, key=reached.get) if reached else None
    if best is None:  # no mode reached it: the best is the lowest loss at equal time
        others = {n: m["loss_at_equal_time"] for n, m in modes.items()
                  if n not in BASELINES and m["loss_at_equal_time"] is not None}
        best = min(others, key=others.get) if others else None
    best_t = reached.get(best) if best is not None else None
    return {
        "profile": profile, "link_mbit": list(rates), "target_loss": round(target, 4),
        "best_baseline": best_baseline,
        "best_baseline_time_to_target_s": base_t,
        "best_baseline_held_out_loss": modes[best_baseline]["held_out_loss"],
        "ddp_held_out_loss": modes["ddp"]["held_out_loss"],
        "equal_time_s": round(equal_t, 2),
        "ddp_time_to_target_s": ddp_t, "moshray_time_to_target_s": best_t,
        "moshray_mode": best,
        "held_out_loss": modes[best]["held_out_loss"] if best is not None else None,
        "time_to_target_vs_best_baseline": (None if best_t is None or not base_t else
                                            round(best_t / base_t, 3)),
        "time_to_target_vs_ddp": (None if best_t is None or not ddp_t else
                                  round(best_t / ddp_t, 3)),
        "modes": modes,
    }


def steps_within(points: Sequence[tuple[float, float]], t_s: float) -> int:
    """How many of a curve's steps came at or before ``t_s`` seconds. Pure."""
    return sum(1 for t, _ in points if t <= t_s)


def held_out_check(mode: str, baseline: Curve, rerun: Curve, fraction: float) -> dict:
    """The held-out form of the target: ``mode`` run again for the steps it took in
    ``fraction`` of the ``baseline`` run's wall time (``rerun``), its final model's held-out
    loss against the baseline's final model's. ``met`` when the rerun's held-out loss is at
    most the baseline's and its wall time at most ``fraction`` of the baseline's (None where
    a held-out loss is missing). Pure."""
    base_s = baseline.points[-1][0] if baseline.points else None
    wall = rerun.points[-1][0] if rerun.points else None
    loss = rerun.held_out[-1][1] if rerun.held_out else None
    base_loss = baseline.held_out[-1][1] if baseline.held_out else None
    ratio = None if wall is None or not base_s else round(wall / base_s, 3)
    return {"mode": mode, "baseline": baseline.name, "fraction": fraction,
            "steps": len(rerun.points), "wall_s": _round(wall),
            "baseline_wall_s": _round(base_s), "time_vs_baseline": ratio,
            "held_out_loss": _round(loss), "baseline_held_out_loss": _round(base_loss),
            "met": (None if loss is None or base_loss is None or ratio is None else
                    bool(loss <= base_loss and ratio <= fraction + 1e-9))}


def median_step_s(points: Sequence[tuple[float, float]]) -> float | None:
    """The median seconds between consecutive steps of a curve (None with under 2 steps):
    a step's time, robust to the odd slow step (a join, a descheduled process)."""
    gaps = sorted(b[0] - a[0] for a, b in zip(points, points[1:]))
    if not gaps:
        return None
    mid = len(gaps) // 2
    return gaps[mid] if len(gaps) % 2 else (gaps[mid - 1] + gaps[mid]) / 2


def compare_figures(profile: str, baseline_name: str, runs: dict[str, dict[str, Curve]]
                    ) -> dict:
    """The ``--compare`` JSON object from ``runs`` (layout name -> system -> curve, for
    ``baseline_name`` and ``profile``; ``Curve.bytes_by_node`` counted both ways on each
    link). Per system and layout: steps, the median of the nodes taking part in a step
    (``peers_per_step``), the median step time and the bytes per step on
    the last node's link (the straggler's, or zone B's only node: every byte on it
    crosses the slow inter-zone link); per system ``step_time_rise`` (the profile's median
    step over the baseline's, minus 1: 0.25 is 25% slower) and ``last_link_bytes_fall``
    (the baseline's bytes per step on that link over the profile's); where the runs counted
    ``Curve.cross_zone_bytes``, ``cross_zone_bytes_per_step`` per layout and
    ``cross_zone_bytes_fall`` per system (the baseline's over the profile's: with several
    nodes in zone B, the last link also carries zone B's own traffic, so this is the
    wire's figure); likewise ``averaged_cross_zone_bytes_per_step`` and
    ``averaged_cross_zone_bytes_fall`` from ``Curve.averaged_cross_zone_bytes`` (the
    averaging's own bytes between zones: the grid's figure, without Ray's control traffic,
    which crosses the zones too and does not shrink with the grid). A figure is None where
    a run has too few steps. Pure."""
    systems: dict[str, dict] = {}
    rise, fall, cross, averaged = {}, {}, {}, {}
    names = sorted({s for by in runs.values() for s in by})
    for sys_name in names:
        per = {}
        for layout in (baseline_name, profile):
            c = runs.get(layout, {}).get(sys_name)
            steps = len(c.points) if c else 0
            per[layout] = {
                "steps": steps,
                # a swarm that stepped without a node (its replica never synced, its
                # contributions missed their deadlines) shows it here
                "peers_per_step": (None if c is None or not c.peers else
                                   sorted(c.peers)[len(c.peers) // 2]),
                "median_step_s": None if c is None else _round(median_step_s(c.points)),
                "last_link_bytes_per_step": (int(c.bytes_by_node[-1] / steps)
                                             if c and c.bytes_by_node and steps else None),
                "cross_zone_bytes_per_step": (int(c.cross_zone_bytes / steps) if c and steps
                                              and c.cross_zone_bytes is not None else None),
                "averaged_cross_zone_bytes_per_step": (
                    int(c.averaged_cross_zone_bytes / steps) if c and steps and
                    c.averaged_cross_zone_bytes is not None else None),
            }
        systems[sys_name] = per
        base, shaped = per[baseline_name], per[profile]
        rise[sys_name] = (None if not (base["median_step_s"] and shaped["median_step_s"]) else
                          round(shaped["median_step_s"] / base["median_step_s"] - 1, 3))
        fall[sys_name] = (None if not (base["last_link_bytes_per_step"]
                                       and shaped["last_link_bytes_per_step"]) else
                          round(base["last_link_bytes_per_step"]
                                / shaped["last_link_bytes_per_step"], 3))
        for key, into in (("cross_zone_bytes_per_step", cross),
                          ("averaged_cross_zone_bytes_per_step", averaged)):
            if base[key] and shaped[key]:
                into[sys_name] = round(base[key] / shaped[key], 3)
    out = {"profile": profile, "baseline": baseline_name, "systems": systems,
           "step_time_rise": rise, "last_link_bytes_fall": fall}
    if cross:
        out["cross_zone_bytes_fall"] = cross
    if averaged:
        out["averaged_cross_zone_bytes_fall"] = averaged
    return out


def grid_cross_zone_fall(zones: Sequence[tuple[int, str]], epochs: int = 20) -> float | None:
    """What the grid's plans predict for ``last_link_bytes_fall`` of a zoned layout: bytes
    crossing zones per step, zone-blind over zone-aware, each the mean over ``epochs``
    plans of the peers one per slot (``grid.cross_zone_bytes``). None with one zone."""
    from moshray.cluster.collective.grid import DEFAULT_MAX_GROUP, cross_zone_bytes, plan_grid

    of = {f"node{slot}": zone for slot, zone in zones}
    if len(set(of.values())) < 2:
        return None
    peers = sorted(of)
    blind = sum(cross_zone_bytes(plan_grid(peers, DEFAULT_MAX_GROUP, epoch=e), of, 1000)
                for e in range(epochs))
    aware = sum(cross_zone_bytes(plan_grid(peers, DEFAULT_MAX_GROUP, epoch=e, zones=of), of,
                                 1000) for e in range(epochs))
    return round(blind / aware, 3) if aware else None


def _round(value: float | None) -> float | None:
    """4 decimals; None for None or a non-finite loss (a diverged run: JSON has no NaN)."""
    return None if value is None or not math.isfinite(value) else round(value, 4)


# --------------------------------------------------------------------------- the edge


def model_figures(config, nodes: int, repeats: int = 5) -> tuple[int, float]:
    """(fp16 gradient bytes, compute seconds of one node's share of a global step) of
    ``config``'s model (a ``TrainConfig``) on ``nodes`` nodes, measured here on one thread
    as a replica runs."""
    import torch

    from moshray.jobs.examples.lm.model import build_model

    torch.set_num_threads(1)
    model = build_model(config.model.to_model_config(), seed=0)
    params = sum(p.numel() for p in model.parameters())
    t = config.training
    x = torch.randint(0, config.model.vocab_size, (t.batch_size, config.model.seq_len))
    model.loss(x, x).backward()  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        model.loss(x, x).backward()
    micro_s = (time.perf_counter() - started) / repeats
    accum = max(1, math.ceil(t.target_batch_size / (nodes * t.batch_size)))
    return 2 * params, micro_s * accum


def profile_links(profile_name: str, config, nodes: int):
    """``(NodeLinks, wire_bytes, compute_s)``: link profile ``profile_name`` laid onto
    ``nodes`` separate hosts for ``config``'s model (``model_figures``: the rates give the
    profile's compute-to-communication ratio), after one line on stderr saying so.
    ``ValueError`` (one line naming the choices) for an unknown profile;
    ``LinksBenchError`` where network namespaces cannot be made here."""
    from moshray.jobs.local import links, netns

    profile = links.get_profile(profile_name)
    why = netns.unavailable()
    if why:
        raise LinksBenchError(f"link profiles need separate hosts (network namespaces): {why}")
    wire_bytes, compute_s = model_figures(config, nodes)
    laid = links.lay_out(profile, nodes, wire_bytes, compute_s)
    print(f"links {profile.name}: {profile.description}; model {wire_bytes / 1e3:.0f} kB fp16 "
          f"gradients, {compute_s * 1e3:.0f} ms compute per node per step -> links "
          f"{laid.mbit} Mbit/s" + (f", zone links {dict(laid.zone_links)} Mbit/s"
                                   if laid.zone_links else ""), file=sys.stderr, flush=True)
    return laid, wire_bytes, compute_s


def _config(sets: Sequence[str]):
    from moshray.jobs.config import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    argv = [a for s in sets for a in ("--set", s)]
    return config_from_args(parser.parse_args(argv))


class LinkBytes:
    """Bytes each spot node has sent on its link: the host side's ``rx_bytes``; with
    ``both_ways`` what it sent and received (``rx_bytes + tx_bytes``: every byte that
    crossed its link)."""

    def __init__(self, cluster, slots: Sequence[int], both_ways: bool = False):
        ways = ("rx_bytes", "tx_bytes") if both_ways else ("rx_bytes",)
        self.paths = [[Path(f"/sys/class/net/{cluster.net.host(s).veth}/statistics/{w}")
                       for w in ways] for s in slots]

    def read(self) -> list[int]:
        return [sum(int(p.read_text()) for p in node) for node in self.paths]


class ZoneBytes:
    """Bytes crossing between a zone and the rest: the host side of the zone's link
    (``HostNetwork.zone_link``, between its bridge and the head's), ``rx_bytes +
    tx_bytes``: every frame between the zone and the rest, Ethernet header included, each
    once; traffic inside the zone stays on its bridge and is not counted."""

    def __init__(self, cluster, zone: str):
        link = cluster.net.zone_link(zone)
        self.paths = [Path(f"/sys/class/net/{link}/statistics/{w}")
                      for w in ("rx_bytes", "tx_bytes")]

    def read(self) -> int:
        return sum(int(p.read_text()) for p in self.paths)


def zone_layout(laid, zone_b: int):
    """``laid`` (the ``zones`` profile laid onto n slots: the last in zone B, behind zone
    B's slow link) with its last ``zone_b`` slots in zone B, on zone B's bridge, the
    others in zone A. ``ValueError`` unless ``1 <= zone_b <= n - 1``. Pure."""
    from dataclasses import replace as with_

    n = len(laid.mbit)
    if not 1 <= zone_b <= n - 1:
        raise ValueError(f"zone B needs 1 to {n - 1} of {n} nodes, got {zone_b}")
    return with_(laid, zones=tuple((i, "b" if i >= n - zone_b else "a") for i in range(n)))


def _driver_env(cluster, home: Path) -> dict:
    env = cluster.driver_env()
    env["HOME"] = str(home)
    env.pop("MOSHRAY_CHECKPOINT_URI", None)
    home.mkdir(parents=True, exist_ok=True)
    return env


def _run_bounded(argv: list[str], env: dict, log_path: Path, out_path: Path | None,
                 bound_s: float, cwd: Path) -> int:
    """Run ``argv`` (a session of its own), stdout to ``out_path`` (or the log); kill its
    process group after ``bound_s``. Returns its exit status (-9 if killed)."""
    with open(log_path, "w") as err, open(out_path or os.devnull, "w") as out:
        proc = subprocess.Popen(argv, stdout=out if out_path else err, stderr=err, env=env,
                                cwd=cwd, start_new_session=True, text=True)
        try:
            return proc.wait(timeout=bound_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with _quiet():
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                return -9
        finally:
            if proc.poll() is None:
                with _quiet():
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], ProcessLookupError)


def _relative(points: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    if not points:
        return ()
    t0 = points[0][0]
    return tuple((round(t - t0, 3), loss) for t, loss in points)


def run_baseline(name: str, cluster, sets: Sequence[str], nodes: int, seconds: float,
                 run_dir: Path, counter: LinkBytes, local_steps: int = 16
                 ) -> tuple[Curve, str | None]:
    """The baseline ``name`` of ``BASELINES`` (a Ray Train driver) on the cluster's spot
    nodes for ``seconds`` after its workers' first step (``--steady-seconds``: start-up is
    not part of the window; torchft's DiLoCo with ``local_steps`` inner steps and this
    bench's outer step); returns its curve and the state file of its final checkpoint
    (None if none)."""
    from moshray.jobs.bench.goodput_runs import latest_persisted

    run_dir.mkdir(parents=True, exist_ok=True)
    extra = list(BASELINES[name])
    if "--torchft" in extra:
        extra += ["--sync-every", str(local_steps), "--outer-lr", str(OUTER_LR),
                  "--outer-momentum", str(OUTER_MOMENTUM)]
    storage = run_dir / "raytrain"
    argv = [sys.executable, "-m", "moshray.jobs.bench.raytrain_baseline",
            "--address", cluster.address, "--duration", str(seconds + STARTUP_S),
            "--steady-seconds", str(seconds),
            "--max-workers", str(nodes), "--fixed", "--checkpoint-every", str(10**9),
            "--storage-path", str(storage), "--cpus-per-worker", "1",
            "--recorder", f"links-recorder-{uuid.uuid4().hex[:8]}", "--gloo-ifname", "eth0",
            *extra, "--set", f"run_dir={run_dir}", "--set", f"cluster.max_nodes={nodes}",
            *[a for s in sets for a in ("--set", s)]]
    before = counter.read()
    out = run_dir / "stdout.jsonl"
    status = _run_bounded(argv, _driver_env(cluster, run_dir / "home"),
                          run_dir / "driver.log", out, seconds + STARTUP_S + FINISH_S, run_dir)
    sent = [a - b for a, b in zip(counter.read(), before)]
    summary = None
    for line in out.read_text().splitlines():
        if line.startswith("{") and '"finished"' in line:
            summary = json.loads(line)
    if summary is None:
        raise LinksBenchError(f"{name}: the Ray Train driver exited {status} without a "
                              f"summary; see {run_dir / 'driver.log'}")
    steps = [s for s in summary["records"]["steps"] if s[3] is not None]
    points = [(float(s[0]), float(s[3])) for s in steps]  # [unix, step, samples, loss, world]
    return (Curve(name, _relative(points), sum(sent) / len(sent), bytes_by_node=tuple(sent),
                  peers=tuple(int(s[4]) for s in steps)),
            summary.get("checkpoint") or latest_persisted(str(storage)))


def run_moshray(name: str, cluster, sets: Sequence[str], extra: Sequence[str], nodes: int,
                seconds: float, run_dir: Path, counter: LinkBytes) -> tuple[Curve, Path]:
    """moshray's job (``moshray.jobs.train``) on the cluster for ``seconds`` plus
    ``MOSHRAY_STARTUP_S`` (its replicas' start-up, 10-25 s here, is inside its
    ``max_seconds``); returns its curve and where its final model is: the job saves it
    (``save_model``: the model every replica of the last step holds, for DiLoCo the outer
    anchor) to ``<run_dir>/run/model.pt`` on the driver's machine. It keeps no checkpoint
    here (on several machines it refuses a checkpoint path on one machine's disk, and the
    embedded cluster has no durable store)."""
    from moshray.jobs.local.cluster import free_ports

    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "moshray.jobs.train", "--json", "--trace", "off",
            "--max-seconds", str(seconds + MOSHRAY_STARTUP_S), "--metrics-port", str(free_ports(1)[0]),
            "--max-nodes", str(nodes), "--set", f"run_dir={run_dir / 'run'}",
            "--set", "checkpoint.optional=true", "--set", "save_model=true",
            *[a for s in (*sets, *extra) for a in ("--set", s)]]
    before = counter.read()
    status = _run_bounded(argv, _driver_env(cluster, run_dir / "home"), run_dir / "driver.log",
                          run_dir / "stdout.jsonl", seconds + STARTUP_S + FINISH_S, run_dir)
    sent = [a - b for a, b in zip(counter.read(), before)]
    saved = run_dir / "run" / "summary.json"
    try:
        summary = json.loads(saved.read_text())
        history = summary["history"]  # [epoch, at_s, samples, loss, peers]
    except (OSError, ValueError, KeyError):
        raise LinksBenchError(f"{name}: the job exited {status} without {saved}; see "
                              f"{run_dir / 'driver.log'}") from None
    history = [h for h in history if h[3] is not None]
    points = [(float(h[1]), float(h[3])) for h in history]
    crossed = summary.get("cross_zone_bytes")
    return Curve(name, _relative(points), sum(sent) / len(sent), bytes_by_node=tuple(sent),
                 peers=tuple(int(h[4]) for h in history),
                 averaged_cross_zone_bytes=None if crossed is None else float(crossed)), \
        run_dir / "run" / "model.pt"


def final_moshray_model(path: Path) -> dict | None:
    """The model a moshray run saved (``save_model``: ``<run_dir>/model.pt``), or None if
    it saved none (the job logs why)."""
    import torch

    return torch.load(path, weights_only=True) if Path(path).is_file() else None


def with_held_out(curves: dict[str, Curve], finals: dict, config, files: Sequence[str]
                  ) -> tuple[dict[str, Curve], dict[str, str]]:
    """Each curve with its final model's held-out loss as its one held-out point, at its
    last step's time (``finals``: name -> DDP's state file or a moshray run's saved
    model); and, per run whose final model could not be evaluated, why (one line: the
    run's figures then go without it)."""
    from dataclasses import replace

    from moshray.jobs.bench.goodput_runs import held_out_loss, raytrain_final_state

    out, missing = dict(curves), {}
    for name, curve in curves.items():
        if not curve.points:  # (no step: nothing to place a point at)
            continue
        where = finals.get(name)
        try:
            state = (raytrain_final_state(where) if name in BASELINES else
                     final_moshray_model(where) if where is not None else None)
            loss = held_out_loss(config, files, state)
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            missing[name] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
            continue
        if loss is None:
            missing[name] = f"no final state found ({where})"
        else:
            out[name] = replace(curve, held_out=((curve.points[-1][0], loss),))
    return out, missing


# DiLoCo's outer step for this bench's H (16): DiLoCo's own 0.7 / 0.9 were tuned for H = 500
# and overshoot here (an effective outer lr of 0.7 / (1 - 0.9) = 7 against 0.4 / 0.3 = 1.3);
# the sweep that chose these is in docs/performance.md (time to a loss over slow links).
OUTER_LR, OUTER_MOMENTUM = 0.4, 0.7


def mode_settings(local_steps: int) -> dict[str, tuple[str, ...]]:
    """Each moshray system's ``--set`` overrides (the DiLoCo modes' outer step:
    ``OUTER_LR``, ``OUTER_MOMENTUM``)."""
    diloco = ("training.mode=local_sgd", "training.outer_optimizer=nesterov",
              f"training.local_steps={local_steps}", f"training.outer_lr={OUTER_LR}",
              f"training.outer_momentum={OUTER_MOMENTUM}")
    return {"collaborative": ("training.mode=collaborative", "training.compression=fp16"),
            "diloco8": (*diloco, "training.compression=blockwise8"),
            "diloco4": (*diloco, "training.compression=blockwise4"),
            "diloco_overlap": (*diloco, "training.compression=blockwise8",
                               "training.overlap=on"),
            "auto": ("training.mode=auto",)}


def plot(path: Path, result: dict, curves: dict[str, Curve]) -> Path:
    """Loss (smoothed) against seconds since the first step, one line per run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from moshray.jobs.plots import save_png

    fig = Figure(figsize=(7, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, c in curves.items():
        pts = smoothed(c.points)
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], linewidth=1.2, label=name)
        if c.held_out:  # the final model's held-out loss: a marker in the run's colour
            ax.plot([p[0] for p in c.held_out], [p[1] for p in c.held_out], marker="o",
                    linestyle="none", color=line.get_color())
    finite = [p[1] for c in curves.values() for p in smoothed(c.points) if math.isfinite(p[1])]
    ddp_start = smoothed(curves["ddp"].points)[0][1] if curves["ddp"].points else None
    if finite and ddp_start is not None:  # a diverging run leaves the frame, not the scale
        ax.set_ylim(min(finite) - 0.1, max(ddp_start, result["target_loss"]) + 0.5)
    held_out = any(c.held_out for c in curves.values())
    ax.axhline(result["target_loss"], color="grey", linestyle="--", linewidth=0.8,
               label="target (DDP's final loss)")
    ax.set_xlabel("wall seconds since the first step")
    ax.set_ylabel(f"training loss (mean of {SMOOTH} steps)"
                  + ("; dots: final model's held-out loss" if held_out else ""))
    ax.set_title(f"links: {result['profile']} ({result['link_mbit']} Mbit/s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return save_png(fig, path)


def _cluster(nodes: int, laid):
    """A separate-hosts cluster of ``nodes`` spot nodes with ``laid``'s links and zones."""
    from moshray.jobs.local.cluster import LocalCluster, LocalClusterConfig

    return LocalCluster(LocalClusterConfig(spot_nodes=nodes, hosts="netns", cpus_per_node=1,
                                           head_cpus=1, object_store_bytes=100 * 1024 * 1024,
                                           **laid.cluster_fields()))


def run_compare(profile_name: str, nodes: int, seconds: float, short: bool, out_dir: Path,
                systems: Sequence[str], local_steps: int = 16, zone_b: int = 1) -> dict:
    """``--compare``: ``systems`` (of ``COMPARE_CHOICES``; ``diloco8`` averages every
    ``local_steps`` local steps, so its step is a round of them) on the profile's
    baseline layout (``links.baseline``: even links, or no zone labels), then on the
    profile's own, each layout a fresh cluster; returns ``compare_figures`` with the
    layouts' rates and, for zones, ``grid_cross_zone_fall``. Writes
    ``links-<profile>-compare.json`` under ``out_dir``. ``zone_b``: the zones profile's
    nodes in zone B (``zone_layout``); both layouts then count the bytes crossing between
    zone B and the rest (``ZoneBytes``: ``cross_zone_bytes_fall``)."""
    from moshray.jobs.local import links

    sets = SHORT_MODEL if short else FULL_MODEL
    laid, wire_bytes, compute_s = profile_links(profile_name, _config(sets), nodes)
    if laid.zones:
        try:
            laid = zone_layout(laid, zone_b)
        except ValueError as exc:
            raise LinksBenchError(f"--zone-b: {exc}") from None
        print(f"zone B: the last {zone_b} node(s), zones {dict(laid.zones)}, joined by "
              f"{dict(laid.zone_links)} Mbit/s", file=sys.stderr, flush=True)
    zone_b_slots = [slot for slot, zone in laid.zones if zone == "b"]
    try:
        base_name, base = links.baseline(laid)
    except ValueError as exc:
        raise LinksBenchError(f"--compare: {exc}") from None
    settings = mode_settings(local_steps)
    layouts = {base_name: base, profile_name: laid}
    runs: dict[str, dict[str, Curve]] = {}
    failed: dict[str, str] = {}
    for layout, shaped in layouts.items():
        runs[layout] = {}
        cluster = _cluster(nodes, shaped)
        crossing = None
        try:
            counter = LinkBytes(cluster, range(nodes), both_ways=True)
            if zone_b_slots:
                crossing = ZoneBytes(cluster, "b")
            for name in systems:
                started = time.monotonic()
                run_dir = out_dir / f"compare-{layout}" / name
                crossed = crossing.read() if crossing else None
                try:
                    curve = (
                        run_baseline("ddp", cluster, sets, nodes, seconds, run_dir, counter)[0]
                        if name == "ddp" else
                        run_moshray(name, cluster, sets,
                                    (*settings[name], *links.BASELINE_SETS.get(layout, ())),
                                    nodes, seconds,
                                    run_dir, counter)[0])
                    if crossing is not None:
                        curve = replace(curve, cross_zone_bytes=crossing.read() - crossed)
                    runs[layout][name] = curve
                except LinksBenchError as exc:
                    failed[f"{layout}/{name}"] = str(exc)
                    print(f"bench links: {layout}: {exc}", file=sys.stderr, flush=True)
                    continue
                print(f"bench links: {layout}: {name}: {len(runs[layout][name].points)} "
                      f"steps in {time.monotonic() - started:.0f} s", file=sys.stderr,
                      flush=True)
        finally:
            cluster.shutdown()
    result = compare_figures(profile_name, base_name, runs)
    result.update(layouts={n: {"link_mbit": list(l.mbit), "zones": dict(l.zones),
                               "zone_links": dict(l.zone_links)}
                           for n, l in layouts.items()},
                  failed=failed, nodes=nodes, seconds_per_run=seconds, short=short,
                  zone_b=len(zone_b_slots) or None,
                  gradient_bytes_fp16=wire_bytes, step_compute_s=round(compute_s, 4))
    if laid.zones:
        result["grid_cross_zone_fall"] = grid_cross_zone_fall(laid.zones)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"links-{profile_name}-compare.json").write_text(json.dumps(
        {**result, "curves": {f"{layout}/{n}": c.points for layout, by in runs.items()
                              for n, c in by.items()}}))
    return result


def run(profile_name: str, nodes: int, seconds: float, short: bool, local_steps: int,
        out_dir: Path, systems: Sequence[str] = SYSTEMS,
        held_out_fraction: float = HELD_OUT_FRACTION) -> dict:
    """The whole bench (see the module docstring); returns the JSON object. With
    ``held_out_fraction`` (0: not run) the best mode runs once more, for the steps it took
    in that fraction of DDP's wall time, and its final model's held-out loss is compared
    with the best baseline's (``held_out_check``, the JSON's ``held_out_check``)."""
    from moshray.actors.replica.mode_choice import choose_mode
    from moshray.jobs.local import links

    profile = links.get_profile(profile_name)
    sets = SHORT_MODEL if short else FULL_MODEL
    laid, wire_bytes, compute_s = profile_links(profile_name, _config(sets), nodes)
    rates = laid.mbit
    slowest = laid.slowest
    choice = choose_mode(slowest * 1e6 if slowest else 10e9, wire_bytes, compute_s)
    print(choice.line, file=sys.stderr, flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    curves: dict[str, Curve] = {}
    finals: dict = {}  # where each run's final model is (a state file, a checkpoint dir)
    failed: dict[str, str] = {}  # a moshray mode that failed: its one line (DDP's is fatal)
    settings = mode_settings(local_steps)
    cluster = _cluster(nodes, laid)
    rerun = None
    try:
        counter = LinkBytes(cluster, range(nodes))
        for name in systems:
            started = time.monotonic()
            if name in BASELINES:
                why = _baseline_missing(name)
                try:
                    if why:
                        raise LinksBenchError(f"{name}: not run: {why}")
                    curves[name], finals[name] = run_baseline(
                        name, cluster, sets, nodes, seconds, out_dir / name, counter,
                        local_steps)
                except LinksBenchError as exc:
                    if name == "ddp":
                        raise
                    failed[name] = str(exc)
                    print(f"bench links: {exc}", file=sys.stderr, flush=True)
                    continue
            else:
                try:
                    curves[name], finals[name] = run_moshray(
                        name, cluster, sets, settings[name], nodes, seconds, out_dir / name,
                        counter)
                except LinksBenchError as exc:
                    failed[name] = str(exc)
                    print(f"bench links: {exc}", file=sys.stderr, flush=True)
                    continue
            print(f"bench links: {name}: {len(curves[name].points)} steps in "
                  f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        rerun = _held_out_rerun(curves, settings, held_out_fraction, profile.name, rates,
                                cluster, sets, nodes, seconds, out_dir, counter, failed)
    finally:
        cluster.shutdown()
    inputs = _held_out_inputs(sets, nodes, out_dir / "ddp" / "home")
    curves, held_out_missing = with_held_out(curves, finals, *inputs)
    for name, why in held_out_missing.items():
        print(f"bench links: {name}: no held-out loss ({why})", file=sys.stderr, flush=True)
    result = figures(profile.name, curves, rates)
    if rerun is not None:
        mode, curve, where = rerun
        held, missing = with_held_out({curve.name: curve}, {curve.name: where}, *inputs)
        held_out_missing.update(missing)
        result["held_out_check"] = held_out_check(mode, curves[result["best_baseline"]],
                                                  held[curve.name],
                                                  held_out_fraction)
    result.update(failed=failed, held_out_missing=held_out_missing,
                  not_run={n: "not named by --systems" for n in SYSTEMS + OPTIONAL
                           if n not in systems},
                  nodes=nodes, seconds_per_run=seconds, short=short, local_steps=local_steps,
                  gradient_bytes_fp16=wire_bytes, step_compute_s=round(compute_s, 4),
                  auto_choice={"mode": choice.mode, "local_steps": choice.local_steps,
                               "reason": choice.reason})
    result["plot"] = str(plot(out_dir / f"links-{profile.name}.png", result, curves))
    (out_dir / f"links-{profile.name}.json").write_text(json.dumps(
        {**result, "curves": {n: c.points for n, c in curves.items()},
         "held_out": {n: c.held_out for n, c in curves.items()}}))
    return result


def _baseline_missing(name: str) -> str | None:
    """Why the baseline ``name`` cannot run here (one line), or None."""
    if "--torchft" not in BASELINES[name]:
        return None
    try:
        import torchft  # noqa: F401
    except ImportError:
        return "torchft is not installed (pip install 'moshray[bench]')"
    return None


def _held_out_rerun(curves: dict[str, Curve], settings: dict, fraction: float, profile: str,
                    rates, cluster, sets: Sequence[str], nodes: int, seconds: float,
                    out_dir: Path, counter: LinkBytes, failed: dict):
    """``run``'s held-out check: the best moshray mode of ``curves`` (``figures``) run again
    for ``training.max_steps`` = the steps it took in ``fraction`` of the best baseline's
    wall time; ``(mode, curve, its saved model)``, or None where there is nothing to run
    (no fraction, no DDP steps, no mode, or no step in that time) or the run failed (named
    in ``failed``)."""
    ddp = curves.get("ddp")
    if not fraction or ddp is None or not ddp.points:
        return None
    found = figures(profile, curves, rates)
    best, baseline = found["moshray_mode"], curves[found["best_baseline"]]
    if best not in settings or best not in curves:
        return None
    steps = steps_within(curves[best].points, fraction * baseline.points[-1][0])
    if steps < 1:
        return None
    name = f"{best}_held_out"
    started = time.monotonic()
    try:
        curve, where = run_moshray(name, cluster, sets,
                                   (*settings[best], f"training.max_steps={steps}"), nodes,
                                   seconds, out_dir / name, counter)
    except LinksBenchError as exc:
        failed[name] = str(exc)
        print(f"bench links: {exc}", file=sys.stderr, flush=True)
        return None
    print(f"bench links: {name}: {len(curve.points)} steps (of {steps}) in "
          f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return best, curve, where


def _held_out_inputs(sets: Sequence[str], nodes: int, home: Path) -> tuple:
    """(config, files) for ``with_held_out``: the runs' model and
    ``cluster.max_nodes`` (the corpus's regions, whose held-out ends are evaluated), and
    the corpus the DDP driver trained on (built under its ``HOME``)."""
    from moshray.jobs.examples.lm.corpus import resolve_data

    config = _config((*sets, f"cluster.max_nodes={nodes}"))
    cache = config.data.cache_dir
    cache = str(home / cache[2:]) if cache.startswith("~/") else os.path.expanduser(cache)
    return config, resolve_data(list(config.data.paths) or None, cache)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moshray.jobs.local.links import PROFILES

    parser.add_argument("--profile", default="slow", choices=tuple(PROFILES),
                        help="link profile (jobs/local/links.py: the arithmetic)")
    parser.add_argument("--nodes", type=int, default=None,
                        help="spot nodes, each its own host (default 3; 2 with --short)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="training seconds per run (default: 60 with --short, else 300)")
    parser.add_argument("--local-steps", type=int, default=16,
                        help="DiLoCo's inner steps between outer steps")
    parser.add_argument("--short", action="store_true",
                        help="a tiny model and 2 nodes unless --nodes: a few minutes")
    parser.add_argument("--systems", default=None,
                        help=f"comma-separated, of {','.join(SYSTEMS + OPTIONAL)} (ddp "
                             f"required; default: all but {' and '.join(OPTIONAL)}, each "
                             f"one more run of --seconds); with --compare of "
                             f"{','.join(COMPARE_CHOICES)} (default: the profile's)")
    parser.add_argument("--compare", action="store_true",
                        help="straggler: step time on even links against one link 10x "
                             "slower (ddp and collaborative); zones: bytes per step on the "
                             "slow inter-zone link, zone-blind against zone-aware grid "
                             "(collaborative); each layout a cluster of its own")
    parser.add_argument("--zone-b", type=int, default=1,
                        help="--compare --profile zones: the last N nodes form zone B, each "
                             "behind the slow link (default 1); the bytes crossing between "
                             "the zones are counted on zone B's links")
    parser.add_argument("--held-out-fraction", type=float, default=HELD_OUT_FRACTION,
                        help="run the best mode again for the steps it took in this fraction "
                             "of the best baseline's time and compare its final model's "
                             "held-out loss with that baseline's (default 1/2; 0: skip)")
    parser.add_argument("--out", default="bench-links", help="directory for the PNG and JSON")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    add_results_argument(parser)


def main(args: argparse.Namespace) -> int:
    nodes = _nodes(args)
    systems = _systems(args)
    why = _refusal(args, nodes, systems)
    if why:
        print(f"bench links: {why}", file=sys.stderr)
        return 2
    seconds = args.seconds or (60.0 if args.short else 300.0)
    # absolute: each run's driver works in its own folder, and a relative --out (the
    # result file's command keeps it as typed) would be read from there
    out_dir = Path(args.out).expanduser().resolve()
    try:
        if args.compare:
            result = run_compare(args.profile, nodes, seconds, args.short, out_dir,
                                 systems, args.local_steps, args.zone_b)
        else:
            result = run(args.profile, nodes, seconds, args.short, args.local_steps,
                         out_dir, systems, args.held_out_fraction)
    except LinksBenchError as exc:
        print(f"bench links: {exc}", file=sys.stderr)
        return 1
    save_result("links", args, result)
    if not args.json:
        print("\n".join(_compare_table(result) if args.compare else _table(result)))
    print(json.dumps(result), flush=True)
    return 0


def _nodes(args: argparse.Namespace) -> int:
    return args.nodes if args.nodes is not None else 2 if args.short else 3


def _systems(args: argparse.Namespace) -> tuple[str, ...]:
    default = COMPARE_SYSTEMS.get(args.profile, ()) if args.compare else SYSTEMS
    return tuple(s for s in (args.systems or ",".join(default)).split(",") if s)


def _refusal(args: argparse.Namespace, nodes: int, systems: Sequence[str]) -> str | None:
    """Why the arguments cannot run (one line), or None."""
    if args.compare and args.profile not in COMPARE_SYSTEMS:
        return (f"--compare takes --profile {' or '.join(COMPARE_SYSTEMS)}, got "
                f"{args.profile!r}")
    if args.compare and (not systems or any(s not in COMPARE_CHOICES for s in systems)):
        return f"--compare runs only {', '.join(COMPARE_CHOICES)}; got {args.systems!r}"
    if not args.compare and ("ddp" not in systems
                             or any(s not in SYSTEMS + OPTIONAL for s in systems)):
        return (f"--systems must include ddp and name only {', '.join(SYSTEMS + OPTIONAL)}; "
                f"got {args.systems!r}")
    if not 2 <= nodes <= 8:
        return f"--nodes must be 2..8, got {nodes}"
    if args.local_steps < 1:
        return f"--local-steps must be >= 1, got {args.local_steps}"
    if not 0 <= args.held_out_fraction <= 1:
        return f"--held-out-fraction must be 0..1, got {args.held_out_fraction}"
    if args.zone_b != 1 and not (args.compare and args.profile == "zones"):
        return "--zone-b goes with --compare --profile zones"
    if not 1 <= args.zone_b <= nodes - 1:
        return f"--zone-b must be 1..{nodes - 1} (--nodes {nodes}), got {args.zone_b}"
    return None


def _table(result: dict) -> list[str]:
    lines = [f"target: the best baseline's ({result['best_baseline']}) final training loss "
             f"{result['target_loss']} (held out: {result['best_baseline_held_out_loss']}); "
             f"the best mode ({result['moshray_mode']}) in "
             f"{result['time_to_target_vs_best_baseline']} of its time, held out "
             f"{result['held_out_loss']}"]
    for name, m in result["modes"].items():
        lines.append(f"{name:>24}: to target {m['time_to_target_s']} s, "
                     f"{m['bytes_per_node_to_target']} B/node to target, held-out "
                     f"{m['held_out_loss']}, training loss at {result['equal_time_s']} s "
                     f"{m['loss_at_equal_time']}")
    check = result.get("held_out_check")
    if check:
        lines.append(f"held-out check: {check['mode']} for {check['steps']} steps, "
                     f"{check['wall_s']} s ({check['time_vs_baseline']} of "
                     f"{check['baseline']}'s), held-out {check['held_out_loss']} against "
                     f"{check['baseline_held_out_loss']}: met {check['met']}")
    return lines


def _compare_table(result: dict) -> list[str]:
    return [f"{name:>14}: " + ", ".join(
        f"{layout} median step {m['median_step_s']} s, {m['last_link_bytes_per_step']} "
        f"B/step on the last link" for layout, m in by.items())
        + f"; step time rise {result['step_time_rise'][name]}, last link's bytes fall "
        f"{result['last_link_bytes_fall'][name]}"
        + (f", bytes across the zones fall {result['cross_zone_bytes_fall'].get(name)}"
           if "cross_zone_bytes_fall" in result else "")
        + (f" (the averaging's own: {result['averaged_cross_zone_bytes_fall'].get(name)})"
           if "averaged_cross_zone_bytes_fall" in result else "")
        for name, by in result["systems"].items()]
