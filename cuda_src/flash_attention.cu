// Flash attention forward for prefill and chunked prefill, two kernels with one contract:
//
// flash_attention_kernel (sm_80+), FlashAttention-2 style: one CTA computes BM query rows of one
// head of one sequence; each warp owns BM / WARPS rows (MT m16 tiles). K/V tiles of BN keys are
// staged in shared memory with cp.async (two stages: tile j+1 loads while tile j is computed), rows
// padded by 8 elements so that ldmatrix's eight 16-byte row reads hit distinct banks. S = Q K^T and
// O += P V run on mma.sync.m16n8k16 (fp32 accumulate).
//
// flash_attention_wgmma_kernel (sm_90a, D a multiple of 64): each warpgroup owns 64 query rows and
// multiplies with wgmma straight from shared memory: S = Q K^T with Q and K as 128-byte-swizzled
// K-major tiles, O += P V with P from registers and V read transposed (MN-major) from the same
// swizzled layout; no ldmatrix, no register copies of K or V.
//
// flash_attention_kernel also reads a paged fp8 cache (C = __nv_fp8_e4m3, cuinfer/ops/fp8.py): the
// tiles' codes go by cp.async into a raw double buffer, and each tile is decoded (exactly, KvChunk)
// into one T stage of K and V before its products, behind one more barrier a tile.
//
// Both round P to T before the PV product, as FlashAttention does. Softmax is online in fp32: the
// row max is taken on the raw scores (scale > 0) and each exponential is one FFMA and one ex2:
// p = 2^(s * scale * log2(e) - max * scale * log2(e)).
#include "flash_attention.cuh"

