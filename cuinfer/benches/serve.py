"""Serving workloads through the engine's online API: throughput, TTFT, time per output token.

    python -m cuinfer.bench serve --workload mixed|shared-prefix|long|rate [--preset llama3-8b] [--quant int4]
                                  [--kv-cache-dtype fp8]

Fixed-seed synthetic requests (random token ids, ignore_eos) arrive on a schedule; the loop adds
each request when its time comes and steps the engine, stamping every token as it comes back:
- mixed: 512 requests, prompt U[64, 1024], output U[64, 512], all at once;
- shared-prefix: 256 requests, one 2,048-token system prompt + a U[32, 256]-token question, output
  128; run with prefix caching on and off;
- long: 32 short requests (prompt 128, output 512) decoding while 8 prompts of 8,000 tokens arrive,
  at each --budgets step budget, and the 32 alone: their inter-token gaps while the long prompts
  prefill against alone;
- rate: --num-requests mixed-shape requests with Poisson arrivals at --rate per second.
--http URL sends the same workloads to an OpenAI-compatible server (benches/serve_http.py).
Rows: output and total tok/s, TTFT and TPOT (a request's time per token after its first) p50/p99,
peak KV usage, prefix-cache hit rate, preemptions, and the seconds spent in the engine's steps that
carried prompt tokens (prefill and mixed) and in its decode-only steps (the rest of the wall is the
loop's own: adding requests, stamping tokens); the dtype column names the weights' format and,
with --kv-cache-dtype fp8, the KV cache's (the same memory then holds twice the tokens). Each engine
runs Engine.warm_up before its clock starts, as the server does before it listens. --peer runs the
same prompts through transformers' continuous batching (generate_batch; one max_new_tokens for all:
the workload's mean).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np

from ..cli import add_kv_cache_dtype_argument
from ..ops import runtime
from ..serving.sampling import SamplingParams

WORKLOADS = ("mixed", "shared-prefix", "long", "rate")


def add_arguments(parser):
    parser.add_argument("--workload", default="mixed,shared-prefix,long", help=f"comma-separated: {WORKLOADS}")
    parser.add_argument("--preset", default="llama3-8b", help="a models/*.json preset (random weights)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--quant", choices=("none", "int8", "int4"), default="none",
                        help="the linear layers' format, quantized on the GPU as bench decode does")
    add_kv_cache_dtype_argument(parser)
    parser.add_argument("--budget", type=int, default=2048, help="max_batch_tokens of a step")
    parser.add_argument("--budgets", default="512,2048,8192", help="the long workload's step budgets")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second (rate workload)")
    parser.add_argument("--num-requests", type=int, default=256, help="requests of the rate workload")
    parser.add_argument("--scale", type=float, default=1.0, help="scale every request count (quick runs)")
    parser.add_argument("--peer", action="store_true", help="also run transformers generate_batch")
    parser.add_argument("--http", metavar="URL", help="drive this OpenAI-compatible server instead of the engine")
    parser.add_argument("--model", help="--http: the model name the server serves")
    parser.add_argument("--concurrency", type=int, default=0, help="--http: requests in flight at most (0: all)")
    parser.add_argument("--api-key", help="--http: sent as Authorization: Bearer KEY")
    parser.add_argument("--vocab", type=int, default=32000, help="--http: prompt token ids are drawn below this")


@dataclass
class Request:
    prompt: list
    max_new: int
    arrival: float = 0.0  # seconds after the start
    group: str = ""
    times: list = field(default_factory=list)  # when each token (over HTTP: each chunk) came back
    n_out: int | None = None  # output tokens, when not one per stamp (the server's usage)


def _ids(rng, n, vocab):
    return rng.integers(0, vocab, int(n)).tolist()


def workload(name, vocab, scale=1.0, rate=8.0, num_requests=256, seed=0) -> list:
    rng = np.random.default_rng(seed)
    n = lambda k: max(1, int(k * scale))  # noqa: E731
    if name == "mixed":
        return [Request(_ids(rng, rng.integers(64, 1025), vocab), int(rng.integers(64, 513))) for _ in range(n(512))]
    if name == "shared-prefix":
        system = _ids(rng, 2048, vocab)
        return [Request(system + _ids(rng, rng.integers(32, 257), vocab), 128) for _ in range(n(256))]
    if name == "long":
        short = [Request(_ids(rng, 128, vocab), 512, 0.0, "short") for _ in range(32)]
        return short + [Request(_ids(rng, 8000, vocab), 16, 1.0 + 0.05 * i, "long") for i in range(8)]
    if name == "rate":
        gaps = rng.exponential(1.0 / rate, n(num_requests))
        return [Request(_ids(rng, rng.integers(64, 1025), vocab), int(rng.integers(64, 513)), float(t))
                for t in np.cumsum(gaps)]
    raise runtime.CuinferError(f"--workload: got {name!r}, need one of {', '.join(WORKLOADS)}")


def drive(engine, requests) -> dict:
    """Run the requests through the engine's online API in real time; the run's totals."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    ids, peak, t0 = {}, 0.0, time.perf_counter()
    hits0, pre0 = engine.blocks.hit_tokens, engine.scheduler.num_preemptions
    prefill0, decode0 = engine.stats.prefill_s, engine.stats.decode_s
    while order or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while order and requests[order[0]].arrival <= now:
            r = requests[order.pop(0)]
            ids[engine.add_request(r.prompt, SamplingParams(max_new_tokens=r.max_new, ignore_eos=True))] = r
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, requests[order[0]].arrival - now))
            continue
        outs = engine.step()
        stamp = time.perf_counter() - t0
        peak = max(peak, engine.kv_cache_usage())
        for o in outs:
            ids[o.request_id].times += [stamp] * len(o.new_token_ids)
    wall = time.perf_counter() - t0
    prompt_tokens = sum(len(r.prompt) for r in requests)
    return {"wall_s": wall, "out_tok": sum(len(r.times) for r in requests), "prompt_tok": prompt_tokens,
            "peak_kv": peak, "hit_rate": (engine.blocks.hit_tokens - hits0) / prompt_tokens,
            "preemptions": engine.scheduler.num_preemptions - pre0,
            "prefill_step_s": engine.stats.prefill_s - prefill0, "decode_step_s": engine.stats.decode_s - decode0}


