"""Decoder weights: Hugging Face tensors fused into the layout the model runs on, then moved to a device.

Per layer: q/k/v projections become one [q + k + v, hidden] matrix (and one bias for
Qwen2-style attention_bias), gate/up become one [2 * intermediate, hidden] matrix,
so each is a single linear call; which Hugging Face modules stack into which is the
architecture's data (cuinfer.model.arch: Phi-3 stores them stacked already). Linear
weights stay in the HF layout [out, in] (y = x @ w.T) and may be quantized
(cuinfer.ops.quant): quantized at load by to_device, or quantized already in the checkpoint
(every row carries its own scales, so quantized q/k/v and gate/up stack row-wise as they
are); norms and the embedding stay float.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import CuinferError
from ..ops.quant import ARRAYS, QUANTIZED, concat_rows, quantize_spec, split_rows
from .arch import LINEAR_FIELDS


@dataclass
class LayerWeights:
    qkv: object  # [(n_heads + 2 * n_kv_heads) * head_dim, hidden]
    o: object  # [hidden, n_heads * head_dim]
    gate_up: object  # [2 * intermediate, hidden]
    down: object  # [hidden, intermediate]
    attn_norm: object  # [hidden]; the norms are as the arch names them (arch.NORM_FIELDS), None if absent
    mlp_norm: object  # [hidden]
    qkv_bias: object = None  # [(n_heads + 2 * n_kv_heads) * head_dim]
    q_norm: object = None  # [head_dim]
    k_norm: object = None  # [head_dim]
    attn_out_norm: object = None  # [hidden]
    mlp_out_norm: object = None  # [hidden]


@dataclass
class Weights:
    embed: object  # [vocab, hidden]
    layers: list
    norm: object  # [hidden]
    lm_head: object  # [vocab, hidden]; the embedding itself when tied


def fused_modules(config) -> dict:
    """Each linear field -> [(Hugging Face module, rows)] whose weights it stacks, in order (the arch's)."""
    return config.arch.linear(config)


def _stack(parts):
    """The rows of `parts` (float arrays, or quantized weights of one format) in one matrix."""
    if len(parts) == 1:
        return parts[0]
    return concat_rows(parts) if any(isinstance(p, QUANTIZED) for p in parts) else np.concatenate(parts, axis=0)


def _get(tensors, name):
    if name not in tensors:
        raise CuinferError(f"checkpoint: tensor {name!r} is missing")
    return tensors[name]


def fuse(config, tensors) -> Weights:
    """Hugging Face names -> fused numpy weights, kept in the checkpoint's dtype (to_device casts);
    quantized ones (Int8Weight / Int4Weight, from a quantized checkpoint) stack as quantized. Norm
    weights become offset + w (float32) where the arch's norms multiply by that (Gemma's 1 + w)."""
    arch = config.arch
    norm = (lambda w: w) if not arch.norm_offset else (lambda w: np.asarray(w, np.float32) + arch.norm_offset)
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        get = lambda name, p=p: _get(tensors, p + name)
        modules = fused_modules(config)
        bias = None
        if config.attention_bias:
            bias = np.concatenate([get(f"{m}.bias") for m, _ in modules["qkv"]])
        linear = {field: _stack([get(f"{m}.weight") for m, _ in parts]) for field, parts in modules.items()}
        norms = {field: norm(get(f"{module}.weight")) for field, module in arch.norms.items()}
        layers.append(LayerWeights(qkv_bias=bias, **linear, **norms))
    embed = _get(tensors, "model.embed_tokens.weight")
    lm_head = tensors.get("lm_head.weight")
    if lm_head is None or (config.tie_word_embeddings and not isinstance(lm_head, QUANTIZED)):
        lm_head = embed  # tied (a quantized checkpoint keeps its int8 lm_head as a tensor of its own)
    return Weights(embed=embed, layers=layers, norm=norm(_get(tensors, "model.norm.weight")), lm_head=lm_head)


def linear_tensors(config, w: Weights) -> dict:
    """Inverse of fuse for quantized decoder linear layers: Hugging Face name -> its rows of the fused weight."""
    out = {}
    for i, lw in enumerate(w.layers):
        for field, modules in fused_modules(config).items():
            parts = split_rows(getattr(lw, field), [rows for _, rows in modules])
            out.update({f"model.layers.{i}.{m}.weight": part for (m, _), part in zip(modules, parts)})
    return out


def to_device(w: Weights, xp, dtype, quant=None, lm_head_quant=None) -> Weights:
    """Cast to `dtype` on the array module `xp`; linear weights quantized when `quant` is set
    (a cuinfer.ops.quant.parse_spec string: "int8" per row, "int4" in groups of 128 with the
    "minmax" fit, "int4-g32-mse", ...; a matrix whose in_features the group does not divide takes the largest
    group size that does). On the GPU the weights are quantized there (the same bits as numpy).
    Linear weights quantized already (Int8Weight / Int4Weight, e.g. from cuinfer.model.gptq) are moved
    as they are. lm_head_quant ("int8"; Model.from_tensors passes it with any `quant`) quantizes
    the lm_head (its own copy when tied: the embedding gathers rows and stays in `dtype`); the
    output layer keeps 8 bits under int4, as llama.cpp's 4-bit mixes keep it at 6.
    A `quant` for weights quantized already (a checkpoint saved by cuinfer.quantize) is an error."""
    put = lambda a: None if a is None else xp.asarray(np.asarray(a).astype(dtype))

    def linear_weight(a, quant=quant):
        if isinstance(a, QUANTIZED):  # quantized already (cuinfer.model.gptq, a quantized checkpoint)
            if quant is not None:
                raise CuinferError(f"--quant {quant}: the weights are quantized already (a checkpoint "
                                           "saved by cuinfer.quantize): load it without --quant")
            return a if xp is np else a.to_device()
        if quant is None:
            return put(a)
        return quantize_spec(xp.asarray(np.asarray(a, dtype=np.float32)), quant)

    layers = []
    for lw in w.layers:
        fields = {k: (linear_weight if k in LINEAR_FIELDS else put)(v) for k, v in vars(lw).items()}
        layers.append(LayerWeights(**fields))
    embed = put(w.embed)
    if lm_head_quant is not None:
        lm_head = linear_weight(w.lm_head, lm_head_quant)
    else:
        lm_head = embed if w.lm_head is w.embed else linear_weight(w.lm_head, None)
    return Weights(embed=embed, layers=layers, norm=put(w.norm), lm_head=lm_head)


def nonfinite_tensor(config, w: Weights):
    """The name of the first weight holding NaN or Inf (for a fused one, the Hugging Face tensors
    it stacks), else None. One reduction per array where it lives (quantized: its float scales)."""
    from ..ops import runtime

    modules, norms = fused_modules(config), config.arch.norms
    named = [("model.embed_tokens.weight", w.embed), ("model.norm.weight", w.norm), ("lm_head.weight", w.lm_head)]
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        named += [(f"{p}{module}.weight", getattr(lw, f)) for f, module in norms.items()]
        named.append((" / ".join(f"{p}{m}.bias" for m, _ in modules["qkv"]), lw.qkv_bias))
        named += [(" / ".join(f"{p}{m}.weight" for m, _ in modules[f]), getattr(lw, f)) for f in LINEAR_FIELDS]
    for name, a in named:
        arrays = [] if a is None else [getattr(a, n) for n in ARRAYS[type(a)]] if isinstance(a, QUANTIZED) else [a]
        for x in arrays:
            if x.dtype.kind == "f" or x.dtype == runtime.bfloat16:
                xp = runtime.require_cupy() if runtime.is_device_array(x) else np
                if not bool(xp.isfinite(x if x.dtype.kind == "f" else x.astype(np.float32)).all()):  # bf16: cast
                    return name
    return None
