"""Speculative decoding: tok/s with and without it, acceptance, and the cost of a verify step.

A checkpoint (default: the default model) in --dtype, greedy, up to --new-tokens per prompt, each
answer ending at the model's end token (--ignore-eos: always --new-tokens; the tokens past the answer
are the model's continuation of its own end, no longer grounded in the prompt). Rows:
- "grounded b=B <method>": the input-grounded prompts of benches/spec_prompts.json (repeat,
  summarize or edit a given passage, in the chat template) through one Engine with max_num_seqs=B
  (continuous batching at B), for the methods plain, ngram and draft (the --draft checkpoint, or the
  target quantized to --draft-quant at load, e.g. its int4 copy), the last two at each --k; "draft
  always" is the draft with Speculator.adaptive off (every step verifies: its acceptance and raw
  cost, where the adaptive rows may turn a slow draft off). Each engine runs the set once to
  warm up (graphs captured), then --repeat times timed (the fastest pass is reported). ms: wall milliseconds per generated token, prefill
  included; peer_ms: plain's at the same B, so speedup = tok/s over plain decoding, measured in the
  same run. The shape column gives that tok/s, the decode phase's (tokens of decode and verify steps
  over their time, without the prompts' prefill steps) and its speedup over plain's, draft tokens
  accepted of proposed, the mean accepted length (tokens a sequence gains per verify step) and how
  many outputs equal plain decoding's.
- "open b=1 <method>": the open-ended prompts of the same file: the slowdown where drafts rarely hit
  (backoff turns speculation off per sequence).
- "verify k=K <model>": GPU ms of one greedy verify step of K drafts plus one token (Verifier: a
  CUDA graph of the decode kernels over K + 1 rows, ending in the argmax) at batch 1 and a 512-token context, against a plain greedy decode step (DecodeGraph) of
  the same model and context (peer_ms); for the target and for --verify-preset (random weights,
  default llama3-8b; "none" to skip). Its shape column gives the cost ratio and the speedup the
  acceptance measured at batch 1 with ngram would give at that cost: (1 + accepted per verify row)
  / (ratio at k), with the plain decode steps between verify steps left out.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from .. import bench
from ..cli import int_in
from ..model.decoder import Model
from ..model.kv_cache import CacheShape, KVCache
from ..ops import runtime
from ..serving.engine import Engine
from ..serving.runner import DecodeGraph
from ..serving.sampling import SamplingParams
from ..serving.verify import Verifier

PROMPTS = Path(__file__).with_name("spec_prompts.json")
VERIFY_CONTEXT = 512


def add_arguments(parser):
    parser.add_argument("--checkpoint", help="the target checkpoint (default: the default model)")
    parser.add_argument("--draft", help="a draft checkpoint (default: the target quantized to --draft-quant)")
    parser.add_argument("--draft-quant", default="int4", help="the draft made from the target at load; none: no draft")
    parser.add_argument("--batch", default="1,4,16", help="batch sizes (max_num_seqs), comma-separated")
    parser.add_argument("--k", default="4", help="num_speculative_tokens, comma-separated: rows for each")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--ignore-eos", action="store_true", help="generate --new-tokens past the end token")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--repeat", type=int_in(1, 100), default=3, help="timed passes a row; the fastest is reported")
    parser.add_argument("--verify-preset", default="llama3-8b", help="a models/*.json preset for the verify rows; none")


def load_prompts(tokenizer) -> dict:
    sets = json.loads(PROMPTS.read_text(encoding="utf-8"))
    return {name: [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in ps] for name, ps in sets.items()}


def engine_for(model, tok, speculative, k, max_num_seqs, kv_tokens) -> Engine:
    cfg = model.config
    shape = CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    cache = KVCache.allocate(shape, model.dtype, model.xp, kv_tokens)
    return Engine(model, cache, tok, tok.eos_token_ids, max_batch_tokens=2048, max_num_seqs=max_num_seqs,
                  speculative=speculative, num_speculative_tokens=k)


def timed(engine, prompts, params, repeat: int):
    """(wall seconds, outputs, stats) of the fastest of `repeat` identical generate calls after one
    that warms up: at batch 1 a SmolLM2 step is ~0.6 ms and single passes spread by up to 10 %."""
    engine.generate(prompts, params)
    best = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        secs = time.perf_counter() - t0
        if best is None or secs < best[0]:
            best = (secs, outs, engine.stats)
    return best


def generation_rows(model, tok, draft, args, batches) -> tuple:
    """(rows, ngram's accepted drafts per verify row at batch 1) over the prompt sets."""
    sets = load_prompts(tok)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=args.ignore_eos)
    ks = [int(k) for k in str(args.k).split(",")]
    methods = [("plain", None, 0, True)] + [(f"{m} k={k}", spec, k, adaptive) for k in ks for m, spec, adaptive in
                                            (("ngram", "ngram", True), ("draft", draft, True),
                                             ("draft always", draft, False)) if spec is not None]
    kv_tokens = max(batches) * (max(len(p) for s in sets.values() for p in s) + args.new_tokens + 64)
    rows, gain = [], 0.0
    for name, prompts, bs in (("grounded", sets["grounded"], batches), ("open", sets["open"], [1])):
        for b in bs:
            base = None
            for method, speculative, k, adaptive in methods:
                eng = engine_for(model, tok, speculative, k or 1, b, kv_tokens)
                if speculative is not None:
                    eng.spec.adaptive = adaptive
                secs, outs, st = timed(eng, prompts, params, args.repeat)
                n = sum(len(o.token_ids) for o in outs)
                ms = 1000 * secs / n
                decode_tok_s = st.decode_tokens / st.decode_s
                if base is None:
                    base = (ms, [o.token_ids for o in outs], decode_tok_s)
                same = sum(o.token_ids == t for o, t in zip(outs, base[1]))
                detail = (f"{n / secs:.0f} tok/s · decode {decode_tok_s:.0f} tok/s "
                          f"({decode_tok_s / base[2]:.2f}x plain's)")
                if speculative is not None:
                    detail += (f" · accepted {st.accepted_tokens}/{st.draft_tokens} · mean accepted length "
                               f"{st.mean_accepted_length:.2f} · same as plain {same}/{len(outs)}")
                    if (name, b, method) == ("grounded", 1, f"ngram k={ks[0]}") and st.verify_rows:
                        gain = st.accepted_tokens / st.verify_rows
                rows.append({"name": f"{name} b={b} {method}", "shape": detail, "dtype": str(model.dtype),
                             "ms": ms, "peer": "plain", "peer_ms": base[0]})
                del eng
    return rows, gain


