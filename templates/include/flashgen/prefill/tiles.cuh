// Prefill data movement: the shared-memory layout, the Q tile load (RoPE on the way; for fp8 K/V in the fp8
// fragments' column order), the KV pipeline (page ids prefetched, cp.async into swizzled tiles) and the in-place
// RoPE pass over a K tile.
//
// Config: DTypeQ, DTypeKV, DTypeMMA, HEAD_DIM, HEAD_DIM_VO, PAGE_SIZE, NUM_WARPS, MMA_Q, TILE_KV, STAGES, SMEM_BYTES, PAGED.
#pragma once
#include <type_traits>
#include <flashgen/common/kv_rows.cuh>
#include <flashgen/common/logits.cuh>
#include <flashgen/common/mma.cuh>
#include <flashgen/common/positions.cuh>
#include <flashgen/common/tile_entry.cuh>
#include <flashgen/common/variant.cuh>

namespace flashgen::prefill {

template <class C>
struct Layout {
  using DTypeQ = typename C::DTypeQ;
  using DTypeKV = typename C::DTypeKV;
  using DTypeMMA = typename C::DTypeMMA;  // Q's type in shared memory: q's, or fp16 for fp8 K/V
  // fp8 K/V: tiles stay fp8 in shared memory (half the bytes); fragments are converted in registers (prefill/fp8.cuh)
  static constexpr bool FP8 = sizeof(DTypeKV) == 1;
  static constexpr int D = C::HEAD_DIM, DV = C::HEAD_DIM_VO;
  static constexpr int WARP_ROWS = 16 * C::MMA_Q;
  static constexpr int TILE_Q = C::NUM_WARPS * WARP_ROWS;
  static constexpr int TILE_KV = C::TILE_KV;
  static constexpr int THREADS = C::NUM_WARPS * 32;
  static constexpr int Q_CHUNKS = D * int(sizeof(DTypeMMA)) / 16;  // 16-byte chunks per row
  static constexpr int K_CHUNKS = D * int(sizeof(DTypeKV)) / 16;
  static constexpr int V_CHUNKS = DV * int(sizeof(DTypeKV)) / 16;
  static constexpr int Q_BYTES = TILE_Q * D * int(sizeof(DTypeMMA));
  static constexpr int K_STAGE = TILE_KV * D * int(sizeof(DTypeKV));
  static constexpr int V_STAGE = TILE_KV * DV * int(sizeof(DTypeKV));
  static constexpr int K_OFFSET = Q_BYTES;
  static constexpr int V_OFFSET = K_OFFSET + C::STAGES * K_STAGE;
  static constexpr int ROW_OFFSETS = V_OFFSET + C::STAGES * V_STAGE;  // the paged ring (ragged: unused)
  static constexpr int TOTAL = ROW_OFFSETS + 2 * TILE_KV * 8;
  static_assert(TOTAL == C::SMEM_BYTES, "codegen and the kernel disagree on the shared-memory size");
  static_assert(Q_CHUNKS % 8 == 0 && K_CHUNKS % 8 == 0 && V_CHUNKS % 8 == 0, "rows of whole 128-byte lines (swizzle)");
  static_assert(TILE_KV % 16 == 0 && TILE_KV <= THREADS, "one KV row offset per thread");
  static_assert(C::STAGES >= 2, "at least double buffering");
  static_assert(FP8 || std::is_same_v<DTypeKV, DTypeQ>, "16-bit K/V must have q's dtype");
  static_assert(sizeof(DTypeMMA) == 2 && (FP8 || std::is_same_v<DTypeMMA, DTypeQ>),
                "a 16-bit mma type, q's unless K/V are fp8");
  static_assert(!FP8 || !C::ROPE_K, "RoPE rotates K in shared memory, in 16-bit tiles only");
};

// element index of (row, 16-byte chunk) in a swizzled tile whose rows have `chunks` chunks of 8 elements
__device__ __forceinline__ int tile_index(int row, int chunk, int chunks) { return row * chunks * 8 + swizzle(row, chunk) * 8; }
// the same in a K/V tile of T (16 / sizeof(T) elements a chunk: 8, or 16 for fp8)
template <typename T>
__device__ __forceinline__ int kv_index(int row, int chunk, int chunks) {
  constexpr int E = 16 / int(sizeof(T));
  return row * chunks * E + swizzle(row, chunk) * E;
}


// 8 elements in 16-bit storage (columns d0 .. d0 + 7) through f(value, column), in place: a variant's load
// transform
template <typename T, class F>
__device__ __forceinline__ void map_chunk(uint4& a, int d0, const F& f) {
  uint32_t* w = reinterpret_cast<uint32_t*>(&a);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = unpack2<T>(w[i]);
    w[i] = pack2<T>(f(x.x, d0 + 2 * i), f(x.y, d0 + 2 * i + 1));
  }
}

