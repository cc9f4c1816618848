"""paged_attention (decode): reference against contiguous attention, kernel (split-K + merge) against reference."""
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuinfer.ops import family_module, fp8, runtime
from cuinfer.ops.attention_ref import paged_prefix_attention, varlen_attention
from cuinfer.ops.paged_attention import HEAD_DIMS, WARPS, cta_warps, paged_attention, split_bound, split_config
from tests.conftest import assert_close, poison
from tests.ops.test_flash_attention import attention_loops, scatter_paged
from tests.ops.test_write_kv import inv_freq_for

DTYPES = [np.dtype(np.float16), runtime.bfloat16]


def decode_reference(q, k_cache, v_cache, tables, lens, window=0):
    cu = np.arange(len(lens) + 1, dtype=np.int32)
    return paged_prefix_attention(q, k_cache, v_cache, tables, cu, lens, window=window)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reference_is_last_row_of_contiguous(block_size):
    rng = np.random.default_rng(block_size)
    lens = np.array([1, block_size - 1, block_size + 1, 3 * block_size, 0], np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    k, v = rng.standard_normal((2, cu[-1], 2, 16)).astype(np.float32)
    q_full = rng.standard_normal((cu[-1], 6, 16)).astype(np.float32)
    tables, k_cache, v_cache = scatter_paged(rng, cu, block_size, k, v)
    last = np.maximum(cu[1:] - 1, 0)
    got = paged_attention(q_full[last], k_cache, v_cache, tables, lens)
    want = varlen_attention(q_full, k, v, cu)[last]
    want[lens == 0] = 0  # an empty context gives zeros
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    i = 3  # and against the float64 loops
    ref = attention_loops(q_full[cu[i]:cu[i + 1]], k[cu[i]:cu[i + 1]], v[cu[i]:cu[i + 1]], 0.25, True)[-1]
    np.testing.assert_allclose(got[i], ref, rtol=1e-5, atol=1e-6)


def test_split_config():
    """The fewest splits whose grid keeps 3/4 of the SMs' resident warps busy (132 SMs, 20 warps each
    for G <= 4): the choices the H100 sweep of every split and warp count found fastest."""
    assert split_config(32, 8, 512, 132) == (1, 512)  # 256 CTAs of 8 warps: one wave, no merge
    assert split_config(16, 8, 512, 132) == (2, 256)  # 128 CTAs would fill half of it
    assert split_config(8, 8, 2048, 132) == (4, 512)
    assert split_config(64, 8, 1024, 132) == (1, 1024)  # 512 CTAs of 5 warps
    assert split_config(16, 8, 4096, 132) == (4, 1024)  # at least 4 splits of 1024 tokens
    assert split_config(1, 8, 32768, 132) == (32, 1024)
    assert split_config(1, 8, 512, 132) == (16, 32)  # never fills 3/4: as many splits as 32 tokens allow
    assert split_config(256, 8, 100, 132) == (1, 128)
    assert split_config(3, 1, 1, 132) == (1, 32)
    assert split_config(3, 2, 4097, 132, 8)[0] > split_config(3, 2, 5000, 132, 8)[0]  # rounded: not monotonic
    for seqs, kv, group in ((1, 8, 4), (3, 2, 8), (16, 8, 4), (32, 8, 4)):  # split_bound sizes workspaces:
        bounds = [split_bound(seqs, kv, c, 132, group) for c in range(1, 9000, 7)]  # it must not decrease
        assert bounds == sorted(bounds)
        assert all(split_config(seqs, kv, c, 132, group)[0] <= b for c, b in zip(range(1, 9000, 7), bounds))


def test_cta_warps():
    assert cta_warps(256, 4, 132) == 8  # 2 CTAs of 8 warps an SM: one wave
    assert cta_warps(512, 4, 132) == 5  # 4 CTAs of 5 warps an SM, one wave
    assert cta_warps(640, 4, 132) == 4  # 5 CTAs of 4 warps
    assert cta_warps(768, 4, 132) == 6  # two full waves of 3 CTAs of 6; 4 warps would leave a 16 % wave
    assert cta_warps(396, 2, 132) == 6 and cta_warps(397, 2, 132) == 5
    assert cta_warps(48, 4, 132) == 8 and cta_warps(2048, 1, 132) == 5
    assert cta_warps(48, 8, 132) == 4  # G = 8: 168 registers, 4 warps only


def test_rows_in_flight():
    """U = 4 where four loop steps cover the split, else 8 (G <= 4, D <= 128); every launch the op
    can make is a registered instantiation."""
    pa = family_module("paged_attention")
    assert pa.rows_in_flight(4, 128, 32, 8) == 4 and pa.rows_in_flight(4, 128, 64, 8) == 4
    assert pa.rows_in_flight(4, 128, 65, 8) == 8 and pa.rows_in_flight(4, 128, 416, 4) == 8
    assert pa.rows_in_flight(4, 64, 128, 8) == 4 and pa.rows_in_flight(4, 64, 129, 8) == 8
    assert pa.rows_in_flight(8, 64, 1024, 4) == 4 and pa.rows_in_flight(2, 256, 1024, 8) == 4
    for seqs, ctx, d, (heads, kv) in itertools.product((1, 3, 32, 256), (1, 100, 512, 4096, 40000), pa.HEAD_DIMS,
                                                      ((32, 8), (9, 3), (32, 32), (32, 4))):
        group = pa.padded_group(heads, kv)
        n_splits, partition = pa.split_config(seqs, kv, ctx, 132, group)
        warps = pa.cta_warps(n_splits * kv * seqs, group, 132)
        u = pa.rows_in_flight(group, d, partition, warps)
        for dtype, new_kv, fp8_cache in itertools.product((np.float16, runtime.bfloat16), (False, True),
                                                          (False, True)):
            cache = fp8.FP8 if fp8_cache else dtype
            mma = pa.tensor_cores(d, partition, warps)
            assert pa.instantiation(dtype, d, group, u, new_kv, warps, cache, mma) in pa.INSTANTIATIONS


def test_tensor_cores():
    """The tensor-core loops for D = 64, 96, 128 in splits past one loop step of the lane loops at U = 8."""
    pa = family_module("paged_attention")
    assert pa.tensor_cores(128, 384, 5) and pa.tensor_cores(96, 1024, 4) and pa.tensor_cores(64, 288, 8)
    assert not pa.tensor_cores(128, 128, 8) and pa.tensor_cores(128, 160, 8)  # 8 steps of 16 rows
    assert not pa.tensor_cores(64, 256, 8) and not pa.tensor_cores(256, 1024, 4) and not pa.tensor_cores(80, 1024, 4)


def test_argument_checks():
    q = np.zeros((2, 8, 64), np.float16)
    cache = np.zeros((4, 16, 2, 64), np.float16)
    tables, lens = np.zeros((2, 2), np.int32), np.array([3, 4], np.int32)
    with pytest.raises(ValueError, match="block_tables: got shape"):
        paged_attention(q, cache, cache, tables[:1], lens)
    with pytest.raises(ValueError, match="v_cache: got shape"):
        paged_attention(q, cache, cache[:, :8], tables, lens)
    with pytest.raises(ValueError, match="context_lens: got dtype int64"):
        paged_attention(q, cache, cache, tables, lens.astype(np.int64))
    with pytest.raises(ValueError, match="q: got 8 heads"):
        cache3 = np.zeros((4, 16, 3, 64), np.float16)
        paged_attention(q, cache3, cache3, tables, lens)


ctx_len = st.one_of(st.sampled_from([0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 255, 256, 257, 1023, 1025]),
                    st.integers(1, 3000))


@pytest.mark.gpu
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(ctx_len, min_size=1, max_size=9), ratio=st.sampled_from([1, 3, 4, 7, 8]),
       n_kv=st.sampled_from([1, 2, 3]), d=st.sampled_from(HEAD_DIMS), dtype=st.sampled_from(DTYPES),
       block_size=st.sampled_from([8, 16, 32]), mag=st.sampled_from([0.5, 1.0, 4.0]), fp8_cache=st.booleans(),
       seed=st.integers(0, 2**31))
