"""Linear layer y = x @ W.T (+ bias) with fp16 / bf16, INT8 or INT4 weights, and its fused epilogues.

linear(x, w, bias=None, out=None, activation=None, norm=None, residual=None, add=None, add_out=None)
    -> [M, N] in x's dtype; with add, (that, the new x)
    x: [M, K] fp16 / bf16; w: [N, K] array of x's dtype, or cuinfer.ops.quant.Int8Weight /
    Int4Weight (Hugging Face layout, out_features first); bias: [N] in x's dtype.
    activation="silu_and_mul" / "gelu_and_mul": w is the stacked [gate; up] weight [2I, K] (bias [2I])
    and the result is act(x @ gate.T) * (x @ up.T), [M, I] (ops.silu_and_mul / gelu_and_mul of the
    plain result; GELU-tanh for Gemma).
    norm=(weight [K], eps): x is the residual stream and the product is taken with
    ops.rms_norm(x, weight, eps) instead (the decoder's pre-norm, fused: see below).
    residual: [M, N] (not with activation, not aliasing out): the result is round(round(y) +
    residual), the decoder's residual add rounded as the separate add would round it.
    add=(y0 [M, K], weight [K]) (with norm): x is first replaced by ops.rms_norm(y0, weight, eps,
    add_to=x), Gemma's output norm and residual add of the previous layer (eps: norm's), written to
    add_out (default: a new array) and returned beside the result; the GEMV does it in its prologue.
linear_argmax(x, w, out=None, workspace=None, norm=None) -> int32 [M]
    argmax over N of the logits x @ W.T rounded to x's dtype (ties: the lowest index), for
    greedy decoding; norm as in linear. workspace: int32 [argmax_workspace_size(N)] of the GEMV's
    partial maxima; None allocates one. Past the GEMV's rows (route) the logits are made as linear makes
    them (the GEMM or cuBLAS, into a new array) and reduced per row; the workspace is not used.

numpy arrays run the reference: dequantize to float32, matmul in float32, round once.
cupy arrays (route(w, m, k) names the one taken): the decode GEMV of cuda_src/linear.cu (tensor
cores, weights dequantized in registers, every weight byte read once, epilogue fused) for M <=
GEMV_MAX_M (1 row of fp16 / bf16 weights, 8 of quantized ones; 16 for a 16-bit weight the wgmma
kernel does not take); for quantized weights at 9 <= M <= MMA_MAX_M (ones its wgmma kernel takes: <=
WGMMA_MAX_M), and fp16 / bf16 ones the wgmma kernel takes at 2 <= M <= WGMMA16_MAX_M (sm_90), the GEMMs of
ops.linear_mma (dequantization in registers or none, bias / residual / gated epilogues fused, y
rounded once). With norm, every GEMV block first normalizes the rows of x into shared memory (no
launch of its own) when a 16-row chunk of them fits in NORM_SMEM bytes, and the wgmma GEMM in its
x pass; otherwise, and on the mma.sync GEMM and prefill paths, ops.rms_norm runs first. Without norm
the rows are copied there all the same when they fit, so the main loop's x reads never miss L1.
Beyond those (fp16 / bf16 weights above 16 rows that the wgmma GEMM does not take, quantized ones
above the GEMMs' rows: prefill) the weight is dequantized to a scratch [N, K] array and multiplied by
cuBLAS gemmEx in fp32 (ops.cublas, a bias pre-filled in an fp32 scratch, beta = 1) with fp32 split-K
reductions, so y is rounded once as in the GEMV; a gated
epilogue then runs unfused (ops.silu_and_mul / gelu_and_mul on an [M, 2I] intermediate) and the
residual is added after. Every path can be captured in a CUDA graph: the GEMV, the GEMM, the
reduction and the norm allocate nothing when `out` (and for argmax `workspace`) is given; the
cuBLAS path's scratch arrays come from whatever pool the capture allocates from.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import runtime
from .activation import act_and_mul_reference, gelu_and_mul, silu_and_mul
from .cublas import gemm
from .linear_mma import (
    MMA_MAX_M,
    WGMMA16_MAX_M,
    WGMMA_MAX_M,
    check_epilogue,
    check_quant_weight,
    linear_mma,
    weight_bits,
    wgmma_fits,
)
from .quant import GROUP_SIZES, Int4Weight, Int8Weight
from .rms_norm import rms_norm, rms_norm_reference

KERNEL_DTYPES = (np.dtype(np.float16), runtime.bfloat16)
GEMV_ROWS = 16  # rows of x per GEMV launch (two n8 tiles)
# by weight bits: above, the GEMMs (route) or cuBLAS. Quantized at 9-16 rows the GEMMs win (H200, llama3-8b
# decode b=16: int4 4,800 -> 5,518 tok/s on mma.sync, int8 3,895 -> 4,668 on wgmma; the linear layers at 9
# rows 2.42 -> 2.29 / 3.39 -> 2.74 ms), at 8 the GEMV (int4 3,870 against 3,224, int8 2,805 against 2,442).
# fp16 from 2 rows on the wgmma kernel (NX = 16; its linear layers take ~4.19 ms a step at any 1-16 rows, the
# GEMV's 4.18 / 4.30 / 4.93 / 5.12 / 5.63 at 1 / 2 / 4 / 8 / 16): decode b=2 434 -> 440 tok/s, b=4 763 -> 874,
# b=8 1,449 -> 1,685, b=16 2,598 -> 3,254. A 16-bit weight that kernel does not take keeps the GEMV to GEMV_ROWS.
GEMV_MAX_M = {16: 1, 8: 8, 4: 8}
EPILOGUES = {"store": 0, "silu_and_mul": 1, "argmax": 2, "gelu_and_mul": 3}  # EPI_* of linear.cu
GATED = {"silu_and_mul": ("silu", silu_and_mul), "gelu_and_mul": ("gelu_tanh", gelu_and_mul)}  # act, unfused op
QUAD_K = {16: 32, 8: 64, 4: 128}  # k per quad step of one lane quad
NULL = np.uint64(0)  # a null pointer kernel argument
NORM_SMEM = 32 * 1024  # bytes of normalized x rows a GEMV block may stage in shared memory


class Tile(NamedTuple):
    nt: int  # n8 tiles of x rows (M <= 8 nt)
    rt: int  # m16 tiles of output rows per block
    u: int  # quads per warp per pipeline stage
    warps: int  # warps per block, splitting the block's K range
    split: int  # blocks of a cluster splitting K (sm_90)
    occupancy: int = 0  # blocks per SM the kernel's launch bounds promise (0: 16 / warps)


def path(bits: int, m: int) -> str:
    """The device path for M rows of x and weights of `bits` by rows alone: "gemv", "mma" (the GEMMs of
    ops.linear_mma) or "cublas"; route(w, m, k) resolves "mma" for a weight the GEMMs do not take."""
    if m <= GEMV_MAX_M[bits]:
        return "gemv"
    return "mma" if m <= (WGMMA16_MAX_M if bits == 16 else WGMMA_MAX_M) else "cublas"


def route(w, m: int, k: int, activation=None) -> str:
    """The path linear() takes on the device for M rows of x by w: path(bits, m), where "mma" needs the
    GEMMs to take w (quantized weights up to MMA_MAX_M rows always, else where the wgmma kernel takes it,
    linear_mma.wgmma_fits); otherwise the GEMV up to GEMV_ROWS rows, then cuBLAS."""
    bits = weight_bits(w)
    p = path(bits, m)
    if p != "mma" or (bits < 16 and m <= MMA_MAX_M) or wgmma_fits(w, k, activation):
        return p
    return "gemv" if m <= GEMV_ROWS else "cublas"


def tile_config(bits: int, m: int, n: int, k: int, epilogue="store", sms=132, clusters=True, group_size=128) -> Tile:
    """The tile for M rows of x, N outputs and K inputs, from the H100 sweeps (docs/linear.md).

    Quantized weights at M <= 8 (the GEMV sweep; int8 from the decode-graph sweep; from 9 rows
    linear() takes the GEMM, and the M > 8 rule below serves direct calls, bench linear's): U = 1
    int4 quad per stage below 64 quads of K, else 2 (int8: always 2; int4 also at 1-3 blocks per SM,
    the grid in one wave: llama3-8b's o 6.5 -> 4.9 us in the H100 sweep; at 2-3 blocks only g128,
    whose U = 2 kernel fits the 80 registers of three 8-warp blocks an SM without spills (ptxas:
    g64 / g32 spill), and its launch bounds promise 3); 4 warps per block from 6
    blocks per SM on, int8 16 at 1-2 blocks per SM, else 8; a grid of fewer blocks than SMs splits
    K over a cluster of up to 4 blocks (sm_90), each keeping >= two pipeline stages (2 WARPS U
    quads); on 256+ blocks a split measured slower. fp16 / bf16 weights and M > 8 (the sweep's tiles; the
    M <= 8 rule measured slower there): RT = 2 at M > 8 once the grid still has >= 4
    blocks per SM, U = 4 / RT (/ 2 for int4), at M > 8 16 warps below 4 blocks per SM, else 8 (fp16
    at M <= 8: 8 warps, 3-14 % faster than 16 on every phi3-mini and gemma2-9b GEMV of 192-576
    blocks in the decode-graph sweep); fp16 at M <= 8
    with >= 6 blocks per SM and K < 1024 (< 32 quads) U = 1 and 4 warps (smollm2's lm_head, 576 x
    49152: 23.1 us against 28.2 at U = 4 with 8 warps; llama3-8b's 4096 x 128256 keeps U = 4 with
    8 warps, its best: docs/decode.md). With a gated epilogue half the warps take the
    gate rows and half the up rows, each warp as in a plain GEMV."""
    nt = 1 if m <= 8 else 2
    rt = 2 if nt == 2 and epilogue not in GATED and n >= 16 * 2 * 4 * sms else 1
    blocks = -(-n // (16 * rt))
    quads = -(-k // QUAD_K[bits])
    if bits == 16 or nt == 2:
        if bits == 16 and nt == 1 and blocks >= 6 * sms and quads < 32:
            return Tile(1, 1, 1, 4, 1)  # short rows, many blocks (a small model's lm_head)
        u = max(1, 4 // rt // (2 if bits == 4 else 1))
        return Tile(nt, rt, u, 16 if nt == 2 and rt == 1 and blocks < 4 * sms else 8, 1)
    one_wave = bits == 4 and sms <= blocks < (3 if group_size == 128 else 2) * sms  # at U = 2
    u = 2 if bits == 8 or quads >= 64 or one_wave else 1
    occupancy = 3 if one_wave and blocks >= 2 * sms else 0
    warps = 4 if blocks >= 6 * sms else 16 if bits == 8 and sms <= blocks <= 2 * sms else 8
    split = 1
    while clusters and split < 4 and blocks * split < sms and quads >= 2 * split * warps * u:
        split *= 2
    return Tile(nt, rt, u, warps, split, occupancy)


def instantiation(dtype, bits: int, group_size: int, tile: Tile, epilogue="store", staged=0,
                  integer_zeros=False) -> str:
    """integer_zeros: int4 zero points all integers in 0..15 (Int4Weight.integer_zeros), subtracted in
    the nibble conversion instead of through a second sum per group. staged (XS): 0 x read from global
    memory, 1 staged in shared memory (normalized there with a norm), 2 also linear's add first."""
    nt, rt, u, warps, split, occupancy = tile
    iz = "true" if bits == 4 and integer_zeros else "false"
    head = f"{runtime.ctype(dtype)}, {bits}, {group_size}, {iz}, {nt}, {rt}, {u}, {warps}"
    tail = f"{EPILOGUES[epilogue]}, {int(staged)}, {occupancy or 16 // warps}"
    if split == 1:
        return f"linear_kernel<{head}, {tail}>"
    return f"linear_split_kernel<{head}, {split}, {tail}>"


def norm_stride(k: int) -> int:
    """Elements per row of the normalized x in shared memory (norm_stride of linear_stage.cuh)."""
    return -(-k // 64) * 64 + 32


def norm_fits(m: int, k: int, dtype) -> bool:
    """Whether the GEMV normalizes x itself: the rows of one launch (<= GEMV_ROWS) fit NORM_SMEM."""
    return min(m, GEMV_ROWS) * norm_stride(k) * np.dtype(dtype).itemsize <= NORM_SMEM


def staged_smem(m: int, k: int, dtype, bits: int, norm: bool, add: bool) -> int:
    """Dynamic shared memory of an XS GEMV (stage_rows in linear_stage.cuh), norm_stride(k) elements a row:
    the m rows of x; with fp16 / bf16 weights (WS) also add's y0 rows, then the norm weight and
    add's weight."""
    if bits != 16:
        rows = m
    else:
        rows = 2 * m + 2 if add else m + int(norm)
    return rows * norm_stride(k) * np.dtype(dtype).itemsize


def stages_x(m: int, k: int, dtype, norm: bool) -> bool:
    """Whether the GEMV reads x from shared memory (the XS kernels): with a norm (the caller checked
    norm_fits), and without one whenever the rows fit too (K % 8 == 0: 16-byte rows)."""
    return norm or (k % 8 == 0 and norm_fits(m, k, dtype))


def reduce_instantiation(dtype) -> str:
    """linear_argmax_reduce_kernel over float32 partials or over logits of `dtype`."""
    return f"linear_argmax_reduce_kernel<{runtime.ctype(dtype)}>"


def dequant_instantiation(dtype, bits: int, group_size: int) -> str:
    return f"linear_dequant_kernel<{runtime.ctype(dtype)}, {bits}, {group_size}>"


def _formats():
    yield 16, 0, False
    yield 8, 0, False
    for g in GROUP_SIZES:
        yield 4, g, True
        yield 4, g, False


INSTANTIATIONS = sorted(
    {instantiation(dt, b, g, tile_config(b, m, n, k, epi, group_size=g), epi, norm, iz) for dt in KERNEL_DTYPES
     for b, g, iz in _formats() for m in {1, GEMV_ROWS if b == 16 else GEMV_MAX_M[b]}
     for n in (1024, 3072, 6144, 1 << 20) for k in (576, 4096)
     for epi in EPILOGUES for norm in {False, m == 1}
     if epi != "gelu_and_mul" or (m, n, k) == (1, 6144, 4096)}  # GELU differs from SiLU in its activation only
    | {instantiation(dt, b, g, tile_config(b, 1, 3072, 4096, epi, group_size=g), epi, 2, iz) for dt in KERNEL_DTYPES
       for b, g, iz, epi in ((16, 0, False, "store"), (8, 0, False, "gelu_and_mul"), (4, 128, True, "store"))}
    # linear's add (Gemma's output norms): the prologue is the same for every format and epilogue
    | {dequant_instantiation(dt, b, g) for dt in KERNEL_DTYPES for b, g, _ in _formats() if b < 16}
    | {reduce_instantiation(dt) for dt in (np.float32, *KERNEL_DTYPES)})


def linear_reference(x, w, bias=None):
    """float32 [M, N]: x @ dequantized(W).T + bias, all in float32."""
    wf = w.dequantize() if isinstance(w, (Int8Weight, Int4Weight)) else np.asarray(w, dtype=np.float32)
    y = np.asarray(x, dtype=np.float32) @ wf.T
    return y if bias is None else y + np.asarray(bias, dtype=np.float32)


def _check_weight(w, k, dev):
    """Validate the weight object against in_features k; returns N."""
    if isinstance(w, (Int8Weight, Int4Weight)):
        return check_quant_weight(w, k, dev)
    runtime.check("w", w, ndim=2)
    n = w.shape[0]
    runtime.check("w", w, shape=(n, k))
    if runtime.is_device_array(w) != dev:
        raise ValueError("w: weight arrays must be numpy for numpy x and cupy for cupy x "
                         "(quantized weights: w.to_device())")
    return n


def _check_inputs(x, w, dev):
    """Check x and w (dtype, shape, K alignment on the device); returns (M, K, N)."""
    runtime.check("x", x, dtype=KERNEL_DTYPES, ndim=2)
    m, k = x.shape
    n = _check_weight(w, k, dev)
    bits = weight_bits(w)
    if bits == 16:
        runtime.check("w", w, dtype=x.dtype)
    if dev:
        if k % (need := {16: 8, 8: 16, 4: 32}[bits]):
            raise ValueError(f"x: got K = {k} columns, need a multiple of {need} for {bits}-bit weights")
        runtime.check("x", x, align=16)
        runtime.check("w" if bits == 16 else "w.qweight", w if bits == 16 else w.qweight, align=16)
    return m, k, n


def linear(x, w, bias=None, out=None, activation=None, norm=None, residual=None, add=None, add_out=None):
    """x @ W.T (+ bias), or its act-and-mul of the two halves, of x or its RMSNorm, plus a
    residual; with add, (that, the new x); see the module docstring."""
    dev = runtime.on_device(x, bias, out, residual, _norm_weight(norm), *_add_arrays(add, norm), add_out)
    m, k, n_w = _check_inputs(x, w, dev)
    n, out = check_epilogue(x, n_w, bias, out, activation, residual)
    _check_norm(norm, x)
    via = route(w, m, k, activation) if dev else None
    if add is not None:
        runtime.check("add y0", add[0], dtype=x.dtype, shape=x.shape)
        runtime.check("add weight", add[1], dtype=x.dtype, shape=(k,))
        if not (via == "gemv" and norm_fits(m, k, x.dtype)):  # the add first, on its own
            x = rms_norm(add[0], add[1], norm[1], add_to=x, out=add_out)
            return linear(x, w, bias, out, activation, norm, residual), x
        add_out = runtime.check_out(add_out, x.shape, x.dtype, x)
        cp = runtime.require_cupy()
        if cp.may_share_memory(add_out, x) or cp.may_share_memory(add_out, add[0]):
            raise ValueError("add_out: must not overlap x or y0 (the GEMV's blocks read them while one writes it)")
        for name, a in (("add y0", add[0]), ("add weight", add[1]), ("add_out", add_out)):
            runtime.check(name, a, align=16)
    if not dev:
        y = linear_reference(x if norm is None else rms_norm_reference(x, *norm), w, bias)
        y = (act_and_mul_reference(y, GATED[activation][0]) if activation else y).astype(x.dtype)  # rounded once
        out[...] = y if residual is None else (y.astype(np.float32) + residual.astype(np.float32)).astype(x.dtype)
        return out
    runtime.check("out", out, align=16)
    if via == "mma":
        return linear_mma(x, w, bias, out, activation, residual, norm)
    if norm is not None and (via != "gemv" or not norm_fits(m, k, x.dtype)):
        x, norm = rms_norm(x, *norm), None
    if via == "cublas":
        if activation:
            return GATED[activation][1](_prefill(x, w, bias, runtime.require_cupy().empty((m, n_w), x.dtype)), out=out)
        _prefill(x, w, bias, out)
        if residual is not None:
            out += residual  # T(T(y) + residual): one rounding of the exact sum
        return out
    epilogue = activation or "store"
    for m0 in range(0, m, GEMV_ROWS):
        rows = slice(m0, min(m, m0 + GEMV_ROWS))
        _gemv(x[rows], w, bias, out[rows], _tile(w, rows.stop - m0, n, k, epilogue), epilogue,
              norm=norm, residual=None if residual is None else residual[rows],
              add=None if add is None else (add[0][rows], add[1], add_out[rows]))
    return out if add is None else (out, add_out)


def _add_arrays(add, norm) -> tuple:
    """linear's add checked for form: its (y0, weight) arrays, or () without add."""
    if add is None:
        return ()
    if not (isinstance(add, tuple) and len(add) == 2):
        raise ValueError("add: need a (y0, weight) pair or None")
    if norm is None:
        raise ValueError("add: needs norm (x + rms_norm(y0) is then normalized)")
    return add


def _norm_weight(norm):
    if norm is None:
        return None
    if not (isinstance(norm, tuple) and len(norm) == 2):
        raise ValueError("norm: need a (weight, eps) pair or None")
    return norm[0]


def _check_norm(norm, x):
    if norm is not None:
        runtime.check("norm weight", norm[0], dtype=x.dtype, shape=(x.shape[1],))


def argmax_workspace_size(n: int) -> int:
    """int32 elements of linear_argmax's workspace for N logits (any M, any weight format)."""
    return 2 * GEMV_ROWS * -(-n // 16)


def linear_argmax(x, w, out=None, workspace=None, norm=None):
    """int32 [M]: argmax over N of x (or its RMSNorm) @ W.T rounded to x's dtype, ties to the lowest index."""
    dev = runtime.on_device(x, out, workspace, _norm_weight(norm))
    m, k, n = _check_inputs(x, w, dev)
    _check_norm(norm, x)
    out = runtime.check_out(out, (m,), np.int32, x)
    if not dev:
        xn = x if norm is None else rms_norm_reference(x, *norm)
        logits = linear_reference(xn, w).astype(x.dtype).astype(np.float32)  # rounded as linear() stores them
        out[...] = np.argmax(logits, axis=1)
        return out
    if route(w, m, k) != "gemv":  # the logits as linear() makes them, then one block per row
        logits = linear(x, w, norm=norm)
        runtime.launch(runtime.kernel("linear", reduce_instantiation(x.dtype)), (m,), (1024,),
                       (logits, NULL, out, np.int32(n)))
        return out
    if norm is not None and not norm_fits(m, k, x.dtype):
        x, norm = rms_norm(x, *norm), None
    cp = runtime.require_cupy()
    if workspace is None:
        workspace = cp.empty(argmax_workspace_size(n), np.int32)
    runtime.check("workspace", workspace, dtype=np.int32, ndim=1)
    if workspace.size < argmax_workspace_size(n):
        raise ValueError(f"workspace: got {workspace.size} elements, need >= {argmax_workspace_size(n)} "
                         "(argmax_workspace_size(N))")
    reduce = runtime.kernel("linear", reduce_instantiation(np.float32))
    for m0 in range(0, m, GEMV_ROWS):
        mc = min(GEMV_ROWS, m - m0)
        tile = _tile(w, mc, n, k, "argmax")
        nb = -(-n // (16 * tile.rt))
        vals, idx = workspace[:mc * nb].view(np.float32), workspace[mc * nb:2 * mc * nb]
        _gemv(x[m0:m0 + mc], w, None, None, tile, "argmax", (vals, idx), norm=norm)
        runtime.launch(reduce, (mc,), (1024,), (vals, idx, out[m0:m0 + mc], np.int32(nb)))
    return out


def _tile(w, m, n, k, epilogue):
    info = runtime.device_info()
    return tile_config(weight_bits(w), m, n, k, epilogue, info["sm_count"], int(info["arch"][3:]) >= 90,
                       getattr(w, "group_size", 128))


def _gemv(x, w, bias, out, tile, epilogue="store", parts=(NULL, NULL), norm=None, residual=None, add=None):
    """Launch linear_kernel / linear_split_kernel with `tile` on checked arguments (M <= 8 tile.nt);
    norm: (weight, eps) to normalize x in the kernel (norm_fits), residual: added by EPI_STORE, add:
    (y0, weight, new x) of linear's add, with norm. The kernel stages x in shared memory whenever
    its rows fit (norm_fits), normalized or not."""
    (m, k), bits = x.shape, weight_bits(w)
    n = w.shape[0] // (2 if epilogue in GATED else 1)
    staged = 2 if add is not None else stages_x(m, k, x.dtype, norm is not None)
    kern = runtime.kernel("linear", instantiation(x.dtype, bits, w.group_size if bits == 4 else 0, tile, epilogue,
                                                  staged, bits == 4 and w.integer_zeros))
    qweight = w if bits == 16 else w.qweight
    norm_w, eps = norm if norm is not None else (NULL, 0.0)
    args = (x, qweight, _scales(w), NULL if bias is None else bias, norm_w, np.float32(eps),
            NULL if residual is None else residual, NULL if out is None else out, *parts,
            np.int32(m), np.int32(n), np.int32(k), *(add if add is not None else (NULL, NULL, NULL)))
    smem = staged_smem(m, k, x.dtype, bits, norm is not None, add is not None) if staged else 0
    runtime.launch(kern, (-(-n // (16 * tile.rt)), tile.split), (32 * tile.warps,), args, smem)
    return out


def dequantize_weight(w, dtype):
    """Device [N, K] weight of `dtype` from an Int8Weight / Int4Weight on the device."""
    cp = runtime.require_cupy()
    n, k = w.shape
    bits = weight_bits(w)
    scratch = cp.empty((n, k), dtype=dtype)
    kern = runtime.kernel("linear", dequant_instantiation(dtype, bits, w.group_size if bits == 4 else 0))
    runtime.launch(kern, (-(-(n * k // 8) // 256),), (256,), (w.qweight, _scales(w), scratch, np.int32(n), np.int32(k)))
    return scratch


def _scales(w):
    """The scales argument of the kernels: int8 scales, int4 (scale, zero) pairs, null for fp16 / bf16."""
    return w.scales_zeros if isinstance(w, Int4Weight) else w.scales if isinstance(w, Int8Weight) else NULL


def _prefill(x, w, bias, out):
    """out = x @ W.T + bias through cuBLAS (ops.cublas: fp32 compute, capturable), rounded once. With a
    bias the product goes to an fp32 scratch pre-filled with it (beta = 1), then to T: into a T output
    cuBLAS may round the product before it adds C (H100, bf16, K = 8: -5.234 + 4.719 gave -0.5, not
    -0.5156)."""
    cp = runtime.require_cupy()
    wt = w if weight_bits(w) == 16 else dequantize_weight(w, x.dtype)
    if bias is None:
        return gemm(x, wt, out)
    acc = gemm(x, wt, cp.broadcast_to(bias.astype(cp.float32), out.shape).copy(), beta=1.0)
    out[...] = acc  # the one rounding to T
    return out
