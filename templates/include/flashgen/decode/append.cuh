// Fused append + decode (C::APPEND): the new token's K/V row, computed from k_new / v_new in registers, written
// into its cache slot and handed to the attention without a read of that slot.
//
// The new token sits at place kv_len - 1 of its request (the plan counts it). Split-KV chunks partition
// [0, kv_len), so only the work items whose chunk ends at kv_len see that place: the one of qo tile 0 writes the
// row into the cache (its page id loaded beside the first tiles', the store not waited on); every one of them
// (one per qo tile) leaves the row out of its tile's cp.async (by its index in the tile) and stores it
// into that tile's stage in shared memory as the tile is issued (inject), so the tile's own barrier publishes it.
// So no CTA of the launch reads the slot being written, and the attention sees exactly the bytes the cache
// receives: the same as flashgen.append_kv, then decode.
//
// The row's loads are issued beside q's, and it is finished in stage_q: K turns by the cosines and sines q's row 0
// turns by (the same position, the same pairs), so the row costs no sincos of its own, and nothing of it sits
// between the prologue and the first tile.
//
// The row as append_kv writes it: K rotated when the cache holds rotated K (ROPE_K_ON_WRITE: the spec's RoPE has
// k_rotated), each value times 1 / scale and cast to the cache's dtype (fp8: saturated). A thread owns 8 elements
// in each half of the row (its RoPE pairs; 16 bytes of a 16-bit cache, 8 of an fp8 one, so an fp8 row spreads over
// as many threads as a bf16 one): threads [0, K_PAIRS) K, the next V_PAIRS V.
//
// Config: DTypeQ, DTypeKV, HEAD_DIM, HEAD_DIM_VO, ROPE_K_ON_WRITE, ROPE_SCALING.
#pragma once
#include <flashgen/common/fp8.cuh>
#include <flashgen/common/rope.cuh>
#include <flashgen/common/vec.cuh>
#include <flashgen/decode/tiles.cuh>

namespace flashgen::decode {

template <class C>
struct NewRow {
  using DTypeKV = typename C::DTypeKV;
  using DTypeQ = typename C::DTypeQ;
  using L = Layout<C>;
  static constexpr int ELEMS = 8;  // elements of a thread's piece in each half of the row
  using Bits = std::conditional_t<L::FP8, uint2, uint4>;  // a piece in the cache's dtype
  static constexpr int K_PAIRS = C::HEAD_DIM / (2 * ELEMS), V_PAIRS = C::HEAD_DIM_VO / (2 * ELEMS);
  static_assert(K_PAIRS == L::Q_CHUNKS / 2, "K piece c is stage_q's chunk c of q's row 0, job c");
  static constexpr int CHUNK_ELEMS = 16 / int(sizeof(DTypeKV));  // elements of a 16-byte shared-memory chunk
  static_assert(K_PAIRS + V_PAIRS <= L::THREADS, "a thread per piece pair");
  static_assert(C::HEAD_DIM % (2 * ELEMS) == 0 && C::HEAD_DIM_VO % (2 * ELEMS) == 0, "whole pieces in each half");

  bool active = false, is_k = false;
  int piece = 0;  // the low piece; its pair is piece + K_PAIRS (K) or + V_PAIRS (V)
  uint4 raw_lo, raw_hi;  // the piece pair as loaded (q's dtype), until finish
  Bits lo, hi;           // the row's bytes in the cache's dtype

  // ELEMS elements of q's dtype as floats
  static __device__ __forceinline__ void unpack(const uint4& raw, float (&x)[ELEMS]) {
    const DTypeQ* e = reinterpret_cast<const DTypeQ*>(&raw);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = Vec16<DTypeQ>::to_float(e[j]);
  }

  static __device__ __forceinline__ Bits pack(const float (&x)[ELEMS]) {
    Bits out;
    if constexpr (L::FP8) {
      constexpr __nv_fp8_interpretation_t kind = std::is_same_v<DTypeKV, __nv_fp8_e4m3> ? __NV_E4M3 : __NV_E5M2;
      __nv_fp8x2_storage_t* pairs = reinterpret_cast<__nv_fp8x2_storage_t*>(&out);
#pragma unroll
      for (int i = 0; i < 4; ++i) pairs[i] = __nv_cvt_float2_to_fp8x2(make_float2(x[2 * i], x[2 * i + 1]), __NV_SATFINITE, kind);
    } else {
      DTypeKV* e = reinterpret_cast<DTypeKV*>(&out);
#pragma unroll
      for (int j = 0; j < ELEMS; ++j) e[j] = Vec16<DTypeKV>::from_float(x[j]);
    }
    return out;
  }

