// The GEMV's x prologue (linear.cu includes it ahead of its kernels): the x rows, or their RMSNorm,
// or both after a residual add, staged in shared memory before the main loop.
#pragma once

#include "mma.cuh"

using namespace cuinfer;

// Row stride (elements) of the normalized x in shared memory: rows 64 bytes apart modulo 128, so
// the two rows of x one 8-lane phase of a 16-byte load reads fall in different banks.
__host__ __device__ constexpr int norm_stride(int K) { return (K + 63) / 64 * 64 + 32; }

// xs[m, :] = the M <= MAXM rows of s, or with a weight w their RMSNorm (s is the residual stream),
// rounded as rms_norm.cu rounds it (rms_inv, rms_normed); ends with a barrier. K % 8 == 0.
// ADD (with w): s is first replaced by round(s + rms_normed(add_o, add_w)), rms_norm.cu's ADD 2
// (Gemma's output norm and residual add, of the previous linear layer's output add_o), which block
// (0, 0) also writes to add_out [M, K]: that norm needs no launch of its own either.
// The rows are taken p at a time, p the largest power of two <= min(M, WARPS), each by WARPS / p
// warps (RowShare), so a verify step's or a small batch's rows are reduced side by side, not one
// after another. M = 1 has a copy of its own in which the share is constants (every warp takes the
// row; its sum of squares is block_reduce's): the runtime share cost batch-1 GEMVs ~0.1 us each.
// Each thread copies the chunks it then sums. WS (the fp16 / bf16 GEMVs): every global read of the
// prologue is one cp.async round trip, the norm weights copied before pdl_wait
// (prefetch_norm_weights: no kernel writes them), the rows of s and add_o in one batch after it;
// the rest works in shared memory. Without WS (the quantized GEMVs, which measured slower with
// it: docs/linear.md) the rows of s are copied with cp.async unless ADD, and the rest is read
// from global memory where it is used.
// Shared memory (staged_smem in ops/linear.py), rows norm_stride(K) elements apart: xs [M], and
// with WS add_o's rows [M] (ADD), then w's copy, then add_w's (ADD).
template <int WARPS> struct RowShare {
  int first, step, wpr, i0;  // rows first, first + step, ...; wpr warps a row; chunks at i0, i0 + 256 wpr, ...
  __device__ __forceinline__ static RowShare whole() { return {0, 1, WARPS, static_cast<int>(threadIdx.x) * 8}; }
  __device__ __forceinline__ static RowShare of(int M) {
    constexpr int LW = ilog2(WARPS);
    static_assert(1 << LW == WARPS, "a power-of-two warp count");
    const int lg = 31 - __clz(min(M, WARPS));  // p = 2^lg
    return {static_cast<int>(threadIdx.x >> 5) >> (LW - lg), 1 << lg, WARPS >> lg,
            static_cast<int>(threadIdx.x & ((32 << (LW - lg)) - 1)) * 8};
  }
  // scratch[warp of the row] = the warp's sum of x; row_sum: the row's sum from them (after a barrier)
  __device__ __forceinline__ void warp_sum_to(float* scratch, float x) const {
    x = warp_reduce(x);
    if ((threadIdx.x & 31) == 0) scratch[(threadIdx.x >> 5) & (wpr - 1)] = x;
  }
  __device__ __forceinline__ float row_sum(const float* scratch) const {
    const int lane = threadIdx.x & 31;
    return warp_reduce(lane < wpr ? scratch[lane] : 0.0f);
  }
};

// WS: where the norm weights' copies sit in stage_rows' shared memory (w, then with ADD add_w
// norm_stride(K) further), past the rows.
template <bool ADD, typename T>
__device__ __forceinline__ T* norm_weights_in(T* xs, int M, int K) {
  return xs + (ADD ? 2 : 1) * M * norm_stride(K);
}

// WS: the norm weights' copies, one cp.async group; stage_rows waits for it with its own copies.
template <typename T, int THREADS, bool ADD>
__device__ __forceinline__ void prefetch_norm_weights(const T* __restrict__ w, const T* __restrict__ add_w, T* xs,
                                                      int M, int K) {
  if (w == nullptr) return;  // block-uniform
  const int ks = norm_stride(K);
  T* ws = norm_weights_in<ADD>(xs, M, K);
#pragma unroll 1
  for (int i = threadIdx.x * 8; i < K; i += THREADS * 8) {
    cp_async16(smem_u32(ws + i), w + i);
    if constexpr (ADD) cp_async16(smem_u32(ws + ks + i), add_w + i);
  }
  cp_async_commit();
}

