"""A shared level split over its keys for the Hopper kernel, on the CPU: the chunk count (``choose_chunks``, its
worked cases and limits), the chunked table (``split_level``: every page in exactly one chunk, whole pages, true
positions kept; attended by the fp64 reference and merged it is the level's own answer), and what a
CascadeWrapper with CUDA stubbed decides and plans (backend, chunks, records, run() plumbing)."""

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
from flashgen import ALiBi, AttentionSpec, Causal, CascadeLevel, CascadePolicy, Paged, RoPE, SlidingWindow
from flashgen.api import cascade as cascade_api
from flashgen.api import sm90
from flashgen.plan import PlanError, validate_csr
from flashgen.plan.cascade import LevelTable, level_positions
from flashgen.plan.cascade_split import chunk_bounds, choose_chunks, split_level
from flashgen.testing.reference import merge_states_ref, reference_attention
from stub_cuda import on_device, stubbed_cuda

# ---------------------------------------------------------------------------------------------- choose_chunks


@pytest.mark.parametrize("args, kwargs, chunks", [
    ((4, 8, 2048, 16, 132), {}, 4),  # batch 128 over 32k: 128 items, one wave of 8192-key chunks
    ((4, 8, 2048, 16, 132), {"item_overhead": 0}, 4),
    ((1, 8, 2048, 16, 132), {}, 16),  # 8 items: 16 chunks of 2048 keys (the minimum) fill 128 SMs
    ((1, 8, 2048, 16, 132), {"min_chunk_tokens": 512}, 16),  # 33 (two waves of 1008) lose to 16 (one of 2048)
    ((4, 8, 128, 16, 132), {}, 1),  # 2k keys: one chunk of >= 2048
    ((4, 8, 256, 16, 132), {}, 2),
    ((4, 8, 256, 16, 132), {"min_fill": 0.6}, 1),  # 64 items: under 60 % of the SMs
    ((17, 8, 4096, 16, 132), {}, 1),  # 136 items fill the SMs unsplit
    ((0, 8, 4096, 16, 132), {}, 1),
    ((4, 8, 1, 16, 132), {"min_chunk_tokens": 1}, 1),  # one page: nothing to split
    ((1, 1, 5, 17, 4), {"min_chunk_tokens": 1}, 4),  # page size 17, one item on 4 SMs: 4 chunks of 1-2 pages
    ((1, 2, 5, 16, 4), {"min_chunk_tokens": 16}, 2),
    ((1, 1, 3, 1, 132), {"min_chunk_tokens": 1}, 1),  # 3 keys: the items' overhead outweighs the split
    ((1, 1, 3, 1, 132), {"min_chunk_tokens": 1, "item_overhead": 0}, 3),  # page size 1: a chunk a key
])
def test_choose_chunks_cases(args, kwargs, chunks):
    assert choose_chunks(*args, **kwargs) == chunks


@settings(max_examples=200, deadline=None)
@given(tiles=st.integers(0, 40), heads=st.integers(1, 16), max_pages=st.integers(0, 5000),
       page_size=st.sampled_from([1, 3, 16, 17, 64]), sms=st.integers(1, 160), min_tokens=st.integers(1, 4096),
       min_fill=st.sampled_from([0.0, 0.6]))
def test_choose_chunks_limits(tiles, heads, max_pages, page_size, sms, min_tokens, min_fill):
    chunks = choose_chunks(tiles, heads, max_pages, page_size, sms, min_chunk_tokens=min_tokens, min_fill=min_fill)
    items = tiles * heads
    assert chunks >= 1
    if items == 0 or items >= sms or max_pages <= 1:
        assert chunks == 1
    if chunks > 1:
        assert items * chunks <= 2 * sms  # one or two waves
        assert max_pages // chunks * page_size >= min_tokens  # every chunk of the longest group
        assert items * chunks >= min_fill * sms


# ---------------------------------------------------------------------------------------------- split_level


def level_of(qo_lens, npages, last, page_size, rng):
    """A shared level: groups with ``qo_lens`` queries over ``npages`` fresh pages (shuffled ids)."""
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int64)
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    ids = rng.permutation(int(indptr[-1]) + 3)[: indptr[-1]].astype(np.int32)
    last = np.asarray(last, np.int32)
    lens = validate_csr(indptr, ids, last, page_size)
    return LevelTable(qo, lens, indptr, ids, last)


