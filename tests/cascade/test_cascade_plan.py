"""Cascade levels on the CPU: derivation from page tables (random prefix trees and arbitrary lists), folding, the
cost model's choices, and the errors of bad levels."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cascade_batches import csr, last_page_lens, request_tokens, tree_pages
from flashgen.plan import (CascadeLevel, CascadePolicy, PlanError, check_levels, choose_levels, derive_levels,
                           fold_level, level_cost)
from flashgen.plan import cascade, cascade_cost
from flashgen.plan.cascade import check_causal, empty_level
from flashgen.plan.cascade_cost import Shape, check_policy

SHAPE = Shape(32, 8)


def group_of(level, token: int) -> int:
    return int(np.searchsorted(level.qo_indptr, token, side="right")) - 1


def assert_levels_cover(levels, lists, last, qo_lens, page_size):
    """Each request's pages, concatenated over the levels (the group holding its first query at each level), are
    its own tokens in order; every group's pages are whole but the last, whose length is kv_last_page_len."""
    starts = np.concatenate([[0], np.cumsum(qo_lens)])
    total = int(starts[-1])
    for level in levels:
        assert level.qo_indptr[0] == 0 and level.qo_indptr[-1] == total
        assert (np.diff(level.qo_indptr) >= 0).all() and (np.diff(level.kv_indptr) >= 0).all()
        assert set(level.qo_indptr.tolist()) <= set(starts.tolist())  # groups are runs of whole requests
        pages = np.diff(level.kv_indptr)
        expect = np.where(pages > 0, (pages - 1) * page_size + level.kv_last_page_len, 0)
        assert (level.kv_lens == expect).all() and ((level.kv_last_page_len == 0) == (pages == 0)).all()
    for b, pages in enumerate(lists):
        if not qo_lens[b]:
            continue
        tokens = []
        for level in levels:
            g = group_of(level, int(starts[b]))
            ids = level.kv_indices[level.kv_indptr[g]:level.kv_indptr[g + 1]].tolist()
            tokens += request_tokens(ids, int(level.kv_last_page_len[g]), page_size)
        assert tokens == request_tokens(pages, int(last[b]), page_size), f"request {b}"


def unique_tokens(lists, last, page_size) -> int:
    """KV tokens a perfect cascade reads: every page once, as much of it as its longest use."""
    used: dict[int, int] = {}
    for pages, n in zip(lists, last):
        for i, p in enumerate(pages):
            used[p] = max(used.get(p, 0), page_size if i < len(pages) - 1 else int(n))
    return sum(used.values())


def block_table(lists: list[list[int]], pad: int = 0) -> np.ndarray:
    """The block table of ``lists`` (rows padded with -1, ``pad`` columns more than the longest)."""
    table = np.full((len(lists), max(map(len, lists), default=0) + pad), -1, np.int32)
    for b, pages in enumerate(lists):
        table[b, :len(pages)] = pages
    return table


def assert_same_levels(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for name in ("qo_indptr", "kv_lens", "kv_indptr", "kv_indices", "kv_last_page_len"):
            assert getattr(x, name).tolist() == getattr(y, name).tolist(), name


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 12), depth=st.integers(0, 4),
       page_size=st.sampled_from([1, 4, 16, 17]), decode=st.booleans(), causal=st.booleans())
def test_derived_levels_of_prefix_trees(seed, batch, depth, page_size, decode, causal):
    rng = np.random.default_rng(seed)
    lists = tree_pages(rng, batch, depth)
    last = last_page_lens(rng, lists, page_size)
    qo_lens = np.ones(batch, np.int64) if decode else rng.integers(0, 5, batch)
    qo = np.concatenate([[0], np.cumsum(qo_lens)])
    levels = derive_levels(qo, **csr(lists, last), page_size=page_size, causal=causal)
    assert_levels_cover(levels, lists, last, qo_lens, page_size)
    assert_same_levels(levels, derive_levels(qo, **csr(lists, last), page_size=page_size, causal=causal,
                                             block_table=block_table(lists, seed % 3)))
    if decode or not causal:  # (a causal prefill's sharing is cut at each request's first query: more levels)
        assert len(levels) <= depth + 1
    for parent, child in zip(levels, levels[1:]):  # derived groups nest
        assert fold_level(parent, child, page_size) is not None
    if causal:
        check_causal(levels)
    if decode:  # every shared page is found: each page read once
        assert sum(int(t.kv_lens.sum()) for t in levels) == unique_tokens(lists, last, page_size)
    for cap in range(1, len(levels) + 1):
        capped = derive_levels(qo, **csr(lists, last), page_size=page_size, causal=causal, max_levels=cap)
        assert len(capped) == cap
        assert_levels_cover(capped, lists, last, qo_lens, page_size)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 10), alphabet=st.integers(1, 6),
       page_size=st.sampled_from([1, 3, 16]))
