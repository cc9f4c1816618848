"""Machine-ceiling probes for the wgmma GEMM (sm_90): bulk-copy streams and the wgmma issue rate.

stream_probe(w, x, grid, stages, shape, x_wrap, out=None, checksum=True, layout="runs") -> uint64 [1]
    w, x: uint8, 16-byte aligned; shape = (slots, w_bytes, x_bytes), one of STREAM_SHAPES. Block b of
    `grid` streams stages of w_bytes of w (its own run: w[(b stages + i) w_bytes:]) and x_bytes of x
    (x[i x_bytes % x_wrap:], one region every block reads) through a ring of `slots` slots of shared
    memory, one bulk copy each (the wgmma GEMM's weights from HBM and x from L2); `out` (zeroed by the
    caller) gets the 32-bit words landed summed mod 2^64, or with checksum=False those of each slot's
    first 16 bytes only (the copies alone, for timing). The other layouts (shape one of INT8_SHAPES)
    stream the same bytes as an int8 weight of grid 128 rows and stages 128 k, block b's stage i
    being its rows b 128 .. + 128 at k 128 i (a slot starts with row b 128's 16 bytes there):
    "box": w's first bytes are that weight [N, K] row-major, one tensor-map copy a stage, as the int8
    wgmma GEMM copies its weights; "tiles": w holds it in 2 KB tiles of 16 rows x 128 k, tile (t, i)
    at (t stages + i) 2 KB, eight bulk copies a stage (int8 stored as int4's tiles16 are).
    numpy arrays run the reference.
wgmma_probe(nx, warpgroups, registers, wait, iters, blocks) -> (cycles int64 [blocks], acc float32 [blocks])
    One block an SM, each warpgroup issuing `iters` groups of 8 wgmma m64n{nx}k16 (A from registers
    or from shared memory, B from shared memory, all ones) with a wait for all (wait 0) or all but
    the last group (wait 1) after each: the clock64 cycles of each block's loop, and its first
    accumulator (128 iters when every product landed). Needs sm_90.
"""
from __future__ import annotations

import numpy as np

from . import runtime
from .linear_mma import weight_map
from .quant import Int8Weight

STREAM_SHAPES = [(4, 32768, 0), (4, 0, 32768), (8, 8192, 0), (4, 8192, 32768), (6, 8192, 16384), (6, 16384, 8192)]
INT8_SHAPES = [(6, 16384, 8192)]
LAYOUTS = ("runs", "box", "tiles")
WGMMA_SHAPES = [(64, 2, True, 0), (128, 1, True, 0), (128, 2, True, 0), (128, 2, False, 0), (128, 2, True, 1),
                (256, 2, True, 0)]


def stream_instantiation(shape, checksum=True, layout="runs") -> str:
    slots, wb, xb = shape
    return f"stream_probe_kernel<{slots}, {wb}, {xb}, {str(checksum).lower()}, {LAYOUTS.index(layout)}>"


def wgmma_instantiation(nx: int, warpgroups: int, registers: bool, wait: int) -> str:
    return f"wgmma_probe_kernel<{nx}, {warpgroups}, {str(registers).lower()}, {wait}>"


INSTANTIATIONS = ([stream_instantiation(s, c) for s in STREAM_SHAPES for c in (True, False)]
                  + [stream_instantiation(s, c, lay) for s in INT8_SHAPES for c in (True, False) for lay in LAYOUTS[1:]]
                  + [wgmma_instantiation(*s) for s in WGMMA_SHAPES])


def stream_probe_reference(w, x, grid: int, stages: int, shape, x_wrap: int, checksum=True,
                           layout="runs") -> np.ndarray:
    """The words stream_probe lands (checksum=False: each slot's first 16 bytes), summed mod 2^64: uint64 [1]."""
    _, wb, xb = shape
    w = np.asarray(w[:grid * stages * wb])
    if not checksum and layout != "runs":  # row b 128's 16 bytes at k 128 i
        first = (w.reshape(grid * 128, stages * 128)[::128].reshape(grid, stages, 128) if layout == "box" else
                 w.reshape(grid * 8, stages, 2048)[::8])[:, :, :16]
        return np.array([int(np.ascontiguousarray(first).view(np.uint32).sum(dtype=np.uint64)) % (1 << 64)], np.uint64)
    if not checksum:  # a slot starts with its weights' run, or without weights its x
        first = w.reshape(grid * stages, wb)[:, :16] if wb else np.stack(
            [np.asarray(x[i * xb % x_wrap:][:16]) for i in range(stages)] * grid)
        return np.array([int(np.ascontiguousarray(first).view(np.uint32).sum(dtype=np.uint64)) % (1 << 64)], np.uint64)
    total = int(w.view(np.uint32).sum(dtype=np.uint64)) if wb else 0
    for i in range(stages if xb else 0):
        o = i * xb % x_wrap
        total += grid * int(np.asarray(x[o:o + xb]).view(np.uint32).sum(dtype=np.uint64))
    return np.array([total % (1 << 64)], np.uint64)


