"""`moshray bench report`: docs/performance.md and the README's table, from result files.

Inputs: the result files in ``--results`` (default ``docs/results``, written by a bench's
``--results DIR``, see ``jobs/bench/results.py``) and the hand-written method and findings
in ``--template`` (default ``docs/performance.template.md``). For every headline benchmark
(:data:`HEADLINES`) the newest result file is rendered: a table of its figures with the
command, the date, the commit and the machine. A benchmark with no result file renders
``no result file yet: run <command>``; no figure is ever taken from anywhere else.

The template holds ``<!-- summary -->`` (the table of every headline's latest figure) and
one ``<!-- result:<bench> -->`` line per headline, each replaced by that bench's section;
a missing or unknown placeholder is an error. An optional ``<!-- others -->`` line lists
the newest result of every other bench (e.g. ``bench gpu``) with its scalar figures. The README gets the summary table between
``<!-- performance:begin -->`` and ``<!-- performance:end -->``.

``--check`` writes nothing and exits 1 with one line when ``--out`` or the README differ
from what the files render (``tests/test_readme.py`` runs it). Bad input (an unreadable
result file, a template without its placeholders, a README without the markers) exits 2
with one line saying what to fix. Rendering is pure (:func:`render_performance`,
:func:`render_summary`); only :func:`main` reads and writes files.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moshray.jobs.bench.results import RESULTS_DIR, Result, ResultError, load_results

TEMPLATE = "docs/performance.template.md"
OUT = "docs/performance.md"
SUMMARY = "<!-- summary -->"
OTHERS = "<!-- others -->"
README_BEGIN = "<!-- performance:begin -->"
README_END = "<!-- performance:end -->"
_PLACEHOLDER = re.compile(r"^<!-- result:([a-z0-9_-]+) -->$", re.MULTILINE)

Rows = list[tuple[str, str]]


class ReportError(ValueError):
    """Inputs that cannot be rendered; ``str()`` is one line saying what to fix."""


def fmt(value: Any, spec: str = ".3f", unit: str = "") -> str:
    """``value`` formatted by ``spec`` (``-`` for a missing value) with ``unit`` appended."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    try:
        return format(value, spec) + unit
    except (TypeError, ValueError):
        return str(value)


def _met(value: Any, target: float, *, at_most: bool = False) -> str:
    if value is None:
        return ""
    ok = value <= target if at_most else value >= target
    return " (met)" if ok else " (missed)"


# --------------------------------------------------------------------------- headlines


@dataclass(frozen=True)
class Headline:
    """One headline benchmark: the command that measures it, a one-line summary of its
    figures for the README and the rows of its table in docs/performance.md. ``line`` and
    ``rows`` take the result's ``figures`` and must tolerate missing keys (``-``). A bench
    with several headlines (one per setting) names each (``key``: its template placeholder,
    default ``bench``) and says which of its results are the headline's (``takes``: by the
    command line that made it)."""

    bench: str
    title: str
    command: str
    line: Callable[[Mapping[str, Any]], str]
    rows: Callable[[Mapping[str, Any]], Rows]
    key: str = ""
    takes: Callable[[str], bool] = lambda command: True

    @property
    def name(self) -> str:
        return self.key or self.bench

    def runs(self, results: Mapping[str, Sequence["Result"]]) -> list:
        """This headline's results, newest first."""
        return [r for r in results.get(self.bench) or [] if self.takes(r.command)]


def _allreduce_line(f: Mapping) -> str:
    return (f"`ratio_vs_gloo` {fmt(f.get('ratio_vs_gloo'), '.2f')} (moshray "
            f"{fmt(f.get('moshray_s'), '.3f', ' s')}, gloo {fmt(f.get('gloo_s'), '.3f', ' s')}; "
            f"{f.get('peers')} peers x {fmt(f.get('size_mb'), 'g')} MB, {f.get('compression')})")


def _allreduce_rows(f: Mapping) -> Rows:
    rows = [
        ("peers x size, codec", f"{f.get('peers')} x {fmt(f.get('size_mb'), 'g')} MB, "
                                f"{f.get('compression')}, {f.get('reps')} timed rounds"),
        ("moshray, median round", fmt(f.get("moshray_s"), ".3f", " s")),
        ("gloo ring, median", fmt(f.get("gloo_s"), ".3f", " s")),
        ("`ratio_vs_gloo` (gloo / moshray, target >= 0.5)",
         fmt(f.get("ratio_vs_gloo"), ".2f") + _met(f.get("ratio_vs_gloo"), 0.5)),
        ("max relative error", fmt(f.get("max_rel_error"), ".2e")),
        ("within the codec's documented bound", fmt(f.get("within_bound"))),
    ]
    if "kill_one_s" in f:
        rows.append(("one peer killed mid-round: survivors done in",
                     fmt(f.get("kill_one_s"), ".2f", " s")))
    rows.append(("load average during the run", fmt(f.get("load_average"), ".1f")))
    return rows


