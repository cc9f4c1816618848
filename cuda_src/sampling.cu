// Token sampling, one CTA per row, no sort: temperature -> top-k -> top-p (of the top-k mass) ->
// min-p, then the inverse CDF at the row's uniform, in the order of descending logits. The math is
// cuinfer/ops/sampling.py's reference, operation for operation, so both pick the same token:
//   rank key  K_i = (order_bits(x_i) << 32) | (0xffffffff - i): descending K is descending logit,
//             ties by ascending token id (-0 counts as +0); every key is distinct.
//   weight    s_i = (x_i - max) / temperature (fp32, correctly rounded); p_i = exp_det(s_i) (a
//             fixed sequence of separately rounded fp32 operations, 0 below s = -32);
//             w_i = trunc(p_i * 2^31), an integer: every sum of weights is exact, whatever its order.
//   top-k     K_k = the key of rank k - 1 (k = 0 or k >= n: every token).
//   top-p     S_k = sum of w over K >= K_k; X = double(top_p) * S_k; K_p = the key of the first token
//             (descending K) whose inclusive sum of those weights reaches X. Kept: K >= K_p and p >= min_p.
//   sample    S = sum of the kept w; t = min(floor(double(u) * S), S - 1); the first kept token whose
//             inclusive sum of kept weights exceeds t.
// Temperature 0 takes the argmax (the largest key: the lowest id among equal maxima).
// "The first token whose inclusive sum exceeds t" is a radix select over the 64-bit keys, 8 bits a
// pass from the top: a weighted histogram of the next digit over the tokens that match the prefix
// found so far picks the digit whose bin holds the crossing; it stops early when that bin holds one
// token. Histogram updates are aggregated per warp (match_any + reduce_add) before the shared atomics;
// the first pass's histogram also gives the total weight the target depends on (S_k, S): no sum pass.
#include "common.cuh"

using namespace cuinfer;

namespace {

constexpr float S_CUT = -32.0f;          // p = 0 below (w would be 0 from s = -21.5 on anyway)
constexpr float W_SCALE = 2147483648.0f;  // 2^31: w <= 2^31, a row of < 2^21 tokens sums below 2^53

__device__ __forceinline__ unsigned order_bits(float x) {
  unsigned b = __float_as_uint(x);
  if (b == 0x80000000u) b = 0u;  // -0 ranks as +0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ unsigned long long rank_key(float x, int i) {
  return (static_cast<unsigned long long>(order_bits(x)) << 32) | (0xffffffffu - static_cast<unsigned>(i));
}

// exp(s) for s in [S_CUT, 0] (Cephes expf), every operation rounded on its own (no FMA contraction),
// as the NumPy reference computes it in float32.
__device__ __forceinline__ float exp_det(float s) {
  const float k = rintf(__fmul_rn(s, 1.44269504088896341f));
  float r = __fsub_rn(s, __fmul_rn(k, 0.693359375f));
  r = __fsub_rn(r, __fmul_rn(k, -2.12194440e-4f));
  const float z = __fmul_rn(r, r);
  float y = 1.9875691500e-4f;
  y = __fadd_rn(__fmul_rn(y, r), 1.3981999507e-3f);
  y = __fadd_rn(__fmul_rn(y, r), 8.3334519073e-3f);
  y = __fadd_rn(__fmul_rn(y, r), 4.1665795894e-2f);
  y = __fadd_rn(__fmul_rn(y, r), 1.6666665459e-1f);
  y = __fadd_rn(__fmul_rn(y, r), 5.0000001201e-1f);
  y = __fadd_rn(__fadd_rn(__fmul_rn(y, z), r), 1.0f);
  return __fmul_rn(y, __int_as_float((127 + static_cast<int>(k)) << 23));  // exact: 2^k, k >= -47
}

struct RowParams {
  float max, tau, min_p;
  float d_cut;  // x - max below it: s < S_CUT for certain (p = 0 without the division)
  unsigned long long keep_from;  // tokens with K >= keep_from pass top-k (and top-p once known)
};

__device__ __forceinline__ float prob(float x, const RowParams& rp) {
  const float d = __fsub_rn(x, rp.max);
  if (!(d >= rp.d_cut)) return 0.0f;  // the same 0 the division would give, cheaper
  const float s = __fdiv_rn(d, rp.tau);
  return s >= S_CUT ? exp_det(s) : 0.0f;  // NaN s (x = -inf = max) gives 0
}
__device__ __forceinline__ unsigned weight(float p) { return static_cast<unsigned>(__fmul_rn(p, W_SCALE)); }

struct Shared {
  unsigned long long w[256];  // weight per digit
  unsigned long long key[256];  // a key in the bin (the only one when c == 1)
  unsigned c[256];  // tokens per digit
  unsigned long long red[32];
  unsigned long long sel_above, sel_key;
  unsigned sel_digit, sel_count;
};

// Sum (or max) of a u64 over the block; every thread gets it.
template <bool MAX>
__device__ __forceinline__ unsigned long long block_reduce_u64(unsigned long long v, Shared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long u = __shfl_xor_sync(0xffffffffu, v, o);
    v = MAX ? (u > v ? u : v) : v + u;
  }
  __syncthreads();
  if (lane == 0) sh.red[warp] = v;
  __syncthreads();
  v = lane < n_warps ? sh.red[lane] : 0ull;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long u = __shfl_xor_sync(0xffffffffu, v, o);
    v = MAX ? (u > v ? u : v) : v + u;
  }
  return v;
}

