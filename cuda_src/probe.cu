// Machine ceilings the wgmma GEMM is measured against (python -m cuinfer.bench hopper), sm_90 only:
// how fast bulk copies stream into shared memory from HBM and from L2, and how many FLOP an SM
// issues through wgmma with A from registers or from shared memory.
#include "common.cuh"
#include "mma.cuh"

using namespace cuinfer;

// grid: any · block: 160 (warp 0 copies, warps 1-4 consume) · smem: dynamic SLOTS (WB + XB) bytes.
// Per stage i < stages a slot of the ring receives WB bytes of w (block b's own run: w + (b stages +
// i) WB, as the GEMM's weights from HBM) and XB bytes of x (x + i XB mod xwrap, one region all blocks
// share, as the GEMM's x from L2), both by one bulk copy completing on the slot's full mbarrier; the
// consumers add up the slot's 32-bit words (mod 2^64, SUM) or read one word (the copies alone, as fast
// as they go) and release it. sum += the block's total.
// LAYOUT 1 (box): w is instead a TensorMap of w's bytes as the int8 GEMM maps an Int8Weight (its
// [stages, 1, 128 gridDim.x, 64] 16-bit view, 128-byte swizzle), and block b's stage i is the box of
// its 128 rows b 128 .. + 128 and their bytes 128 i .. + 128 (WB = 16 KB), as linear_wgmma_kernel
// copies them; the ring is then 1024-byte aligned (1 KB more shared memory). LAYOUT 2 (tiles): w
// holds 2 KB tiles of 16 rows x 128 bytes, tile (t, i) at (t stages + i) 2 KB, and block b's stage i
// is tiles 8b .. 8b + 7 at i, eight bulk copies (an int8 weight stored as int4's tiles16 are).
// LAYOUT 0: runs, one copy a stage, as above.
// w, x 16-byte aligned; WB, XB, xwrap multiples of 16.
template <int SLOTS, int WB, int XB, bool SUM, int LAYOUT = 0>
__global__ void __launch_bounds__(160) stream_probe_kernel(const char* __restrict__ w, const char* __restrict__ x,
                                                           int stages, long long xwrap,
                                                           unsigned long long* __restrict__ sum) {
#if __CUDA_ARCH__ >= 900
  constexpr int kSlot = WB + XB;
  constexpr bool kBox = LAYOUT == 1;
  static_assert(kSlot % 16 == 0 && kSlot > 0, "slot");
  static_assert(LAYOUT == 0 || WB == 16384, "an int8 stage is 128 rows x 128 bytes");
  static_assert(!kBox || kSlot % 1024 == 0, "a box lands 1024-byte aligned");
  extern __shared__ __align__(128) unsigned char raw[];
  __shared__ __align__(8) unsigned long long bars[2 * SLOTS];
  __shared__ unsigned long long part[4];
  const unsigned ring = kBox ? (smem_u32(raw) + 1023) & ~1023u : smem_u32(raw);
  const unsigned char* smem = raw + (ring - smem_u32(raw));
  const unsigned full0 = smem_u32(bars), empty0 = full0 + 8 * SLOTS;
  if (threadIdx.x == 0) {
    for (int s = 0; s < SLOTS; ++s) mbar_init(full0 + 8 * s, 1), mbar_init(empty0 + 8 * s, 128);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const char* wb = w + (long long)blockIdx.x * stages * WB;
    for (int i = 0; i < stages; ++i) {
      const unsigned full = full0 + 8 * (i % SLOTS), slot = ring + (i % SLOTS) * kSlot;
      if (i >= SLOTS) mbar_wait(empty0 + 8 * (i % SLOTS), (i / SLOTS - 1) & 1);
      mbar_expect_tx(full, kSlot);
      if constexpr (kBox) {
        tma_load_4d(slot, reinterpret_cast<const TensorMap*>(w), 0, 128 * blockIdx.x, 0, i, full);
      } else if constexpr (LAYOUT == 2) {
        for (int t = 0; t < 8; ++t)
          bulk_load(slot + 2048 * t, w + ((long long)(8 * blockIdx.x + t) * stages + i) * 2048, 2048, full);
      } else if (WB) {
        bulk_load(slot, wb + (long long)i * WB, WB, full);
      }
      if (XB) bulk_load(slot + WB, x + (long long)i * XB % xwrap, XB, full);
    }
  } else if (threadIdx.x >= 32) {
    unsigned long long acc[4] = {0, 0, 0, 0};  // four chains: the sums keep up with an L2 stream
    for (int i = 0; i < stages; ++i) {
      mbar_wait(full0 + 8 * (i % SLOTS), (i / SLOTS) & 1);
      const uint4* v = reinterpret_cast<const uint4*>(smem + (i % SLOTS) * kSlot);
      for (int k = threadIdx.x - 32; k < (SUM ? kSlot / 16 : 1); k += 128) {
        const uint4 q = v[k];
        acc[0] += q.x, acc[1] += q.y, acc[2] += q.z, acc[3] += q.w;
      }
      mbar_arrive(empty0 + 8 * (i % SLOTS));  // each thread releases its own reads
    }
    acc[0] += acc[1] + acc[2] + acc[3];
    for (int o = 16; o > 0; o >>= 1) acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32 - 1] = acc[0];
  }
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(sum, part[0] + part[1] + part[2] + part[3]);
#else
  __trap();
#endif
}

// grid: one block an SM · block: 128 WGS · smem: dynamic NX 256 + 9 KB. Each of the WGS warpgroups
// issues `iters` groups of 8 wgmma m64nNXk16 (A: 64 x 16 halves from registers, RS, or from shared
// memory; B: NX x 128 k in shared memory, K-major, 128-byte swizzle; every element of A and B 1.0),
// waiting after each group for all of them (WAIT 0) or all but the last (WAIT 1). cycles[block]: the
// clock64 span of the loop; acc[block]: the first accumulator of thread 0 (128 iters, exactly).
template <int NX, int WGS, bool RS, int WAIT>
__global__ void __launch_bounds__(128 * WGS) wgmma_probe_kernel(int iters, long long* __restrict__ cycles,
                                                                float* __restrict__ acc_out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem[];
  const unsigned raw = smem_u32(smem), base = (raw + 1023) & ~1023u;
  const unsigned xs = base, as = base + NX * 256;  // B: two 64-k column blocks; A: 64 rows x 64 k
  unsigned* words = reinterpret_cast<unsigned*>(smem + (base - raw));
  for (int i = threadIdx.x; i < (NX * 256 + 8192) / 4; i += blockDim.x) words[i] = 0x3c003c00u;  // 1.0, 1.0
  wgmma::fence_proxy_async();
  __syncthreads();
  float acc[NX / 2];
#pragma unroll
  for (int i = 0; i < NX / 2; ++i) acc[i] = 0.0f;
  const unsigned a[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    wgmma::fence();
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const unsigned long long b = wgmma::desc128(xs + (s / 4) * NX * 128 + 32 * (s % 4), 16, 1024);
      if constexpr (RS) wgmma::mma_rs_k<NX, __half>(acc, a, b);
      else wgmma::mma_ss<NX, __half>(acc, wgmma::desc128(as + 32 * (s % 4), 16, 1024), b, 1);
    }
    wgmma::commit();
    wgmma::wait<WAIT>();
    wgmma::fence_regs(acc);
  }
  wgmma::wait<0>();
  wgmma::fence_regs(acc);
  __syncthreads();
  const long long t1 = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0, acc_out[blockIdx.x] = acc[0];
#else
  __trap();
#endif
}
