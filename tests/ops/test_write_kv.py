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


def norm_flip_slack(x, weight, eps, dtype):
    """Per element of the rotated heads, what a flipped rounding of the head norm can carry into them.
    rms_norm rounds twice (n = x / rms to the dtype, then weight * n again), and the kernel's 1 / rms
    differs from NumPy's in its last bits (summation order, rsqrt): where x / rms lies that close
    (2^-20 relative) to a rounding tie, n may round the other way, weight amplifies that ulp and weight
    * n may round the other way too; RoPE mixes each element with its pair. Zero everywhere else."""
    if np.dtype(dtype) == np.float32:
        return np.zeros(x.shape)
    mant = 10 if np.dtype(dtype) == np.float16 else 7

    def ulp(a):
        a = np.maximum(np.abs(a.astype(np.float64)), 2.0 ** -14)
        return 2.0 ** (np.floor(np.log2(a)) - mant)

    x32 = x.astype(np.float32)
    n = x32 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(eps))
    near_tie = (n * (1 - 2.0 ** -20)).astype(dtype) != (n * (1 + 2.0 ** -20)).astype(dtype)
    w = np.abs(weight.astype(np.float64))
    e = np.where(near_tie, w * ulp(n) + ulp(w * n), 0.0)
    half = x.shape[-1] // 2
    return e + np.concatenate([e[..., half:], e[..., :half]], axis=-1)


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


# ------------------------------------------------------------- q/k norm, per-token frequencies
def head_normed(x, w, eps):
    """x RMS-normed over each head, float64 (independent of rms_norm_reference)."""
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


def test_numpy_path_norms_heads_before_rotating():
    from cuinfer.ops.write_kv import write_kv_reference

    rng = np.random.default_rng(1)
    q, k, v, pos, slots = make(rng, 11, 6, 2, 32, np.float32, 3, 8)
    wq, wk = (1 + 0.3 * rng.standard_normal(32)).astype(np.float32), rng.standard_normal(32).astype(np.float32)
    inv = inv_freq_for(32)
    kc, vc = np.zeros((3, 8, 2, 32), np.float32), np.zeros((3, 8, 2, 32), np.float32)
    out = write_kv(q, k, v, pos, kc, vc, slots, inv, q_norm=wq, k_norm=wk, eps=1e-5)
    np.testing.assert_allclose(out, rotate_complex(head_normed(q, wq, 1e-5), pos, inv), rtol=1e-5, atol=1e-5)
    want_k, want_v = expected_caches(head_normed(k, wk, 1e-5), v, pos, slots, inv, kc.shape, 0.0)
    np.testing.assert_allclose(kc, want_k, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(vc, want_v)
    # without the norm weights nothing is normed
    kc2 = np.zeros_like(kc)
    np.testing.assert_allclose(write_kv_reference(q, k, v, pos, kc2, vc, slots, inv), rotate_complex(q, pos, inv),
                               rtol=1e-5, atol=1e-5)


def test_numpy_path_per_token_frequencies():
    rng = np.random.default_rng(2)
    q, k, v, pos, slots = make(rng, 9, 4, 4, 16, np.float32, 2, 8)
    invs = np.stack([inv_freq_for(16, 10000.0 * (1 + t)) for t in range(9)])  # [tokens, half]
    kc, vc = np.zeros((2, 8, 4, 16), np.float32), np.zeros((2, 8, 4, 16), np.float32)
    out = write_kv(q, k, v, pos, kc, vc, slots, invs)
    for t in range(9):
        np.testing.assert_allclose(out[t:t + 1], rotate_complex(q[t:t + 1], pos[t:t + 1], invs[t]), rtol=1e-5, atol=1e-5)
        if slots[t] >= 0:
            np.testing.assert_allclose(kc.reshape(-1, 4, 16)[slots[t]], rotate_complex(k[t:t + 1], pos[t:t + 1], invs[t])[0],
                                       rtol=1e-5, atol=1e-5)


def test_norm_argument_checks():
    q, k = np.zeros((3, 4, 64), np.float16), np.zeros((3, 2, 64), np.float16)
    cache = np.zeros((2, 8, 2, 64), np.float16)
    pos, slots, inv = np.zeros(3, np.int32), np.zeros(3, np.int32), inv_freq_for(64)
    w = np.ones(64, np.float16)
    with pytest.raises(ValueError, match="q_norm, k_norm: need both or neither"):
        write_kv(q, k, k, pos, cache, cache, slots, inv, q_norm=w)
    with pytest.raises(ValueError, match="k_norm: got shape"):
        write_kv(q, k, k, pos, cache, cache, slots, inv, q_norm=w, k_norm=w[:32])
    with pytest.raises(ValueError, match="q_norm: got dtype float32"):
        write_kv(q, k, k, pos, cache, cache, slots, inv, q_norm=w.astype(np.float32), k_norm=w)
    with pytest.raises(ValueError, match=r"inv_freq: got shape \(2, 32\)"):
        write_kv(q, k, k, pos, cache, cache, slots, np.zeros((2, 32), np.float32))


@pytest.mark.gpu
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.sampled_from([1, 2, 17, 111]), heads=st.sampled_from([(8, 8), (12, 4), (7, 1), (32, 8), (16, 2)]),
       d=st.sampled_from([64, 128, 256]), dtype=st.sampled_from([np.float16, runtime.bfloat16, np.float32]),
       in_place=st.booleans(), per_token=st.booleans(), scale=st.sampled_from([1.0, 30.0]),
       seed=st.integers(0, 2**31))
