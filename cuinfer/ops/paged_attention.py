"""Paged decode attention: one query token per sequence against a paged KV cache.

paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None, out=None, *,
                max_context_len=None, workspace=None, new_kv=None, qk_norm=None, window=0, softcap=None)
    q: [num_seqs, n_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, n_kv_heads, head_dim],
        q's dtype or uint8 fp8 E4M3 codes (cuinfer.ops.fp8: read decoded, new rows written encoded)
    block_tables: int32 [num_seqs, max_blocks_per_seq]; context_lens: int32 [num_seqs]
    returns [num_seqs, n_heads, head_dim] in q's dtype (zeros where context_lens is 0)
    window > 0: only the last `window` keys of each sequence are read and counted (the kernel's
    partitions start at context_lens - window); softcap as in flash_attention

new_kv=(k, v, slot_mapping, inv_freq) fuses write_kv into the call (decode: each sequence's new
token is its last, at position context_lens - 1): q and k are then un-rotated, and the call does
what write_kv(q, k, v, context_lens - 1, k_cache, v_cache, slot_mapping, inv_freq) followed by
paged_attention on the rotated q does, bit for bit, in one launch:
    k, v: [num_seqs, n_kv_heads, head_dim]; slot_mapping: int32 [num_seqs], the cache slot of
    position context_lens - 1 (block_tables' entry for it; < 0: no write); inv_freq: float32
    [head_dim // 2] (cuinfer.ops.rope.rope_inv_freq), or [num_seqs, head_dim // 2] (a row each:
    longrope's frequencies per sequence, as write_kv takes them). q, k, v may be views of one qkv row
    ([num_seqs, (n_heads + 2 * n_kv_heads) * head_dim]): rows any 16-byte multiple apart, heads
    contiguous within a row. A sequence with context_lens 0 writes nothing (and gives zeros).
    qk_norm=(q_norm, k_norm, eps) (with new_kv only): q and k heads RMS-normed first, as
    write_kv(..., q_norm=, k_norm=, eps=) norms them (Qwen3, Gemma 3), bit for bit.
    chunk_rows=c (with new_kv; a verify step of speculative decoding): rows i*c .. i*c + c - 1 are
    consecutive positions of one sequence (real rows first, then rows of context_lens 0); every row
    attends to the new K/V of the rows of its chunk before it, so the call does what write_kv of
    all rows followed by paged_attention does, bit for bit, in one launch.

cupy arrays launch cuda_src/paged_attention.cu: one CTA per (split, kv_head, sequence)
reads each K/V row once for all query heads of its group (4 to 8 warps, whichever keeps the most
warps busy over the grid's waves: cta_warps); when sequences are few and long the context is split
(flash-decoding): each split writes fp32 partials to the workspace and the last CTA of a
(sequence, KV head) to finish, found with an atomic arrival counter, merges them (one launch
either way). The grid and the split count depend on the shapes and on max_context_len only,
never on the values in context_lens.

Under CUDA-graph capture (and to avoid a device sync per call) the caller passes, all
allocated before capture and kept alive as long as the graph:
    out             [num_seqs, n_heads, head_dim], q's dtype
    max_context_len an int >= every context_lens value any replay will see (the grid is
                    sized from it at capture; tokens past it would be ignored)
    workspace       float32, at least workspace_elems(num_seqs, n_heads, n_kv_heads,
                    head_dim, max_context_len) elements (any size >= 1 when that is 0),
                    16-byte aligned, zero-initialized before first use (cupy.zeros): its
                    first elements are int32 arrival counters, one per (sequence, KV head),
                    that the kernel leaves at zero. Reuse it only for calls with the same
                    num_seqs and n_kv_heads (other calls' partials would sit where the
                    counters are), or zero it again first.
A replay then reads new q, block_tables and context_lens copied into the same buffers.
Inputs written on another stream must be ordered before the capture stream's work
(an event, or a device synchronize): a non-blocking stream does not wait for the
legacy default stream. Without these arguments the op allocates and may read
context_lens back, so it refuses to run on a capturing stream.
"""
from __future__ import annotations

import functools

import numpy as np

from . import fp8, runtime
from .attention_ref import default_scale, paged_prefix_attention
from .flash_attention import check_window
from .write_kv import check_head_rows

