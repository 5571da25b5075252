"""`moshray bench scale`: the Coordinator and Moshpit All-Reduce at 16 to 1,024 peers, in one
process (no Ray), with simulated peers.

Two parts per peer count N (``--peers 16,64,256,1024``):

**The control plane.** The real ``CoordinatorCore`` (membership, progress, plans,
quarantine, notices, shard ledger) with a simulated clock, driven as the actor shell drives it
(``cluster/coordinator/actor.py``): after every call the state is saved to a store
(``durable.DurableState`` over a counting ``MemoryKV``, as the actor's ``_after_call`` does to
the GCS, the metrics sink's record included) and every new plan's views are serialized,
each participant's own (``messages.PeerPlan``: what Ray does for each
``receive_plan.remote(view)`` push); the call's
arguments are deserialized and its reply serialized, as Ray does in the actor's process. Each simulated
second is one global step: every peer heartbeats and reports its micro-batch; the step's
plan is made when the reported samples reach the target (half the peers' samples, as a
swarm's accumulating micro-batches reach it while silent peers are still members); every
ready peer at the epoch is in it, and its participants report the next epoch as committed.
Churn (``--churn``, a share of the peers per step, seeded): half of it spot notices (the
peers on the noticed node drain, then leave), half silent deaths (a peer stops; the
Coordinator expires it after ``peer_ttl_s``), and as many joiners (register, ask a donor,
ready at the current epoch). Measured over the simulated seconds (``--steps``): the
Coordinator's CPU time per global step (every call and its save and pushes, all serialized
under the actor's one lock, so this is also its lock time), messages and control-plane
bytes per peer and in total, the largest view pushed (``plan_bytes``), store writes per
step, rounds and group sizes; and the memory the core holds after the steps
(``tracemalloc`` of its objects, ``--memory-steps`` more steps), or, with
``--memory-global-steps G`` (e.g. 10,000, a long job's), after G global steps of the control plane
alone (``memory_run``: the same peers and churn, no heartbeat calls and no serialization,
so a long run fits in minutes), as the bytes of the objects the core holds
(``retained_bytes``; not the stand-in for Ray's GCS), measured along the way
(``memory_curve``); ``--memory-budget-s`` stops it early, and the figures say how far it
got.

Caveat: a bench peer's handle is its id (a string); a real ``ActorHandle`` pickles larger
and slower, so push bytes and time are a lower bound of the actor's.

**The collective.** The real ``Averager``, grid, round and codecs over the in-process
``transport.LocalNetwork``, with the job key (contributions signed and checked), one plan
of the N peers (``grid.plan_grid`` through ``Membership``), each peer given its view of it
(``RoundPlan.views``, as the Coordinator sends it), ``--avg-steps`` steps each.
Peer i's tensor is blocks of N values with 1 at place i of each, so every
result says exactly whose contributions each of its parts holds (place i > 0) and with what
weight (``held_and_error``): the figures are the largest error of each result against the
exact weighted mean of the contributions it holds (float64); the share of live peers' contributions averaged
exactly (per survivor: the live peers its result holds in every part, 0 if the result is
off by more than ``EXACT``; the mean over survivors), the share of survivors whose result
is exact, and the bytes each peer sent against the grid's ``2 x rounds x tensor bytes``. One
more step kills ``--deaths`` of the peers (10% by default) mid-round, after they sent
their first-round contributions.

``--json``: the last line is one JSON object with ``by_peers`` (per N:
``coordinator_ms_per_step``, ``coordinator_ms_per_second`` (per simulated second, whatever
the step rate: ``global_steps_per_second``), ``coordinator_memory_mb``,
``bytes_per_peer_per_step``,
``grid_bytes_per_peer_per_step``, ``averaged_share_with_deaths``, ``max_abs_error`` and the
rest) and ``fits`` (each figure's best fit among O(1), O(log N), O(N), O(N log N),
O(N^2)). A plot of the figures against N goes to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import pickle
import random
import sys
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moshray.jobs.bench.results import add_results_argument, save_result

FITS = {"O(1)": lambda n: 1.0, "O(log N)": math.log2, "O(N)": float,
        "O(N log N)": lambda n: n * math.log2(n), "O(N^2)": lambda n: float(n) ** 2}
SAMPLES = 32  # samples per peer per step
STEP_S = 1.0  # simulated seconds per global step (one heartbeat and one report per peer)
EXACT = 1e-6  # a result within this of the exact weighted mean is averaged exactly (fp32)
AVERAGE_TIMEOUT_S = 30.0  # a round's deadline in the collective part (in-process: no waits)


class ScaleBenchError(RuntimeError):
    """Bad arguments (the message is the one line to print)."""


@dataclass
class _Wire:
    """What crossed the (simulated) wire to and from the Coordinator."""

    messages: int = 0
    bytes: int = 0
    plan_bytes: list[int] = field(default_factory=list)
    seconds: float = 0.0  # the Coordinator's CPU time in calls, saves and pushes


class _Shell:
    """The actor shell's per-call work around a ``CoordinatorCore`` (see module docstring):
    ``call`` runs a method, saves what changed, serializes each participant's view of each
    new plan, and counts the messages, bytes and CPU time. ``lean`` (the long memory run):
    no serialization, only the call and its saves."""

    def __init__(self, n: int, max_group: int, seed: int, lean: bool = False):
        from moshray.cluster import metrics
        from moshray.cluster.coordinator.core import CoordinatorCore
        from moshray.cluster.coordinator.durable import DurableState, MemoryKV
        from moshray.cluster.coordinator.membership import MembershipConfig
        from moshray.cluster.coordinator.metrics_sink import MetricsSink

        self.now = 0.0
        self.lean = lean
        self.kv = MemoryKV()
        self.store = DurableState(self.kv, "bench")
        self.core = CoordinatorCore(
            MembershipConfig(max_group=max_group, peer_ttl_s=30.0, seed=seed),
            clock=lambda: self.now, target_batch_size=max(1, n * SAMPLES // 2),
            store=self.store)
        self.plans: list = []
        self.core.push_plan = lambda plan, views: self.plans.append((plan, views))
        self.sink = MetricsSink(metrics.Prices(), lambda: None, labels={"job": "bench"})
        self.wire = _Wire()

    def call(self, method: str, *args):
        if self.lean:
            reply = getattr(self.core, method)(*args)
            self.core.save()
            self.store.save_record("sink", self.sink.snapshot())
            self.plans.clear()
            return reply
        sent = pickle.dumps(args)  # the caller's work, not the Coordinator's
        started = time.process_time()
        args = pickle.loads(sent)  # the actor deserializes the call ...
        reply = getattr(self.core, method)(*args)
        self.core.save()
        self.store.save_record("sink", self.sink.snapshot())
        pushed = []
        for plan, views in self.plans:
            for peer in plan.participants:
                pushed.append(len(pickle.dumps(views[peer])))
        answer = len(pickle.dumps(reply))  # ... and serializes its reply
        self.wire.seconds += time.process_time() - started
        self.wire.messages += 2 + len(pushed)
        self.wire.bytes += len(sent) + answer + sum(pushed)
        if self.plans:
            self.wire.plan_bytes.append(max(pushed, default=0))
        self.plans.clear()
        return reply


class _Swarm:
    """``n`` simulated peers around one ``_Shell``: ``step`` is one simulated second (the
    churn's events, then every live peer's heartbeat and report, then the participants of
    a new plan report it applied). ``lean``: no heartbeat calls (the reports are heard
    from anyway) and no serialization, for the long memory run."""

    def __init__(self, n: int, churn: float, max_group: int, seed: int, lean: bool = False):
        self.rng = random.Random(seed)
        self.shell = _Shell(n, max_group, seed, lean)
        self.core = self.shell.core
        self.churn, self.lean = churn, lean
        self.alive: dict[str, str] = {}  # peer -> node
        self.dead: dict[str, float] = {}  # silent peers -> when they went
        self.serial = iter(range(10**9))
        self.contributed: dict[str, tuple[int, int]] = {}
        self.rounds: list[int] = []
        self.groups: list[int] = []
        for _ in range(n):
            self.join(None)

    def join(self, state_epoch: int | None) -> None:
        peer = f"p{next(self.serial):06d}"
        node = f"n-{peer}"
        call, core = self.shell.call, self.core
        call("register", peer, peer, node, 1.0)
        if state_epoch is not None:
            call("donor", peer)
        call("mark_ready", peer, core.epoch if state_epoch is None else state_epoch)
        self.alive[peer] = node

    def step(self) -> None:
        from moshray.cluster.coordinator.progress import ProgressReport

        shell, core, alive, contributed = self.shell, self.core, self.alive, self.contributed
        events = self.churn * len(alive)
        whole = int(events) + (self.rng.random() < events - int(events))
        for k in range(whole):  # half notices, half silent deaths, as many joiners
            victim = self.rng.choice(sorted(alive))
            if k % 2 == 0:
                shell.call("note_notice", alive[victim], shell.now + 2 * STEP_S)
                shell.call("leave", victim)
            else:
                self.dead[victim] = shell.now
            alive.pop(victim)
            self.join(core.epoch)
        epoch = core.epoch
        for peer in sorted(alive):
            if not self.lean:
                shell.call("heartbeat", peer)
            done = contributed.pop(peer, None)
            reply = shell.call("report", ProgressReport(
                peer, epoch, SAMPLES, loss=1.0, checksum=f"c{epoch}", numel=1024,
                contributed=done, micro=1))
            if reply.resync:
                shell.call("mark_ready", peer, core.epoch)
        plan = core.progress.plan
        if plan is not None and plan.epoch == epoch + 1:
            if not self.lean:
                self.rounds.append(len(plan.grid.rounds))
                self.groups.extend(len(g.members) for r in plan.grid.rounds for g in r.groups)
            for peer in plan.participants:
                if peer in alive:
                    contributed[peer] = (plan.epoch, SAMPLES)
            # the participants apply the step: their next report is at the plan's epoch
            for peer in plan.participants:
                if peer in alive:
                    shell.call("report", ProgressReport(
                        peer, plan.epoch, 0, checksum=f"c{plan.epoch}", numel=1024,
                        contributed=contributed.pop(peer), micro=0))
        shell.now += STEP_S


def retained_bytes(root: object, exclude: tuple = ()) -> int:
    """The bytes of every object reachable from ``root`` (``sys.getsizeof`` each, once),
    but through functions, methods, classes and modules (code and shared state, not the
    object's own) and the objects in ``exclude``. O(objects reached)."""
    import gc
    import types

    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
            types.MethodType, types.CodeType, types.FrameType)
    seen = {id(x) for x in exclude}
    todo, total = [root], 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        todo.extend(gc.get_referents(obj))
    return total


