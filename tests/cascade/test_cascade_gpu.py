"""GPU tests of CascadeWrapper against the fp64 flat reference over the whole sequences: NaN-poisoned outputs, NaN
in every cache slot no request reads, batches whose requests share pages along random prefix trees."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashgen
from cascade_batches import csr, last_page_lens, shared_cache, tree_pages
from flashgen import AttentionSpec, Causal, CascadeLevel, CascadePolicy, NoMask, Paged
from flashgen.testing.check import check_attention
from graph_replay import fill_pools, reference_check, replay_after_replanning

pytestmark = pytest.mark.cuda

HEADS = 2  # kv heads
NEVER = CascadePolicy(fold="never")  # every level with KV runs (test batches are too small to pay)


def tree_case(seed: int, batch: int, depth: int, page_size: int, qo_lens, group: int, order: str = "NHD",
              spare_pages: int = 2):
    """(q, kv, table, qo_indptr) on the CPU, bf16: a random prefix-tree batch."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    lists = tree_pages(rng, batch, depth)
    last = last_page_lens(rng, lists, page_size)
    kv = shared_cache(lists, last, page_size, HEADS, 128, torch.bfloat16, order=order, spare_pages=spare_pages,
                      generator=gen)
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int64)
    q = torch.randn(int(qo[-1]), HEADS * group, 128, generator=gen).to(torch.bfloat16)
    return q, kv, csr(lists, last), qo


def check(wrapper, spec, q, kv, table, qo, **plan):
    """Plan (unless ``plan`` is None), run into poisoned out / lse, assert against the flat reference."""
    if plan is not None:
        plan.setdefault("levels", None)
        if plan["levels"] is None:
            plan.update(qo_indptr=qo, **table)
        wrapper.plan(num_qo_heads=q.shape[1], num_kv_heads=HEADS, **plan)
    q_gpu, kv_gpu = q.cuda(), tuple(x.cuda() for x in kv)
    return check_attention(lambda out: wrapper.run(q_gpu, kv_gpu, out=out, return_lse=True), spec, q, kv,
                           qo_indptr=qo, **table)


def running(wrapper) -> list[str]:
    return [r.runs for r in wrapper.levels]


@pytest.mark.parametrize("page_size,group,order", [(1, 4, "NHD"), (16, 1, "HND"), (17, 4, "NHD"), (16, 4, "NHD")])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_derived_levels(page_size, group, order, shape):
    spec = AttentionSpec(128, kv_layout=Paged(page_size, order), mask=Causal())
    wrapper = flashgen.CascadeWrapper(spec)
    for seed, depth in ((0, 1), (1, 2), (2, 3)):
        rng = np.random.default_rng(seed)
        qo_lens = np.ones(9, np.int64) if shape == "decode" else rng.integers(0, 7, 9)
        q, kv, table, qo = tree_case(seed, 9, depth, page_size, qo_lens, group, order)
        check(wrapper, spec, q, kv, table, qo, policy=NEVER)
        assert running(wrapper)[-1] == ("decode" if shape == "decode" else "portable")
        assert len(wrapper._runs) == len(wrapper.levels) >= 2  # every level ran, a shared one at least


