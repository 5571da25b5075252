"""Training data with no download: byte streams from Parquet or text files.

The default corpus is the Python standard library's own ``.py`` sources,
written once into Parquet shards under a cache directory. User data is any
mix of local paths, directories and ``s3://`` / ``gs://`` URIs holding
``.parquet`` files (a ``text`` column) or ``.txt`` files; everything is read
through ``pyarrow.fs`` so local and object-store paths take the same code path.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import sysconfig
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from moshray.actors.replica.data_sources import as_uri, filesystem

__all__ = [
    "ByteBatches",
    "DATA_SUFFIXES",
    "build_default_corpus",
    "resolve_data",
]

DATA_SUFFIXES = (".parquet", ".txt")
MANIFEST_NAME = "manifest.json"
CORPUS_FORMAT = 1  # bump when the shard layout changes so old caches are rebuilt
HELD_OUT_FRACTION = 0.05

# Directory names skipped when walking the stdlib: tests are huge and
# repetitive, installed packages are not the stdlib, caches are not source.
_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


# --------------------------------------------------------------------------- corpus


def _stdlib_sources(stdlib: Path) -> list[Path]:
    """``.py`` files under ``stdlib`` in a deterministic (sorted) order."""
    found: list[Path] = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)  # prune in place
        found.extend(Path(root, f) for f in sorted(files) if f.endswith(".py"))
    return found


def _read_manifest(cache: Path, max_bytes: int, shard_bytes: int) -> list[str] | None:
    """Shard paths of a complete, matching cached corpus, else ``None``."""
    try:
        manifest = json.loads((cache / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    if (
        manifest.get("format") != CORPUS_FORMAT
        or manifest.get("max_bytes") != max_bytes
        or manifest.get("shard_bytes") != shard_bytes
    ):
        return None
    shards = [str(cache / name) for name in manifest.get("shards", [])]
    if not shards or not all(os.path.isfile(s) for s in shards):
        return None
    return shards


def _atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)`` then rename over ``path`` (atomic on a local fs)."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def build_default_corpus(
    cache_dir: str, max_bytes: int = 8_000_000, shard_bytes: int = 1_000_000
) -> list[str]:
    """Return the default corpus's Parquet shard paths, building them if needed.

    The first call reads the standard library's ``.py`` files (sorted order,
    skipping test directories and ``site-packages``) up to ``max_bytes`` of
    UTF-8 (the last file is truncated to fit), and writes Parquet shards of
    about ``shard_bytes`` each (one ``text`` column, one row per file) named
    ``corpus-00000.parquet``... plus ``manifest.json`` into ``cache_dir``
    (``~`` is expanded). Every file is written under a temporary name and
    renamed into place, and the manifest is written last, so a crash leaves
    either no manifest (the next call rebuilds) or a complete corpus;
    concurrent builders write identical bytes, so racing is harmless.

    Later calls whose manifest matches ``max_bytes`` and ``shard_bytes`` return
    the cached paths without touching the files. Raises ``ValueError`` for
    non-positive sizes, ``FileNotFoundError`` if no stdlib sources are found,
    and ``OSError`` if ``cache_dir`` cannot be written.
    """
    if max_bytes <= 0 or shard_bytes <= 0:
        raise ValueError(
            f"max_bytes and shard_bytes must be positive, got {max_bytes} and {shard_bytes}"
        )
    cache = Path(cache_dir).expanduser()
    cached = _read_manifest(cache, max_bytes, shard_bytes)
    if cached is not None:
        return cached

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    shards: list[list[str]] = [[]]
    shard_size = 0
    total = 0
    for source in _stdlib_sources(stdlib):
        if total >= max_bytes:
            break
        try:
            raw = source.read_bytes()
            raw.decode("utf-8")  # skip the rare non-UTF-8 file rather than mangle it
        except (OSError, UnicodeDecodeError):
            continue
        raw = raw[: max_bytes - total]
        text = raw.decode("utf-8", errors="ignore")  # truncation may split a character
        if not text:
            continue
        if shard_size >= shard_bytes:
            shards.append([])
            shard_size = 0
        shards[-1].append(text)
        shard_size += len(raw)
        total += len(raw)
    if total == 0:
        raise FileNotFoundError(f"no readable .py sources found under stdlib path {stdlib}")

    cache.mkdir(parents=True, exist_ok=True)
    names = []
    for i, rows in enumerate(shards):
        name = f"corpus-{i:05d}.parquet"
        table = pa.table({"text": pa.array(rows, type=pa.string())})
        _atomic_write(cache / name, lambda tmp, t=table: pq.write_table(t, str(tmp)))
        names.append(name)
    manifest = {
        "format": CORPUS_FORMAT,
        "source": "python-stdlib",
        "python": sys.version.split()[0],
        "max_bytes": max_bytes,
        "shard_bytes": shard_bytes,
        "total_bytes": total,
        "shards": names,
    }
    _atomic_write(
        cache / MANIFEST_NAME, lambda tmp: tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    )
    return [str(cache / name) for name in names]


# --------------------------------------------------------------------------- resolving


def resolve_data(uris: list[str] | None, cache_dir: str) -> list[str]:
    """Expand data locations into a sorted, de-duplicated list of data files.

    ``None`` or an empty list means the default corpus
    (:func:`build_default_corpus` in ``cache_dir``). Otherwise each entry is a
    local path, a directory (searched recursively), or an ``s3://`` /
    ``gs://`` / ``file://`` URI; files ending in ``.parquet`` or ``.txt`` are
    kept. Local results are absolute paths, remote ones keep their scheme.

    Raises ``FileNotFoundError`` (one line) when a path does not exist or a
    directory holds no data files, and ``ValueError`` when a file is named
    explicitly but is neither ``.parquet`` nor ``.txt``.
    """
    if not uris:
        return build_default_corpus(cache_dir)
    found: set[str] = set()
    for uri in uris:
        fs, path = filesystem(uri)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"data path not found: {uri}")
        if info.type == pafs.FileType.File:
            if not path.endswith(DATA_SUFFIXES):
                raise ValueError(f"data file {uri} is neither .parquet nor .txt")
            found.add(as_uri(fs, path, uri))
            continue
        matches = [
            entry.path
            for entry in fs.get_file_info(pafs.FileSelector(path, recursive=True))
            if entry.type == pafs.FileType.File and entry.path.endswith(DATA_SUFFIXES)
        ]
        if not matches:
            raise FileNotFoundError(f"no .parquet or .txt files under data path {uri}")
        found.update(as_uri(fs, m, uri) for m in matches)
    return sorted(found)


# --------------------------------------------------------------------------- batches


@dataclass(frozen=True)
class ShippedFile:
    """A data file carried through Ray's object store instead of a filesystem.

    The driver's built-in corpus lives on the driver's disk, which no other machine sees:
    ``ship_files`` puts each file's bytes in the object store, and a replica on any node
    reads them back. ``refs`` holds one ObjectRef inside a tuple so Ray passes it through
    actor arguments unresolved. The driver owns the objects: keep the list alive for the job.
    """

    name: str
    refs: tuple


def ship_files(paths: list[str]) -> list[ShippedFile]:
    """Put each local file's bytes in Ray's object store (driver side; Ray connected)."""
    import ray

    return [ShippedFile(os.path.basename(p), (ray.put(Path(p).read_bytes()),)) for p in paths]


DataFile = str | ShippedFile


@functools.lru_cache(maxsize=64)
def _read_bytes(uri: DataFile) -> bytes:
    """UTF-8 bytes of one data file: raw bytes for ``.txt``, the ``text`` column for Parquet.
    Cached per process (a replica opens many shards of the same few files).

    ``uri`` is a path or URI the caller's machine can open (local, ``s3://``, ``gs://``),
    or a ``ShippedFile`` fetched from the object store."""
    if isinstance(uri, ShippedFile):
        import ray

        raw = ray.get(uri.refs[0])
        if not uri.name.endswith(".parquet"):
            return bytes(raw)
        return _parquet_text(pa.BufferReader(raw), uri.name)
    fs, path = filesystem(uri)
    if path.endswith(".parquet"):
        with fs.open_input_file(path) as handle:
            return _parquet_text(handle, uri)
    with fs.open_input_stream(path) as stream:
        return stream.read()


def _parquet_text(source, name: str) -> bytes:
    """UTF-8 bytes of a Parquet file's ``text`` column; ``ValueError`` naming ``name`` when
    it has none. Read with ``ParquetFile``: ``pq.read_table`` goes through
    ``pyarrow.dataset``, whose import (pandas with it) costs every starting replica about
    0.3 CPU-s."""
    reader = pq.ParquetFile(source)
    columns = reader.schema_arrow.names
    if "text" not in columns:
        raise ValueError(f"parquet file {name} has no 'text' column (columns: {columns})")
    table = reader.read(columns=["text"])
    return b"".join(s.encode("utf-8") for s in table.column("text").to_pylist() if s)


class ByteBatches:
    """Random-offset byte batches from one shard of a list of data files.

    Sharding: with at least as many files as shards, shard ``i`` reads files
    ``i, i + num_shards, ...`` (round robin); with fewer files, every shard
    reads all of them and keeps the ``i``-th of ``num_shards`` contiguous
    slices of the concatenated byte stream. Either way the shard's bytes form
    one ``uint8`` array.

    The last 5% of that array is held out for :meth:`held_out_batch`;
    :meth:`next_batch` samples only before it (unless the stream is too short
    to split, in which case both use the whole stream). Offsets come from a
    ``numpy`` Generator seeded by ``(seed, shard_index)``, so a given shard
    replays the same batch sequence.

    The constructor raises ``ValueError`` for bad sizes or a shard with fewer
    than ``seq_len + 1`` bytes, ``FileNotFoundError``/``OSError`` when a file
    cannot be read, and ``ValueError`` for a Parquet file without ``text``.
    """

    def __init__(
        self,
        files: list[DataFile],
        shard_index: int,
        num_shards: int,
        seq_len: int,
        batch_size: int,
        seed: int,
    ) -> None:
        if not files:
            raise ValueError("ByteBatches needs at least one data file")
        if num_shards <= 0 or not 0 <= shard_index < num_shards:
            raise ValueError(
                f"shard_index must be in [0, num_shards), got {shard_index} of {num_shards}"
            )
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(
                f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}"
            )
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.shard_index = shard_index
        self.num_shards = num_shards

        if len(files) >= num_shards:
            self.files = list(files[shard_index::num_shards])
            stream = np.frombuffer(b"".join(_read_bytes(f) for f in self.files), dtype=np.uint8)
        else:
            self.files = list(files)
            whole = np.frombuffer(b"".join(_read_bytes(f) for f in self.files), dtype=np.uint8)
            start = len(whole) * shard_index // num_shards
            end = len(whole) * (shard_index + 1) // num_shards
            stream = whole[start:end]
        if len(stream) < seq_len + 1:
            raise ValueError(
                f"shard {shard_index}/{num_shards} has {len(stream)} bytes, "
                f"need at least seq_len + 1 = {seq_len + 1}"
            )
        self.stream = stream  # (num_bytes,) uint8, read-only view

        window = seq_len + 1  # x and y together span seq_len + 1 bytes
        n = len(stream)
        self.held_out_start = max(0, min(int(n * (1 - HELD_OUT_FRACTION)), n - window))
        # Too short to split: train on everything rather than refuse to run.
        self.train_end = self.held_out_start if self.held_out_start >= window else n
        self._rng = np.random.default_rng([seed, shard_index])

    @property
    def num_bytes(self) -> int:
        """Length of this shard's byte stream."""
        return len(self.stream)

    def windows(self, offsets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` for the windows starting at ``offsets`` (``(batch,)`` ints in
        ``[0, num_bytes - seq_len - 1]``); see ``next_batch``."""
        idx = offsets[:, None] + np.arange(self.seq_len + 1)  # (batch, seq_len + 1)
        chunk = torch.from_numpy(self.stream[idx].astype(np.int64))  # (batch, seq_len + 1)
        return chunk[:, :-1], chunk[:, 1:]  # x, y: (batch, seq_len), y[t] = x[t + 1]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` int64 tensors ``(batch_size, seq_len)``; ``y`` is ``x`` shifted by one."""
        offsets = self._rng.integers(0, self.train_end - self.seq_len, size=self.batch_size)
        return self.windows(offsets)

    def held_out_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Deterministic evaluation batch from the last 5% of the stream.

        Offsets are evenly spaced over the held-out region and independent of
        the sampling RNG, so every call (and every replica of this shard) sees
        the same batch.
        """
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        last = self.num_bytes - self.seq_len - 1  # last valid offset
        offsets = np.linspace(self.held_out_start, last, batch_size).astype(np.int64)
        return self.windows(offsets)

    def state_dict(self) -> dict:
        """Sampling RNG state, so a resumed replica continues the same sequence."""
        return {"bit_generator": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        """Restore the sampling RNG state saved by :meth:`state_dict`."""
        self._rng.bit_generator.state = state["bit_generator"]
