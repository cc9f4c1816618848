"""Quantized linear weights: INT8 per output channel and INT4 group-wise.

A linear weight has the Hugging Face layout W [out_features N, in_features K], y = x @ W.T.

Int8Weight: w[n, k] = qweight[n, k] * scales[n]
    qweight int8 [N, K] (symmetric, -127..127), scales fp16 [N].

Int4Weight: w[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g],  g = k // group_size
    q in 0..15, scales and zeros fp16 (group_size 32, 64 or 128), stored in tiles of 16 rows
    (T = ceil(N / 16) tiles, rows past N zero), so that a GEMV warp reads each tile's next
    128 k as one 1 KB run and a row's (scale, zero) in one 4-byte load:

    qweight      uint32 [T, ceil(K / 128), 16, 16]: [t, Q, r] = the 16 words of row 16 t + r in
                 quad Q (its k 128 Q .. 128 Q + 127), packed as pack_int4 packs a row;
    scales_zeros fp16 [T, K / group_size, 16, 2]: [t, g, r] = (scale, zero) of row 16 t + r, group g.

    Int4Weight.pack builds both from q, scales and zeros [N, ...]; the scales / zeros / unpack
    accessors give them back. A row's words, 8 nibbles each, are in the order the GEMV's
    mma.sync fragments want (cuda_src/linear.cu), so a lane needs no shuffle:

    one row, one quad of 128 k (16 words = 64 bytes; k = 128 Q + 32 j + 8 c + 4 s + o):
      words 4c .. 4c+3 belong to lane c of an mma quad (one 16-byte load);
      word j holds the 8 consecutive k = 32 j + 8 c + 0..7: s = 0 feeds k16 step 2j, s = 1
      step 2j + 1, and the lane's 8 x values for both come in one 16-byte load:

      bits          31..28 27..24 23..20 19..16 | 15..12 11..8  7..4   3..0
      nibble           7      6      5      4   |    3     2     1      0
      k - 32j - 8c     7      5      3      1   |    6     4     2      0

    (word >> 4i) & 0x000f000f puts nibble i in the low half and nibble i + 4 in the high
    half: k (0, 1) for i = 0, (2, 3) for i = 1, (4, 5) for i = 2, (6, 7) for i = 3, exactly
    the two k of one register of the A fragment. OR-ing 0x64006400 makes two halves 1024 + q
    (half 1024 has ulp 1; bf16 uses 0x43004300, 128 + q), one subtraction takes 1024 off:
    two weights per lop3 + hsub2, no integer-to-float conversion. Zero padding fills
    the last quad when K % 128 != 0; every k16 step lies inside one group.

    The tensor cores see exact values, so the GEMV computes with w exactly as `dequantize`
    gives it. When every zero point is an integer in 0..15 (`integer_zeros`: minmax, GPTQ,
    GGUF Q4_0) the subtraction takes 1024 + zero off instead, giving q - zero, and each group
    ends with scale * sum (q - zero) x; otherwise (GGUF Q4_1, the MSE fit) the tensor cores see
    q and the group's fp32 sums give scale * (sum q x - zero * sum x).

Saved form (checkpoints) and GGUF blocks: cuinfer.io.quant_io.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from . import runtime

GROUP_SIZES = (32, 64, 128)
QUAD_K = 128  # k per packed quad (16 uint32 per row)
TILE_ROWS = 16  # rows of an int4 tile
INT4_LAYOUT = "tiles16"  # the `layout` of an int4 checkpoint's quantization entry
BITS = {"int8": 8, "int4": 4}
METHODS = tuple(BITS)


def _xp(a):
    """The array module of `a`: cupy for a device array, else numpy."""
    return runtime.cupy_or_none() if runtime.is_device_array(a) else np


def _fp16_round_up(s):
    """fp16 scales (of s >= 0) never below the fp32 ones, so the quantization grid covers the range."""
    h = s.astype(np.float16)
    low = h.astype(np.float32) < s
    return (h.view(np.uint16) + low.astype(np.uint16)).view(np.float16)  # the next fp16 up where low


def asnumpy(a):
    return runtime.cupy_or_none().asnumpy(a) if runtime.is_device_array(a) else np.asarray(a)


def _to_device(a):
    return runtime.require_cupy().asarray(a)


# ------------------------------------------------------------------------ int4 packing
_NIBBLE = np.array([[0, 4, 1, 5], [2, 6, 3, 7]])  # _NIBBLE[s, o]: nibble of k = 4 s + o in a word


def pack_int4(q):
    """q: uint8 [N, K] in 0..15 -> qweight uint32 [N, ceil(K / 128) * 16] in the documented order
    (numpy or cupy, as q)."""
    xp = _xp(q)
    n, k = q.shape
    quads = -(-k // QUAD_K)
    padded = xp.zeros((n, quads * QUAD_K), dtype=xp.uint32)
    padded[:, :k] = q
    # padded: [N, Q, j, c, s, o] with k = 128 Q + 32 j + 8 c + 4 s + o
    q6 = padded.reshape(n, quads, 4, 4, 2, 4)
    words = (q6 << xp.asarray(4 * _NIBBLE, dtype=xp.uint32)).sum(axis=(4, 5), dtype=xp.uint32)  # [N, Q, j, c]
    return xp.ascontiguousarray(words.transpose(0, 1, 3, 2)).reshape(n, quads * 16)  # word 4 c + j


def unpack_int4(qweight, k):
    """Inverse of pack_int4: uint8 [N, K]."""
    n = qweight.shape[0]
    words = np.asarray(qweight, dtype=np.uint32).reshape(n, -1, 4, 4).transpose(0, 1, 3, 2)  # [N, Q, j, c]
    q6 = (words[..., None, None] >> (4 * _NIBBLE).astype(np.uint32)) & np.uint32(0xF)  # [N, Q, j, c, s, o]
    return q6.reshape(n, -1)[:, :k].astype(np.uint8)


# ------------------------------------------------------------------------ weight objects
def _once(weight, compute):
    """compute() of a host weight, made once and kept read-only on the weight (the CPU backend's
    linear layers reuse it every call); a device weight's is made on each call."""
    if runtime.is_device_array(weight.qweight):
        return compute()
    if "dense" not in weight._memo:
        a = compute()
        a.setflags(write=False)
        weight._memo["dense"] = a
    return weight._memo["dense"]


