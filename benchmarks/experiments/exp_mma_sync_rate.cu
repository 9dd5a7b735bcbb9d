// The mma.sync ceiling of the portable prefill (the instruction it runs on): the peak m16n8k16 bf16 rate (fp32
// accumulate) of this GPU, every warp issuing ILP independent mmas from registers (no shared memory, no loads).
// The operands are fixed bit patterns, not random data, so the power draw (and clock) is not a kernel's.
//   nvcc -O3 -arch=sm_90a -o /tmp/mma_rate benchmarks/experiments/exp_mma_sync_rate.cu && /tmp/mma_rate
// H200, 2026-11-30 (benchmarks/results/mma-sync-rate-2026-11-30.log): 581-647 TFLOP/s (647 with 8-16 warps an SM),
// against 806-810 for the wgmma matmul: the portable kernel's 378-398 is 59-62 % of it.
#include <cstdio>
#include <cuda_runtime.h>
#include <cstdint>
template <int ILP>
__global__ void k(float* out, int iters) {
  uint32_t a0 = threadIdx.x, a1 = a0 * 3, a2 = a0 * 5, a3 = a0 * 7, b0 = a0 * 11, b1 = a0 * 13;
  float c[ILP][4] = {};
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < ILP; ++j)
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                   : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  float s = 0; for (int j = 0; j < ILP; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
  if (s == 12345.f) out[0] = s;
}
template <int ILP>
void run(int warps, int blocks_per_sm, int sms) {
  float* out; cudaMalloc(&out, 4);
  int iters = 4096, blocks = sms * blocks_per_sm, threads = warps * 32;
  k<ILP><<<blocks, threads>>>(out, iters);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  cudaEventRecord(e0);
  for (int r = 0; r < 10; ++r) k<ILP><<<blocks, threads>>>(out, iters);
  cudaEventRecord(e1); cudaEventSynchronize(e1);
  float ms; cudaEventElapsedTime(&ms, e0, e1);
  double flops = 10.0 * blocks * warps * double(iters) * ILP * 2 * 16 * 8 * 16;
  printf("ILP %d warps/block %2d blocks/SM %d: %.0f TFLOP/s\n", ILP, warps, blocks_per_sm, flops / (ms * 1e-3) / 1e12);
  cudaFree(out);
}
int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  for (int w : {4, 8, 16}) { run<4>(w, 1, sms); run<8>(w, 1, sms); run<8>(w, 2, sms); }
  run<16>(8, 2, sms);
  return 0;
}
