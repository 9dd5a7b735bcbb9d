"""Shared checks of the compile-only tests: build variants in parallel, read ptxas's resource report, and copy
kernels compiled once per session into a test's private cache."""

from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flashgen import jit
from flashgen.cache import CacheStore

WORKERS = max(2, os.cpu_count() or 1)  # nvcc is one thread: one compile per core


def build_all(jobs: list[tuple[str, object, str]], workers: int = WORKERS, options: dict | None = None,
              cache: Path | None = None) -> list[tuple[object, str]]:
    """Compile ``(op, spec, arch)`` jobs into ``cache`` (default: the current cache) with the family's kernel
    ``options``; returns ``(entry, ptxas report)`` per job."""
    store = CacheStore(cache) if cache is not None else None

    def one(job):
        op, spec, arch = job
        entry = jit.ensure_compiled(spec, op, arch, store, options=options)
        return entry, (entry.path / "ptxas.log").read_text()

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, jobs))


def seed(cache: Path, kernel_cache: Path, jobs: list[tuple[str, object, str]]) -> list[object]:
    """Copy the entries of ``(op, spec, arch)`` jobs into ``cache``, compiling them once per session in
    ``kernel_cache`` (the `kernel_cache` fixture); returns the copies' entries, read back from ``cache``."""
    from flashgen.cache import read_entry

    copies = []
    for entry, _ in build_all(jobs, cache=kernel_cache):
        target = cache / entry.path.parent.name / entry.path.name
        if not target.exists():
            shutil.copytree(entry.path, target)
        copies.append(read_entry(target)[0])
    return copies


def assert_sound_cubin(entry, report: str, entry_points: list[str], label: str = "") -> None:
    """An ELF cubin with the expected entry points and no register spills (stores or loads)."""
    assert entry.cubin[:4] == b"\x7fELF", entry.uri
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), f"{entry.uri} {label} spills registers: {report}"
    assert entry.manifest["entry_points"] == entry_points, entry.manifest["entry_points"]
