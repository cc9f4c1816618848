// Quantized linear layers y = x @ W.T (+ bias) at M = 17..256 rows of x: a tensor-core GEMM with
// the int8 / int4 weight dequantized in registers (the decode GEMV of linear.cu covers M <= 16).
//
// Weight formats as linear.cu (cuinfer/ops/quant.py documents them): int8 q [N, K] with one fp16
// scale per row; int4 tiles16 q uint32 [ceil(N/16), ceil(K/128), 16, 16] (a tile's 128 k as 1 KB,
// a row's 64 bytes in the interleaved nibble order) with (scale, zero) pairs [ceil(N/16), K/GS, 16].
//
// One block: WARPS warps, each RT 16-row weight tiles (A of mma.sync m16n8k16) times the block's
// 8 NT rows of x (NT n8 tiles of B), fp32 accumulators. K runs in stages of 128 k through a
// STAGES-deep cp.async ring in shared memory holding, per stage, the block's weight rows (64 bytes
// a row and quad, each 16-row tile as 1 KB in the tiles16 order, copied row by row so that any N and
// a [gate; up] split inside a storage tile need nothing special), its int4 (scale, zero) pairs and
// the 8 NT x rows (padded rows: the 16-byte fragment loads below are free of bank conflicts). Every warp reads the whole x
// tile, so each x load feeds RT weight tiles and each dequantized weight fragment NT x tiles.
// The fragments follow linear.cu's relabelling of the contraction index: lane c of a quad gives
// its four k slots {2c, 2c+1, 2c+8, 2c+9} of a k16 step to four consecutive k of its own 16-byte
// weight chunk, and reads x with the same map (one 16-byte load per x row and 8 k): no shuffles.
// int4 feeds the tensor cores exact q - zero (integer zeros, IZ) or q plus a second mma with
// A = ones (fractional zeros), per scale group, and the group ends with acc += scale * sum in fp32
// (quant.cuh); int8 is exact in T and its per-row scale multiplies the finished sum. So y is
// x @ dequantize(W).T in fp32, rounded once, as the GEMV computes it.
//
// Rows of x past M read row M - 1 and weight rows past N read the last tile / row: their outputs are
// never stored (a row of A or a column of B reaches only its own outputs). Grids of fewer blocks
// than SMs split K over a thread-block cluster (sm_90) reduced through distributed shared memory.
//
// linear_wgmma_kernel (below, "wgmma"): the same fragments fed to wgmma from registers, for int4 with
// integer zeros and for int8 on sm_90, with a producer warpgroup that stores x in the fragments' k
// order; and fp16 / bf16 weights copied by TMA in wgmma's own layout, both operands from shared memory.
#include "mma.cuh"
#include "quant.cuh"

using namespace cuinfer;

// Epilogues (EPILOGUES of ops/linear.py): store y (+ bias) with an optional residual,
// round(round(y) + residual); act(gate) * up of the stacked weight [gate; up] ([2N, K]), both sums
// in fp32, rounded once (act: SiLU or GELU-tanh).
#define MMA_EPI_STORE 0
#define MMA_EPI_SILU_AND_MUL 1
#define MMA_EPI_GELU_AND_MUL 3

#if __CUDA_ARCH__ >= 900
#define MMA_CLUSTER(n) __cluster_dims__(1, n, 1)
#else
#define MMA_CLUSTER(n)
#endif

