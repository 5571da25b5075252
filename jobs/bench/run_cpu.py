"""Where a whole benchmark run's CPU went, by role, for ``moshray bench goodput``.

On this kind of machine every "node" of the embedded cluster shares the same cores, so what a
node event costs (starting a raylet and its agents, starting a replica or a Ray Train worker
group) is taken from the processes that train. The ideal of ``bench goodput`` counts a node
as productive from the instant it appears. This module measures how much of the machine each
role actually had over a run, so the gap can be read off the run itself.

``CpuSampler`` (a context manager) reads ``/proc`` every ``interval_s`` in a thread of the
bench's process and keeps every process below it (the driver subprocess with its embedded
cluster, or the cluster the bench runs for Ray Train with its driver). Roles, from each
process's Ray title (``run_role``):

- ``training``: moshray's replicas (``ReplicaActor``) and Ray Train's workers
  (``RayTrainWorker``), from the moment their worker process became that actor, so their
  own start-up (importing torch, building the model, copying state) is in;
- ``control``: moshray's Coordinator, Ray Train's controller, any other actor;
- ``watchers``: moshray's notice watchers (one per node);
- ``ray_daemons``: raylets, the GCS, the dashboard, every node's agents
  (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``), idle Ray workers (a worker
  process's own start, before it hosts an actor, is here);
- ``drivers``: the job's driver process and the bench itself (its trace replay, this
  sampler: about 1% of a core).

Failure behaviour: without ``/proc`` the sampler reports nothing (``result`` stays None). A
process that ends between two samples loses its CPU since the last one (at most
``interval_s`` per process), so the figures are lower bounds. Processes already running when
the sampler starts count from their first sample; those started later count from zero.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from moshray.jobs.bench.join_profile import ProcSample, descendants, read_procs, used_since

RUN_ROLES = ("training", "control", "watchers", "ray_daemons", "drivers")
_TRAINING = ("ReplicaActor", "RayTrainWorker")
# Ray's own processes that carry a ``ray::`` title: idle workers and every node's agents.
_RAY_TITLED = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnv")
_DAEMONS = ("raylet", "gcs_server", "dashboard", "agent", "log_monitor", "monitor.py",
            "ray.util.client.server")


def run_role(title: str) -> str:
    """The role (see ``RUN_ROLES``) of a process with command line / Ray title ``title``."""
    if title.startswith("ray::"):
        if any(name in title for name in _TRAINING):
            return "training"
        if "NoticeWatcher" in title:
            return "watchers"
        return "ray_daemons" if title.startswith(_RAY_TITLED) else "control"
    program = title.split(" --", 1)[0]  # the executable and script, not their options
    if any(name in program for name in _DAEMONS):
        return "ray_daemons"
    return "drivers"


class CpuAccount:
    """CPU seconds by role, accumulated from successive samples of a set of processes.

    Pure bookkeeping: ``add`` takes one ``read_procs`` mapping and the pids in scope. The
    first sample is the baseline; after it each process counts what it used since the
    sample before (``join_profile.used_since``: a new process, or a reused pid, from zero)."""

    def __init__(self) -> None:
        self.by_role = dict.fromkeys(RUN_ROLES, 0.0)
        self._last: dict[int, ProcSample] | None = None

    def add(self, procs: Mapping[int, ProcSample], scope) -> None:
        if self._last is None:
            self._last = dict(procs)
            return
        for pid in scope:
            p = procs.get(pid)
            if p is not None:
                self.by_role[run_role(p.title)] += used_since(self._last, p)
        # every process's latest reading, so one that a sample missed (a failed read)
        # does not count from zero at the next; updated in place, not copied per sample
        self._last.update(procs)


@dataclass(frozen=True)
class RunCpu:
    """CPU seconds by role (``RUN_ROLES`` order) over ``wall_s`` on ``cpus`` cores."""

    wall_s: float
    cpus: int
    cpu_s: dict[str, float]

    def cores(self, role: str) -> float:
        """The average number of cores ``role`` had over the run."""
        return self.cpu_s[role] / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict:
        return {"wall_s": round(self.wall_s, 1), "cpus": self.cpus,
                "cpu_s": {r: round(v, 1) for r, v in self.cpu_s.items()},
                "cores": {r: round(self.cores(r), 3) for r in self.cpu_s}}

    def line(self) -> str:
        """``training 852 CPU-s (1.38 cores), ..., drivers 26 CPU-s (0.04 cores); 1157 of
        1234 CPU-s``: each role, then all roles together against cores x wall time."""
        used = sum(self.cpu_s.values())
        parts = ", ".join(f"{r} {v:.0f} CPU-s ({self.cores(r):.2f} cores)"
                          for r, v in self.cpu_s.items())
        return f"{parts}; {used:.0f} of {self.wall_s * self.cpus:.0f} CPU-s"


class CpuSampler:
    """``with CpuSampler() as s: ...`` samples the processes below this one (``root``) every
    ``interval_s`` until the block ends; then ``s.result`` is a ``RunCpu`` (None without
    ``/proc``). Never raises for the processes it reads."""

    def __init__(self, interval_s: float = 1.0, root: int | None = None,
                 proc_root: str = "/proc") -> None:
        self.interval_s = interval_s
        self.root = os.getpid() if root is None else root
        self.proc_root = proc_root
        self.result: RunCpu | None = None
        self._account = CpuAccount()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._seen = False

    def _sample(self) -> None:
        procs = read_procs(self.proc_root)
        if procs:
            self._seen = True
            self._account.add(procs, descendants(procs, [self.root]))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "CpuSampler":
        self._started = time.monotonic()
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._sample()
        if self._seen:
            self.result = RunCpu(time.monotonic() - self._started, os.cpu_count() or 1,
                                 dict(self._account.by_role))
