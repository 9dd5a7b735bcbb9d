"""The `flashgen` command. `info` runs as a real process (the entry point); the rest call `cli.main` in this
process (each process would spend seconds importing torch), with kernels that are not the point of a test
copied from the session's shared cache rather than compiled again."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from compile_checks import prefetch, seed, seed_planner
from flashgen import cli
from flashgen.cli import DEFAULT_BUILDS
from flashgen.compile import toolchain

REPO = Path(__file__).resolve().parents[2]


def flashgen(*args, cache: Path, **env):
    return subprocess.run([sys.executable, "-m", "flashgen.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "FLASHGEN_CACHE_DIR": str(cache), **env})


@pytest.fixture
def run(cache_dir, capsys):
    """``run(*args)`` -> (exit code, stdout, stderr) of ``flashgen *args`` on the test's private cache."""
    def run(*args):
        code = cli.main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def plan_file(tmp_path: Path, items: list[dict]) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(items))
    return str(path)


MERGE_F16 = {"op": "merge_states", "spec": {"type": "MergeSpec", "dtype": "float16"}}
ROPE_PLAN = [{"op": "prefill_sm90", "spec": {
    "type": "AttentionSpec", "head_dim": 128, "kv_layout": {"type": "Paged", "page_size": 16},
    "mask": {"type": "Causal"}, "pos_encoding": {"type": "RoPE"}}}]
PLANS = sorted((REPO / "plans").glob("*.json"))


def plan_builds(items: list[dict]) -> list[tuple[str, object]]:
    """What `flashgen build --plan` compiles for a plan's items (cli._plan_builds on a file)."""
    specs = [(item["op"], cli.spec_from_dict(item["spec"])) for item in items]
    return [b for op, spec in specs for b in (cli.sm90_builds(spec) if op == "prefill_sm90" else [(op, spec)])]


def test_an_fp8_spec_builds_both_sm90_routes():
    """fp8 K/V on sm90: the pre-pass and the 16-bit twin (outside CUDA graphs) and the kernel that converts them
    itself (in a graph); over a gathered page size the graph route is the portable kernel's, so not built here."""
    from flashgen.spec import AttentionSpec, Causal, Paged

    spec = AttentionSpec(128, kv_dtype="float8_e4m3fn", kv_layout=Paged(16), mask=Causal())
    builds = cli.sm90_builds(spec)
    assert [op for op, _ in builds] == ["rope_gather", "prefill_sm90", "prefill_sm90"]
    assert builds[1][1].kv_dtype == "bfloat16" and builds[2] == ("prefill_sm90", spec)
    gathered = spec.replace(kv_layout=Paged(5))
    assert [op for op, _ in cli.sm90_builds(gathered)] == ["rope_gather", "prefill_sm90"]
    plain = spec.replace(kv_dtype="bfloat16")
    assert cli.sm90_builds(plain) == [("prefill_sm90", plain)]


prefetch(__name__, [(op, spec, "sm_90a") for op, spec in DEFAULT_BUILDS + tuple(plan_builds(ROPE_PLAN))]
         + [(op, spec, "sm_90a") for plan in PLANS for op, spec in plan_builds(json.loads(plan.read_text()))]
         + [("merge_states", cli.spec_from_dict(MERGE_F16["spec"]), "sm_80")])