def pct(values, q):
    return float(np.percentile(values, q)) if len(values) else float("nan")


def row(name, requests, totals) -> dict:
    ttft = [1000 * (r.times[0] - r.arrival) for r in requests if r.times]
    tokens = [r.n_out or len(r.times) for r in requests]
    tpot = [1000 * (r.times[-1] - r.times[0]) / (n - 1) for r, n in zip(requests, tokens) if n > 1 and r.times]
    wall = totals["wall_s"]
    return {"name": name, "ms": 1000 * wall, "requests": len(requests),
            "out_tok_s": totals["out_tok"] / wall, "total_tok_s": (totals["out_tok"] + totals["prompt_tok"]) / wall,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99), "peak_kv": totals["peak_kv"],
            "hit_rate": totals["hit_rate"], "preemptions": totals["preemptions"],
            **{k: totals[k] for k in ("prefill_step_s", "decode_step_s") if k in totals}}


def gaps_ms(requests, start, end) -> list:
    """Inter-token gaps (ms) of the requests whose second token falls in [start, end]."""
    return [1000 * (b - a) for r in requests for a, b in zip(r.times, r.times[1:]) if start <= b <= end]


def make_engine(cp, model, args, budget, caching=True):
    from ..model.kv_cache import CacheShape, KVCache, kv_cache_dtype_for
    from ..serving.engine import Engine

    cfg = model.config
    shape = CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    cache = KVCache.allocate(shape, kv_cache_dtype_for(args.kv_cache_dtype, model.dtype), cp, memory_fraction=0.7)
    engine = Engine(model, cache, max_batch_tokens=budget, max_num_seqs=args.max_num_seqs,
                    enable_prefix_caching=caching)
    warm = engine.warm_up()  # as a server starts: nothing compiled or captured on the clock
    print(f"warm-up {warm['seconds']:.1f} s, {warm['graphs']} graphs, {warm['graph_mib']:.0f} MiB of graph pool",
          file=sys.stderr, flush=True)
    return engine


def fresh(requests):
    return [Request(r.prompt, r.max_new, r.arrival, r.group) for r in requests]


