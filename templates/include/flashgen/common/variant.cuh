// User-defined attention variants: the helpers a hook may call and the view of a declared tensor.
// Integer // and % floor as Python's do (C truncates); fg_pow on ints is exponentiation by squaring
// (a negative exponent gives 0, where Python would give a float).
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <type_traits>

namespace flashgen {
namespace variant {

constexpr int TILE_EMPTY = 0;    // every pair of the tile masked: the tile is skipped
constexpr int TILE_PARTIAL = 1;  // evaluate the mask per pair
constexpr int TILE_FULL = 2;     // every pair kept: the tile runs unmasked

// One element of a declared tensor by ld.global.nc. No kernel writes a declared tensor, so the load is stated as
// a pure function of its address (asm without volatile or a memory clobber). Loads of one address in straight-line
// code are merged by ptxas (a per-row value, slopes[qo_head] or doc_ids[qo_idx], read once for the pairs of a row),
// though the arithmetic on them is kept once a call, where a plain load would let cicc fold it too (nvcc 13.0:
// benchmarks/experiments/exp_load_cse.py); loads under a branch or a predicate a pair stay one a pair.
template <typename T>
__device__ __forceinline__ T load_input(const T* ptr) {
  if constexpr (sizeof(T) == 1) {  // bool, uint8_t
    uint32_t v;
    asm("ld.global.nc.u8 %0, [%1];" : "=r"(v) : "l"(ptr));
    if constexpr (std::is_same_v<T, bool>) return v != 0;
    else return static_cast<T>(v);
  } else if constexpr (sizeof(T) == 2) {  // __half, __nv_bfloat16
    unsigned short v;
    asm("ld.global.nc.b16 %0, [%1];" : "=h"(v) : "l"(ptr));
    if constexpr (std::is_same_v<T, __half>) return __ushort_as_half(v);
    else return __ushort_as_bfloat16(v);
  } else if constexpr (sizeof(T) == 4) {  // int32_t, float
    uint32_t v;
    asm("ld.global.nc.b32 %0, [%1];" : "=r"(v) : "l"(ptr));
    if constexpr (std::is_same_v<T, float>) return __uint_as_float(v);
    else return static_cast<T>(v);
  } else {  // int64_t
    static_assert(sizeof(T) == 8 && std::is_integral_v<T>, "a declared tensor's element: bool, uint8, int32, int64, "
                  "float16, bfloat16 or float32");
    unsigned long long v;
    asm("ld.global.nc.b64 %0, [%1];" : "=l"(v) : "l"(ptr));
    return static_cast<T>(v);
  }
}

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
    return load_input(data + offset);
  }
  __device__ __forceinline__ T operator[](long long i) const {
    static_assert(RANK == 1, "t[i] indexes a rank-1 tensor; use t(i, j, ...)");
    return load_input(data + i * stride[0]);
  }
};

// The hooks of a kernel without a variant: every flag off (the kernels test the flags with if constexpr, so a
// kernel without a variant compiles to the same code as before variants existed). A rendered variant defines
// flashgen_variant::Hooks with the same flags and a static member per given hook (kernels/variant.py). HEAVY: the
// pair hooks inline enough code that a kernel runs them from as few sites as it can (heavy_pair_hooks).
struct NoHooks {
  static constexpr bool ANY = false, HEAVY = false, DISTANCE = false, SCORE = false, MASK = false, MASK_TILE = false,
                        Q_TRANSFORM = false, K_TRANSFORM = false, OUTPUT = false, SINK = false, SOFTMAX = true;
};

