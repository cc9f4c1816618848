"""--kv-cache-dtype / kv_cache_dtype: "auto" (the model's dtype) or "fp8" (E4M3 codes in uint8,
cuinfer/ops/fp8.py) reaches every cache (the engine's, a draft model's, the benches' and eval's);
a bad name is one message; an fp8 cache gives logits close to the float cache's, and exactly those
of a float cache whose entries are rounded to E4M3 (the CPU backend, a tiny random checkpoint)."""
import argparse
import subprocess
import sys

import numpy as np
import pytest
from helpers import make_tiny_checkpoint

from cuinfer import generate
from cuinfer.errors import CuinferError
from cuinfer.model.kv_cache import KVCache, kv_cache_dtype_for
from cuinfer.model.step_inputs import Batch
from cuinfer.ops import fp8
from cuinfer.serving.engine import Engine
from cuinfer.serving.sampling import SamplingParams

KV_TOKENS = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("kvdtype"))


@pytest.fixture(scope="module")
def engines(ckpt):
    """{"auto": Engine, "fp8": Engine} of the tiny checkpoint on the CPU (float32 model)."""
    return {name: Engine.from_pretrained(ckpt, device="cpu", kv_tokens=KV_TOKENS, kv_cache_dtype=name)
            for name in ("auto", "fp8")}


def test_kv_cache_dtype_reaches_the_cache(engines):
    auto, f8 = engines["auto"].kv_cache, engines["fp8"].kv_cache
    assert auto.dtype == engines["auto"].model.dtype == np.float32
    assert f8.dtype == fp8.FP8 == np.uint8 and f8.k.dtype == f8.v.dtype == np.uint8
    assert f8.num_blocks == auto.num_blocks and f8.token_bytes * 4 == auto.token_bytes  # 1 byte vs float32's 4
    assert kv_cache_dtype_for("fp8_e4m3", np.float16) == np.uint8
    assert kv_cache_dtype_for("auto", np.float16) == np.float16


@pytest.mark.parametrize("name", ["fp16", "FP8", "", None])
def test_a_bad_kv_cache_dtype_is_one_message_before_anything_loads(name):
    with pytest.raises(CuinferError, match="kv cache dtype: got .*, need 'auto' or 'fp8'"):
        Engine.from_pretrained("/nonexistent/checkpoint", device="cpu", kv_cache_dtype=name)


def test_the_draft_models_cache_follows_the_targets(ckpt):
    for name, dtype in (("fp8", np.uint8), ("auto", np.float32)):
        eng = Engine.from_pretrained(ckpt, device="cpu", kv_tokens=KV_TOKENS, kv_cache_dtype=name,
                                     speculative_model=ckpt)
        draft = eng.spec.proposer.cache
        assert draft.dtype == eng.kv_cache.dtype == dtype and draft.num_blocks == eng.kv_cache.num_blocks


