// The Hopper prefill's consumer warpgroups (WG1, WG2; setmaxnreg.inc): per KV tile S = Q K^T (wgmma SS), the
// softmax (sm90/softmax.cuh) and O += P V (wgmma RS), the GEMMs of consecutive tiles overlapping the softmax and
// the two warpgroups taking turns (sm90/named_barrier.cuh); an item's last P V is carried into the next item's
// first step (Pending), and its rows written by the epilogue (sm90/epilogue.cuh).
#pragma once
#include <cmath>
#include <cstdint>
#include <flashgen/common/fastdiv.cuh>
#include <flashgen/common/logits.cuh>
#include <flashgen/common/tile_entry.cuh>
#include <flashgen/sm90/custom_mask.cuh>
#include <flashgen/sm90/epilogue.cuh>
#include <flashgen/sm90/fp8.cuh>
#include <flashgen/sm90/layout.cuh>
#include <flashgen/sm90/named_barrier.cuh>
#include <flashgen/sm90/positions.cuh>
#include <flashgen/sm90/softmax.cuh>
#include <flashgen/sm90/tile_scheduler.cuh>
#include <flashgen/sm90/tma.cuh>
#include <flashgen/sm90/wgmma.cuh>

namespace flashgen::sm90 {

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
    Wgmma<C::TILE_KV, typename C::DTypeMMA>::ss(s, desc_advance(q_desc, col * L::Q_BLOCK + in_row),
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
    Wgmma<C::HEAD_DIM, typename C::DTypeMMA>::rs(o, pa[kk], desc_advance(v_desc, kk * 16 * 128),
                                                kk > 0 || !fresh);  // an item's first P V overwrites O (scale-d 0)
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
  named_barrier_sync(BARRIER_WARPGROUP + wg, 128);
}

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
  int request;       // its request (a variant's hooks)
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
  write_rows<C>(p, pd.w, o, pd.m, pd.l, smem_base, wg, pd.request);
  pd.active = false;
}

