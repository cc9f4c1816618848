"""Quantized weights in files: a quantized checkpoint's arrays and config entry, GGUF's quantized blocks.

Saved form (python -m cuinfer.quantize; safetensors): a quantized weight `<prefix>.weight` is
stored as the arrays of its object, in cuinfer.ops.quant's layout, so loading is a copy: int8
`<prefix>.qweight` (I8) and `<prefix>.scales` (F16), int4 `<prefix>.qweight` (U32) and
`<prefix>.scales_zeros` (F16) (`saved_parts`). config.json gets a `quantization` entry
(`quantization_config`), e.g. `{"method": "int4", "bits": 4, "group_size": 128, "fit": "gptq",
"modules": [the architecture's linear modules], "lm_head": "int8", "layout": "tiles16"}`: every decoder linear
layer in `method` (int4: each matrix in the group group_for picks, as at load), the lm_head in int8
(its own tensor even when the embeddings are tied), the rest in the checkpoint's float dtype.
`layout` names cuinfer.ops.quant's int4 tile layout (int4 checkpoints of an earlier row-major layout have
none and must be quantized again).
GGUF Q4_0 / Q4_1 blocks import as int4 group 32 without a float round trip; Q8_0 (int8
with a scale per 32) is re-quantized per channel (error <= scale / 2 on top of Q8_0's).
"""
from __future__ import annotations

import json

import numpy as np

from ..errors import CuinferError
from ..ops.quant import (
    ARRAYS,
    BITS,
    FITS,
    GROUP_SIZES,
    INT4_LAYOUT,
    QUAD_K,
    TILE_ROWS,
    Int4Weight,
    Int8Weight,
    asnumpy,
    int4_group,
    parse_spec,
    quantize,
)


def quantization_config(spec, lm_head, modules):
    """The `quantization` entry of config.json for a parse_spec string; lm_head: the lm_head's method;
    modules: the Hugging Face modules of a layer stored quantized, as --quant quantizes them at load
    (the architecture's linear modules: config.arch.modules(config)); lm_head.weight is quantized too."""
    method, group_size, fit = parse_spec(spec)
    int4 = method == "int4"
    return {"method": method, "bits": BITS[method], "group_size": group_size if int4 else None,
            "fit": fit if int4 else None, "modules": list(modules), "lm_head": lm_head,
            "layout": INT4_LAYOUT if int4 else None}


def is_quantized(name, entry):
    """Whether the Hugging Face weight `name` is stored quantized under `entry` (config.json's quantization)."""
    return name == "lm_head.weight" or name.endswith(tuple(f".{m}.weight" for m in entry["modules"]))


def _method(entry, name):
    """The method the quantized weight `name` is stored in under `entry`."""
    return entry["lm_head"] if name == "lm_head.weight" else entry["method"]


