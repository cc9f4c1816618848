"""Linear layer y = x @ W.T (+ bias) with fp16 / bf16, INT8 or INT4 weights.

linear(x, w, bias=None, out=None) -> [M, N] in x's dtype
    x: [M, K] fp16 / bf16; w: [N, K] array of x's dtype, or cuinfer.quant.Int8Weight /
    Int4Weight (Hugging Face layout, out_features first); bias: [N] in x's dtype.

numpy arrays run the reference: dequantize to float32, matmul in float32, round once.
cupy arrays: for M <= 16 (decode) cuda_src/linear.cu's tensor-core GEMV with the weight
dequantized in registers (16-byte streamed loads, warps split K, one block per 16 RT rows);
for M > 16 (prefill) the weight is dequantized to a scratch [N, K] array by
linear_dequant_kernel and multiplied by cuBLAS (cupy.matmul), as is an fp16 / bf16 weight;
a bias is then added in x's dtype (one more rounding than the GEMV, which adds it in fp32).
"""
from __future__ import annotations

import numpy as np

from .. import runtime
from ..quant import GROUP_SIZES, Int4Weight, Int8Weight

KERNEL_DTYPES = (np.dtype(np.float16), runtime.bfloat16)
GEMV_MAX_M = 16
NULL = np.uint64(0)  # a null pointer kernel argument (no scales / zeros / bias)


def weight_bits(w) -> int:
    return 4 if isinstance(w, Int4Weight) else 8 if isinstance(w, Int8Weight) else 16


