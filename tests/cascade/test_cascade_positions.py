"""True positions across cascade levels on the CPU: ``level_positions`` (worked cases and its errors), and the
levels a position-taking CascadeWrapper plans, each attended by the fp64 reference at its explicit positions and
merged, against flat attention over the whole sequences (RoPE, ALiBi, windows)."""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
import torch

import flashgen
from cascade_batches import csr, last_page_lens, shared_cache, tree_pages
from flashgen import ALiBi, AttentionSpec, Causal, CascadePolicy, NoMask, Paged, RoPE, SlidingWindow, SpecError
from flashgen.api import cascade as cascade_api
from flashgen.plan import PlanError
from flashgen.plan.cascade import LevelTable, level_positions
from flashgen.testing.reference import merge_states_ref, reference_attention
from stub_cuda import stubbed_cuda


def table(qo, lens, page_size=4):
    lens = np.asarray(lens)
    npages = -(-lens // page_size)
    indptr = np.concatenate([[0], np.cumsum(npages)])
    last = np.where(lens > 0, lens - (npages - 1) * page_size, 0)
    return LevelTable(np.asarray(qo), lens, indptr, np.arange(indptr[-1]), last)


def test_level_positions_of_a_two_group_tree():
    # level 0: one group of 5 tokens over 6 keys; level 1: groups (req 0-1) 5 keys, (req 2) none; last: own keys
    levels = [table([0, 5], [6]), table([0, 3, 5], [5, 0]), table([0, 1, 3, 5], [2, 4, 1])]
    pages, q_pos = level_positions(levels, 4)
    assert [p.tolist() for p in pages] == [[0, 4], [6, 10], [11, 11, 6]]
    # request 0: 6 + 5 + 2 keys, one query; request 1: 6 + 5 + 4, two; request 2: 6 + 0 + 1, two
    assert q_pos.tolist() == [12, 13, 14, 5, 6]


def test_levels_must_nest_and_be_csr():
    levels = [table([0, 2, 4], [4, 8]), table([0, 1, 4], [1, 1])]  # group 1 of the last level straddles
    with pytest.raises(PlanError, match=r"^levels\[1\]: group 1's tokens have different keys before this level"):
        level_positions(levels, 4)
    block = levels[0]._replace(kv_indptr=None, block_table=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(PlanError, match=r"^levels\[0\]: true positions .* not block_table"):
        level_positions([block, levels[1]], 4)


@contextmanager
def stubbed():
    cpu = lambda device=None: torch.device("cpu")  # noqa: E731
    with stubbed_cuda(), mock.patch.object(cascade_api, "resolve_device", cpu), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (9, 0)):
        yield


SPECS = [AttentionSpec(64, kv_layout=Paged(4), mask=Causal(), pos_encoding=RoPE()),
         AttentionSpec(64, kv_layout=Paged(4), mask=SlidingWindow(6), pos_encoding=ALiBi()),
         AttentionSpec(64, kv_layout=Paged(3), mask=NoMask(), pos_encoding=ALiBi())]


@pytest.mark.parametrize("spec", SPECS, ids=["causal_rope", "window_alibi", "nomask_alibi"])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_planned_levels_at_true_positions_are_flat_attention(spec, shape):
    page = spec.kv_layout.page_size
    with stubbed():
        wrapper = flashgen.CascadeWrapper(spec, num_sms=132)
        for seed, depth in ((0, 0), (1, 1), (2, 2)):
            rng = np.random.default_rng(seed)
            gen = torch.Generator().manual_seed(seed)
            lists = tree_pages(rng, 6, depth)
            last = last_page_lens(rng, lists, page)
            kv = shared_cache(lists, last, page, 2, 64, torch.float64, generator=gen)
            qo_lens = np.ones(6, np.int64) if shape == "decode" else rng.integers(0, 5, 6)
            qo = np.concatenate([[0], np.cumsum(qo_lens)])
            q = torch.randn(int(qo[-1]), 4, 64, generator=gen, dtype=torch.float64)
            flat = csr(lists, last)
            wrapper.plan(qo_indptr=qo, **flat, num_qo_heads=4, num_kv_heads=2, policy=CascadePolicy(fold="never"))
            runs = wrapper._run_tables
            assert all(inner._positions is not None for inner in wrapper._runs)
            pages, q_pos = level_positions([t for _, t in runs], page)
            states = [reference_attention(s, q, kv, qo_indptr=t.qo_indptr, **t.table(), q_pos=q_pos,
                                          kv_page_pos=p) for (s, t), p in zip(runs, pages)]
            out, lse = merge_states_ref(torch.stack([o for o, _ in states], 1), torch.stack([x for _, x in states], 1))
            ref, ref_lse = reference_attention(spec, q, kv, qo_indptr=qo, **flat)
            assert torch.equal(lse.isneginf(), ref_lse.isneginf())
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


def test_sm90_runs_positions():
    with stubbed():
        for spec in SPECS:
            flashgen.CascadeWrapper(spec, prefill_backend="sm90")  # the Hopper kernels take the option
