"""Numerically stable softmax.

softmax(x, axis=-1, out=None) -> same shape and dtype as x
exp(x - max) / sum(exp(x - max)) in float32, rounded once to the dtype. -inf entries give 0; a
row whose entries are all -inf gives NaN (as torch.softmax). numpy arrays run the reference
(any axis); cupy arrays launch cuda_src/softmax.cu (last axis only: one CTA per row, a row of
up to 8 vectors per thread read once, longer rows such as a 128k vocabulary read twice).
`out` may be x.
"""
from __future__ import annotations

import numpy as np

from . import runtime
from .rms_norm import ITEMS, row_launch


def instantiation(dtype, vec, items) -> str:
    return f"softmax_kernel<{runtime.ctype(dtype)}, {vec}, {items}>"


INSTANTIATIONS = [instantiation(dt, v, i) for dt in runtime.FLOAT_DTYPES for v in runtime.vector_widths(dt)
                  for i in ITEMS]


def softmax_reference(x, axis=-1):
    """float32, same shape as x: exp(x - max) / sum in float32; an all -inf slice gives NaN."""
    x32 = np.asarray(x).astype(np.float32)
    with np.errstate(invalid="ignore"):  # all -inf: -inf - -inf = NaN, deliberately
        e = np.exp(x32 - x32.max(axis=axis, keepdims=True))
        return e / e.sum(axis=axis, keepdims=True)


def softmax(x, axis=-1, out=None):
    dev = runtime.on_device(x, out)
    runtime.check("x", x, dtype=runtime.FLOAT_DTYPES)
    if x.ndim == 0:
        raise ValueError("x: got a 0-d array, need at least 1 dimension")
    out = runtime.check_out(out, x.shape, x.dtype, x)
    if not dev:
        out[...] = softmax_reference(x, axis).astype(x.dtype)  # rounded once
        return out
    if axis not in (-1, x.ndim - 1):
        raise ValueError(f"axis: got {axis}, the GPU kernel supports only the last axis (-1)")
    n = x.shape[-1]
    if n >= 2**31:
        raise ValueError(f"x: got rows of {n} elements, need fewer than 2**31")
    vec = runtime.vector_width(x, out)
    items, threads = row_launch(n // vec, max_threads=512)
    kern = runtime.kernel("softmax", instantiation(x.dtype, vec, items))
    runtime.launch(kern, (x.size // max(n, 1),), (threads,), (x, out, np.int32(n)))
    return out
