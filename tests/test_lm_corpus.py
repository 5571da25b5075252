"""The built-in job's corpus (``jobs/examples/lm.ByteCorpus``): every shard draws windows
from the whole corpus, never from a held-out tail, and a given (shard, seed) replays."""

from __future__ import annotations

import torch

from moshray.jobs.examples.lm.example import ByteCorpus


def _regions_file(tmp_path, regions: int, size: int) -> str:
    """A file of ``regions`` equal slices; slice r is byte ``r`` for its first 95% and
    ``100 + r`` in its held-out last 5%."""
    body = b"".join(bytes([r]) * (size * 95 // 100) + bytes([100 + r]) * (size * 5 // 100)
                    for r in range(regions))
    path = tmp_path / "corpus.txt"
    path.write_bytes(body)
    return str(path)


def test_every_shard_draws_from_every_region_and_never_from_held_out(tmp_path):
    path = _regions_file(tmp_path, regions=4, size=4000)
    corpus = ByteCorpus((path,), seq_len=16, batch_size=8, num_shards=4, regions=4)
    for shard in range(4):
        batches = list(corpus.open(shard, seed=0))
        # about 1/num_shards of a pass: 4 * (3800 - 16) offsets / (4 shards * 16 * 8)
        assert len(batches) == 4 * (3800 - 16) // (4 * 16 * 8)
        seen = torch.cat([torch.cat([x, y], dim=1) for x, y in batches]).unique().tolist()
        assert set(seen) == {0, 1, 2, 3}, seen  # all regions, no held-out byte (>= 100)
        for x, y in batches:
            assert x.shape == y.shape == (8, 16)


def test_a_shard_replays_for_its_seed_and_differs_across_shards(tmp_path):
    path = tmp_path / "d.txt"
    path.write_bytes(bytes(range(256)) * 64)
    corpus = ByteCorpus((str(path),), seq_len=8, batch_size=4, num_shards=8, regions=2)
    first = [x for x, _ in corpus.open(3, seed=1)]
    again = [x for x, _ in corpus.open(3, seed=1)]
    other = [x for x, _ in corpus.open(4, seed=1)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    for x in first:  # windows are contiguous bytes of the file
        assert torch.equal((x[:, 1:] - x[:, :-1]) % 256, torch.ones_like(x[:, 1:]))
