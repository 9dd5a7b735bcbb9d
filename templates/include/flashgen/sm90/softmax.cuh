// The Hopper prefill consumers' softmax step in registers: the logits transform (ALiBi, soft-cap), the element
// mask, the online softmax (base 2) over a wgmma accumulator tile, O's rescale and P packed as RS A fragments.
#pragma once
#include <cmath>
#include <cstdint>
#include <flashgen/common/logits.cuh>
#include <flashgen/common/mma.cuh>
#include <flashgen/common/variant.cuh>
#include <flashgen/sm90/custom_mask.cuh>
#include <flashgen/sm90/positions.cuh>

namespace flashgen::sm90 {

// tanh(x) = 1 - 2 / (e^(2x) + 1) by ex2.approx and rcp.approx (relative error ~1e-7 away from 0, absolute ~1e-7
// near it), with far fewer registers than tanhf; saturates to +-1
__device__ __forceinline__ float tanh_fast(float x) { return 1.f - 2.f * rcp_fast(exp2_fast(x * (2.f * LOG2E)) + 1.f); }

// Per-thread row state: rows g and g + 8 of the warp's 16 (h = 0, 1).
struct RowState {
  float m[2], l[2];
  int q_pos[2];
  float slope[2];  // ALiBi slope of the row's q head, pre-multiplied like S (see LogitsParams)
  int qo_head[2];  // a variant's hooks only: the row's q head
};

// What a variant's pair hooks need besides the rows: the request and the kv head of the item
struct HookItem {
  int batch, kv_head;
};

// Whether a variant runs hooks per (query, key) pair (a score or mask hook, or weights without softmax): the
// logits are then in natural-log units up to the exponent (the hooks' contract), else in base 2.
template <class V>
constexpr bool pair_hooked() {
  return V::SCORE || V::MASK || !V::SOFTMAX;
}

// Whether a tile its list calls full keeps a raw S, its scale folded into the exponent as without a variant
// (softmax), where the hooks' natural-log units would take a multiply a logit (hooks_by_pair skips such a tile):
// a tile predicate's lists, no score hook, softmax, no logits transform, up to head_dim 128. Not for lists the mask
// hook wrote (48 bytes spilled at head_dim 128, sm_90a, nvcc 13.0) nor at head_dim 256 (prefix-LM's spills 28 -> 48
// bytes).
template <class C>
constexpr bool fold_full_scale() {
  using V = typename C::Variant;
  return C::TILE_LIST && V::MASK_TILE && !V::SCORE && V::SOFTMAX && !C::ALIBI && !C::SOFT_CAP && C::HEAD_DIM <= 128;
}

// The logits transform's runtime values (see logits.cuh for the order of the steps), folded so that a logit
// takes one multiply, the ALiBi FMA and the cap: with soft-cap, y = S * sm_scale / cap + slope / cap * (key - q)
// and the base-2 logit is cap * log2(e) * tanh(y); without it, S * sm_scale * log2(e) + slope * log2(e) * (key - q).
// The slopes in RowState carry the same factor (1 / cap or log2(e)). With pair hooks (pair_hooked) the same in
// natural-log units: log2(e) is left out (mul = sm_scale, cap_log2 = cap), so that a hook takes the logit with no
// conversion and the exponent folds log2(e) into its FMA.
struct LogitsParams {
  float mul, cap_log2;
  int kv_hi, window_left;
};

// The pair hooks' distance (common/variant.cuh), without an I2F a pair: a row's part, the thread's first key of the
// tile t0 + 2 q4 less the row's query position, converted once a tile; key i adds its offset from that key, a
// constant. A key clamped to kv_hi - 1 is hidden, so its distance may be the unclamped key's.
template <class V>
__device__ __forceinline__ void row_distances(float (&row)[2], const RowState& rs, int t0) {
#pragma unroll
  for (int h = 0; h < 2; ++h) row[h] = flashgen::variant::row_distance<V>(t0 + 2 * (threadIdx.x % 4), rs.q_pos[h]);
}
template <class V>
__device__ __forceinline__ float key_distance(const float (&row)[2], int i) {
  return flashgen::variant::pair_distance<V>(row[(i / 2) % 2], 8 * (i / 4) + i % 2);
}

// The pair hooks on a tile whose keys all lie inside the item (not under a tile predicate, without explicit
// positions), before the spec's mask: every pair evaluated, so that what the hooks read for a row is read once a
// tile, and a tile the mask leaves alone takes the hooks alone, no test or clamp a pair (the item's last tile and
// a predicate's partial ones take hooks_by_pair: one path for all, its keys clamped to kv_hi, spilled at sm_90a,
// nvcc 13.0). A score hook alone (or weights without softmax): a mask hook's per-key reads held across the mask
// spilled (the document mask, 12 bytes). Logits in the kernel's units (natural log with pair hooks: see
// LogitsParams).
// ANY_TILE (heavy hooks, V::HEAVY): any tile of the item, each key past kv_hi taken as the last before it (a clamp a
// pair), so that the hooks' code is instantiated once a softmax, not again in hooks_by_pair; hide_inside<C, true>
// then hides the keys past kv_hi.
template <class C, bool ANY_TILE = false, class Params>
__device__ __forceinline__ void hooks_inside(float (&s)[C::TILE_KV / 2], const RowState& rs, const LogitsParams& lg,
                                             int t0, const Params& p, const HookItem& hi) {
  using V = typename C::Variant;
  constexpr bool RAW = !C::ALIBI && !C::SOFT_CAP;
  const int q4 = threadIdx.x % 4;
  float row_dist[2];
  row_distances<V>(row_dist, rs, t0);
#pragma unroll
  for (int i = 0; i < C::TILE_KV / 2; ++i) {
    int place = t0 + 8 * (i / 4) + 2 * q4 + i % 2;
    if constexpr (ANY_TILE) place = min(place, lg.kv_hi - 1);
    const int h = (i / 2) % 2;
    s[i] = flashgen::variant::pair_logit<V>(p, RAW ? s[i] * lg.mul : s[i], hi.batch, rs.q_pos[h], place,
                                            rs.qo_head[h], hi.kv_head, key_distance<V>(row_dist, i));
  }
}

// The spec's mask after hooks_inside, on a tile inside the item: a hidden pair's hook value is discarded. Each
// key's offset from the thread's first key is compared with bounds a row (a compare with a constant a key; the
// hooks' key indices are not held to here, which spilled). ANY_TILE: on any tile, keys past kv_hi hidden too (their
// bound folded into the causal one's).
template <class C, bool ANY_TILE = false>
__device__ __forceinline__ void hide_inside(float (&s)[C::TILE_KV / 2], const RowState& rs, const LogitsParams& lg,
                                            int t0, const MaskBits<C>& bits) {
  constexpr float HIDDEN = C::Variant::SOFTMAX ? -INFINITY : 0.f;
  typename MaskBits<C>::Words words;
  bits.select(words);
  int end[2], begin[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int first = t0 + 2 * (threadIdx.x % 4);
    end[h] = rs.q_pos[h] + 1 - first;
    if constexpr (ANY_TILE) end[h] = C::CAUSAL ? min(end[h], lg.kv_hi - first) : lg.kv_hi - first;
    begin[h] = rs.q_pos[h] - lg.window_left - first;
  }
#pragma unroll
  for (int i = 0; i < C::TILE_KV / 2; ++i) {
    const int key = 8 * (i / 4) + i % 2, h = (i / 2) % 2;
    bool ok = true;
    if constexpr (C::CAUSAL || ANY_TILE) ok = key < end[h];
    if constexpr (C::WINDOW) ok = ok && key >= begin[h];
    if constexpr (C::CUSTOM_MASK) ok = ok && MaskBits<C>::visible(words, i);
    if (!ok) s[i] = HIDDEN;
  }
}

// The mask hook over a tile's pairs as bits (bit i: pair i kept), eight pairs a step (two rows, keys 2 q4 + {0, 1,
// 8, 9} of 16) in a loop that is not unrolled: the hook's code is instantiated eight times a call site, not once a
// pair (TILE_KV / 2 times), which was most of a mask-hook kernel's code and of its compile time (ptxas). Each key
// is clamped to kv_hi - 1, so that the hook only ever sees real pairs (what it says of a key past kv_hi is
// discarded). A row's loads (doc_ids[qo_idx], ancestors[qo_idx]) are the same in every step.
template <class C, class Params>
__device__ __forceinline__ uint64_t mask_hook_bits(const RowState& rs, const LogitsParams& lg, int t0, const Params& p,
                                                   const HookItem& hi, const float (&row_dist)[2]) {
  using V = typename C::Variant;
  static_assert(C::TILE_KV / 2 <= 64, "a tile's pairs a thread fit the bits");
  const int first = t0 + 2 * (threadIdx.x % 4);
  uint64_t keep = 0;
#pragma unroll 1
  for (int j = 0; j < C::TILE_KV / 16; ++j) {
    uint32_t step = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int offset = 16 * j + 8 * (e / 4) + e % 2, h = (e / 2) % 2;  // pair 8 j + e
      const bool kept = V::mask(p.variant, hi.batch, rs.q_pos[h], min(first + offset, lg.kv_hi - 1), rs.qo_head[h],
                                hi.kv_head, flashgen::variant::pair_distance<V>(row_dist[h], offset));
      step |= uint32_t(kept) << e;
    }
    keep |= uint64_t(step) << (8 * j);
  }
  return keep;
}

