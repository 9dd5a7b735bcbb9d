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
// fp8 K/V (e4m3, e5m2) stay fp8 in shared memory and are converted in registers after ldmatrix (decode/tiles.cuh:
// fp8 fragments) to fp16, the mma's type then (one cvt a pair, where bf16 would take three; a bf16 q is
// multiplied by sm_scale and rounded to fp16 when staged); the per-tensor scales are folded in on the host
// (k_scale into sm_scale) and at the output (v_scale).
//
// Config (rendered by codegen): DTypeQ, DTypeKV, DTypeMMA, DTypeO, HEAD_DIM, HEAD_DIM_VO, PAGE_SIZE, NUM_WARPS,
// STAGES, SMEM_BYTES, PAGED, ROPE (q turns), ROPE_K (K turns as it is read; false where the cache holds rotated
// K), ROPE_SCALING (Llama-3.1 / YaRN frequencies), ALIBI, SOFT_CAP, WINDOW, POSITIONS, APPEND, ROPE_K_ON_WRITE.
//
// APPEND (decode/append.cuh): the new token's k_new / v_new row is written into its cache slot and attended in
// the same launch.
//
// POSITIONS (common/positions.cuh): the query sits at q_pos[token] and key t at its page's kv_page_pos entry +
// its offset in the page; the window then masks keys element by element (kv_start is not moved), and RoPE and
// ALiBi use those positions.
//
// Variant (common/variant.cuh): the mask and score hooks run on each (query, key) pair, after the spec's own
// transform and before its mask, with batch = the request, qo_idx = the query's position (kv_len - 1, or q_pos),
// kv_idx = the key's; rows past the group's heads ask for the group's last head. softmax=False keeps the hook's
// weights as P (no max, no normaliser); the sink and the output hook run where a row is finished (epilogue).
// q_transform runs on each raw element as q is staged (stage_q), k_transform on K fragments in registers after
// their ldmatrix (fp8: dequantised by k_scale), both before RoPE.
//
// This header is the kernel's entry; decode/tiles.cuh holds the layout and the copies, decode/epilogue.cuh the
// write-out and the split-KV merge (its protocol: common/split_merge.cuh).
#pragma once
#include <flashgen/common/kv_rows.cuh>
#include <flashgen/common/logits.cuh>
#include <flashgen/common/mma.cuh>
#include <flashgen/common/positions.cuh>
#include <flashgen/common/variant.cuh>
#include <flashgen/decode/tiles.cuh>
#include <flashgen/decode/epilogue.cuh>
#include <flashgen/decode/append.cuh>

