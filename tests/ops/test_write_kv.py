"""write_kv: RoPE on q and k + paged cache write, against an independent rotation and rope_reference."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuinfer.ops import runtime
from cuinfer.ops.write_kv import write_kv
from tests.conftest import assert_close, poison


def inv_freq_for(d, theta=10000.0):
    return (theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)).astype(np.float32)


def rotate_complex(x, positions, inv_freq):
    """x: [tokens, heads, d] -> rotated, as the complex product (x1 + i x2) e^(i theta), float64.

    theta = positions * inv_freq rounded to float32, as the kernel (and Hugging Face) compute it.
    """
    half = x.shape[-1] // 2
    theta = (positions.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    z = (x[..., :half].astype(np.float64) + 1j * x[..., half:]) * np.exp(1j * theta)[:, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


def make(rng, tokens, n_heads, n_kv, d, dtype, n_blocks, block_size, max_pos=4096):
    q = rng.standard_normal((tokens, n_heads, d)).astype(np.float32).astype(dtype)
    k = rng.standard_normal((tokens, n_kv, d)).astype(np.float32).astype(dtype)
    v = rng.standard_normal((tokens, n_kv, d)).astype(np.float32).astype(dtype)
    pos = rng.integers(0, max_pos, tokens).astype(np.int32)
    slots = rng.permutation(n_blocks * block_size)[:tokens].astype(np.int32)
    slots[rng.random(tokens) < 0.2] = -1  # padding tokens
    return q, k, v, pos, slots


def expected_caches(k, v, pos, slots, inv_freq, shape, fill):
    kc, vc = np.full(shape, fill, np.float64), np.full(shape, fill, np.float64)
    keep = slots >= 0
    flat_k, flat_v = kc.reshape(-1, *shape[2:]), vc.reshape(-1, *shape[2:])
    flat_k[slots[keep]] = rotate_complex(k, pos, inv_freq)[keep]
    flat_v[slots[keep]] = v[keep]
    return kc, vc


def test_numpy_path_matches_rotation_and_scatter():
    rng = np.random.default_rng(0)
    pytest.importorskip("cuinfer.ops.rope")
    q, k, v, pos, slots = make(rng, 13, 4, 2, 64, np.float32, 4, 8)
    inv = inv_freq_for(64)
    kc, vc = np.zeros((4, 8, 2, 64), np.float32), np.zeros((4, 8, 2, 64), np.float32)
    out = write_kv(q, k, v, pos, kc, vc, slots, inv)
    np.testing.assert_allclose(out, rotate_complex(q, pos, inv), rtol=1e-5, atol=1e-5)
    want_k, want_v = expected_caches(k, v, pos, slots, inv, kc.shape, 0.0)
    np.testing.assert_allclose(kc, want_k, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(vc, want_v)


def test_argument_checks():
    q, k = np.zeros((3, 4, 64), np.float16), np.zeros((3, 2, 64), np.float16)
    cache = np.zeros((2, 8, 2, 64), np.float16)
    pos, slots, inv = np.zeros(3, np.int32), np.zeros(3, np.int32), inv_freq_for(64)
    with pytest.raises(ValueError, match="inv_freq: got dtype float64"):
        write_kv(q, k, k, pos, cache, cache, slots, inv.astype(np.float64))
    with pytest.raises(ValueError, match="slot_mapping: got shape"):
        write_kv(q, k, k, pos, cache, cache, slots[:2], inv)
    with pytest.raises(ValueError, match="k_cache: got shape"):
        write_kv(q, k, k, pos, cache[:, :, :1], cache, slots, inv)
    with pytest.raises(ValueError, match="positions: got dtype int64"):
        write_kv(q, k, k, pos.astype(np.int64), cache, cache, slots, inv)


@pytest.mark.gpu
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.sampled_from([1, 2, 17, 111, 989]), heads=st.sampled_from([(8, 8), (12, 4), (7, 1), (32, 8)]),
       d=st.sampled_from([64, 80, 96, 128, 256]), dtype=st.sampled_from([np.float32, np.float16, runtime.bfloat16]),
       in_place=st.booleans(), packed=st.sampled_from([0, 8, 24]), max_pos=st.sampled_from([16, 4096, 131072]),
       seed=st.integers(0, 2**31))
def test_write_kv_kernel(cp, tokens, heads, d, dtype, in_place, packed, max_pos, seed):
    """packed > 0: q, k and v are views of one row per token, as sliced from a qkv projection, with
    `packed` elements of padding after v (row strides of any 16-byte multiple)."""
    rng = np.random.default_rng(seed)
    block_size, n_blocks = 16, -(-tokens // 16) + 2
    q, k, v, pos, slots = make(rng, tokens, heads[0], heads[1], d, dtype, n_blocks, block_size, max_pos)
    inv = inv_freq_for(d, 500000.0)
    shape = (n_blocks, block_size, heads[1], d)
    kc, vc = (cp.asarray(np.full(shape, np.nan, dtype)) for _ in range(2))  # NaN for bf16 too
    if packed:
        rows = cp.asarray(np.concatenate([a.reshape(tokens, -1) for a in (q, k, v)]
                                         + [np.zeros((tokens, packed), dtype)], axis=1))
        nq, nkv = heads[0] * d, heads[1] * d
        q_d, k_d, v_d = (rows[:, a:b].reshape(tokens, -1, d) for a, b in ((0, nq), (nq, nq + nkv),
                                                                         (nq + nkv, nq + 2 * nkv)))
    else:
        q_d, k_d, v_d = (cp.asarray(a) for a in (q, k, v))
    out = q_d if in_place and not packed else poison(cp, q.shape, dtype)
    res = write_kv(q_d, k_d, v_d, cp.asarray(pos), kc, vc, cp.asarray(slots), cp.asarray(inv), out=out)
    assert res is out
    assert_close(out, rotate_complex(q, pos, inv), dtype)
    want_k, want_v = expected_caches(k, v, pos, slots, inv, shape, np.nan)
    keep = ~np.isnan(want_k)
    assert np.array_equal(np.isnan(cp.asnumpy(kc).astype(np.float32)), ~keep)  # untouched slots stay NaN
    assert_close(cp.asnumpy(kc)[keep], want_k[keep], dtype)
    assert np.array_equal(cp.asnumpy(vc)[keep], want_v[keep].astype(dtype))
