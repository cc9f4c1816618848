"""flash_attention / flash_attention_paged: references against float64 loops, kernels against references."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuinfer.ops import fp8, runtime
from cuinfer.ops.attention_ref import causal_attention, paged_prefix_attention, varlen_attention
from cuinfer.ops.flash_attention import (
    HEAD_DIMS,
    device_tile,
    flash_attention,
    flash_attention_paged,
    launch_kernel,
    tile_config,
)
from cuinfer.ops.paged_attention import paged_attention
from tests.conftest import assert_close, poison

DTYPES = [np.dtype(np.float16), runtime.bfloat16]


def attention_loops(q, k, v, scale, causal, window=0, softcap=0.0):
    """float64, one query and head at a time: softmax over the visible keys (the last `window` of
    them when window > 0; scores capped as c * tanh(x / c) when softcap c), then the weighted sum."""
    m, h, d = q.shape
    n, hk = k.shape[:2]
    out = np.zeros((m, h, d))
    for i in range(m):
        for j in range(h):
            kh = j // (h // hk)
            last = n - m + i if causal else n - 1
            first = max(0, last - window + 1) if window else 0
            s = np.array([scale * np.dot(q[i, j].astype(np.float64), k[t, kh]) for t in range(first, last + 1)])
            if softcap:
                s = softcap * np.tanh(s / softcap)
            if len(s):
                w = np.exp(s - s.max())
                out[i, j] = (w[:, None] * v[first: last + 1, kh].astype(np.float64)).sum(0) / w.sum()
    return out


def scatter_paged(rng, cu, block_size, *arrays, extra_blocks=3):
    """Packed [tokens, n_kv, d] arrays (sequences by cu) -> block_tables and one paged cache each.

    Sequences get random, non-contiguous blocks; every slot no sequence owns holds NaN.
    Returns (block_tables [num_seqs, max_blocks], caches [num_blocks, block_size, n_kv, d] ...).
    """
    lens = np.diff(cu)
    per = [-(-int(n) // block_size) for n in lens]
    n_blocks = sum(per) + extra_blocks
    perm = rng.permutation(n_blocks).astype(np.int32)
    tables = np.zeros((len(lens), max(per + [1])), dtype=np.int32)
    caches = [np.full((n_blocks, block_size) + a.shape[1:], np.nan, dtype=a.dtype) for a in arrays]
    used = 0
    for i, n in enumerate(lens):
        tables[i, : per[i]] = perm[used: used + per[i]]
        used += per[i]
        t = np.arange(n)
        for cache, a in zip(caches, arrays):
            cache[tables[i, t // block_size], t % block_size] = a[cu[i]: cu[i] + n]
    return (tables, *caches)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("m,n,h,hk", [(5, 5, 4, 4), (3, 9, 6, 2), (1, 7, 7, 1), (0, 4, 2, 1), (4, 4, 8, 1)])
def test_reference_matches_loops(m, n, h, hk, causal):
    rng = np.random.default_rng(m * 100 + n)
    q = rng.standard_normal((m, h, 16))
    k, v = rng.standard_normal((2, n, hk, 16))
    got = causal_attention(q, k, v, 0.3, causal, dtype=np.float64)
    np.testing.assert_allclose(got, attention_loops(q, k, v, 0.3, causal), rtol=1e-12, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(0, 9), extra=st.integers(0, 20), window=st.integers(1, 24),
       softcap=st.sampled_from([0.0, 0.7, 5.0]), ratio=st.sampled_from([1, 3]), seed=st.integers(0, 2**31))
def test_reference_window_and_softcap_match_loops(m, extra, window, softcap, ratio, seed):
    """Windows at, just under and just over the context length, chunks of any size."""
    rng = np.random.default_rng(seed)
    n = m + extra
    q = rng.standard_normal((m, 2 * ratio, 8)) * 2
    k, v = rng.standard_normal((2, n, 2, 8))
    got = causal_attention(q, k, v, 0.4, True, dtype=np.float64, window=window, softcap=softcap)
    np.testing.assert_allclose(got, attention_loops(q, k, v, 0.4, True, window, softcap), rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=4), data=st.data(),
       block_size=st.sampled_from([8, 16]), seed=st.integers(0, 2**31))
def test_paged_window_reads_no_key_before_it(lens, data, block_size, seed):
    """The paged references with a window: keys before every query's window are NaN in the cache and
    change nothing (neither read nor counted); the result equals contiguous windowed attention."""
    rng = np.random.default_rng(seed)
    window = data.draw(st.sampled_from(sorted({1, block_size - 1, block_size, block_size + 1, max(lens),
                                               max(lens) + 1})))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = rng.standard_normal((cu[-1], 4, 16)).astype(np.float32)
    k, v = rng.standard_normal((2, cu[-1], 2, 16)).astype(np.float32)
    q_lens = np.array([data.draw(st.integers(1, n)) for n in lens], np.int32)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    rows = np.concatenate([np.arange(cu[i + 1] - q_lens[i], cu[i + 1]) for i in range(len(lens))])
    poisoned_k, poisoned_v = k.copy(), v.copy()
    for i, n in enumerate(lens):  # keys no query of the chunk sees
        before = cu[i] + max(0, n - q_lens[i] - window + 1)
        poisoned_k[cu[i]:before] = poisoned_v[cu[i]:before] = np.nan
    tables, k_cache, v_cache = scatter_paged(rng, cu, block_size, poisoned_k, poisoned_v)
    ctx = np.array(lens, np.int32)
    want = varlen_attention(q, k, v, cu, window=window)[rows]
    got = flash_attention_paged(q[rows], k_cache, v_cache, tables, cu_q, ctx, window=window)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    last = cu[1:] - 1
    got = paged_attention(q[last], k_cache, v_cache, tables, ctx, window=window)
    np.testing.assert_allclose(got, varlen_attention(q, k, v, cu, window=window)[last], rtol=1e-5, atol=1e-6)


def test_window_argument_checks():
    q = np.zeros((4, 2, 64), np.float32)
    cu = np.array([0, 4], np.int32)
    with pytest.raises(ValueError, match="window: got -1"):
        flash_attention(q, q, q, cu, window=-1)
    with pytest.raises(ValueError, match="window: a sliding window needs causal=True"):
        flash_attention(q, q, q, cu, causal=False, window=3)
    with pytest.raises(ValueError, match="softcap: got 0"):
        flash_attention(q, q, q, cu, softcap=0)


def test_reference_chunks_long_sequences(monkeypatch):
    from cuinfer.ops import attention_ref

    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 40, 4, 8)).astype(np.float32)
    full = causal_attention(q, k[:, :2], v[:, :2], 0.5)
    monkeypatch.setattr(attention_ref, "_SCORES_PER_CHUNK", 4 * 40 * 3)  # 3 queries per chunk
    np.testing.assert_allclose(causal_attention(q, k[:, :2], v[:, :2], 0.5), full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paged_reference_matches_contiguous(block_size):
    rng = np.random.default_rng(block_size)
    cu = np.array([0, 1, block_size - 1, 3 * block_size + 1, 3 * block_size + 1 + 40], dtype=np.int32)
    t = cu[-1]
    q = rng.standard_normal((t, 8, 32)).astype(np.float32)
    k, v = rng.standard_normal((2, t, 2, 32)).astype(np.float32)
    tables, k_cache, v_cache = scatter_paged(rng, cu, block_size, k, v)
    # the whole sequence as one chunk: equals contiguous causal attention
    got = paged_prefix_attention(q, k_cache, v_cache, tables, cu, np.diff(cu).astype(np.int32))
    np.testing.assert_allclose(got, varlen_attention(q, k, v, cu), rtol=1e-5, atol=1e-6)
    # the last 3 tokens of each (long enough) sequence as the chunk
    lens = np.diff(cu)
    q_lens = np.minimum(lens, 3)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    rows = np.concatenate([np.arange(cu[i + 1] - q_lens[i], cu[i + 1]) for i in range(len(lens))])
    got = paged_prefix_attention(q[rows], k_cache, v_cache, tables, cu_q, lens.astype(np.int32))
    np.testing.assert_allclose(got, varlen_attention(q, k, v, cu)[rows], rtol=1e-5, atol=1e-6)


def test_argument_checks():
    q = np.zeros((4, 8, 64), np.float16)
    k3, k = np.zeros((4, 3, 64), np.float16), np.zeros((4, 2, 64), np.float16)
    cu = np.array([0, 4], np.int32)
    with pytest.raises(ValueError, match="q: got 8 heads"):
        flash_attention(q, k3, k3, cu)
    with pytest.raises(ValueError, match="cu_seqlens: got dtype int64"):
        flash_attention(q, k, k, cu.astype(np.int64))
    with pytest.raises(ValueError, match=r"v: got shape"):
        flash_attention(q, k, k[:3], cu)
    with pytest.raises(ValueError, match="k: got dtype float32"):
        flash_attention(q, k.astype(np.float32), k, cu)
    with pytest.raises(ValueError, match="k: must be C-contiguous"):
        flash_attention(q, k3[:, :2], k, cu)
    cache = np.zeros((2, 16, 2, 64), np.float16)
    with pytest.raises(ValueError, match="context_lens: got shape"):
        flash_attention_paged(q, cache, cache, np.zeros((1, 2), np.int32), cu, np.array([4, 4], np.int32))


def test_numpy_path_fp32_and_out():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((6, 4, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, 6, 2, 8)).astype(np.float32)
    out = np.empty_like(q)
    res = flash_attention(q, k, v, np.array([0, 2, 6], np.int32), out=out)
    assert res is out
    np.testing.assert_allclose(out, varlen_attention(q, k, v, np.array([0, 2, 6])), rtol=1e-6)


# ------------------------------------------------------------------------------------ GPU
def _rand(cp, rng, shape, dtype, mag=1.0):
    x = (rng.standard_normal(shape) * mag).astype(np.float32).astype(dtype)  # rounded inputs
    return x, cp.asarray(x)


def run_contiguous(cp, kernel, q, k, v, cu, causal, out, window=0, softcap=None):
    """flash_attention with the device's kernel (kernel None), the sm_80 one ("mma", on any device) or
    the device's on 3 CTAs ("few")."""
    if kernel is None:
        return flash_attention(q, k, v, cp.asarray(cu), causal, out=out, window=window, softcap=softcap)
    d = q.shape[-1]
    tile = tile_config(d, 80) if kernel == "mma" else device_tile(d)
    launch_kernel(q, k, v, out, cp.asarray(cu), None, None, 0, len(cu) - 1, int(np.diff(cu).max()), d ** -0.5,
                  causal, tile, window=window, softcap=softcap, ctas=FEW_CTAS[kernel])


