"""What an architecture family is, as data: the `Arch` record each family module fills in.

A family module (llama.py, qwen3.py, phi3.py, gemma.py) holds everything that distinguishes its
models: the Hugging Face tensor names of a layer and how they stack into the fused linear layers,
the norms a layer has, the GGUF names llama.cpp writes, and the block's math flags, read from
config.json by its `read` function into ModelConfig fields. The decoder, the checkpoint loader, the
quantizer and the GGUF import read this record and nothing else about the family.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ...errors import CuinferError

# LayerWeights' norm fields, in the order a layer applies them: before q/k/v; on q and k per head
# (before RoPE); on the attention output (before its residual add); before gate/up; on the MLP output
NORM_FIELDS = ("attn_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm")
HEAD_NORMS = ("q_norm", "k_norm")  # weights of head_dim; the others are of hidden_size
LINEAR_FIELDS = ("qkv", "o", "gate_up", "down")

SLIDING, FULL = "sliding_attention", "full_attention"  # Hugging Face layer_types


def llama_linear(c) -> dict:
    """The Llama layout: q/k/v and gate/up stored as separate Hugging Face modules."""
    return {"qkv": [("self_attn.q_proj", c.q_size), ("self_attn.k_proj", c.kv_size),
                    ("self_attn.v_proj", c.kv_size)],
            "o": [("self_attn.o_proj", c.hidden_size)],
            "gate_up": [("mlp.gate_proj", c.intermediate_size), ("mlp.up_proj", c.intermediate_size)],
            "down": [("mlp.down_proj", c.hidden_size)]}


def gguf_table(layer: dict) -> dict:
    """GGUF name -> Hugging Face name ({i}: layer) of a family whose layer tensors llama.cpp names
    `layer` (GGUF name in a block -> Hugging Face name in a layer), the embedding, final norm and
    output named as for every family."""
    return {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight",
            **{f"blk.{{i}}.{g}": f"model.layers.{{i}}.{h}" for g, h in layer.items()}}


# llama.cpp's names of a Llama layer (gguf-py's tensor map)
LLAMA_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def no_fields(d: dict) -> dict:
    return {}


@dataclass(frozen=True)
class Arch:
    names: dict  # Hugging Face architecture -> model_type (config.json)
    linear: Callable  # config -> {LINEAR_FIELDS field: [(Hugging Face module, rows)]}, stacked in order
    norms: dict  # NORM_FIELDS field -> Hugging Face module of a layer ("input_layernorm")
    read: Callable = no_fields  # config.json dict -> the ModelConfig fields this family sets
    norm_offset: float = 0.0  # every norm multiplies by (norm_offset + w): Gemma's (1 + w)
    embed_scale: bool = False  # the embedding output times sqrt(hidden_size) (Gemma)
    gguf_arch: str | None = None  # general.architecture of the GGUF files llama.cpp writes
    gguf_names: dict = field(default_factory=dict)  # GGUF name -> Hugging Face name, {i}: layer (gguf_table)
    gguf_permuted_qk: bool = False  # llama.cpp interleaved the rotary pairs of Q and K rows (Llama)
    gguf_norm_shift: float = 0.0  # llama.cpp stored every norm weight plus this (Gemma: 1, its 1 + w)
    # (get, tensor, fields) -> the ModelConfig fields the family's GGUF metadata sets beyond the shared
    # ones in `fields` (get(key, default): "<arch>.<key>"; tensor(GGUF name): float32 array or None)
    gguf_read: Callable | None = None
    gguf_config_tensors: tuple = ()  # GGUF tensors that hold config (Phi-3's longrope factors), not weights

    def modules(self, config) -> list:
        """The Hugging Face modules of a layer's linear weights (the quantizable ones), in order."""
        return [m for parts in self.linear(config).values() for m, _ in parts]

    def layer_shapes(self, config) -> dict:
        """A layer's tensors, name within the layer -> shape: norms, linear weights, q/k/v biases."""
        inputs = {"qkv": config.hidden_size, "o": config.q_size, "gate_up": config.hidden_size,
                  "down": config.intermediate_size}
        linear = self.linear(config)
        out = {f"{module}.weight": (config.head_dim if f in HEAD_NORMS else config.hidden_size,)
               for f, module in self.norms.items()}
        for f, parts in linear.items():
            out.update({f"{m}.weight": (rows, inputs[f]) for m, rows in parts})
        if config.attention_bias:
            out.update({f"{m}.bias": (rows,) for m, rows in linear["qkv"]})
        return out


def no_attention_bias(d: dict) -> bool:
    """False, or CuinferError: where transformers' attention_bias also puts a bias on o_proj, which
    no released checkpoint of these families has and the decoder does not add."""
    if d.get("attention_bias"):
        raise CuinferError(f"config: attention_bias (biases on q, k, v and o) is not supported for "
                           f"{', '.join(d.get('architectures') or [])}")
    return False


def layer_types(d: dict, sliding) -> tuple:
    """config.json's layer_types, else each layer i "sliding_attention" where sliding(i), else
    "full_attention"; every layer full when the config has no sliding_window."""
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    window = d.get("sliding_window")
    return tuple(SLIDING if window and sliding(i) else FULL for i in range(d["num_hidden_layers"]))
