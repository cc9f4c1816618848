// Paged decode attention (one query token per sequence), flash-decoding split over the context.
//
// One CTA per (split, kv_head, sequence) computes all G query heads of the KV group
// from one read of each K/V row. A row of D elements is KL lanes x 16 bytes (KL =
// D/8 rounded up to a power of two), so a warp covers 32/KL rows per step; U steps
// are loaded before they are used, to keep enough 16-byte loads in flight. The split's
// block-table entries are staged in shared memory first, and the loads are unpredicated
// (rows past the end and lanes past D read a valid row, their results are dropped), so
// the U loads of a step issue back to back instead of waiting on a table read each.
// Pass 1 writes the scores (prescaled by scale * log2 e) of the split's tokens to shared memory,
// pass 2 turns them into exp2(s - max), pass 3 streams V. A row's lanes reduce their partial dot
// products and a step's rows their partial outputs scattered (reduce_scatter): each lane ends with
// one (row, head) score, and a fraction of the outputs, instead of all of them.
// MMA (D = 64, 96, 128 in long splits): passes 1 and 3 on tensor cores instead, a warp taking tiles of 16
// keys (mma.sync m16n8k16, the heads padded to 8 columns; paged_attention_mma.cuh).
// With one split the CTA writes the output; otherwise it writes fp32 (out / sum, max, sum)
// partials and counts itself in on an arrival counter of its (kv_head, sequence), and the
// last CTA to arrive merges the partials of every split that holds rows of the context (splits
// past it do nothing; no second kernel).
// NEW_KV (decode with the new token fused in): q and the new k arrive un-rotated; every CTA rotates
// q (RoPE rotate-half at position ctx - 1, as write_kv.cu, after the q/k norm where the model has
// one), and the CTA whose split holds position ctx - 1 also rotates k and writes k and v to the cache
// row at slot_mapping[seq] before its loops, which then read that row back like any other (through L2:
// see load_kv). Under programmatic
// dependent launch (a graph replay) the NEW_KV kernel reads the step's inputs before pdl_wait, and
// when its split is one loop step (short contexts at small batches) and D <= 128 copies the split's K/V
// rows to shared memory there (cp.async), so they stream in while the qkv GEMV finishes; the
// writer then patches the new row into that stage. With chunk_rows > 1 (a verify step: each chunk
// of chunk_rows consecutive rows holds consecutive positions of one sequence, real rows first) a
// row's CTAs also write the rows of its chunk before it (the row attends to them), so no write_kv
// launch precedes the verify step's attention either.
// The cache holds T or fp8 E4M3 (C = __nv_fp8_e4m3, cuinfer/ops/fp8.py): a lane's chunk of a row is
// then 8 bytes (KvChunk), decoded to T where it is loaded, and the new rows are encoded where written.
#include "common.cuh"

using namespace cuinfer;

// A K/V row chunk as stored (decoded where used: an fp8 row's codes take half the registers). The
// NEW_KV kernel writes a cache row in this launch and reads it back after a barrier, so its loads must
// be coherent (ld.global.cg: L2); the plain kernel's may take the read-only path (ld.global.nc, which
// may miss a write made during the kernel).
template <bool COHERENT, typename T, typename C>
__device__ __forceinline__ typename KvChunk<T, C>::Raw load_kv(const C* p) {
  const auto* r = reinterpret_cast<const typename KvChunk<T, C>::Raw*>(p);
  return COHERENT ? __ldcg(r) : *r;
}

