"""flashgen.testing.check on the CPU: the reference's own output (rounded to the kernel's dtype) passes; a
perturbed output, a NaN, an unwritten row, a wrong lse and a wrong fully masked (-inf) row fail with a message
that names the error, where it is and the bound."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from flashgen import AttentionSpec, Causal, CustomMask, Paged, Ragged
from flashgen.testing.check import assert_matches_reference, check_attention, nan_out, poison_allocator
from flashgen.testing.layouts import random_batch
from flashgen.testing.reference import reference_attention
from flashgen.testing.tolerance import _max_error, noise_floor, same_dtype_reference

# request 1 has no KV (its rows: out 0, lse -inf), request 3 no queries
QO, KV = [5, 3, 17, 0, 9], [40, 0, 17, 6, 70]


def batch(spec, seed=0):
    q, kv, table = random_batch(spec, QO, KV, 2, 3, generator=torch.Generator().manual_seed(seed))
    return q, kv, dict(table, qo_indptr=np.concatenate([[0], np.cumsum(QO)]).astype(np.int32))


SPEC = AttentionSpec(64, kv_layout=Paged(5), mask=Causal())
Q, KV_CACHE, TABLE = batch(SPEC)
REF, REF_LSE = reference_attention(SPEC, Q, KV_CACHE, **TABLE)
EMPTY_ROWS = slice(QO[0], QO[0] + QO[1])  # the rows of the request without KV


def kernel(edit=None, *, lse=True, other_buffer=False):
    """A stand-in kernel: writes the fp64 reference rounded to q's dtype (lse fp32) into the out it is given;
    ``edit(out, lse)`` then breaks it."""

    def run(out):
        assert torch.isnan(out).all(), "check_attention must hand run() a NaN-filled out"
        target = torch.empty_like(out) if other_buffer else out
        target[: REF.shape[0]] = REF.to(out.dtype)
        out_lse = torch.full(out.shape[:2], float("nan"))
        out_lse[: REF.shape[0]] = REF_LSE.float()
        if edit is not None:
            edit(target, out_lse)
        return (target, out_lse) if lse else target

    return run


def check(run, spec=SPEC, q=Q, kv=KV_CACHE, table=TABLE, **kw):
    return check_attention(run, spec, q, kv, device="cpu", **dict(table, **kw))


def test_the_reference_rounded_to_the_dtype_passes():
    out, lse = check(kernel())
    assert out.dtype == torch.bfloat16 and out.shape == (sum(QO), 6, 64) and lse.shape == (sum(QO), 6)
    assert bool((out[EMPTY_ROWS] == 0).all()) and bool(torch.isneginf(lse[EMPTY_ROWS]).all())


def test_the_same_dtype_math_passes():
    low, low_lse = same_dtype_reference(SPEC, Q, KV_CACHE, **TABLE)

    def run(out):
        out.copy_(low.to(out.dtype))
        return out, low_lse.float()

    check(run)


def test_a_perturbed_output_fails_naming_error_place_and_bound():
    def edit(out, lse):
        out[7, 4, 33] += 0.5

    with pytest.raises(AssertionError, match=r"^out: max \|out - fp64\| = .* at \(7, 4, 33\) .* exceeds the bound "
                                             r".* = 2 \* .* \(same-dtype error.*\) \+ .* \(noise floor"):
        check(kernel(edit))


def test_an_error_just_inside_the_bound_passes_and_just_outside_fails():
    low, _ = same_dtype_reference(SPEC, Q.float(), KV_CACHE, **TABLE)  # fp32 q: the same-dtype math in fp32
    bound = 2 * _max_error(low, REF)[0] + noise_floor(torch.float32, REF)
    for scale, fails in ((0.5, False), (1.5, True)):
        def run(out, scale=scale):  # fp32 out: the kernel's own rounding does not blur the edge
            out.copy_(REF.float())
            out[2, 1, 5] += scale * bound
            return out, REF_LSE.float()

        if fails:
            with pytest.raises(AssertionError, match=r"^out: .* at \(2, 1, 5\)"):
                check(run, q=Q.float())
        else:
            check(run, q=Q.float())


def test_a_nan_fails():
    def edit(out, lse):
        out[20, 0, 0] = float("nan")

    with pytest.raises(AssertionError, match=r"^out: NaN at \(20, 0, 0\) \(1 NaNs\)"):
        check(kernel(edit))


def test_a_row_the_kernel_never_writes_stays_nan_and_fails():
    def run(out):
        out[1:] = REF[1:].to(out.dtype)  # row 0 is skipped
        return out, REF_LSE.float()

    with pytest.raises(AssertionError, match=r"^out: NaN at \(0, 0, 0\) \(384 NaNs\)"):
        check(run)


def test_a_wrong_lse_fails():
    def edit(out, lse):
        lse[30, 5] += 0.25

    with pytest.raises(AssertionError, match=r"^lse: max \|lse - fp64\| = .* at \(30, 5\)"):
        check(kernel(edit))
    with pytest.raises(AssertionError, match=r"^lse: NaN at \(3, 2\)"):
        check(kernel(lambda out, lse: lse.__setitem__((3, 2), float("nan"))))


def test_a_wrong_fully_masked_row_fails():
    """Rows that see no key: out exactly 0 (within the bound) and lse exactly -inf, both ways round."""
    row = EMPTY_ROWS.start + 1
    with pytest.raises(AssertionError, match=rf"^lse: max \|lse - fp64\| = inf at \({row}, 3\)"):
        check(kernel(lambda out, lse: lse.__setitem__((row, 3), 0.0)))  # a finite lse for a row that sees nothing
    with pytest.raises(AssertionError, match=r"^lse: max \|lse - fp64\| = inf at \(0, 0\)"):
        check(kernel(lambda out, lse: lse.__setitem__((0, 0), float("-inf"))))  # -inf for a row that sees keys
    with pytest.raises(AssertionError, match=rf"^out: max \|out - fp64\| = .* at \({row}, 2, 9\)"):
        check(kernel(lambda out, lse: out.__setitem__((row, 2, 9), 0.5)))  # the row's out is not 0


def test_custom_mask_rows_that_see_nothing():
    spec = AttentionSpec(64, kv_layout=Ragged(), mask=CustomMask())
    q, kv, table = batch(spec, seed=1)
    gen = torch.Generator().manual_seed(2)
    masks = [torch.rand(a, b, generator=gen) < 0.5 for a, b in zip(QO, KV)]
    masks[0][2] = False  # row 2 sees nothing
    ref, ref_lse = reference_attention(spec, q, kv, custom_mask=masks, **table)
    assert bool(torch.isneginf(ref_lse[2]).all())

    def run(out, broken=False):
        out.copy_(ref.to(out.dtype))
        lse = ref_lse.float().clone()
        if broken:
            lse[2, 0] = -1e30
        return out, lse

    check_attention(run, spec, q, kv, device="cpu", custom_mask=masks, **table)
    with pytest.raises(AssertionError, match=r"^lse: max \|lse - fp64\| = inf at \(2, 0\)"):
        check_attention(lambda out: run(out, True), spec, q, kv, device="cpu", custom_mask=masks, **table)


def test_runtime_values_reach_the_reference():
    """The kernel ran with sm_scale 0.3; a check with the spec's default scale fails, with 0.3 passes."""
    ref, ref_lse = reference_attention(SPEC, Q, KV_CACHE, sm_scale=0.3, **TABLE)

    def run(out):
        out.copy_(ref.to(out.dtype))
        return out, ref_lse.float()

    check(run, sm_scale=0.3)
    with pytest.raises(AssertionError, match="^out: max"):
        check(run)


