"""The built-in job, `moshray train`: a byte-level transformer LM, through the public API.

The same ``loop(session)`` a user writes: build the model (with DMoE layers calling the
cluster's experts when the config asks for them), ``session.prepare`` it with AdamW, and
step on every batch of the shards this replica is handed. The data is ``ByteCorpus``:
the corpus files (URIs, or files shipped through the object store) cut into shards of
random-offset byte windows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moshray.actors.data import ByteBatches, DataFile
from moshray.actors.replica import Job
from moshray.actors.session import Session

SHARDS = 64


@dataclass(frozen=True)
class ByteCorpus:
    """Shard ``i`` of ``num_shards`` is the ``i``-th slice of the files' bytes (or every
    ``num_shards``-th file when there are enough files); opened with ``seed`` it yields
    about one pass over its bytes of ``(x, y)`` windows at random offsets (the last 5% of
    the slice held out, as ``ByteBatches`` does)."""

    files: tuple[DataFile, ...]
    seq_len: int
    batch_size: int
    num_shards: int = SHARDS

    def open(self, shard: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        batches = ByteBatches(list(self.files), shard, self.num_shards, self.seq_len,
                              self.batch_size, seed)
        for _ in range(max(1, batches.train_end // (self.seq_len * self.batch_size))):
            yield batches.next_batch()


def train_loop(session: Session) -> None:
    from moshray.actors.model import build_model
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
    driver, to size them)."""
    from moshray.actors.data import _read_bytes

    seq_len, batch = config.model.seq_len, config.training.batch_size
    total = sum(len(_read_bytes(f)) for f in files)
    shards = max(1, min(SHARDS, total // (4 * (seq_len + 1) * batch)))
    return Job(train_loop, ByteCorpus(tuple(files), seq_len, batch, shards))
