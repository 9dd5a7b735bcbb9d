"""PagedKVCache: sequences by id over a page pool — allocation, append, fork with copy-on-write, free, truncate,
the prefix cache, out-of-pages policies with swap and resume, page tables for ``plan()``, and stats."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import numpy as np
import torch

from .policy import POLICIES, Preemption, plan_victims
from .pool import KV_FORMS, LAYOUTS, PagePool
from .prefix import PrefixCache, hash_chain
from .tables import PageTables, WriteCoords, build_tables, build_write_coords

DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")


class KVCacheError(ValueError):
    """A bad call to ``PagedKVCache``: an unknown or duplicate sequence id, a swapped-out sequence used before
    ``resume``, or an argument of the wrong shape, dtype, device or range; the message names the argument."""


@dataclass(frozen=True)
class CacheStats:
    """Page and token counts of a ``PagedKVCache`` (``cache.stats()``).

    ``pages_in_use``: pages held by live sequences; ``pages_cached``: unreferenced prefix-cache pages;
    ``pages_free``: on the free list (the three add up to ``num_pages``); ``tokens_stored``: KV tokens of live
    sequences; ``waste_tokens``: ``page_size * pages - tokens`` summed over live sequences (at most one
    partial page each); ``swapped_pages``/``swapped_seqs``: held in host memory by swapped-out sequences.
    """

    num_pages: int
    page_size: int
    pages_in_use: int
    pages_cached: int
    pages_free: int
    tokens_stored: int
    waste_tokens: int
    live_seqs: int
    swapped_seqs: int
    swapped_pages: int


@dataclass
class _Seq:
    pages: list
    length: int
    order: int
    tokens: list = field(default_factory=list)  # known token ids, a prefix of the stream (may run past length)
    keys: list = field(default_factory=list)  # hash-chain keys of its first full pages
    swapped: tuple | None = None  # (k, v) in host memory while swapped out


def _positive(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise KVCacheError(f"{name}: got {value!r}, expected an int >= {minimum}")
    return int(value)


def _dtype(dtype: object) -> torch.dtype:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPES or not isinstance(getattr(torch, name, None), torch.dtype):
        raise KVCacheError(f"dtype: got {dtype!r}, expected one of {', '.join(DTYPES)} (a torch dtype or its name)")
    return getattr(torch, name)


def _token_list(name: str, tokens: object) -> list[int]:
    array = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise KVCacheError(f"{name}: expected a 1-D sequence of integer token ids, got {array.dtype} "
                           f"shape {array.shape}")
    return array.tolist()


class PagedKVCache:
    """A paged KV cache: a pool of pages, sequences by id, and the page tables the wrappers plan with.

    ``cache.kv`` is the pool in the layout the wrappers read: ``kv_form="combined"``: ``[num_pages, 2,
    page_size, num_kv_heads, head_dim]`` (NHD; HND swaps ``page_size`` and ``num_kv_heads``); ``"pair"``: a
    ``(k, v)`` tuple of ``[num_pages, page_size, num_kv_heads, head_dim]``. Sequences grow by ``append``
    (K/V of new tokens) or ``allocate`` (slots only, for a kernel that writes them), share pages through
    ``fork`` (copy-on-write of a shared partial last page) and the prefix cache (``add(seq_id, tokens)``),
    and give them back with ``free``. ``page_tables(seq_ids)`` and ``write_coords`` feed ``plan()`` and the
    append kernel. ``out_of_pages`` ("raise", "evict", "swap", "recompute"; ``flashgen.kvcache.policy``) says
    what happens when the free list runs dry; preempted sequences are listed in ``cache.preempted``.

    >>> cache = PagedKVCache(8, 4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    >>> cache.add("a", tokens=[1, 2, 3, 4, 5])
    0
    >>> cache.append("a", torch.randn(5, 2, 8), torch.randn(5, 2, 8))
    >>> cache.page_tables(["a"]).kv_last_page_len.tolist(), cache.stats().waste_tokens
    ([1], 3)
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype | str = torch.bfloat16, layout: str = "NHD", device: torch.device | str = "cpu",
                 *, kv_form: str = "combined", out_of_pages: str = "raise", prefix_cache: bool = True):
        for name, value in (("num_pages", num_pages), ("page_size", page_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            _positive(name, value)
        if layout not in LAYOUTS:
            raise KVCacheError(f"layout: got {layout!r}, expected one of {LAYOUTS}")
        if kv_form not in KV_FORMS:
            raise KVCacheError(f"kv_form: got {kv_form!r}, expected one of {KV_FORMS}")
        if out_of_pages not in POLICIES:
            raise KVCacheError(f"out_of_pages: got {out_of_pages!r}, expected one of {POLICIES}")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise KVCacheError(f"device: got {device!r}, expected a torch device ({e})") from None
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.page_size, self.num_kv_heads, self.head_dim = int(page_size), int(num_kv_heads), int(head_dim)
        self.dtype, self.layout, self.kv_form, self.device = _dtype(dtype), layout, kv_form, device
        self.out_of_pages = out_of_pages
        self._pool = PagePool(int(num_pages), self.page_size, self.num_kv_heads, self.head_dim, self.dtype, layout,
                              kv_form, device)
        self._prefix = PrefixCache() if prefix_cache else None
        self._seqs: dict[object, _Seq] = {}
        self._protected: set = set()
        self._added = 0
        self.preempted: list[Preemption] = []

    # ------------------------------------------------------------------------------------------ reading

    @property
    def kv(self):
        """The pool, as ``wrapper.run(q, cache.kv)`` takes it (one tensor, or a ``(k, v)`` pair)."""
        return self._pool.kv

    @property
    def num_pages(self) -> int:
        return self._pool.num_pages

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def seq_ids(self) -> list:
        """Every sequence (live and swapped out), in the order added."""
        return list(self._seqs)

    def _seq(self, seq_id: object, name: str = "seq_id", live: bool = True) -> _Seq:
        try:
            seq = self._seqs[seq_id]
        except (KeyError, TypeError):
            raise KVCacheError(f"{name}: no sequence {seq_id!r} in the cache") from None
        if live and seq.swapped is not None:
            raise KVCacheError(f"{name}: sequence {seq_id!r} is swapped out; call resume({seq_id!r}) first")
        return seq

    def seq_len(self, seq_id: object) -> int:
        """KV tokens stored for ``seq_id`` (a swapped-out sequence keeps its length)."""
        return self._seq(seq_id, live=False).length

    def pages(self, seq_id: object) -> list[int]:
        """The page ids of a live sequence, in order."""
        return list(self._seq(seq_id).pages)

    def is_swapped(self, seq_id: object) -> bool:
        return self._seq(seq_id, live=False).swapped is not None

    def refcount(self, page: int) -> int:
        """How many live sequences' page tables hold ``page``."""
        page = _positive("page", page, 0)
        if page >= self.num_pages:
            raise KVCacheError(f"page: got {page}, expected 0..{self.num_pages - 1}")
        return self._pool.refcount[page]

    def pages_needed(self, seq_id: object, num_tokens: int) -> int:
        """Pages that growing live ``seq_id`` by ``num_tokens`` would take (new pages, plus one where a shared
        partial last page must be copied first): what a scheduler compares with ``stats().pages_free``."""
        seq = self._seq(seq_id)
        n = _positive("num_tokens", num_tokens, 0)
        return -(-(seq.length + n) // self.page_size) - len(seq.pages) + (n > 0 and self._cow_needed(seq))

    def free_pages(self) -> list[int]:
        return self._pool.free_pages()

    def cached_pages(self) -> list[int]:
        """Unreferenced prefix-cache pages, least recently released first (the eviction order)."""
        return self._prefix.unreferenced() if self._prefix else []

    def gather(self, seq_id: object) -> tuple[torch.Tensor, torch.Tensor]:
        """A live sequence's K and V as dense ``[seq_len, num_kv_heads, head_dim]`` tensors (copies)."""
        seq = self._seq(seq_id)
        return self._pool.gather(seq.pages, seq.length)

    def stats(self) -> CacheStats:
        live = [s for s in self._seqs.values() if s.swapped is None]
        swapped = [s for s in self._seqs.values() if s.swapped is not None]
        tokens = sum(s.length for s in live)
        cached = self._prefix.num_unreferenced if self._prefix else 0
        free = self._pool.num_free
        return CacheStats(
            num_pages=self.num_pages, page_size=self.page_size, pages_in_use=self.num_pages - free - cached,
            pages_cached=cached, pages_free=free, tokens_stored=tokens,
            waste_tokens=sum(len(s.pages) for s in live) * self.page_size - tokens, live_seqs=len(live),
            swapped_seqs=len(swapped), swapped_pages=sum(s.swapped[0].shape[0] for s in swapped))

    # ------------------------------------------------------------------------------------------ tables

    def page_tables(self, seq_ids: list, device: torch.device | str | None = None) -> PageTables:
        """Page tables of live sequences in batch order ``seq_ids``: CSR and block table (``PageTables``).
        With ``device``, ``kv_indices`` and ``block_table`` are also copied there (lengths stay on the host).

        >>> wrapper.plan(**cache.page_tables(batch).csr(), num_qo_heads=32, num_kv_heads=8)  # doctest: +SKIP
        """
        seqs = [self._seq(s, "seq_ids") for s in seq_ids]
        return build_tables([s.pages for s in seqs], [s.length for s in seqs], self.page_size, device)

    def write_coords(self, seq_ids: list, num_new: list[int] | int) -> WriteCoords:
        """Where the last ``num_new[b]`` tokens of each live sequence live (``slot_mapping``, ``batch_indices``,
        ``positions``): the coordinates an append kernel takes after ``allocate``."""
        seqs = [self._seq(s, "seq_ids") for s in seq_ids]
        new = [num_new] * len(seqs) if isinstance(num_new, numbers.Integral) else list(num_new)
        if len(new) != len(seqs):
            raise KVCacheError(f"num_new: {len(new)} entries, expected {len(seqs)} (one per seq_ids entry)")
        for b, (s, n) in enumerate(zip(seqs, new)):
            if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 0 <= n <= s.length:
                raise KVCacheError(f"num_new[{b}]: got {n!r}, expected an int in 0..{s.length} (the sequence's length)")
        return build_write_coords([s.pages for s in seqs], [s.length for s in seqs], new, self.page_size)

    # ------------------------------------------------------------------------------------------ sequences

    def add(self, seq_id: object, tokens: object = None) -> int:
        """Start sequence ``seq_id``, empty or, with ``tokens`` (its prompt's ids), with the leading full pages
        the prefix cache holds for them (by reference). Returns how many leading tokens are cached (a multiple
        of page_size, at most ``len(tokens) - 1``: one token is left to compute); append the rest's K/V."""
        self._check_new("seq_id", seq_id, " (free it first)")
        ids = [] if tokens is None else _token_list("tokens", tokens)
        pages, keys = [], []
        if self._prefix is not None and ids:
            for key in hash_chain(ids, self.page_size, limit=(len(ids) - 1) // self.page_size):
                page = self._prefix.lookup(key)
                if page is None:
                    break
                pages.append(page)
                keys.append(key)
            for page in pages:
                self._retain(page)
        self._seqs[seq_id] = _Seq(pages, len(pages) * self.page_size, self._next_order(), ids, keys)
        return len(pages) * self.page_size

    def allocate(self, seq_id: object, num_tokens: int, tokens: object = None) -> torch.Tensor:
        """Grow a live sequence by ``num_tokens`` slots (pages taken as needed, a shared partial last page
        copied first) and return their ``slot_mapping`` (host int32 ``[num_tokens]``). Their K/V is written
        by the caller (the append kernel); pages they fill join the prefix cache now, so write them before the
        next ``add`` could match them. ``tokens``: their ids, for the prefix cache."""
        n = _positive("num_tokens", num_tokens)
        seq = self._seq(seq_id)
        ids = None if tokens is None else self._new_ids(tokens, n)
        return torch.from_numpy(self._grow(seq_id, seq, n, ids).astype(np.int32))

    def append(self, seq_id: object, k: torch.Tensor, v: torch.Tensor, tokens: object = None) -> None:
        """Write new tokens' K and V (``[n, num_kv_heads, head_dim]``, the cache's dtype and device) at the end
        of a live sequence, taking pages as needed. ``tokens`` (``[n]`` ids) key the pages they fill in the
        prefix cache (a sequence added with its prompt knows those ids already).

        On a GPU pool of fp16/bf16 K/V the write is one ``flashgen.append_kv`` launch; on the CPU a torch
        scatter (``PagePool.write_tokens``), with the same ``slot_mapping``.
        """
        seq = self._seq(seq_id)
        n = self._check_kv(k, v)
        ids = None if tokens is None else self._new_ids(tokens, n)
        slots = self._grow(seq_id, seq, n, ids)
        self._pool.write_tokens(torch.from_numpy(slots).to(self.device), k, v)

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, heads: slice | None = None,
              positions: torch.Tensor | None = None, rope=None) -> None:
        """Write K/V of slots that ``allocate`` handed out: ``k, v [n, kv heads, head_dim]`` into KV heads
        ``heads`` (a slice of ``range(num_kv_heads)``, all when None: a model whose layers share the pool
        writes its layer's heads) at ``slot_mapping [n]`` (int32/int64 on the pool's device; -1 skips a row,
        on the GPU). On a GPU pool of fp16/bf16 K/V it is one ``flashgen.append_kv`` launch, graph-safe and
        without a host sync, that also rotates K at ``positions [n]`` with ``rope`` (a ``flashgen.RoPE``);
        on the CPU a scatter (``rope`` refused: rotate K first). Only shapes are checked: the hot path.

        >>> slots = cache.allocate("a", 3)                                               # doctest: +SKIP
        >>> cache.write(slots.cuda(), k, v, positions=pos, rope=flashgen.RoPE(500000.0))  # doctest: +SKIP
        """
        if heads is None:
            heads = slice(0, self.num_kv_heads)
        if not isinstance(heads, slice) or heads.step not in (None, 1) or not (
                0 <= (heads.start or 0) < (heads.stop if heads.stop is not None else self.num_kv_heads)
                <= self.num_kv_heads):
            raise KVCacheError(f"heads: got {heads!r}, expected a slice start:stop within 0..{self.num_kv_heads}")
        count = len(range(*heads.indices(self.num_kv_heads)))
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != (count, self.head_dim):
                raise KVCacheError(f"{name}: expected a tensor [n, {count}, {self.head_dim}] (the heads written), "
                                   f"got {getattr(t, 'shape', type(t).__name__)}")
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.shape != (k.shape[0],):
            raise KVCacheError(f"slot_mapping: expected a tensor [{k.shape[0]}] (one slot a row of k), got "
                               f"{getattr(slot_mapping, 'shape', type(slot_mapping).__name__)}")
        self._pool.write_tokens(slot_mapping, k, v, heads, positions, rope)

    def first_page(self, seq_id: object) -> int:
        """The first page id of a live sequence (-1 while it has none): the key that puts requests sharing a
        prefix next to each other in a batch (the cascade's derived levels share consecutive requests' pages)."""
        pages = self._seq(seq_id).pages
        return pages[0] if pages else -1

    def _check_new(self, name: str, seq_id: object, hint: str = "") -> None:
        """``KVCacheError`` naming ``name`` unless ``seq_id`` is hashable and not yet in the cache."""
        try:
            hash(seq_id)
        except TypeError:
            raise KVCacheError(f"{name}: {seq_id!r} is not hashable") from None
        if seq_id in self._seqs:
            raise KVCacheError(f"{name}: sequence {seq_id!r} is already in the cache{hint}")

    def fork(self, parent: object, child: object) -> None:
        """Start ``child`` as a copy of live ``parent``: every page shared (refcount + 1, no bytes copied); the
        shared partial last page is copied on the first write of either (copy-on-write)."""
        seq = self._seq(parent, "parent")
        self._check_new("child", child)
        for page in seq.pages:
            self._retain(page)
        self._seqs[child] = _Seq(list(seq.pages), seq.length, self._next_order(), list(seq.tokens), list(seq.keys))

    def free(self, seq_id: object) -> None:
        """Drop a sequence (live or swapped out): its pages lose a reference; keyed pages stay cached."""
        seq = self._seq(seq_id, live=False)
        for page in seq.pages:
            self._release(page)
        del self._seqs[seq_id]
        self._protected.discard(seq_id)

    def truncate(self, seq_id: object, num_tokens: int) -> None:
        """Shorten a live sequence to its first ``num_tokens`` tokens (pages past them lose a reference)."""
        seq = self._seq(seq_id)
        n = _positive("num_tokens", num_tokens, 0)
        if n > seq.length:
            raise KVCacheError(f"num_tokens: got {n}, expected 0..{seq.length} (the length of {seq_id!r})")
        keep = -(-n // self.page_size)
        for page in seq.pages[keep:]:
            self._release(page)
        del seq.pages[keep:]
        seq.length = n
        del seq.tokens[n:]
        del seq.keys[n // self.page_size:]

    def protect(self, seq_id: object, protected: bool = True) -> None:
        """Keep ``seq_id`` from being chosen as a victim by the swap and recompute policies (or allow it again)."""
        self._seq(seq_id, live=False)
        (self._protected.add if protected else self._protected.discard)(seq_id)

    def preempt(self, seq_id: object) -> None:
        """Preempt live ``seq_id`` now, as the ``swap`` policy would (its pages copied to host memory;
        ``resume`` brings them back): for a scheduler whose own victim is the sequence it could not grow.
        Listed in ``preempted``. Only a cache with ``out_of_pages="swap"`` swaps; free the sequence otherwise."""
        self._seq(seq_id)
        if self.out_of_pages != "swap":
            raise KVCacheError(f"seq_id: preempt({seq_id!r}) swaps a sequence out; this cache has out_of_pages="
                               f"{self.out_of_pages!r} (free it and recompute it instead)")
        self._preempt(seq_id)

    def resume(self, seq_id: object) -> None:
        """Bring a swapped-out sequence back: its saved pages are copied into free pages (taken under the
        out-of-pages policy, the sequence protected), byte for byte."""
        seq = self._seq(seq_id, live=False)
        if seq.swapped is None:
            raise KVCacheError(f"seq_id: sequence {seq_id!r} is not swapped out")
        k, v = seq.swapped
        self._reserve(k.shape[0], seq_id, f"resume({seq_id!r})")
        seq.pages = self._pool.take(k.shape[0])
        self._pool.load(seq.pages, k, v)
        seq.swapped = None
        if self._prefix is not None:
            for key, page in zip(seq.keys, seq.pages):
                self._prefix.insert(key, page)

    def evict(self, num_pages: int | None = None) -> int:
        """Free up to ``num_pages`` (all if None) unreferenced prefix-cache pages, least recently released
        first; returns how many were freed. Referenced pages are never evicted."""
        if self._prefix is None:
            return 0
        n = self._prefix.num_unreferenced if num_pages is None else _positive("num_pages", num_pages, 0)
        pages = self._prefix.evict(n)
        for page in pages:
            self._pool.give_back(page)
        return len(pages)

    def take_preempted(self) -> list[Preemption]:
        """The preemptions since the last call (``cache.preempted``), clearing the list."""
        out, self.preempted = self.preempted, []
        return out

    # ------------------------------------------------------------------------------------------ internals

    def _next_order(self) -> int:
        self._added += 1
        return self._added

    def _check_kv(self, k: object, v: object) -> int:
        shape = f"[n, {self.num_kv_heads}, {self.head_dim}]"
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise KVCacheError(f"{name}: expected a tensor {shape}, got {type(t).__name__}")
            if t.dim() != 3 or tuple(t.shape[1:]) != (self.num_kv_heads, self.head_dim) or t.shape[0] < 1:
                raise KVCacheError(f"{name}: expected shape {shape} with n >= 1, got {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise KVCacheError(f"{name}: expected dtype {self.dtype} (the cache's), got {t.dtype}")
            if t.device != self.device:
                raise KVCacheError(f"{name}: expected a tensor on {self.device} (the cache's), got {t.device}")
        if k.shape != v.shape:
            raise KVCacheError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
        return k.shape[0]

    def _new_ids(self, tokens: object, n: int) -> list[int]:
        ids = _token_list("tokens", tokens)
        if len(ids) != n:
            raise KVCacheError(f"tokens: {len(ids)} ids, expected {n} (one per new token)")
        return ids

    def _retain(self, page: int) -> None:
        if self._pool.refcount[page] == 0 and self._prefix is not None:
            self._prefix.referenced(page)
        self._pool.refcount[page] += 1

    def _release(self, page: int) -> None:
        self._pool.refcount[page] -= 1
        if self._pool.refcount[page] == 0 and not (self._prefix is not None and self._prefix.released(page)):
            self._pool.give_back(page)

    def _cow_needed(self, seq: _Seq) -> bool:
        return bool(seq.length % self.page_size) and self._pool.refcount[seq.pages[-1]] > 1

    def _grow(self, seq_id: object, seq: _Seq, n: int, ids: list[int] | None) -> np.ndarray:
        """Make room for ``n`` tokens at the end of ``seq`` (all-or-nothing) and return their slots (int64)."""
        ps, old = self.page_size, seq.length
        new_pages = -(-(old + n) // ps) - len(seq.pages)
        self._reserve(new_pages + self._cow_needed(seq), seq_id, f"append of {n} token(s) to {seq_id!r}")
        if old % ps:  # the partial last page is written: make it private and unkeyed
            last = seq.pages[-1]
            if self._pool.refcount[last] > 1:
                (copy,) = self._pool.take(1)
                self._pool.copy_page(last, copy)
                self._pool.refcount[last] -= 1
                seq.pages[-1] = copy
            elif self._prefix is not None:
                self._prefix.forget(last)
        seq.pages.extend(self._pool.take(new_pages))
        seq.length = old + n
        if ids is not None and len(seq.tokens) >= old:
            seq.tokens[old:] = ids
        self._key_full_pages(seq)
        positions = np.arange(old, old + n)
        return np.asarray(seq.pages, dtype=np.int64)[positions // ps] * ps + positions % ps

    def _key_full_pages(self, seq: _Seq) -> None:
        """Key the sequence's newly filled pages whose token ids are known."""
        if self._prefix is None:
            return
        full = min(seq.length, len(seq.tokens)) // self.page_size
        start = len(seq.keys)
        if full > start:
            keys = hash_chain(seq.tokens, self.page_size, start, seq.keys[-1] if seq.keys else b"", full)
            for i, key in enumerate(keys, start):
                self._prefix.insert(key, seq.pages[i])
            seq.keys.extend(keys)

    def _reserve(self, need: int, seq_id: object, what: str) -> None:
        """Make ``need`` pages free under the out-of-pages policy, or raise ``OutOfPages`` having changed
        nothing. ``seq_id`` is protected."""
        free = self._pool.num_free
        if need <= free:
            return
        cached = self._prefix.num_unreferenced if self._prefix else 0
        candidates = []
        if self.out_of_pages in ("swap", "recompute") and need > free + cached:
            candidates = sorted(((s.order, sid, s.pages) for sid, s in self._seqs.items()
                                 if s.swapped is None and sid != seq_id and sid not in self._protected),
                                key=lambda c: -c[0])
        victims = plan_victims(what, need, free, cached, self.out_of_pages, [(sid, p) for _, sid, p in candidates],
                               self._pool.refcount)
        for victim in victims:
            self._preempt(victim)
        if need > self._pool.num_free:
            self.evict(need - self._pool.num_free)

    def _preempt(self, seq_id: object) -> None:
        seq = self._seqs[seq_id]
        if self.out_of_pages == "swap":
            seq.swapped = self._pool.save(seq.pages)
        for page in seq.pages:
            self._release(page)
        seq.pages = []
        self.preempted.append(Preemption(seq_id, self.out_of_pages, seq.length))
        if self.out_of_pages == "recompute":
            del self._seqs[seq_id]
            self._protected.discard(seq_id)
