"""GGUF import: dequantization, the Q/K row order, tokenizer metadata, and clear refusals."""
import numpy as np
import pytest
from helpers import llama_cpp_permute, varied_strings, write_gguf

from cuinfer.convert import load_preset, random_tensors
from cuinfer.io.checkpoint import load_checkpoint
from cuinfer.ops.runtime import CuinferError

gguf = pytest.importorskip("gguf")
from cuinfer.io import gguf as cg

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


def small_config(**over):
    # 2 layers, hidden 256, 4 heads / 2 kv heads of 64, GQA; vocab 256 keeps the file small
    return load_preset("tiny").replace(vocab_size=256, intermediate_size=320, **over)


@pytest.mark.parametrize("shift", range(len(TYPES)))
def test_every_type_converts_to_ggufs_dequantization(tmp_path, shift):
    config = small_config()
    tensors = random_tensors(config, "float32", seed=shift)
    types = {n: TYPES[(i + shift) % len(TYPES)] for i, n in enumerate(tensors) if tensors[n].ndim == 2}
    expected = write_gguf(tmp_path / "m.gguf", config, tensors, types)
    out = cg.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    got_config, got = load_checkpoint(out)
    assert got_config == config.replace(torch_dtype="float32", rms_norm_eps=got_config.rms_norm_eps)
    assert got_config.rms_norm_eps == pytest.approx(config.rms_norm_eps, rel=1e-6)
    for name in tensors:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{name} ({types.get(name, 'F32')})")
        if types.get(name, "F32") == "F32":  # stored exactly, so Q/K come back in the original order
            np.testing.assert_array_equal(got[name], tensors[name], err_msg=name)


def test_untied_model_has_lm_head(tmp_path):
    config = small_config(tie_word_embeddings=False)
    tensors = random_tensors(config, "float32")
    write_gguf(tmp_path / "m.gguf", config, tensors)
    got_config, got = load_checkpoint(cg.convert_gguf(tmp_path / "m.gguf", tmp_path / "out", "bfloat16"))
    assert not got_config.tie_word_embeddings and got_config.torch_dtype == "bfloat16"
    np.testing.assert_array_equal(got["lm_head.weight"], tensors["lm_head.weight"].astype(got["lm_head.weight"].dtype))


def blocks_of(kind, d, q, m=0.0):
    """One ggml block from its fields, laid out by hand (not through gguf)."""
    d16 = np.float16(d).tobytes()
    if kind == "Q8_0":
        return np.frombuffer(d16 + np.asarray(q, np.int8).tobytes(), np.uint8)
    q = np.asarray(q, np.uint8)
    nibbles = (q[:16] | (q[16:] << 4)).astype(np.uint8).tobytes()
    return np.frombuffer(d16 + (np.float16(m).tobytes() if kind == "Q4_1" else b"") + nibbles, np.uint8)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_matches_the_block_formula(kind):
    rng = np.random.default_rng(7)
    rows, per_row = 3, 2
    fields = [(rng.uniform(-0.1, 0.1), rng.integers(-128, 128, 32) if kind == "Q8_0" else rng.integers(0, 16, 32),
               rng.uniform(-1, 1)) for _ in range(rows * per_row)]
    raw = np.concatenate([blocks_of(kind, *f) for f in fields]).reshape(rows, -1)
    got = cg.dequantize(raw, kind, 32 * per_row)
    want = np.empty((rows * per_row, 32))
    for b, (d, q, m) in enumerate(fields):  # float64 loops over the fp16-rounded fields
        d, m = float(np.float16(d)), float(np.float16(m))
        for j in range(32):
            want[b, j] = {"Q8_0": d * q[j], "Q4_0": d * (q[j] - 8), "Q4_1": d * q[j] + m}[kind]
    np.testing.assert_allclose(got, want.reshape(rows, -1), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]))


