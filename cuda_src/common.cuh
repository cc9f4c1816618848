// Shared device code for every kernel family: dtype conversion, 16-byte vectors,
// warp and block reductions. Included by cuda_src/<family>.cu; compiled by NVRTC.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace cuinfer {

// ---------------------------------------------------------------- conversions
template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// Round to nearest even, as numpy's astype does.
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// ------------------------------------------------------------- 16-byte vectors
// Vec<T, N>: N elements of T loaded or stored as one access of N*sizeof(T) bytes
// (16 bytes when N = 16 / sizeof(T)). The pointer must be aligned to that size.
template <typename T, int N> struct alignas(sizeof(T) * N) Vec {
  T v[N];
  __device__ __forceinline__ static Vec load(const T* p) { return *reinterpret_cast<const Vec*>(p); }
  __device__ __forceinline__ void store(T* p) const { *reinterpret_cast<Vec*>(p) = *this; }
  // Non-coherent, no-L1-allocate load for data read exactly once (weights, streamed rows).
  __device__ __forceinline__ static Vec load_stream(const T* p) {
    Vec r;
    if constexpr (sizeof(Vec) == 16) {
      int4 raw = __ldcs(reinterpret_cast<const int4*>(p));
      r = *reinterpret_cast<Vec*>(&raw);
    } else {
      r = load(p);
    }
    return r;
  }
};

template <typename T, int N> struct VecF {  // N floats, the fp32 working copy of a Vec<T, N>
  float v[N];
  __device__ __forceinline__ static VecF from(const Vec<T, N>& x) {
    VecF r;
#pragma unroll
    for (int i = 0; i < N; ++i) r.v[i] = to_float(x.v[i]);
    return r;
  }
  __device__ __forceinline__ Vec<T, N> to() const {
    Vec<T, N> r;
#pragma unroll
    for (int i = 0; i < N; ++i) r.v[i] = from_float<T>(v[i]);
    return r;
  }
};

// ------------------------------------------------------------- KV-cache chunks
// Eight consecutive elements of a KV-cache row whose kernels compute in T. The cache holds T itself
// (Raw: 16 bytes) or fp8 E4M3 codes (C = __nv_fp8_e4m3, Raw: 8 bytes; cuinfer/ops/fp8.py). decode
// is exact (every E4M3 value is a half, a bfloat16 and a float), so a kernel computes with exactly
// the values the cache holds; encode rounds a T row to nearest even, saturating at +-448.
// Two E4M3 codes (the low byte first) as a half2, exactly. sm_89+ has the conversion
// (cvt.rn.f16x2.e4m3x2); elsewhere each code's bits move under a half's (sign; exponent and mantissa
// below the half's), which reads as the value times 2^-8, subnormals included, and one multiply by
// 256 scales it back. (cuda_fp8.h's own emulation is exact too, but took NVRTC ~5x as long to compile.)
__device__ __forceinline__ __half2 e4m3x2_to_half2(unsigned short w) {
#if __CUDA_ARCH__ >= 890
  return __half2(__nv_cvt_fp8x2_to_halfraw2(w, __NV_E4M3));
#else
  const unsigned x = (w & 0xFFu) | ((w & 0xFF00u) << 8);  // code i in half i's low byte
  unsigned h = ((x & 0x00800080u) << 8) | ((x & 0x007F007Fu) << 7);
  const __half2 scaled = __hmul2(*reinterpret_cast<const __half2*>(&h), __float2half2_rn(256.0f));
  const unsigned nan = __vcmpeq2(x & 0x007F007Fu, 0x007F007Fu);  // 0x7f / 0xff: NaN
  h = (*reinterpret_cast<const unsigned*>(&scaled) & ~nan) | (nan & 0x7FFF7FFFu);
  return *reinterpret_cast<const __half2*>(&h);
#endif
}

// A half as T: itself, or through float (exact).
template <typename T> __device__ __forceinline__ T half_to(__half x) { return from_float<T>(__half2float(x)); }
template <> __device__ __forceinline__ __half half_to<__half>(__half x) { return x; }

template <typename T, typename C> struct KvChunk;
template <typename T> struct KvChunk<T, T> {
  static_assert(sizeof(T) == 2, "8 elements of a 16-bit T");
  using Raw = uint4;
  __device__ __forceinline__ static Vec<T, 8> decode(Raw r) { return *reinterpret_cast<const Vec<T, 8>*>(&r); }
  __device__ __forceinline__ static Raw encode(const Vec<T, 8>& x) { return *reinterpret_cast<const Raw*>(&x); }
};
template <typename T> struct KvChunk<T, __nv_fp8_e4m3> {
  using Raw = uint2;
  __device__ __forceinline__ static Vec<T, 8> decode(Raw r) {
    const unsigned words[2] = {r.x, r.y};
    Vec<T, 8> y;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 h = e4m3x2_to_half2(static_cast<unsigned short>(words[i / 2] >> (16 * (i % 2))));
      y.v[2 * i] = half_to<T>(__low2half(h));
      y.v[2 * i + 1] = half_to<T>(__high2half(h));
    }
    return y;
  }
  __device__ __forceinline__ static Raw encode(const Vec<T, 8>& x) {
    unsigned words[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_fp8x2_storage_t p = __nv_cvt_float2_to_fp8x2(
          make_float2(to_float(x.v[2 * i]), to_float(x.v[2 * i + 1])), __NV_SATFINITE, __NV_E4M3);
      words[i / 2] |= static_cast<unsigned>(p) << (16 * (i % 2));
    }
    return make_uint2(words[0], words[1]);
  }
};
// One element of a T row rounded into a cache of C.
template <typename T, typename C> __device__ __forceinline__ C to_cache(T x) {
  if constexpr (sizeof(C) == sizeof(T)) {
    return x;
  } else {
    return C(to_float(x));  // __nv_fp8_e4m3's constructor: round to nearest even, saturating
  }
}