@st.composite
def levels(draw):
    page_size = draw(st.sampled_from([1, 5, 16, 17]))
    groups = draw(st.integers(1, 5))
    npages = draw(st.lists(st.integers(0, 9), min_size=groups, max_size=groups))
    last = [draw(st.integers(1, page_size)) if n else 0 for n in npages]
    qo_lens = draw(st.lists(st.integers(0, 4), min_size=groups, max_size=groups))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    return level_of(qo_lens, npages, last, page_size, rng), page_size, draw(st.integers(1, 7))


@settings(max_examples=150, deadline=None)
@given(levels())
def test_chunks_cover_every_page_once_in_whole_pages(case):
    level, page_size, chunks = case
    chunked = split_level(level, chunks, page_size)
    table, groups, total_q = chunked.table, level.groups, int(level.qo_indptr[-1])
    assert chunked.chunks == chunks and table.groups == chunks * groups
    # queries: request k * groups + g is group g's rows in copy k of q
    qo = table.qo_indptr
    assert qo[-1] == chunks * total_q
    np.testing.assert_array_equal(qo[:-1].reshape(chunks, groups) - np.arange(chunks)[:, None] * total_q,
                                  np.broadcast_to(level.qo_indptr[:-1], (chunks, groups)))
    # a valid CSR table whose lengths add up to the level's, group by group
    lens = validate_csr(table.kv_indptr, table.kv_indices, table.kv_last_page_len, page_size)
    np.testing.assert_array_equal(lens, table.kv_lens)
    np.testing.assert_array_equal(lens.reshape(chunks, groups).sum(0), level.kv_lens)
    # each group's pages, chunk after chunk, are its pages in order; sizes differ by at most one
    pages = np.diff(table.kv_indptr).reshape(chunks, groups)
    for g in range(groups):
        got = [table.kv_indices[table.kv_indptr[k * groups + g]: table.kv_indptr[k * groups + g + 1]]
               for k in range(chunks)]
        want = level.kv_indices[level.kv_indptr[g]: level.kv_indptr[g + 1]]
        np.testing.assert_array_equal(np.concatenate(got), want)
        assert pages[:, g].max() - pages[:, g].min() <= 1
        # every chunk but the group's last ends on a whole page
        full = [k for k in range(chunks - 1) if pages[k, g]]
        assert all(table.kv_last_page_len[k * groups + g] == page_size for k in full)
    if chunked.order is not None:
        np.testing.assert_array_equal(level.kv_indices[chunked.order], table.kv_indices)
    else:
        assert groups == 1 and table.kv_indices is level.kv_indices


def test_chunk_bounds_and_the_worked_split():
    assert chunk_bounds(np.array([5, 2, 0]), 3).tolist() == [[0, 1, 3, 5], [0, 0, 1, 2], [0, 0, 0, 0]]
    level = LevelTable(np.array([0, 2, 3]), np.array([40, 5]), np.array([0, 3, 4]), np.array([7, 8, 9, 4]),
                       np.array([8, 5]))
    chunked = split_level(level, 2, 16)
    table = chunked.table
    assert table.qo_indptr.tolist() == [0, 2, 3, 5, 6]
    assert table.kv_indptr.tolist() == [0, 1, 1, 3, 4] and table.kv_indices.tolist() == [7, 8, 9, 4]
    assert table.kv_last_page_len.tolist() == [16, 0, 8, 5] and table.kv_lens.tolist() == [16, 0, 24, 5]
    pages, q_pos = chunked.positions(np.array([0, 16, 32, 100]), np.array([50, 51, 120]))
    assert pages.tolist() == [0, 16, 32, 100] and q_pos.tolist() == [50, 51, 120] * 2


def test_split_level_refuses_what_it_cannot_cut():
    level = LevelTable(np.array([0, 1, 2]), np.array([16, 16]), np.array([0, 1, 2]),
                       on_device(torch.tensor([3, 4], dtype=torch.int32)), np.array([16, 16]))
    with pytest.raises(PlanError, match=r"^levels: a level split into chunks takes a CSR page table"):
        split_level(level, 2, 16)
    with pytest.raises(PlanError, match=r"^chunks: got 0, expected >= 1"):
        split_level(level._replace(kv_indices=np.array([3, 4])), 0, 16)
    one = LevelTable(np.array([0, 2]), np.array([40]), np.array([0, 3]),
                     on_device(torch.tensor([3, 4, 5], dtype=torch.int32)), np.array([8]))
    table = split_level(one, 2, 16).table  # one group: device ids re-cut in place
    assert table.kv_indices is one.kv_indices and table.kv_indptr.tolist() == [0, 1, 3]


