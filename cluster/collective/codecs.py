"""Wire codecs for all-reduce parts: a ``Codec`` interface and a registry by name (pure numpy).

A codec turns a float32 vector into an ``Encoded`` payload (what is ``ray.put`` into the
object store, or carried inline) and back. The round, the config's ``training.compression``
and ``moshray bench allreduce --compression`` all read their choices from this registry
(``codec_names``, ``get_codec``); a new codec is one ``Codec`` subclass and one
``register_codec`` call in a module every process of the job imports (the replicas decode
what the others encode, so the registry must agree across processes).

Built-ins, and the error each introduces per value x of a vector v (each all-reduce stage
encodes twice: the contribution, then the reduced result); ``Codec.error_bound`` computes
the bound for given values:

- ``none``: exact (float32).
- ``fp16``: relative error <= 2**-11 (half precision rounding) for |x| in fp16's normal
  range (6.1e-5 .. 65504), absolute <= 2**-24 below it. A vector whose largest finite
  magnitude m exceeds 65504 is sent scaled by a power of two s (the smallest with
  m / s <= 65504, carried in ``meta``): the relative bound is kept and the absolute floor
  becomes s * 2**-24, so a healthy gradient element over 65504 never overflows the wire.
- ``uint8``: uniform 8-bit over [min(v), max(v)]: absolute error <= (max - min) / 510.
- ``blockwise8``: uniform 8-bit per block of ``BLOCK`` values: absolute error <=
  (block max - block min) / 510, so one outlier only hurts its own block.
- ``blockwise4``: uniform 4-bit per block of ``BLOCK4`` values, two values packed per byte
  (``data`` holds ``ceil(numel / 2)`` bytes: ``wire_length``): absolute error <=
  (block max - block min) / 30. Meant for DiLoCo's outer gradients (the averaged
  parameter delta of ``local_sgd`` with ``outer_optimizer = "nesterov"``), which tolerate
  coarse quantisation where per-step gradients would not.

Non-finite inputs are not "fixed" by a codec: they decode to non-finite values so the
receiver's validation rejects them.

Half-precision conversions (``to_half``, ``to_float``) run through torch's vectorized
kernels when torch is importable (about 10x numpy's scalar loops at 100 MB); both are
IEEE conversions (round to nearest even, overflow to inf, subnormals kept), bit for bit
what numpy's ``astype`` computes (tests/test_compression.py checks every fp16 value and
random float32 bit patterns), so peers with and without torch agree. Torch is imported by
``warm_up`` or on first use, so reading the registry (the config does) costs no torch
import.
"""

from __future__ import annotations

import functools
import math
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

BLOCK = 4096
BLOCK4 = 256  # 4-bit blocks are smaller: 16 levels leave less room for an outlier
FP16_MAX = 65504.0

# Received payloads are read-only object-store buffers, handed to torch's conversion
# kernels (``_convert``); they are only ever read there.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                        category=UserWarning)


@dataclass(frozen=True)
class Encoded:
    """A compressed vector: ``data`` plus per-block ``(offset, scale)`` pairs in ``meta``.

    ``codec`` is the registered name of the codec that made it (``decode`` looks it up)."""

    codec: str
    numel: int
    data: np.ndarray
    meta: np.ndarray  # float32 (blocks, 2): offset and scale; empty where a codec needs none

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.meta.nbytes)


_EMPTY = np.zeros((0, 2), dtype=np.float32)


class Codec(ABC):
    """One wire format (see module docstring). Subclasses set ``name`` (a lower-case
    identifier, unique in the registry), ``wire_dtype`` (the dtype of ``Encoded.data``) and
    ``error`` (the documented bound in words), and implement ``encode``, ``decode`` and
    ``error_bound``. Contracts: ``encode`` never modifies its input and returns an
    ``Encoded`` with ``codec == name``, ``numel == values.size`` and ``data`` of
    ``wire_dtype`` and shape ``(wire_length(numel),)`` (``numel`` unless the codec packs
    several values per element); ``decode`` returns ``numel`` float32 values and
    raises ``ValueError`` (or ``TypeError`` / ``IndexError``) for a payload it cannot
    read, which the round rejects as the sender's; non-finite inputs decode non-finite."""

    name: str = ""
    wire_dtype: np.dtype = np.dtype(np.float32)
    error: str = ""

    @abstractmethod
    def encode(self, values: np.ndarray) -> Encoded:
        """Encode a 1-d float32 vector (contiguous; the input is never modified)."""

    @abstractmethod
    def decode(self, enc: Encoded) -> np.ndarray:
        """The ``enc.numel`` float32 values of ``enc``."""

    @abstractmethod
    def error_bound(self, values: np.ndarray) -> float:
        """The documented worst-case absolute error of one encode/decode of ``values``
        (a finite, 1-d float32 vector)."""

    def wire_length(self, numel: int) -> int:
        """Elements of ``Encoded.data`` for ``numel`` values (the round checks payloads
        against it); ``numel`` unless the codec packs several values per element."""
        return numel

    def received_values(self, enc: Encoded) -> np.ndarray:
        """The values of ``enc`` for arithmetic, equal to ``decode(enc)`` value for value;
        a codec may return a wire buffer (possibly read-only) that numpy widens exactly."""
        return self.decode(enc)

    def decode_into(self, enc: Encoded, out: np.ndarray) -> None:
        """Decode ``enc`` into the float32 array ``out`` (length already checked)."""
        np.copyto(out, self.received_values(enc), casting="same_kind")

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


