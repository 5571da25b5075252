"""The files of a group checkpoint load no code, in one process (DCP without a process
group; the multi-rank resharding is in test_group_checkpoint.py): a model and its optimizer
round-trip through the JSON index and weights-only reads, types and all; the manifest names
each file with its sha256 and a load checks them before reading anything; a pickle planted
as the index or a shard is refused in one line and never runs, whether its hash gives it
away or the manifest was rewritten to match; an older moshray's manifest is refused saying
what to do; a checkpoint on object storage (moto's S3) is uploaded, fetched and checked the
same way."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import warnings

import pytest
import torch

from moshray.actors.replica.group_checkpoint import (
    INDEX, MANIFEST, CheckpointError, CheckpointManifest, OlderCheckpointError, fetch,
    load_state, local_staging, newest, read_manifest, save_state, staging_path, verify_files,
)

from moshray.actors.replica.group_checkpoint_storage import index_from_json, index_to_json

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Planted:
    """What an attacker plants: unpickling it calls ``os.mkdir(marker)`` (any code could
    run there instead)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def build(optimizer: str = "adamw"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
           if optimizer == "adamw" else torch.optim.SGD(model.parameters(), lr=0.1,
                                                        momentum=0.9))
    return model, opt


def trained(optimizer: str = "adamw"):
    model, opt = build(optimizer)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(torch.randn(4, 5, generator=g)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def save(model, opt, final: str, optimizer: str = "adamw") -> str:
    head = CheckpointManifest(2, 1, "ddp", optimizer, ())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert save_state(model, opt, staging_path(final, "ab12") if "://" not in final
                          else local_staging("ab12"), final, head, rank=0) is None
    return final


def rewrite(path: str, name: str, blob: bytes) -> None:
    """Replace ``name`` with ``blob`` and give the manifest its size and sha256: what an
    attacker who can write the bucket can also do."""
    with open(os.path.join(path, name), "wb") as f:
        f.write(blob)
    with open(os.path.join(path, MANIFEST)) as f:
        d = json.load(f)
    d["files"] = [[f, len(blob), hashlib.sha256(blob).hexdigest()] if f == name else [f, n, h]
                  for f, n, h in d["files"]]
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(d, f)


def load(path: str, optimizer: str = "adamw"):
    model, opt = build(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manifest = read_manifest(path)
        verify_files(path, manifest)
        load_state(model, opt, path, manifest)
    return model, opt


def assert_same(a, b):
    (ma, oa), (mb, ob) = a, b
    for (name, x), (_, y) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert torch.equal(x, y), name
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]  # the betas stay a tuple, lr a float
    for p, state in sa["state"].items():
        for key, value in state.items():
            assert torch.equal(value, sb["state"][p][key]), (p, key)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_model_and_optimizer_round_trip_through_a_json_index_and_hashed_files(tmp_path,
                                                                              optimizer):
    saved = trained(optimizer)
    path = save(*saved, str(tmp_path / "step-2"), optimizer)
    assert sorted(os.listdir(path)) == [INDEX, "__0_0.distcp", MANIFEST]
    with open(os.path.join(path, INDEX), "rb") as f:
        index = json.loads(f.read())  # JSON, not a pickle
    assert index["format"] == "moshray-dcp-index"
    assert index["entries"]["optim.param_groups.0.lr"] == {"bytes": True}
    manifest = read_manifest(path)
    decoded = index_from_json(json.dumps(index).encode(), manifest.shards, path)
    assert json.loads(index_to_json(decoded)) == index
    for name, size, digest in manifest.files:
        with open(os.path.join(path, name), "rb") as f:
            blob = f.read()
        assert (len(blob), hashlib.sha256(blob).hexdigest()) == (size, digest)
    assert_same(load(path, optimizer), saved)


@pytest.mark.parametrize("name", [INDEX, "__0_0.distcp"])
def test_a_planted_pickle_is_refused_by_its_hash_and_never_runs(tmp_path, name):
    path = save(*trained(), str(tmp_path / "step-2"))
    marker = tmp_path / "ran"
    size = os.path.getsize(os.path.join(path, name))
    blob = pickle.dumps(Planted(str(marker)))
    with open(os.path.join(path, name), "wb") as f:  # padded: pickle ignores what follows
        f.write(blob + b" " * (size - len(blob)))
    with pytest.raises(CheckpointError, match=rf"^{path}: file {name}: sha256 differs from "
                       r"the manifest \(corrupt or replaced\); not loaded$"):
        load(path)
    assert not marker.exists()


def test_a_pickled_index_is_refused_unread_even_with_a_manifest_that_matches(tmp_path):
    path = save(*trained(), str(tmp_path / "step-2"))
    marker = tmp_path / "ran"
    rewrite(path, INDEX, pickle.dumps(Planted(str(marker))))
    manifest = read_manifest(path)
    with pytest.raises(CheckpointError, match=rf"^{path}: \.metadata refused, not a group "
                       r"checkpoint index: not JSON$"):
        verify_files(path, manifest)
    model, opt = build()
    with pytest.raises(CheckpointError, match=r"\.metadata refused, not a group checkpoint "
                       r"index: not JSON"):  # each rank's reader decodes it the same way
        load_state(model, opt, path, manifest)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["tensor", "bytes"])
