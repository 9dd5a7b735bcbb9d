// The Hopper prefill's tile scheduler: the CTA's list of work items and what the producer and consumer warps
// need of each (a Work). Persistent CTAs (one per SM) walk the list: work index x in [0, num_items *
// num_kv_heads) is kv head x / num_items and plan item num_items - 1 - x % num_items (a request's later, longer
// causal q tiles first); CTA c takes x = c, c + gridDim.x, ... Warps 2-3 of the producer warpgroup, the
// scheduler, compute each item's Work once (work_of) and publish it in a ring of WORK_SLOTS shared-memory slots
// (sm90/layout.cuh: read_work; sm90/producer.cuh: produce_q).
#pragma once
#include <cstdint>
#include <flashgen/common/fastdiv.cuh>

namespace flashgen::sm90 {

// A work item: its packed rows and KV range. Packed row prow -> token token0 + prow / group,
// q head kv_head * group + prow % group, query position q_base + prow / group (group: group_of).
struct Work {
  int token0, row0, rows_total, last_row, kv_head, q_base, kv_lo, kv_hi, kv_row0, num_tiles, last_page;
  const int32_t* pages;  // paged: the request's page ids (kv_indices + kv_indptr[request], or a block_table row)
  const int32_t* tiles;  // custom mask: the item's tile list (num_tiles entries)
  int64_t mask_bit0;     // custom mask: the bit of the request's (token 0, key 0)
  bool valid;
  // the request's KV length: its queries are its last rows_total / group positions, the first at q_base
  __device__ __forceinline__ int kv_len(const FastDiv& group) const { return q_base + group.div(rows_total); }
};

// The GQA group (q heads a kv head) as a divider: a packed row's token and q head are its quotient and
// remainder, by a multiply-high with the plan's magic numbers (fastdiv.cuh) where `/` by the runtime group
// costs ~20 instructions, about six times an item a consumer thread. Rebuilt from the params at each use,
// so its fields are constant-bank operands, not registers held across the item.
template <class Params>
__device__ __forceinline__ FastDiv group_of(const Params& p) {
  return {p.group_magic, p.group_shift, p.group_size};
}

// Work slots: the scheduler publishes item k in slot k % WORK_SLOTS once its previous occupant was read by the
// 64 threads of the K and V warps and the 256 consumer threads (WORK_READERS arrivals on work_empty)
constexpr int WORK_SLOTS = 4, WORK_READERS = 64 + 256;

// Whether producer warp 3 writes the items' tile lists in the kernel (sm90/tile_lists.cuh produce_lists): a
// variant's tile predicate (C::TILE_LIST with mask_tile). A mask hook without one keeps its pre-pass kernel, a CTA
// an item.
template <class C>
constexpr bool list_warp() {
  return C::TILE_LIST && C::Variant::MASK_TILE;
}

// A coherent 32-bit load (ld.relaxed.cta): for what another warp of the CTA wrote to global memory during the
// kernel, read after the barrier wait that orders the two (a plain const load may be issued as a non-coherent
// one, which need not see it; volatile, so that it stays after the wait, itself volatile asm)
__device__ __forceinline__ int load_relaxed(const int32_t* at) {
  int v;
  asm volatile("ld.relaxed.cta.global.b32 %0, [%1];\n" : "=r"(v) : "l"(at));
  return v;
}

// A variant tile predicate's list of (item, kv head) (C::TILE_LIST): written by the list warp or the pre-pass
// (sm90/tile_lists.cuh) at p.tiles + num_kv_heads * tile_indptr[item] + kv_head * (tile_indptr[item + 1] -
// tile_indptr[item]), the count first, then the entries. tile_indptr (planned on the host) gives an item one more
// int a kv head than its KV range has tiles.
template <class Params>
__device__ __forceinline__ const int32_t* tile_list_of(const Params& p, int item, int kv_head) {
  const int first = p.tile_indptr[item], size = p.tile_indptr[item + 1] - first;
  return p.tiles + int64_t(first) * p.num_kv_heads + int64_t(kv_head) * size;
}

// Work index x's item. LISTED = false: its KV range as such (the pre-pass that writes a tile predicate's lists)
template <class C, bool LISTED = true, class Params>
__device__ __forceinline__ Work work_of(const Params& p, int x) {
  Work w;
  const int item = p.num_items - 1 - x % p.num_items, request = p.request_idx[item];
  w.valid = request >= 0;  // padding items of a fixed-capacity plan are skipped by every warp alike
  if (!w.valid) return w;
  w.token0 = p.qo_indptr[request];
  const int qo_len = p.qo_indptr[request + 1] - w.token0, kv_len = p.kv_len[request];
  const FastDiv group = group_of(p);
  w.kv_head = x / p.num_items;
  w.row0 = p.qo_tile_idx[item] * C::TILE_Q;
  w.rows_total = qo_len * group.d;
  w.last_row = min(w.row0 + C::TILE_Q, w.rows_total) - 1;
  w.q_base = kv_len - qo_len;
  w.kv_lo = p.kv_start[item];
  w.kv_hi = p.kv_end[item];
  // explicit positions (C::POSITIONS): keys need not be contiguous in position, so the range is not clipped
  if constexpr (C::CAUSAL && !C::POSITIONS) w.kv_hi = min(w.kv_hi, w.q_base + group.div(w.last_row) + 1);
  if constexpr (C::WINDOW && !C::POSITIONS) {  // keys before the first row's window: whole tiles skipped, the start tile-aligned
    const int first = w.q_base + group.div(w.row0) - p.window_left;
    if (first > w.kv_lo) w.kv_lo += (first - w.kv_lo) / C::TILE_KV * C::TILE_KV;
  }
  w.num_tiles = w.kv_hi > w.kv_lo ? (w.kv_hi - w.kv_lo + C::TILE_KV - 1) / C::TILE_KV : 0;
  w.tiles = nullptr;
  w.mask_bit0 = 0;
  if constexpr (C::CUSTOM_MASK) {  // the planned list of tiles some row can see replaces the range
    const int first = p.tile_indptr[item];
    w.tiles = p.tiles + first;
    w.num_tiles = p.tile_indptr[item + 1] - first;
    w.mask_bit0 = p.mask_offset[request];
  }
  if constexpr (C::TILE_LIST && LISTED) {  // the tiles of the range the tile predicate did not call empty
    const int32_t* list = tile_list_of(p, item, w.kv_head);
    w.num_tiles = list_warp<C>() ? load_relaxed(list) : list[0];
    w.tiles = list + 1;
  }
  if constexpr (C::PAGED) {
    w.pages = p.block_table != nullptr ? p.block_table + int64_t(request) * p.block_table_stride
                                       : p.kv_indices + p.kv_indptr[request];
    w.last_page = max(kv_len - 1, 0) / C::PAGE_SIZE;
    w.kv_row0 = 0;
  } else {
    w.pages = nullptr;
    w.last_page = 0;
    w.kv_row0 = p.kv_indptr[request];  // row of the K / V tensors (ragged: requests concatenated)
  }
  return w;
}

}  // namespace flashgen::sm90
