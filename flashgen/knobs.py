"""Every environment variable flashgen reads, declared once and typed.

Read at call time (not import time) so tests can scope them with ``monkeypatch.setenv``. None of them
shapes a kernel: a kernel-shaping choice is a family option that enters the kernel's uri and key
(``BatchPrefillWrapper(spec, kernel_options={"tiles": "kv32"})``).

| variable | meaning |
|---|---|
| ``FLASHGEN_CACHE_DIR`` | the writable kernel cache (default ``~/.cache/flashgen``) |
| ``FLASHGEN_EXTRA_CACHE_DIRS`` | read-only caches searched first, ``os.pathsep``-separated (AOT caches shipped with a deployment) |
| ``FLASHGEN_CUDA_ARCH`` | target arch (``sm_90a``, ``90a``, ``9.0a``), overriding the GPU's own |
| ``FLASHGEN_DISABLE_JIT`` | ``1``: a cache miss raises ``MissingKernelError`` instead of compiling |
| ``FLASHGEN_NVCC_THREADS`` | ``nvcc --threads`` value (default 1) |
| ``FLASHGEN_VERBOSE`` | ``1``: print each compile and its time to stderr |
| ``FLASHGEN_CHECK_INDICES`` | ``1``: the wrappers' ``check_indices`` defaults to on (device page ids checked at plan; syncs) |
| ``CUDA_HOME`` / ``CUDA_PATH`` | the toolkit: ``bin/nvcc`` under it is used, and it is an error if it has none |
"""

from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    value = os.environ.get("FLASHGEN_CACHE_DIR")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "flashgen"


def extra_cache_dirs() -> list[Path]:
    value = os.environ.get("FLASHGEN_EXTRA_CACHE_DIRS", "")
    return [Path(p).expanduser() for p in value.split(os.pathsep) if p.strip()]


def cuda_arch() -> str | None:
    value = os.environ.get("FLASHGEN_CUDA_ARCH", "").strip()
    return value or None


def disable_jit() -> bool:
    return _flag("FLASHGEN_DISABLE_JIT")


def nvcc_threads() -> int:
    return int(os.environ.get("FLASHGEN_NVCC_THREADS", "1"))


def verbose() -> bool:
    return _flag("FLASHGEN_VERBOSE")


def check_indices() -> bool:
    return _flag("FLASHGEN_CHECK_INDICES")


def cuda_home() -> tuple[str, Path | None]:
    """(the variable that names the toolkit, its folder): ``CUDA_HOME``, else ``CUDA_PATH``; (``""``, None)
    when neither is set."""
    for name in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(name, "").strip()
        if value:
            return name, Path(value).expanduser()
    return "", None