namespace {

__host__ __device__ constexpr bool mma_gated(int epi) {
  return epi == MMA_EPI_SILU_AND_MUL || epi == MMA_EPI_GELU_AND_MUL;
}

// store_rows' row stride (floats) for a block of `rows` weight rows: 4 mod 32, so the fragments'
// writes of both GEMMs are free of bank conflicts.
__host__ __device__ constexpr int red_stride(int rows) { return rows + 4; }

// Shared-memory geometry of a block (bytes). ops/linear_mma.py smem_bytes mirrors kSmem.
template <int WBITS, int GS, int NT, int RT, int WARPS, int STAGES> struct Geo {
  static constexpr int kTiles = RT * WARPS;                   // 16-row weight tiles of the block
  static constexpr int kQuads = WBITS == 4 ? 1 : 2;           // 1 KB weight quads per tile and stage
  static constexpr int kGroups = WBITS == 4 ? 128 / GS : 0;   // int4 scale groups per stage
  static constexpr int kW = kTiles * kQuads * 1024;           // weights of a stage
  static constexpr int kS = kTiles * kGroups * 64;            // int4 (scale, zero) pairs of a stage
  static constexpr int kXRow = 256 + (WBITS == 4 ? 64 : 16);  // one x row of a stage, padded
  static constexpr int kStage = kW + kS + 8 * NT * kXRow;
  static constexpr int kRed = 8 * NT * red_stride(16 * kTiles) * 4;  // fp32 results of the epilogue (store_rows)
  static constexpr int kSmem = STAGES * kStage > kRed ? STAGES * kStage : kRed;
};

// What a block works on: its output rows [row0, row0 + 16 RT (WARPS or WARPS / 2 gated)), x rows
// [m0, m0 + 8 NT), stages [t_begin, t_end) of K.
struct Block {
  int row0, m0, t_begin, t_end;
};

// Block tile ti (warp ti / RT, its tile ti % RT): the weight half (gate 0, up 1) and the first
// output row. Gated: warps [0, WARPS / 2) hold gate rows, the others the up rows of the same outputs.
template <int RT, int WARPS, int EPI> __device__ __forceinline__ int tile_row(int ti, int row0, int& half) {
  const int w = ti / RT;
  half = mma_gated(EPI) ? w / (WARPS / 2) : 0;
  const int wr = mma_gated(EPI) ? w % (WARPS / 2) : w;
  return row0 + (wr * RT + ti % RT) * 16;
}

// 4-byte global -> shared copy (cp.async.cg takes 16 bytes only).
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

// The cp.async copies of one stage, their sources kept as 32-bit byte offsets computed once (a
// stage adds t times a constant): this thread's chunks i = threadIdx.x + j 32 WARPS. Weights go row
// by row: a block tile's row rr is weight row half N + min(first + rr, N - 1) (any N; the up half of
// an int4 [gate; up] may start inside a storage tile). In a slot each block tile is 16 rows of 64
// bytes per quad (int8: two quads), its int4 (scale, zero) pairs 64 bytes per group, then the x
// rows (kXRow bytes apart, zeros past K). The first weights are issued before pdl_wait.
template <typename T, int WBITS, int GS, int NT, int RT, int WARPS, int STAGES, int EPI> struct Loader {
  using G = Geo<WBITS, GS, NT, RT, WARPS, STAGES>;
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int kWC = G::kTiles * (WBITS == 4 ? 64 : 128) / THREADS;  // weight chunks a thread
  static constexpr int kSC = WBITS == 4 ? G::kTiles * G::kGroups * 16 / THREADS : 0;  // 4-byte pair copies
  static constexpr int kXC = 8 * NT * 16 / THREADS;                           // x chunks a thread
  static_assert(kWC * THREADS == G::kTiles * (WBITS == 4 ? 64 : 128) && kXC * THREADS == 8 * NT * 16 &&
                    (WBITS == 8 || kSC * THREADS == G::kTiles * G::kGroups * 16),
                "whole chunks per thread");
  const char* w;
  const char* s;
  const char* x;
  unsigned w_off[kWC], s_off[kSC > 0 ? kSC : 1], x_off[kXC];
  int K, n_groups;

  __device__ __forceinline__ static int weight_row(int ti, int rr, int row0, int N) {
    int half;
    const int first = tile_row<RT, WARPS, EPI>(ti, row0, half);
    return half * N + min(first + rr, N - 1);
  }

  __device__ __forceinline__ Loader(const T* x_, const void* w_, const __half* scales, const Block& b, int M, int N,
                                    int K_)
      : w(static_cast<const char*>(w_)), s(reinterpret_cast<const char*>(scales)),
        x(reinterpret_cast<const char*>(x_)), K(K_), n_groups(WBITS == 4 ? K_ / GS : 0) {
#pragma unroll
    for (int j = 0; j < kWC; ++j) {
      const int i = threadIdx.x + j * THREADS;
      if constexpr (WBITS == 4) {  // i: tile i / 64, row (i / 4) % 16, 16-byte chunk i % 4
        const int row = weight_row(i >> 6, (i >> 2) & 15, b.row0, N);
        w_off[j] = static_cast<unsigned>(tiled_row(row, (K + 127) / 128) * 64 + (i & 3) * 16);
      } else {  // i: tile i / 128, row (i / 8) % 16, chunk i % 8 of the row's 128 k
        const int row = weight_row(i >> 7, (i >> 3) & 15, b.row0, N);
        w_off[j] = static_cast<unsigned>((size_t)row * K + 16 * (i & 7));
      }
    }
#pragma unroll
    for (int j = 0; j < kSC; ++j) {  // i: tile, group gi of the stage, row i % 16
      const int i = threadIdx.x + j * THREADS, gi = (i / 16) % G::kGroups;
      const int row = weight_row(i / (G::kGroups * 16), i & 15, b.row0, N);
      s_off[j] = static_cast<unsigned>((tiled_row(row, n_groups) + 16 * gi) * 4);
    }
#pragma unroll
    for (int j = 0; j < kXC; ++j) {  // i: x row i / 16, 16-byte chunk i % 16
      const int i = threadIdx.x + j * THREADS, m = min(b.m0 + (i >> 4), M - 1);
      x_off[j] = static_cast<unsigned>(((size_t)m * K + 8 * (i & 15)) * sizeof(T));
    }
  }

  // Stage t's weights (and int4 pairs) into the slot at shared address st.
  __device__ __forceinline__ void weights(unsigned st, int t) const {
#pragma unroll
    for (int j = 0; j < kWC; ++j) {
      const int i = threadIdx.x + j * THREADS;
      if constexpr (WBITS == 4) {
        cp_async16(st + i * 16, w + w_off[j] + (size_t)t * 1024);
      } else {
        const bool ok = t * 128 + 16 * (i & 7) < K;
        cp_async16(st + (i >> 7) * 2048 + ((i >> 2) & 1) * 1024 + ((i >> 3) & 15) * 64 + (i & 3) * 16,
                   w + (ok ? w_off[j] + (size_t)t * 128 : 0), ok);
      }
    }
#pragma unroll
    for (int j = 0; j < kSC; ++j) {
      const int i = threadIdx.x + j * THREADS;
      if (t * G::kGroups + (i / 16) % G::kGroups < n_groups)
        cp_async4(st + G::kW + i * 4, s + s_off[j] + (size_t)t * G::kGroups * 64);
    }
  }

  // Stage t's x rows into the slot at shared address st.
  __device__ __forceinline__ void rows(unsigned st, int t) const {
#pragma unroll
    for (int j = 0; j < kXC; ++j) {
      const int i = threadIdx.x + j * THREADS;
      const bool ok = t * 128 + 8 * (i & 15) < K;
      cp_async16(st + G::kW + G::kS + (i >> 4) * G::kXRow + (i & 15) * 16,
                 x + (ok ? x_off[j] + (size_t)t * 128 * sizeof(T) : 0), ok);
    }
  }
};

// The lane's 16 bytes of x row 8 n + g4 at element e of the stage.
template <int XROW> __device__ __forceinline__ uint4 x16(const unsigned char* xs, int n, int g4, int e) {
  return *reinterpret_cast<const uint4*>(xs + (8 * n + g4) * XROW + 2 * e);
}

// acc += one int4 stage (one 128-k quad) of this warp's RT tiles: wst / sst the warp's weights and
// pairs in the slot, xs the slot's x rows. Per scale group the mma steps sum p = (q - z) x exactly;
// IZ: z = zero and acc += scale p, else z = 0, px = sum x (A = ones), acc += scale (p - zero px).
// The x tiles go in chunks of NC (p: RT NC 4 registers, not RT NT 4), each converting the group's
// nibbles again: ALU work is cheap next to the tensor cores' at these tiles.
template <typename T, int GS, bool IZ, int NT, int RT, int XROW>
__device__ __forceinline__ void int4_stage(float (&acc)[RT][NT][4], const unsigned char* wst,
                                           const unsigned char* sst, const unsigned char* xs, int t, int n_groups) {
  constexpr int GQ = 128 / GS, kWords = GS / 32, NC = NT < 4 ? NT : 4;
  static_assert(NT % NC == 0, "x tiles in whole chunks");
  constexpr u32 ones[4] = {Pair<T>::kOne, Pair<T>::kOne, Pair<T>::kOne, Pair<T>::kOne};
  const int lane = threadIdx.x & 31, c = lane & 3, g4 = lane >> 2;
  uint4 raw[RT][2];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      raw[r][h] = *reinterpret_cast<const uint4*>(wst + r * 1024 + (g4 + 8 * h) * 64 + 16 * c);
#pragma unroll
  for (int gi = 0; gi < GQ; ++gi) {
    if (t * GQ + gi >= n_groups) break;  // the last quad of K % 128 != 0: its padding is never computed
    __half2 sz[RT][2];
    ZeroSub zs[RT][2];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sz[r][h] = *reinterpret_cast<const __half2*>(sst + (r * GQ + gi) * 64 + (g4 + 8 * h) * 4);
        zs[r][h] = zero_sub<IZ>(sz[r][h], T());
      }
#pragma unroll
    for (int n0 = 0; n0 < NT; n0 += NC) {
      float p[RT][NC][4], px[NC][4];
#pragma unroll
      for (int n = 0; n < NC; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          px[n][j] = 0.0f;
#pragma unroll
          for (int r = 0; r < RT; ++r) p[r][n][j] = 0.0f;
        }
#pragma unroll
      for (int wi = 0; wi < kWords; ++wi) {
        const int j = gi * kWords + wi;  // word j: k = 32 j + 8 c .. +8 of the quad, mma steps 2j, 2j+1
        u32 ql[RT][4], qh[RT][4];        // rows g4, g4 + 8
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          int4_word<T>(reinterpret_cast<const u32*>(&raw[r][0])[j], zs[r][0], ql[r]);
          int4_word<T>(reinterpret_cast<const u32*>(&raw[r][1])[j], zs[r][1], qh[r]);
        }
#pragma unroll
        for (int n = 0; n < NC; ++n) {
          const uint4 bv = x16<XROW>(xs, n0 + n, g4, 32 * j + 8 * c);
          const u32* bw = reinterpret_cast<const u32*>(&bv);
#pragma unroll
          for (int st = 0; st < 2; ++st) {
            if constexpr (!IZ) mma16816<T>(px[n], ones, bw[2 * st], bw[2 * st + 1]);
#pragma unroll
            for (int r = 0; r < RT; ++r) {
              const u32 a[4] = {ql[r][2 * st], qh[r][2 * st], ql[r][2 * st + 1], qh[r][2 * st + 1]};
              mma16816<T>(p[r][n], a, bw[2 * st], bw[2 * st + 1]);
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // accumulator values 2h, 2h + 1 are weight row g4 + 8 h
          const float scale = __low2float(sz[r][h]), zero = __high2float(sz[r][h]);
#pragma unroll
          for (int n = 0; n < NC; ++n)
#pragma unroll
            for (int e = 2 * h; e < 2 * h + 2; ++e)
              acc[r][n0 + n][e] = fmaf(scale, IZ ? p[r][n][e] : fmaf(-zero, px[n][e], p[r][n][e]), acc[r][n0 + n][e]);
        }
    }
  }
}

// acc += one int8 stage (two 64-k quads; lane c's 16 bytes are k 16 c .. +16 of a quad, words
// 2 xl + s feeding mma step s of x load xl) of this warp's RT tiles. Quads past K are skipped.
template <typename T, int NT, int RT, int XROW>
__device__ __forceinline__ void int8_stage(float (&acc)[RT][NT][4], const unsigned char* wst, const unsigned char* xs,
                                           int t, int K) {
  const int lane = threadIdx.x & 31, c = lane & 3, g4 = lane >> 2;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    if (t * 128 + 64 * u >= K) break;
    uint4 raw[RT][2];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        raw[r][h] = *reinterpret_cast<const uint4*>(wst + r * 2048 + u * 1024 + (g4 + 8 * h) * 64 + 16 * c);
#pragma unroll
    for (int xl = 0; xl < 2; ++xl) {
      u32 a[RT][2][4];
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const u32 wl = reinterpret_cast<const u32*>(&raw[r][0])[2 * xl + s];
          const u32 wh = reinterpret_cast<const u32*>(&raw[r][1])[2 * xl + s];
          a[r][s][0] = int8_pair<T>(wl, 0), a[r][s][1] = int8_pair<T>(wh, 0);
          a[r][s][2] = int8_pair<T>(wl, 1), a[r][s][3] = int8_pair<T>(wh, 1);
        }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const uint4 bv = x16<XROW>(xs, n, g4, 64 * u + 16 * c + 8 * xl);
        const u32* bw = reinterpret_cast<const u32*>(&bv);
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
          for (int r = 0; r < RT; ++r) mma16816<T>(acc[r][n], a[r][s], bw[2 * s], bw[2 * s + 1]);
      }
    }
  }
}