@pytest.mark.parametrize("heads, head_dim", [(1, 4), (4, 64), (3, 128), (9, 64)])
def test_unpermute_inverts_llama_cpp_permute(heads, head_dim):
    w = np.random.default_rng(heads).standard_normal((heads * head_dim, 5))
    np.testing.assert_array_equal(cg.unpermute_rows(llama_cpp_permute(w, heads), heads), w)
    # within a head, llama.cpp's row 2p + h is Hugging Face's row h * head_dim / 2 + p
    g = llama_cpp_permute(w, heads)
    assert np.array_equal(g[1], w[head_dim // 2]) and np.array_equal(g[2], w[1])


def test_raw_blocks_keep_the_quantized_bytes(tmp_path):
    config = small_config()
    tensors = random_tensors(config, "float32")
    types = {n: "Q4_1" for n in tensors if n.endswith("proj.weight")}
    write_gguf(tmp_path / "m.gguf", config, tensors, types)
    raws = {r.name: r for r in cg.raw_tensors(tmp_path / "m.gguf")}
    _, got = load_checkpoint(cg.convert_gguf(tmp_path / "m.gguf", tmp_path / "out"))
    q = raws["model.layers.1.self_attn.k_proj.weight"]
    assert (q.gguf_name, q.type, q.shape) == ("blk.1.attn_k.weight", "Q4_1", (128, 256))
    assert q.blocks.dtype == np.uint8 and q.blocks.shape == (128, 256 // 32 * 20)
    for r in raws.values():
        np.testing.assert_array_equal(cg.dequantize(r.blocks, r.type, r.shape[-1]).reshape(r.shape), got[r.name])


def test_tokenizer_from_metadata(tmp_path):
    from cuinfer.io.tokenizer import Tokenizer

    config = small_config()
    write_gguf(tmp_path / "m.gguf", config, random_tensors(config, "float32"))
    tok = Tokenizer.from_pretrained(cg.convert_gguf(tmp_path / "m.gguf", tmp_path / "out"))
    ids = tok.encode("the thin<|im_end|><unused3>")
    assert [tok.id_to_token(i) for i in ids] == ["t", "he", "Ġt", "h", "in", "<|im_end|>", "<unused3>"]
    assert tok.decode(ids) == "the thin<|im_end|><unused3>" and tok.decode(ids, True) == "the thin<unused3>"
    assert tok.bos_token_id == 1 and tok.eos_token_ids == {2}
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"


def test_llama3_style_tokenizer(tmp_path):
    from cuinfer.io.tokenizer import Tokenizer

    config = small_config()
    # "3 4" outranks "1 2": the GPT-2 regex keeps "1234" whole -> 12|34; Llama 3's splits
    # numbers into groups of three first -> 123|4
    merges = ("3 4", "1 2", "12 3")
    write_gguf(tmp_path / "m.gguf", config, random_tensors(config, "float32"), pre="llama-bpe",
               add_bos=True, merges=merges)
    tok = Tokenizer.from_pretrained(cg.convert_gguf(tmp_path / "m.gguf", tmp_path / "out"))
    ids = tok.encode("1234")
    assert [tok.id_to_token(i) for i in ids] == ["<|im_start|>", "123", "4"]
    assert tok.encode("1234", add_special_tokens=False) == ids[1:] and tok.decode(ids[1:]) == "1234"
    write_gguf(tmp_path / "g.gguf", config, random_tensors(config, "float32"), pre="gpt2", merges=merges)
    tok = Tokenizer.from_pretrained(cg.convert_gguf(tmp_path / "g.gguf", tmp_path / "g"))
    assert [tok.id_to_token(i) for i in tok.encode("1234")] == ["12", "34"]


def test_qwen2_tokenizer_splits_single_digits(tmp_path):
    from cuinfer.io.tokenizer import Tokenizer

    config = small_config()
    write_gguf(tmp_path / "q.gguf", config, random_tensors(config, "float32"), pre="qwen2",
               merges=("1 2", "3 4", "12 3"))
    tok = Tokenizer.from_pretrained(cg.convert_gguf(tmp_path / "q.gguf", tmp_path / "q"))
    assert [tok.id_to_token(i) for i in tok.encode("1234 ab")] == ["1", "2", "3", "4", "Ġ", "a", "b"]


def arch_config(name, **over):
    """A small config of preset `name`'s architecture (2 layers, hidden 256, head_dim 64, vocab 256)."""
    c = load_preset(name)
    fields = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 320, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 512}
    if c.layer_types is not None:
        fields.update(layer_types=c.layer_types[:2], sliding_window=16)
    return c.replace(**{**fields, **over})


GGUF_CASES = {"llama": "tiny", "qwen2": "tiny-qwen2", "qwen3": "qwen3-8b", "phi3": "phi3-mini", "gemma2": "tiny-gemma2",
              "gemma3": "gemma3-12b-text"}


@pytest.mark.parametrize("arch", list(GGUF_CASES))
def test_gguf_names_are_llama_cpps(arch):
    """Every tensor name of each architecture maps to the name gguf-py's tensor map (llama.cpp's
    converter) gives it, and back."""
    from helpers import gguf_name

    from cuinfer.io.checkpoint import expected_tensors

    config = arch_config(GGUF_CASES[arch], tie_word_embeddings=arch == "gemma2")  # llama.cpp: no Gemma 2 lm_head
    assert config.arch.gguf_arch == arch
    for name in expected_tensors(config):
        assert cg.hf_name(gguf_name(name, arch, 2), config.arch) == name


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3"])
def test_other_architectures_round_trip(tmp_path, arch):
    """Qwen2 (biases), Qwen3 (q/k norms, head_dim), Phi-3 (fused q/k/v and gate/up, a window): no Q/K
    permutation, every tensor back exactly, the config as written."""
    config = arch_config(GGUF_CASES[arch], head_dim=48 if arch == "qwen3" else 64)
    tensors = random_tensors(config, "float32")
    write_gguf(tmp_path / "m.gguf", config, tensors, arch=arch, types={n: "F32" for n in tensors})
    got_config, got = load_checkpoint(cg.convert_gguf(tmp_path / "m.gguf", tmp_path / "out"))
    assert got_config == config.replace(torch_dtype="float32", rms_norm_eps=got_config.rms_norm_eps,
                                        bos_token_id=1, eos_token_id=(2,),
                                        layer_types=None if config.sliding_window is None else ("sliding_attention",) * 2)
    for name in tensors:
        np.testing.assert_array_equal(got[name], tensors[name], err_msg=name)


@pytest.mark.parametrize("change, message", [
    (dict(arch="gemma"), "GGUF architecture 'gemma' is not supported"),
    (dict(types={"model.layers.0.mlp.up_proj.weight": "Q4_K"}), "blk.0.ffn_up.weight has GGUF type Q4_K"),
    (dict(tokenizer_model="t5"), "GGUF tokenizer model 't5' is not supported"),
    (dict(pre="deepseek-coder"), "GGUF pre-tokenizer 'deepseek-coder' is not supported"),
])
def test_refusals(tmp_path, change, message):
    config = small_config()
    write_gguf(tmp_path / "m.gguf", config, random_tensors(config, "float32"), **change)
    with pytest.raises(CuinferError, match=message):
        cg.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_unreadable_files(tmp_path):
    with pytest.raises(CuinferError, match="no such file"):
        cg.convert_gguf(tmp_path / "none.gguf", tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CuinferError, match="not a readable GGUF file"):
        cg.convert_gguf(tmp_path / "junk.gguf", tmp_path / "out")
    config = small_config()
    write_gguf(tmp_path / "m.gguf", config, random_tensors(config, "float32"))
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "m.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(CuinferError, match="not a readable GGUF file"):
        cg.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_tensor_name():
    assert cg.hf_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    with pytest.raises(CuinferError, match="unknown GGUF tensor 'blk.0.attn_qkv.weight'"):
        cg.hf_name("blk.0.attn_qkv.weight")


def test_commands_take_a_gguf_file(tmp_path, monkeypatch, capsys):
    """generate (and every command that takes a checkpoint) accepts a GGUF file: converted once into
    the cache, said on stderr, reused while the file is unchanged."""
    from cuinfer import generate

    monkeypatch.setenv("CUINFER_CACHE", str(tmp_path / "cache"))
    config = small_config()
    write_gguf(tmp_path / "m.gguf", config, random_tensors(config, "float32"))
    argv = [str(tmp_path / "m.gguf"), "--prompt", "the", "--max-new-tokens", "3", "--device", "cpu"]
    assert generate.main(argv) == 0
    assert "converting" in capsys.readouterr().err
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 1
    assert generate.main(argv) == 0
    assert "converting" not in capsys.readouterr().err


def spm_gguf(tmp_path, text, vocab_size=600, **train):
    """(SentencePieceProcessor, GGUF path): a BPE model trained on `text` as Llama's was (byte
    fallback, no normalization, spaces kept), written the way llama.cpp writes a "llama" vocabulary."""
    spm = pytest.importorskip("sentencepiece")
    gguf = pytest.importorskip("gguf")
    (tmp_path / "corpus.txt").write_text(text)
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"),
                                   model_type="bpe", vocab_size=vocab_size, byte_fallback=True,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   character_coverage=1.0, minloglevel=2, **train)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    n = sp.get_piece_size()
    types = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_context_length(512)
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    if not train.get("add_dummy_prefix", True):
        w.add_add_space_prefix(False)  # as llama.cpp writes Gemma's
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sp, tmp_path / "t.gguf"


@pytest.mark.parametrize("space_prefix", [True, False])
def test_sentencepiece_tokenizer_equals_sentencepiece(tmp_path, space_prefix):
    """A "llama" (SentencePiece BPE) vocabulary rebuilt from GGUF metadata encodes and decodes every
    string of the corpus as SentencePiece itself does: merges by score, the space prefix (Llama 2,
    Phi-3) or none (Gemma: add_space_prefix false), byte fallback."""
    from tokenizers import Tokenizer as HFTokenizer

    from cuinfer.io.tokenizer import TINY_CORPUS, Tokenizer

    strings = varied_strings()
    sp, path = spm_gguf(tmp_path, "\n".join([TINY_CORPUS] * 4 + strings[::3]), add_dummy_prefix=space_prefix)
    out = tmp_path / "tok"
    out.mkdir()
    cg.tokenizer_files(cg.open_gguf(path), out)
    tok = HFTokenizer.from_file(str(out / "tokenizer.json"))
    ours = Tokenizer.from_pretrained(out)
    for s in strings:
        want = sp.encode(s)
        got = tok.encode(s, add_special_tokens=False).ids
        assert got == want, (s, [sp.id_to_piece(i) for i in got], [sp.id_to_piece(i) for i in want])
        assert tok.decode(got) == sp.decode(want), s
        stream = ours.stream(skip_special_tokens=False)  # streamed text: the same, space prefix and all
        assert "".join(stream.push(t) for t in got) + stream.flush() == sp.decode(want), s


# ------------------------------------------------- GGUF files of transformers checkpoints
SLIDING, FULL = "sliding_attention", "full_attention"
# test_architectures case -> (GGUF architecture, config changes under which llama.cpp's fixed rules
# hold: Gemma's attention scale head_dim^-1/2 and its windowed layers; a 6-layer Gemma 3 has a full one)
LLAMA_CPP_CASES = {
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    "phi3-window": ("phi3", {}),
    "phi3-longrope": ("phi3", {"original_max_position_embeddings": 32, "max_position_embeddings": 128}),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}),
    "gemma3": ("gemma3", {"query_pre_attn_scalar": 16, "num_hidden_layers": 6, "layer_types": [SLIDING] * 5 + [FULL]}),
}


