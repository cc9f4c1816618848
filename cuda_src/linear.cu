// Linear layers y = x @ W.T (+ bias) for decode batches (M = 1..16 rows of x) with the
// weight dequantized in registers, and the dequantize-to-scratch kernel of the prefill path.
//
// Weight formats (cuinfer/ops/quant.py documents the layouts):
//   WBITS 16: W [N, K] in T (fp16 / bf16), row-major.
//   WBITS 8 : q int8 [N, K] row-major, w = q * scale[n] (fp16 scales, per output channel).
//   WBITS 4 : w = (q - zero[n, g]) * scale[n, g] for groups of GS along K, rows in tiles of 16:
//             q uint32 [ceil(N/16), ceil(K/128), 16, 16] (each tile's 128 k as 1 KB, a row's
//             64 bytes in the interleaved nibble order of quant.py), (scale, zero) fp16 pairs
//             [ceil(N/16), K/GS, 16].
//
// The GEMV runs on tensor cores: mma.sync m16n8k16 with A = 16 weight rows and B = up to 8
// rows of x per n-tile (NT = 2 n-tiles for M = 9..16), fp32 accumulators. A contraction
// index is only a label, so each lane of a quad (lane % 4 = c) gives its four k slots
// {2c, 2c+1, 2c+8, 2c+9} of a k16 step to four CONSECUTIVE k of its own 16-byte weight load;
// x is read with the same map, so the weights need no shuffle to reach fragment order:
//   fp16 : lane c loads k = kq + 8c .. +8        (2 mma steps), a quad covers 32 k
//   int8 : lane c loads k = kq + 16c .. +16      (4 mma steps), a quad covers 64 k
//   int4 : lane c loads k = kq + 32j + 8c .. +8 for words j = 0..3 (packed that way), word j
//          feeding steps 2j and 2j+1 (4 k each) from one 16-byte x load; a quad covers
//          128 k and every mma step lies inside one scale group (32 | GS).
// int8 scales multiply the finished dot product. int4 feeds the tensor cores exact values: with
// integer zero points (IZ: every zero in 0..15, as minmax, GPTQ and Q4_0 give) q - zero, taken in
// the nibble conversion, and the group ends with acc += scale sum (q - zero) x; with fractional
// ones (the MSE fit, Q4_1) q, and the steps of one group also sum x into a second fragment (an
// mma with A = ones), the group ending with acc += scale (sum q x - zero sum x), in fp32.
// The epilogue (EPI_*) stores y (optionally plus a residual), or act(gate) * up of a stacked [gate; up] weight
// (act: SiLU or GELU-tanh), or
// per-block argmax partials; small grids split K over the blocks of a cluster (sm_90) that meet
// in distributed shared memory. With XS every block first copies the x rows to shared memory, read
// by the main loop (no L1 misses in its dependent chain); given a norm weight it writes their
// RMSNorm instead (x is the residual stream, normalized as rms_norm.cu rounds it): the decoder's
// norm costs no launch of its own.
#include "mma.cuh"
#include "quant.cuh"

using namespace cuinfer;

namespace {

// (value, index) pairs: the larger value wins, ties go to the lower index; NaN never wins.
__device__ __forceinline__ void argmax_merge(float& best, int& idx, float v, int i) {
  if (v > best || (v == best && i < idx)) best = v, idx = i;
}
__device__ __forceinline__ void argmax_warp(float& best, int& idx) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    argmax_merge(best, idx, __shfl_xor_sync(0xffffffffu, best, off), __shfl_xor_sync(0xffffffffu, idx, off));
}

}  // namespace

// Epilogues of linear_kernel: EPI_STORE out[m, n] = y (+ bias), with a residual
// round(round(y) + residual[m, n]) (the decoder's residual add, rounded as the unfused pair);
// EPI_SILU_AND_MUL out[m, n] = silu(y[m, n]) * y[m, n + N] for the stacked weight [gate; up]
// ([2N, K]), both sums in fp32, rounded once; EPI_GELU_AND_MUL the same with gelu_tanh (Gemma); EPI_ARGMAX: per block and row m of x the (max,
// lowest index) of T(y) over the block's rows, into part_val / part_idx [M, gridDim.x]
// (linear_argmax_reduce_kernel finishes).
#define EPI_STORE 0
#define EPI_SILU_AND_MUL 1
#define EPI_ARGMAX 2
#define EPI_GELU_AND_MUL 3
// the gated epilogues: a block computes the gate and the up rows of its outputs
__host__ __device__ constexpr bool gated(int epi) { return epi == EPI_SILU_AND_MUL || epi == EPI_GELU_AND_MUL; }

