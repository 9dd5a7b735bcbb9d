// Batch prefill on Hopper (sm_90a), FlashAttention-3 recipe.
//
// Persistent CTAs (one per SM) walk the work list: work index x in [0, num_items * num_kv_heads) is kv head
// x / num_items and plan item num_items - 1 - x % num_items (a request's later, longer causal q tiles first);
// CTA c takes x = c, c + gridDim.x, ... Each item is (request, 128-row packed q tile, whole KV range: plans are
// unsplit). Three warpgroups:
//   WG0 producer (setmaxnreg.dec). Warp 0 K, warp 1 V: tiles of TILE_KV tokens by TMA (4-D maps; ragged: one box of
//       TILE_KV rows a 64-column block, paged: one box a page, lanes issuing in parallel) into STAGES-deep rings, each stage with a full
//       barrier (1 arrival + the tile's bytes) and an empty barrier (every consumer thread arrives); the stage
//       counter runs on across items, so the next item's tiles stream in while the consumers finish the last.
//       Pages TMA cannot take (C::GATHER) are gathered row by row by the warp's lanes with cp.async into the same
//       swizzled layout (kv_gather.cuh); the full barrier then takes 32 arrivals, one a lane once its copies landed
//       (cp.async.mbarrier.arrive.noinc), and consumers fence the async proxy after it.
//       Warps 2-3, the scheduler: each item's plan entries are read once, into a Work published in a ring of
//       WORK_SLOTS shared-memory slots (work_full; every reader releases it by work_empty), so the K and V
//       warps start an item's loads without the plan's dependent global loads; then its 128 packed Q rows into
//       the 128B-swizzled Q tile, once the consumers released that Q buffer (q_empty): where the GQA group
//       divides 128, a 3-D TMA box a 64-column block issued by one thread (q_full takes its bytes), else by
//       cp.async, fence.proxy.async and q_full. An invalid Work ends the list.
//   WG1, WG2 consumers (setmaxnreg.inc): 64 packed q rows each (packed row = token * group + q head in the
//       group). Per KV tile: S = Q K^T (wgmma SS, fp32), online softmax in registers (base 2), P -> 16-bit A
//       fragments, O += P V (wgmma RS, V MN-major). The GEMMs of consecutive tiles overlap the softmax, and the
//       two warpgroups take turns issuing them (ping-pong), continuously across items. An item's last P V is
//       issued together with the next item's first S (Pending), so an item boundary costs one step, not two.
//       Epilogue: where the staging fits in shared memory (C::O_STAGED) and the group divides 16, a warp's 16
//       rows inside the request by stmatrix into a staging area of the warp, then a 3-D TMA store a 64-column
//       block; other rows straight from registers; lse from registers.
//
// Masks: causal (aligned to the KV end: q_pos = kv_len - qo_len + token) clips the KV range to what the tile's
// rows can see, a sliding window (causal, plus keys >= q_pos - window_left) also skips the tiles before the
// first row's window; the element mask runs on tiles that cross kv_hi, a causal or a window boundary of the
// warpgroup's rows. A custom bit mask replaces the range by the item's planned tile list (custom_mask.cuh):
// fully masked tiles are never loaded, the bits are read only for BITS tiles, CAUSAL ones are masked by the
// query positions. ALiBi and soft-cap transform the logits before the mask (logits.cuh).
#pragma once
#include <flashgen/fastdiv.cuh>
#include <flashgen/logits.cuh>
#include <flashgen/mma.cuh>
#include <flashgen/sm90/custom_mask.cuh>
#include <flashgen/sm90/kv_gather.cuh>
#include <flashgen/sm90/tma.cuh>
#include <flashgen/sm90/wgmma.cuh>

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

constexpr int Q_LOADERS = 64;  // warps 2-3 of the producer warpgroup (a multiple of a Q row's 16-byte chunks)
// Work slots: the scheduler publishes item k in slot k % WORK_SLOTS once its previous occupant was read by the
// 64 threads of the K and V warps and the 256 consumer threads (WORK_READERS arrivals on work_empty)
constexpr int WORK_SLOTS = 4, WORK_READERS = 64 + 256;