def test_info_runs(tmp_path):
    out = flashgen("info", cache=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "nvcc" in out.stdout and str(tmp_path) in out.stdout


@pytest.mark.nvcc
def test_build_list_verify_clean(run, cache_dir, kernel_cache):
    seed(cache_dir, kernel_cache, [(op, spec, "sm_90a") for op, spec in DEFAULT_BUILDS])
    planner = seed_planner(cache_dir)  # the native planner: `flashgen build` puts it in the cache too
    code, built, err = run("build", "--arch", "sm_90a")
    assert code == 0, err
    assert len(built.strip().splitlines()) == len(DEFAULT_BUILDS) + 1 == 7
    assert built.count("sm_90a  merge_states_") == 3 and "sm_90a  decode_d128" in built
    assert "sm_90a  prefill_sm90_d128" in built
    assert built.strip().splitlines()[-1].startswith("host  planner")
    assert run("cache", "list")[1].count(" ok") == 6 + planner
    assert run("cache", "verify")[0] == 0
    cubin = next((cache_dir / "sm_90a").glob("merge_states_f16-*")) / "kernel.cubin"
    cubin.write_bytes(b"\x7fELF garbage")
    code, bad, _ = run("cache", "verify")
    assert code == 1 and "BAD" in bad
    assert run("cache", "clean", "--corrupt")[0] == 0
    assert run("cache", "list")[1].count(" ok") == 5 + planner
    run("cache", "clean")
    assert run("cache", "list")[1].strip() == ""


def test_build_without_gpu_or_arch_is_a_clear_error(run, monkeypatch):
    monkeypatch.delenv("FLASHGEN_CUDA_ARCH", raising=False)
    monkeypatch.setattr(toolchain, "device_arch", lambda device=None: None)
    code, _, err = run("build")
    assert code == 2
    assert "explicit arch" in err


@pytest.mark.nvcc
def test_build_from_a_plan_file(run, tmp_path, cache_dir):
    seed_planner(cache_dir)
    code, out, err = run("build", "--arch", "sm_80", "--plan", plan_file(tmp_path, [MERGE_F16]))  # compiles
    assert code == 0, err
    assert "sm_80  merge_states_f16" in out


@pytest.mark.nvcc
def test_a_build_without_a_cxx_compiler_builds_the_kernels(run, tmp_path, cache_dir, kernel_cache, monkeypatch):
    from flashgen import jit_native as build

    seed(cache_dir, kernel_cache, [("merge_states", cli.spec_from_dict(MERGE_F16["spec"]), "sm_80")])
    monkeypatch.setattr(build, "COMPILERS", (str(tmp_path / "missing" / "c++"),))
    code, out, err = run("build", "--arch", "sm_80", "--plan", plan_file(tmp_path, [MERGE_F16]))
    assert code == 0, err
    assert "sm_80  merge_states_f16" in out
    assert re.match(r"host  planner +not built \(no C\+\+ compiler: looked for \S+missing/c\+\+ on PATH, and no "
                    r"cache holds a planner built from this source .*\); plans use the Python list paths$",
                    out.splitlines()[-1]), out


@pytest.mark.nvcc
def test_hopper_only_builds_are_skipped_for_other_archs(run, tmp_path, cache_dir, kernel_cache):
    items = [{"op": "prefill_sm90", "spec": {"type": "AttentionSpec", "head_dim": 64, "kv_layout": {"type": "Ragged"}}},
             MERGE_F16]
    seed(cache_dir, kernel_cache, [("merge_states", cli.spec_from_dict(MERGE_F16["spec"]), "sm_80")])
    seed_planner(cache_dir)
    code, out, err = run("build", "--arch", "sm_80", "--plan", plan_file(tmp_path, items))
    assert code == 0, err
    assert "skipping 1 sm_90a-only build(s): prefill_sm90" in out and "sm_80  merge_states_f16" in out


@pytest.mark.nvcc
def test_a_rope_spec_builds_what_the_sm90_backend_runs(run, tmp_path, cache_dir, kernel_cache):
    """RoPE on sm90 is the rope_gather pre-pass plus the kernel of the spec's ragged twin: a plan naming the
    spec gets both, so a deployment with FLASHGEN_DISABLE_JIT=1 finds them."""
    plan = plan_file(tmp_path, ROPE_PLAN)
    assert cli._plan_builds(Path(plan)) == plan_builds(ROPE_PLAN)
    seed(cache_dir, kernel_cache, [(op, spec, "sm_90a") for op, spec in plan_builds(ROPE_PLAN)])
    seed_planner(cache_dir)
    code, out, err = run("build", "--arch", "sm_90a", "--plan", plan)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("host  planner"), out  # the kernels, then the planner
    assert "sm_90a  rope_gather_d128_vo128_bf16_kvbf16_paged16nhd_nomask_rope_nocap" in out  # mask-free
    assert "sm_90a  prefill_sm90_d128_vo128_bf16_kvbf16_ragged_causal_nopos_nocap" in out


@pytest.mark.nvcc
def test_shipped_build_plans_compile(run, cache_dir, kernel_cache, monkeypatch):
    for plan in PLANS:
        cache = cache_dir / plan.stem
        monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(cache))
        builds = cli._plan_builds(plan)
        assert builds == plan_builds(json.loads(plan.read_text()))
        seed(cache, kernel_cache, [(op, spec, "sm_90a") for op, spec in builds])  # compiled once a session
        seed_planner(cache)
        code, out, err = run("build", "--arch", "sm_90a", "--plan", str(plan))
        assert code == 0, err
        assert len(out.strip().splitlines()) == len(json.loads(plan.read_text())) + 1  # and the planner


