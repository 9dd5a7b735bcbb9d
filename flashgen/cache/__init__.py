"""Leaf service: the kernel cache directory (key, entries, locks, verify, clean)."""

from .key import KeyInputs, kernel_key, read_header_tree
from . import index
from .store import MANIFEST, CacheError, CacheStore, Entry, read_entry

__all__ = ["KeyInputs", "kernel_key", "read_header_tree", "MANIFEST", "CacheError", "CacheStore", "Entry", "read_entry", "index"]
