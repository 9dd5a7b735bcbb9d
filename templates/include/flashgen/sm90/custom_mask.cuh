// Custom bit masks in the Hopper prefill: tile lists and a thread's mask bits.
//
// Tile lists (planned on the host, flashgen/plan/mask_tiles.py): an item visits only its KV tiles that some
// row of its q tile can see, ascending, as entries (tile_entry.cuh). A FULL tile (every pair visible) runs
// without the element mask; a BITS tile with the mask's bits; a CAUSAL tile (its bits are key <= the query's
// position, the diagonal tiles of document masks) with bits made from the query positions, none read.
// A variant's tile predicate (C::TILE_LIST) has lists of the same entries, FULL or BITS (partial: the mask hook
// runs per pair), written on the device by a pre-pass (sm90/tile_lists.cuh). Without either an item's tiles are
// the contiguous range from kv_lo and no entry is read.
//
// Mask bits: request b's [qo_len, kv_len] bit matrix starts at bit mask_offset[b] of custom_mask (row-major,
// little-endian bits: bit i is bit i % 8 of byte i / 8; set = visible). A consumer thread holds rows g and
// g + 8 of its warp's 16, keys t0 + 8 j + 2 q + e (j < TILE_KV / 8, e = 0, 1; see wgmma.cuh), so each of its
// rows needs the TILE_KV bits from bit_row + t0: read as TILE_KV / 32 + 1 aligned 32-bit words (a word is read
// only when it holds a byte of the row, so no read leaves the 4-byte words the mask's own bytes lie in), then
// funnel-shifted and shifted by 2 q, so that key 8 j + 2 q + e is bit 8 (j % 4) + e of word j / 4.
#pragma once
#include <cstdint>
#include <flashgen/common/fastdiv.cuh>
#include <flashgen/common/tile_entry.cuh>
#include <flashgen/sm90/tile_scheduler.cuh>

namespace flashgen::sm90 {

template <class C>
struct TileList {
  // whether an item's tiles come from a list: a custom mask's (planned on the host) or a variant tile
  // predicate's (C::TILE_LIST: written by the pre-pass, sm90/tile_lists.cuh)
  static constexpr bool LISTED = C::CUSTOM_MASK || C::TILE_LIST;
  // entry t of the item's list, else 0 (nothing to read); lists the kernel's own list warp writes (list_warp) by a
  // coherent load, after the barriers that order them (the non-coherent path may not see writes of the kernel)
  __device__ __forceinline__ static int entry(const int32_t* tiles, int t) {
    if constexpr (list_warp<C>()) return load_relaxed(tiles + t);
    else if constexpr (LISTED) return __ldg(tiles + t);
    else return 0;
  }
  // the first KV position of the item's t-th tile (a custom mask's entries count tiles from key 0, a tile
  // predicate's from the item's kv_lo)
  __device__ __forceinline__ static int pos(int kv_lo, int t, int e) {
    if constexpr (C::CUSTOM_MASK) return entry_tile(e) * C::TILE_KV;
    else if constexpr (C::TILE_LIST) return kv_lo + entry_tile(e) * C::TILE_KV;
    else return kv_lo + t * C::TILE_KV;
  }
  // the tile's kind (ENTRY_FULL, ENTRY_BITS or ENTRY_CAUSAL; tile_entry.cuh)
  __device__ __forceinline__ static int kind(int e) { return LISTED ? entry_kind(e) : ENTRY_FULL; }
};

// Into L2 ahead of use: the mask bits of a partial tile at key t0 for every token of item w's packed rows, one
// token a lane (TILE_KV bits span at most TILE_KV / 8 + 1 bytes: two prefetches, at the first byte and 16 bytes
// on, cover them within the 32-byte sectors they touch; the second is clamped to the row's last byte, so no
// prefetch leaves the request's own bits). The K producer warp issues them with the tile's loads, a few steps
// before the consumers read the bits (MaskBits::load), so that those reads hit L2 instead of waiting on DRAM
// under the tile's S.
template <class W>
__device__ __forceinline__ void prefetch_mask_bits(const uint8_t* mask, const W& w, const FastDiv& group, int t0,
                                                   int lane) {
  const int first = group.div(w.row0), last = group.div(w.last_row), kv_len = w.kv_len(group);
  for (int token = first + lane; token <= last; token += 32) {
    const int64_t row = w.mask_bit0 + int64_t(token) * kv_len, at = (row + t0) >> 3;
    const int64_t end = (row + kv_len - 1) >> 3;  // the row's last byte (t0 < kv_len: a partial tile has keys)
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(mask + at));
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(mask + (at + 16 < end ? at + 16 : end)));
  }
}