# user errors: exit code 2 and one line on stderr naming what is wrong, never a traceback (in-process: fast)
PLAN_ERRORS = {
    "invalid-json": ('[{"op": 1', r"--plan \S+: not valid JSON \(Expecting"),
    "a-dict": ('{"op": "decode", "spec": {}}', r"--plan \S+: got a JSON object, expected a JSON list of"),
    "no-spec": ('[{"op": "decode"}]', r"--plan \S+: item 0: got \{\"op\": \"decode\"\}, expected \{\"op\""),
    "spec-not-a-dict": ('[{"op": "decode", "spec": "d128"}]', r"item 0: got .*expected \{\"op\": \.\.\., \"spec\""),
    "no-op": ('[{"spec": {"head_dim": 128}}]', r"item 0: got .*expected \{\"op\""),
    "unknown-op": ('[{"op": "decodes", "spec": {"head_dim": 128}}]', r"item 0: op 'decodes', expected one of append, decode"),
    "bad-spec": ('[{"op": "decode", "spec": {"head_dim": 100}}]', r"item 0: spec: head_dim: got 100, expected"),
    "second-item": ('[{"op": "merge_states", "spec": {"type": "MergeSpec"}}, 7]', r"item 1: got 7, expected"),
}


def run_main(capsys, *argv) -> tuple[int, str, str]:
    from flashgen.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("text, message", PLAN_ERRORS.values(), ids=PLAN_ERRORS.keys())
def test_a_bad_plan_file_is_a_one_line_error(tmp_path, capsys, monkeypatch, text, message):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    plan = tmp_path / "plan.json"
    plan.write_text(text)
    code, out, err = run_main(capsys, "build", "--arch", "sm_80", "--plan", str(plan))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"flashgen build: error: --plan {plan}: ") and re.search(message, err), err


def test_unreadable_plans_and_bad_job_counts_are_usage_errors(tmp_path, capsys):
    code, _, err = run_main(capsys, "build", "--arch", "sm_80", "--plan", str(tmp_path))
    assert code == 2 and err.strip() == f"flashgen build: error: --plan {tmp_path}: cannot read it (Is a directory)"
    code, _, err = run_main(capsys, "build", "--arch", "sm_80", "--plan", str(tmp_path / "missing.json"))
    assert code == 2 and "missing.json: cannot read it (No such file or directory)" in err
    for jobs in ("0", "-2", "two"):
        code, _, err = run_main(capsys, "build", "--arch", "sm_80", "-j", jobs)
        assert code == 2 and err.strip().splitlines()[-1] == (
            f"flashgen build: error: argument -j/--jobs: got '{jobs}', expected an int >= 1")


def test_an_empty_plan_says_there_is_nothing_to_build(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    plan = tmp_path / "plan.json"
    plan.write_text("[]")
    code, out, err = run_main(capsys, "build", "--plan", str(plan))  # no arch needed: nothing to compile
    assert (code, out, err) == (0, "nothing to build: the plans list no kernels\n", "")
    plan.write_text('[{"op": "prefill_sm90", "spec": {"head_dim": 64, "kv_layout": {"type": "Ragged"}}}]')
    code, out, err = run_main(capsys, "build", "--arch", "sm_80", "--plan", str(plan))
    assert code == 0 and out.splitlines()[-1] == "sm_80  nothing to build for this arch"