def test_fp8_kv_doubles_the_noise_floor():
    low, _ = same_dtype_reference(SPEC, Q.float(), KV_CACHE, **TABLE)
    base, floor = 2 * _max_error(low, REF)[0], noise_floor(torch.float32, REF)

    def run(out):  # between the bf16 bound and the fp8 one
        out.copy_(REF.float())
        out[4, 0, 0] += base + 1.5 * floor
        return out, REF_LSE.float()

    with pytest.raises(AssertionError, match=r"^out: .* at \(4, 0, 0\)"):
        check(run, q=Q.float())
    check(run, q=Q.float(), kv_dtype=torch.float8_e4m3fn)


def test_lse_is_required_unless_waived():
    with pytest.raises(AssertionError, match=r"^run: expected \(out, lse\), got Tensor"):
        check(kernel(lse=False))
    out, lse = check(kernel(lse=False), lse=False)
    assert lse is None and out.shape == REF.shape


def test_the_returned_out_must_be_the_poisoned_buffer():
    with pytest.raises(AssertionError, match="^out: run\\(\\) returned a tensor other than the poisoned buffer"):
        check(kernel(other_buffer=True))


def test_capacity_past_the_batch():
    """CUDA-graph wrappers: out has max_total_q rows, the batch's are checked."""
    out, lse = check(kernel(), rows=sum(QO) + 11)
    assert out.shape[0] == sum(QO) + 11 and bool(torch.isnan(out[sum(QO):]).all())


def test_assert_matches_reference_on_held_outputs():
    ref, ref_lse = assert_matches_reference(SPEC, Q, KV_CACHE, REF.to(torch.bfloat16), REF_LSE.float(), **TABLE)
    assert torch.equal(ref, REF) and torch.equal(ref_lse, REF_LSE)
    assert_matches_reference(SPEC, Q, KV_CACHE, REF.to(torch.bfloat16), **TABLE)  # out alone
    with pytest.raises(AssertionError, match=r"^out: shape \(4, 6, 64\) vs reference"):
        assert_matches_reference(SPEC, Q, KV_CACHE, REF[:4].to(torch.bfloat16), **TABLE)


def test_nan_out_and_cpu_poisoning():
    out = nan_out(SPEC, Q, rows=3, device="cpu")
    assert out.shape == (3, 6, 64) and out.dtype == torch.bfloat16 and bool(torch.isnan(out).all())
    poison_allocator((3, 6), torch.float32, "cpu")  # no caching allocator on the CPU: nothing to do


def test_testing_imports_only_spec_and_plan():
    """The oracle stays independent of what it checks: flashgen.testing imports flashgen.spec, flashgen.plan
    and itself, never the wrappers, codegen or a compiled kernel."""
    root = Path(__file__).resolve().parents[2] / "flashgen" / "testing"
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            for name in names:
                if name.split(".")[0] == "flashgen":
                    assert name.split(".")[1] in ("spec", "plan"), f"{path.name} imports {name}"
