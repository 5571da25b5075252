"""Wire compression for all-reduce parts: pure numpy, no Ray.

A codec turns a float32 vector into an ``Encoded`` payload (what is ``ray.put`` into the
object store) and back. Errors introduced, per value x of a vector v (each all-reduce
stage encodes twice: the contribution, then the reduced result):

- ``none``: exact (float32).
- ``fp16``: relative error <= 2**-11 (half precision rounding) for |x| in fp16's normal
  range (6.1e-5 .. 65504); values beyond 65504 become inf and are rejected downstream as
  non-finite, so fp16 is for gradients and parameter deltas, not raw large values.
- ``uint8``: uniform 8-bit over [min(v), max(v)]: absolute error <= (max - min) / 510.
- ``blockwise8``: uniform 8-bit per block of ``BLOCK`` values: absolute error <=
  (block max - block min) / 510, so one outlier only hurts its own block.

Non-finite inputs are not "fixed" by a codec: they decode to non-finite values so the
receiver's validation rejects them.

Half-precision conversions (``to_half``, ``to_float``) run through torch's vectorized
kernels when torch is importable (about 10x numpy's scalar loops at 100 MB); both are
IEEE conversions (round to nearest even, overflow to inf, subnormals kept), bit for bit
what numpy's ``astype`` computes (tests/test_compression.py checks every fp16 value and
random float32 bit patterns), so peers with and without torch agree.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass

import numpy as np

try:
    import torch as _torch
except ImportError:  # pragma: no cover - torch is a dependency; numpy is the fallback
    _torch = None
else:
    # Received payloads are read-only object-store buffers; they are only ever read here.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                            category=UserWarning)

BLOCK = 4096


class Compression(str, enum.Enum):
    NONE = "none"
    FP16 = "fp16"
    UINT8 = "uint8"
    BLOCKWISE8 = "blockwise8"


@dataclass(frozen=True)
class Encoded:
    """A compressed vector: ``data`` plus per-block ``(offset, scale)`` pairs in ``meta``."""

    codec: Compression
    numel: int
    data: np.ndarray
    meta: np.ndarray  # float32 (blocks, 2): offset and scale; empty for none/fp16

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.meta.nbytes)


WIRE_DTYPE = {
    Compression.NONE: np.dtype(np.float32),
    Compression.FP16: np.dtype(np.float16),
    Compression.UINT8: np.dtype(np.uint8),
    Compression.BLOCKWISE8: np.dtype(np.uint8),
}

_EMPTY = np.zeros((0, 2), dtype=np.float32)


def encode(values: np.ndarray, codec: Compression | str = Compression.NONE) -> Encoded:
    """Encode a 1-d float32 vector. The input is never modified."""
    codec = Compression(codec)
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if codec is Compression.NONE:
        return Encoded(codec, values.size, values, _EMPTY)
    if codec is Compression.FP16:
        return Encoded(codec, values.size, to_half(values), _EMPTY)
    block = values.size if codec is Compression.UINT8 else BLOCK
    return _encode_uint8(values, max(block, 1), codec)


def decode(enc: Encoded) -> np.ndarray:
    """Decode back to a float32 vector of ``enc.numel`` values."""
    if enc.codec is Compression.NONE:
        return enc.data
    if enc.codec is Compression.FP16:
        return to_float(enc.data)
    block = enc.numel if enc.codec is Compression.UINT8 else BLOCK
    return _decode_uint8(enc, max(block, 1))


def received_values(enc: Encoded) -> np.ndarray:
    """The values of ``enc`` for arithmetic, without a copy where the wire format allows:
    ``none`` gives the (possibly read-only, object-store backed) buffer itself, ``fp16`` the
    half-precision array, which numpy widens exactly to float32 inside each operation;
    8-bit codecs are decoded. Equal to ``decode(enc)`` value for value."""
    if enc.codec in (Compression.NONE, Compression.FP16):
        return enc.data
    return decode(enc)


def round_trip(values: np.ndarray, codec: Compression | str) -> np.ndarray:
    """``values`` as a receiver of ``encode(values, codec)`` sees them (``received_values``)."""
    return received_values(encode(values, codec))


def decode_into(enc: Encoded, out: np.ndarray) -> None:
    """Decode ``enc`` into the float32 array ``out`` (same length) in one pass."""
    if out.shape != (enc.numel,):
        raise ValueError(f"out has shape {out.shape}, payload {enc.numel} values")
    if enc.codec is Compression.FP16:
        to_float(enc.data, out)
    else:
        np.copyto(out, received_values(enc), casting="same_kind")


def to_half(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``values`` (float32) as float16, into ``out`` if given; exactly
    ``values.astype(np.float16)`` (see module docstring)."""
    if out is None:
        out = np.empty(values.shape, dtype=np.float16)
    _convert(values, out)
    return out


