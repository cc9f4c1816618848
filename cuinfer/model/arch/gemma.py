"""Gemma 2 and Gemma 3 (text).

Four norms per layer, all x * (1 + w): before attention and on its output, before the MLP and on
its output (the "sandwich"); the embedding times sqrt(hidden_size); a GELU-tanh gated MLP;
attention scaled by query_pre_attn_scalar^-1/2 instead of head_dim^-1/2; tied embeddings by
default. Sliding windows on alternating layers (Gemma 2) or on five of every six (Gemma 3).
Gemma 2 caps attention scores and the final logits with cap * tanh(x / cap); Gemma 3 instead
normalizes q and k per head and gives its sliding layers their own RoPE base (rope_local_base_freq).
"""
from .base import Arch, layer_types, llama_linear, no_attention_bias

NORMS = {"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
         "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}


def read_gemma(d: dict, sliding) -> dict:
    return {"attention_bias": no_attention_bias(d),
            "tie_word_embeddings": bool(d.get("tie_word_embeddings", True)),
            "hidden_act": d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
            "query_pre_attn_scalar": d.get("query_pre_attn_scalar") or d.get("head_dim") or 256,
            "attn_logit_softcapping": d.get("attn_logit_softcapping"),
            "final_logit_softcapping": d.get("final_logit_softcapping"),
            "layer_types": layer_types(d, sliding)}


def read_gemma2(d: dict) -> dict:
    return read_gemma(d, lambda i: i % 2 == 0)


def read_gemma3(d: dict) -> dict:
    pattern = d.get("sliding_window_pattern", 6)
    rope = d.get("rope_parameters") or {}
    local = (rope.get("sliding_attention") or {}).get("rope_theta") or d.get("rope_local_base_freq", 10000.0)
    return {**read_gemma(d, lambda i: (i + 1) % pattern != 0), "rope_local_base_freq": float(local)}


GEMMA2 = Arch(names={"Gemma2ForCausalLM": "gemma2"}, linear=llama_linear, norms=NORMS, read=read_gemma2,
              norm_offset=1.0, embed_scale=True)
GEMMA3 = Arch(names={"Gemma3ForCausalLM": "gemma3_text"}, linear=llama_linear,
              norms={**NORMS, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}, read=read_gemma3,
              norm_offset=1.0, embed_scale=True)
ARCHES = (GEMMA2, GEMMA3)