def tile_config(bits: int, m: int, n: int) -> tuple:
    """(NT, RT, U, WARPS) for M rows of x and N outputs, measured on the H100 (notes/linear.md).

    NT n8 tiles cover M. RT m16 row tiles per block share each x fragment: 2 at M > 8 once the
    grid still has >= 4 blocks per SM (x loads then rival the weight bytes). Each warp has U
    quads in compute and U more in flight (double-buffered); the raw weights take 16 RT U
    registers, kept <= 32 (<= 128 registers, no spills, ptxas -v sm_90). WARPS split K in a
    block: 16 when the grid has under 4 blocks per SM (N < 8448), else 8."""
    nt = 1 if m <= 8 else 2
    rt = 2 if nt == 2 and n >= 16 * 2 * 4 * 132 else 1
    u = 4 // rt // (2 if bits == 4 else 1)
    warps = 16 if rt == 1 and -(-n // 16) < 4 * 132 else 8
    return nt, rt, u, warps


def instantiation(dtype, bits: int, group_size: int, nt: int, rt: int, u: int, warps: int) -> str:
    return f"linear_kernel<{runtime.ctype(dtype)}, {bits}, {group_size}, {nt}, {rt}, {u}, {warps}>"


def dequant_instantiation(dtype, bits: int, group_size: int) -> str:
    return f"linear_dequant_kernel<{runtime.ctype(dtype)}, {bits}, {group_size}>"


def _formats():
    yield 16, 0
    yield 8, 0
    for g in GROUP_SIZES:
        yield 4, g


INSTANTIATIONS = sorted(
    {instantiation(dt, b, g, *tile_config(b, m, n)) for dt in KERNEL_DTYPES for b, g in _formats()
     for m in (1, 16) for n in (1, 1 << 14, 1 << 20)}
    | {dequant_instantiation(dt, b, g) for dt in KERNEL_DTYPES for b, g in _formats() if b < 16})


def linear_reference(x, w, bias=None):
    """float32 [M, N]: x @ dequantized(W).T + bias, all in float32."""
    wf = w.dequantize() if isinstance(w, (Int8Weight, Int4Weight)) else np.asarray(w, dtype=np.float32)
    y = np.asarray(x, dtype=np.float32) @ wf.T
    return y if bias is None else y + np.asarray(bias, dtype=np.float32)


def _check_weight(w, k, dev):
    """Validate the weight object against in_features k; returns N."""
    if isinstance(w, Int8Weight):
        n = w.shape[0]
        runtime.check("w.qweight", w.qweight, dtype=np.int8, shape=(n, k))
        runtime.check("w.scales", w.scales, dtype=np.float16, shape=(n,))
        arrays = (w.qweight, w.scales)
    elif isinstance(w, Int4Weight):
        n = w.shape[0]
        if tuple(w.shape) != (n, k):
            raise ValueError(f"w: got shape {tuple(w.shape)}, need [*, {k}] (x has {k} columns)")
        if w.group_size not in GROUP_SIZES or k % w.group_size:
            raise ValueError(f"w.group_size: got {w.group_size}, need one of {GROUP_SIZES} dividing K = {k}")
        runtime.check("w.qweight", w.qweight, dtype=np.uint32, shape=(n, -(-k // 128) * 16))
        runtime.check("w.scales", w.scales, dtype=np.float16, shape=(n, k // w.group_size))
        runtime.check("w.zeros", w.zeros, dtype=np.float16, shape=(n, k // w.group_size))
        arrays = (w.qweight, w.scales, w.zeros)
    else:
        runtime.check("w", w, ndim=2)
        n = w.shape[0]
        runtime.check("w", w, shape=(n, k))
        arrays = (w,)
    if any(runtime.is_device_array(a) != dev for a in arrays):
        raise ValueError("w: weight arrays must be numpy for numpy x and cupy for cupy x "
                         "(quantized weights: w.to_device())")
    return n


def linear(x, w, bias=None, out=None):
    """x @ W.T (+ bias) in x's dtype; see the module docstring for shapes and formats."""
    dev = runtime.on_device(x, bias, out)
    runtime.check("x", x, dtype=KERNEL_DTYPES, ndim=2)
    m, k = x.shape
    n = _check_weight(w, k, dev)
    bits = weight_bits(w)
    if bits == 16:
        runtime.check("w", w, dtype=x.dtype)
    if bias is not None:
        runtime.check("bias", bias, dtype=x.dtype, shape=(n,))
    out = runtime.check_out(out, (m, n), x.dtype, x)
    if not dev:
        out[...] = linear_reference(x, w, bias).astype(x.dtype)  # rounded once
        return out
    need = {16: 8, 8: 16, 4: 32}[bits]
    if k % need:
        raise ValueError(f"x: got K = {k} columns, need a multiple of {need} for {bits}-bit weights")
    runtime.check("x", x, align=16)
    runtime.check("out", out, align=16)
    if m > GEMV_MAX_M:
        return _prefill(x, w, bias, out)
    qweight = w if bits == 16 else w.qweight
    runtime.check("w" if bits == 16 else "w.qweight", qweight, align=16)
    return _gemv(x, w, bias, out, tile_config(bits, m, n))


def _gemv(x, w, bias, out, config):
    """Launch linear_kernel with config = (NT, RT, U, WARPS) on checked arguments."""
    (m, k), n, bits = x.shape, out.shape[1], weight_bits(w)
    nt, rt, u, warps = config
    kern = runtime.kernel("linear", instantiation(x.dtype, bits, w.group_size if bits == 4 else 0, nt, rt, u, warps))
    qweight = w if bits == 16 else w.qweight
    scales = w.scales if bits < 16 else NULL
    zeros = w.zeros if bits == 4 else NULL
    args = (x, qweight, scales, zeros, NULL if bias is None else bias, out, np.int32(m), np.int32(n), np.int32(k))
    runtime.launch(kern, (-(-n // (16 * rt)),), (32 * warps,), args)
    return out


def dequantize_weight(w, dtype):
    """Device [N, K] weight of `dtype` from an Int8Weight / Int4Weight on the device."""
    cp = runtime.require_cupy()
    n, k = w.shape
    bits = weight_bits(w)
    scratch = cp.empty((n, k), dtype=dtype)
    kern = runtime.kernel("linear", dequant_instantiation(dtype, bits, w.group_size if bits == 4 else 0))
    zeros = w.zeros if bits == 4 else NULL
    runtime.launch(kern, (-(-(n * k // 8) // 256),), (256,), (w.qweight, w.scales, zeros, scratch, np.int32(n), np.int32(k)))
    return scratch


def _prefill(x, w, bias, out):
    cp = runtime.require_cupy()
    wt = w if weight_bits(w) == 16 else dequantize_weight(w, x.dtype)
    cp.matmul(x, wt.T, out=out)
    if bias is not None:
        out += bias  # an add in x's dtype: the product is rounded before the bias (the GEMV adds in fp32)
    return out
