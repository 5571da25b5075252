"""``training.mode = "auto"`` at the job's start: measure, then decide (``mode_choice``).

A ``LinkProbe`` actor on each live spot node (where the replicas will run) builds the
built-in LM from the config, times one node's share of a global step (forward and backward
on one thread, as a replica does) and hands the driver a payload the size of the model's
fp16 gradients (1 to 16 MB), whose fetch time over the node's link gives its bandwidth.
The slowest node's bandwidth and compute time go to ``choose_mode``; the driver prints its
one line and trains with the resolved mode. A job of the user's own (``moshray.fit``: the
model lives in its loop, unknown before the loop runs) and a cluster with no spot node after
``wait_s`` fall back to ``collaborative``, saying so in the same one line. Every wait is
bounded (``timeout_s`` per probe).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from moshray.actors.replica.mode_choice import ModeChoice, choose_mode, resolve_training

MIN_PROBE_BYTES = 1 << 20
MAX_PROBE_BYTES = 16 << 20


def probe_bytes(wire_bytes: float) -> int:
    """The payload a probe sends: the gradient's size within [1 MB, 16 MB]."""
    return int(min(max(wire_bytes, MIN_PROBE_BYTES), MAX_PROBE_BYTES))


def _probe_class():
    import ray

    @ray.remote(num_cpus=0)
    class LinkProbe:
        """Measures one node's step compute and serves a payload to time its link."""

        def compute_s(self, model: dict, batch: int, micro_batches: int) -> float:
            import torch

            from moshray.jobs.examples.lm.model import ModelConfig, build_model

            torch.set_num_threads(1)
            cfg = ModelConfig(**model)
            net = build_model(cfg, seed=0)
            x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))  # (batch, seq_len)
            net.loss(x, x).backward()  # warm-up
            started = time.perf_counter()
            for _ in range(micro_batches):
                net.loss(x, x).backward()
            return time.perf_counter() - started

        def payload(self, nbytes: int):
            import numpy as np

            return np.ones(nbytes, dtype=np.uint8)

    return LinkProbe


def _spot_nodes() -> list[str]:
    import ray

    from moshray.cluster.placement import SPOT_RESOURCE

    return [n["NodeID"] for n in ray.nodes()
            if n["Alive"] and n.get("Resources", {}).get(SPOT_RESOURCE)]


def measure_and_choose(config, job_is_builtin: bool, wait_s: float = 120.0,
                       timeout_s: float = 120.0) -> ModeChoice:
    """Probe the live spot nodes (waiting up to ``wait_s`` for one) and decide. A fallback
    (``collaborative``) carries its reason instead of figures."""
    import ray
    from dataclasses import asdict

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not job_is_builtin:
        return ModeChoice("collaborative", None, 0.0, 0.0,
                          "the job's model is built in its own loop, so its gradient size "
                          "is unknown before it runs: the default")
    deadline = time.monotonic() + wait_s
    nodes = _spot_nodes()
    while not nodes and time.monotonic() < deadline:
        time.sleep(1.0)
        nodes = _spot_nodes()
    if not nodes:
        return ModeChoice("collaborative", None, 0.0, 0.0,
                          f"no spot node to measure within {wait_s:.0f} s: the default")
    model = config.model.to_model_config()
    t = config.training
    params = _parameters(model)
    wire = 2 * params  # fp16 gradients
    micro = max(1, math.ceil(t.target_batch_size / (len(nodes) * t.batch_size)))
    nbytes = probe_bytes(wire)
    probe_cls = _probe_class()
    probes = [probe_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node, soft=False)).remote() for node in nodes]
    try:
        computes = ray.get([p.compute_s.remote(asdict(model), t.batch_size, micro)
                            for p in probes], timeout=timeout_s)
        rates = []
        for p in probes:
            best = math.inf
            for _ in range(2):  # the first fetch also pays the payload's creation
                started = time.perf_counter()
                ray.get(p.payload.remote(nbytes), timeout=timeout_s)
                best = min(best, time.perf_counter() - started)
            rates.append(8.0 * nbytes / best)
    finally:
        for p in probes:
            ray.kill(p)
    return choose_mode(min(rates), wire, max(computes))


def _parameters(model_config) -> int:
    from moshray.jobs.examples.lm.model import build_model

    return sum(p.numel() for p in build_model(model_config, seed=0).parameters())


def resolve_auto(config, job_is_builtin: bool, out):
    """``config`` with ``training.mode = "auto"`` resolved (printed to ``out`` in one
    line); any other mode is returned as is."""
    if config.training.mode != "auto":
        return config
    choice = measure_and_choose(config, job_is_builtin)
    print(choice.line, file=out, flush=True)
    return replace(config, training=resolve_training(config.training, choice))
