"""The fp64 reference against a naive implementation written independently (a loop over query rows)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashgen.plan import csr_to_block_table
from flashgen.spec import (ALiBi, AttentionSpec, BlockSparse, Causal, CustomMask, Paged, Ragged, RoPE,
                           SlidingWindow)
from flashgen.testing import (alibi_slopes, merge_state_ref, merge_states_ref, pack_custom_mask, paged_kv_cache,
                              reference_attention, unpack_custom_mask)
from flashgen.testing.tolerance import assert_attention_close, same_dtype_reference

D = 64


# ---------------------------------------------------------------------------------------------- naive oracle


def naive_slopes(n: int) -> list[float]:
    def pow2(m: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [start * start ** i for i in range(m)]
    if math.log2(n).is_integer():
        return pow2(n)
    closest = 2 ** math.floor(math.log2(n))
    return pow2(closest) + naive_slopes(2 * closest)[0::2][: n - closest]


def naive_rope(x: np.ndarray, pos: float, theta: float, scale: float) -> np.ndarray:
    half = x.shape[-1] // 2
    freqs = np.array([(pos / scale) / theta ** (2 * j / x.shape[-1]) for j in range(half)])
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * freqs)
    return np.concatenate([z.real, z.imag], axis=-1)


def naive_attention(q, ks, vs, qo_lens, *, mask="none", window=0, custom=None, rope=None, alibi=False,
                    cap=None, sm_scale=None):
    """Loop over requests and query rows; numpy fp64; returns (out, lse)."""
    q = q.double().numpy()
    hq = q.shape[1]
    slopes = naive_slopes(hq) if alibi else None
    out = np.zeros((q.shape[0], hq, vs[0].shape[-1]))
    lse = np.full((q.shape[0], hq), -np.inf)
    row = 0
    for b, (k, v) in enumerate(zip(ks, vs)):
        k, v = k.double().numpy(), v.double().numpy()
        n, group = k.shape[0], hq // k.shape[1]
        for i in range(qo_lens[b]):
            qp = n - qo_lens[b] + i
            for h in range(hq):
                qv, kk, vv = q[row, h], k[:, h // group], v[:, h // group]
                if rope:
                    qv = naive_rope(qv, qp, *rope)
                    kk = np.stack([naive_rope(kk[j], j, *rope) for j in range(n)]) if n else kk
                s = kk @ qv * (sm_scale or 1 / math.sqrt(q.shape[-1]))
                if alibi:
                    s = s + slopes[h] * (np.arange(n) - qp)
                if cap:
                    s = cap * np.tanh(s / cap)
                ok = np.ones(n, bool)
                if mask in ("causal", "window"):
                    ok &= np.arange(n) <= qp
                if mask == "window":
                    ok &= np.arange(n) >= qp - window
                if custom is not None:
                    ok &= custom[b][i]
                if ok.any():
                    m = s[ok].max()
                    e = np.where(ok, np.exp(s - m), 0.0)
                    out[row, h] = e @ vv / e.sum()
                    lse[row, h] = m + math.log(e.sum())
            row += 1
    return torch.from_numpy(out), torch.from_numpy(lse)


def close(a, b, tol=1e-9):
    assert a.shape == b.shape
    assert torch.equal(torch.isneginf(a), torch.isneginf(b))
    fin = torch.isfinite(b)
    assert torch.allclose(a[fin], b[fin], atol=tol, rtol=tol), float((a[fin] - b[fin]).abs().max())


def random_batch(gen, qo_lens, kv_lens, hq, hkv, dv=D, dtype=torch.float64):
    q = torch.randn(sum(qo_lens), hq, D, generator=gen, dtype=torch.float64).to(dtype)
    ks = [torch.randn(n, hkv, D, generator=gen, dtype=torch.float64).to(dtype) for n in kv_lens]
    vs = [torch.randn(n, hkv, dv, generator=gen, dtype=torch.float64).to(dtype) for n in kv_lens]
    return q, ks, vs


def indptr(lens):
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)


# ---------------------------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("page_size", [1, 3, 16, 64, 256])
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("table", ["csr", "block_table"])
@pytest.mark.parametrize("combined", [False, True])
def test_paged_layouts_match_naive(page_size, order, table, combined):
    gen = torch.Generator().manual_seed(page_size * 7 + len(order + table) + combined)
    qo_lens, kv_lens = [3, 1, 0, 2, 1], [5, 0, 4, 300, 17]
    q, ks, vs = random_batch(gen, qo_lens, kv_lens, hq=4, hkv=2)
    kv, kv_indptr, kv_indices, last = paged_kv_cache(ks, vs, page_size, order=order, combined=combined, generator=gen)
    spec = AttentionSpec(D, dtype="float16", kv_layout=Paged(page_size, order), mask=Causal())
    if table == "csr":
        pt = dict(kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=last)
    else:
        bt, seq_lens = csr_to_block_table(kv_indptr, kv_indices, last, page_size, pad_value=-1)
        pt = dict(block_table=bt, seq_lens=seq_lens)
    out, lse = reference_attention(spec, q, kv, qo_indptr=indptr(qo_lens), **pt)
    ref, ref_lse = naive_attention(q, ks, vs, qo_lens, mask="causal")
    close(out, ref)
    close(lse, ref_lse)
    assert torch.isfinite(out).all()  # NaN-filled unused slots were never read


def test_ragged_layout_and_stacked_kv():
    gen = torch.Generator().manual_seed(1)
    qo_lens, kv_lens = [2, 3, 1], [2, 9, 0]
    q, ks, vs = random_batch(gen, qo_lens, kv_lens, hq=8, hkv=2)
    spec = AttentionSpec(D, kv_layout=Ragged())
    k, v = torch.cat(ks), torch.cat(vs)
    out, lse = reference_attention(spec, q, (k, v), qo_indptr=indptr(qo_lens), kv_indptr=indptr(kv_lens))
    out2, _ = reference_attention(spec, q, torch.stack([k, v], 1), qo_indptr=indptr(qo_lens), kv_indptr=indptr(kv_lens))
    ref, ref_lse = naive_attention(q, ks, vs, qo_lens)
    close(out, ref)
    close(lse, ref_lse)
    close(out2, ref)
    assert (out[-1] == 0).all() and torch.isneginf(lse[-1]).all()  # empty KV: out 0, lse -inf


# ---------------------------------------------------------------------------------------------- options

OPTIONS = {
    "nomask": (dict(), dict()),
    "causal": (dict(mask=Causal()), dict(mask="causal")),
    "window": (dict(mask=SlidingWindow(3)), dict(mask="window", window=3)),
    "custom": (dict(mask=CustomMask()), dict(custom=True)),
    "rope": (dict(mask=Causal(), pos_encoding=RoPE(500.0, 1.0)), dict(mask="causal", rope=(500.0, 1.0))),
    "rope_scaled": (dict(pos_encoding=RoPE(10000.0, 4.0)), dict(rope=(10000.0, 4.0))),
    "alibi": (dict(mask=Causal(), pos_encoding=ALiBi()), dict(mask="causal", alibi=True)),
    "soft_cap": (dict(soft_cap=2.0), dict(cap=2.0)),
    "sm_scale": (dict(sm_scale=0.3), dict(sm_scale=0.3)),
    "vo_dim": (dict(head_dim_vo=128, mask=Causal()), dict(mask="causal")),
    "everything": (dict(mask=SlidingWindow(5), pos_encoding=ALiBi(), soft_cap=1.5, sm_scale=0.2),
                   dict(mask="window", window=5, alibi=True, cap=1.5, sm_scale=0.2)),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("group", [1, 4, 7])
def test_options_match_naive(option, group):
    spec_kw, naive_kw = OPTIONS[option]
    gen = torch.Generator().manual_seed(hash((option, group)) % 2**31)
    hkv = 2 if group < 7 else 1
    dv = spec_kw.get("head_dim_vo", D)
    qo_lens, kv_lens = [4, 1, 3, 6], [11, 7, 0, 3]  # last request: qo_len > kv_len
    q, ks, vs = random_batch(gen, qo_lens, kv_lens, hq=hkv * group, hkv=hkv, dv=dv)
    spec = AttentionSpec(D, kv_layout=Ragged(), **spec_kw)
    kwargs = {}
    if naive_kw.get("custom"):
        masks = [torch.rand(a, b, generator=gen) < 0.6 for a, b in zip(qo_lens, kv_lens)]
        kwargs["custom_mask"] = pack_custom_mask(masks)
        naive_kw = dict(custom=[m.numpy() for m in masks])
    out, lse = reference_attention(spec, q, (torch.cat(ks), torch.cat(vs)), qo_indptr=indptr(qo_lens),
                                   kv_indptr=indptr(kv_lens), **kwargs)
    ref, ref_lse = naive_attention(q, ks, vs, qo_lens, **naive_kw)
    close(out, ref)
    close(lse, ref_lse)


def test_runtime_values_override_spec():
    gen = torch.Generator().manual_seed(2)
    q, ks, vs = random_batch(gen, [3], [20], hq=2, hkv=2)
    spec = AttentionSpec(D, kv_layout=Ragged(), mask=SlidingWindow(2), pos_encoding=RoPE(), soft_cap=5.0)
    out, _ = reference_attention(spec, q, (ks[0], vs[0]), qo_indptr=[0, 3], kv_indptr=[0, 20], window_left=6,
                                 rope_theta=100.0, rope_scale=2.0, soft_cap=0.5, sm_scale=0.7)
    ref, _ = naive_attention(q, ks, vs, [3], mask="window", window=6, rope=(100.0, 2.0), cap=0.5, sm_scale=0.7)
    close(out, ref)


def test_fully_masked_rows_give_zero_and_neg_inf():
    gen = torch.Generator().manual_seed(3)
    q, ks, vs = random_batch(gen, [5], [2], hq=2, hkv=2)
    spec = AttentionSpec(D, kv_layout=Ragged(), mask=Causal())
    out, lse = reference_attention(spec, q, (ks[0], vs[0]), qo_indptr=[0, 5], kv_indptr=[0, 2])
    # q positions are -3..1: rows 0..2 see nothing
    assert (out[:3] == 0).all() and torch.isneginf(lse[:3]).all()
    assert torch.isfinite(lse[3:]).all() and (out[3:] != 0).any()


def test_block_sparse_matches_masked_dense():
    gen = torch.Generator().manual_seed(4)
    m, n, r, c = 10, 13, 4, 3  # 3 block rows (last partial), 5 block columns (last partial)
    q, ks, vs = random_batch(gen, [m], [n], hq=4, hkv=2)
    bsr_indptr, bsr_indices = [0, 2, 2, 5], [0, 3, 1, 2, 4]  # block row 1 is empty
    spec = AttentionSpec(D, kv_layout=BlockSparse(r, c))
    out, lse = reference_attention(spec, q, (ks[0], vs[0]), bsr=(bsr_indptr, bsr_indices))
    dense = np.zeros((m, n), bool)
    for row in range(3):
        for col in bsr_indices[bsr_indptr[row]: bsr_indptr[row + 1]]:
            dense[row * r: (row + 1) * r, col * c: (col + 1) * c] = True
    ref, ref_lse = naive_attention(q, ks, vs, [m], custom=[dense])
    close(out, ref)
    close(lse, ref_lse)
    assert (out[4:8] == 0).all()


def test_alibi_slopes_known_values():
    assert alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]
    assert torch.allclose(alibi_slopes(12), torch.tensor(naive_slopes(12), dtype=torch.float64))
    assert alibi_slopes(12)[8:].tolist() == [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5]


def test_custom_mask_pack_roundtrip_and_bit_order():
    gen = torch.Generator().manual_seed(5)
    shapes = [(3, 5), (0, 4), (1, 1), (7, 2)]
    masks = [torch.rand(a, b, generator=gen) < 0.5 for a, b in shapes]
    packed = pack_custom_mask(masks)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(sum(a * b for a, b in shapes) / 8)
    back = unpack_custom_mask(packed, [a for a, _ in shapes], [b for _, b in shapes])
    assert all(torch.equal(x, y) for x, y in zip(masks, back))
    # little-endian: bit 0 of byte 0 is mask[0][0, 0]; bit 1 is mask[0][0, 1]
    assert pack_custom_mask([torch.tensor([[False, True, False, False, False, False, False, False, True]])]).tolist() == [2, 1]
    with pytest.raises(ValueError, match="custom_mask"):
        unpack_custom_mask(packed, [3], [5])


# ---------------------------------------------------------------------------------------------- merge


def test_merge_states_equal_attention_over_the_union():
    gen = torch.Generator().manual_seed(6)
    q, ks, vs = random_batch(gen, [3], [40], hq=4, hkv=4)
    spec = AttentionSpec(D, kv_layout=Ragged())
    parts = [(0, 7), (7, 8), (8, 8), (8, 40)]  # includes an empty part
    states = [reference_attention(spec, q, (ks[0][a:b], vs[0][a:b]), qo_indptr=[0, 3], kv_indptr=[0, b - a])
              for a, b in parts]
    full, full_lse = reference_attention(spec, q, (ks[0], vs[0]), qo_indptr=[0, 3], kv_indptr=[0, 40])
    v, s = merge_states_ref(torch.stack([o for o, _ in states], 1), torch.stack([l for _, l in states], 1))
    close(v, full)
    close(s, full_lse)
    v2, s2 = merge_state_ref(*states[0], *merge_state_ref(*states[1], *states[3]))
    close(v2, full)
    close(s2, full_lse)


def test_merge_of_empty_states_is_zero_not_nan():
    v = torch.randn(2, 3, 4, 8)
    s = torch.randn(2, 3, 4)
    s[0] = float("-inf")
    s[1, 1:] = float("-inf")
    mv, ms = merge_states_ref(v, s)
    assert not torch.isnan(mv).any()
    assert (mv[0] == 0).all() and torch.isneginf(ms[0]).all()
    close(mv[1], v[1, 0].double())
    close(ms[1], s[1, 0].double())


# ---------------------------------------------------------------------------------------------- tolerance


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_assert_attention_close_accepts_kernel_like_and_rejects_wrong(dtype):
    gen = torch.Generator().manual_seed(7)
    q, ks, vs = random_batch(gen, [4, 2], [50, 9], hq=4, hkv=2, dtype=dtype)
    spec = AttentionSpec(D, dtype=dtype, kv_layout=Ragged(), mask=Causal())
    args = dict(qo_indptr=[0, 4, 6], kv_indptr=[0, 50, 59])
    kv = (torch.cat(ks), torch.cat(vs))
    ref, ref_lse = reference_attention(spec, q, kv, **args)
    low, low_lse = same_dtype_reference(spec, q, kv, **args)
    assert_attention_close(ref.to(dtype), ref, low)  # a kernel that rounds the exact answer passes
    assert_attention_close(low_lse.float(), ref_lse, low_lse, dtype=dtype, name="lse")
    bad = ref.to(dtype).clone()
    bad[5, 1, 3] += 0.25
    with pytest.raises(AssertionError, match=r"at \(5, 1, 3\)"):
        assert_attention_close(bad, ref, low)
    bad[5, 1, 3] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        assert_attention_close(bad, ref, low)
    wrong_inf = ref_lse.clone()
    wrong_inf[0, 0] = float("-inf")
    with pytest.raises(AssertionError):
        assert_attention_close(wrong_inf, ref_lse, low_lse, dtype=dtype, name="lse")


def test_fp8_kv_same_dtype_reference_runs():
    gen = torch.Generator().manual_seed(8)
    q, ks, vs = random_batch(gen, [2], [30], hq=2, hkv=1, dtype=torch.bfloat16)
    spec = AttentionSpec(D, dtype="bfloat16", kv_dtype="float8_e4m3fn", kv_layout=Ragged())
    kv = (ks[0].to(torch.float8_e4m3fn), vs[0].to(torch.float8_e4m3fn))
    ref, _ = reference_attention(spec, q, kv, qo_indptr=[0, 2], kv_indptr=[0, 30])
    low, _ = same_dtype_reference(spec, q, kv, qo_indptr=[0, 2], kv_indptr=[0, 30])
    assert_attention_close(ref.to(torch.bfloat16), ref, low, kv_dtype=torch.float8_e4m3fn)
    assert 0 < float((low - ref).abs().max()) < 0.1
