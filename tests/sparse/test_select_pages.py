"""select_pages (sparse attention over pages) on the CPU: the kept-page table of every selection form, its
last-page lengths, its refusals; attention over it equals attention over the whole table with the skipped
pages masked, in the fp64 reference and through the decode planner and the CPU executor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashgen
from flashgen import ALiBi, AttentionSpec, Causal, CustomMask, Paged, Ragged, RoPE, SlidingWindow, SpecError
from flashgen.plan import PlanError, plan_decode, validate_csr
from flashgen.testing import paged_kv_cache, reference_attention
from flashgen.testing.executor import run_plan

from stub_cuda import stubbed_cuda

D = 64
SPEC = AttentionSpec(D, kv_layout=Paged(16))
# three requests: 4 pages (the last of 5 tokens), 1 page (a full one), none
TABLE = dict(kv_indptr=[0, 4, 5, 5], kv_indices=[9, 3, 7, 1, 4], kv_last_page_len=[5, 16, 0])


def as_lists(table):
    return {name: np.asarray(value).tolist() for name, value in table.items()}


@pytest.mark.parametrize("selection", [
    dict(keep=[[3, 1], [0, -1], [-1, -1]]),
    dict(keep=[1, 3, 0], keep_indptr=[0, 2, 3, 3]),
    dict(keep=[3, 1, 0], keep_indptr=[0, 2, 3, 3]),  # any order within a request
    dict(page_mask=np.array([False, True, False, True, True])),
    dict(page_mask=torch.tensor([False, True, False, True, True])),
])
def test_every_form_gives_the_kept_table(selection):
    table = flashgen.select_pages(SPEC, **TABLE, **selection)
    # request 0 keeps pages 1 (full) and 3 (its last: 5 tokens); request 1 its only page; request 2 nothing
    assert as_lists(table) == dict(kv_indptr=[0, 2, 3, 3], kv_indices=[3, 1, 4], kv_last_page_len=[5, 16, 0])


def test_a_kept_set_without_the_last_page_is_all_full_pages():
    table = flashgen.select_pages(SPEC, **TABLE, keep=[[0, 2], [-1, -1], [-1, -1]])
    assert as_lists(table) == dict(kv_indptr=[0, 2, 2, 2], kv_indices=[9, 7], kv_last_page_len=[16, 0, 0])
    assert validate_csr(**table, page_size=16).tolist() == [32, 0, 0]


def test_the_table_feeds_the_decode_wrapper():
    table = flashgen.select_pages(SPEC, **TABLE, keep=[[2, 3], [0, -1], [-1, -1]])
    with stubbed_cuda():
        wrapper = flashgen.BatchDecodeWrapper(SPEC)
        wrapper.plan(**table, num_qo_heads=4, num_kv_heads=2)
        assert wrapper._core.planned.q_shape[0] == 3


def test_device_ids_stay_where_they_are():
    ids = torch.tensor(TABLE["kv_indices"], dtype=torch.int32)
    table = flashgen.select_pages(SPEC, **{**TABLE, "kv_indices": ids}, keep=[[3], [0], [-1]])
    assert np.asarray(table["kv_indices"]).tolist() == [1, 4]


@pytest.mark.parametrize("spec, message", [
    (AttentionSpec(D, kv_layout=Paged(16), mask=Causal()), r"^mask: select_pages takes NoMask\(\) only.*"
     r"pass positions=True"),
    (AttentionSpec(D, kv_layout=Paged(16), mask=SlidingWindow(64)), r"^mask: select_pages takes NoMask"),
    (AttentionSpec(D, kv_layout=Paged(16), mask=CustomMask()), r"^mask: select_pages takes NoMask"),
    (AttentionSpec(D, kv_layout=Paged(16), pos_encoding=RoPE()), r"^pos_encoding: select_pages takes None only"),
    (AttentionSpec(D, kv_layout=Paged(16), pos_encoding=ALiBi()), r"^pos_encoding: select_pages takes None only"),
    (AttentionSpec(D, kv_layout=Ragged()), r"^spec: select_pages takes a spec with a Paged\(\.\.\.\) kv_layout"),
])
def test_positions_are_refused(spec, message):
    with pytest.raises(SpecError, match=message):
        flashgen.select_pages(spec, **TABLE, keep=[[0], [0], [-1]])


def test_soft_cap_and_sm_scale_are_position_free():
    spec = AttentionSpec(D, kv_layout=Paged(16), soft_cap=30.0, sm_scale=0.1)
    assert as_lists(flashgen.select_pages(spec, **TABLE, keep=[[0], [0], [-1]]))["kv_indices"] == [9, 4]


@pytest.mark.parametrize("selection, message", [
    (dict(), r"^keep: give one selection"),
    (dict(keep=[[0]] * 3, page_mask=np.ones(5, bool)), r"^keep: give one selection"),
    (dict(keep=[[4], [0], [-1]]), r"^keep\[0, 0\] = 4 is outside request 0's pages \[0, 4\)"),
    (dict(keep=[[0], [0], [0]]), r"^keep\[2, 0\] = 0 is outside request 2's pages \[0, 0\)"),
    (dict(keep=[[1, 1], [0, -1], [-1, -1]]), r"^keep\[0, 1\] = 1: request 0 keeps that page twice"),
    (dict(keep=[[0], [0]]), r"^keep: has 2 rows, expected batch_size = 3"),
    (dict(keep=[[0], [0], [-1]], keep_indptr=[0, 1, 2, 2]), r"^keep_indptr: goes with a flat keep"),
    (dict(keep=[0, 0]), r"^keep_indptr: required with a flat keep"),
    (dict(keep=[0, -1], keep_indptr=[0, 2, 2, 2]), r"^keep\[1\] = -1 is outside request 0's pages \[0, 4\)"),
    (dict(keep=[0, 0], keep_indptr=[0, 2, 2, 2]), r"^keep\[1\] = 0: request 0 keeps that page twice"),
    (dict(keep=[0], keep_indptr=[0, 1, 1]), r"^keep_indptr: has 3 entries, expected batch_size \+ 1 = 4"),
    (dict(keep=[0], keep_indptr=[0, 1, 2, 2]), r"^keep_indptr\[-1\] = 2 > len\(keep\) = 1"),
    (dict(keep=[0.5], keep_indptr=[0, 1, 1, 1]), r"^keep: dtype float64, expected an integer dtype"),
    (dict(page_mask=np.ones(4, bool)), r"^page_mask: expected bool \[5\] \(kv_indptr\[-1\], one flag per page\)"),
    (dict(page_mask=np.ones(5, np.int32)), r"^page_mask: expected bool \[5\]"),
    (dict(page_mask=np.ones(5, bool), keep_indptr=[0, 1, 1, 1]), r"^keep_indptr: goes with keep"),
])
def test_bad_selections_name_the_argument(selection, message):
    with pytest.raises(PlanError, match=message):
        flashgen.select_pages(SPEC, **TABLE, **selection)


def test_bad_tables_name_the_argument():
    with pytest.raises(PlanError, match=r"^kv_last_page_len\[0\] = 17, expected 1..16"):
        flashgen.select_pages(SPEC, **{**TABLE, "kv_last_page_len": [17, 16, 0]}, keep=[[0], [0], [-1]])
    with pytest.raises(PlanError, match=r"^kv_indptr\[-1\] = 5 > len\(kv_indices\) = 4"):
        flashgen.select_pages(SPEC, **{**TABLE, "kv_indices": [9, 3, 7, 1]}, keep=[[0], [0], [-1]])


def test_a_large_batch_is_vectorised():
    batch, pages = 4096, 64
    rng = np.random.default_rng(0)
    indptr = np.arange(batch + 1) * pages
    last = rng.integers(1, 17, batch)
    keep = np.argsort(rng.random((batch, pages)), axis=1)[:, :8]
    table = flashgen.select_pages(SPEC, indptr, np.arange(batch * pages), last, keep=keep)
    lens = validate_csr(**table, page_size=16)
    assert lens.tolist() == np.where((keep == pages - 1).any(1), 7 * 16 + last, 8 * 16).tolist()
    assert (np.diff(table["kv_indices"].reshape(batch, 8), axis=1) > 0).all()


@settings(max_examples=30, deadline=None)
@given(page_size=st.sampled_from([1, 3, 16]), lens=st.lists(st.integers(0, 70), min_size=1, max_size=6),
       qo=st.sampled_from([1, 3]), keep_fraction=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_attention_over_kept_pages_is_attention_with_the_rest_masked(page_size, lens, qo, keep_fraction, seed):
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(D, kv_layout=Paged(page_size), soft_cap=5.0)
    ks = [torch.randn(n, 2, D, generator=gen, dtype=torch.float64) for n in lens]
    vs = [torch.randn(n, 2, D, generator=gen, dtype=torch.float64) for n in lens]
    kv, indptr, indices, last = paged_kv_cache(ks, vs, page_size, generator=gen)
    mask = rng.random(int(indptr[-1])) < keep_fraction
    table = flashgen.select_pages(spec, indptr, indices, last, page_mask=mask)
    q = torch.randn(qo * len(lens), 8, D, generator=gen, dtype=torch.float64)
    qo_indptr = np.arange(len(lens) + 1) * qo
    kept = reference_attention(spec, q, kv, qo_indptr=qo_indptr, **table)
    # the whole table with a custom mask that hides the tokens of skipped pages
    npages = np.diff(indptr.numpy())
    token_masks = [torch.from_numpy(np.repeat(mask[indptr[b]: indptr[b + 1]], page_size)[: n]).expand(qo, n)
                   for b, n in enumerate(lens)]
    masked = reference_attention(spec.replace(mask=CustomMask()), q, kv, qo_indptr=qo_indptr, kv_indptr=indptr,
                                 kv_indices=indices, kv_last_page_len=last, custom_mask=token_masks)
    assert torch.equal(torch.isneginf(kept[1]), torch.isneginf(masked[1]))
    assert torch.allclose(kept[0], masked[0], atol=1e-10)
    assert npages.sum() == mask.size
    if qo == 1:  # decode: the planner's partition over the kept pages, run by the CPU executor
        kv_lens = validate_csr(**table, page_size=page_size)
        plan = plan_decode(kv_lens, num_qo_heads=8, num_kv_heads=2, num_sms=4, tile_rows=8)
        out = run_plan(plan, spec, q, kv, **table)
        assert torch.allclose(out[0], kept[0], atol=1e-10)
        assert torch.equal(torch.isneginf(out[1]), torch.isneginf(kept[1]))


def test_positions_give_the_kept_pages_true_places():
    spec = AttentionSpec(D, kv_layout=Paged(16), mask=SlidingWindow(40), pos_encoding=RoPE())
    table = flashgen.select_pages(spec, **TABLE, keep=[[2, 0], [0, -1], [-1, -1]], positions=True)
    assert table["kv_indices"].tolist() == [9, 7, 4]
    assert table["kv_page_pos"].tolist() == [0, 32, 0]  # request 0's pages 0 and 2, request 1's page 0
    assert table["q_pos"].tolist() == [52, 15, 0]  # 3 x 16 + 5 tokens, 16, none


def test_the_reference_at_natural_explicit_positions_is_the_default():
    spec = AttentionSpec(D, kv_layout=Paged(4), mask=SlidingWindow(3), pos_encoding=ALiBi())
    gen = torch.Generator().manual_seed(0)
    ks, vs = ([torch.randn(n, 2, D, generator=gen, dtype=torch.float64) for n in (9, 4)] for _ in range(2))
    kv, indptr, indices, last = paged_kv_cache(ks, vs, 4, generator=gen)
    q = torch.randn(3, 4, D, generator=gen, dtype=torch.float64)
    table = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last)
    want = reference_attention(spec, q, kv, qo_indptr=[0, 2, 3], **table)
    got = reference_attention(spec, q, kv, qo_indptr=[0, 2, 3], **table, q_pos=[7, 8, 3], kv_page_pos=[0, 4, 8, 0])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