def test_paged_attention_kernel(cp, lens, ratio, n_kv, d, dtype, block_size, mag, fp8_cache, seed):
    """fp8_cache: the caches as E4M3 codes (NaN where no sequence owns a slot: 0x7f), the reference over them."""
    rng = np.random.default_rng(seed)
    lens = np.array(lens, np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    k = rng.standard_normal((cu[-1], n_kv, d)).astype(np.float32).astype(dtype)
    v = rng.standard_normal((cu[-1], n_kv, d)).astype(np.float32).astype(dtype)
    tables, k_cache, v_cache = scatter_paged(rng, cu, block_size, k, v)
    if fp8_cache:
        k_cache, v_cache = fp8.encode_e4m3(k_cache), fp8.encode_e4m3(v_cache)
    q = (rng.standard_normal((len(lens), n_kv * ratio, d)) * mag).astype(np.float32).astype(dtype)
    out = poison(cp, q.shape, dtype)
    paged_attention(cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), cp.asarray(tables),
                    cp.asarray(lens), out=out)
    assert_close(out, decode_reference(q, k_cache, v_cache, tables, lens), dtype)


@pytest.mark.gpu
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(ctx_len, min_size=1, max_size=6), window=st.one_of(
           st.sampled_from([1, 2, 7, 8, 9, 31, 32, 33, 1023, 1024, 1025]), st.integers(1, 3000)),
       ratio=st.sampled_from([1, 4, 7, 8]), d=st.sampled_from(HEAD_DIMS), dtype=st.sampled_from(DTYPES),
       block_size=st.sampled_from([8, 16, 32]), softcap=st.sampled_from([None, 0.5, 50.0]),
       seed=st.integers(0, 2**31))
