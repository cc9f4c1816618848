// Gated activations of the MLP: out = act(gate) * up with x = [gate | up] along the last axis.
// ACT 0: SiLU (x * sigmoid(x), common.cuh silu); ACT 1: tanh-approximated GELU, the function of
// common.cuh gelu_tanh written as x * sigmoid(2z) (0.5 (1 + tanh z) = 1 / (1 + e^(-2z))): for
// negative x, 1 + tanhf(z) cancels and loses up to 1e-3 of relative precision at x = -5, the
// sigmoid form does not. act(gate) * up is computed in fp32 and rounded once to T.
#include "common.cuh"

using namespace cuinfer;

template <int ACT> __device__ __forceinline__ float activation(float x) {
  if constexpr (ACT == 0) return silu(x);
  else return x / (1.0f + expf(-2.0f * 0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// grid: (ceil(rows * d / VEC / 256)) · block: 256 · smem: none
// x: [rows, 2 * d] row-major ([gate | up]); out: [rows, d]; d % VEC == 0, pointers aligned to
// VEC * sizeof(T). One VEC-wide vector of out per thread.
template <typename T, int VEC, int ACT>
__global__ void __launch_bounds__(256)
activation_kernel(const T* __restrict__ x, T* __restrict__ out, long long rows, int d) {
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
