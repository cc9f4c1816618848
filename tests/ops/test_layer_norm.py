"""layer_norm: the reference against a float64 formula, launcher checks, the kernel against the reference."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuinfer.ops import runtime
from cuinfer.ops.layer_norm import layer_norm
from tests.conftest import assert_close, poison

DTYPES = [np.float32, np.float16, runtime.bfloat16]


def layer_norm_f64(x, w, b, eps):
    out = np.empty(x.shape, np.float64)
    for r, row in enumerate(x.astype(np.float64)):
        mean = sum(row) / row.size
        var = sum((v - mean) ** 2 for v in row) / row.size
        out[r] = (row - mean) / np.sqrt(var + eps) * w + (0 if b is None else b)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_reference_matches_float64(dtype, with_bias):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 201)) * 2 + 5).astype(dtype)
    w, b = rng.uniform(0.5, 1.5, 201).astype(dtype), rng.standard_normal(201).astype(dtype)
    b = b if with_bias else None
    ref = layer_norm_f64(x, w.astype(np.float64), None if b is None else b.astype(np.float64), 1e-5)
    assert_close(layer_norm(x, w, b, 1e-5), ref)


def test_reference_keeps_precision_on_a_large_offset():
    x = (1e4 + np.random.default_rng(2).standard_normal((3, 512))).astype(np.float32)
    w = np.ones(512, np.float32)
    assert_close(layer_norm(x, w, None, 1e-5), layer_norm_f64(x, w, None, 1e-5))


def test_argument_checks():
    x, w = np.zeros((3, 8), np.float16), np.ones(8, np.float16)
    with pytest.raises(ValueError, match="bias: got shape"):
        layer_norm(x, w, w[:4], 1e-5)
    with pytest.raises(ValueError, match="weight: got dtype float32"):
        layer_norm(x, w.astype(np.float32), None, 1e-5)
    with pytest.raises(ValueError, match="x: must be C-contiguous"):
        layer_norm(np.zeros((8, 3), np.float16).T, w, None, 1e-5)
    with pytest.raises(ValueError, match="x: got 1 dimensions"):
        layer_norm(w, w, None, 1e-5)


@pytest.mark.gpu
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.sampled_from([1, 17, 111]), hidden=st.sampled_from([1, 17, 111, 989, 4096, 8192, 20000]),
       dtype=st.sampled_from(DTYPES), with_bias=st.booleans(), in_place=st.booleans(),
       offset=st.sampled_from([0.0, 100.0]), scale=st.sampled_from([1.0, 1e3]), seed=st.integers(0, 2**31))
def test_layer_norm_kernel(cp, rows, hidden, dtype, with_bias, in_place, offset, scale, seed):
    rng = np.random.default_rng(seed)
    x = (offset + scale * rng.standard_normal((rows, hidden))).astype(dtype)
    w = rng.uniform(-2, 2, hidden).astype(dtype)
    b = rng.standard_normal(hidden).astype(dtype) if with_bias else None
    want = layer_norm(x, w, b, 1e-5)
    dx = cp.asarray(x)
    out = dx if in_place else poison(cp, x.shape, dtype)
    got = layer_norm(dx, cp.asarray(w), None if b is None else cp.asarray(b), 1e-5, out=out)
    assert got is out
    assert_close(got, want)
