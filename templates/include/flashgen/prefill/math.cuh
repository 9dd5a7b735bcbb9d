// Prefill math on a KV tile: the row state that waits in shared memory (mask bounds, query positions, ALiBi
// slopes, softmax statistics), S = Q K^T by mma.sync, the logits transform, the element mask on boundary
// tiles, the online softmax and O += P V.
//
// Config: DTypeQ, DTypeKV, DTypeMMA, HEAD_DIM, HEAD_DIM_VO, NUM_WARPS, MMA_Q, TILE_KV, Q_IN_REGS, CAUSAL, WINDOW, CUSTOM_MASK,
// ALIBI, SOFT_CAP (and what prefill/tiles.cuh reads).
#pragma once
#include <flashgen/common/positions.cuh>
#include <flashgen/prefill/tiles.cuh>

namespace flashgen::prefill {

// What the element mask needs: the KV end of the item, where the request's queries sit, its mask bits.
struct MaskInfo {
  int kv_hi, q_base, qo_len, kv_len, window_left;
  const uint8_t* bits;  // custom mask of this request (bit offset 0 = (token 0, key 0)), or null
  int64_t bit0;
};

// What a variant's hooks ask of a row besides its query position: the request, the kv head, the row's q head
// (a __shared__ variable of its own, beside RowInfo: a kernel without a variant never names it, so it takes no space)
template <int N, int WARPS>
struct HookRows {
  int batch, kv_head, qo_head[N];
  int qo_begin[WARPS], qo_end[WARPS];  // a warp's query positions (the tile predicate's rows)
};
template <class C>
using HookRowsOf = HookRows<Layout<C>::TILE_Q, C::Variant::MASK_TILE ? C::NUM_WARPS : 1>;

// The CTA's row state that waits in shared memory, where it costs no registers over the scores tile (the
// register peak: 64-key tiles at d=128 spill with it in registers): the mask bounds, each packed row's query
// position and ALiBi slope (read on boundary tiles; ALiBi: every tile), and each thread's online-softmax
// statistics (read and written once a tile by the softmax step).
template <class C>
struct RowInfo {
  MaskInfo mi;
  int full_lo[C::NUM_WARPS], full_hi[C::NUM_WARPS];  // a warp's tiles [full_lo, full_hi) need no element mask
  int q_pos[Layout<C>::TILE_Q];
  float slope[C::ALIBI ? Layout<C>::TILE_Q : 1];
  float4 stats[C::MMA_Q][Layout<C>::THREADS];  // {m[mq][0], m[mq][1], l[mq][0], l[mq][1]} of thread t: private

  // whether tile number t (list entry e, first key t0) needs the element mask: a custom mask's BITS and CAUSAL
  // tiles and a tile crossing kv_hi; else the warp's tiles outside [full_lo, full_hi)
  __device__ __forceinline__ bool boundary(int warp, int t, int e, int t0) const {
    if constexpr (C::CUSTOM_MASK) return entry_kind(e) != ENTRY_FULL || t0 + C::TILE_KV > mi.kv_hi;
    else return t < full_lo[warp] || t >= full_hi[warp];
  }
  // the CTA-local row of the thread's accumulator row h of mma tile mq
  static __device__ __forceinline__ int row(int warp, int lane, int mq, int h) {
    return warp * Layout<C>::WARP_ROWS + mq * 16 + lane / 4 + 8 * h;
  }
  __device__ __forceinline__ void load_stats(float (&m)[C::MMA_Q][2], float (&l)[C::MMA_Q][2]) const {
#pragma unroll
    for (int mq = 0; mq < C::MMA_Q; ++mq) {
      const float4 v = stats[mq][threadIdx.x];
      m[mq][0] = v.x, m[mq][1] = v.y, l[mq][0] = v.z, l[mq][1] = v.w;
    }
  }
  __device__ __forceinline__ void store_stats(const float (&m)[C::MMA_Q][2], const float (&l)[C::MMA_Q][2]) {
#pragma unroll
    for (int mq = 0; mq < C::MMA_Q; ++mq) stats[mq][threadIdx.x] = make_float4(m[mq][0], m[mq][1], l[mq][0], l[mq][1]);
  }
};

// v, opaque to the compiler: per-lane swizzle terms derived from it are recomputed in every KV tile rather than
// hoisted out of the main loop and held in registers (a few integer ops a tile; registers are the limit there)
__device__ __forceinline__ int opaque(int v) {
  asm volatile("" : "+r"(v));
  return v;
}

// A lane's ldmatrix row in a swizzled tile: chunk c (even, compile-time) of the row sits at chunk c ^ x (x < 8,
// per lane). Rows are whole 128-byte lines, so with the row's start 128-byte aligned the byte address is
// (start | x * 16) ^ (c & 7) * 16 + (c & ~7) * 16: one LOP3 with one of four constants, and an immediate offset
// (where a chain of IMAD / LEA a ldmatrix was computed before).
struct SwizzledRow {
  uint32_t base;  // shared-memory byte address of the row's start, | x * 16
  __device__ __forceinline__ SwizzledRow(const void* row, int x) : base(smem_addr(row) | uint32_t(x) << 4) {}
  // the address of chunk c of the row, plus `bytes` (a compile-time offset: other rows of the tile)
  __device__ __forceinline__ uint32_t at(int c, int bytes = 0) const {
    return (base ^ uint32_t(c & 7) << 4) + uint32_t((c & ~7) * 16 + bytes);
  }
};

// S accumulators of the warp's 16 * MMA_Q rows cleared
template <class C>
__device__ __forceinline__ void clear_scores(float (&s)[C::MMA_Q][C::TILE_KV / 8][4]) {
#pragma unroll
  for (int mq = 0; mq < C::MMA_Q; ++mq)
#pragma unroll
    for (int nt = 0; nt < C::TILE_KV / 8; ++nt) s[mq][nt][0] = s[mq][nt][1] = s[mq][nt][2] = s[mq][nt][3] = 0.f;
}

// Q's mma A fragments of k-step j for each of the warp's MMA_Q row blocks: held in registers (Q_IN_REGS) or
// read by ldmatrix at q_at (the lane's swizzled Q row)
template <class C, int QR>
__device__ __forceinline__ void q_fragments(uint32_t (&qa)[C::MMA_Q][4], const uint32_t (&q_regs)[C::MMA_Q][QR][4],
                                            const SwizzledRow& q_at, int j) {
  using L = Layout<C>;
#pragma unroll
  for (int mq = 0; mq < C::MMA_Q; ++mq) {
    if constexpr (C::Q_IN_REGS) {
#pragma unroll
      for (int i = 0; i < 4; ++i) qa[mq][i] = q_regs[mq][j][i];
    } else {
      ldmatrix_x4(qa[mq], q_at.at(2 * j, mq * 16 * L::Q_CHUNKS * 16));
    }
  }
}

// the custom-mask bit of (row, key 0), or -1 for a row past the request's queries
__device__ __forceinline__ int64_t row_bit(const MaskInfo& mi, int q_pos) {
  const int token = q_pos - mi.q_base;
  return token < mi.qo_len ? mi.bit0 + int64_t(token) * mi.kv_len : -1;
}

// a row's custom-mask bits of keys [t0, t0 + TILE_KV), bit k = key t0 + k: TILE_KV / 8 + 1 byte loads and a
// funnel shift (at the row's end, only its own bytes); 0 for a row past the request's queries
template <int TILE_KV>
__device__ __forceinline__ uint64_t mask_window(const MaskInfo& mi, int64_t bit_row, int t0) {
  static_assert(TILE_KV <= 64, "a custom-mask window is one 64-bit word");
  if (bit_row < 0) return 0;
  const int64_t first = bit_row + t0;
  const uint8_t* bytes = mi.bits + (first >> 3);
  const int left = int(((bit_row + mi.kv_len - 1) >> 3) - (first >> 3));  // the row's bytes after the first
  uint64_t lo = 0, hi = 0;
  if (left >= TILE_KV / 8) {
#pragma unroll
    for (int i = 0; i < TILE_KV / 8; ++i) lo |= uint64_t(__ldg(bytes + i)) << (8 * i);
    hi = __ldg(bytes + TILE_KV / 8);
  } else {
    for (int i = 0; i <= left; ++i) lo |= uint64_t(__ldg(bytes + i)) << (8 * i);
  }
  const int shift = int(first & 7);
  return (lo >> shift) | (shift != 0 ? hi << (TILE_KV - shift) : 0);
}

// S = Q K^T for the warp's 16 * MMA_Q rows and the TILE_KV keys of the tile
template <class C, int QR>
__device__ __forceinline__ void scores(float (&s)[C::MMA_Q][C::TILE_KV / 8][4], const uint32_t (&q_regs)[C::MMA_Q][QR][4],
                                       const typename C::DTypeMMA* q_smem, const typename C::DTypeKV* ks, int warp, int lane) {
  using L = Layout<C>;
  // every ldmatrix row of a lane is lane % 8 modulo 8, so its swizzle is (2j + b) ^ (lane % 8) = 2j ^ x with a
  // per-lane x: the addresses are a per-lane base plus compile-time offsets
  const int mat = lane / 8, mrow = opaque(lane % 8);
  const SwizzledRow q_at(q_smem + (warp * L::WARP_ROWS + lane % 16) * L::Q_CHUNKS * 8, (lane / 16) ^ mrow);
  const SwizzledRow k_at(ks + (8 * (mat / 2) + mrow) * L::K_CHUNKS * 8, (mat % 2) ^ mrow);
  clear_scores<C>(s);
  // fully unrolled, so the first k-step's mma start from zero (no accumulator clear) and Q in registers
  // has constant indices (+2-5 % over 4-step unrolling at d=128, 2026-11-29)
#pragma unroll
  for (int j = 0; j < L::D / 16; ++j) {
    uint32_t qa[C::MMA_Q][4];
    q_fragments<C>(qa, q_regs, q_at, j);
#pragma unroll
    for (int nn = 0; nn < L::TILE_KV / 16; ++nn) {
      uint32_t kf[4];
      ldmatrix_x4(kf, k_at.at(2 * j, 16 * nn * L::K_CHUNKS * 16));
#pragma unroll
      for (int mq = 0; mq < C::MMA_Q; ++mq) {
        mma_16816<typename C::DTypeKV>(s[mq][2 * nn], qa[mq], kf[0], kf[1]);
        mma_16816<typename C::DTypeKV>(s[mq][2 * nn + 1], qa[mq], kf[2], kf[3]);
      }
    }
  }
}

// S -> base-2 logits with ALiBi / soft-cap (without them, online_softmax folds sm_scale * log2(e) into its FFMA)
template <class C>
__device__ __forceinline__ void logits(float (&s)[C::MMA_Q][C::TILE_KV / 8][4], const RowInfo<C>& ri,
                                       LogitsTransform<C::ALIBI, C::SOFT_CAP>& transform, int tile_start, int warp,
                                       int lane, const int32_t* page_pos = nullptr) {
  static_assert(C::ALIBI || C::SOFT_CAP, "plain scores are scaled in online_softmax");
  if constexpr (C::POSITIONS && C::ALIBI) {  // ALiBi by true key positions (keys past kv_hi: masked later)
    const int base = tile_start + 2 * (lane % 4), last = ri.mi.kv_hi - 1;
#pragma unroll
    for (int mq = 0; mq < C::MMA_Q; ++mq)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = RowInfo<C>::row(warp, lane, mq, h);
        const int q_pos = ri.q_pos[r];
        transform.slope = ri.slope[r];
#pragma unroll
        for (int nt = 0; nt < C::TILE_KV / 8; ++nt)
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e) {
            const int k_pos = key_position<C::PAGE_SIZE>(page_pos, min(base + nt * 8 + e % 2, last));
            s[mq][nt][e] = transform(s[mq][nt][e], k_pos - q_pos);
          }
      }
    return;
  }
#pragma unroll
  for (int mq = 0; mq < C::MMA_Q; ++mq)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int q_pos = 0;
      if constexpr (C::ALIBI) {
        const int r = RowInfo<C>::row(warp, lane, mq, h);
        q_pos = ri.q_pos[r];
        transform.slope = ri.slope[r];
      }
#pragma unroll
      for (int nt = 0; nt < C::TILE_KV / 8; ++nt)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e)
          s[mq][nt][e] = transform(s[mq][nt][e], tile_start + nt * 8 + 2 * (lane % 4) + (e % 2) - q_pos);
    }
}

// A variant's pair hooks (common/variant.cuh) on every tile, after the spec's mask: each pair the mask left
// visible gets its natural-log logit (the spec's ALiBi and soft-cap applied here, not in logits()) through the
// hooks, and leaves in base 2; a hidden pair is -inf (softmax=False: weight 0). Every pair is evaluated and the
// hidden ones discarded (pair_value), a key past kv_hi at the last before it: a hook never sees a key past the
// request's. qo_idx is the row's query position (a row past the request's queries asks
// for its last query), kv_idx the key's position; distance the lane's first key's offset from the row's query,
// converted once a row a tile, plus the key's offset from that key (explicit positions: each key's own).
template <class C, class Params>
__device__ __forceinline__ void hook_logits(const Params& p, float (&s)[C::MMA_Q][C::TILE_KV / 8][4], const RowInfo<C>& ri,
                                            const HookRowsOf<C>& hr,
                                            LogitsTransform<C::ALIBI, C::SOFT_CAP>& transform, int tile_start,
                                            int warp, int lane, const int32_t* page_pos, bool use_mask) {
  using V = typename C::Variant;
  const MaskInfo& mi = ri.mi;
  const int base = tile_start + 2 * (lane % 4), batch = hr.batch, kv_head = hr.kv_head;
  constexpr float UNITS = V::SOFTMAX ? LOG2E : 1.f;
#pragma unroll
  for (int mq = 0; mq < C::MMA_Q; ++mq)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = RowInfo<C>::row(warp, lane, mq, h);
      int q_pos = ri.q_pos[r];
      if constexpr (!C::POSITIONS) q_pos = min(q_pos, mi.q_base + mi.qo_len - 1);
      const int qo_head = hr.qo_head[r];
      if constexpr (C::ALIBI) transform.slope = ri.slope[r];
      const float row_dist = flashgen::variant::row_distance<V>(base, q_pos);
#pragma unroll
      for (int nt = 0; nt < C::TILE_KV / 8; ++nt)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          const int t = base + nt * 8 + e % 2;
          int k_pos = min(t, mi.kv_hi - 1);
          if constexpr (C::POSITIONS) k_pos = key_position<C::PAGE_SIZE>(page_pos, k_pos);
          const bool hidden = t >= mi.kv_hi || s[mq][nt][e] == -INFINITY;
          const float dist = C::POSITIONS ? flashgen::variant::distance_at<V>(q_pos, k_pos)
                                          : flashgen::variant::pair_distance<V>(row_dist, nt * 8 + e % 2);
          s[mq][nt][e] = flashgen::variant::pair_value<V>(p, hidden, transform.natural(s[mq][nt][e], k_pos - q_pos),
                                                          batch, q_pos, k_pos, qo_head, kv_head, dist, use_mask) *
                         UNITS;
        }
    }
}