template <class C>
struct Layout {
  static constexpr int D = C::HEAD_DIM, BLOCKS = D / 64;  // 64-column blocks of 128-byte rows
  static constexpr int WG_ROWS = 64, THREADS = 384;
  static constexpr int Q_BLOCK = C::TILE_Q * 128, KV_BLOCK = C::TILE_KV * 128;
  static constexpr int Q_BYTES = BLOCKS * Q_BLOCK, KV_STAGE = BLOCKS * KV_BLOCK;
  static constexpr int K_OFFSET = C::Q_BUFFERS * Q_BYTES;  // Q buffers: the next item's Q loads during this one
  static constexpr int V_OFFSET = K_OFFSET + C::STAGES * KV_STAGE;
  // the staged epilogue (C::O_STAGED): each consumer warp's 16 O rows as its TMA store's box (write_rows), a
  // 128B-swizzled block of 16 rows a 64-column block; 1024-aligned, as all above
  static constexpr int O_STAGE_BLOCK = 16 * 128, O_STAGE_WARP = BLOCKS * O_STAGE_BLOCK;
  static constexpr int O_STAGE_OFFSET = V_OFFSET + C::STAGES * KV_STAGE, O_STAGE_BYTES = C::O_STAGED ? 8 * O_STAGE_WARP : 0;
  static constexpr int BAR_OFFSET = O_STAGE_OFFSET + O_STAGE_BYTES;
  // barriers, then the Work slots; the dynamic base is aligned up to 1024 at run time
  static constexpr int BAR_BYTES = 256, WORK_OFFSET = BAR_OFFSET + BAR_BYTES, WORK_BYTES = 512, ALIGN_SLACK = 1024;
  // a gathered cache: the K and the V warp's row addresses of the tile they copy (8 bytes each)
  static constexpr int GATHER_OFFSET = WORK_OFFSET + WORK_BYTES, GATHER_BYTES = C::GATHER ? 2 * C::TILE_KV * 8 : 0;
  static constexpr int TOTAL = GATHER_OFFSET + GATHER_BYTES + ALIGN_SLACK;
  static_assert(TOTAL == C::SMEM_BYTES, "codegen and the kernel disagree on the shared-memory size");
  static_assert(C::TILE_Q == 2 * WG_ROWS, "two consumer warpgroups of 64 rows");
  static_assert(O_STAGE_OFFSET % 1024 == 0, "the O staging lies on 128B swizzle atoms");
  static_assert(D % 64 == 0 && sizeof(typename C::DTypeQ) == 2, "rows of whole 128-byte blocks of 16-bit values");
  static_assert(C::TILE_KV % 16 == 0 && C::TILE_KV <= 256 && (C::TILE_KV == 64 || C::TILE_KV == 128 || C::TILE_KV == 256),
                "wgmma N of S");
  static_assert((4 * C::STAGES + 2 * C::Q_BUFFERS + 2 * WORK_SLOTS) * 8 <= BAR_BYTES, "barriers fit their region");
  static_assert(C::Q_BUFFERS == 1 || C::Q_BUFFERS == 2, "one or two Q buffers");
  static_assert(Q_LOADERS % (D / 8) == 0, "the Q loaders cover whole rows of 16-byte chunks");
  static_assert(WORK_SLOTS * sizeof(Work) <= WORK_BYTES, "the Work slots fit their region");
  static_assert(C::PRODUCER_REGS * 128 + C::CONSUMER_REGS * 256 <= 65536, "register budgets fit the SM");
};


// The barrier ring: full and empty barriers of K and V for each stage, then Q's full and empty, then the Work
// slots' full and empty; 8 bytes each.
template <class C>
struct Barriers {
  uint32_t base;
  __device__ __forceinline__ uint32_t full_k(int s) const { return base + 8 * s; }
  __device__ __forceinline__ uint32_t full_v(int s) const { return base + 8 * (C::STAGES + s); }
  __device__ __forceinline__ uint32_t empty_k(int s) const { return base + 8 * (2 * C::STAGES + s); }
  __device__ __forceinline__ uint32_t empty_v(int s) const { return base + 8 * (3 * C::STAGES + s); }
  __device__ __forceinline__ uint32_t q_full(int b) const { return base + 8 * (4 * C::STAGES + b); }
  __device__ __forceinline__ uint32_t q_empty(int b) const { return base + 8 * (4 * C::STAGES + C::Q_BUFFERS + b); }
  __device__ __forceinline__ uint32_t work_full(int j) const { return base + 8 * (4 * C::STAGES + 2 * C::Q_BUFFERS + j); }
  __device__ __forceinline__ uint32_t work_empty(int j) const {
    return base + 8 * (4 * C::STAGES + 2 * C::Q_BUFFERS + WORK_SLOTS + j);
  }
  // q_tma: Q by TMA (one arrival + the tile's bytes), else by the Q_LOADERS threads' cp.async (each arrives)
  __device__ __forceinline__ void init(bool q_tma) const {
    for (int b = 0; b < C::Q_BUFFERS; ++b) {
      mbarrier_init(q_full(b), q_tma ? 1 : Q_LOADERS);
      mbarrier_init(q_empty(b), 256);
    }
    for (int j = 0; j < WORK_SLOTS; ++j) {
      mbarrier_init(work_full(j), 1);
      mbarrier_init(work_empty(j), WORK_READERS);
    }
    for (int s = 0; s < C::STAGES; ++s) {
      mbarrier_init(full_k(s), C::GATHER ? 32 : 1);  // gathered: each lane of the warp; TMA: one + the bytes
      mbarrier_init(full_v(s), C::GATHER ? 32 : 1);
      mbarrier_init(empty_k(s), 256);  // every consumer thread arrives once it has finished the tile
      mbarrier_init(empty_v(s), 256);
    }
    fence_barrier_init();
  }
};

template <class C, class Params>
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
  if constexpr (C::CAUSAL) w.kv_hi = min(w.kv_hi, w.q_base + group.div(w.last_row) + 1);
  if constexpr (C::WINDOW) {  // keys before the first row's window: whole tiles skipped, the start tile-aligned
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

// Item j of the CTA's list: its Work slot, once the scheduler published it. The caller releases the slot
// (work_empty) once it is done reading it.
template <class C>
__device__ __forceinline__ const Work& read_work(const uint8_t* smem, const Barriers<C>& bars, uint32_t j) {
  mbarrier_wait(bars.work_full(j % WORK_SLOTS), (j / WORK_SLOTS) & 1);
  return reinterpret_cast<const Work*>(smem + Layout<C>::WORK_OFFSET)[j % WORK_SLOTS];
}

// The boxes of one KV tile (per 64-column block): TILE_KV rows of a ragged tensor, or BOX rows of each page it
// spans (PAGE_SIZE is a multiple of 8 that divides TILE_KV or is divided by it, so boxes never straddle pages
// and land on whole 8-row swizzle atoms). Maps are 4-D, innermost first: NHD {dim, head, row, page}, HND
// {dim, row, head, page}; a ragged tensor is one page of all its rows.
template <class C>
struct KVBoxes {
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
    dst += b * Layout<C>::KV_BLOCK + chunk * BOX * 128;
    if constexpr (C::HND) tma_load_4d(dst, map, bar, 64 * b, row, w.kv_head, page);
    else tma_load_4d(dst, map, bar, 64 * b, w.kv_head, row, page);
  }
};

