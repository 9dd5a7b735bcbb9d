"""The decode fast path (``plan_decode``) equals the general split-KV path field for field, order included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashgen.plan import PlanError, plan_decode, plan_split_kv


def assert_same_plan(fast, general):
    assert fast.kind == general.kind and fast.info == general.info
    assert {n: f.length for n, f in fast.schema.items()} == {n: f.length for n, f in general.schema.items()}
    for name in general.schema:
        assert fast.numpy(name).tolist() == general.numpy(name).tolist(), name


@st.composite
def decode_batches(draw):
    n = draw(st.integers(0, 40))
    short = st.one_of(st.just(0), st.just(1), st.integers(0, 64))
    kv = draw(st.lists(st.one_of(short, st.integers(0, 40000)), min_size=n, max_size=n))
    group = draw(st.sampled_from([1, 4, 7, 32]))
    num_kv_heads = draw(st.sampled_from([1, 2, 8]))
    options = dict(tile_rows=draw(st.sampled_from([None, 4, 16, 64])), num_sms=draw(st.sampled_from([4, 16, 132])),
                   kv_granularity=draw(st.sampled_from([1, 3, 16, 64])), enable_split=draw(st.booleans()))
    if draw(st.booleans()):
        options["max_batch_size"] = n + draw(st.integers(0, 20))
        if draw(st.booleans()):
            options["max_total_q"] = options["max_batch_size"] + draw(st.integers(0, 20))
        if draw(st.booleans()):
            options["capacity"] = draw(st.integers(0, 80))
    return np.array(kv, dtype=draw(st.sampled_from([np.int32, np.int64]))), group * num_kv_heads, num_kv_heads, options


@settings(max_examples=300, deadline=None)
@given(decode_batches())
def test_decode_fast_path_equals_general_path(batch):
    kv_lens, hq, hkv, options = batch
    if kv_lens.size == 0 and options["tile_rows"] is None:
        options["tile_rows"] = 16  # an empty prefill batch sizes tiles for 0 queries, decode for 1
    heads = dict(num_qo_heads=hq, num_kv_heads=hkv, **options)
    try:
        general = plan_split_kv(np.arange(kv_lens.size + 1), kv_lens, **heads)
    except PlanError as error:  # a capacity the batch does not fit: the same error from both
        with pytest.raises(PlanError, match=str(error).split(":")[0]):
            plan_decode(kv_lens, **heads)
        return
    assert_same_plan(plan_decode(kv_lens, **heads), general)
    buffer = torch.full((general.numel + 64,), 7, dtype=torch.int32)  # stale contents must not leak through
    assert_same_plan(plan_decode(torch.from_numpy(kv_lens), host_buffer=buffer, **heads), general)


def test_decode_fast_path_on_bench_sized_batches():
    rng = np.random.default_rng(1)
    buffer = torch.empty(1 << 20, dtype=torch.int32)
    for batch in (1, 16, 256, 1024, 4096):
        kv_lens = np.exp(rng.uniform(np.log(16), np.log(32768), batch)).astype(np.int32)
        kv_lens[: batch // 10] = rng.integers(0, 3, batch // 10)
        heads = dict(num_qo_heads=32, num_kv_heads=8, kv_granularity=16, num_sms=132)
        general = plan_split_kv(np.arange(batch + 1), kv_lens, **heads)
        assert_same_plan(plan_decode(kv_lens, host_buffer=buffer, **heads), general)
        fixed = dict(heads, max_batch_size=batch + 100)
        assert_same_plan(plan_decode(kv_lens, **fixed), plan_split_kv(np.arange(batch + 1), kv_lens, **fixed))


def test_decode_length_errors():
    with pytest.raises(PlanError, match=r"kv_lens\[2\] = -1, expected >= 0"):
        plan_decode(np.array([5, 2**31 - 1, -1], np.int64), num_qo_heads=4, num_kv_heads=4)
    with pytest.raises(PlanError, match=r"kv_lens\[1\] = 1073741824, expected < 2\*\*30"):
        plan_decode(np.array([5, 2**30], np.int32), num_qo_heads=4, num_kv_heads=4)
