"""Page-table validation and CSR <-> block-table conversion."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashgen.plan import (PageTableError, PlanError, block_table_to_csr, csr_to_block_table, kv_lens_from_csr,
                           plan_decode, validate_block_table, validate_csr, validate_indptr)
from flashgen.plan.page_table import csr_lens


@st.composite
def csr_tables(draw):
    page_size = draw(st.sampled_from([1, 3, 16, 64]))
    lens = draw(st.lists(st.integers(0, 300), min_size=1, max_size=12))
    npages = [-(-n // page_size) for n in lens]
    pool = sum(npages) + draw(st.integers(0, 5))
    perm = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(pool)[: sum(npages)]
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    last = np.array([n - (p - 1) * page_size if p else 0 for n, p in zip(lens, npages)], dtype=np.int32)
    return page_size, pool, np.array(lens), indptr, perm.astype(np.int32), last


@settings(max_examples=60, deadline=None)
@given(csr_tables())
def test_csr_block_table_roundtrip(table):
    page_size, pool, lens, indptr, indices, last = table
    assert validate_csr(indptr, indices, last, page_size, pool).tolist() == lens.tolist()
    bt, seq_lens = csr_to_block_table(indptr, indices, last, page_size, pad_value=-1)
    assert bt.dtype == torch.int32 and seq_lens.tolist() == lens.tolist()
    assert validate_block_table(bt, seq_lens, page_size, pool).tolist() == lens.tolist()
    for b in range(lens.size):  # row b lists request b's pages, in order
        n = indptr[b + 1] - indptr[b]
        assert bt[b, :n].tolist() == indices[indptr[b]: indptr[b + 1]].tolist()
        assert (bt[b, n:] == -1).all()
    back = block_table_to_csr(bt, seq_lens, page_size)
    assert [x.tolist() for x in back] == [indptr.tolist(), indices.tolist(), last.tolist()]
    assert kv_lens_from_csr(indptr, last, page_size).tolist() == lens.tolist()


def _outcome(fn, *args):
    try:
        return [a.tolist() for a in fn(*args)]
    except PlanError as exc:
        return type(exc), str(exc)


def _validate_csr_of_valid_ids(indptr, last, page_size):
    # validate_csr with page ids that pass: what the intake of device ids (never read) must say
    total = int(indptr[-1]) if indptr.size and indptr[-1] > 0 else 0
    return validate_indptr("kv_indptr", indptr), validate_csr(indptr, np.zeros(total, np.int32), last, page_size)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-3, 40), min_size=0, max_size=40), st.lists(st.integers(-2, 17), max_size=40),
       st.sampled_from([np.int32, np.int64]))
def test_csr_lens_matches_validate_csr(steps, last, dtype):
    # the one-pass intake of device page tables: the same lengths, or the same first error, as the host intake
    indptr = np.cumsum([0, *steps]).astype(dtype) if steps or last else np.zeros(0, dtype)
    if steps and steps[0] == 40:
        indptr = indptr + 1
    last = np.array(last[: len(steps) + (len(last) % 3 == 1)], dtype=dtype)
    ours = _outcome(csr_lens, indptr, last, 16)
    theirs = _outcome(_validate_csr_of_valid_ids, indptr, last, 16)
    assert ours == theirs


@pytest.mark.parametrize("batch", [3, 300])
@pytest.mark.parametrize("last, pages, message", [
    (0, 2, r"kv_last_page_len\[1\] = 0, expected 1..16"),
    (17, 2, r"kv_last_page_len\[1\] = 17, expected 1..16"),
    (-3, 2, r"kv_last_page_len\[1\] = -3, expected 1..16"),
    (5, 0, r"kv_last_page_len\[1\] = 5, expected 0 \(the request has no pages\)"),
    (-1, 0, r"kv_last_page_len\[1\] = -1, expected 0"),
])
def test_last_page_len_is_checked_without_page_ids(batch, last, pages, message):
    # kv_indptr and kv_last_page_len are host arrays whichever side the page ids are on: both intakes check them
    npages = np.full(batch, 2)
    npages[1] = pages
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    lens = np.full(batch, 5, np.int32)
    lens[1] = last
    for check in (lambda: csr_lens(indptr, lens, 16), lambda: kv_lens_from_csr(indptr, lens, 16),
                  lambda: validate_csr(indptr, np.zeros(int(indptr[-1]), np.int32), lens, 16)):
        with pytest.raises(PageTableError, match=message):
            check()


GOOD = dict(kv_indptr=[0, 2, 2, 3], kv_indices=[4, 1, 0], kv_last_page_len=[5, 0, 16])


@pytest.mark.parametrize("change, message", [
    (dict(kv_indptr=[1, 2, 2, 3]), r"kv_indptr\[0\] = 1, expected 0"),
    (dict(kv_indptr=[0, 2, 1, 3]), r"kv_indptr\[2\] = 1 < kv_indptr\[1\] = 2"),
    (dict(kv_indptr=[0, 2, 2, 4]), r"kv_indptr\[-1\] = 4 > len\(kv_indices\) = 3"),
    (dict(kv_indices=[4, 8, 0]), r"kv_indices\[1\] = 8 is outside the page pool \[0, 8\)"),
    (dict(kv_indices=[4, 1, -2]), r"kv_indices\[2\] = -2"),
    (dict(kv_last_page_len=[5, 0, 17]), r"kv_last_page_len\[2\] = 17, expected 1..16"),
    (dict(kv_last_page_len=[0, 0, 16]), r"kv_last_page_len\[0\] = 0, expected 1..16"),
    (dict(kv_last_page_len=[5, 3, 16]), r"kv_last_page_len\[1\] = 3, expected 0 \(the request has no pages\)"),
    (dict(kv_last_page_len=[5, 0]), r"kv_last_page_len: has 2 entries, expected batch_size = 3"),
    (dict(kv_indptr=[[0, 2, 2, 3]]), r"kv_indptr: has shape \(1, 4\), expected 1 dimension"),
    (dict(kv_indices=[4.0, 1.0, 0.0]), r"kv_indices: dtype float64, expected an integer dtype"),
])
def test_csr_errors_name_array_and_position(change, message):
    with pytest.raises(PageTableError, match=message):
        validate_csr(**{**GOOD, **change}, page_size=16, num_pages=8)


def test_csr_good_table_passes():
    assert validate_csr(**GOOD, page_size=16, num_pages=8).tolist() == [21, 0, 16]


@pytest.mark.parametrize("block_table, seq_lens, message", [
    ([[3, 1, -1], [0, 9, -1]], [20, 17], r"block_table\[1, 1\] = 9 is outside the page pool \[0, 4\)"),
    ([[3, 1, -1], [-1, -1, -1]], [20, 1], r"block_table\[1, 0\] = -1"),
    ([[3, 1, 2], [0, 2, 1]], [20, 49], r"seq_lens\[1\] = 49 needs 4 pages, more than block_table's 3 columns"),
    ([[3, 1, 2], [0, 2, 1]], [20, -1], r"seq_lens\[1\] = -1, expected >= 0"),
    ([[3, 1, 2], [0, 2, 1]], [20], r"seq_lens: has 1 entries, expected batch_size = 2"),
    ([3, 1, 2], [20], r"block_table: has shape \(3,\), expected 2 dimension"),
])
def test_block_table_errors_name_array_and_position(block_table, seq_lens, message):
    with pytest.raises(PageTableError, match=message):
        validate_block_table(block_table, seq_lens, page_size=16, num_pages=4)


def test_block_table_unused_entries_are_not_read():
    assert validate_block_table([[3, 1, -7], [0, 99, 99]], [20, 16], 16, num_pages=4).tolist() == [20, 16]


def test_page_size_and_indptr_errors():
    with pytest.raises(PageTableError, match="page_size: got 0"):
        validate_csr(**GOOD, page_size=0)
    with pytest.raises(PageTableError, match=r"qo_indptr\[-1\] = 3, expected 4"):
        validate_indptr("qo_indptr", [0, 3], length=4)
    with pytest.raises(PageTableError, match="max_blocks = 1"):
        csr_to_block_table(**GOOD, page_size=16, max_blocks=1)


def test_cuda_tensors_are_refused_without_syncing():
    class FakeCuda(torch.Tensor):  # a CPU tensor that claims to live on a GPU
        @property
        def device(self):
            return torch.device("cuda", 0)

    lens = torch.tensor([5, 7]).as_subclass(FakeCuda)
    with pytest.raises(PlanError, match="kv_lens: is a cuda tensor"):
        plan_decode(lens, num_qo_heads=4, num_kv_heads=4)
    with pytest.raises(PlanError, match="kv_indptr: is a cuda tensor"):
        validate_csr(torch.tensor([0, 1]).as_subclass(FakeCuda), [0], [1], 16)
