"""RMSNorm (Llama), optionally fused with the residual add before it.

rms_norm(x, weight, eps, residual=None, out=None)
    x: [rows, hidden]; weight: [hidden]; residual: [rows, hidden] or None
    no residual -> normed: [rows, hidden]
    residual    -> (normed, new_residual) with new_residual = x + residual rounded to the dtype
                   (the residual stream lives in the model dtype) and normed = rmsnorm(new_residual)
`out` is normed, or for the fused form a (normed, new_residual) pair; new_residual may be
`residual` itself (updated in place, as the decoder does) and normed may be x. numpy arrays run
the reference; cupy arrays launch cuda_src/rms_norm.cu (one CTA per row, x and residual read once).

Rounding follows Hugging Face LlamaRMSNorm: normalize in fp32, round to the dtype, multiply by
the weight (in fp32, rounded once).
"""
from __future__ import annotations

import numpy as np

from . import runtime

ITEMS = (1, 2, 4, 8)  # 16-byte vectors a thread keeps in registers
MAX_THREADS = 512


def row_launch(n_vec: int, max_threads: int = 256):
    """(items, threads) for one CTA per row of n_vec vectors, shared by the row kernels.

    The fewest vectors per thread that cover the row with at most max_threads threads (a row of
    8192 fp16 is 1024 vectors: 4 per thread, 256 threads); rows longer than that get ITEMS[-1]
    per thread and up to MAX_THREADS threads, and stream what does not fit.
    """
    def threads_for(items):
        return max(32, (-(-n_vec // items) + 31) // 32 * 32)

    for items in ITEMS:
        if threads_for(items) <= max_threads:
            return items, threads_for(items)
    return ITEMS[-1], min(MAX_THREADS, threads_for(ITEMS[-1]))


def instantiation(dtype, vec, items, fused) -> str:
    return f"rms_norm_kernel<{runtime.ctype(dtype)}, {vec}, {items}, {'true' if fused else 'false'}>"


INSTANTIATIONS = [instantiation(dt, v, i, f) for dt in runtime.FLOAT_DTYPES for v in runtime.vector_widths(dt)
                  for i in ITEMS for f in (False, True)]


def rms_norm_reference(x, weight, eps):
    """normed: [rows, hidden] in x.dtype, HF LlamaRMSNorm rounding.

    n = x * 1/sqrt(mean(x^2) + eps) in float32, rounded to x.dtype (as HF casts back to the
    input dtype), then weight * n in float32, rounded to x.dtype.
    """
    x32 = x.astype(np.float32)
    inv_rms = np.float32(1) / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(eps))
    n = (x32 * inv_rms).astype(x.dtype).astype(np.float32)  # rounded to the dtype, as HF
    return (weight.astype(np.float32) * n).astype(x.dtype)  # rounded once


def rms_norm(x, weight, eps, residual=None, out=None):
    dev = runtime.on_device(x, weight, residual, *(out if isinstance(out, tuple) else (out,)))
    runtime.check("x", x, dtype=runtime.FLOAT_DTYPES, ndim=2)
    rows, hidden = x.shape
    runtime.check("weight", weight, dtype=x.dtype, shape=(hidden,))
    fused = residual is not None
    if fused:
        runtime.check("residual", residual, dtype=x.dtype, shape=(rows, hidden))
        if out is None:
            out = (None, None)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError("out: with residual, need a (normed, new_residual) pair or None")
        normed = runtime.check_out(out[0], x.shape, x.dtype, x)
        new_res = runtime.check_out(out[1], x.shape, x.dtype, x)
    else:
        if isinstance(out, tuple):
            raise ValueError("out: without residual, need one array or None, got a tuple")
        normed, new_res = runtime.check_out(out, x.shape, x.dtype, x), None
    if not dev:
        if fused:
            new_res[...] = (x.astype(np.float32) + residual.astype(np.float32)).astype(x.dtype)  # rounded
            normed[...] = rms_norm_reference(new_res, weight, eps)
            return normed, new_res
        normed[...] = rms_norm_reference(x, weight, eps)
        return normed
    arrays = (x, weight, normed) + ((residual, new_res) if fused else ())
    vec = runtime.vector_width(*arrays)
    items, threads = row_launch(hidden // vec)
    kern = runtime.kernel("rms_norm", instantiation(x.dtype, vec, items, fused))
    args = (x, residual if fused else x, weight, normed, new_res if fused else normed,
            np.int32(hidden), np.float32(eps))
    runtime.launch(kern, (rows,), (threads,), args)
    return (normed, new_res) if fused else normed