// Split-K across the blocks of a thread-block cluster (sm_90): SPLIT blocks along y share a row
// tile, each reduces its K / SPLIT, and block 0 of the cluster adds the others' sums through
// distributed shared memory. Below sm_90 there are no clusters and tile_config keeps SPLIT = 1.
// (cluster_sync, cluster_rank, load_cluster: mma.cuh)
#if __CUDA_ARCH__ >= 900
#define LINEAR_CLUSTER(n) __cluster_dims__(1, n, 1)
#else
#define LINEAR_CLUSTER(n)
#endif

#include "linear_stage.cuh"

// The epilogue's operands that do not depend on the product, for one output: int8 scales, bias (of
// the up half too with a gated epilogue), residual; neutral where there is none.
struct EpiIn {
  float scale = 1.0f, up_scale = 1.0f, bias = 0.0f, up_bias = 0.0f, res = 0.0f;
};

// One block: 16 RT output rows (RR = 2 RT weight row tiles with a gated epilogue: the gate tiles,
// then the up tiles N rows further), the quads [rank, rank + 1) * ceil(quads / SPLIT) of K.
// Every warp holds RT row tiles: with a gated epilogue warps [0, WARPS / 2) take the gate tiles
// and the others the up tiles (a warp's registers are those of a plain GEMV, which doubles the
// blocks an SM holds). Warp kw of its half takes quad steps q_begin + (i * KW + kw) * U + u,
// loading the next U quads (and their int4 (scale, zero) pairs) while it computes these; the warps
// meet in shared memory.
template <typename T, int WBITS, int GS, bool IZ, int NT, int RT, int U, int WARPS, int SPLIT, int EPI, int XS>
__device__ __forceinline__ void linear_body(const T* __restrict__ x, const void* __restrict__ w,
                                            const __half* __restrict__ scales, const T* __restrict__ bias,
                                            const T* __restrict__ norm_w, float eps,
                                            const T* __restrict__ residual, T* __restrict__ out,
                                            float* __restrict__ part_val, int* __restrict__ part_idx, int M, int N,
                                            int K, const T* __restrict__ add_o, const T* __restrict__ add_w,
                                            T* __restrict__ add_out) {
  using L = Layout<WBITS>;
  static_assert(WBITS != 4 || GS == 32 || GS == 64 || GS == 128, "int4 group size");
  constexpr int RR = gated(EPI) ? 2 * RT : RT;  // weight row tiles per block
  constexpr int GQ = WBITS == 4 ? 128 / GS : 1;              // int4 scale groups per quad
  constexpr int V = RR * NT * 4;                             // accumulator values per lane
  constexpr int KW = WARPS * RT / RR;                        // warps per weight half, splitting K
  static_assert(KW >= 1 && WARPS % (RR / RT) == 0, "a gated epilogue needs an even warp count");
  __shared__ float partial[KW][V][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c = lane & 3, g4 = lane >> 2;
  const int half = warp / KW, kw = warp % KW;  // weight half (gate 0, up 1) and K slot of this warp
  const int row0 = blockIdx.x * 16 * RT;
  const int n_quads = (K + L::kQuadK - 1) / L::kQuadK;
  const int per_split = (n_quads + SPLIT - 1) / SPLIT;
  const int q_begin = (SPLIT > 1 ? blockIdx.y : 0) * per_split, q_end = min(n_quads, q_begin + per_split);
  const int n_groups = WBITS == 4 ? K / GS : 1;

  float acc[RT][NT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[r][n][j] = 0.0f;

  // Every format packs a quad of one weight row into 64 bytes: the lane's 16 bytes of quad q of
  // row (r, h) (row g4 + 8 h of row tile r of the warp's weight half) are at wrow[r][h] +
  // kQuadStride q (int4: 16-row tiles, a tile's quad 1 KB), its int4 (scale, zero) of group g at
  // pairs[grow[r][h] + 16 g]. Rows past N read row N - 1: the epilogue stores no output of theirs,
  // and a row of A only reaches its own outputs.
  constexpr int kQuadStride = WBITS == 4 ? 16 * 64 : 64;
  const __half2* pairs = reinterpret_cast<const __half2*>(scales);
  const char* wrow[RT][2];
  int grow[RT][2];  // int4: the row's first (scale, zero)
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min(row0 + 16 * r + 8 * h + g4, N - 1) + half * N;
      const size_t first = WBITS == 4 ? tiled_row(row, n_quads) * 64 : (size_t)row * K * WBITS / 8;
      wrow[r][h] = pinned(static_cast<const char*>(w) + first + 16 * c);
      grow[r][h] = pinned(static_cast<int>(tiled_row(row, n_groups)));  // pinned: held in a register (the main loop recomputed it)
    }

  // Raw weights (and int4 (scale, zero) pairs) of quads base .. base + U - 1. fp16 / int8 lanes
  // past K load zeros (x is zero there too); int4 rows are padded to whole quads, and the steps
  // of quads and groups past the end are never computed, so their registers are left as they are.
  auto load = [&](uint4 (&a_raw)[U][RT][2], __half2 (&sz)[U][RT][2][GQ], int base) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = base + u;
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint4* src = reinterpret_cast<const uint4*>(wrow[r][h] + (size_t)q * kQuadStride);
          if constexpr (WBITS == 4) {
            if (q < q_end) {
              a_raw[u][r][h] = __ldcs(src);
#pragma unroll
              for (int gi = 0; gi < GQ; ++gi) {
                const int g = q * GQ + gi;
                if (g < n_groups) sz[u][r][h][gi] = pairs[grow[r][h] + 16 * g];
              }
            }
          } else {
            const bool ok = q < q_end && q * L::kQuadK + (c + 1) * L::kLaneK <= K;
            a_raw[u][r][h] = ok ? __ldcs(src) : make_uint4(0, 0, 0, 0);
          }
        }
    }
  };

  // Software pipeline: the next U quads are in flight while this warp computes the current U.
  // The first ones are loaded before pdl_wait(): no kernel of a graph writes weights, so in a
  // replay they stream in while the previous kernel finishes.
  uint4 a_raw[U][RT][2], a_next[U][RT][2];
  __half2 sz[U][RT][2][GQ], sz_next[U][RT][2][GQ];
  load(a_raw, sz, q_begin + kw * U);
  extern __shared__ uint4 norm_smem[];  // XS: stage_rows' shared memory
  T* xs = reinterpret_cast<T*>(norm_smem);
  constexpr bool WS = XS && WBITS == 16;  // stage_rows' WS: the fp16 / bf16 GEMVs
  if constexpr (WS) prefetch_norm_weights<T, 32 * WARPS, XS == 2>(norm_w, add_w, xs, M, K);
  pdl_wait();
  pdl_trigger();  // at once, as every kernel here: the next one's loads before its wait overlap this one

  // Epilogue thread i finishes accumulator value i / 32 of lane i % 32 (of the gate or only half):
  // output row `row`, x row `m`. With NT = 1 fp16 / int4 weights its operands are loaded here, so
  // their latency hides behind the main loop instead of following the reduction. Not with NT = 2
  // (no registers to spare), nor int8 or the argmax: their kernels sit at 64 registers, and 4-8 more
  // cost them a block per SM (run R: int8 GEMVs 2.93 -> 3.05 ms a llama3-8b step).
  constexpr int VO = RT * NT * 4, IT = (VO + WARPS - 1) / WARPS;
  constexpr bool EARLY = NT == 1 && WBITS != 8 && EPI != EPI_ARGMAX;
  auto out_pos = [&](int i, int& row, int& m) {
    const int v = i >> 5, l = i & 31, j = v & 3, n = (v >> 2) % NT, r = v / (4 * NT);
    row = row0 + 16 * r + (l >> 2) + 8 * (j >> 1);
    m = 8 * n + 2 * (l & 3) + (j & 1);
  };
  auto epi_in = [&](int i) {
    EpiIn e;
    int row, m;
    out_pos(i, row, m);
    if (row >= N || m >= M) return e;
    if constexpr (WBITS == 8) e.scale = __half2float(scales[row]);
    if constexpr (WBITS == 8 && gated(EPI)) e.up_scale = __half2float(scales[row + N]);
    if (bias != nullptr) e.bias = to_float(bias[row]);
    if (gated(EPI) && bias != nullptr) e.up_bias = to_float(bias[row + N]);
    if (EPI == EPI_STORE && residual != nullptr) e.res = to_float(residual[(size_t)m * N + row]);
    return e;
  };
  EpiIn early[EARLY ? IT : 1];
  if constexpr (EARLY) {
#pragma unroll
    for (int it = 0; it < IT; ++it)
      if (threadIdx.x + it * 32 * WARPS < VO * 32) early[it] = epi_in(threadIdx.x + it * 32 * WARPS);
  }

  // x16(n, k): 16 bytes from column k of the x row of n-tile n, min(8 n + g4, M - 1) (a column
  // of B only reaches its own outputs, and those of rows past M are never stored): the global
  // rows, or with XS their copy (or RMSNorm) in shared memory, written while the first weights load.
  if constexpr (XS)
    stage_rows<T, 32 * WARPS, XS == 2, WS, 8 * NT>(x, norm_w, eps, xs, M, K, add_o, add_w, add_out);
  const T* xrow[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int m = min(8 * n + g4, M - 1);
    xrow[n] = XS ? xs + pinned(m * norm_stride(K)) : pinned(x + (size_t)m * K);
  }
  auto x16 = [&](int n, int k) { return *reinterpret_cast<const uint4*>(xrow[n] + k); };
  for (int base = q_begin + kw * U; base < q_end; base += KW * U) {
    if (base + KW * U < q_end) load(a_next, sz_next, base + KW * U);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = base + u;
      if (q >= q_end) break;
      const int kq = q * L::kQuadK;
      if constexpr (WBITS == 16 || WBITS == 8) {
        constexpr int kLoads = L::kLaneK / 8;  // 16-byte x loads per lane: 1 (fp16), 2 (int8)
        const bool k_ok = kq + (c + 1) * L::kLaneK <= K;
#pragma unroll
        for (int xl = 0; xl < kLoads; ++xl) {
          uint4 b[NT];
#pragma unroll
          for (int n = 0; n < NT; ++n) b[n] = k_ok ? x16(n, kq + c * L::kLaneK + 8 * xl) : make_uint4(0, 0, 0, 0);
#pragma unroll
          for (int s = 0; s < 2; ++s) {  // the two k16 steps of these 8 x values
#pragma unroll
            for (int r = 0; r < RT; ++r) {
              u32 a[4];
              if constexpr (WBITS == 16) {
                const u32* lo = reinterpret_cast<const u32*>(&a_raw[u][r][0]);
                const u32* hi = reinterpret_cast<const u32*>(&a_raw[u][r][1]);
                a[0] = lo[2 * s]; a[1] = hi[2 * s]; a[2] = lo[2 * s + 1]; a[3] = hi[2 * s + 1];
              } else {
                const u32 wl = reinterpret_cast<const u32*>(&a_raw[u][r][0])[2 * xl + s];
                const u32 wh = reinterpret_cast<const u32*>(&a_raw[u][r][1])[2 * xl + s];
                a[0] = int8_pair<T>(wl, 0); a[1] = int8_pair<T>(wh, 0);
                a[2] = int8_pair<T>(wl, 1); a[3] = int8_pair<T>(wh, 1);
              }
#pragma unroll
              for (int n = 0; n < NT; ++n) {
                const u32* bw = reinterpret_cast<const u32*>(&b[n]);
                mma16816<T>(acc[r][n], a, bw[2 * s], bw[2 * s + 1]);
              }
            }
          }
        }
      } else {
        // A group's steps accumulate p = sum (q - z) x (exact products); with an integer zero point
        // (IZ) z = zero and the group ends with acc += scale p, else z = 0, a second mma with A = ones
        // sums px = sum x per row of x, and the group ends with acc += scale (p - zero px), in fp32.
        constexpr int kWords = GS / 32;  // words (two k16 steps, 32 k) per scale group
        constexpr u32 ones[4] = {Pair<T>::kOne, Pair<T>::kOne, Pair<T>::kOne, Pair<T>::kOne};
#pragma unroll
        for (int gi = 0; gi < GQ; ++gi) {
          if (kq / GS + gi >= n_groups) break;
          float p[RT][NT][4], px[NT][4];
#pragma unroll
          for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              px[n][j] = 0.0f;
#pragma unroll
              for (int r = 0; r < RT; ++r) p[r][n][j] = 0.0f;
            }
          ZeroSub zs[RT][2];
#pragma unroll
          for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) zs[r][h] = zero_sub<IZ>(sz[u][r][h][gi], T());
#pragma unroll
          for (int wi = 0; wi < kWords; ++wi) {
            const int j = gi * kWords + wi;  // word j of the lane: k = kq + 32 j + 8 c .. +8, steps 2j, 2j+1
            uint4 b[NT];
#pragma unroll
            for (int n = 0; n < NT; ++n) b[n] = x16(n, kq + 32 * j + 8 * c);
            u32 ql[RT][4], qh[RT][4];  // rows g4, g4 + 8: nibbles (i, i + 4) are k 2i, 2i + 1 of the word
#pragma unroll
            for (int r = 0; r < RT; ++r) {
              int4_word<T>(reinterpret_cast<const u32*>(&a_raw[u][r][0])[j], zs[r][0], ql[r]);
              int4_word<T>(reinterpret_cast<const u32*>(&a_raw[u][r][1])[j], zs[r][1], qh[r]);
            }
#pragma unroll
            for (int st = 0; st < 2; ++st) {  // k 4 st .. 4 st + 3 of the word: pairs 2 st, 2 st + 1
#pragma unroll
              for (int n = 0; n < NT; ++n) {
                const u32* bw = reinterpret_cast<const u32*>(&b[n]);
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
              const float scale = __low2float(sz[u][r][h][gi]), zero = __high2float(sz[u][r][h][gi]);
#pragma unroll
              for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e)
                  acc[r][n][e] = fmaf(scale, IZ ? p[r][n][e] : fmaf(-zero, px[n][e], p[r][n][e]), acc[r][n][e]);
            }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          a_raw[u][r][h] = a_next[u][r][h];
#pragma unroll
          for (int gi = 0; gi < GQ; ++gi) sz[u][r][h][gi] = sz_next[u][r][h][gi];
        }
  }

  // Sum the warps' fragments into partial[0] (value v of lane l at [v][l]), then the cluster's blocks.
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j) partial[kw][((half * RT + r) * NT + n) * 4 + j][lane] = acc[r][n][j];
  __syncthreads();
  float* red = &partial[0][0][0];
  for (int i = threadIdx.x; i < V * 32; i += 32 * WARPS) {
    float y = 0.0f;
#pragma unroll
    for (int wi = 0; wi < KW; ++wi) y += (&partial[wi][0][0])[i];
    red[i] = y;
  }
  __syncthreads();
  if constexpr (SPLIT > 1) {
#if __CUDA_ARCH__ >= 900
    cluster_sync();  // every block's sums are in its shared memory
    const bool leader = cluster_rank() == 0;
    if (leader) {
      for (int i = threadIdx.x; i < V * 32; i += 32 * WARPS) {
        float y = red[i];
#pragma unroll
        for (int s = 1; s < SPLIT; ++s) y += load_cluster(red + i, s);
        red[i] = y;
      }
    }
    cluster_sync();  // the leader has read the others' shared memory: they may exit
    if (!leader) return;
#else
    __trap();  // unreachable: SPLIT > 1 is launched on sm_90 and newer only (ops/linear.py)
#endif
  }

  // Epilogue (out_pos, epi_in above).
  __shared__ float logit[EPI == EPI_ARGMAX ? 16 : 1][16 * RT];
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    const int i = threadIdx.x + it * 32 * WARPS;
    int row, m;
    out_pos(i, row, m);
    if (i >= VO * 32 || row >= N || m >= M) continue;
    EpiIn e;
    if constexpr (EARLY) e = early[it];
    else e = epi_in(i);
    float y = red[i];
    if constexpr (WBITS == 8) y *= e.scale;
    if (bias != nullptr) y += e.bias;
    if constexpr (gated(EPI)) {
      float up = red[i + VO * 32];
      if constexpr (WBITS == 8) up *= e.up_scale;
      if (bias != nullptr) up += e.up_bias;
      y = (EPI == EPI_SILU_AND_MUL ? silu(y) : gelu_tanh(y)) * up;
    }
    if constexpr (EPI == EPI_STORE) {
      if (residual != nullptr) y = to_float(from_float<T>(y)) + e.res;
    }
    if constexpr (EPI == EPI_ARGMAX) {
      logit[m][row - row0] = to_float(from_float<T>(y));  // the logits rounded to T, as linear() stores them
    } else {
      out[(size_t)m * N + row] = from_float<T>(y);
    }
  }
  if constexpr (EPI == EPI_ARGMAX) {
    __syncthreads();
    const int rows = min(16 * RT, N - row0);
    for (int m = warp; m < M; m += WARPS) {
      float best = __int_as_float(0xff800000u);  // -inf
      int idx = row0;
      for (int lr = lane; lr < rows; lr += 32) argmax_merge(best, idx, logit[m][lr], row0 + lr);
      argmax_warp(best, idx);
      if (lane == 0) part_val[(size_t)m * gridDim.x + blockIdx.x] = best, part_idx[(size_t)m * gridDim.x + blockIdx.x] = idx;
    }
  }
}

