"""Gaps: GPU time a decode step spends between two graph replays, per stream operation around them.

The decode bench's engine for a preset at batch 1 (random weights, --prompt-len + --new-tokens,
one generate call to capture the graphs), then loops of --steps replays of its largest-context
greedy graph, each with the stream operations listed in the row's name before or after it, timed
with CUDA events around the loop (median of three loops after a warm-up one; ms a step). The rows differ from the
replay alone by what those operations cost between replays: the inputs' host-to-device copy
(whole, or without the token slots as a pipelined step copies them), the tokens' device-to-device
copy (a pipelined step whose bucket changed), their device-to-host DMA copy, and the kernel that
DecodeGraph.read_async uses instead.
"""
from __future__ import annotations

import types

import numpy as np

from .. import bench
from ..convert import load_preset
from ..model.decoder import Model
from ..ops import runtime
from ..serving.runner import copy_async
from .decode import DEFAULT_MODEL, decode_run, largest_greedy_step, make_engine, random_weights


def add_arguments(parser):
    parser.add_argument("--preset", default=DEFAULT_MODEL, help="a models/*.json preset (random weights)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300, help="replays a timed loop")


def loop_ms(ops, steps: int) -> float:
    """GPU ms a step of `ops` called in order `steps` times back to back (bench.time_ms of the loop:
    median of three after one)."""
    def loop():
        for _ in range(steps):
            for op in ops:
                op()
    return bench.time_ms(loop, warmup=1, iters=3) / steps


def run(args):
    cp = runtime.require_cupy()
    config = load_preset(args.preset)
    model = Model(config, random_weights(cp, config, np.float16))
    shape = types.SimpleNamespace(prompt_len=args.prompt_len, new_tokens=args.new_tokens, sync_decode=False,
                                  kv_cache_dtype="auto")
    engine = make_engine(cp, model, 1, shape)
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, (1, args.prompt_len)).tolist()
    decode_run(engine, prompts, args.new_tokens)
    graphs, step = engine.decoder, largest_greedy_step(engine, 1)
    stream, rt = cp.cuda.get_current_stream(), cp.cuda.runtime
    size, tokens = step.host.size, step.inputs.token_ids[:1]
    spare = cp.zeros(1, dtype=np.int32)
    pinned = np.frombuffer(cp.cuda.alloc_pinned_memory(4), dtype=np.int32, count=1)
    ops = {
        "inputs H2D": lambda: copy_async(cp, step.device, step.host, size, rt.memcpyHostToDevice, stream),
        "inputs H2D past the tokens": lambda: copy_async(cp, step.device[1:], step.host[1:], size - 1,
                                                         rt.memcpyHostToDevice, stream),
        "tokens D2D": lambda: copy_async(cp, spare, tokens, 1, rt.memcpyDeviceToDevice, stream),
        "replay": step.graph.launch,
        "tokens D2H (DMA)": lambda: copy_async(cp, pinned, tokens, 1, rt.memcpyDeviceToHost, stream),
        "tokens read_async (kernel)": lambda: graphs.read_async(tokens),
    }
    variants = [["replay"], ["inputs H2D", "replay"], ["inputs H2D past the tokens", "replay"],
                ["inputs H2D", "tokens D2D", "replay"], ["replay", "tokens D2H (DMA)"],
                ["replay", "tokens read_async (kernel)"],
                ["inputs H2D", "tokens D2D", "replay", "tokens D2H (DMA)"],
                ["inputs H2D past the tokens", "replay", "tokens read_async (kernel)"]]
    rows = []
    for names in variants:
        ms = loop_ms([ops[n] for n in names], args.steps)
        rows.append({"name": " + ".join(names), "shape": f"{args.preset} b=1", "dtype": "float16", "ms": ms})
    return rows
