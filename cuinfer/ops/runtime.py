"""Kernel runtime: compile cuda_src/<family>.cu with NVRTC, cache, load through CuPy, launch.

One mechanism serves the GPU path and the compile check:

    compile_family(family, exprs, arch) -> Compiled(cubin, lowered names)

builds every template instantiation in `exprs` (strings such as
"rms_norm_kernel<__half, 8>") in one NVRTC program for `arch` ("sm_90"). It needs
no GPU, only NVRTC and the CUDA headers. `kernel(family, expr)` compiles one
instantiation for the current device (memory cache, then disk cache keyed by the
source hash, the instantiation, the arch and the NVRTC version) and returns a
`cupy.RawKernel` loaded through `cupy.RawModule`. `precompile(pairs)` fills that disk cache with
many instantiations at once, one NVRTC process per core (warm-ups, benchmark sweeps, a GPU test run
on a fresh machine).

Launchers use `check(...)` to validate arrays before a launch: a bad launch must
never reach the GPU.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CompileError, CuinferError, NoDeviceError, bfloat16  # noqa: F401 (runtime.CuinferError & co)

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


# ------------------------------------------------------------------------ compiling

def source_dir() -> Path:
    here = Path(__file__).resolve().parent.parent  # the package: cuinfer/cuda_src when installed
    for d in (here.parent / "cuda_src", here / "cuda_src"):
        if d.is_dir():
            return d
    raise CuinferError(f"cuda_src/ not found next to {here}: reinstall cuinfer")


def cuda_include_dir() -> str:
    """Directory that holds cuda_fp16.h (pip wheel, CUDA_PATH or /usr/local/cuda)."""
    candidates = []
    try:
        from cuda import pathfinder

        candidates.append(pathfinder.find_nvidia_header_directory("cudart"))
    except Exception:
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            candidates.append(os.path.join(os.environ[env], "include"))
    candidates.append("/usr/local/cuda/include")
    for c in candidates:
        if c and os.path.exists(os.path.join(c, "cuda_fp16.h")):
            return c
    raise CompileError(
        "the CUDA headers (cuda_fp16.h) were not found: pip install nvidia-cuda-runtime-cu12 "
        "(or -cu13), or set CUDA_PATH to a CUDA toolkit"
    )


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    lowered: dict  # instantiation string -> mangled name


def _nvrtc():
    require_cupy()
    from cupy.cuda import nvrtc

    return nvrtc


def nvrtc_version() -> tuple:
    return tuple(_nvrtc().getVersion())


def compile_options(arch: str, pdl: bool = False, defines: tuple = ()) -> list:
    """NVRTC options; pdl compiles the programmatic-dependent-launch waits and triggers in
    (CUINFER_PDL in common.cuh), for kernels that `launch` starts with the PDL attribute; defines:
    macros set to 1 (a family's measurement builds, e.g. linear_mma.cu's CUINFER_TIMELINE).
    sm_90 builds for sm_90a, Hopper's arch-specific target (wgmma; a cubin that runs on every
    compute capability 9.0 device)."""
    target = "sm_90a" if arch == "sm_90" else arch
    return ["-std=c++17", f"-arch={target}", "-lineinfo", f"-I{source_dir()}",
            f"-I{cuda_include_dir()}"] + (["-DCUINFER_PDL=1"] if pdl else []) + [f"-D{d}=1" for d in defines]


def source_hash(family: str) -> str:
    h = hashlib.sha256()
    for f in sorted(source_dir().glob("*.cuh")) + [source_dir() / f"{family}.cu"]:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def compile_family(family: str, exprs, arch: str, pdl: bool = False, defines: tuple = ()) -> Compiled:
    """Compile the instantiations `exprs` of cuda_src/<family>.cu for `arch` (e.g. "sm_90")."""
    nvrtc = _nvrtc()
    path = source_dir() / f"{family}.cu"
    if not path.exists():
        raise CompileError(f"no kernel family {family!r}: {path} does not exist")
    prog = nvrtc.createProgram(path.read_text(), str(path), [], [])
    try:
        for e in exprs:
            nvrtc.addNameExpression(prog, e)
        try:
            nvrtc.compileProgram(prog, compile_options(arch, pdl, defines))
        except nvrtc.NVRTCError as err:
            log = nvrtc.getProgramLog(prog)
            raise CompileError(f"NVRTC failed on {family} for {arch} ({err}):\n{log}") from None
        lowered = {e: nvrtc.getLoweredName(prog, e) for e in exprs}
        return Compiled(bytes(nvrtc.getCUBIN(prog)), lowered)
    finally:
        nvrtc.destroyProgram(prog)


def cache_dir() -> Path:
    base = os.environ.get("CUINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "cuinfer")
    return Path(base) / "kernels"


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


def cached_cubin(family: str, expr: str, arch: str, pdl: bool, defines: tuple = ()) -> tuple:
    """(cubin path, lowered name) of `expr` in the disk cache for (arch, pdl, defines), compiled and
    stored first if missing. The key: the source hash, the instantiation, the arch, the NVRTC version
    and the options. No GPU needed."""
    cubin_path, meta_path = _cache_paths(family, expr, arch, pdl, defines)
    if not (cubin_path.exists() and meta_path.exists()):
        compiled = compile_family(family, [expr], arch, pdl, defines)
        cubin_path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(cubin_path, compiled.cubin)
        _atomic_write(meta_path, json.dumps(compiled.lowered).encode())
    return cubin_path, json.loads(meta_path.read_text())[expr]


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
    missing = [j for j in jobs if not all(p.exists() for p in _cache_paths(*j))]
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


def _cache_paths(family: str, expr: str, arch: str, pdl: bool, defines: tuple = ()) -> tuple:
    key = hashlib.sha256(
        f"{source_hash(family)}|{expr}|{arch}|{nvrtc_version()}|{compile_options(arch, pdl, defines)}".encode()
    ).hexdigest()[:24]
    return cache_dir() / f"{family}-{key}.cubin", cache_dir() / f"{family}-{key}.json"


def _atomic_write(path: Path, data: bytes):
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


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
        _launch_ex(k, grid + (1,) * (3 - len(grid)), block + (1,) * (3 - len(block)), args, smem, pdl)
    else:
        k(grid, block, args, shared_mem=smem)


# Driver API structs of cuda.h (CUDA 12 / 13) for cuLaunchKernelEx, which CuPy does not wrap.
class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("value", ctypes.c_uint64 * 8)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3), ("smem", ctypes.c_uint32),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint32)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PARAM_FORMATS = {np.dtype(np.int32): "i4x", np.dtype(np.uint32): "I4x", np.dtype(np.float32): "f4x",
                  np.dtype(np.int64): "q", np.dtype(np.uint64): "Q", np.dtype(np.float64): "d"}


@functools.lru_cache(maxsize=None)
def _libcuda():
    """The CUDA driver library (the entry points runtime calls declared), or None where it cannot be loaded."""
    p = ctypes.c_void_p
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), p, p, p]
        lib.cuTensorMapEncodeTiled.argtypes = [p, ctypes.c_int, ctypes.c_uint32, p, p, p, p, p,
                                               ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):  # no driver, or one older than CUDA 12
        return None
    return lib


def _driver_call(name, *args):
    lib = _libcuda()
    if lib is None:
        raise CuinferError(f"{name}: the CUDA driver (libcuda.so.1) could not be loaded")
    err = getattr(lib, name)(*args)
    if err:
        msg = ctypes.c_char_p()
        lib.cuGetErrorName(err, ctypes.byref(msg))
        raise CuinferError(f"{name} failed: {msg.value.decode() if msg.value else err}")


@functools.lru_cache(maxsize=None)
def _pdl_driver():
    """The programmatic-stream-serialization launch attribute when programmatic dependent launch is
    on: an sm_90+ device, the driver found and CUINFER_PDL not 0; else None."""
    if os.environ.get("CUINFER_PDL", "1") == "0" or int(device_arch()[3:]) < 90 or _libcuda() is None:
        return None
    attr = _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    return attr


def _launch_ex(k, grid, block, args, smem, pdl):
    """cuLaunchKernelEx of k on the current stream, with programmatic stream serialization when pdl:
    a device array passes its pointer, a numpy scalar its value (each in an 8-byte slot of one
    parameter buffer), a bytes object its bytes (a struct passed by value)."""
    cp = require_cupy()
    fmt, values, blobs = ["<"], [], {}
    for i, a in enumerate(args):
        if isinstance(a, cp.ndarray):
            fmt.append("Q")
            values.append(a.data.ptr)
        elif isinstance(a, np.generic) and a.dtype in _PARAM_FORMATS:
            fmt.append(_PARAM_FORMATS[a.dtype])
            values.append(a.item())
        elif isinstance(a, bytes):
            blobs[i] = ctypes.create_string_buffer(a, len(a))
            fmt.append("Q")
            values.append(0)
        else:
            raise TypeError(f"kernel argument {a!r}: need a cupy array, bytes or a numpy scalar of "
                            f"{', '.join(map(str, _PARAM_FORMATS))}")
    buf = ctypes.create_string_buffer(struct.pack("".join(fmt), *values))
    base = ctypes.addressof(buf)
    params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(blobs[i]) if i in blobs else base + 8 * i
                                               for i in range(len(values))))
    attr = _pdl_driver() if pdl else None
    config = _LaunchConfig(grid, block, smem, cp.cuda.get_current_stream().ptr,
                           ctypes.pointer(attr) if attr is not None else None, 1 if attr is not None else 0)
    _driver_call("cuLaunchKernelEx", ctypes.byref(config), k.kernel.ptr, params, None)


def tensor_map(a, box) -> bytes:
    """A CUtensorMap (128 bytes) for TMA copies of `box`-shaped tiles (element counts, outermost
    first, as a shape) out of the C-contiguous 16-bit device array `a`, with the 128-byte swizzle
    (the innermost box side must be 64 elements) and zeros past the array's bounds. Passed to a
    kernel by value (launch takes bytes) as a `const __grid_constant__ TensorMap`. A map encodes
    only the address, shape, strides and box, so maps are cached on those: a paged prefill's K and V
    maps (of the cache's fixed buffers) are encoded once, not at every layer of every step."""
    if a.dtype.itemsize != 2 or not a.flags.c_contiguous or box[-1] * 2 != 128 or len(box) != a.ndim:
        raise ValueError(f"tensor_map: need a C-contiguous 16-bit array and a box of its rank ending in 64 "
                         f"(got {a.dtype}, shape {a.shape}, box {box})")
    return _encoded_map(a.data.ptr, tuple(a.shape), tuple(a.strides), tuple(box))


_DEVICE_MAPS: dict = {}  # (device, (pointer, shape, strides, box)) -> the map in device memory, kept for good


def tensor_map_device(a, shape, strides, box):
    """tensor_map's map of a view of the 16-bit device array `a` (its pointer with `shape` and byte
    `strides`, outermost first: the innermost stride one element, the others multiples of 16) as a
    128-byte device array, for a kernel that takes a `const TensorMap*` in global memory (launched
    through CuPy, with no host cost). Maps are kept for good, as graphs replay them: one per weight and
    box. The first call for a view copies its map to the device, which a stream capturing a CUDA graph
    cannot do: run the call once before capturing it (serving.runner.capture does)."""
    if (a.dtype.itemsize != 2 or strides[-1] != 2 or any(s % 16 for s in strides[:-1]) or box[-1] != 64
            or len(box) != len(shape)):
        raise ValueError(f"tensor_map_device: need a 16-bit view with unit innermost stride, 16-byte outer "
                         f"strides and a box ending in 64 (got {a.dtype}, shape {shape}, strides {strides}, box {box})")
    cp = require_cupy()
    key = (a.data.ptr, tuple(shape), tuple(strides), tuple(box))
    at = (cp.cuda.Device().id, key)
    if at not in _DEVICE_MAPS:
        if capturing():
            raise CuinferError("tensor_map_device: a new tensor map cannot be copied to the device during CUDA "
                               "graph capture: run the call once before capturing it")
        with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):  # not a graph's pool
            _DEVICE_MAPS[at] = cp.asarray(np.frombuffer(_encoded_map(*key), np.uint8))
    return _DEVICE_MAPS[at]


@functools.lru_cache(maxsize=1024)
def _encoded_map(ptr: int, shape: tuple, strides: tuple, box: tuple) -> bytes:
    rank = len(shape)
    dims = (ctypes.c_uint64 * rank)(*reversed(shape))
    steps = (ctypes.c_uint64 * max(rank - 1, 1))(*reversed(strides[:-1]))
    boxes = (ctypes.c_uint32 * rank)(*reversed(box))
    ones = (ctypes.c_uint32 * rank)(*([1] * rank))
    out = (ctypes.c_uint64 * 24)()  # 192 bytes: a 64-byte aligned 128-byte map inside
    addr = -(-ctypes.addressof(out) // 64) * 64
    # UINT16 data (bytes are bytes), no interleave, 128-byte swizzle, 256-byte L2 promotion, zero fill
    _driver_call("cuTensorMapEncodeTiled", addr, 1, rank, ptr, dims, steps, boxes, ones, 0, 3, 3, 0)
    return ctypes.string_at(addr, 128)


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