// WG0 warp 0 (K) and warp 1 (V): the tiles of every item the scheduler publishes into their stage ring, a tile's
// boxes issued by the warp's lanes (a paged tile is up to 32 boxes). Stage s = it % STAGES of the CTA's running tile count it
// is refilled once every consumer thread released it; a fresh empty barrier passes the first wait (parity 1).
// The next tile's position (custom mask: its list entry) and page ids are read one tile ahead.
// With a custom mask the K warp (mask != nullptr) also prefetches each BITS tile's mask bits into L2.
template <class C, class Params>
__device__ __forceinline__ void produce_kv(const Params& p, const uint8_t* mask, const uint8_t* smem,
                                           const CUtensorMap* map, uint32_t ring,
                                           uint32_t (Barriers<C>::*full)(int) const,
                                           uint32_t (Barriers<C>::*empty)(int) const, const Barriers<C>& bars) {
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
    int next_page = boxer ? Boxes::page(w, next_pos, lane) : 0;
    for (int t = 0; t < w.num_tiles; ++t, ++it) {
      const int s = it % C::STAGES;
      const int pos0 = next_pos, page = next_page;
      const bool bits = TileList<C>::kind(next_entry) == ENTRY_BITS;
      if (t + 1 < w.num_tiles) {
        next_entry = TileList<C>::entry(w.tiles, t + 1);
        next_pos = TileList<C>::pos(w.kv_lo, t + 1, next_entry);
        if (boxer) next_page = Boxes::page(w, next_pos, lane);
      }
      mbarrier_wait((bars.*empty)(s), ((it / C::STAGES) & 1) ^ 1);
      if (lane == 0) mbarrier_arrive_expect_tx((bars.*full)(s), L::KV_STAGE);
      __syncwarp();
      if (boxer) Boxes::load(ring + s * L::KV_STAGE, map, (bars.*full)(s), w, pos0, lane, page);
      if constexpr (C::CUSTOM_MASK)
        if (bits && mask != nullptr) prefetch_mask_bits(mask, w, group_of(p), pos0, lane);
    }
    mbarrier_arrive(bars.work_empty(j % WORK_SLOTS));
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
    const Work w = work_of<C>(p, x);
    if (!w.valid) continue;
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
      // r * CHUNKS + c, a thread's jobs tid, + Q_LOADERS, ... (everything but tid recomputed a job: column
      // invariants held across the items' work_of spilled in 40 registers)
      const auto* src0 = p.q + (int64_t(w.token0) * p.num_qo_heads + w.kv_head * group.d) * L::D;
#pragma unroll 1
      for (int job = tid; job < C::TILE_Q * CHUNKS; job += Q_LOADERS) {
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

// WG0 warps 2-3: Q by TMA from one thread (the rest are done), or by cp.async from all 64
template <class C, class Params>
__device__ __forceinline__ void produce_q_warps(const Params& p, uint8_t* smem, const Barriers<C>& bars) {
  if (!p.q_tma) produce_q<C, false>(p, smem, bars);
  else if (threadIdx.x == 64) produce_q<C, true>(p, smem, bars);
}

// Issue S = Q K^T over head_dim in k16 steps (asynchronous: the caller commits and waits). Q rows of this
// warpgroup start at q_wg (block 0).
template <class C>
__device__ __forceinline__ void issue_qk(float (&s)[C::TILE_KV / 2], uint32_t q_wg, uint32_t k_stage) {
  using L = Layout<C>;
  const uint64_t q_desc = desc_k_major(q_wg), k_desc = desc_k_major(k_stage);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < L::D / 16; ++k) {
    const uint32_t col = (k / 4), in_row = (k % 4) * 32;
    Wgmma<C::TILE_KV, typename C::DTypeKV>::ss(s, desc_advance(q_desc, col * L::Q_BLOCK + in_row),
                                                desc_advance(k_desc, col * L::KV_BLOCK + in_row), k > 0);
  }
}

// Issue O += P V over the tile's tokens in k16 steps (V: rows = tokens, 64-column blocks at KV_BLOCK bytes)
template <class C>
__device__ __forceinline__ void issue_pv(float (&o)[C::HEAD_DIM / 2], uint32_t (&pa)[C::TILE_KV / 16][4],
                                         uint32_t v_stage, bool fresh = false) {
  using L = Layout<C>;
  const uint64_t v_desc = desc_mn_major(v_stage, L::KV_BLOCK);
  fence_operands(o);
  fence_operands(pa);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < C::TILE_KV / 16; ++kk)
    Wgmma<C::HEAD_DIM, typename C::DTypeKV>::rs(o, pa[kk], desc_advance(v_desc, kk * 16 * 128),
                                                kk > 0 || !fresh);  // an item's first P V overwrites O (scale-d 0)
}

// tanh(x) = 1 - 2 / (e^(2x) + 1) by ex2.approx and rcp.approx (relative error ~1e-7 away from 0, absolute ~1e-7
// near it), with far fewer registers than tanhf; saturates to +-1
__device__ __forceinline__ float tanh_fast(float x) { return 1.f - 2.f * rcp_fast(exp2_fast(x * (2.f * LOG2E)) + 1.f); }

