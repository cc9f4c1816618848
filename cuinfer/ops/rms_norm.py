"""RMSNorm (Llama), optionally fused with the residual add before or after it.

rms_norm(x, weight, eps, residual=None, out=None, *, add_to=None)
    x: [rows, hidden]; weight: [hidden]; residual, add_to: [rows, hidden] or None (not both)
    neither     -> normed: [rows, hidden]
    residual    -> (normed, new_residual) with new_residual = x + residual rounded to the dtype
                   (the residual stream lives in the model dtype) and normed = rmsnorm(new_residual)
    add_to      -> add_to + rmsnorm(x), the norm rounded, then the sum (Gemma's norms on the
                   attention and MLP outputs, before their residual adds)
`out` is the result, or for the residual form a (normed, new_residual) pair; new_residual may be
`residual` itself (updated in place, as the decoder does), normed may be x, the add_to form's
result may be add_to. numpy arrays run
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


ADD = {None: 0, "before": 1, "after": 2}  # the kernel's residual add: none, before the norm, after it


def instantiation(dtype, vec, items, add=None) -> str:
    return f"rms_norm_kernel<{runtime.ctype(dtype)}, {vec}, {items}, {ADD[add]}>"


INSTANTIATIONS = [instantiation(dt, v, i, a) for dt in runtime.FLOAT_DTYPES for v in runtime.vector_widths(dt)
                  for i in ITEMS for a in ADD]


def rms_norm_reference(x, weight, eps):
    """normed: [rows, hidden] in x.dtype, HF LlamaRMSNorm rounding.

    n = x * 1/sqrt(mean(x^2) + eps) in float32, rounded to x.dtype (as HF casts back to the
    input dtype), then weight * n in float32, rounded to x.dtype.
    """
    x32 = x.astype(np.float32)
    inv_rms = np.float32(1) / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(eps))
    n = (x32 * inv_rms).astype(x.dtype).astype(np.float32)  # rounded to the dtype, as HF
    return (weight.astype(np.float32) * n).astype(x.dtype)  # rounded once


def rms_norm(x, weight, eps, residual=None, out=None, *, add_to=None):
    dev = runtime.on_device(x, weight, residual, add_to, *(out if isinstance(out, tuple) else (out,)))
    runtime.check("x", x, dtype=runtime.FLOAT_DTYPES, ndim=2)
    rows, hidden = x.shape
    runtime.check("weight", weight, dtype=x.dtype, shape=(hidden,))
    if add_to is not None:
        if residual is not None:
            raise ValueError("add_to: not with residual (one add, before or after the norm)")
        runtime.check("add_to", add_to, dtype=x.dtype, shape=(rows, hidden))
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
        if add_to is not None:
            normed[...] = (add_to.astype(np.float32) + rms_norm_reference(x, weight, eps).astype(np.float32)
                           ).astype(x.dtype)  # the norm rounded, then the sum
            return normed
        if fused:
            new_res[...] = (x.astype(np.float32) + residual.astype(np.float32)).astype(x.dtype)  # rounded
            normed[...] = rms_norm_reference(new_res, weight, eps)
            return normed, new_res
        normed[...] = rms_norm_reference(x, weight, eps)
        return normed
    arrays = (x, weight, normed) + ((residual, new_res) if fused else ()) + ((add_to,) if add_to is not None else ())
    vec = runtime.vector_width(*arrays)
    items, threads = row_launch(hidden // vec)
    add = "before" if fused else "after" if add_to is not None else None
    kern = runtime.kernel("rms_norm", instantiation(x.dtype, vec, items, add))
    args = (x, residual if fused else x if add_to is None else add_to, weight, normed, new_res if fused else normed,
            np.int32(hidden), np.float32(eps))
    runtime.launch(kern, (rows,), (threads,), args)
    return (normed, new_res) if fused else normed
