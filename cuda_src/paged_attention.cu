// Paged decode attention (one query token per sequence), flash-decoding split over the context.
//
// One CTA per (split, kv_head, sequence) computes all G query heads of the KV group
// from one read of each K/V row. A row of D elements is KL lanes x 16 bytes (KL =
// D/8 rounded up to a power of two), so a warp covers 32/KL rows per step; U steps
// are loaded before they are used, to keep enough 16-byte loads in flight. The split's
// block-table entries are staged in shared memory first, and the loads are unpredicated
// (rows past the end and lanes past D read a valid row, their results are dropped), so
// the U loads of a step issue back to back instead of waiting on a table read each.
// Pass 1 writes the scores (prescaled by scale * log2 e) of the split's tokens to
// shared memory, pass 2 turns them into exp2(s - max), pass 3 streams V.
// With one split the CTA writes the output; otherwise fp32 (out / sum, max, sum)
// partials go to the merge kernel below.
#include "common.cuh"

using namespace cuinfer;

// grid: (n_splits, n_kv_heads, num_seqs) · block: 128
// smem: 4 * (G * partition + 4 * G * D + 8 * G + partition / block_size + 2)
// q, out: [num_seqs, n_heads, D]; k_cache, v_cache: [num_blocks, 1 << block_shift, n_kv_heads, D]
// block_tables: [num_seqs, max_blocks]; context_lens: [num_seqs]
// part_out: [num_seqs, n_heads, n_splits, D] fp32; part_ml: [num_seqs, n_heads, n_splits, 2] (max, sum)
// G: query heads per KV head, padded (the real count is n_heads / n_kv_heads <= G).
// U: K/V rows each lane loads before it uses the first (bytes in flight).
// Launch bounds: 5 CTAs per SM (<= 102 registers) where that costs no spills (G <= 4, D <= 128).
template <typename T, int D, int G, int U>
__global__ void __launch_bounds__(128, (G <= 4 && D <= 128) ? 5 : 1) paged_attention_kernel(
    const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_ml,
    const int* __restrict__ block_tables, const int* __restrict__ context_lens, int max_blocks,
    int block_shift, int n_heads, int n_kv_heads, int partition, float scale_log2) {
  pdl_wait();  // every input of this kernel may come from the previous one
  pdl_trigger();
  constexpr int WARPS = 4;
  constexpr int CHUNKS = D / 8;
  constexpr int KL = CHUNKS <= 8 ? 8 : (CHUNKS <= 16 ? 16 : 32);  // lanes per row
  constexpr int RPW = 32 / KL;                                      // rows per warp step
  constexpr int STEP = WARPS * RPW;                                 // rows per CTA step
  static_assert(CHUNKS <= 32, "D must be at most 256");

  const int split = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z, n_splits = gridDim.x;
  const int group = n_heads / n_kv_heads;
  const int ctx = context_lens[seq];
  const int start = split * partition, end = min(ctx, start + partition), len = end - start;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, sub = lane / KL, chunk = lane % KL;
  const bool active = chunk < CHUNKS;
  const size_t head0 = (size_t)seq * n_heads + (size_t)kv_head * group;  // first q head of the group

  if (len <= 0) {  // an empty split (or an empty context): zeros, and sum 0 for the merge
    for (int i = tid; i < group * D; i += blockDim.x) {
      const size_t h = head0 + i / D;
      if (n_splits == 1) {
        out[h * D + i % D] = from_float<T>(0.0f);
      } else {
        part_out[(h * n_splits + split) * D + i % D] = 0.0f;  // the merge weighs it by 0, so it must be finite
        if (i % D == 0) {
          part_ml[(h * n_splits + split) * 2] = Max::identity();
          part_ml[(h * n_splits + split) * 2 + 1] = 0.0f;
        }
      }
    }
    return;
  }

  extern __shared__ float smem[];
  float* scores = smem;                       // [G][partition]
  float* red = scores + G * partition;        // [WARPS][G][D]
  float* stat = red + WARPS * G * D;          // [2][G][WARPS]: max, sum
  int* blocks = reinterpret_cast<int*>(stat + 2 * G * WARPS);  // the split's block-table entries

  const int* table = block_tables + (size_t)seq * max_blocks;
  const int first_block = start >> block_shift;
  for (int i = tid; i <= ((end - 1) >> block_shift) - first_block; i += blockDim.x)
    blocks[i] = table[first_block + i];

  float qv[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    VecF<T, 8> x{};
    if (g < group && active) x = VecF<T, 8>::from(Vec<T, 8>::load(q + (head0 + g) * D + chunk * 8));
#pragma unroll
    for (int e = 0; e < 8; ++e) qv[g][e] = x.v[e] * scale_log2;
  }
  __syncthreads();  // blocks[] written

  const int block_mask = (1 << block_shift) - 1;
  const size_t row_stride = (size_t)n_kv_heads * D;
  const size_t col = (size_t)kv_head * D + min(chunk, CHUNKS - 1) * 8;  // idle lanes re-read a valid chunk
  // element offset of token t's row (t clamped to the split, so every load is in bounds)
  auto offset_of = [&](int t) {
    t = min(t, end - 1);
    return (((size_t)blocks[(t >> block_shift) - first_block] << block_shift) + (t & block_mask)) * row_stride + col;
  };

  // pass 1: scores
  float mx[G];
#pragma unroll
  for (int g = 0; g < G; ++g) mx[g] = Max::identity();
  for (int base = start + warp * RPW; base < end; base += STEP * U) {  // warp-uniform loop
    Vec<T, 8> kr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) kr[u] = Vec<T, 8>::load(k_cache + offset_of(base + u * STEP + sub));
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = base + u * STEP + sub;
      const VecF<T, 8> kf = VecF<T, 8>::from(kr[u]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float acc = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = fmaf(qv[g][e], kf.v[e], acc);
#pragma unroll
        for (int o = KL / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (t < end) {
          mx[g] = fmaxf(mx[g], acc);
          if (chunk == 0) scores[g * partition + t - start] = acc;
        }
      }
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float m = warp_reduce<Max>(mx[g]);
    if (lane == 0) stat[g * WARPS + warp] = m;
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float m = stat[g * WARPS];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) m = fmaxf(m, stat[g * WARPS + w]);
    mx[g] = m;  // every row of the split has a finite score, so m is finite
  }

  // pass 2: p = exp2(s - max), row sums
  float sum[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float s = 0.0f;
    for (int t = tid; t < len; t += blockDim.x) {
      const float p = exp2f(scores[g * partition + t] - mx[g]);
      scores[g * partition + t] = p;
      s += p;
    }
    s = warp_reduce(s);
    if (lane == 0) stat[(G + g) * WARPS + warp] = s;
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) s += stat[(G + g) * WARPS + w];
    sum[g] = s;
  }

  // pass 3: acc = sum_t p_t v_t for this lane's 8 columns
  float acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;
  for (int base = start + warp * RPW; base < end; base += STEP * U) {
    Vec<T, 8> vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) vr[u] = Vec<T, 8>::load(v_cache + offset_of(base + u * STEP + sub));
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = min(base + u * STEP + sub, end - 1);
      const bool live = base + u * STEP + sub < end;
      const VecF<T, 8> vf = VecF<T, 8>::from(vr[u]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = live ? scores[g * partition + t - start] : 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, vf.v[e], acc[g][e]);
      }
    }
  }
  // reduce over the rows a warp step covers (lanes with the same chunk), then over warps
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e)
#pragma unroll
      for (int o = KL; o < 32; o <<= 1) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
  if (sub == 0 && active) {
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < 8; ++e) red[(warp * G + g) * D + chunk * 8 + e] = acc[g][e];
  }
  __syncthreads();
  for (int i = tid; i < group * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) o += red[(w * G + g) * D + d];
    float l = 0.0f, m = 0.0f;