def test_paged_attention_kernel_window(cp, lens, window, ratio, d, dtype, block_size, softcap, seed):
    """Only the last `window` keys count, and the rows before them are never read (NaN there); with
    and without Gemma 2's score cap."""
    rng = np.random.default_rng(seed)
    lens = np.array(lens, np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    k, v = (rng.standard_normal((cu[-1], 2, d)).astype(np.float32).astype(dtype) for _ in range(2))
    tables, k_cache, v_cache = scatter_paged(rng, cu, block_size, k, v)
    q = (rng.standard_normal((len(lens), 2 * ratio, d)) * 2).astype(np.float32).astype(dtype)
    k_dev, v_dev = k_cache.copy(), v_cache.copy()
    for i, n in enumerate(lens):
        t = np.arange(max(0, int(n) - window))
        k_dev[tables[i, t // block_size], t % block_size] = v_dev[tables[i, t // block_size], t % block_size] = np.nan
    out = poison(cp, q.shape, dtype)
    paged_attention(cp.asarray(q), cp.asarray(k_dev), cp.asarray(v_dev), cp.asarray(tables), cp.asarray(lens),
                    out=out, window=window, softcap=softcap)
    cu = np.arange(len(lens) + 1, dtype=np.int32)
    want = paged_prefix_attention(q, k_cache, v_cache, tables, cu, lens, window=window, softcap=softcap)
    assert_close(out, want, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(("lens", "ratio", "d"), [([20000], 4, 128), ([8193, 1, 5000], 8, 64), ([12345], 7, 256),
                                             ([40000], 4, 128)])  # the last: 157 splits, more than the merge threads
def test_paged_attention_long_split(cp, lens, ratio, d):
    rng = np.random.default_rng(len(lens))
    lens = np.array(lens, np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    k, v = rng.standard_normal((2, cu[-1], 2, d)).astype(np.float16)
    tables, k_cache, v_cache = scatter_paged(rng, cu, 16, k, v)
    q = rng.standard_normal((len(lens), 2 * ratio, d)).astype(np.float16)
    out = poison(cp, q.shape, np.float16)
    paged_attention(cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), cp.asarray(tables),
                    cp.asarray(lens), out=out)
    assert_close(out, decode_reference(q, k_cache, v_cache, tables, lens))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("ratio", "d"), [(4, 128), (8, 64), (1, 256)])
def test_split_arrival_counters_reset(cp, dtype, ratio, d):
    """The last CTA of each (sequence, KV head) merges and zeroes its arrival counter: every call twice
    on one workspace into a NaN-poisoned out, other context lengths, a fixed split count (max_context_len)
    or one per call (from the largest context)."""
    from cuinfer.ops.paged_attention import decode_splits, workspace_elems

    rng = np.random.default_rng(ratio * d)
    num_seqs, n_kv, max_ctx = 3, 2, 5000
    n_heads = n_kv * ratio
    assert decode_splits(num_seqs, n_heads, n_kv, max_ctx)[0] > 1
    ws = cp.zeros(workspace_elems(num_seqs, n_heads, n_kv, d, max_ctx), cp.float32)
    cu = np.arange(num_seqs + 1, dtype=np.int32) * max_ctx
    k, v = (rng.standard_normal((cu[-1], n_kv, d)).astype(np.float32).astype(dtype) for _ in range(2))
    tables, k_cache, v_cache = scatter_paged(rng, cu, 16, k, v)
    k_d, v_d, tables_d = cp.asarray(k_cache), cp.asarray(v_cache), cp.asarray(tables)
    for bound in (max_ctx, None):
        for lens in ([5000, 1, 2999], [0, 4097, 33], [1, 1, 1]):
            lens = np.array(lens, np.int32)
            q = rng.standard_normal((num_seqs, n_heads, d)).astype(np.float32).astype(dtype)
            got = []
            for _ in range(2):
                out = poison(cp, q.shape, dtype)
                paged_attention(cp.asarray(q), k_d, v_d, tables_d, cp.asarray(lens), out=out, max_context_len=bound,
                                workspace=ws)
                assert not cp.asnumpy(ws[:num_seqs * n_kv].view(cp.int32)).any()  # the counters lead the workspace
                got.append(cp.asnumpy(out))
            assert_close(got[0], decode_reference(q, k_cache, v_cache, tables, lens), dtype)
            np.testing.assert_array_equal(got[1], got[0])


@pytest.mark.gpu
def test_matches_flash_attention_paged_decode(cp):
    from cuinfer.ops.flash_attention import flash_attention_paged

    rng = np.random.default_rng(5)
    lens = np.array([1, 300, 77], np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    k, v = rng.standard_normal((2, cu[-1], 2, 128)).astype(np.float16)
    tables, k_cache, v_cache = (cp.asarray(a) for a in scatter_paged(rng, cu, 16, k, v))
    q = cp.asarray(rng.standard_normal((3, 8, 128)).astype(np.float16))
    a = paged_attention(q, k_cache, v_cache, tables, cp.asarray(lens))
    b = flash_attention_paged(q, k_cache, v_cache, tables, cp.arange(4, dtype=cp.int32), cp.asarray(lens))
    assert_close(a, cp.asnumpy(b).astype(np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_graph_capture_write_kv_and_decode(cp, dtype):
    """write_kv + paged_attention captured once on a non-blocking stream, replayed with new q/k/v and
    other context lengths (longer, shorter, the captured maximum) copied into the same buffers."""
    from cuinfer.ops.paged_attention import workspace_elems
    from cuinfer.ops.write_kv import write_kv, write_kv_reference
    from tests.ops.test_write_kv import inv_freq_for

    rng = np.random.default_rng(11)
    num_seqs, n_heads, n_kv, d, bs, max_ctx = 3, 8, 2, 128, 16, 3000
    max_blocks = -(-max_ctx // bs)
    tables = rng.permutation(num_seqs * max_blocks + 1)[:num_seqs * max_blocks]
    tables = tables.reshape(num_seqs, max_blocks).astype(np.int32)
    cache_shape = (num_seqs * max_blocks + 1, bs, n_kv, d)
    k_cache, v_cache = (cp.asarray(rng.standard_normal(cache_shape).astype(np.float32).astype(dtype))
                        for _ in range(2))
    tables_d, lens_d, inv = cp.asarray(tables), cp.zeros(num_seqs, cp.int32), cp.asarray(inv_freq_for(d))
    q_d, q_rot, out = (cp.empty((num_seqs, n_heads, d), dtype) for _ in range(3))
    k_d, v_d = (cp.empty((num_seqs, n_kv, d), dtype) for _ in range(2))
    pos_d, slot_d = cp.empty(num_seqs, cp.int32), cp.empty(num_seqs, cp.int32)
    ws = cp.zeros(max(1, workspace_elems(num_seqs, n_heads, n_kv, d, max_ctx)), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)

    def step():
        write_kv(q_d, k_d, v_d, pos_d, k_cache, v_cache, slot_d, inv, out=q_rot)
        paged_attention(q_rot, k_cache, v_cache, tables_d, lens_d, out=out, max_context_len=max_ctx, workspace=ws)

    def feed(lens):
        """New inputs for one decode step, copied into the static buffers on the capture stream."""
        lens = np.array(lens, np.int32)
        pos = lens - 1
        host = {"q": rng.standard_normal((num_seqs, n_heads, d)), "k": rng.standard_normal((num_seqs, n_kv, d)),
                    "v": rng.standard_normal((num_seqs, n_kv, d))}
        host = {name: a.astype(np.float32).astype(dtype) for name, a in host.items()}
        host.update(pos=pos, lens=lens, slots=(tables[np.arange(num_seqs), pos // bs] * bs + pos % bs).astype(np.int32))
        with stream:
            for buf, name in ((q_d, "q"), (k_d, "k"), (v_d, "v"), (pos_d, "pos"), (lens_d, "lens"), (slot_d, "slots")):
                buf.set(host[name])
            out.fill(np.nan)
            q_rot.fill(np.nan)
        return host

    cp.cuda.Device().synchronize()  # the buffers above were written on the default stream
    feed([10, 20, 30])
    with stream:
        step()  # eagerly once: kernels compiled, nothing left to allocate
        stream.synchronize()
        stream.begin_capture()
        try:
            with pytest.raises(ValueError, match="workspace"):
                paged_attention(q_rot, k_cache, v_cache, tables_d, lens_d, out=out, max_context_len=max_ctx)
        finally:
            stream.end_capture()
        stream.begin_capture()
        step()
        graph = stream.end_capture()
    for lens in ([1000, 2999, 1], [max_ctx, 17, 2048]):
        kc, vc = cp.asnumpy(k_cache), cp.asnumpy(v_cache)
        host = feed(lens)
        graph.launch(stream)
        stream.synchronize()
        q_ref = write_kv_reference(host["q"], host["k"], host["v"], host["pos"], kc, vc, host["slots"],
                                   inv_freq_for(d))
        assert_close(q_rot, q_ref, dtype)
        assert_close(k_cache, kc.astype(np.float32), dtype)
        assert np.array_equal(cp.asnumpy(v_cache), vc)
        got = cp.asnumpy(out)  # checked on the inputs it read: the rotated q and caches on the device
        ref = decode_reference(cp.asnumpy(q_rot), cp.asnumpy(k_cache), vc, tables, host["lens"])
        assert_close(got, ref, dtype)
        eager = paged_attention(q_rot, k_cache, v_cache, tables_d, lens_d, max_context_len=max_ctx)
        assert np.array_equal(cp.asnumpy(eager), got)  # same grid and arithmetic as the replay


# ---------------------------------------------------------------- new_kv: RoPE + cache write fused in
def split_qkv(qkv, n_heads, n_kv, d):
    """q [rows, n_heads, d], k, v [rows, n_kv, d]: views of a qkv buffer [rows, (n_heads + 2 n_kv) d + pad]."""
    nq, nkv, rows = n_heads * d, n_kv * d, qkv.shape[0]
    return (qkv[:, :nq].reshape(rows, n_heads, d), qkv[:, nq:nq + nkv].reshape(rows, n_kv, d),
            qkv[:, nq + nkv:nq + 2 * nkv].reshape(rows, n_kv, d))


def new_token_case(rng, lens, ratio, n_kv, d, dtype, block_size, pad=0, drop=0.0, fp8_cache=False,
                   per_row_freq=False):
    """NumPy inputs of a fused decode step: each sequence's context (random K/V, NaN elsewhere in the cache and
    in the rows the call writes), a qkv buffer for the new tokens and the slots of their positions lens - 1 (a
    spare block's slots where a length is 0, -1 for a `drop` fraction of rows); fp8_cache: the caches as E4M3
    codes (NaN: 0x7f); per_row_freq: RoPE frequencies a row each (longrope's short or long ones per sequence)."""
    lens = np.array(lens, np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    k, v = (rng.standard_normal((cu[-1], n_kv, d)).astype(np.float32).astype(dtype) for _ in range(2))
    tables, k_cache, v_cache = scatter_paged(rng, cu, block_size, k, v)
    owned = {int(tables[i, j]) for i, n in enumerate(lens) for j in range(-(-int(n) // block_size))}
    spare = min(set(range(k_cache.shape[0])) - owned)
    pos = np.maximum(lens - 1, 0)
    slots = np.where(lens > 0, tables[np.arange(len(lens)), pos // block_size] * block_size + pos % block_size,
                     spare * block_size + np.arange(len(lens)))
    slots[rng.random(len(lens)) < drop] = -1
    for cache in (k_cache, v_cache):  # a row about to be written holds no data yet (a fresh block is NaN)
        cache.reshape(-1, n_kv, d)[slots[(slots >= 0) & (lens > 0)]] = np.nan
    if fp8_cache:
        k_cache, v_cache = fp8.encode_e4m3(k_cache), fp8.encode_e4m3(v_cache)
    width = (n_kv * ratio + 2 * n_kv) * d + pad
    qkv = rng.standard_normal((len(lens), width)).astype(np.float32).astype(dtype)
    inv_freq = inv_freq_for(d, 500000.0)
    if per_row_freq:
        inv_freq = (inv_freq * rng.choice([1.0, 0.25, 1 / 3], size=(len(lens), 1))).astype(np.float32)
    return {"qkv": qkv, "k_cache": k_cache, "v_cache": v_cache, "tables": tables, "lens": lens,
            "slots": slots.astype(np.int32), "inv_freq": inv_freq, "n_heads": n_kv * ratio, "n_kv": n_kv, "d": d}


def bits(a):
    """An array's bit pattern as a NumPy integer array (bitwise equality, NaN included)."""
    a = a.get() if runtime.is_device_array(a) else np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def device_case(cp, case, strided=True):
    """The case's arrays on the device: q, k, v (views of the qkv buffer, or contiguous copies) and the rest."""
    qkv = cp.asarray(case["qkv"])
    q, k, v = split_qkv(qkv, case["n_heads"], case["n_kv"], case["d"])
    if strided:  # views, not copies
        assert (q.data.ptr, k.data.ptr) == (qkv.data.ptr, qkv.data.ptr + q[0].nbytes)
    else:
        q, k, v = (cp.ascontiguousarray(a) for a in (q, k, v))
    return dict(qkv=qkv, q=q, k=k, v=v, **{name: cp.asarray(case[name]) for name in
                                           ("lens", "slots", "inv_freq", "tables", "k_cache", "v_cache")})


def write_kv_then_decode(cp, case, max_context_len, window=0, qk_norm=None):
    """(out, k_cache, v_cache) of write_kv at positions lens - 1 then paged_attention, on copies of the caches."""
    from cuinfer.ops.write_kv import write_kv

    a = device_case(cp, case, strided=False)
    slots = cp.where(a["lens"] > 0, a["slots"], -1).astype(cp.int32)
    pos = (a["lens"] - 1).astype(cp.int32)
    q_norm, k_norm, eps = qk_norm or (None, None, 1e-6)
    q_rot = write_kv(a["q"], a["k"], a["v"], pos, a["k_cache"], a["v_cache"], slots, a["inv_freq"], q_norm=q_norm,
                     k_norm=k_norm, eps=eps)
    out = paged_attention(q_rot, a["k_cache"], a["v_cache"], a["tables"], a["lens"], max_context_len=max_context_len,
                          window=window)
    return out, a["k_cache"], a["v_cache"]


def check_fused_matches_write_kv(cp, case, max_context_len=None, strided=True, window=0, qk_norm=False,
                                 chunk_rows=1):
    """paged_attention(new_kv=...) against write_kv then paged_attention: caches and output bit for bit
    (the same rounded q and K/V, the same split, the same arithmetic); qk_norm: with random q/k norm
    weights (and a random epsilon) in both; chunk_rows: a verify step's chunks (verify_case)."""
    b = device_case(cp, case, strided)
    norm = None
    if qk_norm:
        rng = np.random.default_rng(case["d"])
        q_norm, k_norm = (cp.asarray((1 + 0.5 * rng.standard_normal(case["d"])).astype(b["q"].dtype)) for _ in "qk")
        norm = (q_norm, k_norm, float(rng.choice([1e-6, 1e-5, 0.5])))
    out = poison(cp, b["q"].shape, b["q"].dtype)
    got = paged_attention(b["q"], b["k_cache"], b["v_cache"], b["tables"], b["lens"], out=out,
                          max_context_len=max_context_len, new_kv=(b["k"], b["v"], b["slots"], b["inv_freq"]),
                          qk_norm=norm, window=window, chunk_rows=chunk_rows)
    assert got is out
    for x, y in zip((out, b["k_cache"], b["v_cache"]), write_kv_then_decode(cp, case, max_context_len, window, norm)):
        np.testing.assert_array_equal(bits(x), bits(y))


def test_new_kv_numpy_path_composes_write_kv():
    """The NumPy path (strided q/k/v of one qkv buffer) is write_kv's reference at lens - 1, then attention."""
    from cuinfer.ops.write_kv import write_kv

    rng = np.random.default_rng(7)
    for dtype, fp8_cache, per_row in ((np.float32, False, False), (np.float16, False, True), (np.float16, True, False)):
        case = new_token_case(rng, [1, 16, 17, 0, 40], 3, 2, 64, dtype, 16, pad=8, drop=0.3, fp8_cache=fp8_cache,
                              per_row_freq=per_row)
        q, k, v = split_qkv(case["qkv"], 6, 2, 64)
        kc, vc = case["k_cache"].copy(), case["v_cache"].copy()
        got = paged_attention(q, kc, vc, case["tables"], case["lens"], new_kv=(k, v, case["slots"], case["inv_freq"]))
        kc_ref, vc_ref = case["k_cache"].copy(), case["v_cache"].copy()
        q_rot = write_kv(*(np.ascontiguousarray(a) for a in (q, k, v)), case["lens"] - 1, kc_ref, vc_ref,
                         np.where(case["lens"] > 0, case["slots"], -1).astype(np.int32), case["inv_freq"])
        np.testing.assert_array_equal(bits(kc), bits(kc_ref))
        np.testing.assert_array_equal(bits(vc), bits(vc_ref))
        np.testing.assert_array_equal(got, paged_attention(q_rot, kc_ref, vc_ref, case["tables"], case["lens"]))
        assert not np.isnan(got).any() and not got[3].any()  # the empty context: zeros, and no write


def test_qk_norm_numpy_path_composes_write_kv():
    """With qk_norm the NumPy path is write_kv's reference with the norms, then attention."""
    from cuinfer.ops.write_kv import write_kv

    rng = np.random.default_rng(8)
    case = new_token_case(rng, [1, 16, 17, 40], 3, 2, 64, np.float32, 16, pad=8)
    q, k, v = split_qkv(case["qkv"], 6, 2, 64)
    wq, wk = (1 + 0.3 * rng.standard_normal((2, 64))).astype(np.float32)
    kc, vc = case["k_cache"].copy(), case["v_cache"].copy()
    got = paged_attention(q, kc, vc, case["tables"], case["lens"], new_kv=(k, v, case["slots"], case["inv_freq"]),
                          qk_norm=(wq, wk, 1e-5))
    kc_ref, vc_ref = case["k_cache"].copy(), case["v_cache"].copy()
    q_rot = write_kv(*(np.ascontiguousarray(a) for a in (q, k, v)), case["lens"] - 1, kc_ref, vc_ref, case["slots"],
                     case["inv_freq"], q_norm=wq, k_norm=wk, eps=1e-5)
    np.testing.assert_array_equal(bits(kc), bits(kc_ref))
    np.testing.assert_array_equal(got, paged_attention(q_rot, kc_ref, vc_ref, case["tables"], case["lens"]))
    plain = paged_attention(q, case["k_cache"].copy(), case["v_cache"].copy(), case["tables"], case["lens"],
                            new_kv=(k, v, case["slots"], case["inv_freq"]))
    assert not np.allclose(got, plain)  # the norms change the result


def test_qk_norm_argument_checks():
    q = np.zeros((2, 8, 64), np.float16)
    cache = np.zeros((4, 16, 2, 64), np.float16)
    tables, lens = np.zeros((2, 2), np.int32), np.array([3, 4], np.int32)
    w = np.ones(64, np.float16)
    with pytest.raises(ValueError, match="qk_norm: needs new_kv"):
        paged_attention(q, cache, cache, tables, lens, qk_norm=(w, w, 1e-6))
    new_kv = (q[:, :2], q[:, :2], lens, np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="k_norm: got shape"):
        paged_attention(q, cache, cache, tables, lens, new_kv=new_kv, qk_norm=(w, w[:32], 1e-6))
    with pytest.raises(ValueError, match="q_norm: got dtype float32"):
        paged_attention(q, cache, cache, tables, lens, new_kv=new_kv, qk_norm=(w.astype(np.float32), w, 1e-6))
    with pytest.raises(ValueError, match="got eps 0"):
        paged_attention(q, cache, cache, tables, lens, new_kv=new_kv, qk_norm=(w, w, 0))


def test_new_kv_argument_checks():
    case = new_token_case(np.random.default_rng(1), [5, 9], 2, 2, 64, np.float16, 16)
    q, k, v = split_qkv(case["qkv"], 4, 2, 64)
    args = (case["k_cache"], case["v_cache"], case["tables"], case["lens"])
    with pytest.raises(ValueError, match="k: got strides"):
        paged_attention(q, *args, new_kv=(k.transpose(0, 2, 1).copy().transpose(0, 2, 1), v, case["slots"],
                                          case["inv_freq"]))
    with pytest.raises(ValueError, match="v: got shape"):
        paged_attention(q, *args, new_kv=(k, v[:1], case["slots"], case["inv_freq"]))
    with pytest.raises(ValueError, match="slot_mapping: got dtype int64"):
        paged_attention(q, *args, new_kv=(k, v, case["slots"].astype(np.int64), case["inv_freq"]))
    with pytest.raises(ValueError, match="inv_freq: got shape"):
        paged_attention(q, *args, new_kv=(k, v, case["slots"], case["inv_freq"][:16]))
    with pytest.raises(ValueError, match="inv_freq: got shape"):  # a row each: one per q row
        paged_attention(q, *args, new_kv=(k, v, case["slots"], np.tile(case["inv_freq"], (len(q) + 1, 1))))


@pytest.mark.gpu
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.one_of(st.sampled_from([1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 255, 256, 257, 1025]),
                               st.integers(0, 3000)), min_size=1, max_size=6),
       ratio=st.sampled_from([1, 4, 7, 8]), n_kv=st.sampled_from([1, 2]), d=st.sampled_from([64, 80, 96, 128, 256]),
       dtype=st.sampled_from(DTYPES), block_size=st.sampled_from([8, 16, 32]), pad=st.sampled_from([0, 8, 24]),
       strided=st.booleans(), drop=st.sampled_from([0.0, 0.3]), extra=st.sampled_from([None, 0, 1, 700]),
       qk_norm=st.booleans(), fp8_cache=st.booleans(), per_row_freq=st.booleans(), seed=st.integers(0, 2**31))
def test_new_kv_matches_write_kv_then_decode(cp, lens, ratio, n_kv, d, dtype, block_size, pad, strided, drop, extra,
                                             qk_norm, fp8_cache, per_row_freq, seed):
    case = new_token_case(np.random.default_rng(seed), lens, ratio, n_kv, d, dtype, block_size, pad, drop, fp8_cache,
                          per_row_freq)
    check_fused_matches_write_kv(cp, case, None if extra is None else max(lens) + extra, strided, qk_norm=qk_norm)


def verify_case(rng, prefixes, drafts, q, ratio, n_kv, d, dtype, block_size, pad=0, fp8_cache=False,
                per_row_freq=False):
    """A verify step's inputs (speculative decoding): sequence i has prefixes[i] tokens cached and drafts[i] + 1
    <= q new rows, its chunk rows i*q .. i*q + q - 1 (real rows first, then rows of length 0 and slot -1), each
    row with its own length, slot and a copy of the sequence's block table; the new rows' slots are NaN;
    per_row_freq: RoPE frequencies a row each, differing within a chunk."""
    new = np.array(drafts, np.int32) + 1
    case = new_token_case(rng, np.array(prefixes) + new, ratio, n_kv, d, dtype, block_size, pad, fp8_cache=fp8_cache)
    rows = len(prefixes) * q
    seq, j = np.divmod(np.arange(rows), q)
    real = j < new[seq]
    lens = np.where(real, np.array(prefixes)[seq] + j + 1, 0).astype(np.int32)
    pos = np.maximum(lens - 1, 0)
    tables = case["tables"][seq]
    slots = np.where(real, tables[np.arange(rows), pos // block_size] * block_size + pos % block_size, -1)
    for cache in (case["k_cache"], case["v_cache"]):  # the rows the step writes hold no data yet
        cache.reshape(-1, n_kv, d)[slots[real]] = 0x7F if fp8_cache else np.nan
    width = case["qkv"].shape[1]
    inv_freq = case["inv_freq"]
    if per_row_freq:
        inv_freq = (inv_freq * rng.choice([1.0, 0.25, 1 / 3], size=(rows, 1))).astype(np.float32)
    return dict(case, qkv=rng.standard_normal((rows, width)).astype(np.float32).astype(dtype), lens=lens,
                slots=slots.astype(np.int32), tables=np.ascontiguousarray(tables), inv_freq=inv_freq)


@pytest.mark.gpu
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=st.lists(st.tuples(st.one_of(st.sampled_from([0, 1, 7, 15, 31, 255, 1025]), st.integers(0, 3000)),
                                 st.integers(0, 16)), min_size=1, max_size=4),
       q_extra=st.sampled_from([0, 1, 3]), ratio=st.sampled_from([1, 3, 4, 8]), d=st.sampled_from(HEAD_DIMS),
       dtype=st.sampled_from(DTYPES), block_size=st.sampled_from([8, 16]), qk_norm=st.booleans(),
       window=st.sampled_from([0, 0, 1, 5, 300]), extra=st.sampled_from([None, 0, 700]), fp8_cache=st.booleans(),
       per_row_freq=st.booleans(), seed=st.integers(0, 2**31))
def test_new_kv_verify_chunks(cp, chunks, q_extra, ratio, d, dtype, block_size, qk_norm, window, extra, fp8_cache,
                              per_row_freq, seed):
    """chunk_rows: each row of a verify step writes its K/V and those of its chunk's rows before it, then attends:
    caches and output bit for bit those of write_kv over every row then paged_attention (short contexts take the
    staged path, long ones split; a window may leave the chunk's first rows unread)."""
    prefixes, drafts = (list(x) for x in zip(*chunks))
    q = max(drafts) + 1 + q_extra
    case = verify_case(np.random.default_rng(seed), prefixes, drafts, q, ratio, 2, d, dtype, block_size, pad=8,
                       fp8_cache=fp8_cache, per_row_freq=per_row_freq)
    check_fused_matches_write_kv(cp, case, None if extra is None else int(case["lens"].max()) + extra, window=window,
                                 qk_norm=qk_norm, chunk_rows=q)


def test_chunk_rows_checks():
    q = np.zeros((4, 8, 64), np.float16)
    cache = np.zeros((4, 16, 2, 64), np.float16)
    tables, lens = np.zeros((4, 2), np.int32), np.array([3, 4, 1, 0], np.int32)
    with pytest.raises(ValueError, match="chunk_rows: got 2 for 4 rows, need new_kv"):
        paged_attention(q, cache, cache, tables, lens, chunk_rows=2)
    new_kv = (q[:, :2], q[:, :2], lens, np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="chunk_rows: got 3 for 4 rows"):
        paged_attention(q, cache, cache, tables, lens, new_kv=new_kv, chunk_rows=3)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_cache", [False, True], ids=["", "fp8"])
@pytest.mark.parametrize("u", [4, 8, "mma"])
@pytest.mark.parametrize("warps", WARPS)
@pytest.mark.parametrize(("ratio", "d", "dtype"), [(4, 128, np.float16), (3, 64, runtime.bfloat16),
                                                   (2, 256, np.float16)])
def test_cta_widths(cp, monkeypatch, u, warps, ratio, d, dtype, fp8_cache):
    """Every CTA width and rows-in-flight count (cta_warps and rows_in_flight pick them from the grid,
    so small tests would see one), and the tensor-core loops at each width (tensor_cores picks them for
    long splits only), plain and fused, one split (staged rows when fused, but not with mma) and
    several; over an fp8 cache too."""
    if u != 4 and d > 128:
        pytest.skip("D > 128 takes U = 4 only, and not the tensor cores")
    monkeypatch.setattr(family_module("paged_attention"), "cta_warps", lambda *_: warps)
    monkeypatch.setattr(family_module("paged_attention"), "rows_in_flight", lambda *_: 8 if u == "mma" else u)
    monkeypatch.setattr(family_module("paged_attention"), "tensor_cores", lambda *_: u == "mma")
    rng = np.random.default_rng(warps * d)
    for lens in ([33, 1, 0, 70], [1300, 5]):
        lens_a = np.array(lens, np.int32)
        cu = np.concatenate([[0], np.cumsum(lens_a)]).astype(np.int32)
        k, v = (rng.standard_normal((cu[-1], 2, d)).astype(np.float32).astype(dtype) for _ in range(2))
        tables, k_cache, v_cache = scatter_paged(rng, cu, 16, k, v)
        if fp8_cache:
            k_cache, v_cache = fp8.encode_e4m3(k_cache), fp8.encode_e4m3(v_cache)
        q = rng.standard_normal((len(lens), 2 * ratio, d)).astype(np.float32).astype(dtype)
        out = poison(cp, q.shape, dtype)
        paged_attention(cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), cp.asarray(tables),
                        cp.asarray(lens_a), out=out)
        assert_close(out, decode_reference(q, k_cache, v_cache, tables, lens_a), dtype)
        for qk_norm in (False, True):
            case = new_token_case(rng, lens, ratio, 2, d, dtype, 16, pad=8, fp8_cache=fp8_cache)
            check_fused_matches_write_kv(cp, case, qk_norm=qk_norm)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("ratio", "d"), [(4, 128), (7, 80), (1, 96), (8, 64)])
def test_new_kv_split_boundaries(cp, dtype, ratio, d):
    """The new token first / last in a split, first in the last split, the whole context; batch 1 and 3."""
    from cuinfer.ops.paged_attention import decode_splits

    rng = np.random.default_rng(ratio * d)
    max_ctx = 4000
    for num_seqs in (1, 3):
        n_splits, part = decode_splits(num_seqs, 2 * ratio, 2, max_ctx)
        assert n_splits > 1
        for lens in ([part + 1], [part], [2 * part + 1], [(n_splits - 1) * part + 1], [1], [max_ctx]):
            case = new_token_case(rng, (lens + [1, 2 * part - 1])[:num_seqs], ratio, 2, d, dtype, 16, pad=8)
            check_fused_matches_write_kv(cp, case, max_ctx)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize(("d", "dtype"), [(d, np.dtype(np.float16)) for d in HEAD_DIMS] + [(128, runtime.bfloat16)])
@pytest.mark.parametrize("lens", [[33, 1, 0], [1300]], ids=["single", "split"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["", "qk_norm"])
def test_new_kv_small(cp, d, dtype, group, lens, qk_norm):
    """Every fused instantiation once, at small sizes (for compute-sanitizer), with and without q/k norms."""
    case = new_token_case(np.random.default_rng(group * d), lens, group, 2, d, dtype, 16, pad=8)
    case["slots"][1:2] = -1  # single: the 1-token sequence writes nothing (and reads its cache row)
    check_fused_matches_write_kv(cp, case, qk_norm=qk_norm)


@pytest.mark.gpu
def test_new_kv_graph_capture(cp):
    """The fused call captured once, replayed with new qkv rows, lengths and slots copied into its buffers: each
    replay matches write_kv + paged_attention on copies of the caches, and leaves the counters at zero."""
    from cuinfer.ops.paged_attention import workspace_elems

    rng = np.random.default_rng(3)
    ratio, n_kv, d, bs, max_ctx = 4, 2, 128, 16, 3000
    case = new_token_case(rng, [max_ctx, max_ctx], ratio, n_kv, d, np.float16, bs, pad=8)
    b = device_case(cp, case)
    new_kv = (b["k"], b["v"], b["slots"], b["inv_freq"])
    ws = cp.zeros(workspace_elems(2, n_kv * ratio, n_kv, d, max_ctx), cp.float32)
    out = cp.empty(b["q"].shape, b["q"].dtype)
    stream = cp.cuda.Stream(non_blocking=True)

    def step():
        paged_attention(b["q"], b["k_cache"], b["v_cache"], b["tables"], b["lens"], out=out, max_context_len=max_ctx,
                        workspace=ws, new_kv=new_kv)

    cp.cuda.Device().synchronize()
    with stream:
        step()  # eagerly once: compiled, nothing left to allocate
        stream.synchronize()
        stream.begin_capture()
        step()
        graph = stream.end_capture()
    for lens in ([1000, 2999], [17, max_ctx], [1, 1]):
        lens = np.array(lens, np.int32)
        pos = lens - 1
        slots = case["tables"][np.arange(2), pos // bs] * bs + pos % bs
        case.update(qkv=rng.standard_normal(case["qkv"].shape).astype(np.float16), lens=lens,
                    slots=np.where(rng.random(2) < 0.3, -1, slots).astype(np.int32),
                    k_cache=cp.asnumpy(b["k_cache"]), v_cache=cp.asnumpy(b["v_cache"]))
        with stream:
            for name in ("qkv", "lens", "slots"):
                b[name].set(case[name])
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
        for x, y in zip((out, b["k_cache"], b["v_cache"]), write_kv_then_decode(cp, case, max_ctx)):
            np.testing.assert_array_equal(bits(x), bits(y))
        assert not ws[:2 * n_kv].view(cp.int32).any()


@pytest.mark.gpu
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.one_of(st.sampled_from([1, 2, 8, 9, 33, 256, 257, 1025]), st.integers(0, 3000)),
                     min_size=1, max_size=6),
       window=st.one_of(st.sampled_from([1, 2, 8, 9, 32, 33, 256, 1024]), st.integers(1, 3000)),
       ratio=st.sampled_from([1, 4, 8]), d=st.sampled_from([64, 128, 256]), dtype=st.sampled_from(DTYPES),
       block_size=st.sampled_from([8, 16]), extra=st.sampled_from([None, 0, 700]), seed=st.integers(0, 2**31))
def test_new_kv_window_matches_write_kv_then_decode(cp, lens, window, ratio, d, dtype, block_size, extra, seed):
    """The fused write with a window: the split that holds the new row (counted from ctx - window) writes it."""
    case = new_token_case(np.random.default_rng(seed), lens, ratio, 2, d, dtype, block_size)
    check_fused_matches_write_kv(cp, case, None if extra is None else max(lens) + extra, window=window)
