"""Mixed steps: prefill chunks and decodes in one forward, against the same work as separate steps.

A preset with random weights on the GPU (default llama3-8b fp16). Each row is one step shape: P
prompt chunks of L new tokens each (ending at context C, so a chunk attends over C - L cached
tokens too; shapes with L > C are left out) and D decoding sequences at context C, all in one
Model.forward (paged FlashAttention over the chunks, the split-K decode kernel over the decodes,
linear layers over all P * L + D rows: what the engine runs when chunked prefill meets running
decodes). ms: the GPU time of that step (CUDA events, median); peer_ms: the same
work as two steps, the P chunks alone plus the D decodes alone (a DecodeGraph replay, the engine's
decode step); speedup = peer_ms / ms. A second row per shape runs the step through
serving.piecewise (the engine's path: graphs between the attentions, every bucket captured first)
against Model.forward. The shape column gives the tokens the step processes, its tok/s and the host
ms to enqueue it (the call's return, the device idle before it: where that exceeds the GPU's time,
the step waits on the host). The KV cache holds random values: attention reads the same bytes
whatever they are.
"""
from __future__ import annotations

import time

import numpy as np

from .. import bench
from ..model.decoder import Model
from ..model.kv_cache import CacheShape, KVCache
from ..model.step_inputs import Batch
from ..ops import runtime
from ..serving.piecewise import PiecewiseForward
from ..serving.runner import DecodeGraph
from .decode import random_weights

BLOCK = 16
# (P, L, D): a short prompt alone, a chunk with a few decodes, then the engine's larger mixes
SHAPES = ((1, 64, 0), (1, 256, 32), (1, 512, 64), (4, 512, 128), (1, 512, 256), (2, 1024, 32), (1, 2048, 64))


def add_arguments(parser):
    parser.add_argument("--preset", default="llama3-8b", help="a models/*.json preset (random weights)")
    parser.add_argument("--context", type=int, default=1024, help="tokens of every sequence's context (C)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")


def shape_rows(cp, model, config, shapes, ctx: int) -> list:
    blocks = -(-ctx // BLOCK)
    most = max(p + d for p, _, d in shapes)
    shape = CacheShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, BLOCK)
    cache = KVCache.allocate(shape, model.dtype, cp, (most * blocks + 1) * BLOCK)
    for k, v in (cache.layer(i) for i in range(config.num_hidden_layers)):
        k[...] = cp.random.standard_normal(k.shape, dtype=cp.float32).astype(k.dtype)
        v[...] = k
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(most)]
    decoder = DecodeGraph(model, cache, most * blocks)
    shapes = [s for s in shapes if s[1] <= ctx]
    piecewise = PiecewiseForward(model, cache, max(p * n + d for p, n, d in shapes), decoder.pool, decoder.stream)
    piecewise.capture_all()
    rng = np.random.default_rng(0)
    rows = []
    for p, n, d in shapes:
        chunks = [(rng.integers(0, config.vocab_size, n).tolist(), ctx - n, tables[i]) for i in range(p)]
        decodes = [([int(rng.integers(0, config.vocab_size))], ctx - 1, tables[p + i]) for i in range(d)]
        mixed = Batch.from_chunks(chunks + decodes, BLOCK).to(cp)
        prefill = Batch.from_chunks(chunks, BLOCK).to(cp)
        ms = bench.time_ms(lambda b=mixed: model.forward(b, cache), warmup=3, iters=10)
        graphs = bench.time_ms(lambda b=mixed: piecewise.forward(b), warmup=3, iters=10)
        host = [host_ms(cp, lambda b=mixed: model.forward(b, cache)), host_ms(cp, lambda b=mixed: piecewise.forward(b))]
        alone = bench.time_ms(lambda b=prefill: model.forward(b, cache), warmup=3, iters=10)
        step = [[t[0] for t, _, _ in decodes], [s for _, s, _ in decodes], [t for _, _, t in decodes]]
        decode = bench.time_ms(lambda s=step: decoder.run(*s, greedy=True), warmup=3, iters=10) if d else 0.0
        tokens = p * n + d
        rows.append({"name": f"mixed P={p} L={n} D={d} C={ctx}",
                     "shape": f"{tokens} tokens · {tokens / ms * 1e3:,.0f} tok/s · host {host[0]:.1f} ms",
                     "ms": ms, "peer": "prefill + decode steps", "peer_ms": alone + decode})
        rows.append({"name": f"mixed piecewise P={p} L={n} D={d} C={ctx}",
                     "shape": f"{tokens} tokens · {tokens / graphs * 1e3:,.0f} tok/s · host {host[1]:.1f} ms",
                     "ms": graphs, "peer": "Model.forward", "peer_ms": ms})
    return rows


def host_ms(cp, fn, iters: int = 5) -> float:
    """Median host milliseconds of fn() returning, the device idle before each call."""
    times = []
    for _ in range(iters):
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
    cp.cuda.Device().synchronize()
    return sorted(times)[len(times) // 2]


def run(args):
    from ..convert import load_preset

    cp = runtime.require_cupy()
    dtype = runtime.bfloat16 if args.dtype == "bfloat16" else np.dtype(np.float16)
    config = load_preset(args.preset)
    model = Model(config, random_weights(cp, config, dtype))
    return [{**r, "dtype": args.dtype} for r in shape_rows(cp, model, config, SHAPES, args.context)]
