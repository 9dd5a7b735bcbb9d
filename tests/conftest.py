"""Shared test setup: the `cuda` marker skips without a GPU, the `hopper` marker without one of compute
capability 9.0 (sm_90a kernels), the `nvcc` marker without nvcc. A test that builds into or inspects the
cache takes a private one (`cache_dir`); compile-only tests share one per session (`shared_cache`), so a
kernel that several of them check is compiled once."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _has_nvcc() -> bool:
    try:
        from flashgen.compile import find_nvcc

        find_nvcc()
        return True
    except Exception:
        return False


def _is_hopper() -> bool:
    if not HAS_GPU:
        return False
    import torch

    return torch.cuda.get_device_capability() == (9, 0)


ROOT = Path(__file__).resolve().parents[1]
HAS_GPU = _has_gpu()
HAS_NVCC = _has_nvcc()
IS_HOPPER = _is_hopper()

if not HAS_GPU and "OMP_NUM_THREADS" not in os.environ:
    # CPU runs (CI: two cores, shared) compute small fp64 references, where torch's second OpenMP thread buys
    # nothing and, spinning for a core another process holds, made the CPU executor tests 4x slower
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU")
    skip_nvcc = pytest.mark.skip(reason="needs nvcc")
    skip_hopper = pytest.mark.skip(reason="needs a Hopper GPU (sm_90a)")
    for item in items:
        if "cuda" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        elif "hopper" in item.keywords and not IS_HOPPER:
            item.add_marker(skip_hopper)
        if "nvcc" in item.keywords and not HAS_NVCC:
            item.add_marker(skip_nvcc)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private, empty writable cache for one test."""
    path = tmp_path / "cache"
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(path))
    monkeypatch.delenv("FLASHGEN_EXTRA_CACHE_DIRS", raising=False)
    monkeypatch.delenv("FLASHGEN_DISABLE_JIT", raising=False)
    return path


def pytest_sessionstart(session):
    """Load the native planner (building it on a miss) in the environment's cache, once: a test's first plan
    would otherwise build it into whatever private cache that test has set (tests/plan/test_plan_native.py)."""
    from flashgen.plan import native

    native.planner()


def pytest_collection_finish(session):
    """Start compiling the selected compile tests' kernels in the background (tests/compile_checks.py)."""
    session.config.kernel_cache = Path(tempfile.mkdtemp(prefix="flashgen-kernel-cache-"))
    session.config.prefetcher = None
    import compile_checks

    modules = {item.module.__name__ for item in session.items
               if "nvcc" in item.keywords and getattr(item, "module", None) is not None}
    jobs = [job for module, job in compile_checks.PREFETCH if module in modules]
    if not (HAS_NVCC and jobs):
        return
    jobs_file = session.config.kernel_cache / "prefetch.json"
    jobs_file.write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # its own process group (killed whole at the end), in this session: a new session would be a new
    # scheduler autogroup, where its lower priority would not count against the tests'
    session.config.prefetcher = subprocess.Popen(
        [sys.executable, compile_checks.__file__, str(jobs_file), str(session.config.kernel_cache)], env=env,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=os.setpgrp)


def pytest_sessionfinish(session):
    prefetcher = getattr(session.config, "prefetcher", None)
    if prefetcher is not None and prefetcher.poll() is None:
        os.killpg(prefetcher.pid, signal.SIGKILL)  # with its nvcc
        prefetcher.wait()
    if getattr(session.config, "kernel_cache", None) is not None:
        shutil.rmtree(session.config.kernel_cache, ignore_errors=True)


@pytest.fixture(scope="session")
def kernel_cache(pytestconfig):
    """The session's shared kernel cache folder (see `shared_cache`), which the prefetcher fills."""
    return pytestconfig.kernel_cache


@pytest.fixture
def shared_cache(kernel_cache, monkeypatch):
    """The session's shared kernel cache as this test's writable cache: for tests that only check what a kernel
    compiles to (tests/compile_checks.py: build_all, seed)."""
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(kernel_cache))
    monkeypatch.delenv("FLASHGEN_EXTRA_CACHE_DIRS", raising=False)
    monkeypatch.delenv("FLASHGEN_DISABLE_JIT", raising=False)
    return kernel_cache


@pytest.fixture(scope="session")
def gpu_cache_dir(tmp_path_factory):
    """One cache shared by the GPU tests of a session (kernels compile once)."""
    path = tmp_path_factory.mktemp("gpu-cache")
    yield path
    shutil.rmtree(path, ignore_errors=True)
