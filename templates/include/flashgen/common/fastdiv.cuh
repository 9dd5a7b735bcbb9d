// Division by a run-time divisor d >= 1 through a multiply-high: the host computes magic and shift once a plan
// (flashgen/api/fastdiv.py, fast_div), the device pays a multiply-high and a shift where a 32-bit `/` by a
// register costs ~20 instructions. Exact for every dividend n in [0, 2^31), d in [1, 2^31):
//   q = __umulhi(2 n, magic) >> shift = floor(n magic / 2^(31 + shift)), shift = ceil(log2 d),
//   magic = ceil(2^(31 + shift) / d) in [2^31, 2^32). The doubling lets d = 1 (magic 2^31, shift 0) use the
//   same formula; the proof is in fast_div's docstring, tests/test_fastdiv.py checks it for d = 1..256.
#pragma once

#include <cstdint>

namespace flashgen {

struct FastDiv {
  uint32_t magic;
  int shift;
  int d;

  // n in [0, 2^31): a negative n gives garbage, not n / d
  __device__ __forceinline__ int div(int n) const { return int(__umulhi(uint32_t(n) << 1, magic) >> shift); }
  __device__ __forceinline__ void divmod(int n, int& q, int& r) const {
    q = div(n);
    r = n - q * d;
  }
};

}  // namespace flashgen
