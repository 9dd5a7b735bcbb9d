// 16-byte vectors of fp16 / bf16 / fp32 elements, loaded and stored in one instruction, computed in fp32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace flashgen {

template <typename T>
struct Vec16 {
  static constexpr int N = 16 / sizeof(T);
  float v[N];

  __device__ __forceinline__ void load(const T* ptr) { convert(*reinterpret_cast<const uint4*>(ptr)); }

  __device__ __forceinline__ void convert(const uint4& raw) {
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = to_float(e[i]);
  }

  __device__ __forceinline__ void store(T* ptr) const {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i) e[i] = from_float(v[i]);
    *reinterpret_cast<uint4*>(ptr) = raw;
  }

  __device__ __forceinline__ void fill(float x) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = x;
  }

  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ T from_float(float x) {
    if constexpr (sizeof(T) == 4) return x;
    else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(x);
    else return __float2bfloat16_rn(x);
  }
};

}  // namespace flashgen
