"""Quantized checkpoints: python -m cuinfer.quantize writes them, load_checkpoint reads them, and the
saved model computes what quantizing the float checkpoint at load computes, bit for bit (CPU)."""
import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open
from test_checkpoint import rewrite
from test_model import GPU_LOGIT_REL_L2, make_cache, prompts, run_chunks

from cuinfer import eval as cuinfer_eval
from cuinfer import generate
from cuinfer.convert import RandomTensors, load_preset
from cuinfer.io import quant_io
from cuinfer.io.checkpoint import expected_tensors, load_checkpoint, save_checkpoint
from cuinfer.io.config import ModelConfig, load_config
from cuinfer.io.tokenizer import write_tiny_tokenizer
from cuinfer.model.decoder import LM_HEAD_QUANT, Model
from cuinfer.model.gptq import gptq_model
from cuinfer.ops import quant, runtime
from cuinfer.ops.runtime import CuinferError
from cuinfer.quantize import main as quantize_main
from cuinfer.quantize import quantize_checkpoint

# The tiny presets with an MLP width every int4 group divides (688 has none) and the tiny tokenizer's vocabulary:
# "tied" is llama (tied embeddings, fp16), "qwen2" has q/k/v bias, an lm_head and bf16 weights, "phi3"
# stores q/k/v and gate/up as one module each, "gemma2" has four (1 + w) norms a layer and softcaps.
CASES = {name: load_preset(preset).replace(intermediate_size=640, vocab_size=512) for name, preset in
         (("tied", "tiny"), ("qwen2", "tiny-qwen2"), ("phi3", "tiny-phi3"), ("gemma2", "tiny-gemma2"))}
RTN_SPECS = ["int8", "int4", "int4-g32"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory, tokenizer_dir):
    """case name -> a float checkpoint directory with random weights."""
    root = tmp_path_factory.mktemp("float")
    return {name: save_checkpoint(root / name, cfg, RandomTensors(cfg, cfg.torch_dtype), tokenizer_dir)
            for name, cfg in CASES.items()}


@pytest.fixture(scope="module")
def int4_ckpt(float_ckpt, tmp_path_factory):
    return quantize_checkpoint(float_ckpt["tied"], tmp_path_factory.mktemp("q") / "int4", "int4")


def logits(model):
    """All-position logits of two sequences, in chunks of 16 (prefill chunks over the paged cache)."""
    seqs = list(zip([[0, 1, 2], [3, 4]], prompts(model.config, [40, 21])))
    return np.concatenate(run_chunks(model, make_cache(model.config, model), seqs, 16))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("spec", RTN_SPECS)
def test_saved_model_equals_quantize_at_load(float_ckpt, tmp_path, case, spec):
    src = float_ckpt[case]
    dst = quantize_checkpoint(src, tmp_path / "q", spec)
    config, tensors = load_checkpoint(dst)
    method, group_size, _ = quant.parse_spec(spec)
    kind = quant.Int8Weight if method == "int8" else quant.Int4Weight
    for name, w in tensors.items():
        if quant_io.is_quantized(name, config.quantization):
            assert isinstance(w, quant.Int8Weight if name == "lm_head.weight" else kind), name
            assert getattr(w, "group_size", group_size) == group_size
        else:
            assert isinstance(w, np.ndarray) and w.dtype == config.dtype, name
    assert "lm_head.weight" in tensors  # an int8 copy even when the embeddings are tied
    float_config, float_tensors = load_checkpoint(src)
    want = logits(Model.from_tensors(float_config, float_tensors, "cpu", quant=spec))
    np.testing.assert_array_equal(logits(Model.from_tensors(config, tensors, "cpu")), want)


def test_gptq_checkpoint_equals_the_in_memory_model(float_ckpt, tmp_path):
    src = float_ckpt["qwen2"]
    calib = np.random.default_rng(3).integers(0, CASES["qwen2"].vocab_size, 2 * 512)
    dst = quantize_checkpoint(src, tmp_path / "gptq", "int4-g64-gptq", calib)
    config, tensors = load_checkpoint(dst)
    assert config.quantization["fit"] == "gptq" and tensors["model.layers.0.mlp.up_proj.weight"].group_size == 64
    want = logits(gptq_model(*load_checkpoint(src), calib, 64, "cpu"))
    np.testing.assert_array_equal(logits(Model.from_tensors(config, tensors, "cpu")), want)