template <typename T, int THREADS, bool ADD, bool WS, int MAXM>
__device__ __forceinline__ void stage_rows_as(const RowShare<THREADS / 32> rs, const T* __restrict__ s,
                                              const T* __restrict__ w, float eps, T* xs, int M, int K,
                                              const T* __restrict__ add_o, const T* __restrict__ add_w,
                                              T* __restrict__ add_out) {
  __shared__ float scratch[ADD ? 2 : 1][MAXM][32];
  const int ks = norm_stride(K);
  const bool writer = ADD && blockIdx.x == 0 && blockIdx.y == 0;
  const int i0 = rs.i0, di = rs.wpr * 256;  // this thread's chunks of a row: i0, i0 + di, ...
  // Where the loops read: row m of s and add_o at s_row(m), o_row(m); the weights at gw, aw.
  T* const os = xs + M * ks;
  const T* const gw = WS ? norm_weights_in<ADD>(xs, M, K) : w;
  const T* const aw = WS ? gw + ks : add_w;
  auto s_row = [&](int m) { return ADD && !WS ? s + (size_t)m * K : xs + m * ks; };
  auto o_row = [&](int m) { return WS ? os + m * ks : add_o + (size_t)m * K; };
  if (WS || !ADD) {
#pragma unroll 1
    for (int m = rs.first; m < M; m += rs.step)
#pragma unroll 1
      for (int i = i0; i < K; i += di) {
        cp_async16(smem_u32(xs + m * ks + i), s + (size_t)m * K + i);
        if (ADD && WS) cp_async16(smem_u32(os + m * ks + i), add_o + (size_t)m * K + i);
      }
    cp_async_commit();
    cp_async_wait_all();  // this thread's chunks have landed (it reads only those before a barrier)
  }
  if constexpr (ADD) {
#pragma unroll 1
    for (int m = rs.first; m < M; m += rs.step) {
      float o_sq = 0.0f;
#pragma unroll 1
      for (int i = i0; i < K; i += di) {
        const Vec<T, 8> o = Vec<T, 8>::load(o_row(m) + i);
#pragma unroll
        for (int e = 0; e < 8; ++e) o_sq += to_float(o.v[e]) * to_float(o.v[e]);
      }
      rs.warp_sum_to(scratch[1][m], o_sq);
    }
    __syncthreads();  // the sums (and with WS every thread's copies of the norm weights)
#pragma unroll 1
    for (int m = rs.first; m < M; m += rs.step) {
      const float add_inv_rms = rms_inv(rs.row_sum(scratch[1][m]), K, eps);
      float sum_sq = 0.0f;
#pragma unroll 1
      for (int i = i0; i < K; i += di) {
        Vec<T, 8> v = Vec<T, 8>::load(s_row(m) + i);
        const Vec<T, 8> o = Vec<T, 8>::load(o_row(m) + i), g = Vec<T, 8>::load(aw + i);
#pragma unroll
        for (int e = 0; e < 8; ++e)
          v.v[e] = from_float<T>(to_float(v.v[e]) + to_float(rms_normed(o.v[e], g.v[e], add_inv_rms)));
        if (writer) v.store(add_out + (size_t)m * K + i);
        v.store(xs + m * ks + i);
#pragma unroll
        for (int e = 0; e < 8; ++e) sum_sq += to_float(v.v[e]) * to_float(v.v[e]);
      }
      if (w != nullptr) rs.warp_sum_to(scratch[0][m], sum_sq);  // w is set with ADD: the test saves 4 registers (ptxas)
    }
  } else if (w != nullptr) {  // block-uniform
#pragma unroll 1
    for (int m = rs.first; m < M; m += rs.step) {
      float sum_sq = 0.0f;
#pragma unroll 1
      for (int i = i0; i < K; i += di) {
        const Vec<T, 8> v = Vec<T, 8>::load(xs + m * ks + i);
#pragma unroll
        for (int e = 0; e < 8; ++e) sum_sq += to_float(v.v[e]) * to_float(v.v[e]);
      }
      rs.warp_sum_to(scratch[0][m], sum_sq);
    }
  }
  if (w != nullptr) {
    __syncthreads();  // the sums (and the norm weights' copies)
#pragma unroll 1
    for (int m = rs.first; m < M; m += rs.step) {
      const float inv_rms = rms_inv(rs.row_sum(scratch[0][m]), K, eps);
#pragma unroll 1
      for (int i = i0; i < K; i += di) {  // this thread's own elements
        const Vec<T, 8> v = Vec<T, 8>::load(xs + m * ks + i), g = Vec<T, 8>::load(gw + i);
        Vec<T, 8> o;
#pragma unroll
        for (int e = 0; e < 8; ++e) o.v[e] = rms_normed(v.v[e], g.v[e], inv_rms);
        o.store(xs + m * ks + i);
      }
    }
  }
  __syncthreads();
}

template <typename T, int THREADS, bool ADD, bool WS, int MAXM>
__device__ __forceinline__ void stage_rows(const T* __restrict__ s, const T* __restrict__ w, float eps, T* xs,
                                           int M, int K, const T* __restrict__ add_o, const T* __restrict__ add_w,
                                           T* __restrict__ add_out) {
  using Share = RowShare<THREADS / 32>;
  if (M == 1)
    stage_rows_as<T, THREADS, ADD, WS, MAXM>(Share::whole(), s, w, eps, xs, M, K, add_o, add_w, add_out);
  else
    stage_rows_as<T, THREADS, ADD, WS, MAXM>(Share::of(M), s, w, eps, xs, M, K, add_o, add_w, add_out);
}