// The pair hooks after the spec's mask (a pair it hid is -inf), every pair evaluated and the hidden ones
// discarded, so that what the hooks read for a row is read once a tile, a key past kv_hi taken as the last before
// it (the hooks only ever see real pairs). A mask hook without a tile predicate takes its verdicts from
// mask_hook_bits (none on a tile its list calls full), then any score hook runs pair by pair. With a predicate the
// mask hook runs pair by pair: only the partial tiles reach it, and there the rolled loop cost prefix-LM 4-6 % at
// 4x4096 (H200, b87866b), for less code saved (two sites, not four). With explicit positions a branch a pair (a
// key past kv_hi has no position to read). A tile its list calls full, without a score hook, calls none.
template <class C, class KP, class Params>
__device__ __forceinline__ void hooks_by_pair(float (&s)[C::TILE_KV / 2], const RowState& rs, const LogitsParams& lg,
                                              int t0, const KP& kp, const Params& p, const HookItem& hi, int cls) {
  using V = typename C::Variant;
  constexpr bool RAW = !C::ALIBI && !C::SOFT_CAP;
  constexpr float HIDDEN = V::SOFTMAX ? -INFINITY : 0.f;
  const int q4 = threadIdx.x % 4;
  // a tile full by its list: nothing to evaluate; a raw S keeps its scale for the exponent (fold_full_scale),
  // else takes it here
  if (C::TILE_LIST && !V::SCORE && V::SOFTMAX && cls == flashgen::variant::TILE_FULL) {
    if constexpr (RAW && !fold_full_scale<C>())
#pragma unroll
      for (int i = 0; i < C::TILE_KV / 2; ++i) s[i] *= lg.mul;
    return;
  }
  const bool use_mask = cls != flashgen::variant::TILE_FULL;
  float row_dist[2];
  row_distances<V>(row_dist, rs, t0);
  if constexpr (V::MASK && !V::MASK_TILE && !C::POSITIONS) {  // (cls: TILE_FULL or TILE_PARTIAL)
    const uint64_t keep = use_mask ? mask_hook_bits<C>(rs, lg, t0, p, hi, row_dist) : ~uint64_t(0);
#pragma unroll
    for (int i = 0; i < C::TILE_KV / 2; ++i) {
      const int place = min(t0 + 8 * (i / 4) + 2 * q4 + i % 2, lg.kv_hi - 1), h = (i / 2) % 2;
      float x = RAW ? s[i] * lg.mul : s[i];
      if constexpr (V::SCORE)
        x = V::score(p.variant, x, hi.batch, rs.q_pos[h], place, rs.qo_head[h], hi.kv_head,
                     key_distance<V>(row_dist, i));
      s[i] = s[i] == -INFINITY || !((keep >> i) & 1) ? HIDDEN : x;
    }
  } else if constexpr (C::POSITIONS) {
#pragma unroll
    for (int i = 0; i < C::TILE_KV / 2; ++i) {
      const int place = t0 + 8 * (i / 4) + 2 * q4 + i % 2, h = (i / 2) % 2, pos = kp.at(t0, i);
      const bool hidden = place >= lg.kv_hi || s[i] == -INFINITY || cls == flashgen::variant::TILE_EMPTY;
      s[i] = hidden ? HIDDEN
                    : flashgen::variant::pair_logit<V>(p, RAW ? s[i] * lg.mul : s[i], hi.batch, rs.q_pos[h], pos,
                                                       rs.qo_head[h], hi.kv_head,
                                                       flashgen::variant::distance_at<V>(rs.q_pos[h], pos), use_mask);
    }
  } else {
#pragma unroll
    for (int i = 0; i < C::TILE_KV / 2; ++i) {
      const int place = min(t0 + 8 * (i / 4) + 2 * q4 + i % 2, lg.kv_hi - 1), h = (i / 2) % 2;
      s[i] = flashgen::variant::pair_value<V>(p, s[i] == -INFINITY || cls == flashgen::variant::TILE_EMPTY,
                                              RAW ? s[i] * lg.mul : s[i], hi.batch, rs.q_pos[h], place,
                                              rs.qo_head[h], hi.kv_head, key_distance<V>(row_dist, i), use_mask);
    }
  }
}

