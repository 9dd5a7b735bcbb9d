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


def test_heavy_pair_hooks_are_weighed_by_their_calls():
    from flashgen.kernels.variant import HEAVY_HOOK_WEIGHT, heavy_pair_hooks, hook_weight
    from flashgen.variants.examples import EXAMPLES

    heavy = {name for name, pair in EXAMPLES.items() for v in pair if v is not None and heavy_pair_hooks(v)}
    assert heavy == {"t5_bias"}
    assert hook_weight("return logit / scale;") == 12
    assert hook_weight("// logf(x) / 2\nreturn logit;") == 0  # comments weigh nothing
    assert hook_weight("return logit + logf(1.f + kv_idx);") < HEAVY_HOOK_WEIGHT
    assert heavy_pair_hooks(Variant(score="return logit + logf(1.f + kv_idx) / logf(2.f);"))
    assert not heavy_pair_hooks(Variant(sink="return logf(2.f) * expf(1.f) / 3.f;"))  # not a pair hook
    assert not heavy_pair_hooks(None)
    assert "static constexpr bool HEAVY = true;" in render_variant(EXAMPLES["t5_bias"][0])
    assert "static constexpr bool HEAVY = false;" in render_variant(EXAMPLES["alibi"][0])


def test_the_pair_hooks_take_the_distance_and_the_kernels_compute_it_where_read():
    from flashgen.kernels.variant import hook_signature, reads_distance
    from flashgen.variants.examples import EXAMPLES

    assert hook_signature("score").endswith("int qo_head, int kv_head, float distance)")
    assert hook_signature("mask").endswith("int qo_head, int kv_head, float distance)")
    assert all("distance" not in hook_signature(h) for h in HOOKS if h not in ("score", "mask"))
    reading = {name for name, pair in EXAMPLES.items() for v in pair if v is not None and reads_distance(v)}
    assert reading == {"alibi"}  # both spellings: the snippet names it, the traced one's conversion becomes it
    assert all(reads_distance(v) for v in EXAMPLES["alibi"])
    assert reads_distance(Variant(mask="return distance < 0.f;")) and not reads_distance(None)
    assert "static constexpr bool DISTANCE = true;" in render_variant(EXAMPLES["alibi"][1])
    assert "static constexpr bool DISTANCE = false;" in render_variant(EXAMPLES["document"][1])


def _sm90_causal_ptx(variant, tmp_path) -> str:
    """The PTX (sm_90a) of the Hopper prefill with ``variant`` over ragged K/V, causal, d128."""
    from flashgen import jit
    from flashgen.spec import AttentionSpec, Causal, Ragged

    spec = AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=variant)
    (tmp_path / "kernel.cu").write_text(jit.render(spec, "prefill_sm90"))
    cmd = [str(find_nvcc().path), "-ptx", "-arch=sm_90a", "-O3", "-std=c++17", "--expt-relaxed-constexpr",
           f"-I{include_dir()}", "kernel.cu", "-o", "kernel.ptx"]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return (tmp_path / "kernel.ptx").read_text()


@pytest.mark.nvcc
def test_the_alibi_example_converts_no_int_a_pair(tmp_path):
    # the ALiBi snippet's bias through distance: its kernels' int -> float conversions are a row's, not a pair's
    # (sm_90a, nvcc 13.0: 16 cvt.rn.f32.s32 in the Hopper prefill's PTX, 264 through static_cast<float> a pair)
    from flashgen.variants.examples import EXAMPLES

    assert _sm90_causal_ptx(EXAMPLES["alibi"][1], tmp_path).count("cvt.rn.f32.s32") < 64


@pytest.mark.nvcc
def test_the_sm90_kernel_inlines_a_heavy_hook_once_a_tile(tmp_path):
    # T5's bucket floors once a pair: 64 pairs a thread a tile. Inlined at the first tile and in the tile loop,
    # inside the item and at its edge, it was 4 x 64 floors (ptxas 11 s at sm_90a); one site is 64.
    from flashgen.variants.examples import EXAMPLES

    assert _sm90_causal_ptx(EXAMPLES["t5_bias"][0], tmp_path).count("cvt.rmi.f32.f32") == 64
