// LayerNorm over the last axis: out = (x - mean) * rsqrt(var + eps) * w + b, in fp32, rounded
// once to T (as torch.nn.functional.layer_norm). Both statistics are taken on x - x[0] (the row's
// first element, exact when the row sits on a large offset) and in two reductions
// (var = mean((x - mean)^2), not E[x^2] - mean^2): a row like 100 + N(0, 1) keeps its digits.
// A row is read from global memory once: each thread keeps up to ITEMS 16-byte vectors of it in
// registers; a longer row streams the rest three times (the later reads mostly from L2).
#include "common.cuh"

using namespace cuinfer;

// grid: (rows) · block: 32..512, a multiple of 32 · smem: 32 floats
// x, out: [rows, hidden] row-major; weight, bias: [hidden] (bias may be null); hidden % VEC == 0,
// pointers aligned to VEC * sizeof(T); out may alias x.
template <typename T, int VEC, int ITEMS>
__global__ void __launch_bounds__(512)
layer_norm_kernel(const T* x, const T* __restrict__ weight, const T* __restrict__ bias, T* out,
                  int hidden, float eps) {
  pdl_wait();  // every input of this kernel may come from the previous one
  pdl_trigger();
  __shared__ float scratch[32];
  const int n_vec = hidden / VEC;
  const T* row = x + static_cast<long long>(blockIdx.x) * hidden;
  T* out_row = out + static_cast<long long>(blockIdx.x) * hidden;
  const float shift = to_float(row[0]);
  Vec<T, VEC> cache[ITEMS];
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < n_vec) {
      cache[j] = Vec<T, VEC>::load(row + i * VEC);
#pragma unroll
      for (int e = 0; e < VEC; ++e) sum += to_float(cache[j].v[e]) - shift;
    }
  }
  for (int i = threadIdx.x + ITEMS * blockDim.x; i < n_vec; i += blockDim.x) {
    const Vec<T, VEC> v = Vec<T, VEC>::load(row + i * VEC);
#pragma unroll
    for (int e = 0; e < VEC; ++e) sum += to_float(v.v[e]) - shift;
  }
  const float mean = block_reduce(sum, scratch) / hidden;  // of x - shift

  float sum_sq = 0.0f;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < n_vec) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float d = to_float(cache[j].v[e]) - shift - mean;
        sum_sq += d * d;
      }
    }
  }
  for (int i = threadIdx.x + ITEMS * blockDim.x; i < n_vec; i += blockDim.x) {
    const Vec<T, VEC> v = Vec<T, VEC>::load(row + i * VEC);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float d = to_float(v.v[e]) - shift - mean;
      sum_sq += d * d;
    }
  }
  const float inv_std = 1.0f / sqrtf(block_reduce(sum_sq, scratch) / hidden + eps);

  auto store = [&](const Vec<T, VEC>& v, int i) {
    const Vec<T, VEC> w = Vec<T, VEC>::load(weight + i * VEC);
    Vec<T, VEC> b;
    if (bias) b = Vec<T, VEC>::load(bias + i * VEC);
    Vec<T, VEC> o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float y = (to_float(v.v[e]) - shift - mean) * inv_std * to_float(w.v[e]);
      o.v[e] = from_float<T>(bias ? y + to_float(b.v[e]) : y);
    }
    o.store(out_row + i * VEC);
  };
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < n_vec) store(cache[j], i);
  }
  for (int i = threadIdx.x + ITEMS * blockDim.x; i < n_vec; i += blockDim.x)
    store(Vec<T, VEC>::load(row + i * VEC), i);
}
