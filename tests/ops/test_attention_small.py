"""Every attention kernel instantiation the ops launch, once each at small sizes, against the references.

Small enough to run under compute-sanitizer (memcheck, racecheck) in a minute or two:
    compute-sanitizer --tool racecheck python -m pytest -q tests/ops/test_attention_small.py
Shapes cover a partial last tile, several K/V tiles, a partial last KV block, GQA, an empty sequence and, for
decode, both the single-pass and the split + merge paths.
"""
import numpy as np
import pytest

from cuinfer.ops import runtime
from cuinfer.ops.attention_ref import paged_prefix_attention, varlen_attention
from cuinfer.ops.flash_attention import HEAD_DIMS, device_tile, flash_attention, flash_attention_paged, launch_kernel
from cuinfer.ops.paged_attention import GROUPS, paged_attention
from cuinfer.ops.write_kv import write_kv
from tests.conftest import assert_close, poison
from tests.ops.test_flash_attention import scatter_paged
from tests.ops.test_write_kv import expected_caches, inv_freq_for, make, rotate_complex

CASES = [(d, np.dtype(np.float16)) for d in HEAD_DIMS] + [(128, runtime.bfloat16)]


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("d", "dtype"), CASES)
def test_flash_attention_small(cp, d, dtype, causal):
    rng = np.random.default_rng(d)
    cu = np.array([0, 1, 1, 71, 371], np.int32)  # lengths 1, 0, 70, 300 (several K/V tiles: both stages)
    q, k, v = _rand(rng, (371, 4, d), dtype), _rand(rng, (371, 1, d), dtype), _rand(rng, (371, 1, d), dtype)
    out = poison(cp, q.shape, dtype)
    flash_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(cu), causal, out=out)
    assert_close(out, varlen_attention(q, k, v, cu, causal), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(("d", "dtype"), CASES)
def test_flash_attention_paged_small(cp, d, dtype):
    rng = np.random.default_rng(d + 1)
    ctx, q_lens = np.array([17, 90, 333], np.int32), np.array([1, 40, 150], np.int32)
    cu_kv = np.concatenate([[0], np.cumsum(ctx)]).astype(np.int32)
    k, v = _rand(rng, (cu_kv[-1], 2, d), dtype), _rand(rng, (cu_kv[-1], 2, d), dtype)
    tables, k_cache, v_cache = scatter_paged(rng, cu_kv, 16, k, v)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = _rand(rng, (cu_q[-1], 6, d), dtype)
    out = poison(cp, q.shape, dtype)
    flash_attention_paged(cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), cp.asarray(tables),
                          cp.asarray(cu_q), cp.asarray(ctx), out=out)
    assert_close(out, paged_prefix_attention(q, k_cache, v_cache, tables, cu_q, ctx), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [0, 4, 16], ids=["contiguous", "cp.async-pages", "tma-pages"])
@pytest.mark.parametrize(("d", "dtype"), CASES)
def test_flash_attention_few_ctas_small(cp, d, dtype, block_size):
    """Two CTAs for every work item: a persistent CTA walks a dozen or more, its ring and Q barriers
    going through many phases, and the paged producer zeroes the V rows past several contexts."""
    rng = np.random.default_rng(d + block_size)
    ctx, q_lens = np.array([17, 90, 333, 0, 200], np.int32), np.array([1, 40, 150, 0, 200], np.int32)
    cu_kv = np.concatenate([[0], np.cumsum(ctx)]).astype(np.int32)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    k, v = _rand(rng, (cu_kv[-1], 2, d), dtype), _rand(rng, (cu_kv[-1], 2, d), dtype)
    q = _rand(rng, ((cu_q if block_size else cu_kv)[-1], 6, d), dtype)
    out = poison(cp, q.shape, dtype)
    if block_size:
        tables, k_cache, v_cache = scatter_paged(rng, cu_kv, block_size, k, v)
        launch_kernel(cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), out, cp.asarray(cu_q),
                      cp.asarray(ctx), cp.asarray(tables), block_size, len(ctx), int(q_lens.max()), d ** -0.5,
                      True, device_tile(d, block_size), ctas=2)
        ref = paged_prefix_attention(q, k_cache, v_cache, tables, cu_q, ctx)
    else:
        launch_kernel(cp.asarray(q), cp.asarray(k), cp.asarray(v), out, cp.asarray(cu_kv), None, None, 0, len(ctx),
                      int(ctx.max()), d ** -0.5, True, device_tile(d), ctas=2)
        ref = varlen_attention(q, k, v, cu_kv, True)
    assert_close(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize(("d", "dtype"), CASES)
@pytest.mark.parametrize("lens", [[33, 0, 5], [1300]], ids=["single", "split"])
def test_paged_attention_small(cp, d, dtype, group, lens):
    rng = np.random.default_rng(group * d)
    lens = np.array(lens, np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    k, v = _rand(rng, (cu[-1], 2, d), dtype), _rand(rng, (cu[-1], 2, d), dtype)
    tables, k_cache, v_cache = scatter_paged(rng, cu, 16, k, v)
    q = _rand(rng, (len(lens), 2 * group, d), dtype)
    out = poison(cp, q.shape, dtype)
    paged_attention(cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), cp.asarray(tables),
                    cp.asarray(lens), out=out)
    ref = paged_prefix_attention(q, k_cache, v_cache, tables, np.arange(len(lens) + 1, dtype=np.int32), lens)
    assert_close(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16), runtime.bfloat16])
def test_write_kv_small(cp, dtype):
    rng = np.random.default_rng(3)
    q, k, v, pos, slots = make(rng, 19, 8, 2, 128, dtype, 3, 16)
    inv = inv_freq_for(128)
    shape = (3, 16, 2, 128)
    kc, vc = (cp.asarray(np.full(shape, np.nan, dtype)) for _ in range(2))
    out = poison(cp, q.shape, dtype)
    write_kv(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(pos), kc, vc, cp.asarray(slots),
             cp.asarray(inv), out=out)
    assert_close(out, rotate_complex(q, pos, inv), dtype)
    want_k, want_v = expected_caches(k, v, pos, slots, inv, shape, np.nan)
    keep = ~np.isnan(want_k)
    assert_close(cp.asnumpy(kc)[keep], want_k[keep], dtype)
    assert np.array_equal(cp.asnumpy(vc)[keep], want_v[keep].astype(dtype))
