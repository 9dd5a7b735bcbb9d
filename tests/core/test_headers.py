"""The device headers under templates/include/flashgen: each compiles alone (a translation unit that includes only
it: it includes what it uses), none is over 500 lines, and the kernel templates include headers that exist.
Hopper headers (sm90/) compile for sm_90a, the portable ones for sm_80."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from compile_checks import WORKERS

INCLUDE = Path(__file__).resolve().parents[2] / "templates" / "include"
HEADERS = sorted(p.relative_to(INCLUDE).as_posix() for p in (INCLUDE / "flashgen").rglob("*.cuh"))
MAX_LINES = 500


def nvcc() -> str:
    home = os.environ.get("CUDA_HOME")
    for candidate in ([str(Path(home) / "bin" / "nvcc")] if home else []) + [shutil.which("nvcc") or "",
                                                                                  "/usr/local/cuda/bin/nvcc"]:
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.skip("needs nvcc")


def test_headers_are_found():
    assert "flashgen/common/mma.cuh" in HEADERS and "flashgen/sm90/kernel.cuh" in HEADERS, HEADERS


@pytest.mark.parametrize("header", HEADERS)
def test_header_is_short_and_guarded(header):
    text = (INCLUDE / header).read_text()
    assert len(text.splitlines()) <= MAX_LINES, f"{header}: {len(text.splitlines())} lines (at most {MAX_LINES})"
    assert "#pragma once" in text, f"{header} has no #pragma once"


def test_templates_include_existing_headers():
    for template in sorted(INCLUDE.parent.glob("*.j2")):
        for name in re.findall(r"#include <(flashgen/[^>]+)>", template.read_text()):
            assert (INCLUDE / name).is_file(), f"{template.name} includes {name}, which does not exist"


def _compile_alone(folder: Path, header: str) -> str:
    """nvcc's complaint when ``header`` does not compile as the only include of a translation unit, else ''."""
    arch = "sm_90a" if header.startswith("flashgen/sm90/") else "sm_80"
    folder.mkdir(parents=True)
    source = folder / "alone.cu"
    source.write_text(f"#include <{header}>\n")
    cmd = [nvcc(), "-cubin", f"-arch={arch}", "-std=c++17", "--expt-relaxed-constexpr", f"-I{INCLUDE}",
           "-o", str(folder / "alone.cubin"), str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return "" if done.returncode == 0 else f"{header} does not compile alone ({arch}):\n{done.stderr[-4000:]}"


@pytest.fixture(scope="module")
def compiled_alone(tmp_path_factory):
    """header -> nvcc's complaint ('' when it compiles), every header compiled at once (one nvcc per core)."""
    base = tmp_path_factory.mktemp("alone")
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        return dict(zip(HEADERS, pool.map(lambda item: _compile_alone(base / str(item[0]), item[1]),
                                          enumerate(HEADERS))))


@pytest.mark.nvcc
@pytest.mark.parametrize("header", HEADERS)
def test_header_compiles_alone(compiled_alone, header):
    assert not compiled_alone[header], compiled_alone[header]
