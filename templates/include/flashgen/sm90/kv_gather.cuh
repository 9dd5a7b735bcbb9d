// Paged KV at page sizes a TMA box cannot take (not a multiple of 8, or neither dividing nor divided by the KV
// tile: a box must land on whole 8-row 128B-swizzle atoms and never straddle a page): one producer warp copies a
// tile row by row with cp.async into the same layout the TMA writes, 64-column blocks of TILE_KV 128-byte rows,
// 16-byte chunk c of row r at r * 128 + (c ^ r % 8) * 16 of its block (swizzle(), as the Q loader).
//
// Lane l keeps one 16-byte column chunk, l % CHUNKS, and walks rows l / CHUNKS, + ROWS, ... (ROWS = 32 / CHUNKS
// rows a warp-wide pass: 4 at head_dim 64, 2 at 128, 1 at 256), so a pass reads whole rows, coalesced, and each
// lane's source column and destination block are constants. Row pos of the request lives in page
// pages[pos / PAGE_SIZE] (the index clamped to the request's last page, so that the page list is never read
// past its end) at token pos % PAGE_SIZE; rows at or past kv_len are zero-filled (src-size 0, nothing read).
// The page ids are read once a tile, each lane the rows lane + 32 i, into the warp's row offsets in shared memory,
// so no copy waits on a global load. A lane's copies complete on the stage's full barrier by
// cp.async.mbarrier.arrive.noinc (32 arrivals): the warp never waits for its copies and keeps STAGES tiles in
// flight; the consumers fence the async proxy after that barrier (cp.async writes through the generic proxy,
// wgmma reads through the async one).
#pragma once
#include <cstdint>
#include <flashgen/mma.cuh>

namespace flashgen::sm90 {

// 16 bytes global -> shared (a shared-window address), zeros and no read with fill_zero; completes with the
// thread's cp.async groups (generic proxy: fence.proxy.async before wgmma may read it)
__device__ __forceinline__ void cp_async_16_shared(uint32_t dst, const void* src, bool fill_zero) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(fill_zero ? 0 : 16)
               : "memory");
}

// arrive on the mbarrier at bar once all of this thread's earlier cp.async copies have landed (asynchronously: the
// thread runs on); .noinc: the arrival counts against the barrier's expected count, one per lane and phase
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

template <class C>
struct PageRows {
  using T = typename C::DTypeKV;
  static constexpr int CHUNKS = C::HEAD_DIM / 8, ROWS = 32 / CHUNKS, BLOCK = C::TILE_KV * 128;
  static_assert(32 % CHUNKS == 0 && C::TILE_KV % 32 == 0, "a warp pass covers whole rows");

  // the element offsets (from the cache at the item's kv head) of the tile's rows into off[TILE_KV] (shared
  // memory), -1 for a row at or past kv_len (zero-filled); lane l computes rows l, l + 32, ...; the page list is
  // read clamped to the request's last page
  __device__ __forceinline__ static void offsets(int64_t* off, const int32_t* pages, int last_page,
                                                 int64_t stride_page, int64_t stride_token, int kv_len, int pos0,
                                                 int lane) {
    constexpr int PER_LANE = C::TILE_KV / 32;
    int32_t page[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) page[i] = __ldg(pages + min((pos0 + lane + 32 * i) / C::PAGE_SIZE, last_page));
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int pos = pos0 + lane + 32 * i;
      off[lane + 32 * i] = pos < kv_len ? page[i] * stride_page + (pos % C::PAGE_SIZE) * stride_token : -1;
    }
  }

  // the tile into the stage at shared address stage: pass k copies rows r = lane / CHUNKS + ROWS k (whole rows,
  // coalesced), each lane its chunk lane % CHUNKS of its row (the row's offset a broadcast shared-memory read).
  // col: the cache at the item's kv head and this lane's chunk (element offset kv_head * stride_head + lane % CHUNKS * 8)
  __device__ __forceinline__ static void load(uint32_t stage, const T* col, const int64_t* off, int lane) {
    const int c = lane % CHUNKS, r0 = lane / CHUNKS;
    const uint32_t dst = stage + c / 8 * BLOCK;
#pragma unroll 8
    for (int r = r0; r < C::TILE_KV; r += ROWS) {
      const int64_t o = off[r];
      cp_async_16_shared(dst + r * 128 + swizzle(r, c % 8) * 16, col + (o < 0 ? 0 : o), o < 0);
    }
  }
};

}  // namespace flashgen::sm90
