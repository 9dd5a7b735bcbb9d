// A variant's mask in the Hopper prefill (C::TILE_LIST: a mask hook, no explicit positions, no custom mask): a
// pre-pass kernel, launched ahead of the prefill on its stream, classifies each work item's KV tiles and writes
// them as the tile list the prefill's producer and consumers walk (sm90/custom_mask.cuh: TileList), so that
// empty tiles are never loaded and full ones run without the mask hook.
//
// A warp a work index x (the item and kv head of work_of) walks the item's KV range (work_of's, clipped by causal
// and the window) in tiles of keys [t0, min(t0 + TILE_KV, kv_hi)). With a tile predicate (mask_tile) lane l
// classifies tiles l, l + 32, ... over the item's rows (every q head of the kv head's group, the queries of its
// tokens); without one the warp classifies each tile together by the mask hook itself (mask_hook_class). The
// warp compacts the non-empty tiles by a ballot, in ascending order, as entries t << ENTRY_SHIFT | kind (t
// counted from kv_lo; ENTRY_FULL where every pair is kept, else ENTRY_BITS: the consumers then run the mask hook
// per pair, after classifying the tile again over their own 64 rows where there is a predicate), and lane 0
// writes the count before them (tile_list_of). Padding items are left alone: no warp of the prefill reads them.
//
// PER_HEAD = false (a mask hook that names neither qo_head nor kv_head: kernels/prefill_sm90.py
// sm90_tile_heads): the warps of kv head 0 alone run, each classifying over its item's distinct query tokens,
// and write the same list for every kv head.
#pragma once
#include <cstdint>
#include <flashgen/common/fastdiv.cuh>
#include <flashgen/common/tile_entry.cuh>
#include <flashgen/common/variant.cuh>
#include <flashgen/sm90/tile_scheduler.cuh>

