"""What a training run shows its user: one progress line per global step, and the run's
outputs (``summary.json`` and ``training.png`` in ``run_dir``). Pure except for the file
writes in ``write_outputs``."""

from __future__ import annotations

import json
import logging

log = logging.getLogger("moshray.train")

BAR_WIDTH = 20


def run_fraction(epoch: int, elapsed: float, max_steps: int | None,
                 max_seconds: float | None) -> float | None:
    """How far the run is towards its bound (the nearer of steps and seconds), or None."""
    parts = []
    if max_steps:
        parts.append(epoch / max_steps)
    if max_seconds:
        parts.append(elapsed / max_seconds)
    return min(max(parts), 1.0) if parts else None


def progress_line(h, total_samples: int, elapsed: float, live: int, preemptions: int,
                  fraction: float | None = None) -> str:
    """One console line for a committed global step; with a bar when the run is bounded.

    ``h`` is a history row ``(epoch, at_s, samples, loss, peers)``.
    """
    epoch, _, samples, loss, peers = h
    loss_s = f"{loss:.4f}" if loss is not None else "  -   "
    rate = total_samples / elapsed if elapsed > 0 else 0.0
    bar = ""
    if fraction is not None:
        done = int(round(fraction * BAR_WIDTH))
        bar = f"[{'#' * done}{'.' * (BAR_WIDTH - done)}] {fraction * 100:3.0f}% | "
    return (f"step {epoch:5d} | {bar}loss {loss_s} | {rate:8.1f} samples/s | peers {peers} "
            f"(live {live}) | preemptions {preemptions}")


class Console:
    """The progress lines of a run, one per global step, each printed once (by epoch).

    ``show`` prints the steps of ``stats["history"]`` not shown yet. The samples/s of a
    line sums the history afresh: its counts are corrected as replicas report what they
    really averaged (cluster/coordinator/step_samples.py). A restarted Coordinator starts a new
    history (its sum drops): the old one's sum is kept and added."""

    def __init__(self, out) -> None:
        self.out = out
        self.printed = 0  # the last epoch shown
        self._earlier = 0  # samples of the histories of earlier Coordinator lives
        self._current = 0

    def show(self, stats: dict, elapsed: float, fraction: float | None = None) -> None:
        history = stats.get("history", [])
        total = sum(h[2] for h in history)
        if total < self._current:
            self._earlier += self._current
        self._current = total
        for h in history:
            if h[0] > self.printed:
                self.printed = h[0]
                print(progress_line(h, self._earlier + total, elapsed, stats.get("live", 0),
                                    stats.get("preemptions", 0), fraction),
                      file=self.out, flush=True)


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
    are the two apart (worst replica each)."""
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
        "rollbacks": stats.get("rollbacks", 0),  # steps lost with every peer holding them
        "lost_steps": max((s["lost_steps"] + s["repeated_steps"] for s in statuses), default=0),
        "skipped_steps": max((s["lost_steps"] for s in statuses), default=0),
        "repeated_steps": max((s["repeated_steps"] for s in statuses), default=0),
        "rebalance_s_max": max(stats.get("rebalance_s") or [0.0]),
    }


def done_line(summary: dict) -> str:
    return (f"done: {summary['steps']} steps, {summary['samples']} samples in "
            f"{summary['wall_s']:.1f} s ({summary['samples_per_s']:.1f} samples/s), "
            f"{summary['preemptions']} preemptions survived, loss "
            f"{summary['initial_loss']} -> {summary['final_loss']}, replicas consistent: "
            f"{summary['replicas_consistent']}")
