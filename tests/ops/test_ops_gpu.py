"""flashgen's torch ops on the GPU: a toy decoder (2 layers, paged prefill then decode, append_kv into a cache held as a
module buffer) under ``torch.compile(fullgraph=True)`` matches eager, and with ``mode="reduce-overhead"`` its CUDA-graph
replays match eager step after step, with the same plan and after re-planning a growing batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import flashgen  # noqa: E402
import flashgen.ops as ops  # noqa: E402
from flashgen.spec import AttentionSpec, Causal, Paged  # noqa: E402
from toy_decoder import Batch, ToyDecoder, twin  # noqa: E402

pytestmark = pytest.mark.cuda

PAGE_SIZE, PAGES_EACH, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 16, 4, 8, 2, 128, 256
PROMPTS = [37, 5, 20]
TOL = {"atol": 3e-2, "rtol": 3e-2}  # bf16: the compiled graph may fuse the residual adds differently


def _setup(graph: bool):
    batch = Batch(PROMPTS, PAGE_SIZE, PAGES_EACH)
    eager = ToyDecoder(hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                       num_pages=len(PROMPTS) * PAGES_EACH, page_size=PAGE_SIZE, device="cuda")
    traced = twin(eager)
    torch._dynamo.mark_static_address(traced.kv_cache)  # a graph replay reads and writes the cache in place
    prefill = flashgen.BatchPrefillWrapper(AttentionSpec(HEAD_DIM, dtype="bfloat16", kv_layout=Paged(PAGE_SIZE),
                                                         mask=Causal()))
    options = {"use_cuda_graph": True, "max_batch_size": len(PROMPTS),
               "max_num_pages": len(PROMPTS) * PAGES_EACH} if graph else {}
    decode = flashgen.BatchDecodeWrapper(AttentionSpec(HEAD_DIM, dtype="bfloat16", kv_layout=Paged(PAGE_SIZE)),
                                         **options)
    return batch, eager, traced, prefill, decode


def _plan(wrapper, tables):
    wrapper.plan(**tables, num_qo_heads=HEADS, num_kv_heads=KV_HEADS)


def _inputs(gen, rows, slots):
    return torch.randn(rows, HIDDEN, generator=gen).to("cuda", torch.bfloat16), slots.cuda()


@torch.no_grad()
def test_toy_decoder_compiled_matches_eager():
    torch._dynamo.reset()
    batch, eager, traced, prefill, decode = _setup(graph=False)
    compiled = torch.compile(traced, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    tables, slots = batch.prefill()
    _plan(prefill, tables)
    x, slots = _inputs(gen, sum(PROMPTS), slots)
    torch.testing.assert_close(compiled(x, slots, prefill, False), eager(x, slots, prefill, False), **TOL)
    for _ in range(4):
        tables, slots = batch.decode()
        _plan(decode, tables)
        x, slots = _inputs(gen, len(PROMPTS), slots)
        torch.testing.assert_close(compiled(x, slots, decode, True), eager(x, slots, decode, True), **TOL)
    torch.testing.assert_close(traced.kv_cache, eager.kv_cache, **TOL)


@torch.no_grad()
@pytest.mark.parametrize("replan", [False, True], ids=["same-plan", "replanned"])
def test_toy_decoder_cuda_graph_replays_match_eager(replan):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    batch, eager, traced, prefill, decode = _setup(graph=True)
    step = torch.compile(traced, fullgraph=True, mode="reduce-overhead")
    gen = torch.Generator().manual_seed(1)
    tables, slots = batch.prefill()
    _plan(prefill, tables)
    x, slots = _inputs(gen, sum(PROMPTS), slots)
    eager(x, slots, prefill, False)
    traced(x, slots, prefill, False)  # the prefill runs eagerly on both (its plan changes its grid)
    tables, slots = batch.decode()
    _plan(decode, tables)
    for i in range(6):  # warm-up, capture, then replays
        if replan and i:
            tables, slots = batch.decode()
            _plan(decode, tables)
        x, slots_d = _inputs(gen, len(PROMPTS), slots)
        torch.compiler.cudagraph_mark_step_begin()
        got = step(x, slots_d, decode, True).clone()
        torch.testing.assert_close(got, eager(x, slots_d, decode, True), **TOL, msg=lambda m: f"step {i}: {m}")
    assert not torch._dynamo.utils.counters["inductor"]["cudagraph_skips"], "the step was not captured"
    torch.testing.assert_close(traced.kv_cache, eager.kv_cache, **TOL)


@torch.no_grad()
def test_attention_and_merges_compiled_match_eager():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, h, 128, generator=gen).to("cuda", torch.bfloat16) for n, h in ((33, 8), (70, 2), (70, 2)))

    def split_attention(q, k, v):  # attention over two halves of the keys, merged, against one call
        o_a, s_a = ops.attention(q, k[:35], v[:35], return_lse=True)
        o_b, s_b = ops.attention(q, k[35:], v[35:], return_lse=True)
        o, s = ops.merge_state(o_a, s_a, o_b, s_b)
        both = ops.merge_states(torch.stack([o_a, o_b], 1), torch.stack([s_a, s_b], 1))[0]
        ops.merge_state_in_place(o_a, s_a, o_b, s_b)
        return o, both, o_a

    compiled = torch.compile(split_attention, fullgraph=True)
    whole = flashgen.attention(q, k, v)
    for got, want in zip(compiled(q, k, v), split_attention(q, k, v)):
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(got, whole, **TOL)
