// Batch prefill on Hopper (sm_90a), FlashAttention-3 recipe, v1 (correctness first).
//
// One CTA runs one work item of the split-KV plan (request, qo tile, whole KV range: plans are unsplit) for
// the kv head blockIdx.y, with 3 warpgroups:
//   WG0 producer: setmaxnreg.dec; one thread streams K and V tiles of TILE_KV tokens by TMA (3-D maps over
//       [total_kv, num_kv_heads, head_dim], box [TILE_KV, 1, 64]) into STAGES-deep rings, each stage with a
//       full barrier (1 arrival + the tile's bytes) and an empty barrier (every consumer thread arrives).
//   WG1, WG2 consumers: setmaxnreg.inc; each owns 64 packed q rows of the 128-row tile (packed row =
//       token * group + q head in the group). Q is loaded once with plain loads into the 128B-swizzled layout.
//       Per KV tile: S = Q K^T (wgmma SS, fp32), online softmax in registers (base 2), P -> 16-bit A
//       fragments, O += P V (wgmma RS, V MN-major), release the stage.
// Epilogue: O / l and lse (natural log) straight from registers to global memory.
//
// Masks: causal (aligned to the KV end: q_pos = kv_len - qo_len + token) clips the KV range to what the tile's
// rows can see; the element mask runs on tiles that cross kv_hi or a causal boundary of the warpgroup's rows.
// Not yet: ping-pong between consumers, softmax/GEMM overlap, persistent scheduling, split-KV partials.
#pragma once
#include <flashgen/logits.cuh>
#include <flashgen/mma.cuh>
#include <flashgen/sm90/tma.cuh>
#include <flashgen/sm90/wgmma.cuh>