// Per-thread row state: rows g and g + 8 of the warp's 16 (h = 0, 1).
struct RowState {
  float m[2], l[2];
  int q_pos[2];
  float slope[2];  // ALiBi slope of the row's q head, pre-multiplied like S (see LogitsParams)
};

// The logits transform's runtime values (see logits.cuh for the order of the steps), folded so that a logit
// takes one multiply, the ALiBi FMA and the cap: with soft-cap, y = S * sm_scale / cap + slope / cap * (key - q)
// and the base-2 logit is cap * log2(e) * tanh(y); without it, S * sm_scale * log2(e) + slope * log2(e) * (key - q).
// The slopes in RowState carry the same factor (1 / cap or log2(e)).
struct LogitsParams {
  float mul, cap_log2;
  int kv_hi, window_left;
};

// S -> P in place: P = 2^(logit - m) with the running max m (base 2) and sum l. Without ALiBi or soft-cap the
// logit is S * scale_log2, folded into the exponent (sm_scale > 0, checked at plan time: the max of raw S is
// then the max logit). Masked tiles hide (row, key) pairs past kv_hi, after the row's query position (causal),
// before its window or whose custom-mask bit is clear. o_scale is the factor O must be multiplied by before
// P V is added (applied by the caller once the previous P V has completed).
template <class C>
__device__ __forceinline__ void softmax(float (&s)[C::TILE_KV / 2], RowState& rs, float (&o_scale)[2],
                                        const LogitsParams& lg, bool masked, int t0, const MaskBits<C>& bits) {
  constexpr bool RAW = !C::ALIBI && !C::SOFT_CAP;
  const int q4 = threadIdx.x % 4;
  if constexpr (!RAW) {
    float bias[2];  // ALiBi: the bias of the thread's first key of the tile in each row, then + slope per key
#pragma unroll
    for (int h = 0; h < 2; ++h) bias[h] = C::ALIBI ? rs.slope[h] * float(t0 + 2 * q4 - rs.q_pos[h]) : 0.f;
#pragma unroll
    for (int i = 0; i < C::TILE_KV / 2; ++i) {
      float x = s[i] * lg.mul;
      if constexpr (C::ALIBI) x += fmaf(rs.slope[(i / 2) % 2], float(8 * (i / 4) + i % 2), bias[(i / 2) % 2]);
      if constexpr (C::SOFT_CAP) x = lg.cap_log2 * tanh_fast(x);
      s[i] = x;
    }
  }
  if (masked) {
    typename MaskBits<C>::Words words;
    bits.select(words);
    if (C::CUSTOM_MASK && !C::CAUSAL && t0 + C::TILE_KV <= lg.kv_hi) {
      // a partial tile inside the KV range: the bits alone (a bit test and a select a key, where the bound
      // check below doubles that; short documents have one such tile an item)
#pragma unroll
      for (int i = 0; i < C::TILE_KV / 2; ++i)
        if (!MaskBits<C>::visible(words, i)) s[i] = -INFINITY;
    } else {
#pragma unroll
      for (int i = 0; i < C::TILE_KV / 2; ++i) {
        const int pos = t0 + 8 * (i / 4) + 2 * q4 + i % 2, q_pos = rs.q_pos[(i / 2) % 2];
        bool ok = pos < lg.kv_hi;
        if constexpr (C::CAUSAL) ok = ok && pos <= q_pos;
        if constexpr (C::WINDOW) ok = ok && pos >= q_pos - lg.window_left;
        if constexpr (C::CUSTOM_MASK) ok = ok && MaskBits<C>::visible(words, i);
        if (!ok) s[i] = -INFINITY;
      }
    }
  }
  const float mul = RAW ? lg.mul : 1.f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int i = 2 * h; i < C::TILE_KV / 2; i += 4) mx = fmaxf(mx, fmaxf(s[i], s[i + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
    const float m_new = fmaxf(rs.m[h], mx * mul);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet: P = 0, not NaN
    o_scale[h] = exp2_fast(rs.m[h] - m_use);
    rs.m[h] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int i = 2 * h; i < C::TILE_KV / 2; i += 4) {
      s[i] = exp2_fast(fmaf(s[i], mul, -m_use));
      s[i + 1] = exp2_fast(fmaf(s[i + 1], mul, -m_use));
      sum += s[i] + s[i + 1];
    }
    rs.l[h] = rs.l[h] * o_scale[h] + sum;
  }
}

template <class C>
__device__ __forceinline__ void rescale(float (&o)[C::HEAD_DIM / 2], const float (&o_scale)[2]) {
#pragma unroll
  for (int i = 0; i < C::HEAD_DIM / 2; ++i) o[i] *= o_scale[(i / 2) % 2];
}

