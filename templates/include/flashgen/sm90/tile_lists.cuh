// A variant's mask in the Hopper prefill (C::TILE_LIST: a mask hook, no explicit positions, no custom mask): each
// work item's KV tiles classified and written as the tile list the prefill's producer and consumers walk
// (sm90/custom_mask.cuh: TileList), so that empty tiles are never loaded and full ones run without the mask hook.
//
// A work index x (the item and kv head of work_of) walks the item's KV range (work_of's, clipped by causal and
// the window) in tiles of keys [t0, min(t0 + TILE_KV, kv_hi)), counted from kv_lo. With a tile predicate
// (mask_tile) producer warp 3 of the prefill itself writes the lists (produce_lists; list_warp in
// sm90/tile_scheduler.cuh), a work index at a time, lane l classifying tiles l, l + 32, ... over the item's rows
// (every q head of the kv head's group, the queries of its tokens), a few items ahead of the scheduler. Without
// one a pre-pass kernel, launched ahead of the prefill on its stream, classifies the tiles by the mask hook itself
// (plan_tiles_by_hook, mask_hook_class), a warp a tile, every warp of its grid striding over the slots of all the
// lists at once, so that an item's tiles spread over the SMs (one item's are all a CTA's where a CTA takes an
// item: at 1x16384 causal the last q tile's 128 tiles, ~50 us of one SM's issue). Each class goes into the tile's
// own slot of its list, and the warp that classifies an item's last tile (an arrival count a list, back to 0 for
// the next launch) compacts the list in place by ballots, in ascending order, as entries t << ENTRY_SHIFT | kind
// (ENTRY_FULL where every pair is kept, else ENTRY_BITS: the consumers then run the mask hook per pair), the
// count written before them (tile_list_of). Padding items are left alone: no warp of the prefill reads them.
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

constexpr int TILE_HOOK_WARPS = 8;  // warps a CTA of the mask hook's pre-pass, a warp a tile at a time
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
// first row sees the last key, window: its last row the first key) the pairs go unbounded. After each step the
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
  auto step = [&](int r0, auto bounded) {
#pragma unroll
    for (int u = 0; u < HOOK_ROWS_A_VOTE; ++u) {
      const int r = min(r0 + u, last);
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
    if (whole) {
      step(r0, std::false_type{});
    } else {
      step(r0, std::true_type{});
    }
    if (__any_sync(0xffffffff, kept) && __any_sync(0xffffffff, dropped)) return flashgen::variant::TILE_PARTIAL;
  }
  return __any_sync(0xffffffff, kept) ? flashgen::variant::TILE_FULL : flashgen::variant::TILE_EMPTY;
}

// An item's arrivals (PTX memory model): each warp's lane 0 writes its tile's class, then adds 1 to the item's
// count with release semantics (no other write of the warp needs publishing); the adds form one release sequence,
// so the warp that reads the last of them and then fences (acquire) sees every class. No warp but the last
// invalidates its SM's L1: __threadfence() does (fence.sc: MEMBAR.SC.GPU, CCTL.IVALL), and after each tile it
// sent the other warps' doc_ids reads to L2 (55 / 95 us at 4x4096 / 1x16384 against 27 / 58 a CTA an item).
__device__ __forceinline__ int arrive_release(int32_t* count) {
  int old;
  asm volatile("atom.release.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(count) : "memory");
  return old;
}
__device__ __forceinline__ void fence_acquire() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }

// The item that slot s of kv head 0's lists belongs to: the last item with tile_indptr[item] <= s (the offsets
// strictly increase: an item's list holds its count's slot). A 32-way search, uniform over the warp: a step
// narrows [lo, hi) to one of 32 spans by a ballot.
template <class Params>
__device__ __forceinline__ int item_of_slot(const Params& p, int s, int lane) {
  int lo = 0, hi = p.num_items;  // tile_indptr[lo] <= s < tile_indptr[hi]
  while (hi - lo > 1) {  // (uniform over the warp)
    const int step = (hi - lo + 31) / 32, i = lo + lane * step;
    const uint32_t below = __ballot_sync(0xffffffff, i < hi && p.tile_indptr[i] <= s);  // lanes 0 .. k
    lo += (31 - __clz(below)) * step;
    hi = min(hi, lo + step);
  }
  return lo;
}

