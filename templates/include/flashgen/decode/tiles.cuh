// Decode data layout and movement: the CTA's shared memory (Q tile, STAGES-deep K/V rings, the row-offset ring),
// swizzled tile indexing, the cp.async tile copy, the Q tile load (RoPE on the way) and fp8 K/V fragments
// converted in registers.
//
// Config: DTypeQ, DTypeKV, DTypeMMA, HEAD_DIM, HEAD_DIM_VO, NUM_WARPS, STAGES, SMEM_BYTES, ROPE, ROPE_SCALING.
#pragma once
#include <type_traits>
#include <flashgen/common/fp8.cuh>
#include <flashgen/common/logits.cuh>
#include <flashgen/common/mma.cuh>
#include <flashgen/common/variant.cuh>

namespace flashgen::decode {

template <class C>
struct Layout {
  using DTypeQ = typename C::DTypeQ;
  using DTypeKV = typename C::DTypeKV;
  // fp8 K/V: tiles stay fp8 in shared memory (half the bytes); fragments are converted in registers
  static constexpr bool FP8 = sizeof(DTypeKV) == 1;
  static constexpr int TILE = C::NUM_WARPS * 16;
  static constexpr int THREADS = C::NUM_WARPS * 32;
  static constexpr int K_CHUNKS = C::HEAD_DIM * int(sizeof(DTypeKV)) / 16;  // 16-byte chunks per row
  static constexpr int V_CHUNKS = C::HEAD_DIM_VO * int(sizeof(DTypeKV)) / 16;
  static constexpr int Q_CHUNKS = C::HEAD_DIM * int(sizeof(DTypeQ)) / 16;
  static constexpr int Q_BYTES = 16 * C::HEAD_DIM * int(sizeof(DTypeQ));
  static constexpr int K_STAGE = TILE * C::HEAD_DIM * int(sizeof(DTypeKV));
  static constexpr int V_STAGE = TILE * C::HEAD_DIM_VO * int(sizeof(DTypeKV));
  static constexpr int OFFSETS_BYTES = 2 * TILE * 8;
  static constexpr int K_OFFSET = Q_BYTES;
  static constexpr int V_OFFSET = K_OFFSET + C::STAGES * K_STAGE;
  static constexpr int ROW_OFFSETS = V_OFFSET + C::STAGES * V_STAGE;
  static constexpr int TOTAL = ROW_OFFSETS + OFFSETS_BYTES;
  // epilogue, over everything after Q (stages, offsets): per warp o [16][HEAD_DIM_VO] fp32
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
  static_assert(sizeof(typename C::DTypeMMA) == 2 && (FP8 || std::is_same_v<typename C::DTypeMMA, DTypeQ>),
                "a 16-bit mma type, q's unless K/V are fp8");
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
// from src + offsets[r] (a negative offset: a row past the request, zero-filled). SKIP: row skip_row is left
// alone (the fused append's new row, stored from registers: no cp.async touches it), found by its index so the
// offsets of every tile stay the plain decode's. With RPP a multiple of 8 the swizzle repeats every pass, so the
// destination is the first pass's plus j * RPP rows of WIDTH elements.
template <typename T, int TILE, int RPP, int CHUNKS, int WIDTH, bool SKIP = false>
__device__ __forceinline__ void copy_tile_rows(T* smem, const T* src, const int64_t* offsets, int row0, int col,
                                               int skip_row = -1) {
#pragma unroll
  for (int j = 0; j < TILE / RPP; ++j) {
    const int r = row0 + j * RPP;
    const int64_t off = offsets[r];
    const int dst = RPP % 8 == 0 ? copy_index<T>(row0, col, CHUNKS) + j * RPP * WIDTH : copy_index<T>(r, col, CHUNKS);
    if constexpr (SKIP) {
      if (r == skip_row) continue;
    }
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

// ---- fp8 K/V fragments, converted in registers
// ldmatrix treats an fp8 row's 16-byte chunk as 8 16-bit columns, so lane (g, t4) receives bytes 4 t4 .. 4 t4 + 3
// of row g of each 8 x 16-byte matrix: four consecutive head-dim columns of one key. The mma's B fragment wants
// columns (2 t4, 2 t4 + 1) and (2 t4 + 8, 2 t4 + 9) of a 16-column k-step; a dot product does not care about the
// order of its terms, so K's columns 4 t4 + {0, 1, 2, 3} take those slots and Q is stored with its columns in the
// same order (stage_q), which leaves S unchanged. For V, ldmatrix.trans hands lane (g, t4) the 16-bit words at
// rows (keys) 2 t4 and 2 t4 + 1 of column-pair g: columns 2g and 2g + 1 of two consecutive keys, the B fragment
// of two n-tiles (the even and the odd columns of the chunk); the epilogue puts the columns back (write_states).

// the mma slot of column k (even) of a 16-column k-step, k and k + 1 moving together
__device__ __forceinline__ int fp8_k_slot(int k) {
  const int base = k & ~15, quad = (k & 15) / 4, half = (k & 3) / 2;
  return base + 2 * quad + 8 * half;
}
template <typename T>
__device__ __forceinline__ uint32_t& q_smem_pair(T* q_smem, int row, int col, int chunks) {
  return *reinterpret_cast<uint32_t*>(q_smem + tile_index(row, col / 8, chunks) + col % 8);
}

// fp8_k_frag and fp8_v_frags (common/fp8.cuh): the B fragments from one ldmatrix register of a K tile, and from
// the ldmatrix.trans registers of a V chunk

// Q: 16 rows (padded with zeros) into shared memory in the mma's type, the variant's q_transform (request batch,
// query q_pos) and then RoPE applied on the way; where the mma's type is not q's (fp8 K/V under a bf16 q run the
// mma in fp16), q is multiplied by `scale` (sm_scale) last and held to fp16's finite range.
// APPEND: `row` (decode/append.cuh: NewRow, its loads issued) is finished here, K turned by the angles of q's
// row 0 (ROPE_K_ON_WRITE: the new key sits at q_pos too); `row` is not touched otherwise.
template <class C, class Params, class Row>
__device__ __forceinline__ void stage_q(const Params& p, typename C::DTypeMMA* q_smem, int token, int q_head0,
                                        int rows_valid, int q_pos, float scale, int batch, Row& row) {
  using L = Layout<C>;
  using DTypeQ = typename C::DTypeQ;
  using DTypeMMA = typename C::DTypeMMA;
  constexpr bool PRESCALE = !std::is_same_v<DTypeMMA, DTypeQ>;
  constexpr int D = C::HEAD_DIM;
  const int tid = threadIdx.x;
  float row_cos[8], row_sin[8];  // ROPE_K_ON_WRITE: the angles of row 0's chunk c = tid (the K piece of thread tid)
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
      if constexpr (C::Variant::Q_TRANSFORM) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          lo[i] = flashgen::variant::q_value<typename C::Variant>(p, lo[i], batch, q_pos, q_head0 + r, c * 8 + i);
          hi[i] = flashgen::variant::q_value<typename C::Variant>(p, hi[i], batch, q_pos, q_head0 + r, D / 2 + c * 8 + i);
        }
      }
      if constexpr (C::ROPE && C::ROPE_K_ON_WRITE) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          float cs, sn;
          rope_cos_sin_by<C::ROPE_SCALING, true>(cs, sn, float(q_pos), c * 8 + i, D, p);
          rope_pair(lo[i], hi[i], cs, sn);
          if (r == 0) row_cos[i] = cs, row_sin[i] = sn;
        }
      } else if constexpr (C::ROPE) {
#pragma unroll
        for (int i = 0; i < 8; ++i) rope_rotate_by<C::ROPE_SCALING, true>(lo[i], hi[i], float(q_pos), c * 8 + i, D, p);
      }
      if constexpr (PRESCALE) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          lo[i] = fminf(fmaxf(lo[i] * scale, -65504.f), 65504.f);
          hi[i] = fminf(fmaxf(hi[i] * scale, -65504.f), 65504.f);
        }
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
      aw[i] = pack2<DTypeMMA>(lo[2 * i], lo[2 * i + 1]);
      bw[i] = pack2<DTypeMMA>(hi[2 * i], hi[2 * i + 1]);
    }
    if constexpr (L::FP8) {  // columns in fp8 fragment order (fp8_k_slot), one pair a store
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int slot = fp8_k_slot(c * 8 + 2 * i);
        q_smem_pair(q_smem, r, slot, L::Q_CHUNKS) = aw[i];
        q_smem_pair(q_smem, r, slot + D / 2, L::Q_CHUNKS) = bw[i];
      }
    } else {
      *reinterpret_cast<uint4*>(q_smem + tile_index(r, c, L::Q_CHUNKS)) = a;
      *reinterpret_cast<uint4*>(q_smem + tile_index(r, c + L::Q_CHUNKS / 2, L::Q_CHUNKS)) = b;
    }
  }
  if constexpr (C::APPEND) row.finish(p, row_cos, row_sin);
}

}  // namespace flashgen::decode