// Where a select reads its tokens: the row (token j is id j; from shared memory when CACHE) or the
// compacted list of the tokens that may weigh anything (any order: the keys carry the ids).
template <typename T, bool CACHE> struct RowSrc {
  const T* row;
  const float* cache;
  int n;
  __device__ __forceinline__ float x(int j) const {
    if constexpr (CACHE) return cache[j];
    else return to_float(row[j]);
  }
  __device__ __forceinline__ int id(int j) const { return j; }
};
struct ListSrc {
  const float* xs;
  const int* ids;
  int n;
  __device__ __forceinline__ float x(int j) const { return xs[j]; }
  __device__ __forceinline__ int id(int j) const { return ids[j]; }
};

constexpr int LIST_CAP = 2048;  // tokens the compacted list holds (16 KiB of shared memory)

// Mode of a select pass: which tokens weigh what.
enum Mode { COUNT = 0, TOP_P = 1, KEPT = 2 };

template <int MODE>
__device__ __forceinline__ unsigned token_weight(float x, unsigned long long key, const RowParams& rp) {
  if (MODE == COUNT) return 1u;
  if (key < rp.keep_from) return 0u;
  const float p = prob(x, rp);
  if (MODE == KEPT && !(p >= rp.min_p)) return 0u;
  return weight(p);
}

// One histogram pass of the select: the weighted histogram of digit (key >> shift) & 255 over the
// tokens whose key matches `prefix` above bit shift + 8.
template <int MODE, typename Src>
__device__ void histogram(const Src& src, int shift, unsigned long long prefix, const RowParams& rp, Shared& sh) {
  for (int b = threadIdx.x; b < 256; b += blockDim.x) {
    sh.w[b] = 0;
    sh.c[b] = 0;
  }
  __syncthreads();
  const unsigned long long hi_mask = shift >= 56 ? 0ull : (~0ull << (shift + 8));
  const int lane = threadIdx.x & 31;
  for (int base = 0; base < src.n; base += blockDim.x) {  // whole warps iterate together
    const int j = base + threadIdx.x;
    unsigned digit = 256u, w = 0u;
    unsigned long long key = 0;
    if (j < src.n) {
      const float x = src.x(j);
      key = rank_key(x, src.id(j));
      if ((key & hi_mask) == prefix) {
        digit = static_cast<unsigned>(key >> shift) & 255u;
        w = token_weight<MODE>(x, key, rp);
      }
    }
    if (!__any_sync(0xffffffffu, digit < 256u)) continue;  // no token of this warp matches
    const unsigned peers = __match_any_sync(0xffffffffu, digit);
    const unsigned lo = __reduce_add_sync(peers, w & 0xffffu), hi = __reduce_add_sync(peers, w >> 16);
    if (digit < 256u && lane == __ffs(peers) - 1) {
      atomicAdd(&sh.w[digit], (static_cast<unsigned long long>(hi) << 16) + lo);
      atomicAdd(&sh.c[digit], static_cast<unsigned>(__popc(peers)));
      atomicExch(&sh.key[digit], key);  // read only where the bin holds one token (atomic: a bin of
                                        // several has several writers, whichever lands is unused)
    }
  }
  __syncthreads();
}

