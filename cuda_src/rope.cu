// Rotary position embedding, Hugging Face rotate-half convention, on q and k in one launch:
//   x_rot[i] = x[i] cos(a_i) - x[i + h] sin(a_i),  x_rot[i + h] = x[i + h] cos(a_i) + x[i] sin(a_i)
// with h = head_dim / 2 and a_i = position * inv_freq[i] rounded to fp32. cos/sin come from
// sincosf (full range reduction: positions reach 128k, where __sinf is wrong), once per
// (token, i) into shared memory; the rotation is fp32 without FMA contraction (as the NumPy
// reference computes it) and rounded once to T.
#include "common.cuh"

using namespace cuinfer;

// grid: (tokens) · block: 128 · smem: head_dim floats (cos | sin)
// q, q_out: [tokens, n_heads, head_dim]; k, k_out: [tokens, n_kv, head_dim]; positions: [tokens];
// inv_freq: float32 [head_dim / 2]; (head_dim / 2) % VEC == 0, pointers aligned to
// VEC * sizeof(T). q_out may alias q and k_out k.
template <typename T, int VEC, typename PosT>
__global__ void __launch_bounds__(128)
rope_kernel(const T* q, const T* k, const PosT* __restrict__ positions,
            const float* __restrict__ inv_freq, T* q_out, T* k_out, int n_heads, int n_kv,
            int head_dim) {
  pdl_wait();  // every input of this kernel may come from the previous one
  pdl_trigger();
  extern __shared__ float cos_sin[];  // cos_sin: [2, head_dim / 2]
  const int half = head_dim / 2;
  const long long t = blockIdx.x;
  const float pos = static_cast<float>(positions[t]);
  for (int i = threadIdx.x; i < half; i += blockDim.x)
    sincosf(pos * inv_freq[i], &cos_sin[half + i], &cos_sin[i]);
  __syncthreads();

  const int h_vec = half / VEC;
  for (int w = threadIdx.x; w < (n_heads + n_kv) * h_vec; w += blockDim.x) {
    const int head = w / h_vec, c = (w - head * h_vec) * VEC;
    const bool is_q = head < n_heads;
    const long long off = is_q ? (t * n_heads + head) * head_dim : (t * n_kv + head - n_heads) * head_dim;
    const T* src = (is_q ? q : k) + off;
    T* dst = (is_q ? q_out : k_out) + off;
    const Vec<T, VEC> a = Vec<T, VEC>::load(src + c), b = Vec<T, VEC>::load(src + half + c);
    Vec<T, VEC> ra, rb;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float x1 = to_float(a.v[e]), x2 = to_float(b.v[e]);
      const float cs = cos_sin[c + e], sn = cos_sin[half + c + e];
      ra.v[e] = from_float<T>(__fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn)));
      rb.v[e] = from_float<T>(__fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn)));
    }
    ra.store(dst + c);
    rb.store(dst + half + c);
  }
}
