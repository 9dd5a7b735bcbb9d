"""PagedKVCache against a pure-Python model, driven by hypothesis state machines.

Random add (with or without a prompt, so the prefix cache hits) / append / allocate + external write / fork /
truncate / free / resume / evict / protect sequences over small pools (page sizes 1, 3, 16; every policy), and
after every step: each live sequence's K/V, gathered through its page table (both forms, through the
reference's layout code), equals the model's dense copy (so copy-on-write never changed another sequence's
bytes, a prefix hit gave the bytes its prompt has, and a swapped-and-resumed sequence came back exactly); each
page's refcount is the number of live tables that hold it; free, cached and referenced pages partition the
pool; waste is under one page per sequence; a failed call (OutOfPages) changed nothing; preemptions are
reported and match the policy. At the end everything is freed and every refcount is back to zero.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flashgen import AttentionSpec, OutOfPages, Paged, PagedKVCache
from flashgen.testing.layouts import request_kv

H, D = 1, 64
SYSTEM = list(range(10, 60))  # a shared system prompt: prompts that start with it hit the prefix cache


class _Seq:
    def __init__(self, tokens):
        self.tokens = list(tokens)  # known ids, may run past the stored length (the prompt)
        self.k = torch.zeros(0, H, D, dtype=torch.float16)
        self.v = torch.zeros(0, H, D, dtype=torch.float16)
        self.swapped = False


class CacheMachine(RuleBasedStateMachine):
    page_size, num_pages, policy, layout, kv_form, prefix = 3, 10, "raise", "NHD", "combined", True

    def __init__(self):
        super().__init__()
        self.cache = PagedKVCache(self.num_pages, self.page_size, H, D, torch.float16, self.layout,
                                  kv_form=self.kv_form, out_of_pages=self.policy, prefix_cache=self.prefix)
        self.spec = AttentionSpec(D, dtype="float16", kv_layout=Paged(self.page_size, self.layout))
        self.model: dict[int, _Seq] = {}
        self.rows: dict[tuple, torch.Tensor] = {}  # K/V row of a known token prefix: equal prompts, equal bytes
        self.next_id = 0
        self.gen = torch.Generator().manual_seed(0)

    # ------------------------------------------------------------------------------------------ model

    def _row(self, prefix: tuple | None) -> torch.Tensor:
        if prefix is None:
            return torch.randn(2, H, D, generator=self.gen).half()
        if prefix not in self.rows:
            self.rows[prefix] = torch.randn(2, H, D, generator=self.gen).half()
        return self.rows[prefix]

    def _new_rows(self, seq: _Seq, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        old = seq.k.shape[0]
        rows = torch.stack([self._row(tuple(seq.tokens[:p + 1]) if p < len(seq.tokens) else None)
                            for p in range(old, old + n)])
        return rows[:, 0].contiguous(), rows[:, 1].contiguous()

    def _snapshot(self):
        c = self.cache
        seqs = {s: (c.seq_len(s), c.is_swapped(s), None if c.is_swapped(s) else c.pages(s)) for s in c.seq_ids}
        return seqs, c.free_pages(), c.cached_pages(), [c.refcount(p) for p in range(c.num_pages)], c.stats()

    def _call(self, fn, *args, **kwargs) -> bool:
        """Run a cache call; on OutOfPages check nothing changed. Then take the reported preemptions."""
        before = self._snapshot()
        try:
            fn(*args, **kwargs)
            ok = True
        except OutOfPages:
            assert self._snapshot() == before, "a failed call changed the cache"
            assert self.cache.preempted == []
            ok = False
        self.preempted_now = self.cache.take_preempted()
        for p in self.preempted_now:
            assert p.kind == self.policy and p.seq_id in self.model and not self.model[p.seq_id].swapped
            assert p.num_tokens == self.model[p.seq_id].k.shape[0]
            if p.kind == "swap":
                self.model[p.seq_id].swapped = True
            else:
                del self.model[p.seq_id]
                assert p.seq_id not in self.cache
        return ok

    def _grow(self, sid: int, n: int, ids: list | None, external: bool) -> None:
        seq = self.model[sid]
        old = seq.k.shape[0]
        trial = _Seq(seq.tokens[:old] + ids if ids is not None and len(seq.tokens) >= old else seq.tokens)
        trial.k = seq.k
        k, v = self._new_rows(trial, n)
        needed, in_use = self.cache.pages_needed(sid, n), self.cache.stats().pages_in_use
        if external:  # allocate, then write through the slots as the append kernel will
            ok = self._call(self._allocate_write, sid, n, ids, k, v)
        else:
            ok = self._call(self.cache.append, sid, k, v, tokens=ids)
        if ok:
            seq.tokens, seq.k, seq.v = trial.tokens, torch.cat([seq.k, k]), torch.cat([seq.v, v])
            if not self.preempted_now:  # what pages_needed promised is what the call took
                assert self.cache.stats().pages_in_use - in_use == needed

    def _allocate_write(self, sid, n, ids, k, v):
        slots = self.cache.allocate(sid, n, tokens=ids)
        self.cache._pool.write_tokens(slots.long(), k, v)

    def _live(self) -> list[int]:
        return sorted(s for s, q in self.model.items() if not q.swapped)

    # ------------------------------------------------------------------------------------------ rules

    @rule(data=st.data(), prompt=st.booleans())
    def add(self, data, prompt):
        sid, self.next_id = self.next_id, self.next_id + 1
        tokens = None
        if prompt:
            head = data.draw(st.sampled_from([0, self.page_size, 2 * self.page_size + 1]))
            tokens = SYSTEM[:head] + data.draw(st.lists(st.integers(0, 2), max_size=self.page_size + 2))
        cached = self.cache.add(sid, tokens)
        seq = self.model[sid] = _Seq(tokens or [])
        assert cached % self.page_size == 0 and cached <= max(len(seq.tokens) - 1, 0)
        if cached:
            seq.k, seq.v = self._new_rows(seq, cached)
        if tokens and len(tokens) > cached:  # the prompt's uncached rest
            self._grow(sid, len(tokens) - cached, None, external=False)

    @precondition(lambda self: self._live())
    @rule(data=st.data(), n=st.integers(1, 20), with_ids=st.booleans(), external=st.booleans())
    def append(self, data, n, with_ids, external):
        sid = data.draw(st.sampled_from(self._live()))
        ids = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)) if with_ids else None
        self._grow(sid, n, ids, external)

    @precondition(lambda self: self._live())
    @rule(data=st.data(), then=st.sampled_from([None, "parent", "child"]), n=st.integers(1, 4))
    def fork(self, data, then, n):
        parent = data.draw(st.sampled_from(self._live()))
        sid, self.next_id = self.next_id, self.next_id + 1
        self.cache.fork(parent, sid)
        p = self.model[parent]
        child = self.model[sid] = _Seq(p.tokens)
        child.k, child.v = p.k.clone(), p.v.clone()
        if then is not None:  # a write into the shared partial last page: copy-on-write
            self._grow(parent if then == "parent" else sid, n, None, external=False)

    @precondition(lambda self: self._live())
    @rule(data=st.data(), then_append=st.booleans())
    def truncate(self, data, then_append):
        sid = data.draw(st.sampled_from(self._live()))
        seq = self.model[sid]
        n = data.draw(st.integers(0, seq.k.shape[0]))
        self.cache.truncate(sid, n)
        seq.k, seq.v, seq.tokens = seq.k[:n], seq.v[:n], seq.tokens[:n]
        if then_append:  # new ids into a page that may be keyed or shared: it must stop being either
            self._grow(sid, data.draw(st.integers(1, 3)), None, external=False)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.free(sid)
        del self.model[sid]

    @precondition(lambda self: any(q.swapped for q in self.model.values()))
    @rule(data=st.data())
    def resume(self, data):
        sid = data.draw(st.sampled_from(sorted(s for s, q in self.model.items() if q.swapped)))
        if self._call(self.cache.resume, sid):
            self.model[sid].swapped = False

    @rule(n=st.one_of(st.none(), st.integers(0, 3)))
    def evict(self, n):
        cached = len(self.cache.cached_pages())
        assert self.cache.evict(n) == (cached if n is None else min(n, cached))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), flag=st.booleans())
    def protect(self, data, flag):
        self.cache.protect(data.draw(st.sampled_from(sorted(self.model))), flag)

    # ------------------------------------------------------------------------------------------ checks

    @invariant()
    def data_intact(self):
        live = self._live()
        assert sorted(self.cache.seq_ids) == sorted(self.model)
        tables = self.cache.page_tables(live)
        for form in (tables.csr(), tables.blocks()):
            for sid, (k, v) in zip(live, request_kv(self.spec, self.cache.kv, **form)):
                assert torch.equal(k, self.model[sid].k) and torch.equal(v, self.model[sid].v), sid

    @invariant()
    def pages_accounted(self):
        c, ps = self.cache, self.page_size
        held = [0] * c.num_pages
        for sid in self._live():
            pages = c.pages(sid)
            assert len(pages) == -(-c.seq_len(sid) // ps)  # waste < one page per sequence
            for p in pages:
                held[p] += 1
        assert [c.refcount(p) for p in range(c.num_pages)] == held
        free, cached = c.free_pages(), c.cached_pages()
        referenced = {p for p in range(c.num_pages) if held[p]}
        assert len(set(free)) == len(free) and len(set(cached)) == len(cached)
        assert not (set(free) & set(cached)) and not (referenced & (set(free) | set(cached)))
        assert len(free) + len(cached) + len(referenced) == c.num_pages
        s = c.stats()
        assert (s.pages_free, s.pages_cached, s.pages_in_use) == (len(free), len(cached), len(referenced))
        assert s.tokens_stored == sum(self.model[q].k.shape[0] for q in self._live())
        assert 0 <= s.waste_tokens <= (ps - 1) * s.live_seqs
        swapped = [q for q in self.model.values() if q.swapped]
        assert s.swapped_seqs == len(swapped) and s.swapped_pages == sum(-(-q.k.shape[0] // ps) for q in swapped)

    def teardown(self):
        for sid in list(self.model):
            self.cache.free(sid)
        c = self.cache
        assert all(c.refcount(p) == 0 for p in range(c.num_pages)) and c.stats().pages_in_use == 0
        c.evict()
        assert sorted(c.free_pages()) == list(range(c.num_pages))


CONFIGS = [  # page_size, num_pages, policy, layout, kv_form, prefix cache
    (1, 24, "raise", "NHD", "combined", True),
    (1, 24, "swap", "HND", "pair", True),
    (3, 10, "evict", "HND", "combined", True),
    (3, 10, "swap", "NHD", "combined", True),
    (3, 10, "recompute", "NHD", "pair", True),
    (3, 10, "raise", "NHD", "pair", False),
    (16, 4, "raise", "HND", "pair", True),
    (16, 4, "evict", "NHD", "combined", True),
    (16, 4, "swap", "HND", "combined", True),
    (16, 4, "recompute", "HND", "combined", False),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"page{c[0]}-{c[2]}-{c[3]}-{c[4]}" + ("" if c[5] else "-noprefix"))
def test_state_machine(config):
    machine = type("Machine", (CacheMachine,), dict(zip(
        ("page_size", "num_pages", "policy", "layout", "kv_form", "prefix"), config)))
    machine.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None, derandomize=True,
                                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    machine.TestCase().runTest()
