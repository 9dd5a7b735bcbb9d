"""Cache key, cache store, compile pipeline (nvcc, no GPU)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

import flashgen
from flashgen import jit
from flashgen.cache import KeyInputs, kernel_key, read_entry
from flashgen.kernels import render as render_module
from flashgen.compile import ToolchainError, toolchain
from flashgen.spec import MergeSpec

REPO = Path(__file__).resolve().parents[2]
SPEC = MergeSpec("bfloat16")
OP = "merge_states"
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


@pytest.mark.nvcc
def test_corrupt_cubin_is_rebuilt(cache_dir):
    entry = jit.ensure_compiled(SPEC, OP, "sm_90a")
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
def test_read_only_extra_cache_is_searched_first(tmp_path, cache_dir, monkeypatch):
    shipped = tmp_path / "aot"
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(shipped))
    built = jit.ensure_compiled(SPEC, OP, "sm_90a")
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("FLASHGEN_EXTRA_CACHE_DIRS", str(shipped))
    monkeypatch.setenv("FLASHGEN_DISABLE_JIT", "1")
    found = jit.ensure_compiled(SPEC, OP, "sm_90a")
    assert found.path == built.path
    # a deployment machine without nvcc still finds it, by content key
    monkeypatch.setattr(toolchain, "_candidates", lambda: [tmp_path / "no" / "nvcc"])
    assert jit.ensure_compiled(SPEC, OP, "sm_90a").path == built.path


def test_missing_nvcc_is_a_clear_error(cache_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(toolchain, "_candidates", lambda: [tmp_path / "no" / "nvcc"])
    with pytest.raises(ToolchainError, match="nvcc not found.*CUDA_HOME"):
        toolchain.find_nvcc()
    with pytest.raises(ToolchainError, match="nvcc not found"):
        jit.ensure_compiled(SPEC, OP, "sm_90a")


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


WORKER = textwrap.dedent("""
    import sys
    from flashgen import jit
    from flashgen.spec import MergeSpec
    entry = jit.ensure_compiled(MergeSpec("float16"), "merge_states", "sm_90a")
    print(jit.stats["compiles"], entry.path)
""")


@pytest.mark.nvcc
def test_concurrent_processes_build_once(cache_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLASHGEN_CACHE_DIR": str(cache_dir)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(4)]
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(int(o[0]) for o in outs) == 1  # exactly one process compiled
    assert len({o[1] for o in outs}) == 1
    entries = list((cache_dir / "sm_90a").iterdir())
    assert [p.name for p in entries if not p.name.startswith(".")] == [Path(outs[0][1]).name]
    assert read_entry(Path(outs[0][1]))[0] is not None
    assert not list((cache_dir / "sm_90a" / ".tmp").iterdir())  # no leftover build folders


@pytest.mark.nvcc
def test_manifest_records_the_build(cache_dir):
    entry = jit.ensure_compiled(SPEC, OP, "sm_90a")
    manifest = json.loads((entry.path / "manifest.json").read_text())
    assert manifest["uri"] == "merge_states_bf16" and manifest["arch"] == "sm_90a"
    assert manifest["entry_points"] == ["merge_state", "merge_states"]
    assert manifest["key"].startswith(entry.path.name.rsplit("-", 1)[1])
