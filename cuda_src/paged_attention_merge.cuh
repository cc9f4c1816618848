// The split-K merge of paged_attention.cu (which includes it ahead of its kernel).
#pragma once

#include "common.cuh"

using namespace cuinfer;

// The split-K epilogue, called by every thread of a CTA after it wrote its partials (n_splits > 1).
// The CTA that arrives last on *arrival merges its group's heads into out and resets *arrival to 0
// for the next launch: out = sum_s w_s part_out_s / sum_s w_s over the n_live splits that hold rows
// of the context (the others neither write partials nor arrive), w_s = sum_s * exp2(max_s - max).
// Release: the CTA's writes, bar.sync, then thread 0's atomic with acq_rel semantics at gpu scope
// (cumulative: it releases what the barrier ordered before it; two __threadfence() around a relaxed
// atomic cost ~0.6 us a call more, docs/decode.md);
// acquire: the same atomic in the last CTA, then bar.sync. Other CTAs' partials are read with
// ld.global.cg (L2, never a stale L1 line). Each thread merges 4 columns of one head on its own, CH
// splits at a time: their (max, sum) pairs and partial outputs are loaded together (one round trip
// per CH splits), the running sum rescaled by the new maximum (online softmax).
template <typename T, int D>
__device__ __forceinline__ void merge_if_last(const float* part_out, const float* part_ml, int* arrival, T* out,
                                              size_t head0, int group, int n_splits, int n_live) {
  constexpr int C = D / 4, CH = 8;  // float4 columns of a head, splits per round trip
  __syncthreads();  // the CTA's partials are written
  int last = 0;
  if (threadIdx.x == 0) {
    int before;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(arrival) : "memory");
    last = before == n_live - 1;
    if (last) *arrival = 0;  // every split has arrived: nothing else touches it in this launch
  }
  if (!__syncthreads_or(last)) return;

  for (int i = threadIdx.x; i < group * C; i += blockDim.x) {
    const int g = i / C, c = i % C;
    const float2* ml = reinterpret_cast<const float2*>(part_ml) + (head0 + g) * n_splits;
    const float4* po = reinterpret_cast<const float4*>(part_out + (head0 + g) * n_splits * D) + c;
    float m = Max::identity(), l = 0.0f, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s0 = 0; s0 < n_live; s0 += CH) {
      float2 x[CH];
      float4 pv[CH];
#pragma unroll
      for (int j = 0; j < CH; ++j) {
        const bool ok = s0 + j < n_live;
        x[j] = ok ? __ldcg(ml + s0 + j) : make_float2(0.0f, 0.0f);
        pv[j] = ok ? __ldcg(po + (size_t)(s0 + j) * C) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
      float mb = m;
#pragma unroll
      for (int j = 0; j < CH; ++j)
        if (x[j].y > 0.0f) mb = fmaxf(mb, x[j].x);
      if (mb == Max::identity()) continue;  // every split so far is empty
      const float r = exp2f(m - mb);        // 0 while m is the identity (acc, l are 0 then)
      l *= r;
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] *= r;
#pragma unroll
      for (int j = 0; j < CH; ++j) {
        const float w = x[j].y > 0.0f ? x[j].y * exp2f(x[j].x - mb) : 0.0f;
        l += w;
        acc[0] = fmaf(w, pv[j].x, acc[0]);
        acc[1] = fmaf(w, pv[j].y, acc[1]);
        acc[2] = fmaf(w, pv[j].z, acc[2]);
        acc[3] = fmaf(w, pv[j].w, acc[3]);
      }
      m = mb;
    }
    VecF<T, 4> o;  // l is 0 only when the whole context is empty: zeros
#pragma unroll
    for (int e = 0; e < 4; ++e) o.v[e] = l > 0.0f ? acc[e] / l : 0.0f;
    o.to().store(out + (head0 + g) * D + c * 4);
  }
}
