"""Shared checks of the compile-only tests: build variants in parallel and read ptxas's resource report."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from flashgen import jit


def build_all(jobs: list[tuple[str, object, str]], workers: int = 2,
              options: dict | None = None) -> list[tuple[object, str]]:
    """Compile ``(op, spec, arch)`` jobs into the current cache (with the family's kernel ``options``);
    returns ``(entry, ptxas report)`` per job."""
    def one(job):
        op, spec, arch = job
        entry = jit.ensure_compiled(spec, op, arch, options=options)
        return entry, (entry.path / "ptxas.log").read_text()

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, jobs))


def assert_sound_cubin(entry, report: str, entry_points: list[str], label: str = "") -> None:
    """An ELF cubin with the expected entry points and no register spills (stores or loads)."""
    assert entry.cubin[:4] == b"\x7fELF", entry.uri
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), f"{entry.uri} {label} spills registers: {report}"
    assert entry.manifest["entry_points"] == entry_points, entry.manifest["entry_points"]
