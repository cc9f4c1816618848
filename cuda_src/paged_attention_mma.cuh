// The tensor-core passes of paged_attention_kernel (MMA: D a multiple of 32, at most 128), included by
// paged_attention.cu. A warp takes tiles of 16 consecutive keys (tile w, w + WARPS, ... of the split)
// and multiplies them with mma.sync m16n8k16, the group's query heads padded to the 8 columns of n:
// a tile's scores are 8 instructions at D = 128 and its values 8 more, where the lane loops' value
// pass alone is 539 SASS instructions a loop of 16 rows (docs/attention.md). Lane l = 4 g + t loads 16-byte
// chunks of K and V rows straight from the cache (no shared memory), and the chunks' order inside a
// fragment is chosen so that no lane moves data but its own:
//
// Scores, S^T (16 keys x 8 heads) = K (16 keys x D) Q^T: the lane loads chunks 4 i + t of keys g and
// g + 8; words 2 s and 2 s + 1 of chunk 4 i + t are the A fragment of k16 step 2 i + s, so the step's
// column 2 t + e is the row's element 8 (4 i + t) + 4 s + e and column 2 t + 8 + e its element
// 8 (4 i + t) + 4 s + 2 + e. The B fragment (Q^T) takes q's elements in the same order: head g's
// chunk 4 i + t, held in registers for the whole pass (mma_q). The lane ends with the scores of keys
// g and g + 8 for heads 2 t and 2 t + 1.
//
// Values, O^T (D x 8 heads) = V^T (D x 16 keys) P^T: the lane loads chunk g + 8 h of keys 2 t, 2 t + 1,
// 2 t + 8, 2 t + 9 (the A fragment's columns: keys) and pairs the four rows' words with byte
// permutes: word e of chunk c gives the m16 tile (h, e) whose row g is element 8 c + 2 e and row g + 8
// element 8 c + 2 e + 1. P^T, the B fragment, is head g's probabilities of those four keys, read from
// the scores in shared memory and rounded to T (as FlashAttention rounds P). The lane ends with
// elements 8 c + 2 e and 8 c + 2 e + 1 for heads 2 t and 2 t + 1.
#pragma once
#include "mma.cuh"

namespace {

template <int D> struct MmaTiles {
  static_assert(D % 32 == 0 && D <= 128, "the tensor-core passes take D = 32, 64, 96 or 128");
  static constexpr int NI = D / 32;            // scores: the lane's chunks 4 i + t of a key
  static constexpr int NH = (D + 63) / 64;     // values: the lane's chunks g + 8 h of a key
  static constexpr int NT = D <= 64 ? 2 : 1;   // tiles a warp loads before it uses the first (8 chunks a lane)
};

// Query head g's chunks 4 i + t (zeros for g >= group): the B fragments of the score pass.
template <typename T, int D>
__device__ __forceinline__ void mma_q(const T* q_group, int group, int lane, unsigned (&qf)[D / 32][4]) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < D / 32; ++i) {
    const uint4 w = g < group ? *reinterpret_cast<const uint4*>(q_group + g * D + (4 * i + t) * 8) : uint4{};
    qf[i][0] = w.x, qf[i][1] = w.y, qf[i][2] = w.z, qf[i][3] = w.w;
  }
}

// The words of a chunk as stored, decoded to T.
template <typename T, typename C>
__device__ __forceinline__ void chunk_words(typename KvChunk<T, C>::Raw r, unsigned (&w)[4]) {
  const Vec<T, 8> v = KvChunk<T, C>::decode(r);
  const uint4 u = *reinterpret_cast<const uint4*>(&v);
  w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
}

// The walk both passes share: a warp's tiles w, w + WARPS, ... of the split, NT at a time. For each,
// the lane loads chunks chunk_of(c) (c < CH) of its keys key_of(j) (j < KEYS, offsets in the tile)
// before it uses the first, then use(first key of the tile, its chunks [KEYS][CH]). row_of(key): the
// element offset of key's row of this KV head (clamped to the split).
template <typename T, typename C, int D, int WARPS, int KEYS, int CH, bool COHERENT, typename KeyOf, typename ChunkOf,
          typename RowOf, typename Use>
