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


def test_samples_per_second_over_a_trailing_window():
    rates = plots.samples_per_second(history(), window_s=2.0)
    assert rates[0] == pytest.approx(32 / 0.5)  # window = time since start at t=0.5
    assert rates[-1] == pytest.approx(4 * 32 / 2.0)  # steps at t=28.5..30 in (28, 30]
    with pytest.raises(ValueError, match="window_s"):
        plots.samples_per_second(history(), 0)


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
