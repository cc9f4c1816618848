// RMSNorm over the last axis, optionally fused with the residual add that precedes or follows it.
//   ADD 0 (plain):  out = w * round(x * rsqrt(mean(x^2) + eps))
//   ADD 1 (before): s = round(x + residual) -> residual_out;  out = w * round(s * rsqrt(mean(s^2) + eps))
//   ADD 2 (after):  out = round(residual + round(w * round(x * rsqrt(mean(x^2) + eps))))  (Gemma's norms
//                   on the attention and MLP outputs, before their residual adds)
// round() is to the storage dtype T (Hugging Face LlamaRMSNorm: normalize in fp32, cast to the
// input dtype, multiply by the weight); the product w * n is taken in fp32 and rounded once.
// A row is read from global memory once: each thread keeps up to ITEMS 16-byte vectors of it in
// registers (raw T, 4 registers per vector); a row longer than blockDim * ITEMS vectors streams
// the rest twice (the second read mostly from L2).
#include "common.cuh"

using namespace cuinfer;

template <typename T, int VEC, int ADD>
__device__ __forceinline__ Vec<T, VEC> rms_norm_load(const T* x, const T* residual, T* residual_out,
                                                     long long off, float& sum_sq) {
  Vec<T, VEC> v = Vec<T, VEC>::load(x + off);
  if constexpr (ADD == 1) {
    const Vec<T, VEC> r = Vec<T, VEC>::load(residual + off);
#pragma unroll
    for (int e = 0; e < VEC; ++e) v.v[e] = from_float<T>(to_float(v.v[e]) + to_float(r.v[e]));
    v.store(residual_out + off);  // the new residual stream, in T
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float f = to_float(v.v[e]);
    sum_sq += f * f;
  }
  return v;
}

template <typename T, int VEC, int ADD>
__device__ __forceinline__ void rms_norm_store(const Vec<T, VEC>& v, const T* weight, const T* residual, T* out,
                                               long long off, int col, float inv_rms) {
  const Vec<T, VEC> w = Vec<T, VEC>::load(weight + col);
  Vec<T, VEC> o;
#pragma unroll
  for (int e = 0; e < VEC; ++e) o.v[e] = rms_normed(v.v[e], w.v[e], inv_rms);
  if constexpr (ADD == 2) {
    const Vec<T, VEC> r = Vec<T, VEC>::load(residual + off);
#pragma unroll
    for (int e = 0; e < VEC; ++e) o.v[e] = from_float<T>(to_float(r.v[e]) + to_float(o.v[e]));
  }
  o.store(out + off);
}

// grid: (rows) · block: 32..512, a multiple of 32 · smem: 32 floats
// x, out, residual, residual_out, weight: [rows, hidden] ([hidden] for weight) row-major,
// hidden % VEC == 0, pointers aligned to VEC * sizeof(T). residual_out may alias residual and
// out may alias x or (ADD 2) residual (each element is read before the same thread writes it).
template <typename T, int VEC, int ITEMS, int ADD>
__global__ void __launch_bounds__(512)
rms_norm_kernel(const T* x, const T* residual, const T* __restrict__ weight, T* out,
                T* residual_out, int hidden, float eps) {
  pdl_wait();  // every input of this kernel may come from the previous one
  pdl_trigger();
  __shared__ float scratch[32];
  const int n_vec = hidden / VEC;
  const long long base = static_cast<long long>(blockIdx.x) * hidden;
  Vec<T, VEC> cache[ITEMS];
  float sum_sq = 0.0f;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < n_vec)
      cache[j] = rms_norm_load<T, VEC, ADD>(x, residual, residual_out, base + i * VEC, sum_sq);
  }
  for (int i = threadIdx.x + ITEMS * blockDim.x; i < n_vec; i += blockDim.x)
    rms_norm_load<T, VEC, ADD>(x, residual, residual_out, base + i * VEC, sum_sq);
  sum_sq = block_reduce(sum_sq, scratch);
  const float inv_rms = rms_inv(sum_sq, hidden, eps);

#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < n_vec) rms_norm_store<T, VEC, ADD>(cache[j], weight, residual, out, base + i * VEC, i * VEC, inv_rms);
  }
  const T* src = ADD == 1 ? residual_out : x;  // the rounded sum was written in the first pass
  for (int i = threadIdx.x + ITEMS * blockDim.x; i < n_vec; i += blockDim.x)
    rms_norm_store<T, VEC, ADD>(Vec<T, VEC>::load(src + base + i * VEC), weight, residual, out, base + i * VEC,
                                i * VEC, inv_rms);
}
