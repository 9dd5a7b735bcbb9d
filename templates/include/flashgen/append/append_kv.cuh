// The KV-cache write: new tokens' K and V into their pages, K optionally rotated (RoPE at the token's position, Llama-3.1 or YaRN scaled),
// both optionally quantised to fp8 (cache = fp8(x / scale)).
//
// Work: one row = (token, kv head) of HEAD_DIM elements, THREADS_PER_ROW threads a row. A thread owns ELEMS
// elements of the low half of the row and the ELEMS elements HEAD_DIM/2 further on (the RoPE pairs, so the
// rotation stays in registers), of K and of V: ELEMS * sizeof(DTypeKV) = 16 bytes, so every cache store is one
// 16-byte vector and every load of the new K/V one (16-bit cache) or two (fp8) 16-byte vectors. The threads of a
// row are adjacent lanes and the rows of a CTA adjacent (token, head) pairs: loads and stores are coalesced.
//
// Where a token goes (skipped tokens write nothing, so padding in a captured graph costs no branch on the host):
//   slot_mapping: slot = slot_mapping[t]; page = slot / PAGE_SIZE, offset = slot % PAGE_SIZE; skip slot < 0
//   csr:          b = batch_indices[t], pos = positions[t]; page = kv_indices[kv_indptr[b] + pos / PAGE_SIZE],
//                 offset = pos % PAGE_SIZE; skip b outside [0, batch), pos < 0, or pos beyond b's pages
// and any page id outside [0, num_pages). RoPE rotates by positions[t] (both forms); with a cos/sin table a
// position outside its rows skips the token.
#pragma once
#include <flashgen/common/fp8.cuh>
#include <flashgen/common/rope.cuh>
#include <flashgen/common/vec.cuh>

namespace flashgen {

// ELEMS consecutive elements of a row of the new K or V, as loaded
template <class C>
struct AppendChunk {
  using In = typename C::DTypeIn;
  static constexpr int VECS = C::ELEMS * int(sizeof(In)) / 16;
  uint4 raw[VECS];

  __device__ __forceinline__ void load(const In* src) {
#pragma unroll
    for (int i = 0; i < VECS; ++i) raw[i] = __ldg(reinterpret_cast<const uint4*>(src) + i);
  }

