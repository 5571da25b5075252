"""Tests for moshray.jobs.examples.lm.corpus: cached stdlib corpus, resolving, batches."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from moshray.jobs.examples.lm.corpus import ByteBatches, _stdlib_sources, build_default_corpus, resolve_data

SMALL = {"max_bytes": 60_000, "shard_bytes": 20_000}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    return build_default_corpus(str(tmp_path_factory.mktemp("corpus")), **SMALL)


def test_corpus_shards_are_parquet_with_a_text_column(corpus):
    names = [os.path.basename(p) for p in corpus]
    assert names == [f"corpus-{i:05d}.parquet" for i in range(len(corpus))]
    assert len(corpus) >= 2  # 60 kB in 20 kB shards
    total = 0
    for path in corpus:
        table = pq.read_table(path)
        assert table.column_names == ["text"]
        assert table.num_rows >= 1
        total += sum(len(s.encode()) for s in table.column("text").to_pylist())
    assert 0.95 * SMALL["max_bytes"] <= total <= SMALL["max_bytes"]
    manifest = json.loads(open(os.path.join(os.path.dirname(corpus[0]), "manifest.json")).read())
    assert manifest["shards"] == names


def test_stdlib_walk_is_sorted_and_skips_tests_and_site_packages():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = _stdlib_sources(stdlib)
    assert len(sources) > 100
    assert all(p.suffix == ".py" for p in sources)
    parts = {part for p in sources for part in p.relative_to(stdlib).parts[:-1]}
    assert not parts & {"test", "tests", "site-packages", "__pycache__"}
    assert sources == _stdlib_sources(stdlib)  # stable order across calls


def test_corpus_is_built_once_and_then_cached(tmp_path):
    first = build_default_corpus(str(tmp_path), **SMALL)
    stamps = {p: os.stat(p).st_mtime_ns for p in first}
    manifest = tmp_path / "manifest.json"
    manifest_stamp = manifest.stat().st_mtime_ns
    second = build_default_corpus(str(tmp_path), **SMALL)
    assert second == first
    assert {p: os.stat(p).st_mtime_ns for p in second} == stamps
    assert manifest.stat().st_mtime_ns == manifest_stamp
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # no leftover temp files


def test_corpus_is_rebuilt_when_its_manifest_is_missing(tmp_path):
    first = build_default_corpus(str(tmp_path), **SMALL)
    contents = [pq.read_table(p).to_pylist() for p in first]
    (tmp_path / "manifest.json").unlink()
    again = build_default_corpus(str(tmp_path), **SMALL)
    assert again == first
    assert [pq.read_table(p).to_pylist() for p in again] == contents  # deterministic build


def test_resolve_none_means_default_corpus(tmp_path):
    assert resolve_data(None, str(tmp_path)) == resolve_data([], str(tmp_path))
    assert all(p.startswith(str(tmp_path)) for p in resolve_data(None, str(tmp_path)))


def test_resolve_expands_directories_sorted_and_filtered(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("b")
    (tmp_path / "sub" / "a.parquet").write_bytes(b"")
    (tmp_path / "notes.md").write_text("ignored")
    single = tmp_path / "b.txt"
    files = resolve_data([str(tmp_path), str(single)], "unused")
    assert files == sorted([str(tmp_path / "b.txt"), str(tmp_path / "sub" / "a.parquet")])


def test_resolve_file_uri(tmp_path):
    (tmp_path / "x.txt").write_text("x")
    assert resolve_data([f"file://{tmp_path}"], "unused") == [str(tmp_path / "x.txt")]


def test_resolve_missing_path_raises_one_line_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="data path not found") as info:
        resolve_data([str(missing)], "unused")
    assert str(missing) in str(info.value) and "\n" not in str(info.value)


def test_resolve_directory_without_data_files(tmp_path):
    (tmp_path / "readme.md").write_text("x")
    with pytest.raises(FileNotFoundError, match="no .parquet or .txt"):
        resolve_data([str(tmp_path)], "unused")


def _write_txt(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_batches_are_shifted_by_one_and_deterministic(corpus):
    a = ByteBatches(corpus, shard_index=0, num_shards=1, seq_len=32, batch_size=4, seed=3)
    b = ByteBatches(corpus, shard_index=0, num_shards=1, seq_len=32, batch_size=4, seed=3)
    for _ in range(3):
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert xa.shape == ya.shape == (4, 32)
        assert xa.dtype == torch.long
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    other = ByteBatches(corpus, shard_index=0, num_shards=1, seq_len=32, batch_size=4, seed=4)
    assert not torch.equal(other.next_batch()[0], a.next_batch()[0])


def test_batches_match_the_underlying_bytes(tmp_path):
    data = bytes(range(256)) * 40  # byte at offset o is o % 256
    path = _write_txt(tmp_path / "d.txt", data)
    batches = ByteBatches([path], 0, 1, seq_len=8, batch_size=16, seed=0)
    x, y = batches.next_batch()
    assert torch.equal((x[:, 1:] - x[:, :-1]) % 256, torch.ones(16, 7, dtype=torch.long))
    assert torch.equal(y, (x + 1) % 256)
    # Training windows stay before the held-out tail.
    assert batches.held_out_start >= 0.94 * len(data)


def test_held_out_batch_is_deterministic_and_disjoint_from_training(tmp_path):
    # First 95% is 'a', the last 5% is 'b': training must see only 'a', eval only 'b'.
    path = _write_txt(tmp_path / "d.txt", b"a" * 9_500 + b"b" * 500)
    batches = ByteBatches([path], 0, 1, seq_len=16, batch_size=64, seed=0)
    x1, y1 = batches.held_out_batch(8)
    for _ in range(5):
        x, y = batches.next_batch()
        assert set(x.unique().tolist()) | set(y.unique().tolist()) == {ord("a")}
    x2, _ = batches.held_out_batch(8)
    assert torch.equal(x1, x2)  # independent of the sampling RNG
    assert x1.shape == (8, 16)
    assert set(x1.unique().tolist()) | set(y1.unique().tolist()) == {ord("b")}


def test_round_robin_sharding_over_files(tmp_path):
    files = [_write_txt(tmp_path / f"{i}.txt", bytes([65 + i]) * 200) for i in range(4)]
    shard1 = ByteBatches(files, shard_index=1, num_shards=2, seq_len=8, batch_size=32, seed=0)
    assert shard1.files == [files[1], files[3]]
    assert set(np.unique(shard1.stream).tolist()) == {66, 68}


def test_contiguous_slices_when_fewer_files_than_shards(tmp_path):
    path = _write_txt(tmp_path / "d.txt", bytes(range(90)) * 10)  # 900 bytes
    slices = [ByteBatches([path], i, 3, seq_len=8, batch_size=2, seed=0).stream for i in range(3)]
    assert [len(s) for s in slices] == [300, 300, 300]
    assert np.concatenate(slices).tobytes() == bytes(range(90)) * 10


def test_parquet_files_use_the_text_column(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": [1, 2], "text": ["hello ", "world!" * 10]}), str(path))
    batches = ByteBatches([str(path)], 0, 1, seq_len=8, batch_size=2, seed=0)
    assert batches.stream.tobytes() == ("hello " + "world!" * 10).encode()


def test_parquet_without_text_column_is_rejected(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"body": ["x" * 100]}), str(path))
    with pytest.raises(ValueError, match="no 'text' column"):
        ByteBatches([str(path)], 0, 1, seq_len=8, batch_size=2, seed=0)


def test_reading_parquet_does_not_import_pyarrow_dataset(tmp_path):
    """Every starting replica reads the corpus: ``pyarrow.dataset`` (and pandas with it)
    would add about 0.3 CPU-s to each start."""
    import subprocess
    import sys

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["hello world " * 20]}), str(path))
    code = ("import sys; from moshray.jobs.examples.lm.corpus import ByteBatches; "
            f"ByteBatches([{str(path)!r}], 0, 1, seq_len=8, batch_size=2, seed=0); "
            "print('pyarrow.dataset' in sys.modules, 'pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["False", "False"]


def test_too_short_shard_is_rejected(tmp_path):
    path = _write_txt(tmp_path / "d.txt", b"tiny")
    with pytest.raises(ValueError, match="seq_len"):
        ByteBatches([path], 0, 1, seq_len=8, batch_size=2, seed=0)


def test_rng_state_round_trip_resumes_the_sequence(corpus):
    a = ByteBatches(corpus, 0, 1, seq_len=16, batch_size=2, seed=1)
    a.next_batch()
    saved = a.state_dict()
    expected = a.next_batch()[0]
    b = ByteBatches(corpus, 0, 1, seq_len=16, batch_size=2, seed=99)
    b.load_state_dict(saved)
    assert torch.equal(b.next_batch()[0], expected)
