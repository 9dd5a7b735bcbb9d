// Paged KV at page sizes a TMA box cannot take (not a multiple of 8, or neither dividing nor divided by the KV
// tile: a box must land on whole 8-row 128B-swizzle atoms and never straddle a page): one producer warp copies a
// tile row by row with cp.async into the same layout the TMA writes, 64-column blocks of TILE_KV 128-byte rows,
// 16-byte chunk c of row r at r * 128 + (c ^ r % 8) * 16 of its block (swizzle(), as the Q loader).
//
// Lane l keeps one 16-byte column chunk, l % CHUNKS, and walks rows l / CHUNKS, + ROWS, ... (ROWS = 32 / CHUNKS
// rows a warp-wide pass: 4 at head_dim 64, 2 at 128, 1 at 256), so a pass reads whole rows, coalesced, and each
// lane's source column and destination block are constants. Row pos of the request lives in page
// pages[pos / PAGE_SIZE] at token pos % PAGE_SIZE; rows at or past kv_len copy the request's last row (see
// addresses()), so the page list is never read past its end.
// The page ids are read once a tile, each lane the rows lane + 32 i, into the warp's row addresses in shared
// memory, so no copy waits on a global load. A lane's copies complete on the stage's full barrier by
// cp.async.mbarrier.arrive.noinc (32 arrivals): the warp never waits for its copies and keeps STAGES tiles in
// flight; the consumers fence the async proxy after that barrier (cp.async writes through the generic proxy,
// wgmma reads through the async one).
#pragma once
#include <cstdint>
#include <flashgen/common/mma.cuh>

namespace flashgen::sm90 {

// 16 bytes global -> shared, to a shared-window address (mma.cuh's cp_async_16 takes a generic pointer and a
// zero-fill; the gather never zero-fills, see addresses()); through the generic proxy: the consumers fence
// the async proxy before wgmma reads it
__device__ __forceinline__ void cp_async_16_shared(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(16) : "memory");
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

  // where row r's address is kept: the rows one lane copies (r0, r0 + ROWS, ...) side by side, so that a lane reads
  // two of them with one 16-byte shared-memory load
  __device__ __forceinline__ static constexpr int slot(int r) { return r % ROWS * (C::TILE_KV / ROWS) + r / ROWS; }

  // the addresses of the tile's rows (the cache at the item's kv head) into rows[TILE_KV] (shared memory, slot());
  // lane l computes rows l, l + 32, ... A row at or past kv_len (kv_len >= 1) copies row kv_len - 1: a real row,
  // finite, whose logits the mask removes and whose V row zero_v_tail zeroes, as for a TMA page's rows past the
  // request
  __device__ __forceinline__ static void addresses(const T** rows, const T* head, const int32_t* pages,
                                                   int64_t stride_page, int64_t stride_token, int kv_len, int pos0,
                                                   int lane) {
    constexpr int PER_LANE = C::TILE_KV / 32;
    int pos[PER_LANE], page[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      pos[i] = max(min(pos0 + lane + 32 * i, kv_len - 1), 0);
      page[i] = __ldg(pages + pos[i] / C::PAGE_SIZE);
    }
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
      rows[slot(lane + 32 * i)] = head + page[i] * stride_page + (pos[i] % C::PAGE_SIZE) * stride_token;
  }

  // the tile into the stage at shared address stage: pass k copies rows r = r0 + ROWS k, r0 = lane / CHUNKS (whole
  // rows, coalesced), each lane its chunk c = lane % CHUNKS of its row. The row addresses are read BATCH at a
  // time (16-byte loads, two rows each) ahead of their copies, so the copies do not wait on one load each. As ROWS
  // is a power of two above r0, r % 8 = r0 ^ (ROWS k % 8): the swizzled chunk is the lane's c % 8 ^ r0 xor a
  // constant of the pass, and the destination a per-lane base plus an immediate.
  __device__ __forceinline__ static void load(uint32_t stage, const T* const* rows, int lane) {
    constexpr int PASSES = C::TILE_KV / ROWS, BATCH = C::GATHER_BATCH;
    static_assert(PASSES % BATCH == 0, "whole batches");
    const int c = lane % CHUNKS, r0 = lane / CHUNKS, sw = (c % 8) ^ r0;
    const uint32_t dst = stage + c / 8 * BLOCK + r0 * 128;
    const ulonglong2* mine = reinterpret_cast<const ulonglong2*>(rows + r0 * PASSES);
#pragma unroll
    for (int k0 = 0; k0 < PASSES; k0 += BATCH) {
      ulonglong2 a[BATCH / 2];
#pragma unroll
      for (int j = 0; j < BATCH / 2; ++j) a[j] = mine[k0 / 2 + j];
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        const int k = k0 + j;
        const T* row = reinterpret_cast<const T*>(j % 2 ? a[j / 2].y : a[j / 2].x);
        cp_async_16_shared(dst + ROWS * k * 128 + ((sw ^ (ROWS * k % 8)) << 4), row + c * 8);
      }
    }
  }
};

}  // namespace flashgen::sm90
