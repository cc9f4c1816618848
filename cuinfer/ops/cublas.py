"""cuBLAS GEMMs that CUDA graphs can capture, through ctypes.

    gemm(x, w, out, out_dtype)    # out [M, N] = x [M, K] @ w.T ([N, K] row-major), fp32 compute

CuPy's cuBLAS wrapper refuses to be called under stream capture (its setStream raises). cuBLAS
itself captures fine once its handle has a workspace of its own (cublasSetWorkspace): it then
allocates nothing while a graph is captured. So cuinfer keeps one handle per device, created with
a WORKSPACE-byte workspace, and calls cublasGemmEx on the current stream, with fp32 split-K
reductions (no second rounding in fp16 / bf16). The library is the one CuPy loaded.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from . import runtime

WORKSPACE = 32 << 20  # bytes: what cuBLAS asks for on Hopper
CUDA_DTYPES = {np.dtype(np.float16): 2, runtime.bfloat16: 14, np.dtype(np.float32): 0}  # cudaDataType
OP_N, OP_T = 0, 1
COMPUTE_32F = 68  # cublasComputeType_t
GEMM_DEFAULT = -1
MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16  # split-K partial sums stay fp32
LIBRARIES = ("libcublas.so.13", "libcublas.so.12", "libcublas.so")


@functools.lru_cache(maxsize=None)
def _library():
    from cupy_backends.cuda.libs import cublas  # noqa: F401 (loads libcublas; dlopen by name then finds it)

    for name in LIBRARIES:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        for fn in ("cublasCreate_v2", "cublasSetWorkspace_v2", "cublasSetStream_v2", "cublasSetMathMode",
                   "cublasGemmEx"):
            getattr(lib, fn).restype = ctypes.c_int
        return lib
    raise runtime.CuinferError(f"cuBLAS: none of {', '.join(LIBRARIES)} could be loaded")


def _check(status: int, what: str):
    if status != 0:
        raise runtime.CuinferError(f"cuBLAS {what} failed with status {status}")


@functools.lru_cache(maxsize=None)
def _handle(device: int):
    """(handle, workspace) of `device`: kept for the process's life, like CuPy's own handle."""
    cp, lib = runtime.require_cupy(), _library()
    handle = ctypes.c_void_p()
    _check(lib.cublasCreate_v2(ctypes.byref(handle)), "create")
    workspace = cp.empty(WORKSPACE, np.uint8)
    _check(lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(workspace.data.ptr), ctypes.c_size_t(WORKSPACE)),
           "set workspace")
    _check(lib.cublasSetMathMode(handle, MATH_DISALLOW_REDUCED_PRECISION_REDUCTION), "set math mode")
    return handle, workspace


def gemm(x, w, out, beta: float = 0.0):
    """out = x @ w.T + beta * out for row-major x [M, K], w [N, K] (one dtype) and out [M, N] (that
    dtype or float32), accumulated in fp32 and rounded once; on the current stream, capturable."""
    cp, lib = runtime.require_cupy(), _library()
    (m, k), n = x.shape, w.shape[0]
    for name, a in (("x", x), ("w", w), ("out", out)):
        if not a.flags.c_contiguous:
            raise ValueError(f"{name}: need a C-contiguous array")
    if w.dtype != x.dtype or w.shape[1] != k or out.shape != (m, n) or out.dtype not in (x.dtype, np.float32):
        raise ValueError(f"gemm: x {x.dtype} {x.shape}, w {w.dtype} {w.shape}, out {out.dtype} {out.shape} "
                         "do not fit out = x @ w.T")
    handle, _ = _handle(cp.cuda.Device().id)
    _check(lib.cublasSetStream_v2(handle, ctypes.c_void_p(cp.cuda.get_current_stream().ptr)), "set stream")
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(beta)
    t = CUDA_DTYPES[x.dtype]
    # column-major out.T [N, M] = W [N, K] (w row-major = col-major [K, N], transposed) @ x.T
    _check(lib.cublasGemmEx(handle, OP_T, OP_N, n, m, k, ctypes.byref(alpha), ctypes.c_void_p(w.data.ptr), t, k,
                            ctypes.c_void_p(x.data.ptr), t, k, ctypes.byref(beta), ctypes.c_void_p(out.data.ptr),
                            CUDA_DTYPES[out.dtype], n, COMPUTE_32F, GEMM_DEFAULT), "gemmEx")
    return out
