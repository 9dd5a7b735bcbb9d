"""The planner's fast paths (``fast_paths.plan_numpy``: numpy straight into the host buffer; ``list_paths``:
Python lists for a few requests) equal the reference path ``split_kv._plan_general`` (``heuristics.choose_split``,
``split_kv_arrays``, ``Plan.pack``) field for field, item order included, for every option."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashgen.plan import PlanError, plan_decode, plan_prefill, plan_split_kv
from flashgen.plan import split_kv as S
from flashgen.plan.fast_paths import plan_numpy


def assert_same_plan(fast, general):
    assert fast.kind == general.kind and fast.info == general.info
    assert {n: f.length for n, f in fast.schema.items()} == {n: f.length for n, f in general.schema.items()}
    for name in general.schema:
        assert fast.numpy(name).tolist() == general.numpy(name).tolist(), name


def reference(qo_indptr, kv_lens, **options):
    return S._plan_general(S.request_for(qo_indptr, kv_lens, **options))


@st.composite
def prefill_batches(draw):
    n = draw(st.one_of(st.integers(0, 8), st.integers(0, 80)))
    short = st.one_of(st.just(0), st.just(1), st.integers(0, 64))
    kv = draw(st.lists(st.one_of(short, st.integers(0, 40000)), min_size=n, max_size=n))
    q = draw(st.lists(st.one_of(st.just(0), st.just(1), st.integers(0, 300)), min_size=n, max_size=n))
    group = draw(st.sampled_from([1, 4, 7, 8]))
    num_kv_heads = draw(st.sampled_from([1, 2, 8]))
    options = dict(tile_rows=draw(st.sampled_from([None, 16, 64, 128])),
                   num_sms=draw(st.sampled_from([4, 16, 132, 264])), kv_granularity=draw(st.sampled_from([1, 16, 64])),
                   enable_split=draw(st.booleans()),
                   balance_tail=draw(st.booleans()), split_min_waves=draw(st.sampled_from([None, 1.0, 2.0])))
    if draw(st.booleans()):
        options["max_batch_size"] = n + draw(st.integers(0, 20))
        options["max_total_q"] = sum(q) + draw(st.integers(0, 50))
        if draw(st.booleans()):
            options["capacity"] = draw(st.integers(0, 300))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    qo = np.concatenate([[0], np.cumsum(q, dtype=np.int64)]).astype(dtype)
    return qo, np.array(kv, dtype=dtype), group * num_kv_heads, num_kv_heads, options


@settings(max_examples=400, deadline=None)
@given(prefill_batches())
def test_prefill_paths_equal_the_general_path(batch):
    qo, kv_lens, hq, hkv, options = batch
    heads = dict(num_qo_heads=hq, num_kv_heads=hkv, **options)
    try:
        general = reference(qo, kv_lens, **heads)
    except PlanError as error:  # a capacity the batch does not fit: the same error
        with pytest.raises(PlanError, match=str(error).split(":")[0]):
            plan_split_kv(qo, kv_lens, **heads)
        return
    assert_same_plan(plan_split_kv(qo, kv_lens, **heads), general)
    buffer = torch.full((general.numel + 64,), 7, dtype=torch.int32)  # stale contents must not leak through
    assert_same_plan(plan_split_kv(torch.from_numpy(qo), torch.from_numpy(kv_lens), host_buffer=buffer, **heads),
                     general)
    # the numpy fast path on the same batch (a small batch takes the list path above)
    assert_same_plan(plan_numpy(S.request_for(qo, kv_lens, **heads)), general)


@pytest.mark.parametrize("batch", [1, 2, 4, 6, 16, 64, 256, 1024, 4096])
@pytest.mark.parametrize("balance_tail", [False, True])
def test_bench_sized_prefill_batches(batch, balance_tail):
    rng = np.random.default_rng(batch)
    kv_lens = np.exp(rng.uniform(np.log(16), np.log(32768), batch)).astype(np.int32)
    qo_lens = np.minimum(np.exp(rng.uniform(0, np.log(512), batch)).astype(np.int32), kv_lens)
    qo_lens[: batch // 10] = 0
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    for options in ({}, {"split_min_waves": 2.0}, {"max_batch_size": batch + 3, "max_total_q": int(qo[-1]) + 9}):
        heads = dict(num_qo_heads=32, num_kv_heads=8, kv_granularity=64, num_sms=264, tile_rows=128,
                     balance_tail=balance_tail, **options)
        assert_same_plan(plan_split_kv(qo, kv_lens, **heads), reference(qo, kv_lens, **heads))


@pytest.mark.parametrize("batch", [1, 3, 24, 25, 200])
def test_decode_list_and_numpy_paths(batch):
    rng = np.random.default_rng(batch)
    kv_lens = np.exp(rng.uniform(0, np.log(40000), batch)).astype(np.int64)
    kv_lens[::5] = 0
    for options in ({}, {"enable_split": False}, {"max_batch_size": batch + 7}, {"num_sms": 4, "kv_granularity": 1}):
        heads = dict(num_qo_heads=32, num_kv_heads=8, tile_rows=16, **options)
        assert_same_plan(plan_decode(kv_lens, **heads), reference(np.arange(batch + 1), kv_lens, **heads))


def test_large_lengths_take_the_general_path():
    # past the fast paths' int32 bounds (a 2**31-token KV): the reference path plans, with the same result
    qo, kv = np.array([0, 3, 5]), np.array([2**31 + 5, 100], np.int64)
    heads = dict(num_qo_heads=8, num_kv_heads=8)
    assert_same_plan(plan_prefill(qo, kv, **heads), reference(qo, kv, split_min_waves=2.0, **heads))


def test_invalid_small_batches_raise_the_checks_errors():
    with pytest.raises(PlanError, match=r"qo_indptr\[2\] = 2 < qo_indptr\[1\] = 3"):
        plan_prefill(np.array([0, 3, 2]), np.array([10, 10]), num_qo_heads=4, num_kv_heads=4)
    with pytest.raises(PlanError, match=r"qo_indptr\[0\] = 1, expected 0"):
        plan_prefill(np.array([1, 3]), np.array([10]), num_qo_heads=4, num_kv_heads=4)
    with pytest.raises(PlanError, match=r"kv_lens\[1\] = -4, expected >= 0"):
        plan_prefill(np.array([0, 3, 5]), np.array([10, -4]), num_qo_heads=4, num_kv_heads=4)
    with pytest.raises(PlanError, match=r"kv_lens: has 1 entries, expected batch_size = 2"):
        plan_prefill(torch.tensor([0, 3, 5]), torch.tensor([10]), num_qo_heads=4, num_kv_heads=4)
    with pytest.raises(PlanError, match=r"kv_lens\[1\] = -1, expected >= 0"):
        plan_decode(np.array([5, -1, 3]), num_qo_heads=4, num_kv_heads=4)


@pytest.mark.parametrize("seed", range(12))
def test_decode_list_path_ties_at_the_chunk_length(seed):
    # lengths that are multiples of the granularity, so that last chunks (and unsplit requests) of exactly
    # kv_chunk tokens tie with the full chunks: the list path's item order must stay the reference's
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 25))
    kv_lens = rng.integers(0, 64, batch) * 64
    kv_lens[rng.integers(0, batch)] = int(rng.integers(1, 5000))
    for options in ({}, {"num_sms": 8}, {"num_sms": 2, "kv_granularity": 64}, {"max_batch_size": batch + 2}):
        heads = dict(num_qo_heads=16, num_kv_heads=2, tile_rows=16, **options)
        assert_same_plan(plan_decode(kv_lens, **heads), reference(np.arange(batch + 1), kv_lens, **heads))
