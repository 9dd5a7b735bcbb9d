// Decode epilogue: the warps' online-softmax states merged through shared memory and written, to the output or,
// for an item of a split request, to its fp32 partial; the last item of the request then merges the partials.
//
// Config: DTypeO, HEAD_DIM_VO, NUM_WARPS (and what decode/tiles.cuh reads).
#pragma once
#include <flashgen/common/logits.cuh>
#include <flashgen/common/mma.cuh>
#include <flashgen/common/split_merge.cuh>
#include <flashgen/common/variant.cuh>
#include <flashgen/decode/tiles.cuh>

namespace flashgen::decode {

// An item's place among its request's split-KV partials, read at the kernel's start (its loads overlap the
// start chain rather than sitting between the stream's end and the partial's write)
struct SplitInfo {
  int chunk;       // the item's chunk (-1: the request is not split)
  int first;       // the request's first partial row (merge_indptr)
  int num_chunks;  // the request's partials
};

// The merge of a split request's partials by its last item (common/split_merge.cuh: merge_if_last), rows of the
// item's head group.
template <class C, class Params>
__device__ __forceinline__ void merge_partials(const Params& p, uint8_t* smem, const SplitInfo& si, int token,
                                               int q_head0, int rows_valid, int request, int q_pos) {
  using DTypeO = typename C::DTypeO;
  using V = typename C::Variant;
  constexpr int DV = C::HEAD_DIM_VO;
  const int num_chunks = si.num_chunks;
  // One warp per row, each lane 4 columns of every 128. The partials come a batch of MERGE_BATCH chunks at a
  // time: the lane's 16 bytes of each chunk's row by cp.async into the warp's slice of the (now idle) pipeline
  // buffers, issued together with the batch's lse loads, so a batch costs one round trip to L2 (the weights need
  // the lse max, the copies do not) without holding the batch in registers. Each lane reads back only what it
  // copied, so a wait_group orders it; no barrier. Batches after the first rescale the running sums (online, as
  // in the kernel). An empty partial was written as zeros with lse -inf: weight 0 times 0.
  using L = Layout<C>;
  constexpr int CB = L::MERGE_COL_BLOCKS, KB = L::MERGE_BATCH;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t stride = p.num_qo_heads, first = si.first;
  float4* stage = reinterpret_cast<float4*>(smem + L::K_OFFSET) + warp * KB * CB * 32 + lane;  // [KB][CB][32 lanes]
  for (int r = warp; r < rows_valid; r += C::NUM_WARPS) {
    const int64_t head = q_head0 + r;
    const float* lse_col = p.tmp_lse + first * stride + head;
    const float* o_col = p.tmp_o + (first * stride + head) * DV + lane * 4;
    float4 acc[CB];
#pragma unroll
    for (int cb = 0; cb < CB; ++cb) acc[cb] = make_float4(0.f, 0.f, 0.f, 0.f);
    MergeState ms;
    for (int k0 = 0; k0 < num_chunks; k0 += KB) {
#pragma unroll
      for (int j = 0; j < KB; ++j)
#pragma unroll
        for (int cb = 0; cb < CB; ++cb) {
          const bool ok = k0 + j < num_chunks && cb * 128 + lane * 4 < DV;
          cp_async_16(stage + (j * CB + cb) * 32, ok ? o_col + (k0 + j) * stride * DV + cb * 128 : o_col, !ok);
        }
      cp_async_commit();
      const float lse_k = lane < KB && k0 + lane < num_chunks ? __ldcg(lse_col + (k0 + lane) * stride) : -INFINITY;
      float mb = lse_k;
#pragma unroll
      for (int x = 16; x > 0; x /= 2) mb = fmaxf(mb, __shfl_xor_sync(0xffffffff, mb, x));
      const float corr = ms.begin(mb);
      const float w_lane = ms.weight(lse_k);
      float wsum = w_lane;
#pragma unroll
      for (int x = 16; x > 0; x /= 2) wsum += __shfl_xor_sync(0xffffffff, wsum, x);
      ms.add(wsum);
#pragma unroll
      for (int cb = 0; cb < CB; ++cb) {
        acc[cb].x *= corr; acc[cb].y *= corr; acc[cb].z *= corr; acc[cb].w *= corr;
      }
      cp_async_wait<0>();
#pragma unroll
      for (int j = 0; j < KB; ++j) {
        const float w = __shfl_sync(0xffffffff, w_lane, j);
#pragma unroll
        for (int cb = 0; cb < CB; ++cb) {
          const float4 x = stage[(j * CB + cb) * 32];
          acc[cb].x += w * x.x; acc[cb].y += w * x.y; acc[cb].z += w * x.z; acc[cb].w += w * x.w;
        }
      }
    }
    float inv = ms.inv_sum();
    float var_lse = 0.f;  // a variant's row lse: softmax=False has none (its partials are sums, lse 0, weight 1
    if constexpr (V::ANY) {  // each: added), a sink moves it and scales the merged row
      if constexpr (V::SOFTMAX) var_lse = ms.lse();
      else inv = 1.f;
      inv *= flashgen::variant::sink_factor<V>(p, var_lse, request, q_pos, int(head));
    }
#pragma unroll
    for (int cb = 0; cb < CB; ++cb) {
      const int col = cb * 128 + lane * 4;
      if (col < DV) {
        auto x = [&](float v, int i) { return flashgen::variant::output_value<V>(p, v * inv, request, q_pos, int(head), col + i); };
        const uint2 packed = make_uint2(pack2<DTypeO>(x(acc[cb].x, 0), x(acc[cb].y, 1)), pack2<DTypeO>(x(acc[cb].z, 2), x(acc[cb].w, 3)));
        *reinterpret_cast<uint2*>(p.o + (int64_t(token) * stride + head) * DV + col) = packed;
      }
    }
    if (lane == 0 && p.lse != nullptr) p.lse[int64_t(token) * stride + head] = V::ANY ? var_lse : ms.lse();
  }
}

// the warps' (m, l, O) merged through shared memory (the pipeline's, free now) and written: to out and lse,
// or for an item of a split request to its partial row, the last item of the request merging them all
template <class C, class Params>
__device__ __forceinline__ void write_states(const Params& p, uint8_t* smem, const SplitInfo& si, int token,
                                             int q_head0, int rows_valid, float (&o)[C::HEAD_DIM_VO / 8][4],
                                             float (&m)[2], float (&l)[2], int request, int q_pos) {
  using L = Layout<C>;
  using DTypeO = typename C::DTypeO;
  using V = typename C::Variant;
  constexpr int DV = C::HEAD_DIM_VO;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  float* o_part = reinterpret_cast<float*>(smem + L::K_OFFSET);      // [NUM_WARPS][16][DV]
  float* ml_part = o_part + C::NUM_WARPS * 16 * DV;                  // [NUM_WARPS][16][2]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 2);
    const int r = g + 8 * h;
    if (t4 == 0) {
      ml_part[(warp * 16 + r) * 2] = m[h];
      ml_part[(warp * 16 + r) * 2 + 1] = l[h];
    }
    if constexpr (L::FP8) {  // o[2c] holds chunk c's even columns, o[2c + 1] its odd ones: 4 t4 .. 4 t4 + 3
#pragma unroll
      for (int c = 0; c < DV / 16; ++c) {
        *reinterpret_cast<float4*>(o_part + (warp * 16 + r) * DV + 16 * c + 4 * t4) =
            make_float4(o[2 * c][2 * h], o[2 * c + 1][2 * h], o[2 * c][2 * h + 1], o[2 * c + 1][2 * h + 1]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < DV / 8; ++j) {
        *reinterpret_cast<float2*>(o_part + (warp * 16 + r) * DV + 8 * j + 2 * t4) = make_float2(o[j][2 * h], o[j][2 * h + 1]);
      }
    }
  }
  __syncthreads();

  const bool split = si.chunk >= 0;
  const int64_t out_row = split ? int64_t(si.first + si.chunk) : int64_t(token);
  constexpr int COLS = 8;  // output columns per thread job
  for (int job = tid; job < 16 * DV / COLS; job += L::THREADS) {
    const int r = job / (DV / COLS), col = (job % (DV / COLS)) * COLS;
    if (r >= rows_valid) continue;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < C::NUM_WARPS; ++w) m_all = fmaxf(m_all, ml_part[(w * 16 + r) * 2]);
    float acc[COLS] = {}, l_all = 0.f;
    if (m_all != -INFINITY) {
#pragma unroll
      for (int w = 0; w < C::NUM_WARPS; ++w) {
        const float wgt = exp2f(ml_part[(w * 16 + r) * 2] - m_all);
        l_all += wgt * ml_part[(w * 16 + r) * 2 + 1];
#pragma unroll
        for (int i = 0; i < COLS; ++i) acc[i] += wgt * o_part[(w * 16 + r) * DV + col + i];
      }
    }
    float inv = l_all > 0.f ? p.v_scale / l_all : 0.f;  // fp8 V: its per-tensor scale
    float var_lse = 0.f;  // a variant's row lse (softmax=False: the weights' sum, no normaliser, lse 0)
    if constexpr (V::ANY) {
      if constexpr (V::SOFTMAX) var_lse = l_all > 0.f ? (m_all + log2f(l_all)) * LN2 : -INFINITY;
      else inv = p.v_scale;
      if (!split) inv *= flashgen::variant::sink_factor<V>(p, var_lse, request, q_pos, q_head0 + r);
    }
#pragma unroll
    for (int i = 0; i < COLS; ++i) acc[i] *= inv;
    const float lse = V::ANY ? var_lse : l_all > 0.f ? (m_all + log2f(l_all)) * LN2 : -INFINITY;
    const int64_t head = q_head0 + r;
    if constexpr (V::OUTPUT) {
      if (!split) {
#pragma unroll
        for (int i = 0; i < COLS; ++i) acc[i] = flashgen::variant::output_value<V>(p, acc[i], request, q_pos, int(head), col + i);
      }
    }
    if (split) {
      float* dst = p.tmp_o + (out_row * p.num_qo_heads + head) * DV + col;
#pragma unroll
      for (int i = 0; i < COLS; i += 4) *reinterpret_cast<float4*>(dst + i) = make_float4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]);
      if (col == 0) p.tmp_lse[out_row * p.num_qo_heads + head] = lse;
    } else {
      store_row<DTypeO, COLS>(p.o + (out_row * p.num_qo_heads + head) * DV + col, acc);
      if (col == 0 && p.lse != nullptr) p.lse[out_row * p.num_qo_heads + head] = lse;
    }
  }
  if (split) {  // counter of the (token, head group): the last item merges
    int* counter = p.counters + int64_t(token) * p.num_qo_heads + q_head0;
    merge_if_last(counter, si.num_chunks, [&] { merge_partials<C>(p, smem, si, token, q_head0, rows_valid, request, q_pos); });
  }
}

}  // namespace flashgen::decode