// ------------------------------------------------------------------ reductions
struct Sum {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
  __device__ __forceinline__ static float identity() { return 0.0f; }
};
struct Max {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
  __device__ __forceinline__ static float identity() { return __int_as_float(0xff800000); }  // -inf
};

// floor(log2 n), n >= 1, at compile time
__host__ __device__ constexpr int ilog2(int n) { return n > 1 ? 1 + ilog2(n / 2) : 0; }

template <typename Op = Sum> __device__ __forceinline__ float warp_reduce(float x, Op op = Op()) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Reduce over the whole block; every thread gets the result. `scratch` holds at least
// 32 floats of shared memory; the call has barriers, so every thread of the block must call it.
template <typename Op = Sum>
__device__ __forceinline__ float block_reduce(float x, float* scratch, Op op = Op()) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_warps = (blockDim.x + 31) >> 5;
  x = warp_reduce(x, op);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < n_warps ? scratch[lane] : Op::identity();
  return warp_reduce(x, op);
}

// ------------------------------------------------------------- cp.async (sm_80)
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// 16-byte global -> shared copy; zero-fills the destination when !valid. The clobber keeps the
// compiler from moving this thread's earlier shared-memory reads of the slot past it.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
// 8-byte copy (.ca: .cg takes 16 bytes only), for an fp8 cache's chunks; zero-fills when !valid.
__device__ __forceinline__ void cp_async8(unsigned dst, const void* src, bool valid = true) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0) : "memory");
}
// A chunk of Raw (KvChunk's 16 or 8 bytes).
template <typename Raw> __device__ __forceinline__ void cp_async_raw(unsigned dst, const void* src) {
  if constexpr (sizeof(Raw) == 16) {
    cp_async16(dst, src);
  } else {
    cp_async8(dst, src);
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { cp_async_wait<0>(); }

// ------------------------------------------------- programmatic dependent launch
// On sm_90 every kernel is compiled with -DCUINFER_PDL (runtime.kernel; CUINFER_PDL=0 turns it
// off), and runtime.launch gives the launches captured into a CUDA graph programmatic stream
// serialization: in a replay a kernel may start while the kernel before it is still running, once
// that one has called pdl_trigger() in every block (or finished). Eager launches go without the
// attribute: the grid starts after its predecessor, and pdl_wait() returns at once.
// Contract for every kernel of cuda_src/:
//   * pdl_wait() in every thread before its first access to memory another kernel of the graph
//     writes (activations, the KV cache, workspaces; weights are written only outside graphs, so
//     the GEMV loads its first ones before it). It returns when the previous kernel has finished
//     and its writes are visible, so the order of the whole stream stays transitive. (A kernel that
//     reads nothing its predecessor writes may read before it, and then waits before its first
//     store: the second launch of a linear_mma call, which reads the x that the first launch reads.)
//   * pdl_trigger() right after pdl_wait(): the next kernel may then be scheduled onto free SMs
//     and run its part before pdl_wait() (its block table, staged K/V rows, first weights) under
//     this one. Since every kernel triggers only after its own wait, when kernel N+1 starts
//     kernel N-1 has finished: what N+1 reads before its wait must not be written by N. (The
//     GEMV used to trigger after its main loop; at once, a decode step is 6-11 % faster: docs/decode.md.)
// Without CUINFER_PDL (sm_80, or CUINFER_PDL=0) both compile to nothing.
__device__ __forceinline__ void pdl_wait() {
#if defined(CUINFER_PDL) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(CUINFER_PDL) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// RMSNorm (Hugging Face LlamaRMSNorm rounding), shared by rms_norm.cu and the GEMV's norm prologue:
// 1 / sqrt(mean(x^2) + eps) correctly rounded, as numpy; then w * round_T(x * inv_rms), rounded once.
__device__ __forceinline__ float rms_inv(float sum_sq, int n, float eps) {
  return 1.0f / sqrtf(sum_sq / n + eps);
}
template <typename T> __device__ __forceinline__ T rms_normed(T x, T w, float inv_rms) {
  return from_float<T>(to_float(w) * to_float(from_float<T>(to_float(x) * inv_rms)));
}

// RoPE rotate-half of one pair (x1, x2) = (x[j], x[j + D/2]) with c, s the cos and sin of its angle:
// rope_lo = x1 c - x2 s, rope_hi = x2 c + x1 s, each one fma on a rounded product, spelled out so that
// every kernel that rotates (write_kv, the fused decode attention) rounds alike whatever ptxas contracts.
__device__ __forceinline__ float rope_lo(float x1, float x2, float c, float s) {
  return __fmaf_rn(x1, c, -__fmul_rn(x2, s));
}
__device__ __forceinline__ float rope_hi(float x1, float x2, float c, float s) {
  return __fmaf_rn(x1, s, __fmul_rn(x2, c));
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

// tanh-approximated GELU, as used by Gemma / GPT-2 ("gelu_pytorch_tanh"):
// 0.5 x (1 + tanh z) written as x * sigmoid(2z) = x / (1 + e^(-2z)). For negative x the
// tanh form cancels in 1 + tanh z (1e-3 relative error at x = -5); this form does not.
__device__ __forceinline__ float gelu_tanh(float x) {
  const float z = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return x / (1.0f + expf(-2.0f * z));
}

}  // namespace cuinfer
