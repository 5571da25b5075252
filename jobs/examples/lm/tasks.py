"""The example LM as small, self-contained training tasks: batches cut from a deterministic
text (this package's own LM sources: nothing is downloaded), the model of ``model.py`` and
its loss, as a ``moshray.data.from_fn`` function (``lm_shard``) and as a replica group's
``GroupTask`` (``lm_task``). Used by the sharded example, ``moshray bench gpu`` and
``moshray bench groups``, and the tests of replica groups. Everything is module-level: the
replicas and ranks unpickle it.
"""

from __future__ import annotations

import functools
from pathlib import Path



@functools.lru_cache(maxsize=1)
def corpus_bytes() -> bytes:
    """A small deterministic text, read from this package's own sources (no download)."""
    from moshray.jobs.examples.lm import corpus, example, model

    return b"\n".join(Path(m.__file__).read_bytes() for m in (model, corpus, example))


def lm_windows(rng, rows: int, seq_len: int):
    """``(x, y)`` int64 tensors ``(rows, seq_len)``: random windows of ``corpus_bytes`` and
    the same shifted by one byte."""
    import numpy as np
    import torch

    data = np.frombuffer(corpus_bytes(), dtype=np.uint8)
    starts = rng.integers(0, data.size - seq_len - 1, size=rows)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]  # (rows, seq_len + 1)
    w = torch.from_numpy(data[idx].astype(np.int64))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def lm_shard(shard: int, num_shards: int, seed: int, *, seq_len: int, batch: int,
             batches: int = 8):
    """``moshray.data.from_fn``'s function: ``batches`` batches of shard ``shard``."""
    import numpy as np

    rng = np.random.default_rng([seed, shard, num_shards])
    for _ in range(batches):
        yield lm_windows(rng, batch, seq_len)


def lm_step_batch(step: int, *, seq_len: int, rows: int, seed: int = 0):
    """A ``GroupTask.batch``: the global batch of ``step``."""
    import numpy as np

    return lm_windows(np.random.default_rng([seed, step]), rows, seq_len)


def lm_build(model_config: dict, seed: int = 0):
    from moshray.jobs.examples.lm.model import ModelConfig, build_model

    return build_model(ModelConfig(**model_config), seed=seed)


def lm_loss(model, batch):
    x, y = batch
    logits = model(x)  # (batch, seq, vocab); model may be a DDP wrapper, so no .loss()
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def lm_task(model_config: dict, steps: int, rows: int, *, amp: bool, lr: float = 1e-3):
    """The example LM as a ``GroupTask`` (``rows``: the global batch)."""
    from moshray.actors.replica.group_spec import GroupTask

    seq_len = model_config.get("seq_len", 128)
    return GroupTask(functools.partial(lm_build, model_config),
                     functools.partial(lm_step_batch, seq_len=seq_len, rows=rows),
                     lm_loss, steps=steps, lr=lr, amp=amp)