def test_write_kv_norm_kernel(cp, tokens, heads, d, dtype, in_place, per_token, scale, seed):
    """q/k norm + RoPE + cache write (Qwen3, Gemma 3), optionally per-token frequencies (longrope),
    against the NumPy reference on the same inputs; outputs and caches poisoned with NaN first."""
    from cuinfer.ops.write_kv import write_kv_reference

    rng = np.random.default_rng(seed)
    block_size, n_blocks = 16, -(-tokens // 16) + 2
    q, k, v, pos, slots = make(rng, tokens, heads[0], heads[1], d, dtype, n_blocks, block_size, 131072)
    q, k = ((scale * x.astype(np.float32)).astype(dtype) for x in (q, k))
    wq = (1 + 0.5 * rng.standard_normal(d)).astype(np.float32).astype(dtype)
    wk = rng.standard_normal(d).astype(np.float32).astype(dtype)
    inv = np.stack([inv_freq_for(d, 10000.0 * (1 + (t % 3))) for t in range(tokens)]) if per_token \
        else inv_freq_for(d, 1000000.0)
    shape = (n_blocks, block_size, heads[1], d)
    kc, vc = (cp.asarray(np.full(shape, np.nan, dtype)) for _ in range(2))
    ref_kc, ref_vc = np.full(shape, np.nan, dtype), np.full(shape, np.nan, dtype)
    want_q = write_kv_reference(q, k, v, pos, ref_kc, ref_vc, slots, inv, wq, wk, 1e-6)
    q_d = cp.asarray(q)
    out = q_d if in_place else poison(cp, q.shape, dtype)
    res = write_kv(q_d, cp.asarray(k), cp.asarray(v), cp.asarray(pos), kc, vc, cp.asarray(slots), cp.asarray(inv),
                   out=out, q_norm=cp.asarray(wq), k_norm=cp.asarray(wk), eps=1e-6)
    assert res is out
    assert_close(out, want_q, dtype, slack=norm_flip_slack(q, wq, 1e-6, dtype))
    got_k = cp.asnumpy(kc).astype(np.float32)
    keep = ~np.isnan(ref_kc.astype(np.float32))
    assert np.array_equal(np.isnan(got_k), ~keep)  # untouched slots stay NaN
    k_slack = np.full(shape, np.nan)  # k's, where the reference wrote each token's k
    written = slots >= 0
    k_slack.reshape(-1, *shape[2:])[slots[written]] = norm_flip_slack(k, wk, 1e-6, dtype)[written]
    assert_close(got_k[keep], ref_kc.astype(np.float32)[keep], dtype, slack=k_slack[keep])
    assert np.array_equal(cp.asnumpy(vc)[keep], ref_vc[keep])


@pytest.mark.gpu
def test_write_kv_norm_allocates_nothing_with_out(cp):
    """Under CUDA-graph capture with `out` given the normed launch allocates nothing (a replay writes
    what an eager launch writes)."""
    rng = np.random.default_rng(5)
    dtype = np.float16
    q, k, v, pos, slots = make(rng, 4, 8, 2, 128, dtype, 2, 16)
    slots = np.arange(4, dtype=np.int32)
    w = (1 + 0.1 * rng.standard_normal(128)).astype(dtype)
    args = [cp.asarray(a) for a in (q, k, v, pos)]
    caches = [cp.zeros((2, 16, 2, 128), dtype) for _ in range(4)]
    rest = [cp.asarray(slots), cp.asarray(inv_freq_for(128))]
    w_d = cp.asarray(w)
    eager = cp.empty(q.shape, dtype)
    write_kv(*args, caches[0], caches[1], *rest, out=eager, q_norm=w_d, k_norm=w_d)
    out = cp.empty(q.shape, dtype)
    write_kv(*args, caches[2], caches[3], *rest, out=out, q_norm=w_d, k_norm=w_d)  # compiled before capture
    out.fill(np.nan)
    caches[2].fill(0)
    cp.cuda.Device().synchronize()  # the capture stream does not wait for the legacy one
    stream = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        write_kv(*args, caches[2], caches[3], *rest, out=out, q_norm=w_d, k_norm=w_d)
        graph = stream.end_capture()
    assert pool.total_bytes() == 0
    graph.launch(stream)
    stream.synchronize()
    assert cp.array_equal(out, eager) and cp.array_equal(caches[2], caches[0])


def test_views_of_one_qkv_row():
    """q, k, v as views of the qkv projection's rows (the decoder's): the result of packed copies."""
    rng = np.random.default_rng(6)
    tokens, nh, nkv, d = 5, 4, 2, 16
    qkv = rng.standard_normal((tokens, (nh + 2 * nkv) * d)).astype(np.float32)
    q, k, v = (qkv[:, a:b].reshape(tokens, -1, d) for a, b in ((0, nh * d), (nh * d, (nh + nkv) * d),
                                                                ((nh + nkv) * d, None)))
    pos, slots, inv = np.arange(tokens, dtype=np.int32), np.arange(tokens, dtype=np.int32), inv_freq_for(d)
    caches = [np.zeros((1, 8, nkv, d), np.float32) for _ in range(4)]
    got = write_kv(q, k, v, pos, caches[0], caches[1], slots, inv)
    want = write_kv(*(np.ascontiguousarray(a) for a in (q, k, v)), pos, caches[2], caches[3], slots, inv)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(caches[0], caches[2])
    np.testing.assert_array_equal(caches[1], caches[3])
    odd = np.zeros((tokens, qkv.shape[1] + 1), np.float32)[:, :-1]  # rows 4 bytes past a multiple of 16
    with pytest.raises(ValueError, match=r"q: got strides \(516, 64, 4\)"):
        write_kv(odd[:, :nh * d].reshape(tokens, nh, d), k, v, pos, caches[0], caches[1], slots, inv)
    with pytest.raises(ValueError, match="v: got strides"):
        write_kv(q, k, v[:, ::-1], pos, caches[0], caches[1], slots, inv)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [np.float16, runtime.bfloat16])
