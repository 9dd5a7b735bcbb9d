// The K pre-pass of the Hopper prefill (RoPE specs, and variants with a k_transform): from any KV layout into
// ragged scratch tensors, which the sm90 kernel then reads as a ragged batch with neither: each request's K through
// the variant's k_transform (C::Variant::K_TRANSFORM, each element as it is read: common/variant.cuh k_value) and,
// with C::ROPE, rotated by its key position; V copied; with C::ROPE also q, through the q_transform and rotated by
// its query position (without RoPE the caller passes total_q = 0: q is not copied and the kernel runs its own
// q_transform). So a hook runs once an element, not once for every q tile that reads the key. One thread a pair
// (x[i], x[i + D/2]) of one row and head (Llama halves, logits.cuh's rope_rotate); a K pair's thread also copies
// V's elements i and i + D/2.
//   flat index j < total_q * Hq * D/2:        q token, q head, pair
//   then j < ... + total_kv_out * Hkv * D/2:  kv token of the scratch, kv head, pair
// Query position: kv_len - qo_len + (token - qo_indptr[b]); key position: token - kv_out_indptr[b]. With
// C::POSITIONS (common/positions.cuh): q_pos[token], and key t of request b at its kv_page_pos entry + offset,
// which the thread of pair 0, head 0 also writes to kv_pos_out[token of the scratch]. The hooks see those
// positions (batch: the request b).
#pragma once
#include <flashgen/common/kv_rows.cuh>
#include <flashgen/common/logits.cuh>
#include <flashgen/common/positions.cuh>
#include <flashgen/common/variant.cuh>
#include <flashgen/common/vec.cuh>

namespace flashgen {

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
  using V = Vec16<T>;  // its element conversions
  using H = typename C::Variant;
  static_assert(C::ROPE || !H::Q_TRANSFORM, "without RoPE q is not copied: the kernel runs the q_transform");
  constexpr int HALF = C::HEAD_DIM / 2;
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t q_pairs = p.total_q * p.num_qo_heads * HALF;
  if (j < q_pairs) {
    const int i = j % HALF;
    const int64_t row = j / HALF, token = row / p.num_qo_heads;  // row = token * Hq + head
    const int b = request_of(p.qo_indptr, p.batch, token);
    int pos;
    if constexpr (C::POSITIONS) pos = __ldg(p.q_pos + token);
    else pos = p.kv_len[b] - (p.qo_indptr[b + 1] - p.qo_indptr[b]) + int(token - p.qo_indptr[b]);
    float lo = V::to_float(p.q[row * C::HEAD_DIM + i]), hi = V::to_float(p.q[row * C::HEAD_DIM + i + HALF]);
    if constexpr (H::Q_TRANSFORM) {
      const int head = int(row % p.num_qo_heads);
      lo = flashgen::variant::q_value<H>(p, lo, b, pos, head, i);
      hi = flashgen::variant::q_value<H>(p, hi, b, pos, head, i + HALF);
    }
    if constexpr (C::ROPE) rope_rotate(lo, hi, float(pos), i, C::HEAD_DIM, p.rope_rcp_scale, p.rope_log2_theta);
    p.q_out[row * C::HEAD_DIM + i] = V::from_float(lo);
    p.q_out[row * C::HEAD_DIM + i + HALF] = V::from_float(hi);
    return;
  }
  const int64_t k = j - q_pairs;
  if (k >= p.total_kv_out * p.num_kv_heads * HALF) return;
  const int i = k % HALF, head = (k / HALF) % p.num_kv_heads;
  const int64_t token = k / HALF / p.num_kv_heads;
  const int b = request_of(p.kv_out_indptr, p.batch, token);
  const int pos = int(token - p.kv_out_indptr[b]);
  const KVRows<C::PAGED, C::PAGE_SIZE> rows(p, b);
  const int64_t src = rows.offset(pos, rows.page(pos)) + int64_t(head) * p.stride_head;
  const int64_t dst = (token * p.num_kv_heads + head) * C::HEAD_DIM;
  float lo = V::to_float(p.k[src + i]), hi = V::to_float(p.k[src + i + HALF]);
  int k_pos = pos;
  if constexpr (C::POSITIONS) {
    k_pos = key_position<C::PAGE_SIZE>(request_page_pos(p, b), pos);
    if (i == 0 && head == 0) p.kv_pos_out[token] = k_pos;
  }
  if constexpr (H::K_TRANSFORM) {
    lo = flashgen::variant::k_value<H>(p, lo, b, k_pos, head, i);
    hi = flashgen::variant::k_value<H>(p, hi, b, k_pos, head, i + HALF);
  }
  if constexpr (C::ROPE) rope_rotate(lo, hi, float(k_pos), i, C::HEAD_DIM, p.rope_rcp_scale, p.rope_log2_theta);
  p.k_out[dst + i] = V::from_float(lo);
  p.k_out[dst + i + HALF] = V::from_float(hi);
  p.v_out[dst + i] = p.v[src + i];
  p.v_out[dst + i + HALF] = p.v[src + i + HALF];
}

}  // namespace flashgen
