"""Linear layers: decode GEMV with fp16, INT8 and INT4 g128 weights against cuBLAS and torch fp16.

Llama-3-8B shapes (in_features K, out_features N) at M = 1, 4, 16 rows of x (decode GEMVs) and 32,
64, 128, 256 (the serving batches: quantized weights through the GEMM of ops.linear_mma, fp16
through cuBLAS). Bytes = the
weight's bytes (qweight + scales + zeros) plus x and y. Every variant, ours and the
peers', is timed over 20 back-to-back calls queued behind a long copy (queued_ms) that cycle
through enough weight copies (>= 120 MB) that each call streams its weight from HBM, not
from the 50 MB L2.
The peer of every row is cupy.matmul (cuBLAS) on an fp16 weight of the same shape; a
`torch fp16` row (torch.nn.functional.linear) per shape is measured in the same run.
`--sweep PRESET` instead times every M = 1 tile of the preset's four decode GEMVs with their fused
epilogues (norm, SwiGLU, residual), as a decode graph replays them (docs/linear.md); `--sweep-m 1 5 9`
adds tile_config's tile at those rows of x (a small batch, a verify step's k + 1 rows).
`--mma-sweep` instead times the quantized GEMM (ops.linear_mma) at each --m with mma_tile's tile and
its neighbours (split, warps, stages, NT) on the five shapes.
`--layer PRESET` instead times one decoder layer's four linear calls at each --m as the engine makes
them (ops.linear: qkv and gate_up with their RMSNorm, gate_up's SiLU, o and down with the residual),
per --formats, against the fp16 layer (cuBLAS above 16 rows) in the same run.
`--timeline PRESET` instead runs each of those calls that a GEMM (mma.sync or wgmma) takes at each --m
once in its CUINFER_TIMELINE build (replayed from a CUDA graph after warm-up, on a weight copy not in L2;
a call of two launches, MmaTile's tail, with the second's blocks as they start in decode) and summarizes its blocks'
stamps: when the first stage was ready, how long the main loop and the epilogue took (medians over
blocks, us; with a split, the epilogue's parts: the wait until every block of the cluster holds its
results, reading the block's sums from them, storing them, and the closing barrier), and when the
blocks started and ended after the first one's start.
"""
from __future__ import annotations

import itertools

import numpy as np

from .. import bench
from ..cli import int_in
from ..ops import runtime
from ..ops.linear import GEMV_ROWS, QUAD_K, Tile, _gemv, instantiation, linear, route, stages_x, tile_config
from ..ops.linear_mma import _launch as mma_launch
from ..ops.linear_mma import instantiation as mma_instantiation
from ..ops.linear_mma import mma_tile, smem_bytes
from ..ops.quant import Int4Weight, Int8Weight

SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256)]
ROWS_M = (1, 4, 16, 32, 64, 128, 256)
REPS = 20
ROTATE_BYTES = 120 << 20


def add_arguments(parser):
    parser.add_argument("--m", type=int, nargs="*", default=list(ROWS_M), help="rows of x")
    parser.add_argument("--sweep", metavar="PRESET",
                        help="instead: time every M = 1 tile of the decode GEMVs of a models/*.json preset")
    parser.add_argument("--formats", default="int4,int8",
                        help="--sweep's, --mma-sweep's and --layer's weight formats: fp16, int8, int4")
    parser.add_argument("--sweep-m", type=int_in(1, GEMV_ROWS), nargs="*", default=[1],
                        help="--sweep's rows of x, 1..16: every tile at 1, tile_config's at the others")
    parser.add_argument("--mma-sweep", action="store_true",
                        help="instead: time the quantized GEMM's tiles around mma_tile's pick at each --m")
    parser.add_argument("--timeline", metavar="PRESET",
                        help="instead: the GEMMs' per-block timelines of a preset's layer calls at each --m")
    parser.add_argument("--layer", metavar="PRESET",
                        help="instead: time a decoder layer's four linear calls of a models/*.json preset at each --m")


SWEEP_BITS = {"fp16": (16, 0), "int8": (8, 0), "int4": (4, 128)}


def decode_gemvs(config):
    """(name, K, N, epilogue, norm, residual) of a decoder layer's GEMVs as Model.layer calls them."""
    h, inter = config.hidden_size, config.intermediate_size
    return [("qkv", h, config.q_size + 2 * config.kv_size, "store", True, False),
            ("o", config.q_size, h, "store", False, True),
            ("gate_up", h, inter, "silu_and_mul", True, False), ("down", inter, h, "store", False, True)]