// grid: (ceil(max_q_len / BM), n_heads, num_seqs), x reversed so the heaviest causal blocks
//   start first · block: 32 * WARPS · smem: (BM + 4 * BN) * (D + 8) * sizeof(T); fp8 C:
//   (BM + 2 * BN) * (D + 8) * sizeof(T) + 4 * BN * D
// q, out: [tokens, n_heads, D]; cu_seqlens_q: [num_seqs + 1]
// contiguous: k, v: [tokens, n_kv_heads, D], keys of sequence i at rows cu_seqlens_q[i]..
// PAGED: k, v: [num_blocks, 1 << block_shift, n_kv_heads, D] of C (T or fp8); block_tables: [num_seqs, max_blocks];
//   context_lens: [num_seqs]; the q rows are the last q_len of context_lens[i] positions.
// Query i of a chunk sees keys 0 .. i + kv_len - q_len when causal, every key otherwise; with
// window > 0 (causal) only the last `window` of them, and key tiles wholly before them are not read.
// cap_in > 0: scores capped, cap_out * tanh(s * cap_in), scale_log2 then 1 (Tile).
template <typename T, typename C, int D, int BM, int BN, int WARPS, bool PAGED>
__global__ void __launch_bounds__(32 * WARPS) flash_attention_kernel(
    const T* __restrict__ q, const C* __restrict__ k, const C* __restrict__ v, T* __restrict__ out,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ context_lens,
    const int* __restrict__ block_tables, int max_blocks, int block_shift, int n_heads,
    int n_kv_heads, float scale_log2, int causal, int window, float cap_in, float cap_out) {
  cuinfer::pdl_wait();  // every input of this kernel may come from the previous one
  cuinfer::pdl_trigger();
  using namespace cuinfer;
  using namespace cuinfer::fa;
  constexpr int MT = BM / (16 * WARPS);  // m16 tiles per warp
  constexpr int STRIDE = D + 8;          // padded shared-memory row, elements
  constexpr int CHUNKS = D / 8;          // 16-byte chunks per row
  constexpr int NT = BN / 8;             // n8 tiles of S
  constexpr int DT = D / 8;              // n8 tiles of O
  constexpr int KS = D / 16;             // k16 steps of Q K^T
  constexpr int THREADS = 32 * WARPS;
  constexpr bool Q_IN_REGS = MT * KS * 4 <= 32;  // else Q fragments are re-read from sQ each tile
  static_assert(MT >= 1 && BM == MT * 16 * WARPS, "BM must be a multiple of 16 * WARPS");
  static_assert(BN % 16 == 0 && D % 16 == 0, "BN and D must be multiples of 16");
  constexpr bool FP8 = sizeof(C) != sizeof(T);  // decoded from a raw double buffer into one T stage
  static_assert(!FP8 || PAGED, "an fp8 K/V is a paged cache");
  using Chunk = KvChunk<T, C>;

  // x reversed: the heaviest causal blocks start first
  const Tile t = tile_of<BM, BN, PAGED>((gridDim.x - 1 - blockIdx.x) * BM, blockIdx.y, blockIdx.z, cu_seqlens_q,
                                         context_lens, n_heads, n_kv_heads, causal, window, cap_in, cap_out);
  if (t.empty) return;
  const int head = t.head, m0 = t.m0;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [BM][STRIDE]; reused for the output tile
  T* sK = sQ + BM * STRIDE;                // [2][BN][STRIDE] (fp8: [BN][STRIDE])
  T* sV = sK + (FP8 ? 1 : 2) * BN * STRIDE;  // likewise
  // fp8: the tiles' codes, [2][BN][D] bytes each of K and V
  unsigned char* rawK = reinterpret_cast<unsigned char*>(sV + (FP8 ? 1 : 2) * BN * STRIDE);
  unsigned char* rawV = rawK + 2 * BN * D;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  // Q lands with tile 0. Without tiles no Q is copied: the rows a thread copies are staged by other
  // warps, and the staging of the (zero) output below waits for this warp's copies only.
  for (int c = tid; t.n_tiles > 0 && c < BM * CHUNKS; c += THREADS) {
    const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
    const bool ok = m0 + r < t.q_len;
    const T* src = q + ((size_t)(t.q_start + (ok ? m0 + r : 0)) * n_heads + head) * D + col;
    cp_async16(smem_u32(sQ + r * STRIDE + col), src, ok);
  }
  const int* table = PAGED ? block_tables + (size_t)t.seq * max_blocks : nullptr;
  auto load_kv = [&](int tile, int stage) {
    for (int c = tid; c < BN * CHUNKS; c += THREADS) {
      const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
      size_t off;
      const bool ok = kv_chunk<D, PAGED>(t, (t.tile0 + tile) * BN + r, col, table, block_shift, n_kv_heads, off);
      if constexpr (FP8) {
        cp_async8(smem_u32(rawK + (stage * BN + r) * D + col), k + off, ok);
        cp_async8(smem_u32(rawV + (stage * BN + r) * D + col), v + off, ok);
      } else {
        cp_async16(smem_u32(sK + (stage * BN + r) * STRIDE + col), k + off, ok);
        cp_async16(smem_u32(sV + (stage * BN + r) * STRIDE + col), v + off, ok);
      }
    }
  };
  // fp8: the codes of stage `stage` into the T tiles (after a barrier that ends the last tile's reads)
  auto decode_kv = [&](int stage) {
#pragma unroll 1
    for (int c = tid; c < BN * CHUNKS; c += THREADS) {
      const int r = c / CHUNKS, col = (c % CHUNKS) * 8, raw = (stage * BN + r) * D + col;
      Chunk::decode(*reinterpret_cast<const typename Chunk::Raw*>(rawK + raw)).store(sK + r * STRIDE + col);
      Chunk::decode(*reinterpret_cast<const typename Chunk::Raw*>(rawV + raw)).store(sV + r * STRIDE + col);
    }
  };
  load_kv(0, 0);
  cp_async_commit();

  unsigned qf[MT][Q_IN_REGS ? KS : 1][4];
  float o[MT][4 * DT];
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 4 * DT; ++i) o[mt][i] = 0.0f;
    row_max[mt][0] = row_max[mt][1] = Max::identity();
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }
  const int warp_row0 = m0 + warp * MT * 16;  // first query row (in the chunk) of this warp

  for (int j = 0; j < t.n_tiles; ++j) {
    const int stage = j & 1;
    cp_async_wait_all();
    __syncthreads();  // tile j visible to all; every warp is done with tile j - 1's stage
    if (Q_IN_REGS && j == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          const int r = warp * MT * 16 + mt * 16 + (lane % 16), col = ks * 16 + (lane / 16) * 8;
          ldmatrix_x4(qf[mt][Q_IN_REGS ? ks : 0], smem_u32(sQ + r * STRIDE + col));
        }
    }
    if (j + 1 < t.n_tiles) load_kv(j + 1, stage ^ 1);
    cp_async_commit();
    if constexpr (FP8) {
      decode_kv(stage);
      __syncthreads();  // tile j decoded
    }

    // S = Q K^T for this warp's rows and the BN keys of tile j
    float s[MT][4 * NT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4 * NT; ++i) s[mt][i] = 0.0f;
    const T* kt = sK + (FP8 ? 0 : stage * BN * STRIDE);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      unsigned a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (Q_IN_REGS) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[mt][i] = qf[mt][ks][i];
        } else {
          const int r = warp * MT * 16 + mt * 16 + (lane % 16), col = ks * 16 + (lane / 16) * 8;
          ldmatrix_x4(a[mt], smem_u32(sQ + r * STRIDE + col));
        }
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        unsigned b[4];
        const int key = np * 16 + (lane % 8) + 8 * (lane / 16), col = ks * 16 + 8 * ((lane / 8) % 2);
        ldmatrix_x4(b, smem_u32(kt + key * STRIDE + col));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(&s[mt][8 * np], a[mt], b[0], b[1]);
          mma16816<T>(&s[mt][8 * np + 4], a[mt], b[2], b[3]);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float alpha[2];
      online_softmax<NT>(s[mt], row_max[mt], row_sum[mt], alpha, (t.tile0 + j) * BN, warp_row0 + mt * 16, t,
                         causal, scale_log2, lane);
      rescale<DT>(o[mt], alpha);
    }

    // O += P V
    const T* vt = sV + (FP8 ? 0 : stage * BN * STRIDE);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      unsigned pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) p_fragment<T>(s[mt], kk, pa[mt]);
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        unsigned b[4];
        const int key = kk * 16 + (lane % 8) + 8 * ((lane / 8) % 2), col = dp * 16 + 8 * (lane / 16);
        ldmatrix_x4_trans(b, smem_u32(vt + key * STRIDE + col));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(&o[mt][8 * dp], pa[mt], b[0], b[1]);
          mma16816<T>(&o[mt][8 * dp + 4], pa[mt], b[2], b[3]);
        }
      }
    }
  }

  // normalise, stage this warp's rows in its own part of sQ, store 16-byte rows
  cp_async_wait_all();  // no copy is left in flight (n_tiles 0: tile 0's K / V)
  __syncwarp();         // this warp's last ldmatrix reads of its sQ rows precede the writes below
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float inv[2];
    row_inverse(row_sum[mt], inv);
    const int r = warp * MT * 16 + mt * 16 + lane / 4;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      const int col = dt * 8 + 2 * (lane % 4);
      *reinterpret_cast<unsigned*>(sQ + r * STRIDE + col) = pack2<T>(o[mt][4 * dt] * inv[0], o[mt][4 * dt + 1] * inv[0]);
      *reinterpret_cast<unsigned*>(sQ + (r + 8) * STRIDE + col) =
          pack2<T>(o[mt][4 * dt + 2] * inv[1], o[mt][4 * dt + 3] * inv[1]);
    }
  }
  __syncwarp();
  for (int c = lane; c < MT * 16 * CHUNKS; c += 32) {
    const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
    const int row = warp_row0 + r;
    if (row < t.q_len)
      Vec<T, 8>::load(sQ + (warp * MT * 16 + r) * STRIDE + col)
          .store(out + ((size_t)(t.q_start + row) * n_heads + head) * D + col);
  }
}