@dataclass(frozen=True)
class Int8Weight:
    qweight: object  # int8 [N, K]
    scales: object  # fp16 [N]
    shape: tuple  # (N, K)
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def to_device(self):
        return Int8Weight(_to_device(self.qweight), _to_device(self.scales), self.shape)

    def dequantize(self):
        """float32 [N, K] (read-only; made once for host arrays)."""
        return _once(self, lambda: asnumpy(self.qweight).astype(np.float32)
                     * asnumpy(self.scales).astype(np.float32)[:, None])

    @property
    def nbytes(self):
        return self.qweight.nbytes + self.scales.nbytes


def _tiled(a, xp):
    """[N, X, ...] -> [ceil(N / 16), X, 16, ...]: rows in tiles of 16, zero rows past N."""
    n = a.shape[0]
    t = -(-n // TILE_ROWS)
    padded = xp.zeros((t * TILE_ROWS,) + a.shape[1:], dtype=a.dtype)
    padded[:n] = a
    return xp.ascontiguousarray(padded.reshape(t, TILE_ROWS, *a.shape[1:]).swapaxes(1, 2))


@dataclass(frozen=True)
class Int4Weight:
    qweight: object  # uint32 [T, ceil(K / 128), 16, 16], T = ceil(N / 16)
    scales_zeros: object  # fp16 [T, K / group_size, 16, 2]
    group_size: int
    shape: tuple  # (N, K)
    integer_zeros: bool = field(init=False, repr=False, compare=False)  # every zero in 0..15 is an integer
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):  # the GEMV then subtracts the zero in its nibble conversion (linear.cu)
        z = self.scales_zeros[..., 1]
        whole = bool(((z >= 0) & (z <= 15) & (z == _xp(z).rint(z))).all())
        object.__setattr__(self, "integer_zeros", whole)

    @classmethod
    def pack(cls, q, scales, zeros, group_size):
        """From q uint8 [N, K] in 0..15 and fp16 scales, zeros [N, K / group_size] (numpy or cupy, as q)."""
        xp = _xp(q)
        sz = xp.stack([xp.asarray(scales, dtype=xp.float16), xp.asarray(zeros, dtype=xp.float16)], axis=-1)
        n, k = q.shape
        return cls(_tiled(pack_int4(q).reshape(n, -1, 16), xp), _tiled(sz, xp), group_size, (n, k))

    def _rows(self, a):
        """[T, X, 16, ...] -> [N, X, ...] (inverse of _tiled)."""
        t, x = a.shape[:2]
        return a.swapaxes(1, 2).reshape(t * TILE_ROWS, x, *a.shape[3:])[: self.shape[0]]

    @property
    def scales(self):
        """fp16 [N, K / group_size]."""
        return self._rows(self.scales_zeros)[..., 0]

    @property
    def zeros(self):
        """fp16 [N, K / group_size]."""
        return self._rows(self.scales_zeros)[..., 1]

    def unpack(self):
        """q: numpy uint8 [N, K]."""
        n, k = self.shape
        return unpack_int4(self._rows(asnumpy(self.qweight)).reshape(n, -1), k)

    def to_device(self):
        return Int4Weight(_to_device(self.qweight), _to_device(self.scales_zeros), self.group_size, self.shape)

    def dequantize(self):
        """float32 [N, K]: (q - zero) * scale, q - zero exact in float32 (read-only; made once for
        host arrays)."""
        return _once(self, self._dequantize)

    def _dequantize(self):
        q = self.unpack().astype(np.float32)
        d = q - np.repeat(asnumpy(self.zeros).astype(np.float32), self.group_size, axis=1)
        return d * np.repeat(asnumpy(self.scales).astype(np.float32), self.group_size, axis=1)

    @property
    def nbytes(self):
        return self.qweight.nbytes + self.scales_zeros.nbytes


