// The variant's k_transform in the Hopper prefill: the K warp runs the hook over each element of a K tile before
// the consumers' wgmma reads it (batch = the item's request, kv_idx = the key's true position, kv_head, dim = its
// column), rounded back to K's dtype, as decode and the portable prefill do (common/variant.cuh k_value).
//
// TMA-loaded K (C::K_STAGED): the K warp's TMA lands each tile in a staging stage (K16_STAGES of them) laid out as
// the 16-bit stage itself: 64-column blocks of TILE_KV 128-byte rows, 128B-swizzled (the K map and its boxes are
// the plain kernel's), and the warp writes the transformed tile into the 16-bit stage the wgmma descriptors read,
// then makes the writes visible to the async proxy (fence.proxy.async) and arrives on the stage's full barrier,
// one arrival a lane, as fp8's conversion (sm90/fp8.cuh). A gathered cache (C::GATHER): the warp waits for its
// own cp.async copies of the tile and transforms the 16-bit stage in place, then fences and arrives alike.
//
// Both read and write chunk c of row r at r * 128 + (c ^ r % 8) * 16 of its block. Lane l takes 16-byte chunk
// l % 8 (columns 8 (l % 8) ..) of row l / 8 of each 4-row pass, so a quarter warp reads or writes one whole
// 128-byte row (no bank conflicts). Pass k covers rows 4 k % TILE_KV .. + 3 of block 4 k / TILE_KV; its rows are
// 4 (k % 2) + l / 8 modulo 8, so a chunk's address is one of two per-lane constants (k even, odd) plus the pass's
// offset, and its key the lane's row l / 8 plus the pass's 4 k % TILE_KV.
#pragma once
#include <cstdint>
#include <flashgen/common/mma.cuh>
#include <flashgen/common/positions.cuh>
#include <flashgen/common/variant.cuh>
#include <flashgen/sm90/layout.cuh>
#include <flashgen/sm90/tile_scheduler.cuh>
#include <flashgen/sm90/tma.cuh>

namespace flashgen::sm90 {

// What the hook needs of a K tile besides its elements: the request (batch), the kv head, the tile's first key
// place pos0 and the item's last key place `last` (rows past it, masked later, ask for that key, so a hook that
// indexes a tensor by kv_idx never reads past the request); C::POSITIONS: the request's first kv_page_pos entry
// (paged: where its page ids start; ragged: its first row), keys then at their true positions.
struct KeyTile {
  int batch, kv_head, pos0, last, first;
};

template <class C, class Params>
__device__ __forceinline__ KeyTile key_tile(const Params& p, const Work& w, int request, int pos0) {
  int first = 0;
  if constexpr (C::POSITIONS) first = C::PAGED ? int(w.pages - p.kv_indices) : w.kv_row0;
  return {request, w.kv_head, pos0, w.kv_hi - 1, first};
}

// the kv_idx of row `row` of the tile: its place in the request, or with C::POSITIONS its page's kv_page_pos
// entry plus its offset in the page (Ragged: a position a key)
template <class C, class Params>
__device__ __forceinline__ int key_index(const Params& p, const KeyTile& kt, int row) {
  const int place = min(kt.pos0 + row, kt.last);
  if constexpr (C::POSITIONS) return key_position<C::PAGED ? C::PAGE_SIZE : 1>(p.kv_page_pos + kt.first, place);
  else return place;
}

// The K tile at shared address src through the hook into the 16-bit stage at dst (src == dst: in place), by the
// warp's 32 lanes, a pass an iteration: as few registers as a rolled loop needs (the producer warpgroup has 40
// or 56, and the hook's own take some)
template <class C, class Params>
__device__ __forceinline__ void transform_k_tile(const Params& p, const KeyTile& kt, uint32_t src, uint32_t dst,
                                                 int lane) {
  using L = Layout<C>;
  using T = typename C::DTypeKV;
  static_assert(sizeof(T) == 2 && C::TILE_KV % 8 == 0, "16-bit K in whole 8-row swizzle atoms");
  constexpr int PASSES = C::TILE_KV * C::HEAD_DIM / 8 / 32;  // 4-row passes, a 16-byte chunk a lane each
  const int r = lane / 8, c = lane % 8;
  const uint32_t even = r * 128 + (c ^ r) * 16;  // pass k: rows 4 (k % 2) + r modulo 8, chunk c ^ that
#pragma unroll 1
  for (int k = 0; k < PASSES; ++k) {
    const int row = 4 * k % C::TILE_KV, block = 4 * k / C::TILE_KV;
    const uint32_t at = block * L::KV_BLOCK + row * 128 + (even ^ (k % 2) * 64);
    const int kv_idx = key_index<C>(p, kt, row + r), dim = 64 * block + 8 * c;
    uint32_t w[4];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "r"(src + at));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = unpack2<T>(w[i]);
      w[i] = pack2<T>(flashgen::variant::k_value<typename C::Variant>(p, x.x, kt.batch, kv_idx, kt.kv_head, dim + 2 * i),
                      flashgen::variant::k_value<typename C::Variant>(p, x.y, kt.batch, kv_idx, kt.kv_head, dim + 2 * i + 1));
    }
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + at), "r"(w[0]), "r"(w[1]), "r"(w[2]),
                 "r"(w[3]));
  }
}

// The K warp's tile i (the CTA's running count), TMA-loaded (C::K_STAGED): its staging stage, once its TMA landed
// (full8: one arrival + the bytes, phase i / K16_STAGES), through the hook into 16-bit stage i % STAGES once the
// consumers released that (empty); the writes made visible to wgmma (the async proxy) before the lane arrives on
// the stage's full barrier (32 arrivals)
template <class C, class Params>
__device__ __forceinline__ void transform_k(const Params& p, const KeyTile& kt, uint32_t i, uint32_t staging,
                                            uint32_t ring, uint32_t full, uint32_t empty, uint32_t full8, int lane) {
  using L = Layout<C>;
  mbarrier_wait(full8, (i / C::K16_STAGES) & 1);
  mbarrier_wait(empty, ((i / C::STAGES) & 1) ^ 1);
  transform_k_tile<C>(p, kt, staging + i % C::K16_STAGES * L::KV_STAGE, ring + i % C::STAGES * L::KV_STAGE, lane);
  fence_proxy_async();
  mbarrier_arrive(full);
}

// A gathered K tile in its 16-bit stage at `stage`, once this lane's cp.async copies landed and the warp's are
// visible to it (__syncwarp orders them), through the hook in place; then fenced for wgmma, and the lane arrives
// on the stage's full barrier (32 arrivals, as the copies' own would)
template <class C, class Params>
__device__ __forceinline__ void transform_k_gathered(const Params& p, const KeyTile& kt, uint32_t stage, uint32_t full,
                                                     int lane) {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncwarp();
  transform_k_tile<C>(p, kt, stage, stage, lane);
  fence_proxy_async();
  mbarrier_arrive(full);
}

}  // namespace flashgen::sm90