_REGISTRY: dict[str, Codec] = {}


def register_codec(codec: Codec, replace: bool = False) -> Codec:
    """Make ``codec`` available under ``codec.name`` (to the config, the bench and the
    round). Raises ``ValueError`` for a name that is empty, not a lower-case identifier,
    ``auto`` (the config's own choice) or already taken (unless ``replace``), and
    ``TypeError`` for an object that is not a ``Codec``. Returns ``codec``."""
    if not isinstance(codec, Codec):
        raise TypeError(f"register_codec needs a Codec instance, got {type(codec).__name__}")
    name = codec.name
    if not isinstance(name, str) or not name.isidentifier() or name != name.lower() \
            or name == "auto":
        raise ValueError(f"codec name {name!r} must be a lower-case identifier other than "
                         f"'auto'")
    if name in _REGISTRY and not replace and _REGISTRY[name] is not codec:
        raise ValueError(f"codec {name!r} is already registered; pass replace=True to "
                         f"replace it")
    _REGISTRY[name] = codec
    return codec


def unregister_codec(name: str) -> None:
    """Remove a registered codec (tests that register a toy one). Unknown names: no-op."""
    _REGISTRY.pop(name, None)


def get_codec(codec: Codec | str) -> Codec:
    """The registered codec named ``codec`` (a ``Codec`` is returned as is). Raises
    ``ValueError`` naming the registered codecs for an unknown name."""
    if isinstance(codec, Codec):
        return codec
    found = _REGISTRY.get(codec) if isinstance(codec, str) else None
    if found is None:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(codec_names())}")
    return found


def codec_names() -> tuple[str, ...]:
    """The registered codec names, in registration order (built-ins first)."""
    return tuple(_REGISTRY)


# ----------------------------------------------------------------------- module API


def encode(values: np.ndarray, codec: Codec | str = "none") -> Encoded:
    """Encode a 1-d float32 vector with ``codec`` (a name or a ``Codec``). The input is
    never modified. Raises ``ValueError`` for an unknown codec."""
    codec = get_codec(codec)
    return codec.encode(np.ascontiguousarray(values, dtype=np.float32).reshape(-1))


def decode(enc: Encoded) -> np.ndarray:
    """Decode back to a float32 vector of ``enc.numel`` values (``ValueError`` if its codec
    is not registered here)."""
    return get_codec(enc.codec).decode(enc)


def received_values(enc: Encoded) -> np.ndarray:
    """The values of ``enc`` for arithmetic, without a copy where the wire format allows:
    ``none`` gives the (possibly read-only, object-store backed) buffer itself, unscaled
    ``fp16`` the half-precision array, which numpy widens exactly to float32 inside each
    operation; others are decoded. Equal to ``decode(enc)`` value for value."""
    return get_codec(enc.codec).received_values(enc)


def round_trip(values: np.ndarray, codec: Codec | str) -> np.ndarray:
    """``values`` as a receiver of ``encode(values, codec)`` sees them (``received_values``)."""
    return received_values(encode(values, codec))


def decode_into(enc: Encoded, out: np.ndarray) -> None:
    """Decode ``enc`` into the float32 array ``out`` (same length) in one pass. Raises
    ``ValueError`` if the lengths differ."""
    if out.shape != (enc.numel,):
        raise ValueError(f"out has shape {out.shape}, payload {enc.numel} values")
    get_codec(enc.codec).decode_into(enc, out)


def max_abs_error_bound(values: np.ndarray, codec: Codec | str) -> float:
    """The documented worst-case absolute error of one encode/decode of ``values``."""
    codec = get_codec(codec)
    values = np.asarray(values, dtype=np.float32).reshape(-1)
    if values.size == 0:
        return 0.0
    return codec.error_bound(values)


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


def warm_up() -> None:
    """Import torch for the half-precision conversions now (about a second), so that the
    first round that needs them does not pay it past its deadlines (``Averager`` calls
    this when it is made)."""
    _torch()