// P as RS A fragments: k-step kk is S registers 8 kk .. 8 kk + 7 in pairs (see wgmma.cuh)
template <class C>
__device__ __forceinline__ void pack_p(uint32_t (&pa)[C::TILE_KV / 16][4], const float (&s)[C::TILE_KV / 2]) {
#pragma unroll
  for (int kk = 0; kk < C::TILE_KV / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[kk][r] = pack2<typename C::DTypeKV>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
}

// O / l and lse (natural log; -inf for a row that sees no key) of the thread's two rows, h = 0, 1: rows
// lane / 4 + 8 h of the warp's 16. A row that sees no key (l = 0) is stored as O * 0, no select: its O is zero on
// every path (its P is 0 against finite V rows, zero_v_tail; an item without tiles passes zeros). The warp's
// 16 rows go by TMA stores where they are whole tokens inside the request (C::O_STAGED and p.o_tma: the group
// divides 16), else straight from registers (rows past the request are not written).
template <class C, class Params>
__device__ __forceinline__ void write_rows(const Params& p, const Work& w, const float (&o)[C::HEAD_DIM / 2],
                                           const float (&m)[2], const float (&l_part)[2], uint32_t smem_base, int wg) {
  using L = Layout<C>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x % 128 / 32, q4 = lane % 4;
  float l[2], inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] = l_part[h];
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 2);
    inv[h] = l[h] > 0.f ? rcp_fast(l[h]) : 0.f;  // rcp.approx: a row's O / l to within an ulp, no slow path
  }
  auto value = [&](int i, int h) { return o[i] * inv[h]; };
  auto lse = [&](int h) { return l[h] > 0.f ? (m[h] + log2f(l[h])) * LN2 : -INFINITY; };
  auto o_row = [&](int prow) {  // packed row -> row of o and lse: (token, q head)
    const FastDiv group = group_of(p);
    int token, head;
    group.divmod(prow, token, head);
    return int64_t(w.token0 + token) * p.num_qo_heads + w.kv_head * group.d + head;
  };
  const int prow_w = w.row0 + wg * 64 + warp * 16, prow0 = prow_w + lane / 4;
  if constexpr (C::O_STAGED) {
    // every row of the warp inside the request (the vote, uniform by construction, shares the register
    // stores' row test; prow_w + 16 <= rows_total spilled in the heaviest variant)
    if (p.o_tma && __all_sync(0xffffffff, prow0 + 8 < w.rows_total)) {
      // The warp's 16 rows are 16 / group tokens times the group's q heads: in o [tokens, q heads, dim] a 3-D box
      // {64 columns, group heads, 16 / group tokens} (the map tma_o), row-major as the packed rows. stmatrix
      // writes them into the warp's staging area as the box lies in shared memory, 128B-swizzled: block b of
      // 16 rows x 128 bytes, 16-byte chunk c of row r at (c ^ r % 8) * 16, so the 8 rows of a matrix hit
      // distinct banks; then one lane issues a store a block. Ordering, within the warp alone: lane 0 waits
      // until its previous stores have read the area (normally long done), __syncwarp, every lane writes,
      // fence.proxy.async makes the generic writes visible to the stores (async proxy), __syncwarp, lane 0
      // stores. run() waits for the last stores before the CTA exits.
      const uint32_t area = smem_base + L::O_STAGE_OFFSET + (wg * 4 + warp) * L::O_STAGE_WARP;
      // stmatrix jj: matrix i (its rows named by lanes 8 i .. 8 i + 7: row lane % 16 of the warp's) is columns
      // 8 j .. 8 j + 7, j = 2 jj + i / 2, of rows 8 h .. 8 h + 7, h = i % 2: the lane's chunk is j % 8 =
      // 2 (jj % 4) + lane / 16 of block jj / 4, swizzled by its row's lane % 8
      const int swz = lane / 16 ^ lane % 8;
      if (lane == 0) bulk_wait_read<0>();
      __syncwarp();
#pragma unroll
      for (int jj = 0; jj < C::HEAD_DIM / 16; ++jj) {
        uint32_t r[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int j = 2 * jj + i / 2, h = i % 2;
          r[i] = pack2<typename C::DTypeO>(value(4 * j + 2 * h, h), value(4 * j + 2 * h + 1, h));
        }
        stmatrix_x4(area + lane % 16 * 128 + jj / 4 * L::O_STAGE_BLOCK + (2 * (jj % 4) ^ swz) * 16, r[0], r[1], r[2],
                    r[3]);
      }
      fence_proxy_async();
      __syncwarp();
      if (lane == 0) {
        const FastDiv group = group_of(p);
#pragma unroll
        for (int b = 0; b < L::BLOCKS; ++b)
          tma_store_3d(&p.tma_o, area + b * L::O_STAGE_BLOCK, 64 * b, w.kv_head * group.d,
                       w.token0 + group.div(prow_w));
        bulk_commit();
      }
      if (q4 == 0 && p.lse != nullptr) {
#pragma unroll
        for (int h = 0; h < 2; ++h) p.lse[o_row(prow0 + 8 * h)] = lse(h);
      }
      return;
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int prow = prow0 + 8 * h;
    if (prow >= w.rows_total) continue;
    const int64_t row = o_row(prow);
    typename C::DTypeO* dst = p.o + row * C::HEAD_DIM + 2 * q4;
#pragma unroll
    for (int j = 0; j < C::HEAD_DIM / 8; ++j)
      *reinterpret_cast<uint32_t*>(dst + 8 * j) =
          pack2<typename C::DTypeO>(value(4 * j + 2 * h, h), value(4 * j + 2 * h + 1, h));
    if (q4 == 0 && p.lse != nullptr) p.lse[row] = lse(h);
  }
}