def _scale_largest(f: Mapping) -> tuple[str, Mapping]:
    by = f.get("by_peers") or {}
    if not by:
        return "-", {}
    n = max(by, key=int)
    return n, by[n]


def _scale_line(f: Mapping) -> str:
    n, top = _scale_largest(f)
    return (f"at {n} simulated peers: Coordinator "
            f"{fmt(top.get('coordinator_ms_per_step'), '.0f', ' ms')} per global step "
            f"(target <= 50){_met(top.get('coordinator_ms_per_step'), 50, at_most=True)}, "
            f"10% dying mid-round: {fmt(top.get('averaged_share_with_deaths'), '.2f')} of the "
            f"live contributions averaged exactly (target >= 0.85)"
            f"{_met(top.get('averaged_share_with_deaths'), 0.85)}")


def _scale_rows(f: Mapping) -> Rows:
    by = f.get("by_peers") or {}
    fits = f.get("fits") or {}
    rows: Rows = [("peers (simulated, in one process)", ", ".join(sorted(by, key=int)) or "-"),
                  ("largest averaging group", fmt(f.get("max_group"), "d"))]
    figures = (("Coordinator CPU per global step", "coordinator_ms_per_step", ".1f", " ms"),
               ("Coordinator CPU per simulated second", "coordinator_ms_per_second", ".1f",
                " ms"),
               ("global steps per simulated second", "global_steps_per_second", ".2f", ""),
               ("messages per peer per step (control plane)", "messages_per_peer_per_step",
                ".1f", ""),
               ("control-plane bytes per peer per step", "control_bytes_per_peer_per_step",
                ".0f", " B"),
               ("plan size", "plan_bytes", ".0f", " B"),
               ("store (GCS) writes per step", "store_writes_per_step", ".1f", ""),
               ("Coordinator memory after the memory run", "coordinator_memory_mb", ".1f",
                " MB"),
               ("averaging rounds (grid dimensions)", "grid_rounds", "d", ""),
               ("averaging bytes sent per peer per step", "bytes_per_peer_per_step", ".0f",
                " B"),
               ("the grid's 2 x rounds x tensor bytes", "grid_bytes_per_peer_per_step", ".0f",
                " B"),
               ("live contributions averaged exactly, no deaths", "averaged_share", ".3f", ""),
               ("the same with 10% dying mid-round", "averaged_share_with_deaths", ".3f", ""),
               ("survivors' results exact with deaths", "exact_results_with_deaths", ".3f", ""),
               ("largest error against the exact mean", "max_abs_error", ".1e", ""))
    for label, key, spec, unit in figures:
        values = " / ".join(fmt(by[n].get(key), spec, unit) for n in sorted(by, key=int))
        fit = fits.get(key)
        rows.append((label, values + (f" (fit {fit})" if fit else "")))
    return rows


def _counts(f: Mapping) -> list[tuple[str, Mapping]]:
    counts = f.get("counts") or {}
    return sorted(counts.items(), key=lambda kv: int(kv[0]))


def _step_line(f: Mapping) -> str:
    counts = _counts(f)
    nodes = " / ".join(n for n, _ in counts)
    rates = " / ".join(fmt(c.get("samples_per_s"), ".1f") for _, c in counts)
    return f"{rates} samples/s at {nodes} node(s), {fmt(f.get('seconds'), 'g')} s each"


def _step_rows(f: Mapping) -> Rows:
    rows = []
    for n, c in _counts(f):
        prof = c.get("profile") or {}
        med, share = prof.get("median_s") or {}, prof.get("share") or {}
        parts = ", ".join(f"{k[:-2]} {fmt(v, '.0%')}" for k, v in share.items())
        rows.append((f"{n} node(s)",
                     f"{fmt(c.get('samples_per_s'), '.1f')} samples/s; a step of "
                     f"{fmt(c.get('samples_per_step'), '.1f')} samples in "
                     f"{fmt(med.get('wall_s'), '.3f', ' s')}" + (f" ({parts})" if parts else "")))
    return rows


def _goodput_line(f: Mapping) -> str:
    ft = f.get("moshray_vs_raytrain_torchft")
    torchft = ("Ray Train + torchft not run" if ft is None else
               f"`moshray_vs_raytrain_torchft` {fmt(ft, '.2f')}{_met(ft, 1.5)}")
    return (f"`moshray_vs_raytrain` {fmt(f.get('moshray_vs_raytrain'), '.2f')}, {torchft}, "
            f"`moshray_vs_ideal` {fmt(f.get('moshray_vs_ideal'), '.3f')}, held-out loss "
            f"{fmt(f.get('moshray_eval_loss'), '.2f')} vs Ray Train's "
            f"{fmt(f.get('raytrain_eval_loss'), '.2f')} and torchft's "
            f"{fmt(f.get('raytrain_torchft_eval_loss'), '.2f')}")


