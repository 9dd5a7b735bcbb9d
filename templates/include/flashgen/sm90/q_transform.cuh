// The q side of the Hopper prefill's load transforms: the variant's q_transform and, for a cache of rotated K
// (RoPE(k_rotated=True): C::ROPE), q's rotation (C::ROPE_SCALING: Llama-3.1 / YaRN frequencies, common/rope.cuh).
// Q lands by TMA (or the loaders' cp.async) in the item's 128B-swizzled Q buffer, and each consumer warpgroup, once
// q_full says it is there and before its first wgmma of the item, passes over its own 64 rows in shared memory: each
// element of row r (token, q head) through the hook (batch = the request, qo_idx = the query's position, dim = its
// column), then each pair (x[i], x[i + D/2]) turned by the query's position, in fp32, rounded once back to q's dtype
// (as the portable prefill and the rope_gather pre-pass round). A thread takes a 16-byte chunk of a row; with RoPE
// the chunk c and its partner D/2 on, of RPT consecutive rows: its 8 pairs' angle rates computed once, their
// cosines and sines once a query position (a GQA group's rows share their token's), so that at a group of 4 a
// thread evaluates 8 sines and cosines an item rather than 32 (that cost, before the item's first GEMM, took 8 % at
// 4 x 4096). The writes are generic-proxy stores that wgmma (the async proxy) then reads:
// each thread fences them (fence.proxy.async) and the warpgroup meets at its own named barrier before any of it
// issues the GEMM. Rows past the request are left as they are (masked, never written). The Q buffer is not read by
// the other warpgroup's GEMMs (each reads its own 64 rows) and is not reloaded before both released it (q_empty), so
// the pass races with nothing. A spec whose K the rope_gather pre-pass turns never reaches here with RoPE or a
// q_transform (kernels/rope_gather.py ragged_twin: the pass turns q too, after the hook).
#pragma once
#include <cstdint>
#include <flashgen/common/fastdiv.cuh>
#include <flashgen/common/mma.cuh>
#include <flashgen/common/rope.cuh>
#include <flashgen/common/variant.cuh>
#include <flashgen/sm90/layout.cuh>
#include <flashgen/sm90/named_barrier.cuh>
#include <flashgen/sm90/positions.cuh>
#include <flashgen/sm90/tile_scheduler.cuh>
#include <flashgen/sm90/tma.cuh>

namespace flashgen::sm90 {

// the 16-byte chunk c (columns 8c .. 8c + 7) of row r of the 128B-swizzled Q tile
template <class L>
__device__ __forceinline__ uint4* q_chunk(uint8_t* q_tile, int r, int c) {
  return reinterpret_cast<uint4*>(q_tile + c / 8 * L::Q_BLOCK + r * 128 + swizzle(r, c % 8) * 16);
}

// the 8 elements of a chunk as floats, and back (rounded once)
template <class T>
__device__ __forceinline__ void chunk_floats(float (&x)[8], const uint4& raw) {
  const uint32_t* words = reinterpret_cast<const uint32_t*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = unpack2<T>(words[i]);
    x[2 * i] = v.x, x[2 * i + 1] = v.y;
  }
}
template <class T>
__device__ __forceinline__ uint4 chunk_of(const float (&x)[8]) {
  uint4 raw;
  uint32_t* words = reinterpret_cast<uint32_t*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) words[i] = pack2<T>(x[2 * i], x[2 * i + 1]);
  return raw;
}

// consumer warpgroup wg (0, 1) over its rows of the Q tile at q_tile (item w of request `request`)
template <class C, class Params>
__device__ __forceinline__ void transform_q(const Params& p, const Work& w, uint8_t* q_tile, int wg, int request) {
  using L = Layout<C>;
  using V = typename C::Variant;
  using DTypeQ = typename C::DTypeQ;
  constexpr int CHUNKS = L::D / 8;  // 16-byte chunks of a row
  const FastDiv group = group_of(p);
  const int qo_len = C::POSITIONS ? group.div(w.rows_total) : 0;
  const int t = threadIdx.x % 128;
  if constexpr (C::ROPE) {
    constexpr int PAIRS = CHUNKS / 2, RPT = L::WG_ROWS * PAIRS / 128;  // chunk pairs of a row, rows a thread
    static_assert(RPT * 128 == L::WG_ROWS * PAIRS, "the warpgroup's rows and chunk pairs, evenly over its threads");
    const int c = t % PAIRS, r0 = wg * L::WG_ROWS + t / PAIRS * RPT;
    float rate[8], cs[8], sn[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) rate[e] = rope_angle_rate<C::ROPE_SCALING>(c * 8 + e, L::D, p);
    int turned = INT32_MIN;  // the query position cs / sn hold (none yet: positions lie in [-2^30, 2^30))
#pragma unroll 1
    for (int r = r0; r < r0 + RPT && w.row0 + r < w.rows_total; ++r) {
      int token, head;
      group.divmod(w.row0 + r, token, head);
      const int qo_idx = query_position<C>(p, w, token, qo_len), qo_head = w.kv_head * group.d + head;
      if (qo_idx != turned) {
        turned = qo_idx;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          rope_sincos(float(qo_idx) * rate[e], &sn[e], &cs[e]);
          if constexpr (C::ROPE_SCALING) cs[e] *= p.rope_mscale, sn[e] *= p.rope_mscale;
        }
      }
      uint4* lo_at = q_chunk<L>(q_tile, r, c);
      uint4* hi_at = q_chunk<L>(q_tile, r, c + PAIRS);
      float lo[8], hi[8];
      chunk_floats<DTypeQ>(lo, *lo_at);
      chunk_floats<DTypeQ>(hi, *hi_at);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if constexpr (V::Q_TRANSFORM) {
          lo[e] = flashgen::variant::q_value<V>(p, lo[e], request, qo_idx, qo_head, c * 8 + e);
          hi[e] = flashgen::variant::q_value<V>(p, hi[e], request, qo_idx, qo_head, L::D / 2 + c * 8 + e);
        }
        rope_pair(lo[e], hi[e], cs[e], sn[e]);
      }
      *lo_at = chunk_of<DTypeQ>(lo);
      *hi_at = chunk_of<DTypeQ>(hi);
    }
  } else {
#pragma unroll 1
    for (int job = t; job < L::WG_ROWS * CHUNKS; job += 128) {
      const int r = wg * L::WG_ROWS + job / CHUNKS, c = job % CHUNKS, prow = w.row0 + r;
      if (prow >= w.rows_total) continue;
      int token, head;
      group.divmod(prow, token, head);
      const int qo_idx = query_position<C>(p, w, token, qo_len), qo_head = w.kv_head * group.d + head;
      uint4* at = q_chunk<L>(q_tile, r, c);
      float x[8];
      chunk_floats<DTypeQ>(x, *at);
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] = flashgen::variant::q_value<V>(p, x[e], request, qo_idx, qo_head, c * 8 + e);
      *at = chunk_of<DTypeQ>(x);
    }
  }
  fence_proxy_async();  // this thread's stores, visible to wgmma ...
  named_barrier_sync(BARRIER_WARPGROUP + wg, 128);  // ... once every thread of the warpgroup has made its own so
}

}  // namespace flashgen::sm90