#pragma unroll
    for (int gg = 0; gg < G; ++gg)  // register arrays indexed by constants only
      if (gg == g) l = sum[gg], m = mx[gg];
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
}

// grid: (n_heads, num_seqs) · block: 128 · smem: 4 * round_up(n_splits, 8) (the split weights)
// part_out: [num_seqs, n_heads, n_splits, D]; part_ml: [num_seqs, n_heads, n_splits, 2]; out: [num_seqs, n_heads, D]
// out = sum_s w_s part_out_s / sum_s w_s with w_s = sum_s * exp2(max_s - max); empty splits have sum 0
// (and part_out 0). The weights go to shared memory first (zero-padded to a multiple of 8), so the
// loop over splits issues 8 independent loads at a time and every access is in bounds.
template <typename T, int D>
__global__ void __launch_bounds__(128) paged_attention_merge_kernel(
    const float* __restrict__ part_out, const float* __restrict__ part_ml, T* __restrict__ out, int n_splits) {
  pdl_wait();  // every input of this kernel may come from the previous one
  pdl_trigger();
  constexpr int CH = 8;
  extern __shared__ float weight[];  // [round_up(n_splits, CH)]
  __shared__ float scratch[32];
  const int n_pad = (n_splits + CH - 1) / CH * CH;
  const size_t h = (size_t)blockIdx.y * gridDim.x + blockIdx.x;
  const float* ml = part_ml + h * n_splits * 2;
  float m = Max::identity();
  for (int s = threadIdx.x; s < n_splits; s += blockDim.x)
    if (ml[2 * s + 1] > 0.0f) m = fmaxf(m, ml[2 * s]);
  m = block_reduce<Max>(m, scratch);
  float wsum = 0.0f;
  for (int s = threadIdx.x; s < n_pad; s += blockDim.x) {
    const float l = s < n_splits ? ml[2 * s + 1] : 0.0f;
    const float w = l > 0.0f ? l * exp2f(ml[2 * s] - m) : 0.0f;
    weight[s] = w;
    wsum += w;
  }
  wsum = block_reduce(wsum, scratch);  // its barriers also publish weight[]
  const float* po = part_out + h * n_splits * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int s0 = 0; s0 < n_pad; s0 += CH) {
      float pv[CH];
#pragma unroll
      for (int i = 0; i < CH; ++i) pv[i] = s0 + i < n_splits ? po[(size_t)(s0 + i) * D + d] : 0.0f;
#pragma unroll
      for (int i = 0; i < CH; ++i) acc = fmaf(weight[s0 + i], pv[i], acc);
    }
    out[h * D + d] = from_float<T>(wsum > 0.0f ? acc / wsum : 0.0f);
  }
}