SPECS = [AttentionSpec(64, kv_layout=Paged(4)),
         AttentionSpec(64, kv_layout=Paged(4), mask=SlidingWindow(9), pos_encoding=ALiBi()),
         AttentionSpec(64, kv_layout=Paged(4), pos_encoding=RoPE())]


@pytest.mark.parametrize("spec", SPECS, ids=["plain", "window_alibi", "rope"])
@pytest.mark.parametrize("chunks", [2, 3, 5])
def test_chunked_level_merged_is_the_level(spec, chunks):
    # a level of 3 groups attended whole, and as chunks (q repeated, states merged): the same fp64 answer
    page_size = spec.kv_layout.page_size
    rng = np.random.default_rng(chunks)
    gen = torch.Generator().manual_seed(chunks)
    level = level_of([2, 1, 3], [5, 1, 0], [3, 4, 0], page_size, rng)
    lists = [level.kv_indices[level.kv_indptr[g]: level.kv_indptr[g + 1]].tolist() for g in range(3)]
    kv = shared_cache(lists, level.kv_last_page_len, page_size, 2, 64, torch.float64, generator=gen, spare_pages=4)
    q = torch.randn(6, 4, 64, generator=gen, dtype=torch.float64)
    place = {}
    if spec.pos_encoding is not None:  # keys after 7 earlier ones, queries well after them
        pages = [p + 7 for p in level_positions([level], page_size)[0]]
        place = {"kv_page_pos": pages[0], "q_pos": np.array([30, 31, 40, 50, 51, 52])}
    want = reference_attention(spec, q, kv, qo_indptr=level.qo_indptr, **level.table(), **place)
    chunked = split_level(level, chunks, page_size)
    if place:
        place = dict(zip(("kv_page_pos", "q_pos"), chunked.positions(place["kv_page_pos"], place["q_pos"])))
    out, lse = reference_attention(spec, q.repeat(chunks, 1, 1), kv, qo_indptr=chunked.table.qo_indptr,
                                   **chunked.table.table(), **place)
    got = merge_states_ref(out.view(chunks, 6, 4, 64).transpose(0, 1), lse.view(chunks, 6, 4).transpose(0, 1))
    assert torch.equal(got[1].isneginf(), want[1].isneginf())
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-10)
    finite = want[1].isfinite()
    torch.testing.assert_close(got[1][finite], want[1][finite], rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------- the wrapper


@contextmanager
def stubbed(capability=(9, 0)):
    """CUDA stubbed (tests/stub_cuda.py) on a device of ``capability``; the Hopper kernel's RoPE scratch maps,
    which its plan() encodes through the driver, stood in for."""
    cpu = lambda device=None: torch.device("cpu")  # noqa: E731
    with stubbed_cuda(), mock.patch.object(cascade_api, "resolve_device", cpu), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: capability), \
            mock.patch.object(sm90, "kv_tensor_map", lambda *args: bytes(128)):
        yield


def prefix_batch(batch: int, prefix_pages: int, suffix_pages: int = 1, page_size: int = 16):
    """``batch`` requests over one shared prefix of ``prefix_pages`` pages, then ``suffix_pages`` each."""
    lists = [list(range(prefix_pages)) + [prefix_pages + b * suffix_pages + i for i in range(suffix_pages)]
             for b in range(batch)]
    return csr(lists, np.full(batch, page_size, np.int32))


SPEC = AttentionSpec(128, kv_layout=Paged(16), mask=Causal())


