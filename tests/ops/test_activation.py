"""silu_and_mul / gelu_and_mul: the reference against float64 formulas, launcher checks, the kernel."""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuinfer.ops import runtime
from cuinfer.ops.activation import gelu_and_mul, silu_and_mul
from tests.conftest import assert_close, poison

DTYPES = [np.float32, np.float16, runtime.bfloat16]


def silu_f64(g):
    return g * (1 / (1 + math.exp(-g)) if g > -700 else 0.0)  # g * sigmoid(g)


def gelu_tanh_f64(g):
    return 0.5 * g * (1 + math.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op, f", [(silu_and_mul, silu_f64), (gelu_and_mul, gelu_tanh_f64)])
def test_reference_matches_float64(op, f, dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 4, 2 * 37)) * 4).astype(dtype)
    x[0, 0, :3] = [-100, 100, 0]  # exp overflow in silu's sigmoid
    x64 = x.astype(np.float64)
    want = np.vectorize(f)(x64[..., :37]) * x64[..., 37:]
    assert_close(op(x), want)


def test_argument_checks():
    x = np.zeros((4, 6), np.float16)
    with pytest.raises(ValueError, match="x: got shape"):
        silu_and_mul(np.zeros((4, 5), np.float16))
    with pytest.raises(ValueError, match="out: got shape"):
        silu_and_mul(x, out=np.zeros((4, 6), np.float16))
    with pytest.raises(ValueError, match="out: got dtype float32"):
        gelu_and_mul(x, out=np.zeros((4, 3), np.float32))
    with pytest.raises(ValueError, match="x: got dtype int64"):
        silu_and_mul(x.astype(np.int64))
    with pytest.raises(ValueError, match="x: must be C-contiguous"):
        silu_and_mul(np.zeros((6, 4), np.float16).T)


@pytest.mark.gpu
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lead=st.sampled_from([(1,), (17,), (3, 5), (111,)]), d=st.sampled_from([1, 17, 111, 989, 4096, 14336]),
       dtype=st.sampled_from(DTYPES), gelu=st.booleans(), unaligned=st.booleans(),
       scale=st.sampled_from([1.0, 30.0, 200.0]), seed=st.integers(0, 2**31))
def test_act_and_mul_kernel(cp, lead, d, dtype, gelu, unaligned, scale, seed):
    op = gelu_and_mul if gelu else silu_and_mul
    rng = np.random.default_rng(seed)
    x = (scale * rng.standard_normal(lead + (2 * d,))).astype(dtype)
    want = op(x)
    buf = cp.empty(x.size + unaligned, dtype=dtype)  # unaligned: narrower vectors
    dx = buf[unaligned:].reshape(x.shape)
    dx[...] = cp.asarray(x)
    out = poison(cp, want.shape, dtype)
    assert op(dx, out=out) is out
    assert_close(out, want)