def _goodput_rows(f: Mapping) -> Rows:
    ideal, rt = f.get("moshray_vs_ideal"), f.get("moshray_vs_raytrain")
    ft = f.get("moshray_vs_raytrain_torchft")
    steady = f.get("steady_state_vs_raytrain")
    return [
        ("trace, nodes, length", f"{f.get('trace')}, {f.get('max_nodes')} nodes, "
                                 f"{fmt(f.get('duration_s'), '.0f', ' s')} at "
                                 f"{fmt(f.get('time_scale'), '.0f')}x"),
        ("useful samples: moshray / Ray Train / Ray Train + torchft / ideal",
         f"{fmt(f.get('moshray_samples'), ',')} / {fmt(f.get('raytrain_samples'), ',')} / "
         f"{fmt(f.get('raytrain_torchft_samples'), ',')} / "
         f"{fmt(f.get('ideal_samples'), ',.0f')}"),
        ("`moshray_vs_raytrain` (target >= 2)", fmt(rt, ".2f") + _met(rt, 2.0)),
        ("`moshray_vs_raytrain_torchft` (target >= 1.5)",
         fmt(ft, ".2f") + _met(ft, 1.5) if ft is not None else
         f"not run: {f.get('raytrain_torchft_missing') or 'no figure in this result file'}"),
        ("Ray Train + torchft: replica restarts, steps its quorum discarded",
         f"{fmt(f.get('raytrain_torchft_replica_restarts'), 'd')}, "
         f"{fmt(f.get('raytrain_torchft_discarded_steps'), 'd')}"),
        ("`moshray_vs_ideal` (target >= 0.9)", fmt(ideal, ".3f") + _met(ideal, 0.9)),
        ("failure-free / ideal, elasticity",
         f"{fmt(f.get('moshray_failure_free_vs_ideal'), '.3f')}, "
         f"{fmt(f.get('moshray_elasticity'), '.3f')}"),
        ("`steady_state_vs_raytrain` (target >= 0.9)", fmt(steady, ".3f") + _met(steady, 0.9)),
        ("scaling 2 -> 4 nodes, moshray vs DDP",
         f"{fmt(f.get('moshray_scaling'), '.3f')} vs {fmt(f.get('raytrain_scaling'), '.3f')}"),
        ("held-out loss, moshray vs Ray Train vs Ray Train + torchft",
         f"{fmt(f.get('moshray_eval_loss'), '.2f')} vs {fmt(f.get('raytrain_eval_loss'), '.2f')}"
         f" vs {fmt(f.get('raytrain_torchft_eval_loss'), '.2f')}"),
        ("moshray preemptions survived, replicas consistent",
         f"{fmt(f.get('moshray_preemptions'), 'd')}, {fmt(f.get('moshray_replicas_consistent'))}"),
        ("Ray Train restarts", fmt(f.get("raytrain_restarts"), "d")),
        ("`machine_drift` (slowest / fastest bare step)", fmt(f.get("machine_drift"), ".2f")),
    ]


def _links_of(f: Mapping) -> str:
    links = f.get("links") or {}
    return f"{links.get('profile', '-')} ({links.get('link_mbit', '-')} Mbit/s)"


def _goodput_links_line(f: Mapping) -> str:
    rt = f.get("moshray_vs_raytrain")
    return (f"links {_links_of(f)}: `moshray_vs_raytrain` {fmt(rt, '.2f')}{_met(rt, 3.0)}, "
            f"`moshray_vs_ideal` {fmt(f.get('moshray_vs_ideal'), '.3f')}")


def _goodput_links_rows(f: Mapping) -> Rows:
    rt = f.get("moshray_vs_raytrain")
    rows = [("link profile (Mbit/s per node)", _links_of(f))]
    rows += [(label, value) for label, value in _goodput_rows(f)
             if not label.startswith("`moshray_vs_raytrain`")]
    rows.insert(3, ("`moshray_vs_raytrain` on these links (target >= 3)",
                    fmt(rt, ".2f") + _met(rt, 3.0)))
    peers = f.get("moshray_peers")
    if peers:  # a goodput made by a swarm of one says nothing of its links
        rows.insert(4, ("moshray replicas per global step: mean, max; samples from steps of >1",
                        f"{fmt(peers.get('mean'), '.2f')}, {peers.get('max')}; "
                        f"{fmt(peers.get('multi_sample_share'), '.0%')}"))
    return rows


def _compare_layouts(f: Mapping) -> str:
    return "; ".join(f"{name} {l.get('link_mbit')}"
                     + (f" zones {l['zones']}" if l.get("zones") else "")
                     + (f" zone links {l['zone_links']}" if l.get("zone_links") else "")
                     for name, l in (f.get("layouts") or {}).items())


def _baseline_of(f: Mapping) -> tuple[str, float | None, float | None, float]:
    """``(best baseline, its time to the target, the best mode's time over it, the goal)``:
    a result file made before the stronger baselines has DDP's with the 1/3 goal."""
    if "best_baseline" in f:
        return (f["best_baseline"], f.get("best_baseline_time_to_target_s"),
                f.get("time_to_target_vs_best_baseline"), 1 / 2)
    return "ddp", f.get("ddp_time_to_target_s"), f.get("time_to_target_vs_ddp"), 1 / 3


