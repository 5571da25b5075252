"""What a training run shows its user: the progress of the run on the console, and the
run's outputs (``summary.json`` and ``training.png`` in ``run_dir``).

The console (:class:`Console`): on a terminal, ONE progress line redrawn in place (tqdm);
off a terminal (a pipe, a log file, ``ray job logs``), one plain line every
``interval_s`` seconds, and one for the last step. The line's figures come from pure
functions (:func:`trailing_rate`, :func:`eta_s`, :func:`progress_line`) over the
Coordinator's step history rows ``(epoch, at_s, samples, loss, peers)``. Anything else the
driver prints while the bar is up goes through :class:`ConsoleStream` (the bar is cleared
and redrawn around each whole line). :func:`quiet_ray_logs` keeps Ray's own processes'
lines (raylet, GCS server: they stay in the session's log files) off the console.
Pure except for the console writes and the file writes in ``write_outputs``."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

log = logging.getLogger("moshray.train")

from moshray.cluster.metrics.state import RATE_WINDOW_S as WINDOW_S, Rate, trailing_rate  # noqa: F401
INTERVAL_S = 10.0  # off a terminal: one progress line every INTERVAL_S seconds
# Lines Ray's log monitor forwards from its own processes, by the "pid" it gives them:
# these are Ray's internals (their files under the session's logs/ keep them).
RAY_INTERNAL_PIDS = frozenset({"raylet", "gcs_server"})
# moshray's own control actors whose lines stay off the console too: what they log (a
# watcher's "terminate notice, 0.4 s left") is counted on the progress line and in the
# summary, and kept in the session's worker logs.
CONTROL_ACTORS = frozenset({"NoticeWatcher"})


def run_fraction(epoch: int, elapsed: float, max_steps: int | None,
                 max_seconds: float | None) -> float | None:
    """How far the run is towards its bound (the nearer of steps and seconds), or None."""
    parts = []
    if max_steps:
        parts.append(epoch / max_steps)
    if max_seconds:
        parts.append(elapsed / max_seconds)
    return min(max(parts), 1.0) if parts else None


def sig4(x: float | None) -> str:
    """``x`` to 4 significant digits (``5.424000475141737`` -> ``5.424``); ``-`` for None
    or a non-finite value."""
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:#.4g}"  # '#': trailing zeros kept (5.430, not 5.43)


@dataclass(frozen=True)
class Bounds:
    """What ends the run (None: no such bound): global steps, wall seconds, passes over
    the data."""

    max_steps: int | None = None
    max_seconds: float | None = None
    max_epochs: float | None = None

    @property
    def bounded(self) -> bool:
        return any(b is not None for b in (self.max_steps, self.max_seconds, self.max_epochs))


def eta_s(bounds: Bounds, step: int, elapsed: float, rate: Rate,
          epochs_done: float | None = None) -> float | None:
    """Seconds until the nearest bound ends the run, or None when none is known (an
    unbounded run, or no rate yet for a step or epoch bound). Steps left are at
    ``rate.steps_per_s``; epochs left at the rate the epochs so far took (``epochs_done``
    passes over the data in ``elapsed`` seconds)."""
    left = []
    if bounds.max_seconds is not None:
        left.append(max(0.0, bounds.max_seconds - elapsed))
    if bounds.max_steps is not None and rate.steps_per_s > 0:
        left.append(max(0, bounds.max_steps - step) / rate.steps_per_s)
    if bounds.max_epochs is not None and epochs_done and elapsed > 0:
        left.append(max(0.0, bounds.max_epochs - epochs_done) * elapsed / epochs_done)
    return min(left) if left else None


def clock_text(seconds: float | None) -> str:
    """``1:05:09`` / ``4:07``; ``?`` for None."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def progress_line(step: int, rate: Rate, loss: float | None, live: int, preemptions: int,
                  bounds: Bounds = Bounds(), eta: float | None = None) -> str:
    """One progress line: ``step 120 of 500 | 812.3 samples/s | loss 5.424 | peers 3 |
    preemptions 1 | ETA 0:42`` (``of max_steps`` and the ETA only for a bounded run)."""
    total = f" of {bounds.max_steps}" if bounds.max_steps is not None else ""
    line = (f"step {step}{total} | {rate.samples_per_s:.1f} samples/s | loss {sig4(loss)} | "
            f"peers {live} | preemptions {preemptions}")
    if bounds.bounded:
        line += f" | ETA {clock_text(eta)}"
    return line


