// Split-KV partials merged without a second launch, and the lse-weighted combine of attention states.
//
// The protocol (decode and the portable prefill): each CTA of a split unit (a request's head group, a prefill q
// tile) writes its partial, fp32 O and natural-log lse, then counts itself in on the unit's counter; the last
// of the unit's num_partials CTAs merges every partial into the output and sets the counter back to 0, so the
// next launch, or a CUDA-graph replay, starts from zero. How a caller moves the partials (decode: cp.async
// batches a warp per row; prefill: register batches a thread per 8 columns) is its own; the count, the last
// arrival, the ordering and the reset are merge_if_last's, and the -inf lse handling MergeState's.
//
// The combine (also the standalone merge kernels'): s = log(sum_k exp(s_k)), o = sum_k o_k exp(s_k - s). A
// partial with s_k = -inf (no visible key) has weight 0; if every s_k is -inf the result is o = 0, s = -inf.
#pragma once
#include <cmath>

namespace flashgen {

// atomicAdd with acquire and release semantics at GPU scope: returns the old value
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* address, int value) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(address), "r"(value) : "memory");
  return old;
}

// The last of `num_partials` CTAs to count in on `counter` runs merge() (every thread of it), then resets the
// counter. Call it from every thread of the CTA once the CTA's partial is written. Why it is correct (PTX memory
// model): the barrier orders every thread's partial writes before thread 0's atom, whose release is cumulative,
// so one release per CTA publishes the whole partial (no per-thread fence); the atoms on a counter form one
// release sequence, so the last CTA's acquire sees every partial, and the second barrier orders that acquire
// before its other threads' loads. The reset needs no barrier: every CTA of the unit has counted in, and no
// thread reads the counter again in this launch; the kernel's end publishes it to the next launch.
template <class Merge>
__device__ __forceinline__ void merge_if_last(int* counter, int num_partials, Merge&& merge) {
  __shared__ int is_last;
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomic_add_acq_rel_gpu(counter, 1) == num_partials - 1;
  __syncthreads();
  if (!is_last) return;
  merge();
  if (threadIdx.x == 0) *counter = 0;
}

// The running state of an online lse-weighted combine over batches of partials: m, the largest lse so far;
// sum, the sum of exp(lse_k - m). A batch starts with begin(its largest lse), which returns the factor the
// accumulated output must be scaled by (0 while nothing was visible); weight(lse_k) is then partial k's weight,
// added to sum by add(). An lse of -inf weighs 0, and while every lse is -inf the base is 0, never -inf - -inf.
struct MergeState {
  float m = -INFINITY, sum = 0.f, base = 0.f;

  MergeState() = default;
  // every partial in one batch whose largest lse is max_lse: no rescale to come
  __device__ __forceinline__ explicit MergeState(float max_lse)
      : m(max_lse), sum(0.f), base(max_lse == -INFINITY ? 0.f : max_lse) {}
  __device__ __forceinline__ float begin(float batch_max) {
    const float m_new = fmaxf(m, batch_max);
    base = m_new == -INFINITY ? 0.f : m_new;
    const float scale = expf(m - base);  // 0 on the first visible batch (m = -inf)
    sum *= scale;
    m = m_new;
    return scale;
  }
  __device__ __forceinline__ float weight(float lse) const { return expf(lse - base); }
  __device__ __forceinline__ void add(float w) { sum += w; }
  // 1 / sum, or 0 for a row that sees no key (its output 0)
  __device__ __forceinline__ float inv_sum() const { return sum > 0.f ? 1.f / sum : 0.f; }
  // the merged lse (natural log), -inf for a row that sees no key
  __device__ __forceinline__ float lse() const { return sum > 0.f ? m + logf(sum) : -INFINITY; }
};

}  // namespace flashgen