def test_a_planted_shard_entry_is_refused_by_the_weights_only_loader_and_never_runs(
        tmp_path, kind):
    """The manifest and the index rewritten to match a pickle appended to the shard: every
    entry of ``kind`` (a tensor chunk, or a non-tensor value) points at it."""
    path = save(*trained(), str(tmp_path / "step-2"))
    marker, control = tmp_path / "ran", tmp_path / "control"
    planted = io.BytesIO()
    torch.save(Planted(str(marker)), planted)  # DCP's own encoding of an entry
    with open(os.path.join(path, INDEX)) as f:
        index = json.load(f)
    shard = os.path.join(path, "__0_0.distcp")
    with open(shard, "rb") as f:
        blob = f.read()
    for entry in index["storage"]:
        if ("bytes" in index["entries"][entry[0]]) == (kind == "bytes"):
            entry[4:6] = [len(blob), len(planted.getvalue())]
    rewrite(path, "__0_0.distcp", blob + planted.getvalue())
    rewrite(path, INDEX, json.dumps(index).encode())
    with pytest.raises(CheckpointError, match=rf"^{path}: .*refused by the weights-only "
                       r"loader \(UnpicklingError: "):
        load(path)  # the hashes match: only the loader stands in the way
    assert not marker.exists()
    # the same payload does run under a full unpickle, as DCP's own planner reads bytes
    twin = io.BytesIO()
    torch.save(Planted(str(control)), twin)
    twin.seek(0)
    torch.load(twin, weights_only=False)
    assert control.is_dir()


def test_a_manifest_naming_an_unexpected_file_is_refused(tmp_path):
    ok = [[INDEX, 5, "b" * 64], ["__0_0.distcp", 10, "a" * 64]]
    base = {"format": "moshray-group-checkpoint", "version": 2, "step": 3, "world_size": 2,
            "parallel": "fsdp", "optimizer": "adamw", "state": [["w", [4, 2]]]}

    def refused(files):
        with pytest.raises(CheckpointError) as err:
            CheckpointManifest.from_json(json.dumps(dict(base, files=files)), "ck")
        assert "\n" not in str(err.value)
        return str(err.value)

    assert CheckpointManifest.from_json(json.dumps(dict(base, files=ok))).files[0][0] == INDEX
    assert refused(ok + [["../run.py", 1, "c" * 64]]) == (
        "ck: refused: the manifest names '../run.py', not a file of a group checkpoint of 2 "
        "ranks")
    assert "names '__2_0.distcp', not a file" in refused(ok + [["__2_0.distcp", 1, "c" * 64]])
    assert "names 'x.pkl', not a file" in refused(ok + [["x.pkl", 1, "c" * 64]])
    assert refused(ok + [ok[1]]) == "ck: refused: the manifest names __0_0.distcp twice"
    assert refused(ok[1:]) == "ck: refused: the manifest names no .metadata"
    assert "sha256 'nope'" in refused([ok[0], ["__0_0.distcp", 10, "nope"]])
    assert refused([[INDEX, 5]]).startswith("ck: unreadable manifest (ValueError")


