// The Hopper prefill's epilogue: a consumer warp's rows normalised and written, by TMA stores from a staging area
// in shared memory or straight from registers, with their lse.
#pragma once
#include <cmath>
#include <cstdint>
#include <flashgen/common/fastdiv.cuh>
#include <flashgen/common/logits.cuh>
#include <flashgen/common/mma.cuh>
#include <flashgen/common/variant.cuh>
#include <flashgen/sm90/layout.cuh>
#include <flashgen/sm90/positions.cuh>
#include <flashgen/sm90/tile_scheduler.cuh>
#include <flashgen/sm90/tma.cuh>

namespace flashgen::sm90 {

// O / l and lse (natural log; -inf for a row that sees no key) of the thread's two rows, h = 0, 1: rows
// lane / 4 + 8 h of the warp's 16. A row that sees no key (l = 0) is stored as O * 0, no select: its O is zero on
// every path (its P is 0 against finite V rows, zero_v_tail; an item without tiles passes zeros). The warp's
// 16 rows go by TMA stores where they are whole tokens inside the request (C::O_STAGED and p.o_tma: the group
// divides 16), else straight from registers (rows past the request are not written).
template <class C, class Params>
__device__ __forceinline__ void write_rows(const Params& p, const Work& w, const float (&o)[C::HEAD_DIM / 2],
                                           const float (&m)[2], const float (&l_part)[2], uint32_t smem_base, int wg,
                                           int request = 0) {
  using L = Layout<C>;
  using V = typename C::Variant;
  const int lane = threadIdx.x % 32, warp = threadIdx.x % 128 / 32, q4 = lane % 4;
  const int prow_w = w.row0 + wg * 64 + warp * 16, prow0 = prow_w + lane / 4;
  float l[2], inv[2], lse_h[2];
  int q_idx[2] = {0, 0}, qo_head[2] = {0, 0};  // a variant's rows: the query position and q head
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] = l_part[h];
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffff, l[h], 2);
    inv[h] = l[h] > 0.f ? rcp_fast(l[h]) : 0.f;  // rcp.approx: a row's O / l to within an ulp, no slow path
    if constexpr (V::ANY) {  // the sink and the output hook of a finished row (softmax=False: the weights' sum)
      lse_h[h] = l[h] > 0.f ? (m[h] + log2f(l[h])) * LN2 : -INFINITY;
      const FastDiv group = group_of(p);
      int token, head;
      group.divmod(min(prow0 + 8 * h, w.rows_total - 1), token, head);
      q_idx[h] = query_position<C>(p, w, token, C::POSITIONS ? group.div(w.rows_total) : 0);
      qo_head[h] = w.kv_head * group.d + head;
      if constexpr (!V::SOFTMAX) inv[h] = 1.f, lse_h[h] = 0.f;
      inv[h] *= flashgen::variant::sink_factor<V>(p, lse_h[h], request, q_idx[h], qo_head[h]);
    }
    if constexpr (L::FP8) inv[h] *= p.v_scale;  // fp8 V: its per-tensor scale
  }
  // register i of a row holds column 8 (i / 4) + 2 q4 + i % 2 (wgmma.cuh)
  auto value = [&](int i, int h) {
    return flashgen::variant::output_value<V>(p, o[i] * inv[h], request, q_idx[h], qo_head[h], 8 * (i / 4) + 2 * q4 + i % 2);
  };
  auto lse = [&](int h) {
    if constexpr (V::ANY) return lse_h[h];
    else return l[h] > 0.f ? (m[h] + log2f(l[h])) * LN2 : -INFINITY;
  };
  auto o_row = [&](int prow) {  // packed row -> row of o and lse: (token, q head)
    const FastDiv group = group_of(p);
    int token, head;
    group.divmod(prow, token, head);
    return int64_t(w.token0 + token) * p.num_qo_heads + w.kv_head * group.d + head;
  };
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

}  // namespace flashgen::sm90
