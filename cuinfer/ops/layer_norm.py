"""LayerNorm over the last axis.

layer_norm(x, weight, bias, eps, out=None)
    x: [rows, hidden]; weight: [hidden]; bias: [hidden] or None -> [rows, hidden]
out = (x - mean) / sqrt(var + eps) * weight + bias computed in float32 and rounded once to the
dtype (as torch.nn.functional.layer_norm); var is the biased variance mean((x - mean)^2), both
taken on x shifted by the row's first element (a row on a large offset keeps its precision).
`out` may be x. numpy arrays run the reference; cupy arrays launch cuda_src/layer_norm.cu (one
CTA per row, the row read once).
"""
from __future__ import annotations

import numpy as np

from . import runtime
from .rms_norm import ITEMS, row_launch


def instantiation(dtype, vec, items) -> str:
    return f"layer_norm_kernel<{runtime.ctype(dtype)}, {vec}, {items}>"


INSTANTIATIONS = [instantiation(dt, v, i) for dt in runtime.FLOAT_DTYPES for v in runtime.vector_widths(dt)
                  for i in ITEMS]


def layer_norm_reference(x, weight, bias, eps):
    """float32 [rows, hidden]: two-pass mean and biased variance in float32, affine in float32.

    The statistics are taken on x - x[:, :1] (shifted by each row's first element, as the kernel
    does), so a large common offset does not cancel the digits of the variance.
    """
    x32 = x.astype(np.float32)
    s = x32 - x32[:, :1]  # exact while x is within a factor 2 of x[:, 0]
    d = s - s.mean(axis=-1, keepdims=True)
    y = d * (np.float32(1) / np.sqrt((d * d).mean(axis=-1, keepdims=True) + np.float32(eps)))
    y = y * weight.astype(np.float32)
    return y if bias is None else y + bias.astype(np.float32)


def layer_norm(x, weight, bias, eps, out=None):
    dev = runtime.on_device(x, weight, bias, out)
    runtime.check("x", x, dtype=runtime.FLOAT_DTYPES, ndim=2)
    rows, hidden = x.shape
    runtime.check("weight", weight, dtype=x.dtype, shape=(hidden,))
    if bias is not None:
        runtime.check("bias", bias, dtype=x.dtype, shape=(hidden,))
    out = runtime.check_out(out, x.shape, x.dtype, x)
    if not dev:
        out[...] = layer_norm_reference(x, weight, bias, eps).astype(x.dtype)  # rounded once
        return out
    vec = runtime.vector_width(*(a for a in (x, weight, bias, out) if a is not None))
    items, threads = row_launch(hidden // vec)
    kern = runtime.kernel("layer_norm", instantiation(x.dtype, vec, items))
    bias_ptr = bias if bias is not None else np.uint64(0)  # null: no bias
    runtime.launch(kern, (rows,), (threads,), (x, weight, bias_ptr, out, np.int32(hidden), np.float32(eps)))
    return out