def test_a_long_shared_prefix_of_a_decode_batch_splits_onto_the_hopper_kernel():
    # the benchmark's shape: 128 decoding requests, a 32k prefix (2048 pages), 32 q / 8 kv heads: 32 CTAs unsplit
    table = prefix_batch(128, 2048)
    with stubbed():
        wrapper = flashgen.CascadeWrapper(SPEC, num_sms=132)
        wrapper.plan(qo_indptr=np.arange(129), **table, num_qo_heads=32, num_kv_heads=8)
        assert [(r.runs, r.chunks) for r in wrapper.levels] == [("sm90", 4), ("decode", 1)]
        (split,) = wrapper._split
        assert split.chunks == 4 and split.inner.backend == "sm90" and len(wrapper._runs) == 1
        chunked = split.level.table
        assert chunked.qo_indptr.tolist() == [0, 128, 256, 384, 512]
        assert chunked.kv_indptr.tolist() == [0, 512, 1024, 1536, 2048] and chunked.kv_lens.tolist() == [8192] * 4
        plan = split.inner._impl.last_plan  # one item a (chunk, q tile): 16, run by 8 kv heads = 128 CTAs
        assert int((plan.numpy("request_idx") >= 0).sum()) == 16 and split.inner._impl._grid == (128, 1, 1)
        # run(): q copied into [4, 128, 32, 128], the chunks attended (the Hopper kernel's launch needs a GPU: its
        # run() is stood in for), their states merged into out in place
        calls = []

        def chunks_run(q, kv_cache, out=None, return_lse=False):
            calls.append((tuple(q.shape), tuple(out.shape), q.is_contiguous()))
            return out, on_device(torch.zeros(out.shape[:2]))

        split.inner.run = chunks_run
        q = on_device(torch.ones(128, 32, 128, dtype=torch.bfloat16))
        cache = tuple(on_device(torch.zeros(2048 + 128, 16, 8, 128, dtype=torch.bfloat16)) for _ in range(2))
        real_empty, real_empty_like = torch.empty, torch.empty_like
        with mock.patch.object(torch, "empty_like", lambda t, **kw: on_device(real_empty_like(t, **kw))), \
                mock.patch.object(cascade_api.torch, "empty", lambda *a, **kw: on_device(real_empty(*a, **kw))):
            out, lse = wrapper.run(q, cache, return_lse=True)
            assert out.shape == (128, 32, 128) and lse.shape == (128, 32)
            assert calls == [((512, 32, 128), (512, 32, 128), True)]
            assert split._q.shape == (4, 128, 32, 128) and bool((split._q == 1).all())
            buffers = (split._q, split._out)
            wrapper.plan(qo_indptr=np.arange(129), **table, num_qo_heads=32, num_kv_heads=8)
            split.inner.run = chunks_run
            wrapper.run(q, cache)
            assert split._q is buffers[0] and split._out is buffers[1]  # kept from plan to plan
    # Ampere: the portable kernel, whole; a CUDA-graph wrapper: its path unchanged
    with stubbed((8, 0)):
        wrapper = flashgen.CascadeWrapper(SPEC, num_sms=132)
        wrapper.plan(qo_indptr=np.arange(129), **table, num_qo_heads=32, num_kv_heads=8)
        assert [(r.runs, r.chunks) for r in wrapper.levels] == [("portable", 1), ("decode", 1)]
    with stubbed():
        for backend in ("auto", "sm90"):
            wrapper = flashgen.CascadeWrapper(SPEC, num_sms=132, use_cuda_graph=True, num_levels=2,
                                              max_batch_size=128, prefill_backend=backend)
            wrapper.plan(qo_indptr=np.arange(129), **table, num_qo_heads=32, num_kv_heads=8)
            assert wrapper.levels[0].chunks == 1 and wrapper._split == ()
            assert wrapper.levels[0].runs == ("portable" if backend == "auto" else "sm90")


@pytest.mark.parametrize("prefix_pages, backend, want", [
    (64, "auto", ("portable", 1)),  # 1k keys: too short to split
    (256, "auto", ("portable", 1)),  # 4k keys: 2 chunks fill 64 of 132 SMs, under 60 %
    (256, "sm90", ("sm90", 2)),  # forced: split whatever the fill
    (512, "auto", ("sm90", 4)),  # 8k keys: 4 chunks of 2048, 128 CTAs
    (64, "sm90", ("sm90", 1)),
])
def test_the_split_rule_by_prefix_length(prefix_pages, backend, want):
    with stubbed():
        wrapper = flashgen.CascadeWrapper(SPEC, num_sms=132, prefill_backend=backend)
        wrapper.plan(qo_indptr=np.arange(129), **prefix_batch(128, prefix_pages), num_qo_heads=32, num_kv_heads=8,
                     policy=CascadePolicy(fold="never"))
        assert (wrapper.levels[0].runs, wrapper.levels[0].chunks) == want


