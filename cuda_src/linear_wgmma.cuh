// The wgmma half of linear_mma.cu, included at its end (it uses that file's Block, store_rows,
// MMA_ARGS, MMA_CLUSTER and WG_STAMP): linear_wgmma_kernel and wgmma_x_kernel, the x pass before it.
#pragma once

namespace {

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
// same 64 outputs; above NX = 128 their accumulators take registers from warpgroup 0, setmaxnreg):
// per half stage of 64 k each lane turns its words straight into wgmma's A fragments
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
  static constexpr int kWS = WS, kXS = XS;                      // weight and x slots
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

// A block's work as every role of linear_wgmma_kernel sees it: its tiles (with a split, its cluster's
// one tile and the block's share of K) and the addresses of its mbarriers.
template <int NX, int WS, int XS, int SPLIT, int EPI> struct WgWork {
  int x_tiles, n_st, rows, tiles, t_begin, n_t;  // n_t <= 0: a split past K (its fragments are zeros)
  unsigned wfull0, wempty0, xfull0, xempty0, redfree;  // wfull[WS], wempty[WS], xfull[XS], xempty[XS], redfree
  __device__ __forceinline__ WgWork(int M, int N, int K, unsigned bars)
      : x_tiles((M + NX - 1) / NX), n_st(K / 128), rows(mma_gated(EPI) ? 64 : 128),
        tiles((N + rows - 1) / rows * x_tiles),  // SPLIT > 1: the grid has one block a tile
        t_begin((SPLIT > 1 ? blockIdx.y : 0) * ((n_st + SPLIT - 1) / SPLIT)),
        n_t(min(n_st, t_begin + (n_st + SPLIT - 1) / SPLIT) - t_begin), wfull0(bars), wempty0(bars + 8 * WS),
        xfull0(wempty0 + 8 * WS), xempty0(xfull0 + 8 * XS), redfree(xempty0 + 8 * XS) {}
  __device__ __forceinline__ Block block_of(int tile) const {
    return Block{tile / x_tiles * rows, tile % x_tiles * NX, t_begin, t_begin + n_t};
  }
  // whether the block takes a k-th tile, `tile`: with SPLIT > 1 its one tile (a loop of one trip the
  // compiler sees as such)
  __device__ __forceinline__ bool more(int tile, int k) const { return SPLIT > 1 ? k < 1 : tile < tiles; }
};

// Lane 0 of warp 0, 16-bit and int8 weights: each stage's 128 rows through the tensor map w into the
// weight ring (rows past N are zero-filled, and count). No kernel of a graph writes weights: no pdl_wait.
template <class G, int WBITS, class Work>
__device__ __forceinline__ void copy_weights_tma(const Work& wk, const void* w, unsigned ring) {
  constexpr int WS = G::kWS;
  const TensorMap* map = static_cast<const TensorMap*>(w);
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map) : "memory");
  int gc = 0;  // stages issued
  for (int tile = blockIdx.x, k = 0; wk.more(tile, k); tile += gridDim.x, ++k) {
    const int row0 = wk.block_of(tile).row0;
    for (int i = 0; i < wk.n_t; ++i, ++gc) {
      const unsigned full = wk.wfull0 + 8 * (gc % WS);
      if (gc >= WS) mbar_wait(wk.wempty0 + 8 * (gc % WS), (gc / WS - 1) & 1);
      mbar_expect_tx(full, G::kW);
      tma_load_4d(ring + (gc % WS) * G::kWSlot, map, 0, row0, 0, (WBITS == 16 ? 2 : 1) * (wk.t_begin + i), full);
    }
  }
}

