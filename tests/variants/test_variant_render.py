"""render_variant: the functors compile for sm_90a in a tiny standalone .cu, and an nvcc error inside a hook
is reported against the hook's own line."""

from __future__ import annotations

import subprocess

import pytest

from flashgen import Variant, render_variant
from flashgen.compile import find_nvcc
from flashgen.kernels import include_dir
from flashgen.spec import HOOKS

ALL_HOOKS = Variant(
    score="float y = logit * scale;\nreturn y + static_cast<float>(bias(qo_head, kv_idx));",
    mask=lambda b, h, q_idx, kv_idx, doc: (doc[q_idx] == doc[kv_idx]) & (q_idx // 3 >= kv_idx % 5),
    mask_tile="return kv_begin >= qo_end ? TILE_EMPTY : TILE_PARTIAL;",
    q_transform="value * 2.0f", k_transform=lambda x, dim: x * (dim + 1), output="value", sink="sinks[qo_head]",
    tensors=[("doc", "int32", 1), ("bias", "bfloat16", 2), ("sinks", "float32", 1)], scalars=[("scale", "float32")],
)


def _kernel(variant: Variant) -> str:
    head = "// test\n"
    body = render_variant(variant, "kernel.cu", first_line=head.count("\n") + 1)
    calls = []
    for hook in variant.hooks:
        n = len(HOOKS[hook.name].inputs)
        args = ", ".join(["1.0f" if t == "float" else "1" for _, t in HOOKS[hook.name].inputs][:n])
        calls.append(f"  out[{len(calls)}] = (float)flashgen_variant::{hook.name}(params, {args});")
    return head + body + ('extern "C" __global__ void call_hooks(flashgen_variant::VariantParams params, float* out) {\n'
                          + "\n".join(calls) + "\n}\n")


def _nvcc(tmp_path, source: str) -> subprocess.CompletedProcess:
    path = tmp_path / "kernel.cu"
    path.write_text(source)
    cmd = [str(find_nvcc().path), "-cubin", "-arch=sm_90a", "-std=c++17", f"-I{include_dir()}", "kernel.cu",
           "-o", "kernel.cubin"]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_line_directives_return_to_the_physical_line():
    text = render_variant(ALL_HOOKS, "kernel.cu", first_line=5).split("\n")
    for i, line in enumerate(text):
        if line.startswith('#line') and line.endswith('"kernel.cu"'):
            assert int(line.split()[1]) == 5 + i + 1


@pytest.mark.nvcc
def test_every_hook_compiles_for_sm90a(tmp_path):
    result = _nvcc(tmp_path, _kernel(ALL_HOOKS))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "kernel.cubin").stat().st_size > 0


@pytest.mark.nvcc
def test_an_error_in_a_hook_names_the_hooks_line(tmp_path):
    bad = Variant(score="float y = logit;\nreturn y + logit.nonsense;")  # passes the light check, fails nvcc
    result = _nvcc(tmp_path, _kernel(bad))
    assert result.returncode != 0
    assert "variant.score(2)" in result.stderr, result.stderr


@pytest.mark.nvcc
def test_shipped_examples_compile_both_spellings(tmp_path):
    from flashgen.variants.examples import EXAMPLES

    for name, pair in EXAMPLES.items():
        for variant in (v for v in pair if v is not None):
            result = _nvcc(tmp_path, _kernel(variant))
            assert result.returncode == 0, f"{name}: {result.stderr}"
