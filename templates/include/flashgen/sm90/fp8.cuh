// The Hopper prefill over fp8 K/V (e4m3, e5m2): the K and V warps' TMA lands each fp8 tile in a staging stage
// (Layout: 64-column blocks of 64-byte rows, unswizzled), and the same warp converts it into the 16-bit stage the
// wgmma descriptors read (128B-swizzled), then arrives on the stage's full barrier, one arrival a lane. The GEMMs
// run in fp16, as the portable prefill's (prefill/fp8.cuh): every fp8 value is exact in fp16, e4m3 converts by
// one cvt a pair and e5m2 by one byte move a pair (common/fp8.cuh). A bf16 q is multiplied by sm_scale and
// rounded to fp16 in shared memory by its consumer warpgroup (prescale_q; the scores are then scaled by 1),
// k_scale is folded into sm_scale on the host and v_scale applied to the output (write_rows).
//
// Cost a 128 x 128 tile (head_dim 128): 1024 16-byte fp8 chunks, 32 a lane, each one 16-byte shared load, eight
// conversions (e4m3: a cvt a pair, the high pair read from the word's upper half; e5m2: a prmt a pair) and two
// 16-byte stores, 11 instructions a chunk, ~357 a lane a tile. Lane l converts chunks l, l + 32, ...: 8 rows of 4
// chunks a warp pass, so the loads read 512 consecutive bytes and the stores hit each bank 4 times (512 bytes): no
// conflicts. Its row is l / 4 modulo 8, so the swizzle is a per-lane constant and every address a per-lane base
// plus an immediate. KV8_AHEAD loads stay in flight ahead of the chunk being converted (3 up to head_dim 128, where
// the producer has 56 registers; 0 at 256, in 40), so the ~30 clk shared-load latency hides behind the previous
// chunks' conversions.
#pragma once
#include <cstdint>
#include <flashgen/common/fp8.cuh>
#include <flashgen/sm90/layout.cuh>
#include <flashgen/sm90/named_barrier.cuh>
#include <flashgen/sm90/tma.cuh>

namespace flashgen::sm90 {

// 16 fp8 values (one 16-byte chunk, words w) -> 16 values of T (words h, in order): e4m3 to fp16 one cvt a pair,
// each word's high pair read from its upper half-register (no shift); else fp8_pair (e5m2 to fp16: one prmt a pair)
template <class T, class FP8>
__device__ __forceinline__ void convert_chunk(const uint32_t (&w)[4], uint32_t (&h)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __half> && std::is_same_v<FP8, __nv_fp8_e4m3>) {
      asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
          : "=r"(h[2 * i]), "=r"(h[2 * i + 1])
          : "r"(w[i]));
    } else {
      h[2 * i] = fp8_pair<T, FP8, 0, 1>(w[i]);
      h[2 * i + 1] = fp8_pair<T, FP8, 2, 3>(w[i]);
    }
  }
}

// The fp8 tile at shared address `staging` into the 16-bit stage at `stage`, by the warp's 32 lanes, once
// wait_stage() returns (the stage's consumers released it; the first AHEAD chunks are read before). Software
// pipelined and fully unrolled: chunk k + AHEAD's load is issued before chunk k is converted and stored, so AHEAD
// loads are in flight behind each conversion (in program order: the loads and stores are volatile), and every
// address is a per-lane base plus an immediate.
template <class C, class Wait>
__device__ __forceinline__ void convert_tile(uint32_t staging, uint32_t stage, int lane, Wait wait_stage) {
  using L = Layout<C>;
  using T = typename C::DTypeMMA;
  using FP8 = typename C::DTypeKV;
  constexpr int PASSES = C::TILE_KV * C::HEAD_DIM / 16 / 32;  // 8-row passes over the tile, a chunk a lane each
  constexpr int AHEAD = C::KV8_AHEAD, SLOTS = AHEAD + 1;
  static_assert(PASSES > AHEAD, "the pipeline fills within the tile");
  const int r = lane / 4, c = lane % 4;  // the lane's row modulo 8 and its 16-column chunk
  const uint32_t src = staging + lane * 16;
  const uint32_t lo = stage + r * 128 + ((2 * c) ^ r) * 16, hi = stage + r * 128 + ((2 * c + 1) ^ r) * 16;
  uint32_t w[SLOTS][4];
  auto load = [&](int k) {
    uint32_t(&v)[4] = w[k % SLOTS];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                 : "r"(src + k * 512));
  };