@functools.cache
def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency; numpy is the fallback
        return None
    return torch


def _convert(src: np.ndarray, dst: np.ndarray) -> None:
    if src.shape != dst.shape:
        raise ValueError(f"shapes differ: {src.shape} -> {dst.shape}")
    torch = _torch() if src.size else None
    if torch is not None and src.flags.c_contiguous and dst.flags.c_contiguous \
            and dst.flags.writeable:
        torch.from_numpy(dst).copy_(torch.from_numpy(src))
        return
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(dst, src, casting="unsafe")


def max_abs(values: np.ndarray) -> float:
    """The largest magnitude in ``values`` without allocating a temporary: one pass
    (torch's ``aminmax``, where torch is importable and the array is a contiguous float
    array in native byte order), else two numpy reductions. NaN if any value is NaN, inf
    if any is infinite, 0.0 for an empty vector."""
    if values.size == 0:
        return 0.0
    torch = _torch()
    if torch is not None and values.dtype in _TORCH_FLOATS and values.flags.c_contiguous:
        lo, hi = torch.aminmax(torch.from_numpy(values))
        return float(max(hi.item(), -lo.item()))
    return float(max(values.max(), -values.min()))


# the dtypes ``max_abs`` hands to torch (native byte order: ``np.dtype`` equality checks it)
_TORCH_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64))


# ----------------------------------------------------------------------- built-ins


class NoneCodec(Codec):
    """float32 as is: exact."""

    name = "none"
    wire_dtype = np.dtype(np.float32)
    error = "exact"

    def encode(self, values: np.ndarray) -> Encoded:
        return Encoded(self.name, values.size, values, _EMPTY)  # a view: put copies it once

    def decode(self, enc: Encoded) -> np.ndarray:
        return enc.data

    def error_bound(self, values: np.ndarray) -> float:
        return 0.0


class Fp16Codec(Codec):
    """IEEE half precision, scaled by a power of two when the vector exceeds its range."""

    name = "fp16"
    wire_dtype = np.dtype(np.float16)
    error = ("relative <= 2**-11 plus absolute <= s * 2**-24 (s: the power-of-two scale, 1 "
             "unless the largest magnitude exceeds 65504)")

    @staticmethod
    def scale_for(values: np.ndarray) -> float:
        """1.0, or the smallest power of two s with ``max|values| / s <= FP16_MAX`` when the
        largest magnitude is finite and over ``FP16_MAX`` (NaN or inf: 1.0, passed on)."""
        m = max_abs(values)
        if not (math.isfinite(m) and m > FP16_MAX):
            return 1.0
        s = 2.0 ** math.ceil(math.log2(m / FP16_MAX))
        while m / s > FP16_MAX:  # guard log2's rounding
            s *= 2.0
        return s

    def encode(self, values: np.ndarray) -> Encoded:
        s = self.scale_for(values)
        if s == 1.0:
            return Encoded(self.name, values.size, to_half(values), _EMPTY)
        scaled = values * np.float32(1.0 / s)  # exact: a power of two
        return Encoded(self.name, values.size, to_half(scaled),
                       np.array([[0.0, s]], dtype=np.float32))

    def _scale(self, enc: Encoded) -> float:
        if enc.meta.size == 0:
            return 1.0
        if enc.meta.shape != (1, 2):
            raise ValueError(f"fp16 meta of shape {enc.meta.shape}, expected (1, 2)")
        return float(enc.meta[0, 1])

    def decode(self, enc: Encoded) -> np.ndarray:
        out = to_float(enc.data)
        s = self._scale(enc)
        if s != 1.0:
            with np.errstate(over="ignore", invalid="ignore"):
                out *= np.float32(s)
        return out

    def received_values(self, enc: Encoded) -> np.ndarray:
        return enc.data if self._scale(enc) == 1.0 else self.decode(enc)

    def decode_into(self, enc: Encoded, out: np.ndarray) -> None:
        s = self._scale(enc)
        to_float(enc.data, out)
        if s != 1.0:
            with np.errstate(over="ignore", invalid="ignore"):
                out *= np.float32(s)

    def error_bound(self, values: np.ndarray) -> float:
        return max_abs(values) * 2.0**-11 + self.scale_for(values) * 2.0**-24