__device__ __forceinline__ void for_each_tile(int warp, int start, int end, const C* cache, KeyOf key_of,
                                              ChunkOf chunk_of, RowOf row_of, Use use) {
  constexpr int NT = MmaTiles<D>::NT;
  const int n_tiles = (end - start + 15) / 16;
  for (int tile = warp; tile < n_tiles; tile += WARPS * NT) {  // warp-uniform
    typename KvChunk<T, C>::Raw r[NT][KEYS][CH];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int j = 0; j < KEYS; ++j) {
        const C* row = cache + row_of(start + 16 * (tile + n * WARPS) + key_of(j));
#pragma unroll
        for (int c = 0; c < CH; ++c) r[n][j][c] = load_kv<COHERENT, T>(row + chunk_of(c) * 8);
      }
#pragma unroll
    for (int n = 0; n < NT; ++n) use(start + 16 * (tile + n * WARPS), r[n]);
  }
}

// Pass 1: emit(key, s0, s1) with the raw dot products of key (keys past `end` included: the caller
// drops them) with heads 2 t and 2 t + 1.
template <typename T, typename C, int D, int WARPS, bool COHERENT, typename RowOf, typename Emit>
__device__ __forceinline__ void mma_scores(const unsigned (&qf)[D / 32][4], int warp, int lane, int start, int end,
                                           const C* cache, RowOf row_of, Emit emit) {
  constexpr int NI = MmaTiles<D>::NI;
  const int g = lane / 4, t = lane % 4;
  using Raw = typename KvChunk<T, C>::Raw;
  for_each_tile<T, C, D, WARPS, 2, NI, COHERENT>(
      warp, start, end, cache, [&](int j) { return g + 8 * j; }, [&](int i) { return 4 * i + t; }, row_of,
      [&](int key0, const Raw (&r)[2][NI]) {
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < NI; ++i) {
          unsigned k0[4], k1[4];
          chunk_words<T, C>(r[0][i], k0);
          chunk_words<T, C>(r[1][i], k1);
#pragma unroll
          for (int s = 0; s < 2; ++s) {
            const unsigned a[4] = {k0[2 * s], k1[2 * s], k0[2 * s + 1], k1[2 * s + 1]};
            mma16816<T>(c, a, qf[i][2 * s], qf[i][2 * s + 1]);
          }
        }
        emit(key0 + g, c[0], c[1]);
        emit(key0 + g + 8, c[2], c[3]);
      });
}

// Pass 3: acc[h][e] += the tile (h, e) of O^T over the split's keys, p_of(key, head) the probability
// (0 past `end`; heads >= G are asked for too).
template <typename T, typename C, int D, int WARPS, bool COHERENT, typename RowOf, typename P>
__device__ __forceinline__ void mma_values(float (&acc)[MmaTiles<D>::NH][4][4], int warp, int lane, int start,
                                           int end, const C* cache, RowOf row_of, P p_of) {
  constexpr int NH = MmaTiles<D>::NH;
  const int g = lane / 4, t = lane % 4;
  using Raw = typename KvChunk<T, C>::Raw;
  for_each_tile<T, C, D, WARPS, 4, NH, COHERENT>(
      warp, start, end, cache, [&](int w) { return 2 * t + (w & 1) + 8 * (w >> 1); },
      [&](int h) { return min(g + 8 * h, D / 8 - 1); }, row_of, [&](int key0, const Raw (&r)[4][NH]) {
        const int key = key0 + 2 * t;
        const unsigned b0 = pack2<T>(p_of(key, g), p_of(key + 1, g));
        const unsigned b1 = pack2<T>(p_of(key + 8, g), p_of(key + 9, g));
#pragma unroll
        for (int h = 0; h < NH; ++h) {
          unsigned v[4][4];
#pragma unroll
          for (int w = 0; w < 4; ++w) chunk_words<T, C>(r[w][h], v[w]);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const unsigned a[4] = {__byte_perm(v[0][e], v[1][e], 0x5410), __byte_perm(v[0][e], v[1][e], 0x7632),
                                   __byte_perm(v[2][e], v[3][e], 0x5410), __byte_perm(v[2][e], v[3][e], 0x7632)};
            mma16816<T>(acc[h][e], a, b0, b1);
          }
        }
      });
}

}  // namespace
