// Batch decode on tensor cores: one query token per request, the q heads of one GQA group as the rows of
// an m16n8k16 tile, so each K/V byte is read once for the whole group.
//
// One CTA runs one work item of the split-KV plan: (request, qo tile, kv chunk [kv_start, kv_end)) for one kv
// head (the grid's order: see run). NUM_WARPS warps share a KV tile of NUM_WARPS * 16 tokens, each warp taking
// 16 of its rows, with its own online-softmax state; the warps' states are merged through shared memory at the
// end.
// K/V tiles flow through a STAGES-deep cp.async pipeline into swizzled shared memory. Page ids are loaded
// into registers two tiles ahead of their copy, so small pages never stall the copy engine.
//
// fp8 K/V (e4m3, e5m2) are copied as fp8 and widened per tile in shared memory to q's dtype; the
// per-tensor scales are folded in on the host (k_scale into sm_scale) and at the output (v_scale).
//
// Config (rendered by codegen): DTypeQ, DTypeKV, DTypeO, HEAD_DIM, HEAD_DIM_VO, PAGE_SIZE, NUM_WARPS,
// STAGES, SMEM_BYTES, PAGED, ROPE, ALIBI, SOFT_CAP, WINDOW.
#pragma once
#include <flashgen/fp8.cuh>
#include <flashgen/kv_rows.cuh>
#include <flashgen/logits.cuh>
#include <flashgen/mma.cuh>

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
  // the split merge's staging (merge_if_last), over the same buffers: per warp MERGE_BATCH chunks x
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

// An item's place among its request's split-KV partials, read at the kernel's start (its loads overlap the
// start chain rather than sitting between the stream's end and the partial's write)
struct SplitInfo {
  int chunk;       // the item's chunk (-1: the request is not split)
  int first;       // the request's first partial row (merge_indptr)
  int num_chunks;  // the request's partials
};

__device__ __forceinline__ int atomic_add_acq_rel(int* address, int value) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(address), "r"(value) : "memory");
  return old;
}

// Split-KV finish without a second launch: every item of a (token, head group) publishes its partial, then
// counts itself in; the last to arrive merges all partials into the output and resets the counter (so
// the next run, or a CUDA-graph replay, starts from zero).
template <class C, class Params>
__device__ __forceinline__ void merge_if_last(const Params& p, uint8_t* smem, const SplitInfo& si, int token,
                                              int q_head0, int rows_valid) {
  __shared__ int is_last;
  using DTypeO = typename C::DTypeO;
  constexpr int DV = C::HEAD_DIM_VO;
  // the CTA's partial, ordered before thread 0's release by the barrier (release is cumulative), so no thread
  // fences on its own; thread 0's acquire, ordered before the other threads' loads by the second barrier,
  // makes every other item's partial visible to the merge (the pattern of CUTLASS's split-K semaphore)
  __syncthreads();
  int* counter = p.counters + int64_t(token) * p.num_qo_heads + q_head0;
  const int num_chunks = si.num_chunks;
  if (threadIdx.x == 0) is_last = atomic_add_acq_rel(counter, 1) == num_chunks - 1;
  __syncthreads();
  if (!is_last) return;
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
    float m = -INFINITY, sum = 0.f;
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
      const float m_new = fmaxf(m, mb), m_use = m_new == -INFINITY ? 0.f : m_new;
      const float corr = expf(m - m_use);  // 0 on the first batch (m = -inf)
      const float w_lane = expf(lse_k - m_use);
      float wsum = w_lane;
#pragma unroll
      for (int x = 16; x > 0; x /= 2) wsum += __shfl_xor_sync(0xffffffff, wsum, x);
      sum = sum * corr + wsum;
      m = m_new;
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
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
    for (int cb = 0; cb < CB; ++cb) {
      const int col = cb * 128 + lane * 4;
      if (col < DV) {
        const uint2 packed = make_uint2(pack2<DTypeO>(acc[cb].x * inv, acc[cb].y * inv), pack2<DTypeO>(acc[cb].z * inv, acc[cb].w * inv));
        *reinterpret_cast<uint2*>(p.o + (int64_t(token) * stride + head) * DV + col) = packed;
      }
    }
    if (lane == 0 && p.lse != nullptr) p.lse[int64_t(token) * stride + head] = sum > 0.f ? m + logf(sum) : -INFINITY;
  }
  __syncthreads();
  if (threadIdx.x == 0) *counter = 0;
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

