// The K pre-pass of the Hopper prefill (RoPE over unrotated K, variants with a k_transform, fp8 K/V): from any KV layout into
// ragged scratch tensors, which the sm90 kernel then reads as a ragged batch with neither: each request's K through
// the variant's k_transform (C::Variant::K_TRANSFORM, each element as it is read: common/variant.cuh k_value) and,
// with C::ROPE, rotated by its key position (C::ROPE_SCALING: Llama-3.1 / YaRN frequencies, common/rope.cuh); V
// copied; with C::ROPE also q, through the q_transform and rotated by
// its query position (without RoPE the caller passes total_q = 0: q is not copied and the kernel runs its own
// q_transform). So a hook runs once an element, not once for every q tile that reads the key. One thread a chunk
// of VEC rotation pairs (x[i], x[i + D/2]), i = i0 .. i0 + VEC - 1, of one row and head: a 16-byte load and store
// of each half (Llama halves, logits.cuh's rope_rotate); a K chunk's thread also copies V's two 16-byte chunks.
//   flat index j < total_q * Hq * CHUNKS:        q token, q head, chunk (CHUNKS = D / 2 / VEC)
//   then j < ... + total_kv_out * Hkv * CHUNKS:  kv token of the scratch, kv head, chunk
// Query position: kv_len - qo_len + (token - qo_indptr[b]); key position: token - kv_out_indptr[b]. With
// C::POSITIONS (common/positions.cuh): q_pos[token], and key t of request b at its kv_page_pos entry + offset,
// which the thread of pair 0, head 0 also writes to kv_pos_out[token of the scratch]. The hooks see those
// positions (batch: the request b). fp8 K/V (C::DTypeKV) go into the 16-bit scratch: K exactly as it is (k_scale
// stays in sm_scale), or, under a k_transform, times k_scale before the hook (which sees the dequantised element;
// the host then leaves k_scale out of sm_scale); V times v_scale, rounded once to DType.
#pragma once
#include <flashgen/common/kv_rows.cuh>
#include <flashgen/common/logits.cuh>
#include <flashgen/common/positions.cuh>
#include <flashgen/common/fp8.cuh>
#include <flashgen/common/variant.cuh>
#include <flashgen/common/vec.cuh>

