"""Linear layers: decode GEMV with fp16, INT8 and INT4 g128 weights against cuBLAS and torch fp16.

Llama-3-8B shapes (in_features K, out_features N) at M = 1, 4, 16 rows of x. Bytes = the
weight's bytes (qweight + scales + zeros) plus x and y. Every variant, ours and the
peers', is timed over 20 back-to-back calls queued behind a long copy (queued_ms) that cycle
through enough weight copies (>= 120 MB) that each call streams its weight from HBM, not
from the 50 MB L2.
The peer of every row is cupy.matmul (cuBLAS) on an fp16 weight of the same shape; a
`torch fp16` row (torch.nn.functional.linear) per shape is measured in the same run.
"""
from __future__ import annotations

import numpy as np

from .. import bench, runtime
from ..ops.linear import QUAD_K, Tile, _gemv, instantiation, linear, tile_config
from ..quant import Int4Weight, Int8Weight

SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256)]
ROWS_M = (1, 4, 16)
REPS = 20
ROTATE_BYTES = 120 << 20


def add_arguments(parser):
    parser.add_argument("--m", type=int, nargs="*", default=list(ROWS_M), help="rows of x")
    parser.add_argument("--sweep", action="store_true",
                        help="instead: time int4 g128 / int8 tiles (warps, U, split-K) per shape at M = 1")


SWEEP_FORMATS = ("int4", "int8")


