"""Result files: one small JSON per benchmark run, the source of ``docs/performance.md``.

A benchmark given ``--results DIR`` (``add_results_argument``) ends its run with
:func:`save_result`, which writes ``DIR/<bench>-<UTC date and time>.json``::

    {"bench": "allreduce", "command": "moshray bench allreduce --peers 4 ...",
     "date": "2026-11-27T16:02:11Z", "commit": "7c25d57", "dirty": true,
     "machine": {"cpu": "AMD EPYC ...", "cores": 2, "memory_gib": 23.4, "gpus": [],
                 "load_average": 3.1},
     "figures": {...the bench's own JSON object...}}

The committed folder is ``docs/results`` (:data:`RESULTS_DIR`); ``moshray bench report``
(``jobs/bench/report.py``) renders the newest file of each benchmark. Files are never
edited by hand: git keeps the history, and a figure that is not in a result file is not
rendered. :func:`load_results` reads a folder back; a file that is not a result raises
:class:`ResultError` naming the file and what is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS_DIR = "docs/results"
REQUIRED = ("bench", "command", "date", "figures")
# Machine-local paths a bench adds to its JSON; they mean nothing in the repository.
_LOCAL_KEYS = ("json", "plot")


class ResultError(ValueError):
    """A result file that cannot be read; ``str()`` is one line naming the file."""


@dataclass(frozen=True)
class Result:
    """One run's result file: which bench, how it was run, when, where, and its figures."""

    bench: str
    command: str
    date: str  # ISO 8601 UTC, "2026-11-27T16:02:11Z": sorts as time does
    figures: Mapping[str, Any]
    machine: Mapping[str, Any]
    commit: str | None
    dirty: bool | None
    path: Path

    @property
    def day(self) -> str:
        """The UTC date of the run, ``YYYY-MM-DD``."""
        return self.date[:10]


def add_results_argument(parser: argparse.ArgumentParser) -> None:
    """``--results DIR``: also write this run's result file into DIR (off by default)."""
    parser.add_argument("--results", metavar="DIR", default=None,
                        help=f"also write a result file <bench>-<date>.json into DIR "
                             f"(the committed one is {RESULTS_DIR}; `moshray bench report` "
                             "renders it)")


def command_line(args: argparse.Namespace, bench: str) -> str:
    """The command that ran, as a user would type it: ``moshray bench <bench> ...``.

    ``moshray``'s entry point stores its argv in ``args.argv`` (``jobs/cli.py``); a module
    run as ``python -m moshray.jobs.bench.<bench>`` falls back to ``sys.argv``.
    """
    argv = getattr(args, "argv", None)
    if not argv:
        rest = list(sys.argv[1:])
        if rest[:2] == ["bench", bench]:
            rest = rest[2:]
        argv = ["bench", bench, *rest]
    return shlex.join(["moshray", *argv])


def machine() -> dict[str, Any]:
    """What ran it: CPU model, cores, memory, GPUs (names, via torch if it is imported or
    installed) and the 1-minute load average at the end of the run."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    try:
        memory = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    gpus: list[str] = []
    try:
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory, "gpus": gpus,
            "load_average": round(os.getloadavg()[0], 2)}


def _git(*argv: str) -> str | None:
    try:
        done = subprocess.run(["git", *argv], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def save_result(bench: str, args: argparse.Namespace, figures: Mapping[str, Any],
                *, now: float | None = None) -> Path | None:
    """Write ``<args.results>/<bench>-<date>.json`` if ``--results`` was given; return its
    path (None without ``--results``). The write is atomic (a temporary name, then a
    rename). ``figures`` must be JSON-able; its machine-local paths (``json``, ``plot``)
    are left out. An unwritable folder raises OSError: the run's figures are still on
    stdout and in ``--out``."""
    folder = getattr(args, "results", None)
    if folder is None:
        return None
    stamp = time.gmtime(time.time() if now is None else now)
    status = _git("status", "--porcelain", "--untracked-files=no")
    record = {
        "bench": bench,
        "command": command_line(args, bench),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", stamp),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty": None if status is None else bool(status),
        "machine": machine(),
        "figures": {k: v for k, v in figures.items() if k not in _LOCAL_KEYS},
    }
    out = Path(folder).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{bench}-{time.strftime('%Y%m%dT%H%M%SZ', stamp)}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    print(f"result: {path}", file=sys.stderr, flush=True)
    return path


def read_result(path: Path) -> Result:
    """One result file; :class:`ResultError` if it is not JSON or lacks a required key."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ResultError(f"{path}: not a readable JSON result file ({exc})") from None
    if not isinstance(data, dict):
        raise ResultError(f"{path}: a result file holds one JSON object")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ResultError(f"{path}: missing {', '.join(missing)} (write result files with "
                          "a bench's --results DIR, never by hand)")
    if not isinstance(data["figures"], dict):
        raise ResultError(f"{path}: 'figures' must be a JSON object")
    return Result(bench=str(data["bench"]), command=str(data["command"]),
                  date=str(data["date"]), figures=data["figures"],
                  machine=data.get("machine") or {}, commit=data.get("commit"),
                  dirty=data.get("dirty"), path=Path(path))


def load_results(folder: str | Path) -> dict[str, list[Result]]:
    """Every result file in ``folder`` (``*.json``), grouped by bench, newest first (by
    ``date``, then file name). A missing folder gives no results."""
    out: dict[str, list[Result]] = {}
    root = Path(folder)
    if not root.is_dir():
        return out
    for path in sorted(root.glob("*.json")):
        result = read_result(path)
        out.setdefault(result.bench, []).append(result)
    for results in out.values():
        results.sort(key=lambda r: (r.date, r.path.name), reverse=True)
    return out