// one tile's step of the online softmax (base 2) for rows g and g + 8: new running max, rescaled sum and O,
// and the scores turned into probabilities in place
template <int DV>
__device__ __forceinline__ void online_softmax(float (&s)[2][4], float (&m)[2], float (&l)[2], float (&o)[DV / 8][4]) {
  #pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float m_new = fmaxf(m[h], mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float scale = exp2f(m[h] - m_use);
        m[h] = m_new;
        l[h] *= scale;
        if (__any_sync(0xffffffff, scale != 1.f)) {  // once the running max settles, most tiles skip this
  #pragma unroll
          for (int j = 0; j < DV / 8; ++j) {
            o[j][2 * h] *= scale;
            o[j][2 * h + 1] *= scale;
          }
        }
  #pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          s[nt][2 * h] = exp2f(s[nt][2 * h] - m_use);
          s[nt][2 * h + 1] = exp2f(s[nt][2 * h + 1] - m_use);
          l[h] += s[nt][2 * h] + s[nt][2 * h + 1];
        }
      }
}

// the warps' (m, l, O) merged through shared memory (the pipeline's, free now) and written: to out and lse,
// or for an item of a split request to its partial row, the last item of the request merging them all
template <class C, class Params>
__device__ __forceinline__ void write_states(const Params& p, uint8_t* smem, const SplitInfo& si, int token,
                                             int q_head0, int rows_valid, float (&o)[C::HEAD_DIM_VO / 8][4],
                                             float (&m)[2], float (&l)[2]) {
  using L = Layout<C>;
  using DTypeO = typename C::DTypeO;
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
#pragma unroll
    for (int j = 0; j < DV / 8; ++j) {
      *reinterpret_cast<float2*>(o_part + (warp * 16 + r) * DV + 8 * j + 2 * t4) = make_float2(o[j][2 * h], o[j][2 * h + 1]);
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
    const float inv = l_all > 0.f ? p.v_scale / l_all : 0.f;  // fp8 V: its per-tensor scale
#pragma unroll
    for (int i = 0; i < COLS; ++i) acc[i] *= inv;
    const float lse = l_all > 0.f ? (m_all + log2f(l_all)) * LN2 : -INFINITY;
    const int64_t head = q_head0 + r;
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
  if (split) merge_if_last<C>(p, smem, si, token, q_head0, rows_valid);
}

template <class C, class Params>
__device__ __forceinline__ void run(const Params& p) {
  using L = Layout<C>;
  using DTypeQ = typename C::DTypeQ;
  using DTypeKV = typename C::DTypeKV;
  using DTypeO = typename C::DTypeO;
  using DTypeMMA = DTypeQ;  // the mma operand type: K/V as stored, or widened from fp8
  constexpr int D = C::HEAD_DIM, DV = C::HEAD_DIM_VO, TILE = L::TILE, S = C::STAGES;

  // The host picks the grid. More CTAs than one wave: a 1-D grid, kv head fastest, so the kv heads of one item
  // start together and stream the same pages at about the same time (NHD: a token's heads side by side; DRAM
  // rows opened for one head serve the others; 0.5-1.4 % at batch 16-64). One wave (small batches, split):
  // (items, kv heads), item fastest, which measured ~1 % faster at batch 1. Either way every (item, head) runs once.
  unsigned item_u = blockIdx.x, head_u = blockIdx.y;
  if (gridDim.y == 1) {
    const unsigned num_kv_heads = unsigned(p.num_qo_heads / p.group_size);
    item_u = blockIdx.x / num_kv_heads;
    head_u = blockIdx.x - item_u * num_kv_heads;
  }
  const int item = int(item_u), kv_head = int(head_u);
  const int request = p.request_idx[item];
  if (request < 0) return;  // padding item of a fixed-capacity plan
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int kv_len = p.kv_len[request];
  const int q_pos = kv_len - 1;
  int kv_start = p.kv_start[item];
  const int kv_end = p.kv_end[item];
  if constexpr (C::WINDOW) kv_start = max(kv_start, q_pos - p.window_left);
  const int token = p.qo_indptr[request];
  const int chunk = p.chunk_idx[item];
  const SplitInfo si{chunk, chunk >= 0 ? p.merge_indptr[token] : 0, chunk >= 0 ? p.num_chunks[request] : 1};
  const int row0 = p.qo_tile_idx[item] * 16;               // first packed row (q head within the group)
  const int rows_valid = min(16, p.group_size - row0);

  extern __shared__ __align__(128) uint8_t smem[];
  DTypeQ* q_smem = reinterpret_cast<DTypeQ*>(smem);
  DTypeKV* k_smem = reinterpret_cast<DTypeKV*>(smem + L::K_OFFSET);
  DTypeKV* v_smem = reinterpret_cast<DTypeKV*>(smem + L::V_OFFSET);
  int64_t* row_offsets = reinterpret_cast<int64_t*>(smem + L::ROW_OFFSETS);  // [2][TILE]
  DTypeMMA* k_conv = reinterpret_cast<DTypeMMA*>(smem + L::CONV_OFFSET);  // fp8 only: the widened tile
  DTypeMMA* v_conv = k_conv + TILE * D;

  const int q_head0 = kv_head * p.group_size + row0;

  // ---- the KV pipeline
  const KVRows<C::PAGED, C::PAGE_SIZE> rows(p, request);
  const int num_tiles = kv_end > kv_start ? (kv_end - kv_start + TILE - 1) / TILE : 0;
  const DTypeKV* k_head = p.k + int64_t(kv_head) * p.stride_head;
  const DTypeKV* v_head = p.v + int64_t(kv_head) * p.stride_head;

  auto page_of = [&](int tile) -> int32_t {  // thread tid < TILE owns row tid of every tile
    const int pos = kv_start + tile * TILE + tid;
    return (tid < TILE && tile < num_tiles && pos < kv_end) ? rows.page(pos) : 0;
  };
  auto store_offset = [&](int tile, int32_t page_id) {
    const int pos = kv_start + tile * TILE + tid;
    if (tid < TILE) row_offsets[(tile & 1) * TILE + tid] = (tile < num_tiles && pos < kv_end) ? rows.offset(pos, page_id) : -1;
  };
  // Each thread copies one fixed 16-byte column chunk of every (THREADS / CHUNKS)-th row of a tile: its
  // source column and (rows stepping by a multiple of 8) its swizzled destination are per-thread constants,
  // so a copy costs a shared-memory read of the row offset, an add and the cp.async.
  constexpr int K_RPP = L::THREADS / L::K_CHUNKS, V_RPP = L::THREADS / L::V_CHUNKS;
  static_assert(L::THREADS % L::K_CHUNKS == 0 && L::THREADS % L::V_CHUNKS == 0, "whole rows per pass");
  const int k_row0 = tid / L::K_CHUNKS, k_col = tid % L::K_CHUNKS;
  const int v_row0 = tid / L::V_CHUNKS, v_col = tid % L::V_CHUNKS;
  const DTypeKV* k_src = k_head + k_col * (16 / int(sizeof(DTypeKV)));
  const DTypeKV* v_src = v_head + v_col * (16 / int(sizeof(DTypeKV)));
  auto issue = [&](int tile) {
    if (tile < num_tiles) {
      const int64_t* offsets = row_offsets + (tile & 1) * TILE;
      DTypeKV* ks = k_smem + (tile % S) * TILE * D;
      DTypeKV* vs = v_smem + (tile % S) * TILE * DV;
      copy_tile_rows<DTypeKV, TILE, K_RPP, L::K_CHUNKS, D>(ks, k_src, offsets, k_row0, k_col);
      copy_tile_rows<DTypeKV, TILE, V_RPP, L::V_CHUNKS, DV>(vs, v_src, offsets, v_row0, v_col);
    }
    cp_async_commit();  // always commit, so group counting stays uniform
  };

  // the first tiles' page ids are loaded before Q, so the two global round trips overlap
  int32_t first_pages[S + 1];
#pragma unroll
  for (int tile = 0; tile <= S; ++tile) first_pages[tile] = page_of(tile);

  stage_q<C>(p, q_smem, token, q_head0, rows_valid, q_pos);


  // prologue: tiles 0 .. S-2 in flight, offsets of tile S-1 stored, page ids of tile S in registers
#pragma unroll
  for (int tile = 0; tile < S - 1; ++tile) {
    store_offset(tile, first_pages[tile]);
    __syncthreads();
    issue(tile);
  }
  store_offset(S - 1, first_pages[S - 1]);
  int32_t next_page = first_pages[S];

  // Q as mma A fragments: held in registers up to head_dim 128 (loaded once; the prologue's barriers made
  // the Q tile visible), re-read from shared memory for each tile above that, where registers run out
  constexpr bool Q_IN_REGS = D <= 128;
  uint32_t q_regs[Q_IN_REGS ? D / 16 : 1][4];
  if constexpr (Q_IN_REGS) {
#pragma unroll
    for (int j = 0; j < D / 16; ++j) ldmatrix_x4(q_regs[j], q_smem + tile_index(lane % 16, 2 * j + lane / 16, L::Q_CHUNKS));
  }
  auto q_frag = [&](int j, uint32_t (&a)[4]) {
    if constexpr (Q_IN_REGS) {
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = q_regs[j][i];
    } else {
      ldmatrix_x4(a, q_smem + tile_index(lane % 16, 2 * j + lane / 16, L::Q_CHUNKS));
    }
  };

  // ---- per-warp online softmax state: rows g and g + 8 of the tile
  float o[DV / 8][4];
#pragma unroll
  for (int j = 0; j < DV / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  LogitsTransform<C::ALIBI, C::SOFT_CAP> transform{p.sm_scale, p.soft_cap, p.soft_cap > 0.f ? 1.f / p.soft_cap : 0.f, 0.f};
  float slope[2] = {0.f, 0.f};
  if constexpr (C::ALIBI) {
    slope[0] = alibi_slope(q_head0 + g, p.num_qo_heads);
    slope[1] = alibi_slope(q_head0 + g + 8, p.num_qo_heads);
  }

  for (int tile = 0; tile < num_tiles; ++tile) {
    cp_async_wait<S - 2>();
    __syncthreads();
    issue(tile + S - 1);
    store_offset(tile + S, next_page);
    next_page = page_of(tile + S + 1);

    const DTypeMMA* ks;
    const DTypeMMA* vs;
    if constexpr (L::FP8) {  // widen the fp8 tile into the 16-bit tile the mma reads
      widen_tile<L::TILE, L::K_CHUNKS, L::THREADS>(k_smem + (tile % S) * TILE * D, k_conv);
      widen_tile<L::TILE, L::V_CHUNKS, L::THREADS>(v_smem + (tile % S) * TILE * DV, v_conv);
      __syncthreads();
      ks = k_conv;
      vs = v_conv;
    } else {
      ks = k_smem + (tile % S) * TILE * D;
      vs = v_smem + (tile % S) * TILE * DV;
    }
    const int n0 = warp * 16;  // this warp's 16 rows of the tile

    // S = Q K^T for 16 q rows x 16 kv rows
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    const int mat = lane / 8, mrow = lane % 8;
    if constexpr (C::ROPE) {
      const int kv_row_lo = n0 + g, kv_row_hi = n0 + 8 + g;
      const float pos_lo = float(kv_start + tile * TILE + kv_row_lo), pos_hi = float(kv_start + tile * TILE + kv_row_hi);
#pragma unroll
      for (int j = 0; j < D / 32; ++j) {  // k-steps j and j + D/32 hold the two halves of each rotated pair
        uint32_t qa[4], qb[4], ka[4], kb[4];
        q_frag(j, qa);
        q_frag(j + D / 32, qb);
        ldmatrix_x4(ka, ks + tile_index(n0 + 8 * (mat / 2) + mrow, 2 * j + (mat % 2), L::KC_CHUNKS));
        ldmatrix_x4(kb, ks + tile_index(n0 + 8 * (mat / 2) + mrow, 2 * (j + D / 32) + (mat % 2), L::KC_CHUNKS));
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // reg r: n-tile r / 2 (row g or 8 + g), d = 16j + 2t4 + 8 (r % 2) + {0, 1}
          float2 lo = unpack2<DTypeMMA>(ka[r]), hi = unpack2<DTypeMMA>(kb[r]);
          const float pos = r < 2 ? pos_lo : pos_hi;
          const int d = 16 * j + 2 * t4 + 8 * (r % 2);
          rope_rotate(lo.x, hi.x, pos, d, D, p.rope_rcp_scale, p.rope_log2_theta);
          rope_rotate(lo.y, hi.y, pos, d + 1, D, p.rope_rcp_scale, p.rope_log2_theta);
          ka[r] = pack2<DTypeMMA>(lo.x, lo.y);
          kb[r] = pack2<DTypeMMA>(hi.x, hi.y);
        }
        mma_16816<DTypeMMA>(s[0], qa, ka[0], ka[1]);
        mma_16816<DTypeMMA>(s[1], qa, ka[2], ka[3]);
        mma_16816<DTypeMMA>(s[0], qb, kb[0], kb[1]);
        mma_16816<DTypeMMA>(s[1], qb, kb[2], kb[3]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        uint32_t qa[4], kf[4];
        q_frag(j, qa);
        ldmatrix_x4(kf, ks + tile_index(n0 + 8 * (mat / 2) + mrow, 2 * j + (mat % 2), L::KC_CHUNKS));
        mma_16816<DTypeMMA>(s[0], qa, kf[0], kf[1]);
        mma_16816<DTypeMMA>(s[1], qa, kf[2], kf[3]);
      }
    }

    // logits transform, mask (the tile's end only: the window already moved kv_start), online softmax (base 2)
    const bool last_tile = tile == num_tiles - 1;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = kv_start + tile * TILE + n0 + 8 * nt + 2 * t4 + (e % 2);
        transform.slope = slope[e / 2];
        s[nt][e] = last_tile && pos >= kv_end ? -INFINITY : transform(s[nt][e], pos - q_pos);
      }
    }
    online_softmax<DV>(s, m, l, o);

    // O += P V: P from the S accumulators (C layout -> A layout), V fragments by ldmatrix.trans
    uint32_t pa[4] = {pack2<DTypeMMA>(s[0][0], s[0][1]), pack2<DTypeMMA>(s[0][2], s[0][3]),
                      pack2<DTypeMMA>(s[1][0], s[1][1]), pack2<DTypeMMA>(s[1][2], s[1][3])};
#pragma unroll
    for (int c = 0; c < DV / 16; ++c) {
      uint32_t vf[4];
      ldmatrix_x4_trans(vf, vs + tile_index(n0 + 8 * (mat % 2) + mrow, 2 * c + mat / 2, L::VC_CHUNKS));
      mma_16816<DTypeMMA>(o[2 * c], pa, vf[0], vf[1]);
      mma_16816<DTypeMMA>(o[2 * c + 1], pa, vf[2], vf[3]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline's shared memory is reused below

  write_states<C>(p, smem, si, token, q_head0, rows_valid, o, m, l);
}

}  // namespace flashgen::decode
