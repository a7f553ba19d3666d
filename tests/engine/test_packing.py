"""Step inputs packed into one int32 buffer come back field for field inside a program."""

import jax
import numpy as np
import pytest

from jaxserve.engine.packing import Layout, pack, unpack

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`


def test_every_field_survives_packing_bit_for_bit():
    rng = np.random.default_rng(0)
    tree = {"ids": rng.integers(-5, 1000, (7,)).astype(np.int32),
            "table": rng.integers(0, 9, (3, 4)).astype(np.int32),
            "temperature": rng.standard_normal(5).astype(np.float32),
            "nan_and_inf": np.array([np.nan, -np.inf, -0.0], np.float32),
            "seed": np.array([0, 2**32 - 1, 12345], np.uint32),
            "wants": np.array([True, False, True]),
            "steps": np.int32(8)}
    layout = Layout.of(tree)
    buffer = pack(tree, layout)
    assert buffer.dtype == np.int32 and buffer.shape == (7 + 12 + 5 + 3 + 3 + 3 + 1,)
    out = jax.jit(lambda b: unpack(b, layout))(buffer)
    for name, value in tree.items():
        got = np.asarray(out[name])
        assert got.dtype == value.dtype and got.shape == np.shape(value), name
        assert got.tobytes() == np.asarray(value).tobytes(), name


def test_eight_byte_and_two_byte_fields_are_refused():
    for dtype in (np.int64, np.float16):
        with pytest.raises(ValueError, match="4-byte"):
            Layout.of({"x": np.zeros(3, dtype)})