// The block's results in red ([8 NT x rows][red_stride(ROWS)] fp32: an x row's ROWS weight rows in
// order, gated the first half the gate rows and the second their up rows) summed over the cluster's
// blocks in rank order and stored through the epilogue by THREADS threads, 8 consecutive outputs of an
// x row a thread at a time (16-byte loads and stores where N % 8 == 0 and out and residual are 16-byte
// aligned): with SPLIT > 1 each block of the cluster finishes 1 / SPLIT of them, reading the others'
// results through distributed shared memory. tid: the thread's index among the THREADS; NAMED: they
// are not the whole block, and meet at named barrier 1 instead of __syncthreads.
template <typename T, int WBITS, int ROWS, int XR, int THREADS, int SPLIT, int EPI, bool NAMED = false>
__device__ __forceinline__ void store_rows(const float* red, const __half* __restrict__ scales,
                                           const T* __restrict__ bias, const T* __restrict__ residual,
                                           T* __restrict__ out, const Block& b, int M, int N,
                                           int tid) {
  constexpr int RS = red_stride(ROWS), OUTS = mma_gated(EPI) ? ROWS / 2 : ROWS, UNITS = XR * OUTS / 8;
  static_assert(ROWS % 32 == 0, "red_stride(ROWS) = 4 mod 32");
  unsigned rank = 0;
  if constexpr (SPLIT > 1) {
#if __CUDA_ARCH__ >= 900
    cluster_sync();  // every block's results are in its shared memory
    rank = cluster_rank();
#else
    __trap();  // unreachable: SPLIT > 1 is launched on sm_90 and newer only (ops/linear_mma.py)
#endif
  } else if constexpr (NAMED) {
    asm volatile("bar.sync 1, %0;\n" ::"n"(THREADS) : "memory");
  } else {
    __syncthreads();
  }
  const bool vec = N % 8 == 0 && ((reinterpret_cast<size_t>(out) | reinterpret_cast<size_t>(residual)) & 15) == 0;
  for (int u = rank * THREADS + tid; u < UNITS; u += SPLIT * THREADS) {
    const int mi = u / (OUTS / 8), r0 = u % (OUTS / 8) * 8, m = b.m0 + mi, row = b.row0 + r0;
    if (m >= M || row >= N) continue;
    float y[8], g[8];
#pragma unroll
    for (int s = 0; s < SPLIT; ++s)
#pragma unroll
      for (int q = 0; q < (mma_gated(EPI) ? 4 : 2); ++q) {  // 16-byte pieces: y, then gated the up rows
        const float* p = red + mi * RS + r0 + (q & 1) * 4 + (q >> 1) * OUTS;
        float4 v;
        if constexpr (SPLIT > 1) {
#if __CUDA_ARCH__ >= 900
          v = load_cluster4(p, s);
#endif
        } else {
          v = *reinterpret_cast<const float4*>(p);
        }
        float* d = (q >> 1 ? g : y) + (q & 1) * 4;
        if (s == 0) d[0] = v.x, d[1] = v.y, d[2] = v.z, d[3] = v.w;
        else d[0] += v.x, d[1] += v.y, d[2] += v.z, d[3] += v.w;
      }
    T res[8];
    if (EPI == MMA_EPI_STORE && residual != nullptr) {
      if (vec) *reinterpret_cast<uint4*>(res) = *reinterpret_cast<const uint4*>(residual + (size_t)m * N + row);
      else
#pragma unroll
        for (int k = 0; k < 8; ++k) res[k] = row + k < N ? residual[(size_t)m * N + row + k] : T();
    }
    T o[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int rk = min(row + k, N - 1);  // past N: computed, not stored
      float v = y[k];
      if constexpr (WBITS == 8) v *= __half2float(scales[rk]);
      if (bias != nullptr) v += to_float(bias[rk]);
      if constexpr (mma_gated(EPI)) {
        float up = g[k];
        if constexpr (WBITS == 8) up *= __half2float(scales[rk + N]);
        if (bias != nullptr) up += to_float(bias[rk + N]);
        v = (EPI == MMA_EPI_SILU_AND_MUL ? silu(v) : gelu_tanh(v)) * up;
      }
      if (EPI == MMA_EPI_STORE && residual != nullptr)
        v = to_float(from_float<T>(v)) + to_float(res[k]);  // round(round(y) + residual)
      o[k] = from_float<T>(v);
    }
    if (vec) *reinterpret_cast<uint4*>(out + (size_t)m * N + row) = *reinterpret_cast<const uint4*>(o);
    else
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (row + k < N) out[(size_t)m * N + row + k] = o[k];
  }
  if constexpr (SPLIT > 1) {
#if __CUDA_ARCH__ >= 900
    cluster_sync();  // the others have read this block's shared memory: it may exit
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

// ------------------------------------------------------------------ wgmma (sm_90a)
// linear_wgmma_kernel, for the larger M (int4 with integer zeros; 16-bit weights: below): three
// warpgroups, 128 weight rows a block times NX x rows, K in stages of 128 through two rings of shared memory filled by bulk copies
// (cp.async.bulk) that complete on a slot's full mbarrier and are refilled once the 256 consumer
// threads released the slot on its empty one (each its own reads). Warp 0 fills the WS weight slots,
// kChunk = 4 stages each: the block's eight 16-row weight tiles as they are in memory (tiles16: a
// tile's stages are consecutive 1 KB runs, so one copy of 4 KB a tile) and their (scale, zero) pairs
// (one copy a tile); warp 1 fills the XS x slots, a stage each, with x as wgmma_x_kernel has laid it
// out beforehand in the order the weight fragments need (below). In this kernel the count of copies
// costs more than their bytes (H100, gate_up at 128 rows with the multiplies switched off: 1 KB weight
// and 64-byte scale copies a stage 63.8 us, without the scale copies 48.8, one 8 KB copy 41.4), hence
// chunks; x, from L2, wants a deeper ring of one-stage slots (ops/linear_mma.py's wgmma_tile), hence
// two rings. Warpgroups 1 and 2 each own 64 weight rows (gated: 1 the gate rows, 2 the up rows of the
// same 64 outputs): per half stage of 64 k each lane turns its words straight into wgmma's A fragments
// (the mma.sync A fragment of its warp's 16 rows, round((q - z) scale) in T: dequantize() rounded to
// T, as the cuBLAS path's scratch holds it) and multiplies them by the x tile in shared memory (K-major
// B, 128-byte swizzle); the second half is dequantized while the first one's multiplies run. No
// barrier over the block inside the loop; the results leave through store_rows.
//
// The order of k: lane c's 16 bytes of a row of a weight tile are words 2 h + j = k 64 h + 32 j + 8 c
// .. + 8 (tiles16), which feed k16 steps 2 j and 2 j + 1 of half h: slot 2 c + e of step 2 j + s is k
// 32 j + 8 c + 4 s + e of the half, slot 8 + 2 c + e is k 32 j + 8 c + 4 s + 2 + e. So B's 16-byte chunk
// 4 j + 2 s + u (slots 8 u .. 8 u + 7 of step 2 j + s) of a half holds pair 2 s + u of each of the four
// 16-byte chunks of x's k 32 j .. 32 j + 32: a 4 x 4 transpose of 4-byte pairs (wgmma_x_kernel).
//
// 16-bit weights (WBITS 16): nothing to dequantize, so the kernel streams. A weight slot is one stage,
// the block's 128 rows as two 64-k halves of [128 rows][128 bytes], filled by one TMA copy through the
// weight's tensor map, whose 128-byte swizzle is wgmma's K-major layout: each warpgroup multiplies its
// 64 rows of the slot (A by descriptor) by the x slot (x in k order), eight wgmma a stage.
//
// int8 weights (WBITS 8): the weight [N', K] as it is, a slot one stage of the block's 128 rows x 128
// bytes, filled by one TMA copy (the bytes viewed as 16-bit pairs, 128-byte swizzle). Lane c of a quad
// takes bytes 32 c .. 32 c + 32 of its rows r and r + 8 (16-byte chunks 2 c and 2 c + 1, the second
// for the second half): word s of a chunk feeds k16 step s of its half, bytes 0-1 to slots 2 c, 2 c + 1
// and bytes 2-3 to slots 8 + 2 c, 9 + 2 c (int8_pair: exact values of T). So slot 2 c + e of step s
// (0..7 over the stage) is k 32 c + 4 s + e and slot 8 + 2 c + e is k 32 c + 4 s + 2 + e: B's 16-byte
// chunk q (0..15 over the stage's two halves) holds 4-byte pair q of each of the stage's four 32-k
// blocks (wgmma_x_kernel, ORDER 8). The row scales multiply the finished sums in store_rows, as in
// the mma.sync kernel.

// desc128's high word for a K-major 128-byte-swizzled operand (sbo 1024, the swizzle mode)
constexpr unsigned long long kDescHi = (1024ull >> 4 << 32) | (1ull << 62);

template <int WBITS, int GS, int NX, int WS, int XS> struct WGeo {
  static constexpr bool kTma = WBITS != 4;                      // weights by TMA through a tensor map
  static constexpr int kChunk = kTma ? 1 : 4;                   // stages of a weight slot
  static constexpr int kX = NX * 256;                           // an x slot: NX rows x 128 k, two 64-k halves
  static constexpr int kTile = kChunk * 1024;                   // int4: a weight tile's kChunk stages
  // int4: the eight tiles, [tile][stage][1 KB]; 16-bit: the stage's 128 rows, [64-k half][row][128 bytes];
  // int8: the stage's 128 rows, [row][128 bytes]
  static constexpr int kW = WBITS == 16 ? 2 * 128 * 128 : WBITS == 8 ? 128 * 128 : 8 * kTile;
  static constexpr int kGroups = WBITS == 4 ? 128 / GS : 0;     // scale groups of a stage
  static constexpr int kTileS = kChunk * kGroups * 64;          // a tile's pairs, [stage][group][16 rows]
  static constexpr int kWSlot = (kW + 8 * kTileS + 1023) / 1024 * 1024;
  static constexpr int kRing = WS * kWSlot + XS * kX;          // weight slots, then x slots
  static constexpr int kRS = red_stride(128);                    // store_rows' row stride (floats)
  static constexpr int kRed = NX * kRS * 4;                     // fp32 results of the epilogue
  static constexpr int kRedAt = WS * kWSlot;                     // the results go over the x slots
  static constexpr int kSmem = (kRing > kRedAt + kRed ? kRing : kRedAt + kRed) + 1024;  // + alignment
};

// (q - z) pairs times the group scale, rounded once to T (as dequantize() rounded to T).
__device__ __forceinline__ u32 scaled(u32 q, __half2 scale_zero, __half) {
  __half2 r = __hmul2(*reinterpret_cast<__half2*>(&q), __low2half2(scale_zero));
  return *reinterpret_cast<u32*>(&r);
}
__device__ __forceinline__ u32 scaled(u32 q, __half2 scale_zero, __nv_bfloat16) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&q));
  const float sc = __low2float(scale_zero);
  __nv_bfloat162 r = __floats2bfloat162_rn(f.x * sc, f.y * sc);
  return *reinterpret_cast<u32*>(&r);
}