def saved_parts(entry, name, shape):
    """{stored name: (shape, dtype)} of the quantized weight `name` [N, K] (`<prefix>.weight`): the arrays
    of its Int8Weight / Int4Weight in their in-memory layout: int8 `<prefix>.qweight` (int8 [N, K]) and
    `.scales` (fp16 [N]); int4 `<prefix>.qweight` (uint32 [T, ceil(K / 128), 16, 16]) and `.scales_zeros`
    (fp16 [T, K / group, 16, 2]), T = ceil(N / 16). The int4 group of a matrix is group_for(K, entry's
    group_size)."""
    prefix, (n, k) = name[: -len(".weight")], shape
    f16 = np.dtype(np.float16)
    if _method(entry, name) == "int8":
        return {f"{prefix}.qweight": ((n, k), np.dtype(np.int8)), f"{prefix}.scales": ((n,), f16)}
    t = -(-n // TILE_ROWS)
    groups = k // int4_group(k, entry["group_size"], name)
    return {f"{prefix}.qweight": ((t, -(-k // QUAD_K), TILE_ROWS, 16), np.dtype(np.uint32)),
            f"{prefix}.scales_zeros": ((t, groups, TILE_ROWS, 2), f16)}


def weight_arrays(name, weight):
    """{stored name: numpy array} of the quantized `<prefix>.weight` `name`, as saved_parts names them."""
    prefix = name[: -len(".weight")]
    return {f"{prefix}.{f}": asnumpy(getattr(weight, f)) for f in ARRAYS[type(weight)]}


def weight_from_arrays(entry, name, shape, arrays):
    """Inverse of weight_arrays: the Int8Weight / Int4Weight [N, K] = `shape` of `name` from arrays
    ({stored name: array}, as loaded: no copy)."""
    parts = [arrays[n] for n in saved_parts(entry, name, shape)]
    if _method(entry, name) == "int8":
        return Int8Weight(*parts, tuple(shape))
    return Int4Weight(*parts, int4_group(shape[1], entry["group_size"], name), tuple(shape))


# ------------------------------------------------------------------------ GGUF blocks
GGML_Q4_0, GGML_Q4_1, GGML_Q8_0 = 2, 3, 8  # ggml type ids (gguf.GGMLQuantizationType)
_BLOCK_BYTES = {GGML_Q4_0: 18, GGML_Q4_1: 20, GGML_Q8_0: 34}


def from_gguf_blocks(data, qtype, shape):
    """Raw GGUF blocks of a [N, K] weight (gguf reader's tensor.data, uint8) -> a weight object.

    Q4_0 (d, q - 8 per 32): int4 group 32, scale d, zero 8, exact.
    Q4_1 (d, m, q per 32, w = d q + m): int4 group 32, scale d, zero -m / d rounded to fp16
        (exact when representable); a block with d = 0 becomes q = 1, scale m, zero 0, exact.
    Q8_0 (d, q per 32): dequantized exactly in fp32, then re-quantized to int8 per channel.
    """
    qtype = int(qtype)
    n, k = shape
    if qtype not in _BLOCK_BYTES:
        raise ValueError(f"qtype: got ggml type {qtype}, need Q4_0 ({GGML_Q4_0}), Q4_1 ({GGML_Q4_1}) or Q8_0 ({GGML_Q8_0})")
    if k % 32:
        raise ValueError(f"shape: got in_features {k}, need a multiple of 32")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, k // 32, _BLOCK_BYTES[qtype])
    d = blocks[..., :2].copy().view(np.float16)[..., 0]  # d: [N, K / 32]
    if qtype == GGML_Q8_0:
        q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
        return quantize((q * d.astype(np.float32)[..., None]).reshape(n, k), "int8")
    qs = blocks[..., 4:] if qtype == GGML_Q4_1 else blocks[..., 2:]  # 16 bytes: k j in low nibbles, j + 16 high
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # q: [N, K / 32, 32]
    if qtype == GGML_Q4_0:
        return Int4Weight.pack(q.reshape(n, k), d, np.full_like(d, 8), 32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    d32 = d.astype(np.float32)
    flat = d32 == 0
    q = np.where(flat[..., None], np.uint8(1), q)
    scales = np.where(flat, m.astype(np.float16), d)
    with np.errstate(divide="ignore", invalid="ignore"):
        zeros = np.where(flat, 0.0, -m / np.where(flat, 1, d32))
    zeros = np.clip(zeros, -65504, 65504).astype(np.float16)
    return Int4Weight.pack(q.reshape(n, k), scales, zeros, 32)


def check_entry(q: dict | None, modules) -> dict | None:
    """The validated `quantization` entry of a config (None for float weights); modules: the
    architecture's linear modules, which it must list."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CuinferError(f"config: quantization must be an object, got {q!r}")
    method = q.get("method")
    if method not in BITS:
        raise CuinferError(f"config: quantization method {method!r} is not supported: need one of {', '.join(BITS)}")
    int4 = method == "int4"
    allowed = {"bits": (BITS[method],), "group_size": GROUP_SIZES if int4 else (None,),
               "fit": FITS + ("gptq",) if int4 else (None,), "modules": (list(modules),), "lm_head": ("int8",),
               "layout": (INT4_LAYOUT,) if int4 else (None,)}
    for key, values in allowed.items():
        if q.get(key) not in values:
            hint = " (an int4 checkpoint of an earlier layout: quantize it again with python -m cuinfer.quantize)" \
                if key == "layout" else ""
            raise CuinferError(f"config: quantization {key} {json.dumps(q.get(key))} for {method}: need "
                               + " or ".join(map(json.dumps, values)) + hint)
    unknown = sorted(set(q) - set(allowed) - {"method"})
    if unknown:
        raise CuinferError(f"config: quantization has unknown key {unknown[0]!r}")
    return {"method": method, **{k: q.get(k) for k in allowed}}
