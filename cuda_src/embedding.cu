// Embedding lookup: out[t] = round(table[ids[t]] * scale) (scale 1: the row itself; Gemma scales by
// sqrt(hidden)). An id outside [0, vocab) never reads the table: its row of out is written with zeros
// (the NumPy reference raises ValueError instead).
#include "common.cuh"

using namespace cuinfer;

// grid: (n) · block: 32..256, a multiple of 32 · smem: none
// ids: [n] (IdT = int or long long); table: [vocab, hidden]; out: [n, hidden], row-major,
// hidden % VEC == 0, pointers aligned to VEC * sizeof(T).
template <typename T, int VEC, typename IdT>
__global__ void __launch_bounds__(256)
embedding_kernel(const IdT* __restrict__ ids, const T* __restrict__ table, T* __restrict__ out,
                 long long vocab, int hidden, float scale) {
  pdl_wait();  // every input of this kernel may come from the previous one
  pdl_trigger();
  const long long id = ids[blockIdx.x];
  const bool valid = id >= 0 && id < vocab;
  const T* src = table + (valid ? id : 0) * hidden;
  T* dst = out + static_cast<long long>(blockIdx.x) * hidden;
  Vec<T, VEC> zero;
#pragma unroll
  for (int e = 0; e < VEC; ++e) zero.v[e] = from_float<T>(0.0f);
#pragma unroll 4  // up to four 16-byte loads in flight per thread before the stores
  for (int c = threadIdx.x * VEC; c < hidden; c += blockDim.x * VEC) {
    Vec<T, VEC> v = valid ? Vec<T, VEC>::load(src + c) : zero;
#pragma unroll
    for (int e = 0; e < VEC; ++e) v.v[e] = from_float<T>(to_float(v.v[e]) * scale);  // exact for scale 1
    v.store(dst + c);
  }
}
