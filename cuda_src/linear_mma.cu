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
// than SMs split K over a thread-block cluster (sm_90) reduced through distributed shared memory
// (store_rows, linear_store.cuh: the epilogue of both kernels).
//
// linear_wgmma_kernel (linear_wgmma.cuh, "wgmma"): the same fragments fed to wgmma from registers, for int4 with
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

// CUINFER_TIMELINE (a measurement build: `bench linear --timeline`, linear_mma._launch's timeline):
// per block b = blockIdx.x + gridDim.x blockIdx.y < 1024, [%globaltimer at its start, clock64 there,
// clock64 once the block's first stage is ready (wgmma: the consumers'), at the end of the main loop,
// at the block's exit, %globaltimer there, clock64 once its cluster's blocks all hold their results in
// shared memory (split > 1: after store_rows' first cluster_sync), the SM's id, and with a split
// clock64 once the block has read its units' sums from the cluster and once it has stored them
// (before the closing barrier)]. Stamped by the block's first thread (wgmma: thread 0, then the
// consumers' first, thread 128). At file scope: inside the anonymous namespace the array's symbol
// gets an internal name that the host cannot look up.
#ifdef CUINFER_TIMELINE
__device__ unsigned long long linear_timeline[1024][10];
#define WG_STAMP(cond, i, v) \
  if (cond) linear_timeline[blockIdx.x + gridDim.x * blockIdx.y][i] = (v)
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
#else
#define WG_STAMP(cond, i, v)
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

