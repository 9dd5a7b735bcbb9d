"""The cache's lookup index: a hit loads the entry without rendering or running nvcc; a miss, a stale record
or changed sources take the render-and-key path and record the index again (nvcc, no GPU)."""

from __future__ import annotations

import json
import shutil

import pytest

from compile_checks import prefetch, seed
from flashgen import jit
from flashgen.cache import index
from flashgen.compile import toolchain
from flashgen.kernels import render as render_module
from flashgen.spec import MergeSpec

SPEC, OP, ARCH = MergeSpec("bfloat16"), "merge_states", "sm_90a"
prefetch(__name__, [(OP, SPEC, ARCH)])
pytestmark = pytest.mark.nvcc


@pytest.fixture
def indexed(cache_dir, kernel_cache):
    """A private cache holding SPEC's entry and its index record (written by the first, unindexed lookup)."""
    seed(cache_dir, kernel_cache, [(OP, SPEC, ARCH)])
    entry = jit.ensure_compiled(SPEC, OP, ARCH)
    (record,) = (cache_dir / ARCH / index.INDEX_DIR).glob("*.json")
    return entry, record


def _no_render(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("rendered on an index hit")

    monkeypatch.setattr(jit, "prepare", refuse)
    monkeypatch.setattr(toolchain, "_probe", refuse)


def test_hit_loads_without_rendering(indexed, monkeypatch):
    entry, record = indexed
    assert json.loads(record.read_text())["entry"] == entry.path.name  # a folder name: relocatable
    _no_render(monkeypatch)
    before = jit.stats["compiles"]
    assert jit.ensure_compiled(SPEC, OP, ARCH).path == entry.path
    assert jit.stats["compiles"] == before


def test_hit_in_a_moved_extra_cache(indexed, tmp_path, monkeypatch):
    entry, _ = indexed
    moved = tmp_path / "moved"
    shutil.copytree(entry.path.parent.parent, moved)
    shutil.rmtree(entry.path.parent.parent / ARCH)
    monkeypatch.setenv("FLASHGEN_EXTRA_CACHE_DIRS", str(moved))
    monkeypatch.setenv("FLASHGEN_DISABLE_JIT", "1")
    _no_render(monkeypatch)
    assert jit.ensure_compiled(SPEC, OP, ARCH).path == moved / ARCH / entry.path.name


def test_stale_record_is_a_miss(indexed, monkeypatch):
    entry, record = indexed
    data = json.loads(record.read_text())
    record.write_text(json.dumps({**data, "content_key": "0" * 64}))  # the entry was built from other sources
    hit = jit.lookup_indexed(SPEC, OP, jit.default_store(), ARCH)
    assert hit.entry is None
    assert jit.ensure_compiled(SPEC, OP, ARCH).path == entry.path  # found by its key, and recorded again
    assert json.loads(record.read_text()) == data
    for bad in ("not json", json.dumps({**data, "entry": "../elsewhere"}), json.dumps({"entry": 1})):
        record.write_text(bad)
        assert jit.lookup_indexed(SPEC, OP, jit.default_store(), ARCH).entry is None


def test_corrupt_entry_behind_a_record_is_a_miss(indexed):
    entry, _ = indexed
    cubin = entry.path / "kernel.cubin"
    cubin.write_bytes(cubin.read_bytes()[:100])
    assert jit.lookup_indexed(SPEC, OP, jit.default_store(), ARCH).entry is None


def test_another_compiler_is_a_miss_where_one_is_present(indexed, tmp_path, monkeypatch):
    entry, record = indexed
    record.write_text(json.dumps({**json.loads(record.read_text()), "toolchain": "/other/nvcc:1:2"}))
    assert jit.lookup_indexed(SPEC, OP, jit.default_store(), ARCH).entry is None
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(toolchain, "_candidates", lambda: [tmp_path / "no" / "nvcc"])
    assert jit.lookup_indexed(SPEC, OP, jit.default_store(), ARCH).entry.path == entry.path  # no compiler


def test_a_changed_template_tree_misses_the_index(indexed, tmp_path, monkeypatch):
    entry, _ = indexed
    checkout = tmp_path / "templates"
    shutil.copytree(render_module.templates_dir(), checkout)
    monkeypatch.setattr(render_module, "templates_dir", lambda: checkout)
    assert jit.lookup_indexed(SPEC, OP, jit.default_store(), ARCH).entry is not None  # same bytes: same digest
    header = next((checkout / "include" / "flashgen").rglob("*.cuh"))
    header.write_bytes(header.read_bytes() + b"\n// edited\n")
    jit._sources_digest.cache_clear()  # as a new process: one process keeps the digest it computed
    assert jit.lookup_indexed(SPEC, OP, jit.default_store(), ARCH).entry is None
