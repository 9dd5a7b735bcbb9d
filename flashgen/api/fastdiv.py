"""Host half of the device's fast divider (``templates/include/flashgen/common/fastdiv.cuh``, ``FastDiv``)."""

from __future__ import annotations


def fast_div(d: int) -> tuple[int, int]:
    """``(magic, shift)`` of divisor ``d`` in [1, 2^31) for ``FastDiv``: for every n in [0, 2^31),
    ``n // d == umulhi(2 n, magic) >> shift``, umulhi the high 32 bits of the 64-bit product of two uint32.

    shift = ceil(log2 d) and magic = ceil(2^(31 + shift) / d), so 2^(shift - 1) < d <= 2^shift and magic lies in
    [2^31, 2^32). Why it is exact: 2 n < 2^32 fits a uint32, and the formula is floor(n magic / 2^(31 + shift)).
    With e = magic d - 2^(31 + shift), 0 <= e < d, and n = q d + r, 0 <= r < d:
    n magic / 2^(31 + shift) = q + (r + n e / 2^(31 + shift)) / d, where n e < 2^31 d <= 2^(31 + shift), so the
    bracket lies in [r, r + 1) within [0, d) and the floor is q. The doubling of n (a 31-bit dividend) is what
    lets d = 1 (magic 2^31, shift 0) use the same formula: with umulhi(n, magic) a magic for d = 1 would need 33
    bits.

    Example::

        >>> fast_div(3)                      # 2^33 / 3 = 2863311530.67 rounded up
        (2863311531, 2)
        >>> magic, shift = fast_div(3)
        >>> ((2 * 7 * magic) >> 32) >> shift  # 7 // 3
        2
        >>> fast_div(1), fast_div(8)
        ((2147483648, 0), (2147483648, 3))
    """
    if not 1 <= d < 2**31:
        raise ValueError(f"d: expected a divisor in [1, 2^31), got {d}")
    shift = (d - 1).bit_length()  # ceil(log2 d)
    magic = -(-(1 << (31 + shift)) // d)
    return magic, shift
