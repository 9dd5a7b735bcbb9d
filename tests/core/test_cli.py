import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashgen.cli import DEFAULT_BUILDS

REPO = Path(__file__).resolve().parents[2]


def flashgen(*args, cache: Path, **env):
    return subprocess.run([sys.executable, "-m", "flashgen.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "FLASHGEN_CACHE_DIR": str(cache), **env})


def test_info_runs(tmp_path):
    out = flashgen("info", cache=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "nvcc" in out.stdout and str(tmp_path) in out.stdout


@pytest.mark.nvcc
def test_build_list_verify_clean(tmp_path):
    built = flashgen("build", "--arch", "sm_90a", cache=tmp_path)
    assert built.returncode == 0, built.stderr
    assert len(built.stdout.strip().splitlines()) == len(DEFAULT_BUILDS) == 6
    assert built.stdout.count("sm_90a  merge_states_") == 3 and "sm_90a  decode_d128" in built.stdout
    assert "sm_90a  prefill_sm90_d128" in built.stdout
    listed = flashgen("cache", "list", cache=tmp_path)
    assert listed.stdout.count(" ok") == 6
    assert flashgen("cache", "verify", cache=tmp_path).returncode == 0
    cubin = next((tmp_path / "sm_90a").glob("merge_states_f16-*")) / "kernel.cubin"
    cubin.write_bytes(b"\x7fELF garbage")
    bad = flashgen("cache", "verify", cache=tmp_path)
    assert bad.returncode == 1 and "BAD" in bad.stdout
    assert flashgen("cache", "clean", "--corrupt", cache=tmp_path).returncode == 0
    assert flashgen("cache", "list", cache=tmp_path).stdout.count(" ok") == 5
    flashgen("cache", "clean", cache=tmp_path)
    assert flashgen("cache", "list", cache=tmp_path).stdout.strip() == ""


def test_build_without_gpu_or_arch_is_a_clear_error(tmp_path):
    out = flashgen("build", cache=tmp_path, CUDA_VISIBLE_DEVICES="", FLASHGEN_CUDA_ARCH="")
    assert out.returncode == 2
    assert "explicit arch" in out.stderr


@pytest.mark.nvcc
def test_build_from_a_plan_file(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text('[{"op": "merge_states", "spec": {"type": "MergeSpec", "dtype": "float16"}}]')
    out = flashgen("build", "--arch", "sm_80", "--plan", str(plan), cache=tmp_path / "c")
    assert out.returncode == 0, out.stderr
    assert "sm_80  merge_states_f16" in out.stdout


@pytest.mark.nvcc
def test_hopper_only_builds_are_skipped_for_other_archs(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text('[{"op": "prefill_sm90", "spec": {"type": "AttentionSpec", "head_dim": 64, "kv_layout": '
                    '{"type": "Ragged"}}}, {"op": "merge_states", "spec": {"type": "MergeSpec", "dtype": "float16"}}]')
    out = flashgen("build", "--arch", "sm_80", "--plan", str(plan), cache=tmp_path / "c")
    assert out.returncode == 0, out.stderr
    assert "skipping 1 sm_90a-only build(s): prefill_sm90" in out.stdout and "sm_80  merge_states_f16" in out.stdout


@pytest.mark.nvcc
def test_a_rope_spec_builds_what_the_sm90_backend_runs(tmp_path):
    """RoPE on sm90 is the rope_gather pre-pass plus the kernel of the spec's ragged twin: a plan naming the
    spec gets both, so a deployment with FLASHGEN_DISABLE_JIT=1 finds them."""
    plan = tmp_path / "plan.json"
    plan.write_text('[{"op": "prefill_sm90", "spec": {"type": "AttentionSpec", "head_dim": 128, "kv_layout": '
                    '{"type": "Paged", "page_size": 16}, "mask": {"type": "Causal"}, "pos_encoding": '
                    '{"type": "RoPE"}}}]')
    out = flashgen("build", "--arch", "sm_90a", "--plan", str(plan), cache=tmp_path / "c")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout
    assert "sm_90a  rope_gather_d128_vo128_bf16_kvbf16_paged16nhd_nomask_rope_nocap" in out.stdout  # mask-free
    assert "sm_90a  prefill_sm90_d128_vo128_bf16_kvbf16_ragged_causal_nopos_nocap" in out.stdout


@pytest.mark.nvcc
def test_shipped_build_plans_compile(tmp_path):
    for plan in sorted((REPO / "plans").glob("*.json")):
        out = flashgen("build", "--arch", "sm_90a", "--plan", str(plan), cache=tmp_path / plan.stem)
        assert out.returncode == 0, out.stderr
        assert len(out.stdout.strip().splitlines()) == len(__import__("json").loads(plan.read_text()))
