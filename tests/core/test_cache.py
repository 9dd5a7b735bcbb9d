"""Cache key, cache store, compile pipeline (nvcc, no GPU)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import flashgen
from compile_checks import prefetch, seed, seed_planner
from flashgen import cli, jit
from flashgen.cache import CacheStore, KeyInputs, kernel_key, read_entry
from flashgen.kernels import render as render_module
from flashgen.compile import ToolchainError, ptx_lines, toolchain
from flashgen.spec import MergeSpec

REPO = Path(__file__).resolve().parents[2]
SPEC = MergeSpec("bfloat16")
OP = "merge_states"
prefetch(__name__, [(OP, SPEC, "sm_90a")])
BASE = KeyInputs({"kernel.cu": "int x;"}, {"flashgen/a.cuh": b"#pragma once"}, "nvcc 13.0", "sm_90a",
                 ("-O3",), "0.1.0")


def test_key_is_deterministic():
    assert kernel_key(BASE) == kernel_key(replace(BASE))


@pytest.mark.parametrize(
    "change",
    [
        {"sources": {"kernel.cu": "int y;"}},
        {"headers": {"flashgen/a.cuh": b"#pragma once "}},
        {"headers": {"flashgen/b.cuh": b"#pragma once"}},
        {"nvcc_version": "nvcc 13.1"},
        {"arch": "sm_80"},
        {"flags": ("-O2",)},
        {"flashgen_version": "0.1.1"},
    ],
)
def test_key_changes_with_every_input(change):
    assert kernel_key(replace(BASE, **change)) != kernel_key(BASE)


def test_key_is_length_prefixed():
    a = replace(BASE, flags=("-O3", "-g"))
    b = replace(BASE, flags=("-O3-g",))
    assert kernel_key(a) != kernel_key(b)


def _key_in_subprocess() -> str:
    code = "from flashgen import jit; from flashgen.spec import MergeSpec; " \
           "print(jit.prepare(MergeSpec('bfloat16'), 'merge_states', 'sm_90a').key)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    return out.stdout.strip()


@pytest.mark.nvcc
def test_key_is_stable_across_processes():
    assert _key_in_subprocess() == jit.prepare(SPEC, OP, "sm_90a").key


@pytest.fixture
def template_copy(tmp_path, monkeypatch):
    """A private copy of templates/ that the test may edit."""
    copy = tmp_path / "templates"
    shutil.copytree(render_module.templates_dir(), copy)
    monkeypatch.setattr(render_module, "templates_dir", lambda: copy)
    render_module.environment.cache_clear()
    jit._header_tree.cache_clear()
    yield copy
    render_module.environment.cache_clear()
    jit._header_tree.cache_clear()


@pytest.mark.nvcc
def test_one_template_byte_changes_the_key(template_copy):
    before = jit.prepare(SPEC, OP, "sm_90a").key
    path = template_copy / "merge_states.cu.j2"
    path.write_text(path.read_text().replace("// flashgen generated:", "// flashgen  generated:"))
    render_module.environment.cache_clear()
    assert jit.prepare(SPEC, OP, "sm_90a").key != before


@pytest.mark.nvcc
def test_one_header_byte_changes_the_key(template_copy):
    before = jit.prepare(SPEC, OP, "sm_90a").key
    path = template_copy / "include" / "flashgen" / "merge" / "merge_states.cuh"
    path.write_bytes(path.read_bytes() + b" ")
    jit._header_tree.cache_clear()
    assert jit.prepare(SPEC, OP, "sm_90a").key != before


@pytest.mark.nvcc
def test_arch_changes_the_key_and_equivalent_specs_share_it():
    assert jit.prepare(SPEC, OP, "sm_90a").key != jit.prepare(SPEC, OP, "sm_80").key
    assert jit.prepare(MergeSpec("bf16"), OP, "90a").key == jit.prepare(SPEC, OP, "sm_90a").key


@pytest.mark.nvcc
def test_compile_produces_a_verified_cubin(cache_dir):
    before = jit.stats["compiles"]
    entry = jit.ensure_compiled(SPEC, OP, "sm_90a")
    assert jit.stats["compiles"] == before + 1
    assert entry.path.parent == cache_dir / "sm_90a" and entry.path.name.startswith("merge_states_bf16-")
    assert entry.cubin[:4] == b"\x7fELF"
    assert {"kernel.cu", "build.ninja", "kernel.cubin", "manifest.json", "ptxas.log"} <= {
        p.name for p in entry.path.iterdir()}
    assert "Used" in (entry.path / "ptxas.log").read_text()  # the resource report is kept
    jit.ensure_compiled(SPEC, OP, "sm_90a")
    assert jit.stats["compiles"] == before + 1  # warm: nothing compiled


@pytest.fixture
def shipped(cache_dir, kernel_cache):
    """The test's private cache holding SPEC's sm_90a entry (compiled once per session)."""
    (entry,) = seed(cache_dir, kernel_cache, [(OP, SPEC, "sm_90a")])
    return entry


@pytest.mark.nvcc
def test_corrupt_cubin_is_rebuilt(shipped):
    entry = shipped
    cubin = entry.path / "kernel.cubin"
    cubin.write_bytes(cubin.read_bytes()[: len(entry.cubin) // 2])  # truncated
    assert read_entry(entry.path)[0] is None
    before = jit.stats["compiles"]
    rebuilt = jit.ensure_compiled(SPEC, OP, "sm_90a")
    assert jit.stats["compiles"] == before + 1
    assert rebuilt.path == entry.path and read_entry(rebuilt.path)[0] is not None


@pytest.mark.nvcc
def test_disabled_jit_names_the_spec(cache_dir, monkeypatch):
    monkeypatch.setenv("FLASHGEN_DISABLE_JIT", "1")
    with pytest.raises(flashgen.MissingKernelError, match="merge_states_bf16.*FLASHGEN_DISABLE_JIT"):
        jit.ensure_compiled(SPEC, OP, "sm_90a")


@pytest.mark.nvcc
def test_read_only_extra_cache_is_searched_first(tmp_path, cache_dir, kernel_cache, monkeypatch):
    aot = tmp_path / "aot"
    (built,) = seed(aot, kernel_cache, [(OP, SPEC, "sm_90a")])
    monkeypatch.setenv("FLASHGEN_EXTRA_CACHE_DIRS", str(aot))
    monkeypatch.setenv("FLASHGEN_DISABLE_JIT", "1")
    found = jit.ensure_compiled(SPEC, OP, "sm_90a")
    assert found.path == built.path
    # a deployment machine without nvcc still finds it, by content key
    _without_nvcc(monkeypatch, tmp_path)
    assert jit.ensure_compiled(SPEC, OP, "sm_90a").path == built.path


def _without_nvcc(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(toolchain, "_candidates", lambda: [tmp_path / "no" / "nvcc"])


def test_missing_nvcc_is_a_clear_error(cache_dir, tmp_path, monkeypatch):
    _without_nvcc(monkeypatch, tmp_path)
    with pytest.raises(ToolchainError, match="nvcc not found.*CUDA_HOME"):
        toolchain.find_nvcc()
    with pytest.raises(ToolchainError, match="nvcc not found"):
        jit.ensure_compiled(SPEC, OP, "sm_90a")


@pytest.mark.parametrize("variable", ["CUDA_HOME", "CUDA_PATH"])
def test_cuda_home_without_nvcc_is_an_error_not_a_fall_back(tmp_path, monkeypatch, variable):
    """Another nvcc (on PATH) is never taken silently in place of the toolkit CUDA_HOME names."""
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(toolchain.shutil, "which", lambda name: "/usr/bin/nvcc-elsewhere")
    monkeypatch.setenv(variable, str(tmp_path))
    with pytest.raises(ToolchainError, match=rf"{variable}={tmp_path} has no nvcc: looked for {tmp_path}/bin/nvcc; "
                                             f"point {variable} at a CUDA toolkit folder"):
        toolchain.find_nvcc()


def test_no_gpu_needs_an_explicit_arch(monkeypatch):
    monkeypatch.delenv("FLASHGEN_CUDA_ARCH", raising=False)
    monkeypatch.setattr(toolchain, "device_arch", lambda device=None: None)
    with pytest.raises(ToolchainError, match="explicit arch"):
        toolchain.choose_arch(None)
    monkeypatch.setenv("FLASHGEN_CUDA_ARCH", "9.0a")
    assert toolchain.choose_arch(None) == "sm_90a"
    assert toolchain.choose_arch("sm_80") == "sm_80"  # the argument wins


def test_bad_arch_is_rejected():
    with pytest.raises(ToolchainError, match="arch: got 'hopper'"):
        toolchain.normalize_arch("hopper")


@pytest.mark.nvcc
def test_compile_error_keeps_nvcc_log_and_source(cache_dir, template_copy):
    path = template_copy / "include" / "flashgen" / "merge" / "merge_states.cuh"
    path.write_text(path.read_text() + "\nthis is not C++;\n")
    jit._header_tree.cache_clear()
    with pytest.raises(flashgen.CompileError) as info:
        jit.ensure_compiled(SPEC, OP, "sm_90a")
    assert "error" in info.value.log and info.value.source.name == "kernel.cu" and info.value.source.exists()


@pytest.mark.nvcc
def test_manifest_records_the_build(shipped):
    entry = shipped
    manifest = json.loads((entry.path / "manifest.json").read_text())
    assert manifest["uri"] == "merge_states_bf16" and manifest["arch"] == "sm_90a"
    assert manifest["entry_points"] == ["merge_state", "merge_states", "merge_states_in_place"]
    assert manifest["key"].startswith(entry.path.name.rsplit("-", 1)[1])
    source = (entry.path / "kernel.cu").read_bytes()
    assert manifest["files"]["kernel.cu"] == [len(source), hashlib.sha256(source).hexdigest()]
    assert set(manifest["files"]) == {"build.ninja", "kernel.cu", "nvcc.log", "ptxas.log"}


@pytest.mark.nvcc
def test_builds_are_byte_reproducible(tmp_path, cache_dir, monkeypatch):
    """One key, one cubin: built in another cache folder, from another checkout (another include path) and through
    `flashgen build`, the bytes are the same, and no folder of either build is in them."""
    first = jit.ensure_compiled(SPEC, OP, "sm_90a")
    checkout = tmp_path / "elsewhere" / "templates"
    shutil.copytree(render_module.templates_dir(), checkout)
    monkeypatch.setattr(render_module, "templates_dir", lambda: checkout)
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "aot"))
    seed_planner(tmp_path / "aot")
    plan = tmp_path / "plan.json"
    plan.write_text('[{"op": "merge_states", "spec": {"type": "MergeSpec", "dtype": "bfloat16"}}]')
    try:
        assert cli.main(["build", "--arch", "sm_90a", "--plan", str(plan)]) == 0
    finally:
        render_module.environment.cache_clear()
    (second,) = [path for path in CacheStore(tmp_path / "aot").entry_dirs() if path.parent.name == "sm_90a"]
    assert second.name == first.path.name
    assert (second / "kernel.cubin").read_bytes() == first.cubin
    for folder in (str(cache_dir), str(tmp_path), str(REPO), ".tmp"):
        assert folder.encode() not in first.cubin, folder
    assert b"flashgen/merge\0" in first.cubin and b"merge_states.cuh\0" in first.cubin  # -lineinfo, relative names


def test_ptx_line_table_names_are_relative():
    ptx = ('\t.file\t1 "/build/x/.tmp/k.1.a/kernel.cu"\n\t.file\t2 "/opt/fg/templates/include/flashgen/common/vec.cuh"\n'
           '\t.file\t3 "/usr/local/cuda-13.0/bin/../targets/x86_64-linux/include/cuda_fp16.hpp"\n'
           '\t.file\t4 "/usr/include/c++/12/cmath"\n\t.loc\t1 2 3\n')
    assert ptx_lines.relocate_ptx(ptx, "/build/x/.tmp/k.1.a", "/opt/fg/templates/include/") == (
        '\t.file\t1 "kernel.cu"\n\t.file\t2 "flashgen/common/vec.cuh"\n\t.file\t3 "cuda/include/cuda_fp16.hpp"\n'
        '\t.file\t4 "/usr/include/c++/12/cmath"\n\t.loc\t1 2 3\n')


@pytest.mark.nvcc
@pytest.mark.skipif(toolchain.device_arch() is not None, reason="needs a machine without a GPU")
def test_build_without_a_gpu_compiles_then_says_there_is_none(shipped, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CUDA_ARCH", "sm_90a")
    with pytest.raises(flashgen.NoDeviceError, match=r"kernel merge_states_bf16 is compiled for sm_90a and cached "
                                                     r"at .*, but no GPU is visible .*ensure_compiled") as info:
        flashgen.build(SPEC, OP)
    assert info.value.entry.path == shipped.path
    with pytest.raises(flashgen.NoDeviceError, match="no GPU is visible"):
        flashgen.build(SPEC, OP, device=0)
    monkeypatch.delenv("FLASHGEN_CUDA_ARCH")
    with pytest.raises(flashgen.NoDeviceError, match=r"no target arch is set .* flashgen.ensure_compiled\(spec, "
                                                     r"'merge_states', arch='sm_90a'\)") as info:
        flashgen.build(SPEC, OP)
    assert info.value.entry is None
