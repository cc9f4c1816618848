"""Fused RoPE + KV-cache write: rotate q and k, store rotated k and v into the paged caches.

write_kv(q, k, v, positions, k_cache, v_cache, slot_mapping, inv_freq, out=None, *,
         q_norm=None, k_norm=None, eps=1e-6) -> rotated q
    q: [tokens, n_heads, head_dim]; k, v: [tokens, n_kv_heads, head_dim]; positions: int32 [tokens]
        (q, k, v may be views of one qkv row: heads contiguous, rows a multiple of 16 bytes apart)
    k_cache, v_cache: [num_blocks, block_size, n_kv_heads, head_dim], updated in place: q's dtype, or
        uint8 fp8 E4M3 codes (cuinfer.ops.fp8; q float16 / bfloat16 on the GPU): k and v rounded to
        q's dtype, then encoded
    slot_mapping: int32 [tokens], slot = block * block_size + offset; a negative slot skips the token
    inv_freq: float32 [head_dim // 2] from cuinfer.ops.rope.rope_inv_freq (Hugging Face rotate-half),
        or [tokens, head_dim // 2], each token its own frequencies (Phi-3's longrope)
    q_norm, k_norm: [head_dim] in q's dtype, both or neither: every q and k head is RMS-normed
        (rms_norm's rounding, epsilon eps) before it is rotated (Qwen3, Gemma 3)
`out` (packed) may be q itself when q is packed (in place). numpy arrays run the reference; cupy arrays launch
cuda_src/write_kv.cu (a CTA per 4 heads of a token). Under CUDA-graph capture pass `out` (allocated
before capture): the op then allocates nothing, and its grid depends on shapes only.
"""
from __future__ import annotations

import numpy as np

from . import fp8, runtime

INSTANTIATIONS = [f"write_kv_kernel<{runtime.ctype(dt)}, {cache}, {str(norm).lower()}>"
                  for dt in (np.float32, np.float16, runtime.bfloat16)
                  for cache in (runtime.ctype(dt),) + (("__nv_fp8_e4m3",) if dt != np.float32 else ())
                  for norm in (False, True)]
HEADS = 4  # heads a CTA handles (cuda_src/write_kv.cu)


def head_rms_norm_reference(x, weight, eps):
    """x: [tokens, heads, head_dim] RMS-normed over each head (rms_norm_reference's rounding), in x.dtype."""
    from .rms_norm import rms_norm_reference

    tokens, heads, d = x.shape
    return rms_norm_reference(x.reshape(tokens * heads, d), weight, eps).reshape(x.shape)


def write_kv_reference(q, k, v, positions, k_cache, v_cache, slot_mapping, inv_freq, q_norm=None, k_norm=None,
                       eps=1e-6):
    """Rotated q (float32); writes rotated k and v (rounded to q's dtype, then to the cache's: fp8.store)
    into the caches. With q_norm / k_norm the heads are normed first (rounded to their dtype, as the
    kernel rounds)."""
    from .rope import rope_reference

    if q_norm is not None:
        q, k = head_rms_norm_reference(q, q_norm, eps), head_rms_norm_reference(k, k_norm, eps)
    q_rot = rope_reference(q, positions, inv_freq)
    k_rot = rope_reference(k, positions, inv_freq)
    slots = np.asarray(slot_mapping, dtype=np.int64)
    keep = slots >= 0
    flat_k = k_cache.reshape(-1, *k_cache.shape[2:])  # flat_k: [num_blocks * block_size, n_kv_heads, head_dim]
    flat_v = v_cache.reshape(-1, *v_cache.shape[2:])
    flat_k[slots[keep]] = fp8.store(k_rot[keep], k_cache.dtype, q.dtype)
    flat_v[slots[keep]] = fp8.store(v[keep], v_cache.dtype, q.dtype)
    return q_rot


