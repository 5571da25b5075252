"""Seeded chaos schedules: random preemptions with notice, hard kills and replacements.

Pure: ``chaos_events`` draws a schedule from a seed and ``write_trace`` writes it in the
per-node trace format (``timestamp_ms,add|remove|kill,node``) that the training job's
``--trace`` replays, so chaos goes through the same path as a real spot trace. The same
seed always gives the same schedule.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from moshray.autoscaler.traces import TraceNodeEvent


@dataclass(frozen=True)
class ChaosConfig:
    """What to draw: over ``duration_s`` seconds, ``losses`` node losses on ``nodes``
    initial nodes, each a hard kill with probability ``kill_fraction`` (else a preemption
    with notice), and a replacement node ``replace_after_s`` later. At least ``min_live``
    nodes stay up at any time, and at least ``min_warm`` of them up for ``warm_s`` or
    longer (a node that just came up has not yet copied the swarm's state: losing every
    warm node loses the state, which no spot trace needs to test); only such a node is
    lost; losses are at least ``min_gap_s`` apart."""

    seed: int = 0
    nodes: int = 3
    duration_s: float = 60.0
    losses: int = 4
    kill_fraction: float = 0.5
    replace_after_s: float = 4.0
    min_live: int = 2
    min_gap_s: float = 5.0
    quiet_start_s: float = 8.0  # first loss not before this (the swarm forms first)
    min_warm: int = 1
    warm_s: float = 12.0  # a new node's start plus its first copy, with room (loopback: ~7 s)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.min_live < 1 or self.min_live > self.nodes:
            raise ValueError(f"need 1 <= min_live <= nodes, got min_live={self.min_live}, "
                             f"nodes={self.nodes}")
        if not 0 <= self.min_warm <= self.min_live or self.warm_s < 0:
            raise ValueError(f"need 0 <= min_warm <= min_live and warm_s >= 0, got "
                             f"min_warm={self.min_warm}, warm_s={self.warm_s}")
        if not 0.0 <= self.kill_fraction <= 1.0:
            raise ValueError(f"kill_fraction must be in [0, 1], got {self.kill_fraction}")
        if self.losses < 0 or self.duration_s <= 0 or self.min_gap_s < 0:
            raise ValueError("losses must be >= 0, duration_s > 0 and min_gap_s >= 0")


def chaos_events(config: ChaosConfig) -> tuple[TraceNodeEvent, ...]:
    """The schedule, in time order: the initial adds at 0, then losses and replacements.

    Losses are placed at random times between ``quiet_start_s`` and the end (at least
    ``min_gap_s`` apart); the victim is a node up for ``warm_s`` or longer (one that just
    came up may not yet run the watcher its notice needs), and a loss is skipped when it
    would leave fewer than ``min_live`` nodes, or fewer than ``min_warm`` up that long.
    Every lost node is replaced ``replace_after_s`` later by a new node name.
    """
    rng = random.Random(config.seed)
    events = [TraceNodeEvent(0.0, "add", f"node{i}") for i in range(config.nodes)]
    live = [f"node{i}" for i in range(config.nodes)]
    up_at = {name: 0.0 for name in live}
    pending: list[tuple[float, str]] = []  # (time, name) of replacements to add
    fresh = config.nodes
    t = config.quiet_start_s
    end = config.duration_s - config.replace_after_s
    for _ in range(config.losses):
        t += config.min_gap_s + rng.uniform(0.0, config.min_gap_s)
        if t >= end:
            break
        for at, name in sorted(p for p in pending if p[0] <= t):
            events.append(TraceNodeEvent(at, "add", name))
            live.append(name)
            up_at[name] = at
            pending.remove((at, name))
        if len(live) - 1 < config.min_live:
            continue
        warm = [n for n in live if t - up_at[n] >= config.warm_s]
        if len(warm) - 1 < config.min_warm:
            continue
        victim = rng.choice(warm)
        live.remove(victim)
        kind = "kill" if rng.random() < config.kill_fraction else "remove"
        events.append(TraceNodeEvent(round(t, 3), kind, victim))
        pending.append((round(t + config.replace_after_s, 3), f"node{fresh}"))
        fresh += 1
    for at, name in sorted(pending):
        if at <= config.duration_s:
            events.append(TraceNodeEvent(at, "add", name))
    return tuple(sorted(events, key=lambda e: e.at_s))


def write_trace(events: tuple[TraceNodeEvent, ...], path: str | Path) -> Path:
    """Write ``events`` as a per-node trace file (milliseconds); returns the path."""
    path = Path(path)
    lines = ["timestamp_ms,action,node_id"]
    lines += [f"{int(round(e.at_s * 1000))},{e.kind},{e.node}" for e in events]
    path.write_text("\n".join(lines) + "\n")
    return path