// RoPE rotate-half of chunk c (8 elements) of a head row x, rounded once to T: y_j = x_j cos - x_{j+D/2} sin,
// y_{j+D/2} = x_{j+D/2} cos + x_j sin, through write_kv.cu's rope_lo / rope_hi (common.cuh), so that the
// new k and q match write_kv's bit for bit. cs, sn: cos and sin of the angles of the chunk's 8
// frequencies (chunk c mod D/16). With a norm weight w (Qwen3's, Gemma 3's q/k norms) the row is
// RMS-normed first as write_kv norms it: its sum of squares over the row's KL lanes (in write_kv's
// order), then rms_normed per element. Every lane of the warp calls it (the sum is a shuffle); idle lanes (c >= D/8)
// read chunk 0 and add nothing to the sum.
template <typename T, int D, int KL>
__device__ __forceinline__ Vec<T, 8> rope_chunk(const T* x, int c, const float (&cs)[8], const float (&sn)[8],
                                                const T* w, float eps) {
  constexpr int HALF = D / 16;  // chunks in half a row
  const bool active = c < D / 8;
  c = active ? c : 0;
  const bool lo = c < HALF;
  const int c_other = lo ? c + HALF : c - HALF;
  VecF<T, 8> own = VecF<T, 8>::from(Vec<T, 8>::load(x + c * 8));
  VecF<T, 8> other = VecF<T, 8>::from(Vec<T, 8>::load(x + c_other * 8));
  if (w != nullptr) {
    float sum_sq = 0.0f;  // lane c: the squares of elements 8c .. 8c + 7 in turn, then the row's butterfly
#pragma unroll
    for (int e = 0; e < 8; ++e) sum_sq = __fmaf_rn(own.v[e], own.v[e], sum_sq);
    sum_sq = active ? sum_sq : 0.0f;
#pragma unroll
    for (int o = KL / 2; o > 0; o >>= 1) sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, o);
    const float inv_rms = rms_inv(sum_sq, D, eps);
    const Vec<T, 8> w_own = Vec<T, 8>::load(w + c * 8), w_other = Vec<T, 8>::load(w + c_other * 8);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      own.v[e] = to_float(rms_normed(from_float<T>(own.v[e]), w_own.v[e], inv_rms));
      other.v[e] = to_float(rms_normed(from_float<T>(other.v[e]), w_other.v[e], inv_rms));
    }
  }
  VecF<T, 8> y;
#pragma unroll
  for (int e = 0; e < 8; ++e)
    y.v[e] = lo ? rope_lo(own.v[e], other.v[e], cs[e], sn[e]) : rope_hi(other.v[e], own.v[e], cs[e], sn[e]);
  return y.to();
}

#include "paged_attention_lanes.cuh"
#include "paged_attention_merge.cuh"
#include "paged_attention_mma.cuh"

