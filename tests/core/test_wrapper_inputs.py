"""The wrappers' intake of page tables and runtime values on the CPU (CUDA calls stubbed, tests/stub_cuda.py):
page ids "on the device" are CPU tensors that say they are CUDA ones, so what plan() checks, copies and packs
is seen without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashgen
from flashgen import AttentionSpec, Paged
from flashgen.plan import PageTableError

from stub_cuda import on_device, stubbed_cuda

PAGED = AttentionSpec(128, kv_layout=Paged(16))
HEADS = dict(num_qo_heads=8, num_kv_heads=2)


def _csr(last, indptr=(0, 2, 3)):
    ids = torch.arange(indptr[-1], dtype=torch.int32)
    return dict(kv_indptr=list(indptr), kv_last_page_len=list(last)), ids


@pytest.mark.parametrize("last, indptr, message", [
    ([0, 5], (0, 2, 3), r"kv_last_page_len\[0\] = 0, expected 1..16"),
    ([17, 5], (0, 2, 3), r"kv_last_page_len\[0\] = 17, expected 1..16"),
    ([-3, 5], (0, 2, 3), r"kv_last_page_len\[0\] = -3, expected 1..16"),
    ([5, 5], (0, 0, 3), r"kv_last_page_len\[0\] = 5, expected 0 \(the request has no pages\)"),
])
@pytest.mark.parametrize("wrapper", ["decode", "prefill"])
def test_last_page_len_is_checked_for_device_and_host_ids(last, indptr, message, wrapper):
    with stubbed_cuda():
        if wrapper == "decode":
            w, extra = flashgen.BatchDecodeWrapper(PAGED, num_sms=132), {}
        else:
            w = flashgen.BatchPrefillWrapper(PAGED, num_sms=132, backend="portable")
            extra = {"qo_indptr": [0, 1, 2]}
        arrays, ids = _csr(last, indptr)
        for kv_indices in (on_device(ids), ids):
            with pytest.raises(PageTableError, match=message):
                w.plan(**arrays, kv_indices=kv_indices, **HEADS, **extra)


def test_last_page_len_of_a_large_batch_with_device_ids():
    lens = np.full(256, 40)
    lens[200] = 0
    indptr = np.concatenate([[0], np.cumsum(-(-lens // 16))]).astype(np.int32)
    last = np.where(lens > 0, 8, 0).astype(np.int32)
    last[77] = 40
    with stubbed_cuda():
        w = flashgen.BatchDecodeWrapper(PAGED, num_sms=132)
        ids = on_device(torch.arange(int(indptr[-1]), dtype=torch.int32))
        with pytest.raises(PageTableError, match=r"kv_last_page_len\[77\] = 40, expected 1..16"):
            w.plan(kv_indptr=indptr, kv_indices=ids, kv_last_page_len=last, **HEADS)
        last[77] = 8
        w.plan(kv_indptr=indptr, kv_indices=ids, kv_last_page_len=last, **HEADS)
        assert w._impl.core.planned.q_shape[0] == 256


@pytest.mark.parametrize("seq_lens, message", [
    ([-1, 5], r"seq_lens\[0\] = -1, expected 0..48"),
    ([5, 49], r"seq_lens\[1\] = 49, expected 0..48 \(block_table's 3 columns of 16 tokens\)"),
    ([5], r"seq_lens: has 1 entries, expected batch_size = 2"),
])
def test_seq_lens_must_fit_a_device_block_table(seq_lens, message):
    with stubbed_cuda():
        w = flashgen.BatchDecodeWrapper(PAGED, num_sms=132)
        table = on_device(torch.zeros(2, 3, dtype=torch.int32))
        with pytest.raises(PageTableError, match=message):
            w.plan(block_table=table, seq_lens=seq_lens, **HEADS)
        w.plan(block_table=table, seq_lens=[48, 0], **HEADS)


def test_runtime_value_conventions():
    from flashgen import SlidingWindow
    from flashgen.api.wrapper import WINDOW_NONE, runtime_values

    window = AttentionSpec(128, mask=SlidingWindow(64))
    assert runtime_values(window).window_left == 64
    assert runtime_values(window, window_left=-1).window_left == WINDOW_NONE  # FlashInfer's "no window"
    assert runtime_values(window, window_left=np.int64(7)).window_left == 7
    assert runtime_values(window, window_left=2**40).window_left == WINDOW_NONE  # wider than any KV: none
    assert runtime_values(PAGED, window_left=-1).window_left == 0  # no window to turn off
    assert runtime_values(PAGED, soft_cap=0.0).soft_cap == 0.0  # FlashInfer's "off"
    assert runtime_values(PAGED, sm_scale=np.float32(0.5)).sm_scale == 0.5
    capped = AttentionSpec(128, soft_cap=30.0)
    assert runtime_values(capped).soft_cap == 30.0 and runtime_values(capped, soft_cap=5).soft_cap == 5.0


@pytest.mark.parametrize("kwargs, message", [
    ({"window_left": 5}, r"^window_left: got 5, but this spec has no sliding window"),
    ({"soft_cap": 5.0}, r"^soft_cap: got 5.0, but this spec has no soft-cap"),
    ({"sm_scale": -0.1}, r"^sm_scale: got -0.1, expected a finite number > 0"),
    ({"sm_scale": 1e39}, r"^sm_scale: got 1e\+39, expected a finite number > 0"),
    ({"rope_scale": 1e-300}, r"^rope_scale: got 1e-300, expected a finite number > 0 whose inverse"),
])
def test_runtime_values_the_kernels_would_misread_are_refused(kwargs, message):
    from flashgen.api.wrapper import runtime_values
    from flashgen.plan import PlanError

    with pytest.raises(PlanError, match=message):
        runtime_values(PAGED, **kwargs)


@pytest.mark.parametrize("count", [1, 3])
def test_a_custom_mask_list_has_one_mask_a_request(count):
    from flashgen import CustomMask, Ragged
    from flashgen.plan import PlanError

    with stubbed_cuda():
        w = flashgen.BatchPrefillWrapper(AttentionSpec(128, kv_layout=Ragged(), mask=CustomMask()), num_sms=132,
                                         backend="portable")
        masks = [torch.ones(2, 3, dtype=torch.bool)] * count
        with pytest.raises(PlanError, match=rf"^custom_mask: got {count} masks, expected batch_size = 2"):
            w.plan(qo_indptr=[0, 2, 4], kv_indptr=[0, 3, 6], custom_mask=masks, **HEADS)
        w.plan(qo_indptr=[0, 2, 4], kv_indptr=[0, 3, 6], custom_mask=[torch.ones(2, 3, dtype=torch.bool)] * 2,
               **HEADS)


@pytest.mark.parametrize("form", ["csr", "block_table", "ragged"])
@pytest.mark.parametrize("wrapper", ["decode", "prefill"])
def test_an_empty_batch_given_as_python_lists(form, wrapper):
    from flashgen import Ragged

    spec = AttentionSpec(128, kv_layout=Ragged()) if form == "ragged" else PAGED
    tables = {"csr": dict(kv_indptr=[0], kv_indices=[], kv_last_page_len=[]),
              "block_table": dict(block_table=[], seq_lens=[]), "ragged": dict(kv_indptr=[0])}
    with stubbed_cuda():
        if wrapper == "decode":
            w, extra = flashgen.BatchDecodeWrapper(spec, num_sms=132), {}
        else:
            w, extra = flashgen.BatchPrefillWrapper(spec, num_sms=132, backend="portable"), {"qo_indptr": [0]}
        w.plan(**tables[form], **HEADS, **extra)
        assert w._core.planned.q_shape[0] == 0


def test_runtime_numbers_may_be_numpy_or_one_element_tensors():
    from flashgen import SlidingWindow
    from flashgen.api.wrapper import runtime_values

    window = AttentionSpec(128, mask=SlidingWindow(64))
    got = runtime_values(window, sm_scale=torch.tensor(0.25), window_left=torch.tensor(9), rope_theta=np.float32(1e4))
    assert (got.sm_scale, got.window_left) == (0.25, 9) and isinstance(got.window_left, int)
