"""Attention kernels: prefill TFLOP/s and paged decode GB/s against torch SDPA.

Prefill: B*S = 16k tokens packed (cu_seqlens), 32 query / 8 KV heads, fp16; the peer is
torch.nn.functional.scaled_dot_product_attention on [B, heads, S, d] with enable_gqa=True
(K/V not repeated). Causal FLOPs count half the matrix: 4*B*S*S*H*d / 2.
Decode: 32 query / 8 KV heads, head_dim 128, fp16, block_size 16, random block tables;
bytes = K and V rows read. The peer is SDPA over contiguous [B, 8, ctx, 128] K/V (no
paging) with one query per sequence. Decode and write_kv (ours and the peer) are timed as
20 back-to-back eager calls per event pair: that is the GPU time per call only where it
exceeds the Python launch cost of a call (tens of microseconds); below that the row is
launch-bound and understates the kernel.
"""
from __future__ import annotations

import numpy as np

from .. import bench, runtime
from ..ops.flash_attention import flash_attention
from ..ops.paged_attention import paged_attention, workspace_elems
from ..ops.write_kv import write_kv

N_HEADS, N_KV = 32, 8


def add_arguments(parser):
    parser.add_argument("--tokens", type=int, default=16384, help="prefill tokens per batch (B*S)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")


def _sdpa(torch, b, s, d, causal, kv_len=None):
    kv_len = kv_len or s
    q = torch.randn(b, N_HEADS, s, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, N_KV, kv_len, d, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    f = torch.nn.functional.scaled_dot_product_attention
    return lambda: f(q, k, v, is_causal=causal, enable_gqa=True)


def per_call_ms(fn, reps=20):
    """Milliseconds per call of `reps` back-to-back eager calls between one pair of events."""
    return bench.time_ms(lambda: [fn() for _ in range(reps)], warmup=2, iters=10) / reps


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
                ms = bench.time_ms(lambda: flash_attention(q, k, v, cu, causal, out=out, max_seqlen_q=s))
                flops = 4 * b * s * s * N_HEADS * d * (0.5 if causal else 1.0)
                row = dict(name=f"prefill{' causal' if causal else ''}", shape=f"{b}x{s} d={d}",
                           dtype="float16", ms=ms, flops=flops)
                if torch is not None:
                    row.update(peer="sdpa", peer_ms=bench.time_ms(_sdpa(torch, b, s, d, causal)))
                rows.append(row)
    return rows


def decode_rows(cp, torch, cases, d=128, block_size=16):
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
        ws = cp.empty(max(1, workspace_elems(b, N_HEADS, N_KV, d, ctx)), dtype=cp.float32)
        ms = per_call_ms(lambda: paged_attention(q, k_cache, v_cache, tables, lens, out=out,
                                                 max_context_len=ctx, workspace=ws))
        row = dict(name="decode paged", shape=f"{b}x{ctx} bs={block_size}", dtype="float16", ms=ms,
                   bytes=2 * b * ctx * N_KV * d * 2)
        if torch is not None:
            row.update(peer="sdpa contiguous", peer_ms=per_call_ms(_sdpa(torch, b, 1, d, False, ctx)))
        rows.append(row)
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
    ms = per_call_ms(lambda: write_kv(q, k, v, pos, caches[0], caches[1], slots, inv_freq, out=out))
    return [dict(name="write_kv", shape=f"{tokens} tok d={d}", dtype="float16", ms=ms,
                 bytes=2 * (q.nbytes + k.nbytes + v.nbytes))]


def run(args):
    cp = runtime.require_cupy()
    torch = bench.torch_or_none()
    seq_lens = (2048,) if args.quick else (512, 2048, 4096, 16384)
    rows = decode_rows(cp, torch, ((1, 32768), (16, 4096), (64, 1024)))
    rows += write_kv_rows(cp)
    rows += prefill_rows(cp, torch, args.tokens, seq_lens)
    return rows