#define LINEAR_ARGS                                                                                            \
  const T *__restrict__ x, const void *__restrict__ w, const __half *__restrict__ scales,                      \
      const T *__restrict__ bias, const T *__restrict__ norm_w, float eps, const T *__restrict__ residual,     \
      T *__restrict__ out, float *__restrict__ part_val, int *__restrict__ part_idx, int M, int N, int K,          \
      const T *__restrict__ add_o, const T *__restrict__ add_w, T *__restrict__ add_out
#define LINEAR_PASS x, w, scales, bias, norm_w, eps, residual, out, part_val, part_idx, M, N, K, add_o, add_w, add_out

// grid: (ceil(N / (16 RT))) · block: 32 WARPS (MINB blocks per SM: <= 65536 / (32 WARPS MINB) registers) ·
// smem: static, 4 * WARPS * RT * NT * 128 bytes (+ 64 RT bytes for EPI_ARGMAX); dynamic, with
// XS: sizeof(T) norm_stride(K) M bytes, with fp16 / bf16 weights (WBITS 16) (M + [norm_w]), XS 2 (2 M + 2)
// (stage_rows)
// x: [M, K] (M <= 8 NT), out: [M, N], bias: [N] ([2N] for the gated epilogues) or null, all T;
// w: see the formats above ([2N, K] for the gated epilogues); scales: fp16 [rows] (WBITS 8) or the
// (scale, zero) pairs [ceil(rows / 16), K / GS, 16, 2] (WBITS 4), null for fp16; part_val / part_idx:
// [M, gridDim.x] for EPI_ARGMAX, else null. XS 1 (K % 8 == 0): x staged in shared memory, normalized
// with norm_w [K] in T and eps unless norm_w is null; XS 0: norm_w is null. residual: [M, N] T or null, EPI_STORE only,
// not aliasing out. XS 2: as 1 with norm_w, x first replaced by round(x + rms_normed(add_o [M, K],
// add_w [K])) (stage_rows), also written to add_out [M, K] (aliasing neither x nor add_o); else
// those three are null (their own template value: the prologue's registers stay off the others). Every
// weight byte is read once (streamed).
template <typename T, int WBITS, int GS, bool IZ, int NT, int RT, int U, int WARPS, int EPI, int XS, int MINB>
__global__ void __launch_bounds__(32 * WARPS, MINB) linear_kernel(LINEAR_ARGS) {
  linear_body<T, WBITS, GS, IZ, NT, RT, U, WARPS, 1, EPI, XS>(LINEAR_PASS);
}

