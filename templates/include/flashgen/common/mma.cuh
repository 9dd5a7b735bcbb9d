// Warp-level tensor-core and async-copy primitives (sm_80+): cp.async, ldmatrix, mma.sync m16n8k16.
//
// Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4):
//   A 16x16 (4 regs): {row g, cols 2t..2t+1}, {row g+8, 2t..}, {row g, 2t+8..}, {row g+8, 2t+8..}
//   B 16x8  (2 regs): {k 2t..2t+1, col g}, {k 2t+8.., col g}
//   C 16x8  (4 fp32): {row g, cols 2t, 2t+1}, {row g+8, cols 2t, 2t+1}
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

namespace flashgen {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte global->shared copy; with fill_zero the destination is zeroed and the source not read.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool fill_zero) {
  const int src_bytes = fill_zero ? 0 : 16;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
// 16-byte global->shared copy to OFFSET bytes past shared address dst (an immediate of the instruction), issued
// only where `issue` holds: a guard predicate on the instruction, no branch; where it fails neither the source
// nor the destination is touched (the address may be anything). L2::128B: the L2 fetches the whole 128-byte
// line (a K/V row's chunks are copied by neighbouring threads, so the line is wanted whole)
template <int OFFSET>
__device__ __forceinline__ void cp_async_16_if(uint32_t dst, const void* src, bool issue) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.cg.shared.global.L2::128B [%0+%3], [%1], 16;\n}\n"
               ::"r"(dst), "l"(src), "r"(int(issue)), "n"(OFFSET));
}
// ... and with fill_zero the destination is zeroed and the source ignored (not read: the address may be past the
// end of the tensor)
template <int OFFSET>
__device__ __forceinline__ void cp_async_16_if(uint32_t dst, const void* src, bool issue, bool fill_zero) {
  asm volatile("{\n .reg .pred p, z;\n setp.ne.b32 p, %2, 0;\n setp.ne.b32 z, %3, 0;\n"
               " @p cp.async.cg.shared.global.L2::128B [%0+%4], [%1], 16, z;\n}\n"
               ::"r"(dst), "l"(src), "r"(int(issue)), "r"(int(fill_zero)), "n"(OFFSET));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* ptr) { ldmatrix_x4(r, smem_addr(ptr)); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* ptr) {
  ldmatrix_x4_trans(r, smem_addr(ptr));
}

// c += a * b for one m16n8k16 tile, fp32 accumulate; T is __half or __nv_bfloat16.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// two floats -> one register of two 16-bit values (lo in the low half)
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half22float2(*reinterpret_cast<__half2*>(&x));
  } else {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&x));
  }
}

// XOR swizzle of 16-byte chunks within each 128-byte line: rows read by ldmatrix hit 8 distinct banks groups.
__device__ __forceinline__ int swizzle(int row, int chunk) { return chunk ^ (row & 7); }

}  // namespace flashgen
