// Prefill over fp8 K/V (e4m3, e5m2): S = Q K^T and O += P V on fp8 tiles in shared memory, the fragments converted
// in registers after ldmatrix to fp16, the mma's type (common/fp8.cuh: one cvt a pair for e4m3, a byte move for
// e5m2), as decode does (decode/kernel.cuh).
//
// K: an fp8 row's 16-byte chunk is one k-step (16 head-dim columns). One ldmatrix.x4 brings the four n-tiles of a
// 32-key block in one k-step, where the 16-bit path's x4 brings two (K takes half the ldmatrix, and a warp holds
// Q's fragments of one k-step at a time, as there). Lane (g, t4) holds columns 4 t4 .. 4 t4 + 3 of its key, which feed the
// mma's slots 2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9; Q was staged with its columns in that order (load_q_fp8).
// V: one ldmatrix.x4.trans brings keys 0-7 and 8-15 (matrices 0, 1; 2, 3) of chunks c and c + 1 (32 columns); a
// chunk's even columns feed o[2c], its odd ones o[2c + 1], and the epilogue stores them back in order
// (write_rows). Each converted fragment feeds MMA_Q mma (the warp's m16 tiles): with 32 rows a warp, one
// conversion a pair per mma.
//
// Config: DTypeKV (fp8), DTypeMMA (fp16), HEAD_DIM, HEAD_DIM_VO, MMA_Q, TILE_KV, Q_IN_REGS (and what
// prefill/tiles.cuh reads).
#pragma once
#include <flashgen/common/fp8.cuh>
#include <flashgen/prefill/math.cuh>
#include <flashgen/prefill/tiles.cuh>

namespace flashgen::prefill {

// The variant's k_transform on a converted K fragment pair (fp16 codes w, key `row` of the tile that starts at key
// t0, columns d and d + 1): the dequantised value (the code times k_scale, which the host leaves out of sm_scale
// here) through the hook, held to fp16's finite range. A row past kv_hi asks for the last key; POSITIONS: keys at
// their true positions. Each warp converts the tile's fragments itself, so the hook runs once a warp an element.
template <class C, class Params>
__device__ __forceinline__ auto fp8_k_map(const Params& p, const KVSource<C>& src, const HookRowsOf<C>& rows, int t0,
                                          const int32_t* page_pos) {
  return [&p, &src, &rows, t0, page_pos](uint32_t w, int row, int d) {
    int key = min(t0 + row, src.kv_hi - 1);
    if constexpr (C::POSITIONS) key = key_position<C::PAGE_SIZE>(page_pos, key);
    float2 x = unpack2<__half>(w);
    x.x = flashgen::variant::k_value<typename C::Variant>(p, x.x * p.k_scale, rows.batch, key, rows.kv_head, d);
    x.y = flashgen::variant::k_value<typename C::Variant>(p, x.y * p.k_scale, rows.batch, key, rows.kv_head, d + 1);
    return pack2<__half>(fminf(fmaxf(x.x, -65504.f), 65504.f), fminf(fmaxf(x.y, -65504.f), 65504.f));
  };
}

// S = Q K^T for the warp's 16 * MMA_Q rows and the TILE_KV keys of an fp8 K tile; kx: the variant's k_transform on
// a fragment pair (fp8_k_map), with one
template <class C, int QR, class KX = int>
__device__ __forceinline__ void scores_fp8(float (&s)[C::MMA_Q][C::TILE_KV / 8][4],
                                           const uint32_t (&q_regs)[C::MMA_Q][QR][4],
                                           const typename C::DTypeMMA* q_smem, const typename C::DTypeKV* ks, int warp,
                                           int lane, const KX& kx = 0) {
  using L = Layout<C>;
  using T = typename C::DTypeMMA;
  using FP8 = typename C::DTypeKV;
  static_assert(L::FP8 && L::K_CHUNKS % 8 == 0 && L::TILE_KV % 32 == 0, "fp8 K: 128-byte rows, 32-key blocks");
  // as in scores(): a lane's ldmatrix rows are lane % 8 modulo 8, so the swizzle is a per-lane x and the
  // addresses a per-lane base plus compile-time offsets. K: matrix mat is keys 8 mat .. 8 mat + 7 of a 32-key
  // block (n-tile mat), chunk j (k-step j)
  const int mat = lane / 8, mrow = opaque(lane % 8);
  const SwizzledRow q_at(q_smem + (warp * L::WARP_ROWS + lane % 16) * L::Q_CHUNKS * 8, (lane / 16) ^ mrow);
  const SwizzledRow k_at(ks + (8 * mat + mrow) * L::K_CHUNKS * 16, mrow);
  clear_scores<C>(s);
#pragma unroll
  for (int j = 0; j < L::D / 16; ++j) {
    uint32_t qa[C::MMA_Q][4];
    q_fragments<C>(qa, q_regs, q_at, j);
#pragma unroll
    for (int nq = 0; nq < L::TILE_KV / 32; ++nq) {
      uint32_t kr[4];  // reg i: n-tile 4 nq + i of k-step j
      ldmatrix_x4(kr, k_at.at(j, 32 * nq * L::K_CHUNKS * 16));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t b0, b1;
        fp8_k_frag<T, FP8>(kr[i], b0, b1);
        if constexpr (C::Variant::K_TRANSFORM) {  // key 32 nq + 8 i + g, columns 16 j + 4 t4 + {0, 1} and {2, 3}
          b0 = kx(b0, 32 * nq + 8 * i + lane / 4, 16 * j + 4 * (lane % 4));
          b1 = kx(b1, 32 * nq + 8 * i + lane / 4, 16 * j + 4 * (lane % 4) + 2);
        }
#pragma unroll
        for (int mq = 0; mq < C::MMA_Q; ++mq) mma_16816<T>(s[mq][4 * nq + i], qa[mq], b0, b1);
      }
    }
  }
}

// O += P V over an fp8 V tile: P (fp16) from the S accumulators; o[mq][2c] takes chunk c's even columns,
// o[mq][2c + 1] its odd ones
template <class C>
__device__ __forceinline__ void accumulate_pv_fp8(float (&o)[C::MMA_Q][C::HEAD_DIM_VO / 8][4],
                                                  const float (&s)[C::MMA_Q][C::TILE_KV / 8][4],
                                                  const typename C::DTypeKV* vs, int lane) {
  using L = Layout<C>;
  using T = typename C::DTypeMMA;
  using FP8 = typename C::DTypeKV;
  static_assert(L::FP8 && L::V_CHUNKS % 2 == 0, "fp8 V rows of whole chunk pairs");
  // matrix mat % 2: keys 0-7 / 8-15, mat / 2: chunk c / c + 1 (c even)
  const int mat = lane / 8, mrow = opaque(lane % 8);
  const SwizzledRow v_at(vs + (8 * (mat % 2) + mrow) * L::V_CHUNKS * 16, (mat / 2) ^ mrow);
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
    for (int c = 0; c < L::DV / 16; c += 2) {
      uint32_t vr[4];
      ldmatrix_x4_trans(vr, v_at.at(c, 16 * kk * L::V_CHUNKS * 16));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t even[2], odd[2];
        fp8_v_frags<T, FP8>(vr[2 * h], vr[2 * h + 1], even, odd);
#pragma unroll
        for (int mq = 0; mq < C::MMA_Q; ++mq) {
          mma_16816<T>(o[mq][2 * (c + h)], pa[mq], even[0], even[1]);
          mma_16816<T>(o[mq][2 * (c + h) + 1], pa[mq], odd[0], odd[1]);
        }
      }
    }
  }
}

}  // namespace flashgen::prefill
