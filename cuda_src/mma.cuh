// Tensor-core helpers: mma.sync m16n8k16 and ldmatrix (sm_80+), and wgmma (sm_90a) with its
// shared-memory descriptors. Included by the families that multiply tiles.
#pragma once
#include "common.cuh"

namespace cuinfer {

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a (16x16, row) * b (16x8, col), fp32 accumulate.
// c: 4 consecutive accumulators (the C fragment of one n8 tile).
template <typename T> __device__ __forceinline__ void mma16816(float* c, const unsigned (&a)[4], unsigned b0,
                                                              unsigned b1);
template <> __device__ __forceinline__ void mma16816<__half>(float* c, const unsigned (&a)[4], unsigned b0,
                                                             unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float* c, const unsigned (&a)[4], unsigned b0,
                                                                    unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x on the SFU, denormal results flushed to zero (exp2f adds a rescale around MUFU.EX2 for them).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two floats rounded to T and packed into one 32-bit register (lo = a).
template <typename T> __device__ __forceinline__ unsigned pack2(float a, float b);
template <> __device__ __forceinline__ unsigned pack2<__half>(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<unsigned*>(&h);
}

// ------------------------------------------------------------- Hopper pipelines (sm_90)
// mbarrier in shared memory (sm_90 forms), for producer / consumer pipelines. arrive releases the
// thread's earlier writes; a wait that sees the phase complete acquires them.
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Until the phase of the given parity (0 for phases 0, 2, ..., 1 for 1, 3, ...) has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
  } while (!done);
}
// mbarrier arrival that also expects `bytes` more from asynchronous copies (TMA) in this phase.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Bulk copy (TMA, no tensor map) of `bytes` (a multiple of 16) from global src to shared dst, both
// 16-byte aligned, completing its bytes on the mbarrier bar.
__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// A CUtensorMap (runtime.tensor_map), passed to kernels by value as `const __grid_constant__ TensorMap`.
struct alignas(64) TensorMap {
  unsigned long long raw[16];
};
// TMA: the box at element coordinates (c0 innermost, c1, c2) of `map` into shared memory at dst (its
// swizzle as encoded), completing its bytes on the mbarrier bar.
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TensorMap* map, int c0, int c1, int c2,
                                            unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TensorMap* map, int c0, int c1, int c2, int c3,
                                            unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
// Thread-block clusters (sm_90): a barrier over all blocks of the cluster (it orders shared memory),
// the block's rank, and *p in the shared memory of the cluster's block `rank` (distributed shared
// memory). Defined for __CUDA_ARCH__ >= 900 only.
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}
// cluster_sync's halves: arrive (release: this thread's earlier reads and writes are done) and wait.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ float4 load_cluster4(const float* p, unsigned rank) {  // p 16-byte aligned
  unsigned remote;
  float4 v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote) : "memory");
  return v;
}
__device__ __forceinline__ float load_cluster(const float* p, unsigned rank) {
  unsigned remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
#endif
// Named barrier `id` (1..15) over `threads` threads: sync waits for all of them, arrive only counts.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Warpgroup register budgets (sm_90a; the kernel needs a register cap at entry: __launch_bounds__).
template <int N> __device__ __forceinline__ void regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N> __device__ __forceinline__ void regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }

// ------------------------------------------------------------------ wgmma (sm_90a only)
// A warpgroup (4 consecutive warps, the first one's index a multiple of 4) multiplies a 64-row A by
// a K=16 x N B held in shared memory. The fp32 accumulator d[N/2] of thread t holds, for the warp
// w = t/32 and its lane l, rows 16w + l/4 (+8) and columns 8j + 2(l%4) (+1): d[4j + 0, 1] row l/4,
// d[4j + 2, 3] row l/4 + 8, the mma.sync m16n8 C layout repeated over the n8 tiles j.
//
// Operand tiles in shared memory use the 128-byte swizzle: a tile of R rows x 64 columns (16-bit)
// is R rows of 128 bytes, the 16-byte chunk c of row r stored at chunk c ^ (r % 8); wider tiles are
// several such column blocks one after another. Every block starts 1024-byte aligned.
namespace wgmma {

template <typename T> struct is_half { static constexpr bool value = false; };
template <> struct is_half<__half> { static constexpr bool value = true; };

__device__ __forceinline__ unsigned swizzle128(int row, int chunk) {  // byte offset in a column block
  return row * 128 + ((chunk ^ (row & 7)) << 4);
}
// Matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading and stride byte
// offsets (16-byte units), layout 1 = 128-byte swizzle. K-major operand: sbo = 1024 (the next 8
// rows), lbo unused; the k16 steps inside a column block start 32 bytes apart. MN-major operand
// (transposed B): lbo = the byte distance between 64-column blocks, sbo = 1024 (the next 8 k rows).
__device__ __forceinline__ unsigned long long desc128(unsigned addr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((addr & 0x3ffff) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler's reads and writes of accumulator registers on their side of fence / wait.
template <int N> __device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Keeps A fragment registers of a register-sourced wgmma live and unchanged up to here (the
// instruction reads them asynchronously: call after the wait that covers it).
__device__ __forceinline__ void fence_operand(unsigned (&a)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[i])::"memory");
}
// Shared memory written by ordinary stores or cp.async, read next by wgmma (the async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

#define CUINFER_ACC8 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define CUINFER_ACC12 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}"
#define CUINFER_ACC16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define CUINFER_ACC24 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
  "%18, %19, %20, %21, %22, %23}"
#define CUINFER_ACC32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define CUINFER_ACC48 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"
#define CUINFER_ACC64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
  "%59, %60, %61, %62, %63}"
#define CUINFER_ACC80 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, " \
  "%58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
  "%78, %79}"
#define CUINFER_ACC96 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, " \
  "%58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
  "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define CUINFER_ACC112 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, " \
  "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, " \
  "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, " \
  "%57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, " \
  "%77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, " \
  "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111}"
#define CUINFER_ACC128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
  "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
  "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, " \
  "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, " \
  "%113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define CUINFER_F4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define CUINFER_F16AT(d, i) CUINFER_F4(d, i), CUINFER_F4(d, i + 4), CUINFER_F4(d, i + 8), CUINFER_F4(d, i + 12)
#define CUINFER_F8(d) CUINFER_F4(d, 0), CUINFER_F4(d, 4)
#define CUINFER_F12(d) CUINFER_F4(d, 0), CUINFER_F4(d, 4), CUINFER_F4(d, 8)
#define CUINFER_F16(d) CUINFER_F16AT(d, 0)
#define CUINFER_F24(d) CUINFER_F16(d), CUINFER_F4(d, 16), CUINFER_F4(d, 20)
#define CUINFER_F32(d) CUINFER_F16(d), CUINFER_F16AT(d, 16)
#define CUINFER_F48(d) CUINFER_F32(d), CUINFER_F16AT(d, 32)
#define CUINFER_F64(d) CUINFER_F32(d), CUINFER_F16AT(d, 32), CUINFER_F16AT(d, 48)
#define CUINFER_F80(d) CUINFER_F64(d), CUINFER_F16AT(d, 64)
#define CUINFER_F96(d) CUINFER_F64(d), CUINFER_F16AT(d, 64), CUINFER_F16AT(d, 80)
#define CUINFER_F112(d) CUINFER_F96(d), CUINFER_F16AT(d, 96)
#define CUINFER_F128(d) CUINFER_F64(d), CUINFER_F16AT(d, 64), CUINFER_F16AT(d, 80), CUINFER_F16AT(d, 96), CUINFER_F16AT(d, 112)
// A from shared memory (descriptor a), B from shared memory, K-major. %S = first input operand.
#define CUINFER_WGMMA_SS(N, TY, ACC, OPS, A, B, S)                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" S ", 0;\n"                                          \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " ACC ", %" A ", %" B     \
               ", p, 1, 1, 0, 0;\n}\n"                                                                  \
               : OPS : "l"(a), "l"(b), "r"(scale_d))
// A from registers (the mma.sync A fragment of each warp's 16 rows), B from shared memory, MN-major
// (TB "1") or K-major (TB "0").
#define CUINFER_WGMMA_RS(N, TY, ACC, OPS, A, B, S, TB)                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" S ", 0;\n"                                          \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " ACC ", " A ", %" B       \
               ", p, 1, 1, " TB ";\n}\n"                                                             \
               : OPS : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d))

