"""The cascade's arithmetic on the CPU, in fp64: each level's (out, lse) from the reference over that level's pages
(the mask off in shared levels, the spec's in the last), merged with merge_states_ref, equals flat attention over
the whole sequences. Then CascadeWrapper's plan() with CUDA stubbed (tests/stub_cuda.py): the levels it would run
compose the same way, its records, its run() plumbing and its errors."""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashgen
from cascade_batches import csr, last_page_lens, shared_cache, tree_pages
from flashgen import ALiBi, AttentionSpec, Causal, CascadeLevel, CascadePolicy, CustomMask, NoMask, Paged, Ragged
from flashgen import RoPE, SlidingWindow, SpecError
from flashgen.api import cascade as cascade_api
from flashgen.plan import PlanError, block_table_to_csr, choose_levels, csr_to_block_table, derive_levels
from flashgen.plan.cascade_cost import Shape
from flashgen.testing.reference import merge_states_ref, reference_attention
from stub_cuda import on_device, stubbed_cuda

HEAD_DIM = 64


def tree_batch(seed: int, batch: int, depth: int, page_size: int, qo_lens, num_kv_heads: int, group: int,
               order: str = "NHD"):
    """A prefix-tree batch: (q fp64 [total_q, heads, 64], (k, v) fp64 pages, CSR table, qo_indptr)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    lists = tree_pages(rng, batch, depth)
    last = last_page_lens(rng, lists, page_size)
    kv = shared_cache(lists, last, page_size, num_kv_heads, HEAD_DIM, torch.float64, order=order, generator=gen)
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int64)
    q = torch.randn(int(qo[-1]), num_kv_heads * group, HEAD_DIM, generator=gen, dtype=torch.float64)
    return q, kv, csr(lists, last), qo


def compose(runs, q, kv, **runtime):
    """Merge of the reference (out, lse) of each ``(spec, LevelTable)``, over the same pool."""
    states = [reference_attention(spec, q, kv, qo_indptr=t.qo_indptr, **t.table(), **runtime) for spec, t in runs]
    return merge_states_ref(torch.stack([o for o, _ in states], 1), torch.stack([s for _, s in states], 1))


def assert_same(got, want):
    (out, lse), (ref, ref_lse) = got, want
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())
    finite = ref_lse.isfinite()
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=0, atol=1e-10)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


def qo_lens_for(rng, batch: int, shape: str):
    return np.ones(batch, np.int64) if shape == "decode" else rng.integers(0, 6, batch)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 8), depth=st.integers(0, 3),
       page_size=st.sampled_from([1, 4, 16, 17]), shape=st.sampled_from(["decode", "prefill"]),
       mask=st.sampled_from([NoMask(), Causal()]), group=st.sampled_from([1, 4]),
       fold=st.sampled_from(["never", "cost", "always"]), soft_cap=st.sampled_from([None, 7.0]))
def test_levels_compose_to_flat_attention(seed, batch, depth, page_size, shape, mask, group, fold, soft_cap):
    spec = AttentionSpec(HEAD_DIM, kv_layout=Paged(page_size), mask=mask, soft_cap=soft_cap)
    qo_lens = qo_lens_for(np.random.default_rng(seed + 1), batch, shape)
    q, kv, table, qo = tree_batch(seed, batch, depth, page_size, qo_lens, 2, group)
    levels, flat = derive_levels(qo, **table, page_size=page_size, causal=spec.is_causal, with_table=True)
    _, tables, _ = choose_levels(levels, Shape(2 * group, 2, HEAD_DIM, HEAD_DIM), page_size,
                                 CascadePolicy(fold=fold), flat=flat)
    runs = [(spec.replace(mask=NoMask()), t) for t in tables[:-1]] + [(spec, tables[-1])]
    assert_same(compose(runs, q, kv), reference_attention(spec, q, kv, qo_indptr=qo, **table))


def test_given_levels_with_uneven_groups_and_empty_ones_compose():
    # 6 requests of 1, 3, 0, 1, 1, 1 queries: level 0 shares 2 pages among requests 0-4 (request 5 none); level 1
    # groups 0-1 and 3-4 (request 2, with no query, sits alone, with KV no query reads); the last level holds
    # empty suffixes
    page_size = 16
    lists = [[0, 1, 2], [0, 1, 2, 3], [0, 1, 9], [0, 1, 4], [0, 1, 4, 5], [6]]
    last = np.array([16, 5, 3, 16, 16, 16], np.int32)
    qo = np.array([0, 1, 4, 4, 5, 6, 7])
    gen = torch.Generator().manual_seed(0)
    kv = shared_cache(lists, last, page_size, 2, HEAD_DIM, torch.float64, generator=gen)
    q = torch.randn(int(qo[-1]), 8, HEAD_DIM, generator=gen, dtype=torch.float64)
    levels = [CascadeLevel([0, 6, 7], [0, 2, 2], [0, 1], [16, 0]),
              CascadeLevel([0, 4, 4, 6, 7], [0, 1, 2, 3, 3], [2, 9, 4], [16, 3, 16, 0]),
              CascadeLevel(qo, [0, 0, 1, 1, 1, 2, 3], [3, 5, 6], [0, 5, 0, 0, 16, 16])]
    tables = flashgen.plan.check_levels(levels, page_size)
    for mask in (NoMask(), Causal()):
        spec = AttentionSpec(HEAD_DIM, kv_layout=Paged(page_size), mask=mask)
        runs = [(spec.replace(mask=NoMask()), t) for t in tables[:-1]] + [(spec, tables[-1])]
        assert_same(compose(runs, q, kv), reference_attention(spec, q, kv, qo_indptr=qo, **csr(lists, last)))
    # two queries for request 3, whose last key sits in level 1: causal attention would let its first query see
    # that key, so a causal plan refuses the levels (flat attention differs from their merge)
    qo2 = np.array([0, 1, 4, 4, 6, 7, 8])
    levels2 = [CascadeLevel([0, 7, 8], *levels[0][1:4]), CascadeLevel([0, 4, 4, 7, 8], *levels[1][1:4]),
               CascadeLevel(qo2, *levels[2][1:4])]
    tables2 = flashgen.plan.check_levels(levels2, page_size)
    with pytest.raises(PlanError, match=r"request 3 has 2 queries but 0 keys"):
        flashgen.plan.cascade.check_causal(tables2)
    spec = AttentionSpec(HEAD_DIM, kv_layout=Paged(page_size), mask=Causal())
    q2 = torch.cat([q, q[:1]])
    runs = [(spec.replace(mask=NoMask()), t) for t in tables2[:-1]] + [(spec, tables2[-1])]
    got, _ = compose(runs, q2, kv)
    want, _ = reference_attention(spec, q2, kv, qo_indptr=qo2, **csr(lists, last))
    assert not torch.allclose(got[4], want[4])
    assert_same(compose([(s.replace(mask=NoMask()), t) for s, t in runs], q2, kv),
                reference_attention(spec.replace(mask=NoMask()), q2, kv, qo_indptr=qo2, **csr(lists, last)))


# ---------------------------------------------------------------------------------------------- the wrapper


@contextmanager
def stubbed(capability=(8, 0)):
    cpu = lambda device=None: torch.device("cpu")  # noqa: E731
    with stubbed_cuda(), mock.patch.object(cascade_api, "resolve_device", cpu), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: capability):
        yield


def wrapper_runs(wrapper):
    return list(wrapper._run_tables)


CASES = [  # (spec kwargs, wrapper kwargs, batch, depth, page_size, shape)
    ({"mask": Causal()}, {}, 6, 2, 16, "decode"),
    ({"mask": Causal()}, {}, 5, 3, 4, "prefill"),
    ({}, {"num_levels": 2}, 7, 3, 17, "prefill"),
    ({"soft_cap": 9.0}, {"use_cuda_graph": True, "num_levels": 4, "max_batch_size": 8}, 6, 2, 1, "decode"),
    ({"mask": Causal()}, {"use_cuda_graph": True, "num_levels": 3, "max_batch_size": 8, "max_total_q": 64}, 5, 2, 16,
     "prefill"),
    ({"kv_layout": Paged(5, "HND")}, {}, 4, 2, 5, "decode"),
]


@pytest.mark.parametrize("spec_kwargs, wrapper_kwargs, batch, depth, page_size, shape", CASES)
@pytest.mark.parametrize("form", ["csr", "block_table", "levels"])
def test_wrapper_plans_levels_that_compose_to_flat_attention(spec_kwargs, wrapper_kwargs, batch, depth, page_size,
                                                              shape, form):
    spec = AttentionSpec(HEAD_DIM, **{"kv_layout": Paged(page_size), **spec_kwargs})
    order = spec.kv_layout.order
    for seed in range(3):
        qo_lens = qo_lens_for(np.random.default_rng(seed), batch, shape)
        q, kv, table, qo = tree_batch(seed, batch, depth, page_size, qo_lens, 2, 4, order)
        with stubbed():
            wrapper = flashgen.CascadeWrapper(spec, **wrapper_kwargs)
            policy = CascadePolicy(fold=("never", "cost", "always")[seed])
            if form == "levels":  # the derivation's levels, given back as explicit ones
                levels = derive_levels(qo, **table, page_size=page_size, causal=spec.is_causal,
                                       max_levels=wrapper.num_levels)
                given = [CascadeLevel(t.qo_indptr, **t.table()) for t in levels]
                wrapper.plan(levels=given, num_qo_heads=8, num_kv_heads=2, policy=policy)
            elif form == "block_table":
                bt, seq_lens = csr_to_block_table(**table, page_size=page_size)
                wrapper.plan(qo_indptr=qo, block_table=bt, seq_lens=seq_lens, num_qo_heads=8, num_kv_heads=2,
                             policy=policy)
            else:
                wrapper.plan(qo_indptr=qo, **table, num_qo_heads=8, num_kv_heads=2, policy=policy)
        runs = wrapper_runs(wrapper)
        if wrapper.use_cuda_graph:
            assert len(runs) == wrapper.num_levels and len(wrapper._runs) == wrapper.num_levels
        assert [s.mask for s, _ in runs] == [NoMask()] * (len(runs) - 1) + [spec.mask]
        assert_same(compose(runs, q, kv), reference_attention(spec, q, kv, qo_indptr=qo, **table))
        records = wrapper.levels
        assert records[-1].runs == ("decode" if shape == "decode" and (
            not wrapper.use_cuda_graph or wrapper.max_total_q == wrapper.max_batch_size) else "portable")
        assert sum(r.runs not in ("folded", "empty") for r in records) == len(
            [t for _, t in runs if t.kv_lens.any() or t is runs[-1][1]])


def test_wrapper_records_its_decisions_and_runs_its_levels():
    # 32 decoding requests over a 2048-page prefix, then 4 groups of 8 sharing 1 page, then a page each
    page_size = 16
    lists = [list(range(2048)) + [5000 + b // 8] + [6000 + b] for b in range(32)]
    table = csr(lists, np.full(32, 16, np.int32))
    with stubbed():
        wrapper = flashgen.CascadeWrapper(AttentionSpec(128, kv_layout=Paged(page_size), mask=Causal()))
        wrapper.plan(qo_indptr=np.arange(33), **table, num_qo_heads=32, num_kv_heads=8)
        records = wrapper.levels
        assert [r.runs for r in records] == ["portable", "folded", "decode"]
        assert [(r.level, r.groups, r.kv_tokens) for r in records] == [(0, 1, 2048 * 16), (1, 4, 64), (2, 32, 32 * 32)]
        assert records[0].cascade_us < records[0].flat_us and records[1].cascade_us > records[1].flat_us
        assert records[2].flat_us is None
        q = on_device(torch.zeros(32, 32, 128, dtype=torch.bfloat16))
        cache = tuple(on_device(torch.zeros(8000, page_size, 8, 128, dtype=torch.bfloat16)) for _ in range(2))
        real_empty_like = torch.empty_like
        with mock.patch.object(torch, "empty_like", lambda t, **kw: on_device(real_empty_like(t, **kw))):
            out = on_device(torch.zeros(32, 32, 128, dtype=torch.bfloat16))
            got, lse = wrapper.run(q, cache, out=out, return_lse=True)
            assert got is out and lse.shape == (32, 32)
            scratch = wrapper._scratch
            wrapper.run(q, cache, out=out)
            assert wrapper._scratch is scratch  # the level outputs' buffer is kept
        wrapper.plan(qo_indptr=np.arange(33), **table, num_qo_heads=32, num_kv_heads=8,
                     policy=CascadePolicy(fold="always"))
        assert [r.runs for r in wrapper.levels] == ["folded", "folded", "decode"] and len(wrapper._runs) == 1
        assert wrapper.run(q, cache).shape == (32, 32, 128)


def test_the_hopper_kernel_runs_a_level_only_where_its_grid_fills_the_gpu():
    # decode: 128 queries x group 4 = 4 tiles x 8 kv heads = 32 CTAs < 132 SMs, and a 1k prefix too short to
    # split (chunks of >= 2048 keys): portable; 128 requests of 64 queries: 256 tiles x 8 kv heads: sm90, whole
    # (tests/cascade/test_cascade_split.py: the long prefixes that split)
    lists = [list(range(64)) + [1000 + b] for b in range(128)]
    table = csr(lists, np.full(128, 16, np.int32))
    spec = AttentionSpec(128, kv_layout=Paged(16), mask=Causal())
    with stubbed((9, 0)):
        wrapper = flashgen.CascadeWrapper(spec, num_sms=132)
        assert wrapper._backend(derive_levels(np.arange(129), **table, page_size=16)[0], wrapper._shared_spec, 32,
                                8, CascadePolicy()) == ("portable", 1)
        prefill = derive_levels(np.arange(129) * 64, **table, page_size=16)
        assert wrapper._backend(prefill[0], wrapper._shared_spec, 32, 8, CascadePolicy()) == ("sm90", 1)
        assert flashgen.CascadeWrapper(spec, prefill_backend="portable")._backend(
            prefill[0], wrapper._shared_spec, 32, 8, CascadePolicy()) == ("portable", 1)
    with stubbed((8, 0)):
        wrapper = flashgen.CascadeWrapper(spec, num_sms=132)
        assert wrapper._backend(prefill[0], wrapper._shared_spec, 32, 8, CascadePolicy()) == ("portable", 1)


@pytest.mark.parametrize("spec, message", [
    (AttentionSpec(128, kv_layout=Paged(16), mask=CustomMask()), r"^mask: CascadeWrapper takes NoMask\(\), Causal"),
    (AttentionSpec(128, kv_layout=Ragged()), r"^kv_layout: CascadeWrapper shares pages"),
    (AttentionSpec(128, kv_dtype="float8_e4m3fn", kv_layout=Paged(16)), r"^kv_dtype: CascadeWrapper takes K/V"),
])
def test_specs_the_cascade_cannot_run_exactly_are_refused(spec, message):
    with pytest.raises(SpecError, match=message):
        flashgen.CascadeWrapper(spec)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"use_cuda_graph": True, "max_batch_size": 8}, ValueError,
     r"^num_levels: num_levels and max_batch_size are required"),
    ({"num_levels": 0}, ValueError, r"^num_levels: got 0"),
    ({"prefill_backend": "fast"}, ValueError, r"^prefill_backend: got 'fast'"),
])
def test_bad_constructor_arguments(kwargs, error, message):
    with stubbed(), pytest.raises(error, match=message):
        flashgen.CascadeWrapper(AttentionSpec(128, kv_layout=Paged(16)), **kwargs)


TABLE = {"kv_indptr": [0, 2, 4], "kv_indices": [1, 2, 1, 3], "kv_last_page_len": [16, 16]}
LEVELS = [CascadeLevel([0, 2], [0, 1], [1], [16]), CascadeLevel([0, 1, 2], [0, 1, 2], [2, 3], [16, 16])]


@pytest.mark.parametrize("wrapper_kwargs, plan_kwargs, message", [
    ({}, {"levels": LEVELS, "qo_indptr": [0, 1, 2]}, r"^levels: give either levels"),
    ({}, {}, r"^qo_indptr: required"),
    ({}, {"qo_indptr": [0, 1, 2], "kv_indptr": [0, 2, 4]}, r"^kv_indptr: derived levels take"),
    ({}, {"qo_indptr": [0, 1, 2], "block_table": [[1, 2]]}, r"^block_table: give block_table with seq_lens"),
    ({"num_levels": 1}, {"levels": LEVELS}, r"^levels: 2 levels, more than num_levels = 1"),
    ({"mask": Causal()}, {"levels": [CascadeLevel([0, 3], [0, 1], [1], [16]),
                                     CascadeLevel([0, 3], [0, 1], [2], [1])]},
     r"^levels\[1\]: request 0 has 3 queries but 1 keys in its last level"),
    ({"use_cuda_graph": True, "num_levels": 2, "max_batch_size": 2}, {"qo_indptr": [0, 2, 3]},
     r"^qo_indptr: this CUDA-graph CascadeWrapper runs its last level as decode"),
    ({"use_cuda_graph": True, "num_levels": 2, "max_batch_size": 1, "max_total_q": 4},
     {"qo_indptr": [0, 1, 2]}, r"^levels\[1\] \(derived\): .*batch_size 2 exceeds max_batch_size = 1"),
    ({}, {"qo_indptr": [0, 1, 2], "num_pages": 3}, r"^kv_indices\[3\] = 3 is outside the page pool \[0, 3\)"),
    ({}, {"qo_indptr": [0, 1, 2], "policy": CascadePolicy(fold="no")}, r"^policy\.fold: got 'no'"),
    ({}, {"levels": [([0, 2], [0, 1], [1], [16]), ([0, 1, 3], [0, 1, 2], [2, 3], [16, 16])]},
     r"^levels\[1\]\.qo_indptr\[-1\] = 3, expected total_q = 2"),
])
def test_bad_plans_name_the_argument_and_level(wrapper_kwargs, plan_kwargs, message):
    mask = wrapper_kwargs.pop("mask", NoMask())
    with stubbed():
        wrapper = flashgen.CascadeWrapper(AttentionSpec(128, kv_layout=Paged(16), mask=mask), **wrapper_kwargs)
        table = {} if "levels" in plan_kwargs or "kv_indptr" in plan_kwargs or "block_table" in plan_kwargs else TABLE
        with pytest.raises(PlanError, match=message):
            wrapper.plan(num_qo_heads=8, num_kv_heads=2, **table, **plan_kwargs)
        with pytest.raises(RuntimeError, match=r"^run: call plan\(\) first"):
            wrapper.run(on_device(torch.zeros(2, 8, 128, dtype=torch.bfloat16)), None)


def test_a_device_block_table_is_derived_from_its_host_copy_only():
    bt, seq_lens = csr_to_block_table(**TABLE, page_size=16)
    with stubbed():
        wrapper = flashgen.CascadeWrapper(AttentionSpec(128, kv_layout=Paged(16)))
        with pytest.raises(PlanError, match=r"^block_table: is a .* tensor; planning reads host arrays only"):
            wrapper.plan(qo_indptr=[0, 1, 2], block_table=on_device(bt), seq_lens=seq_lens, num_qo_heads=8,
                         num_kv_heads=2)
        # given levels may hold device page ids: they run as they are (never folded)
        indptr, indices, last = block_table_to_csr(bt, seq_lens, 16)
        wrapper.plan(levels=[CascadeLevel([0, 2], [0, 1], on_device(torch.tensor([1], dtype=torch.int32)), [16]),
                             CascadeLevel([0, 1, 2], block_table=on_device(torch.tensor([[2], [3]], dtype=torch.int32)),
                                          seq_lens=[16, 16])],
                     num_qo_heads=8, num_kv_heads=2, policy=CascadePolicy(fold="always"))
        assert [r.runs for r in wrapper.levels] == ["portable", "decode"]