// V rows of the last tile past the request's KV (the tail of its last page, rows past a ragged batch) hold
// anything, NaN included, and P = 0 there does not cancel NaN: the warpgroup zeroes them before its last P V.
// Rows past a causal or window kv_hi but inside the request are its own keys (finite) and are left alone: most
// causal items end inside their request and skip this. Both consumer
// warpgroups write the same zeros, so their overlap is harmless; the fence and the warpgroup barrier order this
// warpgroup's writes before its own wgmma reads them.
template <class C>
__device__ __forceinline__ void zero_v_tail(uint8_t* smem, int v_stage_offset, int valid_rows, int wg) {
  using L = Layout<C>;
  if (valid_rows >= C::TILE_KV) return;  // uniform over the CTA
  // 16-byte chunks c of row r of block b, numbered in (r, b, c) order: the tail rows are then one range of jobs
  // and every index a division by a constant (in (b, r, c) order the block was job / (tail * 8), a runtime
  // division a chunk); valid_rows >= 0
  constexpr int ROW_JOBS = L::BLOCKS * 8;
  for (int job = valid_rows * ROW_JOBS + threadIdx.x % 128; job < C::TILE_KV * ROW_JOBS; job += 128) {
    const int r = job / ROW_JOBS, b = job / 8 % L::BLOCKS, c = job % 8;
    *reinterpret_cast<uint4*>(smem + v_stage_offset + b * L::KV_BLOCK + r * 128 + c * 16) = make_uint4(0, 0, 0, 0);
  }
  fence_proxy_async();
  named_barrier_sync(1 + wg, 128);
}

// Ping-pong of the two consumer warpgroups (C::PINGPONG): each takes its turn to issue its GEMMs (hardware
// barrier 3 + wg), then hands the turn to the other, so one warpgroup's softmax runs under the other's GEMMs.
// The turns run on across items (both warpgroups take num_tiles + 1 steps an item): WG1 may issue the next
// item's first S while WG2 finishes this one. WG2 gives WG1 the first turn (start), and WG1 takes the last
// hand-over at the end of the list (finish), so both barriers end balanced.
template <class C>
struct Scheduler {
  int wg;
  __device__ __forceinline__ void start() const {
    if constexpr (C::PINGPONG) if (wg == 1) named_barrier_arrive(3, 256);
  }
  __device__ __forceinline__ void finish() const {
    if constexpr (C::PINGPONG) if (wg == 0) named_barrier_sync(3, 256);
  }
  __device__ __forceinline__ void wait_turn() const {
    if constexpr (C::PINGPONG) named_barrier_sync(3 + wg, 256);
  }
  __device__ __forceinline__ void pass_turn() const {
    if constexpr (C::PINGPONG) named_barrier_arrive(4 - wg, 256);
  }
};

// a K or V stage's full barrier; a gathered stage (cp.async, the generic proxy) is then made visible to this
// thread's wgmma (the async proxy)
template <class C>
__device__ __forceinline__ void wait_kv(uint32_t bar, uint32_t parity) {
  mbarrier_wait(bar, parity);
  if constexpr (C::GATHER) fence_proxy_async();
}

// An item's last P V, carried into the next item's first step (issued with its first S, so that the two
// half-steps at an item boundary become one) or flushed on its own (end of the list, or before an item without
// tiles). O and P stay in the caller's registers.
struct Pending {
  Work w;            // the item (its rows, for write_rows)
  float m[2], l[2];  // its rows' softmax state
  uint32_t it_last;  // the CTA's running tile count of its last tile (V stage and phase)
  int tail_rows;     // valid V rows of that tile (kv_len - its start): zero_v_tail
  bool fresh;        // its only P V (one tile): overwrites O
  bool active;
};

template <class C>
__device__ __forceinline__ void pending_v_ready(const Pending& pd, uint8_t* smem, const Barriers<C>& bars, int wg) {
  wait_kv<C>(bars.full_v(pd.it_last % C::STAGES), uint32_t(pd.it_last / C::STAGES) & 1);
  zero_v_tail<C>(smem, Layout<C>::V_OFFSET + pd.it_last % C::STAGES * Layout<C>::KV_STAGE, pd.tail_rows, wg);
}

// after the wait for the pending P V: release its V stage and write its rows
template <class C, class Params>
__device__ __forceinline__ void pending_done(const Params& p, Pending& pd, float (&o)[C::HEAD_DIM / 2],
                                             uint32_t smem_base, const Barriers<C>& bars, int wg) {
  fence_operands(o);
  mbarrier_arrive(bars.empty_v(pd.it_last % C::STAGES));
  write_rows<C>(p, pd.w, o, pd.m, pd.l, smem_base, wg);
  pd.active = false;
}

template <class C, class Params>
__device__ __forceinline__ void flush(const Params& p, Pending& pd, float (&o)[C::HEAD_DIM / 2],
                                      uint32_t (&pa)[C::TILE_KV / 16][4], uint8_t* smem, uint32_t smem_base,
                                      const Barriers<C>& bars, int wg) {
  const Scheduler<C> sched{wg};
  pending_v_ready<C>(pd, smem, bars, wg);
  sched.wait_turn();
  issue_pv<C>(o, pa, smem_base + Layout<C>::V_OFFSET + pd.it_last % C::STAGES * Layout<C>::KV_STAGE, pd.fresh);
  wgmma_commit();
  sched.pass_turn();
  wgmma_wait<0>();
  pending_done<C>(p, pd, o, smem_base, bars, wg);
}