def to_float(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``values`` (float16 or float32) as float32, exactly, into ``out`` if given."""
    if out is None:
        out = np.empty(values.shape, dtype=np.float32)
    _convert(values, out)
    return out


def _convert(src: np.ndarray, dst: np.ndarray) -> None:
    if src.shape != dst.shape:
        raise ValueError(f"shapes differ: {src.shape} -> {dst.shape}")
    if _torch is not None and src.size and src.flags.c_contiguous and dst.flags.c_contiguous \
            and dst.flags.writeable:
        _torch.from_numpy(dst).copy_(_torch.from_numpy(src))
        return
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(dst, src, casting="unsafe")


def _encode_uint8(values: np.ndarray, block: int, codec: Compression) -> Encoded:
    n = values.size
    blocks = -(-n // block) if n else 0
    padded = np.zeros(blocks * block, dtype=np.float32)
    padded[:n] = values
    if n % block:
        padded[n:] = values[-1]  # pad with a real value so min/max are unaffected
    view = padded.reshape(blocks, block)
    lo = view.min(axis=1) if blocks else np.zeros(0, np.float32)
    hi = view.max(axis=1) if blocks else np.zeros(0, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        scale = (hi - lo) / np.float32(255.0)
        safe = np.where(scale > 0, scale, np.float32(1.0))
        q = np.rint((view - lo[:, None]) / safe[:, None])
    q = np.clip(np.nan_to_num(q, nan=0.0), 0, 255).astype(np.uint8).reshape(-1)[:n]
    meta = np.stack([lo, scale], axis=1).astype(np.float32)
    return Encoded(codec, n, q, meta)


def _decode_uint8(enc: Encoded, block: int) -> np.ndarray:
    n = enc.numel
    blocks = enc.meta.shape[0]
    padded = np.zeros(blocks * block, dtype=np.float32)
    padded[:n] = enc.data
    view = padded.reshape(blocks, block)
    with np.errstate(invalid="ignore"):
        view *= enc.meta[:, 1:2]
        view += enc.meta[:, 0:1]
    return padded[:n]


def max_abs_error_bound(values: np.ndarray, codec: Compression | str) -> float:
    """The documented worst-case absolute error of one encode/decode of ``values``."""
    codec = Compression(codec)
    values = np.asarray(values, dtype=np.float32).reshape(-1)
    if codec is Compression.NONE or values.size == 0:
        return 0.0
    if codec is Compression.FP16:
        return float(np.abs(values).max()) * 2.0**-11 + 2.0**-24
    block = values.size if codec is Compression.UINT8 else BLOCK
    blocks = -(-values.size // block)
    padded = np.full(blocks * block, values[-1], dtype=np.float32)
    padded[: values.size] = values
    view = padded.reshape(blocks, block)
    # Half a quantisation step, plus float32 rounding of the reconstruction.
    spread = view.max(axis=1) - view.min(axis=1)
    return float((spread / 510.0).max() + (spread.max() + np.abs(values).max()) * 2.0**-22)