// The item's list compacted in place by the warp that classified its last tile: slot 1 + t holds tile t's class
// (written by the warps of any SM, each before its arrival: read through L2, after the fence that follows the
// last arrival). 32 slots are read before the ballot and written after it, at or below their own (count <= the
// chunk's first tile), so no class is overwritten before it is read. PER_HEAD = false: the entries and the count
// go into every kv head's list.
template <bool PER_HEAD, class Params>
__device__ __forceinline__ void compact_tile_list(const Params& p, int32_t* list, int item, int num_tiles, int lane) {
  using namespace flashgen::variant;
  const int64_t stride = p.tile_indptr[item + 1] - p.tile_indptr[item];
  const int heads = PER_HEAD ? 1 : p.num_kv_heads;
  int count = 0;
  for (int b = 0; b < num_tiles; b += 32) {  // (uniform over the warp)
    const int t = b + lane, cls = t < num_tiles ? __ldcg(list + 1 + t) : TILE_EMPTY;
    const uint32_t kept = __ballot_sync(0xffffffff, cls != TILE_EMPTY);
    if (cls != TILE_EMPTY) {
      const int at = 1 + count + __popc(kept & ((1u << lane) - 1u));
      const int entry = t << ENTRY_SHIFT | (cls == TILE_FULL ? ENTRY_FULL : ENTRY_BITS);
      for (int h = 0; h < heads; ++h) list[h * stride + at] = entry;
    }
    count += __popc(kept);
  }
  for (int h = lane; h < heads; h += 32) list[h * stride] = count;
}

// The mask hook's pre-pass: warp g of the grid (TILE_HOOK_WARPS a CTA) takes slots g, g + the grid's warps, ...
// of the lists (kv head 0's, then PER_HEAD each kv head's: tile_indptr[num_items] slots a head). Slot
// tile_indptr[item] + 1 + t is tile t of work index x = (kv head, item): the warp classifies it (mask_hook_class)
// into that slot and arrives on x's count (p.tile_arrivals: x, or the item where one list serves every kv head);
// the arrival that completes the item's tiles compacts its list and sets the count back to 0. An item without a
// tile (its range empty under causal or the window) has its count written by the warp of its count's slot. The
// lists do not depend on the grid: any grid covers every slot (a CUDA graph keeps its first plan's).
template <class C, bool PER_HEAD, class Params>
__device__ __forceinline__ void plan_tiles_by_hook(const Params& p) {
  using namespace flashgen::variant;
  const int lane = threadIdx.x % 32;
  const int slots = p.tile_indptr[p.num_items];  // a kv head's
  const int64_t total = int64_t(slots) * (PER_HEAD ? p.num_kv_heads : 1);
  const FastDiv group = group_of(p);
  for (int64_t g = int64_t(blockIdx.x) * TILE_HOOK_WARPS + threadIdx.x / 32; g < total;
       g += int64_t(gridDim.x) * TILE_HOOK_WARPS) {  // (uniform over the warp)
    const int kv_head = PER_HEAD ? int(g / slots) : 0, s = int(g - int64_t(kv_head) * slots);
    const int item = item_of_slot(p, s, lane), x = kv_head * p.num_items + p.num_items - 1 - item;
    const Work w = work_of<C, false>(p, x);
    if (!w.valid) continue;
    // the prefill's plan-owned buffer, read-only to the prefill itself (hence const in the params)
    int32_t* list = const_cast<int32_t*>(tile_list_of(p, item, w.kv_head));
    const int t = s - p.tile_indptr[item] - 1;  // -1: the count's slot
    if (t < 0) {
      if (w.num_tiles == 0) compact_tile_list<PER_HEAD>(p, list, item, 0, lane);  // the count alone: 0
      continue;
    }
    if (t >= w.num_tiles) continue;  // past the range clipped by causal or the window
    const int kv_begin = w.kv_lo + t * C::TILE_KV;
    const int cls = mask_hook_class<C, PER_HEAD>(p, w, group, p.request_idx[item], lane, kv_begin,
                                                 min(kv_begin + C::TILE_KV, w.kv_hi));
    int32_t* arrivals = p.tile_arrivals + (PER_HEAD ? x : item);
    int arrived = 0;
    if (lane == 0) {
      list[1 + t] = cls;
      arrived = arrive_release(arrivals) + 1;  // the class published by the arrival
    }
    if (__shfl_sync(0xffffffff, arrived, 0) < w.num_tiles) continue;
    fence_acquire();  // every arrival's class before the reads of the compaction
    compact_tile_list<PER_HEAD>(p, list, item, w.num_tiles, lane);
    if (lane == 0) *arrivals = 0;  // for the next launch
  }
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