# None: the kernel the device gets (wgmma on sm_90 for head_dim 64 / 128 / 256); "mma": the mma.sync
# kernel, which other devices and head dims get, tested on every device; "few": the device's kernel
# on a grid of 3 CTAs, so that a persistent CTA walks many work items (its ring, Q and page-fix
# barriers going through many phases). "cp.async" (paged): the sm_90 producer of pages < 8 rows, on 2.
KERNELS = pytest.mark.parametrize("kernel", [None, "mma", "few"])
FEW_CTAS = {"mma": None, "few": 3, "cp.async": 2, "fp8-mma": None}


seq_len = st.one_of(st.sampled_from([0, 1, 2, 15, 16, 17, 63, 64, 65, 111, 127, 128, 129, 989]),
                    st.integers(1, 700))
# sliding windows at the key tiles' edges (BLOCK_N 32, 64, 128) and past them
windows = st.one_of(st.sampled_from([1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 129, 257]), st.integers(1, 600))


@pytest.mark.gpu
@KERNELS
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(seq_len, min_size=1, max_size=5), ratio=st.sampled_from([1, 3, 4, 7, 8]),
       n_kv=st.sampled_from([1, 2]), d=st.sampled_from(HEAD_DIMS), dtype=st.sampled_from(DTYPES),
       causal=st.booleans(), mag=st.sampled_from([0.5, 1.0, 4.0]), seed=st.integers(0, 2**31))