constexpr unsigned long long NONE = ~0ull;  // select_key's answer for a row of weight 0

// The key of the first token, in descending key order, whose inclusive sum of token_weight<MODE>
// exceeds target_of(W), W the row's total weight (from the first pass's histogram: no separate
// pass); target_of(W) < W. NONE when W = 0.
template <int MODE, typename Src, typename TargetOf>
__device__ unsigned long long select_key(const Src& src, TargetOf target_of, const RowParams& rp, Shared& sh) {
  unsigned long long prefix = 0, above = 0;  // above: the weight of the tokens with keys above the prefix's bin
  unsigned long long target = 0;  // warp 0 only
  for (int shift = 56; shift >= 0; shift -= 8) {
    histogram<MODE>(src, shift, prefix, rp, sh);
    if (threadIdx.x < 32) {  // lane l scans bins 255 - 8l down to 248 - 8l
      const int lane = threadIdx.x;
      unsigned long long total = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) total += sh.w[255 - 8 * lane - j];
      unsigned long long incl = total;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long u = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += u;
      }
      if (shift == 56) {
        const unsigned long long all = __shfl_sync(0xffffffffu, incl, 31);
        if (all == 0) {
          if (lane == 0) {
            sh.sel_count = 1u;
            sh.sel_key = NONE;
          }
        } else {
          target = target_of(all);
        }
      }
      unsigned long long run = above + incl - total;
      if (run <= target && target < run + total) {
        for (int j = 0; j < 8; ++j) {
          const int b = 255 - 8 * lane - j;
          if (target < run + sh.w[b]) {
            sh.sel_digit = b;
            sh.sel_above = run;
            sh.sel_count = sh.c[b];
            sh.sel_key = sh.key[b];
            break;
          }
          run += sh.w[b];
        }
      }
    }
    __syncthreads();
    prefix |= static_cast<unsigned long long>(sh.sel_digit) << shift;
    above = sh.sel_above;
    if (sh.sel_count == 1u) return sh.sel_key;
  }
  return prefix;
}

// top-p, min-p and the pick over the tokens of src (rp.keep_from: the top-k bound); the token's key,
// or NONE for a row of weight 0.
template <typename Src>
__device__ unsigned long long nucleus_pick(const Src& src, RowParams rp, float top_p, float min_p, float u, Shared& sh) {
  if (top_p < 1.0f) {  // X = top_p * S_k; the first token whose inclusive sum reaches X, i.e. exceeds ceil(X) - 1
    const double p = static_cast<double>(top_p);
    const unsigned long long key = select_key<TOP_P>(src, [=](unsigned long long s_k) {
      return static_cast<unsigned long long>(ceil(__dmul_rn(p, static_cast<double>(s_k)))) - 1;
    }, rp, sh);
    if (key != NONE) rp.keep_from = key;
  }
  rp.min_p = min_p;
  const double uu = static_cast<double>(u);
  return select_key<KEPT>(src, [=](unsigned long long s) {
    const unsigned long long t = static_cast<unsigned long long>(floor(__dmul_rn(uu, static_cast<double>(s))));
    return t < s ? t : s - 1;
  }, rp, sh);
}

