"""The codec plug-in point: a toy codec registered through the public interface
(``Codec`` + ``register_codec``) is offered by the config and runs a real group round
(the production ``Averager`` and ``GroupRound`` over ``transport.LocalNetwork``)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from moshray.cluster.collective import codecs
from moshray.cluster.collective.codecs import (Codec, Encoded, codec_names, get_codec,
                                               register_codec)
from test_allreduce_local import inputs, reduce_all, swarm, weighted


class Int16Codec(Codec):
    """Uniform 16-bit over [-m, m], m the vector's largest magnitude (in ``meta``)."""

    name = "toy_int16"
    wire_dtype = np.dtype(np.int16)
    error = "absolute <= m / 65534 (m: the largest magnitude), plus float32 rounding"

    def encode(self, values: np.ndarray) -> Encoded:
        m = codecs.max_abs(values)
        step = np.float32(m / 32767.0) if math.isfinite(m) and m > 0 else \
            np.float32(1.0 if m == 0 else np.nan)  # NaN/inf in: NaN out
        with np.errstate(invalid="ignore"):
            q = np.rint(values / step)
        q = np.nan_to_num(q, nan=0.0).astype(np.int16)
        return Encoded(self.name, values.size, q, np.array([[0.0, step]], np.float32))

    def decode(self, enc: Encoded) -> np.ndarray:
        if enc.meta.shape != (1, 2):
            raise ValueError(f"meta of shape {enc.meta.shape}, expected (1, 2)")
        return enc.data.astype(np.float32) * enc.meta[0, 1]

    def error_bound(self, values: np.ndarray) -> float:
        m = codecs.max_abs(values)
        return m / 65534.0 + m * 2.0**-22


@pytest.fixture
def toy():
    codec = register_codec(Int16Codec())
    try:
        yield codec
    finally:
        codecs.unregister_codec(codec.name)


def test_a_registered_codec_is_listed_looked_up_and_round_trips(toy):
    assert codec_names()[-1] == "toy_int16" and get_codec("toy_int16") is toy
    x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    y = codecs.decode(codecs.encode(x, "toy_int16"))
    assert np.abs(y - x).max() <= codecs.max_abs_error_bound(x, "toy_int16")
    with pytest.raises(ValueError, match="already registered"):
        register_codec(Int16Codec())
    with pytest.raises(ValueError, match="lower-case identifier"):
        bad = Int16Codec()
        bad.name = "auto"
        register_codec(bad)
    with pytest.raises(TypeError, match="Codec instance"):
        register_codec("toy")


def test_the_config_offers_exactly_the_registered_codecs(toy):
    from moshray.jobs.config import ConfigError, TrainConfig

    config = TrainConfig.from_dict({"training": {"compression": "toy_int16"}})
    assert config.training.wire_codec == "toy_int16"
    codecs.unregister_codec("toy_int16")
    with pytest.raises(ConfigError, match="training.compression: must be one of 'auto', "
                                          "'none', 'fp16'"):
        TrainConfig.from_dict({"training": {"compression": "toy_int16"}})


def test_a_group_round_runs_with_the_toy_codec(toy):
    """Four peers average with the toy codec: every peer holds the same bits, within the
    toy's documented bound (contribution plus result encoding) of the exact average."""
    _, averagers, plan = swarm(4, compression="toy_int16")
    assert plan.compression == "toy_int16"
    arrays, weights = inputs(4, size=4001, seed=1)
    results = asyncio.run(reduce_all(averagers, plan, arrays, weights))
    expected = weighted(arrays, weights, arrays)
    bound = max(toy.error_bound(a) for a in arrays.values())
    bound += toy.error_bound(expected.astype(np.float32)) + 1e-6
    first = results["p0"][0]
    for out, report in results.values():
        assert report.rejections == ()
        assert np.array_equal(out, first)
        assert np.abs(out - expected).max() <= bound
        assert report.total_weight == sum(weights.values())