def sweep_tiles(bits, k, n, epilogue, m=1):
    """M = 1 tiles: U 1, 2, 4, 4 / 8 / 16 warps, split 1 / 2 / 4 where every warp gets a quad (with the
    SiLU epilogue half the warps share K), plus tile_config's choice; more rows: that choice only."""
    if m > 1:
        return [tile_config(bits, m, n, k, epilogue)]
    quads = -(-k // QUAD_K[bits])
    halves = 2 if epilogue == "silu_and_mul" else 1
    tiles = {Tile(1, 1, u, w, s) for u in (1, 2, 4) for w in (4, 8, 16) for s in (1, 2, 4) if quads * halves >= s * w * u}
    return sorted(tiles | {tile_config(bits, 1, n, k, epilogue)})


def _random_weight(cp, fmt, n, k):
    if fmt == "fp16":
        return (cp.random.standard_normal((n, k), dtype=cp.float32) / np.sqrt(k)).astype(cp.float16)
    if fmt == "int8":
        return Int8Weight(cp.random.randint(-127, 128, (n, k)).astype(cp.int8),
                          cp.full((n,), 0.01 / np.sqrt(k), cp.float16), (n, k))
    q = cp.random.randint(0, 16, (n, k), dtype=cp.uint8)
    # zero 8: integer zero points, so the GEMV takes its IZ kernels (as the minmax quantizer's weights)
    return Int4Weight.pack(q, cp.full((n, k // 128), 0.1 / np.sqrt(k), cp.float16), cp.full((n, k // 128), 8, cp.float16), 128)


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


def _sweep(cp, preset, formats, ms=(1,)):
    """Each decode GEMV of the preset with its fused epilogue, per tile: one CUDA graph of one call per
    weight copy (>= ROTATE_BYTES of copies: HBM, not L2), its kernels launched as a decode replay
    launches them (programmatic dependent launch on sm_90); ms per call."""
    from ..convert import load_preset
    from ..serving.runner import capture

    gemvs = decode_gemvs(load_preset(preset))
    exprs = {instantiation(np.float16, *SWEEP_BITS[f], t, e, stages_x(m, k, np.float16, norm), True) for f in formats
             for _, k, n, e, norm, _ in gemvs for m in ms for t in sweep_tiles(SWEEP_BITS[f][0], k, n, e, m)}
    runtime.precompile([("linear", e) for e in exprs])  # NVRTC on every core; the runs below load the cubins
    rows = []
    for fmt in formats:
        bits = SWEEP_BITS[fmt][0]
        for (name, k, n, epi, norm, res), m in itertools.product(gemvs, ms):
            copies = _copies(lambda: _random_weight(cp, fmt, 2 * n if epi == "silu_and_mul" else n, k))
            x = cp.random.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
            norm_w = (1 + 0.05 * cp.random.standard_normal(k, dtype=cp.float32)).astype(cp.float16)
            residual = cp.random.standard_normal((m, n), dtype=cp.float32).astype(cp.float16)
            out = cp.empty((m, n), cp.float16)
            for t in sweep_tiles(bits, k, n, epi, m):
                def calls(t=t):
                    for w in copies:
                        _gemv(x, w, None, out, t, epi, norm=(norm_w, 1e-5) if norm else None,
                              residual=residual if res else None)
                cp.cuda.Device().synchronize()
                graph, _, _ = capture(calls, cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool())
                mark = " (tile_config)" if t == tile_config(bits, m, n, k, epi) else ""
                occ = f" occ{t.occupancy}" if t.occupancy else ""
                rows.append(dict(name=f"{fmt} {name} u{t.u} w{t.warps} split{t.split}{occ}{mark}",
                                 shape=f"M={m} K={k} N={n} {epi}{' norm' if norm else ''}{' residual' if res else ''}",
                                 dtype="float16", ms=bench.time_ms(graph.launch, warmup=2, iters=7) / len(copies),
                                 bytes=copies[0].nbytes + x.nbytes + out.nbytes))
                del graph
            del copies
            cp.get_default_memory_pool().free_all_blocks()
    return rows


def mma_sweep_tiles(bits, m, n, k):
    """mma_tile's pick and its neighbours: every split, the other warp count, 8 warps (256 weight rows a
    block: half the x reads from L2 per weight byte; 1 block an SM), 4 stages, the other NT, and for
    int8 RT = 4 with NT = 4 (186 registers; int4 RT = 4 spills)."""
    base = mma_tile(bits, m, n, k)
    tiles = {base, base._replace(warps=6 - base.warps), base._replace(warps=8, minb=1), base._replace(stages=4, minb=2)}
    tiles |= {base._replace(split=s) for s in (1, 2, 4, 8)} | {base._replace(nt=12 - base.nt, minb=2)}
    if bits == 8:
        tiles.add(base._replace(nt=4, rt=4, minb=2))
    return sorted(t for t in tiles if t.minb * (smem_bytes(bits, 128, t) + 1024) <= 228 * 1024)


def _mma_sweep(cp, rows_m, formats):
    """ms per GEMM launch (ops.linear_mma._launch, queued as run() times linear) for each tile."""
    formats = [f for f in formats if f != "fp16"]
    cases = [(k, n, m, f) for k, n in SHAPES for m in rows_m for f in formats]
    exprs = {mma_instantiation(np.float16, *SWEEP_BITS[f], True, t) for k, n, m, f in cases
             for t in mma_sweep_tiles(SWEEP_BITS[f][0], m, n, k)}
    runtime.precompile([("linear_mma", e) for e in exprs])
    busy = (cp.zeros(1 << 28, cp.float32), cp.empty(1 << 28, cp.float32))
    rows = []
    for k, n, m, fmt in cases:
        bits = SWEEP_BITS[fmt][0]
        copies = _copies(lambda: _random_weight(cp, fmt, n, k))  # noqa: B023 (called at once)
        x = cp.random.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
        out = cp.empty((m, n), cp.float16)
        pick = mma_tile(bits, m, n, k)
        for t in mma_sweep_tiles(bits, m, n, k):
            ms = queued_ms(cp, busy, _cycle([lambda w=w, t=t: mma_launch(x, w, None, None, out, t) for w in copies]))
            rows.append(dict(name=f"{fmt} nt{t.nt} w{t.warps} st{t.stages} split{t.split} minb{t.minb}"
                             f"{' (mma_tile)' if t == pick else ''}", shape=f"M={m} K={k} N={n}", dtype="float16",
                             ms=ms, bytes=copies[0].nbytes + x.nbytes + out.nbytes))
        del copies
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def _layer(cp, preset, rows_m, formats):
    """Each of a layer's four linear calls (decode_gemvs) through ops.linear, with its norm, residual
    and activation, from a CUDA graph of one call per layer copy (two copies: HBM, not L2); a row per
    format and M: ms per layer, each call's us in the shape column. The peer is the fp16 layer."""
    from ..convert import load_preset
    from ..serving.runner import capture

    gemvs = decode_gemvs(load_preset(preset))
    rows = []
    for m in rows_m:
        peer_ms = None
        for fmt in ["fp16"] + [f for f in formats if f != "fp16"]:
            total, nbytes, cells = 0.0, 0, []
            for name, k, n, epi, norm, res in gemvs:
                copies = [_random_weight(cp, fmt, 2 * n if epi != "store" else n, k) for _ in range(2)]
                x = cp.random.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
                norm_w = (1 + 0.05 * cp.random.standard_normal(k, dtype=cp.float32)).astype(cp.float16)
                residual = cp.random.standard_normal((m, n), dtype=cp.float32).astype(cp.float16)
                out = cp.empty((m, n), cp.float16)

                def calls(copies=copies, x=x, norm_w=norm_w, residual=residual, out=out, epi=epi, norm=norm, res=res):
                    for w in copies:
                        linear(x, w, activation=None if epi == "store" else epi, norm=(norm_w, 1e-5) if norm else None,
                               residual=residual if res else None, out=out)
                cp.cuda.Device().synchronize()
                graph, _, _ = capture(calls, cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool())
                ms = bench.time_ms(graph.launch, warmup=2, iters=7) / len(copies)
                total += ms
                nbytes += copies[0].nbytes + x.nbytes + out.nbytes
                cells.append(f"{name} {1000 * ms:.1f}")
                del graph, copies
                cp.get_default_memory_pool().free_all_blocks()
            peer_ms = peer_ms or total
            rows.append(dict(name=f"{preset} layer {fmt}", shape=f"M={m}: " + ", ".join(cells) + " us", dtype="float16",
                             ms=total, bytes=nbytes, peer="fp16 (cuBLAS)", peer_ms=peer_ms))
    return rows


def _timeline(cp, preset, rows_m, formats):
    """One row per GEMM call of the preset's layer at each M and format (see the module docstring);
    ms: the call's span, first block start to last block end."""
    from ..convert import load_preset
    from ..ops.linear_mma import WgTile, _launch, call_tile, kernel_instantiation, tile_launches
    from ..serving.runner import capture

    rows = []
    for m, fmt, (name, k, n, epi, _, _) in itertools.product(rows_m, formats, decode_gemvs(load_preset(preset))):
        copies = [_random_weight(cp, fmt, 2 * n if epi != "store" else n, k) for _ in range(3)]
        if route(copies[0], m, k, epi) != "mma":
            continue  # the call is a GEMV's or cuBLAS's
        x = cp.random.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
        out, tile = cp.empty((m, n), cp.float16), call_tile(copies[0], m, n, k, epi)
        wg = isinstance(tile, WgTile)
        stamps = [runtime.module_global("linear_mma", kernel_instantiation(x.dtype, copies[0], t, epi),
                                        "linear_timeline", cp.uint64, (1024, 10), ("CUINFER_TIMELINE",))
                  for t, _, _ in tile_launches(tile)]  # a tail's launch stamps its own module's array
        graph, _, _ = capture(lambda w=copies[0]: _launch(x, w, None, None, out, tile, epi, timeline=True),
                              cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool())
        for w in copies[1:] * 2:  # copies[0] out of L2
            _launch(x, w, None, None, out, tile, epi, timeline=True)
        cp.cuda.Device().synchronize()
        for a in stamps:
            a[...] = 0
        graph.launch()
        cp.cuda.Device().synchronize()
        a = np.concatenate([cp.asnumpy(a).astype(np.int64) for a in stamps])
        # start ns, start clock, first stage, loop end, exit clock, exit ns, cluster's results, SM, sums read, stored
        a = a[a[:, 0] > 0]
        clocks_ns = np.median((a[:, 4] - a[:, 1]) / np.maximum(a[:, 5] - a[:, 0], 1))
        first, loop, epi_us = (np.median(a[:, j + 1] - a[:, j]) / clocks_ns / 1e3 for j in (1, 2, 3))
        parts = (np.median(a[:, j] - a[:, i]) / clocks_ns / 1e3 for i, j in ((3, 6), (6, 8), (8, 9), (9, 4)))
        wait = (" ({:.2f} until the cluster's results, {:.2f} reading them, {:.2f} storing, {:.2f} at the closing "
                "barrier)".format(*parts)) if tile.split > 1 else ""
        start, end = (a[:, 0] - a[:, 0].min()) / 1e3, (a[:, 5] - a[:, 0].min()) / 1e3
        rows.append(dict(
            name=f"{preset} {name} {fmt} M={m}", dtype="float16", ms=end.max() / 1e3, bytes=copies[0].nbytes,
            shape=f"{'wgmma' if wg else 'mma.sync'}, {len(a)} blocks on {len(set(a[:, 7]))} SMs, split {tile.split}"
                  f"{f' (tiles past {tile.head}: {tile.tail})' if not wg and tile.tail else ''}: "
                  f"first stage {first:.2f}, main loop {loop:.2f}, epilogue {epi_us:.2f}{wait} us; starts within "
                  f"{start.max():.2f}, ends {end.min():.2f}-{end.max():.2f} us"))
        del copies
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def run(args):
    cp = runtime.require_cupy()
    formats = [f.strip() for f in args.formats.split(",")]
    if any(f not in SWEEP_BITS for f in formats):
        raise runtime.CuinferError(f"--formats: got {args.formats!r}, need fp16, int8, int4")
    if args.timeline:
        return _timeline(cp, args.timeline, args.m, formats)
    if args.layer:
        return _layer(cp, args.layer, args.m, formats)
    if args.mma_sweep:
        return _mma_sweep(cp, args.m, formats)
    if args.sweep:
        return _sweep(cp, args.sweep, formats, args.sweep_m)
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
