"""Flash attention forward (prefill): packed variable-length sequences, and its paged form.

flash_attention(q, k, v, cu_seqlens, causal=True, scale=None, out=None, *, window=0, softcap=None)
    q: [tokens, n_heads, head_dim]; k, v: [tokens, n_kv_heads, head_dim]; cu_seqlens: int32 [num_seqs + 1]
flash_attention_paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None, out=None,
                      *, window=0, softcap=None)
    k_cache, v_cache: [num_blocks, block_size, n_kv_heads, head_dim], q's dtype or uint8 fp8 E4M3 codes
    (cuinfer.ops.fp8, decoded exactly: where the wgmma kernel would run, the pages the tables name are
    decoded into a pool of q's dtype first, decode_pages; under graph capture, and elsewhere, the
    mma.sync kernel decodes them itself); block_tables: int32
    [num_seqs, max_blocks_per_seq]; context_lens: int32 [num_seqs]. The q rows of sequence i
    are its last q_len_i positions and attend causally to keys 0 .. context_len - q_len + j.
window > 0 (causal only): query j sees only the last `window` of those keys; the kernels skip
the K/V tiles wholly before every window of a CTA's rows, so a key outside is neither read nor
counted. softcap c: scaled scores x -> c * tanh(x / c) before the softmax (Gemma 2).

numpy arrays run the reference (cuinfer.ops.attention_ref), cupy arrays launch
cuda_src/flash_attention.cu: on sm_90 with head_dim 64 / 128 / 256 a persistent warp-specialized
wgmma kernel (a CTA an SM walking the work items; a producer warpgroup filling a ring of K/V tiles
by TMA, or cp.async for pages under 8 rows; consumer warpgroups taking turns on the tensor cores),
elsewhere a FlashAttention-2 kernel on mma.sync m16n8k16 with cp.async double-buffered K/V tiles.
Online softmax in fp32. GQA is native: the kernel maps query head h to KV head
h // (n_heads // n_kv_heads).

The launcher needs the longest query chunk to size the grid; pass `max_seqlen_q` to
avoid reading cu_seqlens back to the host (a device sync).
"""
from __future__ import annotations

import math

import numpy as np

from . import driver, fp8, runtime
from .attention_ref import default_scale, paged_prefix_attention, varlen_attention

HEAD_DIMS = (64, 80, 96, 128, 256)
KERNEL_DTYPES = (np.dtype(np.float16), runtime.bfloat16)
LOG2E = 1.4426950408889634


WGMMA_HEAD_DIMS = (64, 128, 256)  # multiples of 64: whole 128-byte swizzle blocks


def tile_config(head_dim: int, arch: int = 80, block_size: int = 0, fp8_cache: bool = False) -> tuple:
    """(kernel, BLOCK_M, BLOCK_N, warps) for a head dim on compute capability `arch` (90 for sm_90),
    contiguous K/V (block_size 0) or a paged cache of that block size (fp8_cache: of fp8 codes, which
    only the mma.sync kernel decodes).

    sm_90, head_dim 64 / 128 / 256: the persistent warp-specialized wgmma kernel, a producer
    warpgroup and one (d=256) or two consumer warpgroups of 64 query rows; "tma" (K/V copied by
    TMA: contiguous, or pages of at least 8 rows that divide BLOCK_N) or "wgmma" (cp.async with
    zero fill: smaller pages). "mma" (mma.sync) otherwise: O and S accumulators in registers
    without spills (ptxas -v, sm_90: d=64 254 regs, d=80/96 168, d=128 173, d=256 242 with Q
    re-read from shared memory). d=128, H100, 4x4096 causal / full TFLOP/s: 64x64x4 240 / 240,
    128x32x4 228 / 241 (24 B spill since the FFMA softmax), 128x64x8 222 / 234. An fp8 cache at
    d=64 takes 64x64x4 (170 registers): at 128 rows the tile's decode pass spilled 40 bytes."""
    if 90 <= arch < 100 and head_dim in WGMMA_HEAD_DIMS and not fp8_cache:
        bm, bn, warps = (64, 64, 8) if head_dim > 128 else (128, 128, 12)
        tma = block_size == 0 or (block_size >= 8 and bn % block_size == 0)
        return ("tma" if tma else "wgmma", bm, bn, warps)
    if head_dim <= 64 and not fp8_cache:
        return ("mma", 128, 64, 4)  # 2 m16 tiles per warp
    if head_dim <= 128:
        return ("mma", 64, 64, 4)
    return ("mma", 64, 32, 4)


