"""ModelConfig: reading Hugging Face config.json files, refusing what the engine cannot run."""
import json

import numpy as np
import pytest

from cuinfer.convert import load_preset, preset_names
from cuinfer.io.config import ModelConfig, load_config, numpy_dtype
from cuinfer.ops import runtime
from cuinfer.ops.runtime import CuinferError

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
    "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": [2, 7], "tie_word_embeddings": False,
}


def test_llama_fields():
    c = ModelConfig.from_dict(LLAMA)
    assert c.head_dim == 128 and c.q_size == 4096 and c.kv_size == 1024
    assert c.eos_token_id == (2, 7) and c.bos_token_id == 1
    assert c.dtype == runtime.bfloat16 and not c.attention_bias and c.rope_scaling is None
    assert c.model_type == "llama"


def test_explicit_head_dim_and_scalar_eos():
    c = ModelConfig.from_dict({**LLAMA, "head_dim": 64, "eos_token_id": 3})
    assert c.head_dim == 64 and c.q_size == 32 * 64 and c.eos_token_id == (3,)


def test_qwen2_has_bias_and_windows_per_layer():
    q = ModelConfig.from_dict({**LLAMA, "architectures": ["Qwen2ForCausalLM"],
                               "sliding_window": 4096, "use_sliding_window": False})
    assert q.attention_bias and q.layer_types is None and q.window(31) == 0
    q = ModelConfig.from_dict({**LLAMA, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64,
                               "use_sliding_window": True, "max_window_layers": 30})
    assert [q.window(i) for i in (0, 29, 30, 31)] == [0, 0, 64, 64]
    assert ModelConfig.from_dict(q.to_dict()) == q
    assert ModelConfig.from_dict({**LLAMA, "sliding_window": 64}).layer_types is None  # Llama: no windows
    m = ModelConfig.from_dict({**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert m.architecture == "MistralForCausalLM" and not m.attention_bias
    assert all(m.window(i) == 4096 for i in range(32))
    gemma = {k: v for k, v in LLAMA.items() if k not in ("rope_theta", "tie_word_embeddings")}
    g = ModelConfig.from_dict({**gemma, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 512,
                               "num_hidden_layers": 12, "head_dim": 256, "rope_parameters": {
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}})
    assert [g.window(i) for i in range(12)] == [512] * 5 + [0] + [512] * 5 + [0]
    assert g.rope_theta == 1e6 and g.rope_local_base_freq == 1e4 and g.rope_scaling["factor"] == 8.0
    assert g.tie_word_embeddings and g.hidden_act == "gelu_pytorch_tanh" and g.attention_scale == 256 ** -0.5
    assert ModelConfig.from_dict(g.to_dict()) == g


def test_llama3_rope_scaling_and_transformers5_spelling():
    rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
    c = ModelConfig.from_dict({**LLAMA, "rope_scaling": {**rs, "rope_type": None, "type": "llama3"}})
    assert c.rope_scaling == rs
    d = {k: v for k, v in LLAMA.items() if k not in ("rope_theta", "torch_dtype")}
    c5 = ModelConfig.from_dict({**d, "dtype": "float16", "rope_parameters": {**rs, "rope_theta": 5e5}})
    assert c5.rope_theta == 5e5 and c5.rope_scaling == rs and c5.torch_dtype == "float16"
    plain = ModelConfig.from_dict({**d, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e4


@pytest.mark.parametrize("bad, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture GPT2LMHeadModel"),
    ({"architectures": None, "model_type": "gemma"}, "unsupported architecture none .model_type 'gemma'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling linear: factor is null"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 64, "long_factor": [1.0] * 63,
                       "original_max_position_embeddings": 4096}}, "longrope: long_factor is .*need 64 positive"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 64, "long_factor": [1.0] * 64}},
     "longrope: original_max_position_embeddings is null"),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 0.5}, "sliding_window is 0.5"),
    ({"architectures": ["MistralForCausalLM"], "layer_types": ["full_attention"]}, "layer_types .* per layer .32."),
    ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75"),
    ({"attention_bias": True}, r"attention_bias \(biases on q, k, v and o\) is not supported for LlamaForCausalLM"),
    ({"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": -1}, "attn_logit_softcapping is -1"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "missing low_freq_factor"),
    ({"num_key_value_heads": 5}, "not a multiple of num_key_value_heads 5"),
    ({"num_attention_heads": 30}, "hidden_size 4096 is not a multiple"),
    ({"torch_dtype": "int8"}, "dtype 'int8' is not supported"),
    ({"hidden_size": None}, "missing hidden_size"),
    ({"hidden_size": -4096}, "config: hidden_size is -4096, need a positive integer"),
    ({"head_dim": 0}, "config: head_dim is 0, need a positive integer"),
    ({"num_hidden_layers": "32"}, 'config: num_hidden_layers is "32", need a positive integer'),
])
def test_refused_with_a_clear_message(bad, message):
    with pytest.raises(CuinferError, match=message):
        ModelConfig.from_dict({**LLAMA, **bad})