// The A fragments of half H's four k16 steps for the lane's local rows r and r + 8 (one tile), from
// their 16 bytes v[0], v[1] of the stage's weights and the tile's pairs of the stage sz: a[step][4].
template <typename T, int GS, int H>
__device__ __forceinline__ void dequant_half(const unsigned char* sz0, const uint4 (&v)[2], int r, u32 (&a)[4][4]) {
  u32 q[2][2][4];  // [row r, r + 8][word j][pairs]
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const u32 word = H == 0 ? (j ? v[h].y : v[h].x) : (j ? v[h].w : v[h].z);
      const int g = (64 * H + 32 * j) / GS;
      const __half2 sz = *reinterpret_cast<const __half2*>(sz0 + (g * 16 + (r & 15) + 8 * h) * 4);
      int4_word<T>(word, zero_sub<true>(sz, T()), q[h][j]);
#pragma unroll
      for (int i = 0; i < 4; ++i) q[h][j][i] = scaled(q[h][j][i], sz, T());
    }
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int st = 0; st < 2; ++st) {
      a[2 * j + st][0] = q[0][j][2 * st], a[2 * j + st][1] = q[1][j][2 * st];
      a[2 * j + st][2] = q[0][j][2 * st + 1], a[2 * j + st][3] = q[1][j][2 * st + 1];
    }
}