def test_write_kv_kernel_on_qkv_views(cp, norm, dtype):
    """The kernel reads q, k, v as strided views of qkv rows (no copies), as the reference does."""
    from cuinfer.ops.write_kv import write_kv_reference

    rng = np.random.default_rng(7)
    tokens, nh, nkv, d = 37, 12, 4, 128
    qkv = rng.standard_normal((tokens, (nh + 2 * nkv) * d)).astype(np.float32).astype(dtype)
    cut = lambda x: (x[:, :nh * d].reshape(tokens, nh, d), x[:, nh * d:(nh + nkv) * d].reshape(tokens, nkv, d),
                     x[:, (nh + nkv) * d:].reshape(tokens, nkv, d))
    pos = rng.integers(0, 5000, tokens).astype(np.int32)
    slots = rng.permutation(3 * 16)[:tokens].astype(np.int32)
    w = [(1 + 0.2 * rng.standard_normal(d)).astype(dtype) for _ in range(2)] if norm else [None, None]
    inv = inv_freq_for(d)
    shape = (3, 16, nkv, d)
    ref_k, ref_v = np.full(shape, np.nan, dtype), np.full(shape, np.nan, dtype)
    want = write_kv_reference(*cut(qkv), pos, ref_k, ref_v, slots, inv, *w)
    kc, vc = cp.full(shape, np.nan, dtype), cp.full(shape, np.nan, dtype)
    out = poison(cp, (tokens, nh, d), dtype)
    write_kv(*cut(cp.asarray(qkv)), cp.asarray(pos), kc, vc, cp.asarray(slots), cp.asarray(inv), out=out,
             q_norm=None if w[0] is None else cp.asarray(w[0]), k_norm=None if w[1] is None else cp.asarray(w[1]))
    assert_close(out, want, dtype)
    keep = ~np.isnan(ref_k.astype(np.float32))
    assert_close(cp.asnumpy(kc).astype(np.float32)[keep], ref_k.astype(np.float32)[keep], dtype)
    assert np.array_equal(cp.asnumpy(vc)[keep], ref_v[keep])


