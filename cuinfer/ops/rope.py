"""Rotary position embedding (Hugging Face rotate-half convention), with Llama-3 scaling.

rope(q, k, positions, theta, scaling=None, out=None) -> (q_rot, k_rot)
    q: [tokens, n_heads, head_dim]; k: [tokens, n_kv_heads, head_dim]; positions: int32/int64 [tokens]
    head_dim: any even number; scaling: the HF `rope_scaling` dict (rope_type "linear", "llama3" or
    "longrope": its short factors; `rope_inv_freq(..., long=True)` gives the long ones) or None
`out` may be a (q_out, k_out) pair, e.g. (q, k) to rotate in place. numpy arrays run the
reference; cupy arrays launch cuda_src/rope.cu (one CTA per token).

The frequencies are defined once, here: `rope_inv_freq` computes them on the host (float32,
as Hugging Face keeps them); the kernels (this one and write_kv's fused RoPE) take that array
as a device pointer. Angles are position * inv_freq rounded to float32 and their cos/sin are
taken in full precision (sincosf on the GPU; positions reach 128k, so no fast __sinf).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from . import runtime

THREADS = 128
POSITION_CTYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}


def instantiation(dtype, vec, pos_dtype) -> str:
    return f"rope_kernel<{runtime.ctype(dtype)}, {vec}, {POSITION_CTYPES[np.dtype(pos_dtype)]}>"


INSTANTIATIONS = [instantiation(dt, v, p) for dt in runtime.FLOAT_DTYPES for v in runtime.vector_widths(dt)
                  for p in POSITION_CTYPES]


# ----------------------------------------------------------------------- frequencies
def rope_inv_freq(head_dim: int, theta: float, scaling=None, long: bool = False) -> np.ndarray:
    """inv_freq: float32 [head_dim // 2], theta^(-2i/head_dim), scaled when `scaling` says so.

    Computed in float64 and rounded once to float32 (Hugging Face computes the same formula in
    float32; the two agree to an ulp). `scaling` is the config's `rope_scaling` dict: None or
    rope_type "default" means no scaling, "linear" divides every frequency by `factor` (position
    interpolation), "llama3" applies Meta's frequency-dependent scaling (HF
    _compute_llama3_parameters), "longrope" divides frequency i by short_factor[i], or with
    long=True by long_factor[i] (HF _compute_longrope_parameters; its attention_factor scales
    scores, not frequencies: ModelConfig.attention_scale); any other type raises ValueError.
    """
    return _inv_freq(int(head_dim), float(theta), _scaling_key(scaling, long)).copy()


def _scaling_key(scaling, long=False):
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return None
    if kind not in ("linear", "llama3", "longrope"):
        raise ValueError(f"scaling: got rope_type {kind!r}, need 'linear', 'llama3' or 'longrope' "
                         "(or None / 'default')")
    try:
        if kind == "longrope":  # ("ext", per-frequency divisors)
            return ("ext", tuple(float(f) for f in scaling["long_factor" if long else "short_factor"]))
        if kind == "linear":
            return (float(scaling["factor"]),)
        return (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                float(scaling["high_freq_factor"]), float(scaling["original_max_position_embeddings"]))
    except KeyError as e:
        raise ValueError(f"scaling: {kind} rope_scaling needs the key {e.args[0]!r}") from None


@functools.lru_cache(maxsize=64)
def _inv_freq(head_dim, theta, scaling):
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim: got {head_dim}, need a positive even number")
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is not None and scaling[0] == "ext":  # longrope: frequency i divided by factor i
        if len(scaling[1]) != head_dim // 2:
            raise ValueError(f"scaling: got {len(scaling[1])} longrope factors, need head_dim / 2 = {head_dim // 2}")
        inv = inv / np.asarray(scaling[1], np.float64)
    elif scaling is not None and len(scaling) == 1:  # linear
        inv = inv / scaling[0]
    elif scaling is not None:  # llama3
        factor, low, high, old_ctx = scaling
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        # long wavelengths (> old_ctx / low) are divided by factor, short ones (< old_ctx / high)
        # kept, and the band between interpolates linearly in old_ctx / wavelen
        inv = np.where(wavelen > old_ctx / low, inv / factor,
                       np.where(wavelen < old_ctx / high, inv, (1 - smooth) * inv / factor + smooth * inv))
    out = inv.astype(np.float32)
    out.flags.writeable = False
    return out


# ------------------------------------------------------------------------ reference
def rope_reference(x, positions, inv_freq):
    """x_rot: float32 [tokens, heads, head_dim], x rotated by positions * inv_freq (rotate-half;
    inv_freq [head_dim // 2], or [tokens, head_dim // 2] with a row per token).

    x_rot[..., :h] = x1 cos - x2 sin, x_rot[..., h:] = x2 cos + x1 sin with x1, x2 the two halves.
    The angle is rounded to float32 (as the kernel and HF compute it); cos and sin of that
    float32 angle are taken in float64 and rounded to float32; the rotation runs in float32.
    The caller rounds the result to its dtype once.
    """
    x = np.asarray(x, dtype=np.float32)  # x: [tokens, heads, head_dim]
    half = x.shape[-1] // 2
    inv_freq = np.asarray(inv_freq, np.float32)  # [half], or [tokens, half]: each token its own
    angle = np.asarray(positions).astype(np.float32)[:, None] * (inv_freq if inv_freq.ndim == 2 else inv_freq[None, :])
    cos = np.cos(angle.astype(np.float64)).astype(np.float32)[:, None, :]  # cos: [tokens, 1, half]
    sin = np.sin(angle.astype(np.float64)).astype(np.float32)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# ------------------------------------------------------------------------- launcher
def _check_pair(name, pair):
    if pair is None:
        return None, None
    if not (isinstance(pair, tuple) and len(pair) == 2):
        raise ValueError(f"{name}: need a (q_out, k_out) pair or None")
    return pair


def rope(q, k, positions, theta, scaling=None, out=None):
    q_out, k_out = _check_pair("out", out)
    dev = runtime.on_device(q, k, positions, q_out, k_out)
    runtime.check("q", q, dtype=runtime.FLOAT_DTYPES, ndim=3)
    tokens, n_heads, d = q.shape
    if d % 2:
        raise ValueError(f"q: got head_dim {d}, need an even number")
    runtime.check("k", k, dtype=q.dtype, shape=(tokens, None, d))
    runtime.check("positions", positions, dtype=tuple(POSITION_CTYPES), shape=(tokens,))
    inv_freq = rope_inv_freq(d, theta, scaling)
    q_out = runtime.check_out(q_out, q.shape, q.dtype, q)
    k_out = runtime.check_out(k_out, k.shape, k.dtype, k)
    if not dev:
        q_out[...] = rope_reference(q, positions, inv_freq).astype(q.dtype)  # rounded once
        k_out[...] = rope_reference(k, positions, inv_freq).astype(k.dtype)
        return q_out, k_out
    cp = runtime.require_cupy()
    vec = next(w for w in runtime.vector_widths(q.dtype) if (d // 2) % w == 0 and all(
        a.data.ptr % (w * q.dtype.itemsize) == 0 for a in (q, k, q_out, k_out)))
    kern = runtime.kernel("rope", instantiation(q.dtype, vec, positions.dtype))
    args = (q, k, positions, _device_inv_freq(cp.cuda.Device().id, d, float(theta), _scaling_key(scaling)),
            q_out, k_out, np.int32(n_heads), np.int32(k.shape[1]), np.int32(d))
    runtime.launch(kern, (tokens,), (THREADS,), args, smem=4 * d)
    return q_out, k_out


@functools.lru_cache(maxsize=64)
def _device_inv_freq(device_id, head_dim, theta, scaling):
    """inv_freq uploaded once per (device, head_dim, theta, scaling)."""
    cp = runtime.require_cupy()
    with cp.cuda.Device(device_id):
        return cp.asarray(_inv_freq(head_dim, theta, scaling))
