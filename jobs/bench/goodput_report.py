"""`moshray bench goodput`, the report: the plot and the printed tables.

:func:`plot` draws the live nodes and each system's cumulative useful samples next to the
ideal; :func:`table` prints one row per system, :func:`rates_table` the failure-free rates of
both systems at each calibrated node count with the figures derived from them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from moshray.jobs.bench.goodput_curves import SystemResult
from moshray.jobs.bench.goodput_rates import MOSHRAY, RAYTRAIN, RateComparison


def plot(path: Path, live: Sequence[tuple[float, int]],
         curves: dict[str, Sequence[tuple[float, float]]], title: str) -> Path:
    """Live nodes over time (top) and each system's cumulative useful samples (bottom), as a
    PNG at ``path``; written to a temporary name and renamed. Like ``moshray.jobs.plots`` it
    builds a ``Figure`` on the Agg canvas (no pyplot, no process-wide backend switch); that
    module has no two-panel time plot with a separate x per series, hence this function."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 6.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 3]})
    fig.suptitle(title)
    top.step([t for t, _ in live], [n for _, n in live], where="post", color="black")
    top.set_ylabel("live nodes")
    top.set_ylim(0, max([n for _, n in live] + [1]) + 0.5)
    top.yaxis.get_major_locator().set_params(integer=True)
    top.grid(True, alpha=0.3)
    # measured curves change at steps (and drop at rollbacks); the ideal is piecewise linear
    styles = {"ideal": {"linestyle": "--", "color": "gray"}}
    step_style = {"drawstyle": "steps-post"}
    for name, curve in curves.items():
        bottom.plot([t for t, _ in curve], [c for _, c in curve], label=name, linewidth=1.4,
                    **styles.get(name, step_style))
    bottom.set_xlabel("wall seconds")
    bottom.set_ylabel("cumulative samples (useful)")
    bottom.set_xlim(0, live[-1][0] if live else None)
    bottom.set_ylim(bottom=0)
    bottom.legend(loc="upper left")
    bottom.grid(True, alpha=0.3)
    from moshray.jobs.plots import save_png

    return save_png(fig, path)


def to_end(curve: Sequence[tuple[float, int]], duration_s: float) -> list[tuple[float, int]]:
    """The curve held flat from its last point to the end of the window (for the plot)."""
    return [*curve, (duration_s, curve[-1][1])] if curve and curve[-1][0] < duration_s else \
        list(curve)


def fmt(x: float | None, spec: str = ".3f") -> str:
    """``x`` formatted with ``spec``, or ``-`` for None."""
    return "-" if x is None else format(x, spec)


def table(rows: list[tuple[str, SystemResult, float | None]]) -> str:
    """One line per ``(name, result, held-out loss)``: samples, goodput, losses, stall."""
    out = [f"{'system':<20} {'samples':>9} {'goodput/s':>10} {'final loss':>10} "
           f"{'eval loss':>9} {'stall s':>8}"]
    for name, r, eval_loss in rows:
        out.append(f"{name:<20} {r.samples:>9d} {r.goodput:>10.1f} {fmt(r.final_loss):>10} "
                   f"{fmt(eval_loss):>9} {r.stall_s:>8.1f}")
    return "\n".join(out)


def rates_table(cmp: RateComparison) -> str:
    """Failure-free samples/s of both systems and the ideal's rate at each count, then the
    steady-state ratio and the scalings (see ``goodput_rates``)."""
    names = {MOSHRAY: "moshray", RAYTRAIN: "Ray Train"}
    out = [f"{'nodes':<6} {'moshray/s':>10} {'RayTrain/s':>10} {'ideal/s':>9} {'from':>9}"]
    for n in sorted(set(cmp.moshray) | set(cmp.raytrain) | set(cmp.ideal)):
        source = cmp.ideal_source.get(n)
        out.append(f"{n:<6d} {fmt(cmp.moshray.get(n), '.1f'):>10} "
                   f"{fmt(cmp.raytrain.get(n), '.1f'):>10} {fmt(cmp.ideal.get(n), '.1f'):>9} "
                   f"{names.get(source, '-'):>9}")
    out.append(f"steady state ({cmp.steady_nodes} nodes): moshray / Ray Train "
               f"{fmt(cmp.steady_state_vs_raytrain)}")
    m, r = cmp.moshray_scaling, cmp.raytrain_scaling
    if m is not None and r is not None:
        out.append(f"scaling {m.low} -> {m.high} nodes (rate ratio): moshray {m.value:.3f}, "
                   f"Ray Train {r.value:.3f}")
    else:
        out.append("scaling: - (needs failure-free rates at two node counts >= 2)")
    return "\n".join(out)
