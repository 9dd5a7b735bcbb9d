// A variant's mask in the Hopper prefill (C::TILE_LIST: a mask hook, no explicit positions, no custom mask): each
// work item's KV tiles classified and written as the tile list the prefill's producer and consumers walk
// (sm90/custom_mask.cuh: TileList), so that empty tiles are never loaded and full ones run without the mask hook.
//
// A work index x (the item and kv head of work_of) walks the item's KV range (work_of's, clipped by causal and
// the window) in tiles of keys [t0, min(t0 + TILE_KV, kv_hi)), counted from kv_lo. With a tile predicate
// (mask_tile) producer warp 3 of the prefill itself writes the lists (produce_lists; list_warp in
// sm90/tile_scheduler.cuh), a work index at a time, lane l classifying tiles l, l + 32, ... over the item's rows
// (every q head of the kv head's group, the queries of its tokens), a few items ahead of the scheduler. Without
// one a pre-pass kernel, launched ahead of the prefill on its stream, takes a CTA of TILE_HOOK_WARPS warps a work
// index (plan_tiles_by_hook): warp w classifies tiles w, w + TILE_HOOK_WARPS, ... of a chunk of HOOK_CHUNK_TILES
// by the mask hook itself (mask_hook_class) into shared memory, a byte a tile. The non-empty tiles are compacted
// by a ballot, in ascending order, as entries t << ENTRY_SHIFT | kind (ENTRY_FULL where every pair is kept, else
// ENTRY_BITS: the consumers then run the mask hook per pair, after classifying the tile again over their own 64
// rows where there is a predicate), the count written before them (tile_list_of). Padding items are left alone:
// no warp of the prefill reads them.
//
// PER_HEAD = false (a mask hook that names neither qo_head nor kv_head: kernels/prefill_sm90.py
// sm90_tile_heads): only kv head 0's work indices run, each classifying over its item's distinct query tokens,
// and write the same list for every kv head.
#pragma once
#include <cstdint>
#include <type_traits>
#include <flashgen/common/fastdiv.cuh>
#include <flashgen/common/tile_entry.cuh>
#include <flashgen/common/variant.cuh>
#include <flashgen/sm90/layout.cuh>
#include <flashgen/sm90/tile_scheduler.cuh>
#include <flashgen/sm90/tma.cuh>

