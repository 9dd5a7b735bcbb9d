// Logits transforms and positional encodings, in the order of flashgen.testing.reference:
//   RoPE on q and k  ->  x = q.k * sm_scale  ->  + ALiBi slope * (k_pos - q_pos)  ->  soft-cap  ->  mask.
// Kernels work in base 2: the transformed logit is multiplied by log2(e) before exp2.
#pragma once
#include <cmath>
#include <flashgen/common/rope.cuh>  // rope_rotate

namespace flashgen {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// 2^x by ex2.approx.ftz (exp2f wraps the same instruction in a denormal range fix-up); 2^-inf = 0
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x by rcp.approx.ftz (within an ulp; the IEEE division's slow-path branches avoided)
__device__ __forceinline__ float rcp_fast(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

// ALiBi slope of q head `head` out of `num_heads` (Press et al.; also for head counts not a power of two).
__device__ __forceinline__ float alibi_slope(int head, int num_heads) {
  const int n = 1 << (31 - __clz(num_heads));  // largest power of two <= num_heads
  if (head < n) return exp2f(-8.f * float(head + 1) / float(n));
  return exp2f(-8.f * float(2 * (head - n) + 1) / float(2 * n));
}

template <bool ALIBI, bool SOFT_CAP>
struct LogitsTransform {
  float sm_scale, soft_cap, rcp_soft_cap, slope;

  // score: raw q.k; dist = k_pos - q_pos; returns the base-2 logit
  __device__ __forceinline__ float operator()(float score, int dist) const {
    if constexpr (!ALIBI && !SOFT_CAP) return score * (sm_scale * LOG2E);
    float x = score * sm_scale;
    if constexpr (ALIBI) x += slope * float(dist);
    if constexpr (SOFT_CAP) x = soft_cap * tanhf(x * rcp_soft_cap);
    return x * LOG2E;
  }
  // the same logit in natural-log units (what a variant's hooks see)
  __device__ __forceinline__ float natural(float score, int dist) const {
    float x = score * sm_scale;
    if constexpr (ALIBI) x += slope * float(dist);
    if constexpr (SOFT_CAP) x = soft_cap * tanhf(x * rcp_soft_cap);
    return x;
  }
};

}  // namespace flashgen
