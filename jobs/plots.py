"""PNG plots of a training run and of benchmark results (matplotlib, Agg, no pyplot).

Pure functions of plain data plus an output path: nothing here talks to Ray. Figures are
built with ``matplotlib.figure.Figure`` on the Agg canvas, so importing this module never
switches the process-wide backend and works without a display. Files are written to a
temporary name and renamed, so a reader never sees a half-written PNG. Bad input raises
``ValueError`` with a one-line message.

- ``plot_training_run``: loss, samples/s and live peers over time, preemptions marked; takes
  the Coordinator's step history (``CoordinatorCore.stats()["history"]`` rows
  ``(epoch, at_s, samples, loss, peers)``).
- ``plot_bars`` / ``plot_lines``: generic benchmark plots, written next to a benchmark's
  JSON (``plot_path_for(json_path)``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

PREEMPTION_COLOR = "tab:red"
JOIN_COLOR = "tab:green"


def plot_path_for(json_path: str | os.PathLike) -> Path:
    """Where a benchmark's plot goes: its JSON file's path with ``.png``."""
    return Path(json_path).with_suffix(".png")


def rate_curve(history: Sequence[Sequence], window_s: float, end_s: float,
               points: int = 2000) -> tuple[list[float], list[float]]:
    """Pure: samples/s (``trailing_rate``, the console's definition) at regular instants
    from 0 to ``end_s``, every ``window_s / 2`` (wider when that would exceed ``points``):
    a stretch with no step reads 0, so no line is drawn across it. ``history`` rows are
    ``(epoch, at_s, samples, ...)`` in time order."""
    from moshray.cluster.metrics.state import trailing_rate

    if not window_s > 0:
        raise ValueError(f"window_s must be positive, got {window_s!r}")
    step = max(window_s / 2, end_s / points)
    times = [min(end_s, i * step) for i in range(int(math.ceil(end_s / step)) + 1)]
    return times, [trailing_rate(history, t, window_s).samples_per_s if t > 0 else 0.0
                   for t in times]


def training_figure(
    history: Sequence[Sequence],
    *,
    preemptions: Sequence[float] = (),
    joins: Sequence[float] = (),
    peers: Sequence[tuple[float, int]] | None = None,
    window_s: float | None = None,
    title: str = "moshray training run",
) -> Figure:
    """The training-run figure: three stacked axes sharing time (seconds since start).

    ``preemptions`` / ``joins`` are times (s) of lost and added nodes, drawn as vertical lines
    on every axis. ``peers`` is a ``(t, live_peers)`` timeline (e.g. polled by the job); without
    it the participants of each committed step are drawn. ``window_s`` (default: the
    console's, ``RATE_WINDOW_S``) is the window of samples/s (``rate_curve``).
    """
    rows = [tuple(r) for r in history]
    for r in rows:
        if len(r) < 5:
            raise ValueError(f"history rows must be (epoch, at_s, samples, loss, peers), got {r!r}")
    if any(b[1] < a[1] for a, b in zip(rows, rows[1:])):
        raise ValueError("history must be in time order (at_s non-decreasing)")
    times = [float(r[1]) for r in rows]
    end = max([*times, *(t for t, _ in (peers or ())), *preemptions, *joins, 1.0])
    if window_s is None:
        from moshray.cluster.metrics.state import RATE_WINDOW_S as window_s
    window = window_s

    fig = Figure(figsize=(10, 8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_rate, ax_peers = fig.subplots(3, 1, sharex=True)
    fig.suptitle(title)

    loss_points = [(t, float(r[3])) for t, r in zip(times, rows)
                   if r[3] is not None and math.isfinite(float(r[3]))]
    if loss_points:
        ax_loss.plot(*zip(*loss_points), color="tab:blue", linewidth=1.2, label="loss")
    ax_loss.set_ylabel("training loss")

    if rows:
        ax_rate.plot(*rate_curve(rows, window, end), color="tab:purple",
                     linewidth=1.2, label=f"samples/s ({window:.0f} s window)")
        ax_rate.legend(loc="lower right", fontsize="small")
    ax_rate.set_ylabel("samples / s")
    ax_rate.set_ylim(bottom=0)

    if peers:
        ts, counts = zip(*sorted(peers))
        ax_peers.step(ts, counts, where="post", color="tab:orange", label="live peers")
    elif rows:
        ax_peers.step(times, [int(r[4]) for r in rows], where="post", color="tab:orange",
                      label="peers in step")
    ax_peers.set_ylabel("peers")
    ax_peers.set_xlabel("seconds since start")
    ax_peers.set_ylim(bottom=0)
    ax_peers.yaxis.get_major_locator().set_params(integer=True)

    for ax in (ax_loss, ax_rate, ax_peers):
        for i, t in enumerate(preemptions):
            ax.axvline(t, color=PREEMPTION_COLOR, linestyle="--", linewidth=1,
                       label="preemption" if i == 0 else None)
        for i, t in enumerate(joins):
            ax.axvline(t, color=JOIN_COLOR, linestyle=":", linewidth=1,
                       label="node joined" if i == 0 else None)
        ax.grid(True, alpha=0.3)
        ax.set_xlim(0, end)
    if ax_peers.get_legend_handles_labels()[0]:
        ax_peers.legend(loc="lower right", fontsize="small")
    if not rows:
        ax_loss.text(0.5, 0.5, "no committed global step", ha="center", va="center",
                     transform=ax_loss.transAxes)
    return fig


def plot_training_run(history: Sequence[Sequence], path: str | os.PathLike,
                      **kwargs) -> Path:
    """Write the training-run PNG (see ``training_figure`` for the arguments); returns path."""
    return save_png(training_figure(history, **kwargs), path)


def plot_bars(
    path: str | os.PathLike,
    labels: Sequence[str],
    values: Sequence[float],
    *,
    ylabel: str,
    title: str,
    errors: Sequence[float] | None = None,
) -> Path:
    """A bar per label (e.g. moshray vs gloo seconds), each annotated with its value."""
    if len(labels) != len(values) or not labels:
        raise ValueError(f"need one value per label, got {len(labels)} labels and "
                         f"{len(values)} values")
    if errors is not None and len(errors) != len(values):
        raise ValueError(f"need one error per value, got {len(errors)} for {len(values)}")
    fig = Figure(figsize=(max(4.0, 1.2 * len(labels) + 2), 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    bars = ax.bar(list(labels), [float(v) for v in values],
                  yerr=list(errors) if errors is not None else None, capsize=4,
                  color=[f"C{i}" for i in range(len(labels))])
    ax.bar_label(bars, fmt="%.3g", padding=2)
    ax.margins(y=0.12)  # room for the labels above the tallest bar
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    return save_png(fig, path)


def plot_lines(
    path: str | os.PathLike,
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
    logy: bool = False,
) -> Path:
    """One line per named series over the shared ``x`` (e.g. seconds vs tensor size)."""
    if not series:
        raise ValueError("need at least one series to plot")
    for name, ys in series.items():
        if len(ys) != len(x):
            raise ValueError(f"series {name!r} has {len(ys)} points for {len(x)} x values")
    fig = Figure(figsize=(7, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, ys in series.items():
        ax.plot(list(x), list(ys), marker="o", linewidth=1.2, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return save_png(fig, path)


def save_png(fig: Figure, path: str | os.PathLike) -> Path:
    """Write ``fig`` to ``path`` (a .png) atomically: a temporary file, then a rename."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"plot path must end in .png, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