namespace flashgen::sm90 {

constexpr int TILE_HOOK_WARPS = 8;  // warps a CTA of the mask hook's pre-pass, a CTA a work index
constexpr int HOOK_CHUNK_TILES = 1024;  // tiles the mask hook's CTA classifies between two compactions
constexpr int HOOK_ROWS_A_VOTE = 8;  // rows a lane evaluates between two votes of mask_hook_class

// The pre-pass's block (kernels/prefill_sm90.py: TILE_HOOK_THREADS)
template <class C>
constexpr int tile_list_threads() {
  return 32 * TILE_HOOK_WARPS;
}

// The class of item w's KV tile [kv_begin, kv_end) by the mask hook, evaluated over exactly the pairs the prefill
// would pass to it: the item's rows (PER_HEAD: its packed rows, each a (token, q head); else its tokens, at q head
// and kv head 0) against the tile's keys before kv_hi, <= the row's query position (causal) and within its window.
// Lane l takes keys kv_begin + l + 32 j. A step takes HOOK_ROWS_A_VOTE rows (past the last row it repeats that
// one: the same pairs again) in one straight line, with no branch between the hook's calls, so that their loads
// are in flight together; where every row of the step sees every key of the tile (a whole tile, causal: its
// first row sees the last key, window: its last row the first key) the pairs go unbounded, and where the step's
// rows are all the item's its rows go unclamped (r0 + u: the hook's row addresses then step by the tensor's stride,
// ~110 SASS a step for the document mask against ~175 with min(r0 + u, last) a row). After each step the
// warp votes on "some pair kept" and "some pair dropped": both seen -> TILE_PARTIAL at once; at the end
// TILE_FULL where some pair was kept (and none dropped), else TILE_EMPTY (also where the spec's mask hides every
// pair: the prefill's tile would add nothing). The result is uniform over the warp.
template <class C, bool PER_HEAD, class Params>
__device__ __forceinline__ int mask_hook_class(const Params& p, const Work& w, const FastDiv& group, int request,
                                               int lane, int kv_begin, int kv_end) {
  using V = typename C::Variant;
  static_assert(V::MASK && !V::MASK_TILE, "the mask hook classifies tiles where no predicate does");
  static_assert(C::TILE_KV % 32 == 0, "a lane's keys: kv_begin + lane + 32 j");
  const int first = PER_HEAD ? w.row0 : group.div(w.row0), last = PER_HEAD ? w.last_row : group.div(w.last_row);
  auto q_pos_of = [&](int r) { return w.q_base + (PER_HEAD ? group.div(r) : r); };
  bool kept = false, dropped = false;  // this lane's pairs so far
  auto step = [&](int r0, auto bounded, auto clamped) {
#pragma unroll
    for (int u = 0; u < HOOK_ROWS_A_VOTE; ++u) {
      const int r = decltype(clamped)::value ? min(r0 + u, last) : r0 + u;
      int token = r, head = 0;
      if constexpr (PER_HEAD) group.divmod(r, token, head);
      const int q_pos = w.q_base + token, qo_head = w.kv_head * group.d + head;
      int lo = kv_begin, hi = kv_end;  // the keys of the tile the row sees under the spec's mask
      if constexpr (C::CAUSAL) hi = min(hi, q_pos + 1);
      if constexpr (C::WINDOW) lo = max(lo, q_pos - p.window_left);
#pragma unroll
      for (int j = 0; j < C::TILE_KV / 32; ++j) {
        const int key = kv_begin + lane + 32 * j;
        if (!decltype(bounded)::value || (key >= lo && key < hi)) {
          const bool keep = V::mask(p.variant, request, q_pos, key, qo_head, w.kv_head,
                                    flashgen::variant::distance_at<V>(q_pos, key));
          kept |= keep;
          dropped |= !keep;
        }
      }
    }
  };
  for (int r0 = first; r0 <= last; r0 += HOOK_ROWS_A_VOTE) {  // (uniform over the warp)
    const int r1 = min(r0 + HOOK_ROWS_A_VOTE - 1, last);
    const bool whole = kv_end - kv_begin == C::TILE_KV && (!C::CAUSAL || q_pos_of(r0) + 1 >= kv_end) &&
                       (!C::WINDOW || q_pos_of(r1) - p.window_left <= kv_begin);
    if (whole && r1 == r0 + HOOK_ROWS_A_VOTE - 1) {
      step(r0, std::false_type{}, std::false_type{});
    } else if (whole) {
      step(r0, std::false_type{}, std::true_type{});
    } else {
      step(r0, std::true_type{}, std::true_type{});
    }
    if (__any_sync(0xffffffff, kept) && __any_sync(0xffffffff, dropped)) return flashgen::variant::TILE_PARTIAL;
  }
  return __any_sync(0xffffffff, kept) ? flashgen::variant::TILE_FULL : flashgen::variant::TILE_EMPTY;
}

// The mask hook's pre-pass: CTA x (a work index) classifies its item's tiles, TILE_HOOK_WARPS warps a chunk of
// HOOK_CHUNK_TILES at a time, and compacts each chunk as the predicate's warp does its 32 tiles. Every warp walks
// the chunk's ballots alike (so every thread holds the count) and writes the entries of its kv heads' lists:
// PER_HEAD, warp 0 its work index's; else warp w kv heads w, w + TILE_HOOK_WARPS, ... (the lists of an item
// follow kv head 0's at a stride of its size: tile_list_of).
template <class C, bool PER_HEAD, class Params>
__device__ __forceinline__ void plan_tiles_by_hook(const Params& p) {
  using namespace flashgen::variant;
  __shared__ uint8_t classes[HOOK_CHUNK_TILES];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, x = blockIdx.x;
  if (x >= p.num_items * (PER_HEAD ? p.num_kv_heads : 1)) return;  // (uniform over the CTA)
  const Work w = work_of<C, false>(p, x);
  if (!w.valid) return;
  const int item = p.num_items - 1 - x % p.num_items, request = p.request_idx[item];
  // the prefill's plan-owned buffer, read-only to the prefill itself (hence const in the params)
  int32_t* list = const_cast<int32_t*>(tile_list_of(p, item, w.kv_head));
  const int64_t stride = p.tile_indptr[item + 1] - p.tile_indptr[item];
  const int heads = PER_HEAD ? 1 : p.num_kv_heads;
  const FastDiv group = group_of(p);
  int count = 0;
  for (int c0 = 0; c0 < w.num_tiles; c0 += HOOK_CHUNK_TILES) {  // (uniform over the CTA)
    const int n = min(HOOK_CHUNK_TILES, w.num_tiles - c0);
    for (int t = warp; t < n; t += TILE_HOOK_WARPS) {  // (uniform over the warp)
      const int kv_begin = w.kv_lo + (c0 + t) * C::TILE_KV;
      const int cls = mask_hook_class<C, PER_HEAD>(p, w, group, request, lane, kv_begin,
                                                   min(kv_begin + C::TILE_KV, w.kv_hi));
      if (lane == 0) classes[t] = cls;
    }
    __syncthreads();
    for (int b = 0; b < n; b += 32) {  // (uniform over the CTA)
      const int t = b + lane, cls = t < n ? classes[t] : TILE_EMPTY;
      const uint32_t kept = __ballot_sync(0xffffffff, cls != TILE_EMPTY);
      if (cls != TILE_EMPTY) {
        const int at = 1 + count + __popc(kept & ((1u << lane) - 1u));
        const int entry = (c0 + t) << ENTRY_SHIFT | (cls == TILE_FULL ? ENTRY_FULL : ENTRY_BITS);
        for (int h = warp; h < heads; h += TILE_HOOK_WARPS) list[h * stride + at] = entry;
      }
      count += __popc(kept);
    }
    __syncthreads();  // the chunk's classes are read before the next chunk's overwrite them
  }
  for (int h = threadIdx.x; h < heads; h += TILE_HOOK_WARPS * 32) list[h * stride] = count;
}

// A tile list by the tile predicate, into `list` (tile_list_of): a warp, lane l classifying tiles l, l + 32, ... of
// the item's range from kv_lo (num_tiles tiles, cut at kv_hi) over queries [qo_begin, qo_end) of the kv head's
// group, compacted 32 at a time by a ballot, the count written last by lane 0.
template <class C, class Params>
__device__ __forceinline__ void write_tile_list(const Params& p, int32_t* list, int request, int kv_head, int qo_begin,
                                                int qo_end, int kv_lo, int kv_hi, int num_tiles, int lane) {
  using namespace flashgen::variant;
  const int group = p.group_size;
  int count = 0;
  for (int base = 0; base < num_tiles; base += 32) {  // (uniform over the warp)
    const int t = base + lane;
    int cls = TILE_EMPTY;
    if (t < num_tiles) {
      const int kv_begin = kv_lo + t * C::TILE_KV;
      cls = tile_class<typename C::Variant>(p, request, kv_head * group, group, kv_head, qo_begin, qo_end, kv_begin,
                                            min(kv_begin + C::TILE_KV, kv_hi));
    }
    const uint32_t kept = __ballot_sync(0xffffffff, cls != TILE_EMPTY);
    if (cls != TILE_EMPTY) {
      list[1 + count + __popc(kept & ((1u << lane) - 1u))] = t << ENTRY_SHIFT | (cls == TILE_FULL ? ENTRY_FULL : ENTRY_BITS);
    }
    count += __popc(kept);
  }
  if (lane == 0) list[0] = count;
}

// The pre-pass (prefill_sm90_tiles) of a mask hook without a tile predicate (plan_tiles_by_hook). A predicate's
// lists are written in the prefill itself, by producer warp 3 (produce_lists).
template <class C, bool PER_HEAD, class Params>
__device__ __forceinline__ void plan_tiles(const Params& p) {
  static_assert(!C::Variant::MASK_TILE, "a tile predicate's lists are the list warp's (produce_lists)");
  plan_tiles_by_hook<C, PER_HEAD>(p);
}

// Producer warp 3 of the prefill with a tile predicate (list_warp): the tile list of each of the CTA's items, in
// the scheduler's order (the work indices it takes, padding items skipped alike), item k's announced on
// list_full(k % WORK_SLOTS), which the scheduler waits for before it reads the list's count (work_of). The warp
// waits for item k's Work slot as the scheduler does, so that it runs at most WORK_SLOTS items ahead (a list
// barrier's phase then never runs past the scheduler's wait); with two Q buffers the scheduler waits for Q, so
// the lists are written up to two items before their Work is published, the first item's before anything runs.
// The entries' writes reach the list's readers through the barriers: each lane's before __syncwarp, the warp's
// before lane 0's release (mbarrier_arrive), the scheduler's acquire and its release of the Work slot (work_full)
// to the K / V warps and the consumers, who read the entries by coherent loads (TileList::entry).
template <class C, class Params>
__device__ __forceinline__ void produce_lists(const Params& p, const Barriers<C>& bars) {
  static_assert(list_warp<C>(), "the list warp writes a tile predicate's lists");
  const int lane = threadIdx.x % 32;
  int k = 0;
  for (int x = blockIdx.x; x < p.num_items * p.num_kv_heads; x += gridDim.x) {
    mbarrier_wait_backoff<128>(bars.work_empty(k % WORK_SLOTS), ((k / WORK_SLOTS) & 1) ^ 1);
    // the item's Work fields the list needs (as work_of computes them, without what only the loads use)
    const int item = p.num_items - 1 - x % p.num_items, request = p.request_idx[item];
    if (request < 0) continue;  // padding: work_of's invalid Work, which the scheduler skips alike
    const FastDiv group = group_of(p);
    const int kv_head = x / p.num_items, qo_len = p.qo_indptr[request + 1] - p.qo_indptr[request];
    const int row0 = p.qo_tile_idx[item] * C::TILE_Q, last_row = min(row0 + C::TILE_Q, qo_len * group.d) - 1;
    const int q_base = p.kv_len[request] - qo_len;
    const int qo_begin = q_base + group.div(row0), qo_end = q_base + group.div(last_row) + 1;
    int kv_lo = p.kv_start[item], kv_hi = p.kv_end[item];
    if constexpr (C::CAUSAL && !C::POSITIONS) kv_hi = min(kv_hi, qo_end);
    if constexpr (C::WINDOW && !C::POSITIONS) {
      const int first = qo_begin - p.window_left;
      if (first > kv_lo) kv_lo += (first - kv_lo) / C::TILE_KV * C::TILE_KV;
    }
    const int num_tiles = kv_hi > kv_lo ? (kv_hi - kv_lo + C::TILE_KV - 1) / C::TILE_KV : 0;
    // the prefill's plan-owned buffer, read-only to the rest of the kernel (hence const in the params)
    int32_t* list = const_cast<int32_t*>(tile_list_of(p, item, kv_head));
    write_tile_list<C>(p, list, request, kv_head, qo_begin, qo_end, kv_lo, kv_hi, num_tiles, lane);
    __syncwarp();
    if (lane == 0) mbarrier_arrive(bars.list_full(k % WORK_SLOTS));
    ++k;
  }
}

}  // namespace flashgen::sm90