// the custom-mask bits of a thread's two rows for one KV tile (nothing without a custom mask)
template <class C, bool = C::CUSTOM_MASK>
struct MaskBits {
  template <class W>
  __device__ __forceinline__ void load(const uint8_t*, const W&, const FastDiv&, int, int, int, int) {}
  __device__ __forceinline__ void select(uint32_t (&)[2][1]) const {}
  __device__ __forceinline__ static bool visible(const uint32_t (&)[2][1], int) { return true; }
  using Words = uint32_t[2][1];
};

template <class C>
struct MaskBits<C, true> {
  static constexpr int WORDS = C::TILE_KV / 32;
  using Words = uint32_t[2][WORDS];
  uint32_t raw[2][WORDS + 1];
  int shift[2];

  // start the loads of the thread's rows h = 0, 1 of warpgroup wg of item w (a Work: row0, rows_total,
  // mask_bit0, q_base; group: the GQA group, a row's token is row / group) for keys [t0, t0 + TILE_KV) of a
  // tile of kind `kind` (TileList::kind); a row past the request gets zeros, a FULL tile all ones (only kv_hi
  // can mask it), a CAUSAL tile the bits of keys <= the row's query position (no read). The rows' bit offsets
  // are recomputed a tile rather than held: four registers over the whole item spilled the ALiBi variant.
  template <class W>
  __device__ __forceinline__ void load(const uint8_t* mask, const W& w, const FastDiv& group, int t0, int kv_len,
                                       int kind, int wg) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int prow = w.row0 + wg * 64 + threadIdx.x % 128 / 32 * 16 + threadIdx.x % 32 / 4 + 8 * h;
      const int token = group.div(prow);
      const int64_t bit_row = prow < w.rows_total ? w.mask_bit0 + int64_t(token) * kv_len : -1;
      const uint32_t fill = kind != ENTRY_FULL ? 0u : ~0u;
#pragma unroll
      for (int i = 0; i <= WORDS; ++i) raw[h][i] = fill;
      shift[h] = 0;
      if (kind == ENTRY_FULL || bit_row < 0) continue;
      if (kind == ENTRY_CAUSAL) {  // keys t0 .. q_pos visible: the low q_pos - t0 + 1 bits
        const int n = min(max(w.q_base + token - t0 + 1, 0), C::TILE_KV);
#pragma unroll
        for (int i = 0; i < WORDS; ++i)
          raw[h][i] = n >= 32 * (i + 1) ? ~0u : n <= 32 * i ? 0u : (1u << (n - 32 * i)) - 1u;
        continue;
      }
      const int64_t first = bit_row + t0;
      const uintptr_t at = reinterpret_cast<uintptr_t>(mask) + uintptr_t(first >> 3);
      const uintptr_t last = reinterpret_cast<uintptr_t>(mask) + uintptr_t((bit_row + kv_len - 1) >> 3);
      const uint32_t* words = reinterpret_cast<const uint32_t*>(at & ~uintptr_t(3));
      shift[h] = int(at & 3) * 8 + int(first & 7);
#pragma unroll
      for (int i = 0; i <= WORDS; ++i)
        if (reinterpret_cast<uintptr_t>(words + i) <= last) raw[h][i] = __ldg(words + i);
    }
  }

  // the thread's keys: w[h][j / 4] bit 8 (j % 4) + e is key t0 + 8 j + 2 q + e of row h
  __device__ __forceinline__ void select(Words& w) const {
    const int q2 = 2 * (threadIdx.x % 4);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < WORDS; ++i) w[h][i] = __funnelshift_r(raw[h][i], raw[h][i + 1], shift[h]) >> q2;
  }

  // S register i (row (i / 2) % 2, key 8 (i / 4) + 2 q + i % 2)
  __device__ __forceinline__ static bool visible(const Words& w, int i) {
    return (w[(i / 2) % 2][i / 16] >> (8 * ((i / 4) % 4) + i % 2)) & 1u;
  }
};

}  // namespace flashgen::sm90
