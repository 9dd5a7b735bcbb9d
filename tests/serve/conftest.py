"""Fixtures shared by the serving-loop tests."""

import pytest
import torch

from flashgen.kvcache import PagedKVCache


@pytest.fixture
def shared_prefix_cache() -> PagedKVCache:
    """A bf16 pool of 64 pages of 4 tokens (2 kv heads, d64): requests 0-2 share a 9-token prompt and end in a
    token of their own (10 tokens, 3 pages each, the first 2 shared), request 5 holds 7 tokens of its own."""
    cache = PagedKVCache(64, 4, 2, 64, torch.bfloat16, kv_form="pair")
    prompt = list(range(1, 10))
    for rid in range(3):
        cache.add(rid, tokens=prompt + [20 + rid])
        cache.allocate(rid, 10, tokens=prompt + [20 + rid])
    cache.add(5)
    cache.allocate(5, 7)
    return cache