// grid: (n_splits, n_kv_heads, num_seqs) · block: 32 * WARPS
// smem: 4 * (G * partition + WARPS * G * D + 2 * WARPS * G + partition / block_size + 2), with NEW_KV,
// partition <= STEP * U and not MMA that rounded up to 16 bytes + the stage, 2 * ceil(partition / STEP) * 32 * WARPS *
// sizeof(KvChunk<T, C>::Raw)
// q, out: [num_seqs, n_heads, D]; k_cache, v_cache: [num_blocks, 1 << block_shift, n_kv_heads, D] of C
// block_tables: [num_seqs, max_blocks]; context_lens: [num_seqs]
// n_splits > 1 only (16-byte aligned): part_out: [num_seqs, n_heads, n_splits, D] fp32;
// part_ml: [num_seqs, n_heads, n_splits, 2] (max, sum); arrivals: int32 [num_seqs, n_kv_heads], zero
// before the launch and left zero by it
// NEW_KV only: q rows q_stride elements apart (heads contiguous), un-rotated; k_new, v_new: [num_seqs,
// n_kv_heads, D] rows k_stride / v_stride apart, k un-rotated; slot_mapping: [num_seqs] (slot < 0: no
// write); inv_freq: [D / 2] fp32, or with freq_stride > 0 a row per q row, freq_stride elements apart
// (longrope: each sequence's short or long frequencies); qk_norm != 0: every q and k head RMS-normed with q_norm / k_norm [D]
// (epsilon eps) before RoPE, as write_kv's NORM kernel norms; chunk_rows: rows per sequence chunk (1:
// decode, each row its own sequence). Without NEW_KV these are unused and q is contiguous.
// window > 0: only the last `window` keys count; the splits then tile [max(0, ctx - window), ctx) (the
// rows before it are never read), 0: [0, ctx). cap_log2 > 0 (a softcap c: c log2 e): each score s
// (prescaled by scale log2 e) becomes cap_log2 * tanh(s / cap_log2).
// G: query heads per KV head, padded (the real count is n_heads / n_kv_heads <= G).
// U: K/V rows each lane loads before it uses the first (bytes in flight; the lane loops only).
// MMA: passes 1 and 3 on tensor cores (D a multiple of 32, at most 128; no stage).
// WARPS: warps per CTA (4 to 8; 4 for G = 8), chosen by the op so that one wave of the grid holds as
// many warps as the SMs' registers allow.
// Launch bounds: the warps per SM resident_warps in the op assumes, 20 (<= 102 registers: 5 CTAs of 4
// warps, 4 of 5, 3 of 6, 2 of 8) for G <= 4 and 3 CTAs of 4 (<= 168) for G = 8, without spills; the
// plain G = 8 kernel fits 168 unbounded (and is left unbounded, which schedules it better), the NEW_KV
// one would take up to 182 registers (bf16, D = 80 / 96). The MMA kernels of a 16-bit cache at 96
// registers (4 to 6 warps) spill 4-12 bytes at D = 128 and 12 bytes at D = 96, G = 1 (ptxas -v, sm_90a).
template <typename T, typename C, int D, int G, int U, int WARPS, bool NEW_KV, bool MMA>
__global__ void __launch_bounds__(32 * WARPS, G <= 4 ? 20 / WARPS : (NEW_KV ? 3 : 1)) paged_attention_kernel(
    const T* __restrict__ q, const C* __restrict__ k_cache, const C* __restrict__ v_cache,
    T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_ml, int* __restrict__ arrivals,
    const int* __restrict__ block_tables, const int* __restrict__ context_lens, int max_blocks,
    int block_shift, int n_heads, int n_kv_heads, int partition, float scale_log2,
    const T* __restrict__ k_new, const T* __restrict__ v_new, const int* __restrict__ slot_mapping,
    const float* __restrict__ inv_freq, int q_stride, int k_stride, int v_stride, int window, float cap_log2,
    const T* __restrict__ q_norm, const T* __restrict__ k_norm, int qk_norm, float eps, int chunk_rows,
    int freq_stride) {
  if constexpr (!NEW_KV) {
    pdl_wait();  // every input of this kernel may come from the previous one
    pdl_trigger();
  }
  static_assert(WARPS >= 4 && WARPS <= 8 && (G <= 4 || WARPS == 4), "4..8 warps, G = 8 with 4 only");
  constexpr int THREADS = 32 * WARPS;
  constexpr int CHUNKS = D / 8;
  constexpr int KL = CHUNKS <= 8 ? 8 : (CHUNKS <= 16 ? 16 : 32);  // lanes per row
  constexpr int RPW = 32 / KL;                                      // rows per warp step
  constexpr int STEP = WARPS * RPW;                                 // rows per CTA step
  static_assert(CHUNKS <= 32 && D % 16 == 0, "D must be a multiple of 16, at most 256");
  using Chunk = KvChunk<T, C>;
  using Raw = typename Chunk::Raw;

  const int split = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z, n_splits = gridDim.x;
  const int group = n_heads / n_kv_heads;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, sub = lane / KL, chunk = lane % KL;
  const bool active = chunk < CHUNKS;
  // NEW_KV reads the step's inputs before pdl_wait, all loads issued here with context_lens and the
  // block table below: one round trip on the way to the stage copies and RoPE's angles
  const int ctx = context_lens[seq];
  const int slot = NEW_KV ? slot_mapping[seq] : -1;  // the new token's row, written by the CTA whose split holds it
  const int base = window > 0 ? max(0, ctx - window) : 0;  // the first key counted
  const int start = base + split * partition, end = min(ctx, start + partition), len = end - start;
  const size_t head0 = (size_t)seq * n_heads + (size_t)kv_head * group;  // first q head of the group
  int* const arrival = arrivals + (size_t)seq * n_kv_heads + kv_head;
  extern __shared__ float smem[];
  float* scores = smem;                       // [partition][G]: a row's G scores in one load
  float* red = scores + G * partition;        // [WARPS][G][D]
  float* stat = red + WARPS * G * D;          // [2][G][WARPS]: max, sum
  int* blocks = reinterpret_cast<int*>(stat + 2 * G * WARPS);  // the split's block-table entries
  // NEW_KV with a split of one loop step: its K, V rows, [2][US][threads] x Raw (16-byte aligned)
  Raw* stage = reinterpret_cast<Raw*>((reinterpret_cast<size_t>(blocks + (partition >> block_shift) + 2) + 15) &
                                          ~size_t(15));
  // The table entries of the whole partition (those the table holds), loaded alongside context_lens:
  // one round trip instead of two; entries past the context are never used.
  const int* table = block_tables + (size_t)seq * max_blocks;
  const int first_block = start >> block_shift;
  const int n_table = min(((start + partition - 1) >> block_shift) - first_block + 1, max_blocks - first_block);
  for (int i = tid; i < n_table; i += blockDim.x) blocks[i] = table[first_block + i];

  // Splits past the context write nothing and do not arrive: the merge counts the n_live that hold rows.
  // With an empty context split 0 writes the zeros.
  const int n_live = min(n_splits, (ctx - base + partition - 1) / partition);
  if (len <= 0) {
    if (split > 0) return;
    if constexpr (NEW_KV) {
      pdl_wait();
      pdl_trigger();
    }
    for (int i = tid; i < group * D; i += blockDim.x) out[(head0 + i / D) * D + i % D] = from_float<T>(0.0f);
    return;
  }

  // D <= 128 only (ops/paged_attention.py STAGE_MAX_DIM): a D = 256 stage is 32 KB a CTA, and
  // loading its rows after the wait measured faster (docs/attention.md)
  const bool staged = !MMA && NEW_KV && D <= 128 && partition <= STEP * U;
  const int US = (partition + STEP - 1) / STEP;  // steps u of the loop that hold rows of the split

  const int block_mask = (1 << block_shift) - 1;
  const size_t row_stride = (size_t)n_kv_heads * D;
  // element offset of token t's row plus col (t clamped to the split, so every load is in bounds): this
  // lane's chunk (offset_of; idle lanes re-read a valid chunk), or the KV head's row (row_of, MMA)
  auto offset_at = [&](int t, size_t col) {
    t = min(t, end - 1);
    return (((size_t)blocks[(t >> block_shift) - first_block] << block_shift) + (t & block_mask)) * row_stride + col;
  };
  const size_t col = (size_t)kv_head * D + min(chunk, CHUNKS - 1) * 8;
  auto offset_of = [&](int t) { return offset_at(t, col); };
  auto row_of = [&](int t) { return offset_at(t, (size_t)kv_head * D); };

  float qv[G][8];
  if constexpr (NEW_KV) {
    // Before pdl_wait, what the kernel before this one (the qkv GEMV) does not write: RoPE's angles at
    // ctx - 1, one sincosf a frequency into `red` (unused until pass 3; every lane computing its
    // chunk's 8 took longer than a large batch's loads), and the cache rows of past tokens (the new
    // row at ctx - 1 is stale here: the writer below patches it into the stage).
    static_assert(D / 2 <= THREADS, "a thread an angle");
    float2* angles = reinterpret_cast<float2*>(red);
    if (tid < D / 2) {
      float s, c;
      sincosf(static_cast<float>(ctx - 1) * inv_freq[(size_t)seq * freq_stride + tid], &s, &c);
      angles[tid] = make_float2(c, s);
    }
    __syncthreads();  // blocks[] and the angles written
    if (staged) {
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (u < US) {
          const size_t off = offset_of(start + warp * RPW + u * STEP + sub);
          cp_async_raw<Raw>(smem_u32(stage + u * THREADS + tid), k_cache + off);
          cp_async_raw<Raw>(smem_u32(stage + (US + u) * THREADS + tid), v_cache + off);
        }
      cp_async_commit();
    }
    float cs[8], sn[8];
    if (active)
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float2 a = angles[chunk % (CHUNKS / 2) * 8 + e];
        cs[e] = a.x, sn[e] = a.y;
      }
    pdl_wait();  // q, k_new, v_new come from the previous kernel
    pdl_trigger();
    // A verify step (chunk_rows > 1): the row is the b-th of its sequence's chunk, rows seq - b .. seq
    // at positions ctx - 1 - b .. ctx - 1. Its CTAs also write the b rows before it that fall in their
    // split (the rows' own CTAs write them too, with the same bits), one per (warp, sub-row), here
    // where q's registers are not yet live; the stage is patched once it has landed, below.
    const int n_before = seq % chunk_rows;
#pragma unroll 1
    for (int t0 = 0; t0 < n_before; t0 += STEP) {  // CTA-uniform: every lane of a warp takes part in rope_chunk
      const int t = min(t0 + warp * RPW + sub, n_before - 1), row = seq - n_before + t, pos = ctx - 1 - n_before + t;
      float rc[8], rs[8];
#pragma unroll
      for (int e = 0; e < 8; ++e)
        sincosf(static_cast<float>(pos) * inv_freq[(size_t)row * freq_stride + chunk % (CHUNKS / 2) * 8 + e], &rs[e],
                &rc[e]);
      const Vec<T, 8> k_row = rope_chunk<T, D, KL>(k_new + (size_t)row * k_stride + (size_t)kv_head * D, chunk,
                                                   rc, rs, qk_norm ? k_norm : nullptr, eps);
      const int row_slot = slot_mapping[row];
      if (t0 + warp * RPW + sub < n_before && active && row_slot >= 0 && pos >= start && pos < end) {
        const size_t dst = ((size_t)row_slot * n_kv_heads + kv_head) * D + chunk * 8;
        *reinterpret_cast<Raw*>(const_cast<C*>(k_cache) + dst) = Chunk::encode(k_row);
        *reinterpret_cast<Raw*>(const_cast<C*>(v_cache) + dst) =
            Chunk::encode(Vec<T, 8>::load(v_new + (size_t)row * v_stride + (size_t)kv_head * D + chunk * 8));
      }
    }
    // The new token's row goes to the cache from the CTA whose split holds it; its loads issue
    // with q's below (one round trip), the stores after the stage has landed.
    // The writer warp rotates k on all its lanes (a q/k norm sums over them), lane `chunk` of row 0 stores.
    const bool writer_warp = split == min((ctx - 1 - base) / partition, n_splits - 1) && slot >= 0 && warp == 0;
    const bool writer = writer_warp && sub == 0 && active;
    const T* q_w = qk_norm ? q_norm : nullptr;
    Vec<T, 8> kn, vn;
    if (writer_warp)
      kn = rope_chunk<T, D, KL>(k_new + (size_t)seq * k_stride + (size_t)kv_head * D, chunk, cs, sn,
                                qk_norm ? k_norm : nullptr, eps);
    if (writer) vn = Vec<T, 8>::load(v_new + (size_t)seq * v_stride + (size_t)kv_head * D + chunk * 8);
    const T* q_group = q + (size_t)seq * q_stride + (size_t)kv_head * group * D;
    T* q_rot = reinterpret_cast<T*>(red + D);  // MMA: the rotated q [group][D], after the angles
#pragma unroll
    for (int g = 0; g < G; ++g) {
      VecF<T, 8> x{};
      // warp-uniform: every lane rotates (and norms), the active ones keep it (MMA: warp 0, into q_rot)
      if (g < group && (!MMA || warp == 0)) {
        const Vec<T, 8> r = rope_chunk<T, D, KL>(q_group + g * D, chunk, cs, sn, q_w, eps);
        if (active) x = VecF<T, 8>::from(r);
        if (MMA && sub == 0 && active) r.store(q_rot + g * D + chunk * 8);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) qv[g][e] = x.v[e] * scale_log2;
    }
    if (staged) {  // every stage slot has landed before the writer patches one
      cp_async_wait_all();
      __syncthreads();
    }
    // The stage slots of the split's row r (K, then V US * THREADS further): this lane's chunk, and
    // on the last active lane the idle lanes' copies of it.
    auto patch_stage = [&](int r, Raw k4, Raw v4) {
      Raw* ks = stage + r / STEP * THREADS + (r % STEP) / RPW * 32 + (r % RPW) * KL;
      Raw* vs = ks + US * THREADS;
      ks[chunk] = k4, vs[chunk] = v4;
      if (chunk == CHUNKS - 1)
#pragma unroll
        for (int c = CHUNKS; c < KL; ++c) ks[c] = k4, vs[c] = v4;
    };
    if (writer) {
      const size_t dst = ((size_t)slot * n_kv_heads + kv_head) * D + chunk * 8;
      const Raw k_raw = Chunk::encode(kn), v_raw = Chunk::encode(vn);
      *reinterpret_cast<Raw*>(const_cast<C*>(k_cache) + dst) = k_raw;
      *reinterpret_cast<Raw*>(const_cast<C*>(v_cache) + dst) = v_raw;
      if (staged) patch_stage(ctx - 1 - start, k_raw, v_raw);
    }
    if (staged) {  // the verify rows this thread wrote above, read back from L2 into their stage slots
#pragma unroll 1
      for (int t = warp * RPW + sub; t < n_before; t += STEP) {
        const int row_slot = slot_mapping[seq - n_before + t], pos = ctx - 1 - n_before + t;
        if (!active || row_slot < 0 || pos < start || pos >= end) continue;
        const size_t src = ((size_t)row_slot * n_kv_heads + kv_head) * D + chunk * 8;
        patch_stage(pos - start, __ldcg(reinterpret_cast<const Raw*>(k_cache + src)),
                    __ldcg(reinterpret_cast<const Raw*>(v_cache + src)));
      }
    }
  } else if constexpr (!MMA) {  // (MMA loads q's fragments below)
#pragma unroll
    for (int g = 0; g < G; ++g) {
      VecF<T, 8> x{};
      if (g < group && active) x = VecF<T, 8>::from(Vec<T, 8>::load(q + (head0 + g) * D + chunk * 8));
#pragma unroll
      for (int e = 0; e < 8; ++e) qv[g][e] = x.v[e] * scale_log2;
    }
  }
  __syncthreads();  // blocks[] written (and the new K/V row: the loops below may read it)
  const Raw* k_stage = stage + tid;  // this lane's stage slots (K, then V)
  const Raw* v_stage = k_stage + US * THREADS;
  const int base0 = start + warp * RPW;

  // The owner of a (row, head) in pass 1 of the lane loops, and in pass 2: lanes of a row's chunks 0, DUP,
  // 2 DUP, ... of the heads chunk / DUP
  constexpr int DUP = KL / G;
  static_assert(DUP >= 1, "G must not exceed the lanes of a row");
  const bool owner = (chunk & (DUP - 1)) == 0;
  const int head = chunk / DUP;  // reduce_scatter's base (also in warps without rows, which never reduce)
  if constexpr (MMA) {
    // pass 1 on tensor cores (paged_attention_mma.cuh): lane 4 g + t scores keys g, g + 8 for heads
    // 2 t, 2 t + 1, and its maxima for those heads go over the lanes of the same t
    unsigned qf[D / 32][4];
    mma_q<T, D>(NEW_KV ? reinterpret_cast<const T*>(red + D) : q + head0 * D, group, lane, qf);  // NEW_KV: q_rot
    const int t4 = lane % 4;
    float m0 = Max::identity(), m1 = Max::identity();
    mma_scores<T, C, D, WARPS, NEW_KV>(qf, warp, lane, start, end, k_cache, row_of, [&](int t, float s0, float s1) {
      s0 *= scale_log2, s1 *= scale_log2;
      if (cap_log2 > 0.0f) s0 = cap_log2 * tanhf(s0 / cap_log2), s1 = cap_log2 * tanhf(s1 / cap_log2);
      if (t < end) {
        m0 = fmaxf(m0, s0), m1 = fmaxf(m1, s1);
        float* row = scores + (t - start) * G + 2 * t4;
        if constexpr (G == 1) {
          if (t4 == 0) row[0] = s0;
        } else if (2 * t4 < G) {
          *reinterpret_cast<float2*>(row) = make_float2(s0, s1);
        }
      }
    });
#pragma unroll
    for (int o = 4; o < 32; o <<= 1)
      m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, o)), m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, o));
    if (lane < 4 && 2 * lane < G) stat[2 * lane * WARPS + warp] = m0;
    if (lane < 4 && 2 * lane + 1 < G) stat[(2 * lane + 1) * WARPS + warp] = m1;
  } else {
    // pass 1: scores. A row's KL lanes reduce its G dot products scattered (reduce_scatter): lane `chunk`
    // ends with the score of query head `head` (the high bits of chunk pick it), the low bits of chunk
    // hold copies (DUP lanes a head; the one with dup == 0 owns it) and write it to shared memory.
    constexpr int LG = ilog2(G);
    float mh = Max::identity();    // max of this lane's rows for its head
    for_each_row<T, C, U, STEP, THREADS, NEW_KV>(staged, k_stage, US, base0, sub, end, k_cache, offset_of,
                                              [&](const Vec<T, 8>& k, int t) {
      const VecF<T, 8> kf = VecF<T, 8>::from(k);
      float d[G];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        d[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) d[g] = fmaf(qv[g][e], kf.v[e], d[g]);
      }
      reduce_scatter<G, LG, KL / 2, false>(d, lane);
#pragma unroll
      for (int o = DUP / 2; o > 0; o >>= 1) d[0] += __shfl_xor_sync(0xffffffffu, d[0], o);
      if (cap_log2 > 0.0f) d[0] = cap_log2 * tanhf(d[0] / cap_log2);
      if (t < end) {
        mh = fmaxf(mh, d[0]);
        if (owner) scores[(t - start) * G + head] = d[0];
      }
    });
