// Batch prefill on Hopper (sm_90a), FlashAttention-3 recipe.
//
// Persistent CTAs (one per SM) walk the work list: work index x in [0, num_items * num_kv_heads) is kv head
// x / num_items and plan item num_items - 1 - x % num_items (a request's later, longer causal q tiles first);
// CTA c takes x = c, c + gridDim.x, ... Each item is (request, 128-row packed q tile, whole KV range: plans are
// unsplit). Three warpgroups:
//   WG0 producer (setmaxnreg.dec). Warp 0 K, warp 1 V: tiles of TILE_KV tokens by TMA (4-D maps; ragged: one box of
//       TILE_KV rows a 64-column block, paged: one box a page, lanes issuing in parallel) into STAGES-deep rings, each stage with a full
//       barrier (1 arrival + the tile's bytes) and an empty barrier (every consumer thread arrives); the stage
//       counter runs on across items, so the next item's tiles stream in while the consumers finish the last.
//       fp8 K/V land in staging stages the same warp converts to fp16 tiles (sm90/fp8.cuh).
//       Pages TMA cannot take (C::GATHER) are gathered row by row by the warp's lanes with cp.async into the same
//       swizzled layout (kv_gather.cuh); the full barrier then takes 32 arrivals, one a lane once its copies landed
//       (cp.async.mbarrier.arrive.noinc), and consumers fence the async proxy after it.
//       Warps 2-3, the scheduler: each item's plan entries are read once, into a Work published in a ring of
//       WORK_SLOTS shared-memory slots (work_full; every reader releases it by work_empty), so the K and V
//       warps start an item's loads without the plan's dependent global loads; then its 128 packed Q rows into
//       the 128B-swizzled Q tile, once the consumers released that Q buffer (q_empty): where the GQA group
//       divides 128, a 3-D TMA box a 64-column block issued by one thread (q_full takes its bytes), else by
//       cp.async, fence.proxy.async and q_full. An invalid Work ends the list.
//   WG1, WG2 consumers (setmaxnreg.inc): 64 packed q rows each (packed row = token * group + q head in the
//       group). Per KV tile: S = Q K^T (wgmma SS, fp32), online softmax in registers (base 2), P -> 16-bit A
//       fragments, O += P V (wgmma RS, V MN-major). The GEMMs of consecutive tiles overlap the softmax, and the
//       two warpgroups take turns issuing them (ping-pong), continuously across items. An item's last P V is
//       issued together with the next item's first S (Pending), so an item boundary costs one step, not two.
//       Epilogue: where the staging fits in shared memory (C::O_STAGED) and the group divides 16, a warp's 16
//       rows inside the request by stmatrix into a staging area of the warp, then a 3-D TMA store a 64-column
//       block; other rows straight from registers; lse from registers.
//
// Masks: causal (aligned to the KV end: q_pos = kv_len - qo_len + token) clips the KV range to what the tile's
// rows can see, a sliding window (causal, plus keys >= q_pos - window_left) also skips the tiles before the
// first row's window; the element mask runs on tiles that cross kv_hi, a causal or a window boundary of the
// warpgroup's rows. A custom bit mask replaces the range by the item's planned tile list (custom_mask.cuh):
// fully masked tiles are never loaded, the bits are read only for BITS tiles, CAUSAL ones are masked by the
// query positions. ALiBi and soft-cap transform the logits before the mask (logits.cuh).
//
// A variant's q_transform, and RoPE over a cache of rotated K (q alone turns: C::ROPE), run over each item's Q tile
// in shared memory before its first wgmma (q_transform.cuh); a k_transform and K's rotation run in the rope_gather
// pre-pass (they would need a conversion stage between TMA and wgmma).
//
// Files by role: sm90/tile_scheduler.cuh (the work list), layout.cuh (shared memory, mbarriers), producer.cuh
// (K, V and Q loads), q_transform.cuh, mainloop.cuh (the consumers' GEMMs and pipeline), softmax.cuh, epilogue.cuh,
// named_barrier.cuh (the ping-pong turn); this header is the kernel's entry.
#pragma once
#include <cstdint>
#include <flashgen/sm90/layout.cuh>
#include <flashgen/sm90/mainloop.cuh>
#include <flashgen/sm90/named_barrier.cuh>
#include <flashgen/sm90/producer.cuh>
#include <flashgen/sm90/q_transform.cuh>
#include <flashgen/sm90/tma.cuh>