// The A fragments of half H's four k16 steps for the lane's rows r and r + 8 from its 16-byte chunks
// v[row][H] of an int8 slot (the k order above): a[step][4], exact values of T.
template <typename T, int H>
__device__ __forceinline__ void int8_half(const uint4 (&v)[2][2], u32 (&a)[4][4]) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const u32 w0 = reinterpret_cast<const u32*>(&v[0][H])[s], w1 = reinterpret_cast<const u32*>(&v[1][H])[s];
    a[s][0] = int8_pair<T>(w0, 0), a[s][1] = int8_pair<T>(w1, 0);
    a[s][2] = int8_pair<T>(w0, 1), a[s][3] = int8_pair<T>(w1, 1);
  }
}

}  // namespace

#define MMA_ARGS                                                                                             \
  const T *__restrict__ x, const void *__restrict__ w, const __half *__restrict__ scales,                    \
      const T *__restrict__ bias, const T *__restrict__ residual, T *__restrict__ out, int M, int N, int K

// grid: (ceil(N / (16 RT E)) * ceil(M / (8 NT)), SPLIT), E = WARPS (WARPS / 2 gated), the x tiles of
// one row block adjacent (they share its weights through L2); clusters of (1, SPLIT, 1), sm_90 when
// SPLIT > 1 · block: 32 WARPS · smem: dynamic Geo::kSmem bytes
// x: [M, K] T (K % 32 == 0 int4, % 16 int8); w, scales: int8 q [N', K] and fp16 scales [N'], or
// int4 q / (scale, zero) pairs as above, N' = N (2N gated: [gate; up]);
// bias: [N'] T or null; residual: [M, N] T or null (EPI_STORE only, not aliasing out); out: [M, N] T.
// Every weight byte is read from HBM once per launch (once more from L2 per further x tile).
template <typename T, int WBITS, int GS, bool IZ, int NT, int RT, int WARPS, int STAGES, int SPLIT, int EPI, int MINB>
__global__ void __launch_bounds__(32 * WARPS, MINB) MMA_CLUSTER(SPLIT) linear_mma_kernel(MMA_ARGS) {
  using G = Geo<WBITS, GS, NT, RT, WARPS, STAGES>;
  static_assert(WBITS == 8 || GS == 32 || GS == 64 || GS == 128, "int4 group size");
  static_assert(!mma_gated(EPI) || WARPS % 2 == 0, "a gated epilogue needs an even warp count");
  extern __shared__ __align__(128) unsigned char smem[];
  const int x_tiles = (M + 8 * NT - 1) / (8 * NT), n_st = (K + 127) / 128;
  const int per_split = (n_st + SPLIT - 1) / SPLIT, t_begin = (SPLIT > 1 ? blockIdx.y : 0) * per_split;
  constexpr int E = mma_gated(EPI) ? WARPS / 2 : WARPS;
  const Block b{(int)(blockIdx.x / x_tiles) * 16 * RT * E, (int)(blockIdx.x % x_tiles) * 8 * NT, t_begin,
                min(n_st, t_begin + per_split)};
  const unsigned base = smem_u32(smem);
  const int warp = threadIdx.x >> 5;

  const Loader<T, WBITS, GS, NT, RT, WARPS, STAGES, EPI> load(x, w, scales, b, M, N, K);
  // The first stages' weights are issued before pdl_wait (no kernel of a graph writes weights).
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (b.t_begin + s < b.t_end) load.weights(base + s * G::kStage, b.t_begin + s);
  pdl_wait();
  pdl_trigger();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (b.t_begin + s < b.t_end) load.rows(base + s * G::kStage, b.t_begin + s);
    cp_async_commit();
  }

  float acc[RT][NT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[r][n][j] = 0.0f;
  for (int t = b.t_begin; t < b.t_end; ++t) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage t has landed for every thread, and every warp is done with stage t - 1
    const int tn = t + STAGES - 1;
    if (tn < b.t_end) {
      const unsigned slot = base + ((tn - b.t_begin) % STAGES) * G::kStage;
      load.weights(slot, tn);
      load.rows(slot, tn);
    }
    cp_async_commit();
    const unsigned char* st = smem + ((t - b.t_begin) % STAGES) * G::kStage;
    if constexpr (WBITS == 4)
      int4_stage<T, GS, IZ, NT, RT, G::kXRow>(acc, st + warp * RT * 1024, st + G::kW + warp * RT * G::kGroups * 64,
                                              st + G::kW + G::kS, t, K / GS);
    else
      int8_stage<T, NT, RT, G::kXRow>(acc, st + warp * RT * 2048, st + G::kW, t, K);
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring is free: the epilogue's fragments reuse it
  mma_epilogue<T, WBITS, NT, RT, WARPS, SPLIT, EPI>(acc, reinterpret_cast<float*>(smem), scales, bias, residual, out,
                                                     b, M, N);
}