#include "flash_attention_wgmma.cuh"

// grid: (min(work items, SMs)), work items ceil(max_q_len / (64 * WG)) * n_heads * num_seqs (m_blocks
//   = the first factor) · block: 128 * (WG + 1) · smem: (64 * WG + 6 * BN) * D * sizeof(T) + 1024
//   (alignment) + 128 (barriers)
// Arguments, layouts and results as flash_attention_kernel (K/V by cp.async: any power-of-two page).
template <typename T, int D, int BN, int WG, bool PAGED>
__global__ void __launch_bounds__(128 * (WG + 1), 1) flash_attention_wgmma_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ context_lens,
    const int* __restrict__ block_tables, int max_blocks, int block_shift, int n_heads,
    int n_kv_heads, float scale_log2, int causal, int window, float cap_in, float cap_out, int num_seqs,
    int m_blocks) {
  flash_attention_wgmma<T, D, BN, WG, PAGED, false>(q, k, v, out, cu_seqlens_q, context_lens, block_tables,
                                                   max_blocks, block_shift, n_heads, n_kv_heads, scale_log2,
                                                   causal, window, cap_in, cap_out, num_seqs, m_blocks, nullptr,
                                                   nullptr, nullptr);
}

// As flash_attention_wgmma_kernel, K/V loaded by TMA through tensor maps (runtime.tensor_map): q [tokens,
// n_heads, D] in boxes [64 * WG][1][64]; contiguous k, v [tokens, n_kv_heads, D] in [BN][1][64], paged k, v
// [num_blocks, block_size, n_kv_heads, D] in pages [1][block_size][1][64] (block_size >= 8, dividing BN).
template <typename T, int D, int BN, int WG, bool PAGED>
__global__ void __launch_bounds__(128 * (WG + 1), 1) flash_attention_tma_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ context_lens,
    const int* __restrict__ block_tables, int max_blocks, int block_shift, int n_heads,
    int n_kv_heads, float scale_log2, int causal, int window, float cap_in, float cap_out, int num_seqs,
    int m_blocks, const __grid_constant__ cuinfer::TensorMap q_map, const __grid_constant__ cuinfer::TensorMap k_map,
    const __grid_constant__ cuinfer::TensorMap v_map) {
  flash_attention_wgmma<T, D, BN, WG, PAGED, true>(q, k, v, out, cu_seqlens_q, context_lens, block_tables,
                                                  max_blocks, block_shift, n_heads, n_kv_heads, scale_log2,
                                                  causal, window, cap_in, cap_out, num_seqs, m_blocks, &q_map,
                                                  &k_map, &v_map);
}

