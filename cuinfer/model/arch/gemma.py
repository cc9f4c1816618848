"""Gemma 2 and Gemma 3 (text).

Four norms per layer, all x * (1 + w): before attention and on its output, before the MLP and on
its output (the "sandwich"); the embedding times sqrt(hidden_size); a GELU-tanh gated MLP;
attention scaled by query_pre_attn_scalar^-1/2 instead of head_dim^-1/2; tied embeddings by
default. Sliding windows on alternating layers (Gemma 2) or on five of every six (Gemma 3).
Gemma 2 caps attention scores and the final logits with cap * tanh(x / cap); Gemma 3 instead
normalizes q and k per head and gives its sliding layers their own RoPE base (rope_local_base_freq).
GGUF files as llama.cpp's converter writes them: see GGUF_LAYER and gguf_gemma below.
"""
from .base import FULL, LLAMA_GGUF_LAYER, SLIDING, Arch, gguf_table, layer_types, llama_linear, no_attention_bias

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


# llama.cpp's GGUF files (convert_hf_to_gguf.py): every norm stored as 1 + w; no lm_head (tied);
# softcaps and the window in the metadata; the window's layers, the attention scale and (Gemma 3)
# the sliding layers' RoPE base are llama.cpp's fixed rules, not stored (llama-model.cpp)
GGUF_LAYER = {**LLAMA_GGUF_LAYER, "post_attention_norm.weight": "post_attention_layernorm.weight",
              "ffn_norm.weight": "pre_feedforward_layernorm.weight",
              "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
GGUF3_LAYER = {**GGUF_LAYER, "attn_q_norm.weight": "self_attn.q_norm.weight",
               "attn_k_norm.weight": "self_attn.k_norm.weight"}


def gguf_gemma(pattern: int, big_layers: int):
    """GGUF metadata -> fields: windows on layer i where i % pattern < pattern - 1 (llama.cpp's swa
    pattern, unless the file stores attention.sliding_window_pattern), the attention scale
    (hidden / heads)^-1/2 for the 27B (big_layers layers: its query_pre_attn_scalar), else head_dim^-1/2."""
    def read(get, tensor, f):
        n, window = f["num_hidden_layers"], get("attention.sliding_window") or None
        p = get("attention.sliding_window_pattern", pattern)
        sliding = [bool(p[i]) if isinstance(p, list) else i % p < p - 1 for i in range(n)]
        types = tuple(SLIDING if window and s else FULL for s in sliding)
        big = n == big_layers
        return {"hidden_act": "gelu_pytorch_tanh", "layer_types": types if SLIDING in types else None,
                "sliding_window": window if SLIDING in types else None,
                "query_pre_attn_scalar": f["hidden_size"] // f["num_attention_heads"] if big else f["head_dim"],
                "attn_logit_softcapping": get("attn_logit_softcapping"),
                "final_logit_softcapping": get("final_logit_softcapping")}
    return read


def gguf_gemma3(get, tensor, f):
    return {**gguf_gemma(6, 62)(get, tensor, f), "rope_local_base_freq": float(get("rope.freq_base_swa", 10000.0))}


GEMMA2 = Arch(names={"Gemma2ForCausalLM": "gemma2"}, linear=llama_linear, norms=NORMS, read=read_gemma2,
              norm_offset=1.0, embed_scale=True, gguf_arch="gemma2",
              gguf_names={g: h for g, h in gguf_table(GGUF_LAYER).items() if g != "output.weight"},  # tied
              gguf_norm_shift=1.0, gguf_read=gguf_gemma(2, 46))
GEMMA3 = Arch(names={"Gemma3ForCausalLM": "gemma3_text"}, linear=llama_linear,
              norms={**NORMS, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}, read=read_gemma3,
              norm_offset=1.0, embed_scale=True, gguf_arch="gemma3", gguf_names=gguf_table(GGUF3_LAYER),
              gguf_norm_shift=1.0, gguf_read=gguf_gemma3)
ARCHES = (GEMMA2, GEMMA3)
