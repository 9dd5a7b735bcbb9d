"""Write build.ninja for one kernel and run ninja to produce its cubin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .. import knobs
from .toolchain import Nvcc

SOURCE = "kernel.cu"
CUBIN = "kernel.cubin"
RESOURCE_LOG = "ptxas.log"


class CompileError(RuntimeError):
    """nvcc failed. ``log`` holds its output; ``source`` the path of the source it compiled."""

    def __init__(self, message: str, log: str, source: Path):
        super().__init__(message)
        self.log = log
        self.source = source


def nvcc_flags(arch: str) -> list[str]:
    """The compile's flags; all of them go into the cache key. The include path is added at build time
    (the header tree's contents are hashed instead, so the key does not depend on where flashgen lives)."""
    return [
        "-cubin",
        f"-arch={arch}",
        "-O3",
        "-std=c++17",
        "-lineinfo",
        "--expt-relaxed-constexpr",
        "-Xptxas=-v",
        f"--threads={knobs.nvcc_threads()}",
    ]


def _quote(text: str) -> str:
    return text.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def write_build_ninja(build_dir: Path, nvcc: Nvcc, flags: list[str], include_dir: Path) -> Path:
    # ptxas -v prints the resource report on stderr: keep it beside the cubin
    text = (
        "ninja_required_version = 1.3\n"
        f"nvcc = {_quote(str(nvcc.path))}\n"
        f"flags = {' '.join(_quote(f) for f in [*flags, f'-I{include_dir}'])}\n\n"
        "rule nvcc_cubin\n"
        f"  command = $nvcc $flags -o $out $in 2> {RESOURCE_LOG} || (cat {RESOURCE_LOG} >&2; exit 1)\n"
        "  description = nvcc $out\n\n"
        f"build {CUBIN}: nvcc_cubin {SOURCE}\n"
    )
    path = build_dir / "build.ninja"
    path.write_text(text)
    return path


def ninja_binary() -> str:
    try:
        import ninja

        return os.path.join(ninja.BIN_DIR, "ninja")
    except (ImportError, AttributeError):
        return "ninja"


def run_ninja(build_dir: Path, uri: str) -> None:
    """Build ``kernel.cubin`` in ``build_dir``; raise ``CompileError`` with nvcc's log on failure."""
    proc = subprocess.run([ninja_binary(), "-C", str(build_dir)], capture_output=True, text=True)
    if proc.returncode != 0:
        log = (proc.stdout + proc.stderr).strip()
        raise CompileError(
            f"nvcc failed for {uri}; source: {build_dir / SOURCE}\n{log}", log=log, source=build_dir / SOURCE
        )
    if knobs.verbose():
        print(f"flashgen: built {uri} in {build_dir}", file=sys.stderr)
