// fp8 (e4m3, e5m2) to 16-bit conversion, and fp32 to fp8 (the KV-cache write's quantisation).
//
// Every fp8 value is exact in fp16 and in bf16. e4m3 to fp16 is one cvt a pair (cvt.rn.f16x2.e4m3x2); e5m2 to fp16
// is the top byte of the fp16 as it stands (infinities and NaN included). To bf16 there is no one-instruction cvt
// (cvt goes through fp16 and fp32, three instructions a pair), so the bits move instead: a byte's sign, exponent
// and mantissa land in the bf16's fields with the exponent right-aligned in its field, and one packed multiply by
// 2^(127 - bias8) re-biases the exponent, subnormals included (bf16 arithmetic keeps subnormals); an fp8 NaN or
// infinity comes out as a finite value of its bit pattern there.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <flashgen/common/mma.cuh>

namespace flashgen {

template <typename T> struct Bits16;
template <> struct Bits16<__half> { static constexpr int EXP = 5, BIAS = 15; };
template <> struct Bits16<__nv_bfloat16> { static constexpr int EXP = 8, BIAS = 127; };
template <typename FP8> struct Bits8;
template <> struct Bits8<__nv_fp8_e4m3> { static constexpr int EXP = 4, BIAS = 7; };
template <> struct Bits8<__nv_fp8_e5m2> { static constexpr int EXP = 5, BIAS = 15; };

// bytes I and J of w (fp8) -> a packed pair of T: byte I in the low half, byte J in the high half
template <typename T, typename FP8, int I, int J>
__device__ __forceinline__ uint32_t fp8_pair(uint32_t w) {
  constexpr int SHIFT = Bits16<T>::EXP - Bits8<FP8>::EXP;
  constexpr int SCALE_EXP = Bits16<T>::BIAS - Bits8<FP8>::BIAS;
  if constexpr (std::is_same_v<T, __half> && std::is_same_v<FP8, __nv_fp8_e4m3>) {  // one cvt a pair
    const uint32_t pair = (I == 0 && J == 1) ? w : (I == 2 && J == 3) ? (w >> 16) : __byte_perm(w, 0u, I | (J << 4));
    __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(pair & 0xffffu), __NV_E4M3);
    return *reinterpret_cast<uint32_t*>(&raw);
  }
  const uint32_t h = __byte_perm(w, 0u, 0x0404u | (I << 4) | (J << 12));  // byte I -> bits 8-15, J -> 24-31
  if constexpr (SCALE_EXP == 0) {
    return h;
  } else {
    const uint32_t r = (h & 0x80008000u) | ((h & 0x7F007F00u) >> SHIFT);
    constexpr uint32_t scale = uint32_t(Bits16<T>::BIAS + SCALE_EXP) << (15 - Bits16<T>::EXP);  // 2^SCALE_EXP
    if constexpr (std::is_same_v<T, __half>) {
      const __half2 y = __hmul2(*reinterpret_cast<const __half2*>(&r), __half2(__half_raw{uint16_t(scale)}, __half_raw{uint16_t(scale)}));
      return *reinterpret_cast<const uint32_t*>(&y);
    } else {
      const __nv_bfloat162 y = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&r),
                                       __nv_bfloat162(__nv_bfloat16_raw{uint16_t(scale)}, __nv_bfloat16_raw{uint16_t(scale)}));
      return *reinterpret_cast<const uint32_t*>(&y);
    }
  }
}

// 16 floats -> 16 fp8 values (one 16-byte chunk), each rounded to nearest even and saturated to the largest
// finite value (cvt.rn.satfinite on sm_89+, the same rounding in software before)
template <typename FP8>
__device__ __forceinline__ uint4 fp8x16_narrow(const float* x) {
  constexpr __nv_fp8_interpretation_t kind = std::is_same_v<FP8, __nv_fp8_e4m3> ? __NV_E4M3 : __NV_E5M2;
  uint4 out;
  __nv_fp8x2_storage_t* pairs = reinterpret_cast<__nv_fp8x2_storage_t*>(&out);
#pragma unroll
  for (int i = 0; i < 8; ++i) pairs[i] = __nv_cvt_float2_to_fp8x2(make_float2(x[2 * i], x[2 * i + 1]), __NV_SATFINITE, kind);
  return out;
}

}  // namespace flashgen
