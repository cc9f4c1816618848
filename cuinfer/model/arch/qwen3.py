"""Qwen3: the Llama block with an RMSNorm over each q and k head before RoPE (q_norm, k_norm, weights
of head_dim), no q/k/v bias, head_dim from the config (not hidden / heads);
windows as Qwen2's."""
from .base import LLAMA_GGUF_LAYER, Arch, gguf_table, llama_linear, no_attention_bias
from .llama import NORMS, qwen_layer_types


def read(d: dict) -> dict:
    return {"attention_bias": no_attention_bias(d), "layer_types": qwen_layer_types(d)}


GGUF_LAYER = {**LLAMA_GGUF_LAYER, "attn_q_norm.weight": "self_attn.q_norm.weight",
              "attn_k_norm.weight": "self_attn.k_norm.weight"}

QWEN3 = Arch(names={"Qwen3ForCausalLM": "qwen3"}, linear=llama_linear,
             norms={**NORMS, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}, read=read,
             gguf_arch="qwen3", gguf_names=gguf_table(GGUF_LAYER))
ARCHES = (QWEN3,)
