"""The built-in job, `moshray train`: a byte-level transformer LM, through the public API.

The same ``loop(session)`` a user writes: build the model (with DMoE layers calling the
cluster's experts when the config asks for them), ``session.prepare`` it with AdamW, and
step on every batch of the shards this replica is handed. The data is ``ByteCorpus``:
the corpus files (URIs, or files shipped through the object store) cut into shards of
byte windows at random offsets over the whole corpus.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from moshray.jobs.examples.lm.corpus import ByteBatches, DataFile
from moshray.actors.replica.actor import Job
from moshray.actors.replica.session import Session

SHARDS = 64


@dataclass(frozen=True)
class ByteCorpus:
    """The built-in corpus as ``num_shards`` shards of random byte windows.

    Opened with ``seed``, shard ``i`` yields about ``1 / num_shards`` of a pass over the
    corpus's training bytes: ``(x, y)`` windows at random offsets (seeded by ``seed`` and
    ``i``) drawn from the *whole* corpus. Each window comes from one of ``regions``
    contiguous slices (``ByteBatches``' split of the files into ``regions`` shards), picked
    in proportion to its training bytes; the last 5% of each slice is held out and never
    drawn. With ``regions = cluster.max_nodes`` those are exactly the bytes the Ray Train
    baseline leaves out and ``bench goodput`` evaluates on.

    Why the whole corpus: a replica reads one shard at a time, so a step's batch comes from
    the few shards open then. Shards that were contiguous slices made every step's
    gradient come from 4 of the corpus's 64 slices; on the goodput model that cost about
    0.09 nats of held-out loss against uniform windows, offline, at the same samples and
    steps. Windows drawn from everywhere make each step a uniform sample, however few
    shards are open.

    Raises ``ValueError`` (from ``ByteBatches``) if a slice is shorter than a window.
    """

    files: tuple[DataFile, ...]
    seq_len: int
    batch_size: int
    num_shards: int = SHARDS
    regions: int = 1

    def open(self, shard: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        slices = _slices(self.files, self.regions, self.seq_len)
        ends = np.cumsum([b.train_end - self.seq_len for b in slices])  # offsets, cumulated
        starts = np.concatenate(([0], ends[:-1]))
        total = int(ends[-1])
        rng = np.random.default_rng([seed, shard])
        count = max(1, total // (self.num_shards * self.seq_len * self.batch_size))
        for _ in range(count):
            # A window's index over all slices' offsets, then which slice holds it.
            flat = rng.integers(0, total, size=self.batch_size)
            which = np.searchsorted(ends, flat, side="right")
            offsets = flat - starts[which]
            xs, ys = zip(*(slices[r].windows(offsets[which == r])
                           for r in range(self.regions) if (which == r).any()))
            yield torch.cat(xs), torch.cat(ys)


@functools.lru_cache(maxsize=4)
def _slices(files: tuple[DataFile, ...], regions: int, seq_len: int) -> list[ByteBatches]:
    """The corpus's ``regions`` slices, read once per process (every shard a replica opens
    draws from the same ones; only their windows are used, so batch size and seed do not
    matter)."""
    return [ByteBatches(list(files), r, regions, seq_len, 1, 0) for r in range(regions)]


def train_loop(session: Session) -> None:
    from moshray.jobs.examples.lm.model import build_model
    from moshray.actors.moe import RayExpertBackend
    from moshray.cluster import metrics

    cfg, t = session.config, session.config.training
    # DMoE layers call the experts registered with the Coordinator (the ExpertActors the
    # job keeps alive); the experts train themselves on backward.
    experts = RayExpertBackend(session.coordinator) if cfg.model.moe else None
    model = build_model(cfg.model.to_model_config(), seed=t.seed, experts=experts)
    opt = session.prepare(model, torch.optim.AdamW(model.parameters(), lr=t.lr,
                                                   weight_decay=t.weight_decay))
    # bf16 autocast on a GPU that has it; full precision on the CPU.
    amp = session.device.type == "cuda" and torch.cuda.is_bf16_supported()
    for x, y in session.batches():
        with torch.autocast(device_type=session.device.type, dtype=torch.bfloat16, enabled=amp):
            loss = model.loss(x, y)
        opt.step(loss)
        if experts is not None:
            session.record(tuple(metrics.ExpertCallEvent(kind, seconds)
                                 for kind, seconds in experts.take_calls()))


def job(config, files) -> Job:
    """The built-in LM job over ``files`` (paths/URIs the replicas open, or ShippedFiles):
    up to ``SHARDS`` shards, each with room for a few batches (read once here, on the
    driver, to size them); windows come from ``cluster.max_nodes`` regions (fewer if the
    corpus is too short for them), see ``ByteCorpus``."""
    from moshray.jobs.examples.lm.corpus import _read_bytes

    seq_len, batch = config.model.seq_len, config.training.batch_size
    total = sum(len(_read_bytes(f)) for f in files)
    shards = max(1, min(SHARDS, total // (4 * (seq_len + 1) * batch)))
    regions = max(1, min(config.cluster.max_nodes, total // (4 * (seq_len + 1))))
    return Job(train_loop, ByteCorpus(tuple(files), seq_len, batch, shards, regions))