def instantiation(dtype, head_dim: int, paged: bool, tile, cache_dtype=None) -> str:
    """cache_dtype: the paged cache's (None: dtype's; uint8: fp8 E4M3, mma tiles only)."""
    kind, bm, bn, warps = tile
    t, p = runtime.ctype(dtype), "true" if paged else "false"
    if kind in ("tma", "wgmma"):
        return f"flash_attention_{kind}_kernel<{t}, {head_dim}, {bn}, {warps // 4 - 1}, {p}>"
    c = fp8.cache_ctype(dtype if cache_dtype is None else cache_dtype, dtype)
    return f"flash_attention_kernel<{t}, {c}, {head_dim}, {bm}, {bn}, {warps}, {p}>"


INSTANTIATIONS = sorted({instantiation(dt, d, bs > 0, tile_config(d, arch, bs, c == fp8.FP8), c)
                         for dt in (np.float16, runtime.bfloat16) for c in (dt, fp8.FP8)
                         for bs in (0, 4, 16) for arch in (80, 90) for d in HEAD_DIMS if bs or c == dt}
                        | {f"decode_pages_kernel<{runtime.ctype(dt)}>" for dt in (np.float16, runtime.bfloat16)})


def smem_bytes(head_dim: int, tile, itemsize: int = 2, fp8_cache: bool = False) -> int:
    """mma: Q tile + 2 stages of K and V tiles, rows padded by 8 elements (16 bytes); from an fp8
    cache one stage of K and V tiles + 2 stages of their codes (1 byte each); wgmma / tma: Q tile and a
    ring of 3 K/V tiles, rows swizzled in place, 1 KB to align the swizzle atoms, the ring's barriers."""
    kind, bm, bn, _ = tile
    if kind in ("wgmma", "tma"):
        return (bm + 6 * bn) * head_dim * itemsize + 1024 + 128
    if fp8_cache:
        return (bm + 2 * bn) * (head_dim + 8) * itemsize + 4 * bn * head_dim
    return (bm + 4 * bn) * (head_dim + 8) * itemsize


def _check_q(q, n_kv_heads):
    runtime.check("q", q, ndim=3)
    if q.shape[1] % n_kv_heads:
        raise ValueError(f"q: got {q.shape[1]} heads, need a multiple of n_kv_heads = {n_kv_heads}")


def check_window(window, softcap, causal=True):
    """window: an int >= 0 (0: none), causal only; softcap: None or > 0."""
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise ValueError(f"window: got {window!r}, need an int >= 0 (0: no window)")
    if window and not causal:
        raise ValueError("window: a sliding window needs causal=True")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap: got {softcap}, need None or > 0")
    return int(window)


def _check_kernel_args(q, scale):
    runtime.check("q", q, dtype=KERNEL_DTYPES, align=16)
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"q: got head_dim {q.shape[-1]}, need one of {HEAD_DIMS}")
    if not scale > 0:
        raise ValueError(f"scale: got {scale}, need > 0 (the kernel takes the row max before scaling)")


