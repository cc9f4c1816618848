// Fused RoPE (Hugging Face rotate-half) on q and k + paged KV-cache write. A CTA handles HEADS (4)
// heads of one token: blockIdx.y = g rotates q/k heads 4g..4g+3 (q heads first, then k heads) and
// copies v heads 4g..4g+3: a decode step's few tokens spread their heads over many SMs.
// Each thread rotates pairs (x[j], x[j + D/2]) in fp32 with the angle positions[t] * inv_freq[j]
// (rope_lo / rope_hi of common.cuh) and rounds once; v is copied with 16-byte vectors. An fp8 cache
// (C = __nv_fp8_e4m3) gets k and v rounded to T first, then encoded (KvChunk, to_cache).
// NORM (Qwen3, Gemma 3): each q and k head is first RMS-normed over head_dim with its weight
// (q_norm or k_norm), rounded as rms_norm.cu rounds (normalize in fp32, round to T, times the weight
// in fp32, round to T), then rotated: one warp per head, the sum of squares a warp reduction in the
// order the fused decode attention sums a head (paged_attention.cu, rope_chunk): lane c the squares of
// elements 8c .. 8c + 7 in turn, then the butterfly, so that the two agree bit for bit.
// inv_freq is one row [D/2] for every token (freq_stride 0) or one row per token (freq_stride
// D/2: Phi-3's longrope picks short or long factors per sequence).
#include "common.cuh"

using namespace cuinfer;

// One head's rotate-half into y (T, or a cache row of C: rounded to T, then encoded), pairs
// j = j0, j0 + stride, ... < half; with a norm, x normed first.
template <typename T, typename Y, bool NORM>
__device__ __forceinline__ void rope_head(const T* x, Y* y, const float* __restrict__ inv_freq, float pos,
                                          int half, int j0, int stride, const T* __restrict__ w, float inv_rms) {
  for (int j = j0; j < half; j += stride) {
    float s, c;
    sincosf(pos * inv_freq[j], &s, &c);
    float x1, x2;
    if constexpr (NORM) {
      x1 = to_float(rms_normed(x[j], w[j], inv_rms));
      x2 = to_float(rms_normed(x[j + half], w[j + half], inv_rms));
    } else {
      x1 = to_float(x[j]);
      x2 = to_float(x[j + half]);
    }
    y[j] = to_cache<T, Y>(from_float<T>(rope_lo(x1, x2, c, s)));
    y[j + half] = to_cache<T, Y>(from_float<T>(rope_hi(x1, x2, c, s)));
  }
}

// grid: (tokens, ceil((n_heads + n_kv_heads) / HEADS)) · block: 32 * HEADS · smem: none
// q: [tokens, n_heads, head_dim], k, v: [tokens, n_kv_heads, head_dim], rows q_stride / k_stride /
// v_stride elements apart (views of one qkv row), heads contiguous; out: q's shape, packed (may alias
// q when q is packed)
// k_cache, v_cache: [num_blocks * block_size, n_kv_heads, head_dim] viewed flat by slot, elements of C
// (T, or fp8 E4M3: common.cuh's KvChunk)
// positions, slot_mapping: [tokens] (slot < 0: skip the cache write); inv_freq: fp32 [head_dim / 2]
// (freq_stride 0) or [tokens, head_dim / 2] (freq_stride head_dim / 2); q_norm, k_norm: [head_dim]
// (NORM only, else unused)
constexpr int HEADS = 4;  // heads a CTA handles: a warp each with NORM

template <typename T, typename C, bool NORM>
__global__ void __launch_bounds__(32 * HEADS) write_kv_kernel(
    const T* q, const T* __restrict__ k, const T* __restrict__ v, const int* __restrict__ positions,
    C* __restrict__ k_cache, C* __restrict__ v_cache, const int* __restrict__ slot_mapping,
    const float* __restrict__ inv_freq, T* out, int n_heads, int n_kv_heads, int head_dim, int freq_stride,
    const T* __restrict__ q_norm, const T* __restrict__ k_norm, float eps, long long q_stride, long long k_stride,
    long long v_stride) {
  pdl_wait();  // every input of this kernel may come from the previous one
  pdl_trigger();
  constexpr int N = 16 / sizeof(T);
  const long long t = blockIdx.x;
  const int half = head_dim / 2;
  const float pos = static_cast<float>(positions[t]);
  const int slot = slot_mapping[t];
  const int n_rot_heads = slot >= 0 ? n_heads + n_kv_heads : n_heads;
  const float* freq = inv_freq + (size_t)t * freq_stride;
  // head h: q head h into out (h < n_heads), else k head h - n_heads into the token's cache row
  auto source = [&](int h) {
    return h < n_heads ? q + t * q_stride + (size_t)h * head_dim : k + t * k_stride + (size_t)(h - n_heads) * head_dim;
  };
  auto rotate = [&](int h, int j0, int stride, const T* w, float inv_rms) {
    if (h < n_heads)
      rope_head<T, T, NORM>(source(h), out + ((size_t)t * n_heads + h) * head_dim, freq, pos, half, j0, stride, w,
                            inv_rms);
    else
      rope_head<T, C, NORM>(source(h), k_cache + ((size_t)slot * n_kv_heads + (h - n_heads)) * head_dim, freq, pos,
                            half, j0, stride, w, inv_rms);
  };
  const int h0 = blockIdx.y * HEADS, h1 = min(h0 + HEADS, n_rot_heads);
  if constexpr (NORM) {  // a warp per head: its sum of squares, then its pairs
    const int lane = threadIdx.x & 31, h = h0 + (threadIdx.x >> 5);
    if (h < h1) {
      const T* x = source(h);
      float sum_sq = 0.0f;  // rope_chunk's order: lane c sums chunk c (8 elements), then the butterfly
      for (int c = lane; c < head_dim / 8; c += 32) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float f = to_float(x[c * 8 + e]);
          sum_sq = __fmaf_rn(f, f, sum_sq);
        }
      }
      const float inv_rms = rms_inv(warp_reduce(sum_sq), head_dim, eps);
      __syncwarp();  // every lane has read x before any writes y (out may alias q)
      rotate(h, lane, 32, h < n_heads ? q_norm : k_norm, inv_rms);
    }
  } else {
    for (int i = threadIdx.x; i < (h1 - h0) * half; i += blockDim.x) rotate(h0 + i / half, i % half, half, nullptr, 0.0f);
  }
  if (slot < 0) return;
  const int row = n_kv_heads * head_dim;  // a multiple of 8 (head_dim % 8 == 0)
  const int v0 = h0 * head_dim, v1 = min(v0 + HEADS * head_dim, row);  // v heads h0..h0 + 3
  if constexpr (sizeof(C) == sizeof(T)) {
    for (int i = v0 + threadIdx.x * N; i < v1; i += blockDim.x * N)
      Vec<T, N>::load(v + t * v_stride + i).store(v_cache + (size_t)slot * row + i);
  } else {
    using Chunk = KvChunk<T, C>;
    for (int i = v0 + threadIdx.x * 8; i < v1; i += blockDim.x * 8)
      *reinterpret_cast<typename Chunk::Raw*>(v_cache + (size_t)slot * row + i) =
          Chunk::encode(Vec<T, 8>::load(v + t * v_stride + i));
  }
}
