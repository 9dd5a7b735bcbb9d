"""Planner properties: schema and buffer, chunk heuristic, coverage, fixed capacity, cascade, block-sparse."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from flashgen.plan import (SPLIT_KV_SCHEMA, PlanError, choose_kv_chunk, choose_tail_split, plan_block_sparse, plan_cascade,
                           plan_decode, plan_prefill, plan_split_kv)
from flashgen.testing.executor import coverage


def test_plan_is_one_int32_buffer_with_aligned_schema():
    plan = plan_prefill([0, 5, 6, 6], [100, 7000, 3], num_qo_heads=8, num_kv_heads=2, num_sms=16)
    assert plan.kind == "split_kv" and plan.host.dtype == torch.int32 and plan.host.dim() == 1
    assert list(plan.schema) == list(SPLIT_KV_SCHEMA)
    ends = 0
    for name, field in plan.schema.items():
        assert field.offset % 4 == 0 and field.offset >= ends
        ends = field.offset + field.length
        assert plan[name].data_ptr() == plan.host.data_ptr() + 4 * field.offset  # a view, not a copy
    assert plan.numel >= ends
    info = plan.info
    assert info.grid == (info.num_items, 2) and info.group_size == 4
    assert plan["qo_indptr"].tolist() == [0, 5, 6, 6] and plan["kv_len"].tolist() == [100, 7000, 3]
    assert plan["num_chunks"].tolist()[1] > 1 and plan["num_chunks"].tolist()[2] == 0  # no queries, no items


def test_to_device_is_one_non_blocking_copy():
    plan = plan_decode([5, 900, 40], num_qo_heads=4, num_kv_heads=1)
    calls = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(func, "__name__", "") == "copy_":
                calls.append(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            return func(*args, **kwargs)

    device = torch.zeros(plan.numel + 10, dtype=torch.int32)  # stands in for a CUDA buffer
    with Spy():
        views = plan.to_device(device)
    assert calls == [True]
    for name in plan.schema:
        assert torch.equal(views[name], plan[name])
        assert views[name].data_ptr() >= device.data_ptr()
    with pytest.raises(PlanError, match="device_buffer"):
        plan.to_device(torch.zeros(3, dtype=torch.int32))


def test_host_buffer_is_reused():
    buf = torch.zeros(4096, dtype=torch.int32)
    plan = plan_decode([5, 900], num_qo_heads=4, num_kv_heads=4, host_buffer=buf)
    assert plan.host.data_ptr() == buf.data_ptr()
    with pytest.raises(PlanError, match="host_buffer"):
        plan_decode([5, 900], num_qo_heads=4, num_kv_heads=4, host_buffer=torch.zeros(3, dtype=torch.int32))


def test_chunk_heuristic_worked_examples():
    # FA3's example (see choose_kv_chunk): 2 splits beat 3 splits
    assert choose_kv_chunk(np.array([4096]), np.array([48]), 1, num_sms=108) == 2048
    # a mixed decode batch splits only the long request
    lens = np.array([100] * 255 + [8000])
    chunk = choose_kv_chunk(lens, np.ones(256, np.int64), 8)
    assert 100 <= chunk < 8000 and chunk % 16 == 0
    # a batch that already fills the machine with equal work is not split
    assert choose_kv_chunk(np.full(512, 1000), np.ones(512, np.int64), 8) >= 1000
    # one long request on an empty machine is split to fill it
    assert choose_kv_chunk(np.array([16384]), np.array([1]), 8) <= 16384 // 8


def test_long_requests_split_more_and_items_are_balanced():
    lens = np.array([50, 20000, 3000, 700, 20000, 1])
    plan = plan_decode(lens, num_qo_heads=32, num_kv_heads=8, num_sms=132)
    chunks = plan["num_chunks"].numpy()
    assert chunks[1] == chunks[4] > chunks[2] >= chunks[3] >= chunks[0] == chunks[5] == 1
    sizes = (plan["kv_end"] - plan["kv_start"]).numpy()
    assert sizes.max() <= plan.info.kv_chunk
    assert (np.diff(sizes) <= 0).all()  # longest items first


def test_disabled_split_plans_one_chunk_per_request():
    plan = plan_decode([50, 20000, 3], num_qo_heads=32, num_kv_heads=8, enable_split=False)
    assert plan["num_chunks"].tolist() == [1, 1, 1] and (plan["chunk_idx"].numpy() == -1).all()
    assert plan.info.partial_rows == 0 and plan["merge_indptr"].tolist() == [0, 0, 0, 0]


@st.composite
def batches(draw, max_len=3000):
    n = draw(st.integers(1, 6))
    qo = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    kv = draw(st.lists(st.one_of(st.just(0), st.just(1), st.integers(0, max_len)), min_size=n, max_size=n))
    group = draw(st.sampled_from([1, 4, 7]))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    options = dict(tile_rows=draw(st.sampled_from([None, 4, 16, 64])), num_sms=draw(st.sampled_from([4, 16, 132])),
                   kv_granularity=draw(st.sampled_from([1, 3, 16, 64])),
                   split_min_waves=draw(st.sampled_from([None, 2.0])))
    return np.concatenate([[0], np.cumsum(qo)]), np.array(kv), group * num_kv_heads, num_kv_heads, options


@settings(max_examples=60, deadline=None)
@given(batches())
def test_every_request_head_and_kv_position_is_covered_exactly_once(batch):
    qo_indptr, kv_lens, hq, hkv, options = batch
    plan = plan_prefill(qo_indptr, kv_lens, num_qo_heads=hq, num_kv_heads=hkv, **options)
    for counts in coverage(plan):
        assert (counts == 1).all()
    info = plan.info
    merge = plan["merge_indptr"].numpy()
    chunks = plan["num_chunks"].numpy()
    expect = np.repeat(np.where(chunks > 1, chunks, 0), np.diff(qo_indptr))
    assert np.diff(merge).tolist() == expect.tolist() and info.partial_rows == merge[-1]
    # every real qo tile has items; items of empty-KV requests have an empty range
    req = plan["request_idx"].numpy()
    for r in np.flatnonzero((np.diff(qo_indptr) > 0) & (kv_lens == 0)):
        assert ((plan["kv_end"].numpy() - plan["kv_start"].numpy())[req == r] == 0).all()
        assert (req == r).sum() == -(-(np.diff(qo_indptr)[r] * hq // hkv) // info.tile_rows)


@settings(max_examples=30, deadline=None)
@given(batches(), st.integers(0, 40))
def test_fixed_capacity_arrays_do_not_depend_on_the_batch(batch, spare):
    qo_indptr, kv_lens, hq, hkv, options = batch
    options["tile_rows"] = options["tile_rows"] or 16
    max_batch, max_total_q = len(kv_lens) + spare, int(qo_indptr[-1]) + spare
    fixed = dict(max_batch_size=max_batch, max_total_q=max_total_q, num_qo_heads=hq, num_kv_heads=hkv, **options)
    plan = plan_prefill(qo_indptr, kv_lens, **fixed)
    empty = plan_prefill([0], [], **fixed)
    assert {n: f.length for n, f in plan.schema.items()} == {n: f.length for n, f in empty.schema.items()}
    assert plan.info.grid == empty.info.grid and plan.info.partial_capacity == empty.info.partial_capacity
    assert plan.info.partial_rows <= plan.info.partial_capacity
    pad = slice(plan.info.num_items, None)
    assert (plan["request_idx"][pad] == -1).all() and (plan["kv_start"][pad] == 0).all()
    assert (plan["kv_end"][pad] == 0).all()
    assert (plan["qo_indptr"][len(kv_lens):] == int(qo_indptr[-1])).all()
    assert (plan["merge_indptr"][int(qo_indptr[-1]):] == plan.info.partial_rows).all()
    for counts in coverage(plan):
        assert (counts == 1).all()


def test_fixed_capacity_errors():
    with pytest.raises(PlanError, match="max_batch_size = 2"):
        plan_decode([1, 2, 3], num_qo_heads=4, num_kv_heads=4, max_batch_size=2)
    with pytest.raises(PlanError, match="max_total_q = 4"):
        plan_prefill([0, 5], [9], num_qo_heads=4, num_kv_heads=4, max_batch_size=2, max_total_q=4)
    with pytest.raises(PlanError, match="capacity of 2"):
        plan_decode([1, 2, 3], num_qo_heads=4, num_kv_heads=4, max_batch_size=8, capacity=2)


def test_planner_input_errors():
    with pytest.raises(PlanError, match="num_qo_heads: 6 is not a multiple of num_kv_heads = 4"):
        plan_decode([1], num_qo_heads=6, num_kv_heads=4)
    with pytest.raises(PlanError, match=r"kv_lens\[1\] = -3"):
        plan_decode([1, -3], num_qo_heads=4, num_kv_heads=4)
    with pytest.raises(PlanError, match="kv_lens: has 1 entries, expected batch_size = 2"):
        plan_split_kv([0, 1, 2], [4], num_qo_heads=4, num_kv_heads=4)


def test_cascade_levels():
    plan = plan_cascade([([0, 7], [4096]), ([0, 3, 7], [64, 0]), ([0, 1, 3, 6, 7], [5, 9, 1, 0])],
                        num_qo_heads=8, num_kv_heads=2)
    assert plan.kind == "cascade" and plan.info.num_levels == 3 and plan.info.total_q == 7
    assert plan.level(0)["num_chunks"].tolist()[0] > 1  # the shared prefix, one request, is split
    for level in range(3):
        for counts in coverage(plan.level(level)):
            assert (counts == 1).all()
    with pytest.raises(PlanError, match=r"levels\[1\]: qo_indptr\[-1\] = 6, expected total_q = 7"):
        plan_cascade([([0, 7], [10]), ([0, 6], [10])], num_qo_heads=2, num_kv_heads=2)


def test_block_sparse_skips_empty_blocks():
    # 4 block rows x 5 block columns of 3 x 4; N = 18 so the last column block holds 2
    indptr, indices = [0, 2, 2, 5, 6], [0, 4, 1, 2, 4, 3]
    plan = plan_block_sparse(indptr, indices, block_q=3, block_kv=4, qo_len=11, kv_len=18,
                             num_qo_heads=2, num_kv_heads=1, num_sms=4)
    assert plan.kind == "block_sparse" and plan.info.page_size == 4
    assert plan["kv_indices"].tolist() == indices and plan["kv_last_page_len"].tolist() == [2, 0, 2, 4]
    assert plan["kv_len"].tolist() == [6, 0, 10, 4] and plan["qo_indptr"].tolist() == [0, 3, 6, 9, 11]
    items = plan.info.split_kv.num_items
    span = (plan["kv_end"] - plan["kv_start"])[:items]
    assert int(span.sum()) == 6 + 10 + 4  # only the listed blocks' tokens are visited
    empty_row = plan["request_idx"][:items] == 1
    assert int(empty_row.sum()) == 1 and int(span[empty_row].sum()) == 0  # one item that only writes zeros
    with pytest.raises(PlanError, match=r"indices\[1\] = 5 is outside the column blocks \[0, 5\)"):
        plan_block_sparse([0, 2, 2, 2, 2], [0, 5], block_q=3, block_kv=4, qo_len=11, kv_len=18,
                          num_qo_heads=2, num_kv_heads=1)
    with pytest.raises(PlanError, match="sorted and unique"):
        plan_block_sparse([0, 2, 2, 2, 2], [3, 1], block_q=3, block_kv=4, qo_len=11, kv_len=18,
                          num_qo_heads=2, num_kv_heads=1)


def test_tail_split_of_a_partly_empty_last_wave():
    # 4 x 4096 tokens, 32 / 8 heads, 128-row tiles on 132 SMs x 2: 4096 CTAs leave 136 for a 16th wave; its 17
    # tiles (the list's first: the grid runs the list from its end) become 5 chunks each
    assert choose_tail_split(4096, 512, 8, num_sms=264, granularity=64) == (17, 5)
    assert choose_tail_split(4096, 528, 8, num_sms=264, granularity=64) is None  # whole waves
    assert choose_tail_split(4096, 20, 8, num_sms=264, granularity=64) is None  # one partial wave: _choose's
    assert choose_tail_split(100, 512, 8, num_sms=264, granularity=64) is None  # too short to split
    assert choose_tail_split(4096, 512, 8, num_sms=264, granularity=64, max_extra=40) == (17, 3)  # spare slots
    qo = np.arange(5) * 4096
    plan = plan_prefill(qo, [4096] * 4, num_qo_heads=32, num_kv_heads=8, tile_rows=128, kv_granularity=64,
                        num_sms=264, balance_tail=True)
    info, n = plan.info, plan.info.num_items
    assert n == 512 + 17 * 4
    chunk, start, end = (plan.numpy(f)[:n] for f in ("chunk_idx", "kv_start", "kv_end"))
    assert (chunk[:85] == np.tile(np.arange(5), 17)).all() and (chunk[85:] == -1).all()
    assert (start[:85] % 64 == 0).all() and (end[:85] > start[:85]).all()
    merge = np.diff(plan.numpy("merge_indptr")[: 4 * 4096 + 1])
    assert (merge[: 17 * 32] == 5).all() and (merge[17 * 32:] == 0).all() and info.partial_rows == 17 * 32 * 5
    assert_tiles_read_their_kv_once(plan)
    # without balance_tail (and for masks whose items are not their plan length) nothing splits
    assert plan_prefill(qo, [4096] * 4, num_qo_heads=32, num_kv_heads=8, tile_rows=128, kv_granularity=64,
                        num_sms=264).info.num_items == 512
    # a CUDA-graph plan splits within its spare item slots, and its partial rows stay within partial_capacity
    fixed = plan_prefill(qo, [4096] * 4, num_qo_heads=32, num_kv_heads=8, tile_rows=128, kv_granularity=64,
                         num_sms=264, balance_tail=True, max_batch_size=4, max_total_q=4 * 4096)
    assert fixed.info.num_items > 512 and fixed.info.num_items <= fixed.info.capacity
    assert fixed.info.partial_rows <= fixed.info.partial_capacity
    assert_tiles_read_their_kv_once(fixed)
    # the same shape of plan, small enough for coverage()'s dense counts: 32 items on 48 slots, 2 split in 3
    small = plan_prefill(np.arange(5) * 256, [512] * 4, num_qo_heads=32, num_kv_heads=8, tile_rows=128,
                         kv_granularity=64, num_sms=48, balance_tail=True)
    assert small.info.num_items == 32 + 2 * 2
    for counts in coverage(small):
        assert (counts == 1).all()


def assert_tiles_read_their_kv_once(plan):
    # coverage() in interval form, for plans too large for its dense counts: every qo tile of every request reads
    # its KV [0, kv_len) once, in contiguous non-empty chunks (one empty item where kv_len = 0)
    info = plan.info
    req, tile, start, end = (plan.numpy(f)[: info.num_items].astype(np.int64)
                             for f in ("request_idx", "qo_tile_idx", "kv_start", "kv_end"))
    qo = plan.numpy("qo_indptr")[: info.batch_size + 1].astype(np.int64)
    kv = plan.numpy("kv_len")[: info.batch_size].astype(np.int64)
    tiles = -(-(np.diff(qo) * info.group_size) // info.tile_rows)
    order = np.lexsort((start, tile, req))
    req, tile, start, end = req[order], tile[order], start[order], end[order]
    new_tile = np.r_[True, (req[1:] != req[:-1]) | (tile[1:] != tile[:-1])]
    last = np.r_[new_tile[1:], True]
    assert (req >= 0).all() and (tile < tiles[req]).all() and new_tile.sum() == tiles.sum()
    assert (start[new_tile] == 0).all() and (end[last] == kv[req[last]]).all()
    assert (start[~new_tile] == end[np.flatnonzero(~new_tile) - 1]).all()
    assert ((end > start) | (kv[req] == 0)).all()


@settings(max_examples=40, deadline=None)
@given(batches())
def test_tail_split_covers_every_position_once(batch):
    qo_indptr, kv_lens, hq, hkv, options = batch
    if options["tile_rows"] and options["tile_rows"] % (hq // hkv):
        options["tile_rows"] = None  # tail splits need tiles of whole tokens
    plan = plan_prefill(qo_indptr, kv_lens, num_qo_heads=hq, num_kv_heads=hkv, balance_tail=True, **options)
    for counts in coverage(plan):
        assert (counts == 1).all()
    n = plan.info.num_items
    req, tile, chunk = (plan.numpy(f)[:n] for f in ("request_idx", "qo_tile_idx", "chunk_idx"))
    merge = plan.numpy("merge_indptr")[: int(qo_indptr[-1]) + 1]
    rows = []
    for i in np.flatnonzero(chunk >= 0):  # a split tile's chunks are its tokens' merge range, rows used once
        t0 = int(qo_indptr[req[i]]) + int(tile[i]) * plan.info.tile_rows // plan.info.group_size  # its first token
        count = int(((req == req[i]) & (tile == tile[i])).sum())
        assert merge[t0 + 1] - merge[t0] == count and 0 <= chunk[i] < count
        rows.append(int(merge[t0]) + int(chunk[i]))
    assert len(rows) == len(set(rows)) and plan.info.partial_rows == merge[-1]


def test_tail_split_chunks_are_never_empty():
    # 700 tokens in 8 chunks of 64-token multiples: 128-token chunks, so 6 of them (not 8 with two empty)
    from flashgen.plan.split_kv import _split_tail
    items = np.array([[0], [0], [-1], [0], [700]])
    split, counts = _split_tail(items, 1, 8, 64)
    assert counts.tolist() == [6] and split[3].tolist() == [0, 128, 256, 384, 512, 640]
    assert split[4].tolist() == [128, 256, 384, 512, 640, 700] and split[2].tolist() == list(range(6))


def test_a_batch_that_fills_the_gpu_twice_over_is_not_split():
    # 1 x 8192 + 31 x 256 on 264 slots: its work is 8 waves of the longest request's KV, so no request is split
    # (the model alone split the long one into 3 chunks, which measured 8-17 % slower); a lone 512-token request
    # (half a wave) still is
    qo = np.concatenate([[0], np.cumsum([8192] + [256] * 31)])
    kv = [8192] + [256] * 31
    options = dict(num_qo_heads=32, num_kv_heads=8, tile_rows=128, kv_granularity=64, num_sms=264)
    assert (plan_prefill(qo, kv, **options).numpy("num_chunks")[:32] == 1).all()
    assert plan_prefill(qo, kv, split_min_waves=None, **options).numpy("num_chunks")[0] > 1
    assert plan_prefill([0, 512], [512], **options).numpy("num_chunks")[0] > 1


def test_the_worked_examples_hold():
    # the policy's docstring examples (heuristics.py) are doctests: numbers the code computes
    import doctest

    from flashgen.plan import heuristics, host, native, split_kv
    for module in (heuristics, split_kv, host, native):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__


def test_split_policy_replaces_the_candidates_and_the_tail_split():
    from flashgen.plan import DEFAULT_SPLIT_POLICY, SplitPolicy
    from flashgen.plan import split_kv as S

    heads = dict(num_qo_heads=32, num_kv_heads=8, tile_rows=128, kv_granularity=64, num_sms=264)
    forced = SplitPolicy(candidates=lambda max_len, work, num_kv_heads, num_sms, granularity: [1024])
    for qo, kv in (([0, 512], [8192]), (np.arange(14) * 64, np.full(13, 3000))):  # the list and numpy paths
        plan = plan_prefill(qo, kv, split_policy=forced, **heads)
        assert plan.info.kv_chunk == 1024 and (plan.numpy("num_chunks")[: len(kv)] == -(-np.array(kv) // 1024)).all()
        general = S._plan_general(S.request_for(qo, kv, split_min_waves=2.0, split_policy=forced, **heads))
        assert plan.info == general.info
    assert plan_decode([9000, 20], num_qo_heads=32, num_kv_heads=8, split_policy=forced).info.kv_chunk == 1024
    assert plan_decode(np.full(100, 9000), num_qo_heads=32, num_kv_heads=8, split_policy=forced).info.kv_chunk == 1024
    # the tail split: 4 x 4096 tokens split their last wave's 17 items by default, not without a tail_split
    qo, kv = np.arange(5) * 4096, [4096] * 4
    assert plan_prefill(qo, kv, balance_tail=True, **heads).info.num_items == 512 + 17 * 4
    notail = SplitPolicy(tail_split=lambda *args, **kwargs: None)
    assert plan_prefill(qo, kv, balance_tail=True, split_policy=notail, **heads).info.num_items == 512
    assert plan_prefill(qo, kv, balance_tail=True, split_policy=DEFAULT_SPLIT_POLICY, **heads).info.num_items == 580
