"""The tracer's C types: an int computed in 32 bits only where its value and every int it is computed from
provably fit them (the hooks' int inputs are non-negative C ints), else in 64 bits as before."""

from __future__ import annotations

from flashgen import Variant, variant_ops as ops
from flashgen.variants.examples import EXAMPLES


def test_t5_bucket_in_32_bits():
    body = EXAMPLES["t5_bias"][0].score.body
    # |kv - q| < 8 narrows the exact branch to [0, 7]; the other is clamped to [0, 15]: the floor fits an int
    assert "long long" not in body and "LL" not in body
    assert "static_cast<int>(floorf(" in body and "fg_abs((kv_idx - qo_idx))" in body


def test_products_past_32_bits_stay_64():
    v = Variant(score=lambda score, q_idx, kv_idx: score + (kv_idx * 4 - q_idx))
    assert "static_cast<long long>(kv_idx) * 4" in v.score.body
    big = Variant(score=lambda score, kv_idx: score + (kv_idx + 3_000_000_000))
    assert "3000000000LL" in big.score.body


def test_floor_of_an_unbounded_float_stays_64():
    v = Variant(score=lambda score, kv_idx: score + ops.floor(score * 2.0) + kv_idx)
    assert "static_cast<long long>(floorf(" in v.score.body


def test_where_narrows_only_its_own_branches():
    # n < 8 bounds n in the first branch only: the floor of the second (n up to 2^31 - 1, as a float) stays 64-bit
    v = Variant(score=lambda score, kv_idx: score + ops.where(kv_idx < 8, ops.floor(kv_idx * 1.0),
                                                              ops.floor(kv_idx * 1.0)))
    assert "static_cast<long long>(floorf(" in v.score.body
    w = Variant(score=lambda score, kv_idx: score + ops.where(kv_idx < 8, ops.floor(kv_idx + 0.5), 0))
    assert "static_cast<int>(floorf(" in w.score.body


def test_bits_stay_64():
    v = Variant(mask=lambda q_idx, kv_idx: ((q_idx >> kv_idx) & 1) == 1)
    assert "static_cast<long long>(qo_idx) >> static_cast<long long>(kv_idx)" in v.mask.body
