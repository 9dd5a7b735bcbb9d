"""PagedKVCache on the CPU: the page tables it hands out gather each sequence's K/V through the reference's own
layout code (both forms, NHD/HND, combined/pair), the prefix cache, fork and copy-on-write, each out-of-pages
policy, stats and the named errors."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch

import flashgen
from flashgen import AttentionSpec, OutOfPages, Paged, PagedKVCache, Ragged
from flashgen.kvcache import KVCacheError, manager, prefix, tables
from flashgen.testing.layouts import request_kv
from flashgen.testing.reference import reference_attention

H, D = 2, 64


def kv(n: int, seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, D, generator=g).to(dtype), torch.randn(n, H, D, generator=g).to(dtype)


def test_doctests():
    for module in (manager, prefix, tables):
        assert doctest.testmod(module).failed == 0


def test_exported():
    for name in ("PagedKVCache", "OutOfPages", "KVCacheError", "CacheStats", "PageTables", "Preemption", "WriteCoords"):
        assert name in flashgen.__all__ and hasattr(flashgen, name)


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_form", ["combined", "pair"])
def test_tables_gather_each_sequence(page_size, layout, kv_form):
    cache = PagedKVCache(64, page_size, H, D, torch.float16, layout, kv_form=kv_form)
    dense = {}
    for i, n in enumerate([5, 1, 17, 0, 33]):
        cache.add(i)
        if n:
            k, v = kv(n, i, torch.float16)
            cache.append(i, k, v)
            dense[i] = (k, v)
        else:
            dense[i] = kv(0, i, torch.float16)
    cache.fork(2, "c")  # shares 2's pages; the write copies the shared partial last page
    k, v = kv(4, 99, torch.float16)
    cache.append("c", k, v)
    dense["c"] = (torch.cat([dense[2][0], k]), torch.cat([dense[2][1], v]))
    batch = [4, "c", 3, 0, 2, 1]
    t = cache.page_tables(batch)
    spec = AttentionSpec(D, dtype="float16", kv_layout=Paged(page_size, layout))
    for form in (t.csr(), t.blocks()):
        got = request_kv(spec, cache.kv, **form)
        for s, (gk, gv) in zip(batch, got):
            assert torch.equal(gk, dense[s][0]) and torch.equal(gv, dense[s][1]), (s, form.keys())
            assert all(torch.equal(a, b) for a, b in zip(cache.gather(s), dense[s]))
    assert t.kv_indices.dtype == t.block_table.dtype == t.seq_lens.dtype == torch.int32
    assert t.seq_lens.tolist() == [dense[s][0].shape[0] for s in batch]
    # reference attention through the manager's tables equals the one over dense per-sequence K/V
    q = torch.randn(len(batch), 4, D).half()
    qo = list(range(len(batch) + 1))
    out, lse = reference_attention(spec, q, cache.kv, qo_indptr=qo, **t.csr())
    ragged = AttentionSpec(D, dtype="float16", kv_layout=Ragged())
    lens = np.cumsum([0] + [dense[s][0].shape[0] for s in batch])
    want, want_lse = reference_attention(ragged, q, (torch.cat([dense[s][0] for s in batch]),
                                                     torch.cat([dense[s][1] for s in batch])),
                                         qo_indptr=qo, kv_indptr=lens)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_allocate_and_write_coords(layout):
    cache = PagedKVCache(16, 3, H, D, torch.float32, layout)
    cache.add("a")
    cache.add("b")
    cache.append("a", *kv(4, 0))
    slots = cache.allocate("a", 3)
    assert slots.dtype == torch.int32 and slots.shape == (3,)
    cache.allocate("b", 2)
    w = cache.write_coords(["b", "a"], [2, 3])
    pages_a, pages_b = cache.pages("a"), cache.pages("b")
    assert w.slot_mapping.tolist()[2:] == slots.tolist()
    assert w.slot_mapping.tolist()[:2] == [pages_b[0] * 3, pages_b[0] * 3 + 1]
    assert w.batch_indices.tolist() == [0, 0, 1, 1, 1] and w.positions.tolist() == [0, 1, 4, 5, 6]
    assert w.append_indptr.tolist() == [0, 2, 5]
    assert [pages_a[p // 3] * 3 + p % 3 for p in (4, 5, 6)] == slots.tolist()
    # an external writer (the append kernel) writes through the slots; the gather reads it back
    k, v = kv(3, 1)
    cache._pool.write_tokens(slots.long(), k, v)
    assert torch.equal(cache.gather("a")[0][4:], k) and torch.equal(cache.gather("a")[1][4:], v)


def test_prefix_cache_shares_full_pages():
    ps = 4
    cache = PagedKVCache(16, ps, H, D, torch.float32)
    prompt = list(range(100, 111))  # 11 tokens: 2 full pages + 3
    assert cache.add("a", prompt) == 0
    k, v = kv(11, 0)
    cache.append("a", k, v)
    assert cache.add("b", prompt + [7, 8]) == 8  # the two full pages, by reference
    assert cache.pages("b") == cache.pages("a")[:2] and cache.refcount(cache.pages("a")[0]) == 2
    assert cache.add("c", prompt[:8]) == 4  # at most len - 1 tokens: one page, one token left to compute
    assert cache.add("d", [1] + prompt[1:]) == 0  # the chain differs from its first page
    cache.free("a"), cache.free("b"), cache.free("c")
    s = cache.stats()
    assert s.pages_cached == 2 and s.pages_in_use == 0 and s.pages_free == 14
    assert cache.add("e", prompt) == 8
    assert torch.equal(cache.gather("e")[0], k[:8])
    assert cache.stats().pages_cached == 0
    cache.free("e")
    assert cache.evict() == 2 and cache.stats().pages_free == 16 and cache.add("f", prompt) == 0


def test_prefix_cache_off():
    cache = PagedKVCache(8, 2, H, D, torch.float32, prefix_cache=False)
    cache.add("a", [1, 2, 3, 4, 5])
    cache.append("a", *kv(5, 0))
    cache.add("b", [1, 2, 3, 4, 5]) == 0
    cache.free("a")
    assert cache.stats().pages_cached == 0 and cache.stats().pages_free == 8


def test_fork_copy_on_write_keeps_bytes():
    cache = PagedKVCache(8, 4, H, D, torch.float32)
    cache.add("p")
    k, v = kv(6, 0)
    cache.append("p", k, v)
    cache.fork("p", "c")
    assert cache.pages("c") == cache.pages("p") and cache.stats().pages_in_use == 2
    assert cache.pages_needed("c", 1) == 1 and cache.pages_needed("c", 3) == 2 and cache.pages_needed("c", 0) == 0
    k2, v2 = kv(1, 1)
    cache.append("c", k2, v2)
    assert cache.pages("c")[0] == cache.pages("p")[0] and cache.pages("c")[1] != cache.pages("p")[1]
    assert torch.equal(cache.gather("p")[0], k) and torch.equal(cache.gather("c")[0], torch.cat([k, k2]))
    k3, v3 = kv(3, 2)
    cache.append("p", k3, v3)  # the parent's page is its own again: written in place
    assert torch.equal(cache.gather("p")[1], torch.cat([v, v3])) and torch.equal(cache.gather("c")[1], torch.cat([v, v2]))
    cache.free("p"), cache.free("c")
    assert cache.stats().pages_free == 8


def test_truncate():
    cache = PagedKVCache(8, 4, H, D, torch.float32)
    cache.add("a", list(range(9)))
    k, v = kv(9, 0)
    cache.append("a", k, v)
    cache.fork("a", "b")
    cache.truncate("b", 6)
    assert cache.seq_len("b") == 6 and len(cache.pages("b")) == 2
    k2, v2 = kv(2, 1)
    cache.append("b", k2, v2)  # page 1 is shared and keyed: copied, not overwritten
    assert torch.equal(cache.gather("a")[0], k) and torch.equal(cache.gather("b")[0], torch.cat([k[:6], k2]))
    with pytest.raises(KVCacheError, match="num_tokens"):
        cache.truncate("a", 10)


def test_raise_changes_nothing():
    cache = PagedKVCache(4, 2, H, D, torch.float32)
    cache.add("a")
    cache.append("a", *kv(5, 0))
    before = (cache.pages("a"), cache.stats(), cache.free_pages())
    with pytest.raises(OutOfPages, match=r"needs 2 page\(s\), 1 free") as e:
        cache.append("a", *kv(4, 1))
    assert (e.value.requested, e.value.free, e.value.policy) == (2, 1, "raise")
    assert (cache.pages("a"), cache.stats(), cache.free_pages()) == before


def test_evict_policy_uses_cached_pages_only():
    cache = PagedKVCache(4, 2, H, D, torch.float32, out_of_pages="evict")
    cache.add("a", [1, 2, 3, 4])
    cache.append("a", *kv(4, 0))
    cache.free("a")
    cache.add("b")
    cache.append("b", *kv(6, 1))  # 3 pages: 2 free + 1 evicted
    assert cache.stats().pages_cached == 1 and cache.stats().pages_free == 0
    with pytest.raises(OutOfPages, match="out_of_pages='evict'"):
        cache.append("b", *kv(5, 2))
    cache.append("b", *kv(2, 3))  # the last cached page


@pytest.mark.parametrize("policy", ["swap", "recompute"])
def test_preempt_policies(policy):
    cache = PagedKVCache(6, 2, H, D, torch.float32, out_of_pages=policy)
    data = {}
    for s in ("a", "b", "c"):
        cache.add(s)
        data[s] = kv(4, ord(s))
        cache.append(s, *data[s])
    cache.protect("c")
    cache.append("a", *kv(2, 9))  # needs 1 page: "c" is protected, so "b" (the next most recent) goes
    (p,) = cache.take_preempted()
    assert (p.seq_id, p.kind, p.num_tokens) == ("b", policy, 4)
    if policy == "swap":
        assert cache.is_swapped("b") and cache.stats().swapped_pages == 2
        with pytest.raises(KVCacheError, match="resume"):
            cache.append("b", *kv(1, 0))
        cache.free("a")
        cache.resume("b")
        assert all(torch.equal(x, y) for x, y in zip(cache.gather("b"), data["b"]))
    else:
        assert "b" not in cache
    assert all(torch.equal(x, y) for x, y in zip(cache.gather("c"), data["c"]))


def test_preempt_that_cannot_help_changes_nothing():
    cache = PagedKVCache(2, 2, H, D, torch.float32, out_of_pages="swap")
    cache.add("a")
    cache.append("a", *kv(3, 0))
    cache.fork("a", "b")  # all of b's pages are a's: preempting b frees nothing
    with pytest.raises(OutOfPages, match="would free only 0"):
        cache.append("a", *kv(2, 1))
    assert cache.preempted == [] and not cache.is_swapped("b")


def test_errors_name_the_argument():
    with pytest.raises(KVCacheError, match="page_size"):
        PagedKVCache(4, 0, H, D)
    with pytest.raises(KVCacheError, match="num_pages"):
        PagedKVCache(2.0, 1, H, D)
    with pytest.raises(KVCacheError, match="layout"):
        PagedKVCache(4, 1, H, D, layout="NDH")
    with pytest.raises(KVCacheError, match="out_of_pages"):
        PagedKVCache(4, 1, H, D, out_of_pages="drop")
    with pytest.raises(KVCacheError, match="dtype"):
        PagedKVCache(4, 1, H, D, dtype=torch.int32)
    cache = PagedKVCache(4, 2, H, D, torch.float32)
    cache.add("a")
    with pytest.raises(KVCacheError, match="already"):
        cache.add("a")
    with pytest.raises(KVCacheError, match="no sequence 'x'"):
        cache.append("x", *kv(1, 0))
    with pytest.raises(KVCacheError, match="parent: no sequence"):
        cache.fork("x", "y")
    with pytest.raises(KVCacheError, match=r"k: expected shape \[n, 2, 64\]"):
        cache.append("a", torch.zeros(1, 3, D), torch.zeros(1, 3, D))
    with pytest.raises(KVCacheError, match="k: expected dtype"):
        cache.append("a", *kv(1, 0, torch.float16))
    with pytest.raises(KVCacheError, match="k: expected a tensor on cpu"):
        cache.append("a", torch.zeros(1, H, D, device="meta"), torch.zeros(1, H, D, device="meta"))
    with pytest.raises(KVCacheError, match="page: got 4, expected 0..3"):
        cache.refcount(4)
    with pytest.raises(KVCacheError, match="not swapped out"):
        cache.resume("a")
    with pytest.raises(KVCacheError, match="v: shape"):
        cache.append("a", kv(2, 0)[0], kv(1, 0)[1])
    with pytest.raises(KVCacheError, match="num_tokens"):
        cache.allocate("a", 0)
    with pytest.raises(KVCacheError, match="tokens: 2 ids, expected 1"):
        cache.append("a", *kv(1, 0), tokens=[1, 2])
    with pytest.raises(KVCacheError, match="tokens: expected a 1-D"):
        cache.add("b", [[1, 2]])
    with pytest.raises(KVCacheError, match=r"num_new\[0\]"):
        cache.write_coords(["a"], [1])
    assert cache.seq_len("a") == 0 and cache.stats().pages_free == 4


@pytest.mark.cuda
@pytest.mark.parametrize("layout,kv_form,form", [("NHD", "combined", "csr"), ("HND", "pair", "blocks")])
def test_decode_over_the_managers_pool(layout, kv_form, form):
    from flashgen.testing.check import assert_matches_reference

    spec = AttentionSpec(128, dtype="bfloat16", kv_layout=Paged(16, layout))
    cache = PagedKVCache(64, 16, 2, 128, torch.bfloat16, layout, "cuda", kv_form=kv_form)
    for i, n in enumerate([1, 37, 200, 16]):
        cache.add(i)
        cache.append(i, torch.randn(n, 2, 128, device="cuda").bfloat16(), torch.randn(n, 2, 128, device="cuda").bfloat16())
    cache.fork(1, "f")
    cache.append("f", torch.randn(3, 2, 128, device="cuda").bfloat16(), torch.randn(3, 2, 128, device="cuda").bfloat16())
    batch = [2, "f", 0, 1, 3]
    tables = cache.page_tables(batch, device="cuda")
    args = tables.csr() if form == "csr" else tables.blocks()
    wrapper = flashgen.BatchDecodeWrapper(spec)
    wrapper.plan(num_qo_heads=8, num_kv_heads=2, num_pages=cache.num_pages, **args)
    q = torch.randn(len(batch), 8, 128, device="cuda").bfloat16()
    out = wrapper.run(q, cache.kv)
    host = {"kv_indptr": tables.kv_indptr, "kv_indices": tables.kv_indices_host,
            "kv_last_page_len": tables.kv_last_page_len} if form == "csr" else \
        {"block_table": tables.block_table_host, "seq_lens": tables.seq_lens}
    kv_cpu = cache.kv.cpu() if kv_form == "combined" else tuple(x.cpu() for x in cache.kv)
    assert_matches_reference(spec, q.cpu(), kv_cpu, out, qo_indptr=list(range(len(batch) + 1)), **host)