// The tile predicate's class of the warp's rows against keys [tile_start, tile_start + TILE_KV) (cut at kv_hi),
// over every q head of the group (a class holds only where it holds for all of them)
template <class C, class Params>
__device__ __forceinline__ int hook_tile_class(const Params& p, const RowInfo<C>& ri, const HookRowsOf<C>& hr, int warp,
                                               int tile_start) {
  const int group = p.group_size;
  return flashgen::variant::tile_class<typename C::Variant>(
      p, hr.batch, hr.kv_head * group, group, hr.kv_head, hr.qo_begin[warp], hr.qo_end[warp],
      tile_start, min(tile_start + C::TILE_KV, ri.mi.kv_hi));
}

// {first, last} of the tiles [kv_lo + t TILE_KV, + TILE_KV) (cut at kv_hi), t < num_tiles, that the tile predicate
// does not call empty for queries [qo_begin, qo_end) of the group's q heads (last < first: every tile is empty).
// Every thread of the CTA calls it (two barriers); each classes tiles tid, tid + THREADS, ...
template <class C, class Params>
__device__ __forceinline__ int2 live_tiles(const Params& p, int batch, int kv_head, int qo_begin, int qo_end, int kv_lo,
                                           int kv_hi, int num_tiles) {
  __shared__ int first, last;
  if (threadIdx.x == 0) first = num_tiles, last = -1;
  __syncthreads();
  const int group = p.group_size;
  for (int t = threadIdx.x; t < num_tiles; t += Layout<C>::THREADS) {
    const int k0 = kv_lo + t * C::TILE_KV;
    const int cls = flashgen::variant::tile_class<typename C::Variant>(p, batch, kv_head * group, group, kv_head, qo_begin,
                                                                       qo_end, k0, min(k0 + C::TILE_KV, kv_hi));
    if (cls != flashgen::variant::TILE_EMPTY) {
      atomicMin(&first, t);
      atomicMax(&last, t);
    }
  }
  __syncthreads();
  return make_int2(first, last);
}