// WG1 / WG2: one item. The GEMMs of consecutive tiles overlap the softmax (FlashAttention-3's intra-warpgroup
// pipelining): step t issues S_t = Q K_t and O += P_(t-1) V_(t-1) together, waits for S_t only, runs the softmax
// of tile t under the P V, then waits for it and rescales O. `it` is the CTA's running tile count (stages and
// barrier phases), `k` its running item count (Q's barrier phase). Custom mask: the next tile's list entry is
// read one step ahead, a partial tile's bits are loaded while its S is computed. The previous item's last P V
// (pd) is issued with this item's first S; this item's own last P V is left pending in o, pa and pd.
template <class C, class Params>
__device__ __forceinline__ void consume(const Params& p, const Work& w, uint8_t* smem, uint32_t smem_base,
                                        const Barriers<C>& bars, int wg, uint32_t it, uint32_t k, Pending& pd,
                                        float (&o)[C::HEAD_DIM / 2], uint32_t (&pa)[C::TILE_KV / 16][4]) {
  using L = Layout<C>;
  const int warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
  const int wg_first = min(w.row0 + wg * 64, w.last_row), wg_last = min(w.row0 + wg * 64 + 63, w.last_row);
  const FastDiv group = group_of(p);
  const int wq_min = w.q_base + group.div(wg_first), wq_max = w.q_base + group.div(wg_last);
  const int kv_len = w.kv_len(group);
  const float pre = C::SOFT_CAP ? 1.f / p.soft_cap : LOG2E;  // soft_cap > 0 with SOFT_CAP (checked at plan time)
  RowState rs;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    rs.m[h] = -INFINITY;
    rs.l[h] = 0.f;
    const int prow = w.row0 + wg * 64 + warp * 16 + lane / 4 + 8 * h;
    int token, head;
    group.divmod(prow, token, head);
    rs.q_pos[h] = w.q_base + token;
    rs.slope[h] = C::ALIBI ? alibi_slope(w.kv_head * group.d + head, p.num_qo_heads) * pre : 0.f;
  }
  const LogitsParams lg{p.sm_scale * pre, p.soft_cap * LOG2E, w.kv_hi, p.window_left};
  const uint32_t q_wg = smem_base + (k % C::Q_BUFFERS) * L::Q_BYTES + wg * L::WG_ROWS * 128;
  const uint32_t k_base = smem_base + L::K_OFFSET, v_base = smem_base + L::V_OFFSET;
  const Scheduler<C> sched{wg};
  const int n = w.num_tiles;
  auto masked = [&](int t0, bool partial) {
    bool m = partial || t0 + C::TILE_KV > w.kv_hi;
    if constexpr (C::CAUSAL) m = m || t0 + C::TILE_KV - 1 > wq_min;
    if constexpr (C::WINDOW) m = m || t0 < wq_max - lg.window_left;
    return m;
  };
  int next_entry = n > 0 ? TileList<C>::entry(w.tiles, 0) : 0;
  int t0 = 0, kind = 0;
  auto next_tile = [&](int t) {  // tile t's position and kind; starts the read of entry t + 1
    const int e = next_entry;
    if (t + 1 < n) next_entry = TileList<C>::entry(w.tiles, t + 1);
    t0 = TileList<C>::pos(w.kv_lo, t, e);
    kind = TileList<C>::kind(e);
  };
  auto stage = [&](int t) { return (it + t) % C::STAGES; };
  auto phase = [&](int t) { return uint32_t((it + t) / C::STAGES) & 1; };
  const int qb = k % C::Q_BUFFERS;  // q_full(qb) was waited for by the caller
  if (n == 0) {  // no tile: O = 0 and lse = -inf (after the pending item, on its own)
    mbarrier_arrive(bars.q_empty(qb));
    if (pd.active) flush<C>(p, pd, o, pa, smem, smem_base, bars, wg);
    // O = 0, l = 0. Not o zeroed: it holds the last item's rows (or nothing yet), and ordinary writes to the
    // accumulator made ptxas serialize the wgmmas (C7515)
    const float zeros[C::HEAD_DIM / 2] = {};
    write_rows<C>(p, w, zeros, rs.m, rs.l, smem_base, wg);
    return;
  }
  float sc[C::TILE_KV / 2], o_scale[2];
  MaskBits<C> bits;
  next_tile(0);
  wait_kv<C>(bars.full_k(stage(0)), phase(0));
  if (pd.active) pending_v_ready<C>(pd, smem, bars, wg);
  sched.wait_turn();
  issue_qk<C>(sc, q_wg, k_base + stage(0) * L::KV_STAGE);
  wgmma_commit();
  // The previous item's last P V; without one (the CTA's first item, or after an item without tiles) a dummy
  // P V over this item's Q buffer that overwrites o (scale-d 0) and is never read: the step's wgmma groups are
  // then the same on every path, as ptxas needs to keep them asynchronous (a P V issued under a branch, or an
  // empty group, serialized every wgmma or made the wait below wait for both)
  issue_pv<C>(o, pa, pd.active ? v_base + pd.it_last % C::STAGES * L::KV_STAGE : smem_base + qb * L::Q_BYTES,
              pd.active ? pd.fresh : true);
  wgmma_commit();
  sched.pass_turn();
  bits.load(p.custom_mask, w, group, t0, kv_len, kind, wg);
  // the first S alone: the softmax of the item's first tile runs under the previous item's last P V, as in the
  // loop below; then that P V is waited for and its rows written (they hold o) before P overwrites pa
  wgmma_wait<1>();
  fence_operands(sc);
  mbarrier_arrive(bars.empty_k(stage(0)));
  softmax<C>(sc, rs, o_scale, lg, masked(t0, kind != ENTRY_FULL), t0, bits);
  wgmma_wait<0>();  // the P V (pending or dummy) read pa, and o holds its rows
  // the item's last Q K^T is done, and the dummy P V has read the Q buffer: the producer may load the next Q
  if (n == 1) mbarrier_arrive(bars.q_empty(qb));
  if (pd.active) pending_done<C>(p, pd, o, smem_base, bars, wg);
  pack_p<C>(pa, sc);
  // K of the next tile is waited for one step early, between the softmax and the wait for P V (below): the wait
  // loop is a block boundary that ptxas does not hoist the P V wait across. With the K wait at the loop top,
  // ptxas moved wgmma.wait_group 0 up to the start of the softmax, so no ex2 ran under the warpgroup's own P V.
  if (n > 1) wait_kv<C>(bars.full_k(stage(1)), phase(1));
  for (int t = 1; t < n; ++t) {
    next_tile(t);
    wait_kv<C>(bars.full_v(stage(t - 1)), phase(t - 1));
    sched.wait_turn();
    issue_qk<C>(sc, q_wg, k_base + stage(t) * L::KV_STAGE);
    wgmma_commit();
    issue_pv<C>(o, pa, v_base + stage(t - 1) * L::KV_STAGE, t == 1);
    wgmma_commit();
    sched.pass_turn();
    bits.load(p.custom_mask, w, group, t0, kv_len, kind, wg);
    wgmma_wait<1>();
    fence_operands(sc);
    mbarrier_arrive(bars.empty_k(stage(t)));
    if (t == n - 1) mbarrier_arrive(bars.q_empty(qb));
    softmax<C>(sc, rs, o_scale, lg, masked(t0, kind != ENTRY_FULL), t0, bits);
    if (t + 1 < n) wait_kv<C>(bars.full_k(stage(t + 1)), phase(t + 1));  // see above the loop
    wgmma_wait<0>();
    fence_operands(o);
    fence_operands(pa);
    mbarrier_arrive(bars.empty_v(stage(t - 1)));
    rescale<C>(o, o_scale);
    pack_p<C>(pa, sc);
  }
  // the last P V: pending. The last tile's start is t0 either way, but holding t0 to here cost the ALiBi + window
  // variant a spill.
  const int last_t0 = C::CUSTOM_MASK ? t0 : w.kv_lo + (n - 1) * C::TILE_KV;
  pd.w = w;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    pd.m[h] = rs.m[h];
    pd.l[h] = rs.l[h];
  }
  pd.it_last = it + n - 1;
  pd.tail_rows = kv_len - last_t0;
  pd.fresh = n == 1;
  pd.active = true;
}