namespace flashgen {

// VEC elements of the cache at ptr as floats: 16-bit ones as they are, fp8 (8 bytes) converted exactly
template <class KV, int VEC>
__device__ __forceinline__ void load_kv(float (&x)[VEC], const KV* ptr) {
  if constexpr (sizeof(KV) == 2) {
    Vec16<KV> v;
    v.load(ptr);
#pragma unroll
    for (int e = 0; e < VEC; ++e) x[e] = v.v[e];
  } else {
    static_assert(sizeof(KV) == 1 && VEC == 8, "8 fp8 elements: 8 bytes");
    const uint2 raw = *reinterpret_cast<const uint2*>(ptr);
    const KV* e8 = reinterpret_cast<const KV*>(&raw);
#pragma unroll
    for (int e = 0; e < VEC; ++e) x[e] = float(e8[e]);
  }
}

// the request holding token t: the last b with indptr[b] <= t (an empty request shares its start with the next)
__device__ __forceinline__ int request_of(const int32_t* indptr, int batch, int64_t t) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (indptr[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

template <class C, class Params>
__device__ __forceinline__ void rope_gather(const Params& p) {
  using T = typename C::DType;
  using V = Vec16<T>;  // VEC elements of a half, 16 bytes
  using H = typename C::Variant;
  static_assert(C::ROPE || !H::Q_TRANSFORM, "without RoPE q is not copied: the kernel runs the q_transform");
  constexpr int HALF = C::HEAD_DIM / 2, VEC = C::VEC, CHUNKS = HALF / VEC;
  static_assert(VEC == V::N && HALF % VEC == 0, "a thread's chunk: 16 bytes of each half");
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t q_items = p.total_q * p.num_qo_heads * CHUNKS;
  if (j < q_items) {
    const int i0 = int(j % CHUNKS) * VEC;
    const int64_t row = j / CHUNKS, token = row / p.num_qo_heads;  // row = token * Hq + head
    const int b = request_of(p.qo_indptr, p.batch, token);
    int pos;
    if constexpr (C::POSITIONS) pos = __ldg(p.q_pos + token);
    else pos = p.kv_len[b] - (p.qo_indptr[b + 1] - p.qo_indptr[b]) + int(token - p.qo_indptr[b]);
    V lo, hi;
    lo.load(p.q + row * C::HEAD_DIM + i0);
    hi.load(p.q + row * C::HEAD_DIM + HALF + i0);
    const int head = int(row % p.num_qo_heads);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      if constexpr (H::Q_TRANSFORM) {
        lo.v[e] = flashgen::variant::q_value<H>(p, lo.v[e], b, pos, head, i0 + e);
        hi.v[e] = flashgen::variant::q_value<H>(p, hi.v[e], b, pos, head, i0 + e + HALF);
      }
      if constexpr (C::ROPE) rope_rotate_by<C::ROPE_SCALING>(lo.v[e], hi.v[e], float(pos), i0 + e, C::HEAD_DIM, p);
    }
    lo.store(p.q_out + row * C::HEAD_DIM + i0);
    hi.store(p.q_out + row * C::HEAD_DIM + HALF + i0);
    return;
  }
  const int64_t k = j - q_items;
  if (k >= p.total_kv_out * p.num_kv_heads * CHUNKS) return;
  const int i0 = int(k % CHUNKS) * VEC, head = int((k / CHUNKS) % p.num_kv_heads);
  const int64_t token = k / CHUNKS / p.num_kv_heads;
  const int b = request_of(p.kv_out_indptr, p.batch, token);
  const int pos = int(token - p.kv_out_indptr[b]);
  const KVRows<C::PAGED, C::PAGE_SIZE> rows(p, b);
  const int64_t src = rows.offset(pos, rows.page(pos)) + int64_t(head) * p.stride_head;
  const int64_t dst = (token * p.num_kv_heads + head) * C::HEAD_DIM;
  V lo, hi;
  load_kv(lo.v, p.k + src + i0);
  load_kv(hi.v, p.k + src + HALF + i0);
  constexpr bool FP8 = sizeof(typename C::DTypeKV) == 1;
  // fp8 V times v_scale into DType (16-bit V: copied as it is)
  V v_lo, v_hi;
  uint4 raw_lo, raw_hi;
  if constexpr (FP8) {
    load_kv(v_lo.v, p.v + src + i0);
    load_kv(v_hi.v, p.v + src + HALF + i0);
  } else {
    raw_lo = *reinterpret_cast<const uint4*>(p.v + src + i0);
    raw_hi = *reinterpret_cast<const uint4*>(p.v + src + HALF + i0);
  }
  int k_pos = pos;
  if constexpr (C::POSITIONS) {
    k_pos = key_position<C::PAGE_SIZE>(request_page_pos(p, b), pos);
    if (i0 == 0 && head == 0) p.kv_pos_out[token] = k_pos;
  }
  // fp8 into fp16 scratch: held to its finite range (a scaled value may leave it)
  constexpr bool CLAMP = FP8 && std::is_same_v<T, __half>;
  auto held = [](float x) { return CLAMP ? fminf(fmaxf(x, -65504.f), 65504.f) : x; };
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    if constexpr (H::K_TRANSFORM) {  // fp8: the hook sees the dequantised element (k_scale left out of sm_scale)
      if constexpr (FP8) lo.v[e] *= p.k_scale, hi.v[e] *= p.k_scale;
      lo.v[e] = flashgen::variant::k_value<H>(p, lo.v[e], b, k_pos, head, i0 + e);
      hi.v[e] = flashgen::variant::k_value<H>(p, hi.v[e], b, k_pos, head, i0 + e + HALF);
    }
    if constexpr (C::ROPE) rope_rotate_by<C::ROPE_SCALING>(lo.v[e], hi.v[e], float(k_pos), i0 + e, C::HEAD_DIM, p);
    lo.v[e] = held(lo.v[e]), hi.v[e] = held(hi.v[e]);
    if constexpr (FP8) v_lo.v[e] = held(v_lo.v[e] * p.v_scale), v_hi.v[e] = held(v_hi.v[e] * p.v_scale);
  }
  lo.store(p.k_out + dst + i0);
  hi.store(p.k_out + dst + HALF + i0);
  if constexpr (FP8) {
    v_lo.store(p.v_out + dst + i0);
    v_hi.store(p.v_out + dst + HALF + i0);
  } else {
    *reinterpret_cast<uint4*>(p.v_out + dst + i0) = raw_lo;
    *reinterpret_cast<uint4*>(p.v_out + dst + HALF + i0) = raw_hi;
  }
}

}  // namespace flashgen
