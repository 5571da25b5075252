"""``moshray.data.from_torch``: a torch ``Dataset`` or ``DataLoader`` as a job's data, for
both replica kinds, without a cluster. Shards are disjoint index ranges that together hold
every sample once (the shard ledger hands each shard out once per data epoch: no sample is
read twice in an epoch), read through torch's ``DataLoader`` with the user's settings; the
replica-group form (``by_step``) walks a permutation per epoch. Bad input is one line."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.utils.data as tud

from moshray.actors.errors import UserError
from moshray.actors.replica.data_sources import (StepBatches, TorchSource, as_source, by_step,
                                                 from_torch)


class Stream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(3))


class Numbers(tud.Dataset):
    """Sample i is (tensor([i]), i % 3)."""

    def __init__(self, n: int = 103):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), i % 3


BUILT: list[int] = []


def factory() -> Numbers:
    BUILT.append(1)
    return Numbers(30)


def _ids(batches) -> list[int]:
    return [int(v) for x, _ in batches for v in x[:, 0]]


def test_shards_hold_every_sample_once_and_read_through_a_dataloader():
    source = from_torch(Numbers(), batch_size=8, num_shards=5)
    assert isinstance(source, TorchSource) and source.num_shards == 5
    seen = []
    for shard in range(5):
        batches = list(source.open(shard, seed=0))
        assert all(len(x) <= 8 for x, _ in batches) and isinstance(batches[0][1], torch.Tensor)
        start, stop = source.bounds(shard)
        assert sorted(_ids(batches)) == list(range(start, stop))
        seen += _ids(batches)
    assert sorted(seen) == list(range(103))  # one data epoch: each sample once
    # the seed (the data epoch) reorders a shard; the same seed, the same order
    assert _ids(source.open(2, seed=1)) != _ids(source.open(2, seed=2))
    assert _ids(source.open(2, seed=1)) == _ids(source.open(2, seed=1))
    plain = from_torch(Numbers(), batch_size=8, num_shards=5, shuffle=False)
    assert _ids(plain.open(1, seed=7)) == list(range(*plain.bounds(1)))


def test_a_dataloader_a_factory_and_the_users_loader_settings():
    def collate(items):
        return torch.stack([x for x, _ in items]) * 10, torch.tensor([y for _, y in items])

    loader = tud.DataLoader(Numbers(20), batch_size=4, collate_fn=collate)
    source = as_source(loader)  # what moshray.fit(loop, loader) makes of it
    assert (source.batch_size, source.size, source.num_shards) == (4, 20, 5)  # whole batches
    x, _ = next(source.open(3, seed=0))
    assert len(x) == 4 and float(x.min()) == 120.0  # the user's collate_fn ran (x 10)
    BUILT.clear()
    lazy = from_torch(factory, batch_size=5, num_shards=3, size=30)
    assert BUILT == []  # size given: nothing built on the driver
    travelled = pickle.loads(pickle.dumps(lazy))  # (the job spec travels so)
    assert sorted(_ids(travelled.open(0, seed=0)) + _ids(travelled.open(1, seed=0))
                  + _ids(travelled.open(2, seed=0))) == list(range(30))
    assert BUILT == [1]  # built once where it is read
    assert "_built_dataset" not in pickle.loads(pickle.dumps(travelled)).__dict__
    assert as_source(Numbers(10), batch_size=2).num_shards == 5


def test_replica_groups_walk_a_permutation_per_epoch():
    source = from_torch(Numbers(10), batch_size=4)
    steps = by_step(source)
    assert isinstance(steps, StepBatches)
    walk = [int(v) for s in range(5) for v in steps(s)[0][:, 0]]  # 20 samples: 2 epochs
    assert sorted(walk[:10]) == list(range(10)) and sorted(walk[10:]) == list(range(10))
    assert walk[:10] != walk[10:]  # each epoch its own order
    assert [int(v) for v in steps(1)[0][:, 0]] == walk[4:8]  # the same on every rank


@pytest.mark.parametrize("data,kwargs,needle", [
    (Stream(), {}, "IterableDataset cannot be split"),
    (Numbers(), {"shuffle_buffer": 4}, "unknown DataLoader setting"),
    (Numbers(0), {}, "at least one sample"),
    (Numbers(5), {"num_shards": 6}, "num_shards must be in [1, 5]"),
    (object(), {}, "expected a torch Dataset"),
], ids=["iterable", "setting", "empty", "shards", "other"])
def test_bad_input_is_one_line(data, kwargs, needle):
    with pytest.raises(UserError) as err:
        from_torch(data, batch_size=4, **kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_group_job_takes_a_torch_source():
    from moshray.jobs.fit import _group_job

    task = _group_job(lambda session: None, from_torch(Numbers(12), 6))
    assert task is not None
    with pytest.raises(UserError, match="from_torch"):
        _group_job(lambda session: None, [1, 2, 3])
