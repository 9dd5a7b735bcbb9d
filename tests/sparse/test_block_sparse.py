"""BlockSparseWrapper on the CPU (CUDA calls stubbed, tests/stub_cuda.py): the page view of BSR patterns and the
inner wrapper's plan, run by the CPU executor, equal dense attention under the block mask; the dense K / V view;
the backend rule; every refusal, named."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashgen
from flashgen import ALiBi, AttentionSpec, Causal, CustomMask, Paged, Ragged, RoPE, SlidingWindow, SpecError
from flashgen.api.block_sparse import dense_pages, inner_backend
from flashgen.plan import PlanError, bsr_page_table, plan_block_sparse
from flashgen.spec import BlockSparse
from flashgen.testing import reference_attention
from flashgen.testing.executor import run_plan

from stub_cuda import on_device, stubbed_cuda

D = 64
BLOCKS = (1, 16, 64, 128)
DENSITIES = (0.0, 0.05, 0.5, 1.0)
# M and N of a block size: not multiples of it (but for 1), a few blocks each
ROWS = {1: 37, 16: 43, 64: 163, 128: 300}
COLS = {1: 41, 16: 42, 64: 154, 128: 290}


def random_pattern(rows: int, cols: int, density: float, gen: np.random.Generator):
    """A BSR pattern of about ``density`` of the blocks (exactly none at 0, all at 1); at densities in between
    block row 0 is empty and every other row keeps at least one block (N = 0: no blocks)."""
    present = gen.random((rows, cols)) < density
    if 0 < density < 1 and rows and cols:
        present[np.arange(1, rows), gen.integers(0, cols, max(rows - 1, 0))] = True
        present[0] = False
    indptr = np.concatenate([[0], np.cumsum(present.sum(1))])
    indices = np.flatnonzero(present.reshape(-1)) % cols if cols else np.zeros(0, np.int64)
    return indptr, indices


def inputs(m: int, n: int, hq: int, hkv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(m, hq, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(n, hkv, D, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v


def pages_of(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x [N, H, D]`` as ``[ceil(N / C), C, H, D]``, the tail of the last page NaN (read: the result shows it)."""
    pad = x.new_full((-x.shape[0] % c, *x.shape[1:]), float("nan"))
    return torch.cat([x, pad]).view(-1, c, *x.shape[1:])


def assert_same(a, b):
    assert torch.equal(torch.isneginf(a[1]), torch.isneginf(b[1]))
    assert torch.allclose(a[0], b[0], atol=1e-10, rtol=1e-9), float((a[0] - b[0]).abs().max())
    fin = torch.isfinite(b[1])
    assert torch.allclose(a[1][fin], b[1][fin], atol=1e-10, rtol=1e-9)


def wrapper_result(spec, indptr, indices, m, n, r, c, q, k, v, **plan_kwargs):
    """Plan with the wrapper (portable backend, stubbed) and run its inner plan on the CPU over the page view."""
    with stubbed_cuda():
        wrapper = flashgen.BlockSparseWrapper(spec, backend="portable", num_sms=132)
        wrapper.plan(indptr, indices, m, n, r, c, q.shape[1], k.shape[1], **plan_kwargs)
        inner = wrapper._planned[0]
    _, kv_indptr, kv_indices, last, _ = bsr_page_table(indptr, indices, block_q=r, block_kv=c, qo_len=m, kv_len=n)
    paged = spec.replace(kv_layout=Paged(c))
    return run_plan(inner._impl.last_plan, paged, q, (pages_of(k, c), pages_of(v, c)), kv_indptr=kv_indptr,
                    kv_indices=kv_indices, kv_last_page_len=last, **plan_kwargs)


def dense_reference(spec, indptr, indices, r, c, q, k, v, **runtime):
    return reference_attention(spec.replace(kv_layout=BlockSparse(r, c)), q, (k, v), bsr=(indptr, indices), **runtime)