// the position of the request's query `token` (its first at token0): q_base + token, or POSITIONS its q_pos entry
template <class C, class Params>
__device__ __forceinline__ int query_position(const Params& p, int token0, int token, int q_base) {
  if constexpr (C::POSITIONS) return p.q_pos[token0 + token];
  else return q_base + token;
}

// the variant's q_transform of query row (token, head) of request batch at position q_pos, as a map_chunk function
template <class C, class Params>
__device__ __forceinline__ auto q_map(const Params& p, int batch, int q_pos, int head) {
  return [&p, batch, q_pos, head](float x, int d) {
    return flashgen::variant::q_value<typename C::Variant>(p, x, batch, q_pos, head, d);
  };
}

// fp8 K/V: the Q tile in the mma's type (fp16), each 16-column k-step's columns in the order of the fp8 K
// fragments (decode/tiles.cuh: fp8_k_slot). Column pair i (columns 2i, 2i + 1) of k-step j goes to pair i / 2 +
// 4 (i % 2): chunk 2j of the tile holds pairs 0, 2, 4, 6 of the k-step and chunk 2j + 1 pairs 1, 3, 5, 7, two
// 16-byte stores a k-step. The variant's q_transform first, then RoPE (C::ROPE: the cache holds rotated K, q alone
// turns; a job then takes k-step j and its partner D/2 on); then a bf16 q is multiplied by sm_scale (the kernel
// then scales its scores by 1) and held to fp16's finite range; an fp16 q is moved as it is. Rows past the
// request's end are zeros.
template <class C, class Params>
__device__ __forceinline__ void load_q_fp8(const Params& p, typename C::DTypeMMA* q_smem, int token0, int row0,
                                           int rows_total, int kv_head, int q_base, int batch) {
  using L = Layout<C>;
  using DTypeQ = typename C::DTypeQ;
  using DTypeMMA = typename C::DTypeMMA;
  constexpr bool PRESCALE = !std::is_same_v<DTypeMMA, DTypeQ>;
  constexpr int STEPS = C::HEAD_DIM / 16, PARTS = C::ROPE ? 2 : 1, JOBS = STEPS / PARTS;
  const float scale = p.sm_scale;
  for (int job = threadIdx.x; job < L::TILE_Q * JOBS; job += L::THREADS) {
    const int r = job / JOBS, j = job % JOBS, prow = row0 + r;
    uint4 x[PARTS][2];  // k-steps j (and j + JOBS), their two 8-column chunks
#pragma unroll
    for (int h = 0; h < PARTS; ++h) x[h][0] = x[h][1] = make_uint4(0, 0, 0, 0);
    if (prow < rows_total) {
      const int token = prow / p.group_size, head = kv_head * p.group_size + prow % p.group_size;
      const DTypeQ* src = p.q + (int64_t(token0 + token) * p.num_qo_heads + head) * C::HEAD_DIM + 16 * j;
#pragma unroll
      for (int h = 0; h < PARTS; ++h) {
        x[h][0] = *reinterpret_cast<const uint4*>(src + 16 * JOBS * h);
        x[h][1] = *reinterpret_cast<const uint4*>(src + 16 * JOBS * h + 8);
      }
      const int q_pos = query_position<C>(p, token0, token, q_base);
      if constexpr (C::Variant::Q_TRANSFORM) {
        const auto f = q_map<C>(p, batch, q_pos, head);
#pragma unroll
        for (int h = 0; h < PARTS; ++h) {
          map_chunk<DTypeQ>(x[h][0], 16 * (j + JOBS * h), f);
          map_chunk<DTypeQ>(x[h][1], 16 * (j + JOBS * h) + 8, f);
        }
      }
      if constexpr (C::ROPE) {
        rope_chunk_pair<DTypeQ, C::ROPE_SCALING>(x[0][0], x[1][0], float(q_pos), 16 * j, C::HEAD_DIM, p);
        rope_chunk_pair<DTypeQ, C::ROPE_SCALING>(x[0][1], x[1][1], float(q_pos), 16 * j + 8, C::HEAD_DIM, p);
      }
      if constexpr (PRESCALE) {
#pragma unroll
        for (int h = 0; h < PARTS; ++h)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            uint32_t* w = reinterpret_cast<uint32_t*>(&x[h][c]);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float2 v = unpack2<DTypeQ>(w[i]);
              w[i] = pack2<DTypeMMA>(fminf(fmaxf(v.x * scale, -65504.f), 65504.f),
                                     fminf(fmaxf(v.y * scale, -65504.f), 65504.f));
            }
          }
      }
    }