template <class C, class Params>
__device__ __forceinline__ void run(const Params& p) {
  using L = Layout<C>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw), base = (raw + 1023) & ~1023u;  // swizzle atoms need 1024 alignment
  uint8_t* smem = smem_raw + (base - raw);
  const Barriers<C> bars{base + L::BAR_OFFSET};
  if (threadIdx.x == 0) bars.init(p.q_tma);
  __syncthreads();

  // the warpgroup through a shuffle from lane 0 (C::UNIFORM_WG): the compiler then knows it is warp-uniform and
  // keeps the addresses and wgmma descriptors derived from it in uniform registers
  const int wg = C::UNIFORM_WG ? __shfl_sync(0xffffffff, threadIdx.x / 128, 0) : int(threadIdx.x / 128);
  if (wg == 0) {
    setmaxnreg_dec<C::PRODUCER_REGS>();
    if constexpr (C::GATHER) {
      if (threadIdx.x < 32)
        gather_kv<C>(smem, p, p.k, base + L::K_OFFSET, &Barriers<C>::full_k, &Barriers<C>::empty_k, bars);
      else if (threadIdx.x < 64)
        gather_kv<C>(smem, p, p.v, base + L::V_OFFSET, &Barriers<C>::full_v, &Barriers<C>::empty_v, bars);
      else
        produce_q_warps<C>(p, smem, bars);
    } else if (threadIdx.x < 32)
      produce_kv<C>(p, p.custom_mask, smem, &p.tma_k, base + L::K_OFFSET, &Barriers<C>::full_k, &Barriers<C>::empty_k,
                    bars);
    else if (threadIdx.x < 64)
      produce_kv<C>(p, nullptr, smem, &p.tma_v, base + L::V_OFFSET, &Barriers<C>::full_v, &Barriers<C>::empty_v,
                    bars);
    else
      produce_q_warps<C>(p, smem, bars);
  } else {
    setmaxnreg_inc<C::CONSUMER_REGS>();
    const Work* slots = reinterpret_cast<const Work*>(smem + L::WORK_OFFSET);
    const Scheduler<C> sched{wg - 1};
    sched.start();
    float o[C::HEAD_DIM / 2];
    uint32_t pa[C::TILE_KV / 16][4];
    Pending pd;
    pd.active = false;
    for (uint32_t it = 0, k = 0;; ++k) {  // the published items, until an invalid one (its slot read after q_full)
      mbarrier_wait(bars.q_full(k % C::Q_BUFFERS), (k / C::Q_BUFFERS) & 1);
      const Work w = slots[k % WORK_SLOTS];
      if (!w.valid) break;
      mbarrier_arrive(bars.work_empty(k % WORK_SLOTS));
      consume<C>(p, w, smem, base, bars, wg - 1, it, k, pd, o, pa);
      it += w.num_tiles;
    }
    if (pd.active) flush<C>(p, pd, o, pa, smem, base, bars, wg - 1);
    if constexpr (C::O_STAGED) bulk_wait<0>();  // the last rows' TMA stores, before the CTA's shared memory goes away
    sched.finish();
  }
}

}  // namespace flashgen::sm90