// The cp.async copies of one stage: this thread's chunks i = threadIdx.x + j 32 WARPS. Their sources
// are 32-bit byte offsets computed once, added to the stage's base pointer (one value for the whole
// block); their slot offsets are linear in the bits of i, so chunk j's is thread 0's chunk j's (a
// constant) plus this thread's chunk 0's. Weights go row by row: a block tile's row rr is weight row
// half N + min(first + rr, N - 1) (any N; the up half of an int4 [gate; up] may start inside a
// storage tile). In a slot each block tile is 16 rows of 64 bytes per quad (int8: two quads), its
// int4 (scale, zero) pairs 64 bytes per group, then the x rows (kXRow bytes apart, zeros past K).
// The first weights are issued before pdl_wait.
template <typename T, int WBITS, int GS, int NT, int RT, int WARPS, int STAGES, int EPI> struct Loader {
  using G = Geo<WBITS, GS, NT, RT, WARPS, STAGES>;
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int kWC = G::kTiles * (WBITS == 4 ? 64 : 128) / THREADS;  // weight chunks a thread
  static constexpr int kSC = WBITS == 4 ? G::kTiles * G::kGroups * 16 / THREADS : 0;  // 4-byte pair copies
  static constexpr int kXC = 8 * NT * 16 / THREADS;                           // x chunks a thread
  static_assert(kWC * THREADS == G::kTiles * (WBITS == 4 ? 64 : 128) && kXC * THREADS == 8 * NT * 16 &&
                    (WBITS == 8 || kSC * THREADS == G::kTiles * G::kGroups * 16) && THREADS % 16 == 0 &&
                    (THREADS & (THREADS - 1)) == 0,
                "whole chunks per thread; slot offsets linear in the bits of i");
  const char* w;
  const char* s;
  const char* x;
  unsigned w_off[kWC], s_off[kSC > 0 ? kSC : 1], x_off[kXC];
  int w_end, x_end, n_groups;  // a stage t copies this thread's int8 / x chunks while 128 t < w_end / x_end

  // Slot offsets of chunk i: weights (int4: tile i / 64, row (i / 4) % 16, 16-byte chunk i % 4, in
  // order; int8: tile i / 128, row (i / 8) % 16, chunk i % 8 of the row's 128 k into quad (i / 4) % 2),
  // int4 pairs (4 bytes each, in order), x (row i / 16, chunk i % 16).
  __host__ __device__ static constexpr unsigned w_dst(int i) {
    return WBITS == 4 ? i * 16 : (i >> 7) * 2048 + ((i >> 2) & 1) * 1024 + ((i >> 3) & 15) * 64 + (i & 3) * 16;
  }
  __host__ __device__ static constexpr unsigned x_dst(int i) {
    return G::kW + G::kS + (i >> 4) * G::kXRow + (i & 15) * 16;
  }

  __device__ __forceinline__ static int weight_row(int ti, int rr, int row0, int N) {
    int half;
    const int first = tile_row<RT, WARPS, EPI>(ti, row0, half);
    return half * N + min(first + rr, N - 1);
  }

  __device__ __forceinline__ Loader(const T* x_, const void* w_, const __half* scales, const Block& b, int M, int N,
                                    int K)
      : w(static_cast<const char*>(w_)), s(reinterpret_cast<const char*>(scales)),
        x(reinterpret_cast<const char*>(x_)), w_end(K - 16 * (threadIdx.x & 7)), x_end(K - 8 * (threadIdx.x & 15)),
        n_groups(WBITS == 4 ? K / GS : 0) {
#pragma unroll
    for (int j = 0; j < kWC; ++j) {
      const int i = threadIdx.x + j * THREADS;
      if constexpr (WBITS == 4) {
        const int row = weight_row(i >> 6, (i >> 2) & 15, b.row0, N);
        w_off[j] = static_cast<unsigned>(tiled_row(row, (K + 127) / 128) * 64 + (i & 3) * 16);
      } else {
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
    for (int j = 0; j < kXC; ++j) {
      const int i = threadIdx.x + j * THREADS, m = min(b.m0 + (i >> 4), M - 1);
      x_off[j] = static_cast<unsigned>(((size_t)m * K + 8 * (i & 15)) * sizeof(T));
    }
  }

  // Stage t's weights (and int4 pairs) into the slot at shared address st.
  __device__ __forceinline__ void weights(unsigned st, int t) const {
    const char* wt = w + (size_t)t * (WBITS == 4 ? 1024 : 128);
    const unsigned dst = st + w_dst(threadIdx.x);
    if constexpr (WBITS == 4) {
#pragma unroll
      for (int j = 0; j < kWC; ++j) cp_async16(dst + w_dst(j * THREADS), wt + w_off[j]);
      const char* stt = s + (size_t)t * G::kGroups * 64;
#pragma unroll
      for (int j = 0; j < kSC; ++j) {
        const int i = threadIdx.x + j * THREADS;
        if (t * G::kGroups + (i / 16) % G::kGroups < n_groups) cp_async4(st + G::kW + i * 4, stt + s_off[j]);
      }
    } else {  // past K: zeros, copied from the stage's first byte (stage t starts inside row 0 of w)
      const bool ok = t * 128 < w_end;
#pragma unroll
      for (int j = 0; j < kWC; ++j) cp_async16(dst + w_dst(j * THREADS), wt + (ok ? w_off[j] : 0u), ok);
    }
  }

  // Stage t's x rows into the slot at shared address st (past K: zeros, as above).
  __device__ __forceinline__ void rows(unsigned st, int t) const {
    const char* xt = x + (size_t)t * 128 * sizeof(T);
    const unsigned dst = st + x_dst(threadIdx.x);
    const bool ok = t * 128 < x_end;
#pragma unroll
    for (int j = 0; j < kXC; ++j) cp_async16(dst + x_dst(j * THREADS) - x_dst(0), xt + (ok ? x_off[j] : 0u), ok);
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

}  // namespace

#include "linear_store.cuh"

#define MMA_ARGS                                                                                             \
  const T *__restrict__ x, const void *__restrict__ w, const __half *__restrict__ scales,                    \
      const T *__restrict__ bias, const T *__restrict__ residual, T *__restrict__ out, int M, int N, int K

// grid: (tiles, SPLIT), tiles <= ceil(N / (16 RT E)) * ceil(M / (8 NT)) - block0, E = WARPS (WARPS / 2
// gated): tiles block0 + blockIdx.x, the x tiles of one row block adjacent (they share its weights
// through L2); clusters of (1, SPLIT, 1), sm_90 when SPLIT > 1 · block: 32 WARPS · smem: dynamic
// Geo::kSmem bytes. A call may be two launches over its tiles at two splits (ops/linear_mma.py, MmaTile's
// tail): the second's blocks take the SMs the first's leave, and wait for it to finish before they store.
// x: [M, K] T (K % 32 == 0 int4, % 16 int8); w, scales: int8 q [N', K] and fp16 scales [N'], or
// int4 q / (scale, zero) pairs as above, N' = N (2N gated: [gate; up]);
// bias: [N'] T or null; residual: [M, N] T or null (EPI_STORE only, not aliasing out); out: [M, N] T.
// Every weight byte is read from HBM once per launch (once more from L2 per further x tile).
template <typename T, int WBITS, int GS, bool IZ, int NT, int RT, int WARPS, int STAGES, int SPLIT, int EPI, int MINB>
__global__ void __launch_bounds__(32 * WARPS, MINB) MMA_CLUSTER(SPLIT) linear_mma_kernel(MMA_ARGS, int block0) {
  using G = Geo<WBITS, GS, NT, RT, WARPS, STAGES>;
  static_assert(WBITS == 8 || GS == 32 || GS == 64 || GS == 128, "int4 group size");
  static_assert(!mma_gated(EPI) || WARPS % 2 == 0, "a gated epilogue needs an even warp count");
  extern __shared__ __align__(128) unsigned char smem[];
  const int x_tiles = (M + 8 * NT - 1) / (8 * NT), n_st = (K + 127) / 128;
  const int per_split = (n_st + SPLIT - 1) / SPLIT, t_begin = (SPLIT > 1 ? blockIdx.y : 0) * per_split;
  constexpr int E = mma_gated(EPI) ? WARPS / 2 : WARPS;
  const int tile = block0 + blockIdx.x;
  const Block b{tile / x_tiles * 16 * RT * E, tile % x_tiles * 8 * NT, t_begin, min(n_st, t_begin + per_split)};
  const unsigned base = smem_u32(smem);
  const int warp = threadIdx.x >> 5;

  WG_STAMP(threadIdx.x == 0, 0, global_ns());
  WG_STAMP(threadIdx.x == 0, 1, clock64());
  WG_STAMP(threadIdx.x == 0, 7, sm_id());

  const Loader<T, WBITS, GS, NT, RT, WARPS, STAGES, EPI> load(x, w, scales, b, M, N, K);
  // The first stages' weights are issued before pdl_wait (no kernel of a graph writes weights).
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (b.t_begin + s < b.t_end) load.weights(base + s * G::kStage, b.t_begin + s);
  // A call's second launch (block0 > 0: MmaTile's tail) reads nothing its predecessor, the call's first
  // launch, writes: it runs its main loop before pdl_wait and waits before its epilogue, so that it
  // still finishes after the first launch and the next kernel's wait covers both.
  const bool second = block0 > 0;
  if (!second) {
    pdl_wait();
    pdl_trigger();
  }
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
  int slot = 0;  // stage t's, (t - t_begin) % STAGES; stage t + STAGES - 1 loads into the one before it
  for (int t = b.t_begin; t < b.t_end; ++t) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage t has landed for every thread, and every warp is done with stage t - 1
    WG_STAMP(threadIdx.x == 0 && t == b.t_begin, 2, clock64());
    const int tn = t + STAGES - 1;
    if (tn < b.t_end) {
      const unsigned next = base + (slot == 0 ? STAGES - 1 : slot - 1) * G::kStage;
      load.weights(next, tn);
      load.rows(next, tn);
    }
    cp_async_commit();
    const unsigned char* st = smem + slot * G::kStage;
    slot = slot == STAGES - 1 ? 0 : slot + 1;
    if constexpr (WBITS == 4)
      int4_stage<T, GS, IZ, NT, RT, G::kXRow>(acc, st + warp * RT * 1024, st + G::kW + warp * RT * G::kGroups * 64,
                                              st + G::kW + G::kS, t, K / GS);
    else
      int8_stage<T, NT, RT, G::kXRow>(acc, st + warp * RT * 2048, st + G::kW, t, K);
  }
  WG_STAMP(threadIdx.x == 0, 3, clock64());
  cp_async_wait<0>();
  __syncthreads();  // the ring is free: the epilogue's fragments reuse it
  if (second) {
    pdl_wait();
    pdl_trigger();
  }
  mma_epilogue<T, WBITS, NT, RT, WARPS, SPLIT, EPI>(acc, reinterpret_cast<float*>(smem), scales, bias, residual, out,
                                                     b, M, N);
  WG_STAMP(threadIdx.x == 0, 4, clock64());
  WG_STAMP(threadIdx.x == 0, 5, global_ns());
}

#include "linear_wgmma.cuh"
