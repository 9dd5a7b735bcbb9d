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

// prefetch the 128-byte line at ptr into L1 (page ids of the next tile, while the warp waits for its stage)
__device__ __forceinline__ void prefetch_l1(const void* ptr) {
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(ptr));
}

template <class C>
struct PageRows {
  using T = typename C::DTypeKV;
  static constexpr int CHUNKS = C::HEAD_DIM / 8, ROWS = 32 / CHUNKS, BLOCK = C::TILE_KV * 128;
  static_assert(32 % CHUNKS == 0 && C::TILE_KV % ROWS == 0, "a warp pass covers whole rows of the tile");
  // 32-bit page ids of the TILE_KV rows from any position: at most this many 128-byte lines
  static constexpr int ID_LINES = ((C::TILE_KV - 1) / C::PAGE_SIZE + 2 + 31) / 32 + 1;
  static_assert(ID_LINES <= 32, "one line a lane");

  // prefetch the page ids of the tile at pos0 (lanes < ID_LINES, one line each)
  __device__ __forceinline__ static void prefetch_ids(const int32_t* pages, int last_page, int pos0, int lane) {
    if (lane < ID_LINES) prefetch_l1(pages + min(pos0 / C::PAGE_SIZE + 32 * lane, last_page));
  }

  // the tile at request position pos0 into the stage at shared address stage; col: the cache at the item's kv
  // head and this lane's column chunk (element offset kv_head * stride_head + lane % CHUNKS * 8)
  __device__ __forceinline__ static void load(uint32_t stage, const T* col, int64_t stride_page, int64_t stride_token,
                                              const int32_t* pages, int last_page, int kv_len, int pos0, int lane) {
    const int c = lane % CHUNKS;
    const uint32_t dst = stage + c / 8 * BLOCK;
#pragma unroll 8
    for (int r = lane / CHUNKS; r < C::TILE_KV; r += ROWS) {
      const int pos = pos0 + r;
      const int page = __ldg(pages + min(pos / C::PAGE_SIZE, last_page));
      const T* src = col + page * stride_page + (pos % C::PAGE_SIZE) * stride_token;
      cp_async_16_shared(dst + r * 128 + swizzle(r, c % 8) * 16, src, pos >= kv_len);
    }
  }
};

}  // namespace flashgen::sm90
