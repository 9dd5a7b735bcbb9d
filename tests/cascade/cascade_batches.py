"""Batches whose requests share pages along a random prefix tree, for the cascade tests (CPU and GPU): page lists,
their CSR table, and a paged cache whose slots no request uses hold NaN."""

from __future__ import annotations

import numpy as np
import torch


def tree_pages(rng: np.random.Generator, batch: int, depth: int, *, max_prefix: int = 3,
               max_suffix: int = 3) -> list[list[int]]:
    """Page lists of ``batch`` consecutive requests sharing prefixes along a random tree of ``depth`` branchings:
    each node has up to ``max_prefix`` pages of its own (fresh ids, so sharing is exactly the tree's), each request
    up to ``max_suffix`` pages of its own. Page ids are shuffled over the pool."""
    counter = [0]

    def fresh(n: int) -> list[int]:
        counter[0] += n
        return list(range(counter[0] - n, counter[0]))

    def grow(n: int, level: int) -> list[list[int]]:
        if n == 1 or level == depth:
            return [fresh(int(rng.integers(0, max_suffix + 1))) for _ in range(n)]
        prefix = fresh(int(rng.integers(0, max_prefix + 1)))
        cuts = sorted(rng.choice(np.arange(1, n), size=int(rng.integers(0, min(n - 1, 3) + 1)), replace=False).tolist())
        lists = []
        for a, b in zip([0] + cuts, cuts + [n]):
            lists += [prefix + rest for rest in grow(b - a, level + 1)]
        return lists

    lists = grow(batch, 0)
    perm = rng.permutation(max(counter[0], 1))
    return [[int(perm[p]) for p in pages] for pages in lists]


def last_page_lens(rng: np.random.Generator, lists: list[list[int]], page_size: int) -> np.ndarray:
    """``kv_last_page_len``: a request's last page is partial (random length) only where no other request holds it."""
    held: dict[int, int] = {}
    for pages in lists:
        for p in pages:
            held[p] = held.get(p, 0) + 1
    return np.array([0 if not pages else page_size if held[pages[-1]] > 1 else int(rng.integers(1, page_size + 1))
                     for pages in lists], np.int32)


def csr(lists: list[list[int]], last: np.ndarray) -> dict:
    """The CSR page table (host int32 arrays) of ``lists``."""
    indptr = np.zeros(len(lists) + 1, np.int32)
    np.cumsum([len(p) for p in lists], out=indptr[1:])
    indices = np.array([p for pages in lists for p in pages], np.int32)
    return {"kv_indptr": indptr, "kv_indices": indices, "kv_last_page_len": np.asarray(last, np.int32)}


def request_tokens(pages: list[int], last: int, page_size: int) -> list[tuple[int, int]]:
    """(page, slot) of each of a request's tokens, in order."""
    return [(p, s) for i, p in enumerate(pages) for s in range(page_size if i < len(pages) - 1 else last)]


def shared_cache(lists, last, page_size: int, num_kv_heads: int, head_dim: int, dtype, *, order: str = "NHD",
                 spare_pages: int = 2, generator: torch.Generator | None = None):
    """``(k, v)`` pages ``[num_pages, page_size, num_kv_heads, head_dim]`` (HND: heads before tokens), random where
    a request reads and NaN elsewhere (spare pages, the tail of every page past its longest use)."""
    num_pages = max((p for pages in lists for p in pages), default=-1) + 1 + spare_pages
    used = np.zeros(num_pages, np.int64)
    for pages, n in zip(lists, last):
        for i, p in enumerate(pages):
            used[p] = max(used[p], page_size if i < len(pages) - 1 else int(n))
    caches = []
    for _ in range(2):
        x = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
        x[torch.arange(page_size)[None, :] >= torch.from_numpy(used)[:, None]] = float("nan")
        x = x.to(dtype)
        caches.append(x.transpose(1, 2).contiguous() if order == "HND" else x)
    return tuple(caches)