namespace flashgen::sm90 {

constexpr int TILE_LIST_WARPS = 4;  // warps a CTA of the pre-pass (flashgen/kernels/prefill_sm90.py: its block)
constexpr int HOOK_ROWS_A_VOTE = 4;  // rows the warp evaluates between two votes of mask_hook_class

// The class of item w's KV tile [kv_begin, kv_end) by the mask hook, evaluated over exactly the pairs the prefill
// would pass to it: the item's rows (PER_HEAD: its packed rows, each a (token, q head); else its tokens, at q head
// and kv head 0) against the tile's keys before kv_hi, <= the row's query position (causal) and within its window.
// Lane l takes keys kv_begin + l + 32 j, a loop takes the rows, HOOK_ROWS_A_VOTE between votes of the warp on
// "some pair kept" and "some pair dropped": both seen -> TILE_PARTIAL at once; at the end TILE_FULL where no pair
// was dropped, else TILE_EMPTY (also where the spec's mask hides every pair: the prefill's tile would add
// nothing). The result is uniform over the warp.
template <class C, bool PER_HEAD, class Params>
__device__ __forceinline__ int mask_hook_class(const Params& p, const Work& w, const FastDiv& group, int request,
                                               int lane, int kv_begin, int kv_end) {
  using V = typename C::Variant;
  static_assert(V::MASK && !V::MASK_TILE, "the mask hook classifies tiles where no predicate does");
  const int first = PER_HEAD ? w.row0 : group.div(w.row0), last = PER_HEAD ? w.last_row : group.div(w.last_row);
  bool kept = false, dropped = false;  // this lane's pairs so far
  for (int r0 = first; r0 <= last; r0 += HOOK_ROWS_A_VOTE) {  // (uniform over the warp)
#pragma unroll
    for (int u = 0; u < HOOK_ROWS_A_VOTE; ++u) {
      const int r = r0 + u;
      if (r > last) break;
      int token = r, head = 0;
      if constexpr (PER_HEAD) group.divmod(r, token, head);
      const int q_pos = w.q_base + token, qo_head = w.kv_head * group.d + head;
      int lo = kv_begin, hi = kv_end;  // the keys of the tile the row sees under the spec's mask
      if constexpr (C::CAUSAL) hi = min(hi, q_pos + 1);
      if constexpr (C::WINDOW) lo = max(lo, q_pos - p.window_left);
#pragma unroll
      for (int j = 0; j < C::TILE_KV / 32; ++j) {
        const int key = kv_begin + lane + 32 * j;
        if (key >= lo && key < hi) {
          const bool keep = V::mask(p.variant, request, q_pos, key, qo_head, w.kv_head);
          kept |= keep;
          dropped |= !keep;
        }
      }
    }
    if (__any_sync(0xffffffff, kept) && __any_sync(0xffffffff, dropped)) return flashgen::variant::TILE_PARTIAL;
  }
  return __any_sync(0xffffffff, dropped) ? flashgen::variant::TILE_EMPTY : flashgen::variant::TILE_FULL;
}

template <class C, bool PER_HEAD, class Params>
__device__ __forceinline__ void plan_tiles(const Params& p) {
  using namespace flashgen::variant;
  const int lane = threadIdx.x % 32, x = blockIdx.x * TILE_LIST_WARPS + threadIdx.x / 32;
  if (x >= p.num_items * (PER_HEAD ? p.num_kv_heads : 1)) return;  // (uniform over the warp)
  const Work w = work_of<C, false>(p, x);
  if (!w.valid) return;
  const int item = p.num_items - 1 - x % p.num_items, request = p.request_idx[item];
  // the prefill's plan-owned buffer, read-only to the prefill itself (hence const in the params); without
  // PER_HEAD the warp of kv head 0 writes every kv head's list
  int32_t* list = const_cast<int32_t*>(tile_list_of(p, item, w.kv_head));
  const FastDiv group = group_of(p);
  const int qo_begin = w.q_base + group.div(w.row0), qo_end = w.q_base + group.div(w.last_row) + 1;
  int count = 0;
  for (int base = 0; base < w.num_tiles; base += 32) {  // (uniform over the warp)
    const int t = base + lane;
    int cls = TILE_EMPTY;
    if constexpr (C::Variant::MASK_TILE) {
      if (t < w.num_tiles) {
        const int kv_begin = w.kv_lo + t * C::TILE_KV;
        cls = tile_class<typename C::Variant>(p, request, w.kv_head * group.d, group.d, w.kv_head, qo_begin, qo_end,
                                              kv_begin, min(kv_begin + C::TILE_KV, w.kv_hi));
      }
    } else {  // tiles base .. base + 31 one after another, each by the whole warp; lane t - base keeps tile t's
      for (int u = base; u < min(base + 32, w.num_tiles); ++u) {
        const int kv_begin = w.kv_lo + u * C::TILE_KV;
        const int c = mask_hook_class<C, PER_HEAD>(p, w, group, request, lane, kv_begin,
                                                   min(kv_begin + C::TILE_KV, w.kv_hi));
        if (u == t) cls = c;
      }
    }
    const uint32_t kept = __ballot_sync(0xffffffff, cls != TILE_EMPTY);
    if (cls != TILE_EMPTY) {
      if constexpr (PER_HEAD) {
        list[1 + count + __popc(kept & ((1u << lane) - 1u))] = t << ENTRY_SHIFT | (cls == TILE_FULL ? ENTRY_FULL : ENTRY_BITS);
      } else {
        const int at = 1 + count + __popc(kept & ((1u << lane) - 1u));
        const int entry = t << ENTRY_SHIFT | (cls == TILE_FULL ? ENTRY_FULL : ENTRY_BITS);
        for (int h = 0; h < p.num_kv_heads; ++h) const_cast<int32_t*>(tile_list_of(p, item, h))[at] = entry;
      }
    }
    count += __popc(kept);
  }
  if constexpr (PER_HEAD) {
    if (lane == 0) list[0] = count;
  } else {
    for (int h = lane; h < p.num_kv_heads; h += 32) const_cast<int32_t*>(tile_list_of(p, item, h))[0] = count;
  }
}

}  // namespace flashgen::sm90
