"""Write build.ninja for one kernel and run ninja to produce its cubin."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from .. import knobs
from .toolchain import Nvcc

SOURCE = "kernel.cu"
PTX = "kernel.ptx"  # the PTX, its line table's file names made independent of the build folder
RAW_PTX = "kernel.raw.ptx"  # nvcc's own PTX (absolute paths); both PTX files are deleted after the build
CUBIN = "kernel.cubin"
RESOURCE_LOG = "ptxas.log"
FRONT_END_LOG = "nvcc.log"
SOURCE_MTIME = 0  # ptxas records the source's mtime in the line table: a fixed one keeps builds reproducible


class CompileError(RuntimeError):
    """nvcc failed. ``log`` holds its output; ``source`` the path of the source it compiled."""

    def __init__(self, message: str, log: str, source: Path):
        super().__init__(message)
        self.log = log
        self.source = source


def ptx_flags(arch: str) -> list[str]:
    """Source -> PTX. cicc hashes the source's path into the names of internal symbols (kept in the line
    table): naming it ``kernel.cu`` keeps the hash the same in every build folder."""
    return [
        "-ptx",
        f"-arch={arch}",
        "-O3",
        "-std=c++17",
        "-lineinfo",
        "--expt-relaxed-constexpr",
        f"-Xcicc=--orig_src_path_name={SOURCE}",
        f"--threads={knobs.nvcc_threads()}",
    ]


def cubin_flags(arch: str) -> list[str]:
    """PTX -> cubin (ptxas, as ``nvcc -cubin`` from the source would run it; ``-v``: the resource report)."""
    return ["-cubin", f"-arch={arch}", "-lineinfo", "-Xptxas=-v"]


def nvcc_flags(arch: str) -> list[str]:
    """Every flag of the compile (both steps); all of them go into the cache key. The include path is added
    at build time (the header tree's contents are hashed instead, so the key does not depend on where
    flashgen lives)."""
    return [*ptx_flags(arch), *cubin_flags(arch)]


def _arg(text: str) -> str:
    """One shell word in a ninja variable (ninja reads ``$`` as its escape)."""
    return shlex.quote(text).replace("$", "$$")


def write_source(build_dir: Path, source: str) -> Path:
    path = build_dir / SOURCE
    path.write_text(source)
    os.utime(path, (SOURCE_MTIME, SOURCE_MTIME))
    return path


def write_build_ninja(build_dir: Path, nvcc: Nvcc, arch: str, include_dir: Path) -> Path:
    """Three steps, run in ``build_dir``: nvcc to PTX, relative file names in its line table (ptx_lines.py),
    nvcc (ptxas) to the cubin. The cubin's bytes depend on the key's inputs only, not on the folders."""
    # ptxas -v prints the resource report on stderr: keep it beside the cubin
    include = _arg(str(include_dir))
    text = (
        "ninja_required_version = 1.3\n"
        f"nvcc = {_arg(str(nvcc.path))}\n"
        f"python = {_arg(sys.executable)}\n"
        f"ptx_lines = {_arg(str(Path(__file__).with_name('ptx_lines.py')))}\n"
        f"include_dir = {include}\n"
        f"ptx_flags = {' '.join(_arg(f) for f in ptx_flags(arch))} -I$include_dir\n"
        f"cubin_flags = {' '.join(_arg(f) for f in cubin_flags(arch))}\n\n"
        "rule nvcc_ptx\n"
        f"  command = $nvcc $ptx_flags -o $out $in 2> {FRONT_END_LOG} || (cat {FRONT_END_LOG} >&2; exit 1)\n"
        "  description = nvcc $out\n\n"
        "rule ptx_lines\n"
        "  command = $python $ptx_lines $in $out $include_dir\n"
        "  description = line table file names of $out\n\n"
        "rule nvcc_cubin\n"
        f"  command = $nvcc $cubin_flags -o $out $in 2> {RESOURCE_LOG} || (cat {RESOURCE_LOG} >&2; exit 1)\n"
        "  description = ptxas $out\n\n"
        f"build {RAW_PTX}: nvcc_ptx {SOURCE}\n"
        f"build {PTX}: ptx_lines {RAW_PTX}\n"
        f"build {CUBIN}: nvcc_cubin {PTX}\n"
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
    for ptx in (RAW_PTX, PTX):  # larger than the cubin; the PTX a profiler shows is in the cubin (-lineinfo)
        (build_dir / ptx).unlink(missing_ok=True)
    if knobs.verbose():
        print(f"flashgen: built {uri} in {build_dir}", file=sys.stderr)
