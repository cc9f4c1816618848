// The epilogue of linear_mma.cu's two kernels, included after that file's helpers (it uses mma_gated,
// red_stride, Block and WG_STAMP): store_rows, which sums a block's results over its cluster and
// stores them through the bias, residual or gated activation, and mma_epilogue, the mma.sync
// kernel's way into it.
#pragma once

namespace {

// W outputs of T as one vector (W = 8: 16 bytes, 4: 8).
template <int BYTES> struct VecOfBytes;
template <> struct VecOfBytes<16> { using type = uint4; };
template <> struct VecOfBytes<8> { using type = uint2; };
template <typename T, int W> using UnitVec = typename VecOfBytes<W * sizeof(T)>::type;

// What a unit (W = 8 or 4 consecutive outputs of an x row) needs from global memory besides its sums:
// the residual and, int8, the row scales (gated: then the up rows'). Loaded by itself, so that a split
// call can issue the loads before it waits for its cluster.
template <typename T, int WBITS, int EPI, int W>
struct UnitInputs {
  static constexpr int kScales = WBITS == 8 ? (mma_gated(EPI) ? 2 * W : W) : 0;
  T res[W];
  __half sc[kScales > 0 ? kScales : 1];
  __device__ __forceinline__ void load(const __half* __restrict__ scales, const T* __restrict__ residual, int m,
                                       int row, int N, bool vec) {
    using V = UnitVec<T, W>;
    if (EPI == MMA_EPI_STORE && residual != nullptr) {
      if (vec) *reinterpret_cast<V*>(res) = *reinterpret_cast<const V*>(residual + (size_t)m * N + row);
      else
#pragma unroll
        for (int k = 0; k < W; ++k) res[k] = row + k < N ? residual[(size_t)m * N + row + k] : T();
    }
#pragma unroll
    for (int k = 0; k < kScales; ++k) sc[k] = scales[min(row + k % W, N - 1) + (k / W) * N];
  }
};

// A unit's W sums (gated: and their up rows' in g) through the epilogue to out[m][row .. row + W).
template <typename T, int WBITS, int EPI, int W>
__device__ __forceinline__ void store_unit(const float (&y)[W], const float (&g)[W],
                                           const UnitInputs<T, WBITS, EPI, W>& in, const T* __restrict__ bias,
                                           bool residual, T* __restrict__ out, int m, int row, int N, bool vec) {
  T o[W];
#pragma unroll
  for (int k = 0; k < W; ++k) {
    const int rk = min(row + k, N - 1);  // past N: computed, not stored
    float v = y[k];
    if constexpr (WBITS == 8) v *= __half2float(in.sc[k]);
    if (bias != nullptr) v += to_float(bias[rk]);
    if constexpr (mma_gated(EPI)) {
      float up = g[k];
      if constexpr (WBITS == 8) up *= __half2float(in.sc[k + W]);
      if (bias != nullptr) up += to_float(bias[rk + N]);
      v = (EPI == MMA_EPI_SILU_AND_MUL ? silu(v) : gelu_tanh(v)) * up;
    }
    if (EPI == MMA_EPI_STORE && residual)
      v = to_float(from_float<T>(v)) + to_float(in.res[k]);  // round(round(y) + residual)
    o[k] = from_float<T>(v);
  }
  if (vec) *reinterpret_cast<UnitVec<T, W>*>(out + (size_t)m * N + row) = *reinterpret_cast<const UnitVec<T, W>*>(o);
  else
#pragma unroll
    for (int k = 0; k < W; ++k)
      if (row + k < N) out[(size_t)m * N + row + k] = o[k];
}

// A unit's sums from red ([8 NT x rows][red_stride(ROWS)] fp32: an x row's ROWS weight rows in order,
// gated the first half the gate rows and the second their up rows) of each of the cluster's SPLIT
// blocks, added in rank order (SPLIT > 1: through distributed shared memory).
template <int ROWS, int OUTS, int SPLIT, bool GATED, int W>
__device__ __forceinline__ void unit_sums(float (&y)[W], float (&g)[W], const float* red, int mi, int r0) {
  constexpr int P = W / 4;  // 16-byte pieces of y
#pragma unroll
  for (int s = 0; s < SPLIT; ++s)
#pragma unroll
    for (int q = 0; q < (GATED ? 2 : 1) * P; ++q) {  // y, then gated the up rows
      const float* p = red + mi * red_stride(ROWS) + r0 + (q % P) * 4 + (q / P) * OUTS;
      float4 v;
      if constexpr (SPLIT > 1) {
#if __CUDA_ARCH__ >= 900
        v = load_cluster4(p, s);
#endif
      } else {
        v = *reinterpret_cast<const float4*>(p);
      }
      float* d = (q / P ? g : y) + (q % P) * 4;
      if (s == 0) d[0] = v.x, d[1] = v.y, d[2] = v.z, d[3] = v.w;
      else d[0] += v.x, d[1] += v.y, d[2] += v.z, d[3] += v.w;
    }
}

// The block's results in red summed over the cluster's blocks and stored through the epilogue by
// THREADS threads, a unit of W outputs at a time (W-element loads and stores where N % W == 0 and out
// and residual are aligned to them). tid: the thread's index among the THREADS; NAMED: they are not
// the whole block, and meet at named barrier 1 instead of __syncthreads. With SPLIT > 1 each block of
// the cluster finishes 1 / SPLIT of the units, at most MAXU a thread: it loads their inputs before the
// cluster's barrier and arrives at the closing one as soon as it has read the others' results, so
// neither the global loads nor the stores sit between the two barriers. Units are 4 outputs with a
// split, 8 without: a thread's 16-byte reads of the results then fall 16 bytes apart (32 with units of
// 8: two passes of shared memory where one does), and a split's units spread over all of its
// cluster's threads (llama3-8b's o and down at 25-32 rows: 512 units of 8 on 8 blocks of 128 threads
// would leave four blocks idle and the others reading 16 remote pieces a thread). A block's own
// results (no split) keep units of 8, which measured faster there, and so do splits whose threads
// would finish more than 12 units of 4 (NX = 224 split 2: ptxas spills there).
template <typename T, int WBITS, int ROWS, int XR, int THREADS, int SPLIT, int EPI, bool NAMED = false>
__device__ __forceinline__ void store_rows(const float* red, const __half* __restrict__ scales,
                                           const T* __restrict__ bias, const T* __restrict__ residual,
                                           T* __restrict__ out, const Block& b, int M, int N,
                                           int tid) {
  constexpr bool GATED = mma_gated(EPI);
  constexpr int OUTS = GATED ? ROWS / 2 : ROWS, ST = SPLIT * THREADS;
  constexpr int W = SPLIT > 1 && (XR * OUTS / 4 + ST - 1) / ST <= 12 ? 4 : 8, UNITS = XR * OUTS / W;
  static_assert(ROWS % 32 == 0, "red_stride(ROWS) = 4 mod 32");
  const bool vec = N % W == 0 &&
                   ((reinterpret_cast<size_t>(out) | reinterpret_cast<size_t>(residual)) & (W * sizeof(T) - 1)) == 0;
  const auto unit = [&](int u, int& mi, int& r0, int& m, int& row) {
    mi = u / (OUTS / W), r0 = u % (OUTS / W) * W, m = b.m0 + mi, row = b.row0 + r0;
    return u < UNITS && m < M && row < N;
  };
  int mi, r0, m, row;
  if constexpr (SPLIT == 1) {
    if constexpr (NAMED) asm volatile("bar.sync 1, %0;\n" ::"n"(THREADS) : "memory");
    else __syncthreads();
    for (int u = tid; u < UNITS; u += THREADS) {
      if (!unit(u, mi, r0, m, row)) continue;
      float y[W], g[W];
      unit_sums<ROWS, OUTS, 1, GATED, W>(y, g, red, mi, r0);
      UnitInputs<T, WBITS, EPI, W> in;
      in.load(scales, residual, m, row, N, vec);
      store_unit<T, WBITS, EPI, W>(y, g, in, bias, residual != nullptr, out, m, row, N, vec);
    }
  } else {
#if __CUDA_ARCH__ >= 900
    constexpr int MAXU = (UNITS + ST - 1) / ST;
    const int u0 = cluster_rank() * THREADS + tid;
    UnitInputs<T, WBITS, EPI, W> in[MAXU];
#pragma unroll
    for (int i = 0; i < MAXU; ++i)
      if (unit(u0 + i * ST, mi, r0, m, row)) in[i].load(scales, residual, m, row, N, vec);
    cluster_sync();  // every block's results are in its shared memory
    WG_STAMP(threadIdx.x == (THREADS < 256 ? 0 : 128), 6, clock64());
    float y[MAXU][W], g[MAXU][W];
#pragma unroll
    for (int i = 0; i < MAXU; ++i)
      if (unit(u0 + i * ST, mi, r0, m, row)) unit_sums<ROWS, OUTS, SPLIT, GATED, W>(y[i], g[i], red, mi, r0);
    WG_STAMP(threadIdx.x == (THREADS < 256 ? 0 : 128), 8, clock64());
    cluster_arrive();  // this thread's reads of the others' shared memory are done
#pragma unroll
    for (int i = 0; i < MAXU; ++i)
      if (unit(u0 + i * ST, mi, r0, m, row))
        store_unit<T, WBITS, EPI, W>(y[i], g[i], in[i], bias, residual != nullptr, out, m, row, N, vec);
    WG_STAMP(threadIdx.x == (THREADS < 256 ? 0 : 128), 9, clock64());
    cluster_wait();  // every block's reads of this one's are done: it may exit
#else
    __trap();  // unreachable: SPLIT > 1 is launched on sm_90 and newer only (ops/linear_mma.py)
#endif
  }
}

// The warps' fragments to shared memory as store_rows reads them, then store_rows. acc[r][n][j] is the
// mma.sync C fragment: weight row (warp RT + r) 16 + lane / 4 (+ 8 for j >= 2), x row 8 n + 2 (lane % 4)
// (+ 1 for odd j).
template <typename T, int WBITS, int NT, int RT, int WARPS, int SPLIT, int EPI>
__device__ __forceinline__ void mma_epilogue(const float (&acc)[RT][NT][4], float* red,
                                             const __half* __restrict__ scales,
                                             const T* __restrict__ bias, const T* __restrict__ residual,
                                             T* __restrict__ out, const Block& b, int M, int N) {
  constexpr int ROWS = 16 * RT * WARPS, RS = red_stride(ROWS);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        red[(8 * n + 2 * (lane & 3) + (j & 1)) * RS + (warp * RT + r) * 16 + (lane >> 2) + 8 * (j >> 1)] = acc[r][n][j];
  store_rows<T, WBITS, ROWS, 8 * NT, 32 * WARPS, SPLIT, EPI>(red, scales, bias, residual, out, b, M, N, threadIdx.x);
}

}  // namespace