def run_workload(cp, model, args, name) -> list:
    vocab = model.config.vocab_size
    reqs = workload(name, vocab, args.scale, args.rate, args.num_requests)
    rows = []
    if name == "long":
        alone = fresh([r for r in reqs if r.group == "short"])
        drive(make_engine(cp, model, args, args.budget), alone)
        base = pct(gaps_ms(alone, 1.0, float("inf")), 99)
        for budget in (int(b) for b in args.budgets.split(",")):
            run = fresh(reqs)
            totals = drive(make_engine(cp, model, args, budget), run)
            short, long_ = [r for r in run if r.group == "short"], [r for r in run if r.group == "long"]
            window = (1.0, max(r.times[0] for r in long_))
            p99 = pct(gaps_ms(short, *window), 99)
            rows.append({**row(f"long budget {budget}", run, totals), "short_gap_p99_ms": p99,
                         "alone_gap_p99_ms": base, "gap_ratio": p99 / base,
                         "long_prefill_s": window[1] - window[0]})
        return rows
    for caching in ((True, False) if name == "shared-prefix" else (True,)):
        run = fresh(reqs)
        totals = drive(make_engine(cp, model, args, args.budget, caching), run)
        rows.append(row(f"{name} caching {'on' if caching else 'off'}", run, totals))
    return rows


def peer_row(torch, model, name, requests) -> dict:
    """transformers' continuous batching on the same prompts, all at once, mean output length."""
    from transformers import GenerationConfig

    from .decode import hf_peer

    hf = hf_peer(torch, model.config, model.weights)
    new = int(round(np.mean([r.max_new for r in requests])))
    gc = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = hf.generate_batch(inputs=[r.prompt for r in requests], generation_config=gc, progress_bar=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    out_tok = sum(len(o.generated_tokens) for o in out.values())
    prompt_tok = sum(len(r.prompt) for r in requests)
    return {"name": f"{name} transformers generate_batch", "ms": 1000 * wall, "requests": len(requests),
            "out_tok_s": out_tok / wall, "total_tok_s": (out_tok + prompt_tok) / wall, "peer_new_tokens": new}


def run_http(args) -> list:
    from .serve_http import drive_http

    if not args.model:
        raise runtime.CuinferError("--http: give --model, the name the server serves")
    rows = []
    for name in args.workload.split(","):
        reqs = workload(name.strip(), args.vocab, args.scale, args.rate, args.num_requests)
        # the server warmed up at start (Engine.warm_up); 8 requests first open the client's connections
        drive_http(args.http, args.model, [replace(r, arrival=0.0) for r in fresh(reqs[:8])],
                   args.concurrency, args.api_key)
        totals = drive_http(args.http, args.model, reqs, args.concurrency, args.api_key)
        r = {**row(f"{name.strip()} http c={args.concurrency or len(reqs)}", reqs, totals), "shape": args.model}
        print(" · ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), flush=True)
        rows.append(r)
    return rows


def runs_without_gpu(args) -> bool:
    """--http drives a server over the network: no GPU here."""
    return bool(args.http)


def run(args):
    if args.http:
        return run_http(args)
    from ..convert import load_preset
    from ..model.decoder import Model, kernel_dtype
    from .decode import quantized, random_weights

    cp = runtime.require_cupy()
    config = load_preset(args.preset)
    weights = random_weights(cp, config, kernel_dtype(None, args.dtype))
    if args.quant != "none":
        weights = quantized(weights, args.quant)
        cp.get_default_memory_pool().free_all_blocks()  # the float copies: the KV cache sizes from free memory
    model = Model(config, weights)
    dtype = args.dtype if args.quant == "none" else f"{args.dtype} {args.quant}"
    if args.kv_cache_dtype != "auto":
        dtype += f" kv {args.kv_cache_dtype}"
    rows = []
    for name in args.workload.split(","):
        for r in run_workload(cp, model, args, name.strip()):
            rows.append({**r, "shape": args.preset, "dtype": dtype, "kv_cache_dtype": args.kv_cache_dtype})
            print(" · ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()),
                  flush=True)
        if args.peer and args.quant == "none" and name.strip() in ("mixed", "shared-prefix"):
            from .. import bench

            torch = bench.torch_or_none()
            try:
                reqs = workload(name.strip(), config.vocab_size, args.scale, args.rate, args.num_requests)
                r = peer_row(torch, model, name.strip(), reqs)
            except Exception as e:  # the peer is optional: say why it is missing
                r = {"name": f"{name.strip()} transformers generate_batch", "ms": float("nan"), "error": repr(e)}
            rows.append(r)
            print(r, flush=True)
    return rows