def test_derived_levels_of_arbitrary_page_lists(seed, batch, alphabet, page_size):
    # ids from a small alphabet: repeats inside a list, across non-neighbours, shared partial last pages
    rng = np.random.default_rng(seed)
    lists = [rng.integers(0, alphabet, int(rng.integers(0, 6))).tolist() for _ in range(batch)]
    if batch > 1 and rng.random() < 0.5:
        lists[1] = list(lists[0])  # two requests with one page list
    last = np.array([0 if not p else int(rng.integers(1, page_size + 1)) for p in lists], np.int32)
    if batch > 1 and lists[1] == lists[0] and rng.random() < 0.5:
        last[1] = last[0]
    qo_lens = rng.integers(1, 3, batch)
    qo = np.concatenate([[0], np.cumsum(qo_lens)])
    levels = derive_levels(qo, **csr(lists, last), page_size=page_size)
    assert_levels_cover(levels, lists, last, qo_lens, page_size)
    assert_same_levels(levels, derive_levels(qo, **csr(lists, last), page_size=page_size,
                                             block_table=block_table(lists)))


def test_the_worked_examples_hold():
    for module in (cascade, cascade_cost):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__


def test_a_partial_last_page_is_shared_only_by_requests_that_end_on_it_alike():
    table = {"kv_indptr": [0, 2, 4, 6], "kv_indices": [5, 6, 5, 6, 5, 6], "kv_last_page_len": [7, 7, 9]}
    levels = derive_levels([0, 1, 2, 3], **table, page_size=16)
    assert [t.kv_indices.tolist() for t in levels] == [[5], [6], [6]]
    assert levels[1].qo_indptr.tolist() == [0, 2, 3] and levels[1].kv_lens.tolist() == [7, 0]
    assert levels[-1].kv_lens.tolist() == [0, 0, 9]


def test_causal_shares_only_keys_before_the_first_query():
    # two requests of 3 pages (48 tokens) over the same pages; 20 queries each: keys 0..28 precede the first
    # query, so one whole page is shared and the others are each request's own
    table = {"kv_indptr": [0, 3, 6], "kv_indices": [1, 2, 3, 1, 2, 3], "kv_last_page_len": [16, 16]}
    levels = derive_levels([0, 20, 40], **table, page_size=16, causal=True)
    assert levels[0].kv_indices.tolist() == [1] and levels[-1].kv_lens.tolist() == [32, 32]
    decode = derive_levels([0, 1, 2], **table, page_size=16, causal=True)
    assert len(decode) == 2 and decode[0].kv_lens.tolist() == [48] and decode[-1].kv_lens.tolist() == [0, 0]
    with pytest.raises(PlanError, match=r"levels\[1\]: request 1 has 20 queries but 0 keys in its last level after "
                       r"48 shared ones"):
        check_causal([decode[0]._replace(qo_indptr=np.array([0, 21])),
                      decode[1]._replace(qo_indptr=np.array([0, 1, 21]))])
    # a request with more queries than keys, none of them shared, is fine
    alone = derive_levels([0, 1, 6], [0, 2, 3], [1, 2, 3], [16, 3], page_size=16, causal=True)
    check_causal(alone)
    assert alone[-1].kv_lens.tolist() == [32, 3]


