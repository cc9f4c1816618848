"""Attention kernels: prefill TFLOP/s and paged decode GB/s against torch SDPA.

Prefill: B*S = 16k tokens packed (cu_seqlens), 32 query / 8 KV heads, fp16; the peer is
torch.nn.functional.scaled_dot_product_attention on [B, heads, S, d] with enable_gqa=True
(K/V not repeated). Causal FLOPs count half the matrix: 4*B*S*S*H*d / 2. Both are timed as 20
calls replayed from one CUDA graph: back to back, with no host gap between calls (timed one call at
a time, the GPU idled between calls and the short rows moved by up to 25 % from run to run).
Decode: 32 query / 8 KV heads, head_dim 128, fp16, block_size 16, random block tables;
bytes = K and V rows read. The peer is SDPA over contiguous [B, 8, ctx, 128] K/V (no
paging) with one query per sequence. Decode and write_kv (ours and the peer) are timed
as 20 calls replayed from one CUDA graph, as the decoder runs them (eagerly a call costs
more Python than GPU time); every call reads more K/V than the 50 MB L2 holds. Each decode case and
the paged prefill row are also timed over an fp8 (E4M3) cache of the same shape ("fp8 kv" rows:
random codes of magnitude <= 240, bytes = the codes read). Prefill from fp8 has two rows: the
mma.sync kernel decoding its tiles (what a captured call runs), and the eager op, which on sm_90
decodes the pages into a float16 pool for the wgmma kernel (timed with events: it allocates).
`--sweep` adds decode rows for other split partitions and rows-in-flight counts, and
d=128 prefill rows for other tile shapes.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import bench
from ..ops import runtime
from ..ops.flash_attention import flash_attention, flash_attention_paged, launch_kernel
from ..ops.paged_attention import (
    WARPS,
    cta_warps,
    decode_splits,
    launch_decode,
    padded_group,
    paged_attention,
    rows_in_flight,
    split_workspace_elems,
)
from ..ops.write_kv import write_kv
from ..serving.runner import capture

N_HEADS, N_KV = 32, 8
REPS = 20


def add_arguments(parser):
    parser.add_argument("--tokens", type=int, default=16384, help="prefill tokens per batch (B*S)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--sweep", action="store_true", help="decode split / rows-in-flight and prefill tile variants")
    parser.add_argument("--no-prefill", action="store_true", help="decode and write_kv rows only")
    parser.add_argument("--no-decode", action="store_true", help="prefill rows only")


def _sdpa(torch, b, s, d, causal, kv_len=None):
    kv_len = kv_len or s
    q = torch.randn(b, N_HEADS, s, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, N_KV, kv_len, d, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    f = torch.nn.functional.scaled_dot_product_attention
    return lambda: f(q, k, v, is_causal=causal, enable_gqa=True)


def graph_ms(cp, fn, reps=REPS):
    """Milliseconds per fn() replayed from one CUDA graph of `reps` calls (graph.capture: warm-up,
    then capture on a non-blocking stream)."""
    cp.cuda.Device().synchronize()  # inputs made on the default stream are ready
    graph, _, _ = capture(lambda: [fn() for _ in range(reps)], cp.cuda.Stream(non_blocking=True),
                          cp.cuda.MemoryPool())
    return bench.time_ms(graph.launch, warmup=3, iters=20) / reps


def torch_graph_ms(torch, fn, reps=REPS):
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return bench.time_ms(graph.replay, warmup=3, iters=20) / reps


def prefill_rows(cp, torch, tokens, seq_lens):
    rows = []
    for d in (64, 128):
        for s in seq_lens:
            b = max(1, tokens // s)
            q = cp.random.standard_normal((b * s, N_HEADS, d), dtype=cp.float32).astype(cp.float16)
            k = cp.random.standard_normal((b * s, N_KV, d), dtype=cp.float32).astype(cp.float16)
            v = cp.random.standard_normal((b * s, N_KV, d), dtype=cp.float32).astype(cp.float16)
            cu = cp.arange(0, b * s + 1, s, dtype=cp.int32)
            out = cp.empty_like(q)
            for causal in (True, False):
                ms = graph_ms(cp, functools.partial(flash_attention, q, k, v, cu, causal, out=out, max_seqlen_q=s))
                flops = 4 * b * s * s * N_HEADS * d * (0.5 if causal else 1.0)
                row = {"name": f"prefill{' causal' if causal else ''}", "shape": f"{b}x{s} d={d}",
                       "dtype": "float16", "ms": ms, "flops": flops}
                if torch is not None:
                    row.update(peer="sdpa", peer_ms=torch_graph_ms(torch, _sdpa(torch, b, s, d, causal)))
                rows.append(row)
            if d == 128 and s == 4096:
                rows += paged_prefill_row(cp, torch, q, k, v, b, s, d)
    return rows


def fp8_codes(cp, shape):
    """Random E4M3 codes of magnitude <= 240 (exponent field < 15: no NaN, no saturated value)."""
    mag = cp.random.randint(0, 0x78, shape, dtype=cp.int32)
    return (mag | cp.random.randint(0, 2, shape, dtype=cp.int32) << 7).astype(cp.uint8)


def paged_prefill_row(cp, torch, q, k, v, b, s, d, block_size=16):
    """The engine's prefill form: the same causal problem with K/V in a paged cache (blocks in a
    random order), through flash_attention_paged; then over an fp8 cache of the same shape."""
    n_blocks = b * s // block_size
    perm = cp.asarray(np.random.default_rng(0).permutation(n_blocks).astype(np.int32))
    k_cache, v_cache = (cp.empty((n_blocks, block_size, N_KV, d), dtype=cp.float16) for _ in range(2))
    k_cache[perm] = k.reshape(n_blocks, block_size, N_KV, d)
    v_cache[perm] = v.reshape(n_blocks, block_size, N_KV, d)
    tables = perm.reshape(b, s // block_size)
    cu = cp.arange(0, b * s + 1, s, dtype=cp.int32)
    lens = cp.full((b,), s, dtype=cp.int32)
    out = cp.empty_like(q)
    ms = graph_ms(cp, functools.partial(flash_attention_paged, q, k_cache, v_cache, tables, cu, lens, out=out,
                                        max_seqlen_q=s))
    row = {"name": "prefill paged causal", "shape": f"{b}x{s} d={d} bs={block_size}", "dtype": "float16",
           "ms": ms, "flops": 2 * b * s * s * N_HEADS * d}
    if torch is not None:
        row.update(peer="sdpa", peer_ms=torch_graph_ms(torch, _sdpa(torch, b, s, d, True)))
    k8, v8 = fp8_codes(cp, k_cache.shape), fp8_codes(cp, v_cache.shape)
    call = functools.partial(flash_attention_paged, q, k8, v8, tables, cu, lens, out=out, max_seqlen_q=s)
    return [row, dict(row, name="prefill paged causal, in a graph", dtype="float16, fp8 kv", ms=graph_ms(cp, call)),
            dict(row, name="prefill paged causal, eager", dtype="float16, fp8 kv", ms=bench.time_ms(call))]


SWEEP_TILES = (("mma", 64, 64, 4), ("wgmma", 128, 128, 12), ("tma", 128, 128, 12), ("tma", 128, 64, 12))


def prefill_tile_rows(cp, tokens=16384, s=4096, d=128, tiles=SWEEP_TILES):
    """--sweep: d=128 prefill at 4x4096 with other (kernel, BLOCK_M, BLOCK_N, warps) tiles, direct
    launches (wgmma / tma tiles on sm_90 only)."""
    b = tokens // s
    q = cp.random.standard_normal((b * s, N_HEADS, d), dtype=cp.float32).astype(cp.float16)
    k = cp.random.standard_normal((b * s, N_KV, d), dtype=cp.float32).astype(cp.float16)
    v = cp.random.standard_normal((b * s, N_KV, d), dtype=cp.float32).astype(cp.float16)
    cu = cp.arange(0, b * s + 1, s, dtype=cp.int32)
    out = cp.empty_like(q)
    rows = []
    arch = int(runtime.device_info()["arch"][3:])
    for tile in tiles:
        if tile[0] != "mma" and arch != 90:  # wgmma and tma: sm_90 only
            continue
        for causal in (True, False):
            call = functools.partial(launch_kernel, q, k, v, out, cu, None, None, 0, b, s, d ** -0.5, causal, tile)
            rows.append({"name": f"  prefill{' causal' if causal else ''} tile {'x'.join(map(str, tile))}",
                         "shape": f"{b}x{s} d={d}", "dtype": "float16", "ms": graph_ms(cp, call),
                         "flops": 4 * b * s * s * N_HEADS * d * (0.5 if causal else 1.0)})
    return rows


def decode_rows(cp, torch, cases, sweep, d=128, block_size=16):
    rows = []
    rng = np.random.default_rng(0)
    for b, ctx in cases:
        n_blocks = b * (-(-ctx // block_size))
        k_cache = cp.random.standard_normal((n_blocks, block_size, N_KV, d), dtype=cp.float32).astype(cp.float16)
        v_cache = cp.random.standard_normal(k_cache.shape, dtype=cp.float32).astype(cp.float16)
        tables = cp.asarray(rng.permutation(n_blocks).reshape(b, -1).astype(np.int32))
        lens = cp.full((b,), ctx, dtype=cp.int32)
        q = cp.random.standard_normal((b, N_HEADS, d), dtype=cp.float32).astype(cp.float16)
        out = cp.empty_like(q)
        group = padded_group(N_HEADS, N_KV)
        n_splits, partition = decode_splits(b, N_HEADS, N_KV, ctx)
        warps = cta_warps(n_splits * N_KV * b, group, runtime.device_info()["sm_count"])
        variants = [(n_splits, partition, rows_in_flight(group, d, partition, warps), warps)]
        if sweep:
            variants += [(-(-ctx // p), p, u, w) for p in (256, 512, 1024, 2048) for u in (4, 8) for w in WARPS
                         if p <= ctx and (-(-ctx // p), p, u, w) != variants[0]]
        for i, (n, p, u, w) in enumerate(variants):
            ws = cp.zeros(split_workspace_elems(b, N_HEADS, N_KV, d, n), dtype=cp.float32)
            call = (functools.partial(paged_attention, q, k_cache, v_cache, tables, lens, out=out,
                                      max_context_len=ctx, workspace=ws) if i == 0 else
                    functools.partial(launch_decode, q, k_cache, v_cache, tables, lens, out, d ** -0.5,
                                      group, n, p, ws, u, warps=w))
            row = {"name": f"decode paged {n}x{p} U={u} W={w}" if i == 0 else f"  split {n}x{p} U={u} W={w}",
                   "shape": f"{b}x{ctx} bs={block_size}", "dtype": "float16", "ms": graph_ms(cp, call),
                   "bytes": 2 * b * ctx * N_KV * d * 2}
            if i == 0 and torch is not None:
                row.update(peer="sdpa contiguous", peer_ms=torch_graph_ms(torch, _sdpa(torch, b, 1, d, False, ctx)))
            rows.append(row)
            if i == 0:  # the same call over an fp8 cache
                k8, v8 = fp8_codes(cp, k_cache.shape), fp8_codes(cp, v_cache.shape)
                call = functools.partial(paged_attention, q, k8, v8, tables, lens, out=out, max_context_len=ctx,
                                         workspace=ws)
                rows.append(dict(row, name=f"decode paged {n}x{p} U={u} W={w}", dtype="float16, fp8 kv",
                                 ms=graph_ms(cp, call), bytes=row["bytes"] // 2))
    return rows


def write_kv_rows(cp, tokens=4096, d=128, block_size=16):
    q = cp.random.standard_normal((tokens, N_HEADS, d), dtype=cp.float32).astype(cp.float16)
    k = cp.random.standard_normal((tokens, N_KV, d), dtype=cp.float32).astype(cp.float16)
    v = cp.random.standard_normal((tokens, N_KV, d), dtype=cp.float32).astype(cp.float16)
    caches = [cp.empty((tokens // block_size, block_size, N_KV, d), dtype=cp.float16) for _ in range(2)]
    pos = cp.arange(tokens, dtype=cp.int32)
    slots = cp.asarray(np.random.default_rng(1).permutation(tokens).astype(np.int32))
    inv_freq = cp.asarray((10000.0 ** (-np.arange(0, d, 2) / d)).astype(np.float32))
    out = cp.empty_like(q)
    ms = graph_ms(cp, functools.partial(write_kv, q, k, v, pos, caches[0], caches[1], slots, inv_freq, out=out))
    return [{"name": "write_kv", "shape": f"{tokens} tok d={d}", "dtype": "float16", "ms": ms,
            "bytes": 2 * (q.nbytes + k.nbytes + v.nbytes)}]


def run(args):
    cp = runtime.require_cupy()
    torch = bench.torch_or_none()
    seq_lens = (2048,) if args.quick else (512, 2048, 4096, 16384)
    rows = []
    if not args.no_decode:
        rows += decode_rows(cp, torch, ((1, 32768), (16, 4096), (64, 1024)), args.sweep)
        rows += write_kv_rows(cp)
    if not args.no_prefill:
        rows += prefill_rows(cp, torch, args.tokens, seq_lens)
        if args.sweep:
            rows += prefill_tile_rows(cp)
    return rows
