"""Shared test setup: the `cuda` marker skips without a GPU, the `hopper` marker without one of compute
capability 9.0 (sm_90a kernels), the `nvcc` marker without nvcc; every test gets a private kernel cache."""

from __future__ import annotations

import shutil

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


HAS_GPU = _has_gpu()
HAS_NVCC = _has_nvcc()
IS_HOPPER = _is_hopper()


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


@pytest.fixture(scope="session")
def gpu_cache_dir(tmp_path_factory):
    """One cache shared by the GPU tests of a session (kernels compile once)."""
    path = tmp_path_factory.mktemp("gpu-cache")
    yield path
    shutil.rmtree(path, ignore_errors=True)
