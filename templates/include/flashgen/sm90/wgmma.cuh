// Warpgroup matrix multiply (wgmma, sm_90a): shared-memory matrix descriptors for 128B-swizzled tiles, the
// m64nNk16 SS / RS instructions for 16-bit inputs with fp32 accumulators, and the fence / commit / wait.
//
// Tiles. A 128B-swizzled tile is stored as column blocks of 64 elements (128 bytes a row); block b holds the
// tile's rows, row r at r * 128 bytes, its 16-byte chunk c at ((c ^ (r % 8)) * 16) (TMA's SWIZZLE_128B and
// flashgen::swizzle write exactly this). Blocks and tiles are 1024-byte aligned (8 rows = one swizzle atom).
//
// Descriptors (PTX ISA "matrix descriptor"): bits 0-13 start address >> 4, 16-29 leading byte offset >> 4,
// 32-45 stride byte offset >> 4, 49-51 base offset (0: atoms are 1024-aligned), 62-63 swizzle (1 = 128B).
//   K-major (A = Q, B = K of S = Q K^T): rows are M/N, 8-row groups at SBO = 1024; LBO unused (the k16 step,
//     32 bytes, stays inside one 128-byte row); the k-th 16-column step adds k * 32 bytes to the start
//     address within a block.
//   MN-major (B = V of O = P V, imm-trans-b = 1): rows are K (kv tokens), 64 N-elements (d) contiguous; 8-row
//     groups at SBO = 1024, the next 64 N-elements (next column block) at LBO = block bytes; the kk-th
//     16-token step adds kk * 2048 bytes.
//
// Accumulator fragment of m64nN (thread t of the warpgroup, warp w = t / 32, g = t % 32 / 4, q = t % 4):
//   d[i]: row 16 w + g + 8 * ((i / 2) % 2), column 8 * (i / 4) + 2 q + i % 2.
// A fragment of RS (16 x 16 per warp, as mma.sync m16n8k16): a0 (g, 2q..), a1 (g + 8, 2q..), a2 (g, 2q + 8..),
// a3 (g + 8, 2q + 8..): the accumulator registers 8 kk .. 8 kk + 7 of S, packed in pairs, are P's k-step kk.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace flashgen::sm90 {

__device__ __forceinline__ uint64_t smem_desc(uint32_t smem_address, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  uint64_t desc = (smem_address & 0x3FFFF) >> 4;
  desc |= uint64_t((lbo_bytes >> 4) & 0x3FFF) << 16;
  desc |= uint64_t((sbo_bytes >> 4) & 0x3FFF) << 32;
  desc |= uint64_t(1) << 62;  // 128B swizzle
  return desc;
}
// K-major operand starting at a 1024-aligned block plus k * 32 bytes
__device__ __forceinline__ uint64_t desc_k_major(uint32_t smem_address) { return smem_desc(smem_address, 16, 1024); }
// MN-major operand: column blocks of `block_bytes`
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t smem_address, uint32_t block_bytes) {
  return smem_desc(smem_address, block_bytes, 1024);
}
// The descriptor of the operand `bytes` further on: the start address field (bits 0-13) plus bytes >> 4, as one
// 32-bit add to the low word. Shared-memory addresses stay below 2^18 (228 KB), so the field never carries into
// bit 14; the compiler cannot know that, and rebuilding each k-step's descriptor from its address cost ~10
// uniform-datapath instructions a wgmma (~180 of the ~200 instructions that issue a tile's 16).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return (desc & 0xFFFFFFFF00000000ull) | uint32_t(uint32_t(desc) + (bytes >> 4));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// keeps the compiler from moving reads or writes of accumulator registers across wgmma fence / wait
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operands(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}

#define FG_WGMMA_F8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
    "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define FG_WGMMA_F32(d, i) FG_WGMMA_F8(d, i), FG_WGMMA_F8(d, i + 8), FG_WGMMA_F8(d, i + 16), FG_WGMMA_F8(d, i + 24)
#define FG_WGMMA_OPS_64 FG_WGMMA_F32(d, 0)
#define FG_WGMMA_OPS_128 FG_WGMMA_F32(d, 0), FG_WGMMA_F32(d, 32)
#define FG_WGMMA_OPS_256 FG_WGMMA_F32(d, 0), FG_WGMMA_F32(d, 32), FG_WGMMA_F32(d, 64), FG_WGMMA_F32(d, 96)
#define FG_WGMMA_ACC_64 "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FG_WGMMA_ACC_128 "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define FG_WGMMA_ACC_256 "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
// operands after the accumulators: SS (desc_a, desc_b, scale_d); RS (a0..a3, desc_b, scale_d)
#define FG_SS_SCALE_64 "%34"
#define FG_SS_SCALE_128 "%66"
#define FG_SS_SCALE_256 "%130"
#define FG_SS_TAIL_64 "%32, %33"
#define FG_SS_TAIL_128 "%64, %65"
#define FG_SS_TAIL_256 "%128, %129"
#define FG_RS_SCALE_64 "%37"
#define FG_RS_SCALE_128 "%69"
#define FG_RS_SCALE_256 "%133"
#define FG_RS_TAIL_64 "{%32, %33, %34, %35}, %36"
#define FG_RS_TAIL_128 "{%64, %65, %66, %67}, %68"
#define FG_RS_TAIL_256 "{%128, %129, %130, %131}, %132"

// Wgmma<N, T>::ss: d (+)= A B^T with A (64 x 16) and B (N x 16) K-major in shared memory.
// Wgmma<N, T>::rs: d (+)= A B with A (64 x 16) in registers and B (16 x N) MN-major in shared memory.
// scale_d = 0 overwrites d (the first k-step), 1 accumulates.
template <int N, class T>
struct Wgmma;

#define FG_DEFINE_WGMMA(N, T, PTX_T)                                                                             \
  template <>                                                                                                    \
  struct Wgmma<N, T> {                                                                                           \
    __device__ __forceinline__ static void ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " FG_SS_SCALE_##N ", 0;\n"                                  \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_T "." PTX_T " " FG_WGMMA_ACC_##N        \
                   ", " FG_SS_TAIL_##N ", p, 1, 1, 0, 0;\n}\n"                                                   \
                   : FG_WGMMA_OPS_##N                                                                            \
                   : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                                    \
    }                                                                                                            \
    __device__ __forceinline__ static void rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b,         \
                                              int scale_d) {                                                     \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " FG_RS_SCALE_##N ", 0;\n"                                  \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_T "." PTX_T " " FG_WGMMA_ACC_##N        \
                   ", " FG_RS_TAIL_##N ", p, 1, 1, 1;\n}\n"                                                      \
                   : FG_WGMMA_OPS_##N                                                                            \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));                     \
    }                                                                                                            \
  };

FG_DEFINE_WGMMA(64, __nv_bfloat16, "bf16")
FG_DEFINE_WGMMA(128, __nv_bfloat16, "bf16")
FG_DEFINE_WGMMA(256, __nv_bfloat16, "bf16")
FG_DEFINE_WGMMA(64, __half, "f16")
FG_DEFINE_WGMMA(128, __half, "f16")
FG_DEFINE_WGMMA(256, __half, "f16")

}  // namespace flashgen::sm90
