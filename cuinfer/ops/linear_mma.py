"""Linear layers past the GEMV's rows of x: the tensor-core GEMMs of cuda_src/linear_mma.cu (and linear_wgmma.cuh).

linear_mma(x, w, bias=None, out=None, activation=None, residual=None, norm=None) -> [M, N] in x's dtype
    x: [M, K] fp16 / bf16; w: cuinfer.ops.quant.Int8Weight or Int4Weight [N, K], or on sm_90 an fp16 /
    bf16 array of x's dtype the wgmma kernel takes (wgmma_fits); bias: [N].
    activation="silu_and_mul" / "gelu_and_mul": w is the stacked [gate; up] weight [2I, K] (bias [2I])
    and the result is act(x @ gate.T) * (x @ up.T), [M, I], both sums in fp32, rounded once.
    residual: [M, N] (store only, not aliasing out): round(round(y) + residual).
    norm: (weight [K], eps): x is RMS-normalized first, with ops.rms_norm's roundings (the wgmma path
    in its x pass, the mma.sync one by ops.rms_norm).
ops.linear dispatches here for quantized weights at MMA_MIN_M <= M <= MMA_MAX_M, int8 and int4 ones
the wgmma kernel takes (wgmma_fits) up to WGMMA_MAX_M and fp16 / bf16 ones up to WGMMA16_MAX_M
(docs/linear.md).

Two kernels. linear_mma_kernel (mma.sync): the weight dequantized in registers to exact values of T,
int4 group scales and int8 row scales applied in fp32, so y is x @ dequantize(W).T in fp32 rounded
once, as the decode GEMV computes it; each block stages 16 RT WARPS weight rows and 8 NT x rows per 128
k through a cp.async ring. linear_wgmma_kernel (sm_90; int8, and int4 with integer zeros from
WGMMA_MIN_M rows): wgmma_x_kernel first lays x out in the order of the weight fragments (a scratch
array from the current memory pool); one producer warp fills a ring with bulk copies of the packed
weight tiles (four stages a copy), another a ring with that x; two consumer warpgroups dequantize their
words straight into wgmma's A fragments as round((q - z) scale) in T, dequantize() rounded to T as the
cuBLAS path's scratch holds it. 16-bit weights: one TMA copy a stage through the weight's tensor map in
device memory (weight_map), both wgmma operands from shared memory. int8 weights: the bytes by TMA as
they are, converted to exact values of T in registers, the row scales in the epilogue. Small grids
split K over a thread-block cluster (sm_90), reduced in a fixed order through distributed shared
memory; a split mma.sync grid past one wave is two launches, the tiles past the first wave at twice
the split (MmaTile.head / tail, tile_launches). With `out` given, the mma.sync kernel allocates nothing
and the wgmma path only its x scratch from the current pool (CUDA-graph safe: a capture allocates from
its own pool).
numpy arrays run the reference: dequantize to float32, matmul in float32, epilogue, round.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import driver, runtime
from .activation import act_and_mul_reference
from .quant import GROUP_SIZES, TILE_ROWS, Int4Weight, Int8Weight
from .rms_norm import rms_norm, rms_norm_reference

KERNEL_DTYPES = (np.dtype(np.float16), runtime.bfloat16)
# rows of x ops.linear sends here (below: the GEMV; above: cuBLAS on a dequantized copy). The mma.sync
# kernel takes MMA_MIN_M..MMA_MAX_M rows (from 9 rows, where it and the int8 wgmma kernel beat the GEMV:
# ops.linear.GEMV_MAX_M; past 128 cuBLAS on the copy was faster: llama3-8b int4 decode
# at b=256 13,380 tok/s against 12,010), the wgmma kernel (sm_90, int8 and int4 with integer zeros:
# wgmma_fits) up to WGMMA_MAX_M, int4 from WGMMA_MIN_M (H100, a llama3-8b layer's four calls: against
# mma.sync 132 / 135 us at 48 / 64 rows where mma.sync took 156 / 151, 132 at 32 where it took 102;
# against cuBLAS on the copy 529 / 1,033 us at 512 / 1,024 rows where it took 541 / 846. int8, H200,
# llama3-8b decode against mma.sync: b=32 7,105 -> 7,825 tok/s, b=64 9,233 -> 13,960, b=128 10,750 ->
# 19,190).
MMA_MIN_M, MMA_MAX_M = 9, 128
WGMMA_MIN_M, WGMMA_MAX_M = 33, 256
# fp16 / bf16 weights: the wgmma kernel past the GEMV's rows (ops.linear.GEMV_MAX_M) up to WGMMA16_MAX_M on
# sm_90, then cuBLAS (H100, llama3-8b
# fp16 decode with the norm in the x pass: b=32 4,628 -> 4,855 tok/s, b=48 6,649 -> 6,742, b=64 8,436
# -> 8,771 against cuBLAS; H200, past 64 rows, NX = 128: b=128 16,820 against cuBLAS's 17,030, b=256
# 18,700 against 21,730)
WGMMA16_MAX_M = 64
WGMMA_K = 128  # k per stage of the wgmma kernel
WGMMA_SMEM = 227 * 1024  # the shared memory an sm_90 block may opt in to
WGMMA_CHUNK = 4  # stages per weight slot of the wgmma kernel (WGeo::kChunk)
EPILOGUES = {"store": 0, "silu_and_mul": 1, "gelu_and_mul": 3}  # MMA_EPI_* of linear_mma.cu
GATED = {"silu_and_mul": "silu", "gelu_and_mul": "gelu_tanh"}
STAGE_K = 128  # k per pipeline stage


class MmaTile(NamedTuple):
    nt: int  # n8 tiles of x rows per block (8 NT rows of x)
    rt: int  # m16 weight tiles per warp
    warps: int  # warps per block, each its own RT weight tiles (gated: half gate, half up)
    stages: int  # depth of the cp.async ring
    split: int  # blocks of a cluster splitting K (sm_90)
    minb: int  # blocks per SM the launch bounds promise (register cap 65536 / (32 WARPS MINB))
    head: int = 0  # with a tail: the tiles of the first launch (one wave)
    tail: int = 0  # the split of a second launch over the tiles past `head` (0: one launch)


def mma_tile(bits: int, m: int, n: int, k: int, epilogue="store", sms=132, clusters=True,
             integer_zeros=True) -> MmaTile:
    """The tile for M rows of x, N outputs and K inputs (ptxas -v, sm_90). RT = 2 (each x fragment
    feeds two weight tiles: shared-memory bandwidth), 4 warps, 3 stages. NT = 3 up to 24 rows (H200,
    llama3-8b int4 decode at b=24 against NT = 4: 6,351 / 6,362 -> 7,068 / 7,084 tok/s, the linear
    layers 3.05 -> 2.47 ms a step: the padding's multiplies cost more than their share of the
    instructions suggests), else NT = 4 with 3 blocks an SM
    (<= 168 registers, <= 75 KB each; int4 fractional zeros, whose zero sums take NT 4 more
    registers, at 2: they spill at 168); int8 above 32 rows NT = 8 with 2 blocks an SM (~150
    registers, ~100 KB): each dequantized weight fragment feeds twice the mma, and the weights are
    read (from L2) once per 64 rows of x instead of 32. int4 stays at NT = 4: with its per-group sums
    NT = 8 needs 230-255 registers and spills in half the configurations (bf16, fractional zeros,
    2 warps). 2 warps when even a split of 8 leaves most SMs idle (N = 1024); grids below one block
    per SM split K over a cluster of up to 8, each block keeping >= 4 stages. At NT = 3 and 4, grids of
    one to two blocks an SM split in two as well: at 1.7 blocks an SM (llama3-8b's gate_up at 17-32
    rows, 224 blocks) the kernel is latency-bound (ncu, H200: 10 % of the SM's warps active, a warp
    issuing every 4.2 cycles). H200, llama3-8b int4 decode, alternating in one process, tok/s: b=24
    7,107 -> 7,331, b=32 8,778 -> 8,803; at NT = 2 the split's epilogue costs more than the warps gain
    (b=16 5,550 -> 5,434), and qkv's 192 blocks split 8 instead of 4 lost (b=24 6,967, b=32 8,537).
    A grid that a fourth block an SM brings within one wave takes it where the stages fit (int4 NT <= 3):
    gate_up at 17-24 rows split in two, 448 blocks, b=20 6,162 -> 6,225 tok/s, b=24 7,297 -> 7,375 (H200,
    as above; every NT = 3 call at 4 an SM, the grids that fit one wave at 3 included, lost 6.5 %).
    Else a split grid past one wave (gate_up at 25-32 rows: 448 blocks for 396 slots) is two launches:
    the tiles of one wave at the split (head), the rest at twice it (tail), whose blocks take the SMs the
    first launch leaves and run their main loop before they wait for it (linear_mma.cu). H200, llama3-8b
    int4 decode b=32, alternating in one process: one launch 9,593 / 9,595 tok/s, the rest at 4 9,881 /
    9,913, at 8 9,762 / 9,777 (its epilogue 2 us longer, after the first launch's last block); gemma2-9b
    b=32 6,624 -> 6,788. A first launch of less than a wave lost (190 tiles of 224: 9,556 / 9,585)."""
    nt = 8 if bits == 8 and m > 32 else 2 if m <= 16 else 3 if m <= 24 else 4
    minb = 3 if nt <= 4 and (bits == 8 or integer_zeros) else 2
    stages_k = -(-k // STAGE_K)
    gated = epilogue in GATED

    def blocks(warps):
        return -(-n // (16 * 2 * (warps // 2 if gated else warps))) * -(-m // (8 * nt))

    warps = 2 if blocks(4) * 8 < sms else 4
    split = 1
    while (clusters and split < 8 and -(-stages_k // (2 * split)) >= 4
           and (blocks(warps) * split < sms or (split == 1 and nt in (3, 4) and blocks(warps) < 2 * sms))):
        split *= 2
    tile = MmaTile(nt, 2, warps, 3, split, minb)
    fourth = minb == 3 and 3 * sms < blocks(warps) * split <= 4 * sms  # a fourth block: the grid in one wave
    if fourth and 4 * (smem_bytes(bits, 32, tile) + 1024) <= 228 * 1024:
        return tile._replace(minb=4)  # at 128 registers (ptxas spills 20-36 bytes)
    slots, head, tail = minb * sms, minb * sms // split, 2 * split
    if (slots < blocks(warps) * split < 2 * slots and 1 < split < 8 and (blocks(warps) - head) * tail <= slots
            and -(-stages_k // tail) >= 4):  # a partial second wave: its tiles at twice the split
        return tile._replace(head=head, tail=tail)
    return tile


class WgTile(NamedTuple):
    nx: int  # x rows per block (wgmma's N: 16, 24, 32, 48, or a multiple of 32 to 224; 16-bit weights 16, 32, 64)
    wstages: int  # weight slots of WGMMA_CHUNK stages each (16-bit weights: one stage each)
    xstages: int  # x slots of a stage each
    split: int  # blocks of a cluster splitting K (sm_90)


def wgmma_tile(bits: int, m: int, n: int, k: int, epilogue="store", sms=132) -> WgTile:
    """The wgmma kernel's tile: 128 weight rows a block (64 outputs gated) times NX = 64 x rows up to 64 rows
    (16-bit weights 16 up to 16, 32 up to 32; int8 and int4 the smallest of 16, 24, 32 and 48 that holds the
    rows: H200, llama3-8b decode against NX = 64 at b=48, int4 11,350 -> 12,020 tok/s, int8 11,520 -> 12,020,
    int8 against NX = 32 at b=24 6,612 -> 6,733, against NX = 24 at b=16 4,633 -> 4,668), the rows rounded up to
    32 at 65-224 rows (one x tile, no more padding than 31 rows: at 129-192 rows two tiles of 128 had done the
    work of 256, H200, llama3-8b decode, NX = 192 against that: int4 b=160 / 192 16,640 / 18,660 -> 19,060 /
    21,050 tok/s, int8 16,190 / 18,080 -> 19,220 / 21,070), else 128 (NX = 256 at 256 rows, one tile, was no
    faster: int4 21,970 -> 21,770, int8 21,290 -> 21,340). int4: 2 weight slots (8 stages) and 4 x slots at NX =
    96 / 128, 2 and 6 at 48 / 64 (<= 209 KB at g32; H100, a llama3-8b layer's four calls at 64 / 128 / 256 rows:
    3 and 3 at NX = 128, 4 and 4 at 64 took 2.4 / 4.8 / 4.0 % longer, 4 and 2 no less: x, from L2, wants the
    deeper ring). K splits over a cluster of 3, else 2, where the grid then still fits one wave and each block
    keeps >= 8 stages of 128 k (H100, llama3-8b shapes at 128 rows: o split 1 / 2 / 3 / 4 43.2 / 25.6 / 21.5 /
    36.2 us, down 119.8 / 66.1 / 50.5 / 74.1; clusters of 4 were slower every time, as was a second wave).
    16-bit weights, whose copies are 32 KB stages (no dequantization: the kernel streams): NX = 16 up to 16 rows
    (H200, llama3-8b fp16 decode against NX = 32: b=8 1,667 -> 1,685 tok/s, b=16 3,218 -> 3,254), 32 up to 32, 4
    weight and 4 x slots (3 and 3 at NX = 128). int8 (16 KB stages): 4 and 4 at NX = 96 / 128, 6 and 6 at 48 /
    64 (H200, llama3-8b decode at b=64 / 128 against 4 + 8 / 3 + 5, 8 + 4 / 6 + 2 and 4 + 4 / 5 + 3: none did
    better, by 0.3-7 %), 6 and 6 at 32 (H200, b=32: no deeper or shallower ring did better, docs/linear.md "int8
    weights"). Above NX = 128 as many x slots as fit beside the weight ring, at most 4."""
    if bits == 16:
        nx = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    else:
        nx = next(t for t in (16, 24, 32, 48, 64) if t >= m) if m <= 64 else -(-m // 32) * 32 if m <= 224 else 128
    blocks = -(-n // (64 if epilogue in GATED else 128)) * -(-m // nx)
    split = next((s for s in (3, 2) if blocks * s <= sms and k // WGMMA_K >= 8 * s), 1)
    if bits == 16:
        return WgTile(nx, 3, 3, split) if nx == 128 else WgTile(nx, 4, 4, split)
    if nx > 128:  # as many x slots (NX x 256 bytes) as fit beside the weight ring, at most 4
        ws = 4 if bits == 8 else 2
        return next(t for t in (WgTile(nx, ws, x, split) for x in (4, 3, 2))
                    if wgmma_smem_bytes(bits, 32, t) <= WGMMA_SMEM)
    if bits == 8:
        return WgTile(nx, 4, 4, split) if nx >= 96 else WgTile(nx, 6, 6, split)
    return WgTile(nx, 2, 4, split) if nx >= 96 else WgTile(nx, 2, 6, split)


def wgmma_smem_bytes(bits: int, group_size: int, tile: WgTile) -> int:
    """Dynamic shared memory of the wgmma kernel (WGeo::kSmem of linear_wgmma.cuh)."""
    wslot = (2 * 128 * 128 if bits == 16 else 128 * 128 if bits == 8 else
             -(-(WGMMA_CHUNK * (8 * 1024 + 8 * (128 // group_size) * 64)) // 1024) * 1024)
    red = tile.nx * (128 + 4) * 4  # store_rows' results over the x slots (red_stride(128) floats a row)
    return max(tile.wstages * wslot + tile.xstages * tile.nx * 256, tile.wstages * wslot + red) + 1024


def wgmma_fits(w, k: int, activation=None) -> bool:
    """Whether the wgmma kernel takes this weight on this device: sm_90, K a multiple of its 128-k
    stage, and a C-contiguous fp16 / bf16 weight or Int8Weight's bytes 16-byte aligned (its tensor
    map), or int4 with integer zeros, the scales 16-byte aligned (bulk copies) and, gated, each half of
    the stacked weight whole 16-row tiles."""
    if runtime.device_info()["arch"] != "sm_90" or k % WGMMA_K:
        return False
    if isinstance(w, Int4Weight):
        return (w.integer_zeros and (activation not in GATED or w.shape[0] % 32 == 0)
                and w.scales_zeros.data.ptr % 16 == 0)
    a = w.qweight if isinstance(w, Int8Weight) else w  # what its tensor map reads
    return a.flags.c_contiguous and a.data.ptr % 16 == 0


def on_wgmma(w, m: int, k: int, activation=None) -> bool:
    """Whether linear_mma runs M rows of x by this weight on the wgmma kernel (wgmma_fits; int4 from
    WGMMA_MIN_M rows, below on mma.sync)."""
    return (not isinstance(w, Int4Weight) or m >= WGMMA_MIN_M) and wgmma_fits(w, k, activation)


def wgmma_instantiation(dtype, bits: int, group_size: int, tile: WgTile, epilogue="store") -> str:
    gs = group_size if bits == 4 else 0
    return (f"linear_wgmma_kernel<{runtime.ctype(dtype)}, {bits}, {gs}, {tile.nx}, {tile.wstages}, {tile.xstages}, "
            f"{tile.split}, {EPILOGUES[epilogue]}>")


def wgmma_x_instantiation(dtype, nx: int, bits: int, norm=False) -> str:
    """The x pass for the weight's bits: the k order of its fragments (ORDER 4 or 8; 16-bit weights 0,
    k in order)."""
    return f"wgmma_x_kernel<{runtime.ctype(dtype)}, {nx}, {bits % 16}, {'true' if norm else 'false'}>"


def is_plain(w) -> bool:
    """w is an unquantized weight: an fp16 / bf16 array, not an Int8Weight / Int4Weight."""
    return not isinstance(w, (Int8Weight, Int4Weight))


def smem_bytes(bits: int, group_size: int, tile: MmaTile) -> int:
    """Dynamic shared memory of the kernel (Geo::kSmem of linear_mma.cu)."""
    tiles = tile.rt * tile.warps
    stage = tiles * (1 if bits == 4 else 2) * 1024 + (tiles * (128 // group_size) * 64 if bits == 4 else 0)
    stage += 8 * tile.nt * (256 + (64 if bits == 4 else 16))
    return max(tile.stages * stage, 8 * tile.nt * (16 * tiles + 4) * 4)  # the ring, or store_rows' results


def instantiation(dtype, bits: int, group_size: int, integer_zeros: bool, tile: MmaTile, epilogue="store") -> str:
    iz = "true" if bits == 4 and integer_zeros else "false"
    gs = group_size if bits == 4 else 0
    return (f"linear_mma_kernel<{runtime.ctype(dtype)}, {bits}, {gs}, {iz}, {tile.nt}, {tile.rt}, {tile.warps}, "
            f"{tile.stages}, {tile.split}, {EPILOGUES[epilogue]}, {tile.minb}>")


def weight_bits(w) -> int:
    """16 for an fp16 / bf16 array, 8 for an Int8Weight, 4 for an Int4Weight."""
    return 16 if is_plain(w) else 4 if isinstance(w, Int4Weight) else 8


def call_tile(w, m: int, n: int, k: int, epilogue="store"):
    """The tile linear_mma runs M rows of x by w on (N outputs, K inputs) on this device: a WgTile where
    on_wgmma, else an MmaTile."""
    bits, info = weight_bits(w), runtime.device_info()
    if on_wgmma(w, m, k, epilogue):
        return wgmma_tile(bits, m, n, k, epilogue, info["sm_count"])
    return mma_tile(bits, m, n, k, epilogue, info["sm_count"], int(info["arch"][3:]) >= 90,
                    bits == 4 and w.integer_zeros)


def tile_launches(tile, tiles: int = 0) -> list:
    """(tile, first, end) for each launch of a call over `tiles` tiles: one, or with a tail (an MmaTile's)
    tiles [0, head) at its split and [head, tiles) at split `tail`."""
    if isinstance(tile, WgTile) or not tile.tail:
        return [(tile, 0, tiles)]
    head = min(tile.head, tiles)
    return [(tile._replace(head=0, tail=0), 0, head), (tile._replace(split=tile.tail, head=0, tail=0), head, tiles)]


def kernel_instantiation(dtype, w, tile, epilogue="store") -> str:
    """The kernel _launch runs with `tile` (a WgTile or an MmaTile) for weight w and x of `dtype`."""
    bits = weight_bits(w)
    gs = w.group_size if bits == 4 else 0
    if isinstance(tile, WgTile):
        return wgmma_instantiation(dtype, bits, gs, tile, epilogue)
    return instantiation(dtype, bits, gs, bits == 4 and w.integer_zeros, tile, epilogue)


def _formats():
    yield 8, 0, False
    for g in GROUP_SIZES:
        yield 4, g, True
        yield 4, g, False


INSTANTIATIONS = sorted(
    {instantiation(dt, b, g, iz, t, epi) for dt in KERNEL_DTYPES
     for b, g, iz in _formats()
     for m in (9, 17, 32, 64, 128) for n in (1024, 4096, 6144, 14336, 28672, 128256) for k in (4096, 14336)
     for epi in EPILOGUES
     if epi != "gelu_and_mul" or (m, n, k) == (64, 4096, 4096)  # GELU differs from SiLU in its activation only
     for t, _, _ in tile_launches(mma_tile(b, m, n, k, epi, integer_zeros=iz))}
    | {wgmma_instantiation(dt, b, g, wgmma_tile(b, m, n, k, epi), epi) for dt in KERNEL_DTYPES
       for b, g, iz in _formats() if iz and b == 4
       for m in (33, 49, 65, 96, 128, 160, 192, 224, 256) for n in (1024, 4096, 6144, 14336, 128256)
       for k in (4096, 14336)
       for epi in EPILOGUES
       if epi != "gelu_and_mul" or (m, n, k) == (128, 4096, 4096)}
    | {wgmma_instantiation(dt, 16, 0, wgmma_tile(16, m, n, k, epi), epi) for dt in KERNEL_DTYPES
       for m in (9, 17, 33) for n in (1024, 4096, 6144, 14336, 128256) for k in (4096, 14336)
       for epi in EPILOGUES
       if epi != "gelu_and_mul" or (m, n, k) == (33, 4096, 4096)}
    | {wgmma_instantiation(dt, 8, 0, wgmma_tile(8, m, n, k, epi), epi) for dt in KERNEL_DTYPES
       for m in (9, 17, 25, 33, 49, 65, 96, 128, 160, 192, 224, 256) for n in (1024, 4096, 6144, 14336, 128256)
       for k in (4096, 14336)
       for epi in EPILOGUES
       if epi != "gelu_and_mul" or (m, n, k) == (128, 4096, 4096)}
    | {wgmma_x_instantiation(dt, nx, bits, norm) for dt in KERNEL_DTYPES for nx, bits in
       ((16, 16), (32, 16), (64, 16), (16, 8), (24, 8), (32, 8),
        *((nx, b) for nx in (48, *range(64, 225, 32)) for b in (4, 8)))
       for norm in (False, True)})


def linear_mma_reference(x, w, bias=None, activation=None, residual=None):
    """x @ dequantize(W).T + bias in float32, the gated epilogue, rounded once to x's dtype, plus the residual
    rounded again."""
    y = np.asarray(x, np.float32) @ (np.asarray(w, np.float32) if is_plain(w) else w.dequantize()).T
    if bias is not None:
        y = y + np.asarray(bias, np.float32)
    y = (act_and_mul_reference(y, GATED[activation]) if activation else y).astype(x.dtype)
    if residual is not None:
        y = (y.astype(np.float32) + np.asarray(residual, np.float32)).astype(x.dtype)
    return y


def check_quant_weight(w, k: int, dev: bool) -> int:
    """Validate an Int8Weight / Int4Weight against in_features k, its arrays on the device iff dev
    (ops.linear's check of quantized weights too); returns its rows N."""
    if isinstance(w, Int8Weight):
        n = w.shape[0]
        runtime.check("w.qweight", w.qweight, dtype=np.int8, shape=(n, k))
        runtime.check("w.scales", w.scales, dtype=np.float16, shape=(n,))
        arrays = (w.qweight, w.scales)
    elif isinstance(w, Int4Weight):
        n = w.shape[0]
        if tuple(w.shape) != (n, k):
            raise ValueError(f"w: got shape {tuple(w.shape)}, need [*, {k}] (x has {k} columns)")
        if w.group_size not in GROUP_SIZES or k % w.group_size:
            raise ValueError(f"w.group_size: got {w.group_size}, need one of {GROUP_SIZES} dividing K = {k}")
        t = -(-n // TILE_ROWS)
        runtime.check("w.qweight", w.qweight, dtype=np.uint32, shape=(t, -(-k // 128), TILE_ROWS, 16))
        runtime.check("w.scales_zeros", w.scales_zeros, dtype=np.float16, shape=(t, k // w.group_size, TILE_ROWS, 2))
        arrays = (w.qweight, w.scales_zeros)
    else:
        raise ValueError(f"w: got {type(w).__name__}, need an Int8Weight or Int4Weight")  # noqa: TRY004 (DESIGN.md)
    if any(runtime.is_device_array(a) != dev for a in arrays):
        raise ValueError("w: weight arrays must be numpy for numpy x and cupy for cupy x "
                         "(quantized weights: w.to_device())")
    return n


def check_epilogue(x, n_w: int, bias, out, activation, residual):
    """(N, out) after the checks of the epilogue arguments that ops.linear and linear_mma share:
    x [M, K], n_w weight rows, bias [n_w], activation (then n_w = 2 N, [gate; up]), residual
    [M, N] (store only, not aliasing out), out [M, N] (None: a new array)."""
    m = x.shape[0]
    if activation is not None and activation not in GATED:
        raise ValueError(f"activation: got {activation!r}, need None, 'silu_and_mul' or 'gelu_and_mul'")
    if activation and n_w % 2:
        raise ValueError(f"w: got {n_w} rows, need an even number ([gate; up]) for activation={activation!r}")
    n = n_w // 2 if activation else n_w
    if bias is not None:
        runtime.check("bias", bias, dtype=x.dtype, shape=(n_w,))
    if residual is not None:
        if activation:
            raise ValueError("residual: only without activation (the store epilogue)")
        if residual is out:
            raise ValueError("residual: must not be out (the result is written before the residual is read)")
        runtime.check("residual", residual, dtype=x.dtype, shape=(m, n))
    return n, runtime.check_out(out, (m, n), x.dtype, x)


def linear_mma(x, w, bias=None, out=None, activation=None, residual=None, norm=None):
    """x @ W.T (+ bias) for a quantized W (or, sm_90, an fp16 / bf16 one the wgmma kernel takes), or
    act(gate) * up, plus a residual, of x or its RMSNorm: see the module docstring."""
    if norm is not None and not (isinstance(norm, tuple) and len(norm) == 2):
        raise ValueError("norm: need a (weight, eps) pair or None")
    dev = runtime.on_device(x, bias, out, residual, w if is_plain(w) else None, None if norm is None else norm[0])
    runtime.check("x", x, dtype=KERNEL_DTYPES, ndim=2)
    m, k = x.shape
    if is_plain(w):
        runtime.check("w", w, dtype=x.dtype, ndim=2)
        if w.shape[1] != k:
            raise ValueError(f"w: got shape {tuple(w.shape)}, need [*, {k}] (x has {k} columns)")
        n_w = w.shape[0]
    else:
        n_w = check_quant_weight(w, k, dev)
    n, out = check_epilogue(x, n_w, bias, out, activation, residual)
    if norm is not None:
        runtime.check("norm weight", norm[0], dtype=x.dtype, shape=(k,))
    if not dev:
        xn = x if norm is None else rms_norm_reference(x, *norm)
        out[...] = linear_mma_reference(xn, w, bias, activation, residual)
        return out
    bits = weight_bits(w)
    if bits == 16 and not wgmma_fits(w, k, activation):
        raise ValueError(f"w: {x.dtype} weights need sm_90, K a multiple of {WGMMA_K} and a C-contiguous, "
                         "16-byte aligned array (wgmma_fits)")
    weight = w if bits == 16 else w.qweight
    runtime.check("w" if bits == 16 else "w.qweight", weight, align=16)
    if bits == 4:
        runtime.check("w.scales_zeros", w.scales_zeros, align=4)
    if k % (need := 32 if bits == 4 else 16):
        raise ValueError(f"x: got K = {k} columns, need a multiple of {need} for {bits}-bit weights")
    runtime.check("x", x, align=16)
    runtime.check("out", out, align=2)
    if norm is not None:
        runtime.check("norm weight", norm[0], align=16)
    for name, a in (("x", x), ("w" if bits == 16 else "w.qweight", weight)):
        if a.nbytes >= 1 << 32:  # the kernel keeps byte offsets in 32 bits
            raise ValueError(f"{name}: got {a.nbytes} bytes, need < 4 GiB")
    if out is x or (residual is not None and residual is x):
        raise ValueError("out: must not be x")
    tile = call_tile(w, m, n, k, activation or "store")
    if isinstance(tile, WgTile):
        return _launch(x, w, bias, residual, out, tile, activation or "store", norm)
    if norm is not None:
        x = rms_norm(x, *norm)
    return _launch(x, w, bias, residual, out, tile, activation or "store")


def weight_map(w, gated: bool):
    """The device-memory tensor map through which the wgmma kernel copies a 16-bit weight [N', K]: the
    [K / 64, 1, N', 64] view in boxes of (2, 1, 128, 64), or gated the [K / 64, 2, N, 64] view ([gate;
    up], N = N' / 2) in boxes of (2, 2, 64, 64): a stage's 128 k of the block's 128 rows (gated: 64 gate
    and their 64 up rows) as two 64-k halves of 128 rows x 128 bytes. An Int8Weight: its bytes as 16-bit
    pairs, the [K / 128, G, N, 64] view in boxes of (1, G, 128 / G, 64), a stage 128 rows x 128 bytes."""
    if isinstance(w, Int8Weight):
        (n_w, k), q = w.shape, w.qweight.view(runtime.require_cupy().uint16)
        g = 2 if gated else 1
        return driver.tensor_map_device(q, (k // 128, g, n_w // g, 64), (128, n_w // g * k, k, 2),
                                         (1, g, 128 // g, 64))
    (n_w, k), e = w.shape, w.itemsize
    g = 2 if gated else 1
    shape, strides = (k // 64, g, n_w // g, 64), (64 * e, n_w // g * k * e, k * e, e)
    return driver.tensor_map_device(w, shape, strides, (2, g, 128 // g, 64))


def _launch(x, w, bias, residual, out, tile, epilogue="store", norm=None, timeline=False):
    """Launch linear_mma_kernel (an MmaTile) or linear_wgmma_kernel (a WgTile: wgmma_fits) with `tile` on
    checked arguments (tile.split > 1: sm_90 only; norm: WgTile only); an MmaTile with a tail as two
    launches, its first `head` tiles at its split and the rest at split `tail`. timeline: the
    CUINFER_TIMELINE build, which stamps its blocks into linear_timeline (bench linear --timeline)."""
    (m, k), bits = x.shape, weight_bits(w)
    n = out.shape[1]
    gs = w.group_size if bits == 4 else 0
    null = np.uint64(0)
    wg = isinstance(tile, WgTile)
    if wg and not wgmma_fits(w, k, epilogue):
        raise ValueError("the wgmma kernel does not take this weight (wgmma_fits)")
    defines = ("CUINFER_TIMELINE",) if timeline else ()
    weight = weight_map(w, epilogue in GATED) if bits == 16 or (wg and bits == 8) else w.qweight
    scales = null if bits == 16 else w.scales_zeros if bits == 4 else w.scales
    args = (x, weight, scales, null if bias is None else bias, null if residual is None else residual, out,
            np.int32(m), np.int32(n), np.int32(k))
    if wg:
        rows = -(-m // tile.nx) * tile.nx
        xs = runtime.require_cupy().empty((rows, k), x.dtype)  # x in the kernel's order, from the current pool
        runtime.launch(runtime.kernel("linear_mma", wgmma_x_instantiation(x.dtype, tile.nx, bits, norm is not None)),
                       (rows,), (128,), (x, xs, null if norm is None else norm[0],
                                         np.float32(0.0 if norm is None else norm[1]), np.int32(m), np.int32(k)))
        tiles = -(-n // (64 if epilogue in GATED else 128)) * -(-m // tile.nx)
        grid = (tiles if tile.split > 1 else min(tiles, runtime.device_info()["sm_count"]), tile.split)
        kern = runtime.kernel("linear_mma", kernel_instantiation(x.dtype, w, tile, epilogue), defines)
        runtime.launch(kern, grid, (384,), (xs,) + args[1:], wgmma_smem_bytes(bits, gs, tile))
        return out
    rows = 16 * tile.rt * (tile.warps // 2 if epilogue in GATED else tile.warps)
    for t, first, end in tile_launches(tile, -(-n // rows) * -(-m // (8 * tile.nt))):
        if end > first:
            kern = runtime.kernel("linear_mma", kernel_instantiation(x.dtype, w, t, epilogue), defines)
            runtime.launch(kern, (end - first, t.split), (32 * t.warps,), args + (np.int32(first),),
                           smem_bytes(bits, gs, t))
    return out