// Warp 0, int4 weights: lane l < 8 copies tile l's next kChunk stages and their pairs to a weight slot,
// the block's local row 16 l's row of w (gated: rows 64.. the up half), clamped to the last (never
// stored). No kernel of a graph writes weights: no pdl_wait.
template <class G, int EPI, class Work>
__device__ __forceinline__ void copy_weights_int4(const Work& wk, const void* w, const __half* scales, int N,
                                                  unsigned ring, int lane) {
  constexpr int WS = G::kWS;
  const int l = lane & 7, n_w = mma_gated(EPI) ? 2 * N : N;
  int gc = 0;  // chunks issued
  for (int tile = blockIdx.x, k = 0; wk.more(tile, k); tile += gridDim.x, ++k) {
    const int row0 = wk.block_of(tile).row0;
    const int tl = min(mma_gated(EPI) ? (l >> 2) * N + row0 + 16 * (l & 3) : row0 + 16 * l, n_w - 1) / 16;
    const char* wsrc = static_cast<const char*>(w) + ((size_t)tl * wk.n_st + wk.t_begin) * 1024;
    const char* ssrc = reinterpret_cast<const char*>(scales) + ((size_t)tl * wk.n_st + wk.t_begin) * G::kGroups * 64;
    for (int c = 0; c * G::kChunk < wk.n_t; ++c, ++gc) {
      const unsigned slot = ring + (gc % WS) * G::kWSlot, full = wk.wfull0 + 8 * (gc % WS);
      const int t = c * G::kChunk, st = min(G::kChunk, wk.n_t - t);
      if (gc >= WS) mbar_wait(wk.wempty0 + 8 * (gc % WS), (gc / WS - 1) & 1);
      if (lane == 0) mbar_expect_tx(full, st * 8 * (1024 + G::kGroups * 64));
      __syncwarp();
      if (lane < 8) {
        bulk_load(slot + G::kTile * l, wsrc + (size_t)t * 1024, st * 1024, full);
        bulk_load(slot + G::kW + G::kTileS * l, ssrc + (size_t)t * G::kGroups * 64, st * G::kGroups * 64, full);
      }
    }
  }
}