// grid: (ceil(N / (16 RT)), SPLIT), clusters of (1, SPLIT, 1) · otherwise as linear_kernel:
// the blocks of a cluster split K, the cluster's block 0 writes the epilogue. sm_90 and newer.
template <typename T, int WBITS, int GS, bool IZ, int NT, int RT, int U, int WARPS, int SPLIT, int EPI, int XS, int MINB>
__global__ void __launch_bounds__(32 * WARPS, MINB) LINEAR_CLUSTER(SPLIT) linear_split_kernel(LINEAR_ARGS) {
  linear_body<T, WBITS, GS, IZ, NT, RT, U, WARPS, SPLIT, EPI, XS>(LINEAR_PASS);
}

// grid: (M) · block: 1024 · smem: static 256 bytes
// part_val / part_idx: [M, nb] from linear_kernel's EPI_ARGMAX (V = float), or part_val the logits
// [M, nb] themselves (V = T) with part_idx null (the index is the column); out: int32 [M], the
// index of the largest value (ties: the lowest index, as numpy.argmax; NaN never wins).
template <typename V>
__global__ void __launch_bounds__(1024) linear_argmax_reduce_kernel(const V* __restrict__ part_val,
                                                                    const int* __restrict__ part_idx,
                                                                    int* __restrict__ out, int nb) {
  pdl_wait();  // every input of this kernel may come from the previous one
  pdl_trigger();
  __shared__ float vals[32];
  __shared__ int idxs[32];
  const int m = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float best = __int_as_float(0xff800000u);  // -inf
  int idx = 0x7fffffff;
  for (int j = threadIdx.x; j < nb; j += 1024)
    argmax_merge(best, idx, to_float(part_val[(size_t)m * nb + j]), part_idx ? part_idx[(size_t)m * nb + j] : j);
  argmax_warp(best, idx);
  if (lane == 0) vals[warp] = best, idxs[warp] = idx;
  __syncthreads();
  if (warp == 0) {
    best = vals[lane], idx = idxs[lane];
    argmax_warp(best, idx);
    if (lane == 0) out[m] = idx;
  }
}