#pragma unroll
    for (int o = KL; o < 32; o <<= 1) mh = fmaxf(mh, __shfl_xor_sync(0xffffffffu, mh, o));  // over the warp's rows
    if (owner && sub == 0) stat[head * WARPS + warp] = mh;
  }
  __syncthreads();

  float m = stat[head * WARPS];  // the CTA's max for this lane's head: every row of the split has a finite score
#pragma unroll
  for (int w = 1; w < WARPS; ++w) m = fmaxf(m, stat[head * WARPS + w]);

  // pass 2: p = exp2(s - max) in place by the owners, over rows base0 + sub, + STEP, ...; the row sums
  float l = 0.0f;
  if (owner)
    for (int t = base0 + sub; t < end; t += STEP) {
      const float p = exp2f(scores[(t - start) * G + head] - m);
      scores[(t - start) * G + head] = p;
      l += p;
    }
#pragma unroll
  for (int o = KL; o < 32; o <<= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
  if (owner && sub == 0) stat[(G + head) * WARPS + warp] = l;
  __syncthreads();

  if constexpr (MMA) {
    // pass 3 on tensor cores: lane 4 g + t holds elements 8 c + 2 e, + 1 of chunks c = g + 8 h for heads
    // 2 t, 2 t + 1 (acc[h][e]: the m16n8 C fragment)
    float acc[MmaTiles<D>::NH][4][4] = {};
    mma_values<T, C, D, WARPS, NEW_KV>(acc, warp, lane, start, end, v_cache, row_of, [&](int t, int head) {
      return head < G && t < end ? scores[(t - start) * G + head] : 0.0f;
    });
    const int g4 = lane / 4, t4 = lane % 4;
#pragma unroll
    for (int h = 0; h < MmaTiles<D>::NH; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e)
#pragma unroll
        for (int j = 0; j < 2; ++j)
          if (g4 + 8 * h < CHUNKS && 2 * t4 + j < G)
            *reinterpret_cast<float2*>(red + (warp * G + 2 * t4 + j) * D + 8 * (g4 + 8 * h) + 2 * e) =
                make_float2(acc[h][e][j], acc[h][e][2 + j]);
  } else {
    // pass 3: acc = sum_t p_t v_t for this lane's 8 columns, each head's values at acc[8 g ..]
    float acc[G * 8];
#pragma unroll
    for (int i = 0; i < G * 8; ++i) acc[i] = 0.0f;
    for_each_row<T, C, U, STEP, THREADS, NEW_KV>(staged, v_stage, US, base0, sub, end, v_cache, offset_of,
                                              [&](const Vec<T, 8>& v, int t) {
      const bool live = t < end;
      t = min(t, end - 1);
      const VecF<T, 8> vf = VecF<T, 8>::from(v);
      float p[G];  // the row's G probabilities: 16-byte loads from G = 4 on
      if constexpr (G % 4 == 0) {
#pragma unroll
        for (int i = 0; i < G / 4; ++i) {
          const float4 p4 = reinterpret_cast<const float4*>(scores + (t - start) * G)[i];
          p[4 * i] = p4.x, p[4 * i + 1] = p4.y, p[4 * i + 2] = p4.z, p[4 * i + 3] = p4.w;
        }
      } else {
#pragma unroll
        for (int g = 0; g < G; ++g) p[g] = scores[(t - start) * G + g];
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g * 8 + e] = fmaf(live ? p[g] : 0.0f, vf.v[e], acc[g * 8 + e]);
      }
    });
    // reduce over the rows a warp step covers (lanes with the same chunk), scattered over them; then over warps
    constexpr int LR = ilog2(RPW), KEEP = G * 8 / RPW;
    const int first = reduce_scatter<G * 8, LR, KL, true>(acc, lane);
    if (active) {
#pragma unroll
      for (int i = 0; i < KEEP; ++i) {
        const int g = (first + i) / 8, e = (first + i) % 8;
        red[(warp * G + g) * D + chunk * 8 + e] = acc[i];
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < group * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    float o = 0.0f, m = stat[g * WARPS], l = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      o += red[(w * G + g) * D + d];
      m = fmaxf(m, stat[g * WARPS + w]);
      l += stat[(G + g) * WARPS + w];
    }
    const size_t h = head0 + g;
    if (n_splits == 1) {
      out[h * D + d] = from_float<T>(o / l);
    } else {
      part_out[(h * n_splits + split) * D + d] = o / l;
      if (d == 0) {
        part_ml[(h * n_splits + split) * 2] = m;
        part_ml[(h * n_splits + split) * 2 + 1] = l;
      }
    }
  }
  if (n_splits > 1) merge_if_last<T, D>(part_out, part_ml, arrival, out, head0, group, n_splits, n_live);
}
