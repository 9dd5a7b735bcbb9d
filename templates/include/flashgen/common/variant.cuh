// User-defined attention variants: the helpers a hook may call and the view of a declared tensor.
// Integer // and % floor as Python's do (C truncates); fg_pow on ints is exponentiation by squaring
// (a negative exponent gives 0, where Python would give a float).
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>

namespace flashgen {
namespace variant {

constexpr int TILE_EMPTY = 0;    // every pair of the tile masked: the tile is skipped
constexpr int TILE_PARTIAL = 1;  // evaluate the mask per pair
constexpr int TILE_FULL = 2;     // every pair kept: the tile runs unmasked

// A declared tensor: base pointer and element strides; t(i) / t(i, j) / ... read one element, t[i] for rank 1.
template <typename T, int RANK>
struct Tensor {
  const T* data;
  int64_t stride[RANK];

  template <typename... I>
  __device__ __forceinline__ T operator()(I... index) const {
    static_assert(sizeof...(I) == RANK, "a declared tensor takes one index per dimension");
    const long long idx[] = {static_cast<long long>(index)...};
    long long offset = 0;
#pragma unroll
    for (int d = 0; d < RANK; ++d) offset += idx[d] * stride[d];
    return data[offset];
  }
  __device__ __forceinline__ T operator[](long long i) const {
    static_assert(RANK == 1, "t[i] indexes a rank-1 tensor; use t(i, j, ...)");
    return data[i * stride[0]];
  }
};

}  // namespace variant
}  // namespace flashgen

__device__ __forceinline__ long long fg_floordiv(long long a, long long b) {
  long long q = a / b;
  return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ float fg_floordiv(float a, float b) { return floorf(a / b); }
__device__ __forceinline__ long long fg_mod(long long a, long long b) {
  long long r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
__device__ __forceinline__ float fg_mod(float a, float b) { return a - b * floorf(a / b); }
__device__ __forceinline__ long long fg_pow(long long a, long long e) {
  if (e < 0) return 0;
  long long r = 1;
  for (; e; e >>= 1, a *= a)
    if (e & 1) r *= a;
  return r;
}
__device__ __forceinline__ float fg_pow(float a, float b) { return powf(a, b); }
__device__ __forceinline__ long long fg_min(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ float fg_min(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ long long fg_max(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ float fg_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ long long fg_abs(long long a) { return a < 0 ? -a : a; }
__device__ __forceinline__ float fg_abs(float a) { return fabsf(a); }
__device__ __forceinline__ float fg_sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }
