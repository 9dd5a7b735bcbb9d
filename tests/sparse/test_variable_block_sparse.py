"""VariableBlockSparseWrapper on the CPU (CUDA calls stubbed): the per-head page table, the inner plan run by the
CPU executor over the overlapping one-head pages of K / V, and run()'s regrouping of q and out, against the fp64
reference of each kv head under its own block mask; the backend rule and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashgen
from flashgen import ALiBi, AttentionSpec, Causal, CustomMask, Paged, Ragged, RoPE, SpecError
from flashgen.api.variable_block_sparse import head_pages, overlapping_pages_backend, variable_page_table
from flashgen.plan import PlanError
from flashgen.testing import reference_attention
from flashgen.testing.executor import run_plan

from stub_cuda import on_device, stubbed_cuda

D = 64
SPEC = AttentionSpec(D, kv_layout=Ragged())


def head_view(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """``x [N, Hkv, D]`` as the overlapping pages the kernel reads: page ``s * Hkv + h`` is head h's ``page_size``
    rows from token s (``[N * Hkv, page_size, 1, D]``); rows past N are NaN (a read there shows)."""
    n, hkv, d = x.shape
    padded = torch.cat([x, x.new_full((page_size, hkv, d), float("nan"))]).reshape(-1)
    return padded.as_strided((n * hkv, page_size, 1, d), (d, hkv * d, d, 1))


def per_head_reference(spec, q, k, v, masks, **runtime):
    """Each kv head's group of q heads against that head's K / V under its own [M, N] mask."""
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    outs, lses = [], []
    m, n = q.shape[0], k.shape[0]
    for h in range(hkv):
        o, s = reference_attention(spec.replace(mask=CustomMask()), q[:, h * group:(h + 1) * group].contiguous(),
                                   (k[:, h:h + 1], v[:, h:h + 1]), qo_indptr=[0, m], kv_indptr=[0, n],
                                   custom_mask=[masks[h]], **runtime)
        outs.append(o)
        lses.append(s)
    return torch.cat(outs, 1), torch.cat(lses, 1)


def token_masks(block_mask, row_sz, col_sz):
    """Each head's [M, N] bool mask of its blocks."""
    return [torch.from_numpy(np.repeat(np.repeat(np.asarray(b, bool), r, 0), c, 1)) for b, r, c in
            zip(block_mask, row_sz, col_sz)]