def prefill_and_decode(model, cache, prompt_len=40, steps=6, seed=0):
    """float32 logits [1 + steps, vocab]: the last prompt token's (one prefill chunk, through
    flash_attention_paged), then those of `steps` greedy decode steps (paged_attention)."""
    prompt = np.random.default_rng(seed).integers(0, model.config.vocab_size, prompt_len).tolist()
    table = list(range(-(-(prompt_len + steps) // cache.block_size)))
    rows = [model.forward(Batch.from_chunks([(prompt, 0, table)], cache.block_size), cache)]
    for j in range(steps):
        token = int(rows[-1].argmax())
        rows.append(model.forward(Batch.from_chunks([([token], prompt_len + j, table)], cache.block_size), cache))
    return np.concatenate(rows)


def fresh_cache(engine, blocks=4):
    c = engine.kv_cache
    return KVCache(c.shape, blocks, c.dtype)


def test_fp8_cache_logits_are_close_to_the_float_caches(engines, monkeypatch):
    model = engines["auto"].model
    ref = prefill_and_decode(model, fresh_cache(engines["auto"]))
    got = prefill_and_decode(engines["fp8"].model, fresh_cache(engines["fp8"]))
    diff = np.abs(got - ref).max(axis=1)
    spread = ref.std(axis=1)
    # The cache really is fp8: E4M3 keeps 3 mantissa bits (relative rounding up to 2^-4), so the logits move.
    assert (diff > 0).all()
    # Measured on this checkpoint (seed 0, 40-token prompt, 6 decode steps; K/V entries up to ~4 in
    # magnitude): max |fp8 - float| per row 0.95-1.11 against a logit std of ~16.2, i.e. 0.059-0.069
    # of the std (0.127-0.149 over prompt seeds 0-5 when the rows of every prompt position count,
    # the first positions the worst). Bound: 0.15 of the std, ~2x the measured value here.
    assert (diff <= 0.15 * spread).all(), diff / spread
    # Greedy tokens agree: the top-1 margin here is >3 stds, far past what the rounding moves.
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).all()

    # Exactly the float cache rounded to E4M3: attention over an fp8 cache computes with
    # decode_e4m3(codes), and write_kv encodes x.astype(model dtype).
    write_kv = type(model).write_kv

    def rounded_write(i, q, k, v, positions, k_cache, v_cache, slots, freqs, out):
        q = write_kv(model, i, q, k, v, positions, k_cache, v_cache, slots, freqs, out)
        for c in (k_cache, v_cache):  # every entry, earlier ones included: rounding twice changes nothing
            c[...] = fp8.decode_e4m3(fp8.encode_e4m3(c))
        return q

    monkeypatch.setattr(model, "write_kv", rounded_write)
    emulated = prefill_and_decode(model, fresh_cache(engines["auto"]))
    np.testing.assert_allclose(got, emulated, atol=1e-4 * float(spread.max()), rtol=1e-5)


def test_fp8_engine_generates_the_float_engines_greedy_tokens(engines):
    prompts = ["Hello there", "The quick brown fox jumps over", "1 2 3 4 5 6 7"]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    outs = {name: [o.token_ids for o in eng.generate(prompts, params)] for name, eng in engines.items()}
    same = sum(a == b for x, y in zip(outs["auto"], outs["fp8"]) for a, b in zip(x, y))
    assert same >= 0.9 * 8 * len(prompts), outs  # measured: all 24 equal


def test_eval_perplexity_with_an_fp8_cache(engines, ckpt, tmp_path, capsys):
    from cuinfer import eval as cuinfer_eval

    model, tok = engines["auto"].model, engines["auto"].tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 6)
    auto, n = cuinfer_eval.perplexity(model, ids, 32, 16)
    f8, n8 = cuinfer_eval.perplexity(model, ids, 32, 16, kv_cache_dtype="fp8")
    # Measured: log-perplexity 168.0 (random weights: logits of std ~16) moves by 0.156 nats a token.
    assert n == n8 and f8 != auto and abs(np.log(f8) - np.log(auto)) < 0.5
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    assert cuinfer_eval.main(["perplexity", str(ckpt), "--text", str(text), "--window", "32", "--stride", "16",
                              "--device", "cpu", "--kv-cache-dtype", "fp8"]) == 0
    assert "kv cache fp8" in capsys.readouterr().out


def test_generate_cli_with_an_fp8_cache(ckpt, capsys):
    argv = [str(ckpt), "--prompt", "Hello", "--max-new-tokens", "8", "--device", "cpu", "--kv-tokens", "512"]
    texts = []
    for flags in ([], ["--kv-cache-dtype", "auto"], ["--kv-cache-dtype", "fp8"]):
        assert generate.main(argv + flags) == 0
        out, err = capsys.readouterr()
        assert "8 generated" in err
        texts.append(out)
    assert texts[0] == texts[1] == texts[2]  # greedy, margins far past fp8's rounding (see above)


def test_serve_passes_the_kv_cache_dtype_to_the_engine(ckpt, monkeypatch, capsys):
    pytest.importorskip("uvicorn")
    from cuinfer import serve
    from cuinfer.serving.async_engine import AsyncEngine

    seen = {}

    def start(path, **engine_args):
        seen.update(engine_args)
        raise CuinferError("stopped here by the test")

    monkeypatch.setattr(AsyncEngine, "start", staticmethod(start))
    for flags, want in (([], "auto"), (["--kv-cache-dtype", "fp8"], "fp8")):
        assert serve.main([str(ckpt), "--device", "cpu", "--port", "0", *flags]) == 2
        assert seen["kv_cache_dtype"] == want and "stopped here by the test" in capsys.readouterr().err


def test_bench_flags_reach_their_caches(engines):
    from cuinfer.benches import decode, serve

    for module in (decode, serve):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        assert p.parse_args([]).kv_cache_dtype == "auto"
        assert p.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    # bench decode's engine on the CPU backend (its cache is sized from the shapes, not free GPU memory)
    args = argparse.Namespace(prompt_len=8, new_tokens=8, sync_decode=True, kv_cache_dtype="fp8")
    eng = decode.make_engine(np, engines["auto"].model, 2, args, use_graphs=False)
    assert eng.kv_cache.dtype == np.uint8


@pytest.mark.parametrize("argv", [
    ["cuinfer.generate", "CKPT", "--prompt", "a"],
    ["cuinfer.serve", "CKPT"],
    ["cuinfer.eval", "perplexity", "CKPT", "--text", "t.txt"],
    ["cuinfer.bench", "decode"],
    ["cuinfer.bench", "serve"],
])
def test_a_bad_kv_cache_dtype_flag_is_an_argparse_error(ckpt, argv):
    """Refused while parsing, before any model loads (or any GPU is looked for)."""
    argv = [str(ckpt) if a == "CKPT" else a for a in argv]
    r = subprocess.run([sys.executable, "-m", *argv, "--kv-cache-dtype", "fp16"], check=False, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "argument --kv-cache-dtype: invalid choice: 'fp16'" in r.stderr, r.stderr
