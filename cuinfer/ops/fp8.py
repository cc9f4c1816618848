"""The fp8 KV cache's element format: OCP FP8 E4M3 ("e4m3fn": 1 sign, 4 exponent, 3 mantissa bits,
bias 7, no infinities, 0x7f / 0xff NaN, largest finite 448), stored as uint8 arrays on both
backends (neither NumPy nor CuPy has an fp8 dtype). A cache array of dtype `FP8` (uint8) holds these
codes; the kernels take it as `__nv_fp8_e4m3` (`cache_ctype`).

Encoding rounds to nearest even and saturates: |x| > 448 (infinities included) becomes +-448, as
PTX's `cvt.rn.satfinite.e4m3x2.f32` does; NaN becomes 0x7f. Values reach the cache already rounded
to the model's dtype (a row is computed in T, then encoded), so the kernels encode from T and the
reference encodes `x.astype(T)`. Decoding is exact into float16, bfloat16 and float32 (every code is
representable in each), so attention over an fp8 cache computes with exactly `decode_e4m3(cache)`.
No scale factor: values are stored as they are (vLLM's default for an uncalibrated fp8 cache); keys
and values of the models cuinfer runs lie far inside +-448.
"""
from __future__ import annotations

import numpy as np

from . import runtime

FP8 = np.dtype(np.uint8)
MAX = 448.0


def _table() -> np.ndarray:
    """float32 value of every code 0..255."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    mag = np.where((codes & 0x7F) == 0x7F, np.nan, mag)
    return (sign * mag).astype(np.float32)


TABLE = _table()
_POSITIVE = TABLE[:0x7F].astype(np.float64)  # the finite non-negative codes 0x00..0x7e, ascending


def decode_e4m3(codes) -> np.ndarray:
    """float32 values of uint8 E4M3 codes."""
    return TABLE[np.asarray(codes, dtype=np.uint8)]


def encode_e4m3(x) -> np.ndarray:
    """uint8 E4M3 codes of x (any float dtype): round to nearest even, saturating at +-448."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), MAX)
    hi = np.minimum(np.searchsorted(_POSITIVE, a), len(_POSITIVE) - 1)  # first code >= a
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - _POSITIVE[lo], _POSITIVE[hi] - a
    # nearer neighbour; on a tie the even code (its mantissa's last bit is the code's)
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    code = np.where(np.signbit(x), code | 0x80, code)
    return np.where(np.isnan(x), 0x7F, code).astype(np.uint8)


def is_fp8(a) -> bool:
    return a.dtype == FP8


def values(cache) -> np.ndarray:
    """A NumPy cache's values: float32 for an fp8 cache, else the array itself."""
    return decode_e4m3(cache) if is_fp8(cache) else cache


def store(x, cache_dtype, dtype):
    """x rounded as the kernels store it in a cache of `cache_dtype`: to `dtype` (the model's), then
    encoded when the cache is fp8."""
    x = np.asarray(x).astype(dtype)
    return encode_e4m3(x) if np.dtype(cache_dtype) == FP8 else x.astype(cache_dtype)


def cache_ctype(cache_dtype, dtype) -> str:
    """C++ element type of a cache of `cache_dtype` for kernels computing in `dtype`: T itself, or
    `__nv_fp8_e4m3`."""
    cache_dtype = np.dtype(cache_dtype)
    if cache_dtype == FP8:
        return "__nv_fp8_e4m3"
    if cache_dtype != np.dtype(dtype):
        raise ValueError(f"k_cache: got dtype {cache_dtype}, need {np.dtype(dtype)} or uint8 (fp8 e4m3)")
    return runtime.ctype(dtype)


def parse_kv_cache_dtype(name: str, model_dtype) -> np.dtype:
    """`--kv-cache-dtype`: "auto" (the model's dtype) or "fp8" / "fp8_e4m3" (uint8 codes)."""
    if name == "auto":
        return np.dtype(model_dtype)
    if name in ("fp8", "fp8_e4m3"):
        return FP8
    raise ValueError(f"kv cache dtype: got {name!r}, need 'auto' or 'fp8' (e4m3)")