  // the element offset in shared memory of element `e` of row `row` (swizzled as copy_tile_rows writes them)
  static __device__ __forceinline__ int smem_index(int row, int e, int chunks) {
    return copy_index<DTypeKV>(row, e / CHUNK_ELEMS, chunks) + e % CHUNK_ELEMS;
  }

  // issues the loads of this thread's piece pair of the new row of (token, kv_head); nothing waits on them here
  template <class Params>
  __device__ __forceinline__ void load(const Params& p, int token, int kv_head) {
    const int tid = threadIdx.x;
    is_k = tid < K_PAIRS;
    active = tid < K_PAIRS + V_PAIRS;
    if (!active) return;
    piece = is_k ? tid : tid - K_PAIRS;
    const int half = is_k ? C::HEAD_DIM / 2 : C::HEAD_DIM_VO / 2;
    const DTypeQ* src = is_k ? p.k_new + token * p.k_new_stride_token + kv_head * p.k_new_stride_head
                             : p.v_new + token * p.v_new_stride_token + kv_head * p.v_new_stride_head;
    src += piece * ELEMS;
    raw_lo = __ldg(reinterpret_cast<const uint4*>(src));
    raw_hi = __ldg(reinterpret_cast<const uint4*>(src + half));
  }

  // the piece pair in the cache's dtype; K turned (ROPE_K_ON_WRITE) by cos / sin of its ELEMS angles, which
  // stage_q computed for q's row 0 at the same position (its thread's q chunk is this thread's K piece)
  template <class Params>
  __device__ __forceinline__ void finish(const Params& p, const float (&cos)[ELEMS], const float (&sin)[ELEMS]) {
    if (!active) return;
    float a[ELEMS], b[ELEMS];
    unpack(raw_lo, a);
    unpack(raw_hi, b);
    if constexpr (C::ROPE_K_ON_WRITE) {
      if (is_k) {
#pragma unroll
        for (int j = 0; j < ELEMS; ++j) rope_pair(a[j], b[j], cos[j], sin[j]);
      }
    }
    const float mul = is_k ? p.k_rcp_scale : p.v_rcp_scale;  // 1 for a 16-bit cache
#pragma unroll
    for (int j = 0; j < ELEMS; ++j) a[j] *= mul, b[j] *= mul;
    lo = pack(a);
    hi = pack(b);
  }

  // into the cache: row_offset is the slot's element offset from the head's base (KVRows::offset)
  template <class Params>
  __device__ __forceinline__ void write(const Params& p, int kv_head, int64_t row_offset) const {
    if (!active) return;
    DTypeKV* base = const_cast<DTypeKV*>(is_k ? p.k : p.v) + int64_t(kv_head) * p.stride_head + row_offset;
    const int half = is_k ? C::HEAD_DIM / 2 : C::HEAD_DIM_VO / 2;
    *reinterpret_cast<Bits*>(base + piece * ELEMS) = lo;
    *reinterpret_cast<Bits*>(base + half + piece * ELEMS) = hi;
  }

  // into row `row` of the K / V tiles of one stage, whose cp.async leaves that row out (copy_tile_rows' SKIP)
  __device__ __forceinline__ void inject(DTypeKV* ks, DTypeKV* vs, int row) const {
    if (!active) return;
    const int chunks = is_k ? L::K_CHUNKS : L::V_CHUNKS;
    const int half = is_k ? C::HEAD_DIM / 2 : C::HEAD_DIM_VO / 2;
    DTypeKV* tile = is_k ? ks : vs;
    *reinterpret_cast<Bits*>(tile + smem_index(row, piece * ELEMS, chunks)) = lo;
    *reinterpret_cast<Bits*>(tile + smem_index(row, half + piece * ELEMS, chunks)) = hi;
  }
};

}  // namespace flashgen::decode