def flash_attention(q, k, v, cu_seqlens, causal=True, scale=None, out=None, *, max_seqlen_q=None, window=0,
                    softcap=None):
    """Causal (or full) attention over packed sequences; returns [tokens, n_heads, head_dim] in q's dtype."""
    dev = runtime.on_device(q, k, v, cu_seqlens, out)
    window = check_window(window, softcap, causal)
    runtime.check("k", k, ndim=3)
    _check_q(q, k.shape[1])
    tokens, _n_heads, d = q.shape
    runtime.check("k", k, dtype=q.dtype, shape=(tokens, None, d))
    runtime.check("v", v, dtype=q.dtype, shape=tuple(k.shape))
    runtime.check("cu_seqlens", cu_seqlens, dtype=np.int32, ndim=1)
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens: got an empty array, need [num_seqs + 1] offsets starting at 0")
    scale = default_scale(d) if scale is None else float(scale)
    if not dev:
        runtime.check("q", q, dtype=runtime.FLOAT_DTYPES)
        res = varlen_attention(q, k, v, cu_seqlens, causal, scale, window, softcap).astype(q.dtype)  # rounded once
        out = runtime.check_out(out, q.shape, q.dtype, q)
        out[...] = res
        return out
    _check_kernel_args(q, scale)
    for name, a in (("k", k), ("v", v)):
        runtime.check(name, a, align=16)
    out = runtime.check_out(out, q.shape, q.dtype, q)
    runtime.check("out", out, align=16)
    num_seqs = cu_seqlens.shape[0] - 1
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if num_seqs else 0
    launch_kernel(q, k, v, out, cu_seqlens, None, None, 0, num_seqs, max_seqlen_q, scale, causal, window=window,
                  softcap=softcap)
    return out


def flash_attention_paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None,
                          out=None, *, max_seqlen_q=None, window=0, softcap=None):
    """Attention of new query chunks against a paged KV cache (chunked prefill, decode when q_len = 1)."""
    dev = runtime.on_device(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out)
    window = check_window(window, softcap)
    runtime.check("k_cache", k_cache, ndim=4)
    _check_q(q, k_cache.shape[2])
    _tokens, _n_heads, d = q.shape
    runtime.check("k_cache", k_cache, dtype=(q.dtype, fp8.FP8), shape=(None, None, None, d))
    runtime.check("v_cache", v_cache, dtype=k_cache.dtype, shape=tuple(k_cache.shape))
    runtime.check("block_tables", block_tables, dtype=np.int32, ndim=2)
    num_seqs = block_tables.shape[0]
    runtime.check("cu_seqlens_q", cu_seqlens_q, dtype=np.int32, shape=(num_seqs + 1,))
    runtime.check("context_lens", context_lens, dtype=np.int32, shape=(num_seqs,))
    scale = default_scale(d) if scale is None else float(scale)
    if not dev:
        runtime.check("q", q, dtype=runtime.FLOAT_DTYPES)
        res = paged_prefix_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                     window, softcap)
        out = runtime.check_out(out, q.shape, q.dtype, q)
        out[...] = res.astype(q.dtype)  # rounded once
        return out
    _check_kernel_args(q, scale)
    bs = k_cache.shape[1]
    if bs & (bs - 1):
        raise ValueError(f"k_cache: got block_size {bs}, need a power of two")
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        runtime.check(name, a, align=16)
    out = runtime.check_out(out, q.shape, q.dtype, q)
    runtime.check("out", out, align=16)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if num_seqs else 0
    if fp8.is_fp8(k_cache) and num_seqs and not runtime.capturing() and device_tile(d, bs)[0] != "mma":
        # the wgmma kernels read pages of q's dtype: ~2x the mma.sync kernel's prefill TFLOP/s, for one
        # gather of the rows' pages a call (docs/attention.md)
        k_cache, v_cache, block_tables = decode_pages(k_cache, v_cache, block_tables, q.dtype)
    launch_kernel(q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, bs, num_seqs,
                  max_seqlen_q, scale, True, window=window, softcap=softcap)
    return out