# ------------------------------------------------------------- fp8 cache
def test_numpy_path_fp8_cache():
    """An fp8 cache (uint8 E4M3 codes) gets k and v rounded to q's dtype, then encoded; q is as with a float cache."""
    from cuinfer.ops import fp8

    rng = np.random.default_rng(3)
    q, k, v, pos, slots = make(rng, 13, 4, 2, 64, np.float16, 4, 8)
    inv = inv_freq_for(64)
    kc, vc = (np.full((4, 8, 2, 64), 0x7F, np.uint8) for _ in range(2))
    kf, vf = (np.zeros((4, 8, 2, 64), np.float16) for _ in range(2))
    out = write_kv(q, k, v, pos, kc, vc, slots, inv)
    np.testing.assert_array_equal(out, write_kv(q, k, v, pos, kf, vf, slots, inv))
    keep = slots >= 0
    for cache, ref in ((kc, kf), (vc, vf)):
        flat, flat_ref = cache.reshape(-1, 2, 64), ref.reshape(-1, 2, 64)
        np.testing.assert_array_equal(flat[slots[keep]], fp8.encode_e4m3(flat_ref[slots[keep]]))
        untouched = np.setdiff1d(np.arange(32), slots[keep])
        assert (flat[untouched] == 0x7F).all()
    with pytest.raises(ValueError, match="v_cache: got dtype float16, need uint8"):
        write_kv(q, k, v, pos, kc, vf, slots, inv)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [np.float16, runtime.bfloat16])
@pytest.mark.parametrize(("tokens", "heads", "d"), [(1, (32, 8), 128), (37, (12, 4), 96), (300, (7, 1), 64),
                                                    (9, (8, 8), 256), (64, (16, 2), 80)])
def test_write_kv_kernel_fp8_cache(cp, tokens, heads, d, dtype, norm):
    """The kernel into fp8 caches: each code is fp8.encode_e4m3 of what the kernel writes into a cache of dtype
    (the row rounded to dtype, then to E4M3), bit for bit, and q is the same; slots nothing writes keep their
    codes. k and v scaled by up to 300 cross the +-448 saturation."""
    from cuinfer.ops import fp8

    rng = np.random.default_rng(tokens * d)
    block_size, n_blocks = 16, -(-tokens // 16) + 2
    q, k, v, pos, slots = make(rng, tokens, heads[0], heads[1], d, dtype, n_blocks, block_size)
    k, v = (cp.asarray((a.astype(np.float32) * rng.choice([0.01, 1.0, 300.0], a.shape[:2])[..., None]).astype(dtype))
            for a in (k, v))
    args = (cp.asarray(pos),)
    tail = (cp.asarray(slots), cp.asarray(inv_freq_for(d, 500000.0)))
    kw = {}
    if norm:
        kw = {"q_norm": cp.asarray((1 + 0.5 * rng.standard_normal(d)).astype(dtype)),
              "k_norm": cp.asarray((1 + 0.5 * rng.standard_normal(d)).astype(dtype)), "eps": 1e-5}
    shape = (n_blocks, block_size, heads[1], d)
    kf, vf = (cp.asarray(np.full(shape, np.nan, dtype)) for _ in range(2))
    want_q = write_kv(cp.asarray(q), k, v, *args, kf, vf, *tail, out=poison(cp, q.shape, dtype), **kw)
    kc, vc = (cp.full(shape, 0x7F, cp.uint8) for _ in range(2))
    got_q = write_kv(cp.asarray(q), k, v, *args, kc, vc, *tail, out=poison(cp, q.shape, dtype), **kw)
    np.testing.assert_array_equal(cp.asnumpy(got_q).view(np.uint16), cp.asnumpy(want_q).view(np.uint16))
    for got, want in ((kc, kf), (vc, vf)):  # NaN (never written) encodes to 0x7f as well
        np.testing.assert_array_equal(cp.asnumpy(got), fp8.encode_e4m3(cp.asnumpy(want).astype(np.float32)))
    assert np.isin(cp.asnumpy(vc), [0x7E, 0xFE]).any()  # some v saturated
