"""Kernel runtime: arrays and their checks, kernels loaded for the current device, launches.

`kernel(family, expr)` returns the `cupy.RawKernel` of one instantiation of cuda_src/<family>.cu
for the current device (a memory cache, then the disk cache of ops.build, which compiles it with
NVRTC where it is missing), loaded through `cupy.RawModule`. `precompile(pairs)` fills that disk
cache with many instantiations at once, one NVRTC process per core (warm-ups, benchmark sweeps, a
GPU test run on a fresh machine). `launch` starts a kernel on the current stream, through the
driver (ops.driver) where CuPy cannot: captured launches on sm_90 (programmatic dependent launch)
and by-value tensor maps.

Launchers use `check(...)` to validate arrays before a launch: a bad launch must
never reach the GPU.
"""
from __future__ import annotations

import functools
import os

import numpy as np

from ..errors import CompileError, CuinferError, NoDeviceError, bfloat16  # noqa: F401 (runtime.CuinferError & co)
from .build import cache_paths, cached_cubin
from .driver import PROGRAMMATIC_STREAM_SERIALIZATION, LaunchAttribute, libcuda
from .driver import launch_ex as _launch_ex

# --------------------------------------------------------------------------- arrays

CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "__half"}
if bfloat16 is not None:
    CTYPES[bfloat16] = "__nv_bfloat16"
FLOAT_DTYPES = tuple(CTYPES)


def ctype(dtype) -> str:
    """C++ type name of a floating dtype, as used in instantiation strings."""
    dtype = np.dtype(dtype)
    if dtype not in CTYPES:
        raise ValueError(f"dtype {dtype} is not supported: need one of float32, float16, bfloat16")
    return CTYPES[dtype]


def cupy_or_none():
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def pick_device(device=None) -> str:
    """"gpu" when a CUDA device is found (device None), else "cpu"; or the device asked for."""
    if device not in (None, "gpu", "cpu"):
        raise CuinferError(f"device: got {device!r}, need 'gpu' or 'cpu'")
    if device == "cpu":
        return device
    cp = cupy_or_none()
    try:
        found = cp is not None and cp.cuda.runtime.getDeviceCount() > 0
    except cp.cuda.runtime.CUDARuntimeError:
        found = False
    if device == "gpu" and not found:
        raise NoDeviceError("no CUDA device found: use --device cpu")
    return device or ("gpu" if found else "cpu")


def capturing() -> bool:
    """True when the current CuPy stream is capturing a CUDA graph."""
    cp = cupy_or_none()
    return cp is not None and cp.cuda.get_current_stream().is_capturing()


def is_device_array(x) -> bool:
    cp = cupy_or_none()
    return cp is not None and isinstance(x, cp.ndarray)


def require_cupy():
    cp = cupy_or_none()
    if cp is None:
        raise CuinferError(
            "CuPy is not installed: install cuinfer with the extra that matches your CUDA "
            "driver, pip install 'cuinfer[cuda12]' or 'cuinfer[cuda13]', or use the CPU path "
            "(numpy arrays, --device cpu)"
        )
    return cp


def on_device(*arrays) -> bool:
    """True when every array is a CuPy array, False when every one is NumPy; else ValueError."""
    cp = cupy_or_none()
    flags = {cp is not None and isinstance(a, cp.ndarray) for a in arrays if a is not None}
    if len(flags) > 1:
        raise ValueError("arguments mix numpy and cupy arrays: pass all of one kind")
    return flags == {True}


