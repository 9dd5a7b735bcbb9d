// The Hopper prefill's producer warpgroup (WG0, setmaxnreg.dec): warp 0 loads K, warp 1 V, by TMA boxes or, for
// pages TMA cannot take, gathered row by row (sm90/kv_gather.cuh); warps 2-3, the scheduler, publish each item's
// Work and load its Q tile (TMA or cp.async).
#pragma once
#include <cstdint>
#include <flashgen/common/fastdiv.cuh>
#include <flashgen/common/mma.cuh>
#include <flashgen/common/tile_entry.cuh>
#include <flashgen/sm90/custom_mask.cuh>
#include <flashgen/sm90/fp8.cuh>
#include <flashgen/sm90/kv_gather.cuh>
#include <flashgen/sm90/layout.cuh>
#include <flashgen/sm90/tile_lists.cuh>
#include <flashgen/sm90/tile_scheduler.cuh>
#include <flashgen/sm90/tma.cuh>

namespace flashgen::sm90 {

// The boxes of one KV tile (per 64-column block): TILE_KV rows of a ragged tensor, or BOX rows of each page it
// spans (PAGE_SIZE is a multiple of 8 that divides TILE_KV or is divided by it, so boxes never straddle pages
// and land on whole 8-row swizzle atoms). Maps are 4-D, innermost first: NHD {dim, head, row, page}, HND
// {dim, row, head, page}; a ragged tensor is one page of all its rows. fp8 K/V land in their staging stage,
// rows of 64 bytes (Layout::KV8_BLOCK).
template <class C>
struct KVBoxes {
  static constexpr int ROW = Layout<C>::FP8 ? 64 : 128, BLOCK = C::TILE_KV * ROW;
  static constexpr int BOX = C::PAGED && C::PAGE_SIZE < C::TILE_KV ? C::PAGE_SIZE : C::TILE_KV;
  static constexpr int PER_TILE = C::TILE_KV / BOX * Layout<C>::BLOCKS;
  static constexpr int PS = C::PAGED ? C::PAGE_SIZE : C::TILE_KV;
  static_assert(PS % 8 == 0 && (C::TILE_KV % PS == 0 || PS % C::TILE_KV == 0),
                "page size: a multiple of 8 that divides the KV tile or is divided by it");

  static_assert(PER_TILE <= 32, "one box a lane");

  // the page holding box j of the tile at request position pos0 (ragged: 0); past the request, a real page
  // (its rows are masked later)
  __device__ __forceinline__ static int page(const Work& w, int pos0, int j) {
    if constexpr (C::PAGED) return __ldg(w.pages + min((pos0 + j / Layout<C>::BLOCKS * BOX) / C::PAGE_SIZE, w.last_page));
    else return 0;
  }

