"""Hopper ceilings for the wgmma GEMM: bulk-copy streams into shared memory and the wgmma issue rate.

Rows (cuda_src/probe.cu, sm_90 only):
- bulk copies from HBM: one block an SM each streaming its own run of a 1 GiB buffer through
  a ring of shared-memory slots, one copy a slot; GB/s of the bytes read;
- bulk copies from L2: the same, every block reading one 1 MB region over and over;
- the wgmma GEMM's streams of gate_up (llama3-8b, 4096 x 28672 int4 g128) without its multiplies:
  224 blocks of 32 stages, each 8 KB of weights from HBM and the x tile from L2 (32 KB at 128 rows,
  16 KB at 64), ring depths as the kernel's; GB/s counts the weights' bytes; the same for int8 at 32
  rows (16 KB of weights and 8 KB of x a stage, 6 slots), as contiguous runs and as the kernel
  copies them (a tensor-map box of a block's 128 rows x 128 bytes of an [N, K] int8 weight);
- one SM's ceiling: the HBM row on 16 blocks, too few to load HBM, so that its GB/s / 16 is what a
  block streams by itself; the int8 streams (240 stages a block) on 16, 66 and 96 blocks and one an
  SM: where the stream stops scaling with the blocks, and what the box form costs at each (the split
  GEMM calls run 96 blocks at 17-128 rows), against stage-long runs (an int8 weight stored a stage
  of 128 rows x 128 k contiguous) and 16-row tiles (stored as int4's tiles16, eight 2 KB copies a
  stage);
- wgmma m64nNk16 with one block an SM: FLOP an SM-cycle (the H100's dense fp16 peak is 4,096) and
  TFLOP/s, by N, warpgroups, A from registers (RS) or shared memory (SS), and the wait after each
  group of 8 (all, or all but the last).
The stream rows time the copies alone (the consumers only wait and release; the GPU tests check that
the same copies land every word), each the median of three timed passes after a warm-up, its
launches rotating over the buffer so that no pass reads what the previous left in L2.
"""
from __future__ import annotations

from .. import bench
from ..cli import int_in
from ..ops import probe, runtime

GIB = 1 << 30


def add_arguments(parser):
    parser.add_argument("--iters", type=int_in(1, 100000), default=2000,
                        help="groups of 8 wgmma a warpgroup issues (its accumulators stay exact up to 131,072)")


def stream_row(cp, w, x, name, grid, stages, shape, x_wrap, layout="runs"):
    slots, wb, xb = shape
    per_launch = grid * stages * wb
    launches = max(1, min(20, GIB // max(per_launch, 1)))
    out = cp.zeros(1, cp.uint64)

    def passes():
        for j in range(launches):
            probe.stream_probe(w[j * per_launch:], x, grid, stages, shape, x_wrap, out=out, checksum=False,
                               layout=layout)

    ms = bench.time_ms(passes, warmup=1, iters=3) / launches
    landed = grid * stages * (wb + xb)
    return dict(name=name, shape=f"{grid} blocks x {stages} stages, {slots} slots of {wb // 1024} KB HBM + "
                f"{xb // 1024} KB L2 ({landed / ms / 1e6:,.0f} GB/s landed)", dtype="uint8", ms=ms,
                bytes=per_launch if wb else landed)


def run(args):
    cp = runtime.require_cupy()
    sms = runtime.device_info()["sm_count"]
    w = cp.random.randint(0, 256, GIB, dtype=cp.uint8)
    x = cp.random.randint(0, 256, 1 << 20, dtype=cp.uint8)
    rows = [stream_row(cp, w, x, "bulk copy HBM -> shared", sms, 240, (4, 32768, 0), 1 << 20),
            stream_row(cp, w, x, "bulk copy L2 -> shared", sms, 512, (4, 0, 32768), 1 << 20),
            stream_row(cp, w, x, "gate_up's streams, 128 rows", 224, 32, (4, 8192, 32768), 1 << 20),
            stream_row(cp, w, x, "gate_up's streams, 64 rows", 224, 32, (6, 8192, 16384), 1 << 19),
            stream_row(cp, w, x, "int8 gate_up's streams, 32 rows", 224, 32, (6, 16384, 8192), 1 << 20),
            stream_row(cp, w, x, "the same in the int8 GEMM's boxes", 224, 32, (6, 16384, 8192), 1 << 20, "box"),
            stream_row(cp, w, x, "bulk copy HBM -> shared, 16 blocks", 16, 240, (4, 32768, 0), 1 << 20)]
    for grid in (16, 66, 96, sms):
        rows += [stream_row(cp, w, x, f"int8 streams, 32 rows, {grid} blocks", grid, 240, (6, 16384, 8192), 1 << 20),
                 stream_row(cp, w, x, "the same in the int8 GEMM's boxes", grid, 240, (6, 16384, 8192), 1 << 20, "box"),
                 stream_row(cp, w, x, "the same in 16-row tiles", grid, 240, (6, 16384, 8192), 1 << 20, "tiles")]
    for nx, wgs, regs, wait in probe.WGMMA_SHAPES:
        probe.wgmma_probe(nx, wgs, regs, wait, 10, sms)
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        cycles, acc = probe.wgmma_probe(nx, wgs, regs, wait, args.iters, sms)
        b.record()
        b.synchronize()
        if not bool((acc == 128.0 * args.iters).all()):
            raise runtime.CuinferError(f"wgmma_probe N={nx}: accumulators {acc[:4].get()} != {128 * args.iters}")
        flops = sms * wgs * args.iters * 8 * 64 * nx * 16 * 2
        per_cycle = flops / sms / float(cycles.max())
        rows.append(dict(name=f"wgmma m64n{nx}k16 {'RS' if regs else 'SS'}",
                         shape=f"{wgs} warpgroups, wait<{wait}>: {per_cycle:,.0f} FLOP/SM-cycle", dtype="float16",
                         ms=cp.cuda.get_elapsed_time(a, b), flops=flops))
    return rows