#pragma unroll
    for (int h = 0; h < PARTS; ++h) {
      const uint4 a = x[h][0], b = x[h][1];
      const int step = j + JOBS * h;
      *reinterpret_cast<uint4*>(q_smem + tile_index(r, 2 * step, L::Q_CHUNKS)) = make_uint4(a.x, a.z, b.x, b.z);
      *reinterpret_cast<uint4*>(q_smem + tile_index(r, 2 * step + 1, L::Q_CHUNKS)) = make_uint4(a.y, a.w, b.y, b.w);
    }
  }
}

// The CTA's Q tile: packed row r = token (r + row0) / group, q head kv_head * group + (r + row0) % group;
// rows past the request's end are zeros. The variant's q_transform (request batch), then RoPE at q_pos = q_base +
// token, through registers; without either by cp.async, in the commit group of the first KV tile, so the CTA does
// not wait for Q before issuing its KV.
template <class C, class Params>
__device__ __forceinline__ void load_q_16bit(const Params& p, typename C::DTypeQ* q_smem, int token0, int row0,
                                             int rows_total, int kv_head, int q_base, int batch) {
  using L = Layout<C>;
  constexpr int ROWS_Q = L::THREADS / L::Q_CHUNKS;  // rows a pass when every thread keeps one chunk column
  constexpr bool THROUGH_REGS = C::ROPE || C::Variant::Q_TRANSFORM;
  if constexpr (!THROUGH_REGS && !C::PAGED && L::THREADS % L::Q_CHUNKS == 0 && L::TILE_Q % ROWS_Q == 0) {
    // thread t copies chunk t % Q_CHUNKS of rows t / Q_CHUNKS + i * ROWS_Q: one division for the first row's
    // token and head, then a step of ROWS_Q rows (d_token tokens and d_head heads, with a carry) a pass, where a
    // division by the runtime group a copy made issuing Q ~2400 cycles of the CTA's ~5700-cycle start (clock64
    // stamps, 4 x 4096). Ragged only: paged variants built this way lost 2-4 % (their main loop's code moved),
    // so they keep the loop below
    const int c = threadIdx.x % L::Q_CHUNKS, r0 = threadIdx.x / L::Q_CHUNKS, g = p.group_size;
    const int d_token = ROWS_Q / g, d_head = ROWS_Q - d_token * g;
    int token = (row0 + r0) / g, head = row0 + r0 - token * g;
    const typename C::DTypeQ* base = p.q + (int64_t(token0) * p.num_qo_heads + kv_head * g) * C::HEAD_DIM + c * 8;
#pragma unroll
    for (int i = 0; i < L::TILE_Q / ROWS_Q; ++i) {
      const bool past = row0 + r0 + i * ROWS_Q >= rows_total;  // zeros; the source (the request's row 0) not read
      const int64_t at = past ? 0 : (int64_t(token) * p.num_qo_heads + head) * C::HEAD_DIM;
      cp_async_16(q_smem + tile_index(r0 + i * ROWS_Q, c, L::Q_CHUNKS), base + at, past);
      token += d_token;
      head += d_head;
      if (head >= g) head -= g, ++token;
    }
    return;
  }
  if constexpr (!THROUGH_REGS) {
    for (int job = threadIdx.x; job < L::TILE_Q * L::Q_CHUNKS; job += L::THREADS) {
      const int r = job / L::Q_CHUNKS, c = job % L::Q_CHUNKS, prow = min(row0 + r, rows_total - 1);
      const int token = prow / p.group_size, head = kv_head * p.group_size + prow % p.group_size;
      const typename C::DTypeQ* src = p.q + (int64_t(token0 + token) * p.num_qo_heads + head) * C::HEAD_DIM;
      cp_async_16(q_smem + tile_index(r, c, L::Q_CHUNKS), src + c * 8, row0 + r >= rows_total);
    }
    return;
  }
  constexpr int HALF = L::Q_CHUNKS / 2;
  for (int job = threadIdx.x; job < L::TILE_Q * HALF; job += L::THREADS) {
    const int r = job / HALF, c = job % HALF, prow = row0 + r;
    uint4 a = make_uint4(0, 0, 0, 0), b = a;
    if (prow < rows_total) {
      const int token = prow / p.group_size, head = kv_head * p.group_size + prow % p.group_size;
      const typename C::DTypeQ* src = p.q + (int64_t(token0 + token) * p.num_qo_heads + head) * C::HEAD_DIM;
      a = *reinterpret_cast<const uint4*>(src + c * 8);
      b = *reinterpret_cast<const uint4*>(src + C::HEAD_DIM / 2 + c * 8);
      if constexpr (C::Variant::Q_TRANSFORM) {
        const auto f = q_map<C>(p, batch, query_position<C>(p, token0, token, q_base), head);
        map_chunk<typename C::DTypeQ>(a, c * 8, f);
        map_chunk<typename C::DTypeQ>(b, C::HEAD_DIM / 2 + c * 8, f);
      }
      if constexpr (C::ROPE && C::POSITIONS)  // the token's true position
        rope_chunk_pair<typename C::DTypeQ, C::ROPE_SCALING>(a, b, float(p.q_pos[token0 + token]), c * 8,
                                                             C::HEAD_DIM, p);
      else if constexpr (C::ROPE)
        rope_chunk_pair<typename C::DTypeQ, C::ROPE_SCALING>(a, b, float(q_base + token), c * 8, C::HEAD_DIM, p);
    }
    *reinterpret_cast<uint4*>(q_smem + tile_index(r, c, L::Q_CHUNKS)) = a;
    *reinterpret_cast<uint4*>(q_smem + tile_index(r, c + HALF, L::Q_CHUNKS)) = b;
  }
}

// The CTA's Q tile in shared memory, in the mma's type: load_q_16bit, or load_q_fp8 for fp8 K/V
template <class C, class Params>
__device__ __forceinline__ void load_q(const Params& p, typename C::DTypeMMA* q_smem, int token0, int row0, int rows_total,
                                       int kv_head, int q_base, int batch) {
  if constexpr (Layout<C>::FP8) load_q_fp8<C>(p, q_smem, token0, row0, rows_total, kv_head, q_base, batch);
  else load_q_16bit<C>(p, q_smem, token0, row0, rows_total, kv_head, q_base, batch);
}

// The CTA's K/V source: where its rows live in global memory and its num_tiles tiles, clipped at kv_hi.
// Tile t starts at kv_lo + t * TILE_KV, or, with a custom mask, where entry t of the item's tile list says
// (tile_entry.cuh; planned on the host: fully masked tiles are not listed; kv_lo = 0). Thread 0 writes it to
// shared memory once; the pipeline reads it there once a tile, so none of it holds a register over the tile's
// math.
template <class C>
struct KVSource {
  KVRows<C::PAGED, C::PAGE_SIZE> rows;
  const typename C::DTypeKV* k_head;  // the kv head's row 0 (ragged: the request's first row, rows.offset(0, 0))
  const typename C::DTypeKV* v_head;
  const int32_t* tiles;  // custom mask: the item's tile list
  int kv_lo, kv_hi, num_tiles;

  // entry t of the tile list (t < num_tiles), or tile t as a FULL entry without a custom mask
  __device__ __forceinline__ int entry(int t) const {
    if constexpr (C::CUSTOM_MASK) return __ldg(tiles + t);
    else return t << ENTRY_SHIFT | ENTRY_FULL;
  }
  __device__ __forceinline__ int start(int e) const { return kv_lo + entry_tile(e) * C::TILE_KV; }
};

// K/V tiles of positions [src.start(src.entry(t)), ...) clipped at kv_hi. Paged: thread tid < TILE_KV owns row
// tid of every tile's offsets in a two-slot ring in shared memory: its page id is loaded two tiles ahead, a row
// past kv_hi copies row kv_hi - 1 (the mask hides it, and its P = 0 multiplies finite V). Ragged: no ring, the
// copying thread computes its rows' offsets, pos * stride_token past the request's first row (k_head points
// there), and rows past kv_hi are zero filled (source ignored; masked, and P = 0 times V = 0). Offsets are in
// bytes, so a copy's source is one 64-bit add to a per-thread base (no shift a copy).
template <class C>
struct KVPipeline {
  using L = Layout<C>;
  using DTypeKV = typename C::DTypeKV;
  // Whole K rows a pass: thread t copies chunk t % K_CHUNKS of rows t / K_CHUNKS + i * ROWS (i < PASSES). Paged:
  // its rows' offsets sit side by side in the ring (slot), so it reads them with PASSES / 2 16-byte loads, ahead
  // of its copies; V reuses them when its rows have K's chunks.
  static constexpr int ROWS = L::THREADS / L::K_CHUNKS, PASSES = L::TILE_KV / (ROWS > 0 ? ROWS : 1);
  static constexpr bool BY_ROWS = L::THREADS % L::K_CHUNKS == 0 && L::TILE_KV % ROWS == 0 && PASSES % 2 == 0;
  static constexpr bool V_SAME = BY_ROWS && L::V_CHUNKS == L::K_CHUNKS;

  const KVSource<C>& src;  // in shared memory
  DTypeKV* k_smem;
  DTypeKV* v_smem;
  int64_t* row_offsets;  // paged: [2][TILE_KV] byte offsets of K rows, row r at slot(r)

  static __device__ __forceinline__ int slot(int r) {
    if constexpr (BY_ROWS) return (r % ROWS) * PASSES + r / ROWS;
    else return r;
  }
  // the position of row tid of a tile (< num_tiles), clamped to the last row
  __device__ __forceinline__ int row_pos(int tile) const {
    return min(src.start(src.entry(tile)) + int(threadIdx.x), src.kv_hi - 1);
  }
  __device__ __forceinline__ int32_t page_of(int tile) const {
    static_assert(C::PAGED, "the ring is the paged layout's");
    if (threadIdx.x >= L::TILE_KV || tile >= src.num_tiles) return 0;
    return src.rows.page(row_pos(tile));
  }
  __device__ __forceinline__ void store_offset(int tile, int32_t page_id) const {
    static_assert(C::PAGED, "the ring is the paged layout's");
    if (threadIdx.x >= L::TILE_KV || tile >= src.num_tiles) return;
    row_offsets[(tile & 1) * L::TILE_KV + slot(threadIdx.x)] =
        src.rows.offset(row_pos(tile), page_id) * int64_t(sizeof(DTypeKV));
  }
  // V rows: the K row offset scaled by HEAD_DIM_VO / HEAD_DIM (the wrapper checks that V's strides are K's so
  // scaled; K offsets are multiples of HEAD_DIM elements, so this holds in elements and in bytes)
  static __device__ __forceinline__ int64_t v_offset(int64_t k_off) {
    if constexpr (L::D == L::DV) return k_off;
    else return k_off / L::D * L::DV;
  }
  // the global address of 16-byte chunk `chunk` of row offset 0: a copy adds its row's byte offset to it
  static __device__ __forceinline__ const char* chunk_base(const DTypeKV* base, int chunk) {
    return reinterpret_cast<const char*>(base) + chunk * 16;
  }
  __device__ __forceinline__ DTypeKV* k_tile(int tile) const { return k_smem + (tile % C::STAGES) * L::TILE_KV * L::D; }
  __device__ __forceinline__ DTypeKV* v_tile(int tile) const { return v_smem + (tile % C::STAGES) * L::TILE_KV * L::DV; }

  // ragged: the tile's first position (a custom mask's list is not read past its end: a dead tile's copies are
  // predicated off, so any position does) and the byte offset of K row pos
  __device__ __forceinline__ int ragged_start(int tile, bool live) const { return src.start(live ? src.entry(tile) : 0); }
  __device__ __forceinline__ int64_t ragged_offset(int pos) const {
    return int64_t(pos) * (src.rows.stride_token * int64_t(sizeof(DTypeKV)));  // k_head is the request's row 0
  }
  // one chunk: predicated on the tile being live; ragged rows past kv_hi zero filled
  template <int OFFSET = 0>
  static __device__ __forceinline__ void copy(uint32_t dst, const char* from, bool live, bool past) {
    if constexpr (C::PAGED) cp_async_16_if<OFFSET>(dst, from, live);
    else cp_async_16_if<OFFSET>(dst, from, live, past);
  }
  // pass I (row r0 + I * ROWS, chunk c) of K (K_PART) and V (V_PART, rows with K's chunks), then the passes after
  // it. With ROWS a multiple of 8 the swizzle repeats every pass, so a pass's shared address is pass 0's plus a
  // constant, passed as an immediate of the copy (ptxas, short of registers, had rebuilt it a copy). Ragged copies
  // K and V row I side by side, so a row's zero-fill predicate lives for two copies, not across 2 PASSES; paged
  // all of K, then V (the order of the baseline register allocation: interleaved, custom mask + ALiBi spilled)
  static constexpr int K_PART = 1, V_PART = 2;
  template <int PARTS, int I = 0>
  __device__ __forceinline__ void copy_passes(DTypeKV* kt, DTypeKV* vt, int r0, int c, const char* k, const char* v,
                                              const int64_t (&off)[PASSES], bool live, int left) const {
    const bool past = I * ROWS >= left;
    if constexpr (ROWS % 8 != 0) {
      if constexpr (PARTS & K_PART) copy(smem_addr(kt + kv_index<DTypeKV>(r0 + I * ROWS, c, L::K_CHUNKS)), k + off[I], live, past);
      if constexpr (PARTS & V_PART) copy(smem_addr(vt + kv_index<DTypeKV>(r0 + I * ROWS, c, L::V_CHUNKS)), v + off[I], live, past);
    } else {
      if constexpr (PARTS & K_PART)
        copy<I * ROWS * L::K_CHUNKS * 16>(smem_addr(kt + kv_index<DTypeKV>(r0, c, L::K_CHUNKS)), k + off[I], live, past);
      if constexpr (PARTS & V_PART)
        copy<I * ROWS * L::V_CHUNKS * 16>(smem_addr(vt + kv_index<DTypeKV>(r0, c, L::V_CHUNKS)), v + off[I], live, past);
    }
    if constexpr (I + 1 < PASSES) copy_passes<PARTS, I + 1>(kt, vt, r0, c, k, v, off, live, left);
  }

  // one chunk at a time: jobs dealt out over the CTA (rows that do not split evenly over the threads)
  template <int CHUNKS, bool IS_V>
  __device__ __forceinline__ void copy_jobs(DTypeKV* dst, const DTypeKV* head, int tile, bool live) const {
    const int64_t* offsets = row_offsets + (tile & 1) * L::TILE_KV;
    const int t0 = C::PAGED ? 0 : ragged_start(tile, live);
#pragma unroll 4
    for (int job = threadIdx.x; job < L::TILE_KV * CHUNKS; job += L::THREADS) {
      const int r = job / CHUNKS, c = job % CHUNKS;
      const int64_t k_off = C::PAGED ? offsets[slot(r)] : ragged_offset(t0 + r);
      const int64_t off = IS_V ? v_offset(k_off) : k_off;
      copy(smem_addr(dst + kv_index<DTypeKV>(r, c, CHUNKS)), reinterpret_cast<const char*>(head) + off + c * 16, live,
           t0 + r >= src.kv_hi);
    }
  }