def decode_pages(k_cache, v_cache, block_tables, dtype) -> tuple:
    """The pages of fp8 caches that block_tables [rows, max_blocks] names, decoded (exactly) into new
    pools of `dtype`, and the tables renumbered into them: (k_pages, v_pages, tables), the pools
    [rows * max_blocks, block_size, n_kv_heads, head_dim]. One launch; every entry is decoded, used or
    not, so nothing is read back to the host (a page two rows share is decoded twice)."""
    cp = runtime.require_cupy()
    runtime.check("block_tables", block_tables, dtype=np.int32, ndim=2)
    n, page = block_tables.size, k_cache[0].size
    k, v = (cp.empty((n,) + k_cache.shape[1:], dtype) for _ in range(2))
    kern = runtime.kernel("flash_attention", f"decode_pages_kernel<{runtime.ctype(dtype)}>")
    if n:
        runtime.launch(kern, (-(-page // (8 * 256)), n), (256,), (k_cache, v_cache, block_tables, k, v, np.int32(page)))
    return k, v, cp.arange(n, dtype=cp.int32).reshape(block_tables.shape)


def device_tile(head_dim: int, block_size: int = 0, fp8_cache: bool = False) -> tuple:
    """tile_config for the current device (block_size 0: contiguous K/V)."""
    return tile_config(head_dim, int(runtime.device_info()["arch"][3:]), block_size, fp8_cache)


def launch_kernel(q, k, v, out, cu_q, context_lens, block_tables, block_size, num_seqs, max_seqlen_q,
                  scale, causal, tile=None, window=0, softcap=None, ctas=None):
    """Launch on checked arguments; `tile` (kernel, BLOCK_M, BLOCK_N, warps) overrides device_tile
    (tests of every kernel, bench sweeps), `ctas` the persistent kernels' grid (default one CTA an SM;
    tests pass a few, so that each CTA walks many work items)."""
    paged = block_tables is not None
    n_heads, d = q.shape[1], q.shape[2]
    n_kv = k.shape[-2]
    if num_seqs == 0 or max_seqlen_q == 0 or q.shape[0] == 0:
        return  # nothing to compute (and no tensor map of an empty array)
    fp8_cache = fp8.is_fp8(k)
    tile = tile or device_tile(d, block_size if paged else 0, fp8_cache)
    kind, bm, bn, warps = tile
    kern = runtime.kernel("flash_attention", instantiation(q.dtype, d, paged, tile, k.dtype))
    m_blocks = -(-max_seqlen_q // bm)
    persistent = kind in ("tma", "wgmma")  # a CTA an SM, walking the work items
    grid = ((min(m_blocks * n_heads * num_seqs, ctas or runtime.device_info()["sm_count"]), 1, 1) if persistent
            else (m_blocks, n_heads, num_seqs))
    if paged:
        args = (q, k, v, out, cu_q, context_lens, block_tables, np.int32(block_tables.shape[1]),
                np.int32(int(math.log2(block_size))))
    else:
        args = (q, k, v, out, cu_q, cu_q, cu_q, np.int32(0), np.int32(0))  # no context / table
    # a softcap c caps the scores in the kernel: c log2 e tanh(s scale / c), exponentials then of 2^(s - m)
    caps = (scale / softcap, softcap * LOG2E) if softcap else (0.0, 0.0)
    args += (np.int32(n_heads), np.int32(n_kv), np.float32(1.0 if softcap else scale * LOG2E), np.int32(bool(causal)),
             np.int32(window), *(np.float32(c) for c in caps))
    if persistent:
        args += (np.int32(num_seqs), np.int32(m_blocks))
    if kind == "tma":
        kv_box = (1, block_size, 1, 64) if paged else (bn, 1, 64)
        args += (driver.tensor_map(q, (bm, 1, 64)), driver.tensor_map(k, kv_box), driver.tensor_map(v, kv_box))
    runtime.launch(kern, grid, (32 * warps,), args, smem=smem_bytes(d, tile, q.dtype.itemsize, fp8_cache))