def test_config_and_tensors_round_trip(float_ckpt, int4_ckpt, tmp_path):
    config = load_config(int4_ckpt)
    assert config.quantization == {"method": "int4", "bits": 4, "group_size": 128, "fit": "minmax",
                                   "modules": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                               "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
                                   "lm_head": LM_HEAD_QUANT,
                                   "layout": quant.INT4_LAYOUT}
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert config.replace(quantization=None) == load_config(float_ckpt["tied"])
    assert "quantization" not in json.loads((float_ckpt["tied"] / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (int4_ckpt / name).read_bytes() == (float_ckpt["tied"] / name).read_bytes()
    # the stored tensors: the weight objects' arrays with their names, shapes and dtypes
    with safe_open(str(int4_ckpt / "model.safetensors"), "numpy") as f:
        stored = {n: f.get_tensor(n) for n in f.keys()}
    assert {n: a.shape for n, a in stored.items()} == expected_tensors(config)
    assert stored["model.layers.0.mlp.down_proj.qweight"].dtype == np.uint32
    assert stored["model.layers.0.mlp.down_proj.scales_zeros"].shape == (256 // 16, 640 // 128, 16, 2)
    assert stored["lm_head.qweight"].dtype == np.int8 and stored["lm_head.scales"].dtype == np.float16
    assert "model.layers.0.self_attn.q_proj.weight" not in stored
    # what load_checkpoint returns saves back to the same bytes, in shards too
    again = save_checkpoint(tmp_path / "again", *load_checkpoint(int4_ckpt))
    assert (again / "model.safetensors").read_bytes() == (int4_ckpt / "model.safetensors").read_bytes()
    sharded = save_checkpoint(tmp_path / "sharded", *load_checkpoint(int4_ckpt), shard_bytes=2**18)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, b = load_checkpoint(int4_ckpt)[1], load_checkpoint(sharded)[1]
    for name, w in a.items():
        for n, arr in (quant_io.weight_arrays(name, w) if isinstance(w, quant.QUANTIZED) else {name: w}).items():
            got = quant_io.weight_arrays(name, b[name])[n] if isinstance(w, quant.QUANTIZED) else b[name]
            np.testing.assert_array_equal(got, arr)


def copy_of(src, dst):
    return save_checkpoint(dst, *load_checkpoint(src))


@pytest.mark.parametrize("change, message", [
    (lambda t: {n: a for n, a in t.items() if n != "model.layers.1.self_attn.k_proj.scales_zeros"},
     r"missing tensor model\.layers\.1\.self_attn\.k_proj\.scales_zeros"),
    (lambda t: {**t, "model.layers.0.mlp.gate_proj.scales_zeros": t["model.layers.0.mlp.gate_proj.scales_zeros"][:, :1]},
     r"tensor model\.layers\.0\.mlp\.gate_proj\.scales_zeros has shape \(40, 1, 16, 2\).*needs \(40, 2, 16, 2\)"),
    (lambda t: {**t, "model.layers.0.mlp.up_proj.qweight": t["model.layers.0.mlp.up_proj.qweight"].view(np.int32)},
     r"tensor model\.layers\.0\.mlp\.up_proj\.qweight has dtype I32"),
    (lambda t: {**t, "model.layers.0.mlp.up_proj.qweight": t["model.layers.0.mlp.up_proj.qweight"].view(np.float32)},
     r"tensor model\.layers\.0\.mlp\.up_proj\.qweight has dtype F32, LlamaForCausalLM config needs U32"),
    (lambda t: {**t, "lm_head.qweight": t["lm_head.qweight"].astype(np.float16)},
     r"tensor lm_head\.qweight has dtype F16, .* needs I8"),
    (lambda t: {**t, "model.norm.weight": t["model.norm.weight"].astype(np.int8)},
     r"tensor model\.norm\.weight has dtype I8, .* needs F32 or F16 or BF16"),
    (lambda t: {**t, "model.layers.0.mlp.up_proj.weight": np.zeros((640, 256), np.float16)},
     r"unexpected tensor model\.layers\.0\.mlp\.up_proj\.weight"),
])
def test_corrupt_quantized_tensors(int4_ckpt, tmp_path, change, message):
    path = copy_of(int4_ckpt, tmp_path / "c")
    rewrite(path, change)
    with pytest.raises(CuinferError, match=message):
        load_checkpoint(path)


@pytest.mark.parametrize("change, message", [
    ({"method": "int3"}, r"quantization method 'int3' is not supported: need one of int8, int4"),
    ({"bits": 8}, r"quantization bits 8 for int4: need 4"),
    ({"group_size": 48}, r"quantization group_size 48 for int4: need 32 or 64 or 128"),
    ({"fit": "awq"}, r'quantization fit "awq" for int4: need "mse" or "minmax" or "gptq"'),
    ({"modules": ["self_attn.q_proj"]}, r'quantization modules \["self_attn.q_proj"\] for int4: need \["self_attn'),
    ({"lm_head": None}, r'quantization lm_head null for int4: need "int8"'),
    ({"layout": None}, r'quantization layout null for int4: need "tiles16" \(an int4 checkpoint of an earlier '
                       r'layout: quantize it again'),
    ({"method": "int8", "bits": 8}, r"quantization group_size 128 for int8: need null"),
    ({"zero_point": True}, r"quantization has unknown key 'zero_point'"),
    (None, r"quantization must be an object, got \[\]"),
])
def test_bad_quantization_entry(int4_ckpt, tmp_path, change, message):
    path = copy_of(int4_ckpt, tmp_path / "c")
    d = json.loads((path / "config.json").read_text())
    d["quantization"] = [] if change is None else {**d["quantization"], **change}
    (path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CuinferError, match=message):
        load_checkpoint(path)


def test_hugging_face_quantization_config_is_refused(float_ckpt, tmp_path):
    path = copy_of(float_ckpt["tied"], tmp_path / "c")
    d = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**d, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(CuinferError, match="Hugging Face quantization_config is not supported"):
        load_checkpoint(path)


def test_quantize_errors(float_ckpt, int4_ckpt, tmp_path, capsys):
    config, tensors = load_checkpoint(int4_ckpt)
    with pytest.raises(CuinferError, match="quantized already .*without --quant"):
        Model.from_tensors(config, tensors, "cpu", quant="int4")
    with pytest.raises(CuinferError, match="quantized already"):
        quantize_checkpoint(int4_ckpt, tmp_path / "twice", "int8")
    with pytest.raises(CuinferError, match="GPTQ quantizes float weights"):
        gptq_model(config, tensors, np.zeros(512, np.int64))
    with pytest.raises(CuinferError, match="needs --calib"):
        quantize_checkpoint(float_ckpt["tied"], tmp_path / "g", "int4-gptq")
    text = tmp_path / "calib.txt"
    text.write_text("calibration text")
    for argv, message in [
        ([str(float_ckpt["tied"]), str(tmp_path / "x"), "--quant", "int4", "--calib", str(text)], "only the -gptq"),
        ([str(float_ckpt["tied"]), str(tmp_path / "x"), "--quant", "int5"], "unknown part|need int8"),
        ([str(float_ckpt["tied"]), str(int4_ckpt), "--quant", "int8"], "already exists"),
        ([str(tmp_path / "nope"), str(tmp_path / "x"), "--quant", "int8"], "no such checkpoint directory"),
        ([str(float_ckpt["tied"]), str(tmp_path / "x"), "--quant", "int4-gptq", "--calib", str(text)],
         "calibration text: .* tokens, need at least 512"),
    ]:
        assert quantize_main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.splitlines()) == 1, err
        assert __import__("re").search(message, err), err
    with pytest.raises(SystemExit) as e:  # refused while parsing (it was a slice: all but the last 5 tokens)
        quantize_main([str(float_ckpt["tied"]), str(tmp_path / "x"), "--quant", "int4-gptq", "--calib", str(text),
                       "--calib-tokens", "-5"])
    assert e.value.code == 2 and "--calib-tokens: got '-5', need an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_tiny_preset_has_no_int4_group(tmp_path, tokenizer_dir):
    cfg = load_preset("tiny").replace(vocab_size=512)
    src = save_checkpoint(tmp_path / "src", cfg, RandomTensors(cfg), tokenizer_dir)
    for spec in ("int4", "int4-gptq"):  # refused before any calibration
        with pytest.raises(CuinferError, match=r"down_proj\.weight: in_features 688 is not a multiple of any int4"):
            quantize_checkpoint(src, tmp_path / "q", spec, np.zeros(512, np.int64))
    assert not (tmp_path / "q").exists()


def test_cli_quantize_then_generate_and_eval(float_ckpt, tmp_path, capsys):
    """python -m cuinfer.quantize, then generate and eval perplexity on the result with no --quant:
    the same greedy text and perplexity as the float checkpoint quantized at load."""
    src, dst = float_ckpt["tied"], tmp_path / "int4-g64"
    done = subprocess.run([sys.executable, "-m", "cuinfer.quantize", str(src), str(dst), "--quant", "int4-g64"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {dst} (int4-g64: ") and "MiB of weights" in done.stdout
    outputs = []
    for argv in ([str(dst)], [str(src), "--quant", "int4-g64"]):
        assert generate.main(argv + ["--prompt", "Hello there", "--max-new-tokens", "6", "--device", "cpu"]) == 0
        outputs.append(capsys.readouterr().out.rsplit("\n[", 1)[0])
    assert outputs[0] == outputs[1]
    assert generate.main([str(dst), "--prompt", "a", "--device", "cpu", "--quant", "int8"]) == 2
    assert "quantized already" in capsys.readouterr().err
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    ppl = []
    for argv in ([str(dst)], [str(src), "--quant", "int4-g64"]):
        assert cuinfer_eval.main(["perplexity", *argv[:1], "--text", str(text), "--device", "cpu", "--window", "64",
                                  "--stride", "32", *argv[1:]]) == 0
        ppl.append(capsys.readouterr().out.splitlines()[-1].split("perplexity ")[1].split(" over")[0])
    assert ppl[0] == ppl[1]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["int8", "int4-g64"])
@pytest.mark.parametrize("dtype", [np.float16, runtime.bfloat16])
def test_gpu_quantized_checkpoint_matches_cpu(float_ckpt, tmp_path, spec, dtype):
    """The saved weights moved to the GPU as they are: logits within the fp16/bf16 activation
    tolerance of the CPU path on the same (identical) quantized weights."""
    config, tensors = load_checkpoint(quantize_checkpoint(float_ckpt["qwen2"], tmp_path / "q", spec))
    ref = logits(Model.from_tensors(config, tensors, "cpu"))
    got = logits(Model.from_tensors(config, tensors, "gpu", dtype))
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    print(f"{spec} {np.dtype(dtype)}: logits relative L2 error {err:.2e}")
    assert np.isfinite(got).all() and err <= GPU_LOGIT_REL_L2[np.dtype(dtype)]
