// Decode data layout and movement: the CTA's shared memory (Q tile, STAGES-deep K/V rings, the row-offset ring,
// fp8's widened tile), swizzled tile indexing, the cp.async tile copy, fp8 widening and the Q tile load (RoPE on
// the way).
//
// Config: DTypeQ, DTypeKV, HEAD_DIM, HEAD_DIM_VO, NUM_WARPS, STAGES, SMEM_BYTES, ROPE.
#pragma once
#include <type_traits>
#include <flashgen/common/fp8.cuh>
#include <flashgen/common/logits.cuh>
#include <flashgen/common/mma.cuh>

namespace flashgen::decode {

template <class C>
struct Layout {
  using DTypeQ = typename C::DTypeQ;
  using DTypeKV = typename C::DTypeKV;
  // fp8 K/V: tiles arrive as fp8 (half the bytes) and are widened in shared memory to q's dtype
  static constexpr bool FP8 = sizeof(DTypeKV) == 1;
  static constexpr int TILE = C::NUM_WARPS * 16;
  static constexpr int THREADS = C::NUM_WARPS * 32;
  static constexpr int K_CHUNKS = C::HEAD_DIM * int(sizeof(DTypeKV)) / 16;  // 16-byte chunks per row
  static constexpr int V_CHUNKS = C::HEAD_DIM_VO * int(sizeof(DTypeKV)) / 16;
  static constexpr int KC_CHUNKS = C::HEAD_DIM * 2 / 16;  // chunks of a row in the mma (16-bit) layout
  static constexpr int VC_CHUNKS = C::HEAD_DIM_VO * 2 / 16;
  static constexpr int Q_CHUNKS = C::HEAD_DIM * int(sizeof(DTypeQ)) / 16;
  static constexpr int Q_BYTES = 16 * C::HEAD_DIM * int(sizeof(DTypeQ));
  static constexpr int K_STAGE = TILE * C::HEAD_DIM * int(sizeof(DTypeKV));
  static constexpr int V_STAGE = TILE * C::HEAD_DIM_VO * int(sizeof(DTypeKV));
  static constexpr int OFFSETS_BYTES = 2 * TILE * 8;
  static constexpr int K_OFFSET = Q_BYTES;
  static constexpr int V_OFFSET = K_OFFSET + C::STAGES * K_STAGE;
  static constexpr int ROW_OFFSETS = V_OFFSET + C::STAGES * V_STAGE;
  static constexpr int CONV_OFFSET = ROW_OFFSETS + OFFSETS_BYTES;
  static constexpr int CONV_BYTES = FP8 ? TILE * (C::HEAD_DIM + C::HEAD_DIM_VO) * 2 : 0;
  static constexpr int TOTAL = CONV_OFFSET + CONV_BYTES;
  // epilogue, over everything after Q (stages, offsets, widened tile): per warp o [16][HEAD_DIM_VO] fp32
  // and (m, l) [16][2]
  static constexpr int EPILOGUE = C::NUM_WARPS * 16 * (C::HEAD_DIM_VO + 2) * 4;
  // the split merge's staging (merge_partials), over the same buffers: per warp MERGE_BATCH chunks x
  // MERGE_COL_BLOCKS x 32 lanes x 16 bytes; 32 chunks a batch (one L2 round trip for up to 32 partials) where
  // it fits, fewer where the pipeline is small
  static constexpr int MERGE_COL_BLOCKS = (C::HEAD_DIM_VO + 127) / 128;
  static constexpr int MERGE_BATCH_FIT = (TOTAL - K_OFFSET) / (C::NUM_WARPS * MERGE_COL_BLOCKS * 32 * 16);
  static constexpr int MERGE_BATCH = MERGE_BATCH_FIT < 32 ? MERGE_BATCH_FIT : 32;
  static_assert(MERGE_BATCH >= 8, "the merge's staging needs room for 8 chunks a warp");
  static_assert(TOTAL == C::SMEM_BYTES, "codegen and the kernel disagree on the shared-memory size");
  static_assert(EPILOGUE <= TOTAL - K_OFFSET, "epilogue does not fit over the pipeline buffers");
  static_assert(K_CHUNKS >= 8 && V_CHUNKS >= 8 && Q_CHUNKS >= 8, "rows of at least 128 bytes (swizzle)");
  static_assert(FP8 || std::is_same_v<DTypeKV, DTypeQ>, "16-bit K/V must have q's dtype");
  static_assert(C::HEAD_DIM % 32 == 0 && C::HEAD_DIM_VO % 16 == 0, "head dims in mma tiles");
};

// element index of (row, 16-byte chunk) in a swizzled tile of T whose rows have `chunks` chunks
template <typename T>
__device__ __forceinline__ int copy_index(int row, int chunk, int chunks) {
  return (row * chunks + swizzle(row, chunk)) * (16 / int(sizeof(T)));
}
// the same for the 16-bit tiles the mma reads (8 elements a chunk)
__device__ __forceinline__ int tile_index(int row, int chunk, int chunks) { return copy_index<uint16_t>(row, chunk, chunks); }

// One K or V tile by cp.async: the thread's 16-byte chunk `col` of rows row0 + j * RPP (j < TILE / RPP), row r
// from src + offsets[r] (a negative offset: a row past the request, zero-filled). With RPP a multiple of 8 the
// swizzle repeats every pass, so the destination is the first pass's plus j * RPP rows of WIDTH elements.
template <typename T, int TILE, int RPP, int CHUNKS, int WIDTH>
__device__ __forceinline__ void copy_tile_rows(T* smem, const T* src, const int64_t* offsets, int row0, int col) {
#pragma unroll
  for (int j = 0; j < TILE / RPP; ++j) {
    const int r = row0 + j * RPP;
    const int64_t off = offsets[r];
    const int dst = RPP % 8 == 0 ? copy_index<T>(row0, col, CHUNKS) + j * RPP * WIDTH : copy_index<T>(r, col, CHUNKS);
    cp_async_16(smem + dst, src + (off < 0 ? 0 : off), off < 0);
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_row(T* dst, const float (&x)[N]) {
  uint4 packed;
  uint32_t* w = reinterpret_cast<uint32_t*>(&packed);
  static_assert(N == 8, "one 16-byte store");
#pragma unroll
  for (int i = 0; i < N / 2; ++i) w[i] = pack2<T>(x[2 * i], x[2 * i + 1]);
  *reinterpret_cast<uint4*>(dst) = packed;
}

// fp8 tile [TILE][CHUNKS x 16 bytes] (swizzled copy layout) -> 16-bit tile of T (swizzled mma layout)
template <int TILE, int CHUNKS, int THREADS, typename FP8, typename T>
__device__ __forceinline__ void widen_tile(const FP8* src, T* dst) {
  for (int job = threadIdx.x; job < TILE * CHUNKS; job += THREADS) {
    const int r = job / CHUNKS, c = job % CHUNKS;
    uint4 lo, hi;
    fp8x16_widen<T, FP8>(*reinterpret_cast<const uint4*>(src + copy_index<FP8>(r, c, CHUNKS)), lo, hi);
    *reinterpret_cast<uint4*>(dst + tile_index(r, 2 * c, 2 * CHUNKS)) = lo;
    *reinterpret_cast<uint4*>(dst + tile_index(r, 2 * c + 1, 2 * CHUNKS)) = hi;
  }
}

// Q: 16 rows (padded with zeros) into shared memory, RoPE applied on the way
template <class C, class Params>
__device__ __forceinline__ void stage_q(const Params& p, typename C::DTypeQ* q_smem, int token, int q_head0,
                                        int rows_valid, int q_pos) {
  using L = Layout<C>;
  using DTypeQ = typename C::DTypeQ;
  constexpr int D = C::HEAD_DIM;
  const int tid = threadIdx.x;
  for (int job = tid; job < 16 * L::Q_CHUNKS / 2; job += L::THREADS) {
    const int r = job / (L::Q_CHUNKS / 2), c = job % (L::Q_CHUNKS / 2);
    float lo[8], hi[8];
    if (r < rows_valid) {
      const DTypeQ* src = p.q + (int64_t(token) * p.num_qo_heads + q_head0 + r) * D;
      const uint4 a = *reinterpret_cast<const uint4*>(src + c * 8);
      const uint4 b = *reinterpret_cast<const uint4*>(src + D / 2 + c * 8);
      const uint32_t* aw = reinterpret_cast<const uint32_t*>(&a);
      const uint32_t* bw = reinterpret_cast<const uint32_t*>(&b);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 x = unpack2<DTypeQ>(aw[i]), y = unpack2<DTypeQ>(bw[i]);
        lo[2 * i] = x.x; lo[2 * i + 1] = x.y; hi[2 * i] = y.x; hi[2 * i + 1] = y.y;
      }
      if constexpr (C::ROPE) {
#pragma unroll
        for (int i = 0; i < 8; ++i) rope_rotate(lo[i], hi[i], float(q_pos), c * 8 + i, D, p.rope_rcp_scale, p.rope_log2_theta);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) lo[i] = hi[i] = 0.f;
    }
    uint4 a, b;
    uint32_t* aw = reinterpret_cast<uint32_t*>(&a);
    uint32_t* bw = reinterpret_cast<uint32_t*>(&b);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      aw[i] = pack2<DTypeQ>(lo[2 * i], lo[2 * i + 1]);
      bw[i] = pack2<DTypeQ>(hi[2 * i], hi[2 * i + 1]);
    }
    *reinterpret_cast<uint4*>(q_smem + tile_index(r, c, L::Q_CHUNKS)) = a;
    *reinterpret_cast<uint4*>(q_smem + tile_index(r, c + L::Q_CHUNKS / 2, L::Q_CHUNKS)) = b;
  }
}

}  // namespace flashgen::decode