class EightBitCodec(Codec):
    """Uniform 8-bit quantisation per block of ``block`` values (None: the whole vector)."""

    wire_dtype = np.dtype(np.uint8)

    def __init__(self, name: str, block: int | None):
        self.name, self.block = name, block
        self.error = ("absolute <= (max - min) / 510 over the "
                      + ("vector" if block is None else f"block of {block} values"))

    def _block(self, numel: int) -> int:
        return max(numel if self.block is None else self.block, 1)

    def encode(self, values: np.ndarray) -> Encoded:
        block = self._block(values.size)
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
        return Encoded(self.name, n, q, meta)

    def decode(self, enc: Encoded) -> np.ndarray:
        block = self._block(enc.numel)
        n = enc.numel
        blocks = enc.meta.shape[0]
        padded = np.zeros(blocks * block, dtype=np.float32)
        padded[:n] = enc.data
        view = padded.reshape(blocks, block)
        with np.errstate(invalid="ignore"):
            view *= enc.meta[:, 1:2]
            view += enc.meta[:, 0:1]
        return padded[:n]

    def error_bound(self, values: np.ndarray) -> float:
        block = self._block(values.size)
        blocks = -(-values.size // block)
        padded = np.full(blocks * block, values[-1], dtype=np.float32)
        padded[: values.size] = values
        view = padded.reshape(blocks, block)
        # Half a quantisation step, plus float32 rounding of the reconstruction.
        spread = view.max(axis=1) - view.min(axis=1)
        return float((spread / 510.0).max()
                     + (spread.max() + np.abs(values).max()) * 2.0**-22)


NONE = register_codec(NoneCodec())
FP16 = register_codec(Fp16Codec())
UINT8 = register_codec(EightBitCodec("uint8", None))
BLOCKWISE8 = register_codec(EightBitCodec("blockwise8", BLOCK))


class FourBitCodec(Codec):
    """Uniform 4-bit quantisation per block of ``block`` values, two values per byte (the
    first of each pair in the low nibble); ``meta`` holds each block's (min, step)."""

    wire_dtype = np.dtype(np.uint8)

    def __init__(self, name: str, block: int):
        if block < 2 or block % 2:
            raise ValueError(f"a 4-bit block must be an even number >= 2, got {block}")
        self.name, self.block = name, block
        self.error = f"absolute <= (max - min) / 30 over the block of {block} values"

    def wire_length(self, numel: int) -> int:
        return (numel + 1) // 2

    def _blocks(self, values: np.ndarray) -> np.ndarray:
        """``values`` padded with its last value to whole blocks: (blocks, block)."""
        n, block = values.size, self.block
        blocks = -(-n // block)
        padded = np.full(blocks * block, values[-1] if n else 0.0, dtype=np.float32)
        padded[:n] = values
        return padded.reshape(blocks, block)

    def encode(self, values: np.ndarray) -> Encoded:
        n = values.size
        if n == 0:
            return Encoded(self.name, 0, np.zeros(0, np.uint8), _EMPTY)
        view = self._blocks(values)
        lo, hi = view.min(axis=1), view.max(axis=1)
        with np.errstate(invalid="ignore", over="ignore"):
            scale = (hi - lo) / np.float32(15.0)
            safe = np.where(scale > 0, scale, np.float32(1.0))
            q = np.rint((view - lo[:, None]) / safe[:, None])
        q = np.clip(np.nan_to_num(q, nan=0.0), 0, 15).astype(np.uint8).reshape(-1)
        q = q[: 2 * self.wire_length(n)]  # an even count (the block is even)
        packed = q[0::2] | (q[1::2] << 4)
        meta = np.stack([lo, scale], axis=1).astype(np.float32)
        return Encoded(self.name, n, packed, meta)

    def decode(self, enc: Encoded) -> np.ndarray:
        n = enc.numel
        if enc.data.shape != (self.wire_length(n),):
            raise ValueError(f"4-bit payload of {enc.data.shape} bytes for {n} values")
        blocks = -(-n // self.block)
        if enc.meta.shape != (blocks, 2):
            raise ValueError(f"4-bit meta of shape {enc.meta.shape}, expected ({blocks}, 2)")
        q = np.empty(blocks * self.block, dtype=np.float32)
        q[: 2 * enc.data.size: 2] = enc.data & 0x0F
        q[1: 2 * enc.data.size: 2] = enc.data >> 4
        q[2 * enc.data.size:] = 0.0
        view = q.reshape(blocks, self.block)
        with np.errstate(invalid="ignore"):
            view *= enc.meta[:, 1:2]
            view += enc.meta[:, 0:1]
        return q[:n]

    def error_bound(self, values: np.ndarray) -> float:
        view = self._blocks(values)
        spread = view.max(axis=1) - view.min(axis=1)
        # Half a quantisation step, plus float32 rounding of the reconstruction.
        return float((spread / 30.0).max() + (spread.max() + np.abs(values).max()) * 2.0**-22)


BLOCKWISE4 = register_codec(FourBitCodec("blockwise4", BLOCK4))
