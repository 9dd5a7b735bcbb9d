// Prefill epilogue: normalise each warp's rows and write them (output, or an fp32 partial of a split
// request), and the split-KV merge by the last CTA of a tile. fp8 V: O's columns are put back in order (o[2c]
// holds chunk c's even columns, o[2c + 1] its odd ones: prefill/fp8.cuh) and scaled by v_scale.
#pragma once
#include <cmath>
#include <cstdint>
#include <flashgen/common/logits.cuh>
#include <flashgen/common/mma.cuh>
#include <flashgen/common/split_merge.cuh>
#include <flashgen/common/variant.cuh>
#include <flashgen/prefill/math.cuh>
#include <flashgen/prefill/tiles.cuh>

namespace flashgen::prefill {

// Where a tile's rows go: packed row prow of the request -> (token0 + prow / group, kv_head * group + prow % group).
struct TileRows {
  int token0, row0, rows_total, kv_head, group;
  __device__ __forceinline__ int64_t token(int prow) const { return token0 + prow / group; }
  __device__ __forceinline__ int64_t head(int prow) const { return kv_head * group + prow % group; }
};

template <class C, class Params>
__device__ __forceinline__ void write_rows(const Params& p, const TileRows& tr, float (&o)[C::MMA_Q][C::HEAD_DIM_VO / 8][4],
                                           const float (&m)[C::MMA_Q][2], float (&l)[C::MMA_Q][2], int chunk, int warp,
                                           int lane, const RowInfo<C>& ri, const HookRowsOf<C>& hr) {
  using L = Layout<C>;
  using V = typename C::Variant;
  constexpr int DV = C::HEAD_DIM_VO;
  const int g = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int mq = 0; mq < C::MMA_Q; ++mq) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[mq][h] += __shfl_xor_sync(0xffffffff, l[mq][h], 1);
      l[mq][h] += __shfl_xor_sync(0xffffffff, l[mq][h], 2);
      const int prow = tr.row0 + warp * L::WARP_ROWS + mq * 16 + g + 8 * h;
      if (prow >= tr.rows_total) continue;
      const float lv = l[mq][h];
      float inv = lv > 0.f ? 1.f / lv : 0.f;
      if constexpr (!V::SOFTMAX) inv = 1.f;  // the weights' sum, no normaliser
      if constexpr (L::FP8) inv *= p.v_scale;  // fp8 V: its per-tensor scale
      float lse = !V::SOFTMAX ? 0.f : lv > 0.f ? (m[mq][h] + log2f(lv)) * LN2 : -INFINITY;
      const int64_t token = tr.token(prow), head = tr.head(prow);
      // a finished row (not a split partial): the variant's sink, and its output hook below
      const int batch = V::ANY ? hr.batch : 0, q_idx = V::ANY ? ri.q_pos[prow - tr.row0] : 0;
      if constexpr (V::SINK) {
        if (chunk < 0) inv *= flashgen::variant::sink_factor<V>(p, lse, batch, q_idx, int(head));
      }
      auto out = [&](float x, int col) {
        return flashgen::variant::output_value<V>(p, x * inv, batch, q_idx, int(head), col);
      };
      if (chunk >= 0) {
        const int64_t row = (p.merge_indptr[token] + chunk) * int64_t(p.num_qo_heads) + head;
        if constexpr (L::FP8) {  // columns 16 c + 4 t4 .. + 3
          float* dst = p.tmp_o + row * DV + 4 * t4;
#pragma unroll
          for (int c = 0; c < DV / 16; ++c)
            *reinterpret_cast<float4*>(dst + 16 * c) = make_float4(o[mq][2 * c][2 * h] * inv, o[mq][2 * c + 1][2 * h] * inv,
                                                                   o[mq][2 * c][2 * h + 1] * inv, o[mq][2 * c + 1][2 * h + 1] * inv);
        } else {
          float* dst = p.tmp_o + row * DV + 2 * t4;
#pragma unroll
          for (int j = 0; j < DV / 8; ++j)
            *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[mq][j][2 * h] * inv, o[mq][j][2 * h + 1] * inv);
        }
        if (t4 == 0) p.tmp_lse[row] = lse;
      } else {
        const int64_t row = token * p.num_qo_heads + head;
        using DTypeO = typename C::DTypeO;
        if constexpr (L::FP8) {
          DTypeO* dst = p.o + row * DV + 4 * t4;
#pragma unroll
          for (int c = 0; c < DV / 16; ++c) {
            const int col = 16 * c + 4 * t4;
            *reinterpret_cast<uint2*>(dst + 16 * c) =
                make_uint2(pack2<DTypeO>(out(o[mq][2 * c][2 * h], col), out(o[mq][2 * c + 1][2 * h], col + 1)),
                           pack2<DTypeO>(out(o[mq][2 * c][2 * h + 1], col + 2), out(o[mq][2 * c + 1][2 * h + 1], col + 3)));
          }
        } else {
          DTypeO* dst = p.o + row * DV + 2 * t4;
#pragma unroll
          for (int j = 0; j < DV / 8; ++j)
            *reinterpret_cast<uint32_t*>(dst + 8 * j) =
                pack2<DTypeO>(out(o[mq][j][2 * h], 8 * j + 2 * t4), out(o[mq][j][2 * h + 1], 8 * j + 2 * t4 + 1));
        }
        if (t4 == 0 && p.lse != nullptr) p.lse[row] = lse;
      }
    }
  }
}