def last_loss(history: Sequence[tuple]) -> float | None:
    """The newest step's loss that is known (a step may commit without one)."""
    return next((h[3] for h in reversed(history) if h[3] is not None), None)


class ConsoleStream:
    """A text stream for what the driver prints while the progress bar is up: whole lines
    are written with the bar cleared, then the bar is redrawn (a partial line waits for
    its newline). Off a terminal it writes straight through."""

    def __init__(self, raw) -> None:
        self.raw = raw
        self._pending = ""

    def write(self, text: str) -> int:
        from tqdm import tqdm

        self._pending += text
        if "\n" in self._pending:
            whole, _, self._pending = self._pending.rpartition("\n")
            with tqdm.external_write_mode(file=self.raw):
                self.raw.write(whole + "\n")
                self.raw.flush()
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self.write("\n")
        self.raw.flush()

    def isatty(self) -> bool:
        return _isatty(self.raw)

    def __getattr__(self, name):  # encoding, fileno, ... of the stream underneath
        return getattr(self.raw, name)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


_OPEN: "set[Console]" = set()  # consoles whose bar is up (closed on an error by run_job)


def close_open_consoles() -> None:
    """End every progress bar still up (an error ends the run): what is printed next starts
    on a line of its own. Never raises."""
    for console in list(_OPEN):
        try:
            console.close()
        except (OSError, ValueError):
            _OPEN.discard(console)