@pytest.mark.parametrize("mask", [NoMask(), Causal()])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_given_levels_uneven_groups_empty_suffixes_and_unshared_requests(mask, shape):
    # requests 0-4 share 2 pages (level 0), then two uneven groups (0-1, 3-4) share one more (level 1; request 2
    # has a page of 3 tokens alone there); suffixes: request 0 empty, 1 a page of 5 tokens, 2 and 3 empty, 4 a
    # full page; request 5 shares nothing
    page_size = 16
    lists = [[0, 1, 2], [0, 1, 2, 3], [0, 1, 9], [0, 1, 4], [0, 1, 4, 5], [6]]
    last = np.array([16, 5, 3, 16, 16, 16], np.int32)
    qo_lens = [1, 1, 1, 1, 1, 1] if shape == "decode" else [1, 3, 0, 1, 1, 4]
    qo = np.concatenate([[0], np.cumsum(qo_lens)])
    gen = torch.Generator().manual_seed(0)
    kv = shared_cache(lists, last, page_size, HEADS, 128, torch.bfloat16, generator=gen)
    q = torch.randn(int(qo[-1]), HEADS * 4, 128, generator=gen).to(torch.bfloat16)
    spec = AttentionSpec(128, kv_layout=Paged(page_size), mask=mask)
    for device_ids in (False, True):
        ids = (lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")) if device_ids else (lambda x: x)
        levels = [CascadeLevel([0, qo[5], qo[6]], [0, 2, 2], ids([0, 1]), [16, 0]),
                  CascadeLevel([0, qo[2], qo[3], qo[5], qo[6]], [0, 1, 2, 3, 3], ids([2, 9, 4]), [16, 3, 16, 0]),
                  CascadeLevel(qo, [0, 0, 1, 1, 1, 2, 3], ids([3, 5, 6]), [0, 5, 0, 0, 16, 16])]
        wrapper = flashgen.CascadeWrapper(spec)
        check(wrapper, spec, q, kv, csr(lists, last), qo, levels=levels, policy=NEVER)
        assert running(wrapper) == ["portable", "portable", "decode" if shape == "decode" else "portable"]


def test_one_two_and_three_levels():
    spec = AttentionSpec(128, kv_layout=Paged(16), mask=Causal())
    q, kv, table, qo = tree_case(4, 12, 3, 16, np.ones(12, np.int64), 4)  # 3 levels derived
    for num_levels in (1, 2, 3):
        wrapper = flashgen.CascadeWrapper(spec, num_levels=num_levels)
        check(wrapper, spec, q, kv, table, qo, policy=NEVER)
        assert len(wrapper._runs) == len(wrapper.levels) == num_levels


def test_the_cost_model_runs_a_long_prefix_and_folds_a_short_one():
    # 16 decoding requests over 256 shared pages (4096 tokens): the level pays; over 1 shared page it does not
    spec = AttentionSpec(128, kv_layout=Paged(16), mask=Causal())
    for prefix, runs in ((256, ["portable", "decode"]), (1, ["folded", "decode"])):
        lists = [list(range(prefix)) + [1000 + b] for b in range(16)]
        last = np.arange(16, dtype=np.int32) % 16 + 1
        gen = torch.Generator().manual_seed(prefix)
        kv = shared_cache(lists, last, 16, HEADS, 128, torch.bfloat16, generator=gen)
        q = torch.randn(16, HEADS * 4, 128, generator=gen).to(torch.bfloat16)
        wrapper = flashgen.CascadeWrapper(spec)
        check(wrapper, spec, q, kv, csr(lists, last), np.arange(17))
        assert running(wrapper) == runs


def test_soft_cap_and_sm_scale():
    spec = AttentionSpec(128, kv_layout=Paged(16), soft_cap=30.0)
    q, kv, table, qo = tree_case(4, 8, 2, 16, np.ones(8, np.int64), 4)
    wrapper = flashgen.CascadeWrapper(spec)
    wrapper.plan(qo_indptr=qo, **table, num_qo_heads=8, num_kv_heads=HEADS, soft_cap=5.0, sm_scale=0.3, policy=NEVER)
    q_gpu, kv_gpu = q.cuda(), tuple(x.cuda() for x in kv)
    check_attention(lambda out: wrapper.run(q_gpu, kv_gpu, out=out, return_lse=True), spec, q, kv,
                    qo_indptr=qo, **table, soft_cap=5.0, sm_scale=0.3)


@pytest.mark.hopper
def test_the_hopper_kernel_runs_levels_whose_grid_fills_the_gpu():
    # num_sms=1: any grid "fills the GPU", so every prefill level (shared ones and the last) runs on sm90
    spec = AttentionSpec(128, kv_layout=Paged(16), mask=Causal())
    q, kv, table, qo = tree_case(5, 8, 1, 16, np.full(8, 5), 4)
    wrapper = flashgen.CascadeWrapper(spec, num_sms=1)
    check(wrapper, spec, q, kv, table, qo, policy=NEVER)
    assert running(wrapper) == ["sm90"] * len(wrapper.levels)


def test_groups_with_no_keys_give_minus_inf_and_merge_as_nothing():
    # the inner kernels' empty groups: out 0 and lse exactly -inf (the merge's weight 0)
    spec = AttentionSpec(128, kv_layout=Paged(16))
    pages = torch.randn(4, 16, HEADS, 128, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(5, HEADS * 4, 128, dtype=torch.bfloat16, device="cuda")
    table = {"kv_indptr": [0, 0, 1, 1, 1, 1], "kv_indices": torch.tensor([2], dtype=torch.int32, device="cuda"),
             "kv_last_page_len": [0, 7, 0, 0, 0]}
    decode = flashgen.BatchDecodeWrapper(spec)
    decode.plan(num_qo_heads=8, num_kv_heads=HEADS, **table)
    out_d, lse_d = decode.run(q, (pages, pages), return_lse=True)
    for backend in ("portable", "sm90") if torch.cuda.get_device_capability() == (9, 0) else ("portable",):
        prefill = flashgen.BatchPrefillWrapper(spec, backend=backend)
        prefill.plan(qo_indptr=[0, 1, 2, 3, 4, 5], num_qo_heads=8, num_kv_heads=HEADS, **table)
        out_p, lse_p = prefill.run(q, (pages, pages), return_lse=True)
        for out, lse in ((out_d, lse_d), (out_p, lse_p)):
            empty = [0, 2, 3, 4]
            assert bool(torch.isneginf(lse[empty]).all()) and bool((out[empty] == 0).all()), backend
            assert bool(torch.isfinite(lse[1]).all())
    v, s = out_d.clone(), lse_d.clone()
    other, other_lse = torch.full_like(v, float("nan")), torch.full_like(s, float("-inf"))
    flashgen.merge_state_in_place(v, s, other, other_lse)  # an empty state: nothing changes, no NaN read
    assert torch.equal(s.isneginf(), lse_d.isneginf()) and not v.isnan().any()
    torch.testing.assert_close(v, out_d, rtol=0, atol=0)
    torch.testing.assert_close(s, lse_d, rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_cuda_graph_replay_after_replanning(shape):
    """One graph captured around run() of a 3-level wrapper replays after plans of batches with 1 to 3 levels,
    folded or not, fewer requests, no sharing at all."""
    spec = AttentionSpec(128, kv_layout=Paged(16), mask=Causal())
    max_batch, group, pool_pages = 12, 4, 160
    max_total_q = max_batch if shape == "decode" else 48
    wrapper = flashgen.CascadeWrapper(spec, num_levels=3, use_cuda_graph=True, max_batch_size=max_batch,
                                      max_total_q=max_total_q, max_num_pages=256)
    pool_q = torch.empty(max_total_q, HEADS * group, 128, dtype=torch.bfloat16, device="cuda")
    pool_kv = tuple(torch.empty(pool_pages, 16, HEADS, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))

    def load(seed, batch, depth, fold):
        rng = np.random.default_rng(seed)
        qo_lens = np.ones(batch, np.int64) if shape == "decode" else rng.integers(0, 5, batch)
        q, kv, table, qo = tree_case(seed, batch, depth, 16, qo_lens, group, spare_pages=0)
        fill_pools(pool_q, pool_kv, q, kv, nan_rest=True)
        wrapper.plan(qo_indptr=qo, **table, num_qo_heads=HEADS * group, num_kv_heads=HEADS,
                     policy=CascadePolicy(fold=fold))
        assert len(wrapper._runs) == 3
        return q, kv, table, qo

    check_replay = reference_check(spec)

    replay_after_replanning(lambda: wrapper.run(pool_q, pool_kv, return_lse=True), load, check_replay,
                            (0, max_batch, 3, "never"),
                            [(1, 5, 2, "never"), (2, max_batch, 0, "never"), (3, 1, 1, "never"),
                             (4, max_batch, 3, "always"), (5, 9, 3, "cost"), (6, max_batch, 3, "never")])