def _check_of(check: Mapping) -> tuple[str, float | None, float | None]:
    """``(baseline, time over it, its held-out loss)`` of a held-out check (older files:
    DDP's keys)."""
    return (check.get("baseline", "ddp"), check.get("time_vs_baseline", check.get("time_vs_ddp")),
            check.get("baseline_held_out_loss", check.get("ddp_held_out_loss")))


def _time_to_loss_line(f: Mapping) -> str:
    base, base_t, ratio, goal = _baseline_of(f)
    verdict = "" if ratio is None else (" (met)" if ratio <= goal else " (missed)")
    whose = (f"the best baseline's ({base})" if "best_baseline" in f else
             "DDP's (a file from before the stronger baselines)")
    line = (f"to {whose} final loss {fmt(f.get('target_loss'), '.3f')}: "
            f"{f.get('moshray_mode')} {fmt(f.get('moshray_time_to_target_s'), '.1f', ' s')}, "
            f"{base} {fmt(base_t, '.1f', ' s')}: {fmt(ratio, '.3f')} of its time{verdict} "
            f"(target <= 1/{round(1 / goal)})")
    check = f.get("held_out_check")
    if check:
        held = {True: " (met)", False: " (missed)"}.get(check.get("met"), "")
        name, part, loss = _check_of(check)
        line += (f"; held out: {check.get('mode')} stopped at {fmt(part, '.3f')} of {name}'s "
                 f"time, {fmt(check.get('held_out_loss'), '.3f')} vs {name}'s final "
                 f"{fmt(loss, '.3f')}{held}")
    return line


def _time_to_loss_rows(f: Mapping) -> Rows:
    rows: Rows = [("profile, nodes, links (Mbit/s), seconds per run",
                   f"{f.get('profile')}, {f.get('nodes')}, {f.get('link_mbit')}, "
                   f"{f.get('seconds_per_run')}"),
                  ("target: the best baseline's final smoothed training loss (its "
                   "held-out loss)",
                   f"{_baseline_of(f)[0]}: {fmt(f.get('target_loss'), '.3f')} "
                   f"({fmt(f.get('best_baseline_held_out_loss', f.get('ddp_held_out_loss')), '.3f')})")]
    for name, m in (f.get("modes") or {}).items():
        mb = m.get("bytes_per_node_to_target")
        rows.append((name, f"to target {fmt(m.get('time_to_target_s'), '.1f', ' s')} "
                           f"({'-' if mb is None else f'{mb / 1e6:.1f} MB'} sent per node); "
                           f"loss at equal time {fmt(m.get('loss_at_equal_time'), '.3f')}; "
                           f"final model's held-out loss {fmt(m.get('held_out_loss'), '.3f')}; "
                           f"{m.get('steps')} global steps"))
    check = f.get("held_out_check")
    if check:
        verdict = {True: " (met)", False: " (missed)"}.get(check.get("met"), "")
        name, part, loss = _check_of(check)
        rows.append((f"held-out check: the best mode stopped at {fmt(check.get('fraction'), '.2f')}"
                     f" of the baseline's time",
                     f"{check.get('mode')}, {check.get('steps')} steps in "
                     f"{fmt(check.get('wall_s'), '.1f', ' s')} "
                     f"({fmt(part, '.3f')} of {name}'s): held-out loss "
                     f"{fmt(check.get('held_out_loss'), '.3f')} against {name}'s "
                     f"{fmt(loss, '.3f')}{verdict}"))
    return rows


def _straggler_line(f: Mapping) -> str:
    rise = f.get("step_time_rise") or {}
    modes = [(r, name) for name, r in rise.items() if name != "ddp" and r is not None]
    best = min(modes) if modes else (None, "moshray")
    others = ", ".join(f"{name} {fmt(r, '+.0%')}" for r, name in sorted(modes) if r != best[0])
    return (f"step time rise with one link 10x slower: moshray {best[1]} {fmt(best[0], '+.0%')}"
            f"{_met(best[0], 0.25, at_most=True)}{f' ({others})' if others else ''}, "
            f"DDP {fmt(rise.get('ddp'), '+.0%')}")


def _straggler_rows(f: Mapping) -> Rows:
    rows = [("nodes, seconds per run, links (Mbit/s)",
             f"{f.get('nodes')}, {fmt(f.get('seconds_per_run'), 'g')}, {_compare_layouts(f)}")]
    for name, by in (f.get("systems") or {}).items():
        even, slow = by.get("even") or {}, by.get("straggler") or {}
        rise = (f.get("step_time_rise") or {}).get(name)
        target = " (target <= +25%)" + _met(rise, 0.25, at_most=True) if name != "ddp" else ""
        rows.append((f"{name}: median step, even -> one slow link",
                     f"{fmt(even.get('median_step_s'), '.3f', ' s')} -> "
                     f"{fmt(slow.get('median_step_s'), '.3f', ' s')}: "
                     f"{fmt(rise, '+.0%')}{target} ({even.get('steps')} / {slow.get('steps')}"
                     f" steps of {even.get('peers_per_step')} / {slow.get('peers_per_step')} "
                     f"nodes)"))
    return rows