HEAD_DIMS = (64, 80, 96, 128, 256)
GROUPS = (1, 2, 4, 8)  # query heads per KV head, padded up to one of these
KERNEL_DTYPES = (np.dtype(np.float16), runtime.bfloat16)
WARPS = (4, 5, 6, 8)  # warps per CTA (7 would fit no more CTAs per SM than 8)
MIN_PARTITION, MAX_PARTITION = 32, 1024  # tokens per split (multiples of 32)
FULL_WAVE = 0.75  # occupancy at which split_bound stops adding splits
STAGE_MAX_DIM = 128  # the fused decode stages a one-step split's K/V rows before pdl_wait up to this head dim
LOG2E = 1.4426950408889634


def padded_group(n_heads: int, n_kv_heads: int) -> int:
    g = n_heads // n_kv_heads
    for p in GROUPS:
        if g <= p:
            return p
    raise ValueError(f"q: got {g} query heads per KV head, need at most {GROUPS[-1]}")


def loop_step(head_dim: int, warps: int = 4) -> int:
    """K/V rows the kernel's warps cover per step (STEP of the kernel: 16-byte chunks of a row
    on 8, 16 or 32 lanes)."""
    lanes = next(n for n in (8, 16, 32) if head_dim // 8 <= n)
    return warps * (32 // lanes)


def rows_in_flight(group: int, head_dim: int, partition: int, warps: int) -> int:
    """Template U, K/V rows a lane loads before using the first. H100, d=128, G=4, graph replay:
    U=8 beat U=4 by 4-5 % of copy bandwidth at equal grids; with G <= 4 and D <= 128 it fits
    5 CTAs per SM in 96 registers without spills (the launch bounds ask for that). A split that
    four loop steps cover (short contexts at small batches) takes U=4: its rows are few, the fused
    decode stages them before pdl_wait, and U=8 only lengthens the kernel (H100, batch 1, 128 + 256
    tokens, decode graphs: smollm2-135m 1,885 -> 2,033 tok/s, llama3-8b 177.9 -> 180.2, phi3-mini
    325.7 -> 328.4). An fp8 cache takes the same U: twice the rows (as many bytes in flight as from a
    float cache) made it slower (H100, `bench attention` decode, b=16 at 4k: 0.083 -> 0.097 ms)."""
    if group > 4 or head_dim > 128 or partition <= 4 * loop_step(head_dim, warps):
        return 4
    return 8


def tensor_cores(head_dim: int, partition: int, warps: int) -> bool:
    """Whether the kernel's scores and values run on tensor cores (mma.sync, cuda_src/paged_attention_mma.cuh)
    rather than the lane loops: head dims of 32-lane multiples up to 128, in splits longer than one loop
    step of the lane loops at U = 8 (a shorter one is what the fused decode stages before pdl_wait)."""
    return head_dim % 32 == 0 and head_dim <= 128 and partition > 8 * loop_step(head_dim, warps)


def resident_ctas(group: int) -> int:
    """CTAs per SM the decode kernel gets (ptxas -v, sm_90): G <= 4 uses <= 96 registers
    (5 x 128 threads per SM, the launch bounds ask for it), G = 8 uses 142-168 (3 per SM)."""
    return 5 if group <= 4 else 3


def resident_warps(group: int) -> int:
    """Warps per SM the decode kernel's registers allow (its launch bounds ask for them)."""
    return 4 * resident_ctas(group)


def occupancy(ctas: int, group: int, sm_count: int, warps: int) -> float:
    """The fraction of the SMs' resident warps a grid of `ctas` CTAs of `warps` warps keeps busy,
    over the waves it takes (a last, partial wave counts as a whole one)."""
    per_wave = sm_count * (resident_warps(group) // warps)
    return ctas * warps / (-(-ctas // per_wave) * sm_count * resident_warps(group))


@functools.lru_cache(maxsize=None)
def cta_warps(ctas: int, group: int, sm_count: int) -> int:
    """Warps per CTA (4 to 8): the count whose waves keep the most warps busy (occupancy), the
    larger on a tie. H100, d = 128, G = 4, 32 layers' KV (`bench attention`-style sweep of every
    split and warp count, 2026-11-26): 256 CTAs take 8 warps (one wave of 2 an SM), 384 take 6,
    512 take 5, 768 take 6 (W8 within 3 %), 1,024-2,048 take 5: where the old rule (the most
    warps that fit one wave, else 4) left 1,024-2,048 CTAs at 4 warps, 5 are 7-9 % faster, and
    768 CTAs at 4 (a 16 % second wave) ran 20 % slower. G = 8 (168 registers, room for 12 warps)
    keeps 4."""
    if group > 4:
        return 4
    return max(WARPS, key=lambda w: (occupancy(ctas, group, sm_count, w), w))


def instantiation(dtype, head_dim: int, group: int, u: int, new_kv: bool = False, warps: int = 4,
                  cache_dtype=None, mma: bool = False) -> str:
    """cache_dtype: the cache's (None: dtype's; uint8: fp8 E4M3). mma: tensor_cores' loops (u unused: 8)."""
    cache = fp8.cache_ctype(dtype if cache_dtype is None else cache_dtype, dtype)
    return (f"paged_attention_kernel<{runtime.ctype(dtype)}, {cache}, {head_dim}, {group}, {8 if mma else u}, "
            f"{warps}, {str(new_kv).lower()}, {str(mma).lower()}>")


# every (rows in flight, loops) the rules pick: at the shortest split, the lane loops' longest, the longest
INSTANTIATIONS = sorted({instantiation(dt, d, g, rows_in_flight(g, d, p, w), f, w, c, tensor_cores(d, p, w))
                         for dt in (np.float16, runtime.bfloat16) for c in (dt, fp8.FP8) for d in HEAD_DIMS
                         for g in GROUPS for f in (False, True) for w in WARPS if g <= 4 or w == 4
                         for p in (MIN_PARTITION, 8 * loop_step(d, w), MAX_PARTITION)})


def precompile(dtype, head_dim: int, n_heads: int, n_kv_heads: int, cache_dtype=None) -> int:
    """Compile, or load from the disk cache, every instantiation a launch for these heads may pick
    at any batch and context (the warps and rows in flight follow the split), so that no step waits
    on NVRTC (Engine.warm_up); the count. cache_dtype: the cache's (None: dtype's)."""
    g = padded_group(n_heads, n_kv_heads)
    cache = fp8.cache_ctype(dtype if cache_dtype is None else cache_dtype, dtype)
    prefix = f"paged_attention_kernel<{runtime.ctype(dtype)}, {cache}, {head_dim}, {g},"
    exprs = [e for e in INSTANTIATIONS if e.startswith(prefix)]
    runtime.precompile([("paged_attention", e) for e in exprs])  # NVRTC on every core
    for e in exprs:  # then each module loaded
        runtime.kernel("paged_attention", e)
    return len(exprs)


def split_config(num_seqs: int, n_kv_heads: int, max_context_len: int, sm_count: int, group: int = 4) -> tuple:
    """(n_splits, partition): split_bound's count, with partitions rounded up to a multiple of 32
    (which may take fewer splits to cover the context)."""
    ctx = max(1, max_context_len)
    partition = -(-ctx // split_bound(num_seqs, n_kv_heads, max_context_len, sm_count, group))
    partition = -(-partition // 32) * 32
    return -(-ctx // partition), partition


@functools.lru_cache(maxsize=4096)  # bounded: a mixed step's decodes bring their exact longest context
def split_bound(num_seqs: int, n_kv_heads: int, max_context_len: int, sm_count: int, group: int = 4) -> int:
    """The split count (flash-decoding): the fewest splits of 32..1024 tokens whose grid, at its best
    warp count, keeps FULL_WAVE of the resident warps busy (each split adds a merge), else the count
    that comes closest. Same sweep as cta_warps: llama3-8b shapes at 512-2,048 tokens, batch 8-128,
    it picks the fastest variant or one within 3 % (the old rule, one wave of 4-warp CTAs, split b=32
    at 512 tokens in two: 32.7 us a layer against 28.3 unsplit with 8 warps; b=8 at 2k: 36.5 against
    29.9 us). The count depends on the pair count and on the bounds 32..1024 only, and grows with
    the context: it sizes workspaces for every context up to max_context_len (split_config's
    rounded count never exceeds it). Cached: every eager decode launch asks for it."""
    pairs = max(1, num_seqs * n_kv_heads)
    ctx = max(1, max_context_len)
    lo, hi = -(-ctx // MAX_PARTITION), -(-ctx // MIN_PARTITION)
    # past one wave of the smallest CTAs, some count has already reached FULL_WAVE
    hi = min(hi, max(lo, -(-sm_count * resident_warps(group) // (WARPS[0] * pairs))))
    best, best_occ = lo, -1.0
    for n in range(lo, hi + 1):
        occ = occupancy(n * pairs, group, sm_count, cta_warps(n * pairs, group, sm_count))
        if occ >= FULL_WAVE:
            return n
        if occ > best_occ:
            best, best_occ = n, occ
    return best


def workspace_elems(num_seqs: int, n_heads: int, n_kv_heads: int, head_dim: int,
                    max_context_len: int) -> int:
    """float32 scratch elements paged_attention needs for the split partials of any context up to
    max_context_len (0 when none of them splits)."""
    n_splits = split_bound(num_seqs, n_kv_heads, max_context_len, runtime.device_info()["sm_count"],
                           padded_group(n_heads, n_kv_heads))
    return 0 if n_splits == 1 else split_workspace_elems(num_seqs, n_heads, n_kv_heads, head_dim, n_splits)


def split_workspace_elems(num_seqs: int, n_heads: int, n_kv_heads: int, head_dim: int, n_splits: int) -> int:
    """Workspace elements for an explicit split count: the arrival counters (padded to 16 bytes), then
    part_out [num_seqs, n_heads, n_splits, head_dim] and part_ml [num_seqs, n_heads, n_splits, 2]."""
    return _counters(num_seqs, n_kv_heads) + num_seqs * n_heads * n_splits * (head_dim + 2)


def _counters(num_seqs: int, n_kv_heads: int) -> int:
    return -(-num_seqs * n_kv_heads // 4) * 4


def decode_splits(num_seqs: int, n_heads: int, n_kv_heads: int, max_context_len: int) -> tuple:
    """(n_splits, partition) the op launches with on this device."""
    return split_config(num_seqs, n_kv_heads, max_context_len, runtime.device_info()["sm_count"],
                        padded_group(n_heads, n_kv_heads))


def smem_bytes(group: int, partition: int, head_dim: int, block_size: int,
               u: int, new_kv: bool = False, warps: int = 4, chunk_bytes: int = 16, mma: bool = False) -> int:
    """Scores [partition, group] + the cross-warp output reduction [warps, group, head_dim] (fp32)
    + the split's block-table entries (a run of `partition` tokens touches at most
    partition // block_size + 2 blocks). With new_kv, head_dim <= STAGE_MAX_DIM and a split of one
    loop step (partition <= STEP * U; not with mma) the stage of its K and V rows follows, 16-byte aligned:
    [2][ceil(partition / STEP)][threads] x chunk_bytes (a lane's 8 elements: 16, or 8 in an fp8 cache)."""
    attend = group * partition + warps * group * head_dim + 2 * group * warps + partition // block_size + 2
    step = loop_step(head_dim, warps)
    staged = not mma and new_kv and head_dim <= STAGE_MAX_DIM and partition <= step * u
    stage = 2 * -(-partition // step) * 32 * warps * chunk_bytes if staged else 0
    return -(-4 * attend // 16) * 16 + stage


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None, out=None, *,
                    max_context_len=None, workspace=None, new_kv=None, qk_norm=None, window=0, softcap=None,
                    chunk_rows=1):
    dev = runtime.on_device(q, k_cache, v_cache, block_tables, context_lens, out, *(new_kv or ()))
    window = check_window(window, softcap)
    runtime.check("q", q, ndim=3, contiguous=new_kv is None)
    num_seqs, n_heads, d = q.shape
    runtime.check("k_cache", k_cache, dtype=(q.dtype, fp8.FP8), shape=(None, None, None, d))
    runtime.check("v_cache", v_cache, dtype=k_cache.dtype, shape=tuple(k_cache.shape))
    n_kv, bs = k_cache.shape[2], k_cache.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"q: got {n_heads} heads, need a multiple of n_kv_heads = {n_kv}")
    runtime.check("block_tables", block_tables, dtype=np.int32, shape=(num_seqs, None))
    runtime.check("context_lens", context_lens, dtype=np.int32, shape=(num_seqs,))
    scale = default_scale(d) if scale is None else float(scale)
    if new_kv is not None:
        _check_new_kv(q, n_kv, *new_kv)
    if qk_norm is not None:
        _check_qk_norm(q, new_kv, *qk_norm)
    if chunk_rows != 1 and (new_kv is None or chunk_rows < 1 or num_seqs % chunk_rows):
        raise ValueError(f"chunk_rows: got {chunk_rows} for {num_seqs} rows, need new_kv and a divisor of the rows")
    if not dev:
        runtime.check("q", q, dtype=runtime.FLOAT_DTYPES, contiguous=new_kv is None)
        if new_kv is not None:  # by composition: write_kv's reference, then attention on the rotated q
            return paged_attention(_write_new_kv(q, k_cache, v_cache, context_lens, *new_kv, qk_norm), k_cache, v_cache,
                                   block_tables, context_lens, scale, out, window=window, softcap=softcap)
        cu = np.arange(num_seqs + 1, dtype=np.int32)
        res = paged_prefix_attention(q, k_cache, v_cache, block_tables, cu, context_lens, scale, window, softcap)
        out = runtime.check_out(out, q.shape, q.dtype, q)
        out[...] = res.astype(q.dtype)  # rounded once
        return out
    runtime.check("q", q, dtype=KERNEL_DTYPES, align=16, contiguous=new_kv is None)
    if d not in HEAD_DIMS:
        raise ValueError(f"q: got head_dim {d}, need one of {HEAD_DIMS}")
    if bs & (bs - 1):
        raise ValueError(f"k_cache: got block_size {bs}, need a power of two")
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        runtime.check(name, a, align=16)
    if max_context_len is not None and max_context_len < 0:
        raise ValueError(f"max_context_len: got {max_context_len}, need >= 0")
    group = padded_group(n_heads, n_kv)
    missing = [name for name, a in (("out", out), ("max_context_len", max_context_len)) if a is None]
    if missing and runtime.capturing():
        _refuse_capture(missing)
    out = runtime.check_out(out, q.shape, q.dtype, q)
    runtime.check("out", out, align=16)
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if num_seqs else 0
    # a window bounds the keys each sequence reads: fewer splits cover them
    n_splits, partition = decode_splits(num_seqs, n_heads, n_kv, min(max_context_len, window or max_context_len))
    if n_splits > 1 and workspace is None and runtime.capturing():
        _refuse_capture(["workspace"])
    launch_decode(q, k_cache, v_cache, block_tables, context_lens, out, scale, group, n_splits,
                  partition, workspace, new_kv=new_kv, qk_norm=qk_norm, window=window, softcap=softcap,
                  chunk_rows=chunk_rows)
    return out


def _check_new_kv(q, n_kv, k, v, slot_mapping, inv_freq):
    """new_kv's arrays; q, k, v: rows 16-byte multiples apart, heads contiguous within a row."""
    num_seqs, _, d = q.shape
    runtime.check("k", k, dtype=q.dtype, shape=(num_seqs, n_kv, d), contiguous=False)
    runtime.check("v", v, dtype=q.dtype, shape=(num_seqs, n_kv, d), contiguous=False)
    for name, a in (("q", q), ("k", k), ("v", v)):
        check_head_rows(name, a)
        runtime.check(name, a, align=16, contiguous=False)
    runtime.check("slot_mapping", slot_mapping, dtype=np.int32, shape=(num_seqs,))
    per_row = getattr(inv_freq, "ndim", 1) == 2  # longrope: each row its own frequencies
    runtime.check("inv_freq", inv_freq, dtype=np.float32, shape=(num_seqs, d // 2) if per_row else (d // 2,))


def _check_qk_norm(q, new_kv, q_norm, k_norm, eps):
    if new_kv is None:
        raise ValueError("qk_norm: needs new_kv (the unfused path norms in write_kv)")
    d = q.shape[2]
    runtime.check("q_norm", q_norm, dtype=q.dtype, shape=(d,))
    runtime.check("k_norm", k_norm, dtype=q.dtype, shape=(d,))
    if not eps > 0:
        raise ValueError(f"qk_norm: got eps {eps}, need > 0")


def _write_new_kv(q, k_cache, v_cache, context_lens, k, v, slot_mapping, inv_freq, qk_norm=None):
    """The NumPy path of new_kv: write_kv at positions context_lens - 1 (no write where that is -1)."""
    from .write_kv import write_kv

    positions = context_lens - 1
    slots = np.where(positions >= 0, slot_mapping, -1).astype(np.int32)
    q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))
    q_norm, k_norm, eps = qk_norm or (None, None, 1e-6)
    return write_kv(q, k, v, positions, k_cache, v_cache, slots, inv_freq, q_norm=q_norm, k_norm=k_norm, eps=eps)


def _refuse_capture(names):
    raise ValueError(f"{', '.join(names)}: needed under CUDA-graph capture, allocated before it "
                     "(see cuinfer.ops.paged_attention)")


def launch_decode(q, k_cache, v_cache, block_tables, context_lens, out, scale, group, n_splits,
                  partition, workspace=None, u=None, new_kv=None, qk_norm=None, warps=None, window=0, softcap=None,
                  chunk_rows=1):
    """Launch the decode kernel with an explicit split: n_splits * partition tokens must cover every
    context length, partition a multiple of 32; warps per CTA from cta_warps and rows in flight from
    rows_in_flight unless given, the loops from tensor_cores.
    Arguments are checked by the caller."""
    cp = runtime.require_cupy()
    num_seqs, n_heads, d = q.shape
    n_kv, bs = k_cache.shape[2], k_cache.shape[1]
    warps = warps or cta_warps(n_splits * n_kv * num_seqs, group, runtime.device_info()["sm_count"])
    u = u or rows_in_flight(group, d, partition, warps)
    mma = tensor_cores(d, partition, warps)
    if n_splits > 1:
        need = split_workspace_elems(num_seqs, n_heads, n_kv, d, n_splits)
        if workspace is None:
            workspace = cp.zeros(need, dtype=cp.float32)
        runtime.check("workspace", workspace, dtype=np.float32, ndim=1, align=16)
        if workspace.size < need:
            raise ValueError(f"workspace: got {workspace.size} elements, need {need} (workspace_elems)")
        n_cnt, n_out = _counters(num_seqs, n_kv), num_seqs * n_heads * n_splits * d
        arrivals = workspace[:n_cnt].view(np.int32)  # [num_seqs, n_kv] (+ padding)
        part_out = workspace[n_cnt:n_cnt + n_out]  # [num_seqs, n_heads, n_splits, d]
        part_ml = workspace[n_cnt + n_out:need]  # [num_seqs, n_heads, n_splits, 2]
    else:
        part_out = part_ml = arrivals = out  # unused: the kernel writes out directly
    if new_kv is None:  # unused by the plain kernel
        k, v, slot_mapping, inv_freq = q, q, context_lens, part_ml
    else:
        k, v, slot_mapping, inv_freq = new_kv
    q_norm, k_norm, eps = qk_norm or (q, q, 0.0)  # unused without qk_norm
    kern = runtime.kernel("paged_attention", instantiation(q.dtype, d, group, u, new_kv is not None, warps,
                                                          k_cache.dtype, mma))
    args = (q, k_cache, v_cache, out, part_out, part_ml, arrivals, block_tables, context_lens,
            np.int32(block_tables.shape[1]), np.int32(bs.bit_length() - 1), np.int32(n_heads),
            np.int32(n_kv), np.int32(partition), np.float32(scale * LOG2E), k, v, slot_mapping, inv_freq,
            *(np.int32(a.strides[0] // a.itemsize) for a in (q, k, v)), np.int32(window),
            np.float32(softcap * LOG2E if softcap else 0.0), q_norm, k_norm, np.int32(qk_norm is not None),
            np.float32(eps), np.int32(chunk_rows), np.int32(inv_freq.shape[1] if inv_freq.ndim == 2 else 0))
    runtime.launch(kern, (n_splits, n_kv, num_seqs), (32 * warps,), args,
                   smem=smem_bytes(group, partition, d, bs, u, new_kv is not None, warps, 8 * k_cache.itemsize, mma))
