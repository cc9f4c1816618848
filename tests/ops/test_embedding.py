"""embedding: the reference against a loop, out-of-range ids, launcher checks, the kernel (exact)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuinfer.ops import runtime
from cuinfer.ops.embedding import embedding
from tests.conftest import poison

DTYPES = [np.float32, np.float16, runtime.bfloat16]


def test_reference_matches_loop():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((50, 24)).astype(np.float16)
    ids = rng.integers(0, 50, 31).astype(np.int64)
    want = np.stack([table[i] for i in ids])
    np.testing.assert_array_equal(embedding(ids, table), want)


@pytest.mark.parametrize("bad", [-1, 50])
def test_reference_rejects_out_of_range(bad):
    table = np.zeros((50, 8), np.float32)
    with pytest.raises(ValueError, match=f"ids: got id {bad} at index 2"):
        embedding(np.array([0, 1, bad, 3], np.int32), table)


def test_argument_checks():
    table = np.zeros((10, 8), np.float16)
    with pytest.raises(ValueError, match="ids: got dtype float32"):
        embedding(np.zeros(3, np.float32), table)
    with pytest.raises(ValueError, match="ids: got 2 dimensions"):
        embedding(np.zeros((3, 1), np.int32), table)
    with pytest.raises(ValueError, match="table: got 1 dimensions"):
        embedding(np.zeros(3, np.int32), table[0])
    with pytest.raises(ValueError, match="out: got shape"):
        embedding(np.zeros(3, np.int32), table, out=np.zeros((3, 4), np.float16))


@pytest.mark.gpu
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.sampled_from([1, 17, 111, 989]), hidden=st.sampled_from([1, 17, 111, 576, 4096]),
       vocab=st.sampled_from([1, 17, 1000]), dtype=st.sampled_from(DTYPES),
       id_dtype=st.sampled_from([np.int32, np.int64]), bad=st.booleans(), scale=st.sampled_from([1.0, 59.75]),
       seed=st.integers(0, 2**31))
def test_embedding_kernel(cp, n, hidden, vocab, dtype, id_dtype, bad, scale, seed):
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((vocab, hidden)).astype(dtype)
    ids = rng.integers(0, vocab, n).astype(id_dtype)
    want = embedding(ids, table, scale=scale).copy()
    if bad:  # out of range: the kernel writes zeros and reads nothing
        sel = rng.random(n) < 0.3
        ids[sel] = rng.choice([-1, vocab, 2**31 - 1, -(2**31)], sel.sum())
        want[sel] = 0
    out = poison(cp, want.shape, dtype)
    assert embedding(cp.asarray(ids), cp.asarray(table), out=out, scale=scale) is out
    np.testing.assert_array_equal(cp.asnumpy(out), want)  # one float32 product, rounded once


def test_reference_scale():
    """Gemma's embedding scale: each row times the scale in float32, rounded once to the dtype."""
    table = np.array([[1.0, -3.0], [0.5, 2.0]], np.float16)
    got = embedding(np.array([1, 0], np.int32), table, scale=59.75)
    np.testing.assert_array_equal(got, np.array([[29.875, 119.5], [59.75, -179.25]], np.float16))
