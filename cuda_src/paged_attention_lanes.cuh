// The lane loops' helpers of paged_attention.cu (which includes it ahead of its kernel, after load_kv):
// a row of D elements on KL lanes of 16-byte chunks, U rows a lane in flight.
#pragma once

// Sums v over the lanes that differ in the lane bits OFF << l (UP) or OFF >> l, l = 0 .. LEVELS - 1, and
// scatters the sums: at each level the lanes with that bit set keep the upper half of the values, the
// others the lower half, adding the half their partner sends (N / 2 + N / 4 + ... shuffles instead of
// N per level). Afterwards v[0 .. N >> LEVELS) holds the sums of values base .. base + (N >> LEVELS),
// base the return value.
template <int N, int LEVELS, int OFF, bool UP>
__device__ __forceinline__ int reduce_scatter(float (&v)[N], int lane) {
  if constexpr (LEVELS == 0) {
    return 0;
  } else {
    constexpr int half = N / 2;
    static_assert(half >= 1, "more levels than values");
    const bool upper = lane & OFF;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? v[i] : v[i + half];
      v[i] = (upper ? v[i + half] : v[i]) + __shfl_xor_sync(0xffffffffu, send, OFF);
    }
    constexpr int next = UP ? OFF * 2 : OFF / 2;
    return (upper ? half : 0) + reduce_scatter<half, LEVELS - 1, next, UP>(reinterpret_cast<float (&)[half]>(v), lane);
  }
}

// row(chunk, t) for the rows t = base + u * STEP + sub of a lane, base = base0, base0 + STEP * U, ...
// while base < end (rows past end: row() weighs them by 0, so they must be finite; the cache path
// reads the clamped row, the stage gives zeros): with `staged` (one loop step) the chunks the lane
// copied to stage[u * THREADS] (u < US; read where used), else from the cache, U rows loaded
// before the first is used.
template <typename T, typename C, int U, int STEP, int THREADS, bool COHERENT, typename Offset, typename Row>
__device__ __forceinline__ void for_each_row(bool staged, const typename KvChunk<T, C>::Raw* stage, int US, int base0,
                                             int sub, int end, const C* cache, Offset offset_of, Row row) {
  if (staged) {
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (u < US) {  // rows past end get zeros: their slot may hold the new row as it was before its write
        const int t = base0 + u * STEP + sub;
        row(t < end ? KvChunk<T, C>::decode(stage[u * THREADS]) : Vec<T, 8>{}, t);
      }
    return;
  }
  for (int base = base0; base < end; base += STEP * U) {  // warp-uniform loop
    typename KvChunk<T, C>::Raw r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = load_kv<COHERENT, T>(cache + offset_of(base + u * STEP + sub));
#pragma unroll
    for (int u = 0; u < U; ++u) row(KvChunk<T, C>::decode(r[u]), base + u * STEP + sub);
  }
}