// Warp 1: lane 0 copies each stage's slot image of x (wgmma_x_kernel's) to an x slot; a tile's first
// waits for the previous tile's results, which lie over the x slots, to be stored (redfree).
template <class G, typename T, class Work>
__device__ __forceinline__ void copy_x(const Work& wk, const T* x, int K, unsigned xring, int lane) {
  constexpr int XS = G::kXS;
  pdl_wait();
  pdl_trigger();
  int gs = 0, k = 0;  // stages issued, tiles begun
  for (int tile = blockIdx.x; wk.more(tile, k) && lane == 0; tile += gridDim.x, ++k) {
    const char* xsrc = reinterpret_cast<const char*>(x) +
                       ((size_t)wk.block_of(tile).m0 * K * sizeof(T) + (size_t)wk.t_begin * G::kX);
    if (k > 0) mbar_wait(wk.redfree, (k - 1) & 1);
    for (int i = 0; i < wk.n_t; ++i, ++gs) {
      const unsigned full = wk.xfull0 + 8 * (gs % XS);
      if (gs >= XS) mbar_wait(wk.xempty0 + 8 * (gs % XS), (gs / XS - 1) & 1);
      mbar_expect_tx(full, G::kX);
      bulk_load(xring + (gs % XS) * G::kX, xsrc + (size_t)i * G::kX, G::kX, full);
    }
  }
}

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
  static_assert(WS >= 2 && XS >= 2 && (NX % 32 == 0 || NX == 16 || NX == 24 || NX == 48) && NX <= 224,
                "tile");
  constexpr bool kWide = NX > 128;  // 80-112 accumulators a consumer thread: registers moved to them
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bars[2 * (WS + XS) + 1];  // WgWork's
  const WgWork<NX, WS, XS, SPLIT, EPI> wk(M, N, K, smem_u32(bars));
  const unsigned raw_base = smem_u32(smem), ring = (raw_base + 1023) & ~1023u;  // swizzled tiles: 1024-aligned
  const unsigned xring = ring + WS * G::kWSlot;
  unsigned char* sm = smem + (ring - raw_base);
  const int wg = threadIdx.x >> 7, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < WS; ++s) {
      mbar_init(wk.wfull0 + 8 * s, 1);     // the producer's arrival with the chunk's bytes
      mbar_init(wk.wempty0 + 8 * s, 256);  // every consumer thread
    }
    for (int s = 0; s < XS; ++s) {
      mbar_init(wk.xfull0 + 8 * s, 1);
      mbar_init(wk.xempty0 + 8 * s, 256);
    }
    mbar_init(wk.redfree, 256);  // every consumer thread, once it has stored a tile's results
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
  // kWide: the consumers' accumulators take registers from warpgroup 0 (128 x 40 + 256 x 232: the 384 x
  // 168 the launch holds), each side in its own branch to the end (setmaxnreg: the same instruction for a
  // whole warpgroup; ptxas allocates each region for its limit).
  if (wg == 0) {
    if constexpr (kWide) regs_dec<40>();
    if (warp == 0) {  // the weight ring
      if constexpr (G::kTma) {
        if (lane == 0) copy_weights_tma<G, WBITS>(wk, w, ring);
      } else {
        copy_weights_int4<G, EPI>(wk, w, scales, N, ring, lane);
      }
    } else if (warp == 1) {  // the x ring
      copy_x<G>(wk, x, K, xring, lane);
    } else {
      pdl_wait();
    }
    if constexpr (kWide && SPLIT > 1) {  // store_rows' cluster barriers only
      cluster_sync();
      cluster_arrive();
      cluster_wait();
    }
  } else {  // consumers: warpgroup wg - 1 owns local rows 64 (wg - 1) .. + 64, warp w its 16 rows from 16 w
    if constexpr (kWide) regs_inc<232>();
    pdl_wait();
    const int r = 64 * (wg - 1) + 16 * (warp & 3) + (lane >> 2), c = lane & 3;
    // The lane's weights and pairs in weight slot 0, and x slot 0's descriptor's low word (desc128 with
    // lbo 16: the shared address / 16, below 2^14, so 32 bytes further adds 2); the slots and parities
    // advance by counting, and a chunk's bytes are waited for at its first stage.
    const unsigned char* wt0 = sm + (r >> 4) * G::kTile + (r & 15) * 64 + 16 * c;
    const unsigned char* sz0 = sm + G::kW + (r >> 4) * G::kTileS;
    const unsigned xd0 = (xring >> 4) | (1u << 16);
    const unsigned wd0 = ((ring + (wg - 1) * 64 * 128) >> 4) | (1u << 16);  // 16-bit: the warpgroup's rows
    int j = 0, wslot = 0, wpar = 0, xslot = 0, xpar = 0;
    for (int tile = blockIdx.x, k = 0; wk.more(tile, k); tile += gridDim.x, ++k) {
#pragma unroll
      for (int i = 0; i < NX / 2; ++i) acc[i] = 0.0f;
      for (int i = 0; i < wk.n_t; ++i) {
        if (j == 0) mbar_wait(wk.wfull0 + 8 * wslot, wpar);
        mbar_wait(wk.xfull0 + 8 * xslot, xpar);
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
        mbar_arrive(wk.xempty0 + 8 * xslot);  // each thread releases its own reads of the slots
        if (j == G::kChunk - 1 || i == wk.n_t - 1) mbar_arrive(wk.wempty0 + 8 * wslot);
        if (++xslot == XS) xslot = 0, xpar ^= 1;
        if (++j == G::kChunk || i == wk.n_t - 1) {  // the next tile starts a fresh chunk
          j = 0;
          if (++wslot == WS) wslot = 0, wpar ^= 1;
        }
      }
      if constexpr (SPLIT == 1) {  // the results over the x slots, stored by the 256 consumers
        asm volatile("bar.sync 1, 256;\n" ::: "memory");  // both warpgroups' multiplies have read their x
        float* red = reinterpret_cast<float*>(smem + (xring - raw_base));
        wgmma_results<NX, G::kRS>(red, acc, wg, warp, lane);
        store_rows<T, WBITS, 128, NX, 256, 1, EPI, true>(red, scales, bias, residual, out, wk.block_of(tile), M, N,
                                                         threadIdx.x - 128);
        mbar_arrive(wk.redfree);  // this thread's reads of the results are done
      }
    }
    if constexpr (kWide) {  // the consumers finish the block alone
      WG_STAMP(threadIdx.x == 128, 3, clock64());
      if constexpr (SPLIT > 1) {  // the cluster's reduction
        asm volatile("bar.sync 1, 256;\n" ::: "memory");  // both warpgroups' multiplies done: the ring is free
        float* red = reinterpret_cast<float*>(sm);
        wgmma_results<NX, G::kRS>(red, acc, wg, warp, lane);
        store_rows<T, WBITS, 128, NX, 256, SPLIT, EPI>(red, scales, bias, residual, out, wk.block_of(blockIdx.x), M,
                                                       N, threadIdx.x - 128);
      }
      WG_STAMP(threadIdx.x == 128, 4, clock64());
      WG_STAMP(threadIdx.x == 128, 5, global_ns());
    }
  }
  if constexpr (kWide) return;
  WG_STAMP(threadIdx.x == 128, 3, clock64());
  if constexpr (SPLIT > 1) {  // one tile a block: every thread takes part in the cluster's reduction
    __syncthreads();  // every stage consumed (every copy landed): the ring is free, the results reuse it
    float* red = reinterpret_cast<float*>(sm);
    if (wg > 0) wgmma_results<NX, G::kRS>(red, acc, wg, warp, lane);
    store_rows<T, WBITS, 128, NX, 384, SPLIT, EPI>(red, scales, bias, residual, out, wk.block_of(blockIdx.x), M, N,
                                                   threadIdx.x);
  }
  WG_STAMP(threadIdx.x == 128, 4, clock64());
  WG_STAMP(threadIdx.x == 128, 5, global_ns());
#else
  __trap();
#endif
}
