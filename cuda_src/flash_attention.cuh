// Device helpers of the flash attention forward kernels (flash_attention.cu): the tile a CTA works
// on, its K/V chunk addresses, and the online softmax over mma.sync C fragments.
#pragma once
#include "mma.cuh"

namespace cuinfer {
namespace fa {

// A work item: the BM query rows from m0 of one head of one sequence, and its key range:
// the n_tiles key tiles from tile0 (with a sliding window the tiles wholly before the window of the
// CTA's first row are skipped: never read). cap_in > 0: scores s become cap_out * tanh(s * cap_in)
// (a softcap c: cap_in = scale / c, cap_out = c log2 e, and the kernel's scale_log2 is 1).
struct Tile {
  int m0, head, seq, q_start, q_len, kv_len, offset, kv_head, tile0, n_tiles, window;
  float cap_in, cap_out;
  bool empty;  // no query rows: nothing to compute or store
};
template <int BM, int BN, bool PAGED>
__device__ __forceinline__ Tile tile_of(int m0, int head, int seq, const int* cu_seqlens_q, const int* context_lens,
                                        int n_heads, int n_kv_heads, int causal, int window, float cap_in,
                                        float cap_out) {
  Tile t;
  t.cap_in = cap_in;
  t.cap_out = cap_out;
  t.m0 = m0;
  t.head = head;
  t.seq = seq;
  t.q_start = cu_seqlens_q[seq];
  t.q_len = cu_seqlens_q[seq + 1] - t.q_start;
  t.empty = t.m0 >= t.q_len;
  t.kv_len = PAGED ? context_lens[seq] : t.q_len;
  t.offset = t.kv_len - t.q_len;  // query i sees keys <= i + offset
  t.kv_head = head / (n_heads / n_kv_heads);
  const int n_end = causal ? min(t.kv_len, t.m0 + BM + t.offset) : t.kv_len;
  t.window = causal ? window : 0;  // query i sees keys > i + offset - window (0: no window)
  t.tile0 = t.window > 0 ? max(0, t.m0 + t.offset - t.window + 1) / BN : 0;
  t.n_tiles = max(0, (n_end + BN - 1) / BN - t.tile0);
  return t;
}

// Element offset of the 16-byte chunk `col` (elements) of key `key` of this CTA's KV head; false
// past the keys (the chunk is then zero-filled).
template <int D, bool PAGED>
__device__ __forceinline__ bool kv_chunk(const Tile& t, int key, int col, const int* table, int block_shift,
                                         int n_kv_heads, size_t& off) {
  const bool ok = key < t.kv_len;
  size_t row = 0;
  if (ok) {
    if constexpr (PAGED) row = ((size_t)table[key >> block_shift] << block_shift) + (key & ((1 << block_shift) - 1));
    else row = (size_t)t.q_start + key;
  }
  off = (row * n_kv_heads + t.kv_head) * D + col;
  return ok;
}

// One m16 row tile of S (NT n8 tiles, mma.sync C layout: s[4 nt + 2 h + e] is row lane/4 + 8 h, key
// n0 + 8 nt + 2 (lane % 4) + e) through the online softmax: caps the scores (t.cap_in > 0), masks keys
// past the sequence or (causal) past each query's limit or before its window, updates the running max and this thread's part of the row sums, leaves p
// in s and in alpha the factor by which O must be rescaled (rescale()). qrow0: the tile's first query
// row in the chunk.
template <int NT>
__device__ __forceinline__ void online_softmax(float (&s)[4 * NT], float (&row_max)[2], float (&row_sum)[2],
                                               float (&alpha)[2], int n0, int qrow0, const Tile& t, int causal,
                                               float scale_log2, int lane) {
  if (t.cap_in > 0.0f) {
#pragma unroll
    for (int i = 0; i < 4 * NT; ++i) s[i] = t.cap_out * tanhf(s[i] * t.cap_in);
  }
  const bool masked = n0 + 8 * NT > t.kv_len || (causal && n0 + 8 * NT - 1 > qrow0 + t.offset) ||
                      (t.window > 0 && n0 <= qrow0 + 15 + t.offset - t.window);
  if (masked) {  // tiles at the sequence end, across the diagonal or the window's start only
    // row h sees keys lo[h] .. hi[h], counted from this lane's first key: element i's key is
    // base + (i / 4) * 8 + i % 2, a compile-time offset, so each element costs a compare and a select
    const int base = n0 + 2 * (lane % 4);
    int hi[2], lo[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int qrow = qrow0 + lane / 4 + 8 * h;
      hi[h] = (causal ? min(t.kv_len - 1, qrow + t.offset) : t.kv_len - 1) - base;
      lo[h] = qrow + t.offset - t.window + 1 - base;
    }
    if (t.window > 0) {
#pragma unroll
      for (int i = 0; i < 4 * NT; ++i) {
        const int c = (i / 4) * 8 + i % 2, h = (i / 2) % 2;
        if (c > hi[h] || c < lo[h]) s[i] = Max::identity();
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4 * NT; ++i)
        if ((i / 4) * 8 + i % 2 > hi[(i / 2) % 2]) s[i] = Max::identity();
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // raw (unscaled) row max: a tree over the n8 tiles, not a chain of 2 NT dependent steps
    float m[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) m[nt] = fmaxf(s[4 * nt + 2 * h], s[4 * nt + 2 * h + 1]);
#pragma unroll
    for (int w = 1; w < NT; w *= 2)
#pragma unroll
      for (int nt = 0; nt + w < NT; nt += 2 * w) m[nt] = fmaxf(m[nt], m[nt + w]);
    float mx = fmaxf(row_max[h], m[0]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_scaled = mx == Max::identity() ? 0.0f : mx * scale_log2;  // 0: no visible key yet
    alpha[h] = exp2_ftz(fmaf(row_max[h], scale_log2, -m_scaled));
    row_max[h] = mx;
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // four independent sum chains
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = exp2_ftz(fmaf(s[4 * nt + 2 * h + e], scale_log2, -m_scaled));
        s[4 * nt + 2 * h + e] = p;
        part[(2 * nt + e) % 4] += p;
      }
    const float sum = (part[0] + part[1]) + (part[2] + part[3]);
    row_sum[h] = row_sum[h] * alpha[h] + sum;  // this thread's part of the row; quad-summed at the end
  }
}

// O (DT n8 tiles, the same rows as S) times online_softmax's alpha.
template <int DT> __device__ __forceinline__ void rescale(float (&o)[4 * DT], const float (&alpha)[2]) {
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[4 * dt + e] *= alpha[e / 2];
}

// The A fragment of k16 step kk of P V: the accumulators of n8 tiles 2kk and 2kk + 1, rounded to T.
template <typename T, int N>
__device__ __forceinline__ void p_fragment(const float (&s)[N], int kk, unsigned (&a)[4]) {
  a[0] = pack2<T>(s[8 * kk], s[8 * kk + 1]);
  a[1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
  a[2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
  a[3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
}

// 1 / (row sum) of rows lane/4 and lane/4 + 8 (0 for a row that saw no key).
__device__ __forceinline__ void row_inverse(const float (&row_sum)[2], float (&inv)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = row_sum[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[h] = l > 0.0f ? 1.0f / l : 0.0f;
  }
}

// A 4 x 4 transpose over the lanes of a quad (q = lane % 4): lane q's a[i] becomes lane i's a[q] (two
// butterfly rounds of two shuffles each).
__device__ __forceinline__ void quad_transpose(unsigned (&a)[4], int q) {
#pragma unroll
  for (int bit = 1; bit <= 2; bit *= 2) {  // round 1: pairs (0, 1), (2, 3); round 2: (0, 2), (1, 3)
    const bool upper = q & bit;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (i & bit) continue;
      const unsigned got = __shfl_xor_sync(0xffffffffu, upper ? a[i] : a[i + bit], bit);
      if (upper) a[i] = got;
      else a[i + bit] = got;
    }
  }
}

}  // namespace fa
}  // namespace cuinfer