def control_plane(n: int, steps: int, memory_steps: int, churn: float, max_group: int,
                  seed: int, memory_global_steps: int = 0,
                  memory_budget_s: float = math.inf) -> dict:
    """The control plane's figures with ``n`` peers: ``steps`` timed simulated seconds
    (``_simulate``), then the memory the core holds: with ``memory_global_steps``, after
    that many global steps of a lean run (``memory_run``), else after ``memory_steps``
    seconds of a second run traced by ``tracemalloc`` (not timed: tracing slows every
    allocation)."""
    figures = _simulate(n, steps, 0, churn, max_group, seed, traced=False)
    if memory_global_steps > 0:
        figures.update(memory_run(n, memory_global_steps, churn, max_group, seed,
                                  memory_budget_s))
    elif memory_steps > 0:
        memory = _simulate(n, 0, memory_steps, churn, max_group, seed, traced=True)
        figures["coordinator_memory_mb"] = memory["coordinator_memory_mb"]
        figures["steps_for_memory"] = memory["steps_for_memory"]  # simulated seconds
        figures["global_steps_for_memory"] = memory["epoch_at_end"]
        figures["memory_method"] = "tracemalloc"
    return figures


def memory_run(n: int, global_steps: int, churn: float, max_group: int, seed: int,
               budget_s: float = math.inf, points: int = 5) -> dict:
    """The control plane alone (the real core and its saves; the peers report, get plans
    and commit, without moving tensors or serializing messages) until ``global_steps``
    global steps were made or ``budget_s`` of wall time ran out (then the figures say how
    many it reached: ``memory_complete`` False). The memory is ``retained_bytes`` of the
    core (its services, tracker, caches and store object; not the ``MemoryKV`` standing in
    for Ray's GCS, nor the simulated peers), measured at ``points`` steps along the way
    (``memory_curve``: [global steps, MB], to show it flat or growing)."""
    swarm = _Swarm(n, churn, max_group, seed, lean=True)
    core, kv = swarm.core, swarm.shell.kv
    marks = sorted({max(1, global_steps * (i + 1) // points) for i in range(points)})
    curve, started, seconds = [], time.perf_counter(), 0
    out_of_time = False
    while core.epoch < global_steps:
        if time.perf_counter() - started > budget_s:
            out_of_time = True
            break
        swarm.step()
        seconds += 1
        if marks and core.epoch >= marks[0]:
            marks.pop(0)
            curve.append([core.epoch, round(retained_bytes(core, (kv,)) / 2**20, 2)])
    memory = retained_bytes(core, (kv,))
    if not curve or curve[-1][0] != core.epoch:
        curve.append([core.epoch, round(memory / 2**20, 2)])
    return {"coordinator_memory_mb": round(memory / 2**20, 2),
            "global_steps_for_memory": core.epoch, "steps_for_memory": seconds,
            "memory_complete": not out_of_time, "memory_curve": curve,
            "memory_run_s": round(time.perf_counter() - started, 1),
            "memory_method": "object graph", "history_rows": len(core.progress.history)}


def _simulate(n: int, steps: int, memory_steps: int, churn: float, max_group: int,
              seed: int, traced: bool) -> dict:
    if traced:
        tracemalloc.start()
    swarm = _Swarm(n, churn, max_group, seed)
    shell, core = swarm.shell, swarm.core
    timed = {"seconds": 0.0, "messages": 0, "bytes": 0, "puts": 0}
    for _ in range(3 if steps else 0):  # warm up: the first plans
        swarm.step()
    wire0, puts0, epoch0 = (shell.wire.seconds, shell.wire.messages, shell.wire.bytes), \
        shell.kv.puts, core.epoch
    for _ in range(steps):
        swarm.step()
    stepped = core.epoch - epoch0
    made = max(1, stepped)
    timed["seconds"] = shell.wire.seconds - wire0[0]
    timed["messages"] = shell.wire.messages - wire0[1]
    timed["bytes"] = shell.wire.bytes - wire0[2]
    timed["puts"] = shell.kv.puts - puts0
    for _ in range(memory_steps):
        swarm.step()
    del shell.plans[:]
    current = 0
    if traced:
        current, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    rounds, groups = swarm.rounds, swarm.groups
    return {
        "peers": n, "steps_timed": steps, "global_steps_made": made,
        "steps_for_memory": memory_steps, "epoch_at_end": core.epoch,
        "coordinator_ms_per_step": round(1000 * timed["seconds"] / made, 3),
        # per simulated second (each peer's heartbeat and report): what the step rate
        # (a peer that died in the last plan holds the next one until it missed two
        # heartbeats: about one extra simulated second per death) does not move
        "coordinator_ms_per_second": round(1000 * timed["seconds"] / max(steps, 1), 3),
        "global_steps_per_second": round(stepped / max(steps, 1), 2),
        "messages_per_step": round(timed["messages"] / made, 1),
        "messages_per_peer_per_step": round(timed["messages"] / made / n, 2),
        "control_bytes_per_peer_per_step": round(timed["bytes"] / made / n, 1),
        "control_bytes_per_step": round(timed["bytes"] / made),
        "plan_bytes": max(shell.wire.plan_bytes, default=0),
        "store_writes_per_step": round(timed["puts"] / made, 2),
        "rounds": max(rounds, default=0),
        "group_size_max": max(groups, default=0),
        "group_size_mean": round(sum(groups) / len(groups), 2) if groups else 0,
        "coordinator_memory_mb": round(current / 2**20, 2) if traced else None,
        "churn_per_step": churn, "silent_deaths": len(swarm.dead),
    }


def _tensor(i: int, n: int, blocks: int) -> np.ndarray:
    """Peer ``i``'s tensor: ``blocks`` blocks of ``n`` values, 1 at place ``i`` of each."""
    x = np.zeros((blocks, n), dtype=np.float32)
    x[:, i] = 1.0
    return x.reshape(-1)


def held_and_error(out: np.ndarray, n: int, weights: np.ndarray) -> tuple[np.ndarray, float]:
    """Which peers' contributions ``out`` holds in every part, and its largest error against
    the exact weighted mean of what each part holds.

    Every block of ``n`` values says whose weight is in it (place i > 0: peer i) and so what
    the exact mean is (``w_i / sum of the held weights`` at place i, 0 elsewhere). A block
    that a part boundary cuts holds two sets: its values before the cut are checked against
    the block before it, after the cut against the block after it (the cut that fits best
    is taken), so a boundary is never counted as an error and a wrong value always is."""
    blocks = out.reshape(-1, n).astype(np.float64)
    inc = blocks > 0
    exact = np.where(inc, weights / np.maximum((inc * weights).sum(axis=1, keepdims=True),
                                               1e-300), 0.0)
    err = np.abs(blocks - exact).max(axis=1)
    worst = 0.0
    for k, e in enumerate(err):
        if e <= 1e-6 or k == 0 or k == len(err) - 1:
            worst = max(worst, float(e))
            continue
        before = np.abs(blocks[k] - exact[k - 1])
        after = np.abs(blocks[k] - exact[k + 1])
        # the best cut b: [0, b) from the block before, [b, n) from the block after
        head = np.concatenate(([0.0], np.maximum.accumulate(before)))
        tail = np.concatenate((np.maximum.accumulate(after[::-1])[::-1], [0.0]))
        worst = max(worst, float(min(e, np.min(np.maximum(head, tail)))))
    return inc.all(axis=0), worst


async def _average_once(averagers, network, views, arrays, weights, kill: set[str]):
    """One step: every averager averages over its view of the plan (``views``: peer ->
    ``PeerPlan``); the ``kill`` set dies once its first-round contributions are out (a few
    event-loop turns in). Returns {peer: (result, report)} of the survivors."""
    async def one(pid):
        out, report = await averagers[pid].all_reduce([arrays[pid]], weights[pid],
                                                      views[pid], AVERAGE_TIMEOUT_S)
        return pid, out[0], report

    tasks = {pid: asyncio.ensure_future(one(pid)) for pid in averagers}
    if kill:
        for _ in range(3):
            await asyncio.sleep(0)
        for pid in kill:
            network.kill(pid)
            tasks[pid].cancel()
    done = {}
    for pid, task in tasks.items():
        if pid in kill:
            continue
        _, out, report = await task
        done[pid] = (out, report)
    for pid in kill:
        try:
            await tasks[pid]
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the dead peer's own end
            pass
    return done


def collective(n: int, steps: int, numel: int, deaths: float, max_group: int,
               compression: str, seed: int) -> dict:
    """The averaging part at ``n`` peers (see module docstring); its figures."""
    from moshray.cluster.collective.auth import new_job_key
    from moshray.cluster.collective.averager import Averager
    from moshray.cluster.collective.transport import LocalNetwork
    from moshray.cluster.coordinator.membership import Membership, MembershipConfig
    from moshray.cluster.messages import PeerInfo

    blocks = max(1, -(-numel // n))
    numel = blocks * n
    rng = np.random.default_rng(seed)
    key = new_job_key()
    worst, shares, sent, seconds = 0.0, [], [], []
    plan_rounds = 0
    death_share = death_exact = None
    weights_of = np.array([float(1 + i % 4) for i in range(n)])
    for step in range(steps + 1):
        kill_step = step == steps  # the last step: deaths mid-round
        network = LocalNetwork()
        membership = Membership(MembershipConfig(max_group=max_group, compression=compression,
                                                 seed=seed + step))
        averagers = {}
        for i in range(n):
            pid = f"p{i:05d}"
            averagers[pid] = Averager(pid, transport=network.transport(pid), job_key=key)
            network.add(pid, averagers[pid])
            membership.register(PeerInfo(pid, pid), now=0.0)
        membership.epoch = step
        plan = membership.plan(now=0.0)
        plan_rounds = len(plan.grid.rounds)
        index = {pid: i for i, pid in enumerate(sorted(averagers))}
        arrays = {pid: _tensor(index[pid], n, blocks) for pid in averagers}
        weights = {pid: float(weights_of[index[pid]]) for pid in averagers}
        kill = set()
        if kill_step and deaths > 0:
            kill = set(rng.choice(sorted(averagers), size=max(1, int(round(deaths * n))),
                                  replace=False).tolist())
        started = time.perf_counter()
        results = asyncio.run(_average_once(averagers, network, plan.views(), arrays,
                                            weights, kill))
        seconds.append(time.perf_counter() - started)
        live = np.array([pid not in kill for pid in sorted(averagers)])
        step_shares, exact = [], []
        for pid, (out, report) in results.items():
            held, error = held_and_error(out, n, weights_of)
            worst = max(worst, error)
            exact.append(error <= EXACT)
            # the live contributions this result averages exactly (none if it is inexact)
            step_shares.append(float((held & live).sum() / live.sum()) if exact[-1] else 0.0)
            if not kill_step:
                sent.append(report.bytes_sent)
        share = float(np.mean(step_shares)) if step_shares else 0.0
        if kill_step:
            death_share, death_exact = share, float(np.mean(exact)) if exact else 0.0
        else:
            shares.append(share)
    tensor_bytes = numel * 4
    return {
        "avg_steps": steps, "numel": numel, "compression": compression,
        "grid_rounds": plan_rounds,
        "bytes_per_peer_per_step": round(float(np.median(sent))) if sent else 0,
        "grid_bytes_per_peer_per_step": 2 * plan_rounds * tensor_bytes,
        "averaged_share": round(min(shares), 4) if shares else None,
        "averaged_share_with_deaths": None if death_share is None else round(death_share, 4),
        "exact_results_with_deaths": None if death_exact is None else round(death_exact, 4),
        "deaths": deaths,
        "max_abs_error": worst,
        "average_step_s": round(float(np.median(seconds[:-1] or seconds)), 3),
    }


def fit(ns: list[int], ys: list[float]) -> str:
    """The growth among ``FITS`` whose ``y = a + b f(N)`` fits ``ys`` best (least squares on
    relative residuals); "" with fewer than 3 points."""
    if len(ns) < 3 or any(y is None for y in ys) or not any(ys):
        return ""
    best, best_err = "", math.inf
    y = np.asarray(ys, dtype=np.float64)
    scale = np.maximum(np.abs(y), 1e-12)
    for name, f in FITS.items():
        a = np.stack([np.ones(len(ns)), [f(n) for n in ns]], axis=1) / scale[:, None]
        coef, *_ = np.linalg.lstsq(a, y / scale, rcond=None)
        if name != "O(1)" and coef[1] <= 0:
            continue
        err = float(np.sum((a @ coef - y / scale) ** 2))
        if err < best_err - 1e-9:
            best, best_err = name, err
    return best


FIGURES = ("coordinator_ms_per_step", "coordinator_memory_mb", "messages_per_peer_per_step",
           "control_bytes_per_peer_per_step", "plan_bytes", "store_writes_per_step",
           "bytes_per_peer_per_step")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", default="16,64,256,1024", metavar="N,N,...",
                        help="peer counts to run (default 16,64,256,1024)")
    parser.add_argument("--steps", type=int, default=20, metavar="S",
                        help="timed global steps of the control plane per peer count")
    parser.add_argument("--memory-steps", type=int, default=1000, metavar="S",
                        help="more control-plane steps before the memory figure")
    parser.add_argument("--memory-global-steps", type=int, default=0, metavar="G",
                        help="measure the memory after G global steps of the control plane "
                             "alone instead (no tensors, no serialization; e.g. 10000)")
    parser.add_argument("--memory-budget-s", type=float, default=None, metavar="S",
                        help="stop that run after S seconds of wall time per peer count "
                             "(the figures say how many steps it reached)")
    parser.add_argument("--churn", type=float, default=0.01, metavar="F",
                        help="share of the peers replaced per step (notices and silent "
                             "deaths, as many joiners)")
    parser.add_argument("--avg-steps", type=int, default=10, metavar="S",
                        help="averaging steps per peer count (plus one with deaths)")
    parser.add_argument("--numel", type=int, default=4096, metavar="K",
                        help="values per peer's tensor (at least N+1 are used)")
    parser.add_argument("--deaths", type=float, default=0.1, metavar="F",
                        help="share of the peers that die mid-round in the last step")
    parser.add_argument("--max-group", type=int, default=None, metavar="G",
                        help="largest averaging group (default: the product's)")
    parser.add_argument("--compression", default="none",
                        help="the codec of the averaging (a codecs.py name; default none)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the churn, the deaths and the grid (default 0)")
    parser.add_argument("--out", default="runs/bench-scale", metavar="DIR",
                        help="where the plot and scale.json go")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    add_results_argument(parser)


def _peer_counts(text: str) -> list[int]:
    try:
        ns = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ScaleBenchError(f"--peers {text}: give peer counts like 16,64,256") from None
    if not ns or ns[0] < 2:
        raise ScaleBenchError(f"--peers {text}: every count must be >= 2")
    return ns


def run(args: argparse.Namespace) -> dict:
    import logging

    from moshray.cluster.collective.codecs import codec_names
    from moshray.cluster.collective.grid import DEFAULT_MAX_GROUP

    ns = _peer_counts(args.peers)
    if args.steps < 1 or args.avg_steps < 1 or args.memory_steps < 0 or \
            args.memory_global_steps < 0:
        raise ScaleBenchError("--steps and --avg-steps must be >= 1, --memory-steps and "
                              "--memory-global-steps >= 0")
    if args.memory_budget_s is not None and not args.memory_budget_s > 0:
        raise ScaleBenchError("--memory-budget-s must be positive")
    budget_s = math.inf if args.memory_budget_s is None else args.memory_budget_s
    if not 0 <= args.churn < 0.5 or not 0 <= args.deaths < 1:
        raise ScaleBenchError("--churn must be in [0, 0.5) and --deaths in [0, 1)")
    if args.compression not in codec_names():
        raise ScaleBenchError(f"--compression {args.compression}: one of {codec_names()}")
    max_group = args.max_group or DEFAULT_MAX_GROUP
    # a round's rejections of the killed peers' parts are expected here: one line each
    logging.getLogger("moshray").setLevel(logging.ERROR)
    by_peers = {}
    for n in ns:
        started = time.perf_counter()
        figures = control_plane(n, args.steps, args.memory_steps, args.churn, max_group,
                                args.seed, args.memory_global_steps, budget_s)
        figures.update(collective(n, args.avg_steps, args.numel, args.deaths, max_group,
                                  args.compression, args.seed))
        figures["bench_s"] = round(time.perf_counter() - started, 1)
        by_peers[str(n)] = figures
        print(f"{n:5d} peers: Coordinator {figures['coordinator_ms_per_step']:.2f} ms/step "
              f"({figures['coordinator_ms_per_second']:.2f} ms per simulated second, "
              f"{figures['global_steps_per_second']} steps/s; "
              f"{figures['messages_per_peer_per_step']:.1f} messages, "
              f"{figures['control_bytes_per_peer_per_step']:.0f} B per peer), plan "
              f"{figures['plan_bytes']} B, {figures['store_writes_per_step']} store writes/"
              f"step, memory {figures['coordinator_memory_mb']} MB after "
              f"{figures.get('global_steps_for_memory')} global steps"
              f"{'' if figures.get('memory_complete', True) else ' (out of time)'}; averaging "
              f"{figures['grid_rounds']} "
              f"round(s): {figures['bytes_per_peer_per_step']} B/peer/step (grid "
              f"{figures['grid_bytes_per_peer_per_step']}), share averaged "
              f"{figures['averaged_share']} ({figures['averaged_share_with_deaths']} with "
              f"{args.deaths:.0%} dying; exact results {figures['exact_results_with_deaths']}), max error {figures['max_abs_error']:.2e} "
              f"[{figures['bench_s']} s]", flush=True)
    fits = {name: fit(ns, [by_peers[str(n)][name] for n in ns]) for name in FIGURES}
    result = {"peers": ns, "max_group": max_group, "by_peers": by_peers, "fits": fits}
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(result, indent=1) + "\n")
    if len(ns) > 1:
        from moshray.jobs.plots import plot_lines

        result["plot"] = str(plot_lines(
            out / "scale.png", ns,
            {f"{name} ({fits[name] or '-'})": [max(by_peers[str(n)][name], 1e-3) for n in ns]
             for name in FIGURES if all(by_peers[str(n)][name] is not None for n in ns)},
            xlabel="peers", ylabel="per global step (see legend)", logx=True, logy=True,
            title="moshray at scale: Coordinator and averaging per global step"))
    return result


def main(args: argparse.Namespace) -> int:
    try:
        result = run(args)
    except ScaleBenchError as exc:
        print(f"moshray bench scale: {exc}", file=sys.stderr)
        return 2
    save_result("scale", args, result)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="moshray bench scale", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