// boundary tiles only: logits of (row, key) pairs the mask hides become -inf. A thread's keys of a row are
// t0 + 2 * (lane % 4) + k for the compile-time k = 8 * nt + e % 2: each row reduces to a range of k (the KV end,
// causal, window) and, for a custom mask, a window of bits: the mask's (ENTRY_BITS) or keys <= the row's query
// position (ENTRY_CAUSAL; ENTRY_FULL: all ones)
template <class C>
__device__ __forceinline__ void apply_mask(float (&s)[C::MMA_Q][C::TILE_KV / 8][4], const RowInfo<C>& ri,
                                           int tile_start, int warp, int lane, int kind,
                                           const int32_t* page_pos = nullptr) {
  const MaskInfo& mi = ri.mi;
  const int base = tile_start + 2 * (lane % 4);
  if constexpr (C::POSITIONS) {  // each key by its true position (keys need not be contiguous)
#pragma unroll
    for (int mq = 0; mq < C::MMA_Q; ++mq)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int q_pos = ri.q_pos[RowInfo<C>::row(warp, lane, mq, h)];
#pragma unroll
        for (int nt = 0; nt < C::TILE_KV / 8; ++nt)
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e) {
            const int t = base + nt * 8 + e % 2;
            const int k_pos = key_position<C::PAGE_SIZE>(page_pos, min(t, mi.kv_hi - 1));
            bool ok = t < mi.kv_hi;
            if constexpr (C::CAUSAL) ok = ok && k_pos <= q_pos;
            if constexpr (C::WINDOW) ok = ok && k_pos >= q_pos - mi.window_left;
            if (!ok) s[mq][nt][e] = -INFINITY;
          }
      }
    return;
  }
#pragma unroll
  for (int mq = 0; mq < C::MMA_Q; ++mq)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int q_pos = ri.q_pos[RowInfo<C>::row(warp, lane, mq, h)];
      int k_hi = mi.kv_hi - 1 - base, k_lo = 0;  // visible: k_lo <= k <= k_hi
      if constexpr (C::CAUSAL) k_hi = min(k_hi, q_pos - base);
      if constexpr (C::WINDOW) k_lo = q_pos - mi.window_left - base;
      uint64_t bits = 0;
      if constexpr (C::CUSTOM_MASK) {
        const int64_t bit_row = row_bit(mi, q_pos);
        const int n = min(max(q_pos - tile_start + 1, 0), C::TILE_KV);  // CAUSAL: keys t0 .. q_pos
        bits = bit_row < 0 ? 0
               : kind == ENTRY_BITS ? mask_window<C::TILE_KV>(mi, bit_row, tile_start)
               : kind == ENTRY_CAUSAL ? (n >= 64 ? ~uint64_t(0) : (uint64_t(1) << n) - 1)
                           : ~uint64_t(0);
        bits >>= 2 * (lane % 4);
      }
#pragma unroll
      for (int nt = 0; nt < C::TILE_KV / 8; ++nt)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          const int k = nt * 8 + e % 2;
          bool ok = k <= k_hi && k >= k_lo;
          if constexpr (C::CUSTOM_MASK) ok = ok && ((bits >> k) & 1);
          if (!ok) s[mq][nt][e] = -INFINITY;
        }
    }
}

