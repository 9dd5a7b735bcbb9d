// Merge of attention states: partial outputs v with their natural-log log-sum-exp s.
//   s = log(sum_k exp(s_k)),  v = sum_k v_k * exp(s_k - s)
// An s_k of -inf is an empty partial (weight 0); if every s_k is -inf the result is v = 0, s = -inf (the
// combine of common/split_merge.cuh, MergeState, which the kernels' in-launch split merges use too).
//
// Work split: a row is one (token, head) pair; a group of `threads_per_row` lanes (a power of two <= 32,
// chosen on the host) handles a row with 16-byte vectors, looping when head_dim needs more vectors.
// Loops are warp-uniform so that __syncwarp() can order every read of s before any write of s: that
// makes the in-place merge (s_out == s_a) race-free.
#pragma once
#include <cmath>
#include <cstdint>
#include <flashgen/common/split_merge.cuh>
#include <flashgen/common/vec.cuh>

namespace flashgen {

constexpr int STATES_IN_FLIGHT = 4;

struct RowGroup {
  int lane_in_row, row_in_warp, rows_per_warp, threads_per_row;
  int64_t first_row, row_stride;  // first_row - row_in_warp is the same for the whole warp

  __device__ __forceinline__ explicit RowGroup(int threads_per_row_) : threads_per_row(threads_per_row_) {
    const int lane = threadIdx.x % 32;
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int64_t num_warps = int64_t(gridDim.x) * blockDim.x / 32;
    rows_per_warp = 32 / threads_per_row;
    lane_in_row = lane % threads_per_row;
    row_in_warp = lane / threads_per_row;
    first_row = warp * rows_per_warp + row_in_warp;
    row_stride = num_warps * rows_per_warp;
  }
};

// merge_state: v_out = merge(v_a, v_b); in place when v_out == v_a and s_out == s_a, with an optional
// per-token mask (rows of tokens whose mask byte is 0 are left untouched).
template <typename DTypeV, typename Params>
__device__ __forceinline__ void merge_state(const Params& p) {
  using V = Vec16<DTypeV>;
  const RowGroup g(p.threads_per_row);
  // warp-uniform trip count: the loop runs while the warp's first row is in range
  for (int64_t row = g.first_row; row - g.row_in_warp < p.num_rows; row += g.row_stride) {
    bool active = row < p.num_rows;
    if (active && p.mask != nullptr) active = p.mask[row / p.num_heads] != 0;
    const float s_a = active ? p.s_a[row] : -INFINITY;
    const float s_b = active ? p.s_b[row] : -INFINITY;
    __syncwarp();
    if (!active) continue;
    MergeState ms(fmaxf(s_a, s_b));
    float w_a = ms.weight(s_a), w_b = ms.weight(s_b);
    ms.add(w_a + w_b);
    const float inv = ms.inv_sum(), s = ms.lse();
    w_a *= inv;
    w_b *= inv;
    const int64_t base = row * p.head_dim;
    for (int col = g.lane_in_row * V::N; col < p.head_dim; col += g.threads_per_row * V::N) {
      V a, b;
      // an empty partial (weight 0) may hold garbage, even NaN: never read it
      if (w_a != 0.f) a.load(p.v_a + base + col); else a.fill(0.f);
      if (w_b != 0.f) b.load(p.v_b + base + col); else b.fill(0.f);
#pragma unroll
      for (int i = 0; i < V::N; ++i) a.v[i] = a.v[i] * w_a + b.v[i] * w_b;
      a.store(p.v_out + base + col);
    }
    if (g.lane_in_row == 0) p.s_out[row] = s;
  }
}

// merge_states: v [num_tokens, num_states, num_heads, head_dim], s [num_tokens, num_states, num_heads]
// merged along the states dimension into v_out [num_tokens, num_heads, head_dim], s_out [num_tokens, num_heads].
template <typename DTypeV, typename Params>
__device__ __forceinline__ void merge_states(const Params& p) {
  using V = Vec16<DTypeV>;
  const RowGroup g(p.threads_per_row);
  const int64_t num_rows = p.num_tokens * p.num_heads;
  for (int64_t row = g.first_row; row < num_rows; row += g.row_stride) {
    const int64_t token = row / p.num_heads, head = row - token * p.num_heads;
    const int64_t s_base = token * p.num_states * p.num_heads + head;
    float m = -INFINITY;
    for (int k = 0; k < p.num_states; ++k) m = fmaxf(m, p.s[s_base + k * p.num_heads]);
    MergeState ms(m);
    if (m != -INFINITY) {
      for (int k = 0; k < p.num_states; ++k) ms.add(ms.weight(p.s[s_base + k * p.num_heads]));
    }
    const float inv_sum = ms.inv_sum();
    for (int col = g.lane_in_row * V::N; col < p.head_dim; col += g.threads_per_row * V::N) {
      V acc;
      acc.fill(0.f);
      // states in batches of STATES_IN_FLIGHT: issue every load of a batch before using any of them
      for (int k0 = 0; k0 < p.num_states; k0 += STATES_IN_FLIGHT) {
        uint4 raw[STATES_IN_FLIGHT];  // raw 16-byte loads: converted only when used, to save registers
        float w[STATES_IN_FLIGHT];
#pragma unroll
        for (int j = 0; j < STATES_IN_FLIGHT; ++j) {
          const int k = k0 + j;
          w[j] = k < p.num_states && m != -INFINITY ? ms.weight(p.s[s_base + k * p.num_heads]) * inv_sum : 0.f;
          // an empty partial (weight 0) may hold garbage, even NaN: never read it
          raw[j] = w[j] != 0.f ? *reinterpret_cast<const uint4*>(p.v + (s_base + k * p.num_heads) * p.head_dim + col)
                               : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < STATES_IN_FLIGHT; ++j) {
          V x;
          x.convert(raw[j]);
#pragma unroll
          for (int i = 0; i < V::N; ++i) acc.v[i] += w[j] * x.v[i];
        }
      }
      acc.store(p.v_out + row * p.head_dim + col);
    }
    if (g.lane_in_row == 0) p.s_out[row] = ms.lse();
  }
}

// merge_states_in_place: (v, s) [num_rows = num_tokens * num_heads rows] merged in place with num_states more
// states v_parts [num_states, num_rows, head_dim], s_parts [num_states, num_rows] (state-major: a cascade's
// chunks of one split level, each chunk's rows those of every token). One launch merges num_states + 1 states
// a row. Warp-uniform trip count and a __syncwarp() between every read of s and the write of s, as in
// merge_state; each lane reads and writes only its own columns of v.
template <typename DTypeV, typename Params>
__device__ __forceinline__ void merge_states_in_place(const Params& p) {
  using V = Vec16<DTypeV>;
  const RowGroup g(p.threads_per_row);
  for (int64_t row = g.first_row; row - g.row_in_warp < p.num_rows; row += g.row_stride) {
    const bool active = row < p.num_rows;
    const float s_own = active ? p.s[row] : -INFINITY;
    __syncwarp();
    if (!active) continue;
    float m = s_own;
    for (int k = 0; k < p.num_states; ++k) m = fmaxf(m, p.s_parts[k * p.num_rows + row]);
    MergeState ms(m);
    if (m != -INFINITY) {
      ms.add(ms.weight(s_own));
      for (int k = 0; k < p.num_states; ++k) ms.add(ms.weight(p.s_parts[k * p.num_rows + row]));
    }
    const float inv_sum = ms.inv_sum();
    const float w_own = m != -INFINITY ? ms.weight(s_own) * inv_sum : 0.f;
    const int64_t base = row * p.head_dim;
    for (int col = g.lane_in_row * V::N; col < p.head_dim; col += g.threads_per_row * V::N) {
      V acc;
      // an empty state (weight 0) may hold garbage, even NaN: never read it
      if (w_own != 0.f) acc.load(p.v + base + col); else acc.fill(0.f);
#pragma unroll
      for (int i = 0; i < V::N; ++i) acc.v[i] *= w_own;
      for (int k0 = 0; k0 < p.num_states; k0 += STATES_IN_FLIGHT) {
        uint4 raw[STATES_IN_FLIGHT];  // every load of a batch issued before any is used
        float w[STATES_IN_FLIGHT];
#pragma unroll
        for (int j = 0; j < STATES_IN_FLIGHT; ++j) {
          const int k = k0 + j;
          w[j] = k < p.num_states && m != -INFINITY ? ms.weight(p.s_parts[k * p.num_rows + row]) * inv_sum : 0.f;
          raw[j] = w[j] != 0.f ? *reinterpret_cast<const uint4*>(p.v_parts + (k * p.num_rows + row) * p.head_dim + col)
                               : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < STATES_IN_FLIGHT; ++j) {
          V x;
          x.convert(raw[j]);
#pragma unroll
          for (int i = 0; i < V::N; ++i) acc.v[i] += w[j] * x.v[i];
        }
      }
      acc.store(p.v + base + col);
    }
    if (g.lane_in_row == 0) p.s[row] = ms.lse();
  }
}

}  // namespace flashgen
