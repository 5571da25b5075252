"""Tests for moshray.actors.replica.checkpoint: format, atomic naming, pruning, corruption."""

from __future__ import annotations

import hashlib
import logging
import os

import pytest
import torch

from moshray.actors.replica.checkpoint import _HEADER, FORMAT_VERSION, MAGIC, CheckpointStore
from moshray.jobs.examples.lm.model import ModelConfig, build_model

TINY = ModelConfig(seq_len=8, d_model=16, n_layers=1, n_heads=2, d_ff=32)


def _state(step: int) -> dict:
    model = build_model(TINY, seed=step)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.loss(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": step,
        "config": TINY.to_dict(),
        "version": 1,
    }


def test_round_trip_restores_tensors_exactly(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpts"))
    state = _state(5)
    path = store.save(state, step=5)
    assert path == str(tmp_path / "ckpts" / "ckpt-000000005.pt")
    step, loaded = store.load_latest()
    assert step == 5
    assert loaded["step"] == 5 and loaded["config"] == TINY.to_dict() and loaded["version"] == 1
    for name, tensor in state["model"].items():
        assert torch.equal(loaded["model"][name], tensor), name
    assert loaded["optimizer"]["state"][0]["exp_avg"].device.type == "cpu"
    model = build_model(TINY, seed=0)
    model.load_state_dict(loaded["model"])  # loads cleanly into a fresh model


def test_file_has_header_with_digest_and_no_temp_files_remain(tmp_path):
    store = CheckpointStore(str(tmp_path))
    path = store.save({"x": torch.arange(4)}, step=12)
    blob = open(path, "rb").read()
    magic, version, digest, length = _HEADER.unpack_from(blob)
    payload = blob[_HEADER.size :]
    assert (magic, version) == (MAGIC, FORMAT_VERSION)
    assert length == len(payload) and digest == hashlib.sha256(payload).digest()
    assert os.listdir(tmp_path) == ["ckpt-000000012.pt"]


def test_empty_store_and_missing_directory_is_created(tmp_path):
    store = CheckpointStore(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir()
    assert store.list_steps() == []
    assert store.load_latest() is None


def test_pruning_keeps_the_newest(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    for step in (1, 2, 3, 10):
        store.save({"step": step}, step)
    assert store.list_steps() == [3, 10]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000003.pt", "ckpt-000000010.pt"]
    assert store.load_latest() == (10, {"step": 10})


def test_saving_the_same_step_twice_replaces_it(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save({"v": "old"}, 4)
    store.save({"v": "new"}, 4)
    assert store.load_latest() == (4, {"v": "new"})


def test_unrelated_files_are_ignored(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save({"step": 1}, 1)
    (tmp_path / "ckpt-notastep.pt").write_bytes(b"x")
    (tmp_path / ".ckpt-000000009.pt.tmp-abc").write_bytes(b"half written")
    assert store.list_steps() == [1]
    assert store.load_latest() == (1, {"step": 1})


def _flip_last_byte(path: str) -> None:
    blob = bytearray(open(path, "rb").read())
    blob[-1] ^= 0xFF
    open(path, "wb").write(bytes(blob))


def test_checksum_mismatch_is_skipped_with_warning(tmp_path, caplog):
    store = CheckpointStore(str(tmp_path))
    store.save({"step": 10}, 10)
    bad = store.save({"step": 20}, 20)
    _flip_last_byte(bad)
    with caplog.at_level(logging.WARNING, logger="moshray.actors.replica.checkpoint"):
        assert store.load_latest() == (10, {"step": 10})
    [record] = caplog.records
    assert record.getMessage() == f"checkpoint {bad} is corrupt (checksum mismatch); skipping"


def test_truncated_file_is_detected(tmp_path, caplog):
    store = CheckpointStore(str(tmp_path))
    store.save({"step": 1}, 1)
    bad = store.save({"step": 2}, 2)
    blob = open(bad, "rb").read()
    open(bad, "wb").write(blob[: len(blob) // 2])
    with caplog.at_level(logging.WARNING):
        assert store.load_latest() == (1, {"step": 1})
    assert "wrong length" in caplog.text and bad in caplog.text


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"", "truncated header"),
        (b"NOTMAGIC" + bytes(60), "bad magic"),
        (
            _HEADER.pack(MAGIC, FORMAT_VERSION, hashlib.sha256(b"not a pickle").digest(), 12)
            + b"not a pickle",
            "unpicklable payload",
        ),
        (
            _HEADER.pack(MAGIC, 99, hashlib.sha256(b"").digest(), 0),
            "unsupported format version 99",
        ),
    ],
)
def test_each_kind_of_corruption_is_named(tmp_path, caplog, content, reason):
    store = CheckpointStore(str(tmp_path))
    store.save({"ok": True}, 1)
    (tmp_path / "ckpt-000000002.pt").write_bytes(content)
    with caplog.at_level(logging.WARNING):
        assert store.load_latest() == (1, {"ok": True})
    assert f"({reason}" in caplog.text and "ckpt-000000002.pt" in caplog.text


def test_all_corrupt_returns_none(tmp_path, caplog):
    store = CheckpointStore(str(tmp_path))
    _flip_last_byte(store.save({"a": 1}, 1))
    with caplog.at_level(logging.WARNING):
        assert store.load_latest() is None
    assert len(caplog.records) == 1


def test_file_uri_is_accepted(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}")
    store.save({"a": 1}, 3)
    assert (tmp_path / "ckpt-000000003.pt").is_file()
    assert CheckpointStore(str(tmp_path)).load_latest() == (3, {"a": 1})


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(str(tmp_path), keep=0)
    store = CheckpointStore(str(tmp_path))
    with pytest.raises(TypeError, match="dict"):
        store.save([1, 2], 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step"):
        store.save({}, -1)
