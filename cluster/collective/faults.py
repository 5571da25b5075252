"""Fault injection for the collective, applied to a peer's inputs (tests, benchmarks).

Each fault changes what the peer feeds into an unmodified ``Averager`` or ends the
process, so the code path under test is the production one.

- ``die``: the process exits before contributing (a crashed peer mid-round).
- ``die_mid_round``: the process answers the transport for ``DIE_AFTER_S`` (the other
  members' calls to it succeed: they cannot learn of its death from them) and then exits
  without contributing. Only a probe or a deadline can tell the others.
- ``stall``: the peer sleeps for a long time before contributing (a frozen or
  partitioned peer; the test removes its node meanwhile).
- ``nan``: its tensors are NaN.
- ``wrong_shape``: its tensor has one extra value.
- ``stale_epoch``: it runs with an old epoch number.
- ``wrong_dtype``: it encodes with fp16 while the round uses another codec.
- ``huge_values``: its tensors hold 3e38, finite but poisoned.
- ``huge_weight``: its weight is 1e30.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import numpy as np

from moshray.cluster.messages import PeerPlan, RoundPlan

FAULTS = ("die", "die_mid_round", "stall", "nan", "wrong_shape", "stale_epoch", "wrong_dtype",
          "huge_values", "huge_weight")
HUGE_VALUE = 3e38
HUGE_WEIGHT = 1e30
STALL_S = 3600.0
STALE_BY = 1000
DIE_AFTER_S = 1.0


async def apply(fault: str | None, arrays: list, weight: float,
                plan: PeerPlan | RoundPlan):
    if fault is None:
        return arrays, weight, plan
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
    if fault == "die":
        os._exit(1)
    if fault == "die_mid_round":
        await asyncio.sleep(DIE_AFTER_S)
        os._exit(1)
    if fault == "stall":
        await asyncio.sleep(STALL_S)
    if fault == "nan":
        arrays = [np.full_like(np.asarray(a, dtype=np.float32), np.nan) for a in arrays]
    if fault == "huge_values":
        arrays = [np.full_like(np.asarray(a, dtype=np.float32), HUGE_VALUE) for a in arrays]
    if fault == "huge_weight":
        weight = HUGE_WEIGHT
    if fault == "wrong_shape":
        arrays = [np.append(np.asarray(arrays[0], dtype=np.float32), np.float32(0)), *arrays[1:]]
    if fault == "stale_epoch":
        plan = dataclasses.replace(plan, epoch=plan.epoch - STALE_BY)
    if fault == "wrong_dtype":
        codec = "fp16" if plan.compression != "fp16" else "none"
        plan = dataclasses.replace(plan, compression=codec)
    return arrays, weight, plan