@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("c", BLOCKS)
@pytest.mark.parametrize("r", BLOCKS)
def test_wrapper_plan_equals_dense_attention_under_the_block_mask(r, c, density):
    m, n = ROWS[r], COLS[c]
    group = 4 if DENSITIES.index(density) % 2 else 1
    seed = r * 1000 + c * 10 + DENSITIES.index(density)
    indptr, indices = random_pattern(-(-m // r), -(-n // c), density, np.random.default_rng(seed))
    q, k, v = inputs(m, n, 2 * group, 2, seed)
    spec = AttentionSpec(D, kv_layout=Ragged())
    ref = dense_reference(spec, indptr, indices, r, c, q, k, v)
    assert_same(wrapper_result(spec, indptr, indices, m, n, r, c, q, k, v), ref)
    if density == 0:
        assert (ref[0] == 0).all() and torch.isneginf(ref[1]).all()


@settings(max_examples=25, deadline=None)
@given(r=st.sampled_from(BLOCKS), c=st.sampled_from(BLOCKS), m=st.integers(0, 300), n=st.integers(0, 300),
       density=st.sampled_from(DENSITIES), group=st.sampled_from([1, 4]), seed=st.integers(0, 2**16))
def test_random_patterns_plan_and_page_view(r, c, m, n, density, group, seed):
    """The planner's own block-sparse plan and the wrapper's inner plan agree with the dense reference."""
    indptr, indices = random_pattern(-(-m // r), -(-n // c), density, np.random.default_rng(seed))
    q, k, v = inputs(m, n, group, 1, seed)
    spec = AttentionSpec(D, kv_layout=Ragged(), soft_cap=3.0)
    ref = dense_reference(spec, indptr, indices, r, c, q, k, v, sm_scale=0.2)
    plan = plan_block_sparse(indptr, indices, block_q=r, block_kv=c, qo_len=m, kv_len=n, num_qo_heads=group,
                             num_kv_heads=1, num_sms=8, tile_rows=16)
    assert_same(run_plan(plan, spec.replace(kv_layout=BlockSparse(r, c)), q, (k, v), sm_scale=0.2), ref)
    assert_same(wrapper_result(spec, indptr, indices, m, n, r, c, q, k, v, sm_scale=0.2), ref)


def test_page_view_lengths():
    # M = 7 rows of R = 3 (3 block rows), N = 10 keys of C = 4 (column blocks 0, 1 and the partial 2, 2 keys)
    qo, kv_indptr, kv_indices, last, lens = bsr_page_table([0, 2, 2, 4], [0, 2, 1, 2], block_q=3, block_kv=4,
                                                           qo_len=7, kv_len=10)
    assert qo.tolist() == [0, 3, 6, 7]
    assert kv_indices.tolist() == [0, 2, 1, 2] and last.tolist() == [2, 0, 2] and lens.tolist() == [6, 0, 6]


# ---------------------------------------------------------------------------------------------- the K / V view


@pytest.mark.parametrize("n, c", [(128, 64), (130, 64), (0, 16), (7, 1)])
def test_dense_pages_view_reads_pointers_and_strides(n, c):
    base = torch.zeros(n, 3, 2, D, dtype=torch.bfloat16)  # k and v interleaved in one buffer: strided views
    k, v = on_device(base[:, 0]), on_device(base[:, 1])
    spec = AttentionSpec(D, kv_layout=Paged(c))
    view = dense_pages(c)(spec, (k, v), 2)
    assert view.num_pages == -(-n // c)
    assert (view.stride_page, view.stride_token, view.stride_head) == (c * 3 * 2 * D, 3 * 2 * D, D)
    assert view.k.data_ptr() == k.data_ptr() and view.v.data_ptr() == v.data_ptr()
    if n % c == 0:  # what the Hopper kernel's TMA maps read: whole pages, no copy
        assert tuple(view.k.shape) == (n // c, c, 2, D)
        if n and c > 1:  # (torch re-strides an empty view and a dim of size 1; the kernels read the view's strides)
            assert view.k.stride()[:2] == (view.stride_page, 3 * 2 * D)
    else:  # the last page partial: the kernels get pointers and strides only
        assert view.k.dim() == 3


def test_dense_pages_view_checks_k_and_v():
    spec = AttentionSpec(D, kv_layout=Paged(16))
    k = on_device(torch.zeros(32, 2, D, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"kv_cache: expected the pair \(k, v\)"):
        dense_pages(16)(spec, k, 2)
    with pytest.raises(TypeError, match="expected dtype"):
        dense_pages(16)(spec, (k, on_device(torch.zeros(32, 2, D, dtype=torch.float16))), 2)
    with pytest.raises(ValueError, match=r"expected shape \[total_kv, 4, 64\]"):
        dense_pages(16)(spec, (k, k), 4)


# ---------------------------------------------------------------------------------------------- backends


@pytest.mark.parametrize("backend, n, c, expected", [
    ("auto", 1024, 64, "auto"),        # N a multiple of C: the Hopper kernel may load whole pages
    ("auto", 1000, 64, "portable"),    # the last block partial, and C a TMA page size: never past N
    ("auto", 1000, 128, "portable"),
    ("auto", 1000, 16, "portable"),
    ("auto", 1000, 1, "auto"),         # gathered page sizes read rows below the length only
    ("auto", 1000, 48, "auto"),
    ("sm90", 1000, 48, "sm90"),
    ("sm90", 1024, 64, "sm90"),
    ("portable", 1000, 64, "portable"),
])
def test_inner_backend_never_lets_tma_read_past_n(backend, n, c, expected):
    assert inner_backend(AttentionSpec(128, kv_layout=Paged(c)), backend, n, c) == expected


def test_forced_sm90_refuses_a_partial_tma_page():
    with pytest.raises(PlanError, match=r"^N: 1000 is not a multiple of C = 64; backend='sm90'"):
        inner_backend(AttentionSpec(128, kv_layout=Paged(64)), "sm90", 1000, 64)


def test_one_inner_wrapper_per_block_width():
    with stubbed_cuda():
        wrapper = flashgen.BlockSparseWrapper(AttentionSpec(D, kv_layout=Ragged()), backend="portable")
        wrapper.plan([0, 1], [0], 5, 20, 8, 16, 4, 2)
        first = wrapper._planned[0]
        wrapper.plan([0, 1, 1], [1], 9, 40, 8, 16, 4, 2)
        assert wrapper._planned[0] is first
        wrapper.plan([0, 1], [0], 5, 20, 8, 4, 4, 2)
        assert wrapper._planned[0] is not first and wrapper.backend == "portable"
        assert wrapper._planned[0].spec.kv_layout == Paged(4)


# ---------------------------------------------------------------------------------------------- refusals


def test_a_custom_mask_is_refused_at_construction():
    with pytest.raises(SpecError, match=r"^mask: BlockSparseWrapper takes NoMask\(\), Causal\(\) or SlidingWindow"):
        flashgen.BlockSparseWrapper(AttentionSpec(D, mask=CustomMask()))


@pytest.mark.parametrize("spec", [AttentionSpec(D, mask=Causal()), AttentionSpec(D, mask=SlidingWindow(8)),
                                  AttentionSpec(D, pos_encoding=RoPE()), AttentionSpec(D, pos_encoding=ALiBi())])
def test_masks_and_encodings_run_with_true_positions(spec):
    with stubbed_cuda(), mock.patch.object(torch.cuda, "get_device_capability", lambda *a: (9, 0)):
        hopper = flashgen.BlockSparseWrapper(spec, backend="sm90")  # page size 4: gathered, any N
        if not isinstance(spec.pos_encoding, RoPE):  # RoPE's scratch tensor maps need the driver
            hopper.plan([0, 2, 3], [0, 2, 1], 7, 10, 4, 4, 4, 2)
            assert hopper.backend == "sm90" and hopper._planned[0]._positions is not None
    with stubbed_cuda():
        wrapper = flashgen.BlockSparseWrapper(spec)
        wrapper.plan([0, 2, 3], [0, 2, 1], 7, 10, 4, 4, 4, 2)  # M = 7 rows, N = 10 keys, 4 x 4 blocks
        inner = wrapper._planned[0]
        assert wrapper.backend == "portable" and inner._impl.options == {"positions": True}
        assert inner._positions is not None


def test_constructor_arguments_are_checked():
    with pytest.raises(ValueError, match="^backend: got 'fast'"):
        flashgen.BlockSparseWrapper(AttentionSpec(D), backend="fast")
    with pytest.raises(SpecError, match="^kv_dtype"):
        flashgen.BlockSparseWrapper(AttentionSpec(D, kv_dtype="float8_e4m3fn"))
    with pytest.raises(SpecError, match="^head_dim"):
        flashgen.BlockSparseWrapper(AttentionSpec(192), backend="sm90")
    with pytest.raises(TypeError, match="^spec: expected an AttentionSpec"):
        flashgen.BlockSparseWrapper("d128")
    with pytest.raises(ValueError, match="^max_num_blocks: got -1"):
        flashgen.BlockSparseWrapper(AttentionSpec(D), max_num_blocks=-1)


GOOD = dict(indptr=[0, 1, 1], indices=[1], M=8, N=20, R=4, C=16, num_qo_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("change, message", [
    (dict(indptr=[0, 1]), r"^indptr: has 2 entries, expected ceil\(qo_len / block_q\) \+ 1 = 3"),
    (dict(indptr=[1, 1, 1]), r"^indptr\[0\] = 1, expected 0"),
    (dict(indptr=[0, 2, 1], indices=[0, 1]), r"^indptr\[2\] = 1 < indptr\[1\] = 2: must be non-decreasing"),
    (dict(indptr=[0, 1, 2], indices=[1]), r"^indptr\[-1\] = 2 > len\(indices\) = 1"),
    (dict(indices=[2]), r"^indices\[0\] = 2 is outside the column blocks \[0, 2\)"),
    (dict(indices=[-1]), r"^indices\[0\] = -1 is outside"),
    (dict(indptr=[0, 2, 2], indices=[1, 0]), r"^indices\[1\] = 0: each block row's indices must be sorted and unique"),
    (dict(indptr=[0, 2, 2], indices=[1, 1]), r"^indices\[1\] = 1: each block row's indices must be sorted and unique"),
    (dict(indices=[0.5]), r"^indices: dtype float64, expected an integer dtype"),
    (dict(R=0), r"^R: got 0, expected an int >= 1"),
    (dict(C=0), r"^C: got 0, expected an int >= 1"),
    (dict(C=2.0), r"^C: got 2.0, expected an int >= 1"),
    (dict(M=-1), r"^M: got -1, expected an int >= 0"),
    (dict(N=True), r"^N: got True, expected an int >= 0"),
    (dict(num_qo_heads=0), r"^num_qo_heads: got 0, expected an int >= 1"),
    (dict(num_qo_heads=3), r"^num_qo_heads: 3 is not a multiple of num_kv_heads = 2"),
    (dict(num_kv_heads=None), r"^num_kv_heads: got None, expected an int >= 1"),
])
def test_plan_errors_name_the_argument(change, message):
    args = {**GOOD, **change}
    with stubbed_cuda():
        wrapper = flashgen.BlockSparseWrapper(AttentionSpec(D, kv_layout=Ragged()), backend="portable")
        with pytest.raises(PlanError, match=message):
            wrapper.plan(*args.values())


def test_device_pattern_arrays_are_refused():
    with stubbed_cuda():
        wrapper = flashgen.BlockSparseWrapper(AttentionSpec(D, kv_layout=Ragged()), backend="portable")
        with pytest.raises(PlanError, match=r"^indices: is a \w+ tensor; planning reads host arrays only"):
            wrapper.plan(GOOD["indptr"], on_device(torch.tensor([1])), 8, 20, 4, 16, 4, 2)


def test_block_sparse_layout_pins_r_and_c():
    with stubbed_cuda():
        wrapper = flashgen.BlockSparseWrapper(AttentionSpec(D, kv_layout=BlockSparse(4, 16)), backend="portable")
        wrapper.plan(*GOOD.values())
        with pytest.raises(PlanError, match=r"^R, C: got 4 x 8, but the spec's layout is BlockSparse"):
            wrapper.plan(*{**GOOD, "C": 8}.values())


def test_run_checks_k_v_and_q():
    with stubbed_cuda():
        wrapper = flashgen.BlockSparseWrapper(AttentionSpec(D, kv_layout=Ragged()), backend="portable")
        with pytest.raises(RuntimeError, match="^run: call plan"):
            wrapper.run(None, None, None)
        wrapper.plan(*GOOD.values())
        q = on_device(torch.zeros(8, 4, D, dtype=torch.bfloat16))
        k = on_device(torch.zeros(20, 2, D, dtype=torch.bfloat16))
        wrapper.run(q, k, k)
        with pytest.raises(ValueError, match=r"^k: expected \[N = 20, num_kv_heads, dim\] \(the plan's N\), got \(16, 2, 64\)"):
            wrapper.run(q, k[:16], k)
        with pytest.raises(ValueError, match=r"^v: expected \[N = 20.*got Tensor|^v: expected \[N = 20.*got list"):
            wrapper.run(q, k, [k])
        with pytest.raises(ValueError, match=r"^q: expected shape \(8, 4, 64\)"):
            wrapper.run(q[:7], k, k)


def test_cuda_graph_mode_keeps_the_first_shape():
    with stubbed_cuda():
        wrapper = flashgen.BlockSparseWrapper(AttentionSpec(D, kv_layout=Ragged()), backend="portable",
                                              use_cuda_graph=True, max_num_blocks=4)
        with pytest.raises(PlanError, match="^M: got 0, a CUDA-graph wrapper needs M >= 1"):
            wrapper.plan([0], [], 0, 20, 4, 16, 4, 2)
        wrapper.plan(*GOOD.values())
        inner = wrapper._planned[0]
        assert inner.use_cuda_graph and (inner.max_batch_size, inner.max_total_q) == (2, 8)
        wrapper.plan([0, 2, 4], [0, 1, 0, 1], 8, 20, 4, 16, 4, 2)  # more blocks, up to max_num_blocks
        assert wrapper._planned[0] is inner
        with pytest.raises(PlanError, match=r"^M, N, R, C: got \(8, 36, 4, 16\), but a CUDA-graph wrapper keeps"):
            wrapper.plan([0, 1, 1], [2], 8, 36, 4, 16, 4, 2)