namespace flashgen::sm90 {

template <class C, class Params>
__device__ __forceinline__ void run(const Params& p) {
  using L = Layout<C>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw), base = (raw + 1023) & ~1023u;  // swizzle atoms need 1024 alignment
  uint8_t* smem = smem_raw + (base - raw);
  const Barriers<C> bars{base + L::BAR_OFFSET};
  if (threadIdx.x == 0) bars.init(p.q_tma);
  __syncthreads();

  // the warpgroup through a shuffle from lane 0 (C::UNIFORM_WG): the compiler then knows it is warp-uniform and
  // keeps the addresses and wgmma descriptors derived from it in uniform registers
  const int wg = C::UNIFORM_WG ? __shfl_sync(0xffffffff, threadIdx.x / 128, 0) : int(threadIdx.x / 128);
  if (wg == 0) {
    setmaxnreg_dec<C::PRODUCER_REGS>();
    if constexpr (C::GATHER) {
      if (threadIdx.x < 32)
        gather_kv<C>(smem, p, p.k, base + L::K_OFFSET, &Barriers<C>::full_k, &Barriers<C>::empty_k, bars);
      else if (threadIdx.x < 64)
        gather_kv<C>(smem, p, p.v, base + L::V_OFFSET, &Barriers<C>::full_v, &Barriers<C>::empty_v, bars);
      else
        produce_q_warps<C>(p, smem, bars);
    } else if (threadIdx.x < 32)
      produce_kv<C>(p, p.custom_mask, smem, &p.tma_k, base + L::K_OFFSET, &Barriers<C>::full_k, &Barriers<C>::empty_k,
                    bars, base + L::K8_OFFSET, &Barriers<C>::full_k8);
    else if (threadIdx.x < 64)
      produce_kv<C>(p, nullptr, smem, &p.tma_v, base + L::V_OFFSET, &Barriers<C>::full_v, &Barriers<C>::empty_v,
                    bars, base + L::V8_OFFSET, &Barriers<C>::full_v8);
    else
      produce_q_warps<C>(p, smem, bars);
  } else {
    setmaxnreg_inc<C::CONSUMER_REGS>();
    const Work* slots = reinterpret_cast<const Work*>(smem + L::WORK_OFFSET);
    const PingPong<C> turn{wg - 1};
    turn.start();
    float o[C::HEAD_DIM / 2];
    uint32_t pa[C::TILE_KV / 16][4];
    Pending pd;
    pd.active = false;
    for (uint32_t it = 0, k = 0;; ++k) {  // the published items, until an invalid one (its slot read after q_full)
      mbarrier_wait(bars.q_full(k % C::Q_BUFFERS), (k / C::Q_BUFFERS) & 1);
      const Work w = slots[k % WORK_SLOTS];
      if (!w.valid) break;
      // a variant's hooks' batch: the item's request, published beside its slot
      const int request = C::Variant::ANY ? reinterpret_cast<const int*>(smem + L::REQUEST_OFFSET)[k % WORK_SLOTS] : 0;
      mbarrier_arrive(bars.work_empty(k % WORK_SLOTS));
      if constexpr (C::Variant::Q_TRANSFORM || C::ROPE) transform_q<C>(p, w, smem + k % C::Q_BUFFERS * L::Q_BYTES, wg - 1, request);
      consume<C>(p, w, smem, base, bars, wg - 1, it, k, pd, o, pa, request);
      it += w.num_tiles;
    }
    if (pd.active) flush<C>(p, pd, o, pa, smem, base, bars, wg - 1);
    if constexpr (C::O_STAGED) bulk_wait<0>();  // the last rows' TMA stores, before the CTA's shared memory goes away
    turn.finish();
  }
}

}  // namespace flashgen::sm90
