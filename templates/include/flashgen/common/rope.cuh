// Rotary position embedding math (Llama halves: the pair (x[i], x[i + dim/2]) turns by pos * f_i), shared by the
// attention kernels (q and K rotated on the fly) and the KV-cache write (K rotated on the way into its page).
//   f_i = theta^(-2i/dim)                     (rope_inv_freq; `rope_log2_theta` = log2(theta))
//   scaled: f_i -> (1 - s) f_i / factor + s f_i, s = clamp(f_i a + i c + b, 0, 1)   (rope_scaled_freq)
//     Llama-3.1: c = 0 (a blend by wavelength); YaRN: a = 0 (a ramp over the index i); factor 1, a 0, b 1, c 0
//     give f_i back exactly, so one code path serves plain RoPE too (spec/parts.py: rope_terms)
//   angle = pos / scale * f_i                 (`rope_rcp_scale` = 1 / scale)
//   YaRN's attention factor multiplies the rotated pair (cos and sin) by `rope_mscale` (1 otherwise).
#pragma once
#include <cmath>
#include <cstdint>
#include <flashgen/common/mma.cuh>  // pack2, unpack2

namespace flashgen {

// sine and cosine of an angle x = pos * f: x reduced to [-pi, pi] by 2 pi round(x / 2 pi) in two FMAs (2 pi as an
// fp32 head and tail, the product exact inside each FMA), then the MUFU approximations (absolute error ~4e-7 on that
// range). x itself carries |x| 2^-24 of rounding, more than that at any position past ~10, so this is as accurate
// as sincosf here at ~10 instructions against its ~40 (its reduction and polynomials): the rotation's cost in
// every kernel that turns q or K (the portable prefill turns each K tile for every q tile reading it).
__device__ __forceinline__ void rope_sincos(float x, float* s, float* c) {
  const float k = rintf(x * 0.159154943091895336f);  // 1 / 2 pi
  float r = fmaf(-k, 6.28318548202514648f, x);       // 2 pi rounded to fp32 (its head) ...
  r = fmaf(-k, -1.74845553e-07f, r);                 // ... and what that rounding left out (its tail)
  __sincosf(r, s, c);
}

// LIBM: libm's sincosf instead. Decode keeps it: at head_dim 256 with fp8 K turned as it is read and the fused
// append, the reduced form's temporaries spill (8 bytes at 255 registers, sm_90a); decode reads at the copy rate.
template <bool LIBM>
__device__ __forceinline__ void rope_sincos_by(float x, float* s, float* c) {
  if constexpr (LIBM) sincosf(x, s, c);
  else rope_sincos(x, s, c);
}

__device__ __forceinline__ float rope_inv_freq(int i, int dim, float rope_log2_theta) {
  return exp2f(-2.f * float(i) / float(dim) * rope_log2_theta);
}

__device__ __forceinline__ float rope_scaled_freq(float inv_freq, int i, float rcp_factor, float smooth_a,
                                                  float smooth_b, float smooth_c) {
  const float s = fminf(fmaxf(inv_freq * smooth_a + float(i) * smooth_c + smooth_b, 0.f), 1.f);
  return (1.f - s) * inv_freq * rcp_factor + s * inv_freq;
}

// the angle per unit of position of the pair (x[i], x[i + dim/2]): f_i / scale, with the params' scaling where
// SCALED (rope_cos_sin_by's angle is pos times this; its attention factor is the caller's)
template <bool SCALED, class Params>
__device__ __forceinline__ float rope_angle_rate(int i, int dim, const Params& p) {
  float f = rope_inv_freq(i, dim, p.rope_log2_theta);
  if constexpr (SCALED) f = rope_scaled_freq(f, i, p.rope_rcp_factor, p.rope_smooth_a, p.rope_smooth_b, p.rope_smooth_c);
  return p.rope_rcp_scale * f;
}

// (lo, hi) turned by the angle whose cosine and sine are c and s
__device__ __forceinline__ void rope_pair(float& lo, float& hi, float c, float s) {
  const float x1 = lo, x2 = hi;
  lo = x1 * c - x2 * s;
  hi = x2 * c + x1 * s;
}

// the cosine and sine of the angle pos * theta^(-2i/dim) of the pair (x[i], x[i + dim/2])
template <bool LIBM = false>
__device__ __forceinline__ void rope_cos_sin(float& c, float& s, float pos, int i, int dim, float rope_rcp_scale,
                                             float rope_log2_theta) {
  const float inv_freq = rope_inv_freq(i, dim, rope_log2_theta);
  rope_sincos_by<LIBM>(pos * rope_rcp_scale * inv_freq, &s, &c);
}

// the same with the params' scaling (rope_rcp_factor, rope_smooth_a/b/c), times the attention factor (rope_mscale)
template <bool LIBM = false, class Params>
__device__ __forceinline__ void rope_cos_sin_scaled(float& c, float& s, float pos, int i, int dim, const Params& p) {
  const float f = rope_scaled_freq(rope_inv_freq(i, dim, p.rope_log2_theta), i, p.rope_rcp_factor, p.rope_smooth_a,
                                   p.rope_smooth_b, p.rope_smooth_c);
  rope_sincos_by<LIBM>(pos * p.rope_rcp_scale * f, &s, &c);
  c *= p.rope_mscale;
  s *= p.rope_mscale;
}

// an attention kernel's cosine and sine: scaled where its spec's RoPE has a scaling (SCALED), plain otherwise;
// one angle can turn two rows at the same position (the fused append's new key beside q); LIBM: rope_sincos_by
template <bool SCALED, bool LIBM = false, class Params>
__device__ __forceinline__ void rope_cos_sin_by(float& c, float& s, float pos, int i, int dim, const Params& p) {
  if constexpr (SCALED) rope_cos_sin_scaled<LIBM>(c, s, pos, i, dim, p);
  else rope_cos_sin<LIBM>(c, s, pos, i, dim, p.rope_rcp_scale, p.rope_log2_theta);
}

// rotates the pair (x[i], x[i + dim/2]) by pos * theta^(-2i/dim)
__device__ __forceinline__ void rope_rotate(float& lo, float& hi, float pos, int i, int dim, float rope_rcp_scale,
                                            float rope_log2_theta) {
  float c, s;
  rope_cos_sin(c, s, pos, i, dim, rope_rcp_scale, rope_log2_theta);
  rope_pair(lo, hi, c, s);
}

// the same with the params' scaling and attention factor
template <class Params>
__device__ __forceinline__ void rope_rotate_scaled(float& lo, float& hi, float pos, int i, int dim, const Params& p) {
  float c, s;
  rope_cos_sin_scaled(c, s, pos, i, dim, p);
  rope_pair(lo, hi, c, s);
}

// an attention kernel's rotation (rope_cos_sin_by's angle)
template <bool SCALED, bool LIBM = false, class Params>
__device__ __forceinline__ void rope_rotate_by(float& lo, float& hi, float pos, int i, int dim, const Params& p) {
  float c, s;
  rope_cos_sin_by<SCALED, LIBM>(c, s, pos, i, dim, p);
  rope_pair(lo, hi, c, s);
}

// 8 + 8 elements in 16-bit storage (T), the halves of RoPE pairs i0 .. i0 + 7 and their partners i + dim/2, turned
// in place by rope_rotate_by's angle at `pos`
template <typename T, bool SCALED, class Params>
__device__ __forceinline__ void rope_chunk_pair(uint4& a, uint4& b, float pos, int i0, int dim, const Params& p) {
  uint32_t* aw = reinterpret_cast<uint32_t*>(&a);
  uint32_t* bw = reinterpret_cast<uint32_t*>(&b);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 x = unpack2<T>(aw[i]), y = unpack2<T>(bw[i]);
    rope_rotate_by<SCALED>(x.x, y.x, pos, i0 + 2 * i, dim, p);
    rope_rotate_by<SCALED>(x.y, y.y, pos, i0 + 2 * i + 1, dim, p);
    aw[i] = pack2<T>(x.x, x.y);
    bw[i] = pack2<T>(y.x, y.y);
  }
}

}  // namespace flashgen
