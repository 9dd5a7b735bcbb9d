// Batch prefill / append on tensor cores (FlashAttention-2 recipe, mma.sync m16n8k16, sm_80+).
//
// One CTA runs one work item of the split-KV plan: (request, qo tile, kv chunk [kv_start, kv_end)) for one kv
// head (block x: item capacity - 1 - x / H, kv head x % H). A qo tile is TILE_Q packed rows (packed row = token *
// group + q head in the group), so the q heads of a GQA group share every K/V load. Each of the NUM_WARPS warps
// owns 16 * MMA_Q rows: its Q fragments (registers, or shared memory for wide heads), its O accumulators and its
// online-softmax state, so warps never merge. K/V tiles of TILE_KV tokens flow through a STAGES-deep cp.async
// pipeline.
//
// Registers: the scores tile is the peak (O and S accumulators, fragments in flight: d=128 with 64-key tiles
// holds 128 + 64 fp32 a thread), so what the loop needs once a tile or less waits in shared memory (KVSource,
// RowInfo: the KV source and range, mask bounds, row positions, ALiBi slopes, softmax statistics).
//
// Masks: causal (aligned to the KV end) and the sliding window clip the CTA's KV range to what its rows can
// see, so fully masked tiles are never loaded; the per-element mask runs only on a warp's boundary tiles.
// A custom bit mask comes as a tile list per item (planned on the host, flashgen/plan/mask_tiles.py): fully
// masked tiles are not listed, so never loaded; fully visible ones run without the element mask (unless they
// cross kv_hi); CAUSAL ones (bits = key <= query position) are masked by position, no bits read; a device mask
// lists every tile as BITS. Split requests write fp32 partials; the last CTA of a tile merges them
// (common/split_merge.cuh: an atomic counter per tile, reset by the merger, so a CUDA-graph replay starts from
// zero).
//
// This header is the kernel's entry: the bounds of the work item, the pipelined main loop, the epilogue.
// Config (rendered by codegen): DTypeQ, DTypeKV, DTypeMMA, DTypeO, HEAD_DIM, HEAD_DIM_VO, PAGE_SIZE, NUM_WARPS, MMA_Q,
// TILE_KV, STAGES, SMEM_BYTES, Q_IN_REGS, LATE_COPIES, PAGED, ROPE, ROPE_K, ROPE_SCALING, ALIBI, SOFT_CAP, CAUSAL, WINDOW, CUSTOM_MASK,
// POSITIONS.
//
// fp8 K/V (e4m3, e5m2) stay fp8 in shared memory and are converted in registers after ldmatrix (prefill/fp8.cuh)
// to fp16, the mma's type then; Q is staged in fp16 with its columns in the K fragments' order, a bf16 q multiplied
// by sm_scale on the way (so the scores are scaled by 1 here); k_scale is folded into sm_scale on the host and
// v_scale applied at the output (write_rows).
//
// Variant (common/variant.cuh): the pair hooks run on every tile after the spec's mask (prefill/math.cuh
// hook_logits), batch = the request, qo_idx = the query's position (kv_len - qo_len + i, or q_pos), kv_idx = the
// key's; softmax=False keeps the weights as P (no max, no normaliser); the sink and the output hook run where a
// row is finished (prefill/epilogue.cuh). A tile predicate (mask_tile), without explicit positions: the CTA's
// KV range is first cut to its first and last tiles that some row sees (live_tiles: the tiles classed in
// parallel, one a thread), so empty tiles at either end are never loaded; inside it each warp classes its tile:
// TILE_EMPTY skips the warp's Q K^T, softmax and P V (the tile is still loaded: the CTA shares it), TILE_FULL
// runs without the per-pair mask hook. q_transform runs on q's raw elements as they are loaded (through registers),
// k_transform on a landed 16-bit K tile in shared memory (prepare_k, before its RoPE) or, fp8, on each warp's
// converted fragments (fp8_k_map: dequantised by k_scale).
//
// POSITIONS (common/positions.cuh): query token i sits at q_pos[i] and key t at its page's kv_page_pos entry +
// its offset in the page. Keys need not be contiguous in position, so the KV range is not clipped by the mask:
// under causal / window every tile runs the element mask, by true positions (as do RoPE and ALiBi).
#pragma once
#include <flashgen/common/variant.cuh>
#include <flashgen/prefill/tiles.cuh>
#include <flashgen/prefill/math.cuh>
#include <flashgen/prefill/fp8.cuh>
#include <flashgen/prefill/epilogue.cuh>

