"""jobs/plots.py: PNGs of a training run and of benchmark results, from plain data."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.image import imread

from moshray.jobs import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def history(steps: int = 60) -> list[tuple]:
    # (epoch, at_s, samples, loss, peers): 32 samples every 0.5 s, a peer gone from step 30
    return [(e, 0.5 * e, 32, 5.0 - 0.04 * e, 3 if e < 30 else 2) for e in range(1, steps + 1)]


def assert_png(path: Path, min_width: int) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    height, width = imread(path).shape[:2]
    assert width >= min_width and height > 100
    assert not list(path.parent.glob(".*.tmp")), "temporary file left behind"


def test_the_plotted_rate_is_the_consoles_at_regular_instants_and_zero_in_a_gap():
    from moshray.cluster.metrics.state import trailing_rate

    rows = history() + [(61, 60.0, 32, 2.6, 2)]  # nothing committed from 30 s to 60 s
    times, rates = plots.rate_curve(rows, window_s=2.0, end_s=60.0)
    assert times[0] == 0.0 and times[-1] == 60.0 and times[1] == 1.0  # every window / 2
    for t, r in zip(times, rates):
        assert r == (trailing_rate(rows, t, 2.0).samples_per_s if t > 0 else 0.0)
    assert rates[times.index(10.0)] == pytest.approx(4 * 32 / 2.0)  # (8, 10]: 4 steps
    assert all(r == 0.0 for t, r in zip(times, rates) if 32.0 <= t < 60.0)  # the gap
    assert rates[-1] == pytest.approx(32 / 2.0)
    with pytest.raises(ValueError, match="window_s"):
        plots.rate_curve(rows, 0, 60.0)


def test_training_figure_marks_preemptions_on_every_axis():
    fig = plots.training_figure(history(), preemptions=[14.8], joins=[25.0],
                                peers=[(0.0, 3), (14.9, 2), (25.2, 3)])
    axes = fig.get_axes()
    assert len(axes) == 3
    for ax in axes:
        xs = [line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == "--"]
        assert xs == [14.8]
    loss_line = axes[0].get_lines()[0]
    assert list(loss_line.get_ydata()[:2]) == pytest.approx([4.96, 4.92])
    assert list(axes[2].get_lines()[0].get_ydata()) == [3, 2, 3]


def test_plot_training_run_writes_a_png(tmp_path: Path):
    out = plots.plot_training_run(history(), tmp_path / "run" / "training.png",
                                  preemptions=[14.8])
    assert out == tmp_path / "run" / "training.png"
    assert_png(out, 900)
    empty = plots.plot_training_run([], tmp_path / "empty.png")  # a run with no step
    assert_png(empty, 900)


def test_benchmark_plots(tmp_path: Path):
    bars = plots.plot_bars(plots.plot_path_for(tmp_path / "allreduce.json"), ["moshray", "gloo"],
                           [2.21, 0.85], ylabel="seconds", title="all-reduce, 4 x 100 MB",
                           errors=[0.1, 0.05])
    assert bars == tmp_path / "allreduce.png"
    assert_png(bars, 300)
    lines = plots.plot_lines(tmp_path / "sizes.png", [1, 20, 100],
                             {"moshray": [0.1, 0.97, 2.21], "gloo": [0.02, 0.17, 0.85]},
                             xlabel="MB per peer", ylabel="seconds", title="all-reduce",
                             logx=True)
    assert_png(lines, 500)


@pytest.mark.parametrize("call, message", [
    (lambda p: plots.plot_bars(p, ["a", "b"], [1.0], ylabel="", title=""), "one value per label"),
    (lambda p: plots.plot_lines(p, [1, 2], {"a": [1.0]}, xlabel="", ylabel="", title=""),
     "series 'a' has 1 points"),
    (lambda p: plots.plot_lines(p, [1], {}, xlabel="", ylabel="", title=""), "at least one"),
    (lambda p: plots.plot_training_run([(1, 0.5, 8)], p), "history rows"),
    (lambda p: plots.plot_training_run([(1, 2.0, 8, 1.0, 1), (2, 1.0, 8, 1.0, 1)], p),
     "time order"),
    (lambda p: plots.plot_bars(p.with_suffix(".jpg"), ["a"], [1.0], ylabel="", title=""),
     "must end in .png"),
])
def test_bad_input_is_refused(tmp_path: Path, call, message):
    with pytest.raises(ValueError, match=message):
        call(tmp_path / "x.png")