// one (row, 8 columns) of the merge: the partials of chunks 0 .. num_chunks - 1 weighted by exp(lse - max), in
// batches of MERGE_BATCH chunks whose loads are all issued before any is used (an online max across batches).
// The merge runs at the end of a split tile's last chunk, often at the grid's end: a loop of dependent L2 round
// trips (the max, then each chunk's lse and O in turn) cost ~2 num_chunks round trips a job and 16 jobs a thread.
// A chunk whose weight is 0 (no visible key) adds nothing, whatever its partial holds.
constexpr int MERGE_BATCH = 8;

template <class C, class Params>
__device__ __forceinline__ void merge_row(const Params& p, int64_t token, int64_t head, int col, int num_chunks,
                                          int batch, int q_idx) {
  using V = typename C::Variant;
  constexpr int DV = C::HEAD_DIM_VO, B = MERGE_BATCH;
  const int64_t first = (p.merge_indptr[token] * p.num_qo_heads + head), stride = p.num_qo_heads;
  const float* lse_at = p.tmp_lse + first;
  const float* o_at = p.tmp_o + first * DV + col;
  MergeState ms;
  float acc[8] = {};
  for (int k0 = 0; k0 < num_chunks; k0 += B) {
    float x[B];
    float4 a[B], b[B];
#pragma unroll
    for (int i = 0; i < B; ++i) {
      const bool valid = k0 + i < num_chunks;
      const int64_t row = int64_t(k0 + i) * stride;
      x[i] = valid ? __ldcg(lse_at + row) : -INFINITY;
      a[i] = valid ? __ldcg(reinterpret_cast<const float4*>(o_at + row * DV)) : make_float4(0.f, 0.f, 0.f, 0.f);
      b[i] = valid ? __ldcg(reinterpret_cast<const float4*>(o_at + row * DV + 4)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float mb = x[0];
#pragma unroll
    for (int i = 1; i < B; ++i) mb = fmaxf(mb, x[i]);
    // nothing visible yet: skip the batch. Written with begin's own max, so the compiler folds begin's -inf
    // select away (and ptxas keeps the main loop's schedule of 1f535fd in every variant)
    if (fmaxf(ms.m, mb) == -INFINITY) continue;
    const float r = ms.begin(mb);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] *= r;
#pragma unroll
    for (int i = 0; i < B; ++i) {
      const float w = ms.weight(x[i]);
      if (w > 0.f) {
        ms.add(w);
        acc[0] += w * a[i].x; acc[1] += w * a[i].y; acc[2] += w * a[i].z; acc[3] += w * a[i].w;
        acc[4] += w * b[i].x; acc[5] += w * b[i].y; acc[6] += w * b[i].z; acc[7] += w * b[i].w;
      }
    }
  }
  float inv = ms.inv_sum();
  float var_lse = 0.f;  // a variant's row lse: softmax=False has none (its partials are sums, lse 0, weight 1
  if constexpr (V::ANY) {  // each: added), a sink moves it and scales the merged row
    if constexpr (V::SOFTMAX) var_lse = ms.lse();
    else inv = 1.f;
    inv *= flashgen::variant::sink_factor<V>(p, var_lse, batch, q_idx, int(head));
  }
  uint4 packed;
  uint32_t* w = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = pack2<typename C::DTypeO>(flashgen::variant::output_value<V>(p, acc[2 * i] * inv, batch, q_idx, int(head), col + 2 * i),
                                     flashgen::variant::output_value<V>(p, acc[2 * i + 1] * inv, batch, q_idx, int(head), col + 2 * i + 1));
  const int64_t out = token * p.num_qo_heads + head;
  *reinterpret_cast<uint4*>(p.o + out * DV + col) = packed;
  if (col == 0 && p.lse != nullptr) p.lse[out] = V::ANY ? var_lse : ms.lse();
}

// A split tile's finish (common/split_merge.cuh: merge_if_last): every chunk of a (request, qo tile, kv head)
// writes its partial and counts itself in; the last merges the tile's rows. The counter of a tile sits at its
// first packed row's (token, q head), unique over the batch.
template <class C, class Params>
__device__ __forceinline__ void merge_tile(const Params& p, const TileRows& tr, const RowInfo<C>& ri,
                                           const HookRowsOf<C>& hr) {
  using L = Layout<C>;
  using V = typename C::Variant;
  const int64_t first = tr.token(tr.row0);
  int* counter = p.counters + first * p.num_qo_heads + tr.head(tr.row0);
  // the tile's chunks: its tokens' merge range (a request's uniform split, or this tile's own when the plan
  // split the last wave's tiles; a tile holds whole tokens then)
  const int num_chunks = p.merge_indptr[first + 1] - p.merge_indptr[first];
  merge_if_last(counter, num_chunks, [&] {
    constexpr int COLS = C::HEAD_DIM_VO / 8;
    for (int job = threadIdx.x; job < L::TILE_Q * COLS; job += L::THREADS) {
      const int prow = tr.row0 + job / COLS;
      if (prow < tr.rows_total)
        merge_row<C>(p, tr.token(prow), tr.head(prow), (job % COLS) * 8, num_chunks, V::ANY ? hr.batch : 0,
                     V::ANY ? ri.q_pos[prow - tr.row0] : 0);
    }
  });
}

}  // namespace flashgen::prefill