def _zones_fall(f: Mapping, wire: bool = False) -> tuple[str, float | None]:
    """Which bytes a zones result counted and their fall: the averaging's own bytes sent
    between the zones where the replicas counted them (unless ``wire``), else the frames
    crossing between the zones where it counted them (``--zone-b``), else the last node's
    link."""
    for key in (() if wire else ("averaged_cross_zone_bytes",)) + ("cross_zone_bytes",):
        fall = (f.get(key + "_fall") or {}).get("collaborative")
        if fall is not None:
            return key, fall
    return "last_link_bytes", (f.get("last_link_bytes_fall") or {}).get("collaborative")


def _zones_line(f: Mapping) -> str:
    what, fall = _zones_fall(f)
    line = (f"bytes per step crossing between the zones, zone-blind / zone-aware grid "
            f"(`{what}`): {fmt(fall, '.2f')} (the grid predicts "
            f"{fmt(f.get('grid_cross_zone_fall'), '.2f')})")
    wire, wire_fall = _zones_fall(f, wire=True)
    if wire != what:
        line += f"; every frame on the wire (`{wire}`, Ray's own too): {fmt(wire_fall, '.2f')}"
    return line


def _zones_rows(f: Mapping) -> Rows:
    by = (f.get("systems") or {}).get("collaborative") or {}
    blind, aware = by.get("zone_blind") or {}, by.get("zones") or {}
    what, fall = _zones_fall(f)
    wire, wire_fall = _zones_fall(f, wire=True)
    counted = [(what, fall)] + ([(wire, wire_fall)] if wire != what else [])
    return [
        ("nodes, seconds per run, links (Mbit/s)",
         f"{f.get('nodes')}, {fmt(f.get('seconds_per_run'), 'g')}, {_compare_layouts(f)}"),
        *[(f"`{key}` per step: zone-blind -> zone-aware (fall)",
           f"{fmt(blind.get(key + '_per_step'), ',')} -> "
           f"{fmt(aware.get(key + '_per_step'), ',')} ({fmt(value, '.2f')})")
          for key, value in counted],
        ("steps (nodes per step): zone-blind / zone-aware",
         f"{blind.get('steps')} / {aware.get('steps')} ({blind.get('peers_per_step')} / "
         f"{aware.get('peers_per_step')})"),
        ("fall the grid's plans predict", fmt(f.get('grid_cross_zone_fall'), '.2f')),
        ("median step: zone-blind -> zone-aware",
         f"{fmt(blind.get('median_step_s'), '.3f', ' s')} -> "
         f"{fmt(aware.get('median_step_s'), '.3f', ' s')}"),
    ]


_RECOVERY = (("notice_to_rebalanced_s", "notice -> rebalanced", 1.0),
             ("hard_kill_to_progress_s", "hard kill -> progress", 5.0),
             ("join_to_contribution_s", "join -> first contribution", 15.0),
             ("expert_respawn_s", "expert re-spawn", None))


def _recovery_line(f: Mapping) -> str:
    return ", ".join(f"{label} {fmt(f.get(key), '.2f', ' s')}"
                     for key, label, _ in _RECOVERY[:3])


def _recovery_rows(f: Mapping) -> Rows:
    rows = [("trials, nodes, hosts", f"{f.get('trials')}, {f.get('nodes')}, {f.get('hosts')}")]
    for key, label, target in _RECOVERY:
        value = f.get(key)
        text = f"{fmt(value, '.2f', ' s')} (worst {fmt(f.get(key + '_max'), '.2f', ' s')})"
        if target is not None:
            text += f", target <= {target:g} s" + _met(value, target, at_most=True)
        rows.append((label + " (median)", text))
    rows.append(("a step of the job (median)", fmt(f.get("median_step_s"), ".1f", " s")))
    return rows


def _moe_line(f: Mapping) -> str:
    return (f"remote / in-process {fmt(f.get('ratio'), '.2f')} "
            f"({fmt(f.get('remote_tokens_per_s'), '.0f')} vs "
            f"{fmt(f.get('local_tokens_per_s'), '.0f')} tokens/s)")


def _moe_rows(f: Mapping) -> Rows:
    ratio = f.get("ratio")
    return [
        ("experts, nodes, tokens per batch, k",
         f"{f.get('experts')}, {f.get('nodes')}, {f.get('tokens')}, {f.get('k')}"),
        ("in-process", fmt(f.get("local_tokens_per_s"), ".0f", " tokens/s")),
        ("remote (expert actors)", fmt(f.get("remote_tokens_per_s"), ".0f", " tokens/s")),
        ("ratio (target >= 0.5)", fmt(ratio, ".2f") + _met(ratio, 0.5)),
        ("one expert node killed", fmt(f.get("with_failure_tokens_per_s"), ".0f", " tokens/s")
         + f" ({f.get('killed_experts')} experts masked and re-spawned)"),
    ]


