"""rope: inv_freq against HF's float32 formulas, the rotation against complex products, the kernel."""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuinfer.ops import runtime
from cuinfer.ops.rope import rope, rope_inv_freq, rope_reference
from tests.conftest import assert_close, poison

DTYPES = [np.float32, np.float16, runtime.bfloat16]
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)


def llama3_inv_freq_loop(d, theta, s):
    """Meta's apply_scaling (llama/model.py), one frequency at a time in Python floats."""
    out = []
    for i in range(0, d, 2):
        f = 1.0 / theta ** (i / d)
        wavelen = 2 * math.pi / f
        low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
        high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
        if wavelen < high_wl:
            out.append(f)
        elif wavelen > low_wl:
            out.append(f / s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            out.append((1 - smooth) * f / s["factor"] + smooth * f)
    return np.array(out)


def rotate_complex(x, positions, inv_freq):
    """(x1 + i x2) e^(i a) in float64, a = position * inv_freq rounded to float32."""
    half = x.shape[-1] // 2
    a = (positions.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    z = (x[..., :half].astype(np.float64) + 1j * x[..., half:]) * np.exp(1j * a)[:, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


@pytest.mark.parametrize("d, theta", [(64, 10000.0), (128, 500000.0), (6, 100.0)])
def test_inv_freq_default(d, theta):
    hf = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))  # HF, in float32
    np.testing.assert_allclose(rope_inv_freq(d, theta), hf, rtol=3e-7)
    assert rope_inv_freq(d, theta, dict(rope_type="default")).dtype == np.float32


def test_inv_freq_llama3():
    got = rope_inv_freq(128, 500000.0, LLAMA3)
    want = llama3_inv_freq_loop(128, 500000.0, LLAMA3)
    np.testing.assert_allclose(got, want, rtol=1e-7)
    assert got[0] == np.float32(1.0) and got[-1] < rope_inv_freq(128, 500000.0)[-1] / 7.9


def test_inv_freq_linear():
    """Position interpolation (Gemma 3's full layers): every frequency divided by the factor."""
    got = rope_inv_freq(256, 1e6, dict(rope_type="linear", factor=8.0))
    np.testing.assert_allclose(got, rope_inv_freq(256, 1e6) / np.float32(8.0), rtol=1e-7)


def test_inv_freq_longrope():
    """Phi-3's longrope: frequency i divided by short_factor[i] (long_factor[i] with long=True), as
    transformers' 1 / (factor * theta^(2i/d)) in float32."""
    rng = np.random.default_rng(0)
    short, long = (1 + rng.random(48)).tolist(), (1 + 30 * rng.random(48)).tolist()
    scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
               "original_max_position_embeddings": 4096}
    base = np.float32(10000.0) ** (np.arange(0, 96, 2, dtype=np.int64).astype(np.float32) / 96)
    for factors, long_ in ((short, False), (long, True)):
        hf = np.float32(1.0) / (np.asarray(factors, np.float32) * base)
        np.testing.assert_allclose(rope_inv_freq(96, 10000.0, scaling, long=long_), hf, rtol=5e-7)
    with pytest.raises(ValueError, match="got 48 longrope factors, need head_dim / 2 = 32"):
        rope_inv_freq(64, 1e4, scaling)


def test_inv_freq_rejects_other_scaling():
    with pytest.raises(ValueError, match="scaling: got rope_type 'yarn'"):
        rope_inv_freq(128, 1e4, dict(rope_type="yarn", factor=4.0))
    with pytest.raises(ValueError, match="scaling: llama3 rope_scaling needs the key 'factor'"):
        rope_inv_freq(128, 1e4, dict(rope_type="llama3"))
    with pytest.raises(ValueError, match="head_dim: got 7"):
        rope_inv_freq(7, 1e4)


def test_reference_matches_complex_rotation():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 3, 64)).astype(np.float32)
    pos = np.array([0, 1, 2, 100, 4095, 8191, 32768, 100000, 131071])
    inv = rope_inv_freq(64, 500000.0, LLAMA3)
    np.testing.assert_allclose(rope_reference(x, pos, inv), rotate_complex(x, pos, inv), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(rope_reference(x[:1], pos[:1], inv), x[:1])  # position 0: identity


def test_rope_numpy_rounds_once():
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((4, 4, 16)).astype(np.float16), rng.standard_normal((4, 2, 16)).astype(np.float16)
    pos = np.arange(4, dtype=np.int64)
    inv = rope_inv_freq(16, 10000.0)
    q_rot, k_rot = rope(q, k, pos, 10000.0, out=(q, None))
    assert q_rot is q
    assert_close(k_rot, rotate_complex(k, pos, inv))


def test_argument_checks():
    q, k, pos = np.zeros((3, 4, 8), np.float16), np.zeros((3, 2, 8), np.float16), np.zeros(3, np.int32)
    with pytest.raises(ValueError, match="q: got head_dim 7"):
        rope(np.zeros((3, 4, 7), np.float16), k, pos, 1e4)
    with pytest.raises(ValueError, match="k: got shape"):
        rope(q, np.zeros((3, 2, 16), np.float16), pos, 1e4)
    with pytest.raises(ValueError, match="k: got dtype float32"):
        rope(q, k.astype(np.float32), pos, 1e4)
    with pytest.raises(ValueError, match="positions: got dtype float32"):
        rope(q, k, pos.astype(np.float32), 1e4)
    with pytest.raises(ValueError, match="positions: got shape"):
        rope(q, k, pos[:2], 1e4)
    with pytest.raises(ValueError, match="out: need a"):
        rope(q, k, pos, 1e4, out=q)
    with pytest.raises(ValueError, match="scaling: got rope_type 'dynamic'"):
        rope(q, k, pos, 1e4, scaling=dict(rope_type="dynamic", factor=2.0))


@pytest.mark.gpu
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.sampled_from([1, 17, 111, 989]), heads=st.sampled_from([(8, 8), (12, 4), (7, 1), (32, 8)]),
       d=st.sampled_from([2, 6, 34, 64, 80, 128, 256]), dtype=st.sampled_from(DTYPES),
       pos_dtype=st.sampled_from([np.int32, np.int64]), max_pos=st.sampled_from([16, 8192, 131072]),
       llama3=st.booleans(), in_place=st.booleans(), scale=st.sampled_from([1.0, 1e3]),
       seed=st.integers(0, 2**31))
def test_rope_kernel(cp, tokens, heads, d, dtype, pos_dtype, max_pos, llama3, in_place, scale, seed):
    if dtype == np.float32:
        scale = 1.0  # sincosf is within 2 ulp: that error times |x| must stay under fp32's atol
    rng = np.random.default_rng(seed)
    q = (scale * rng.standard_normal((tokens, heads[0], d))).astype(dtype)
    k = (scale * rng.standard_normal((tokens, heads[1], d))).astype(dtype)
    pos = rng.integers(0, max_pos, tokens).astype(pos_dtype)
    pos[0] = max_pos - 1
    scaling, theta = (LLAMA3, 500000.0) if llama3 else (None, 10000.0)
    want_q, want_k = rope(q, k, pos, theta, scaling)
    dq, dk = cp.asarray(q), cp.asarray(k)
    out = (dq, dk) if in_place else (poison(cp, q.shape, dtype), poison(cp, k.shape, dtype))
    got_q, got_k = rope(dq, dk, cp.asarray(pos), theta, scaling, out=out)
    assert got_q is out[0] and got_k is out[1]
    assert_close(got_q, want_q)
    assert_close(got_k, want_k)