// grid: (ceil(N * K / (8 * 256))) · block: 256 · smem: none
// w, scales: as linear_kernel's; out: [N, K] T, the dequantized weight, w = T(scale * (q - zero))
// (rounded once); thread i writes out elements 8i .. 8i + 7 (K % 8 == 0 for int8, K % 32 == 0 for int4).
template <typename T, int WBITS, int GS>
__global__ void __launch_bounds__(256) linear_dequant_kernel(const void* __restrict__ w,
                                                             const __half* __restrict__ scales,
                                                             T* __restrict__ out, int N, int K) {
  pdl_wait();  // every input of this kernel may come from the previous one
  pdl_trigger();
  const size_t i = (size_t)blockIdx.x * 256 + threadIdx.x;
  if (i * 8 >= (size_t)N * K) return;
  const int row = static_cast<int>(i * 8 / K), k = static_cast<int>(i * 8 % K);
  float v[8];
  if constexpr (WBITS == 8) {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const i8*>(w) + i * 8);
    const float s = __half2float(scales[row]);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = s * static_cast<float>(static_cast<i8>((j < 4 ? raw.x : raw.y) >> (8 * (j & 3))));
  } else {
    // k .. k + 7 are the eight nibbles of one word: quad q, word j, lane c (k = 128 q + 32 j + 8 c).
    const int n_quads = (K + 127) / 128, n_groups = K / GS;
    const int q = k / 128, j = (k % 128) / 32, c = (k % 32) / 8;
    const u32 word = static_cast<const u32*>(w)[(tiled_row(row, n_quads) + 16 * q) * 16 + 4 * c + j];
    const __half2 sz = reinterpret_cast<const __half2*>(scales)[tiled_row(row, n_groups) + 16 * (k / GS)];
    const float s = __low2float(sz), z = __high2float(sz);
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const int st = jj >> 2, o = jj & 3, nib = 2 * st + (o >> 1) + 4 * (o & 1);
      v[jj] = s * (static_cast<float>((word >> (4 * nib)) & 0xfu) - z);  // q - zero exact in fp32
    }
  }
  Vec<T, 8> r;
#pragma unroll
  for (int j = 0; j < 8; ++j) r.v[j] = from_float<T>(v[j]);
  r.store(out + i * 8);
}