def _chaos_line(f: Mapping) -> str:
    failures = f.get("invariant_failures")
    verdict = "every invariant held" if failures == [] else (
        f"invariants failed: {'; '.join(failures)}" if failures else "invariants: -")
    kinds = sum(1 for v in (f.get("faults_by_kind") or {}).values() if v)
    return (f"{f.get('faults')} faults of {kinds} kinds, {f.get('steps')} steps, "
            f"{f.get('lost')} lost / "
            f"{f.get('repeated')} repeated / {f.get('rollbacks')} rolled back; {verdict}")


def _chaos_rows(f: Mapping) -> Rows:
    kinds = ", ".join(f"{v} {k}" for k, v in sorted((f.get("faults_by_kind") or {}).items()))
    joins = f.get("join_to_training_s") or {}
    failures = f.get("invariant_failures")
    return [
        ("faults injected", f"{f.get('faults')} ({kinds})"),
        ("global steps; lost, repeated, rolled back",
         f"{f.get('steps')}; {f.get('lost')}, {f.get('repeated')}, {f.get('rollbacks')}"),
        ("kinds not run (why)", "; ".join(f"{k}: {v}" for k, v in
                                          sorted((f.get("faults_ruled_out") or {}).items()))
         or "-"),
        ("global steps committed during each partition / slow link",
         " / ".join(", ".join(map(str, (f.get("steps_during_network_faults") or {}).get(k, [])))
                    or "-" for k in ("partition", "slow_node"))),
        ("quarantines (reasons)", f"{f.get('quarantines')} "
                                  f"({', '.join(f.get('quarantine_reasons') or []) or '-'})"),
        ("seconds stalled (gaps over 2 s)", fmt(f.get("stalled_s"), ".1f", " s")),
        ("a join trains after (median, worst)",
         f"{fmt(joins.get('median'), '.1f', ' s')}, {fmt(joins.get('max'), '.1f', ' s')}"),
        ("replicas at the end / expected, identical",
         f"{f.get('replicas_at_end')} / {f.get('expected_replicas')}, "
         f"{fmt(f.get('replicas_consistent'))}"),
        ("invariants", "all held" if failures == [] else ("; ".join(failures) if failures
                                                           else "-")),
    ]


def _overlap_line(f: Mapping) -> str:
    on, off = f.get("on") or {}, f.get("off") or {}
    return (f"speedup {fmt(f.get('speedup'), '.2f')}x ({fmt(on.get('samples_per_s'), '.1f')} "
            f"vs {fmt(off.get('samples_per_s'), '.1f')} samples/s), loss at equal samples "
            f"{fmt(f.get('loss_delta_at_equal_samples'), '+.3f')}")


def _overlap_rows(f: Mapping) -> Rows:
    rows = []
    for mode, label in (("on", "overlapped"), ("off", "synchronous")):
        m = f.get(mode) or {}
        rows.append((label, f"{fmt(m.get('samples_per_s'), '.1f')} samples/s, loss "
                            f"{fmt(m.get('loss_at_equal_samples'), '.3f')} at "
                            f"{f.get('equal_samples')} samples, final "
                            f"{fmt(m.get('final_loss'), '.3f')}, replicas identical "
                            f"{fmt(m.get('replicas_consistent'))}"))
    rows.append(("speedup (overlapped / synchronous)", fmt(f.get("speedup"), ".2f")))
    return rows


