"""A replica group (actors/replica/group.py) on CPU: 2 Ray actors joined in a gloo process
group train the example LM with FSDP2 and with DDP; the loss decreases, every rank holds the
same unsharded parameters, and those equal a single-process run on the whole batches. Also
the group's pure decisions (backend, batch slices, configuration errors)."""

from __future__ import annotations


import pytest
import torch

from moshray.actors.replica.group import ReplicaGroup
from moshray.actors.replica.group_spec import (
    GroupConfig, GroupError, GroupTask, choose_backend, digest, rank_slice, reference_train,
)
from moshray.jobs.examples.lm.tasks import lm_task

MODEL = {"seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64}


# -- pure decisions -----------------------------------------------------------------------------

def test_backend_is_nccl_only_for_ranks_with_a_gpu_each():
    assert choose_backend("auto", ["cpu", "cpu"], [(), ()]) == "gloo"
    assert choose_backend("auto", ["cuda:0", "cuda:0"], [("0",), ("1",)]) == "nccl"
    # two ranks on one GPU (fractional GPUs): NCCL refuses that, gloo it is
    assert choose_backend("auto", ["cuda:0", "cuda:0"], [("0",), ("0",)]) == "gloo"
    assert choose_backend("gloo", ["cuda:0", "cuda:0"], [("0",), ("1",)]) == "gloo"
    with pytest.raises(ValueError, match="nccl needs one GPU of its own per rank"):
        choose_backend("nccl", ["cuda:0", "cuda:0"], [("0",), ("0",)])
    with pytest.raises(ValueError, match="nccl needs one GPU"):
        choose_backend("nccl", ["cpu", "cpu"], [(), ()])
    # FSDP2 over gloo on CUDA ranks crashed the rank (SIGSEGV on an H200): refused up front
    assert choose_backend("auto", ["cpu", "cpu"], [(), ()], "fsdp") == "gloo"
    assert choose_backend("auto", ["cuda:0", "cuda:0"], [("0",), ("1",)], "fsdp") == "nccl"
    with pytest.raises(ValueError, match="fsdp on CUDA ranks needs nccl"):
        choose_backend("auto", ["cuda:0", "cuda:0"], [("0",), ("0",)], "fsdp")


def test_ranks_get_contiguous_equal_slices_of_the_global_batch():
    x = torch.arange(12).reshape(6, 2)
    parts = [rank_slice((x,), r, 3)[0] for r in range(3)]
    assert torch.equal(torch.cat(parts), x) and all(p.shape == (2, 2) for p in parts)
    with pytest.raises(ValueError, match="5 rows do not divide among 2 ranks"):
        rank_slice((torch.zeros(5, 1),), 0, 2)


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="GroupConfig.parallel: use one of fsdp, ddp"):
        GroupConfig(parallel="zero3")
    with pytest.raises(ValueError, match="GroupConfig.world_size"):
        GroupConfig(world_size=0)
    with pytest.raises(ValueError, match="GroupConfig.gpus_per_rank"):
        GroupConfig(gpus_per_rank=2)
    with pytest.raises(ValueError, match="GroupTask.optimizer"):
        GroupTask(lambda: None, lambda s: (), lambda m, b: None, steps=1, optimizer="lamb")
    with pytest.raises(ValueError, match="GroupTask.steps"):
        GroupTask(lambda: None, lambda s: (), lambda m, b: None, steps=0)


def test_the_reference_run_is_deterministic_and_learns():
    task = lm_task(MODEL, steps=4, rows=8, amp=False, lr=3e-3)
    losses, state = reference_train(task)
    again, state2 = reference_train(task)
    assert losses == again and digest(state.values()) == digest(state2.values())
    assert losses[-1] < losses[0]


# -- a real group on a local Ray ---------------------------------------------------------------

@pytest.fixture
def ray_local(local_cluster):
    """The session's cluster (conftest.py): its driver connection is the process's only one."""
    import ray

    local_cluster.connect()
    return ray


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_a_group_of_two_cpu_ranks_trains_like_one_process(ray_local, parallel):
    task = lm_task(MODEL, steps=4, rows=8, amp=False, lr=3e-3)
    ref_losses, ref_state = reference_train(task)
    group = ReplicaGroup(GroupConfig(world_size=2, parallel=parallel, timeout_s=120.0,
                                     name=parallel))
    try:
        described = group.start()
        assert [d["rank"] for d in described] == [0, 1]
        assert {d["device"] for d in described} == {"cpu"} and group.backend == "gloo"
        report = group.train(task)
        full = group.full_state()
    finally:
        group.close()
    assert report.consistent  # the same losses and unsharded parameters on both ranks
    assert report.losses[-1] < report.losses[0]
    assert report.losses == pytest.approx(ref_losses, rel=1e-4)
    assert set(full) == set(ref_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(full[name], value, rtol=1e-4, atol=1e-5, msg=name)
    numel = sum(v.numel() for v in ref_state.values())
    shards = [r.shard_numel for r in report.ranks]
    if parallel == "fsdp":  # each rank holds about half; together the whole model
        assert sum(shards) >= numel and max(shards) < numel
        assert report.ranks[0].shard_checksum != report.ranks[1].shard_checksum
    else:  # DDP: every rank holds all of it, bitwise equal
        assert shards == [numel, numel]
        assert report.ranks[0].shard_checksum == report.ranks[1].shard_checksum


def test_a_rank_that_fails_raises_a_one_line_error_naming_it(ray_local):
    task = lm_task(MODEL, steps=1, rows=7, amp=False)  # 7 rows do not divide among 2 ranks
    group = ReplicaGroup(GroupConfig(world_size=2, parallel="ddp", timeout_s=60.0, name="bad"))
    try:
        group.start()
        with pytest.raises(GroupError, match="rank [01] failed in train: .*7 rows do not divide"):
            group.train(task)
        assert group.broken  # close() kills the ranks without asking them
    finally:
        group.close()
    assert group.ranks == [] and not group.broken
