// Named (hardware) barriers of the Hopper prefill and the ping-pong turn of its two consumer warpgroups, which
// FlashAttention-3 calls its warp scheduler barriers (named_barrier.hpp). Barrier 0 is __syncthreads; ids 1-2
// are each consumer warpgroup's own 128 threads (zero_v_tail), ids 3-4 the turns.
#pragma once
#include <cstdint>

namespace flashgen::sm90 {

// a barrier of `threads` threads (a multiple of 32) on hardware barrier `id` (0 is __syncthreads)
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// counts the calling warps towards barrier `id` without waiting for it
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// consumer warpgroup wg's own barrier (128 threads): BARRIER_WARPGROUP + wg
constexpr uint32_t BARRIER_WARPGROUP = 1;
// consumer warpgroup wg's turn to issue its GEMMs (both warpgroups, 256 threads): BARRIER_TURN + wg
constexpr uint32_t BARRIER_TURN = 3;

// Ping-pong of the two consumer warpgroups (C::PINGPONG): each takes its turn to issue its GEMMs (hardware
// barrier BARRIER_TURN + wg), then hands the turn to the other, so one warpgroup's softmax runs under the
// other's GEMMs.
// The turns run on across items (both warpgroups take num_tiles + 1 steps an item): WG1 may issue the next
// item's first S while WG2 finishes this one. WG2 gives WG1 the first turn (start), and WG1 takes the last
// hand-over at the end of the list (finish), so both barriers end balanced.
template <class C>
struct PingPong {
  int wg;
  __device__ __forceinline__ void start() const {
    if constexpr (C::PINGPONG) if (wg == 1) named_barrier_arrive(BARRIER_TURN, 256);
  }
  __device__ __forceinline__ void finish() const {
    if constexpr (C::PINGPONG) if (wg == 0) named_barrier_sync(BARRIER_TURN, 256);
  }
  __device__ __forceinline__ void wait_turn() const {
    if constexpr (C::PINGPONG) named_barrier_sync(BARRIER_TURN + wg, 256);
  }
  __device__ __forceinline__ void pass_turn() const {
    if constexpr (C::PINGPONG) named_barrier_arrive(BARRIER_TURN + 1 - wg, 256);
  }
};

}  // namespace flashgen::sm90