QUANTIZED = (Int8Weight, Int4Weight)


# ------------------------------------------------------------------------ quantizers
FITS = ("mse", "minmax")
MSE_STEPS = 20  # candidate grids of the int4 "mse" fit: 15 + (-1 + 0.1 i) steps over the range, i = 0..20


def quantize(w, method, group_size=128, fit="minmax"):
    """Quantize a float weight [N, K] into Int8Weight or Int4Weight. A numpy w gives numpy arrays;
    a cupy w is quantized on its GPU into cupy arrays, bit for bit the numpy result.

    int8: scale = max|w| / 127 per row (rounded up to fp16), q = round(w / scale).
    int4, fit="minmax" (the default): per group the range [min(w, 0), max(w, 0)] maps onto 0..15: scale =
      range / 15 (rounded up to fp16), integer zero = round(-min / scale) in 0..15; keeps
      |w - dequantized| <= scale / 2 and reproduces weights already on such a grid exactly.
    int4, fit="mse": per group the grid w ~ scale * q + offset of least squared
      error among MSE_STEPS + 1 candidates, as llama.cpp's make_qkx2_quants (Q4_K) searches: for
      each candidate the q of the rounded grid (15 + (-1 + 0.1 i)) / range, then scale and
      offset <= 0 refit by least squares to those q; the best becomes scale (fp16) and a
      fractional zero -offset / scale (fp16), and q is rounded once more on that stored grid.
      Outliers may be clipped (no half-step bound) for a smaller group error. On the default
      model (docs/linear.md) "mse" at g32 reproduces its Q4_1 weights (perplexity -0.00%) but
      at g128 loses more than "minmax" (+57% against +31%): clipping its outliers costs more.
    """
    xp = _xp(w)
    w = xp.asarray(w, dtype=xp.float32)
    if w.ndim != 2:
        raise ValueError(f"w: got shape {w.shape}, need [out_features, in_features]")
    n, k = w.shape
    if method == "int8":
        s = _fp16_round_up(xp.abs(w).max(axis=1) / 127)
        s[s == 0] = 1
        q = xp.clip(xp.rint(w / s.astype(xp.float32)[:, None]), -127, 127).astype(xp.int8)
        return Int8Weight(q, s, (n, k))
    if method != "int4":
        raise ValueError(f"method: got {method!r}, need one of {METHODS}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size: got {group_size}, need one of {GROUP_SIZES}")
    if fit not in FITS:
        raise ValueError(f"fit: got {fit!r}, need one of {FITS}")
    if k % group_size:
        raise ValueError(f"w: got in_features {k}, need a multiple of group_size {group_size}")
    g = w.reshape(n, k // group_size, group_size)  # g: [N, groups, group_size]
    if fit == "minmax":
        s, z = minmax_grid(g, xp)
    else:
        s, z = _mse_grid(g, xp)
    s32, z32 = s.astype(xp.float32), z.astype(xp.float32)
    q = xp.clip(xp.rint(g / s32[..., None] + z32[..., None]), 0, 15).astype(xp.uint8)
    return Int4Weight.pack(q.reshape(n, k), s, z, group_size)


def minmax_grid(g, xp=np):
    """fp16 (scale, zero) of the "minmax" fit over the last axis of g (float32 groups of weights):
    [min(w, 0), max(w, 0)] onto 0..15 with the scale rounded up to fp16 and an integer zero."""
    g = g.astype(xp.float32, copy=False)
    lo, hi = xp.minimum(g.min(axis=-1), 0), xp.maximum(g.max(axis=-1), 0)
    s = _fp16_round_up((hi - lo) / 15)
    s[s == 0] = 1
    return s, xp.clip(xp.rint(-lo / s.astype(xp.float32)), 0, 15).astype(xp.float16)


def _mse_grid(g, xp):
    """fp16 (scale, zero) [N, G] of the least-squares int4 grid of each group of g [N, G, gs] (float64
    sums: the numpy and cupy reductions agree far below the fp16 rounding)."""
    g = g.astype(xp.float64)
    gs = g.shape[-1]
    lo, hi = xp.minimum(g.min(axis=2), 0), xp.maximum(g.max(axis=2), 0)
    span = hi - lo
    flat = span == 0
    inv = 1 / xp.where(flat, 1, span)
    sum_x = g.sum(axis=2)
    best = xp.full(lo.shape, xp.inf)
    scale, offset = xp.ones_like(lo), xp.zeros_like(lo)
    for i in range(MSE_STEPS + 1):
        l = xp.clip(xp.rint(((15 - 1 + 0.1 * i) * inv)[..., None] * (g - lo[..., None])), 0, 15)
        sl, sl2, sxl = l.sum(axis=2), (l * l).sum(axis=2), (g * l).sum(axis=2)
        det = gs * sl2 - sl * sl
        ok = det > 0
        det = xp.where(ok, det, 1)
        d, m = (gs * sxl - sum_x * sl) / det, (sl2 * sum_x - sl * sxl) / det
        pos = m > 0  # the offset stays <= 0 (zero >= 0): refit the scale alone
        d, m = xp.where(pos, sxl / xp.where(sl2 > 0, sl2, 1), d), xp.where(pos, 0, m)
        err = ((d[..., None] * l + m[..., None] - g) ** 2).sum(axis=2)
        better = ok & (d > 0) & (err < best)
        best, scale, offset = xp.where(better, err, best), xp.where(better, d, scale), xp.where(better, m, offset)
    s = xp.where(flat, 1, scale).astype(xp.float16)
    s = xp.where(s > 0, s, xp.float16(2.0**-24))  # a scale below fp16's range: the smallest subnormal
    z = xp.where(flat, 0, -offset / s.astype(xp.float64)).astype(xp.float16)
    return s, z


def parse_spec(spec):
    """A --quant value -> (method, group_size, fit): "int8", "int4" (g128, fit "minmax"), "int4-g32",
    "int4-g32-mse", "int4-gptq" (calibrated: cuinfer.model.gptq, needs calibration tokens, so not at
    load time). The int4 group size shrinks, per matrix, to the largest of GROUP_SIZES dividing
    in_features (group_for)."""
    method, *rest = str(spec).split("-")
    group_size, fit = 128, "minmax"
    for part in rest:
        if part in FITS + ("gptq",):
            fit = part
        elif part[:1] == "g" and part[1:].isdigit() and int(part[1:]) in GROUP_SIZES:
            group_size = int(part[1:])
        else:
            raise runtime.CuinferError(f"quantization {spec!r}: unknown part {part!r} (need g32/g64/g128, "
                                       f"{', '.join(FITS)} or gptq)")
    if method not in METHODS or (method == "int8" and rest):
        raise runtime.CuinferError(f"quantization {spec!r}: need int8, or int4[-g32|-g64|-g128][-mse|-minmax|-gptq]")
    return method, group_size, fit


def quantize_spec(w, spec):
    """quantize(w, ...) [N, K] as --quant SPEC does at load: the int4 group shrinks to group_for(K, ...).
    GPTQ is refused: it needs calibration text (cuinfer.model.gptq, python -m cuinfer.quantize --calib)."""
    method, group_size, fit = parse_spec(spec)
    if fit == "gptq":
        raise runtime.CuinferError(f"--quant {spec}: GPTQ needs calibration text, so it is not a load-time format: "
                                   "python -m cuinfer.quantize SRC DST --quant int4-gptq --calib FILE saves it")
    group = int4_group(w.shape[1], group_size, f"--quant {spec}") if method == "int4" else group_size
    return quantize(w, method, group, fit)


def group_for(k, group_size):
    """The int4 group size used for in_features k: group_size if it divides k, else the largest
    smaller one of GROUP_SIZES that does (576 at g128 -> 64); None if none does."""
    return max((g for g in GROUP_SIZES if g <= group_size and k % g == 0), default=None)


def int4_group(k, group_size, what):
    """group_for(k, group_size), or an error naming `what` (the spec or the weight) when no group fits."""
    group = group_for(k, group_size)
    if group is None:
        raise runtime.CuinferError(f"{what}: in_features {k} is not a multiple of any int4 group size {GROUP_SIZES}")
    return group


# ------------------------------------------------------------------------ rows
ARRAYS = {Int8Weight: ("qweight", "scales"), Int4Weight: ("qweight", "scales_zeros")}  # a weight's arrays


def _row_unit(weight, sizes, what):
    """Rows per entry of axis 0 of the weight's arrays (int4: a tile of 16), checking that every size
    but the last is a multiple of it (the tiles of a stack hold no padding between its parts)."""
    unit = TILE_ROWS if isinstance(weight, Int4Weight) else 1
    if any(n % unit for n in sizes[:-1]):
        raise runtime.CuinferError(f"cannot {what} int4 weights of {list(sizes)} rows: int4 rows are stored in "
                                   f"tiles of {TILE_ROWS}, so every part but the last needs a multiple of {TILE_ROWS}")
    return unit


def concat_rows(weights):
    """The quantized weight with the rows of `weights` in order (np.concatenate on axis 0 of each array:
    every row has its own scales and zeros). They must share the format, in_features and group size."""
    first = weights[0]
    formats = {(type(w).__name__, w.shape[1], getattr(w, "group_size", None)) for w in weights}
    if len(formats) > 1:
        raise runtime.CuinferError(f"cannot stack the rows of weights of different formats "
                                   f"(format, in_features, group size): {sorted(formats, key=str)}")
    _row_unit(first, [w.shape[0] for w in weights], "stack")
    arrays = {f: np.concatenate([asnumpy(getattr(w, f)) for w in weights]) for f in ARRAYS[type(first)]}
    return dataclasses.replace(first, **arrays, shape=(sum(w.shape[0] for w in weights), first.shape[1]))


def split_rows(weight, sizes):
    """Inverse of concat_rows: the weights of `sizes` consecutive rows each (views)."""
    unit, out, start = _row_unit(weight, sizes, "split"), [], 0
    for n in sizes:
        arrays = {f: getattr(weight, f)[start // unit:(start + n + unit - 1) // unit] for f in ARRAYS[type(weight)]}
        out.append(dataclasses.replace(weight, **arrays, shape=(n, weight.shape[1])))
        start += n
    return out
