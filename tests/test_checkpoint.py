"""Tests for moshray.actors.replica.checkpoint: weights-only loading, manifests, run
identity, retention, failed saves, and an S3 store on moto's server (127.0.0.1)."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import pickle
import time

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch
from moto_s3 import s3_uri

from moshray.actors.replica.checkpoint import (CheckpointStore, SaveResult, config_mismatch,
                                               fingerprint_mismatch, model_fingerprint,
                                               decode_state, encode_state, run_location)
from moshray.jobs.examples.lm.model import ModelConfig, build_model

TINY = ModelConfig(seq_len=8, d_model=16, n_layers=1, n_heads=2, d_ff=32)


def _state(step: int) -> dict:
    model = build_model(TINY, seed=step)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.loss(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
            "config": {"model": TINY.to_dict()}, "version": 1,
            "rng": {"numpy": np.random.get_state(), "torch": torch.get_rng_state()}}


def _files(path) -> list[str]:
    return sorted(os.listdir(path))


def test_round_trip_restores_tensors_and_numpy_rng_exactly(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpts"), run_id="run-a")
    state = _state(5)
    where = store.save(state, step=5)
    assert where.startswith(str(tmp_path / "ckpts" / "run-a" / "ckpt-000000005-"))
    assert where.endswith(".manifest.json")
    step, loaded = store.load_latest()
    assert step == 5 and loaded["step"] == 5 and loaded["config"] == {"model": TINY.to_dict()}
    for name, tensor in state["model"].items():
        assert torch.equal(loaded["model"][name], tensor), name
    assert loaded["optimizer"]["state"][0]["exp_avg"].device.type == "cpu"
    kind, keys, *rest = loaded["rng"]["numpy"]
    assert kind == "MT19937" and np.array_equal(keys, state["rng"]["numpy"][1])
    np.random.set_state(loaded["rng"]["numpy"])  # usable as numpy's own state
    build_model(TINY, seed=0).load_state_dict(loaded["model"])


def test_manifest_names_each_part_with_size_and_checksum(tmp_path):
    store = CheckpointStore(str(tmp_path), run_id="r", part_bytes=1000)
    where = store.save({"x": torch.arange(1000)}, step=12)
    manifest = json.loads(open(where).read())
    assert manifest["run_id"] == "r" and manifest["step"] == 12 and len(manifest["parts"]) > 2
    on_disk = _files(tmp_path / "r")
    assert on_disk == sorted([p["name"] for p in manifest["parts"]] + [os.path.basename(where)])
    assert all(os.path.getsize(tmp_path / "r" / p["name"]) == p["bytes"]
               for p in manifest["parts"])
    step, state = store.load_latest()
    assert step == 12 and torch.equal(state["x"], torch.arange(1000))


def test_a_payload_that_would_run_code_is_refused(tmp_path, caplog):
    """A checkpoint whose pickle builds an arbitrary object (here os.system) is not loaded,
    even with a matching manifest: the weights-only loader refuses it."""
    store = CheckpointStore(str(tmp_path), run_id="r")
    store.save({"step": 1}, 1)
    where = store.save({"step": 2}, 2)
    manifest = json.loads(open(where).read())
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    buf = io.BytesIO()
    torch.save({"step": 2, "evil": Evil()}, buf, pickle_module=pickle)
    blob = buf.getvalue()
    part = manifest["parts"][0]["name"]
    (tmp_path / "r" / part).write_bytes(blob)
    manifest["parts"] = [{"name": part, "bytes": len(blob),
                          "sha256": hashlib.sha256(blob).hexdigest()}]
    open(where, "w").write(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        assert store.load_latest() == (1, {"step": 1})
    assert not marker.exists()
    assert "weights-only loader" in caplog.text and os.path.basename(where) in caplog.text


def test_state_that_is_not_tensors_or_plain_types_is_refused_by_path():
    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"state\.extra\.thing is a Opaque"):
        encode_state({"extra": {"thing": Opaque()}})
    value = {"a": [np.float32(1.5), (np.arange(3, dtype=np.uint32),)]}
    back = decode_state(encode_state(value))
    assert back["a"][0] == 1.5 and back["a"][1][0].dtype == np.uint32


def test_two_runs_under_one_uri_never_see_each_other(tmp_path):
    a = CheckpointStore(str(tmp_path), run_id="job-a")
    b = CheckpointStore(str(tmp_path), run_id="job-b")
    a.save({"who": "a"}, 100)
    assert b.load_latest() is None and b.list_steps() == []
    b.save({"who": "b"}, 3)
    assert a.load_latest() == (100, {"who": "a"}) and b.load_latest() == (3, {"who": "b"})
    # adopting another run is explicit: its location names it
    uri, run_id = run_location(f"{tmp_path}/job-a")
    assert CheckpointStore(uri, run_id=run_id).load_latest() == (100, {"who": "a"})


def test_a_manifest_copied_from_another_run_is_not_trusted(tmp_path, caplog):
    a = CheckpointStore(str(tmp_path), run_id="job-a")
    b = CheckpointStore(str(tmp_path), run_id="job-b")
    where = a.save({"who": "a"}, 7)
    for name in _files(tmp_path / "job-a"):
        (tmp_path / "job-b" / name).write_bytes((tmp_path / "job-a" / name).read_bytes())
    with caplog.at_level(logging.WARNING):
        assert b.load_latest() is None
    assert "written by run 'job-a', this is run 'job-b'" in caplog.text
    assert os.path.basename(where) in caplog.text


def test_retention_keeps_by_write_time_and_never_drops_what_it_just_wrote(tmp_path):
    now = [1000.0]
    store = CheckpointStore(str(tmp_path), run_id="r", keep=2, clock=lambda: now[0])
    for step in (1, 2, 3):
        now[0] += 10
        store.save({"step": step}, step)
    assert store.list_steps() == [2, 3]
    # A newer-numbered checkpoint written earlier (an older run's numbering, resumed from a
    # lower step) does not push out the one just written.
    now[0] = 5000.0
    store.save({"step": 10}, 10)
    now[0] = 6000.0
    store.save({"step": 4}, 4)
    assert store.list_steps() == [4, 10]
    now[0] = 7000.0
    store.save({"step": 5}, 5)
    assert store.list_steps() == [4, 5]  # 10 was the oldest write
    assert store.load_latest() == (5, {"step": 5})
    assert len(_files(tmp_path / "r")) == 4  # two manifests, one part each


def test_foreign_and_torn_files_neither_count_nor_get_deleted(tmp_path):
    store = CheckpointStore(str(tmp_path), run_id="r", keep=1)
    torn = tmp_path / "r" / "ckpt-999999999-0123456789ab.manifest.json"
    torn.write_text('{"format": "moshray-checkpoint", "vers')
    (tmp_path / "r" / "notes.txt").write_text("mine")
    store.save({"step": 1}, 1)
    assert store.list_steps() == [1] and torn.exists() and (tmp_path / "r" / "notes.txt").exists()
    assert store.load_latest() == (1, {"step": 1})


def test_stale_temporaries_and_unnamed_parts_are_pruned_fresh_ones_kept(tmp_path):
    clock = [time.time()]
    store = CheckpointStore(str(tmp_path), run_id="r", stale_s=60, clock=lambda: clock[0])
    d = tmp_path / "r"
    (d / ".ckpt-000000009-0123456789ab.manifest.json.tmp-abc").write_bytes(b"half")
    (d / "ckpt-000000009-0123456789ab.part000").write_bytes(b"orphan")  # writer died
    store.save({"step": 1}, 1)
    assert len(_files(d)) == 4  # young leftovers may belong to a writer still at work
    clock[0] += 120
    store.save({"step": 2}, 2)
    assert not any(".tmp-" in n or n.startswith("ckpt-000000009") for n in _files(d))
    assert store.list_steps() == [1, 2]


def test_saving_the_same_step_twice_reads_the_newer_write(tmp_path):
    store = CheckpointStore(str(tmp_path), run_id="r")
    store.save({"v": "old"}, 4)
    store.save({"v": "new"}, 4)
    assert store.load_latest() == (4, {"v": "new"})


def _flip_last_byte(path) -> None:
    blob = bytearray(open(path, "rb").read())
    blob[-1] ^= 0xFF
    open(path, "wb").write(bytes(blob))


def _parts(where: str) -> list[str]:
    d = os.path.dirname(where)
    return [os.path.join(d, p["name"]) for p in json.loads(open(where).read())["parts"]]


@pytest.mark.parametrize("damage, reason", [
    (lambda p: _flip_last_byte(p), "checksum mismatch"),
    (lambda p: open(p, "r+b").truncate(5), "wrong length"),
    (lambda p: os.remove(p), "unreadable"),
])
def test_each_kind_of_damage_is_named_and_skipped(tmp_path, caplog, damage, reason):
    store = CheckpointStore(str(tmp_path), run_id="r")
    store.save({"step": 10}, 10)
    bad = store.save({"step": 20}, 20)
    damage(_parts(bad)[0])
    with caplog.at_level(logging.WARNING, logger="moshray.actors.replica.checkpoint"):
        assert store.load_latest() == (10, {"step": 10})
    [record] = caplog.records
    assert reason in record.getMessage() and bad in record.getMessage()


def test_empty_store_and_missing_directory_is_created(tmp_path):
    store = CheckpointStore(str(tmp_path / "a" / "b"), run_id="r")
    assert (tmp_path / "a" / "b" / "r").is_dir() and store.location.endswith("/a/b/r")
    assert store.list_steps() == [] and store.load_latest() is None


def test_file_uri_is_accepted(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}", run_id="r")
    store.save({"a": 1}, 3)
    assert CheckpointStore(str(tmp_path), run_id="r").load_latest() == (3, {"a": 1})


class _FullDisk(pafs.FileSystemHandler):
    """A local directory whose disk fills up after ``room`` bytes (ENOSPC on write)."""

    def __init__(self, room: int) -> None:
        self.local, self.room = pafs.LocalFileSystem(), room

    def __eq__(self, other): return self is other
    def __ne__(self, other): return self is not other
    def get_type_name(self): return "fulldisk"
    def normalize_path(self, path): return path
    def get_file_info(self, paths): return self.local.get_file_info(paths)
    def get_file_info_selector(self, s): return self.local.get_file_info(s)
    def create_dir(self, path, recursive): self.local.create_dir(path, recursive=recursive)
    def delete_dir(self, path): self.local.delete_dir(path)
    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)
    def delete_root_dir_contents(self): raise OSError("refused")
    def delete_file(self, path): self.local.delete_file(path)
    def move(self, src, dest): self.local.move(src, dest)
    def copy_file(self, src, dest): self.local.copy_file(src, dest)
    def open_input_stream(self, path): return self.local.open_input_stream(path)
    def open_input_file(self, path): return self.local.open_input_file(path)
    def open_append_stream(self, path, metadata): raise OSError("refused")

    def open_output_stream(self, path, metadata):
        handler = self

        class Out(io.RawIOBase):
            def __init__(self):
                self.f = open(path, "wb")

            def writable(self):
                return True

            def write(self, b):
                n = len(memoryview(b))
                if n > handler.room:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                handler.room -= n
                return self.f.write(b)

            def close(self):
                self.f.close()
                super().close()

        import pyarrow as pa
        return pa.PythonFile(Out(), mode="w")



def test_a_full_disk_is_a_typed_result_and_leaves_nothing_visible(tmp_path):
    handler = _FullDisk(room=10_000)
    fs = pafs.PyFileSystem(handler)
    store = CheckpointStore(str(tmp_path), run_id="r", filesystem=fs)
    assert store.try_save({"step": 1}, 1).ok
    result = store.try_save({"x": torch.zeros(100_000)}, 2)
    assert isinstance(result, SaveResult) and not result.ok and result.kind == "no_space"
    assert "No space left" in result.error and "step 2 not saved (no_space)" in str(result)
    assert store.load_latest() == (1, {"step": 1})
    assert all(n.startswith("ckpt-000000001-") for n in _files(tmp_path / "r"))
    assert pickle.loads(pickle.dumps(result)) == result  # crosses actor boundaries
    assert store.try_save({"bad": object()}, 3).kind == "state"


def test_config_mismatch_names_what_differs_in_one_line():
    stored = {"model": {**TINY.to_dict(), "moe_grid": (4, 4)}}
    same = {"model": {**TINY.to_dict(), "moe_grid": [4, 4], "dropout": 0.5}}
    assert config_mismatch(stored, same) is None  # dropout decides no shape
    other = {"model": {**TINY.to_dict(), "d_model": 32, "n_layers": 3, "moe_grid": [4, 4]}}
    line = config_mismatch(stored, other)
    assert "model.d_model 16 -> 32" in line and "model.n_layers 1 -> 3" in line
    assert "\n" not in line and "checkpoint.run_id" in line
    assert config_mismatch(None, other) is None and config_mismatch({}, other) is None


def test_the_manifest_records_the_models_fingerprint_and_differences_are_named(tmp_path):
    """A checkpoint's manifest records its model's tensors (name, shape, dtype; no values);
    ``fingerprint_mismatch`` names the first difference in one line."""
    model = {"emb.weight": torch.zeros(10, 4), "head.bias": torch.zeros(10, dtype=torch.bfloat16),
             "steps": torch.tensor(3)}
    CheckpointStore(str(tmp_path), run_id="fp").save({"model": model, "epoch": 1}, 1)
    manifest = json.loads(next((tmp_path / "fp").glob("*.manifest.json")).read_text())
    assert manifest["fingerprint"] == [["emb.weight", [10, 4], "float32"],
                                       ["head.bias", [10], "bfloat16"], ["steps", [], "int64"]]
    assert manifest["fingerprint"] == model_fingerprint(model)
    same = model_fingerprint({k: v.clone() for k, v in model.items()})
    assert fingerprint_mismatch(manifest["fingerprint"], same) is None
    wider = model_fingerprint({**model, "emb.weight": torch.zeros(10, 8)})
    assert fingerprint_mismatch(manifest["fingerprint"], wider) == (
        "'emb.weight' is [10, 4] float32 in the stored model but [10, 8] float32 in this one")
    extra = model_fingerprint({**model, "lora.a": torch.zeros(2)})
    assert fingerprint_mismatch(manifest["fingerprint"], extra) == (
        "'lora.a' is in this model but not in the stored one")
    # a state without a model dict records none
    CheckpointStore(str(tmp_path), run_id="plain").save({"x": 1}, 1)
    plain = json.loads(next((tmp_path / "plain").glob("*.manifest.json")).read_text())
    assert "fingerprint" not in plain


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(str(tmp_path), keep=0)
    with pytest.raises(ValueError, match="run id"):
        CheckpointStore(str(tmp_path), run_id="../escape")
    with pytest.raises(ValueError, match="run directory"):
        run_location("s3://bucket")
    store = CheckpointStore(str(tmp_path), run_id="r")
    with pytest.raises(TypeError, match="dict"):
        store.save([1, 2], 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step"):
        store.save({}, -1)


# --------------------------------------------------------------------------- S3 (moto)


def test_s3_store_writes_parts_then_the_manifest_and_never_moves(s3_endpoint):
    import boto3

    uri = s3_uri(s3_endpoint, "jobs")
    store = CheckpointStore(uri, run_id="run-1", keep=2, part_bytes=4096)
    state = _state(3)
    for step in (1, 2, 3):
        store.save(state if step == 3 else {"step": step}, step)
    s3 = boto3.client("s3", endpoint_url=f"http://{s3_endpoint}", region_name="us-east-1")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="ckpt", Prefix="jobs/")["Contents"]]
    keys = [k for k in keys if not k.endswith("/")]  # (directory markers)
    assert keys and all(k.startswith("jobs/run-1/ckpt-") for k in keys)
    assert not any(".tmp" in k for k in keys)
    manifests = [k for k in keys if k.endswith(".manifest.json")]
    assert len(manifests) == 2  # keep=2
    step, loaded = CheckpointStore(uri, run_id="run-1").load_latest()
    assert step == 3 and all(torch.equal(loaded["model"][k], v)
                             for k, v in state["model"].items())
    assert CheckpointStore(uri, run_id="run-2").load_latest() is None
    # A part lost from the bucket: that checkpoint is skipped, the older one read.
    newest = json.loads(s3.get_object(Bucket="ckpt", Key=max(
        manifests, key=lambda k: k.rsplit("/", 1)[1]))["Body"].read())
    s3.delete_object(Bucket="ckpt", Key=f"jobs/run-1/{newest['parts'][0]['name']}")
    assert CheckpointStore(uri, run_id="run-1").load_latest()[0] == 2


# --------------------------------------------------------------------------- resuming a job


def test_resume_point_takes_this_runs_checkpoint_or_an_adopted_one(tmp_path):
    from moshray.actors.replica.checkpoint import load_resumed, resume_point
    from moshray.cluster.messages import CheckpointRef
    from moshray.jobs.config import ConfigError, load_config

    config = load_config(None, {"checkpoint.uri": str(tmp_path), "run_dir": "runs/job-a"})
    mine = config.to_dict()
    assert resume_point(str(tmp_path), "job-a", None, mine) is None
    CheckpointStore(str(tmp_path), run_id="job-b").save({"config": mine, "who": "b"}, 8)
    assert resume_point(str(tmp_path), "job-a", None, mine) is None  # never another run's
    ref, where = resume_point(str(tmp_path), "job-a", "job-b", mine)  # adopted
    assert (ref, where) == (CheckpointRef(str(tmp_path), "job-b", 8), str(tmp_path / "job-b"))
    assert load_resumed(ref, mine)[1]["who"] == "b"  # what a replica reads from the ref
    ref, _ = resume_point("/elsewhere", "job-a", f"{tmp_path}/job-b", mine)
    assert load_resumed(ref, mine)[1]["who"] == "b"
    CheckpointStore(str(tmp_path), run_id="job-a").save({"config": mine, "who": "a"}, 3)
    ref, _ = resume_point(str(tmp_path), "job-a", "job-b", mine)  # own first
    assert ref == CheckpointRef(str(tmp_path), "job-a", 3)
    with pytest.raises(ConfigError, match="checkpoint.resume_from: no valid checkpoint"):
        resume_point(str(tmp_path), "job-c", "job-d", mine)
    wider = load_config(None, {"model.d_model": "512", "model.n_heads": "8"}).to_dict()
    with pytest.raises(ConfigError) as err:  # from the manifest: no state read
        resume_point(str(tmp_path), "job-a", None, wider)
    assert "model.d_model 256 -> 512" in str(err.value) and "\n" not in str(err.value)


def test_a_save_reports_its_bytes_as_they_move_and_its_size_and_time(tmp_path):
    """The progress a waiting driver bounds its wait by (``MoveBounds``): the size once the
    state is serialized, then the bytes written, in steps of at most ``WRITE_BYTES``."""
    from moshray.actors.replica.checkpoint import WRITE_BYTES

    store = CheckpointStore(str(tmp_path), run_id="r", part_bytes=3 * WRITE_BYTES)
    seen: list[tuple[int, int]] = []
    result = store.try_save({"w": torch.zeros(5 * WRITE_BYTES // 4)}, 1,
                            lambda done, total: seen.append((done, total)))
    total = seen[0][1]
    assert result.ok and result.bytes == total > 5 * WRITE_BYTES and result.seconds > 0
    assert seen[0] == (0, total) and seen[-1] == (total, total)
    assert all(b[0] - a[0] <= WRITE_BYTES for a, b in zip(seen, seen[1:]))
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and len(seen) >= 7


def test_the_driver_reads_only_manifests_to_resume(tmp_path):
    """The driver's memory must not grow with the model. ``resume_point`` reads
    the manifests (step and config) and the parts' sizes, never a part's bytes: it takes a
    checkpoint whose part holds other bytes of the right size (only a read could tell), and
    skips one whose part is missing; the replica's read (``load_resumed``) checks the
    checksums and falls back to the newest whole one."""
    from moshray.actors.replica.checkpoint import load_resumed, resume_point
    from moshray.jobs.config import load_config

    mine = load_config(None, {"checkpoint.uri": str(tmp_path)}).to_dict()
    store = CheckpointStore(str(tmp_path), run_id="big", part_bytes=64 * 1024)
    for step in (4, 9, 11):
        store.save({"config": mine, "w": torch.full((100_000,), float(step))}, step)
    manifest = json.loads(next((tmp_path / "big").glob("ckpt-000000004-*.manifest.json"))
                          .read_text())
    assert manifest["config"] == json.loads(json.dumps(mine)) and len(manifest["parts"]) == 7
    sorted((tmp_path / "big").glob("ckpt-000000011-*.part*"))[-1].unlink()  # 11: one missing
    first = sorted((tmp_path / "big").glob("ckpt-000000009-*.part*"))[0]
    first.write_bytes(bytes(len(first.read_bytes())))  # 9: right size, other bytes
    ref, _ = resume_point(str(tmp_path), "big", None, mine)
    assert ref.step == 9  # its parts' bytes were never read
    step, state = load_resumed(ref, mine)
    assert step == 4 and float(state["w"][0]) == 4.0


def test_a_replica_checks_the_shapes_of_a_checkpoint_whose_manifest_names_no_config(tmp_path):
    """A checkpoint saved without a config in its manifest (a state that carried none, or
    one saved before manifests carried it) is checked where it is loaded: one line."""
    from moshray.actors.errors import UserError
    from moshray.actors.replica.checkpoint import load_resumed, resume_point
    from moshray.jobs.config import load_config

    mine = load_config(None, {"checkpoint.uri": str(tmp_path)}).to_dict()
    wider = load_config(None, {"model.d_model": "512", "model.n_heads": "8"}).to_dict()
    store = CheckpointStore(str(tmp_path), run_id="old")
    store.save({"config": mine, "x": 1}, 2)
    path = next((tmp_path / "old").glob("*.manifest.json"))
    manifest = json.loads(path.read_text())
    del manifest["config"]
    path.write_text(json.dumps(manifest))
    ref, _ = resume_point(str(tmp_path), "old", None, wider)  # unchecked on the driver
    with pytest.raises(UserError) as err:
        load_resumed(ref, wider)
    assert "model.d_model 256 -> 512" in str(err.value) and "\n" not in str(err.value)
    assert load_resumed(ref, mine) == (2, {"config": mine, "x": 1})


def test_the_run_id_is_the_configs_or_the_jobs_name():
    """A new job never continues another's run: its run id is its name, unique unless the
    user named it (resubmitting the name resumes it), or ``checkpoint.run_id``."""
    from moshray.actors.replica.checkpoint import job_run_id
    from moshray.jobs.config import ConfigError, load_config

    first, second = load_config(None, {}).named(), load_config(None, {}).named()
    assert job_run_id(first.checkpoint, first.name) == first.name != second.name
    assert first.run_dir == f"runs/{first.name}"
    exp = load_config(None, {"name": "exp-7"}).named()
    assert job_run_id(exp.checkpoint, exp.name) == "exp-7" and exp.run_dir == "runs/exp-7"
    named = load_config(None, {"checkpoint.run_id": "nightly", "name": "exp-7"})
    assert job_run_id(named.checkpoint, named.name) == "nightly"
    with pytest.raises(ConfigError, match="^name: "):
        load_config(None, {"name": "has space"})
    with pytest.raises(ConfigError, match="checkpoint.run_id"):
        load_config(None, {"checkpoint.run_id": "../up"})