def _check_stream(w, x, grid, stages, shape, x_wrap, layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    shapes = STREAM_SHAPES if layout == "runs" else INT8_SHAPES
    if tuple(shape) not in shapes:
        raise ValueError(f"shape {tuple(shape)} is not one of the {layout} layout's shapes {shapes}")
    _, wb, xb = shape
    if grid < 1 or stages < 1:
        raise ValueError(f"grid and stages must be >= 1, got {grid} and {stages}")
    for name, a in (("w", w), ("x", x)):
        if a.dtype != np.uint8 or a.ndim != 1:
            raise ValueError(f"{name} must be 1-D uint8, got {a.dtype} {a.shape}")
    if w.size < grid * stages * wb:
        raise ValueError(f"w holds {w.size} bytes, the stream reads {grid * stages * wb}")
    if xb and (x_wrap % 16 or x_wrap < xb or x_wrap % xb or x.size < x_wrap):
        raise ValueError(f"x_wrap {x_wrap}: a multiple of x_bytes ({xb}) within x ({x.size} bytes)")


def stream_probe(w, x, grid: int, stages: int, shape, x_wrap: int, out=None, checksum=True, layout="runs"):
    """See the module docstring."""
    _check_stream(w, x, grid, stages, shape, x_wrap, layout)
    if isinstance(w, np.ndarray):
        return stream_probe_reference(w, x, grid, stages, shape, x_wrap, checksum, layout)
    cp = runtime.require_cupy()
    if runtime.device_info()["arch"] != "sm_90":
        raise runtime.CuinferError("stream_probe needs an sm_90 GPU (bulk copies)")
    if (w.data.ptr | x.data.ptr) % 16:
        raise ValueError("w and x must be 16-byte aligned")
    out = cp.zeros(1, cp.uint64) if out is None else out
    slots, wb, xb = shape
    src = w
    if layout == "box":  # the int8 GEMM's own map of w's bytes as an [N, K] weight, N = 128 grid, K = 128 stages
        n, k = 128 * grid, 128 * stages
        src = weight_map(Int8Weight(w[:n * k].view(cp.int8).reshape(n, k), None, (n, k)), gated=False)
    kern = runtime.kernel("probe", stream_instantiation(shape, checksum, layout))
    runtime.launch(kern, (grid,), (160,), (src, x, np.int32(stages), np.int64(max(x_wrap, 16)), out),
                   slots * (wb + xb) + (1024 if layout == "box" else 0))
    return out


def wgmma_probe(nx: int, warpgroups: int, registers: bool, wait: int, iters: int, blocks: int):
    """See the module docstring."""
    if (nx, warpgroups, registers, wait) not in WGMMA_SHAPES:
        raise ValueError(f"({nx}, {warpgroups}, {registers}, {wait}) is not one of WGMMA_SHAPES {WGMMA_SHAPES}")
    if iters < 1 or blocks < 1:
        raise ValueError(f"iters and blocks must be >= 1, got {iters} and {blocks}")
    cp = runtime.require_cupy()
    if runtime.device_info()["arch"] != "sm_90":
        raise runtime.CuinferError("wgmma_probe needs an sm_90 GPU (wgmma)")
    cycles, acc = cp.zeros(blocks, cp.int64), cp.full(blocks, np.nan, cp.float32)
    kern = runtime.kernel("probe", wgmma_instantiation(nx, warpgroups, registers, wait))
    runtime.launch(kern, (blocks,), (128 * warpgroups,), (np.int32(iters), cycles, acc), nx * 256 + 9 * 1024)
    return cycles, acc
