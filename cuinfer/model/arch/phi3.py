"""Phi-3: the Llama block with q/k/v stored as one module (qkv_proj) and gate/up as one
(gate_up_proj, gate rows first); sliding_window, when set, applies to every layer. Phi-3 128k and
Phi-3.5 use longrope (config.py, cuinfer.ops.rope); llama.cpp stores its factors as two tensors."""
import math

from ...errors import CuinferError
from .base import Arch, gguf_table, layer_types
from .llama import NORMS


def linear(c) -> dict:
    return {"qkv": [("self_attn.qkv_proj", c.q_size + 2 * c.kv_size)], "o": [("self_attn.o_proj", c.hidden_size)],
            "gate_up": [("mlp.gate_up_proj", 2 * c.intermediate_size)], "down": [("mlp.down_proj", c.hidden_size)]}


def read(d: dict) -> dict:
    rotary = (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if rotary != 1.0:
        raise CuinferError(f"config: partial_rotary_factor {rotary} is not supported: cuinfer rotates whole heads")
    return {"layer_types": layer_types(d, lambda i: True)}


GGUF_LAYER = {"attn_norm.weight": "input_layernorm.weight", "attn_qkv.weight": "self_attn.qkv_proj.weight",
              "attn_output.weight": "self_attn.o_proj.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
              "ffn_up.weight": "mlp.gate_up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}

LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def gguf_read(get, tensor, f):
    """llama.cpp's longrope (Phi-3 128k, Phi-3.5): the factors as two tensors, the original length and
    the attention factor in the metadata."""
    long, short = (tensor(n) for n in LONGROPE_TENSORS)
    if long is None:
        return {}
    orig = int(get("rope.scaling.original_context_length"))
    factor = f["max_position_embeddings"] / orig
    attention = get("rope.scaling.attn_factor", None)
    if attention is None:  # the default transformers derives (and llama.cpp's converter writes)
        attention = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0
    return {"rope_scaling": {"rope_type": "longrope", "short_factor": [float(x) for x in short.ravel()],
                             "long_factor": [float(x) for x in long.ravel()],
                             "original_max_position_embeddings": orig, "attention_factor": float(attention)}}


PHI3 = Arch(names={"Phi3ForCausalLM": "phi3"}, linear=linear, norms=NORMS, read=read, gguf_arch="phi3",
            gguf_names=gguf_table(GGUF_LAYER), gguf_read=gguf_read, gguf_config_tensors=LONGROPE_TENSORS)
ARCHES = (PHI3,)
