"""GPU tests of a cascade whose shared levels run split over their keys on the Hopper kernel (plan.cascade_split)
against the fp64 flat reference over the whole sequences: 1-3 levels, page sizes 1, 16 and 17, uneven and empty
chunks, Causal, SlidingWindow, RoPE and ALiBi at true positions, device page ids, and the split the rule picks
by itself. NaN-poisoned outputs, NaN in every cache slot no request reads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import flashgen
from cascade_batches import csr, last_page_lens, shared_cache, tree_pages
from flashgen import ALiBi, AttentionSpec, Causal, CascadeLevel, CascadePolicy, NoMask, Paged, RoPE, SlidingWindow
from flashgen.api.backends import kernels_for
from flashgen.testing.check import check_attention

pytestmark = [pytest.mark.cuda, pytest.mark.hopper]

HEADS, GROUP = 2, 4
PLAIN = {ps: AttentionSpec(128, kv_layout=Paged(ps), mask=Causal()) for ps in (1, 16, 17)}
POSITIONED = {  # the specs of test_cascade_positions_gpu.py: their kernels are shared
    "causal_rope": AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=RoPE()),
    "window": AttentionSpec(128, kv_layout=Paged(16), mask=SlidingWindow(24)),
    "causal_alibi": AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=ALiBi()),
    "nomask_alibi": AttentionSpec(128, kv_layout=Paged(16), mask=NoMask(), pos_encoding=ALiBi()),
}


def shared_of(spec: AttentionSpec) -> AttentionSpec:
    return spec if isinstance(spec.mask, SlidingWindow) else spec.replace(mask=NoMask())


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Compile the module's kernels in parallel up front: the shared levels' Hopper kernels, the last levels'."""
    jobs = []
    for spec in PLAIN.values():
        jobs += [(ks, op, None) for op, ks in kernels_for(shared_of(spec), "sm90")]
        jobs += [(spec, "decode", None), (spec, "prefill", None)]
    for spec in POSITIONED.values():
        jobs += [(ks, op, {"positions": True}) for op, ks in kernels_for(shared_of(spec), "sm90")]
        jobs += [(spec, "decode", {"positions": True}), (spec, "prefill", {"positions": True})]
    jobs.append((flashgen.MergeSpec("bfloat16"), "merge_states", None))
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda job: flashgen.ensure_compiled(job[0], job[1], options=job[2]), jobs))


def prefix_tree_case(seed: int, batch: int, depth: int, page_size: int, qo_lens, prefix_pages: int = 5):
    """(q, kv, table, qo_indptr) on the CPU, bf16: ``batch`` requests sharing ``prefix_pages`` pages, then a
    random prefix tree of ``depth`` more shared levels, then pages of their own."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    tree = tree_pages(rng, batch, depth)
    base = max((p for pages in tree for p in pages), default=-1) + 1
    lists = [list(range(base, base + prefix_pages)) + pages for pages in tree]
    last = last_page_lens(rng, lists, page_size)
    kv = shared_cache(lists, last, page_size, HEADS, 128, torch.bfloat16, generator=gen)
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int64)
    q = torch.randn(int(qo[-1]), HEADS * GROUP, 128, generator=gen).to(torch.bfloat16)
    return q, kv, csr(lists, last), qo


def prefix_case(seed: int, batch: int, prefix_pages: int, page_size: int = 16):
    """(q, kv, table, qo_indptr) on the CPU, bf16: ``batch`` decoding requests over one shared prefix of
    ``prefix_pages`` pages, then 1-2 pages of their own (the last partial)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    own = rng.integers(1, 3, batch)
    starts = prefix_pages + np.concatenate([[0], np.cumsum(own)])
    lists = [list(range(prefix_pages)) + list(range(starts[b], starts[b + 1])) for b in range(batch)]
    last = rng.integers(1, page_size + 1, batch).astype(np.int32)
    kv = shared_cache(lists, last, page_size, HEADS, 128, torch.bfloat16, generator=gen)
    q = torch.randn(batch, HEADS * GROUP, 128, generator=gen).to(torch.bfloat16)
    return q, kv, csr(lists, last), np.arange(batch + 1)


def check(wrapper, spec, q, kv, table, qo, **plan):
    wrapper.plan(qo_indptr=qo, **table, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, **plan)
    q_gpu, kv_gpu = q.cuda(), tuple(x.cuda() for x in kv)
    check_attention(lambda out: wrapper.run(q_gpu, kv_gpu, out=out, return_lse=True), spec, q, kv, qo_indptr=qo,
                    **table)