def test_flash_attention_kernel(cp, kernel, lens, ratio, n_kv, d, dtype, causal, mag, seed):
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1])
    q, q_d = _rand(cp, rng, (t, n_kv * ratio, d), dtype, mag)  # mag scales the scores: saturated softmax
    k, k_d = _rand(cp, rng, (t, n_kv, d), dtype)
    v, v_d = _rand(cp, rng, (t, n_kv, d), dtype)
    out = poison(cp, q.shape, dtype)
    run_contiguous(cp, kernel, q_d, k_d, v_d, cu, causal, out)
    assert_close(out, varlen_attention(q, k, v, cu, causal), dtype)


@pytest.mark.gpu
@KERNELS
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(seq_len, min_size=1, max_size=4), window=windows, ratio=st.sampled_from([1, 4, 7]),
       d=st.sampled_from(HEAD_DIMS), dtype=st.sampled_from(DTYPES), softcap=st.sampled_from([None, 0.5, 50.0]),
       seed=st.integers(0, 2**31))
def test_flash_attention_kernel_window(cp, kernel, lens, window, ratio, d, dtype, softcap, seed):
    """Windows, and Gemma 2's score cap (0.5: every score saturated; 50: its value, mostly linear)."""
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1])
    q, q_d = _rand(cp, rng, (t, 2 * ratio, d), dtype, 2.0)
    k, k_d = _rand(cp, rng, (t, 2, d), dtype)
    v, v_d = _rand(cp, rng, (t, 2, d), dtype)
    out = poison(cp, q.shape, dtype)
    run_contiguous(cp, kernel, q_d, k_d, v_d, cu, True, out, window, softcap)
    assert_close(out, varlen_attention(q, k, v, cu, True, window=window, softcap=softcap), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [None, "mma", "cp.async", "few", "fp8", "fp8-mma"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ctx=st.lists(seq_len, min_size=1, max_size=4), data=st.data(), window=windows, ratio=st.sampled_from([1, 4, 8]),
       d=st.sampled_from(HEAD_DIMS), dtype=st.sampled_from(DTYPES), block_size=st.sampled_from([8, 16, 32]),
       seed=st.integers(0, 2**31))
def test_flash_attention_paged_kernel_window(cp, kernel, ctx, data, window, ratio, d, dtype, block_size, seed):
    """Chunks at the end of long contexts: the key tiles before the window are never read (NaN there)."""
    q_lens = [data.draw(st.sampled_from(sorted({0, 1, min(n, 3), min(n, 17), n}))) for n in ctx]
    paged_kernel_case(cp, kernel, ctx, q_lens, ratio, d, dtype, block_size, seed, window)


@pytest.mark.gpu
@KERNELS
@pytest.mark.parametrize("s,d,dtype", [(8191, 128, np.float16), (8193, 64, runtime.bfloat16),
                                       (4097, 256, np.float16)])
def test_flash_attention_long(cp, kernel, s, d, dtype):
    rng = np.random.default_rng(s)
    q, q_d = _rand(cp, rng, (s, 2, d), dtype)
    k, k_d = _rand(cp, rng, (s, 1, d), dtype)
    v, v_d = _rand(cp, rng, (s, 1, d), dtype)
    cu = np.array([0, s], np.int32)
    out = poison(cp, q.shape, dtype)
    run_contiguous(cp, kernel, q_d, k_d, v_d, cu, True, out)
    assert_close(out, varlen_attention(q, k, v, cu, True), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [None, "mma", "cp.async", "few", "fp8", "fp8-mma"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ctx=st.lists(seq_len, min_size=1, max_size=4), data=st.data(), ratio=st.sampled_from([1, 4, 7, 8]),
       d=st.sampled_from(HEAD_DIMS), dtype=st.sampled_from(DTYPES), block_size=st.sampled_from([8, 16, 32]),
       seed=st.integers(0, 2**31))
def test_flash_attention_paged_kernel(cp, kernel, ctx, data, ratio, d, dtype, block_size, seed):
    q_lens = [data.draw(st.sampled_from(sorted({0, 1, min(n, 3), n, n // 2}))) for n in ctx]
    paged_kernel_case(cp, kernel, ctx, q_lens, ratio, d, dtype, block_size, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [None, "mma", "cp.async", "fp8", "fp8-mma"])
def test_flash_attention_paged_kernel_empty_context(cp, kernel):
    """A query row with no key (context 0) gives zeros. Both kernels once copied Q there without waiting
    for it CTA-wide, and the copies could land over the zeros staged in sQ (hypothesis found ctx=[0],
    ratio 7 on the cp.async producer; compute-sanitizer racecheck the same race in the sm_80 kernel)."""
    for d in HEAD_DIMS:
        for ctx, q_lens in (([0], [1]), ([0, 37], [1, 5])):
            paged_kernel_case(cp, kernel, ctx, q_lens, 7, d, np.dtype(np.float16), 8, 0)


def paged_kernel_case(cp, kernel, ctx, q_lens, ratio, d, dtype, block_size, seed, window=0):
    """With a window, the keys of every whole 128-key tile before the window of a chunk's first query
    (no BLOCK_N reads them) are NaN in the cache; the reference gets them clean. kernel "fp8": the caches
    as fp8 codes (NaN: 0x7f) through the op (on sm_90 at d = 64 / 128 / 256 its pages decoded for the wgmma
    kernel), "fp8-mma": the mma.sync kernel decoding them itself; the reference over the same codes."""
    rng = np.random.default_rng(seed)
    cu_kv = np.concatenate([[0], np.cumsum(ctx)]).astype(np.int32)
    k, _ = _rand(cp, rng, (int(cu_kv[-1]), 2, d), dtype)
    v, _ = _rand(cp, rng, (int(cu_kv[-1]), 2, d), dtype)
    tables, k_cache, v_cache = scatter_paged(rng, cu_kv, block_size, k, v)
    k_dev, v_dev = k_cache.copy(), v_cache.copy()
    for i, (n, m) in enumerate(zip(ctx, q_lens)):
        t = np.arange(max(0, n - m - window + 1) // 128 * 128 if window else 0)  # positions never read
        k_dev[tables[i, t // block_size], t % block_size] = v_dev[tables[i, t // block_size], t % block_size] = np.nan
    if kernel in ("fp8", "fp8-mma"):
        k_cache, v_cache, k_dev, v_dev = (fp8.encode_e4m3(a) for a in (k_cache, v_cache, k_dev, v_dev))
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q, q_d = _rand(cp, rng, (int(cu_q[-1]), 2 * ratio, d), dtype)
    lens = np.array(ctx, np.int32)
    out = poison(cp, q.shape, dtype)
    args = (q_d, cp.asarray(k_dev), cp.asarray(v_dev))
    if kernel in (None, "fp8"):
        flash_attention_paged(*args, cp.asarray(tables), cp.asarray(cu_q), cp.asarray(lens), out=out, window=window)
    else:
        if kernel == "cp.async" and runtime.device_info()["arch"] != "sm_90":
            return
        tile = {"mma": tile_config(d, 80), "cp.async": tile_config(d, 90, block_size=4),
                "fp8-mma": tile_config(d, 90, block_size, fp8_cache=True)}.get(kernel)
        launch_kernel(*args, out, cp.asarray(cu_q), cp.asarray(lens), cp.asarray(tables), block_size, len(ctx),
                      max(q_lens), d ** -0.5, True, tile or device_tile(d, block_size), window=window,
                      ctas=FEW_CTAS[kernel])
    assert_close(out, paged_prefix_attention(q, k_cache, v_cache, tables, cu_q, lens, window=window), dtype)


@pytest.mark.gpu
def test_kernel_argument_checks(cp):
    q, k = cp.zeros((4, 2, 72), cp.float16), cp.zeros((4, 1, 72), cp.float16)
    with pytest.raises(ValueError, match="head_dim 72"):
        flash_attention(q, k, k, cp.asarray([0, 4], dtype=cp.int32))
    q = cp.zeros((4, 2, 64), cp.float32)
    with pytest.raises(ValueError, match="q: got dtype float32"):
        flash_attention(q, q, q, cp.asarray([0, 4], dtype=cp.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_pages(cp, dtype):
    """Every entry of the tables, decoded into a new pool (NaN codes stay NaN), tables renumbered in row order."""
    from cuinfer.ops.flash_attention import decode_pages

    rng = np.random.default_rng(5)
    k, v = (rng.integers(0, 256, (9, 16, 2, 80)).astype(np.uint8) for _ in range(2))
    tables = np.array([[3, 0, 8], [8, 8, 1]], np.int32)
    k_out, v_out, renumbered = decode_pages(cp.asarray(k), cp.asarray(v), cp.asarray(tables), dtype)
    np.testing.assert_array_equal(cp.asnumpy(renumbered), np.arange(6).reshape(2, 3))
    for got, codes in ((k_out, k), (v_out, v)):
        assert got.dtype == dtype and got.shape == (6, 16, 2, 80)
        want, got = fp8.decode_e4m3(codes[tables.ravel()]).astype(dtype), cp.asnumpy(got)
        nan = np.isnan(want.astype(np.float32))  # any NaN pattern
        np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
        np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