def verify_rows(cp, model, label, k_max, gain) -> list:
    """GPU ms of a verify step of k = 1..k_max drafts against a plain greedy decode step, batch 1."""
    cfg = model.config
    bs = 16
    n_blocks = -(-(VERIFY_CONTEXT + k_max + 1) // bs)
    cache = KVCache.allocate(CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, bs),
                             model.dtype, cp, (n_blocks + 1) * bs)
    table = list(range(n_blocks))
    decoder = DecodeGraph(model, cache, n_blocks)
    decode_ms = bench.time_ms(lambda: decoder.run([1], [VERIFY_CONTEXT], [table], True), warmup=3, iters=20)
    verifier = Verifier(model, cache)
    rows = []
    for k in range(1, k_max + 1):
        chunks = [([1] * (k + 1), VERIFY_CONTEXT, table)]
        ms = bench.time_ms(lambda: verifier.run(chunks, greedy=True), warmup=3, iters=20)
        ratio = ms / decode_ms
        rows.append({"name": f"verify k={k} {label}", "shape": f"{ratio:.2f}x a decode step · "
                     f"ngram's acceptance would give {(1 + min(gain, k)) / ratio:.2f}x", "dtype": str(model.dtype),
                     "ms": ms, "peer": "decode step", "peer_ms": decode_ms})
    return rows


def run(args):
    from ..convert import load_preset
    from ..io.checkpoint import load_checkpoint, resolve_checkpoint
    from ..io.tokenizer import Tokenizer
    from .decode import random_weights

    cp = runtime.require_cupy()
    dtype = runtime.bfloat16 if args.dtype == "bfloat16" else np.dtype(np.float16)
    batches = [int(b) for b in args.batch.split(",")]
    path = resolve_checkpoint(args.checkpoint)
    config, tensors = load_checkpoint(path)
    model = Model.from_tensors(config, tensors, "gpu", dtype)
    if args.draft:
        dcfg, dtensors = load_checkpoint(resolve_checkpoint(args.draft))
        draft = Model.from_tensors(dcfg, dtensors, "gpu", dtype)
    else:
        draft = None if args.draft_quant == "none" else Model.from_tensors(config, tensors, "gpu", dtype,
                                                                           args.draft_quant)
    del tensors
    rows, gain = generation_rows(model, Tokenizer.from_pretrained(path), draft, args, batches)
    rows += verify_rows(cp, model, path.name, 8, gain)
    if args.verify_preset != "none":
        big = load_preset(args.verify_preset)
        rows += verify_rows(cp, Model(big, random_weights(cp, big, dtype)), args.verify_preset, 8, gain)
    return rows