// d (64 x N) = (scale_d ? d : 0) + A (64 x 16, K-major, descriptor a) * B (16 x N, K-major, descriptor b)
template <int N, typename T>
__device__ __forceinline__ void mma_ss(float (&d)[N / 2], unsigned long long a, unsigned long long b, int scale_d) {
  constexpr bool H = is_half<T>::value;
  if constexpr (N == 16) {
    if constexpr (H) CUINFER_WGMMA_SS(16, "f16", CUINFER_ACC8, CUINFER_F8(d), "8", "9", "10");
    else CUINFER_WGMMA_SS(16, "bf16", CUINFER_ACC8, CUINFER_F8(d), "8", "9", "10");
  } else if constexpr (N == 32) {
    if constexpr (H) CUINFER_WGMMA_SS(32, "f16", CUINFER_ACC16, CUINFER_F16(d), "16", "17", "18");
    else CUINFER_WGMMA_SS(32, "bf16", CUINFER_ACC16, CUINFER_F16(d), "16", "17", "18");
  } else if constexpr (N == 64) {
    if constexpr (H) CUINFER_WGMMA_SS(64, "f16", CUINFER_ACC32, CUINFER_F32(d), "32", "33", "34");
    else CUINFER_WGMMA_SS(64, "bf16", CUINFER_ACC32, CUINFER_F32(d), "32", "33", "34");
  } else {
    static_assert(N == 128, "mma_ss: N is 16, 32, 64 or 128");
    if constexpr (H) CUINFER_WGMMA_SS(128, "f16", CUINFER_ACC64, CUINFER_F64(d), "64", "65", "66");
    else CUINFER_WGMMA_SS(128, "bf16", CUINFER_ACC64, CUINFER_F64(d), "64", "65", "66");
  }
}
// d (64 x N) += A (64 x 16, registers a) * B (16 x N in shared memory, descriptor b): MN-major (row k
// of B is 16-bit row k of the tile) with TB "1", K-major with "0".
// One N of CUINFER_MMA_RS (NN = 2 HALF): accumulators %0 .. %(HALF - 1), then A's four registers, b
// and scale_d.
#define CUINFER_RS_CASE(NN, HALF, A, B, S, TB)                                                       \
  if constexpr (N == NN) {                                                                             \
    if constexpr (H) CUINFER_WGMMA_RS(NN, "f16", CUINFER_ACC##HALF, CUINFER_F##HALF(d), A, B, S, TB);   \
    else CUINFER_WGMMA_RS(NN, "bf16", CUINFER_ACC##HALF, CUINFER_F##HALF(d), A, B, S, TB);              \
  }
#define CUINFER_MMA_RS(TB)                                                                             \
  constexpr bool H = is_half<T>::value;                                                               \
  const int scale_d = 1;                                                                              \
  static_assert((N % 32 == 0 || N == 16 || N == 24 || N == 48) && N <= 256,                           \
                "mma_rs: N is 16, 24, 48 or a multiple of 32 up to 256");                             \
  CUINFER_RS_CASE(16, 8, "{%8, %9, %10, %11}", "12", "13", TB)                                         \
  else CUINFER_RS_CASE(24, 12, "{%12, %13, %14, %15}", "16", "17", TB)                                 \
  else CUINFER_RS_CASE(32, 16, "{%16, %17, %18, %19}", "20", "21", TB)                                 \
  else CUINFER_RS_CASE(48, 24, "{%24, %25, %26, %27}", "28", "29", TB)                                 \
  else CUINFER_RS_CASE(64, 32, "{%32, %33, %34, %35}", "36", "37", TB)                                 \
  else CUINFER_RS_CASE(96, 48, "{%48, %49, %50, %51}", "52", "53", TB)                                 \
  else CUINFER_RS_CASE(128, 64, "{%64, %65, %66, %67}", "68", "69", TB)                                \
  else CUINFER_RS_CASE(160, 80, "{%80, %81, %82, %83}", "84", "85", TB)                                \
  else CUINFER_RS_CASE(192, 96, "{%96, %97, %98, %99}", "100", "101", TB)                              \
  else CUINFER_RS_CASE(224, 112, "{%112, %113, %114, %115}", "116", "117", TB)                         \
  else CUINFER_RS_CASE(256, 128, "{%128, %129, %130, %131}", "132", "133", TB)
template <int N, typename T>
__device__ __forceinline__ void mma_rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b) {
  CUINFER_MMA_RS("1")
}
template <int N, typename T>
__device__ __forceinline__ void mma_rs_k(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b) {
  CUINFER_MMA_RS("0")
}

}  // namespace wgmma
}  // namespace cuinfer
