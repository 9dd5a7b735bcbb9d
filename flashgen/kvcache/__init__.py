"""The paged KV-cache manager: ``PagedKVCache`` (manager.py) over a page pool (pool.py), a hashed prefix cache
(prefix.py), out-of-pages policies (policy.py), and the page tables and write coordinates it hands out
(tables.py). Host logic: it works on a CPU pool as on a GPU one."""

from .manager import CacheStats, KVCacheError, PagedKVCache
from .policy import POLICIES, OutOfPages, Preemption
from .tables import PageTables, WriteCoords

__all__ = ["CacheStats", "KVCacheError", "OutOfPages", "POLICIES", "PagedKVCache", "PageTables", "Preemption",
           "WriteCoords"]
