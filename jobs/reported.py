"""The driver's side of what training loops report (``Session.report``).

Replicas send ``ReportedEvent`` rows ``(name, step, value)`` to the Coordinator, which keeps
them in order (``Coordinator.reported(since)``). The driver reads the new rows at every
supervision poll and at the end (``ReportedLog.poll``) and

- keeps, per name, the last value with the global step it was reported at (the newest
  step's; among rows of one step, the last to arrive): ``summary()`` is the run summary's
  ``reported`` (``{name: {"value": v, "step": s}}``);
- writes each row to TensorBoard event files under ``<run_dir>/tensorboard`` (tag = the
  name, global step = the step; tensorboardX, so no TensorBoard server package is
  needed: ``tensorboard --logdir <run_dir>/tensorboard`` shows them);
- calls the user's ``on_report(step, {name: value})`` once per step and replica batch
  (the hook for MLflow or W&B: ``mlflow.log_metrics(values, step=step)``,
  ``wandb.log(values, step=step)``; moshray depends on neither). An exception it raises is
  logged and the hook is not called again (a logging service must not end the training).

Rows the Coordinator no longer keeps (more than ``MetricsSink``'s ``reported_keep`` between
two polls, or a Coordinator restart) are missed, never read twice. Pure apart from the
event files; the Coordinator read is the caller's ``fetch(since) -> (total, rows)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

OnReport = Callable[[int, dict], None]  # (global step, {name: value}) on the driver
TENSORBOARD_DIR = "tensorboard"


class ReportedLog:
    """See module docstring. ``run_dir`` None: no event files."""

    def __init__(self, run_dir: str | None, on_report: OnReport | None = None):
        self.run_dir, self.on_report = run_dir, on_report
        self.last: dict[str, tuple[int, float]] = {}
        self.seen = 0  # rows read so far (the Coordinator's count)
        self._writer = None

    def poll(self, fetch: Callable[[int], tuple[int, list]]) -> int:
        """Read and handle the rows after those seen; returns how many were new."""
        total, rows = fetch(self.seen)
        if total < self.seen:  # a restarted Coordinator counts from zero again
            self.seen = 0
            total, rows = fetch(0)
        self.seen = total
        self.add(rows)
        return len(rows)

    def add(self, rows: list) -> None:
        """Handle rows ``(peer, name, step, value)`` in the order they were reported."""
        batches: dict[tuple[str, int], dict] = {}
        for peer, name, step, value in rows:
            step, value = int(step), float(value)
            if step >= self.last.get(name, (-1, 0.0))[0]:
                self.last[name] = (step, value)
            self._write(name, value, step)
            batches.setdefault((peer, step), {})[name] = value
        if self.on_report is not None:
            for (_, step), values in batches.items():
                self._call(step, values)
        if rows and self._writer is not None:
            self._writer.flush()

    def _write(self, name: str, value: float, step: int) -> None:
        if self.run_dir is None:
            return
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(str(Path(self.run_dir) / TENSORBOARD_DIR))
        self._writer.add_scalar(name, value, step)

    def _call(self, step: int, values: dict) -> None:
        try:
            self.on_report(step, dict(values))
        except Exception as exc:  # noqa: BLE001 - the user's logging hook; training goes on
            log.warning("on_report raised %s: %s; not called again", type(exc).__name__, exc)
            self.on_report = None

    def summary(self) -> dict:
        """``{name: {"value": v, "step": s}}``: the last value of each name."""
        return {name: {"value": value, "step": step}
                for name, (step, value) in sorted(self.last.items())}

    @property
    def tensorboard_dir(self) -> str | None:
        """Where the event files are (None if nothing was written)."""
        return None if self._writer is None else str(Path(self.run_dir) / TENSORBOARD_DIR)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
