// The Hopper prefill's shared memory (Q buffers, K and V stage rings, the O staging of the TMA-store epilogue,
// an fp8 cache's TMA staging rings, the mbarriers, the Work slots, a gathered cache's row addresses) and its
// mbarrier ring.
#pragma once
#include <cstdint>
#include <flashgen/sm90/tile_scheduler.cuh>
#include <flashgen/sm90/tma.cuh>

namespace flashgen::sm90 {

constexpr int Q_LOADERS = 64;  // warps 2-3 of the producer warpgroup (a multiple of a Q row's 16-byte chunks)

// The threads that copy Q by cp.async where it does not come by TMA: warps 2-3, or warp 2 beside the list warp
template <class C>
constexpr int q_loaders() {
  return list_warp<C>() ? 32 : Q_LOADERS;
}

template <class C>
struct Layout {
  static constexpr int D = C::HEAD_DIM, BLOCKS = D / 64;  // 64-column blocks of 128-byte rows
  static constexpr int WG_ROWS = 64, THREADS = 384;
  static constexpr int Q_BLOCK = C::TILE_Q * 128, KV_BLOCK = C::TILE_KV * 128;
  static constexpr int Q_BYTES = BLOCKS * Q_BLOCK, KV_STAGE = BLOCKS * KV_BLOCK;
  static constexpr int K_OFFSET = C::Q_BUFFERS * Q_BYTES;  // Q buffers: the next item's Q loads during this one
  static constexpr int V_OFFSET = K_OFFSET + C::STAGES * KV_STAGE;
  // the staged epilogue (C::O_STAGED): each consumer warp's 16 O rows as its TMA store's box (write_rows), a
  // 128B-swizzled block of 16 rows a 64-column block; 1024-aligned, as all above
  static constexpr int O_STAGE_BLOCK = 16 * 128, O_STAGE_WARP = BLOCKS * O_STAGE_BLOCK;
  static constexpr int O_STAGE_OFFSET = V_OFFSET + C::STAGES * KV_STAGE, O_STAGE_BYTES = C::O_STAGED ? 8 * O_STAGE_WARP : 0;
  // fp8 K/V (sm90/fp8.cuh): the TMA lands each tile in a staging ring of KV8_STAGES stages, unswizzled 64-column
  // blocks of 64-byte rows, which the K or V warp converts into the 16-bit stage above
  static constexpr bool FP8 = sizeof(typename C::DTypeKV) == 1;
  static constexpr int KV8_BLOCK = C::TILE_KV * 64, KV8_STAGE = BLOCKS * KV8_BLOCK;
  static constexpr int K8_OFFSET = O_STAGE_OFFSET + O_STAGE_BYTES, V8_OFFSET = K8_OFFSET + C::KV8_STAGES * KV8_STAGE;
  static constexpr int BAR_OFFSET = V8_OFFSET + (FP8 ? C::KV8_STAGES * KV8_STAGE : 0);
  // barriers, then the Work slots; the dynamic base is aligned up to 1024 at run time
  static constexpr int BAR_BYTES = 256, WORK_OFFSET = BAR_OFFSET + BAR_BYTES, WORK_BYTES = 512, ALIGN_SLACK = 1024;
  // a gathered cache: the K and the V warp's row addresses of the tile they copy (8 bytes each)
  static constexpr int GATHER_OFFSET = WORK_OFFSET + WORK_BYTES, GATHER_BYTES = C::GATHER ? 2 * C::TILE_KV * 8 : 0;
  static constexpr int TOTAL = GATHER_OFFSET + GATHER_BYTES + ALIGN_SLACK;
  static_assert(TOTAL == C::SMEM_BYTES, "codegen and the kernel disagree on the shared-memory size");
  static_assert(C::TILE_Q == 2 * WG_ROWS, "two consumer warpgroups of 64 rows");
  static_assert(O_STAGE_OFFSET % 1024 == 0, "the O staging lies on 128B swizzle atoms");
  static_assert(D % 64 == 0 && sizeof(typename C::DTypeQ) == 2, "rows of whole 128-byte blocks of 16-bit values");
  static_assert(C::TILE_KV % 16 == 0 && C::TILE_KV <= 256 && (C::TILE_KV == 64 || C::TILE_KV == 128 || C::TILE_KV == 256),
                "wgmma N of S");
  static_assert((4 * C::STAGES + 2 * C::Q_BUFFERS + 3 * WORK_SLOTS + 2 * C::KV8_STAGES) * 8 <= BAR_BYTES,
                "barriers fit their region");
  static_assert(FP8 ? C::KV8_STAGES >= 1 && !C::GATHER && sizeof(typename C::DTypeMMA) == 2 : C::KV8_STAGES == 0,
                "fp8 K/V: TMA staging stages (no gathered pages); 16-bit K/V: none");
  static_assert(C::Q_BUFFERS == 1 || C::Q_BUFFERS == 2, "one or two Q buffers");
  static_assert(q_loaders<C>() % (D / 8) == 0, "the Q loaders cover whole rows of 16-byte chunks");
  // a variant's kernel: each slot's request (the hooks' batch) after the slots, so that Work, and with it every
  // other kernel's code, stays as it is
  static constexpr int REQUEST_OFFSET = WORK_OFFSET + WORK_SLOTS * int(sizeof(Work));
  static_assert(WORK_SLOTS * (sizeof(Work) + sizeof(int)) <= WORK_BYTES, "the Work slots fit their region");
  static_assert(C::PRODUCER_REGS * 128 + C::CONSUMER_REGS * 256 <= 65536, "register budgets fit the SM");
};

// The barrier ring: full and empty barriers of K and V for each stage, then Q's full and empty, then the Work
// slots' full and empty, fp8's staging barriers and the list warp's; 8 bytes each.
template <class C>
struct Barriers {
  uint32_t base;
  __device__ __forceinline__ uint32_t full_k(int s) const { return base + 8 * s; }
  __device__ __forceinline__ uint32_t full_v(int s) const { return base + 8 * (C::STAGES + s); }
  __device__ __forceinline__ uint32_t empty_k(int s) const { return base + 8 * (2 * C::STAGES + s); }
  __device__ __forceinline__ uint32_t empty_v(int s) const { return base + 8 * (3 * C::STAGES + s); }
  __device__ __forceinline__ uint32_t q_full(int b) const { return base + 8 * (4 * C::STAGES + b); }
  __device__ __forceinline__ uint32_t q_empty(int b) const { return base + 8 * (4 * C::STAGES + C::Q_BUFFERS + b); }
  __device__ __forceinline__ uint32_t work_full(int j) const { return base + 8 * (4 * C::STAGES + 2 * C::Q_BUFFERS + j); }
  __device__ __forceinline__ uint32_t work_empty(int j) const {
    return base + 8 * (4 * C::STAGES + 2 * C::Q_BUFFERS + WORK_SLOTS + j);
  }
  // fp8 K/V: the staging stages' full barriers (one arrival + the tile's bytes); the K or V warp that waits for
  // one also refills it, so a staging stage needs no empty barrier
  __device__ __forceinline__ uint32_t full_k8(int s) const {
    return base + 8 * (4 * C::STAGES + 2 * C::Q_BUFFERS + 2 * WORK_SLOTS + s);
  }
  __device__ __forceinline__ uint32_t full_v8(int s) const {
    return base + 8 * (4 * C::STAGES + 2 * C::Q_BUFFERS + 2 * WORK_SLOTS + C::KV8_STAGES + s);
  }
  // the list warp (list_warp): item j's tile list is written (one arrival), before the scheduler reads its count
  __device__ __forceinline__ uint32_t list_full(int j) const {
    return base + 8 * (4 * C::STAGES + 2 * C::Q_BUFFERS + 2 * WORK_SLOTS + 2 * C::KV8_STAGES + j);
  }
  // q_tma: Q by TMA (one arrival + the tile's bytes), else by the q_loaders threads' cp.async (each arrives)
  __device__ __forceinline__ void init(bool q_tma) const {
    for (int b = 0; b < C::Q_BUFFERS; ++b) {
      mbarrier_init(q_full(b), q_tma ? 1 : q_loaders<C>());
      mbarrier_init(q_empty(b), 256);
    }
    for (int j = 0; j < WORK_SLOTS; ++j) {
      mbarrier_init(work_full(j), 1);
      mbarrier_init(work_empty(j), WORK_READERS);
      if constexpr (list_warp<C>()) mbarrier_init(list_full(j), 1);
    }
    for (int s = 0; s < C::KV8_STAGES; ++s) {
      mbarrier_init(full_k8(s), 1);
      mbarrier_init(full_v8(s), 1);
    }
    constexpr bool LANES = C::GATHER || sizeof(typename C::DTypeKV) == 1;
    for (int s = 0; s < C::STAGES; ++s) {
      mbarrier_init(full_k(s), LANES ? 32 : 1);  // gathered or fp8: each lane of the warp; TMA: one + the bytes
      mbarrier_init(full_v(s), LANES ? 32 : 1);
      mbarrier_init(empty_k(s), 256);  // every consumer thread arrives once it has finished the tile
      mbarrier_init(empty_v(s), 256);
    }
    fence_barrier_init();
  }
};

// Item j of the CTA's list: its Work slot, once the scheduler published it. The caller releases the slot
// (work_empty) once it is done reading it.
template <class C>
__device__ __forceinline__ const Work& read_work(const uint8_t* smem, const Barriers<C>& bars, uint32_t j) {
  mbarrier_wait(bars.work_full(j % WORK_SLOTS), (j / WORK_SLOTS) & 1);
  return reinterpret_cast<const Work*>(smem + Layout<C>::WORK_OFFSET)[j % WORK_SLOTS];
}

}  // namespace flashgen::sm90
