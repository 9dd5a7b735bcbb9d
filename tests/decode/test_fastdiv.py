"""fast_div's magic numbers against floor division, through the device formula of fastdiv.cuh in uint64 numpy."""

import doctest

import numpy as np
import pytest

from flashgen.api import fastdiv
from flashgen.api.fastdiv import fast_div

DIVISORS = range(1, 257)  # GQA groups: num_qo_heads / num_kv_heads


def device_div(n: np.ndarray, magic: int, shift: int) -> np.ndarray:
    """FastDiv::div: __umulhi(uint32(n) << 1, magic) >> shift, every step in uint64 as the hardware's 32-bit
    operands and 64-bit product."""
    n2 = (n.astype(np.uint64) << np.uint64(1)) & np.uint64(0xFFFFFFFF)
    return ((n2 * np.uint64(magic)) >> np.uint64(32)) >> np.uint64(shift)


def dividends(d: int) -> np.ndarray:
    # the edges: 0, around d and its multiples near the top, the largest int32; then random ones
    top = 2**31 - 1
    edges = [0, 1, d - 1, d, d + 1, 2 * d - 1, 2 * d, top, top - 1, top - top % d, top - top % d - 1]
    edges += [2**k + j for k in range(31) for j in (-1, 0, 1)]
    rng = np.random.default_rng(d)
    n = np.concatenate([np.array(edges, np.int64), rng.integers(0, 2**31, 20000), rng.integers(0, 1 << 16, 5000)])
    return n[(n >= 0) & (n < 2**31)]


@pytest.mark.parametrize("d", DIVISORS)
def test_fast_div_is_floor_division(d):
    magic, shift = fast_div(d)
    assert 2**31 <= magic < 2**32 and 0 <= shift <= 31  # a uint32 magic and a valid 32-bit shift
    n = dividends(d)
    q = device_div(n, magic, shift)
    np.testing.assert_array_equal(q, n // d)
    # divmod's remainder n - q d is in [0, d)
    assert ((n - q.astype(np.int64) * d >= 0) & (n - q.astype(np.int64) * d < d)).all()


@pytest.mark.parametrize("d", DIVISORS)
def test_an_off_by_one_magic_is_caught(d):
    # the check above can fail: a magic rounded down (floor instead of ceil, or one less) gives d // d = 0
    magic, shift = fast_div(d)
    n = dividends(d)
    assert (device_div(n, magic - 1, shift) != n // d).any()
    assert (device_div(n, (1 << (31 + shift)) // d, shift) != n // d).any() == (d & (d - 1) != 0)


def test_largest_divisors_and_errors():
    for d in (2**31 - 1, 2**30 + 1, 2**30, 3 << 29):
        magic, shift = fast_div(d)
        n = np.array([0, d - 1, d, 2**31 - 1, 2 * d - 1 if 2 * d - 1 < 2**31 else 0], np.int64)
        np.testing.assert_array_equal(device_div(n, magic, shift), n // d)
    for bad in (0, -3, 2**31):
        with pytest.raises(ValueError, match="d: expected a divisor"):
            fast_div(bad)


def test_docstring_example():
    assert doctest.testmod(fastdiv).failed == 0