HEADLINES: tuple[Headline, ...] = (
    Headline("goodput", "goodput under a real AWS spot trace, against Ray Train and Ray Train "
             "+ torchft",
             "moshray bench goodput --trace aws-g4dn-xlarge-us-east-1c-2020-11-20 "
             "--max-nodes 4 --duration 600 --calib-seconds 40 --json",
             _goodput_line, _goodput_rows, takes=lambda command: "--links" not in command),
    Headline("goodput", "goodput under a spot trace and slow links at once, against Ray Train",
             "moshray bench goodput --trace aws-g4dn-xlarge-us-east-1c-2020-11-20 "
             "--time-scale 5 --links slow --max-nodes 3 --duration 240 --calib-seconds 30 "
             "--json", _goodput_links_line, _goodput_links_rows, key="goodput-links",
             takes=lambda command: "--links" in command),
    Headline("recovery", "recovery of the training job: notice, hard kill, join, experts",
             "moshray bench recovery --trials 1 --json", _recovery_line, _recovery_rows),
    Headline("allreduce", "Moshpit All-Reduce against torch.distributed gloo",
             "moshray bench allreduce --peers 4 --size-mb 100 --compression fp16 --kill-one "
             "--json", _allreduce_line, _allreduce_rows),
    Headline("step", "where a failure-free global step's time goes",
             "moshray bench step --nodes 1,2,4 --seconds 40", _step_line, _step_rows),
    Headline("moe", "a DMoE layer with remote experts against the same experts in-process",
             "moshray bench moe --json", _moe_line, _moe_rows),
    Headline("chaos", "a seeded storm of faults, invariants checked",
             "moshray bench chaos --schedule long", _chaos_line, _chaos_rows,
             takes=lambda command: "netns" not in command),
    Headline("chaos", "the storm on separate hosts (partitions, slow links)",
             "moshray bench chaos --schedule long --hosts netns", _chaos_line, _chaos_rows,
             key="chaos-netns", takes=lambda command: "netns" in command),
    Headline("links", "time to the best baseline's loss over slow links: moshray's best mode "
             "vs DDP (fp32, fp16 hook, PowerSGD) and torchft's DiLoCo / Streaming DiLoCo",
             "moshray bench links --profile slow --short --nodes 2 --seconds 60 --json",
             _time_to_loss_line, _time_to_loss_rows, key="links-time-to-loss",
             takes=lambda command: "--compare" not in command),
    Headline("links", "one node on a 10x slower link: step time, moshray vs DDP",
             "moshray bench links --profile straggler --compare --short --nodes 3 --json",
             _straggler_line, _straggler_rows, key="links-straggler",
             takes=lambda command: "--compare" in command and "straggler" in command),
    Headline("links", "two zones: bytes across the slow link, zone-aware vs zone-blind grid",
             "moshray bench links --profile zones --compare --short --nodes 4 --zone-b 2 --json",
             _zones_line, _zones_rows, key="links-zones",
             takes=lambda command: "--compare" in command and "zones" in command),
    Headline("scale", "the Coordinator and the collective at 16 to 1,024 simulated peers",
             "moshray bench scale", _scale_line, _scale_rows),
    Headline("overlap", "overlapped averaging against synchronous steps",
             "moshray bench overlap --nodes 2 --seconds 90", _overlap_line, _overlap_rows),
)


# --------------------------------------------------------------------------- rendering


def _run_command(h: Headline, results_dir: str) -> str:
    return f"{h.command} --results {results_dir}"


def _machine(m: Mapping) -> str:
    gpus = m.get("gpus") or []
    gpu = ", ".join(gpus) if gpus else "no GPU"
    return (f"{m.get('cpu', '?')} ({m.get('cores', '?')} cores, "
            f"{fmt(m.get('memory_gib'), 'g', ' GiB')}, {gpu})")


def _machine_short(m: Mapping) -> str:
    gpus = m.get("gpus") or []
    gpu = f", {len(gpus)} GPU" if gpus else ""
    return (f"{m.get('cores', '?')} cores{gpu}, load "
            f"{fmt(m.get('load_average'), '.1f')}")


def _provenance(r: Result) -> str:
    commit = r.commit or "unknown commit"
    if r.dirty:
        commit += " with uncommitted changes"
    return (f"{r.date.replace('T', ' ').replace('Z', ' UTC')}, {commit}, "
            f"{_machine(r.machine)}, load average {fmt(r.machine.get('load_average'), '.1f')}")


def render_summary(results: Mapping[str, Sequence[Result]],
                   results_dir: str = RESULTS_DIR) -> str:
    """The table of every headline's latest figure: benchmark, figure, command, date and
    machine (cores and load average: figures of a loaded machine are slower)."""
    lines = ["| benchmark | latest figure | command | date | machine |", "|---|---|---|---|---|"]
    for h in HEADLINES:
        runs = h.runs(results)
        if runs:
            r = runs[0]
            lines.append(f"| {h.title} | {h.line(r.figures)} | `{r.command}` | {r.day} | "
                         f"{_machine_short(r.machine)} |")
        else:
            lines.append(f"| {h.title} | no result file yet: run the command | "
                         f"`{_run_command(h, results_dir)}` | - | - |")
    return "\n".join(lines)


def render_section(h: Headline, runs: Sequence[Result], results_dir: str = RESULTS_DIR,
                   link_base: str = "results") -> str:
    """One headline's section: the newest result's figures, command, date and machine."""
    if not runs:
        return (f"No result file yet: run `{_run_command(h, results_dir)}`, then "
                "`moshray bench report`.")
    r = runs[0]
    lines = [f"Latest run: {_provenance(r)}.", "", "```bash", r.command, "```", "",
             "| figure | value |", "|---|---|"]
    lines += [f"| {label} | {value} |" for label, value in h.rows(r.figures)]
    older = len(runs) - 1
    lines += ["", f"Result file: [{r.path.name}]({link_base}/{r.path.name})"
              + (f"; {older} earlier result file(s) of this benchmark in `{results_dir}`."
                 if older else ".")]
    return "\n".join(lines)


def _scalars(figures: Mapping[str, Any], prefix: str = "", depth: int = 2) -> Rows:
    """The figures' numbers, booleans and short strings, objects flattened ``depth`` levels
    deep (``part.key``); lists and deeper objects are left to the result file."""
    rows: Rows = []
    for key, value in figures.items():
        if isinstance(value, Mapping):
            if depth > 0:
                rows += _scalars(value, f"{prefix}{key}.", depth - 1)
        elif isinstance(value, bool) or value is None:
            rows.append((f"`{prefix}{key}`", fmt(value)))
        elif isinstance(value, (int, float)):
            rows.append((f"`{prefix}{key}`", fmt(value, ".4g")))
        elif isinstance(value, str) and len(value) <= 80:
            rows.append((f"`{prefix}{key}`", value.replace("|", "\\|")))
    return rows


