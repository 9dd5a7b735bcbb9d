"""The CPU executor runs plans with the reference math: every partition must give the reference's answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashgen.plan import csr_to_block_table, plan_block_sparse, plan_cascade, plan_decode, plan_prefill
from flashgen.spec import ALiBi, AttentionSpec, BlockSparse, Causal, CustomMask, NoMask, Paged, RoPE, SlidingWindow
from flashgen.testing import pack_custom_mask, paged_kv_cache, reference_attention
from flashgen.testing.executor import PlanExecutionError, run_plan

D = 64
SPECS = {
    "nomask": dict(),
    "causal": dict(mask=Causal()),
    "window": dict(mask=SlidingWindow(40)),
    "custom": dict(mask=CustomMask()),
    "rope": dict(mask=Causal(), pos_encoding=RoPE(1000.0, 2.0)),
    "alibi_cap": dict(mask=Causal(), pos_encoding=ALiBi(), soft_cap=3.0),
}


def assert_same(a, b):
    assert torch.equal(torch.isneginf(a[1]), torch.isneginf(b[1]))
    assert torch.allclose(a[0], b[0], atol=1e-10, rtol=1e-9), float((a[0] - b[0]).abs().max())
    fin = torch.isfinite(b[1])
    assert torch.allclose(a[1][fin], b[1][fin], atol=1e-10, rtol=1e-9)


def make_batch(seed, qo_lens, kv_lens, hq, hkv, page_size, dv=D, order="NHD"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(qo_lens), hq, D, generator=gen, dtype=torch.float64)
    ks = [torch.randn(n, hkv, D, generator=gen, dtype=torch.float64) for n in kv_lens]
    vs = [torch.randn(n, hkv, dv, generator=gen, dtype=torch.float64) for n in kv_lens]
    kv, kv_indptr, kv_indices, last = paged_kv_cache(ks, vs, page_size, order=order, generator=gen)
    return gen, q, kv, dict(kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=last)


@st.composite
def batches(draw):
    n = draw(st.integers(1, 5))
    decode = draw(st.booleans())
    qo = [1] * n if decode else draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    kv = draw(st.lists(st.one_of(st.just(0), st.just(1), st.integers(0, 2500)), min_size=n, max_size=n))
    return dict(qo_lens=qo, kv_lens=kv, group=draw(st.sampled_from([1, 4, 7])), hkv=draw(st.sampled_from([1, 2])),
                page_size=draw(st.sampled_from([1, 3, 16, 64, 256])), spec=draw(st.sampled_from(sorted(SPECS))),
                tile_rows=draw(st.sampled_from([None, 4, 16])), num_sms=draw(st.sampled_from([8, 132])),
                seed=draw(st.integers(0, 2**31)))


@settings(max_examples=40, deadline=None)
@given(batches())
def test_executor_matches_reference(b):
    hq = b["group"] * b["hkv"]
    gen, q, kv, pt = make_batch(b["seed"], b["qo_lens"], b["kv_lens"], hq, b["hkv"], b["page_size"])
    spec = AttentionSpec(D, kv_layout=Paged(b["page_size"]), **SPECS[b["spec"]])
    extra = {}
    if b["spec"] == "custom":
        extra["custom_mask"] = pack_custom_mask([torch.rand(a, c, generator=gen) < 0.7
                                                 for a, c in zip(b["qo_lens"], b["kv_lens"])])
    qo_indptr = np.concatenate([[0], np.cumsum(b["qo_lens"])])
    plan = plan_prefill(qo_indptr, b["kv_lens"], num_qo_heads=hq, num_kv_heads=b["hkv"], tile_rows=b["tile_rows"],
                        num_sms=b["num_sms"], kv_granularity=b["page_size"])
    ref = reference_attention(spec, q, kv, qo_indptr=qo_indptr, **pt, **extra)
    assert_same(run_plan(plan, spec, q, kv, **pt, **extra), ref)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=6), st.integers(0, 3), st.integers(0, 2**31))
def test_fixed_capacity_plan_equals_exact_plan(kv_lens, spare, seed):
    hq, hkv = 8, 2
    _, q, kv, pt = make_batch(seed, [1] * len(kv_lens), kv_lens, hq, hkv, 16, order="HND")
    spec = AttentionSpec(D, kv_layout=Paged(16, "HND"), mask=Causal())
    exact = plan_decode(kv_lens, num_qo_heads=hq, num_kv_heads=hkv, num_sms=16)
    fixed = plan_decode(kv_lens, num_qo_heads=hq, num_kv_heads=hkv, num_sms=16, max_batch_size=len(kv_lens) + spare)
    assert fixed.info.num_items <= fixed.info.capacity and fixed.info.grid[0] == fixed.info.capacity
    assert_same(run_plan(fixed, spec, q, kv, **pt), run_plan(exact, spec, q, kv, **pt))
    assert_same(run_plan(fixed, spec, q, kv, **pt), reference_attention(spec, q, kv, qo_indptr=np.arange(len(kv_lens) + 1), **pt))


def test_block_table_input_gives_the_same_answer():
    _, q, kv, pt = make_batch(11, [2, 3], [40, 300], 4, 2, 16)
    spec = AttentionSpec(D, kv_layout=Paged(16), mask=Causal())
    bt, seq_lens = csr_to_block_table(pt["kv_indptr"], pt["kv_indices"], pt["kv_last_page_len"], 16)
    plan = plan_prefill([0, 2, 5], seq_lens, num_qo_heads=4, num_kv_heads=2, num_sms=8)
    assert_same(run_plan(plan, spec, q, kv, block_table=bt, seq_lens=seq_lens),
                reference_attention(spec, q, kv, qo_indptr=[0, 2, 5], **pt))


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 3), st.integers(0, 20), st.sampled_from([NoMask(), Causal()]), st.integers(0, 2**31))
def test_cascade_equals_flat_attention(groups, prefix_pages, mask, seed):
    page_size, hq, hkv = 4, 8, 2
    rng = np.random.default_rng(seed)
    group_of = np.sort(rng.integers(0, groups, size=rng.integers(groups, 6)))
    group_of[:groups] = np.arange(groups)  # every group has a request
    group_of.sort()
    n = group_of.size
    group_pages = rng.integers(0, 5, size=groups)
    qo_lens = rng.integers(0, 4, size=n)
    suffix = qo_lens + rng.integers(0, 40, size=n)  # the queries are the last tokens of the unique suffix
    # page pool: [prefix pages][group pages][suffix pages (last one partial)]
    pools = [np.arange(prefix_pages)]
    pools += [prefix_pages + np.arange(group_pages[:g].sum(), group_pages[: g + 1].sum()) for g in range(groups)]
    base = prefix_pages + group_pages.sum()
    suffix_pages = -(-suffix // page_size)
    suffix_lists = [base + np.arange(suffix_pages[:r].sum(), suffix_pages[: r + 1].sum()) for r in range(n)]
    num_pages = base + suffix_pages.sum()
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_pages, page_size, hkv, D, generator=gen, dtype=torch.float64)
    v = torch.randn(num_pages, page_size, hkv, D, generator=gen, dtype=torch.float64)
    q = torch.randn(int(qo_lens.sum()), hq, D, generator=gen, dtype=torch.float64)

    def csr(lists, lens):
        last = [ln - (len(p) - 1) * page_size if len(p) else 0 for p, ln in zip(lists, lens)]
        return dict(kv_indptr=np.concatenate([[0], np.cumsum([len(p) for p in lists])]),
                    kv_indices=np.concatenate(lists + [np.zeros(0, np.int64)]), kv_last_page_len=np.array(last))

    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    group_qo = np.concatenate([[0], np.cumsum([qo_lens[group_of == g].sum() for g in range(groups)])])
    levels = [csr([pools[0]], [prefix_pages * page_size]),
              csr(pools[1:], group_pages * page_size),
              csr(suffix_lists, suffix)]
    flat_lists = [np.concatenate([pools[0], pools[1 + group_of[r]], suffix_lists[r]]) for r in range(n)]
    flat_lens = prefix_pages * page_size + group_pages[group_of] * page_size + suffix
    plan = plan_cascade([([0, qo_indptr[-1]], [prefix_pages * page_size]), (group_qo, group_pages * page_size),
                         (qo_indptr, suffix)], num_qo_heads=hq, num_kv_heads=hkv, num_sms=8, tile_rows=8)
    spec = AttentionSpec(D, kv_layout=Paged(page_size), mask=mask)
    flat = reference_attention(spec, q, (k, v), qo_indptr=qo_indptr, **csr(flat_lists, flat_lens))
    assert_same(run_plan(plan, spec, q, (k, v), levels=levels), flat)


@pytest.mark.parametrize("m, n, r, c", [(10, 13, 4, 3), (64, 64, 16, 16), (7, 200, 1, 64)])
def test_block_sparse_plan_equals_reference(m, n, r, c):
    gen = torch.Generator().manual_seed(m * n)
    rows, cols = -(-m // r), -(-n // c)
    present = torch.rand(rows, cols, generator=gen) < 0.4
    present[0] = False  # an empty block row
    indptr = np.concatenate([[0], np.cumsum(present.sum(1).numpy())])
    indices = np.concatenate([np.flatnonzero(row) for row in present.numpy()])
    q = torch.randn(m, 4, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(n, 2, D, generator=gen, dtype=torch.float64) for _ in range(2))
    spec = AttentionSpec(D, kv_layout=BlockSparse(r, c), soft_cap=4.0)
    plan = plan_block_sparse(indptr, indices, block_q=r, block_kv=c, qo_len=m, kv_len=n, num_qo_heads=4,
                             num_kv_heads=2, num_sms=8, tile_rows=8)
    ref = reference_attention(spec, q, (k, v), bsr=(indptr, indices))
    assert_same(run_plan(plan, spec, q, (k, v)), ref)
    assert (ref[0][:r] == 0).all()


def test_executor_rejects_a_plan_that_writes_twice():
    _, q, kv, pt = make_batch(3, [1, 1], [100, 5000], 4, 1, 16)
    spec = AttentionSpec(D, kv_layout=Paged(16))
    plan = plan_decode([100, 5000], num_qo_heads=4, num_kv_heads=1, num_sms=8)
    run_plan(plan, spec, q, kv, **pt)
    kv_end = plan.numpy("kv_end")
    kv_end[0] = kv_end[0] - 1  # the first (longest) item loses its last key: the numbers change...
    with pytest.raises(AssertionError):
        assert_same(run_plan(plan, spec, q, kv, **pt), reference_attention(spec, q, kv, qo_indptr=[0, 1, 2], **pt))
    kv_end[0] += 1
    plan.numpy("chunk_idx")[0] = plan.numpy("chunk_idx")[1]  # ...and two items writing one partial row fail loudly
    with pytest.raises(PlanExecutionError, match="not written exactly once"):
        run_plan(plan, spec, q, kv, **pt)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(20, 90), st.integers(300, 1200), st.sampled_from([1, 2, 4]),
       st.sampled_from([16, 64]), st.integers(0, 2**31))
def test_tail_split_plan_matches_reference(batch, qo_len, kv_len, group, page_size, seed):
    # a small num_sms makes the last wave partly empty: its tiles are split into KV chunks merged per tile
    hkv = 2
    hq = group * hkv
    _, q, kv, pt = make_batch(seed, [qo_len] * batch, [kv_len] * batch, hq, hkv, page_size)
    spec = AttentionSpec(D, kv_layout=Paged(page_size))
    qo_indptr = np.arange(batch + 1) * qo_len
    plan = plan_prefill(qo_indptr, [kv_len] * batch, num_qo_heads=hq, num_kv_heads=hkv, tile_rows=16, num_sms=5,
                        kv_granularity=page_size, balance_tail=True)
    assert_same(run_plan(plan, spec, q, kv, **pt), reference_attention(spec, q, kv, qo_indptr=qo_indptr, **pt))
