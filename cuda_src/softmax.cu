// Softmax over the last axis: out = exp(x - max) / sum(exp(x - max)), fp32, rounded once to T.
// One pass computes each thread's running (max, sum) online (sum rescaled when the max grows),
// then the block merges them; rows of any length work. Each thread keeps up to ITEMS 16-byte
// vectors of its row in registers, so a row of up to blockDim * ITEMS vectors is read once;
// longer rows (a 128k vocabulary) read the rest a second time to write it, back to front.
// -inf entries give 0. A row with no finite maximum (all -inf) gives NaN everywhere, as torch:
// its max is -inf and exp(-inf - -inf) is NaN.
#include "common.cuh"

using namespace cuinfer;


// Fold one vector into the running (max, sum) of this thread.
template <typename T, int VEC>
__device__ __forceinline__ void softmax_fold(const Vec<T, VEC>& v, float& m, float& s) {
  float vmax = m;
#pragma unroll
  for (int e = 0; e < VEC; ++e) vmax = fmaxf(vmax, to_float(v.v[e]));
  if (vmax == Max::identity()) return;  // nothing finite yet: keep s = 0 (exp(-inf - -inf) would be NaN)
  s *= __expf(m - vmax);        // 0 while m is still -inf
#pragma unroll
  for (int e = 0; e < VEC; ++e) s += __expf(to_float(v.v[e]) - vmax);
  m = vmax;
}

template <typename T, int VEC>
__device__ __forceinline__ void softmax_store(const Vec<T, VEC>& v, T* out, float max, float inv_sum) {
  Vec<T, VEC> o;
#pragma unroll
  for (int e = 0; e < VEC; ++e) o.v[e] = from_float<T>(__expf(to_float(v.v[e]) - max) * inv_sum);
  o.store(out);
}

// grid: (rows) · block: 32..512, a multiple of 32 · smem: 32 floats
// x, out: [rows, n] row-major, n % VEC == 0, pointers aligned to VEC * sizeof(T); out may alias x.
template <typename T, int VEC, int ITEMS>
__global__ void __launch_bounds__(512) softmax_kernel(const T* x, T* out, int n) {
  pdl_wait();  // every input of this kernel may come from the previous one
  pdl_trigger();
  __shared__ float scratch[32];
  const int n_vec = n / VEC;
  const long long base = static_cast<long long>(blockIdx.x) * n;
  Vec<T, VEC> cache[ITEMS];
  float m = Max::identity(), s = 0.0f;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < n_vec) {
      cache[j] = Vec<T, VEC>::load_stream(x + base + static_cast<long long>(i) * VEC);  // read once
      softmax_fold(cache[j], m, s);
    }
  }
#pragma unroll 4
  for (int i = threadIdx.x + ITEMS * blockDim.x; i < n_vec; i += blockDim.x)
    softmax_fold(Vec<T, VEC>::load(x + base + static_cast<long long>(i) * VEC), m, s);

  const float max = block_reduce<Max>(m, scratch);
  // a thread that saw only -inf holds s = 0; if the whole row is -inf, max is -inf and the
  // output below is NaN
  const float sum = block_reduce<Sum>(m == Max::identity() ? 0.0f : s * __expf(m - max), scratch);
  const float inv_sum = 1.0f / sum;

#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < n_vec) softmax_store(cache[j], out + base + static_cast<long long>(i) * VEC, max, inv_sum);
  }
  // The streamed part is written back to front: its end was read last, so more of it is still in L2.
  const int first = threadIdx.x + ITEMS * blockDim.x, stride = blockDim.x;
  const int last = first < n_vec ? first + (n_vec - 1 - first) / stride * stride : first - stride;
  for (int i = last; i >= first; i -= stride) {
    const long long off = base + static_cast<long long>(i) * VEC;
    softmax_store(Vec<T, VEC>::load(x + off), out + off, max, inv_sum);
  }
}
