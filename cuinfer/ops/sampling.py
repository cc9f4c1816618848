"""Token sampling: temperature -> top-k -> top-p (of the top-k mass) -> min-p -> inverse CDF.

sampling(logits, temperature, top_k, top_p, min_p, uniforms, out=None) -> int32 [rows]
    logits: [rows, n] float32 / float16 / bfloat16; temperature, top_p, min_p, uniforms: float32
    [rows]; top_k: int32 [rows] (0: off); out: int32 [rows]
Rows with temperature 0 take the argmax (the lowest id among equal maxima). The other rows draw
from the filtered distribution in Hugging Face's warper order, tokens ranked by descending logit
(ties: ascending id), at the row's uniform in [0, 1). numpy arrays run the reference; cupy arrays
launch cuda_src/sampling.cu (one CTA per row, no sort, nothing allocated with `out` given: a CUDA
graph captures it; after top-k, the tokens that can still weigh anything are compacted into shared
memory when at most 2048). Kernel and reference pick the same token, bit for bit, because the math is
defined so that every rounding is the same on both (the .cu file's header):

    key_i = (order_bits(x_i) << 32) | (2^32 - 1 - i)         descending key = the rank order
    s_i = (x_i - max) / temperature                          float32, correctly rounded
    p_i = exp_det(s_i), 0 below s = -32                      float32, a fixed operation sequence
    w_i = trunc(p_i * 2^31)                                  integer weights: exact sums
    top-k: the k highest keys; top-p: X = float64(top_p) * (sum of the top-k weights), the tokens
    up to the first whose inclusive weight sum reaches X; min-p: p_i >= min_p (p_max = 1)
    pick: S = sum of kept weights, t = min(floor(float64(u) * S), S - 1), the first kept token
    whose inclusive sum of kept weights exceeds t.

Tokens with p < 2^-31 of the most likely one get weight 0 (never drawn: at most 2^-31 * n of the
mass). Rows of at most 2^21 tokens (the weight sums stay exact in float64).
"""
from __future__ import annotations

import numpy as np

from . import runtime

THREADS = 1024
MAX_VOCAB = 1 << 21
S_CUT = np.float32(-32.0)
W_SCALE = np.float32(2.0 ** 31)
_EXP_POLY = [np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                     1.6666665459e-1, 5.0000001201e-1)]


def instantiation(dtype, cache: bool) -> str:
    return f"sampling_kernel<{runtime.ctype(dtype)}, {THREADS}, {'true' if cache else 'false'}>"


INSTANTIATIONS = [instantiation(dt, c) for dt in runtime.FLOAT_DTYPES for c in (False, True)]


def order_bits(x):
    """uint32 [...] whose unsigned order is the order of the float32 values x (-0 as +0)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    b = np.where(b == np.uint32(0x80000000), np.uint32(0), b)
    return np.where(b & np.uint32(0x80000000), ~b, b | np.uint32(0x80000000))


def rank_keys(x):
    """uint64 [rows, n]: descending key is descending logit, ties by ascending token id."""
    ids = np.arange(x.shape[-1], dtype=np.uint64)
    return (order_bits(x).astype(np.uint64) << np.uint64(32)) | (np.uint64(0xFFFFFFFF) - ids)


def exp_det(s):
    """exp(s) in float32 for s in [-32, 0]: Cephes' expf, every operation rounded on its own (the
    kernel spells out the same operations without FMA contraction)."""
    s = np.asarray(s, dtype=np.float32)
    k = np.rint(s * np.float32(1.44269504088896341))
    r = (s - k * np.float32(0.693359375)) - k * np.float32(-2.12194440e-4)
    z = r * r
    y = _EXP_POLY[0]
    for c in _EXP_POLY[1:]:
        y = y * r + c
    y = (y * z + r) + np.float32(1.0)
    return np.ldexp(y, k.astype(np.int32)).astype(np.float32)  # exact: 2^k, k >= -47


def probs(x, max_x, temperature):
    """float32 p = exp_det((x - max) / temperature), 0 where that is below -32 (or NaN)."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        s = (x.astype(np.float32) - np.float32(max_x)) / np.float32(temperature)
        ok = s >= S_CUT
        return np.where(ok, exp_det(np.where(ok, s, np.float32(0))), np.float32(0))