namespace flashgen::sm90 {

template <class C>
struct Layout {
  static constexpr int D = C::HEAD_DIM, BLOCKS = D / 64;  // 64-column blocks of 128-byte rows
  static constexpr int WG_ROWS = 64, THREADS = 384;
  static constexpr int Q_BLOCK = C::TILE_Q * 128, KV_BLOCK = C::TILE_KV * 128;
  static constexpr int Q_BYTES = BLOCKS * Q_BLOCK, KV_STAGE = BLOCKS * KV_BLOCK;
  static constexpr int K_OFFSET = Q_BYTES;
  static constexpr int V_OFFSET = K_OFFSET + C::STAGES * KV_STAGE;
  static constexpr int BAR_OFFSET = V_OFFSET + C::STAGES * KV_STAGE;
  static constexpr int BAR_BYTES = 128, ALIGN_SLACK = 1024;  // the dynamic base is aligned up to 1024 at run time
  static constexpr int TOTAL = BAR_OFFSET + BAR_BYTES + ALIGN_SLACK;
  static_assert(TOTAL == C::SMEM_BYTES, "codegen and the kernel disagree on the shared-memory size");
  static_assert(C::TILE_Q == 2 * WG_ROWS, "two consumer warpgroups of 64 rows");
  static_assert(D % 64 == 0 && sizeof(typename C::DTypeQ) == 2, "rows of whole 128-byte blocks of 16-bit values");
  static_assert(C::TILE_KV % 16 == 0 && C::TILE_KV <= 256 && (C::TILE_KV == 64 || C::TILE_KV == 128 || C::TILE_KV == 256),
                "wgmma N of S");
  static_assert(4 * C::STAGES * 8 <= BAR_BYTES, "barriers fit their region");
  static_assert(C::PRODUCER_REGS * 128 + C::CONSUMER_REGS * 256 <= 65536, "register budgets fit the SM");
};

// The barrier ring: full and empty barriers of K and V for each stage, 8 bytes each.
template <class C>
struct Barriers {
  uint32_t base;
  __device__ __forceinline__ uint32_t full_k(int s) const { return base + 8 * s; }
  __device__ __forceinline__ uint32_t full_v(int s) const { return base + 8 * (C::STAGES + s); }
  __device__ __forceinline__ uint32_t empty_k(int s) const { return base + 8 * (2 * C::STAGES + s); }
  __device__ __forceinline__ uint32_t empty_v(int s) const { return base + 8 * (3 * C::STAGES + s); }
  __device__ __forceinline__ void init() const {
    for (int s = 0; s < C::STAGES; ++s) {
      mbarrier_init(full_k(s), 1);
      mbarrier_init(full_v(s), 1);
      mbarrier_init(empty_k(s), 256);  // every consumer thread arrives once it has finished the tile
      mbarrier_init(empty_v(s), 256);
    }
    fence_barrier_init();
  }
};

// The CTA's work: its packed rows and KV range. Packed row prow -> token token0 + prow / group,
// q head kv_head * group + prow % group, query position q_base + prow / group.
struct Work {
  int token0, row0, rows_total, last_row, kv_head, group, q_base, kv_lo, kv_hi, kv_row0, num_tiles;
};

template <class C, class Params>
__device__ __forceinline__ Work work_of(const Params& p, int request, int item) {
  Work w;
  w.token0 = p.qo_indptr[request];
  const int qo_len = p.qo_indptr[request + 1] - w.token0, kv_len = p.kv_len[request];
  w.group = p.group_size;
  w.kv_head = blockIdx.y;
  w.row0 = p.qo_tile_idx[item] * C::TILE_Q;
  w.rows_total = qo_len * w.group;
  w.last_row = min(w.row0 + C::TILE_Q, w.rows_total) - 1;
  w.q_base = kv_len - qo_len;
  w.kv_lo = p.kv_start[item];
  w.kv_hi = p.kv_end[item];
  if constexpr (C::CAUSAL) w.kv_hi = min(w.kv_hi, w.q_base + w.last_row / w.group + 1);
  w.num_tiles = w.kv_hi > w.kv_lo ? (w.kv_hi - w.kv_lo + C::TILE_KV - 1) / C::TILE_KV : 0;
  w.kv_row0 = p.kv_indptr[request] + w.kv_lo;  // row of the K / V tensors (ragged: requests concatenated)
  return w;
}

// WG0, one thread: K and V tiles into the stage rings. Stage s = t % STAGES is refilled once every consumer
// thread released it; a fresh empty barrier passes the first wait (parity 1).
template <class C, class Params>
__device__ __forceinline__ void produce(const Params& p, const Work& w, uint32_t k_smem, uint32_t v_smem,
                                        const Barriers<C>& bars) {
  using L = Layout<C>;
  prefetch_tensormap(&p.tma_k);
  prefetch_tensormap(&p.tma_v);
  for (int t = 0; t < w.num_tiles; ++t) {
    const int s = t % C::STAGES;
    const uint32_t parity = ((t / C::STAGES) & 1) ^ 1;
    const int row = w.kv_row0 + t * C::TILE_KV;
    mbarrier_wait(bars.empty_k(s), parity);
    mbarrier_arrive_expect_tx(bars.full_k(s), L::KV_STAGE);
#pragma unroll
    for (int b = 0; b < L::BLOCKS; ++b)
      tma_load_3d(k_smem + s * L::KV_STAGE + b * L::KV_BLOCK, &p.tma_k, bars.full_k(s), 64 * b, w.kv_head, row);
    mbarrier_wait(bars.empty_v(s), parity);
    mbarrier_arrive_expect_tx(bars.full_v(s), L::KV_STAGE);
#pragma unroll
    for (int b = 0; b < L::BLOCKS; ++b)
      tma_load_3d(v_smem + s * L::KV_STAGE + b * L::KV_BLOCK, &p.tma_v, bars.full_v(s), 64 * b, w.kv_head, row);
  }
}

// The warpgroup's 64 rows of Q into the swizzled Q tile (rows past the request are zeros), then made visible
// to wgmma: fence.proxy.async by every writer, then a barrier of the warpgroup.
template <class C, class Params>
__device__ __forceinline__ void load_q(const Params& p, const Work& w, uint8_t* q_smem, int wg) {
  using L = Layout<C>;
  constexpr int CHUNKS = L::D / 8;  // 16-byte chunks of a row
  const int tid = threadIdx.x % 128;
#pragma unroll 4
  for (int job = tid; job < L::WG_ROWS * CHUNKS; job += 128) {
    const int r = wg * L::WG_ROWS + job / CHUNKS, c = job % CHUNKS, prow = w.row0 + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (prow < w.rows_total) {
      const int64_t qo_row = int64_t(w.token0 + prow / w.group) * p.num_qo_heads + w.kv_head * w.group + prow % w.group;
      v = *reinterpret_cast<const uint4*>(p.q + qo_row * L::D + c * 8);
    }
    *reinterpret_cast<uint4*>(q_smem + (c / 8) * L::Q_BLOCK + r * 128 + (swizzle(r, c % 8) * 16)) = v;
  }
  fence_proxy_async();
  named_barrier_sync(1 + wg, 128);
}

// Issue S = Q K^T over head_dim in k16 steps (asynchronous: the caller commits and waits). Q rows of this
// warpgroup start at q_wg (block 0).
template <class C>
__device__ __forceinline__ void issue_qk(float (&s)[C::TILE_KV / 2], uint32_t q_wg, uint32_t k_stage) {
  using L = Layout<C>;
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < L::D / 16; ++k) {
    const uint32_t col = (k / 4), in_row = (k % 4) * 32;
    Wgmma<C::TILE_KV, typename C::DTypeKV>::ss(s, desc_k_major(q_wg + col * L::Q_BLOCK + in_row),
                                                desc_k_major(k_stage + col * L::KV_BLOCK + in_row), k > 0);
  }
}

