// fp8 (e4m3, e5m2) to 16-bit conversion, and fp32 to fp8 (the KV-cache write's quantisation). Every fp8 value is exact in fp16 and in bf16, so widening loses
// nothing; the hardware converts pairs to fp16 (cvt.f16x2.e4m3x2 / e5m2x2 on sm_89+).
#pragma once
#include <cuda_fp8.h>
#include <flashgen/common/mma.cuh>

namespace flashgen {

// two fp8 values (the low 16 bits of `pair`: low byte first) -> a packed pair of T (__half or __nv_bfloat16)
template <typename T, typename FP8>
__device__ __forceinline__ uint32_t fp8x2_to(uint32_t pair) {
  constexpr __nv_fp8_interpretation_t kind = std::is_same_v<FP8, __nv_fp8_e4m3> ? __NV_E4M3 : __NV_E5M2;
  __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(pair & 0xffffu), kind);
  if constexpr (std::is_same_v<T, __half>) {
    return *reinterpret_cast<uint32_t*>(&raw);
  } else {
    const float2 f = __half22float2(*reinterpret_cast<__half2*>(&raw));
    return pack2<T>(f.x, f.y);
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