def llama_cpp_metadata(arch, config, hf_config):
    """What llama.cpp's converter (convert_hf_to_gguf.py) writes for the family beyond write_gguf's keys."""
    def extra(w):
        if arch == "gemma2":
            w.add_attn_logit_softcapping(config.attn_logit_softcapping)
            w.add_final_logit_softcapping(config.final_logit_softcapping)
        if arch == "gemma3" and config.rope_scaling:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(config.rope_scaling["factor"])
        if arch == "phi3":
            rope = hf_config.rope_parameters
            w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings") or
                                            hf_config.max_position_embeddings)
            if not config.sliding_window:
                w.add_sliding_window(0)  # the converter's "no window" (Phi-4)
            if rope.get("rope_type") == "longrope":
                w.add_rope_scaling_attn_factors(config.rope_scaling["attention_factor"])
                w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
                w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    return extra


@pytest.mark.parametrize("case", list(LLAMA_CPP_CASES))
def test_llama_cpp_gguf_of_a_transformers_checkpoint(tmp_path, case):
    """A random-weight checkpoint saved by transformers, written as llama.cpp's converter writes it
    (names, Gemma's 1 + w norms, softcaps, windows, linear scaling, Phi-3's fused q/k/v and gate/up and
    longrope factors, Qwen3's q/k norms), imports with the config of the Hugging Face directory, and its
    NumPy logits at every position equal transformers' float32 ones."""
    torch = pytest.importorskip("torch")
    from test_architectures import cuinfer_logits, prompt_ids, save_case

    from cuinfer.model.decoder import Model

    arch, over = LLAMA_CPP_CASES[case]
    path, hf = save_case(case, tmp_path / "hf", vocab_size=256, **over)
    config, tensors = load_checkpoint(path)
    gemma = arch.startswith("gemma")
    write_gguf(tmp_path / "m.gguf", config, tensors, arch=arch, norm_shift=1.0 if gemma else 0.0,
               extra=llama_cpp_metadata(arch, config, hf.config))
    got_config, got = load_checkpoint(cg.convert_gguf(tmp_path / "m.gguf", tmp_path / "out"))
    want = config.replace(torch_dtype="float32", rms_norm_eps=got_config.rms_norm_eps, bos_token_id=1, eos_token_id=(2,))
    if case == "phi3-longrope":  # the factors stored in float32 (as transformers computes with them)
        want = want.replace(rope_scaling={**config.rope_scaling, **{
            k: np.float32(config.rope_scaling[k]).tolist() for k in ("short_factor", "long_factor", "attention_factor")}})
    assert got_config == want
    for name, t in tensors.items():  # Gemma's norms back from 1 + w to within an ulp of 1
        np.testing.assert_allclose(got[name], t, rtol=0, atol=2 ** -23 if gemma and name.endswith("norm.weight") else 0)
    ids = prompt_ids()
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids)).logits.numpy()
    model = Model.from_tensors(got_config, got, "cpu")
    for g, r in zip(cuinfer_logits(model, got_config, ids, 1000), ref):
        err = np.linalg.norm(g - r) / np.linalg.norm(r)
        assert err < 2e-6, f"relative L2 error {err:.2e}"


