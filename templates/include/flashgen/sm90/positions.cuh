// Explicit true positions in the Hopper prefill (C::POSITIONS; common/positions.cuh): a consumer thread's query
// rows at q_pos[token], its keys at their page's kv_page_pos entry + the offset in the page (Ragged: a position
// per key). Without the option KeyPositions is empty and the kernel numbers keys by their place.
#pragma once
#include <cstdint>
#include <flashgen/common/positions.cuh>
#include <flashgen/sm90/tile_scheduler.cuh>

namespace flashgen::sm90 {

template <class C, class Params, bool = C::POSITIONS>
struct KeyPositions {
  __device__ __forceinline__ KeyPositions(const Params&, const Work&) {}
};

template <class C, class Params>
struct KeyPositions<C, Params, true> {
  static constexpr int PS = C::PAGED ? C::PAGE_SIZE : 1;  // keys a kv_page_pos entry
  const Params& p;  // kv_page_pos read from the params at each use: no 64-bit address held across the item
  int first;        // the request's first entry
  int last;         // its last entry (reads of keys past the request are clamped to it: those keys are masked)

  // paged (CSR page tables only: the wrappers refuse a block table with positions): the request's entries start
  // where its page ids do; ragged: at its first row
  __device__ __forceinline__ KeyPositions(const Params& params, const Work& w)
      : p(params), first(C::PAGED ? int(w.pages - params.kv_indices) : w.kv_row0), last(max(w.kv_hi - 1, 0) / PS) {}

  // the position of S register i's key of the tile at t0 (a multiple of TILE_KV): place t0 + 8 (i / 4) + 2 q +
  // i % 2, q = lane % 4 (wgmma.cuh). Where pages are multiples of 8 the 8 keys from t0 + 8 (i / 4) share a page,
  // so one entry serves a thread's 4 registers of them (and every lane of the warp reads the same one)
  __device__ __forceinline__ int at(int t0, int i) const {
    const int e = 2 * (threadIdx.x % 4) + i % 2, j8 = 8 * (i / 4);
    int entry, offset;
    if constexpr (PS % 8 == 0 && C::TILE_KV % PS == 0) {
      entry = t0 / PS + j8 / PS, offset = j8 % PS + e;
    } else if constexpr (PS % 8 == 0 && PS % C::TILE_KV == 0) {
      entry = t0 / PS, offset = t0 % PS + j8 + e;
    } else if constexpr (PS % 8 == 0) {
      entry = (t0 + j8) / PS, offset = (t0 + j8) % PS + e;
    } else {
      entry = (t0 + j8 + e) / PS, offset = (t0 + j8 + e) % PS;
    }
    return __ldg(p.kv_page_pos + first + min(entry, last)) + offset;
  }
};

// the query position of packed row token (of the item's qo_len = rows_total / group tokens; rows past the
// request read its last token's)
template <class C, class Params>
__device__ __forceinline__ int query_position(const Params& p, const Work& w, int token, int qo_len) {
  if constexpr (C::POSITIONS) return __ldg(p.q_pos + w.token0 + min(token, qo_len - 1));
  else return w.q_base + token;
}

}  // namespace flashgen::sm90
