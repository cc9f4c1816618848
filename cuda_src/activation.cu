// Gated activations of the MLP: out = act(gate) * up with x = [gate | up] along the last axis.
// ACT 0: SiLU (common.cuh silu); ACT 1: tanh-approximated GELU (common.cuh gelu_tanh).
// act(gate) * up is computed in fp32 and rounded once to T.
#include "common.cuh"

using namespace cuinfer;

template <int ACT> __device__ __forceinline__ float activation(float x) {
  if constexpr (ACT == 0) return silu(x);
  else return gelu_tanh(x);
}

// grid: (ceil(rows * d / VEC / 256)) · block: 256 · smem: none
// x: [rows, 2 * d] row-major ([gate | up]); out: [rows, d]; d % VEC == 0, pointers aligned to
// VEC * sizeof(T). One VEC-wide vector of out per thread.
template <typename T, int VEC, int ACT>
__global__ void __launch_bounds__(256)
activation_kernel(const T* __restrict__ x, T* __restrict__ out, long long rows, int d) {
  pdl_wait();  // every input of this kernel may come from the previous one
  pdl_trigger();
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int d_vec = d / VEC;
  if (i >= rows * d_vec) return;
  const long long row = i / d_vec;
  const int col = static_cast<int>(i - row * d_vec) * VEC;
  const T* gate = x + row * 2 * d + col;
  const Vec<T, VEC> g = Vec<T, VEC>::load_stream(gate), u = Vec<T, VEC>::load_stream(gate + d);
  Vec<T, VEC> o;
#pragma unroll
  for (int e = 0; e < VEC; ++e) o.v[e] = from_float<T>(activation<ACT>(to_float(g.v[e])) * to_float(u.v[e]));
  o.store(out + row * d + col);
}