def test_an_older_manifest_is_refused_saying_what_to_do_and_newest_does_not_pass_it_over(
        tmp_path):
    path = tmp_path / "groups" / "step-00000003"
    path.mkdir(parents=True)
    (path / INDEX).write_bytes(pickle.dumps({"an": "older index"}))
    (path / MANIFEST).write_text(json.dumps({
        "format": "moshray-group-checkpoint", "version": 1, "step": 3, "world_size": 1,
        "parallel": "ddp", "optimizer": "adamw", "state": [],
        "files": [[INDEX, (path / INDEX).stat().st_size]]}))
    message = (rf"^{path}: written by an older moshray \(manifest version 1, no hashes, its "
               r"\.metadata a pickle\), which this version does not load; start fresh "
               r"\(another checkpoint location or run id\) or remove it$")
    with pytest.raises(OlderCheckpointError, match=message):
        read_manifest(str(path))
    with pytest.raises(OlderCheckpointError, match=message):
        newest(str(tmp_path / "groups"))  # a job would otherwise start afresh beside it


def test_the_index_places_chunks_only_in_the_manifests_shards_within_their_sizes(tmp_path):
    path = save(*trained(), str(tmp_path / "step-2"))
    with open(os.path.join(path, INDEX)) as f:
        good = json.load(f)

    def refused(change) -> str:
        index = json.loads(json.dumps(good))
        change(index)
        rewrite(path, INDEX, json.dumps(index).encode())
        with pytest.raises(CheckpointError) as err:
            verify_files(path, read_manifest(path))
        return str(err.value).removeprefix(f"{path}: .metadata refused, not a group "
                                           f"checkpoint index: ")

    size = os.path.getsize(os.path.join(path, "__0_0.distcp"))
    first = good["storage"][0][0]
    assert refused(lambda d: d["storage"][0].__setitem__(3, "../moshray.json")) == \
        f"{first!r} is in '../moshray.json', not a shard file of the manifest"
    assert refused(lambda d: d["storage"][0].__setitem__(4, size)).startswith(
        f"{first!r} ends at byte {size + good['storage'][0][5]} of __0_0.distcp, which has")
    assert refused(lambda d: d["entries"]["model.0.weight"].__setitem__("dtype", "object")) \
        == "'model.0.weight': unknown dtype 'object'"
    assert refused(lambda d: d.__setitem__("version", 9)) == \
        "format 'moshray-dcp-index' version 9, expected 'moshray-dcp-index' 1"


def test_a_checkpoint_on_object_storage_is_uploaded_fetched_and_checked(tmp_path,
                                                                         s3_endpoint):
    from moto_s3 import s3_client, s3_uri

    saved = trained()
    uri = save(*saved, s3_uri(s3_endpoint, "format/step-00000002"))
    s3 = s3_client(s3_endpoint)
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="ckpt", Prefix="format/step-")[
        "Contents"] if not o["Key"].endswith("/")}
    assert keys == {f"format/step-00000002/{n}" for n in (INDEX, MANIFEST, "__0_0.distcp")}
    manifest = read_manifest(uri)
    local = fetch(uri, str(tmp_path / "copy"), manifest)
    assert sorted(os.listdir(local)) == [INDEX, "__0_0.distcp"]
    model, opt = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_state(model, opt, local, manifest)
    assert_same((model, opt), saved)

    marker = tmp_path / "ran"  # a pickle of the index's size in its place
    blob = pickle.dumps(Planted(str(marker)))
    size = dict((n, s) for n, s, _ in manifest.files)[INDEX]
    s3.put_object(Bucket="ckpt", Key=f"format/step-00000002/{INDEX}",
                  Body=blob + b" " * (size - len(blob)))
    with pytest.raises(CheckpointError, match=r"^s3://.*step-00000002\?.*: file \.metadata: "
                       r"sha256 differs from the manifest \(corrupt or replaced\); not "
                       r"loaded$"):
        fetch(uri, str(tmp_path / "again"), read_manifest(uri))
    assert not (tmp_path / "again").exists() and not marker.exists()