@pytest.mark.parametrize("page_size", sorted(PLAIN))
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_forced_splits_of_1_to_3_levels(page_size, shape):
    # 2 and 3 chunks of a 5-page prefix (uneven: 2 + 3, 1 + 2 + 2) and of the tree's levels (some chunks empty)
    spec = PLAIN[page_size]
    wrapper = flashgen.CascadeWrapper(spec)
    for seed, depth, chunks in ((0, 0, 2), (1, 1, 3), (2, 2, 2), (3, 2, 3)):
        rng = np.random.default_rng(seed)
        qo_lens = np.ones(7, np.int64) if shape == "decode" else rng.integers(1, 6, 7)
        q, kv, table, qo = prefix_tree_case(seed, 7, depth, page_size, qo_lens)
        check(wrapper, spec, q, kv, table, qo, policy=CascadePolicy(fold="never", chunks=chunks))
        records = wrapper.levels
        assert records[0].runs == "sm90" and records[0].chunks == chunks
        assert records[-1].runs == ("decode" if shape == "decode" else "portable")
        assert len(wrapper._split) == sum(r.chunks > 1 for r in records) >= 1


@pytest.mark.parametrize("name", sorted(POSITIONED))
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_forced_splits_at_true_positions(name, shape):
    spec = POSITIONED[name]
    wrapper = flashgen.CascadeWrapper(spec)
    for seed, depth, chunks in ((10, 0, 3), (11, 1, 2), (12, 2, 3)):
        rng = np.random.default_rng(seed)
        qo_lens = np.ones(6, np.int64) if shape == "decode" else rng.integers(1, 5, 6)
        q, kv, table, qo = prefix_tree_case(seed, 6, depth, 16, qo_lens)
        check(wrapper, spec, q, kv, table, qo, policy=CascadePolicy(fold="never", chunks=chunks))
        assert wrapper.levels[0].runs == "sm90" and wrapper.levels[0].chunks == chunks


def test_the_rule_splits_a_long_prefix_by_itself():
    # 32 decoding requests over a 4096-key prefix: 32 x 4 = 128 rows = 1 q tile x 2 kv heads = 2 CTAs on 8 SMs;
    # chunks of >= 1024 keys: 4 chunks, 8 CTAs (one wave); the split state merges with the decode's
    spec = PLAIN[16]
    wrapper = flashgen.CascadeWrapper(spec, num_sms=8)
    policy = CascadePolicy(fold="never", min_chunk_tokens=1024)
    check(wrapper, spec, *prefix_case(30, 32, 256), policy=policy)
    assert [(r.runs, r.chunks) for r in wrapper.levels] == [("sm90", 4), ("decode", 1)]
    # re-planned with another batch: 20 requests over 3072 keys, 3 chunks (6 CTAs)
    check(wrapper, spec, *prefix_case(31, 20, 192), policy=policy)
    assert [(r.runs, r.chunks) for r in wrapper.levels] == [("sm90", 3), ("decode", 1)]


def test_a_level_with_device_page_ids_splits_in_place():
    # an explicit shared level of one group whose page ids live on the GPU: the chunks re-cut its kv_indptr
    spec = PLAIN[16]
    q, kv, table, qo = prefix_case(40, 6, 9)
    ids, indptr, last = table["kv_indices"], table["kv_indptr"], table["kv_last_page_len"]
    shared = CascadeLevel([0, 6], [0, 9], torch.from_numpy(ids[:9].copy()).cuda(), [16])
    own = [ids[indptr[b] + 9: indptr[b + 1]] for b in range(6)]
    mine = CascadeLevel(qo, np.concatenate([[0], np.cumsum([len(x) for x in own])]), np.concatenate(own), last)
    wrapper = flashgen.CascadeWrapper(spec)
    wrapper.plan(levels=[shared, mine], num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS,
                 policy=CascadePolicy(fold="never", chunks=4))
    assert [(r.runs, r.chunks) for r in wrapper.levels] == [("sm90", 4), ("decode", 1)]
    q_gpu, kv_gpu = q.cuda(), tuple(x.cuda() for x in kv)
    check_attention(lambda out: wrapper.run(q_gpu, kv_gpu, out=out, return_lse=True), spec, q, kv, qo_indptr=qo,
                    **table)