def test_levels_with_device_ids_split_only_with_one_group():
    ids = lambda n, start=0: on_device(torch.arange(start, start + n, dtype=torch.int32))  # noqa: E731
    last = CascadeLevel(np.arange(129), np.arange(129), np.arange(4000, 4128, dtype=np.int32), np.full(128, 16))
    with stubbed():
        wrapper = flashgen.CascadeWrapper(SPEC, num_sms=132)
        wrapper.plan(levels=[CascadeLevel([0, 128], [0, 2048], ids(2048), [16]), last], num_qo_heads=32,
                     num_kv_heads=8)
        assert (wrapper.levels[0].runs, wrapper.levels[0].chunks) == ("sm90", 4)
        assert wrapper._split[0].level.table.kv_indices is not None
        two = CascadeLevel([0, 64, 128], [0, 2048, 4000], ids(4000), [16, 16])
        wrapper.plan(levels=[two, last], num_qo_heads=32, num_kv_heads=8)
        assert (wrapper.levels[0].runs, wrapper.levels[0].chunks) == ("portable", 1)


@pytest.mark.parametrize("spec", [AttentionSpec(64, kv_layout=Paged(ps), mask=Causal(), **enc)
                                  for ps in (1, 16, 17) for enc in ({}, {"pos_encoding": ALiBi()})]
                         + [AttentionSpec(64, kv_layout=Paged(4), mask=Causal(), pos_encoding=RoPE())],
                         ids=lambda s: f"ps{s.kv_layout.page_size}_{type(s.pos_encoding).__name__}")
def test_a_forced_small_split_composes_to_flat_attention(spec):
    # a few pages a level split into 2-3 uneven chunks (CascadePolicy.chunks), some empty: the planned runs,
    # attended by the fp64 reference and merged, are flat attention over the whole sequences
    page = spec.kv_layout.page_size
    with stubbed():
        wrapper = flashgen.CascadeWrapper(spec)
        for seed, depth, chunks in ((0, 1, 2), (1, 2, 3), (2, 2, 2), (3, 2, 3)):
            rng = np.random.default_rng(seed)
            gen = torch.Generator().manual_seed(seed)
            lists = [[900, 901, 902, 903, 904] + p for p in tree_pages(rng, 5, depth)]
            last = last_page_lens(rng, lists, page)
            kv = shared_cache(lists, last, page, 1, 64, torch.float64, generator=gen)
            qo = np.arange(6)
            q = torch.randn(5, 2, 64, generator=gen, dtype=torch.float64)
            flat = csr(lists, last)
            wrapper.plan(qo_indptr=qo, **flat, num_qo_heads=2, num_kv_heads=1,
                         policy=CascadePolicy(fold="never", chunks=chunks))
            assert wrapper._split and wrapper.levels[0].chunks == chunks
            assert all(r.chunks == (chunks if r.runs == "sm90" else 1) for r in wrapper.levels)
            states = []
            runs = wrapper._run_tables
            place = level_positions([t for _, t in runs], page) if wrapper._positions else None
            for i, (s, t) in enumerate(runs):
                split = next((x for x in wrapper._split if x.source is t), None)
                if split is None:
                    extra = {"kv_page_pos": place[0][i], "q_pos": place[1]} if place else {}
                    states.append(reference_attention(s, q, kv, qo_indptr=t.qo_indptr, **t.table(), **extra))
                    continue
                chunks, table = split.chunks, split.level.table
                out, lse = reference_attention(s, q.repeat(chunks, 1, 1), kv, qo_indptr=table.qo_indptr,
                                               **table.table(), **split.positions)
                states += [(out[k * 5:(k + 1) * 5], lse[k * 5:(k + 1) * 5]) for k in range(chunks)]
            out, lse = merge_states_ref(torch.stack([o for o, _ in states], 1), torch.stack([x for _, x in states], 1))
            ref, ref_lse = reference_attention(spec, q, kv, qo_indptr=qo, **flat)
            assert torch.equal(lse.isneginf(), ref_lse.isneginf())
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("policy, message", [
    (CascadePolicy(min_chunk_tokens=0), r"^policy\.min_chunk_tokens: got 0, expected an int >= 1"),
    (CascadePolicy(min_chunk_tokens=1.5), r"^policy\.min_chunk_tokens: got 1\.5, expected an int >= 1"),
    (CascadePolicy(chunks=0), r"^policy\.chunks: got 0, expected None or an int >= 1"),
    (CascadePolicy(chunks=True), r"^policy\.chunks: got True, expected None or an int >= 1"),
])
def test_bad_split_policies_name_the_field(policy, message):
    with stubbed():
        wrapper = flashgen.CascadeWrapper(SPEC)
        with pytest.raises(PlanError, match=message):
            wrapper.plan(qo_indptr=np.arange(3), **prefix_batch(2, 4), num_qo_heads=8, num_kv_heads=2, policy=policy)