// x [M, K] T -> xs: per tile of NX x rows and 64-k half t, the NX x 128-byte image of x a slot of
// linear_wgmma_kernel holds (128-byte swizzle; ORDER: the k order of the weight fragments, above: 4
// int4's pairs, 8 int8's, 0 k in order, for 16-bit weights), halves of a tile consecutive; rows past M
// are zeros. NORM: each row RMS-normalized first with norm_w (ops.rms_norm's rounding, rms_normed).
// grid: ceil(M / NX) NX blocks (one row each) · block: 128 threads · K % 128 == 0.
template <typename T, int NX, int ORDER, bool NORM>
__global__ void __launch_bounds__(128) wgmma_x_kernel(const T* __restrict__ x, unsigned char* __restrict__ xs,
                                                      const T* __restrict__ norm_w, float eps, int M, int K) {
  const int row = blockIdx.x, r = row % NX;
  const T* xr = x + (size_t)row * K;
  unsigned char* tile = xs + (size_t)(row / NX) * NX * K * sizeof(T);
  pdl_trigger();  // the GEMM may start streaming its weights (it waits for this grid before reading xs)
  pdl_wait();
  float inv_rms = 0.0f;
  if constexpr (NORM) {
    __shared__ float scratch[32];
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; row < M && i < K / 8; i += 128) {
      const uint4 v = *reinterpret_cast<const uint4*>(xr + 8 * i);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float f = to_float(reinterpret_cast<const T*>(&v)[e]);
        sum_sq += f * f;
      }
    }
    inv_rms = rms_inv(block_reduce(sum_sq, scratch), K, eps);
  }
  if constexpr (ORDER == 8) {
    const u32* x2 = reinterpret_cast<const u32*>(xr);
    const u32* w2 = reinterpret_cast<const u32*>(norm_w);
    for (int i = threadIdx.x; i < K / 8; i += 128) {  // chunk q of stage t: pair q of its four 32-k blocks
      const int t = i >> 4, q = i & 15;
      u32 v[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int p = 64 * t + 16 * c + q;  // the pair's index in the row
        v[c] = row < M ? x2[p] : 0u;
        if constexpr (NORM) {
          const u32 wp = w2[p];
#pragma unroll
          for (int e = 0; e < 2; ++e)
            reinterpret_cast<T*>(&v[c])[e] =
                rms_normed(reinterpret_cast<const T*>(&v[c])[e], reinterpret_cast<const T*>(&wp)[e], inv_rms);
        }
      }
      *reinterpret_cast<uint4*>(tile + (size_t)(2 * t + (q >> 3)) * NX * 128 + wgmma::swizzle128(r, q & 7)) =
          make_uint4(v[0], v[1], v[2], v[3]);
    }
  } else {
    for (int q = threadIdx.x; q < K / 32; q += 128) {  // k 32 q .. + 32: half q / 2, its chunks 4 (q % 2) ..
      uint4 v[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        v[c] = row < M ? *reinterpret_cast<const uint4*>(xr + 32 * q + 8 * c) : make_uint4(0, 0, 0, 0);
        if constexpr (NORM) {
          const uint4 wv = *reinterpret_cast<const uint4*>(norm_w + 32 * q + 8 * c);
#pragma unroll
          for (int e = 0; e < 8; ++e)
            reinterpret_cast<T*>(&v[c])[e] =
                rms_normed(reinterpret_cast<const T*>(&v[c])[e], reinterpret_cast<const T*>(&wv)[e], inv_rms);
        }
      }
      unsigned char* half = tile + (size_t)(q >> 1) * NX * 128;
#pragma unroll
      for (int ph = 0; ph < 4; ++ph)
        *reinterpret_cast<uint4*>(half + wgmma::swizzle128(r, 4 * (q & 1) + ph)) =
            ORDER == 4 ? make_uint4(reinterpret_cast<const u32*>(&v[0])[ph], reinterpret_cast<const u32*>(&v[1])[ph],
                                    reinterpret_cast<const u32*>(&v[2])[ph], reinterpret_cast<const u32*>(&v[3])[ph])
                       : v[ph];
    }
  }
}

// A consumer thread's accumulators into red as store_rows reads them: d[4 j + 2 h + e] is weight row
// 64 (wg - 1) + 16 (warp % 4) + lane / 4 + 8 h and x row 8 j + 2 (lane % 4) + e.
template <int NX, int RS>
__device__ __forceinline__ void wgmma_results(float* red, const float (&acc)[NX / 2], int wg, int warp, int lane) {
  const int lr = 64 * (wg - 1) + 16 * (warp & 3) + (lane >> 2), mr = 2 * (lane & 3);
#pragma unroll
  for (int i = 0; i < NX / 2; ++i) red[(8 * (i >> 2) + mr + (i & 1)) * RS + lr + 8 * ((i >> 1) & 1)] = acc[i];
}

// CUINFER_TIMELINE (a measurement build: `bench linear --timeline`, linear_mma._launch's timeline):
// per block b = blockIdx.x + gridDim.x blockIdx.y < 1024, [%globaltimer at its start, clock64 there,
// clock64 once the consumers' first stage is ready, at the end of their main loop, at the block's
// exit, %globaltimer there, after the consumers' pdl_wait, the SM's id]
#ifdef CUINFER_TIMELINE
__device__ unsigned long long linear_wgmma_timeline[1024][8];
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned sm_id() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
#define WG_STAMP(cond, i, v) \
  if (cond) linear_wgmma_timeline[blockIdx.x + gridDim.x * blockIdx.y][i] = (v)
#else
#define WG_STAMP(cond, i, v)
#endif

