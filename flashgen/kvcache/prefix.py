"""The prefix cache: full pages keyed by a hash chain of their token ids, and an LRU of unreferenced ones.

Page ``i`` of a sequence whose token ids are known is keyed by ``h_i = blake2b(h_{i-1} || tokens of page i)``
(``h_{-1}`` empty): equal keys mean equal token prefixes, so a new sequence whose prompt starts with cached
pages takes them by reference instead of recomputing their K/V. A cached page whose refcount drops to 0 stays
here (in LRU order, least recently released first) until it is evicted or referenced again; a referenced page
is never evicted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a full page: a 16-byte digest of the parent page's key and this page's token ids.

    >>> block_hash(b"", [1, 2]) == block_hash(b"", [1, 2]) != block_hash(block_hash(b"", [0]), [1, 2])
    True
    """
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def hash_chain(tokens: list[int], page_size: int, start: int = 0, parent: bytes = b"",
               limit: int | None = None) -> list[bytes]:
    """Keys of the full pages ``start, start + 1, ...`` of ``tokens`` (up to ``limit`` pages), chained from
    ``parent`` (the key of page ``start - 1``)."""
    out = []
    end = len(tokens) // page_size if limit is None else min(len(tokens) // page_size, limit)
    for i in range(start, end):
        parent = block_hash(parent, tokens[i * page_size:(i + 1) * page_size])
        out.append(parent)
    return out


class PrefixCache:
    """Key -> page for registered full pages, and the LRU of those with no reference."""

    def __init__(self) -> None:
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._key_of)

    @property
    def num_unreferenced(self) -> int:
        return len(self._lru)

    def unreferenced(self) -> list[int]:
        """Cached pages with refcount 0, least recently released first."""
        return list(self._lru)

    def lookup(self, key: bytes) -> int | None:
        return self._page_of.get(key)

    def is_cached(self, page: int) -> bool:
        return page in self._key_of

    def insert(self, key: bytes, page: int) -> None:
        """Key a referenced full page; a key already held by another page keeps that page."""
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key] = page
            self._key_of[page] = key

    def forget(self, page: int) -> None:
        """Drop a page's key (its bytes are about to change, or it is evicted)."""
        key = self._key_of.pop(page, None)
        if key is not None:
            del self._page_of[key]
        self._lru.pop(page, None)

    def released(self, page: int) -> bool:
        """A page's refcount fell to 0: keep it (True) if it is keyed, else the caller frees it."""
        if page in self._key_of:
            self._lru[page] = None
            return True
        return False

    def referenced(self, page: int) -> None:
        """A cached page was taken again: it leaves the LRU."""
        self._lru.pop(page, None)

    def evict(self, n: int) -> list[int]:
        """Forget the ``n`` least recently released unreferenced pages and return them (to be freed)."""
        pages = []
        for _ in range(min(n, len(self._lru))):
            page, _ = self._lru.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            pages.append(page)
        return pages
