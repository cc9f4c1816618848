// Flash attention forward, FlashAttention-2 style, for prefill and chunked prefill.
//
// One CTA computes BM query rows of one head of one sequence; each warp owns
// BM / WARPS rows (MT m16 tiles). K/V tiles of BN keys are staged in shared memory
// with cp.async (two stages: tile j+1 loads while tile j is computed), rows padded
// by 8 elements so that ldmatrix's eight 16-byte row reads hit distinct banks.
// S = Q K^T and O += P V run on mma.sync.m16n8k16 (fp32 accumulate); P is rounded
// to T before the PV product, as FlashAttention does. Softmax is online in fp32: the row
// max is taken on the raw scores (scale > 0) and each exponential is one FFMA and one
// ex2: p = 2^(s * scale * log2(e) - max * scale * log2(e)).
#include "common.cuh"

namespace cuinfer {
namespace fa {

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
template <typename T> __device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4],
                                                              unsigned b0, unsigned b1);
template <> __device__ __forceinline__ void mma16816<__half>(float (&c)[4], const unsigned (&a)[4],
                                                             unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const unsigned (&a)[4],
                                                                    unsigned b0, unsigned b1) {
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

}  // namespace fa
}  // namespace cuinfer

// grid: (ceil(max_q_len / BM), n_heads, num_seqs), x reversed so the heaviest causal blocks
//   start first · block: 32 * WARPS · smem: (BM + 4 * BN) * (D + 8) * sizeof(T)
// q, out: [tokens, n_heads, D]; cu_seqlens_q: [num_seqs + 1]
// contiguous: k, v: [tokens, n_kv_heads, D], keys of sequence i at rows cu_seqlens_q[i]..
// PAGED: k, v: [num_blocks, 1 << block_shift, n_kv_heads, D]; block_tables: [num_seqs, max_blocks];
//   context_lens: [num_seqs]; the q rows are the last q_len of context_lens[i] positions.
// Query i of a chunk sees keys 0 .. i + kv_len - q_len when causal, every key otherwise.
template <typename T, int D, int BM, int BN, int WARPS, bool PAGED>
__global__ void __launch_bounds__(32 * WARPS) flash_attention_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ context_lens,
    const int* __restrict__ block_tables, int max_blocks, int block_shift, int n_heads,
    int n_kv_heads, float scale_log2, int causal) {
  cuinfer::pdl_wait();  // every input of this kernel may come from the previous one
  cuinfer::pdl_trigger();
  using namespace cuinfer;
  using namespace cuinfer::fa;
  constexpr int MT = BM / (16 * WARPS);  // m16 tiles per warp
  constexpr int STRIDE = D + 8;          // padded shared-memory row, elements
  constexpr int CHUNKS = D / 8;          // 16-byte chunks per row
  constexpr int NT = BN / 8;             // n8 tiles of S
  constexpr int DT = D / 8;              // n8 tiles of O
  constexpr int KS = D / 16;             // k16 steps of Q K^T
  constexpr int THREADS = 32 * WARPS;
  constexpr bool Q_IN_REGS = MT * KS * 4 <= 32;  // else Q fragments are re-read from sQ each tile
  static_assert(MT >= 1 && BM == MT * 16 * WARPS, "BM must be a multiple of 16 * WARPS");
  static_assert(BN % 16 == 0 && D % 16 == 0, "BN and D must be multiples of 16");

  const int seq = blockIdx.z, head = blockIdx.y;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;
  const int q_start = cu_seqlens_q[seq];
  const int q_len = cu_seqlens_q[seq + 1] - q_start;
  if (m0 >= q_len) return;
  const int kv_len = PAGED ? context_lens[seq] : q_len;
  const int offset = kv_len - q_len;  // query i sees keys <= i + offset
  const int kv_head = head / (n_heads / n_kv_heads);
  const size_t row_stride = (size_t)n_kv_heads * D;
  const int n_end = causal ? min(kv_len, m0 + BM + offset) : kv_len;
  const int n_tiles = (n_end + BN - 1) / BN;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [BM][STRIDE]; reused for the output tile
  T* sK = sQ + BM * STRIDE;                // [2][BN][STRIDE]
  T* sV = sK + 2 * BN * STRIDE;            // [2][BN][STRIDE]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  for (int c = tid; c < BM * CHUNKS; c += THREADS) {
    const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
    const bool ok = m0 + r < q_len;
    const T* src = q + ((size_t)(q_start + (ok ? m0 + r : 0)) * n_heads + head) * D + col;
    cp_async16(smem_u32(sQ + r * STRIDE + col), src, ok);
  }
  const int* table = PAGED ? block_tables + (size_t)seq * max_blocks : nullptr;
  const int block_mask = (1 << block_shift) - 1;
  auto load_kv = [&](int tile, int stage) {
    for (int c = tid; c < BN * CHUNKS; c += THREADS) {
      const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
      const int key = tile * BN + r;
      const bool ok = key < kv_len;
      size_t row = 0;
      if (ok) {
        if constexpr (PAGED) row = ((size_t)table[key >> block_shift] << block_shift) + (key & block_mask);
        else row = (size_t)q_start + key;
      }
      const size_t off = row * row_stride + (size_t)kv_head * D + col;
      cp_async16(smem_u32(sK + (stage * BN + r) * STRIDE + col), k + off, ok);
      cp_async16(smem_u32(sV + (stage * BN + r) * STRIDE + col), v + off, ok);
    }
  };
  load_kv(0, 0);
  cp_async_commit();

  unsigned qf[MT][Q_IN_REGS ? KS : 1][4];
  float o[MT][DT][4];
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.0f;
    row_max[mt][0] = row_max[mt][1] = Max::identity();
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }
  const int warp_row0 = m0 + warp * MT * 16;  // first query row (in the chunk) of this warp

  for (int j = 0; j < n_tiles; ++j) {
    const int stage = j & 1;
    cp_async_wait_all();
    __syncthreads();  // tile j visible to all; every warp is done with tile j - 1's stage
    if (Q_IN_REGS && j == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          const int r = warp * MT * 16 + mt * 16 + (lane % 16), col = ks * 16 + (lane / 16) * 8;
          ldmatrix_x4(qf[mt][Q_IN_REGS ? ks : 0], smem_u32(sQ + r * STRIDE + col));
        }
    }
    if (j + 1 < n_tiles) load_kv(j + 1, stage ^ 1);
    cp_async_commit();

    // S = Q K^T for this warp's rows and the BN keys of tile j
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
    const T* kt = sK + stage * BN * STRIDE;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      unsigned a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (Q_IN_REGS) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[mt][i] = qf[mt][ks][i];
        } else {
          const int r = warp * MT * 16 + mt * 16 + (lane % 16), col = ks * 16 + (lane / 16) * 8;
          ldmatrix_x4(a[mt], smem_u32(sQ + r * STRIDE + col));
        }
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        unsigned b[4];
        const int key = np * 16 + (lane % 8) + 8 * (lane / 16), col = ks * 16 + 8 * ((lane / 8) % 2);
        ldmatrix_x4(b, smem_u32(kt + key * STRIDE + col));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(s[mt][2 * np], a[mt], b[0], b[1]);
          mma16816<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }

    // mask keys past the sequence or (causal) past each query's limit; online softmax
    const int n0 = j * BN;
    const bool masked = n0 + BN > kv_len || (causal && n0 + BN - 1 > warp_row0 + offset);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int qrow = warp_row0 + mt * 16 + lane / 4 + 8 * h;
        float mx = row_max[mt][h];  // raw (unscaled) scores
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = s[mt][nt][2 * h + e];
            const int key = n0 + nt * 8 + 2 * (lane % 4) + e;
            if (masked && (key >= kv_len || (causal && key > qrow + offset))) x = Max::identity();
            s[mt][nt][2 * h + e] = x;
            mx = fmaxf(mx, x);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_scaled = mx == Max::identity() ? 0.0f : mx * scale_log2;  // 0: no visible key yet
        const float alpha = exp2_ftz(fmaf(row_max[mt][h], scale_log2, -m_scaled));
        row_max[mt][h] = mx;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = exp2_ftz(fmaf(s[mt][nt][2 * h + e], scale_log2, -m_scaled));
            s[mt][nt][2 * h + e] = p;
            sum += p;
          }
        row_sum[mt][h] = row_sum[mt][h] * alpha + sum;  // this thread's part of the row; quad-summed at the end
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          o[mt][dt][2 * h] *= alpha;
          o[mt][dt][2 * h + 1] *= alpha;
        }
      }

    // O += P V: the S accumulators of n8 tiles 2kk, 2kk+1 are the A fragment of k16 step kk
    const T* vt = sV + stage * BN * STRIDE;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      unsigned pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        unsigned b[4];
        const int key = kk * 16 + (lane % 8) + 8 * ((lane / 8) % 2), col = dp * 16 + 8 * (lane / 16);
        ldmatrix_x4_trans(b, smem_u32(vt + key * STRIDE + col));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(o[mt][2 * dp], pa[mt], b[0], b[1]);
          mma16816<T>(o[mt][2 * dp + 1], pa[mt], b[2], b[3]);
        }
      }
    }
  }

  // normalise, stage this warp's rows in its own part of sQ, store 16-byte rows
  __syncwarp();  // this warp's last ldmatrix reads of its sQ rows precede the writes below
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = row_sum[mt][h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      inv[h] = l > 0.0f ? 1.0f / l : 0.0f;
    }
    const int r = warp * MT * 16 + mt * 16 + lane / 4;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      const int col = dt * 8 + 2 * (lane % 4);
      *reinterpret_cast<unsigned*>(sQ + r * STRIDE + col) = pack2<T>(o[mt][dt][0] * inv[0], o[mt][dt][1] * inv[0]);
      *reinterpret_cast<unsigned*>(sQ + (r + 8) * STRIDE + col) =
          pack2<T>(o[mt][dt][2] * inv[1], o[mt][dt][3] * inv[1]);
    }
  }
  __syncwarp();
  for (int c = lane; c < MT * 16 * CHUNKS; c += 32) {
    const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
    const int row = warp_row0 + r;
    if (row < q_len)
      Vec<T, 8>::load(sQ + (warp * MT * 16 + r) * STRIDE + col)
          .store(out + ((size_t)(q_start + row) * n_heads + head) * D + col);
  }
}
