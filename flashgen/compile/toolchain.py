"""The CUDA toolchain: find nvcc, read its version, choose the target arch."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .. import knobs


class ToolchainError(RuntimeError):
    """nvcc is missing or unusable, or no target arch can be chosen."""


@dataclass(frozen=True)
class Nvcc:
    path: Path
    version: str  # e.g. "13.0.88"
    banner: str  # the whole `nvcc --version` output, hashed into the cache key


def _candidates() -> list[Path]:
    """Where nvcc is looked for when neither CUDA_HOME nor CUDA_PATH is set."""
    found = []
    which = shutil.which("nvcc")
    if which:
        found.append(Path(which))
    found.append(Path("/usr/local/cuda/bin/nvcc"))
    return found


@functools.lru_cache(maxsize=None)
def _probe(path: str) -> Nvcc:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ToolchainError(f"nvcc at {path} does not run: {exc}") from exc
    match = re.search(r"V(\d+\.\d+\.\d+)", out) or re.search(r"release (\d+\.\d+)", out)
    if not match:
        raise ToolchainError(f"cannot read the version of nvcc at {path} from: {out.strip()!r}")
    return Nvcc(Path(path), match.group(1), out.strip())


def nvcc_identity() -> str:
    """The nvcc ``find_nvcc`` would run, as its path, size and modification time, without running it (a stat);
    "" when there is none. A new toolkit changes it: the cache's lookup index keys hits by it."""
    variable, home = knobs.cuda_home()
    for path in [home / "bin" / "nvcc"] if home is not None else _candidates():
        try:
            stat = os.stat(path)
        except OSError:
            continue
        return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"
    return ""


def find_nvcc() -> Nvcc:
    """The nvcc to use: ``$CUDA_HOME/bin/nvcc`` (``CUDA_PATH`` if ``CUDA_HOME`` is unset) when set, and an
    error if that toolkit has no nvcc (never a silent fall back to another toolkit); else ``nvcc`` on PATH,
    then ``/usr/local/cuda/bin/nvcc``."""
    variable, home = knobs.cuda_home()
    if home is not None:
        nvcc = home / "bin" / "nvcc"
        if not nvcc.is_file():
            raise ToolchainError(
                f"{variable}={home} has no nvcc: looked for {nvcc}; point {variable} at a CUDA toolkit folder "
                f"(the one holding bin/nvcc), or unset it to use nvcc from PATH"
            )
        return _probe(str(nvcc))
    for candidate in _candidates():
        if candidate.is_file():
            return _probe(str(candidate))
    raise ToolchainError(
        "nvcc not found: install the CUDA toolkit and set CUDA_HOME (looked in "
        + ", ".join(str(c) for c in _candidates())
        + ")"
    )


def normalize_arch(arch: str) -> str:
    """``"sm_90a"``, ``"90a"``, ``"9.0a"``, ``"sm90a"`` -> ``"sm_90a"``."""
    text = arch.strip().lower().removeprefix("sm_").removeprefix("sm").removeprefix("compute_")
    match = re.fullmatch(r"(\d+)\.?(\d)([af]?)", text)
    if not match:
        raise ToolchainError(f"arch: got {arch!r}, expected a CUDA arch such as sm_90a, sm_80 or 9.0a")
    return f"sm_{match.group(1)}{match.group(2)}{match.group(3)}"


def device_arch(device: int | None = None) -> str | None:
    """The arch of a visible GPU (``sm_90a`` on Hopper, ``sm_100a`` on Blackwell), or None without one."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    suffix = "a" if major >= 9 else ""  # arch-specific features (wgmma, TMA multicast) need the "a" target
    return f"sm_{major}{minor}{suffix}"


def choose_arch(arch: str | None = None, device: int | None = None) -> str:
    """The target arch: the explicit argument, else ``FLASHGEN_CUDA_ARCH``, else the GPU's own."""
    chosen = arch or knobs.cuda_arch() or device_arch(device)
    if chosen is None:
        raise ToolchainError("no GPU is visible: pass an explicit arch (e.g. arch='sm_90a') or set FLASHGEN_CUDA_ARCH")
    return normalize_arch(chosen)