// The pair hooks' distance kv_idx - qo_idx as a float, where a pair hook reads it (V::DISTANCE; else 0, never
// read). pair_distance: a row's part (its first key's offset from the query, converted once a tile a row) plus
// the key's offset from that first key (a constant of the unrolled loop): one FADD a pair, no I2F. Exact while
// both parts and the sum are below 2^24 in magnitude; beyond, within about an ulp. distance_at: one conversion
// a pair, for the paths that read each key's position (explicit positions) or that are not hot.
template <class V>
__device__ __forceinline__ float row_distance(int first_key, int qo_idx) {
  return V::DISTANCE ? static_cast<float>(first_key - qo_idx) : 0.f;
}
template <class V>
__device__ __forceinline__ float pair_distance(float row, int key_offset) {
  return V::DISTANCE ? row + static_cast<float>(key_offset) : 0.f;
}
template <class V>
__device__ __forceinline__ float distance_at(int qo_idx, int kv_idx) {
  return V::DISTANCE ? static_cast<float>(kv_idx - qo_idx) : 0.f;
}

// One contract for every kernel family. A pair (query qo_idx, key kv_idx) of request `batch`, query head qo_head
// and kv head kv_head, with logit x = q.k * sm_scale in natural-log units (after the spec's ALiBi and soft-cap):
// the mask hook first (a masked pair is -inf, or weight 0 without softmax, and its score is never computed), then
// the score hook. The caller converts the result to its own units (base 2 for the softmax kernels).
// P: the kernel's params (their `variant` field, present when V::ANY, is read in the hooks' branches only).
// distance: kv_idx - qo_idx as a float (pair_distance / distance_at; read by the hooks only where V::DISTANCE).
// use_mask: false on a tile the tile predicate called TILE_FULL (every pair kept).
template <class V, class P>
__device__ __forceinline__ float pair_logit(const P& p, float x, int batch, int qo_idx, int kv_idx, int qo_head,
                                            int kv_head, float distance, bool use_mask = true) {
  if constexpr (V::MASK) {
    if (use_mask && !V::mask(p.variant, batch, qo_idx, kv_idx, qo_head, kv_head, distance))
      return V::SOFTMAX ? -INFINITY : 0.f;
  }
  if constexpr (V::SCORE) x = V::score(p.variant, x, batch, qo_idx, kv_idx, qo_head, kv_head, distance);
  return x;
}

// pair_logit evaluated whether or not the pair is hidden, then selected: a hidden pair gives -inf (weight 0
// without softmax). Evaluated on every pair of a row, a hook's loads that depend on the row alone (slopes[qo_head],
// prefix_len[batch], doc_ids[qo_idx]) become common to the row's pairs and are read once a tile (under a branch a
// pair, they were read pair by pair). The caller passes a key of the request for a pair past its keys, so that
// the hooks only ever see real pairs; what they return for a hidden pair is discarded (its distance may be the
// unclamped key's).
template <class V, class P>
__device__ __forceinline__ float pair_value(const P& p, bool hidden, float x, int batch, int qo_idx, int kv_idx,
                                            int qo_head, int kv_head, float distance, bool use_mask = true) {
  const float y = pair_logit<V>(p, x, batch, qo_idx, kv_idx, qo_head, kv_head, distance, use_mask);
  return hidden ? (V::SOFTMAX ? -INFINITY : 0.f) : y;
}

// The class of a tile of pairs, queries [qo_begin, qo_end) of q heads qo_head0 .. qo_head0 + heads - 1, keys
// [kv_begin, kv_end), by the tile predicate: TILE_EMPTY (skipped) or TILE_FULL (no per-pair mask) where it says
// so for every one of the heads, else TILE_PARTIAL (always, without a predicate).
template <class V, class P>
__device__ __forceinline__ int tile_class(const P& p, int batch, int qo_head0, int heads, int kv_head, int qo_begin,
                                          int qo_end, int kv_begin, int kv_end) {
  if constexpr (V::MASK_TILE) {
    int lo = TILE_FULL, hi = TILE_EMPTY;
    for (int h = 0; h < heads; ++h) {
      const int c = V::mask_tile(p.variant, batch, qo_head0 + h, kv_head, qo_begin, qo_end, kv_begin, kv_end);
      lo = c < lo ? c : lo;
      hi = c > hi ? c : hi;
    }
    return lo == hi ? lo : TILE_PARTIAL;
  } else {
    return TILE_PARTIAL;
  }
}