#pragma unroll
  for (int k = 0; k < AHEAD; ++k) load(k);
  wait_stage();
  // nothing ahead (40 producer registers): two passes an iteration, as few registers as the rolled loop needs
#pragma unroll(AHEAD > 0 ? PASSES : 2)
  for (int k = 0; k < PASSES; ++k) {
    if (k + AHEAD < PASSES) load(k + AHEAD);
    // pass k: rows 8 k .. 8 k + 7 of the tile's 64-column blocks in order (block 8 k / TILE_KV)
    const uint32_t at = (8 * k / C::TILE_KV) * L::KV_BLOCK + (8 * k % C::TILE_KV) * 128;
    uint32_t h[8];
    convert_chunk<T, FP8>(w[k % SLOTS], h);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(lo + at), "r"(h[0]), "r"(h[1]), "r"(h[2]),
                 "r"(h[3]));
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(hi + at), "r"(h[4]), "r"(h[5]), "r"(h[6]),
                 "r"(h[7]));
  }
}

// The K or V warp's tile i (the CTA's running count): its staging stage, once its TMA landed, into its 16-bit
// stage, once the consumers released that; the writes made visible to wgmma (the async proxy) before the lane
// arrives on the stage's full barrier
template <class C>
__device__ __forceinline__ void convert_kv(uint32_t i, uint32_t staging, uint32_t ring, uint32_t full, uint32_t empty,
                                           uint32_t full8, int lane) {
  using L = Layout<C>;
  mbarrier_wait(full8, (i / C::KV8_STAGES) & 1);
  convert_tile<C>(staging + i % C::KV8_STAGES * L::KV8_STAGE, ring + i % C::STAGES * L::KV_STAGE, lane,
                  [&] { mbarrier_wait(empty, ((i / C::STAGES) & 1) ^ 1); });
  fence_proxy_async();
  mbarrier_arrive(full);
}

// A bf16 q with fp8 K/V: the consumer warpgroup's 64 rows of the Q buffer at q_tile, multiplied by sm_scale and
// rounded to fp16 in place, held to fp16's finite range (as the portable prefill's load_q_fp8); then visible to
// the warpgroup's wgmma. Each thread converts 16-byte chunks t, t + 128, ... of the warpgroup's rows in each block.
template <class C>
__device__ __forceinline__ void prescale_q(uint8_t* q_tile, float sm_scale, int wg) {
  using L = Layout<C>;
  constexpr int CHUNKS = L::WG_ROWS * 8;  // 16-byte chunks of the warpgroup's rows in one 64-column block
#pragma unroll
  for (int b = 0; b < L::BLOCKS; ++b)
#pragma unroll
    for (int j = threadIdx.x % 128; j < CHUNKS; j += 128) {
      uint4* at = reinterpret_cast<uint4*>(q_tile + b * L::Q_BLOCK + wg * L::WG_ROWS * 128 + j * 16);
      uint4 v = *at;
      uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 x = unpack2<typename C::DTypeQ>(w[i]);
        w[i] = pack2<typename C::DTypeMMA>(fminf(fmaxf(x.x * sm_scale, -65504.f), 65504.f),
                                           fminf(fmaxf(x.y * sm_scale, -65504.f), 65504.f));
      }
      *at = v;
    }
  fence_proxy_async();
  named_barrier_sync(BARRIER_WARPGROUP + wg, 128);
}

}  // namespace flashgen::sm90
