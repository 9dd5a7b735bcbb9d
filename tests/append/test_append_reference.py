"""The reference of the KV-cache write (flashgen.testing.append), checked on its own on the CPU: where rows land,
what is skipped, RoPE against the attention reference's and Hugging Face's Llama-3.1 formula, the cos/sin table
against theta, fp8 quantisation and scales, layouts and cache forms."""

import math

import numpy as np
import pytest
import torch

from flashgen import Llama31Scaling, RoPE
from flashgen.testing import append_kv_ref, apply_rope, assert_cache_close, cos_sin_table, rope_inv_freq

E4M3 = torch.float8_e4m3fn


def _pool(pages, page_size, heads, dim, dtype=torch.bfloat16, order="NHD"):
    shape = (pages, page_size, heads, dim) if order == "NHD" else (pages, heads, page_size, dim)
    return torch.full(shape, float("nan")).to(dtype)


def _nhd(cache, order):
    return cache.transpose(1, 2) if order == "HND" else cache


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_csr_rows_land_at_their_positions_and_invalid_tokens_are_skipped(order):
    page_size, heads, dim = 4, 2, 64
    pool = (_pool(6, page_size, heads, dim, order=order), _pool(6, page_size, heads, dim, order=order))
    indptr, indices = torch.tensor([0, 2, 3]), torch.tensor([5, 1, 3])  # request 0: pages 5, 1; request 1: page 3
    batch = torch.tensor([0, 0, 1, -1, 1, 2])
    pos = torch.tensor([3, 4, 2, 0, 4, 0])  # token 3: padding; 4: beyond request 1's page; 5: no request 2
    k, v = torch.randn(6, heads, dim).bfloat16(), torch.randn(6, heads, dim).bfloat16()
    kc, vc = (_nhd(c, order) for c in append_kv_ref(k, v, pool, kv_layout=order, kv_indptr=indptr,
                                                   kv_indices=indices, batch_indices=batch, positions=pos))
    for t, (page, off) in enumerate([(5, 3), (1, 0), (3, 2)]):
        assert torch.equal(kc[page, off], k[t]) and torch.equal(vc[page, off], v[t])
    assert int((~kc.isnan()).sum()) == 3 * heads * dim == int((~vc.isnan()).sum())


def test_slot_mapping_skips_negative_slots_and_pages_outside_the_pool():
    pool = _pool(3, 16, 1, 64)
    k = torch.randn(4, 1, 64).bfloat16()
    out = append_kv_ref(k, k, (pool, pool.clone()), slot_mapping=torch.tensor([17, -1, 47, 48]))
    assert torch.equal(out[0][1, 1], k[0]) and torch.equal(out[0][2, 15], k[2])
    assert int((~out[0].isnan()).sum()) == 2 * 64


def test_combined_cache_equals_the_pair():
    pool = _pool(4, 17, 2, 64)
    k, v = torch.randn(5, 2, 64).bfloat16(), torch.randn(5, 2, 64).bfloat16()
    slots = torch.tensor([0, 16, 17, 50, 67])
    pair = append_kv_ref(k, v, (pool, pool.clone()), slot_mapping=slots)
    combined = append_kv_ref(k, v, torch.stack([pool, pool], dim=1), slot_mapping=slots)
    assert_cache_close((combined[:, 0], combined[:, 1]), pair, exact=True)


def test_rope_equals_the_attention_reference_rotation():
    k = torch.randn(7, 3, 128, dtype=torch.float64)
    pos = torch.tensor([0, 1, 5, 100, 1000, 4097, 30000])
    pool = _pool(1, 7, 3, 128, torch.float16)
    out = append_kv_ref(k, k, (pool, pool.clone()), slot_mapping=torch.arange(7), positions=pos,
                        rope=RoPE(500000.0, 2.0))[0][0]
    want = apply_rope(k, pos, 500000.0, 2.0).to(torch.float16)
    assert torch.equal(out, want)
    assert torch.equal(out[0], k[0].half())  # position 0 turns nothing


def test_llama31_frequencies_match_the_wavelength_formula():
    s = Llama31Scaling(8.0, 1.0, 4.0, 8192)
    got = rope_inv_freq(128, 500000.0, s)
    for i, f in enumerate((500000.0 ** (-np.arange(64) * 2 / 128)).tolist()):
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            want = f
        elif wavelen > 8192 / 1:
            want = f / 8
        else:
            smooth = (8192 / wavelen - 1) / 3
            want = (1 - smooth) * f / 8 + smooth * f
        assert got[i].item() == pytest.approx(want, rel=1e-12)
    a, b = s.smooth_terms()  # the kernel's clamp form of the same blend
    smooth = (rope_inv_freq(128, 500000.0) * a + b).clamp(0, 1)
    base = rope_inv_freq(128, 500000.0)
    torch.testing.assert_close((1 - smooth) * base / 8 + smooth * base, got, rtol=1e-12, atol=0)
    assert got[0] == 1.0 and got[-1] < base[-1]


def test_cos_sin_table_rotates_as_theta():
    k = torch.randn(5, 2, 64).bfloat16()
    pos = torch.tensor([3, 0, 77, 200, 10])
    pool = (_pool(1, 5, 2, 64), _pool(1, 5, 2, 64))
    by_theta = append_kv_ref(k, k, pool, slot_mapping=torch.arange(5), positions=pos, rope=RoPE(10000.0))
    by_table = append_kv_ref(k, k, pool, slot_mapping=torch.arange(5), positions=pos,
                             cos_sin_cache=cos_sin_table(300, 64))
    assert_cache_close(by_table, by_theta)
    short = append_kv_ref(k, k, pool, slot_mapping=torch.arange(5), positions=pos, cos_sin_cache=cos_sin_table(50, 64))
    assert int((~short[0].isnan()).sum()) == 3 * 2 * 64  # positions 77 and 200 have no row: skipped


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_quantises_with_scales_and_saturates(per_head):
    heads = 4
    k = torch.randn(6, heads, 64).bfloat16() * 3
    k[0, 0, 0] = 1e4  # beyond e4m3's 448 at scale 0.5: saturates
    scale = torch.tensor([0.5, 1.0, 2.0, 0.25]) if per_head else 0.5
    pool = (_pool(1, 6, heads, 64, E4M3), _pool(1, 6, heads, 64, E4M3))
    kc, vc = append_kv_ref(k, k, pool, slot_mapping=torch.arange(6), k_scale=scale, v_scale=scale)
    s = scale.reshape(1, -1, 1) if per_head else scale
    deq = kc[0].double() * s
    assert kc[0, 0, 0, 0].item() == 448.0
    ok = torch.ones_like(deq, dtype=torch.bool)
    ok[0, 0, 0] = False
    torch.testing.assert_close(deq[ok], k.double()[ok], rtol=2.0**-4, atol=2.0**-9 * 2)
    assert torch.equal(kc.view(torch.uint8), vc.view(torch.uint8))


def test_assert_cache_close_catches_a_touched_poisoned_slot_and_a_wrong_value():
    ref = _pool(1, 2, 1, 64)
    ref[0, 0] = 1.0
    good = ref.clone()
    assert_cache_close(good, ref)
    touched = ref.clone()
    touched[0, 1, 0, 5] = 0.0
    with pytest.raises(AssertionError, match="poisoned"):
        assert_cache_close(touched, ref)
    wrong = ref.clone()
    wrong[0, 0, 0, 3] = 1.1
    with pytest.raises(AssertionError):
        assert_cache_close(wrong, ref)
