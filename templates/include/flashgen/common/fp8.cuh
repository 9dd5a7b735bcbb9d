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

// K: the B fragments (b0, b1) of one n-tile and k-step from one ldmatrix register of an fp8 K tile (lane (g, t4)
// holds columns 4 t4 .. 4 t4 + 3 of key g; they take the mma's slots 2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9, and Q is
// staged in that column order: decode/tiles.cuh fp8_k_slot, prefill/tiles.cuh load_q_fp8)
template <typename T, typename FP8>
__device__ __forceinline__ void fp8_k_frag(uint32_t word, uint32_t& b0, uint32_t& b1) {
  b0 = fp8_pair<T, FP8, 0, 1>(word);
  b1 = fp8_pair<T, FP8, 2, 3>(word);
}

// V: from the ldmatrix.trans registers of keys 0-7 (lo) and 8-15 (hi) of one 16-byte column chunk, the B
// fragments of the chunk's even columns (n-tile 2c: bytes 0 and 2, keys 2 t4 and 2 t4 + 1) and odd columns
// (n-tile 2c + 1: bytes 1 and 3); the epilogue puts the columns back in order
template <typename T, typename FP8>
__device__ __forceinline__ void fp8_v_frags(uint32_t lo, uint32_t hi, uint32_t (&even)[2], uint32_t (&odd)[2]) {
  even[0] = fp8_pair<T, FP8, 0, 2>(lo);
  odd[0] = fp8_pair<T, FP8, 1, 3>(lo);
  even[1] = fp8_pair<T, FP8, 0, 2>(hi);
  odd[1] = fp8_pair<T, FP8, 1, 3>(hi);
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
