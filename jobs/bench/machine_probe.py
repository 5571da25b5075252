"""How fast the machine is at a moment: the bench model's bare training step on one core.

A benchmark that runs for most of an hour on a shared machine compares runs made minutes
apart; if the machine's speed moves in between (other tenants on the host, frequency
scaling), so do the figures. ``bench goodput`` reads this probe before its calibrations,
after them, after moshray's trace run and at the end, and reports the readings and their
spread (``drift``) next to its figures: two rates measured at different times cannot be told
apart more finely than that.

``step_ms`` runs in the caller's process while nothing else of the benchmark runs: the
model of ``model_config`` (``moshray.jobs.examples.lm.model.build_model``), AdamW, a forward, backward
and optimizer step on random bytes of ``batch_size x seq_len``, on one thread (torch's
thread count is restored afterwards, also on error). It measures CPU speed only; a probe
that fails raises (the caller decides whether to go on without it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

__all__ = ["drift", "probe", "report_line", "step_ms"]

log = logging.getLogger("moshray.machine_probe")


def step_ms(model_config, batch_size: int, steps: int = 30, warmup: int = 5,
            seed: int = 0) -> float:
    """Median milliseconds of one training step of ``model_config``'s model over ``steps``
    steps after ``warmup`` unmeasured ones (``actors.model.ModelConfig``; one thread)."""
    if steps < 1 or warmup < 0 or batch_size < 1:
        raise ValueError(f"steps >= 1, warmup >= 0 and batch_size >= 1 needed, got "
                         f"{steps}, {warmup}, {batch_size}")
    import statistics

    import torch

    from moshray.jobs.examples.lm.model import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(model_config, seed=seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, 256, (batch_size, model_config.seq_len), generator=g)
        y = torch.randint(0, 256, (batch_size, model_config.seq_len), generator=g)
        times = []
        for i in range(warmup + steps):
            t = time.perf_counter()
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= warmup:
                times.append(time.perf_counter() - t)
        return statistics.median(times) * 1000.0
    finally:
        torch.set_num_threads(threads)


def drift(readings: Sequence[float | None]) -> float | None:
    """The slowest reading over the fastest (1.0: no drift); None with fewer than two."""
    values = [r for r in readings if r is not None]
    if len(values) < 2:
        return None
    if min(values) <= 0:
        raise ValueError(f"probe readings must be positive, got {values}")
    return max(values) / min(values)


def probe(model_config, batch_size: int) -> float | None:
    """``step_ms`` for a benchmark: None (logged as a warning) if the probe fails, since the
    benchmark's figures stand without it."""
    try:
        return step_ms(model_config, batch_size)
    except Exception as exc:  # noqa: BLE001 - the probe is an aid to reading the figures
        log.warning("machine probe failed: %r", exc)
        return None


def report_line(readings: Mapping[str, float | None]) -> str:
    """One console line: each reading by its label, then the drift."""
    from moshray.jobs.bench.goodput_report import fmt

    shown = ", ".join(f"{label.replace('_', ' ')} {fmt(ms, '.1f')}"
                      for label, ms in readings.items())
    spread = drift(list(readings.values()))
    return (f"machine speed (the model's bare training step on one core, ms): {shown}; drift "
            f"{fmt(spread, '.2f')}{'' if spread is None else 'x'} (runs made at different "
            "times can differ by that much from the machine alone)")