  // box j of the tile at request position pos0 into the stage at dst
  __device__ __forceinline__ static void load(uint32_t dst, const CUtensorMap* map, uint32_t bar, const Work& w, int pos0,
                                              int j, int page) {
    const int b = j % Layout<C>::BLOCKS, chunk = j / Layout<C>::BLOCKS, pos = pos0 + chunk * BOX;
    int row = w.kv_row0 + pos;
    if constexpr (C::PAGED) row = pos % C::PAGE_SIZE;
    dst += b * BLOCK + chunk * BOX * ROW;
    if constexpr (C::HND) tma_load_4d(dst, map, bar, 64 * b, row, w.kv_head, page);
    else tma_load_4d(dst, map, bar, 64 * b, w.kv_head, row, page);
  }
};

// WG0 warp 0 (K) and warp 1 (V): the tiles of every item the scheduler publishes into their stage ring, a tile's
// boxes issued by the warp's lanes (a paged tile is up to 32 boxes). Stage s = it % STAGES of the CTA's running tile count it
// is refilled once every consumer thread released it; a fresh empty barrier passes the first wait (parity 1).
// The next tile's position (custom mask: its list entry) and page ids are read one tile ahead.
// With a custom mask the K warp (mask != nullptr) also prefetches each BITS tile's mask bits into L2.
// fp8 K/V (sm90/fp8.cuh): tile it lands in staging stage it % KV8_STAGES (full8), and the warp converts tile
// it + 1 - KV8_STAGES once it has issued tile it, so KV8_STAGES - 1 tiles' loads stay in flight while it converts
// (across items: the conversion reads no Work); the last ones after the end of the list.
template <class C, class Params>
__device__ __forceinline__ void produce_kv(const Params& p, const uint8_t* mask, const uint8_t* smem,
                                           const CUtensorMap* map, uint32_t ring,
                                           uint32_t (Barriers<C>::*full)(int) const,
                                           uint32_t (Barriers<C>::*empty)(int) const, const Barriers<C>& bars,
                                           uint32_t staging, uint32_t (Barriers<C>::*full8)(int) const) {
  using L = Layout<C>;
  using Boxes = KVBoxes<C>;
  const int lane = threadIdx.x % 32;
  if (lane == 0) prefetch_tensormap(map);
  uint32_t it = 0;  // unsigned: stage and phase are then a mask and a shift
  for (uint32_t j = 0;; ++j) {
    // read in place (fields are re-read from shared memory after each barrier wait rather than held: the warp
    // has 40 registers) and released once the item's tiles are issued
    const Work& w = read_work<C>(smem, bars, j);
    if (!w.valid) break;
    const bool boxer = lane < Boxes::PER_TILE;
    int next_entry = w.num_tiles > 0 ? TileList<C>::entry(w.tiles, 0) : 0;
    int next_pos = TileList<C>::pos(w.kv_lo, 0, next_entry);
    // an item without tiles (empty KV) reads no page id: its request may own none (past the caller's array)
    int next_page = boxer && w.num_tiles > 0 ? Boxes::page(w, next_pos, lane) : 0;
    for (int t = 0; t < w.num_tiles; ++t, ++it) {
      const int s = it % C::STAGES;
      const int pos0 = next_pos, page = next_page;
      const bool bits = TileList<C>::kind(next_entry) == ENTRY_BITS;
      if (t + 1 < w.num_tiles) {
        next_entry = TileList<C>::entry(w.tiles, t + 1);
        next_pos = TileList<C>::pos(w.kv_lo, t + 1, next_entry);
        if (boxer) next_page = Boxes::page(w, next_pos, lane);
      }
      if constexpr (L::FP8) {
        // the staging stage's previous tile was converted by this warp: its reads come before the TMA's writes
        const int s8 = it % C::KV8_STAGES;
        fence_proxy_async();
        __syncwarp();
        if (lane == 0) mbarrier_arrive_expect_tx((bars.*full8)(s8), L::KV8_STAGE);
        __syncwarp();
        if (boxer) Boxes::load(staging + s8 * L::KV8_STAGE, map, (bars.*full8)(s8), w, pos0, lane, page);
      } else {
        mbarrier_wait((bars.*empty)(s), ((it / C::STAGES) & 1) ^ 1);
        if (lane == 0) mbarrier_arrive_expect_tx((bars.*full)(s), L::KV_STAGE);
        __syncwarp();
        if (boxer) Boxes::load(ring + s * L::KV_STAGE, map, (bars.*full)(s), w, pos0, lane, page);
      }
      if constexpr (C::CUSTOM_MASK)
        if (bits && mask != nullptr) prefetch_mask_bits(mask, w, group_of(p), pos0, lane);
      if constexpr (L::FP8) {
        const uint32_t i = it + 1 - C::KV8_STAGES;  // the tile to convert, if any (unsigned: it + 1 >= KV8_STAGES)
        if (it + 1 >= C::KV8_STAGES)
          convert_kv<C>(i, staging, ring, (bars.*full)(i % C::STAGES), (bars.*empty)(i % C::STAGES),
                        (bars.*full8)(i % C::KV8_STAGES), lane);
      }
    }
    mbarrier_arrive(bars.work_empty(j % WORK_SLOTS));
  }
  if constexpr (L::FP8) {
    for (uint32_t i = it + 1 >= C::KV8_STAGES ? it + 1 - C::KV8_STAGES : 0; i < it; ++i)
      convert_kv<C>(i, staging, ring, (bars.*full)(i % C::STAGES), (bars.*empty)(i % C::STAGES),
                    (bars.*full8)(i % C::KV8_STAGES), lane);
  }
}

// WG0 warp 0 (K) or warp 1 (V) of a gathered cache (C::GATHER): as produce_kv, a tile's rows copied by the lanes
// (PageRows), their offsets computed before the wait for the stage. Completion: cp.async.mbarrier.arrive.noinc, one
// arrival a lane once its copies landed, so the warp runs on to the next stage at once; the consumers fence the
// async proxy after the full barrier (wait_kv).
template <class C, class Params>
__device__ __forceinline__ void gather_kv(const uint8_t* smem, const Params& p, const typename C::DTypeKV* cache,
                                          uint32_t ring, uint32_t (Barriers<C>::*full)(int) const,
                                          uint32_t (Barriers<C>::*empty)(int) const, const Barriers<C>& bars) {
  using L = Layout<C>;
  using Rows = PageRows<C>;
  const int lane = threadIdx.x % 32;
  const typename C::DTypeKV** rows =
      reinterpret_cast<const typename C::DTypeKV**>(const_cast<uint8_t*>(smem) + L::GATHER_OFFSET) + threadIdx.x / 32 * C::TILE_KV;
  uint32_t it = 0;  // unsigned: stage and phase are then a mask and a shift
  for (uint32_t j = 0;; ++j) {
    const Work& w = read_work<C>(smem, bars, j);
    if (!w.valid) break;
    const typename C::DTypeKV* head = cache + w.kv_head * p.stride_head;
    const int kv_len = w.kv_len(group_of(p));
    for (int t = 0; t < w.num_tiles; ++t, ++it) {
      const int s = it % C::STAGES;
      __syncwarp();  // every lane has read the previous tile's rows
      Rows::addresses(rows, head, w.pages, p.stride_page, p.stride_token, kv_len,
                      TileList<C>::pos(w.kv_lo, t, TileList<C>::entry(w.tiles, t)), lane);
      mbarrier_wait((bars.*empty)(s), ((it / C::STAGES) & 1) ^ 1);
      __syncwarp();  // the rows are visible to the warp
      Rows::load(ring + s * L::KV_STAGE, rows, lane);
      cp_async_arrive_noinc((bars.*full)(s));
    }
    mbarrier_arrive(bars.work_empty(j % WORK_SLOTS));
  }
}

// WG0 warps 2-3, the scheduler: each item's Work into its slot (work_full), then its 128 packed Q rows into the
// swizzled Q tile once the consumers released that Q buffer (q_empty), announced by q_full (an arrival of each
// thread here). Padding items (request_idx < 0) are not published.
// TMA (where the group divides TILE_Q: p.q_tma, decided at plan time; produce_q_warps then starts one thread of
// the two warps here): an item's rows are the tokens [row0 / group, + TILE_Q / group) of the request times the kv
// head's group of q heads, in q [tokens, q heads, dim] a 3-D box {64 columns, group heads, TILE_Q / group
// tokens} (the map tma_q), which lands row-major, packed row = token * group + head, in the swizzle the tile
// has. The thread expects the tile's bytes on q_full and issues a box a 64-column block. Rows past the request
// are the next request's tokens (rows are independent: they are masked and never written) or, past the tensor,
// zeros. Else the 64 threads copy the rows by cp.async (rows past the request zeros), each making its copies
// visible to wgmma by fence.proxy.async before it arrives. Two instantiations, not a branch in the loop: one
// loop holding both paths spilled in the 40 producer registers, as did a named barrier of the 64 threads
// before a single arrival (the arrival count is the path's instead, Barriers::init).
template <class C, bool TMA, class Params>
__device__ __forceinline__ void produce_q(const Params& p, uint8_t* q_smem, const Barriers<C>& bars) {
  using L = Layout<C>;
  constexpr int CHUNKS = L::D / 8;  // 16-byte chunks of a row
  const int tid = threadIdx.x - 64;
  Work* slots = reinterpret_cast<Work*>(q_smem + L::WORK_OFFSET);
  if constexpr (TMA) prefetch_tensormap(&p.tma_q);
  int k = 0;
  // item k goes into slot k % WORK_SLOTS once every reader released the slot's previous item (a fresh barrier
  // passes the first wait); waited for before the Work is computed, so that it is not live across the wait
  auto wait_slot = [&] { mbarrier_wait_backoff<128>(bars.work_empty(k % WORK_SLOTS), ((k / WORK_SLOTS) & 1) ^ 1); };
  // Q buffer k % Q_BUFFERS, once the consumers released its previous item's Q
  auto wait_q_buffer = [&] {
    mbarrier_wait_backoff<256>(bars.q_empty(k % C::Q_BUFFERS), ((k / C::Q_BUFFERS) & 1) ^ 1);
  };
  auto publish = [&](const Work& w) {
    if (tid == 0) {
      slots[k % WORK_SLOTS] = w;
      mbarrier_arrive(bars.work_full(k % WORK_SLOTS));
    }
  };
  for (int x = blockIdx.x; x < p.num_items * p.num_kv_heads; x += gridDim.x) {
    wait_slot();
    // a tile predicate's list: written by the list warp (produce_lists), its count read here (work_of); a padding
    // item has none (the list warp skips it alike), and waiting for it would wait for the next item's, or forever
    if constexpr (list_warp<C>()) {
      if (p.request_idx[p.num_items - 1 - x % p.num_items] < 0) continue;
      mbarrier_wait(bars.list_full(k % WORK_SLOTS), (k / WORK_SLOTS) & 1);
    }
    const Work w = work_of<C>(p, x);
    if (!w.valid) continue;
    if constexpr (C::Variant::ANY) {  // the item's request, for the hooks (read after work_full, as the slot)
      if (tid == 0)
        reinterpret_cast<int*>(q_smem + L::REQUEST_OFFSET)[k % WORK_SLOTS] = p.request_idx[p.num_items - 1 - x % p.num_items];
    }
    publish(w);
    const int buf = k % C::Q_BUFFERS;
    wait_q_buffer();
    ++k;
    const FastDiv group = group_of(p);
    uint8_t* q_dst = q_smem + buf * L::Q_BYTES;
    if constexpr (TMA) {
      mbarrier_arrive_expect_tx(bars.q_full(buf), L::Q_BYTES);
#pragma unroll
      for (int b = 0; b < L::BLOCKS; ++b)
        tma_load_3d(smem_u32(q_dst + b * L::Q_BLOCK), &p.tma_q, bars.q_full(buf), 64 * b, w.kv_head * group.d,
                    w.token0 + group.div(w.row0));
    } else {
      // every chunk in flight at once (cp.async, no registers held): one memory round trip, where loads through
      // registers (40 of them) kept two in flight and took ~16 round trips for the tile. Chunk c of row r is job
      // r * CHUNKS + c, a thread's jobs tid, + q_loaders, ... (everything but tid recomputed a job: column
      // invariants held across the items' work_of spilled in 40 registers)
      const auto* src0 = p.q + (int64_t(w.token0) * p.num_qo_heads + w.kv_head * group.d) * L::D;
#pragma unroll 1
      for (int job = tid; job < C::TILE_Q * CHUNKS; job += q_loaders<C>()) {
        const int r = job / CHUNKS, c = job % CHUNKS, prow = w.row0 + r;
        const bool past = prow >= w.rows_total;  // rows past the request: zeros, the source not read
        int token, head;
        group.divmod(prow, token, head);
        const int64_t at = past ? 0 : (int64_t(token) * p.num_qo_heads + head) * L::D + c * 8;
        cp_async_16(q_dst + c / 8 * L::Q_BLOCK + r * 128 + swizzle(r, c % 8) * 16, src0 + at, past);
      }
      cp_async_commit();
      cp_async_wait<0>();   // this thread's copies have landed (generic proxy) ...
      fence_proxy_async();  // ... and are made visible to wgmma (async proxy) before the release by q_full
      mbarrier_arrive(bars.q_full(buf));
    }
  }
  // the end of the CTA's list: an invalid Work, and for the consumers (who read a slot after q_full) the next Q
  // buffer's q_full
  Work end;
  end.valid = false;
  wait_slot();
  publish(end);
  wait_q_buffer();
  mbarrier_arrive(bars.q_full(k % C::Q_BUFFERS));
}

// WG0 warps 2-3: Q by TMA from one thread (the rest are done), or by cp.async from all 64; with a tile predicate
// (list_warp) warp 3 writes the items' tile lists and warp 2 alone copies Q where TMA does not
template <class C, class Params>
__device__ __forceinline__ void produce_q_warps(const Params& p, uint8_t* smem, const Barriers<C>& bars) {
  if constexpr (list_warp<C>()) {
    if (threadIdx.x >= 96) {
      produce_lists<C>(p, bars);
      return;
    }
  }
  if (!p.q_tma) produce_q<C, false>(p, smem, bars);
  else if (threadIdx.x == 64) produce_q<C, true>(p, smem, bars);
}

}  // namespace flashgen::sm90
