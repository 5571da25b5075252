"""Sharded checkpoints and placement of a replica group, on CPU
ranks over gloo: a checkpoint written by 2 FSDP2 ranks resumes on 3 ranks, on 1 rank and on
2 DDP ranks with the same unsharded parameters, and one more step from there equals a single
process that never stopped (so the optimizer state came back too); a checkpoint that does not
fit the model is refused naming the first difference. A group's ranks share one node through
a STRICT_PACK placement group that close() removes; a group no node can hold fails within
its timeout naming the resources. Also the pure parts (manifest, comparisons, bundles)."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from moshray.actors.replica.group import ReplicaGroup
from moshray.actors.replica.group_spec import (
    GroupConfig, GroupError, placement_shortfall, rank_bundles, reference_train,
)
from moshray.actors.replica.group_checkpoint import (
    MANIFEST, CheckpointError, CheckpointManifest, first_difference, staging_path, torn_file,
)
from moshray.jobs.examples.lm.tasks import lm_task

# Parameter dims (16, 32, 64, 256) do not divide by 3: FSDP2 shards dim 0 unevenly (padded)
# and DCP reshards such shards as well; rows=6 divides among 1, 2 and 3 ranks.
MODEL = {"seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64}
ROWS, SAVED_AT = 6, 3


def task(steps: int, model: dict = MODEL):
    return lm_task(model, steps=steps, rows=ROWS, amp=False, lr=3e-3)


# -- pure parts -----------------------------------------------------------------------------

def manifest(state, optimizer="adamw", files=()):
    return CheckpointManifest(3, 2, "fsdp", optimizer, tuple(state), tuple(files))


def test_the_first_difference_between_checkpoint_and_model_is_named_in_one_line():
    saved = manifest([("emb.weight", (256, 32)), ("head.bias", (256,))])
    assert first_difference(saved, (("emb.weight", (256, 32)), ("head.bias", (256,))),
                            "adamw") is None
    assert first_difference(saved, (("emb.weight", (256, 48)), ("head.bias", (9,))),
                            "adamw") == ("'emb.weight' has shape (256, 32) in the checkpoint, "
                                         "(256, 48) in the model")
    assert first_difference(saved, (("emb.weight", (256, 32)),), "adamw") == \
        "'head.bias' is in the checkpoint, not in the model"
    assert first_difference(saved, saved.state + (("extra", (1,)),), "adamw") == \
        "'extra' is in the model, not in the checkpoint"
    assert first_difference(saved, saved.state, "sgd") == \
        "optimizer: the checkpoint has adamw, the task sgd"


def test_the_manifest_round_trips_and_a_torn_or_foreign_one_is_refused():
    saved = manifest([("w", (4, 2))], files=[("__0_0.distcp", 10, "a" * 64),
                                              (".metadata", 5, "b" * 64)])
    assert CheckpointManifest.from_json(saved.to_json()) == saved
    with pytest.raises(CheckpointError, match="^ck: format 'other' version 1, expected"):
        CheckpointManifest.from_json('{"format": "other", "version": 1}', "ck")
    with pytest.raises(CheckpointError, match="^ck: unreadable manifest"):
        CheckpointManifest.from_json("{", "ck")
    assert torn_file(saved, {"__0_0.distcp": 10, ".metadata": 5, "x": 1}) is None
    assert torn_file(saved, {"__0_0.distcp": 10}) == "file .metadata is missing"
    assert torn_file(saved, {"__0_0.distcp": 7, ".metadata": 5}) == \
        "file __0_0.distcp has 7 bytes, the manifest says 10"
    assert staging_path("/ck/step-3/", "ab12") == "/ck/step-3.partial-ab12"


def test_bundles_and_the_placement_shortfall_name_the_resources():
    assert rank_bundles(GroupConfig(world_size=2, cpus_per_rank=3)) == ({"CPU": 3.0},) * 2
    assert rank_bundles(GroupConfig(world_size=1, gpus_per_rank=0.5, cpus_per_rank=0)) == \
        ({"GPU": 0.5},)
    bundles = ({"CPU": 3.0, "GPU": 1.0},) * 2
    nodes = [{"CPU": 4.0, "memory": 1e9}, {"CPU": 1.0, "GPU": 1.0}]
    assert placement_shortfall(bundles, nodes) == (
        "needs CPU=6 GPU=2 on one node (2 ranks of CPU=3 GPU=1, STRICT_PACK); no node has "
        "that (the most on one node: CPU=4 GPU=1)")
    assert placement_shortfall(({"CPU": 1.0},) * 2, nodes, (("zone", "a"),)) == (
        "needs CPU=2 on one node (2 ranks of CPU=1, STRICT_PACK); 1 node(s) are big enough "
        "but have it in use or lack the labels zone=a")
    assert GroupConfig(node_labels={"b": "2", "a": "1"}).node_labels == (("a", "1"), ("b", "2"))
    with pytest.raises(ValueError, match="a rank must ask for some CPU or GPU"):
        GroupConfig(cpus_per_rank=0)


# -- a real group on the session's local Ray ------------------------------------------------

@pytest.fixture(scope="module")
def ray_local(local_cluster):
    """The session's cluster (conftest.py): its driver connection is the process's only one."""
    import ray

    local_cluster.connect()
    return ray


@pytest.fixture(scope="module")
def checkpoint(ray_local, tmp_path_factory):
    """A checkpoint at step 3 written by 2 FSDP2 ranks: (path, unsharded parameters)."""
    path = str(tmp_path_factory.mktemp("ckpt") / "step-3")
    group = ReplicaGroup(GroupConfig(world_size=2, parallel="fsdp", timeout_s=120.0,
                                     name="writer"))
    try:
        group.start()
        group.train(task(SAVED_AT))
        saved = group.full_state()
        assert group.save_sharded(path) == SAVED_AT
        with pytest.raises(GroupError, match=r"save_sharded: .*step-3: exists; not replaced$"):
            group.save_sharded(path)  # refused before any rank writes; the group stays sound
        assert not group.broken
    finally:
        group.close()
    return path, saved


@pytest.mark.cluster
def test_the_checkpoint_appears_whole_with_one_shard_per_rank(checkpoint):
    path, _ = checkpoint
    assert set(os.listdir(path)) == {".metadata", MANIFEST, "__0_0.distcp", "__1_0.distcp"}
    parent = os.path.dirname(path)
    assert [f for f in os.listdir(parent) if ".partial-" in f] == []  # renamed, not copied
    with open(os.path.join(path, MANIFEST)) as f:
        saved = CheckpointManifest.from_json(f.read())
    assert (saved.step, saved.world_size, saved.parallel) == (SAVED_AT, 2, "fsdp")


@pytest.mark.cluster
@pytest.mark.parametrize("world, parallel", [(3, "fsdp"), (1, "fsdp"), (2, "ddp")])
def test_a_checkpoint_of_two_fsdp_ranks_resumes_on_another_group(ray_local, checkpoint,
                                                                 world, parallel):
    path, saved = checkpoint
    ref_losses, ref_state = reference_train(task(SAVED_AT + 1))  # one process, never stopped
    group = ReplicaGroup(GroupConfig(world_size=world, parallel=parallel, timeout_s=120.0,
                                     name=f"reader{world}{parallel}"))
    try:
        group.start()
        assert group.load_sharded(path, task(1)) == SAVED_AT
        loaded = group.full_state()
        report = group.train(task(1))  # step 3: needs AdamW's moments and step count back
        after = group.full_state()
    finally:
        group.close()
    assert set(loaded) == set(saved)
    for name, value in saved.items():  # the unsharded parameters, bitwise
        assert torch.equal(loaded[name], value), name
    assert report.consistent
    assert report.losses == pytest.approx(ref_losses[SAVED_AT:], rel=1e-4)
    for name, value in ref_state.items():
        torch.testing.assert_close(after[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.cluster
def test_a_checkpoint_that_does_not_fit_is_refused_naming_the_first_difference(ray_local,
                                                                              checkpoint,
                                                                              tmp_path):
    path, _ = checkpoint
    wider = dict(MODEL, d_ff=96)
    group = ReplicaGroup(GroupConfig(world_size=1, parallel="fsdp", timeout_s=60.0,
                                     name="misfit"))
    try:
        group.start()
        with pytest.raises(GroupError, match=r"^group misfit: load_sharded: .*step-3 does not "
                           r"fit the model: '[\w.]+' has shape \(64, 32\) in the checkpoint, "
                           r"\(96, 32\) in the model$"):
            group.load_sharded(path, task(1, wider))
        with pytest.raises(GroupError, match=r"load_sharded: .*nowhere: no such directory$"):
            group.load_sharded(str(tmp_path / "nowhere"), task(1))
        (tmp_path / "half").mkdir()
        with pytest.raises(GroupError, match=r"half: no moshray.json, not a whole group"):
            group.load_sharded(str(tmp_path / "half"), task(1))
        torn = tmp_path / "torn"
        shutil.copytree(path, torn)
        (torn / "__1_0.distcp").unlink()
        with pytest.raises(GroupError, match=r"torn: torn checkpoint: file __1_0.distcp is "
                           r"missing$"):
            group.load_sharded(str(torn), task(1))
        assert not group.broken and group.step is None  # refused on the ranks, nothing loaded
        assert group.load_sharded(path, task(1)) == SAVED_AT  # the same group still loads
    finally:
        group.close()


@pytest.mark.cluster
def test_a_group_lands_on_one_node_and_close_removes_its_placement_group(ray_local):
    from ray.util.placement_group import placement_group_table

    group = ReplicaGroup(GroupConfig(world_size=2, parallel="ddp", timeout_s=60.0,
                                     name="packed"))
    try:
        described = group.start()
        placement = group.placement
        assert placement_group_table(placement)["state"] == "CREATED"
        assert placement_group_table(placement)["strategy"] == "STRICT_PACK"
    finally:
        group.close()
    assert len({d["node"] for d in described}) == 1
    assert group.placement is None
    assert placement_group_table(placement)["state"] == "REMOVED"

    # pinned by node label: the ranks go to the node named, whichever the packer would pick
    alive = [n["NodeID"] for n in ray_local.nodes()
             if n["Alive"] and n["Resources"].get("CPU", 0) >= 2]
    target = alive[-1]
    group = ReplicaGroup(GroupConfig(world_size=2, parallel="ddp", timeout_s=60.0,
                                     name="pinned", node_labels={"ray.io/node-id": target}))
    try:
        described = group.start()
    finally:
        group.close()
    assert {d["node"] for d in described} == {target}


@pytest.mark.cluster
def test_a_group_no_node_can_hold_fails_within_its_timeout_naming_the_resources(ray_local):
    from ray.util.placement_group import placement_group_table

    group = ReplicaGroup(GroupConfig(world_size=2, cpus_per_rank=3, timeout_s=5.0,
                                     name="toobig"))  # 6 CPUs; the nodes have 4 each
    t0 = time.monotonic()
    try:
        with pytest.raises(GroupError, match=r"^group toobig: not placed within 5 s: needs "
                           r"CPU=6 on one node \(2 ranks of CPU=3, STRICT_PACK\); no node has "
                           r"that \(the most on one node: CPU=4\)$"):
            group.start()
    finally:
        group.close()
    assert time.monotonic() - t0 < 5.0 + 10.0
    assert group.placement is None and group.ranks == []
    left = [pg for pg in placement_group_table().values()
            if pg["name"].startswith("moshray-group-toobig-") and pg["state"] != "REMOVED"]
    assert left == []


@pytest.mark.cluster
def test_a_checkpoint_on_object_storage_is_committed_by_its_manifest_and_resumes(
        local_cluster, s3_endpoint):
    """``path`` on S3 (moto's server): the ranks stage on their node, rank 0 uploads the
    shards and writes the manifest last; a second group on another layout loads it back
    (fetched to its node first), bitwise; a save to a taken location and a torn copy are
    refused in one line. The raylet is started after the server, so it and its workers
    hold the server's credentials, as a cloud node holds its instance role."""
    from cluster_slots import extra_slots
    from moto_s3 import s3_client, s3_uri

    from moshray.actors.replica.group_checkpoint import exists, newest, read_manifest
    from moshray.cluster.placement import SLOT_LABEL

    slot = 9
    base = s3_uri(s3_endpoint, "groups-run")
    path = s3_uri(s3_endpoint, "groups-run/step-00000003")
    with extra_slots(local_cluster, (slot,)):
        on_slot = {SLOT_LABEL: str(slot)}
        writer = ReplicaGroup(GroupConfig(world_size=2, parallel="fsdp", timeout_s=120.0,
                                          name="s3writer", node_labels=on_slot))
        try:
            writer.start()
            writer.train(task(SAVED_AT))
            saved = writer.full_state()
            assert writer.save_sharded(path) == SAVED_AT
            with pytest.raises(GroupError, match=r"step-00000003\?.*: exists; not replaced$"):
                writer.save_sharded(path)
        finally:
            writer.close()
        s3 = s3_client(s3_endpoint)
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket="ckpt", Prefix="groups-run/")[
            "Contents"] if not o["Key"].endswith("/")}  # (pyarrow's directory markers aside)
        assert keys == {f"groups-run/step-00000003/{name}" for name in
                        (".metadata", MANIFEST, "__0_0.distcp", "__1_0.distcp")}
        assert exists(path) and newest(base) == path
        assert read_manifest(path).world_size == 2
        reader = ReplicaGroup(GroupConfig(world_size=1, parallel="fsdp", timeout_s=120.0,
                                          name="s3reader", node_labels=on_slot))
        try:
            reader.start()
            assert reader.load_sharded(path, task(1)) == SAVED_AT
            loaded = reader.full_state()
            s3.delete_object(Bucket="ckpt", Key="groups-run/step-00000003/__1_0.distcp")
            with pytest.raises(GroupError, match=r"torn checkpoint: file __1_0.distcp is "
                               r"missing$"):
                reader.load_sharded(path, task(1))
            assert not reader.broken
        finally:
            reader.close()
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
    assert newest(base) is None  # the torn one is passed over
