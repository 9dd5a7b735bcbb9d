"""flashgen's torch ops on the CPU: every op registered with a schema and a fake, ``torch.library.opcheck`` on each
(schema, autograd registration, fake tensors, AOT dispatch with dynamic shapes), run through CPU kernels of the
reference math (``cpu_ops``), and a toy decoder traced by ``torch.compile(fullgraph=True)`` matching eager."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).parent))

import flashgen.ops as ops  # noqa: E402
from cpu_ops import ReferenceWrapper, cpu_kernels  # noqa: E402
from flashgen import Llama31Scaling, RoPE  # noqa: E402
from flashgen.api import handles  # noqa: E402
from flashgen.ops import library  # noqa: E402
from flashgen.spec import AttentionSpec, Causal, Paged, Ragged  # noqa: E402
from toy_decoder import Batch, ToyDecoder, twin  # noqa: E402

BF16 = torch.bfloat16
OPS = {"decode_run", "decode_run_out", "prefill_run", "prefill_run_out", "cascade_run", "cascade_run_out",
       "block_sparse_run", "block_sparse_run_out", "variable_block_sparse_run", "variable_block_sparse_run_out",
       "attention", "merge_state", "merge_state_in_place", "merge_states", "append_kv"}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    with cpu_kernels():
        yield


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _paged_batch(seed=0):
    """A paged decode batch: spec, planned reference wrapper, q [3, 4, 64], cache [8 pages, 2, 4, 2, 64]."""
    gen = _gen(seed)
    spec = AttentionSpec(64, dtype="bfloat16", kv_layout=Paged(4))
    wrapper = ReferenceWrapper(spec)
    wrapper.plan(kv_indptr=[0, 3, 5, 6], kv_indices=[0, 1, 2, 5, 3, 7], kv_last_page_len=[2, 4, 1])
    q = torch.randn(3, 4, 64, generator=gen).to(BF16)
    cache = torch.randn(8, 2, 4, 2, 64, generator=gen).to(BF16)
    return spec, wrapper, q, cache


def test_every_public_op_is_registered():
    found = {name for name in OPS if hasattr(torch.ops.flashgen, name)}
    assert found == OPS
    assert torch.ops.flashgen.append_kv.default._schema.arguments[2].alias_info.is_write
    assert torch.ops.flashgen.decode_run_out.default._schema.arguments[4].alias_info.is_write


@pytest.mark.parametrize("name", sorted(library.RUN_OPS))
@pytest.mark.parametrize("return_lse", [False, True])
def test_opcheck_run_ops(name, return_lse):
    _, wrapper, q, cache = _paged_batch()
    k, v = cache[:, 0], cache[:, 1]
    pair = library.RUN_OPS[name]
    functional = getattr(torch.ops.flashgen, name)
    torch.library.opcheck(functional, (wrapper.op_handle, q, k, v, 64, return_lse))
    if not pair:
        torch.library.opcheck(functional, (wrapper.op_handle, q, cache, None, 64, return_lse))
    out = torch.empty_like(q)
    torch.library.opcheck(getattr(torch.ops.flashgen, f"{name}_out"), (wrapper.op_handle, q, k, v, out, return_lse))
    expected, lse = functional(wrapper.op_handle, q, k, v, 64, True)
    assert lse.shape == (3, 4) and torch.isfinite(lse).all()
    assert torch.equal(expected, wrapper.run(q, (k, v)))


@pytest.mark.parametrize("return_lse", [False, True])
def test_opcheck_attention(return_lse):
    gen = _gen(1)
    q, k, v = (torch.randn(n, h, 64, generator=gen).to(BF16) for n, h in ((5, 4), (7, 2), (7, 2)))
    torch.library.opcheck(torch.ops.flashgen.attention,
                          (q, k, v, None, True, 0.1, None, None, None, None, None, return_lse))
    spec = ops.spec_json(AttentionSpec(64, dtype="bfloat16", kv_layout=Ragged(), mask=Causal()))
    torch.library.opcheck(torch.ops.flashgen.attention,
                          (q, k, v, spec, False, None, None, None, None, None, None, return_lse))
    assert torch.equal(ops.attention(q, k, v, spec), ops.attention(q, k, v, causal=True))


def test_opcheck_merges():
    gen = _gen(2)
    v_a, v_b = (torch.randn(6, 4, 32, generator=gen).to(BF16) for _ in range(2))
    s_a, s_b = (torch.randn(6, 4, generator=gen) for _ in range(2))
    s_b[0] = float("-inf")
    torch.library.opcheck(torch.ops.flashgen.merge_state, (v_a, s_a, v_b, s_b))
    mask = torch.tensor([True, False, True, True, False, True])
    for m in (None, mask):
        torch.library.opcheck(torch.ops.flashgen.merge_state_in_place, (v_a.clone(), s_a.clone(), v_b, s_b, m))
    torch.library.opcheck(torch.ops.flashgen.merge_states,
                          (torch.randn(6, 3, 4, 32, generator=gen), torch.randn(6, 3, 4, generator=gen)))
    v, s = v_a.clone(), s_a.clone()
    ops.merge_state_in_place(v, s, v_b, s_b, mask)
    merged, lse = ops.merge_state(v_a, s_a, v_b, s_b)
    assert torch.equal(v[mask], merged[mask]) and torch.equal(v[~mask], v_a[~mask])
    assert torch.equal(s[mask], lse[mask])


@pytest.mark.parametrize("pair", [False, True])
def test_opcheck_append_kv(pair):
    gen = _gen(3)
    k, v = (torch.randn(3, 2, 64, generator=gen).to(BF16) for _ in range(2))
    cache = torch.zeros(4, 2, 4, 2, 64, dtype=BF16)
    caches = (cache[:, 0].clone(), cache[:, 1].clone()) if pair else (cache, None)
    slots, positions = torch.tensor([1, 6, 13]), torch.tensor([1, 2, 3])
    args = (k, v, *caches, None, None, None, None, positions, slots, "NHD", [10000.0, 1.0],
            [8.0, 1.0, 4.0, 8192.0], None, None, None, None, None)
    torch.library.opcheck(torch.ops.flashgen.append_kv, args)
    ops.append_kv(k, v, caches if pair else cache, slot_mapping=slots, positions=positions, rope=RoPE(),
                  rope_scaling=Llama31Scaling())
    written = caches[0] if pair else cache[:, 0]
    assert written.flatten(0, 1)[slots].abs().sum() > 0 and written.flatten(0, 1)[0].abs().sum() == 0


def test_fakes_give_the_eager_shapes():
    """Fake tensors only (no kernel runs, no wrapper is looked up): shapes and dtypes from the arguments."""
    with FakeTensorMode():
        q, cache = torch.empty(5, 8, 128, dtype=BF16), torch.empty(10, 2, 16, 2, 128, dtype=BF16)
        out, lse = torch.ops.flashgen.decode_run(12345, q, cache, None, 96, True)
        assert out.shape == (5, 8, 96) and out.dtype == BF16 and lse.shape == (5, 8) and lse.dtype == torch.float32
        assert torch.ops.flashgen.prefill_run(12345, q, cache, None, 128, False)[1].shape == (0,)
        lse = torch.ops.flashgen.cascade_run_out(12345, q, cache, None, torch.empty(5, 8, 128, dtype=BF16), True)
        assert lse.shape == (5, 8)
        v, s = torch.ops.flashgen.merge_states(torch.empty(5, 3, 8, 64), torch.empty(5, 3, 8))
        assert v.shape == (5, 8, 64) and s.shape == (5, 8)
        out, _ = torch.ops.flashgen.attention(q, torch.empty(9, 2, 128, dtype=BF16), torch.empty(9, 2, 64, dtype=BF16),
                                              None, True, None, None, None, None, None, None, False)
        assert out.shape == (5, 8, 64)


def test_eager_calls_skip_the_dispatcher(monkeypatch):
    _, wrapper, q, cache = _paged_batch()
    monkeypatch.setattr(library, "RUNS", {})  # any op-layer call would fail
    out, lse = ops.decode_run(wrapper, q, cache, return_lse=True)
    assert wrapper.runs == 1 and lse.shape == (3, 4)


def test_handles_name_their_wrapper_until_it_goes():
    spec, wrapper, q, cache = _paged_batch()
    handle = wrapper.op_handle
    assert handles.lookup(handle) is wrapper and ReferenceWrapper(spec).op_handle != handle
    del wrapper
    gc.collect()
    with pytest.raises(ValueError, match=f"handle: {handle} names no live flashgen wrapper"):
        torch.ops.flashgen.decode_run(handle, q, cache, None, 64, False)


def test_real_wrappers_register_a_handle():
    from stub_cuda import stubbed_cuda

    import flashgen

    with stubbed_cuda():
        spec = AttentionSpec(128, kv_layout=Paged(16))
        made = [flashgen.BatchDecodeWrapper(spec), flashgen.BatchPrefillWrapper(spec, backend="portable"),
                flashgen.CascadeWrapper(spec, device=torch.device("cuda", 0)),
                flashgen.BlockSparseWrapper(AttentionSpec(128), backend="portable"),
                flashgen.VariableBlockSparseWrapper(AttentionSpec(128), backend="portable")]
    assert all(handles.lookup(w.op_handle) is w for w in made)
    assert len({w.op_handle for w in made}) == len(made)


def test_bad_arguments_name_themselves():
    _, wrapper, q, cache = _paged_batch()
    with pytest.raises(ValueError, match="v_cache: block_sparse_run takes K and V as two tensors"):
        torch.ops.flashgen.block_sparse_run(wrapper.op_handle, q, cache, None, 64, False)
    with pytest.raises(Exception, match="kv_cache: expected a tensor or a"):  # Dynamo wraps it, message kept
        torch.compile(lambda q: ops.decode_run(wrapper, q, (cache,)), fullgraph=True, backend="eager")(q)
    spec = AttentionSpec(64, dtype="bfloat16", kv_layout=Ragged())
    with pytest.raises(Exception, match="spec: under torch.compile pass flashgen.ops.spec_json"):
        torch.compile(lambda q: ops.attention(q, q, q, spec), fullgraph=True, backend="eager")(q)


@torch.no_grad()  # inference: the ops have no backward
def _decode_loop(backend, steps: int = 3):
    """(eager outputs, compiled outputs) of a prefill and ``steps`` decode steps of the toy decoder."""
    torch._dynamo.reset()
    page_size, batch = 4, Batch([5, 9, 3], page_size=4, pages_each=4)
    eager = ToyDecoder(num_pages=12, page_size=page_size)
    traced = twin(eager)
    compiled = torch.compile(traced, fullgraph=True, backend=backend)
    prefill = ReferenceWrapper(AttentionSpec(64, dtype="bfloat16", kv_layout=Paged(page_size), mask=Causal()))
    decode = ReferenceWrapper(AttentionSpec(64, dtype="bfloat16", kv_layout=Paged(page_size)))
    gen = _gen(4)
    results = []
    tables, slots = batch.prefill()
    prefill.plan(**tables)  # plan() runs outside the compiled region
    x = torch.randn(int(tables["qo_indptr"][-1]), 128, generator=gen).to(BF16)
    results.append((eager(x, slots, prefill, False), compiled(x, slots, prefill, False)))
    for _ in range(steps):
        tables, slots = batch.decode()
        decode.plan(**tables)
        x = torch.randn(3, 128, generator=gen).to(BF16)
        results.append((eager(x, slots, decode, True), compiled(x, slots, decode, True)))
    assert torch.equal(eager.kv_cache, traced.kv_cache)
    return results


def test_toy_decoder_compiles_whole_and_matches_eager():
    seen = set()

    def recording(gm, example_inputs):  # the "eager" backend, noting which ops the graphs call
        seen.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    for want, got in _decode_loop(recording):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert {"flashgen.append_kv.default", "flashgen.prefill_run.default", "flashgen.decode_run.default"} <= seen


def test_toy_decoder_through_aot_autograd_matches_eager():
    """aot_eager functionalizes: append_kv's cache write becomes a functional op and a copy back into the buffer."""
    for want, got in _decode_loop("aot_eager"):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