def sweep_tiles(bits, k, n):
    """Tiles of the sweep for one shape at M = 1: 4 or 8 warps, U, split-K 1..8 while each split keeps
    one full pipeline stage (WARPS U quads), plus the tile_config choice."""
    quads = -(-k // QUAD_K[bits])
    us = (1, 2) if bits == 4 else (2, 4)
    tiles = {Tile(1, 1, u, w, s) for w in (4, 8) for u in us for s in (1, 2, 4, 8) if quads >= s * w * u
             and (s == 1 or n <= 16384)}
    return sorted(tiles | {tile_config(bits, 1, n, k)})


def sweep_instantiations():
    import numpy as np

    bits = {"int4": (4, 128), "int8": (8, 0)}
    return sorted({instantiation(np.float16, *bits[f], t) for f in SWEEP_FORMATS for k, n in SHAPES
                   for t in sweep_tiles(bits[f][0], k, n)})

def _random_weight(cp, fmt, n, k):
    if fmt == "fp16":
        return (cp.random.standard_normal((n, k), dtype=cp.float32) / np.sqrt(k)).astype(cp.float16)
    if fmt == "int8":
        return Int8Weight(cp.random.randint(-127, 128, (n, k)).astype(cp.int8),
                          cp.full((n,), 0.01 / np.sqrt(k), cp.float16), (n, k))
    groups = k // 128
    return Int4Weight(cp.random.randint(0, 256, (n, k // 2), dtype=cp.uint8).view(cp.uint32),
                      cp.full((n, groups), 0.1 / np.sqrt(k), cp.float16), cp.full((n, groups), 8, cp.float16),
                      128, (n, k))


def queued_ms(cp, busy, fn, reps=REPS, warmup=3, iters=15):
    """Median milliseconds per fn() over `reps` calls queued behind >= ~2 ms of copies (`busy`: a
    pair of 1 GB arrays): Python enqueues the calls while the GPU copies, so they run back to back
    and the CUDA events bracket GPU time, not the 10-20 us Python launch cost of each call. A sample
    whose start event had already passed when the last call was queued (the GPU may have waited on
    Python: seen as 4-10x outliers on the H100) is dropped and the head start grows by a copy.
    cupy.matmul cannot be captured in a CUDA graph (cuBLAS under stream capture is refused), so
    ours, cuBLAS and torch (same legacy default stream) are all timed this one way."""
    for _ in range(warmup):
        fn()
    times, copies = [], 3
    while len(times) < iters:
        for _ in range(copies):
            cp.copyto(busy[1], busy[0])
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(reps):
            fn()
        starved = start.done
        stop.record()
        stop.synchronize()
        if starved and copies < 24:
            copies += 1
            continue
        times.append(cp.cuda.get_elapsed_time(start, stop) / reps)
    times.sort()
    return times[len(times) // 2]


def _copies(make):
    """Enough weight copies (at most REPS) to hold ROTATE_BYTES, so the L2 cannot keep them."""
    first = make()
    return [first] + [make() for _ in range(min(REPS, -(-ROTATE_BYTES // first.nbytes)) - 1)]


def _cycle(fns):
    state = {"i": 0}

    def step():
        fns[state["i"] % len(fns)]()
        state["i"] += 1
    return step


def _sweep(cp, busy):
    rows = []
    for k, n in SHAPES:
        x = cp.random.standard_normal((1, k), dtype=cp.float32).astype(cp.float16)
        out = cp.empty((1, n), cp.float16)
        for fmt in SWEEP_FORMATS:
            copies = _copies(lambda: _random_weight(cp, fmt, n, k))
            bits = 4 if fmt == "int4" else 8
            chosen = tile_config(bits, 1, n, k)
            for t in sweep_tiles(bits, k, n):
                fns = [lambda w=w, t=t: _gemv(x, w, None, out, t) for w in copies]
                ms = queued_ms(cp, busy, _cycle(fns))
                mark = " (tile_config)" if t == chosen else ""
                rows.append(dict(name=f"{fmt} w{t.warps} u{t.u} split{t.split}{mark}", shape=f"M=1 K={k} N={n}",
                                 dtype="float16", ms=ms, bytes=copies[0].nbytes + x.nbytes + out.nbytes))
            del copies
            cp.get_default_memory_pool().free_all_blocks()
    return rows


def run(args):
    cp = runtime.require_cupy()
    if args.sweep:
        return _sweep(cp, (cp.zeros(1 << 28, cp.float32), cp.empty(1 << 28, cp.float32)))
    torch = bench.torch_or_none()
    rows, sums = [], {}
    busy = (cp.zeros(1 << 28, cp.float32), cp.empty(1 << 28, cp.float32))
    for k, n in SHAPES:
        for m in args.m:
            x = cp.random.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
            out = cp.empty((m, n), cp.float16)
            io_bytes = x.nbytes + out.nbytes
            nbytes16 = n * k * 2
            ws = _copies(lambda: _random_weight(cp, "fp16", n, k))
            peer_ms = queued_ms(cp, busy, _cycle([lambda w=w: cp.matmul(x, w.T, out=out) for w in ws]), REPS)
            shape = f"M={m} K={k} N={n}"
            measured = [("cublas fp16", peer_ms, nbytes16)]
            for fmt in ("fp16", "int8", "int4"):
                copies = ws if fmt == "fp16" else _copies(lambda: _random_weight(cp, fmt, n, k))
                ms = queued_ms(cp, busy, _cycle([lambda w=w: linear(x, w, out=out) for w in copies]), REPS)
                measured.append((f"ours {fmt if fmt != 'int4' else 'int4 g128'}", ms, copies[0].nbytes))
                del copies
            if torch is not None:
                tx = torch.randn(m, k, device="cuda", dtype=torch.float16)
                tws = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in ws]
                f = torch.nn.functional.linear
                measured.append(("torch fp16", queued_ms(cp, busy, _cycle([lambda w=w: f(tx, w) for w in tws]), REPS),
                                 nbytes16))
                del tws
            del ws
            for name, ms, wbytes in measured:
                rows.append(dict(name=name, shape=shape, dtype="float16", ms=ms, bytes=wbytes + io_bytes,
                                 peer="cublas fp16", peer_ms=peer_ms))
                s = sums.setdefault((m, name), [0.0, 0, 0.0])
                s[0] += ms
                s[1] += wbytes + io_bytes
                s[2] += peer_ms
            cp.get_default_memory_pool().free_all_blocks()
    for (m, name), (ms, nbytes, peer_ms) in sums.items():
        rows.append(dict(name=f"sum {name}", shape=f"M={m}, 5 shapes", dtype="float16", ms=ms, bytes=nbytes,
                         peer="cublas fp16", peer_ms=peer_ms))
    return rows
