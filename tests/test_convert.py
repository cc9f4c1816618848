"""python -m cuinfer.convert: random checkpoints, GGUF files, and bad input ending in one message."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import write_gguf

from cuinfer.convert import RandomTensors, load_preset, main, random_checkpoint, random_tensors
from cuinfer.io.checkpoint import load_checkpoint
from cuinfer.io.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent


def test_random_cli_round_trips(tmp_path, capsys):
    assert main(["--random", "tiny-qwen2", str(tmp_path / "r"), "--dtype", "bfloat16", "--seed", "5"]) == 0
    assert "wrote" in capsys.readouterr().out
    config, tensors = load_checkpoint(tmp_path / "r")
    ref = random_tensors(config, "bfloat16", seed=5)
    assert config.torch_dtype == "bfloat16" and config.attention_bias
    for n in ref:
        assert np.array_equal(tensors[n].view(np.uint16), ref[n].view(np.uint16)), n
    Tokenizer.from_pretrained(tmp_path / "r").encode("tokenizer files are there")


def test_random_weights_have_realistic_scale():
    config = load_preset("tiny")
    t = RandomTensors(config, "float32", seed=0)
    assert abs(t["model.layers.0.mlp.down_proj.weight"].std() * 688 ** 0.5 - 1) < 0.02
    assert abs(t["model.embed_tokens.weight"].std() - 1) < 0.01
    norm = t["model.layers.1.input_layernorm.weight"]
    assert abs(norm.mean() - 1) < 0.01 and norm.std() < 0.1
    # a tensor does not depend on which others were made, or in what order
    assert np.array_equal(RandomTensors(config, "float32", 0)["model.norm.weight"], t["model.norm.weight"])
    assert not np.array_equal(RandomTensors(config, "float32", 1)["model.norm.weight"], t["model.norm.weight"])
    with pytest.raises(KeyError):
        t["lm_head.weight"]  # tied


def test_offline_tokenizer_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("CUINFER_CACHE", str(tmp_path / "empty-cache"))
    path = random_checkpoint("tiny", tmp_path / "t")
    tok = Tokenizer.from_pretrained(path)
    assert tok.vocab_size <= load_preset("tiny").vocab_size and tok.eos_token_ids == {2}
    assert tok.decode(tok.encode("héllo 🤗")) == "héllo 🤗"


def run_cli(*args):
    r = subprocess.run([sys.executable, "-m", "cuinfer.convert", *map(str, args)], cwd=ROOT,
                       capture_output=True, text=True)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def test_cli_exit_code_and_message(tmp_path):
    r = run_cli(tmp_path / "missing.gguf", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "missing.gguf: no such file" in r.stderr
    assert not (tmp_path / "out").exists()


def test_cli_bad_seed_is_refused_while_parsing(tmp_path):
    r = run_cli("--random", "tiny", tmp_path / "out", "--seed", "-1")  # NumPy's generator raised ValueError
    assert r.returncode == 2 and "argument --seed: got '-1', need an integer >= 0" in r.stderr
    assert not (tmp_path / "out").exists()


def small_gguf(path, **change):
    config = load_preset("tiny").replace(vocab_size=256)
    write_gguf(path, config, random_tensors(config, "float32"), **change)
    return path


@pytest.mark.parametrize("case, message", [
    ("wrong-arch", "GGUF architecture 'gemma' is not supported"),
    ("wrong-type", "has GGUF type Q4_K"),
    ("truncated", "not a readable GGUF file"),
    ("not-gguf", "not a readable GGUF file"),
    ("unwritable", "cannot write here"),
    ("exists", "already exists"),
    ("unknown-preset", "unknown preset 'llama9'"),
])
def test_bad_input_is_one_message(tmp_path, capsys, case, message):
    src, out, extra = tmp_path / "m.gguf", tmp_path / "out", []
    if case == "wrong-arch":
        small_gguf(src, arch="gemma")
    elif case == "wrong-type":
        small_gguf(src, types={"model.layers.1.mlp.gate_proj.weight": "Q4_K"})
    elif case == "truncated":
        data = small_gguf(src).read_bytes()
        src.write_bytes(data[: len(data) - 4096])
    elif case == "not-gguf":
        src.write_bytes(b"\0" * 4096)
    elif case == "unwritable":
        small_gguf(src)
        (tmp_path / "a-file").write_text("")
        out = tmp_path / "a-file" / "out"
    elif case == "exists":
        small_gguf(src)
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif case == "unknown-preset":
        src, extra = "llama9", ["--random"]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main([str(src), str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing half-written
    if case == "exists":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_gguf_cli_converts(tmp_path, capsys):
    assert main([str(small_gguf(tmp_path / "m.gguf")), str(tmp_path / "out")]) == 0
    config, tensors = load_checkpoint(tmp_path / "out")
    assert config.torch_dtype == "float32" and len(tensors) == 2 * 9 + 2