// The sink of a finished softmax row: a logit s that takes probability mass but carries no value (gpt-oss). A
// row normalised over its keys, with log-sum-exp lse (natural log; -inf for no visible key), is scaled by
// exp(lse) / (exp(lse) + exp(s)) and its lse becomes log(exp(lse) + exp(s)). Returns the factor; updates lse.
__device__ __forceinline__ float sink_row(float sink, float& lse) {
  const float factor = __fdividef(1.f, 1.f + expf(sink - lse));  // lse = -inf: 0
  const float hi = fmaxf(lse, sink);
  lse = hi + log1pf(expf(fminf(lse, sink) - hi));
  return factor;
}

// The factor a finished row's normalised output takes for the variant's sink (1 without one), its lse updated
// (sink_row); the sink of (batch, qo_idx, qo_head).
template <class V, class P>
__device__ __forceinline__ float sink_factor(const P& p, float& lse, int batch, int qo_idx, int qo_head) {
  if constexpr (V::SINK) return sink_row(V::sink(p.variant, batch, qo_idx, qo_head), lse);
  else return 1.f;
}

// One element of q (column dim of query qo_idx, head qo_head) through the q_transform hook, as it is loaded: the raw
// element (an fp32 value of q's dtype), before the spec's RoPE and before sm_scale (unchanged without a hook).
template <class V, class P>
__device__ __forceinline__ float q_value(const P& p, float x, int batch, int qo_idx, int qo_head, int dim) {
  if constexpr (V::Q_TRANSFORM) return V::q_transform(p.variant, x, batch, qo_idx, qo_head, dim);
  else return x;
}

// One element of k (column dim of key kv_idx, kv head kv_head) through the k_transform hook, as it is loaded: the
// raw element (fp8 K dequantised: the code times k_scale), before the spec's RoPE (unchanged without a hook).
template <class V, class P>
__device__ __forceinline__ float k_value(const P& p, float x, int batch, int kv_idx, int kv_head, int dim) {
  if constexpr (V::K_TRANSFORM) return V::k_transform(p.variant, x, batch, kv_idx, kv_head, dim);
  else return x;
}

// One element (column dim) of a finished, normalised output row through the output hook (unchanged without one).
template <class V, class P>
__device__ __forceinline__ float output_value(const P& p, float x, int batch, int qo_idx, int qo_head, int dim) {
  if constexpr (V::OUTPUT) return V::output(p.variant, x, batch, qo_idx, qo_head, dim);
  else return x;
}

}  // namespace variant
}  // namespace flashgen

// a traced hook's `a & b` / `a | b` on bools: both operands evaluated, as in Python (&& and || would put a load of
// the right one under a branch a pair, where it cannot be merged with its row's)
__device__ __forceinline__ bool fg_and(bool a, bool b) { return a & b; }
__device__ __forceinline__ bool fg_or(bool a, bool b) { return a | b; }
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
// min, max and abs of ints in 32 bits where a traced hook's values provably fit them (trace.py _Emitter)
__device__ __forceinline__ int fg_min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int fg_max(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ int fg_abs(int a) { return a < 0 ? -a : a; }
__device__ __forceinline__ long long fg_min(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ float fg_min(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ long long fg_max(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ float fg_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ long long fg_abs(long long a) { return a < 0 ? -a : a; }
__device__ __forceinline__ float fg_abs(float a) { return fabsf(a); }
// sigmoid(x) = (1 + tanh(x / 2)) / 2 by tanh.approx (one MUFU op, relative error ~2^-11): 1 / (1 + e^-x) took
// two (ex2, rcp), and with them the Hopper consumers' registers spilled 160 bytes under softmax=False
__device__ __forceinline__ float fg_sigmoid(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(0.5f * x));
  return fmaf(0.5f, y, 0.5f);
}