// Issue O += P V over the tile's tokens in k16 steps (V: rows = tokens, 64-column blocks at KV_BLOCK bytes)
template <class C>
__device__ __forceinline__ void issue_pv(float (&o)[C::HEAD_DIM / 2], uint32_t (&pa)[C::TILE_KV / 16][4],
                                         uint32_t v_stage) {
  using L = Layout<C>;
  fence_operands(o);
  fence_operands(pa);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < C::TILE_KV / 16; ++kk)
    Wgmma<C::HEAD_DIM, typename C::DTypeKV>::rs(o, pa[kk], desc_mn_major(v_stage + kk * 16 * 128, L::KV_BLOCK), 1);
}

// 2^x by ex2.approx.ftz (exp2f adds a denormal fix-up around the same instruction); 2^-inf = 0
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Per-thread row state: rows g and g + 8 of the warp's 16 (h = 0, 1).
struct RowState {
  float m[2], l[2];
  int q_pos[2];
};

// S -> P in place: P = 2^(S * scale_log2 - m) with the running max m (base 2, scaled units) and sum l; masked
// tiles hide (row, key) pairs past kv_hi or after the row's query position. o_scale is the factor O must be
// multiplied by before P V is added (applied by the caller once the previous P V has completed).
// sm_scale > 0 (checked at plan time): the max of raw S scales to the max of the logits.
template <class C>
__device__ __forceinline__ void softmax(float (&s)[C::TILE_KV / 2], RowState& rs, float (&o_scale)[2],
                                        float scale_log2, bool masked, int t0, int kv_hi) {
  const int q4 = threadIdx.x % 4;
  if (masked) {
#pragma unroll
    for (int i = 0; i < C::TILE_KV / 2; ++i) {
      const int pos = t0 + 8 * (i / 4) + 2 * q4 + i % 2;
      bool ok = pos < kv_hi;
      if constexpr (C::CAUSAL) ok = ok && pos <= rs.q_pos[(i / 2) % 2];
      if (!ok) s[i] = -INFINITY;
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int i = 2 * h; i < C::TILE_KV / 2; i += 4) mx = fmaxf(mx, fmaxf(s[i], s[i + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
    const float m_new = fmaxf(rs.m[h], mx * scale_log2);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet: P = 0, not NaN
    o_scale[h] = exp2_fast(rs.m[h] - m_use);
    rs.m[h] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int i = 2 * h; i < C::TILE_KV / 2; i += 4) {
      s[i] = exp2_fast(fmaf(s[i], scale_log2, -m_use));
      s[i + 1] = exp2_fast(fmaf(s[i + 1], scale_log2, -m_use));
      sum += s[i] + s[i + 1];
    }
    rs.l[h] = rs.l[h] * o_scale[h] + sum;
  }
}

template <class C>
__device__ __forceinline__ void rescale(float (&o)[C::HEAD_DIM / 2], const float (&o_scale)[2]) {
#pragma unroll
  for (int i = 0; i < C::HEAD_DIM / 2; ++i) o[i] *= o_scale[(i / 2) % 2];
}

// P as RS A fragments: k-step kk is S registers 8 kk .. 8 kk + 7 in pairs (see wgmma.cuh)
template <class C>
__device__ __forceinline__ void pack_p(uint32_t (&pa)[C::TILE_KV / 16][4], const float (&s)[C::TILE_KV / 2]) {
#pragma unroll
  for (int kk = 0; kk < C::TILE_KV / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[kk][r] = pack2<typename C::DTypeKV>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
}

// O / l and lse (natural log; -inf for a row that sees no key) of the thread's two rows
template <class C, class Params>
__device__ __forceinline__ void write_rows(const Params& p, const Work& w, const float (&o)[C::HEAD_DIM / 2],
                                           RowState& rs, int wg) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x % 128 / 32, q4 = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = rs.l[h];
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    const int prow = w.row0 + wg * 64 + warp * 16 + lane / 4 + 8 * h;
    if (prow >= w.rows_total) continue;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int64_t row = int64_t(w.token0 + prow / w.group) * p.num_qo_heads + w.kv_head * w.group + prow % w.group;
    typename C::DTypeO* dst = p.o + row * C::HEAD_DIM + 2 * q4;
#pragma unroll
    for (int j = 0; j < C::HEAD_DIM / 8; ++j)
      *reinterpret_cast<uint32_t*>(dst + 8 * j) =
          pack2<typename C::DTypeO>(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
    if (q4 == 0 && p.lse != nullptr) p.lse[row] = l > 0.f ? (rs.m[h] + log2f(l)) * LN2 : -INFINITY;
  }
}

// Ping-pong of the two consumer warpgroups (C::PINGPONG): each takes its turn to issue its GEMMs (hardware
// barrier 3 + wg), then hands the turn to the other, so one warpgroup's softmax runs under the other's GEMMs.
// WG2 gives WG1 the first turn; every step of WG1 hands over, every step of WG2 but its last.
template <class C>
struct Scheduler {
  int wg;
  __device__ __forceinline__ void start(int num_tiles) const {
    if constexpr (C::PINGPONG) if (wg == 1 && num_tiles > 0) named_barrier_arrive(3, 256);
  }
  __device__ __forceinline__ void wait_turn() const {
    if constexpr (C::PINGPONG) named_barrier_sync(3 + wg, 256);
  }
  __device__ __forceinline__ void pass_turn(bool last) const {
    if constexpr (C::PINGPONG) if (wg == 0 || !last) named_barrier_arrive(4 - wg, 256);
  }
};

// WG1 / WG2: the main loop over the CTA's KV tiles. The GEMMs of consecutive tiles overlap the softmax
// (FlashAttention-3's intra-warpgroup pipelining): step t issues S_t = Q K_t and O += P_(t-1) V_(t-1) together,
// waits for S_t only, runs the softmax of tile t under the P V, then waits for it and rescales O.
template <class C, class Params>
__device__ __forceinline__ void consume(const Params& p, const Work& w, uint8_t* smem, uint32_t smem_base,
                                        const Barriers<C>& bars, int wg) {
  using L = Layout<C>;
  load_q<C>(p, w, smem, wg);
  const int warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
  const int wg_first = min(w.row0 + wg * 64, w.last_row);
  const int wq_min = w.q_base + wg_first / w.group;
  RowState rs;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    rs.m[h] = -INFINITY;
    rs.l[h] = 0.f;
    rs.q_pos[h] = w.q_base + (w.row0 + wg * 64 + warp * 16 + lane / 4 + 8 * h) / w.group;
  }
  float o[C::HEAD_DIM / 2];
#pragma unroll
  for (int i = 0; i < C::HEAD_DIM / 2; ++i) o[i] = 0.f;
  const float scale_log2 = p.sm_scale * LOG2E;
  const uint32_t q_wg = smem_base + wg * L::WG_ROWS * 128;
  const uint32_t k_base = smem_base + L::K_OFFSET, v_base = smem_base + L::V_OFFSET;
  const Scheduler<C> sched{wg};
  const int n = w.num_tiles;
  sched.start(n);
  auto masked = [&](int t0) {
    bool m = t0 + C::TILE_KV > w.kv_hi;
    if constexpr (C::CAUSAL) m = m || t0 + C::TILE_KV - 1 > wq_min;
    return m;
  };
  float sc[C::TILE_KV / 2], o_scale[2];
  uint32_t pa[C::TILE_KV / 16][4];
  if (n > 0) {
    mbarrier_wait(bars.full_k(0), 0);
    sched.wait_turn();
    issue_qk<C>(sc, q_wg, k_base);
    wgmma_commit();
    sched.pass_turn(false);
    wgmma_wait<0>();
    fence_operands(sc);
    mbarrier_arrive(bars.empty_k(0));
    softmax<C>(sc, rs, o_scale, scale_log2, masked(w.kv_lo), w.kv_lo, w.kv_hi);
    pack_p<C>(pa, sc);
  }
  for (int t = 1; t < n; ++t) {
    const int s = t % C::STAGES, prev = (t - 1) % C::STAGES;
    const int t0 = w.kv_lo + t * C::TILE_KV;
    mbarrier_wait(bars.full_k(s), (t / C::STAGES) & 1);
    mbarrier_wait(bars.full_v(prev), ((t - 1) / C::STAGES) & 1);
    sched.wait_turn();
    issue_qk<C>(sc, q_wg, k_base + s * L::KV_STAGE);
    wgmma_commit();
    issue_pv<C>(o, pa, v_base + prev * L::KV_STAGE);
    wgmma_commit();
    sched.pass_turn(false);
    wgmma_wait<1>();
    fence_operands(sc);
    mbarrier_arrive(bars.empty_k(s));
    softmax<C>(sc, rs, o_scale, scale_log2, masked(t0), t0, w.kv_hi);
    wgmma_wait<0>();
    fence_operands(o);
    fence_operands(pa);
    mbarrier_arrive(bars.empty_v(prev));
    rescale<C>(o, o_scale);
    pack_p<C>(pa, sc);
  }
  if (n > 0) {
    const int last = (n - 1) % C::STAGES;
    mbarrier_wait(bars.full_v(last), ((n - 1) / C::STAGES) & 1);
    sched.wait_turn();
    issue_pv<C>(o, pa, v_base + last * L::KV_STAGE);
    wgmma_commit();
    sched.pass_turn(true);
    wgmma_wait<0>();
    fence_operands(o);
    mbarrier_arrive(bars.empty_v(last));
  }
  write_rows<C>(p, w, o, rs, wg);
}

template <class C, class Params>
__device__ __forceinline__ void run(const Params& p) {
  using L = Layout<C>;
  const int item = gridDim.x - 1 - blockIdx.x;  // the plan lists a request's q tiles in order: later (longer causal) tiles first
  const int request = p.request_idx[item];
  if (request < 0) return;  // padding item of a fixed-capacity plan (uniform over the CTA)
  const Work w = work_of<C>(p, request, item);

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw), base = (raw + 1023) & ~1023u;  // swizzle atoms need 1024 alignment
  uint8_t* smem = smem_raw + (base - raw);
  const Barriers<C> bars{base + L::BAR_OFFSET};
  if (threadIdx.x == 0) bars.init();
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<C::PRODUCER_REGS>();
    if (threadIdx.x == 0) produce<C>(p, w, base + L::K_OFFSET, base + L::V_OFFSET, bars);
  } else {
    setmaxnreg_inc<C::CONSUMER_REGS>();
    consume<C>(p, w, smem, base, bars, wg - 1);
  }
}

}  // namespace flashgen::sm90
