"""Shared checks of the compile-only tests: build variants in parallel, read ptxas's resource report, copy
kernels compiled once per session into a test's private cache, and compile a session's kernels ahead of the
tests that check them.

Ahead of time: a compile test module lists its kernels with ``prefetch`` when it is imported; after
collection, conftest starts one background process (``python compile_checks.py JOBS CACHE``, at a lower
priority) that compiles the listed kernels of the selected modules into the session's shared cache, in
test order. It runs on the core the CPU tests leave idle; a test that reaches a kernel first compiles it
itself (the entry lock keeps it to one compile), and a failed build is left to the test to report.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flashgen import jit
from flashgen.cache import CacheStore, read_entry
from flashgen.spec import spec_from_dict, spec_to_dict

WORKERS = max(2, os.cpu_count() or 1)  # nvcc is one thread: one compile per core
PREFETCH: list[tuple[str, dict]] = []  # (module name, job) in import order


def prefetch(module: str, jobs: list[tuple[str, object, str]], options: dict | None = None) -> None:
    """Ask for ``(op, spec, arch)`` jobs to be compiled into the shared cache ahead of ``module``'s tests."""
    PREFETCH.extend((module, {"op": op, "spec": spec_to_dict(spec), "arch": arch, "options": options})
                    for op, spec, arch in jobs)


def _prefetch_main(jobs_file: str, cache: str) -> int:
    os.nice(10)  # the tests in the foreground come first
    store = CacheStore(Path(cache))
    for job in json.loads(Path(jobs_file).read_text()):
        try:
            jit.ensure_compiled(spec_from_dict(job["spec"]), job["op"], job["arch"], store, job["options"])
        except Exception:  # noqa: BLE001 - the test that needs the kernel builds it again and reports
            pass
    return 0


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
    copies = []
    for entry, _ in build_all(jobs, cache=kernel_cache):
        target = cache / entry.path.parent.name / entry.path.name
        if not target.exists():
            shutil.copytree(entry.path, target)
        copies.append(read_entry(target)[0])
    return copies


def seed_planner(cache: Path) -> bool:
    """Copy the session's native planner (tests/conftest.py loads it) into ``cache``, so that ``flashgen build``
    there finds it rather than compiling it again; False (nothing copied) where it did not load."""
    from flashgen.plan import native

    entry = native.entry()
    if entry is None:
        return False
    target = cache / entry.path.parent.name / entry.path.name
    if not target.exists():
        shutil.copytree(entry.path, target)
    return True


def assert_sound_cubin(entry, report: str, entry_points: list[str], label: str = "") -> None:
    """An ELF cubin with the expected entry points and no register spills (stores or loads)."""
    assert entry.cubin[:4] == b"\x7fELF", entry.uri
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), f"{entry.uri} {label} spills registers: {report}"
    assert entry.manifest["entry_points"] == entry_points, entry.manifest["entry_points"]


if __name__ == "__main__":
    sys.exit(_prefetch_main(*sys.argv[1:]))