namespace flashgen::decode {

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

template <class C, class Params>
__device__ __forceinline__ void run(const Params& p) {
  using L = Layout<C>;
  using DTypeQ = typename C::DTypeQ;
  using DTypeKV = typename C::DTypeKV;
  using DTypeO = typename C::DTypeO;
  using DTypeMMA = typename C::DTypeMMA;  // q's dtype; fp16 for fp8 K/V (q pre-scaled: stage_q)
  constexpr bool Q_PRESCALED = !std::is_same_v<DTypeMMA, DTypeQ>;
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
  int q_pos = kv_len - 1;
  const int32_t* page_pos = nullptr;  // POSITIONS: this request's kv_page_pos entries
  if constexpr (C::POSITIONS) {
    q_pos = p.q_pos[p.qo_indptr[request]];
    page_pos = request_page_pos(p, request);
  }
  int kv_start = p.kv_start[item];
  const int kv_end = p.kv_end[item];
  if constexpr (C::WINDOW && !C::POSITIONS) kv_start = max(kv_start, q_pos - p.window_left);
  const int token = p.qo_indptr[request];
  const int chunk = p.chunk_idx[item];
  const SplitInfo si{chunk, chunk >= 0 ? p.merge_indptr[token] : 0, chunk >= 0 ? p.num_chunks[request] : 1};
  const int row0 = p.qo_tile_idx[item] * 16;               // first packed row (q head within the group)
  const int rows_valid = min(16, p.group_size - row0);

  extern __shared__ __align__(128) uint8_t smem[];
  DTypeMMA* q_smem = reinterpret_cast<DTypeMMA*>(smem);
  DTypeKV* k_smem = reinterpret_cast<DTypeKV*>(smem + L::K_OFFSET);
  DTypeKV* v_smem = reinterpret_cast<DTypeKV*>(smem + L::V_OFFSET);
  int64_t* row_offsets = reinterpret_cast<int64_t*>(smem + L::ROW_OFFSETS);  // [2][TILE]

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
  auto store_offset = [&](int tile, int32_t page_id) {  // APPEND too: its new row is skipped by index (issue)
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
  NewRow<C> new_row;  // APPEND: the new token's row, in registers (decode/append.cuh)
  int new_tile = -1, new_row_in_tile = 0;
  auto issue = [&](int tile) {
    if (tile < num_tiles) {
      const int64_t* offsets = row_offsets + (tile & 1) * TILE;
      DTypeKV* ks = k_smem + (tile % S) * TILE * D;
      DTypeKV* vs = v_smem + (tile % S) * TILE * DV;
      // APPEND: the new row's tile copies every row but it (by index) and takes the row from registers, published
      // by the barrier before the tile is read (the stage is free: every warp has passed the barrier after its
      // last read); the other tiles pay one compare a tile, not one a row
      if (C::APPEND && tile == new_tile) {
        copy_tile_rows<DTypeKV, TILE, K_RPP, L::K_CHUNKS, D, true>(ks, k_src, offsets, k_row0, k_col, new_row_in_tile);
        copy_tile_rows<DTypeKV, TILE, V_RPP, L::V_CHUNKS, DV, true>(vs, v_src, offsets, v_row0, v_col, new_row_in_tile);
        new_row.inject(ks, vs, new_row_in_tile);
      } else {
        copy_tile_rows<DTypeKV, TILE, K_RPP, L::K_CHUNKS, D>(ks, k_src, offsets, k_row0, k_col);
        copy_tile_rows<DTypeKV, TILE, V_RPP, L::V_CHUNKS, DV>(vs, v_src, offsets, v_row0, v_col);
      }
    }
    cp_async_commit();  // always commit, so group counting stays uniform
  };

  // the first tiles' page ids are loaded before Q, so the two global round trips overlap
  int32_t first_pages[S + 1];
#pragma unroll
  for (int tile = 0; tile <= S; ++tile) first_pages[tile] = page_of(tile);

  // APPEND: the items whose chunk ends at the new token hold its row; its loads (and qo tile 0's load of the slot's
  // page id) go out with q's, stage_q finishes it (K turned by q's angles), and qo tile 0's item writes it into
  // the cache, a store nothing waits on. Nothing of the row sits between the prologue and the first tile.
  int32_t new_page = 0;
  const bool writes_row = C::APPEND && kv_end == kv_len && kv_end > kv_start && p.qo_tile_idx[item] == 0;
  if constexpr (C::APPEND) {
    if (kv_end == kv_len && kv_end > kv_start) {
      new_row.load(p, token, kv_head);
      new_tile = (kv_len - 1 - kv_start) / TILE;
      new_row_in_tile = (kv_len - 1 - kv_start) % TILE;
      if (writes_row && new_row.active) new_page = rows.page(kv_len - 1);
    }
  }

  stage_q<C>(p, q_smem, token, q_head0, rows_valid, q_pos, p.sm_scale, request, new_row);
  if constexpr (C::APPEND) {
    if (writes_row) new_row.write(p, kv_head, rows.offset(kv_len - 1, new_page));
  }

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
  using V = typename C::Variant;
  constexpr bool HOOKED = V::SCORE || V::MASK || !V::SOFTMAX;  // the pair hooks (or sigmoid weights) run
  // softmax=False: P is the weight itself; m stays 0, so the epilogue's warp merge adds the warps' sums
  float m[2] = {V::SOFTMAX ? -INFINITY : 0.f, V::SOFTMAX ? -INFINITY : 0.f}, l[2] = {0.f, 0.f};
  LogitsTransform<C::ALIBI, C::SOFT_CAP> transform{Q_PRESCALED ? 1.f : p.sm_scale, p.soft_cap, p.soft_cap > 0.f ? 1.f / p.soft_cap : 0.f, 0.f};
  float slope[2] = {0.f, 0.f};
  if constexpr (C::ALIBI) {
    slope[0] = alibi_slope(q_head0 + g, p.num_qo_heads);
    slope[1] = alibi_slope(q_head0 + g + 8, p.num_qo_heads);
  }

  // k_transform on K fragments in registers, after their ldmatrix (each warp reads its own 16 keys of a tile, so
  // every element passes once) and before RoPE; fp8: on the dequantised value (the code times k_scale, which the
  // host leaves out of sm_scale here), held to fp16's finite range. A key past kv_end asks for the last one.
  auto k_index = [&](int tile, int row) {
    int pos = min(kv_start + tile * TILE + row, kv_end - 1);
    if constexpr (C::POSITIONS) pos = key_position<C::PAGE_SIZE>(page_pos, pos);
    return pos;
  };
  constexpr bool K_DEQUANT = L::FP8 && V::K_TRANSFORM;  // the params carry k_scale
  auto k_in = [&](float2 x, int kv_idx, int d) {
    if constexpr (K_DEQUANT) x.x *= p.k_scale, x.y *= p.k_scale;
    x.x = flashgen::variant::k_value<V>(p, x.x, request, kv_idx, kv_head, d);
    x.y = flashgen::variant::k_value<V>(p, x.y, request, kv_idx, kv_head, d + 1);
    if constexpr (K_DEQUANT) x.x = fminf(fmaxf(x.x, -65504.f), 65504.f), x.y = fminf(fmaxf(x.y, -65504.f), 65504.f);
    return x;
  };
  auto k_pair = [&](uint32_t w, int kv_idx, int d) {
    const float2 x = k_in(unpack2<DTypeMMA>(w), kv_idx, d);
    return pack2<DTypeMMA>(x.x, x.y);
  };

  for (int tile = 0; tile < num_tiles; ++tile) {
    cp_async_wait<S - 2>();
    __syncthreads();
    issue(tile + S - 1);
    store_offset(tile + S, next_page);
    next_page = page_of(tile + S + 1);

    const DTypeKV* ks = k_smem + (tile % S) * TILE * D;
    const DTypeKV* vs = v_smem + (tile % S) * TILE * DV;
    const int n0 = warp * 16;  // this warp's 16 rows of the tile

    // S = Q K^T for 16 q rows x 16 kv rows
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    const int mat = lane / 8, mrow = lane % 8;
    int key[2] = {0, 0};  // K_TRANSFORM: the kv_idx of the lane's keys n0 + g and n0 + 8 + g
    if constexpr (V::K_TRANSFORM) key[0] = k_index(tile, n0 + g), key[1] = k_index(tile, n0 + 8 + g);
    if constexpr (L::FP8 && C::ROPE_K) {
      // x4: n-tiles 0 and 1 of k-step j (regs 0, 1) and of its rotation partner j + D/32 (regs 2, 3)
      float pos[2] = {float(kv_start + tile * TILE + n0 + g), float(kv_start + tile * TILE + n0 + 8 + g)};
      if constexpr (C::POSITIONS) {  // rows past kv_end (masked below) take the last key's position
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          pos[nt] = float(key_position<C::PAGE_SIZE>(page_pos, min(kv_start + tile * TILE + n0 + 8 * nt + g, kv_end - 1)));
      }
#pragma unroll
      for (int j = 0; j < D / 32; ++j) {
        uint32_t qa[4], qb[4], kr[4];
        q_frag(j, qa);
        q_frag(j + D / 32, qb);
        ldmatrix_x4(kr, ks + copy_index<DTypeKV>(n0 + 8 * (mat % 2) + mrow, j + (mat / 2) * (D / 32), L::K_CHUNKS));
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          uint32_t lo[2], hi[2];
          fp8_k_frag<DTypeMMA, DTypeKV>(kr[nt], lo[0], lo[1]);
          fp8_k_frag<DTypeMMA, DTypeKV>(kr[2 + nt], hi[0], hi[1]);
#pragma unroll
          for (int b = 0; b < 2; ++b) {  // lo[b]: head-dim columns d, d + 1 with d = 16j + 4 t4 + 2b
            float2 x = unpack2<DTypeMMA>(lo[b]), y = unpack2<DTypeMMA>(hi[b]);
            const int d = 16 * j + 4 * t4 + 2 * b;
            if constexpr (V::K_TRANSFORM) x = k_in(x, key[nt], d), y = k_in(y, key[nt], d + D / 2);
            rope_rotate_by<C::ROPE_SCALING, true>(x.x, y.x, pos[nt], d, D, p);
            rope_rotate_by<C::ROPE_SCALING, true>(x.y, y.y, pos[nt], d + 1, D, p);
            lo[b] = pack2<DTypeMMA>(x.x, x.y);
            hi[b] = pack2<DTypeMMA>(y.x, y.y);
          }
          mma_16816<DTypeMMA>(s[nt], qa, lo[0], lo[1]);
          mma_16816<DTypeMMA>(s[nt], qb, hi[0], hi[1]);
        }
      }
    } else if constexpr (L::FP8) {
      // x4: n-tiles 0 and 1 (regs 0, 1; 2, 3) of k-steps j and j + 1
#pragma unroll
      for (int j = 0; j < D / 16; j += 2) {
        uint32_t kr[4];
        ldmatrix_x4(kr, ks + copy_index<DTypeKV>(n0 + 8 * (mat % 2) + mrow, j + mat / 2, L::K_CHUNKS));
#pragma unroll
        for (int step = 0; step < 2; ++step) {
          uint32_t qa[4];
          q_frag(j + step, qa);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            uint32_t b0, b1;
            fp8_k_frag<DTypeMMA, DTypeKV>(kr[2 * step + nt], b0, b1);
            if constexpr (V::K_TRANSFORM) {  // columns 16 (j + step) + 4 t4 + {0, 1} and {2, 3}
              b0 = k_pair(b0, key[nt], 16 * (j + step) + 4 * t4);
              b1 = k_pair(b1, key[nt], 16 * (j + step) + 4 * t4 + 2);
            }
            mma_16816<DTypeMMA>(s[nt], qa, b0, b1);
          }
        }
      }
    } else if constexpr (C::ROPE_K) {
      const int kv_row_lo = n0 + g, kv_row_hi = n0 + 8 + g;
      float pos_lo = float(kv_start + tile * TILE + kv_row_lo), pos_hi = float(kv_start + tile * TILE + kv_row_hi);
      if constexpr (C::POSITIONS) {  // rows past kv_end (masked below) take the last key's position
        pos_lo = float(key_position<C::PAGE_SIZE>(page_pos, min(kv_start + tile * TILE + kv_row_lo, kv_end - 1)));
        pos_hi = float(key_position<C::PAGE_SIZE>(page_pos, min(kv_start + tile * TILE + kv_row_hi, kv_end - 1)));
      }
#pragma unroll
      for (int j = 0; j < D / 32; ++j) {  // k-steps j and j + D/32 hold the two halves of each rotated pair
        uint32_t qa[4], qb[4], ka[4], kb[4];
        q_frag(j, qa);
        q_frag(j + D / 32, qb);
        ldmatrix_x4(ka, ks + tile_index(n0 + 8 * (mat / 2) + mrow, 2 * j + (mat % 2), L::K_CHUNKS));
        ldmatrix_x4(kb, ks + tile_index(n0 + 8 * (mat / 2) + mrow, 2 * (j + D / 32) + (mat % 2), L::K_CHUNKS));
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // reg r: n-tile r / 2 (row g or 8 + g), d = 16j + 2t4 + 8 (r % 2) + {0, 1}
          float2 lo = unpack2<DTypeMMA>(ka[r]), hi = unpack2<DTypeMMA>(kb[r]);
          const float pos = r < 2 ? pos_lo : pos_hi;
          const int d = 16 * j + 2 * t4 + 8 * (r % 2);
          if constexpr (V::K_TRANSFORM) lo = k_in(lo, key[r / 2], d), hi = k_in(hi, key[r / 2], d + D / 2);
          rope_rotate_by<C::ROPE_SCALING, true>(lo.x, hi.x, pos, d, D, p);
          rope_rotate_by<C::ROPE_SCALING, true>(lo.y, hi.y, pos, d + 1, D, p);
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
        ldmatrix_x4(kf, ks + tile_index(n0 + 8 * (mat / 2) + mrow, 2 * j + (mat % 2), L::K_CHUNKS));
        if constexpr (V::K_TRANSFORM) {  // reg r: key n0 + 8 (r / 2) + g, columns 16 j + 8 (r % 2) + 2 t4 + {0, 1}
#pragma unroll
          for (int r = 0; r < 4; ++r) kf[r] = k_pair(kf[r], key[r / 2], 16 * j + 8 * (r % 2) + 2 * t4);
        }
        mma_16816<DTypeMMA>(s[0], qa, kf[0], kf[1]);
        mma_16816<DTypeMMA>(s[1], qa, kf[2], kf[3]);
      }
    }

    // logits transform, mask (the tile's end only: the window already moved kv_start), online softmax (base 2)
    const bool last_tile = tile == num_tiles - 1;
    // the pair hooks' distance: the lane's first key's offset from the query (a key past kv_end is hidden, so its
    // distance may be the unclamped key's), plus each key's offset from it; with positions, each key's own
    const float row_dist = flashgen::variant::row_distance<V>(kv_start + tile * TILE + n0 + 2 * t4, q_pos);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = kv_start + tile * TILE + n0 + 8 * nt + 2 * t4 + (e % 2);
        transform.slope = slope[e / 2];
        if constexpr (HOOKED) {  // the variant's pair hooks on every pair, a key past kv_end at the last before it
          int k_pos = min(pos, kv_end - 1);
          bool hidden = last_tile && pos >= kv_end;  // (only the last tile reaches past kv_end)
          if constexpr (C::POSITIONS) {
            k_pos = key_position<C::PAGE_SIZE>(page_pos, k_pos);
            hidden = hidden || (C::WINDOW && k_pos < q_pos - p.window_left);
          }
          const int qo_head = q_head0 + min(g + 8 * (e / 2), rows_valid - 1);
          const float dist = C::POSITIONS ? flashgen::variant::distance_at<V>(q_pos, k_pos)
                                          : flashgen::variant::pair_distance<V>(row_dist, 8 * nt + e % 2);
          s[nt][e] = flashgen::variant::pair_value<V>(p, hidden, transform.natural(s[nt][e], k_pos - q_pos), request,
                                                      q_pos, k_pos, qo_head, kv_head, dist) *
                     (V::SOFTMAX ? LOG2E : 1.f);
        } else if constexpr (C::POSITIONS) {  // the window by true position, element by element
          const int k_pos = key_position<C::PAGE_SIZE>(page_pos, min(pos, kv_end - 1));
          const bool hidden = pos >= kv_end || (C::WINDOW && k_pos < q_pos - p.window_left);
          s[nt][e] = hidden ? -INFINITY : transform(s[nt][e], k_pos - q_pos);
        } else {
          s[nt][e] = last_tile && pos >= kv_end ? -INFINITY : transform(s[nt][e], pos - q_pos);
        }
      }
    }
    if constexpr (V::SOFTMAX) online_softmax<DV>(s, m, l, o);

    // O += P V: P from the S accumulators (C layout -> A layout), V fragments by ldmatrix.trans
    uint32_t pa[4] = {pack2<DTypeMMA>(s[0][0], s[0][1]), pack2<DTypeMMA>(s[0][2], s[0][3]),
                      pack2<DTypeMMA>(s[1][0], s[1][1]), pack2<DTypeMMA>(s[1][2], s[1][3])};
    if constexpr (L::FP8) {
      // x4.trans: keys 0-7 and 8-15 (regs 0, 1; 2, 3) of 16-byte column chunks c and c + 1; o[2c] takes a chunk's
      // even columns, o[2c + 1] its odd ones
#pragma unroll
      for (int c = 0; c < DV / 16; c += 2) {
        uint32_t vr[4];
        ldmatrix_x4_trans(vr, vs + copy_index<DTypeKV>(n0 + 8 * (mat % 2) + mrow, c + mat / 2, L::V_CHUNKS));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t even[2], odd[2];
          fp8_v_frags<DTypeMMA, DTypeKV>(vr[2 * h], vr[2 * h + 1], even, odd);
          mma_16816<DTypeMMA>(o[2 * (c + h)], pa, even[0], even[1]);
          mma_16816<DTypeMMA>(o[2 * (c + h) + 1], pa, odd[0], odd[1]);
        }
      }
    } else {
#pragma unroll
      for (int c = 0; c < DV / 16; ++c) {
        uint32_t vf[4];
        ldmatrix_x4_trans(vf, vs + tile_index(n0 + 8 * (mat % 2) + mrow, 2 * c + mat / 2, L::V_CHUNKS));
        mma_16816<DTypeMMA>(o[2 * c], pa, vf[0], vf[1]);
        mma_16816<DTypeMMA>(o[2 * c + 1], pa, vf[2], vf[3]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline's shared memory is reused below

  write_states<C>(p, smem, si, token, q_head0, rows_valid, o, m, l, request, q_pos);
}

}  // namespace flashgen::decode
