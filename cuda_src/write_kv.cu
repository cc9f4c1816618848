// Fused RoPE (Hugging Face rotate-half) on q and k + paged KV-cache write, one CTA per token.
// Each thread rotates pairs (x[j], x[j + D/2]) in fp32 with the angle positions[t] * inv_freq[j]
// (rope_lo / rope_hi of common.cuh) and rounds once; v is copied with 16-byte vectors.
#include "common.cuh"

using namespace cuinfer;

// grid: (tokens) · block: 128 · smem: none
// q: [tokens, n_heads, head_dim], k, v: [tokens, n_kv_heads, head_dim], heads contiguous, token rows
// q_stride, k_stride, v_stride elements apart (views of one qkv row work; v's rows 16-byte aligned)
// out: [tokens, n_heads, head_dim] contiguous (may alias q when q is contiguous)
// k_cache, v_cache: [num_blocks * block_size, n_kv_heads, head_dim] viewed flat by slot
// positions, slot_mapping: [tokens] (slot < 0: skip the cache write); inv_freq: [head_dim / 2] fp32
template <typename T>
__global__ void __launch_bounds__(128) write_kv_kernel(
    const T* q, const T* __restrict__ k, const T* __restrict__ v, const int* __restrict__ positions,
    T* __restrict__ k_cache, T* __restrict__ v_cache, const int* __restrict__ slot_mapping,
    const float* __restrict__ inv_freq, T* out, int n_heads, int n_kv_heads, int head_dim, int q_stride,
    int k_stride, int v_stride) {
  pdl_wait();  // every input of this kernel may come from the previous one
  pdl_trigger();
  constexpr int N = 16 / sizeof(T);
  const int t = blockIdx.x, half = head_dim / 2;
  const float pos = static_cast<float>(positions[t]);
  const int slot = slot_mapping[t];
  const int n_rot = (slot >= 0 ? n_heads + n_kv_heads : n_heads) * half;
  for (int i = threadIdx.x; i < n_rot; i += blockDim.x) {
    const int h = i / half, j = i % half;
    float s, c;
    sincosf(pos * inv_freq[j], &s, &c);
    const T* x;
    T* y;
    if (h < n_heads) {
      x = q + (size_t)t * q_stride + (size_t)h * head_dim;
      y = out + ((size_t)t * n_heads + h) * head_dim;
    } else {
      x = k + (size_t)t * k_stride + (size_t)(h - n_heads) * head_dim;
      y = k_cache + ((size_t)slot * n_kv_heads + (h - n_heads)) * head_dim;
    }
    const float x1 = to_float(x[j]), x2 = to_float(x[j + half]);
    y[j] = from_float<T>(rope_lo(x1, x2, c, s));
    y[j + half] = from_float<T>(rope_hi(x1, x2, c, s));
  }
  if (slot < 0) return;
  const int row = n_kv_heads * head_dim;  // a multiple of N (head_dim % 8 == 0)
  for (int i = threadIdx.x * N; i < row; i += blockDim.x * N)
    Vec<T, N>::load(v + (size_t)t * v_stride + i).store(v_cache + (size_t)slot * row + i);
}
