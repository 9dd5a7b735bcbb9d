// A variant's tile predicate in the Hopper prefill (C::TILE_LIST: a mask_tile hook, no explicit positions, no
// custom mask): a pre-pass kernel, launched ahead of the prefill on its stream, classifies each work item's KV
// tiles by the predicate and writes them as the tile list the prefill's producer and consumers walk
// (sm90/custom_mask.cuh: TileList), so that empty tiles are never loaded and full ones run without the mask
// hook.
//
// A warp a work index x (the item and kv head of work_of): lane l classifies tiles l, l + 32, ... of the item's
// KV range (work_of's, clipped by causal and the window) over the item's rows (every q head of the kv head's
// group, the queries of its tokens) and keys [t0, min(t0 + TILE_KV, kv_hi)); the warp compacts the non-empty
// ones by a ballot, in ascending order, as entries t << ENTRY_SHIFT | kind (t counted from kv_lo; ENTRY_FULL
// where every pair is kept, else ENTRY_BITS: the consumers then classify the tile again over their own 64 rows
// and run the mask hook per pair where that is partial), and lane 0 writes the count before them
// (tile_list_of). Padding items are left alone: no warp of the prefill reads them.
#pragma once
#include <cstdint>
#include <flashgen/common/fastdiv.cuh>
#include <flashgen/common/tile_entry.cuh>
#include <flashgen/common/variant.cuh>
#include <flashgen/sm90/tile_scheduler.cuh>

namespace flashgen::sm90 {

constexpr int TILE_LIST_WARPS = 4;  // warps a CTA of the pre-pass (flashgen/kernels/prefill_sm90.py: its block)

template <class C, class Params>
__device__ __forceinline__ void plan_tiles(const Params& p) {
  using namespace flashgen::variant;
  const int lane = threadIdx.x % 32, x = blockIdx.x * TILE_LIST_WARPS + threadIdx.x / 32;
  if (x >= p.num_items * p.num_kv_heads) return;  // (uniform over the warp)
  const Work w = work_of<C, false>(p, x);
  if (!w.valid) return;
  const int item = p.num_items - 1 - x % p.num_items, request = p.request_idx[item];
  // the prefill's plan-owned buffer, read-only to the prefill itself (hence const in the params)
  int32_t* list = const_cast<int32_t*>(tile_list_of(p, item, w.kv_head));
  const FastDiv group = group_of(p);
  const int qo_begin = w.q_base + group.div(w.row0), qo_end = w.q_base + group.div(w.last_row) + 1;
  int count = 0;
  for (int base = 0; base < w.num_tiles; base += 32) {  // (uniform over the warp)
    const int t = base + lane;
    int cls = TILE_EMPTY;
    if (t < w.num_tiles) {
      const int kv_begin = w.kv_lo + t * C::TILE_KV;
      cls = tile_class<typename C::Variant>(p, request, w.kv_head * group.d, group.d, w.kv_head, qo_begin, qo_end,
                                            kv_begin, min(kv_begin + C::TILE_KV, w.kv_hi));
    }
    const uint32_t kept = __ballot_sync(0xffffffff, cls != TILE_EMPTY);
    if (cls != TILE_EMPTY)
      list[1 + count + __popc(kept & ((1u << lane) - 1u))] = t << ENTRY_SHIFT | (cls == TILE_FULL ? ENTRY_FULL : ENTRY_BITS);
    count += __popc(kept);
  }
  if (lane == 0) list[0] = count;
}

}  // namespace flashgen::sm90
