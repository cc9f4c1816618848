// The wgmma forward of flash_attention.cu (included there ahead of its two entry points).
#pragma once

#include "flash_attention.cuh"

// The warp-specialized wgmma forward (sm_90a; D % 64 == 0), behind two entry points that differ in how
// K/V tiles arrive. flash_attention_tma_kernel: one producer warp issues TMA boxes (contiguous K/V, or one
// box a page of a paged cache) that complete on the tile's full mbarrier by byte count; a last tile that
// runs past the context lands on landed[] instead, and the warp zeroes its V rows past the end (an
// unwritten slot may hold NaN, and 0 * NaN poisons P V) before arriving on full. flash_attention_wgmma_
// kernel (pages under 8 rows): the producer's two halves take alternate tiles, copy them with cp.async
// (zero fill past the context), wait for their own copies, fence the proxy and arrive on full.
// Block: 128 * (WG + 1) threads: warpgroup 0 loads, warpgroups 1..WG (WG <= 2) compute 64 query rows
// each. Shared memory, 128-byte swizzled: Q [D/64][64 * WG][64] and a ring of 3 tiles, K [3][D/64][BN][64]
// and V [3][D/64][BN][64], then mbarriers full[3], empty[3], landed[3], q_full and q_free; every consumer
// warp arrives on empty once done with a tile, and on q_free once its last S = Q K^T of a work item is
// done. Persistent: a CTA runs work items blockIdx.x, + gridDim.x, ... (work_item), the ring's tiles
// counted across them, so the producer loads the next item's K/V while the consumers finish this one,
// and its Q (on q_full) as soon as they have freed sQ; the consumers store O from registers. A single
// thread group waits on q_free, one phase after another (the TMA warp, the cp.async producer's half 0):
// a parity wait cannot tell a phase from the one two later.
// Consumer iteration j issues S_{j+1} = Q K_{j+1}^T and O += P_j V_j back to back and runs the softmax
// of S_{j+1} under P_j V_j. Two consumer warpgroups take turns to issue (named barriers, "pingpong"),
// so one's softmax runs while the tensor cores multiply for the other.
template <typename T, int D, int BN, int WG, bool PAGED, bool TMA>
__device__ __forceinline__ void flash_attention_wgmma(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ context_lens,
    const int* __restrict__ block_tables, int max_blocks, int block_shift, int n_heads, int n_kv_heads,
    float scale_log2, int causal, int window, float cap_in, float cap_out, int num_seqs, int m_blocks,
    const cuinfer::TensorMap* q_map, const cuinfer::TensorMap* k_map,
    const cuinfer::TensorMap* v_map) {  // the kernel parameters themselves, when TMA
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  cuinfer::pdl_wait();  // every input of this kernel may come from the previous one
  cuinfer::pdl_trigger();
  using namespace cuinfer;
  using namespace cuinfer::fa;
  constexpr int BM = 64 * WG, STAGES = 3, CHUNKS = D / 8, RSTEP = 64 / CHUNKS;
  constexpr unsigned Q_BLOCK = BM * 128, KV_BLOCK = BN * 128, KV_STAGE = BN * D * 2;  // bytes
  static_assert(D % 64 == 0 && BN % 16 == 0 && sizeof(T) == 2, "D: multiple of 64; BN: of 16; T: 16-bit");
  static_assert(WG == 1 || WG == 2, "one or two consumer warpgroups");
  static_assert(64 % CHUNKS == 0 && BN % RSTEP == 0, "a producer half copies whole rows");

  // Work item w: the query heads of one KV head fastest, then query blocks from the last (the heaviest
  // causal blocks first), then KV heads, then sequences, so that the CTAs running at once read the K/V
  // of one or a few KV heads (L2 holds them); producer and consumers walk the same items and agree on
  // each one's tiles.
  const int group = n_heads / n_kv_heads, per_kv = group * m_blocks, per_seq = per_kv * n_kv_heads;
  const int n_work = per_seq * num_seqs;
  auto work_item = [&](int w) {
    const int rest = w % per_seq, in_kv = rest % per_kv;
    return tile_of<BM, BN, PAGED>((m_blocks - 1 - in_kv / group) * BM, rest / per_kv * group + in_kv % group,
                                  w / per_seq, cu_seqlens_q, context_lens, n_heads, n_kv_heads, causal, window, cap_in,
                                  cap_out);
  };

  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = smem_u32(smem_raw), sQ = (raw + 1023) & ~1023u;  // swizzle atoms: 1024-aligned
  const unsigned sK = sQ + BM * D * 2, sV = sK + STAGES * KV_STAGE, bars = sV + STAGES * KV_STAGE;
  // ring barriers of the it-th tile a CTA loads (counted over all its work items)
  auto full = [&](int it) { return bars + 8 * (it % STAGES); };
  auto empty = [&](int it) { return bars + 8 * (STAGES + it % STAGES); };
  auto landed = [&](int it) { return bars + 8 * (2 * STAGES + it % STAGES); };  // paged TMA: an item's last tile
  const unsigned q_full = bars + 8 * 3 * STAGES, q_free = q_full + 8;
  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32;
  auto at = [](unsigned tile, unsigned block_bytes, int r, int c) {  // chunk c of row r of a tile
    return tile + (c / 8) * block_bytes + wgmma::swizzle128(r, c % 8);
  };
  if (tid == 0) {
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(full(i), TMA ? 1 : 64);
      mbar_init(empty(i), 4 * WG);
      mbar_init(landed(i), 1);
    }
    mbar_init(q_full, TMA ? 1 : 64);
    mbar_init(q_free, 4 * WG);
  }
  __syncthreads();  // barriers initialised; the only CTA-wide barrier

  if (wg == 0 && TMA) {  // producer: one warp, an item's Q after its tile 0 (BN / block_size <= 32 pages a tile)
    if constexpr (WG > 1) regs_dec<40>();
    if (tid < 32) {
      const int block_size = 1 << block_shift;
      int it = 0, items = 0;
      unsigned landed_parity = 0;  // bit s: the parity of landed[s]'s next phase
      for (int w = blockIdx.x; w < n_work; w += gridDim.x) {
        const Tile t = work_item(w);
        if (t.empty || t.n_tiles == 0) continue;
        const int* table = PAGED ? block_tables + (size_t)t.seq * max_blocks : nullptr;
        for (int tile = 0; tile < t.n_tiles; ++tile, ++it) {
          const int s = it % STAGES, key0 = (t.tile0 + tile) * BN;
          // paged: the pages holding keys of the context (none past its last block); the last tile, when
          // it runs past the context, completes on landed[s] so that its V rows past the end can be zeroed
          const int pages = PAGED ? min(BN, t.kv_len - key0 + block_size - 1) >> block_shift : 0;
          const bool fix = PAGED && key0 + BN > t.kv_len;
          const unsigned bar = fix ? landed(it) : full(it);
          // paged: lane i reads the tile's i-th block-table entry (all in one round trip) and copies that page
          const int blk = PAGED && lane < pages ? table[(key0 >> block_shift) + lane] : 0;
          if (it >= STAGES) mbar_wait(empty(it), (it / STAGES - 1) & 1);
          if (lane == 0) {
            const unsigned kv_bytes = PAGED ? 2 * pages * block_size * 128 * (D / 64) : 2 * KV_STAGE;
            mbar_expect_tx(bar, kv_bytes);
            if (!PAGED)
              for (int b = 0; b < D / 64; ++b) {
                const unsigned off = s * KV_STAGE + b * KV_BLOCK;
                tma_load_3d(sK + off, k_map, 64 * b, t.kv_head, t.q_start + key0, bar);
                tma_load_3d(sV + off, v_map, 64 * b, t.kv_head, t.q_start + key0, bar);
              }
          }
          if constexpr (PAGED) {
            __syncwarp();  // the expected bytes are armed before any page lands
            if (lane < pages)
              for (int b = 0; b < D / 64; ++b) {
                const unsigned off = s * KV_STAGE + b * KV_BLOCK + lane * block_size * 128;
                tma_load_4d(sK + off, k_map, 64 * b, t.kv_head, 0, blk, bar);
                tma_load_4d(sV + off, v_map, 64 * b, t.kv_head, 0, blk, bar);
              }
          }
          if (tile == 0) {  // Q once the consumers are done with the previous item's
            if (items > 0) mbar_wait(q_free, (items - 1) & 1);
            if (lane == 0) {
              mbar_expect_tx(q_full, BM * D * 2);
              for (int b = 0; b < D / 64; ++b)
                tma_load_3d(sQ + b * Q_BLOCK, q_map, 64 * b, t.head, t.q_start + t.m0, q_full);
            }
          }
          if (fix) {  // zero the V rows past the context (an unwritten slot may hold NaN; P is 0 there)
            mbar_wait(bar, (landed_parity >> s) & 1);
            landed_parity ^= 1u << s;
            unsigned char* gv = smem_raw + (sV - raw) + s * KV_STAGE;
            for (int c = lane; c < BN * 8 * (D / 64); c += 32) {
              const int b = c / (BN * 8), r = (c / 8) % BN;  // 16-byte chunk c % 8 of row r, column block b
              if (r >= t.kv_len - key0)
                *reinterpret_cast<uint4*>(gv + b * KV_BLOCK + r * 128 + (c % 8) * 16) = uint4{};
            }
            wgmma::fence_proxy_async();
            __syncwarp();
            if (lane == 0) mbar_arrive(full(it));
          }
        }
        ++items;
      }
    }
    return;
  }
  if (wg == 0) {  // producer: two halves of 64 threads take alternate tiles; half 0 loads each item's Q first
    if constexpr (WG > 1) regs_dec<40>();
    const int half = tid / 64, pt = tid % 64;
    const int ch = pt % CHUNKS, r0 = pt / CHUNKS;  // chunk ch of rows r0, r0 + RSTEP, ...
    int it = 0, items = 0;
    for (int w = blockIdx.x; w < n_work; w += gridDim.x) {
      const Tile t = work_item(w);
      if (t.empty || t.n_tiles == 0) continue;
      const int* table = PAGED ? block_tables + (size_t)t.seq * max_blocks : nullptr;
      if (half == 0) {
        if (items > 0) mbar_wait(q_free, (items - 1) & 1);
        for (int c = pt; c < BM * CHUNKS; c += 64) {
          const int r = c / CHUNKS, qc = c % CHUNKS;
          const bool ok = t.m0 + r < t.q_len;
          const T* src = q + ((size_t)(t.q_start + (ok ? t.m0 + r : 0)) * n_heads + t.head) * D + qc * 8;
          cp_async16(at(sQ, Q_BLOCK, r, qc), src, ok);
        }
        cp_async_commit();
        cp_async_wait_all();
        wgmma::fence_proxy_async();
        mbar_arrive(q_full);
      }
      for (int tile = 0; tile < t.n_tiles; ++tile, ++it) {
        if (it % 2 != half) continue;
        if (it >= STAGES) mbar_wait(empty(it), (it / STAGES - 1) & 1);
        const unsigned ks = sK + (it % STAGES) * KV_STAGE, vs = sV + (it % STAGES) * KV_STAGE;
#pragma unroll 4
        for (int i = 0; i < BN / RSTEP; ++i) {
          const int r = r0 + i * RSTEP;
          size_t off;
          const bool ok = kv_chunk<D, PAGED>(t, (t.tile0 + tile) * BN + r, ch * 8, table, block_shift, n_kv_heads, off);
          cp_async16(at(ks, KV_BLOCK, r, ch), k + off, ok);
          cp_async16(at(vs, KV_BLOCK, r, ch), v + off, ok);
        }
        cp_async_commit();
        cp_async_wait_all();         // this half's copies of the tile have landed
        wgmma::fence_proxy_async();  // visible to the tensor cores
        mbar_arrive(full(it));
      }
      ++items;
    }
    return;
  }

  if constexpr (WG > 1) regs_inc<232>();
  const int cw = wg - 1, warp = (tid / 32) % 4;
  const unsigned q_rows = sQ + cw * 64 * 128;  // this warpgroup's 64 rows of each Q column block
  // Turns: warpgroup cw issues after the other's previous issue (barrier 1 + cw), then lets it go; from
  // one work item to the next too, so that warpgroup 0 starts the next item while warpgroup 1 finishes
  // this one. Warpgroup 1 lets warpgroup 0 take the first turn, and warpgroup 0 takes up its last leave.
  auto turn_begin = [&]() { if constexpr (WG > 1) named_sync(1 + cw, 256); };
  auto turn_end = [&]() { if constexpr (WG > 1) named_arrive(2 - cw, 256); };
  if (WG > 1 && cw == 1) named_arrive(1, 256);
  float s[BN / 2], alpha[2], o[D / 2];
  auto issue_s = [&](int it) {  // S = Q K^T of ring tile it: 64 rows x BN keys, D / 16 k-steps
    const unsigned kt = sK + (it % STAGES) * KV_STAGE;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      wgmma::mma_ss<BN, T>(s, wgmma::desc128(q_rows + (ks / 4) * Q_BLOCK + (ks % 4) * 32, 16, 1024),
                           wgmma::desc128(kt + (ks / 4) * KV_BLOCK + (ks % 4) * 32, 16, 1024), ks);
    wgmma::commit();
  };
  auto issue_pv = [&](const unsigned (&p)[BN / 16][4], int it) {  // O += P V, V as the transposed B
    const unsigned vt = sV + (it % STAGES) * KV_STAGE;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      wgmma::mma_rs<D, T>(o, p[kk], wgmma::desc128(vt + kk * 16 * 128, KV_BLOCK, 1024));
    wgmma::commit();
  };

  int it = 0, items = 0;  // the ring tile of this item's tile 0; items with tiles before this one
  for (int w = blockIdx.x; w < n_work; w += gridDim.x) {
    const Tile t = work_item(w);
    if (t.empty) continue;
    const int warp_row0 = t.m0 + cw * 64 + warp * 16;  // first query row (in the chunk) of this warp
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    float row_max[2] = {Max::identity(), Max::identity()}, row_sum[2] = {0.0f, 0.0f};
    if (t.n_tiles > 0) {
      const int n = t.n_tiles;
      mbar_wait(q_full, items & 1);
      mbar_wait(full(it), (it / STAGES) & 1);
      turn_begin();
      wgmma::fence();
      issue_s(it);
      turn_end();
      wgmma::wait<0>();
      wgmma::fence_regs(s);
      if (n == 1 && lane == 0) mbar_arrive(q_free);  // this warp's last read of sQ
      online_softmax<BN / 8>(s, row_max, row_sum, alpha, t.tile0 * BN, warp_row0, t, causal, scale_log2, lane);
      unsigned p[BN / 16][4];  // P of the tile whose P V is next
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) p_fragment<T>(s, kk, p[kk]);

      for (int j = 0; j + 1 < n; ++j) {
        mbar_wait(full(it + j + 1), ((it + j + 1) / STAGES) & 1);
        wgmma::fence_regs(o);
        turn_begin();
        wgmma::fence();
        issue_s(it + j + 1);
        issue_pv(p, it + j);
        turn_end();
        wgmma::wait<1>();  // S_{j+1} done: its softmax runs while P_j V_j is multiplied
        wgmma::fence_regs(s);
        if (j + 2 == n && lane == 0) mbar_arrive(q_free);  // S_{j+1} was the last read of Q
        online_softmax<BN / 8>(s, row_max, row_sum, alpha, (t.tile0 + j + 1) * BN, warp_row0, t, causal,
                               scale_log2, lane);
        wgmma::wait<0>();
        wgmma::fence_regs(o);
        if (lane == 0) mbar_arrive(empty(it + j));  // K_j and V_j are no longer read
        rescale<D / 8>(o, alpha);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) p_fragment<T>(s, kk, p[kk]);
      }
      wgmma::fence_regs(o);
      turn_begin();
      wgmma::fence();
      issue_pv(p, it + n - 1);
      turn_end();
      wgmma::wait<0>();
      wgmma::fence_regs(o);
      if (lane == 0) mbar_arrive(empty(it + n - 1));
      it += n;
      ++items;
    }

    // normalise and store from registers: a quad's lanes hold 8 consecutive columns of a row; after
    // quad_transpose, lane i of the quad holds all 8 of the group's i-th n8 tile, one 16-byte store
    float inv[2];
    row_inverse(row_sum, inv);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp_row0 + lane / 4 + 8 * h;
      T* dst = out + ((size_t)(t.q_start + row) * n_heads + t.head) * D;
#pragma unroll
      for (int g = 0; g < D / 32; ++g) {
        unsigned a[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = pack2<T>(o[16 * g + 4 * i + 2 * h] * inv[h], o[16 * g + 4 * i + 2 * h + 1] * inv[h]);
        quad_transpose(a, lane % 4);
        if (row < t.q_len) *reinterpret_cast<uint4*>(dst + 32 * g + 8 * (lane % 4)) = make_uint4(a[0], a[1], a[2], a[3]);
      }
    }
  }
  if (WG > 1 && cw == 0) named_sync(1, 256);
#endif
}