  // cp.async of one tile's K and V, one commit group. Past the end (tile >= num_tiles) the group is committed
  // empty, so the wait_group counts stay uniform. Ragged: every copy is predicated off rather than branched around
  // (the addresses are formed but not used). Paged: a branch, as its copies wait on the ring's loads anyway;
  // predicated, the live flag and the 8 offsets held together spilled the custom mask + ALiBi kernel (paged 64,
  // fp16: 8 bytes on sm_90a)
  __device__ __forceinline__ void issue(int tile) const {
    const bool live = tile < src.num_tiles;
    if constexpr (C::PAGED) {
      if (!live) {
        cp_async_commit();
        return;
      }
    }
    if constexpr (BY_ROWS) {
      const int r0 = threadIdx.x / L::K_CHUNKS, c = threadIdx.x % L::K_CHUNKS;
      int64_t off[PASSES];
      int left = L::TILE_KV;  // ragged: pass i's row is past kv_hi when i * ROWS >= left
      if constexpr (C::PAGED) {
        const int64_t* offsets = row_offsets + (tile & 1) * L::TILE_KV;
#pragma unroll
        for (int i = 0; i < PASSES / 2; ++i) {
          const longlong2 two = reinterpret_cast<const longlong2*>(offsets + r0 * PASSES)[i];
          off[2 * i] = two.x, off[2 * i + 1] = two.y;
        }
      } else {
        const int pos0 = ragged_start(tile, live) + r0;
        const int64_t o0 = ragged_offset(pos0), step = ragged_offset(ROWS);
        left = src.kv_hi - pos0;
#pragma unroll
        for (int i = 0; i < PASSES; ++i) off[i] = o0 + i * step;
      }
      DTypeKV *kt = k_tile(tile), *vt = v_tile(tile);
      if constexpr (C::PAGED || !V_SAME) {
        // V's base loaded after K's copies: loaded ahead, it held two registers over them (custom mask spilled)
        copy_passes<K_PART>(kt, vt, r0, c, chunk_base(src.k_head, c), nullptr, off, live, left);
        if constexpr (V_SAME) copy_passes<V_PART>(kt, vt, r0, c, nullptr, chunk_base(src.v_head, c), off, live, left);
      } else {
        copy_passes<K_PART | V_PART>(kt, vt, r0, c, chunk_base(src.k_head, c), chunk_base(src.v_head, c), off, live,
                                     left);
      }
      if constexpr (!V_SAME) copy_jobs<L::V_CHUNKS, true>(v_tile(tile), src.v_head, tile, live);
    } else {
      copy_jobs<L::K_CHUNKS, false>(k_tile(tile), src.k_head, tile, live);
      copy_jobs<L::V_CHUNKS, true>(v_tile(tile), src.v_head, tile, live);
    }
    cp_async_commit();
  }

  // A landed 16-bit K tile in shared memory made ready for the mma, once per CTA before any warp reads it: the
  // variant's k_transform on each raw element (request batch, kv head kv_head; key t0 + r, a row past kv_hi asking
  // for the last key, POSITIONS: its true position), then RoPE (ROPE_K)
  template <class Params>
  __device__ __forceinline__ void prepare_k(const Params& p, int tile, const int32_t* page_pos = nullptr, int batch = 0,
                                            int kv_head = 0) const {
    static_assert(!L::FP8, "K prepared in shared memory in 16-bit tiles");
    constexpr int HALF = L::K_CHUNKS / 2;
    DTypeKV* ks = k_tile(tile);
    const int t0 = src.start(src.entry(tile));
    for (int job = threadIdx.x; job < L::TILE_KV * HALF; job += L::THREADS) {
      const int r = job / HALF, c = job % HALF;
      uint4* a = reinterpret_cast<uint4*>(ks + tile_index(r, c, L::K_CHUNKS));
      uint4* b = reinterpret_cast<uint4*>(ks + tile_index(r, c + HALF, L::K_CHUNKS));
      uint4 x = *a, y = *b;
      if constexpr (C::Variant::K_TRANSFORM) {
        int key = min(t0 + r, src.kv_hi - 1);
        if constexpr (C::POSITIONS) key = key_position<C::PAGE_SIZE>(page_pos, key);
        const auto f = [&](float v, int d) {
          return flashgen::variant::k_value<typename C::Variant>(p, v, batch, key, kv_head, d);
        };
        map_chunk<DTypeKV>(x, c * 8, f);
        map_chunk<DTypeKV>(y, L::D / 2 + c * 8, f);
      }
      if constexpr (C::ROPE_K) {
        float pos = float(t0 + r);  // POSITIONS: the key's true position (rows past kv_hi: the last key's)
        if constexpr (C::POSITIONS) pos = float(key_position<C::PAGE_SIZE>(page_pos, min(t0 + r, src.kv_hi - 1)));
        rope_chunk_pair<DTypeKV, C::ROPE_SCALING>(x, y, pos, c * 8, L::D, p);
      }
      *a = x;
      *b = y;
    }
  }
};

}  // namespace flashgen::prefill