def test_derivation_of_a_long_shared_prefix_compares_pairs_both_ways():
    # pairs compared one by one (few long lists), in one gather (many short ones) and as block-table rows give
    # the same levels
    for batch, pre, suf in ((8, 300, 5), (400, 2, 1)):
        lists = [list(range(pre)) + [pre + b * suf + i for i in range(suf)] for b in range(batch)]
        lists[batch // 2][pre // 2] = 10**6  # one request branches off halfway
        last = np.full(batch, 16, np.int32)
        levels = derive_levels(np.arange(batch + 1), **csr(lists, last), page_size=16)
        assert_levels_cover(levels, lists, last, np.ones(batch, np.int64), 16)
        assert_same_levels(levels, derive_levels(np.arange(batch + 1), **csr(lists, last), page_size=16,
                                                 block_table=torch.from_numpy(block_table(lists))))
        # the first half of the prefix read once, its second half once by each side of the branch and once by
        # the request that branched, every suffix once
        half = pre // 2
        assert sum(int(t.kv_lens.sum()) for t in levels) == 16 * (half + 3 * (pre - half) + batch * suf)


def test_a_block_table_that_is_not_the_csr_s_pages_is_refused():
    lists = [[1, 2, 3], [1, 2, 4], [5]]
    table = csr(lists, [16, 16, 16])
    with pytest.raises(PlanError, match=r"block_table: expected the batch's page ids as \[batch = 3, >= 3\]"):
        derive_levels([0, 1, 2, 3], **table, page_size=16, block_table=block_table(lists)[:, :2])
    wrong = block_table(lists)
    wrong[1, 2] = 7
    with pytest.raises(PlanError, match=r"block_table: row 1 does not hold request 1's page ids"):
        derive_levels([0, 1, 2, 3], **table, page_size=16, block_table=wrong)


def test_fold_refuses_groups_that_do_not_nest_partial_pages_and_device_ids():
    parent = check_levels([([0, 2, 4], [0, 1, 2], [1, 2], [16, 5])], 16)[0]
    across = check_levels([([0, 1, 3, 4], [0, 1, 2, 3], [3, 4, 5], [16, 16, 16])], 16)[0]
    assert fold_level(parent, across, 16) is None  # child group 1 spans parent groups 0 and 1
    child = check_levels([([0, 1, 2, 3, 4], [0, 1, 1, 2, 2], [3, 4], [16, 0, 16, 0])], 16)[0]
    assert fold_level(parent, child, 16) is None  # parent group 1 ends in a partial page before page 4
    child = check_levels([([0, 1, 2, 3, 4], [0, 1, 1, 1, 1], [3], [16, 0, 0, 0])], 16)[0]
    folded = fold_level(parent, child, 16)
    assert folded.kv_indices.tolist() == [1, 3, 1, 2, 2] and folded.kv_last_page_len.tolist() == [16, 16, 5, 5]
    assert folded.kv_lens.tolist() == [32, 16, 5, 5]
    on_device = parent._replace(kv_indices=torch.tensor([1, 2]))  # not a numpy array: ids the host cannot move
    assert fold_level(on_device, child, 16) is None


def test_cost_model_folds_short_prefixes_and_keeps_long_ones():
    page = 16

    def batch(prefix_pages, batch_size=128):
        lists = [list(range(prefix_pages)) + [10**5 + b] for b in range(batch_size)]
        return derive_levels(np.arange(batch_size + 1), **csr(lists, np.full(batch_size, page)), page_size=page,
                             with_table=True)

    for prefix, folds in ((2048, False), (64, False), (1, True)):
        levels, flat = batch(prefix)
        kept, tables, choices = choose_levels(levels, SHAPE, page, flat=flat)
        assert [c.decision for c in choices] == (["folded"] if folds else ["run"])
        assert (tables[-1] is flat) == folds and kept == ([1] if folds else [0, 1])
        assert choices[0].cost.pays != folds
    # few readers of 32k keys: flat costs a read each; the level one read and a q tile of matrix work (mostly
    # padding: 2 requests x 4 heads fill 8 of its 128 rows), which 4 readers pay for and 2 do not
    for readers, decision in ((4, "run"), (2, "folded")):
        levels, _ = batch(2048, batch_size=readers)
        assert choose_levels(levels, SHAPE, page)[2][0].decision == decision
    levels, flat = batch(1)
    assert choose_levels(levels, SHAPE, page, CascadePolicy(fold="never"))[0] == [0, 1]
    levels, flat = batch(2048)
    kept, tables, _ = choose_levels(levels, SHAPE, page, CascadePolicy(fold="always"))
    assert kept == [1]
    assert_levels_cover(tables, [list(range(2048)) + [10**5 + b] for b in range(128)], np.full(128, page),
                        np.ones(128, np.int64), page)
    # a CUDA-graph wrapper launches every level anyway: only bytes and matrix work count
    cost = level_cost([16], [128], [128], SHAPE)
    fixed = level_cost([16], [128], [128], SHAPE, fixed_launches=True)
    assert not cost.pays and fixed.pays


def test_cost_model_folds_level_by_level_top_down():
    # level 0: 1 page shared by all 64 requests (folds: 64 x 16 tokens re-read is cheaper than two launches);
    # level 1: 128 pages per half (runs, with level 0's page prepended to each half)
    lists = [[0] + list(range(1 + 128 * (b // 32), 1 + 128 * (b // 32 + 1))) + [10**5 + b] for b in range(64)]
    last = np.full(64, 16, np.int32)
    levels = derive_levels(np.arange(65), **csr(lists, last), page_size=16)
    assert len(levels) == 3
    kept, tables, choices = choose_levels(levels, SHAPE, 16)
    assert [c.decision for c in choices] == ["folded", "run"] and kept == [1, 2]
    assert tables[0].kv_lens.tolist() == [129 * 16, 129 * 16]
    assert_levels_cover(tables, lists, last, np.ones(64, np.int64), 16)


def test_levels_with_device_ids_run_when_they_should_fold():
    levels = check_levels([([0, 2], [0, 1], _device(torch.tensor([3], dtype=torch.int32)), [16]),
                           ([0, 1, 2], [0, 1, 2], [4, 5], [16, 16])], 16)
    assert not levels[0].host
    kept, _, choices = choose_levels(levels, SHAPE, 16)
    assert kept == [0, 1] and choices[0].decision == "run" and not choices[0].cost.pays


def test_empty_levels_are_not_run():
    levels = check_levels([([0, 2], [0, 0], [], [0]), ([0, 1, 2], [0, 1, 2], [4, 5], [16, 16])], 16)
    kept, _, choices = choose_levels(levels, SHAPE, 16)
    assert kept == [1] and choices[0].decision == "empty" and choices[0].cost is None
    empty = empty_level(7)
    assert empty.qo_indptr.tolist() == [0, 7] and empty.kv_lens.tolist() == [0]
    assert empty.table()["kv_indices"].size == 0


def test_given_levels_take_block_tables_mappings_and_tuples():
    levels = check_levels([CascadeLevel([0, 3], block_table=[[4, 2]], seq_lens=[20]),
                           {"qo_indptr": [0, 1, 3], "kv_indptr": [0, 1, 1], "kv_indices": [9],
                            "kv_last_page_len": [3, 0]},
                           ([0, 1, 2, 3], [0, 0, 1, 2], [6, 7], [0, 16, 16])], 16)
    assert [t.kv_lens.tolist() for t in levels] == [[20], [3, 0], [0, 16, 16]]
    assert levels[0].kv_indices.tolist() == [4, 2] and levels[0].kv_last_page_len.tolist() == [4]
    device = check_levels([CascadeLevel([0, 3], block_table=_device(torch.tensor([[4, 2]], dtype=torch.int32)),
                                        seq_lens=[20])], 16)[0]
    assert not device.host and device.table()["seq_lens"].tolist() == [20]


def _device(t: torch.Tensor) -> torch.Tensor:
    from stub_cuda import on_device
    return on_device(t)


BAD_LEVELS = [
    ([], r"^levels: expected a non-empty list"),
    ([([0, 3], [0, 1], [1], [16]), ([0, 1, 2], [0, 1, 2], [1, 2], [16, 16])],
     r"^levels\[1\]\.qo_indptr\[-1\] = 2, expected total_q = 3"),
    ([([0, 3, 2], [0, 1, 1], [1], [16, 0])], r"^levels\[0\]\.qo_indptr\[2\] = 2 < qo_indptr\[1\] = 3"),
    ([([1, 3], [0, 1], [1], [16])], r"^levels\[0\]\.qo_indptr\[0\] = 1, expected 0"),
    ([([0, 3], [0, 1, 1], [1], [16, 0])], r"^levels\[0\]\.kv_indptr: has 3 entries, expected len\(qo_indptr\) = 2"),
    ([([0, 3], [0, 1], [1], [16, 3])], r"^levels\[0\]\.kv_last_page_len: has 2 entries, expected batch_size = 1"),
    ([([0, 3], [0, 2], [1], [16])], r"^levels\[0\]\.kv_indptr\[-1\] = 2 > len\(kv_indices\) = 1"),
    ([([0, 3], [0, 1], [1], [17])], r"^levels\[0\]\.kv_last_page_len\[0\] = 17, expected 1\.\.16"),
    ([([0, 3], [0, 1], [8], [16])], r"^levels\[0\]\.kv_indices\[0\] = 8 is outside the page pool \[0, 8\)"),
    ([([0, 3], [0, 1], [-1], [16])], r"^levels\[0\]\.kv_indices\[0\] = -1 is outside the page pool"),
    ([([0, 3], [0, 1], [1])], r"^levels\[0\]\.qo_indptr: expected a CascadeLevel, a mapping or a 4-tuple"),
    ([{"qo_indptr": [0, 3], "kv_len": [3]}], r"^levels\[0\]\.kv_len: not a CascadeLevel field"),
    ([CascadeLevel([0, 3], [0, 1])], r"^levels\[0\]\.kv_indices: required"),
    ([CascadeLevel([0, 3], block_table=[[1]], seq_lens=[17])], r"^levels\[0\]\.seq_lens\[0\] = 17 needs 2 pages"),
    ([CascadeLevel([0, 3], block_table=[[9]], seq_lens=[3])], r"^levels\[0\]\.block_table\[0, 0\] = 9 is outside"),
    ([CascadeLevel([0, 3], [0, 1], [1], [16], block_table=[[1]], seq_lens=[3])], r"^levels\[0\]\.block_table: give"),
    ("abc", r"^levels: expected a non-empty list"),
]


@pytest.mark.parametrize("levels, message", BAD_LEVELS)
def test_bad_levels_name_the_level_and_argument(levels, message):
    with pytest.raises(PlanError, match=message):
        check_levels(levels, 16, num_pages=8)


@pytest.mark.parametrize("kwargs, message", [
    ({"qo_indptr": [0, 1, 2, 3]}, r"^qo_indptr: has 4 entries, expected batch_size \+ 1 = 3"),
    ({"kv_indices": [1, 2, 9]}, r"^kv_indices\[2\] = 9 is outside the page pool \[0, 8\)"),
    ({"kv_last_page_len": [16, 0]}, r"^kv_last_page_len\[1\] = 0, expected 1\.\.16"),
    ({"kv_indptr": [0, 2, 1]}, r"^kv_indptr\[2\] = 1 < kv_indptr\[1\] = 2"),
    ({"max_levels": 0}, r"^max_levels: got 0, expected None or an int >= 1"),
])
def test_bad_derivation_inputs_name_the_argument(kwargs, message):
    args = {"qo_indptr": [0, 1, 2], "kv_indptr": [0, 2, 3], "kv_indices": [1, 2, 1], "kv_last_page_len": [16, 16],
            "page_size": 16, "num_pages": 8}
    with pytest.raises(PlanError, match=message):
        derive_levels(**{**args, **kwargs})


@pytest.mark.parametrize("policy, message", [
    ("cost", r"^policy: expected a CascadePolicy, got str"),
    (CascadePolicy(fold="sometimes"), r"^policy\.fold: got 'sometimes', expected one of 'cost', 'never', 'always'"),
    (CascadePolicy(copy_gbps=0), r"^policy\.copy_gbps: got 0, expected a finite number > 0"),
    (CascadePolicy(matrix_tflops=float("nan")), r"^policy\.matrix_tflops: got nan"),
    (CascadePolicy(launch_us=-1.0), r"^policy\.launch_us: got -1\.0, expected a finite number >= 0"),
])
def test_bad_policies_name_the_field(policy, message):
    with pytest.raises(PlanError, match=message):
        check_policy(policy)
    assert check_policy(None) == CascadePolicy()
