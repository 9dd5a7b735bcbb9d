// A custom mask's tile-list entry, as the host plans it (flashgen/plan/mask_tiles.py, whose ENTRY_* constants
// these are; tests/test_mask_tiles.py checks that the two agree): entry = tile << ENTRY_SHIFT | kind. A FULL
// tile runs without the element mask, a BITS tile with the mask's bits, a CAUSAL tile (its bits are key <= the
// query's position) with bits made from the query positions, none read.
#pragma once

namespace flashgen {

constexpr int ENTRY_SHIFT = 2, ENTRY_FULL = 0, ENTRY_BITS = 1, ENTRY_CAUSAL = 2;

__host__ __device__ __forceinline__ constexpr int entry_tile(int e) { return e >> ENTRY_SHIFT; }
__host__ __device__ __forceinline__ constexpr int entry_kind(int e) { return e & ((1 << ENTRY_SHIFT) - 1); }

}  // namespace flashgen
