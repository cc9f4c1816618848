// Register-level weight formats of the quantized GEMV (linear.cu; cuinfer/ops/quant.py documents the
// layouts): fp16 / bf16 pairs, int8 bytes and int4 nibbles as exact values of T for mma.sync's A
// fragments, the int4 16-row tile index, and the k a lane quad covers per format.
#pragma once
#include "common.cuh"

namespace cuinfer {

using u32 = unsigned int;
using i8 = signed char;

template <typename T> struct Pair;  // two values of T in one 32-bit register
template <> struct Pair<__half> {
  static constexpr u32 kOne = 0x3c003c00u;
  static constexpr u32 kMagic4 = 0x64006400u;  // half 1024: 0x6400 | n == 1024 + n for n < 1024
  __device__ __forceinline__ static u32 sub(u32 a, u32 b) {
    __half2 r = __hsub2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
    return *reinterpret_cast<u32*>(&r);
  }
};
template <> struct Pair<__nv_bfloat16> {
  static constexpr u32 kOne = 0x3f803f80u;
  static constexpr u32 kMagic4 = 0x43004300u;  // bf16 128: 0x4300 | n == 128 + n for n < 128
  __device__ __forceinline__ static u32 sub(u32 a, u32 b) {
    __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
    return *reinterpret_cast<u32*>(&r);
  }
};

// int8 bytes 2h, 2h+1 of `w` as two exact values of T (q in -128..127).
template <typename T> __device__ __forceinline__ u32 int8_pair(u32 w, int h);
template <> __device__ __forceinline__ u32 int8_pair<__half>(u32 w, int h) {
  // (q + 128) into the low byte of half 1024 (0x6400 | b == 1024 + b), then minus 1152: exact.
  const u32 r = __byte_perm(w ^ 0x80808080u, 0x64646464u, h ? 0x4342 : 0x4140);
  return Pair<__half>::sub(r, 0x64806480u);
}
template <> __device__ __forceinline__ u32 int8_pair<__nv_bfloat16>(u32 w, int h) {
  // bf16 has too few mantissa bits for the byte trick over 0..255: go through fp32 (exact).
  const float lo = static_cast<float>(static_cast<i8>(w >> (16 * h)));
  const float hi = static_cast<float>(static_cast<i8>(w >> (16 * h + 8)));
  __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<u32*>(&r);
}

// p itself, but opaque to the compiler: a loop-invariant address kept in registers instead of
// being recomputed from the kernel parameters at every use inside the loop (which nvcc prefers).
template <typename P> __device__ __forceinline__ P* pinned(P* p) {
  asm("" : "+l"(p));
  return p;
}
__device__ __forceinline__ int pinned(int i) {  // for offsets into shared memory (a pinned generic
  asm("" : "+r"(i));                             // pointer would lose its state space: LD, not LDS)
  return i;
}

// (a & MASK) | MAGIC in one lop3 (the compiler splits it in two: one immediate per instruction).
template <u32 MASK, u32 MAGIC> __device__ __forceinline__ u32 and_or(u32 a) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(a), "n"(MASK), "n"(MAGIC));
  return d;
}

// The constants int4_word subtracts: with an integer zero point z (0..15) it comes off in the same
// instructions, exactly: lo = the magic + z (fp16 1024 + z, bf16 128 + z), hi = -64 - z (fp16's odd
// nibbles); otherwise (z = 0 here) the zero point is applied to the group's sums.
struct ZeroSub {
  u32 lo, hi;
};
template <bool IZ> __device__ __forceinline__ ZeroSub zero_sub(__half2 scale_zero, __half) {
  if constexpr (!IZ) return {Pair<__half>::kMagic4, 0xd400d400u};  // half2 -64
  const __half2 z = __high2half2(scale_zero);
  const __half2 lo = __hadd2(__float2half2_rn(1024.0f), z), hi = __hsub2(__float2half2_rn(-64.0f), z);
  return {*reinterpret_cast<const u32*>(&lo), *reinterpret_cast<const u32*>(&hi)};
}
template <bool IZ> __device__ __forceinline__ ZeroSub zero_sub(__half2 scale_zero, __nv_bfloat16) {
  if constexpr (!IZ) return {Pair<__nv_bfloat16>::kMagic4, 0u};
  const __nv_bfloat162 lo = __float2bfloat162_rn(128.0f + __high2float(scale_zero));
  return {*reinterpret_cast<const u32*>(&lo), 0u};
}

// The eight nibbles of `w` as exact values q - z of T (zero_sub), pairs (i, i + 4) in q[i] for
// i = 0..3: the magic-number OR makes 1024 + q (bf16: 128 + q), one subtraction takes the magic
// (+ z) off. With fp16 the odd nibbles need no shift: (w & 0x00f000f0) | magic is 1024 + 16 q, and
// q - z = that / 16 - 64 - z in one exact fma. bf16 has too few mantissa bits for 16 q: every pair
// is shifted down.
template <typename T> __device__ __forceinline__ void int4_word(u32 w, ZeroSub z, u32 (&q)[4]);
template <> __device__ __forceinline__ void int4_word<__half>(u32 w, ZeroSub z, u32 (&q)[4]) {
  constexpr u32 kMagic = Pair<__half>::kMagic4;
  const __half2 sixteenth = __float2half2_rn(0.0625f);
  auto hi = [&](u32 v) {  // (1024 + 16 q) / 16 - 64 - z = q - z, exact
    __half2 r = __hfma2(*reinterpret_cast<__half2*>(&v), sixteenth, *reinterpret_cast<const __half2*>(&z.hi));
    return *reinterpret_cast<u32*>(&r);
  };
  const u32 w8 = w >> 8;
  q[0] = Pair<__half>::sub(and_or<0x000f000fu, kMagic>(w), z.lo);
  q[1] = hi(and_or<0x00f000f0u, kMagic>(w));
  q[2] = Pair<__half>::sub(and_or<0x000f000fu, kMagic>(w8), z.lo);
  q[3] = hi(and_or<0x00f000f0u, kMagic>(w8));
}
template <> __device__ __forceinline__ void int4_word<__nv_bfloat16>(u32 w, ZeroSub z, u32 (&q)[4]) {
  constexpr u32 kMagic = Pair<__nv_bfloat16>::kMagic4;
#pragma unroll
  for (int i = 0; i < 4; ++i) q[i] = Pair<__nv_bfloat16>::sub(and_or<0x000f000fu, kMagic>(w >> (4 * i)), z.lo);
}

// int4 arrays keep rows in tiles of 16, [ceil(N/16), per_row, 16, ...]: the index (in units of
// the innermost entry) of entry 0 of `row`; its entry e is 16 e further.
__host__ __device__ __forceinline__ size_t tiled_row(int row, int per_row) {
  return (size_t)(row >> 4) * per_row * 16 + (row & 15);
}

template <int WBITS> struct Layout {
  static constexpr int kLaneK = WBITS == 16 ? 8 : WBITS == 8 ? 16 : 32;  // k per lane load
  static constexpr int kQuadK = 4 * kLaneK;                              // k per quad step
};

}  // namespace cuinfer
