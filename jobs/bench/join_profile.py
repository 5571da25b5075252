"""Where one join's time and CPU go, for ``moshray bench recovery``.

A join is timed from its node being alive in Ray's node table (``up``) through three
instants the bench observes from outside the job (``recovery_trials.CloudTrials.join``):

- ``registered_s``: the new replica is a Coordinator member. Its process has started,
  imported torch, built the user's model and optimizer and registered.
- ``ready_s``: it copied the state from a donor and is ready (in the next plan).
- ``committed_s``: the first global step it took part in was committed (the bench's
  ``join_to_contribution_s``).

CPU: every process's CPU seconds (user + system, ``/proc/<pid>/stat``) is read when the
node is added and again at the commit. The new node's processes (the trees under its
raylet and other daemons) are split by their Ray process title into ``replica`` (the
replica actor), ``watcher`` (the notice watcher) and ``node`` (raylet, agents, idle
workers: what any Ray node costs). The rest of the machine is ``running_replicas`` (the
replicas that were training) and ``rest`` (Coordinator, driver, the other nodes' daemons).
With ``available`` (window x cores) this says how much of the machine the join's own
processes took and what the training replicas were left with. ``start_cpu_s``: the new
node's processes by role from their start until the replica was ready (what starting a
replica costs, its training not included).

Pure functions over ``ProcSample`` mappings, plus ``read_procs`` (Linux ``/proc``; an empty
mapping where there is none, and the profile is then left out).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

ROLES = ("replica", "watcher", "node", "running_replicas", "rest")


@dataclass(frozen=True)
class ProcSample:
    """One process at one instant: parent, start time (clock ticks since boot: with the pid,
    it tells a process from a later one that reused the pid), title and CPU seconds."""

    pid: int
    ppid: int
    started: int
    title: str
    cpu_s: float


def parse_stat(pid: int, stat: str, cmdline: bytes, hz: int) -> ProcSample:
    """A ``ProcSample`` from ``/proc/<pid>/stat`` and ``cmdline`` (the title is the command
    line, which Ray's workers set to ``ray::<Actor>.<method>``; else the stat's name).
    Raises ValueError for a malformed stat line."""
    right = stat.rindex(")")
    name = stat[stat.index("(") + 1:right]
    fields = stat[right + 2:].split()
    title = cmdline.replace(b"\0", b" ").decode(errors="replace").strip() or name
    return ProcSample(pid, int(fields[1]), int(fields[19]), title,
                      (int(fields[11]) + int(fields[12])) / hz)


def read_procs(root: str = "/proc") -> dict[int, ProcSample]:
    """Every process now; processes that end while being read are skipped. Empty without
    ``/proc``."""
    try:
        pids = [int(p) for p in os.listdir(root) if p.isdigit()]
    except OSError:
        return {}
    hz = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            with open(f"{root}/{pid}/stat") as f:
                stat = f.read()
            with open(f"{root}/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            out[pid] = parse_stat(pid, stat, cmdline, hz)
        except (OSError, ValueError, IndexError):
            continue
    return out


def descendants(procs: Mapping[int, ProcSample], roots: Iterable[int]) -> set[int]:
    """``roots`` (those alive in ``procs``) and every process below them."""
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    found, todo = set(), [r for r in roots if r in procs]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def role_of(title: str, on_new_node: bool) -> str:
    """The role of a process (see ``ROLES``) from its title and whether it runs on the node
    that joined."""
    replica = "ReplicaActor" in title
    if on_new_node:
        return "replica" if replica else "watcher" if "NoticeWatcher" in title else "node"
    return "running_replicas" if replica else "rest"


def used_since(before: Mapping[int, ProcSample], p: ProcSample) -> float:
    """CPU seconds ``p`` used since the sample ``before``: from zero if it is not there (or
    is another process under the same, reused pid)."""
    b = before.get(p.pid)
    return max(0.0, p.cpu_s - (b.cpu_s if b is not None and b.started == p.started else 0.0))


def cpu_by_role(before: Mapping[int, ProcSample], after: Mapping[int, ProcSample],
                node_roots: Iterable[int]) -> dict[str, float]:
    """CPU seconds each role used between the two samples (``ROLES`` order). A process in
    ``after`` only (or with another start time: a reused pid) counts from zero; processes
    that ended in between are not seen, so the figures are lower bounds."""
    node = descendants(after, node_roots)
    out = dict.fromkeys(ROLES, 0.0)
    for pid, p in after.items():
        out[role_of(p.title, pid in node)] += used_since(before, p)
    return {k: round(v, 2) for k, v in out.items()}


def node_cpu(procs: Mapping[int, ProcSample], node_roots: Iterable[int]) -> dict[str, float]:
    """CPU seconds the processes of a node that joined used since they started, by role
    (``replica``, ``watcher``, ``node``)."""
    got = cpu_by_role({}, procs, node_roots)
    return {k: got[k] for k in ("replica", "watcher", "node")}


@dataclass(frozen=True)
class JoinProfile:
    """One join: its three instants (seconds after the node was up) and, where ``/proc``
    exists, CPU seconds by role over ``window_s`` (node added -> commit) on ``cpus`` cores
    (``cpu_s``) and the new node's until its replica was ready (``start_cpu_s``)."""

    registered_s: float
    ready_s: float
    committed_s: float
    window_s: float
    cpus: int
    cpu_s: dict[str, float] | None
    start_cpu_s: dict[str, float] | None = None

    def to_json(self) -> dict:
        return {"registered_s": round(self.registered_s, 2), "ready_s": round(self.ready_s, 2),
                "committed_s": round(self.committed_s, 2), "window_s": round(self.window_s, 2),
                "cpus": self.cpus, "cpu_s": self.cpu_s, "start_cpu_s": self.start_cpu_s}

    def line(self) -> str:
        text = (f"registered {self.registered_s:.1f} s, ready {self.ready_s:.1f} s, "
                f"committed {self.committed_s:.1f} s")
        if self.start_cpu_s is not None:
            c = self.start_cpu_s
            text += (f"; CPU-s to ready: replica {c['replica']:.1f}, watcher "
                     f"{c['watcher']:.1f}, node daemons {c['node']:.1f}")
        if self.cpu_s is None:
            return text
        c = self.cpu_s
        return (f"{text}; to the commit: new node {c['replica'] + c['watcher'] + c['node']:.1f}"
                f", running replicas {c['running_replicas']:.1f}, rest {c['rest']:.1f} (of "
                f"{self.window_s * self.cpus:.1f} available)")