def check_head_rows(name, a):
    """a: [tokens, heads, head_dim] with heads contiguous within a token's row and rows a multiple
    of 16 bytes apart (the layout of q, k and v sliced from one qkv projection)."""
    tokens, heads, d = a.shape
    rows_ok = tokens <= 1 or (a.strides[0] > 0 and a.strides[0] % 16 == 0)
    if not rows_ok or a.strides[2] != a.itemsize or (heads > 1 and a.strides[1] != d * a.itemsize):
        raise ValueError(f"{name}: got strides {a.strides}, need ({a.itemsize * d}-byte heads contiguous "
                         "in rows a multiple of 16 bytes apart)")


def write_kv(q, k, v, positions, k_cache, v_cache, slot_mapping, inv_freq, out=None, *, q_norm=None, k_norm=None,
             eps=1e-6):
    dev = runtime.on_device(q, k, v, positions, k_cache, v_cache, slot_mapping, inv_freq, out, q_norm, k_norm)
    runtime.check("q", q, dtype=runtime.FLOAT_DTYPES, ndim=3, contiguous=False)
    tokens, n_heads, d = q.shape
    if d % 8:
        raise ValueError(f"q: got head_dim {d}, need a multiple of 8")
    runtime.check("k", k, dtype=q.dtype, shape=(tokens, None, d), contiguous=False)
    n_kv = k.shape[1]
    runtime.check("v", v, dtype=q.dtype, shape=(tokens, n_kv, d), contiguous=False)
    for name, a in (("q", q), ("k", k), ("v", v)):
        check_head_rows(name, a)
    runtime.check("positions", positions, dtype=np.int32, shape=(tokens,))
    runtime.check("k_cache", k_cache, dtype=(q.dtype, fp8.FP8), shape=(None, None, n_kv, d))
    runtime.check("v_cache", v_cache, dtype=k_cache.dtype, shape=tuple(k_cache.shape))
    runtime.check("slot_mapping", slot_mapping, dtype=np.int32, shape=(tokens,))
    per_token = getattr(inv_freq, "ndim", 1) == 2
    runtime.check("inv_freq", inv_freq, dtype=np.float32, shape=(tokens, d // 2) if per_token else (d // 2,))
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm, k_norm: need both or neither")
    norm = q_norm is not None
    if norm:
        runtime.check("q_norm", q_norm, dtype=q.dtype, shape=(d,))
        runtime.check("k_norm", k_norm, dtype=q.dtype, shape=(d,))
    if not dev:
        # slots beyond the cache raise IndexError in numpy; the kernel trusts the scheduler
        res = write_kv_reference(q, k, v, positions, k_cache, v_cache, slot_mapping, inv_freq, q_norm, k_norm, eps)
        out = runtime.check_out(out, q.shape, q.dtype, q)
        out[...] = res.astype(q.dtype)  # rounded once
        return out
    for name, a in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        runtime.check(name, a, align=16, contiguous=name.endswith("cache"))
    if out is None and runtime.capturing():
        raise ValueError("out: needed under CUDA-graph capture, allocated before it (see cuinfer.ops.write_kv)")
    out = runtime.check_out(out, q.shape, q.dtype, q)
    runtime.check("out", out, align=16)
    if fp8.is_fp8(k_cache):
        runtime.check("q", q, dtype=(np.dtype(np.float16), runtime.bfloat16), contiguous=False)
    cache = fp8.cache_ctype(k_cache.dtype, q.dtype)
    kern = runtime.kernel("write_kv", f"write_kv_kernel<{runtime.ctype(q.dtype)}, {cache}, {str(norm).lower()}>")
    args = (q, k, v, positions, k_cache, v_cache, slot_mapping, inv_freq, out,
            np.int32(n_heads), np.int32(n_kv), np.int32(d), np.int32(d // 2 if per_token else 0),
            q_norm if norm else q, k_norm if norm else q, np.float32(eps),
            *(np.int64(a.strides[0] // a.itemsize) for a in (q, k, v)))
    runtime.launch(kern, (tokens, -(-(n_heads + n_kv) // HEADS)), (32 * HEADS,), args)
    return out
