"""The CUDA driver through ctypes, for what CuPy does not wrap: cuLaunchKernelEx (a launch attribute,
structs passed by value) and TMA tensor maps (cuTensorMapEncodeTiled). runtime.launch takes this path
for captured launches on sm_90 (programmatic dependent launch) and for kernels with a by-value map.
"""
from __future__ import annotations

import ctypes
import functools
import struct

import numpy as np

from ..errors import CuinferError


# Driver API structs of cuda.h (CUDA 12 / 13) for cuLaunchKernelEx, which CuPy does not wrap.
class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("value", ctypes.c_uint64 * 8)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3), ("smem", ctypes.c_uint32),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)),
                ("num_attrs", ctypes.c_uint32)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PARAM_FORMATS = {np.dtype(np.int32): "i4x", np.dtype(np.uint32): "I4x", np.dtype(np.float32): "f4x",
                  np.dtype(np.int64): "q", np.dtype(np.uint64): "Q", np.dtype(np.float64): "d"}


@functools.lru_cache(maxsize=None)
def libcuda():
    """The CUDA driver library (the entry points called here declared), or None where it cannot be loaded."""
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
    lib = libcuda()
    if lib is None:
        raise CuinferError(f"{name}: the CUDA driver (libcuda.so.1) could not be loaded")
    err = getattr(lib, name)(*args)
    if err:
        msg = ctypes.c_char_p()
        lib.cuGetErrorName(err, ctypes.byref(msg))
        raise CuinferError(f"{name} failed: {msg.value.decode() if msg.value else err}")


def launch_ex(k, grid, block, args, smem, attr=None):
    """cuLaunchKernelEx of k on the current stream, with the launch attribute `attr` if given (a
    LaunchAttribute: runtime's programmatic stream serialization): a device array passes its pointer,
    a numpy scalar its value (each in an 8-byte slot of one parameter buffer), a bytes object its
    bytes (a struct passed by value)."""
    import cupy as cp

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
    from .runtime import capturing, require_cupy  # runtime imports this module

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