// The pages of an fp8 cache that a block table names, decoded (exactly, KvChunk) into a pool of T:
// flash_attention_paged decodes a call's pages so that the wgmma kernels, which read T pages, serve
// an fp8 cache. grid: (ceil(page / (8 * 256)), entries) · block: 256
// k, v: [num_blocks, page] codes (page = block_size * n_kv_heads * D elements); tables: [entries];
// k_out, v_out: [entries, page] of T, entry e the decoded page tables[e].
template <typename T>
__global__ void __launch_bounds__(256) decode_pages_kernel(const __nv_fp8_e4m3* __restrict__ k,
                                                           const __nv_fp8_e4m3* __restrict__ v,
                                                           const int* __restrict__ tables, T* __restrict__ k_out,
                                                           T* __restrict__ v_out, int page) {
  cuinfer::pdl_wait();
  cuinfer::pdl_trigger();
  using Chunk = cuinfer::KvChunk<T, __nv_fp8_e4m3>;
  const size_t src = (size_t)tables[blockIdx.y] * page, dst = (size_t)blockIdx.y * page;
  for (int i = (blockIdx.x * blockDim.x + threadIdx.x) * 8; i < page; i += gridDim.x * blockDim.x * 8) {
    Chunk::decode(*reinterpret_cast<const uint2*>(k + src + i)).store(k_out + dst + i);
    Chunk::decode(*reinterpret_cast<const uint2*>(v + src + i)).store(v_out + dst + i);
  }
}
