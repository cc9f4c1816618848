"""The Llama family: Llama 2/3/3.1/3.2, Mistral, Qwen2.

Pre-norm blocks (RMSNorm, SwiGLU MLP, rotate-half RoPE, GQA), q/k/v and gate/up as separate
modules. Qwen2 always has q/k/v biases. Windows: Llama has none (transformers ignores a
sliding_window there too); Mistral applies sliding_window to every layer; Qwen2 with
use_sliding_window to the layers from max_window_layers on (transformers writes both as layer_types).
"""
from .base import FULL, LLAMA_GGUF_LAYER, Arch, gguf_table, layer_types, llama_linear, no_attention_bias

NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


def read_llama(d: dict) -> dict:
    return {"attention_bias": no_attention_bias(d), "layer_types": (FULL,) * d["num_hidden_layers"]}


def read_mistral(d: dict) -> dict:
    return {"attention_bias": no_attention_bias(d), "layer_types": layer_types(d, lambda i: True)}


def qwen_layer_types(d: dict) -> tuple:
    """Qwen's windows: only with use_sliding_window, on the layers from max_window_layers on."""
    if not d.get("use_sliding_window", False):
        d = {**d, "sliding_window": None, "layer_types": None}
    return layer_types(d, lambda i: i >= d.get("max_window_layers", 0))


def read_qwen2(d: dict) -> dict:
    return {"attention_bias": True, "layer_types": qwen_layer_types(d)}


QWEN_GGUF_LAYER = {**LLAMA_GGUF_LAYER, **{f"attn_{n}.bias": f"self_attn.{n}_proj.bias" for n in "qkv"}}

LLAMA = Arch(names={"LlamaForCausalLM": "llama"}, linear=llama_linear, norms=NORMS, read=read_llama,
             gguf_arch="llama", gguf_names=gguf_table(LLAMA_GGUF_LAYER), gguf_permuted_qk=True)
MISTRAL = Arch(names={"MistralForCausalLM": "mistral"}, linear=llama_linear, norms=NORMS, read=read_mistral)
QWEN2 = Arch(names={"Qwen2ForCausalLM": "qwen2"}, linear=llama_linear, norms=NORMS, read=read_qwen2,
             gguf_arch="qwen2", gguf_names=gguf_table(QWEN_GGUF_LAYER))
ARCHES = (LLAMA, MISTRAL, QWEN2)