// online-softmax update over the tile's scores: s becomes P; O and l are rescaled only when some row of the
// warp raises its maximum by more than RESCALE_SLACK. A row keeps its old m while the tile's maximum stays
// within the slack, so P = exp2(s * scale - m) <= 2^RESCALE_SLACK (exact in fp32 l and O, bf16 / fp16 P keep
// their relative precision), and O / l and lse = m + log2(l) are unchanged. Rescaling on every raise fired on
// two thirds of the tiles of random inputs at 4 x 4096; with the slack ~1-2 %. The base-2 logit of a score is
// s * scale (scale = sm_scale * log2(e), or 1 where logits() already transformed s), so P is one FFMA and an
// ex2 an element; m is kept in base-2 logits.
constexpr float RESCALE_SLACK = 8.f;
template <class C>
__device__ __forceinline__ void online_softmax(float (&s)[C::MMA_Q][C::TILE_KV / 8][4],
                                               float (&o)[C::MMA_Q][C::HEAD_DIM_VO / 8][4], float (&m)[C::MMA_Q][2],
                                               float (&l)[C::MMA_Q][2], float scale_log2) {
  float m_use[C::MMA_Q][2], scale[C::MMA_Q][2];
  bool moved = false;
#pragma unroll
  for (int mq = 0; mq < C::MMA_Q; ++mq)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < C::TILE_KV / 8; ++nt) mx = fmaxf(mx, fmaxf(s[mq][nt][2 * h], s[mq][nt][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      // -inf + slack is -inf: a row's first visible key always raises it
      const bool raise = mx * scale_log2 > m[mq][h] + RESCALE_SLACK;
      const float m_new = raise ? mx * scale_log2 : m[mq][h];
      m_use[mq][h] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet: P = 0, not NaN
      scale[mq][h] = raise ? exp2_fast(m[mq][h] - m_use[mq][h]) : 1.f;
      moved = moved || raise;
      m[mq][h] = m_new;
    }
  if (__any_sync(0xffffffff, moved)) {
#pragma unroll
    for (int mq = 0; mq < C::MMA_Q; ++mq)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        l[mq][h] *= scale[mq][h];
#pragma unroll
        for (int j = 0; j < C::HEAD_DIM_VO / 8; ++j) {
          o[mq][j][2 * h] *= scale[mq][h];
          o[mq][j][2 * h + 1] *= scale[mq][h];
        }
      }
  }
#pragma unroll
  for (int mq = 0; mq < C::MMA_Q; ++mq)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int nt = 0; nt < C::TILE_KV / 8; ++nt) {
        s[mq][nt][2 * h] = exp2_fast(fmaf(s[mq][nt][2 * h], scale_log2, -m_use[mq][h]));
        s[mq][nt][2 * h + 1] = exp2_fast(fmaf(s[mq][nt][2 * h + 1], scale_log2, -m_use[mq][h]));
        l[mq][h] += s[mq][nt][2 * h] + s[mq][nt][2 * h + 1];
      }
}

// O += P V: P from the S accumulators (C layout -> A layout), V fragments by ldmatrix.trans. (Row sums of P by an
// mma against ones, as FlashInfer does, gained 0-2 % but doubled the causal max error against SDPA: l stays fp32.)
template <class C>
__device__ __forceinline__ void accumulate_pv(float (&o)[C::MMA_Q][C::HEAD_DIM_VO / 8][4],
                                              const float (&s)[C::MMA_Q][C::TILE_KV / 8][4],
                                              const typename C::DTypeKV* vs, int lane) {
  using L = Layout<C>;
  using T = typename C::DTypeKV;
  const int mat = lane / 8, mrow = opaque(lane % 8);
  const SwizzledRow v_at(vs + (8 * (mat % 2) + mrow) * L::V_CHUNKS * 8, (mat / 2) ^ mrow);  // as in scores()
#pragma unroll
  for (int kk = 0; kk < L::TILE_KV / 16; ++kk) {
    uint32_t pa[C::MMA_Q][4];
#pragma unroll
    for (int mq = 0; mq < C::MMA_Q; ++mq) {
      pa[mq][0] = pack2<T>(s[mq][2 * kk][0], s[mq][2 * kk][1]);
      pa[mq][1] = pack2<T>(s[mq][2 * kk][2], s[mq][2 * kk][3]);
      pa[mq][2] = pack2<T>(s[mq][2 * kk + 1][0], s[mq][2 * kk + 1][1]);
      pa[mq][3] = pack2<T>(s[mq][2 * kk + 1][2], s[mq][2 * kk + 1][3]);
    }
#pragma unroll
    for (int c = 0; c < L::DV / 16; ++c) {
      uint32_t vf[4];
      ldmatrix_x4_trans(vf, v_at.at(2 * c, 16 * kk * L::V_CHUNKS * 16));
#pragma unroll
      for (int mq = 0; mq < C::MMA_Q; ++mq) {
        mma_16816<T>(o[mq][2 * c], pa[mq], vf[0], vf[1]);
        mma_16816<T>(o[mq][2 * c + 1], pa[mq], vf[2], vf[3]);
      }
    }
  }
}

}  // namespace flashgen::prefill