template <typename T, int THREADS, bool CACHE>
__device__ __forceinline__ void sample_row(const T* __restrict__ row, float* cache, int n, float tau, int top_k,
                                           float top_p, float min_p, float u, int* out) {
  __shared__ Shared sh;
  __shared__ float list_x[LIST_CAP];
  __shared__ int list_id[LIST_CAP];
  __shared__ unsigned list_n;
  // pass 1: the maximum key (argmax), and the row into shared memory when it fits
  unsigned long long best = 0;
  for (int i = threadIdx.x; i < n; i += THREADS) {
    const float x = to_float(row[i]);
    if (CACHE) cache[i] = x;
    const unsigned long long k = rank_key(x, i);
    best = k > best ? k : best;
  }
  best = block_reduce_u64<true>(best, sh);  // the barrier inside also publishes the cache
  if (tau == 0.0f) {
    if (threadIdx.x == 0) *out = static_cast<int>(0xffffffffu - static_cast<unsigned>(best));
    return;
  }
  const RowSrc<T, CACHE> all{row, cache, n};
  RowParams rp;
  const unsigned ob = static_cast<unsigned>(best >> 32);
  rp.max = __uint_as_float((ob & 0x80000000u) ? (ob & 0x7fffffffu) : ~ob);  // order_bits inverted
  rp.tau = tau;
  rp.d_cut = __fmul_rn(-33.0f, tau);
  rp.min_p = 0.0f;
  rp.keep_from = 0;
  if (top_k > 0 && top_k < n) {
    const unsigned long long k1 = static_cast<unsigned long long>(top_k - 1);
    rp.keep_from = select_key<COUNT>(all, [=](unsigned long long) { return k1; }, rp, sh);
  }
  // Only tokens within top-k and with x - max >= d_cut can weigh anything from here on: when they
  // are few, the remaining selects run over a list of them in shared memory (the same keys, so the
  // same answer) instead of the whole row.
  if (threadIdx.x == 0) list_n = 0;
  unsigned long long may = 0;
  for (int i = threadIdx.x; i < n; i += THREADS) {
    const float x = all.x(i);
    may += rank_key(x, i) >= rp.keep_from && __fsub_rn(x, rp.max) >= rp.d_cut;
  }
  unsigned long long key;
  if (block_reduce_u64<false>(may, sh) <= LIST_CAP) {  // barriers inside: list_n = 0 is visible
    for (int i = threadIdx.x; i < n; i += THREADS) {
      const float x = all.x(i);
      if (rank_key(x, i) >= rp.keep_from && __fsub_rn(x, rp.max) >= rp.d_cut) {
        const unsigned j = atomicAdd(&list_n, 1u);
        list_x[j] = x;
        list_id[j] = i;
      }
    }
    __syncthreads();
    const ListSrc list{list_x, list_id, static_cast<int>(list_n)};
    key = nucleus_pick(list, rp, top_p, min_p, u, sh);
  } else {
    key = nucleus_pick(all, rp, top_p, min_p, u, sh);
  }
  if (threadIdx.x == 0) *out = static_cast<int>(0xffffffffu - static_cast<unsigned>(key == NONE ? best : key));
}

}  // namespace

// grid: (rows) · block: THREADS · smem: n floats when CACHE (the row, read once from global), else none
// logits: [rows, n] row-major; temperature, top_p, min_p, uniforms: float [rows]; top_k: int [rows];
// out: int [rows] (may be the decode step's token slots: written after every read of the logits)
template <typename T, int THREADS, bool CACHE>
__global__ void __launch_bounds__(THREADS, 1) sampling_kernel(const T* __restrict__ logits, int n,
                                                           const float* __restrict__ temperature,
                                                           const int* __restrict__ top_k,
                                                           const float* __restrict__ top_p,
                                                           const float* __restrict__ min_p,
                                                           const float* __restrict__ uniforms, int* out) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ float cache_smem[];
  const int r = blockIdx.x;
  sample_row<T, THREADS, CACHE>(logits + static_cast<long long>(r) * n, CACHE ? cache_smem : nullptr, n, temperature[r],
                         top_k[r], top_p[r], min_p[r], uniforms[r], out + r);
}