namespace flashgen::prefill {

template <class C, class Params>
__device__ __forceinline__ void run(const Params& p) {
  using L = Layout<C>;
  using DTypeKV = typename C::DTypeKV;
  using DTypeMMA = typename C::DTypeMMA;  // q's dtype; fp16 for fp8 K/V (a bf16 q pre-scaled: load_q_fp8)
  constexpr bool Q_PRESCALED = !std::is_same_v<DTypeMMA, typename C::DTypeQ>;
  constexpr int S = C::STAGES, MQ = C::MMA_Q, QR = C::Q_IN_REGS ? L::D / 16 : 1;
  using V = typename C::Variant;
  constexpr bool HOOKED = V::SCORE || V::MASK || !V::SOFTMAX;  // the pair hooks (or sigmoid weights) run
  constexpr bool TILED = V::MASK_TILE && !C::POSITIONS;  // the tile predicate classes tiles

  // items are listed by request, q tiles ascending: block x takes item capacity - 1 - x / H of kv head x % H, so
  // that under a causal mask the longest q tiles of every head start first and the shortest fill the last wave
  // (CTAs start in blockIdx.x order)
  const unsigned num_kv_heads = unsigned(p.num_qo_heads / p.group_size), step = blockIdx.x / num_kv_heads;
  const int item = int(gridDim.x / num_kv_heads - 1 - step), kv_head = int(blockIdx.x - step * num_kv_heads);
  const int request = p.request_idx[item];
  if (request < 0) return;  // padding item of a fixed-capacity plan
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int token0 = p.qo_indptr[request], qo_len = p.qo_indptr[request + 1] - token0;
  const int kv_len = p.kv_len[request], q_base = kv_len - qo_len, group = p.group_size;
  const TileRows tr{token0, p.qo_tile_idx[item] * L::TILE_Q, qo_len * group, kv_head, group};
  const int last_row = min(tr.row0 + L::TILE_Q, tr.rows_total) - 1;

  // the CTA's KV range: the chunk, clipped to what its rows can see; with a custom mask, the chunk's tiles of
  // the item's tile list (positions from the list: kv_lo = 0)
  int kv_lo = p.kv_start[item], kv_hi = p.kv_end[item];
  if constexpr (C::CAUSAL && !C::POSITIONS) kv_hi = min(kv_hi, q_base + last_row / group + 1);
  if constexpr (C::WINDOW && !C::POSITIONS) kv_lo = max(kv_lo, q_base + tr.row0 / group - p.window_left);
  int num_tiles = kv_hi > kv_lo ? (kv_hi - kv_lo + L::TILE_KV - 1) / L::TILE_KV : 0;
  if constexpr (TILED && !C::CUSTOM_MASK) {  // the range cut to its first and last tiles some row sees
    const int2 live = live_tiles<C>(p, request, kv_head, q_base + tr.row0 / group, q_base + last_row / group + 1,
                                    kv_lo, kv_hi, num_tiles);
    kv_hi = live.y < live.x ? kv_lo : min(kv_hi, kv_lo + (live.y + 1) * L::TILE_KV);
    kv_lo = live.y < live.x ? kv_lo : kv_lo + live.x * L::TILE_KV;
    num_tiles = live.y < live.x ? 0 : live.y - live.x + 1;
  }
  const int32_t* tiles = nullptr;
  if constexpr (C::CUSTOM_MASK) {
    tiles = p.tiles + p.tile_indptr[item];
    num_tiles = p.tile_indptr[item + 1] - p.tile_indptr[item];
    kv_lo = 0;
  }
  // this warp's rows decide its boundary tiles: tiles [full_lo, full_hi) need no element mask
  const int w_first = min(tr.row0 + warp * L::WARP_ROWS, last_row);
  const int w_last = min(tr.row0 + (warp + 1) * L::WARP_ROWS - 1, last_row);
  int full_lo = 0, full_hi = (kv_hi - kv_lo) / L::TILE_KV;  // ... and the tile ends by kv_hi (custom mask: unused)
  if constexpr (C::CAUSAL && C::POSITIONS) full_hi = 0;  // every tile: the element mask by true positions
  if constexpr (C::CAUSAL && !C::POSITIONS)  // the tile's last key <= the warp's first query
    full_hi = min(full_hi, max(0, (q_base + w_first / group - kv_lo + 1) / L::TILE_KV));
  if constexpr (C::WINDOW && !C::POSITIONS) {  // the tile's first key >= the warp's last query - window_left
    const int y = q_base + w_last / group - p.window_left - kv_lo;
    full_lo = y > 0 ? (y + L::TILE_KV - 1) / L::TILE_KV : 0;
  }

  // What the main loop reads once a tile or less waits in shared memory, where registers are the limit: the
  // KV source, the rows' mask and ALiBi state, and the epilogue's tile and chunk (read after the loop)
  __shared__ KVSource<C> src;
  __shared__ RowInfo<C> ri;
  __shared__ HookRowsOf<C> hook_rows;  // a variant's hooks only (unused, it takes no space)
  __shared__ TileRows tr_saved;
  __shared__ int chunk_saved;
  __shared__ const int32_t* page_pos;  // POSITIONS: the request's kv_page_pos entries
  extern __shared__ __align__(128) uint8_t smem[];
  DTypeMMA* q_smem = reinterpret_cast<DTypeMMA*>(smem);
  // Ragged: Q's copies first (its rows are read once, from DRAM: the longest wait of the CTA's start), then every
  // thread builds the KV source (the same loads, broadcast) and issues the prologue's KV copies now, not after
  // thread 0's stores and the barrier below; thread 0 also keeps the source in shared memory for the loop. The
  // CTA's first tile then lands ~1000 cycles after its Q. Paged keeps the order below: built this way, its
  // variants lost 2-4 % (their main loop's code moved; measured 2026-11-30).
  if constexpr (!C::PAGED) {
    if constexpr (!L::FP8) load_q<C>(p, q_smem, token0, tr.row0, tr.rows_total, kv_head, q_base, request);
    const KVRows<C::PAGED, C::PAGE_SIZE> kv_rows(p, request);
    const int64_t head_row0 = int64_t(kv_head) * p.stride_head + kv_rows.offset(0, 0);  // + the first row
    const KVSource<C> mine{kv_rows, p.k + head_row0, p.v + KVPipeline<C>::v_offset(head_row0), tiles, kv_lo, kv_hi,
                           num_tiles};
    const KVPipeline<C> early{mine, reinterpret_cast<DTypeKV*>(smem + L::K_OFFSET),
                              reinterpret_cast<DTypeKV*>(smem + L::V_OFFSET),
                              reinterpret_cast<int64_t*>(smem + L::ROW_OFFSETS)};
    for (int tile = 0; tile < S - 1; ++tile) early.issue(tile);
    if (threadIdx.x == 0) src = mine;
    // fp8: Q goes through registers (converted, its columns reordered), after the KV copies are in flight
    if constexpr (L::FP8) load_q<C>(p, q_smem, token0, tr.row0, tr.rows_total, kv_head, q_base, request);
  } else if (threadIdx.x == 0) {
    const KVRows<C::PAGED, C::PAGE_SIZE> rows(p, request);
    const int64_t head_row0 = int64_t(kv_head) * p.stride_head + rows.offset(0, 0);
    src = KVSource<C>{rows, p.k + head_row0, p.v + KVPipeline<C>::v_offset(head_row0), tiles, kv_lo, kv_hi,
                      num_tiles};
  }
  if (threadIdx.x == 0) {
    ri.mi = MaskInfo{kv_hi, q_base, qo_len, kv_len, p.window_left, p.custom_mask,
                     C::CUSTOM_MASK ? p.mask_offset[request] : 0};
    tr_saved = tr;
    chunk_saved = p.chunk_idx[item];
    if constexpr (C::POSITIONS) page_pos = request_page_pos(p, request);
  }
  if (lane == 0) {
    ri.full_lo[warp] = full_lo;
    ri.full_hi[warp] = full_hi;
    if constexpr (TILED) hook_rows.qo_begin[warp] = q_base + w_first / group, hook_rows.qo_end[warp] = q_base + w_last / group + 1;
  }
  for (int r = threadIdx.x; r < L::TILE_Q; r += L::THREADS) {
    if constexpr (C::POSITIONS) ri.q_pos[r] = p.q_pos[token0 + min((tr.row0 + r) / group, max(qo_len - 1, 0))];
    else ri.q_pos[r] = q_base + (tr.row0 + r) / group;
    if constexpr (C::ALIBI) ri.slope[r] = alibi_slope(int(tr.head(tr.row0 + r)), p.num_qo_heads);
    if constexpr (V::ANY) hook_rows.qo_head[r] = int(tr.head(tr.row0 + r));
  }
  if constexpr (V::ANY) {
    if (threadIdx.x == 0) hook_rows.batch = request, hook_rows.kv_head = kv_head;
  }
  if constexpr (C::PAGED) load_q<C>(p, q_smem, token0, tr.row0, tr.rows_total, kv_head, q_base, request);
  __syncthreads();  // src and ri are written

  const KVPipeline<C> pipe{src, reinterpret_cast<DTypeKV*>(smem + L::K_OFFSET),
                           reinterpret_cast<DTypeKV*>(smem + L::V_OFFSET),
                           reinterpret_cast<int64_t*>(smem + L::ROW_OFFSETS)};
  // prologue: tiles 0 .. S-2 in flight; paged: offsets of tile S-1 stored, page ids of tile S in registers
  int32_t next_page = 0;
  if constexpr (C::PAGED) {
    for (int tile = 0; tile < S - 1; ++tile) {
      pipe.store_offset(tile, pipe.page_of(tile));
      __syncthreads();
      pipe.issue(tile);
    }
    pipe.store_offset(S - 1, pipe.page_of(S - 1));
    next_page = pipe.page_of(S);
  }  // ragged: issued above

  // Q fragments (RoPE: the barrier after load_q made the Q tile visible; else Q landed with the first KV tile)
  uint32_t q_regs[MQ][QR][4];
  if constexpr (C::Q_IN_REGS) {
    if constexpr (!C::ROPE) {
      cp_async_wait<S - 2>();
      __syncthreads();
    }
#pragma unroll
    for (int mq = 0; mq < MQ; ++mq)
#pragma unroll
      for (int j = 0; j < QR; ++j)
        ldmatrix_x4(q_regs[mq][j], q_smem + tile_index(warp * L::WARP_ROWS + mq * 16 + lane % 16, 2 * j + lane / 16, L::Q_CHUNKS));
  }

  // per-thread row state: rows g and g + 8 of each of the warp's mma tiles (m and l in ri between tiles)
  float o[MQ][L::DV / 8][4];
#pragma unroll
  for (int mq = 0; mq < MQ; ++mq)
#pragma unroll
    for (int j = 0; j < L::DV / 8; ++j) o[mq][j][0] = o[mq][j][1] = o[mq][j][2] = o[mq][j][3] = 0.f;
  {
    float m[MQ][2], l[MQ][2];
#pragma unroll
    for (int mq = 0; mq < MQ; ++mq) m[mq][0] = m[mq][1] = -INFINITY, l[mq][0] = l[mq][1] = 0.f;
    ri.store_stats(m, l);
  }
  const float sm_scale = Q_PRESCALED ? 1.f : p.sm_scale;
  LogitsTransform<C::ALIBI, C::SOFT_CAP> transform{sm_scale, p.soft_cap, p.soft_cap > 0.f ? 1.f / p.soft_cap : 0.f, 0.f};
  const float scale_log2 = sm_scale * LOG2E;

  // The loop's shared-memory reads (the tile count, the warp's boundary range) are issued at the top, so that
  // their latency passes under Q K^T: read where they were used, at the loop's end and before the softmax, each
  // left its compare waiting on the load (~2 % of the stall samples at 1 x 16384, ncu)
  for (int tile = 0, more = src.num_tiles > 0; more; ++tile) {
    cp_async_wait<S - 2>();
    __syncthreads();
    // 16-bit K: the variant's k_transform, then RoPE (unless the cache holds rotated K), in shared memory
    if constexpr (C::ROPE_K || (V::K_TRANSFORM && !L::FP8)) {
      if constexpr (V::K_TRANSFORM) pipe.prepare_k(p, tile, C::POSITIONS ? page_pos : nullptr, hook_rows.batch, hook_rows.kv_head);
      else pipe.prepare_k(p, tile, C::POSITIONS ? page_pos : nullptr);
      __syncthreads();
    }
    const int e = src.entry(tile), t0 = src.start(e);
    const bool boundary = ri.boundary(warp, tile, e, t0);
    more = tile + 1 < src.num_tiles;
    // the tile predicate's class of the warp's tile (TILE_PARTIAL without one): an empty tile costs the warp only
    // the CTA's shared steps (the next copies, the paged offsets), on a side path that leaves the main one as it is
    const int cls = TILED ? hook_tile_class<C>(p, ri, hook_rows, warp, t0) : flashgen::variant::TILE_PARTIAL;
    if (TILED && cls == flashgen::variant::TILE_EMPTY) {
      pipe.issue(tile + S - 1);
      if constexpr (C::PAGED) {
        pipe.store_offset(tile + S, next_page);
        next_page = pipe.page_of(tile + S + 1);
      }
      continue;
    }
    float s[MQ][L::TILE_KV / 8][4];
    if constexpr (L::FP8 && V::K_TRANSFORM)
      scores_fp8<C, QR>(s, q_regs, q_smem, pipe.k_tile(tile), warp, lane,
                        fp8_k_map<C>(p, src, hook_rows, t0, C::POSITIONS ? page_pos : nullptr));
    else if constexpr (L::FP8) scores_fp8<C, QR>(s, q_regs, q_smem, pipe.k_tile(tile), warp, lane);
    else scores<C, QR>(s, q_regs, q_smem, pipe.k_tile(tile), warp, lane);
    // the next tile's copies after this tile's K ldmatrix (not at the loop top: there they were a chain of shared
    // loads, branches and 16 cp.async between the barrier and the first mma of every warp), or with LATE_COPIES
    // after the softmax, where ptxas interleaves them with the exp2 and P V
    if constexpr (!C::LATE_COPIES) pipe.issue(tile + S - 1);
    if constexpr ((C::ALIBI || C::SOFT_CAP) && !HOOKED) logits<C>(s, ri, transform, t0, warp, lane, C::POSITIONS ? page_pos : nullptr);
    if (boundary) apply_mask<C>(s, ri, t0, warp, lane, entry_kind(e), C::POSITIONS ? page_pos : nullptr);
    if constexpr (HOOKED)
      hook_logits<C>(p, s, ri, hook_rows, transform, t0, warp, lane, C::POSITIONS ? page_pos : nullptr,
                     cls != flashgen::variant::TILE_FULL);
    float m[MQ][2], l[MQ][2];
    ri.load_stats(m, l);
    if constexpr (V::SOFTMAX) online_softmax<C>(s, o, m, l, C::ALIBI || C::SOFT_CAP || HOOKED ? 1.f : scale_log2);
    if constexpr (C::LATE_COPIES) pipe.issue(tile + S - 1);
    // after P V: ptxas keeps shared loads behind an earlier shared store, so a store before accumulate_pv held
    // every V ldmatrix (and P V mma) behind the whole softmax; each thread's own slot, read after the next
    // barrier. With RoPE (its sincos frame) m and l held across P V spill (paged5 window + soft-cap: 8 bytes):
    // stored before it there.
    if constexpr (C::ROPE) ri.store_stats(m, l);
    if constexpr (L::FP8) accumulate_pv_fp8<C>(o, s, pipe.v_tile(tile), lane);
    else accumulate_pv<C>(o, s, pipe.v_tile(tile), lane);
    if constexpr (!C::ROPE) ri.store_stats(m, l);
    // paged: the row offsets of tile + S into the ring slot issue(tile) read; issue(tile + S) reads them after
    // the next barrier, and every warp is past issue(tile) (it ran before this iteration's barrier)
    if constexpr (C::PAGED) {
      pipe.store_offset(tile + S, next_page);
      next_page = pipe.page_of(tile + S + 1);
    }
  }
  cp_async_wait<0>();
  float m[MQ][2], l[MQ][2];
  ri.load_stats(m, l);

  const TileRows tr_out = tr_saved;
  const int chunk = chunk_saved;
  write_rows<C>(p, tr_out, o, m, l, chunk, warp, lane, ri, hook_rows);
  if (chunk >= 0) merge_tile<C>(p, tr_out, ri, hook_rows);
}

}  // namespace flashgen::prefill