def first_exceeding(weights, target) -> int:
    """The first index whose inclusive cumulative sum (uint64, exact) exceeds target."""
    return int(np.searchsorted(np.cumsum(weights, dtype=np.uint64), np.uint64(target), side="right"))


def sample_row_reference(x, temperature, top_k, top_p, min_p, u) -> int:
    """One row's token, by the definition in the module docstring (float32 x [n])."""
    n = x.shape[0]
    key = rank_keys(x)
    best = int(np.argmax(key))
    if temperature == 0:
        return best
    order = np.argsort(key)[::-1]  # keys are distinct: one order
    p = probs(x[order], x[best], temperature)  # in rank order
    w = (p * W_SCALE).astype(np.uint64)  # truncation, as the kernel's conversion
    kept = np.ones(n, dtype=bool)
    if 0 < top_k < n:
        kept[top_k:] = False
    if top_p < 1:
        s_k = int(w[kept].sum(dtype=np.uint64))
        x_p = np.ceil(np.float64(np.float32(top_p)) * np.float64(s_k))
        if x_p >= 1:
            kept[first_exceeding(np.where(kept, w, 0), int(x_p) - 1) + 1:] = False
    kept &= p >= np.float32(min_p)
    v = np.where(kept, w, np.uint64(0))
    s = int(v.sum(dtype=np.uint64))
    if s == 0:  # no finite maximum: the argmax
        return best
    t = min(int(np.floor(np.float64(np.float32(u)) * np.float64(s))), s - 1)
    return int(order[first_exceeding(v, t)])


def sampling_reference(logits, temperature, top_k, top_p, min_p, uniforms):
    x = np.asarray(logits).astype(np.float32)
    return np.array([sample_row_reference(x[i], float(temperature[i]), int(top_k[i]), float(top_p[i]),
                                          float(min_p[i]), float(uniforms[i])) for i in range(x.shape[0])],
                    dtype=np.int32)


STATIC_SMEM = 24 * 1024  # the kernel's static shared memory (histograms, the compacted list), rounded up


def cache_row(n: int) -> bool:
    """Whether a row of n floats fits in the shared memory a CTA may take beside the kernel's own
    (then the row is read once from global memory)."""
    return 4 * n + STATIC_SMEM <= runtime.device_info()["smem_per_block_optin"]


def sampling(logits, temperature, top_k, top_p, min_p, uniforms, out=None):
    dev = runtime.on_device(logits, temperature, top_k, top_p, min_p, uniforms, out)
    runtime.check("logits", logits, dtype=runtime.FLOAT_DTYPES, ndim=2)
    rows, n = logits.shape
    if not 1 <= n < MAX_VOCAB:
        raise ValueError(f"logits: got rows of {n} tokens, need 1..{MAX_VOCAB - 1}")
    for name, a, dt in (("temperature", temperature, np.float32), ("top_k", top_k, np.int32),
                        ("top_p", top_p, np.float32), ("min_p", min_p, np.float32),
                        ("uniforms", uniforms, np.float32)):
        runtime.check(name, a, dtype=dt, shape=(rows,))
    out = runtime.check_out(out, (rows,), np.int32, logits)
    if not dev:
        out[...] = sampling_reference(logits, temperature, top_k, top_p, min_p, uniforms)
        return out
    cache = cache_row(n)
    kern = runtime.kernel("sampling", instantiation(logits.dtype, cache))
    runtime.launch(kern, (rows,), (THREADS,), (logits, np.int32(n), temperature, top_k, top_p, min_p, uniforms, out),
                   smem=4 * n if cache else 0)
    return out