  __device__ __forceinline__ void to_float(float* x, float mul) const {
    const In* e = reinterpret_cast<const In*>(raw);
#pragma unroll
    for (int j = 0; j < C::ELEMS; ++j) x[j] = Vec16<In>::to_float(e[j]) * mul;
  }
};

// ELEMS floats as one 16-byte chunk of the cache's dtype
template <class C>
__device__ __forceinline__ uint4 append_pack(const float* x) {
  using KV = typename C::DTypeKV;
  if constexpr (C::QUANTIZE) {
    return fp8x16_narrow<KV>(x);
  } else {
    uint4 out;
    KV* e = reinterpret_cast<KV*>(&out);
#pragma unroll
    for (int j = 0; j < C::ELEMS; ++j) e[j] = Vec16<KV>::from_float(x[j]);
    return out;
  }
}

// element offset of (token, head 0) in the cache, or -1 where the token is skipped
template <class C, class Params>
__device__ __forceinline__ int64_t append_row(const Params& p, int token) {
  if constexpr (C::SLOT_MAPPING) {
    const int64_t slot = p.slot_mapping[token];
    if (slot < 0) return -1;
    const int64_t page = slot / C::PAGE_SIZE;
    if (page >= p.num_pages) return -1;
    return page * p.stride_page + (slot - page * C::PAGE_SIZE) * p.stride_token;
  } else {
    const int64_t b = p.batch_indices[token], pos = p.positions[token];
    if (b < 0 || b >= p.batch_size || pos < 0) return -1;
    const int64_t entry = p.kv_indptr[b] + pos / C::PAGE_SIZE;
    if (entry >= p.kv_indptr[b + 1]) return -1;
    const int64_t page = p.kv_indices[entry];
    if (page < 0 || page >= p.num_pages) return -1;
    return page * p.stride_page + (pos % C::PAGE_SIZE) * p.stride_token;
  }
}

// lo[j], hi[j] (frequency index first + j) turned by the token's position; false where the cos/sin table has no
// row for it
template <class C, class Params>
__device__ __forceinline__ bool append_rotate(const Params& p, int token, int first, float* lo, float* hi) {
  constexpr int HALF = C::HEAD_DIM / 2;
  const int64_t pos = p.positions[token];
  if constexpr (C::ROPE_COS_SIN) {
    if (pos < 0 || pos >= p.cos_sin_rows) return false;
    const float4* c = reinterpret_cast<const float4*>(p.cos_sin_cache + pos * C::HEAD_DIM + first);
    const float4* s = reinterpret_cast<const float4*>(p.cos_sin_cache + pos * C::HEAD_DIM + HALF + first);
#pragma unroll
    for (int q = 0; q < C::ELEMS / 4; ++q) {
      const float4 cq = __ldg(c + q), sq = __ldg(s + q);
      rope_pair(lo[4 * q + 0], hi[4 * q + 0], cq.x, sq.x);
      rope_pair(lo[4 * q + 1], hi[4 * q + 1], cq.y, sq.y);
      rope_pair(lo[4 * q + 2], hi[4 * q + 2], cq.z, sq.z);
      rope_pair(lo[4 * q + 3], hi[4 * q + 3], cq.w, sq.w);
    }
  } else {
#pragma unroll
    for (int j = 0; j < C::ELEMS; ++j) rope_rotate_scaled(lo[j], hi[j], float(pos), first + j, C::HEAD_DIM, p);
  }
  return true;
}

template <class C, class Params>
__device__ __forceinline__ void append_kv(const Params& p) {
  using In = typename C::DTypeIn;
  using KV = typename C::DTypeKV;
  constexpr int HALF = C::HEAD_DIM / 2, ROWS = C::BLOCK_THREADS / C::THREADS_PER_ROW;
  const int row = blockIdx.x * ROWS + threadIdx.x / C::THREADS_PER_ROW;
  if (row >= p.num_rows) return;
  const int first = (threadIdx.x % C::THREADS_PER_ROW) * C::ELEMS;
  const int token = row / p.num_kv_heads, head = row - token * p.num_kv_heads;
  // the new K/V first (independent of the page lookup, so both latencies overlap)
  const In* k = p.k + token * p.k_stride_token + head * p.k_stride_head + first;
  const In* v = p.v + token * p.v_stride_token + head * p.v_stride_head + first;
  AppendChunk<C> k_lo, k_hi, v_lo, v_hi;
  k_lo.load(k);
  k_hi.load(k + HALF);
  v_lo.load(v);
  v_hi.load(v + HALF);
  const int64_t at = append_row<C>(p, token);
  if (at < 0) return;
  KV* k_dst = p.k_cache + at + head * p.stride_head + first;
  KV* v_dst = p.v_cache + at + head * p.stride_head + first;
  if constexpr (!C::QUANTIZE && !C::ROPE) {  // a copy: the bytes as loaded
    *reinterpret_cast<uint4*>(k_dst) = k_lo.raw[0];
    *reinterpret_cast<uint4*>(k_dst + HALF) = k_hi.raw[0];
    *reinterpret_cast<uint4*>(v_dst) = v_lo.raw[0];
    *reinterpret_cast<uint4*>(v_dst + HALF) = v_hi.raw[0];
  } else {
    float k_mul = 1.f, v_mul = 1.f;  // 1 / scale
    if constexpr (C::QUANTIZE && C::PER_HEAD_SCALE) {
      k_mul = 1.f / p.k_scales[head * p.scale_stride];
      v_mul = 1.f / p.v_scales[head * p.scale_stride];
    } else if constexpr (C::QUANTIZE) {
      k_mul = p.k_rcp_scale;
      v_mul = p.v_rcp_scale;
    }
    float lo[C::ELEMS], hi[C::ELEMS];
    k_lo.to_float(lo, 1.f);
    k_hi.to_float(hi, 1.f);
    if constexpr (C::ROPE) {
      if (!append_rotate<C>(p, token, first, lo, hi)) return;
    }
#pragma unroll
    for (int j = 0; j < C::ELEMS; ++j) lo[j] *= k_mul, hi[j] *= k_mul;
    *reinterpret_cast<uint4*>(k_dst) = append_pack<C>(lo);
    *reinterpret_cast<uint4*>(k_dst + HALF) = append_pack<C>(hi);
    v_lo.to_float(lo, v_mul);
    v_hi.to_float(hi, v_mul);
    *reinterpret_cast<uint4*>(v_dst) = append_pack<C>(lo);
    *reinterpret_cast<uint4*>(v_dst + HALF) = append_pack<C>(hi);
  }
}

}  // namespace flashgen