@pytest.mark.parametrize("arch, layers, hidden, heads, head_dim, scalar", [
    ("Gemma2ForCausalLM", 26, 2304, 8, 256, 256), ("Gemma2ForCausalLM", 46, 4608, 32, 128, 144),
    ("Gemma3ForCausalLM", 34, 2560, 8, 256, 256), ("Gemma3ForCausalLM", 62, 5376, 32, 128, 168)])
def test_gemma_gguf_rules_of_llama_cpp(arch, layers, hidden, heads, head_dim, scalar):
    """What llama.cpp does not store: query_pre_attn_scalar (the 27B models': hidden / heads, as their
    configs say; else head_dim), the windowed layers (Gemma 2 every other from 0, Gemma 3 five of six),
    Gemma 3's local RoPE base; a stored sliding_window_pattern (bools per layer) wins."""
    from cuinfer.model.arch import ARCHES

    meta = {"attention.sliding_window": 4096, "attn_logit_softcapping": 50.0}
    get = lambda key, default=None: meta.get(key, default)
    f = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "head_dim": head_dim}
    got = ARCHES[arch].gguf_read(get, lambda name: None, f)
    assert got["query_pre_attn_scalar"] == scalar and got["sliding_window"] == 4096
    assert got["attn_logit_softcapping"] == 50.0 and got["final_logit_softcapping"] is None
    full = [i for i, t in enumerate(got["layer_types"]) if t == "full_attention"]
    assert full == (list(range(1, layers, 2)) if "Gemma2" in arch else list(range(5, layers, 6)))
    assert got.get("rope_local_base_freq", 10000.0) == 10000.0
    meta["attention.sliding_window_pattern"] = [i % 3 != 2 for i in range(layers)]
    got = ARCHES[arch].gguf_read(get, lambda name: None, f)
    assert [i for i, t in enumerate(got["layer_types"]) if t == "full_attention"] == list(range(2, layers, 3))