def check(name, x, *, dtype=None, ndim=None, shape=None, contiguous=True, align=None):
    """Validate a launcher argument, raising ValueError that names it, says what it got and needs.

    dtype: a dtype or a tuple of allowed dtypes; shape: a tuple with None for free axes;
    align: required alignment in bytes of the data pointer (device arrays only).
    """
    if dtype is not None:
        allowed = _dtypes(dtype)
        if x.dtype not in allowed:
            need = " or ".join(str(d) for d in allowed)
            raise ValueError(f"{name}: got dtype {x.dtype}, need {need}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: got {x.ndim} dimensions (shape {tuple(x.shape)}), need {ndim}")
    if shape is not None and tuple(shape) != x.shape:  # equal: no axis left to compare
        if len(shape) != x.ndim or any(s is not None and s != g for s, g in zip(shape, x.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: got shape {tuple(x.shape)}, need {want}")
    if contiguous and not x.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous (got strides {x.strides})")
    if align is not None and is_device_array(x) and x.data.ptr % align:
        raise ValueError(f"{name}: data pointer must be {align}-byte aligned")
    return x


@functools.lru_cache(maxsize=None)
def _dtypes(dtype) -> tuple:
    """check's dtype argument as a tuple of np.dtype (cached: every launcher checks its arguments on every call)."""
    return tuple(np.dtype(d) for d in (dtype if isinstance(dtype, tuple) else (dtype,)))


def check_out(out, shape, dtype, like):
    """Return `out` checked against (shape, dtype), or a new array of the module of `like`."""
    xp = require_cupy() if is_device_array(like) else np
    if out is None:
        return xp.empty(shape, dtype=dtype)
    if is_device_array(out) != is_device_array(like):
        raise ValueError("out: must be the same kind of array (numpy or cupy) as the inputs")
    return check("out", out, dtype=dtype, shape=tuple(shape))


def vector_widths(dtype) -> list:
    """Every vector width (elements) a launcher may pick for dtype: 16 bytes down to 1 element."""
    w = 16 // np.dtype(dtype).itemsize
    return [w >> i for i in range(w.bit_length())]


def vector_width(*arrays) -> int:
    """Elements per 16-byte vector that every array's row length and pointer allow (1 if none)."""
    width = 16 // max(a.dtype.itemsize for a in arrays)
    while width > 1:
        if all(a.shape[-1] % width == 0 and a.data.ptr % 16 == 0 for a in arrays):
            return width
        width //= 2
    return 1


# ------------------------------------------------------------------------ kernels

def device_arch() -> str:
    cp = require_cupy()
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError:
        n = 0
    if n == 0:
        raise NoDeviceError("no CUDA device found: use numpy arrays (the CPU path) or --device cpu")
    major, minor = cp.cuda.Device().compute_capability[:-1], cp.cuda.Device().compute_capability[-1]
    if int(major) < 8:
        raise CuinferError(f"GPU compute capability {major}.{minor} is not supported: need 8.0 or newer")
    return f"sm_{major}{minor}"


@functools.lru_cache(maxsize=None)
def kernel(family: str, expr: str, defines: tuple = ()):
    """The compiled `expr` of cuda_src/<family>.cu for the current device, as a cupy.RawKernel."""
    module, lowered = _module(family, expr, defines)
    return module.get_function(lowered)


def module_global(family: str, expr: str, name: str, dtype, shape, defines: tuple = ()):
    """The __device__ array `name` of the module kernel(family, expr, defines) launches, as a CuPy
    array over it (a measurement build's stamps)."""
    cp = require_cupy()
    return cp.ndarray(shape, dtype, memptr=_module(family, expr, defines)[0].get_global(name))


@functools.lru_cache(maxsize=None)
def _module(family: str, expr: str, defines: tuple):
    cp = require_cupy()
    cubin_path, lowered = cached_cubin(family, expr, device_arch(), _pdl_driver() is not None, defines)
    return cp.RawModule(path=str(cubin_path)), lowered


def precompile(pairs, arch: str | None = None, pdl: bool | None = None, workers: int | None = None) -> int:
    """Compile into the disk cache every (family, expr) of `pairs` it lacks, one NVRTC process per
    core (NVRTC compiles a program on one thread, 0.5-1 s an instantiation), so that the kernel() calls
    after it only load cubins; the count compiled. arch, pdl: None, what kernel() takes on this
    device."""
    if arch is None:
        arch = device_arch()
    if pdl is None:
        pdl = _pdl_driver() is not None
    jobs = sorted({(f, e, arch, pdl) for f, e in pairs})
    missing = [j for j in jobs if not all(p.exists() for p in cache_paths(*j))]
    workers = min(workers or os.cpu_count() or 1, len(missing))
    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawned, not forked: the children run NVRTC only and must not inherit a CUDA context
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(cached_cubin, *zip(*missing)))
    else:
        for job in missing:
            cached_cubin(*job)
    return len(missing)


def launch(k, grid, block, args, smem: int = 0):
    """Launch a RawKernel on the current stream; first raises the dynamic shared memory limit when
    static + dynamic go above the default 48 KiB. While the stream is capturing a CUDA graph on
    sm_90 (and CUINFER_PDL is not 0) it launches through cuLaunchKernelEx with programmatic stream
    serialization, so in the graph's replays a kernel may start while the previous one finishes
    (the kernels are compiled with their pdl_wait / pdl_trigger calls, see common.cuh). Eager
    launches keep CuPy's path: the ctypes one costs ~50 us of host time (docs/decode.md), taken
    only by kernels with a by-value blob argument (`bytes`: a tensor_map), which CuPy cannot pass."""
    if smem and smem + k.shared_size_bytes > 48 * 1024 and k.max_dynamic_shared_size_bytes < smem:
        k.max_dynamic_shared_size_bytes = smem
    grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,)))
    block = tuple(int(b) for b in (block if isinstance(block, tuple) else (block,)))
    if min(grid) <= 0:
        return  # empty problem: nothing to launch
    pdl = _pdl_driver() is not None and capturing()
    if pdl or any(isinstance(a, bytes) for a in args):
        _launch_ex(k, grid + (1,) * (3 - len(grid)), block + (1,) * (3 - len(block)), args, smem,
                   _pdl_driver() if pdl else None)
    else:
        k(grid, block, args, shared_mem=smem)


@functools.lru_cache(maxsize=None)
def _pdl_driver():
    """The programmatic-stream-serialization launch attribute when programmatic dependent launch is
    on: an sm_90+ device, the driver found and CUINFER_PDL not 0; else None."""
    if os.environ.get("CUINFER_PDL", "1") == "0" or int(device_arch()[3:]) < 90 or libcuda() is None:
        return None
    attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    return attr


@functools.lru_cache(maxsize=None)
def device_info() -> dict:
    cp = require_cupy()
    device_arch()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    return {
        "name": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
        "arch": device_arch(),
        "sm_count": props["multiProcessorCount"],
        "l2_bytes": props["l2CacheSize"],
        "smem_per_block_optin": props["sharedMemPerBlockOptin"],
        "memory_bytes": props["totalGlobalMem"],
    }
