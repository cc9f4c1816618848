"""softmax: the reference against float64 log-sum-exp, -inf handling, launcher checks, the kernel."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuinfer.ops import runtime
from cuinfer.ops.softmax import softmax
from tests.conftest import assert_close, poison

DTYPES = [np.float32, np.float16, runtime.bfloat16]


def softmax_f64(x, axis=-1):
    """exp(x - logsumexp(x)) in float64, logsumexp by an explicit loop over the axis."""
    x = np.moveaxis(x.astype(np.float64), axis, -1)
    out = np.empty_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        row = x[idx]
        m = row.max()
        lse = m + np.log(sum(np.exp(v - m) for v in row)) if np.isfinite(m) else np.nan
        out[idx] = np.exp(row - lse)
    return np.moveaxis(out, -1, axis)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [-1, 0])
def test_reference_matches_float64(dtype, axis):
    x = (np.random.default_rng(0).standard_normal((9, 37)) * 10).astype(dtype)
    x[2, 5] = -np.inf
    assert_close(softmax(x, axis=axis), softmax_f64(x, axis))


def test_reference_neg_inf_rows():
    x = np.array([[-np.inf, -np.inf, -np.inf], [-np.inf, 0.0, 0.0]], np.float32)
    out = softmax(x)
    assert np.isnan(out[0]).all()  # no finite maximum: NaN, as torch
    np.testing.assert_array_equal(out[1], [0.0, 0.5, 0.5])


def test_argument_checks():
    with pytest.raises(ValueError, match="x: got dtype int32"):
        softmax(np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="out: got shape"):
        softmax(np.zeros((2, 3), np.float32), out=np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="x: must be C-contiguous"):
        softmax(np.zeros((3, 2), np.float32).T)


@pytest.mark.gpu
def test_gpu_rejects_other_axes(cp):
    with pytest.raises(ValueError, match="axis: got 0"):
        softmax(cp.zeros((2, 3), cp.float32), axis=0)


@pytest.mark.gpu
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.sampled_from([1, 3, 17]), n=st.sampled_from([1, 17, 111, 989, 4096, 4097, 32769, 128256, 300000]),
       dtype=st.sampled_from(DTYPES), scale=st.sampled_from([1.0, 30.0, 1e3]), neg_inf=st.booleans(),
       in_place=st.booleans(), seed=st.integers(0, 2**31))
def test_softmax_kernel(cp, rows, n, dtype, scale, neg_inf, in_place, seed):
    rng = np.random.default_rng(seed)
    x = (scale * rng.standard_normal((rows, n))).astype(dtype)
    if neg_inf:  # masked entries, and the last row fully masked (NaN)
        x[rng.random(x.shape) < 0.3] = -np.inf
        x[-1] = -np.inf
    want = softmax(x)
    dx = cp.asarray(x)
    out = dx if in_place else poison(cp, x.shape, dtype)
    assert softmax(dx, out=out) is out
    assert_close(out, want)