def test_to_dict_round_trip_and_file(tmp_path):
    for d in (LLAMA, {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "head_dim": 96}):
        c = ModelConfig.from_dict(d)
        assert ModelConfig.from_dict(c.to_dict()) == c
        (tmp_path / "config.json").write_text(json.dumps(c.to_dict()))
        assert load_config(tmp_path) == c == load_config(tmp_path / "config.json")
    hash(c)  # frozen and hashable (rope_scaling is left out of the hash)


def test_load_config_errors(tmp_path):
    with pytest.raises(CuinferError, match="no such file"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CuinferError, match="cannot read config"):
        load_config(tmp_path)


@pytest.mark.parametrize("name", preset_names())
def test_presets_load(name):
    c = load_preset(name)
    assert c.head_dim in (64, 96, 128, 256) and c.num_attention_heads % c.num_key_value_heads == 0
    assert ModelConfig.from_dict(c.to_dict()) == c


def test_preset_shapes():
    assert {"llama3-8b", "llama2-7b", "mistral-7b", "qwen2.5-7b", "smollm2-135m", "tiny"} <= set(preset_names())
    assert load_preset("llama3-8b").rope_scaling["factor"] == 8.0
    assert load_preset("qwen2.5-7b").attention_bias
    assert load_preset("smollm2-135m").tie_word_embeddings
    assert load_preset("phi3-mini").window(31) == 2047 and load_preset("qwen3-8b").window(0) == 0
    g2, g3 = load_preset("gemma2-9b"), load_preset("gemma3-12b-text")
    assert [g2.window(i) for i in range(3)] == [4096, 0, 4096] and g2.final_logit_softcapping == 30.0
    assert [g3.window(i) for i in range(6)] == [1024] * 5 + [0] and g3.rope_local_base_freq == 1e4
    with pytest.raises(CuinferError, match="unknown preset 'gpt5'"):
        load_preset("gpt5")


def test_numpy_dtype():
    assert numpy_dtype("float16") == np.float16 and numpy_dtype(np.float32) == np.float32
    with pytest.raises(CuinferError):
        numpy_dtype(np.int8)


@pytest.mark.parametrize("name, params", [
    # parameter counts the model cards publish (safetensors metadata)
    ("llama3-8b", 8_030_261_248), ("llama2-7b", 6_738_415_616), ("mistral-7b", 7_248_023_552),
    ("qwen2.5-7b", 7_615_616_512), ("smollm2-135m", 134_515_008), ("qwen3-8b", 8_190_735_360),
    ("gemma2-9b", 9_241_705_984), ("phi3-mini", 3_821_079_552),
])
def test_preset_parameter_counts(name, params):
    from cuinfer.io.checkpoint import expected_tensors

    assert sum(int(np.prod(s)) for s in expected_tensors(load_preset(name)).values()) == params


def test_longrope_read_and_round_trip():
    """Phi-3.5's longrope as transformers 5 writes it (rope_parameters, the original length at the top
    level): the factors, the original length and the default attention factor, kept through to_dict."""
    half = 48
    d = {**LLAMA, "architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "num_attention_heads": 32,
         "num_key_value_heads": 32, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
         "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
                             "long_factor": [2.0] * half}}
    c = ModelConfig.from_dict(d)
    m = (1 + np.log(32) / np.log(4096)) ** 0.5
    assert c.rope_scaling == {"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [2.0] * half,
                              "original_max_position_embeddings": 4096, "attention_factor": pytest.approx(m)}
    assert c.attention_scale == pytest.approx(96 ** -0.5 * m * m)
    assert ModelConfig.from_dict(c.to_dict()) == c
    given = ModelConfig.from_dict({**d, "rope_parameters": {**d["rope_parameters"], "attention_factor": 1.5}})
    assert given.rope_scaling["attention_factor"] == 1.5
