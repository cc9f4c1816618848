"""Decoder weights: Hugging Face tensors fused into the layout the model runs on, then moved to a device.

Per layer: q/k/v projections become one [q + k + v, hidden] matrix (and one bias for
Qwen2-style attention_bias), gate/up become one [2 * intermediate, hidden] matrix,
so each is a single linear call. Linear weights stay in the HF layout [out, in]
(y = x @ w.T) and may be quantized (cuinfer.quant); norms and the embedding stay float.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import runtime


@dataclass
class LayerWeights:
    input_norm: object  # [hidden]
    qkv: object  # [(n_heads + 2 * n_kv_heads) * head_dim, hidden]
    qkv_bias: object  # [(n_heads + 2 * n_kv_heads) * head_dim] or None
    o: object  # [hidden, n_heads * head_dim]
    post_norm: object  # [hidden]
    gate_up: object  # [2 * intermediate, hidden]
    down: object  # [hidden, intermediate]


@dataclass
class Weights:
    embed: object  # [vocab, hidden]
    layers: list
    norm: object  # [hidden]
    lm_head: object  # [vocab, hidden]; the embedding itself when tied


LINEAR_FIELDS = ("qkv", "o", "gate_up", "down")


def _get(tensors, name):
    if name not in tensors:
        raise runtime.CuinferError(f"checkpoint: tensor {name!r} is missing")
    return tensors[name]


def fuse(config, tensors) -> Weights:
    """Hugging Face names -> fused numpy weights, kept in the checkpoint's dtype (to_device casts)."""
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        get = lambda name: _get(tensors, p + name)
        bias = None
        if config.attention_bias:
            bias = np.concatenate([get(f"self_attn.{n}_proj.bias") for n in "qkv"])
        layers.append(LayerWeights(
            input_norm=get("input_layernorm.weight"),
            qkv=np.concatenate([get(f"self_attn.{n}_proj.weight") for n in "qkv"], axis=0),
            qkv_bias=bias,
            o=get("self_attn.o_proj.weight"),
            post_norm=get("post_attention_layernorm.weight"),
            gate_up=np.concatenate([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")], axis=0),
            down=get("mlp.down_proj.weight")))
    embed = _get(tensors, "model.embed_tokens.weight")
    tied = config.tie_word_embeddings or "lm_head.weight" not in tensors
    lm_head = embed if tied else tensors["lm_head.weight"]
    return Weights(embed=embed, layers=layers, norm=_get(tensors, "model.norm.weight"), lm_head=lm_head)


def to_device(w: Weights, xp, dtype, quant=None, lm_head_quant=None) -> Weights:
    """Cast to `dtype` on the array module `xp`; linear weights quantized when `quant` is set
    (a cuinfer.quant.parse_spec string: "int8" per row, "int4" in groups of 128 with the
    "minmax" fit, "int4-g32-mse", ...; a matrix whose in_features the group does not divide takes the largest
    group size that does). On the GPU the weights are quantized there (the same bits as numpy).
    Linear weights quantized already (Int8Weight / Int4Weight, e.g. from cuinfer.gptq) are moved
    as they are. lm_head_quant ("int8"; Model.from_tensors passes it with any `quant`) quantizes
    the lm_head (its own copy when tied: the embedding gathers rows and stays in `dtype`); the
    output layer keeps 8 bits under int4, as llama.cpp's 4-bit mixes keep it at 6."""
    put = lambda a: None if a is None else xp.asarray(np.asarray(a).astype(dtype))

    from .quant import GROUP_SIZES, Int4Weight, Int8Weight, group_for, parse_spec, quantize

    def linear_weight(a, quant=quant):
        if isinstance(a, (Int8Weight, Int4Weight)):  # quantized already (cuinfer.gptq)
            return a if xp is np else a.to_device()
        if quant is None:
            return put(a)
        method, group_size, fit = parse_spec(quant)
        if fit == "gptq":
            raise runtime.CuinferError(f"--quant {quant}: GPTQ needs calibration text, so it is not a load-time "
                                       "format: python -m cuinfer.eval perplexity CKPT --quant int4-gptq --calib FILE")
        k = a.shape[1]
        group = group_for(k, group_size) if method == "int4" else group_size
        if group is None:
            raise runtime.CuinferError(f"--quant {quant}: in_features {k} is not a multiple of any "
                                       f"group size {GROUP_SIZES}")
        return quantize(xp.asarray(np.asarray(a, dtype=np.float32)), method, group, fit)

    layers = []
    for lw in w.layers:
        fields = {k: (linear_weight if k in LINEAR_FIELDS else put)(v) for k, v in vars(lw).items()}
        layers.append(LayerWeights(**fields))
    embed = put(w.embed)
    if lm_head_quant is not None:
        lm_head = linear_weight(w.lm_head, lm_head_quant)
    else:
        lm_head = embed if w.lm_head is w.embed else put(w.lm_head)
    return Weights(embed=embed, layers=layers, norm=put(w.norm), lm_head=lm_head)
