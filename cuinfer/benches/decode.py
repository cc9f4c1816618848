"""Decode: end-to-end tok/s of the engine (CUDA graphs) against Hugging Face transformers generate.

A preset (random weights built on the GPU, quantized there with --quant) or a checkpoint; b prompts
of --prompt-len random tokens, --new-tokens greedy tokens each (ignore_eos), through Engine.generate
after a warm-up run of the same shape (graphs captured, kernels compiled). Per row: decode tok/s and
ms per step (decode-only steps, Engine.stats: host work included), the GPU time of one graph replay
(replay ms), of the step's linear layers alone (gemv ms: the same linear calls in one graph) and of
its attention calls alone (attn ms, at the final context, Model.decode_attention),
bytes read per step (every weight once, lm_head included, plus the K/V of the mean context),
achieved GB/s and % of the copy bandwidth (bench.copy_gbs), the roofline tok/s (copy bandwidth /
bytes), prefill tok/s of one 2k-token prompt. The peer: transformers AutoModelForCausalLM on the
same config and the same fp16 weights (shared through DLPack), generate greedy with the same
prompts, at batch 1 (its eager generate takes ~0.13 s a step at 8B: larger batches would
not fit the run's time); its decode ms per step is (t(new) - t(1)) / (new - 1). Quantized rows
are compared with the fp16 peer. Batch-1 rows also run the step eagerly (use_graphs=False): eager tok/s and whether
its tokens equal the graph's. A smollm2-135m batch-1 row (the default model) closes a preset run,
and a last row measures the floor of a kernel chain (floor_row). --kv-cache-dtype fp8 runs every
engine with an fp8 (E4M3) KV cache: its rows say "kv fp8" in name and dtype, and their bytes count
the cache's one byte per K/V element.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from .. import bench
from ..cli import add_kv_cache_dtype_argument
from ..model.arch import HEAD_NORMS
from ..model.decoder import GATED_EPILOGUE, LM_HEAD_QUANT, Model, kernel_dtype
from ..model.kv_cache import CacheShape, KVCache, kv_cache_dtype_for
from ..model.step_inputs import Batch, DecodeInputs, slot_mapping
from ..model.weights import LINEAR_FIELDS, LayerWeights, Weights
from ..ops import runtime
from ..ops.linear import linear, linear_argmax
from ..ops.paged_attention import (
    WARPS,
    launch_decode,
    padded_group,
    split_workspace_elems,
)
from ..ops.quant import quantize_spec
from ..serving.engine import Engine
from ..serving.runner import MIN_CONTEXT_BUCKET, batch_bucket, bucket, capture
from ..serving.sampling import SamplingParams

PREFILL_TOKENS = 2048
DEFAULT_MODEL = "smollm2-135m"


def add_arguments(parser):
    parser.add_argument("--preset", default="llama3-8b", help="a models/*.json preset (random weights)")
    parser.add_argument("--checkpoint", help="a checkpoint directory instead of a preset")
    parser.add_argument("--batch", default="1,8,32", help="batch sizes, comma-separated")
    parser.add_argument("--quant", default="none,int8,int4", help="weight formats: none, int8, int4")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    add_kv_cache_dtype_argument(parser)
    parser.add_argument("--no-peer", action="store_true", help="skip transformers generate")
    parser.add_argument("--sync-decode", action="store_true",
                        help="read each step's tokens before the next is launched (Engine async_decode=False)")
    parser.add_argument("--attn-sweep", action="store_true",
                        help="also time the step's attention with other splits, rows in flight and warps")


# ----------------------------------------------------------------------------- weights

def random_weights(cp, config, dtype, seed=0) -> Weights:
    """Random decoder weights made on the GPU, scaled so activations stay O(1) (as convert.py's)."""
    cp.random.seed(seed)
    h, inter = config.hidden_size, config.intermediate_size
    randn = lambda *s: cp.random.standard_normal(s, dtype=cp.float32)
    lin = lambda n, k: (randn(n, k) * np.float32(k ** -0.5)).astype(dtype)
    norm = lambda n=h: (1 + 0.05 * randn(n)).astype(dtype)  # as fused: Gemma's 1 + w
    qkv = config.q_size + 2 * config.kv_size
    bias = lambda: (0.1 * randn(qkv)).astype(dtype) if config.attention_bias else None
    layers = [LayerWeights(qkv=lin(qkv, h), qkv_bias=bias(), o=lin(h, config.q_size), gate_up=lin(2 * inter, h),
                           down=lin(h, inter), **{f: norm(config.head_dim if f in HEAD_NORMS else h)
                                                  for f in config.arch.norms})
              for _ in range(config.num_hidden_layers)]
    embed = randn(config.vocab_size, h).astype(dtype)
    lm_head = embed if config.tie_word_embeddings else lin(config.vocab_size, h)
    return Weights(embed=embed, layers=layers, norm=norm(), lm_head=lm_head)


def quantized(w: Weights, method: str) -> Weights:
    """The weights as Model.from_tensors quantizes them, made on the GPU: the linear layers in
    `method` (quant.quantize_spec: int4 g128 minmax, a smaller group where 128 does not divide K),
    the lm_head in LM_HEAD_QUANT (its own copy when tied); embedding and norms stay in the float dtype."""
    def q(a, method=method):
        qw = quantize_spec(a, method)
        return qw if runtime.is_device_array(qw.qweight) else qw.to_device()

    layers = [dataclasses.replace(lw, **{f: q(getattr(lw, f)) for f in LINEAR_FIELDS}) for lw in w.layers]
    return dataclasses.replace(w, layers=layers, lm_head=q(w.lm_head, LM_HEAD_QUANT))


def weight_bytes(w: Weights) -> int:
    arrays = [w.norm, w.lm_head] + [a for lw in w.layers for a in vars(lw).values() if a is not None]
    return sum(a.nbytes for a in arrays)


# ----------------------------------------------------------------------------- ours

def make_engine(cp, model, batch, args, use_graphs=True):
    cfg = model.config
    shape = CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    per_seq = -(-(args.prompt_len + args.new_tokens + 1) // shape.block_size) * shape.block_size
    cache = KVCache.allocate(shape, kv_cache_dtype_for(args.kv_cache_dtype, model.dtype), cp,
                             batch * per_seq + PREFILL_TOKENS + shape.block_size)
    return Engine(model, cache, max_batch_tokens=max(512, batch * args.prompt_len),
                  max_num_seqs=max(256, batch), use_graphs=use_graphs, async_decode=not args.sync_decode and use_graphs)


def decode_run(engine, prompts, new_tokens):
    """(decode ms per step, tokens per sequence) of one generate call."""
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    s = engine.stats
    return 1000 * s.decode_s / (s.decode_tokens / len(prompts)), [o.token_ids for o in outs]


def largest_greedy_step(engine, batch):
    """The DecodeGraph step of this batch's bucket with the largest context bucket, greedy."""
    steps = [(w, s) for (b, w, g), s in engine.decoder.steps.items() if b == batch_bucket(batch) and g == "greedy"]
    return max(steps, key=lambda ws: ws[0])[1]


def replay_ms(engine, batch):
    """GPU ms of one replay of the largest-context greedy graph of this batch's bucket."""
    return bench.time_ms(largest_greedy_step(engine, batch).graph.launch, warmup=3, iters=20)


def gemv_ms(cp, model, batch):
    """GPU ms of the greedy step's linear layers alone (fused norms, gated activation, residual and
    argmax, as Model.layer calls them; Gemma's output norms not included), replayed from one graph:
    same shapes and weights, random x."""
    cfg, w, eps = model.config, model.weights, model.config.rms_norm_eps
    x = lambda k: cp.random.standard_normal((batch, k), dtype=cp.float32).astype(model.dtype)
    xh, xq, xi = x(cfg.hidden_size), x(cfg.q_size), x(cfg.intermediate_size)
    act = GATED_EPILOGUE[cfg.hidden_act]

    def step():
        for lw in w.layers:
            linear(xh, lw.qkv, lw.qkv_bias, norm=(lw.attn_norm, eps)), linear(xq, lw.o, residual=xh)
            linear(xh, lw.gate_up, activation=act, norm=(lw.mlp_norm, eps)), linear(xi, lw.down, residual=xh)
        return linear_argmax(xh, w.lm_head, norm=model.final_norm)

    cp.cuda.Device().synchronize()
    graph, _, _ = capture(step, cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool())
    return bench.time_ms(graph.launch, warmup=3, iters=20)


def attention_ms(cp, engine, batch, ctx, variant=None):
    """GPU ms of the step's attention calls alone (every layer, each sequence at context ctx, the
    decode step's bound and workspace: Model.decode_attention, RoPE and the new token's K/V write
    fused where the step fuses them), replayed from one graph; variant (n_splits, partition, rows in
    flight, warps): that launch of the plain kernel instead, on a q taken as rotated."""
    model, cache = engine.model, engine.kv_cache
    n_blocks = -(-ctx // cache.block_size)
    blocks = engine.blocks.allocate(batch * n_blocks)
    table = np.asarray(blocks, dtype=np.int32).reshape(batch, n_blocks)
    pos = np.full(batch, ctx - 1, dtype=np.int32)
    slots = slot_mapping(table, np.arange(batch), pos, cache.block_size)
    inputs = DecodeInputs(None, cp.asarray(pos), cp.asarray(slots), cp.asarray(table), cp.asarray(pos + 1))
    qkv = cp.random.standard_normal((batch, (model.n_heads + 2 * model.n_kv_heads) * model.head_dim),
                                    dtype=cp.float32).astype(model.dtype)
    q, k, v = model.split_qkv(qkv)
    freqs = model.step_inv_freq(inputs.context_lens)
    tables, lens, q_rot = inputs.block_tables, inputs.context_lens, cp.ascontiguousarray(q)
    out, bound = cp.empty_like(q_rot), bucket(ctx, MIN_CONTEXT_BUCKET)
    elems = (model.decode_workspace_elems(batch, bound) if variant is None else
             split_workspace_elems(batch, model.n_heads, model.n_kv_heads, model.head_dim, variant[0]))
    ws = cp.zeros(max(1, elems), dtype=np.float32)
    group = padded_group(model.n_heads, model.n_kv_heads)

    def step():
        for i in range(model.config.num_hidden_layers):
            if variant is None:
                model.decode_attention(i, q, k, v, *cache.layer(i), inputs, freqs, bound, ws)
            else:
                n, p, u, w = variant
                launch_decode(q_rot, *cache.layer(i), tables, lens, out, model.head_dim ** -0.5, group, n, p, ws, u,
                              warps=w)

    cp.cuda.Device().synchronize()
    graph, _, _ = capture(step, cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool())
    ms = bench.time_ms(graph.launch, warmup=3, iters=20)
    engine.blocks.free(blocks)
    return ms


def attention_sweep(cp, engine, batch, ctx):
    """Print attention_ms for partitions of 32-512 tokens (the splits covering the step's context
    bucket), 4 or 8 rows in flight and every warp count the group allows."""
    model = engine.model
    bound = bucket(ctx, MIN_CONTEXT_BUCKET)
    group = padded_group(model.n_heads, model.n_kv_heads)
    for p in (32, 64, 128, 256, 512):
        for u in (4, 8):
            for w in WARPS if group <= 4 else (4,):
                ms = attention_ms(cp, engine, batch, ctx, (-(-bound // p), p, u, w))
                print(f"|   attention {-(-bound // p)}x{p} U={u} W={w} | {ms:.4f} ms |", flush=True)


def prefill_tok_s(cp, engine):
    """tok/s of Model.forward over one 2k-token prompt (eager: prefill is compute-bound)."""
    alloc, bs = engine.blocks, engine.kv_cache.block_size
    blocks = alloc.allocate(PREFILL_TOKENS // bs)
    ids = np.random.default_rng(1).integers(0, engine.model.config.vocab_size, PREFILL_TOKENS)
    batch = Batch.from_chunks([(ids, 0, blocks)], bs).to(cp)
    ms = bench.time_ms(lambda: engine.model.forward(batch, engine.kv_cache), warmup=1, iters=3)
    alloc.free(blocks)
    return PREFILL_TOKENS / ms * 1000


# ----------------------------------------------------------------------------- peer

def hf_state_dict(torch, config, w: Weights) -> dict:
    """Hugging Face name -> torch view of our fused weights (DLPack, no copy), the rows of each fused
    matrix under the architecture's module names; norms with an offset (Gemma's 1 + w) back to w (a copy)."""
    arch, t = config.arch, torch.from_dlpack
    norm = (lambda a: t(a) - arch.norm_offset) if arch.norm_offset else t
    sd = {"model.embed_tokens.weight": t(w.embed), "model.norm.weight": norm(w.norm), "lm_head.weight": t(w.lm_head)}
    modules = arch.linear(config)
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        stacked = [(f, "weight", getattr(lw, f)) for f in modules]
        if lw.qkv_bias is not None:
            stacked.append(("qkv", "bias", lw.qkv_bias))
        for f, kind, a in stacked:
            ends = np.cumsum([rows for _, rows in modules[f]])
            sd.update({f"{p}{m}.{kind}": t(a)[end - rows:end] for (m, rows), end in zip(modules[f], ends)})
        sd.update({f"{p}{module}.weight": norm(getattr(lw, f)) for f, module in arch.norms.items()})
    return sd


def hf_peer(torch, config, w: Weights):
    """transformers' model for `config` whose parameters are views of our fp16 weights (no copy)."""
    import transformers

    d = config.to_dict()
    hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **dict(d, torch_dtype="float16"))
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float16)
    sd = hf_state_dict(torch, config, w)
    hf.load_state_dict(sd, assign=True)
    with torch.device(sd["model.norm.weight"].device):
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_cfg)  # its buffers were on meta
        if hasattr(hf.model.embed_tokens, "embed_scale"):  # Gemma's sqrt(hidden), a buffer: on meta too
            hf.model.embed_tokens.embed_scale = torch.tensor(config.hidden_size ** 0.5)
    left = [n for n, a in list(hf.named_parameters()) + list(hf.named_buffers()) if a.is_meta]
    if left:
        raise runtime.CuinferError(f"transformers peer: tensors not set: {left[:4]}")
    return hf.eval()


def peer_run(torch, hf, prompts, new_tokens):
    """(decode ms per step, tokens per sequence) of transformers generate, greedy."""
    ids = torch.as_tensor(np.asarray(prompts), device="cuda")

    def timed(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()

    timed(2)  # warm-up
    t1, _ = timed(1)
    tn, tokens = timed(new_tokens)
    return 1000 * (tn - t1) / (new_tokens - 1), tokens


# ----------------------------------------------------------------------------- rows

def model_rows(cp, torch, name, config, base, args, batches, quants):
    rows, peer_ms = [], {}
    hf = hf_peer(torch, config, base) if torch is not None and "none" in quants else None
    rng = np.random.default_rng(0)
    for q in quants:
        weights = base if q == "none" else quantized(base, q)
        model = Model(config, weights)
        wbytes = weight_bytes(weights)
        for b in batches:
            prompts = rng.integers(0, config.vocab_size, (b, args.prompt_len)).tolist()
            engine = make_engine(cp, model, b, args)
            decode_run(engine, prompts, args.new_tokens)  # warm-up: compile, capture every bucket
            ms, tokens = decode_run(engine, prompts, args.new_tokens)
            mean_ctx = args.prompt_len + args.new_tokens / 2
            kv = "" if args.kv_cache_dtype == "auto" else f" kv {args.kv_cache_dtype}"
            row = {"name": f"{name} {q}{kv} b={b}", "shape": f"{args.prompt_len}+{args.new_tokens}",
                   "dtype": f"{model.dtype}{kv}", "kv_cache_dtype": args.kv_cache_dtype, "ms": ms,
                   "bytes": wbytes + b * mean_ctx * engine.kv_cache.token_bytes}
            d = {"tok_s": 1000 * b / ms, "replay_ms": replay_ms(engine, b), "gemv_ms": gemv_ms(cp, model, b),
                 "attn_ms": attention_ms(cp, engine, b, args.prompt_len + args.new_tokens),
                 "roofline_tok_s": b * bench.copy_gbs() * 1e9 / row["bytes"],
                 "graph_mib": engine.decoder.graph_bytes() / 2**20, "prefill_tok_s": prefill_tok_s(cp, engine)}
            if b == 1:
                eager = make_engine(cp, model, b, args, use_graphs=False)
                decode_run(eager, prompts, args.new_tokens)  # as the graph run: the prompts then come from the cache
                eager_ms, eager_tokens = decode_run(eager, prompts, args.new_tokens)
                d.update(eager_tok_s=1000 / eager_ms, graph_eq_eager=eager_tokens == tokens)
            if hf is not None and b == 1:
                if not peer_ms:
                    peer_ms[b], hf_tokens = peer_run(torch, hf, prompts, args.new_tokens)
                    d["hf_same_prefix"] = next((i for i, (x, y) in enumerate(zip(tokens[0], hf_tokens[0]))
                                                if x != y), len(tokens[0]))
                row.update(peer="hf generate fp16", peer_ms=peer_ms[b])
            print(detail_line(row["name"], d), flush=True)
            if args.attn_sweep:
                attention_sweep(cp, engine, b, args.prompt_len + args.new_tokens)
            rows.append(row)
            del engine
    return rows


def floor_row(cp, torch, hidden, n=150):
    """The floor of a decode step's kernel chain: n dependent rms_norm calls on one [1, hidden] row
    (each reads the row the previous one wrote, reduces it over the block and writes it), replayed
    from one CUDA graph as a step's kernels are (programmatic dependent launch on sm_90); ms per
    kernel. Peer: torch's rms_norm chained the same way in a torch CUDA graph."""
    from ..ops.rms_norm import rms_norm

    bufs = [cp.random.standard_normal((1, hidden), dtype=cp.float32).astype(cp.float16),
            cp.empty((1, hidden), cp.float16)]
    weight = cp.ones(hidden, cp.float16)

    def chain():
        for i in range(n):
            rms_norm(bufs[i % 2], weight, 1e-5, out=bufs[(i + 1) % 2])

    cp.cuda.Device().synchronize()
    graph, _, _ = capture(chain, cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool())
    row = {"name": f"kernel floor: {n} chained rms_norm", "shape": f"1x{hidden}", "dtype": "float16",
           "ms": bench.time_ms(graph.launch, warmup=3, iters=20) / n}
    if torch is not None:
        x = torch.randn(1, hidden, device="cuda", dtype=torch.float16)
        w = torch.ones(hidden, device="cuda", dtype=torch.float16)
        torch.cuda.synchronize()
        tg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(tg):
            y = x
            for _ in range(n):
                y = torch.nn.functional.rms_norm(y, (hidden,), w, 1e-5)
        row.update(peer="torch rms_norm chain", peer_ms=bench.time_ms(tg.replay, warmup=3, iters=20) / n)
    return row


DETAIL = ("tok_s", "replay_ms", "gemv_ms", "attn_ms", "roofline_tok_s", "graph_mib", "prefill_tok_s", "eager_tok_s",
          "graph_eq_eager", "hf_same_prefix")


def detail_line(name, d) -> str:
    cell = lambda v: "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
    return "| " + name + " | " + " | ".join(cell(d.get(c)) for c in DETAIL) + " |"


def run(args):
    from ..convert import load_preset
    from ..io.checkpoint import load_checkpoint

    cp = runtime.require_cupy()
    torch = None if args.no_peer else bench.torch_or_none()
    batches = [int(b) for b in args.batch.split(",")]
    quants = [q.strip() for q in args.quant.split(",")]
    bad = [q for q in quants if q not in ("none", "int8", "int4")]
    if bad:
        raise runtime.CuinferError(f"--quant: got {bad[0]!r}, need none, int8 or int4")
    dtype = kernel_dtype(None, args.dtype)
    if torch is not None and dtype != np.float16:
        torch = None  # the peer runs fp16 only
    print("| name | " + " | ".join(DETAIL) + " |\n|" + "---|" * (len(DETAIL) + 1), flush=True)
    if args.checkpoint:
        config, tensors = load_checkpoint(args.checkpoint)
        base = Model.from_tensors(config, tensors, "gpu", dtype).weights
        rows = model_rows(cp, torch, config.architecture, config, base, args, batches, quants)
    else:
        config = load_preset(args.preset)
        rows = model_rows(cp, torch, args.preset, config, random_weights(cp, config, dtype), args,
                          batches, quants)
        if args.preset != DEFAULT_MODEL:
            small = load_preset(DEFAULT_MODEL)
            rows += model_rows(cp, torch, DEFAULT_MODEL, small, random_weights(cp, small, dtype), args,
                               [1], ["none"])
    return rows + [floor_row(cp, torch, config.hidden_size)]