def random_sizes(rng, heads, blocks, total, unit):
    """``[heads, blocks]`` sizes (multiples of ``unit``, some 0) each summing to ``total``."""
    out = np.zeros((heads, blocks), np.int64)
    for h in range(heads):
        cuts = np.sort(rng.integers(0, total // unit + 1, blocks - 1)) * unit
        out[h] = np.diff(np.concatenate([[0], cuts, [total]]))
    return out


def emulated_run(inner, spec, page_size, k, v, runtime):
    """The inner wrapper's run() done by the CPU executor over the one-head pages (what the kernel reads)."""
    table = {}

    def run(q, kv, out=None, return_lse=False):
        plan = inner._impl.last_plan
        o, s = run_plan(plan, spec.replace(kv_layout=Paged(page_size)), q.double(),
                        (head_view(k, page_size), head_view(v, page_size)), **table, **runtime)
        out.copy_(o.to(out.dtype))
        return (out, s.float()) if return_lse else out
    return run, table


def run_variable(spec, mask, row_sz, col_sz, q, k, v, **runtime):
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    with stubbed_cuda():
        wrapper = flashgen.VariableBlockSparseWrapper(spec, backend="portable")
        wrapper.plan(mask, row_sz, col_sz, q.shape[1], hkv, **runtime)
        inner = wrapper._planned[0]
        _, _, p, _, kv_indptr, kv_indices, last = variable_page_table(mask, row_sz, col_sz)
        inner.run, table = emulated_run(inner, spec, p, k, v, runtime)
        table.update(kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=last)
        return wrapper.run(q, k, v, return_lse=True)


@settings(max_examples=30, deadline=None)
@given(hkv=st.integers(1, 3), group=st.sampled_from([1, 4]), rows=st.integers(1, 5), cols=st.integers(1, 5),
       unit=st.sampled_from([1, 8, 16]), density=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_each_head_attends_its_own_blocks(hkv, group, rows, cols, unit, density, seed):
    rng = np.random.default_rng(seed)
    m, n = int(rng.integers(0, 90)), int(rng.integers(1, 10)) * unit * 2
    row_sz = random_sizes(rng, hkv, rows, m, 1)
    col_sz = random_sizes(rng, hkv, cols, n, unit)
    mask = rng.random((hkv, rows, cols)) < density
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(m, hkv * group, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(n, hkv, D, generator=gen, dtype=torch.float64) for _ in range(2))
    spec = AttentionSpec(D, kv_layout=Ragged(), soft_cap=4.0)
    out, lse = run_variable(spec, mask, row_sz, col_sz, q, k, v, sm_scale=0.3)
    ref, ref_lse = per_head_reference(spec, q, k, v, token_masks(mask, row_sz, col_sz), sm_scale=0.3)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert torch.allclose(out, ref, atol=1e-10), float((out - ref).abs().max())
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse.double()[fin], ref_lse[fin], atol=1e-5)


def test_page_table_of_two_heads():
    # head 0: rows [2, 1], cols [4, 4]; head 1: rows [3, 0], cols [8, 0] -> pages of gcd = 4 tokens
    mask = np.array([[[1, 0], [1, 1]], [[1, 0], [0, 0]]], bool)
    m, n, p, qo, kv_indptr, kv_indices, last = variable_page_table(mask, [[2, 1], [3, 0]], [[4, 4], [8, 0]])
    assert (m, n, p) == (3, 8, 4)
    assert qo.tolist() == [0, 2, 3, 6, 6]
    assert kv_indptr.tolist() == [0, 1, 3, 5, 5] and last.tolist() == [4, 4, 4, 0]
    # page id s * Hkv + h: head 0 from tokens 0 | 0, 4; head 1 from tokens 0, 4
    assert kv_indices.tolist() == [0, 0, 8, 1, 9]


def test_head_pages_view():
    spec = AttentionSpec(D, kv_layout=Paged(4))
    k = on_device(torch.zeros(12, 3, D, dtype=torch.bfloat16))
    view = head_pages(4, 3)(spec, (k, k), 1)
    assert (view.stride_page, view.stride_token, view.num_pages) == (D, 3 * D, 36)
    strided = on_device(torch.zeros(12, 2, 3, D, dtype=torch.bfloat16)[:, 0])  # k of a [N, 2, Hkv, D] buffer
    with pytest.raises(ValueError, match=r"^k, v: strides .* expected a token's 3 heads side by side"):
        head_pages(4, 3)(spec, (strided, strided), 1)


@pytest.mark.parametrize("page_size, backend, expected", [
    (32, "auto", "portable"),   # a TMA page size: a map cannot describe overlapping pages
    (64, "auto", "portable"),
    (48, "auto", "auto"),       # gathered row by row by the sm90 kernel
    (1, "auto", "auto"),
    (1, "sm90", "sm90"),
    (48, "portable", "portable"),
])
def test_backend_rule(page_size, backend, expected):
    assert overlapping_pages_backend(AttentionSpec(128, kv_layout=Paged(page_size)), backend) == expected


def test_forced_sm90_refuses_tma_page_sizes():
    with stubbed_cuda():
        wrapper = flashgen.VariableBlockSparseWrapper(AttentionSpec(128, kv_layout=Ragged()), backend="sm90")
        with pytest.raises(PlanError, match=r"^block_col_sz: pages of gcd\(block_col_sz\) = 64 tokens"):
            wrapper.plan(np.ones((1, 1, 2), bool), [[10]], [[64, 128]], 4, 1)


def test_alibi_and_custom_masks_are_refused():
    with pytest.raises(SpecError, match="^pos_encoding: VariableBlockSparseWrapper runs each kv head's q heads"):
        flashgen.VariableBlockSparseWrapper(AttentionSpec(D, pos_encoding=ALiBi()))
    with pytest.raises(SpecError, match=r"^mask: VariableBlockSparseWrapper takes NoMask\(\), Causal\(\)"):
        flashgen.VariableBlockSparseWrapper(AttentionSpec(D, mask=CustomMask()))


@pytest.mark.parametrize("spec", [AttentionSpec(D, mask=Causal()), AttentionSpec(D, pos_encoding=RoPE())])
def test_causal_and_rope_run_with_true_positions(spec):
    with stubbed_cuda():
        wrapper = flashgen.VariableBlockSparseWrapper(spec)
        wrapper.plan(np.ones((2, 1, 2), bool), [[6], [6]], [[4, 8], [8, 4]], 4, 2)
        assert wrapper._planned[0]._impl.options == {"positions": True}


@pytest.mark.parametrize("args, message", [
    ((np.ones((1, 2), bool), [[1, 1]], [[4]]), r"^block_mask_map: expected bool \[num_kv_heads, MB, NB\]"),
    ((np.ones((1, 2, 1), bool), [[1]], [[4]]), r"^block_row_sz: has shape \(1, 1\), expected \[num_kv_heads, "
                                                r"blocks\] = \[1, 2\]"),
    ((np.ones((1, 1, 1), bool), [[1]], [[-4]]), r"^block_col_sz\[0, 0\] = -4, expected a size >= 0"),
    ((np.ones((2, 1, 1), bool), [[3], [4]], [[4], [4]]), r"^block_row_sz: head 1's blocks sum to 4, head 0's to 3"),
    ((np.ones((1, 1, 1), bool), [[1.5]], [[4]]), r"^block_row_sz: dtype float64, expected an integer dtype"),
])
def test_bad_patterns_name_the_argument(args, message):
    with pytest.raises(PlanError, match=message):
        variable_page_table(*args)


def test_plan_and_run_checks():
    with stubbed_cuda():
        wrapper = flashgen.VariableBlockSparseWrapper(SPEC, backend="portable")
        with pytest.raises(RuntimeError, match="^run: call plan"):
            wrapper.run(None, None, None)
        with pytest.raises(PlanError, match=r"^num_kv_heads: got 2, but block_mask_map has 1 heads"):
            wrapper.plan(np.ones((1, 1, 1), bool), [[5]], [[8]], 4, 2)
        with pytest.raises(PlanError, match=r"^num_qo_heads: 3 is not a multiple of num_kv_heads = 2"):
            wrapper.plan(np.ones((2, 1, 1), bool), [[5], [5]], [[8], [8]], 3, 2)
        wrapper.plan(np.ones((2, 1, 1), bool), [[5], [5]], [[8], [8]], 4, 2)
        k = on_device(torch.zeros(8, 2, D, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match=r"^q: expected shape \(5, 4, 64\)"):
            wrapper.run(on_device(torch.zeros(4, 4, D, dtype=torch.bfloat16)), k, k)
        with pytest.raises(ValueError, match=r"^v: expected \[N = 8, num_kv_heads, dim\]"):
            wrapper.run(on_device(torch.zeros(5, 4, D, dtype=torch.bfloat16)), k, k[:4])
