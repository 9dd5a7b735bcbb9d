// The variant's q_transform in the Hopper prefill: Q lands by TMA (or the loaders' cp.async) in the item's
// 128B-swizzled Q buffer, and each consumer warpgroup, once q_full says it is there and before its first wgmma
// of the item, passes over its own 64 rows in shared memory: each element of row r (token, q head) through the
// hook (batch = the request, qo_idx = the query's position, dim = its column), rounded back to q's dtype. The
// writes are generic-proxy stores that wgmma (the async proxy) then reads: each thread fences them
// (fence.proxy.async) and the warpgroup meets at its own named barrier before any of it issues the GEMM. Rows past
// the request are left as they are (masked, never written). The Q buffer is not read by the other warpgroup's
// GEMMs (each reads its own 64 rows) and is not reloaded before both released it (q_empty), so the pass races
// with nothing. RoPE specs never reach here with a q_transform (api/backends.py check_sm90: the RoPE pre-pass
// would rotate q before the hook).
#pragma once
#include <cstdint>
#include <flashgen/common/fastdiv.cuh>
#include <flashgen/common/mma.cuh>
#include <flashgen/common/variant.cuh>
#include <flashgen/sm90/layout.cuh>
#include <flashgen/sm90/named_barrier.cuh>
#include <flashgen/sm90/positions.cuh>
#include <flashgen/sm90/tile_scheduler.cuh>
#include <flashgen/sm90/tma.cuh>

namespace flashgen::sm90 {

// consumer warpgroup wg (0, 1) over its rows of the Q tile at q_tile (item w of request `request`)
template <class C, class Params>
__device__ __forceinline__ void transform_q(const Params& p, const Work& w, uint8_t* q_tile, int wg, int request) {
  using L = Layout<C>;
  using V = typename C::Variant;
  using DTypeQ = typename C::DTypeQ;
  constexpr int CHUNKS = L::D / 8;  // 16-byte chunks of a row
  const FastDiv group = group_of(p);
  const int qo_len = C::POSITIONS ? group.div(w.rows_total) : 0;
#pragma unroll 1
  for (int job = threadIdx.x % 128; job < L::WG_ROWS * CHUNKS; job += 128) {
    const int r = wg * L::WG_ROWS + job / CHUNKS, c = job % CHUNKS, prow = w.row0 + r;
    if (prow >= w.rows_total) continue;
    int token, head;
    group.divmod(prow, token, head);
    const int qo_idx = query_position<C>(p, w, token, qo_len), qo_head = w.kv_head * group.d + head;
    uint4* at = reinterpret_cast<uint4*>(q_tile + c / 8 * L::Q_BLOCK + r * 128 + swizzle(r, c % 8) * 16);
    uint4 x = *at;
    uint32_t* words = reinterpret_cast<uint32_t*>(&x);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = unpack2<DTypeQ>(words[i]);
      words[i] = pack2<DTypeQ>(flashgen::variant::q_value<V>(p, v.x, request, qo_idx, qo_head, c * 8 + 2 * i),
                               flashgen::variant::q_value<V>(p, v.y, request, qo_idx, qo_head, c * 8 + 2 * i + 1));
    }
    *at = x;
  }
  fence_proxy_async();  // this thread's stores, visible to wgmma ...
  named_barrier_sync(BARRIER_WARPGROUP + wg, 128);  // ... once every thread of the warpgroup has made its own so
}

}  // namespace flashgen::sm90