template <class C, class Params>
__device__ __forceinline__ void flush(const Params& p, Pending& pd, float (&o)[C::HEAD_DIM / 2],
                                      uint32_t (&pa)[C::TILE_KV / 16][4], uint8_t* smem, uint32_t smem_base,
                                      const Barriers<C>& bars, int wg) {
  const PingPong<C> turn{wg};
  pending_v_ready<C>(pd, smem, bars, wg);
  turn.wait_turn();
  issue_pv<C>(o, pa, smem_base + Layout<C>::V_OFFSET + pd.it_last % C::STAGES * Layout<C>::KV_STAGE, pd.fresh);
  wgmma_commit();
  turn.pass_turn();
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
                                        float (&o)[C::HEAD_DIM / 2], uint32_t (&pa)[C::TILE_KV / 16][4],
                                        int request) {
  using L = Layout<C>;
  const int warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
  const int wg_first = min(w.row0 + wg * 64, w.last_row), wg_last = min(w.row0 + wg * 64 + 63, w.last_row);
  const FastDiv group = group_of(p);
  const int wq_min = w.q_base + group.div(wg_first), wq_max = w.q_base + group.div(wg_last);
  const int kv_len = w.kv_len(group);
  // the logits' units: base 2, or natural log for pair hooks (LogitsParams)
  constexpr float UNITS = pair_hooked<typename C::Variant>() ? 1.f : LOG2E;
  const float pre = C::SOFT_CAP ? 1.f / p.soft_cap : UNITS;  // soft_cap > 0 with SOFT_CAP (checked at plan time)
  RowState rs;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    rs.m[h] = -INFINITY;
    rs.l[h] = 0.f;
    const int prow = w.row0 + wg * 64 + warp * 16 + lane / 4 + 8 * h;
    int token, head;
    group.divmod(prow, token, head);
    rs.q_pos[h] = query_position<C>(p, w, token, C::POSITIONS ? group.div(w.rows_total) : 0);
    rs.slope[h] = C::ALIBI ? alibi_slope(w.kv_head * group.d + head, p.num_qo_heads) * pre : 0.f;
    rs.qo_head[h] = w.kv_head * group.d + head;
    if constexpr (C::Variant::ANY && !C::POSITIONS) rs.q_pos[h] = min(rs.q_pos[h], kv_len - 1);  // past the request: its last
  }
  const HookItem hi{request, w.kv_head};
  // the tile predicate's class of the warpgroup's rows against the tile at t0 (without explicit positions); a
  // tile its list (C::TILE_LIST) calls full is so for every row of the item. Lists the mask hook wrote (no
  // predicate): full as listed, else partial.
  auto tile_cls = [&](int t0, int kind) {
    if constexpr (C::Variant::MASK_TILE && !C::POSITIONS) {
      if (C::TILE_LIST && kind == ENTRY_FULL) return flashgen::variant::TILE_FULL;
      return flashgen::variant::tile_class<typename C::Variant>(p, request, w.kv_head * group.d, group.d, w.kv_head,
                                                              wq_min, wq_max + 1, t0, min(t0 + C::TILE_KV, w.kv_hi));
    } else if constexpr (C::TILE_LIST) {
      return kind == ENTRY_FULL ? flashgen::variant::TILE_FULL : flashgen::variant::TILE_PARTIAL;
    } else {
      return flashgen::variant::TILE_PARTIAL;
    }
  };
  // fp8 K/V under a bf16 q: Q holds q * sm_scale in fp16 (prescale_q), the scores are scaled by 1
  constexpr bool PRESCALED = !std::is_same_v<typename C::DTypeMMA, typename C::DTypeQ>;
  const LogitsParams lg{(PRESCALED ? 1.f : p.sm_scale) * pre, p.soft_cap * UNITS, w.kv_hi, p.window_left};
  const uint32_t q_wg = smem_base + (k % C::Q_BUFFERS) * L::Q_BYTES + wg * L::WG_ROWS * 128;
  const uint32_t k_base = smem_base + L::K_OFFSET, v_base = smem_base + L::V_OFFSET;
  const PingPong<C> turn{wg};
  const int n = w.num_tiles;
  const KeyPositions<C, Params> kp(p, w);
  auto masked = [&](int t0, bool partial) {
    bool m = partial || t0 + C::TILE_KV > w.kv_hi;
    if constexpr (C::CAUSAL && C::POSITIONS) m = true;  // every tile: keys need not be contiguous in position
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
    write_rows<C>(p, w, zeros, rs.m, rs.l, smem_base, wg, request);
    return;
  }
  if constexpr (PRESCALED) prescale_q<C>(smem + qb * L::Q_BYTES, p.sm_scale, wg);
  float sc[C::TILE_KV / 2], o_scale[2];
  MaskBits<C> bits;
  if constexpr (C::Variant::HEAVY) {
    // heavy hooks: the steps below in one loop, the first tile's differences under t == 0, so that the softmax
    // (and the hooks in it) is instantiated once, not twice
    for (int t = 0; t < n; ++t) {
      next_tile(t);
      if (t == 0) {
        wait_kv<C>(bars.full_k(stage(0)), phase(0));
        if (pd.active) pending_v_ready<C>(pd, smem, bars, wg);
      } else {
        wait_kv<C>(bars.full_v(stage(t - 1)), phase(t - 1));
      }
      const uint32_t pv_stage = t > 0       ? v_base + stage(t - 1) * L::KV_STAGE
                                : pd.active ? v_base + pd.it_last % C::STAGES * L::KV_STAGE
                                            : smem_base + qb * L::Q_BYTES;
      const bool pv_fresh = t > 0 ? t == 1 : !pd.active || pd.fresh;
      turn.wait_turn();
      issue_qk<C>(sc, q_wg, k_base + stage(t) * L::KV_STAGE);
      wgmma_commit();
      issue_pv<C>(o, pa, pv_stage, pv_fresh);
      wgmma_commit();
      turn.pass_turn();
      bits.load(p.custom_mask, w, group, t0, kv_len, kind, wg);
      wgmma_wait<1>();
      fence_operands(sc);
      mbarrier_arrive(bars.empty_k(stage(t)));
      if (t > 0 && t == n - 1) mbarrier_arrive(bars.q_empty(qb));
      softmax<C>(sc, rs, o_scale, lg, masked(t0, C::CUSTOM_MASK && kind != ENTRY_FULL), t0, bits, kp, p, hi,
                 tile_cls(t0, kind));
      if (t + 1 < n) wait_kv<C>(bars.full_k(stage(t + 1)), phase(t + 1));
      wgmma_wait<0>();
      if (t == 0) {
        if (n == 1) mbarrier_arrive(bars.q_empty(qb));  // the dummy P V read the Q buffer
        if (pd.active) pending_done<C>(p, pd, o, smem_base, bars, wg);
      } else {
        fence_operands(o);
        fence_operands(pa);
        mbarrier_arrive(bars.empty_v(stage(t - 1)));
        rescale<C>(o, o_scale);
      }
      pack_p<C>(pa, sc);
    }
  } else {
    next_tile(0);
    wait_kv<C>(bars.full_k(stage(0)), phase(0));
    if (pd.active) pending_v_ready<C>(pd, smem, bars, wg);
    turn.wait_turn();
    issue_qk<C>(sc, q_wg, k_base + stage(0) * L::KV_STAGE);
    wgmma_commit();
    // The previous item's last P V; without one (the CTA's first item, or after an item without tiles) a dummy
    // P V over this item's Q buffer that overwrites o (scale-d 0) and is never read: the step's wgmma groups are
    // then the same on every path, as ptxas needs to keep them asynchronous (a P V issued under a branch, or an
    // empty group, serialized every wgmma or made the wait below wait for both)
    issue_pv<C>(o, pa, pd.active ? v_base + pd.it_last % C::STAGES * L::KV_STAGE : smem_base + qb * L::Q_BYTES,
                pd.active ? pd.fresh : true);
    wgmma_commit();
    turn.pass_turn();
    bits.load(p.custom_mask, w, group, t0, kv_len, kind, wg);
    // the first S alone: the softmax of the item's first tile runs under the previous item's last P V, as in the
    // loop below; then that P V is waited for and its rows written (they hold o) before P overwrites pa
    wgmma_wait<1>();
    fence_operands(sc);
    mbarrier_arrive(bars.empty_k(stage(0)));
    softmax<C>(sc, rs, o_scale, lg, masked(t0, C::CUSTOM_MASK && kind != ENTRY_FULL), t0, bits, kp, p, hi,
               tile_cls(t0, kind));
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
      turn.wait_turn();
      issue_qk<C>(sc, q_wg, k_base + stage(t) * L::KV_STAGE);
      wgmma_commit();
      issue_pv<C>(o, pa, v_base + stage(t - 1) * L::KV_STAGE, t == 1);
      wgmma_commit();
      turn.pass_turn();
      bits.load(p.custom_mask, w, group, t0, kv_len, kind, wg);
      wgmma_wait<1>();
      fence_operands(sc);
      mbarrier_arrive(bars.empty_k(stage(t)));
      if (t == n - 1) mbarrier_arrive(bars.q_empty(qb));
      softmax<C>(sc, rs, o_scale, lg, masked(t0, C::CUSTOM_MASK && kind != ENTRY_FULL), t0, bits, kp, p, hi,
                 tile_cls(t0, kind));
      if (t + 1 < n) wait_kv<C>(bars.full_k(stage(t + 1)), phase(t + 1));  // see above the loop
      wgmma_wait<0>();
      fence_operands(o);
      fence_operands(pa);
      mbarrier_arrive(bars.empty_v(stage(t - 1)));
      rescale<C>(o, o_scale);
      pack_p<C>(pa, sc);
    }
  }
  // the last P V: pending. The last tile's start is t0 either way, but holding t0 to here cost the ALiBi + window
  // variant a spill.
  const int last_t0 = TileList<C>::LISTED ? t0 : w.kv_lo + (n - 1) * C::TILE_KV;
  pd.w = w;
  pd.request = request;
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

}  // namespace flashgen::sm90