def render_others(results: Mapping[str, Sequence[Result]], link_base: str = "results") -> str:
    """The newest result of every bench that no headline takes (a bench with no headline,
    or a run no headline of its bench takes): provenance, command and its scalar figures,
    so a new bench's results show before it gets a section of its own."""
    parts = []
    for bench in sorted(results):
        claimed = [h for h in HEADLINES if h.bench == bench]
        left = [r for r in results[bench] if not any(h.takes(r.command) for h in claimed)]
        if not left:
            continue
        r = left[0]
        parts += [f"### {bench}", "", f"Latest run: {_provenance(r)}.", "", "```bash",
                  r.command, "```", "", "| figure | value |", "|---|---|"]
        parts += [f"| {label} | {value} |" for label, value in _scalars(r.figures)]
        parts += ["", f"Result file: [{r.path.name}]({link_base}/{r.path.name}).", ""]
    return "\n".join(parts).rstrip("\n") or "No other result files."


def render_performance(template: str, results: Mapping[str, Sequence[Result]],
                       results_dir: str = RESULTS_DIR, link_base: str = "results") -> str:
    """``template`` with its placeholders replaced (result files linked as
    ``link_base/<file>``, relative to the page); ReportError if the summary or any
    headline's placeholder is missing, or one names no headline."""
    names = [m.group(1) for m in _PLACEHOLDER.finditer(template)]
    known = {h.name for h in HEADLINES}
    unknown = sorted(set(names) - known)
    missing = sorted(known - set(names))
    if unknown or missing or template.count(SUMMARY) != 1:
        raise ReportError(
            f"the template needs one {SUMMARY} line and one <!-- result:<bench> --> line per "
            f"headline benchmark; missing: {', '.join(missing) or '-'}, unknown: "
            f"{', '.join(unknown) or '-'}, summary lines: {template.count(SUMMARY)}")
    by_name = {h.name: h for h in HEADLINES}
    body = _PLACEHOLDER.sub(
        lambda m: render_section(by_name[m.group(1)], by_name[m.group(1)].runs(results),
                                 results_dir, link_base), template)
    body = body.replace(SUMMARY, render_summary(results, results_dir))
    if OTHERS in body:
        body = body.replace(OTHERS, render_others(results, link_base))
    header = (f"<!-- generated by `moshray bench report` from {results_dir} and {TEMPLATE}; "
              "edit those, not this file -->\n")
    return header + body


def splice_readme(text: str, table: str, name: str = "README.md") -> str:
    """``text`` with the summary table between the README's performance markers."""
    if (text.count(README_BEGIN) != 1 or text.count(README_END) != 1
            or text.index(README_BEGIN) > text.index(README_END)):
        raise ReportError(f"{name}: needs one {README_BEGIN} line and, after it, one "
                          f"{README_END} line around the performance table")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    return f"{head}{README_BEGIN}\n{table}\n{README_END}{tail}"


# --------------------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", default=RESULTS_DIR, metavar="DIR",
                        help=f"folder of result files (default {RESULTS_DIR})")
    parser.add_argument("--template", default=TEMPLATE, metavar="FILE",
                        help=f"method and findings with placeholders (default {TEMPLATE})")
    parser.add_argument("--out", default=OUT, metavar="FILE",
                        help=f"the rendered page (default {OUT})")
    parser.add_argument("--readme", default="README.md", metavar="FILE",
                        help="README with the performance markers; 'none' to skip it")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if --out or the README differ")


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise ReportError(f"{path}: cannot read the {what} ({exc.strerror})") from None


def main(args: argparse.Namespace) -> int:
    """Exit 0 written (or up to date), 1 ``--check`` found a difference, 2 bad input."""
    out, readme = Path(args.out), None if args.readme == "none" else Path(args.readme)
    try:
        results = load_results(args.results)
        link_base = Path(os.path.relpath(args.results, out.parent)).as_posix()
        page = render_performance(_read(Path(args.template), "template"), results,
                                  args.results, link_base)
        targets = {out: page}
        if readme is not None:
            targets[readme] = splice_readme(_read(readme, "README"),
                                            render_summary(results, args.results), str(readme))
    except (ReportError, ResultError) as exc:
        print(f"moshray bench report: {exc}", file=sys.stderr)
        return 2
    stale = [p for p, text in targets.items() if not p.exists() or p.read_text() != text]
    if args.check:
        if stale:
            print(f"moshray bench report: {', '.join(map(str, stale))} differ from the result "
                  f"files in {args.results}; run `moshray bench report`", file=sys.stderr)
            return 1
        return 0
    for path in stale:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(targets[path])
        os.replace(tmp, path)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module("moshray.jobs.bench.report"))