class Console:
    """The progress of a run on ``out``.

    ``show(stats, elapsed)`` takes the Coordinator's stats (``history`` rows ``(epoch,
    at_s, samples, loss, peers)``, ``live``, ``preemptions``, ``epoch``) at every poll. On
    a terminal (``tty``; default: ``out.isatty()``) it redraws one line in place; else it
    prints a line when ``interval_s`` seconds (on ``clock``) have passed since the last
    one, and at the first step. ``close()`` prints the last state and, on a terminal,
    leaves the bar's final line. While the bar is up, Python logging to the console goes
    through tqdm (the bar is cleared around each record). Never raises over a write to a
    closed stream."""

    def __init__(self, out, bounds: Bounds = Bounds(), *, tty: bool | None = None,
                 interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.out = out
        self.bounds = bounds
        self.tty = _isatty(out) if tty is None else tty
        self.interval_s = interval_s
        self.clock = clock
        self._last_print: float | None = None
        self._shown_step = 0
        self._bar = None
        self._redirect = None

    def line(self, stats: dict, elapsed: float) -> tuple[str, float | None]:
        """The progress line of ``stats`` and the run's fraction done (None: unbounded)."""
        history = stats.get("history", [])
        step = stats.get("epoch", history[-1][0] if history else 0)
        # the rate now on the Coordinator's clock, as the plot draws it (``trailing_rate``)
        now_s = stats.get("now_s", history[-1][1] if history else 0.0)
        rate = trailing_rate(history, now_s, WINDOW_S)
        epochs = stats.get("data_epochs")
        eta = eta_s(self.bounds, step, elapsed, rate, epochs)
        fraction = None
        if self.bounds.bounded:
            parts = [run_fraction(step, elapsed, self.bounds.max_steps,
                                  self.bounds.max_seconds) or 0.0]
            if self.bounds.max_epochs and epochs is not None:
                parts.append(epochs / self.bounds.max_epochs)
            fraction = min(max(parts), 1.0)
        return (progress_line(step, rate, last_loss(history), stats.get("live", 0),
                              stats.get("preemptions", 0), self.bounds, eta), fraction)

    def show(self, stats: dict, elapsed: float) -> None:
        text, fraction = self.line(stats, elapsed)
        if self.tty:
            self._draw(text, fraction)
            return
        step = stats.get("epoch", 0)
        now = self.clock()
        due = self._last_print is None or now - self._last_print >= self.interval_s
        if step > self._shown_step and due:
            self._print(text)
            self._last_print, self._shown_step = now, step

    def close(self, stats: dict | None = None, elapsed: float | None = None) -> None:
        """The last state (``stats`` if given), then the bar is closed (its line kept)."""
        if stats is not None and elapsed is not None:
            text, fraction = self.line(stats, elapsed)
            if self.tty:
                self._draw(text, fraction)
            elif stats.get("epoch", 0) > self._shown_step or self._last_print is None:
                self._print(text)
        _OPEN.discard(self)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None

    def _draw(self, text: str, fraction: float | None) -> None:
        from tqdm import tqdm

        if self._bar is None:
            from tqdm.contrib.logging import logging_redirect_tqdm

            fmt = "{percentage:3.0f}%|{bar:16}| {desc}" if fraction is not None else "{desc}"
            raw = self.out.raw if isinstance(self.out, ConsoleStream) else self.out
            self._bar = tqdm(total=1000, file=raw,
                             bar_format=fmt, dynamic_ncols=True, leave=True)
            # this driver's log records (moshray's, Ray's) clear and redraw the bar
            self._redirect = logging_redirect_tqdm(
                loggers=[logging.root, logging.getLogger("ray")])
            self._redirect.__enter__()
            _OPEN.add(self)
        self._bar.set_description_str(text, refresh=False)
        if fraction is not None:
            self._bar.n = int(fraction * 1000)
        self._bar.refresh()

    def _print(self, text: str) -> None:
        try:
            print(text, file=self.out, flush=True)
        except ValueError:  # the stream is closed (a test's capture, a shut pipe)
            pass


def quiet_ray_logs(internal: frozenset = RAY_INTERNAL_PIDS,
                   control: frozenset = CONTROL_ACTORS) -> bool:
    """Keep the lines Ray forwards from its own processes (``internal``: raylet, GCS
    server) and from moshray's control actors (``control``, by actor class name) off this
    driver's console; the replicas' own output still shows, printed
    with the progress bar cleared around it. Ray's session log files keep everything.
    Call after ``ray.init(log_to_driver=True)``; idempotent; returns whether Ray's
    printer was found (False: Ray's internals changed, nothing is filtered)."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as hub
    except ImportError:
        return False
    with hub._lock:
        found = [(n, h) for n, h in hub.handlers if n == "ray_print_logs"]
    if not found:
        return False
    name, handler = found[0]
    if getattr(handler, "moshray_quiet", False):
        return True

    def filtered(data: dict) -> None:
        if data.get("pid") in internal or data.get("actor_name") in control:
            return
        from tqdm import tqdm

        with tqdm.external_write_mode():
            handler(data)

    filtered.moshray_quiet = True  # type: ignore[attr-defined]
    hub.remove_handler(name)
    hub.add_handler(name, filtered)
    return True


def write_outputs(run_dir: str, history: list, summary: dict, marks: dict) -> str | None:
    """``<run_dir>/summary.json`` and ``<run_dir>/training.png`` (loss, samples/s and peers
    over time, lost nodes and joins marked); returns the plot's path, None if it failed."""
    from pathlib import Path

    from moshray.jobs import plots

    out_dir = Path(run_dir).expanduser()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / "summary.json.tmp"
        tmp.write_text(json.dumps({**summary, "history": history}) + "\n")
        tmp.replace(out_dir / "summary.json")
        return str(plots.plot_training_run(history, out_dir / "training.png", **marks))
    except (OSError, ValueError) as exc:
        log.warning("run outputs not written to %s: %s", out_dir, exc)
        return None


def save_model(run_dir: str, state: dict | None) -> str | None:
    """``state["model"]`` (a replica's final state) to ``<run_dir>/model.pt``; returns the
    path, or None (logged) when there is no state (no staying replica held the last step)
    or it could not be written."""
    from pathlib import Path

    import torch

    if not state or state.get("model") is None:
        log.warning("model not saved: no staying replica held the last step")
        return None
    path = Path(run_dir).expanduser() / "model.pt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".pt.tmp")
        torch.save(state["model"], tmp)
        tmp.replace(path)
    except (OSError, RuntimeError) as exc:
        log.warning("model not saved to %s: %s", path, exc)
        return None
    return str(path)


def full_size_epoch(history: list) -> int:
    """The epoch of the first step the swarm took at its largest (most peers) in ``history``
    rows ``(epoch, at_s, samples, loss, peers)``; 0 for an empty history."""
    most = max((h[4] for h in history), default=0)
    return next((h[0] for h in history if h[4] >= most), 0)


def summarize(stats: dict, statuses: list[dict], leaving: set[str], wall_s: float,
              hard_losses: int) -> dict:
    """The run's summary from the Coordinator's ``stats`` and the replicas' final statuses.

    Replicas in ``leaving`` (their node got a notice) are reported but not held to the
    staying replicas' consistency. ``lost_steps`` counts committed steps the final state
    skipped or went through twice (0 expected); ``skipped_steps`` and ``repeated_steps``
    are the two apart (worst replica each). ``rolled_back_steps``: committed steps undone
    when every replica holding them died (the swarm fell back to an older state: a
    checkpoint's, or the initial one); ``stale_returns``: replicas cut off before such a
    fall back that came back holding the dropped steps (they resynced).
    ``diverged_steps``: the steps some replica committed with a digest that lost the
    Coordinator's vote (it resynced)."""
    history = stats.get("history", [])
    staying = [s for s in statuses if s["peer"] not in leaving]
    top_epoch = max((s["epoch"] for s in staying), default=0)
    finals = {s["checksum"] for s in staying if s["epoch"] == top_epoch}
    losses = [h[3] for h in history if h[3] is not None]
    samples = sum(h[2] for h in history)
    return {
        "steps": stats.get("epoch", 0),
        "samples": samples,
        "wall_s": wall_s,
        "samples_per_s": samples / wall_s if wall_s > 0 else 0.0,
        "preemptions": stats.get("preemptions", 0),
        "initial_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "replicas": len(statuses),
        "replicas_consistent": len(finals) == 1 and all(s["epoch"] == top_epoch
                                                        for s in staying),
        "leaving_replicas": len(statuses) - len(staying),
        "replica_states": [[s["peer"], s["epoch"], s["checksum"]] for s in statuses],
        "devices": sorted({s.get("device", "cpu") for s in statuses}),
        "replica_gpus": [s.get("gpu_ids", []) for s in statuses],
        "rejected_contributions": sum(s["rejected"] for s in statuses),
        "notices": stats.get("notices", 0),
        "hard_losses": hard_losses,
        "rollbacks": stats.get("rollbacks", 0),  # falls back below a committed step
        # committed steps lost with every replica holding them (resumed from a checkpoint)
        "rolled_back_steps": stats.get("rolled_back_steps", 0),
        # replicas that came back holding steps the swarm had fallen back from (resynced)
        "stale_returns": stats.get("stale_returns", 0),
        "lost_steps": max((s["lost_steps"] + s["repeated_steps"] for s in statuses), default=0),
        "skipped_steps": max((s["lost_steps"] for s in statuses), default=0),
        "repeated_steps": max((s["repeated_steps"] for s in statuses), default=0),
        "rebalance_s_max": stats.get("rebalance_s_max") or 0.0,  # the longest of the run
        # steps some replica committed with a digest the others of that step did not hold
        # (a part owner died after some got its result): each resynced from a donor
        # what the replicas' averaging sent, all and to a peer of another zone
        "allreduce_sent_bytes": stats.get("allreduce_sent_bytes", 0),
        "cross_zone_bytes": stats.get("cross_zone_bytes", 0),
        "diverged_steps": sorted({int(e) for _, e in stats.get("diverged", ())}),
    }


def done_line(summary: dict, run_dir: str | None = None) -> str:
    """The run's end: steps, samples, average samples/s over the whole run, preemptions,
    the loss (4 significant digits); what the replica starts came to (``replica_starts``:
    how many trained, how long they took, how many were gone before they trained); and,
    with ``run_dir``, where its outputs are."""
    line = (f"done: {summary['steps']} steps, {summary['samples']} samples in "
            f"{summary['wall_s']:.1f} s ({summary['samples_per_s']:.1f} samples/s), "
            f"{summary['preemptions']} preemptions survived, loss "
            f"{sig4(summary['initial_loss'])} -> {sig4(summary['final_loss'])}, replicas "
            f"consistent: {summary['replicas_consistent']}")
    if summary.get("replica_starts"):
        from moshray.jobs.controller.replica_states import starts_line

        line += f"\nreplica starts: {starts_line(summary['replica_starts'])}"
    if run_dir is not None:
        from pathlib import Path

        where = Path(run_dir).expanduser()
        try:
            where = where.resolve()
        except OSError:  # the working directory went away: say the path as given
            pass
        plot = summary.get("plot")
        line += (f"\nrun directory: {where} (summary.json"
                 f"{', ' + Path(plot).name if plot else '; the plot was not written'})")
    return line
