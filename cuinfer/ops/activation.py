"""Gated activations of the MLP: act(gate) * up with x = [gate | up] along the last axis.

silu_and_mul(x, out=None), gelu_and_mul(x, out=None)
    x: [..., 2 * d] -> out: [..., d]
act(gate) * up is computed in float32 and rounded once to the dtype (Hugging Face eager rounds
act(gate) to the dtype first; the two differ by at most that one rounding). numpy arrays run the
reference; cupy arrays launch cuda_src/activation.cu (one 16-byte vector of out per thread).
"""
from __future__ import annotations

import numpy as np

from . import runtime

THREADS = 256
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def instantiation(dtype, vec, act) -> str:
    return f"activation_kernel<{runtime.ctype(dtype)}, {vec}, {ACTIVATIONS[act]}>"


INSTANTIATIONS = [instantiation(dt, v, a) for dt in runtime.FLOAT_DTYPES for v in runtime.vector_widths(dt)
                  for a in ACTIVATIONS]


def silu(x):
    """x * sigmoid(x) = x / (1 + exp(-x)), float32 (exp overflow to inf gives -0, as the kernel)."""
    with np.errstate(over="ignore"):
        return x / (np.float32(1) + np.exp(-x))


def gelu_tanh(x):
    """0.5 x (1 + tanh(z)), z = sqrt(2/pi) (x + 0.044715 x^3), float32 ("gelu_pytorch_tanh").

    Written as x / (1 + exp(-2z)), the same function, as the kernel computes it: 1 + tanh(z)
    cancels for negative x.
    """
    z = np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)
    with np.errstate(over="ignore"):
        return x / (np.float32(1) + np.exp(np.float32(-2) * z))


REFERENCES = {"silu": silu, "gelu_tanh": gelu_tanh}  # the float32 NumPy activations, by name


def act_and_mul_reference(x, act):
    """float32 [..., d]: act(gate) * up in float32, x = [gate | up] along the last axis."""
    x32 = np.asarray(x).astype(np.float32)
    d = x32.shape[-1] // 2
    return REFERENCES[act](x32[..., :d]) * x32[..., d:]


def _act_and_mul(x, act, out):
    dev = runtime.on_device(x, out)
    runtime.check("x", x, dtype=runtime.FLOAT_DTYPES)
    if x.ndim == 0 or x.shape[-1] % 2:
        raise ValueError(f"x: got shape {tuple(x.shape)}, need [..., 2 * d] (an even last axis)")
    d = x.shape[-1] // 2
    out = runtime.check_out(out, x.shape[:-1] + (d,), x.dtype, x)
    if not dev:
        out[...] = act_and_mul_reference(x, act).astype(x.dtype)  # rounded once
        return out
    rows = x.size // max(x.shape[-1], 1)
    vec = runtime.vector_width(x, out)
    kern = runtime.kernel("activation", instantiation(x.dtype, vec, act))
    blocks = -(-rows * (d // vec) // THREADS)
    runtime.launch(kern, (blocks,), (THREADS,), (x, out, np.int64(rows), np.int32(d)))
    return out


def silu_and_mul(x, out=None):
    """silu(gate) * up, x = [gate | up] along the last axis: [..., 2 * d] -> [..., d]."""
    return _act_and_mul(x, "silu", out)


def gelu_and_mul(x, out=None):
    """gelu(gate) * up with the tanh approximation of GELU (the function of common.cuh gelu_tanh,
    "gelu_pytorch_tanh", evaluated as x * sigmoid(2z)), x = [gate | up] along the last axis:
    [..., 2 * d] -> [..., d]."""
    return _act_and_mul(x, "gelu_tanh", out)