// S -> P in place: P = 2^(logit - m) with the running max m (base 2) and sum l. Without ALiBi or soft-cap the
// logit is S * scale_log2, folded into the exponent (sm_scale > 0, checked at plan time: the max of raw S is
// then the max logit). Masked tiles hide (row, key) pairs past kv_hi, after the row's query position (causal),
// before its window or whose custom-mask bit is clear. o_scale is the factor O must be multiplied by before
// P V is added (applied by the caller once the previous P V has completed). With explicit positions (kp) the
// ALiBi bias and the causal / window tests take each key's true position (kv_hi still bounds places).
//
// A variant (common/variant.cuh): after the spec's transform, on every tile, each pair visible and before kv_hi
// goes through the hooks in natural-log units (batch = the request, qo_idx = the row's query position, kv_idx =
// the key's: hooks_inside, then the mask, or the mask, then hooks_by_pair); softmax=False keeps the weights as P (no max, no sum:
// o_scale 1). cls: the tile's class (the predicate's over the warpgroup's rows, or its list's) (TILE_EMPTY: every pair hidden, no hook
// called; TILE_FULL: no per-pair mask; the GEMMs run either way, their asynchronous groups stay uniform). With a
// tile list (C::TILE_LIST) an empty tile of the item never gets here, and a full one without a score hook skips
// the hooks' loop.
template <class C, class KP, class Params>
__device__ __forceinline__ void softmax(float (&s)[C::TILE_KV / 2], RowState& rs, float (&o_scale)[2],
                                        const LogitsParams& lg, bool masked, int t0, const MaskBits<C>& bits,
                                        const KP& kp, const Params& p, const HookItem& hi,
                                        int cls = flashgen::variant::TILE_PARTIAL) {
  using V = typename C::Variant;
  constexpr bool HOOKED = pair_hooked<V>();
  constexpr bool RAW = !C::ALIBI && !C::SOFT_CAP;
  const int q4 = threadIdx.x % 4;
  if constexpr (C::POSITIONS) {
    // one pass: each key's position read once for the bias and the mask (two passes held 32 of them between)
#pragma unroll
    for (int i = 0; i < C::TILE_KV / 2; ++i) {
      const int place = t0 + 8 * (i / 4) + 2 * q4 + i % 2, q_pos = rs.q_pos[(i / 2) % 2];
      const int pos = C::ALIBI || C::CAUSAL ? kp.at(t0, i) : place;
      float x = s[i];
      if constexpr (!RAW) {
        x *= lg.mul;
        if constexpr (C::ALIBI) x = fmaf(rs.slope[(i / 2) % 2], float(pos - q_pos), x);
        if constexpr (C::SOFT_CAP) x = lg.cap_log2 * tanh_fast(x);
      }
      if (masked) {  // always under causal / window (mainloop.cuh), else for tiles past kv_hi
        bool ok = place < lg.kv_hi;
        if constexpr (C::CAUSAL) ok = ok && pos <= q_pos;
        if constexpr (C::WINDOW) ok = ok && pos >= q_pos - lg.window_left;
        if (!ok) x = -INFINITY;
      }
      s[i] = x;
    }
  } else if constexpr (!RAW) {
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
  // a tile whose keys all lie inside the item (uniform over the warpgroup); with a score hook alone (or weights
  // without softmax) its hooks come before the mask (hooks_inside), else after it (hooks_by_pair)
  // and heavy hooks (V::HEAVY) take the same path on every tile, clamped, for one instantiation a softmax
  constexpr bool HOOKS_FIRST = HOOKED && !C::POSITIONS && !V::MASK && !V::MASK_TILE;
  constexpr bool ONE_SITE = HOOKS_FIRST && V::HEAVY;
  const bool inside = !C::POSITIONS && !V::MASK_TILE && t0 + C::TILE_KV <= lg.kv_hi;
  if constexpr (ONE_SITE) {
    hooks_inside<C, true>(s, rs, lg, t0, p, hi);
    if (masked) hide_inside<C, true>(s, rs, lg, t0, bits);  // always on a tile past kv_hi (mainloop.cuh)
  } else if (HOOKS_FIRST && inside) {
    hooks_inside<C>(s, rs, lg, t0, p, hi);
    if (masked) hide_inside<C>(s, rs, lg, t0, bits);
  } else {
    if (!C::POSITIONS && masked) {
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
    if constexpr (HOOKED) hooks_by_pair<C>(s, rs, lg, t0, kp, p, hi, cls);
  }
  if constexpr (!V::SOFTMAX) {  // the weights are P: nothing to rescale or sum
    o_scale[0] = o_scale[1] = 1.f;
    return;
  }
  // the exponent's scale: S -> base-2 logit without a transform, natural log -> base 2 after the hooks; a tile
  // its predicate's list calls full, without a score hook, skipped the hooks (hooks_by_pair) and keeps a raw S,
  // whose scale folds into the exponent as without a variant (a multiply a logit less; sm_scale > 0, so its max is
  // the max logit's)
  const bool full_raw = fold_full_scale<C>() && cls == flashgen::variant::TILE_FULL;
  const float mul = HOOKED ? (full_raw ? lg.mul * LOG2E : LOG2E) : RAW ? lg.mul : 1.f;
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
    for (int r = 0; r < 4; ++r) pa[kk][r] = pack2<typename C::DTypeMMA>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
}

}  // namespace flashgen::sm90