// grid: (tiles, SPLIT) with SPLIT > 1, (min(tiles, SMs), 1) with SPLIT 1 (a persistent grid), tiles =
// ceil(N / E) * ceil(M / NX), E = 128 (64 gated), the x tiles of one row block adjacent; clusters of
// (1, SPLIT, 1) · block: 384 threads · smem: dynamic WGeo::kSmem bytes · sm_90a
// only (elsewhere it traps: ops/linear_mma.py launches it on sm_90). x: wgmma_x_kernel's image of x;
// K % 128 == 0. WBITS 4: int4 with integer zeros, gated N % 16 == 0, scales 16-byte aligned. WBITS
// 16: w is the CUtensorMap in device memory of the weight's [K / 64, G, N, 64] view (G = 2 gated:
// [gate; up], else 1) with boxes of (2, G, 128 / G, 64), scales unused (ops/linear_mma.py weight_map).
// WBITS 8: w the map of the int8 bytes as 16-bit pairs, the [K / 128, G, N, 64] view in boxes of (1, G,
// 128 / G, 64); scales the fp16 row scales [N'].
// The other arguments and the results as linear_mma_kernel's.
template <typename T, int WBITS, int GS, int NX, int WS, int XS, int SPLIT, int EPI>
__global__ void __launch_bounds__(384, 1) MMA_CLUSTER(SPLIT) linear_wgmma_kernel(MMA_ARGS) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using G = WGeo<WBITS, GS, NX, WS, XS>;
  static_assert(WBITS == 16 || WBITS == 8 || (WBITS == 4 && (GS == 32 || GS == 64 || GS == 128)),
                "16-bit or int8 weights, or int4 groups of 32, 64 or 128");
  static_assert(WS >= 2 && XS >= 2 && (NX == 32 || NX == 64 || NX == 128), "tile");
  extern __shared__ __align__(128) unsigned char smem[];
  // wfull[WS], wempty[WS], xfull[XS], xempty[XS], redfree
  __shared__ __align__(8) unsigned long long bars[2 * (WS + XS) + 1];
  const int x_tiles = (M + NX - 1) / NX, n_st = K / 128, rows = mma_gated(EPI) ? 64 : 128;
  const int tiles = (N + rows - 1) / rows * x_tiles;  // SPLIT > 1: the grid has one block a tile
  const int per_split = (n_st + SPLIT - 1) / SPLIT, t_begin = (SPLIT > 1 ? blockIdx.y : 0) * per_split;
  const int n_t = min(n_st, t_begin + per_split) - t_begin;  // <= 0: a split past K (its fragments are zeros)
  auto block_of = [&](int tile) { return Block{tile / x_tiles * rows, tile % x_tiles * NX, t_begin, t_begin + n_t}; };
  // a block's tiles: with SPLIT > 1 its one tile (a loop of one trip the compiler sees as such)
  auto more = [&](int tile, int k) { return SPLIT > 1 ? k < 1 : tile < tiles; };
  const unsigned raw_base = smem_u32(smem), ring = (raw_base + 1023) & ~1023u;  // swizzled tiles: 1024-aligned
  const unsigned xring = ring + WS * G::kWSlot;
  unsigned char* sm = smem + (ring - raw_base);
  const unsigned wfull0 = smem_u32(bars), wempty0 = wfull0 + 8 * WS, xfull0 = wempty0 + 8 * WS,
                 xempty0 = xfull0 + 8 * XS, redfree = xempty0 + 8 * XS;
  const int wg = threadIdx.x >> 7, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < WS; ++s) {
      mbar_init(wfull0 + 8 * s, 1);     // the producer's arrival with the chunk's bytes
      mbar_init(wempty0 + 8 * s, 256);  // every consumer thread
    }
    for (int s = 0; s < XS; ++s) {
      mbar_init(xfull0 + 8 * s, 1);
      mbar_init(xempty0 + 8 * s, 256);
    }
    mbar_init(redfree, 256);  // every consumer thread, once it has stored a tile's results
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  WG_STAMP(threadIdx.x == 0, 0, global_ns());
  WG_STAMP(threadIdx.x == 0, 1, clock64());
  WG_STAMP(threadIdx.x == 0, 7, sm_id());

  // SPLIT 1: the block takes tiles blockIdx.x, + gridDim.x, ... (a persistent grid of at most one
  // block an SM); the rings run on across tiles, each tile starting a fresh weight chunk, and a tile's
  // results go over the x slots, so the weights of the next tile stream in during its epilogue and x's
  // wait for redfree.
  float acc[NX / 2];
  if (G::kTma && warp == 0) {  // 16-bit and int8 weights: lane 0 copies each stage's 128 rows through the map
    if (lane == 0) {
      const TensorMap* map = static_cast<const TensorMap*>(w);
      asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map) : "memory");
      int gc = 0;  // stages issued
      for (int tile = blockIdx.x, k = 0; more(tile, k); tile += gridDim.x, ++k) {
        const int row0 = block_of(tile).row0;
        for (int i = 0; i < n_t; ++i, ++gc) {  // no kernel of a graph writes weights: no pdl_wait
          const unsigned full = wfull0 + 8 * (gc % WS);
          if (gc >= WS) mbar_wait(wempty0 + 8 * (gc % WS), (gc / WS - 1) & 1);
          mbar_expect_tx(full, G::kW);  // rows past N are zero-filled, and count
          tma_load_4d(ring + (gc % WS) * G::kWSlot, map, 0, row0, 0, (WBITS == 16 ? 2 : 1) * (t_begin + i), full);
        }
      }
    }
  } else if (warp == 0) {  // int4 weights: lane l < 8 copies tile l's next kChunk stages and their pairs to a slot
    const int l = lane & 7, n_w = mma_gated(EPI) ? 2 * N : N;
    int gc = 0;  // chunks issued
    for (int tile = blockIdx.x, k = 0; more(tile, k); tile += gridDim.x, ++k) {
      // local row 16 l's row of w (gated: rows 64.. the up half), clamped to the last (never stored)
      const int row0 = block_of(tile).row0;
      const int tl = min(mma_gated(EPI) ? (l >> 2) * N + row0 + 16 * (l & 3) : row0 + 16 * l, n_w - 1) / 16;
      const char* wsrc = static_cast<const char*>(w) + ((size_t)tl * n_st + t_begin) * 1024;
      const char* ssrc = reinterpret_cast<const char*>(scales) + ((size_t)tl * n_st + t_begin) * G::kGroups * 64;
      for (int c = 0; c * G::kChunk < n_t; ++c, ++gc) {  // no kernel of a graph writes weights: no pdl_wait
        const unsigned slot = ring + (gc % WS) * G::kWSlot, full = wfull0 + 8 * (gc % WS);
        const int t = c * G::kChunk, st = min(G::kChunk, n_t - t);
        if (gc >= WS) mbar_wait(wempty0 + 8 * (gc % WS), (gc / WS - 1) & 1);
        if (lane == 0) mbar_expect_tx(full, st * 8 * (1024 + G::kGroups * 64));
        __syncwarp();
        if (lane < 8) {
          bulk_load(slot + G::kTile * l, wsrc + (size_t)t * 1024, st * 1024, full);
          bulk_load(slot + G::kW + G::kTileS * l, ssrc + (size_t)t * G::kGroups * 64, st * G::kGroups * 64, full);
        }
      }
    }
  } else if (warp == 1) {  // x: lane 0 copies each stage's slot image (wgmma_x_kernel's) to an x slot
    pdl_wait();
    pdl_trigger();
    int gs = 0, k = 0;  // stages issued, tiles begun
    for (int tile = blockIdx.x; more(tile, k) && lane == 0; tile += gridDim.x, ++k) {
      const char* xsrc = reinterpret_cast<const char*>(x) +
                         ((size_t)block_of(tile).m0 * K * sizeof(T) + (size_t)t_begin * G::kX);
      if (k > 0) mbar_wait(redfree, (k - 1) & 1);  // the previous tile's results are stored
      for (int i = 0; i < n_t; ++i, ++gs) {
        const unsigned full = xfull0 + 8 * (gs % XS);
        if (gs >= XS) mbar_wait(xempty0 + 8 * (gs % XS), (gs / XS - 1) & 1);
        mbar_expect_tx(full, G::kX);
        bulk_load(xring + (gs % XS) * G::kX, xsrc + (size_t)i * G::kX, G::kX, full);
      }
    }
  } else if (wg == 0) {
    pdl_wait();
  } else {  // consumers: warpgroup wg - 1 owns local rows 64 (wg - 1) .. + 64, warp w its 16 rows from 16 w
    pdl_wait();
    WG_STAMP(threadIdx.x == 128, 6, clock64());
    const int r = 64 * (wg - 1) + 16 * (warp & 3) + (lane >> 2), c = lane & 3;
    // The lane's weights and pairs in weight slot 0, and x slot 0's descriptor's low word (desc128 with
    // lbo 16: the shared address / 16, below 2^14, so 32 bytes further adds 2); the slots and parities
    // advance by counting, and a chunk's bytes are waited for at its first stage.
    const unsigned char* wt0 = sm + (r >> 4) * G::kTile + (r & 15) * 64 + 16 * c;
    const unsigned char* sz0 = sm + G::kW + (r >> 4) * G::kTileS;
    const unsigned xd0 = (xring >> 4) | (1u << 16);
    const unsigned wd0 = ((ring + (wg - 1) * 64 * 128) >> 4) | (1u << 16);  // 16-bit: the warpgroup's rows
    int j = 0, wslot = 0, wpar = 0, xslot = 0, xpar = 0;
    for (int tile = blockIdx.x, k = 0; more(tile, k); tile += gridDim.x, ++k) {
#pragma unroll
      for (int i = 0; i < NX / 2; ++i) acc[i] = 0.0f;
      for (int i = 0; i < n_t; ++i) {
        if (j == 0) mbar_wait(wfull0 + 8 * wslot, wpar);
        mbar_wait(xfull0 + 8 * xslot, xpar);
        WG_STAMP(threadIdx.x == 128 && i == 0 && k == 0, 2, clock64());
        const unsigned xd = xd0 + xslot * (G::kX >> 4);
        if constexpr (WBITS == 16) {  // A straight from the slot: [half][row][128 bytes], 128-byte swizzle
          const unsigned wd = wd0 + wslot * (G::kWSlot >> 4);
          wgmma::fence();
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int s = 0; s < 4; ++s)
              wgmma::mma_ss<NX, T>(acc, kDescHi | (wd + h * (128 * 128 >> 4) + 2 * s),
                                   kDescHi | (xd + h * NX * 8 + 2 * s), 1);
          wgmma::commit();
          wgmma::wait<0>();
          wgmma::fence_regs(acc);
        } else {  // A from registers, half by half: int4 dequantized, int8 converted
          const unsigned char* wt = wt0 + wslot * G::kWSlot + j * 1024;
          const unsigned char* sz = sz0 + wslot * G::kWSlot + j * G::kGroups * 64;
          uint4 v[2], v8[2][2];  // int4: the lane's 16 bytes of rows r, r + 8; int8: [row][half] its chunks
          if constexpr (WBITS == 4) {
            v[0] = *reinterpret_cast<const uint4*>(wt), v[1] = *reinterpret_cast<const uint4*>(wt + 8 * 64);
          } else {
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
              for (int hh = 0; hh < 2; ++hh)
                v8[h][hh] = *reinterpret_cast<const uint4*>(sm + wslot * G::kWSlot + wgmma::swizzle128(r + 8 * h, 2 * c + hh));
          }
          u32 a0[4][4], a1[4][4];
          if constexpr (WBITS == 4) dequant_half<T, GS, 0>(sz, v, r, a0);
          else int8_half<T, 0>(v8, a0);
          wgmma::fence();
#pragma unroll
          for (int s = 0; s < 4; ++s) wgmma::mma_rs_k<NX, T>(acc, a0[s], kDescHi | (xd + 2 * s));
          wgmma::commit();
          if constexpr (WBITS == 4) dequant_half<T, GS, 1>(sz, v, r, a1);  // while the first half multiplies
          else int8_half<T, 1>(v8, a1);
          wgmma::fence();
#pragma unroll
          for (int s = 0; s < 4; ++s) wgmma::mma_rs_k<NX, T>(acc, a1[s], kDescHi | (xd + NX * 8 + 2 * s));
          wgmma::commit();
          wgmma::wait<0>();  // before the next stage's fragments are written (ptxas serializes wgmma otherwise)
          wgmma::fence_regs(acc);
#pragma unroll
          for (int s = 0; s < 4; ++s) wgmma::fence_operand(a0[s]), wgmma::fence_operand(a1[s]);
        }
        mbar_arrive(xempty0 + 8 * xslot);  // each thread releases its own reads of the slots
        if (j == G::kChunk - 1 || i == n_t - 1) mbar_arrive(wempty0 + 8 * wslot);
        if (++xslot == XS) xslot = 0, xpar ^= 1;
        if (++j == G::kChunk || i == n_t - 1) {  // the next tile starts a fresh chunk
          j = 0;
          if (++wslot == WS) wslot = 0, wpar ^= 1;
        }
      }
      if constexpr (SPLIT == 1) {  // the results over the x slots, stored by the 256 consumers
        asm volatile("bar.sync 1, 256;\n" ::: "memory");  // both warpgroups' multiplies have read their x
        float* red = reinterpret_cast<float*>(smem + (xring - raw_base));
        wgmma_results<NX, G::kRS>(red, acc, wg, warp, lane);
        store_rows<T, WBITS, 128, NX, 256, 1, EPI, true>(red, scales, bias, residual, out, block_of(tile), M, N,
                                                         threadIdx.x - 128);
        mbar_arrive(redfree);  // this thread's reads of the results are done
      }
    }
  }
  WG_STAMP(threadIdx.x == 128, 3, clock64());
  if constexpr (SPLIT > 1) {  // one tile a block: every thread takes part in the cluster's reduction
    __syncthreads();  // every stage consumed (every copy landed): the ring is free, the results reuse it
    float* red = reinterpret_cast<float*>(sm);
    if (wg > 0) wgmma_results<NX, G::kRS>(red, acc, wg, warp, lane);
    store_rows<T, WBITS, 128, NX, 384, SPLIT, EPI>(red, scales, bias, residual, out, block_of(blockIdx.x), M, N,
                                                   threadIdx.x);
  }
  WG_STAMP(threadIdx.x == 128, 4, clock64());
  WG_STAMP(threadIdx.x == 128, 5, global_ns());
#else
  __trap();
#endif
}
