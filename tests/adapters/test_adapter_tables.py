"""The engine adapters' metadata translation on the CPU: vLLM's and SGLang's per-step metadata become the page
tables a hand-built flashgen plan would take, and attention through them (the fp64 reference) equals attention
over the dense K/V; bad metadata gets an error naming the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashgen import AttentionSpec, Causal, Paged, Ragged
from flashgen.adapters import SGLangAttention, VLLMAttention, sglang_tables, vllm_tables
from flashgen.plan import PlanError
from flashgen.testing.reference import reference_attention

from engine_batches import HEAD_DIM, HEADS, lengths, ragged, sglang_step, vllm_step

PAGE_SIZES = (1, 16, 17, 256)


def through_tables(tables, page_size, q, kv, order="NHD"):
    """fp64 attention of every request through the translated tables (decode part, then prefill part)."""
    spec = AttentionSpec(HEAD_DIM, kv_layout=Paged(page_size, order), mask=Causal())
    parts = []
    if tables.decode is not None:
        nd = tables.num_decodes
        parts.append(reference_attention(spec, q[:nd], kv, qo_indptr=np.arange(nd + 1), **tables.decode)[0])
    if tables.prefill is not None:
        parts.append(reference_attention(spec, q[tables.num_decodes: tables.num_tokens], kv, **tables.prefill)[0])
    return torch.cat(parts)


def dense(qo_lens, kv_lens, ks, vs, q):
    kv, qo_indptr, kv_indptr = ragged(qo_lens, kv_lens, ks, vs)
    spec = AttentionSpec(HEAD_DIM, kv_layout=Ragged(), mask=Causal())
    return reference_attention(spec, q, kv, qo_indptr=qo_indptr, kv_indptr=kv_indptr)[0]


def fill_new(cache_write, qo_lens, ks, vs, slots):
    """Write the new tokens at their slots (what the append kernel does on the GPU)."""
    k = torch.cat([x[x.shape[0] - int(n):] for x, n in zip(ks, qo_lens)])
    v = torch.cat([x[x.shape[0] - int(n):] for x, n in zip(vs, qo_lens)])
    cache_write(slots, k, v)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_vllm_tables_match_a_hand_built_plan(page_size):
    rng, gen = np.random.default_rng(page_size), torch.Generator().manual_seed(page_size)
    qo_lens, kv_lens = lengths(page_size, rng)
    cache, table, slots, ks, vs = vllm_step(page_size, qo_lens, kv_lens, gen)
    qsl = np.concatenate([[0], np.cumsum(qo_lens)])
    tables = vllm_tables(query_start_loc=qsl, seq_lens=kv_lens, block_table=table, block_size=page_size)
    assert tables.num_decodes == 3 and tables.num_tokens == qsl[-1]
    # the decode part is the block table's first rows, in place; the prefill part its next rows
    assert tables.decode["block_table"].data_ptr() == table.data_ptr()
    assert torch.equal(tables.decode["block_table"], table[:3]) and tables.decode["seq_lens"].tolist() == kv_lens[:3].tolist()
    assert torch.equal(tables.prefill["block_table"], table[3:5])
    assert tables.prefill["qo_indptr"].tolist() == (qsl[3:] - qsl[3]).tolist()

    def write(slots, k, v):
        flat = cache.view(-1, 2, page_size, *cache.shape[3:])
        flat[slots // page_size, 0, slots % page_size] = k
        flat[slots // page_size, 1, slots % page_size] = v

    fill_new(write, qo_lens, ks, vs, slots)
    q = torch.randn(int(qsl[-1]), HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    want = dense(qo_lens, kv_lens, ks, vs, q)
    torch.testing.assert_close(through_tables(tables, page_size, q, cache), want, rtol=0, atol=0)
    torch.testing.assert_close(through_tables(tables, page_size, q, tuple(cache.unbind(1))), want, rtol=0, atol=0)


def test_vllm_batches_of_one_kind():
    table = torch.zeros(2, 1, dtype=torch.int32)
    decode = vllm_tables(query_start_loc=[0, 1, 2], seq_lens=[3, 4], block_table=table, block_size=16)
    assert decode.num_decodes == 2 and decode.prefill is None
    prefill = vllm_tables(query_start_loc=[0, 5, 6], seq_lens=[5, 4], block_table=table, block_size=16)
    assert prefill.num_decodes == 0 and prefill.decode is None and prefill.prefill["qo_indptr"].tolist() == [0, 5, 6]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_sglang_tables_match_a_hand_built_plan(page_size):
    rng, gen = np.random.default_rng(page_size + 1), torch.Generator().manual_seed(page_size + 1)
    qo_lens, kv_lens = lengths(page_size, rng)
    r2t, rows, kbuf, vbuf, locs, ks, vs = sglang_step(page_size, qo_lens, kv_lens, gen)
    tables = sglang_tables(req_to_token=r2t, req_pool_indices=rows, seq_lens=kv_lens, extend_seq_lens=qo_lens,
                           page_size=page_size)
    # hand-built CSR: page j of request b is req_to_token[row, j * page_size] // page_size
    pages = [[int(r2t[rows[b], j * page_size]) // page_size for j in range(-(-int(n) // page_size))]
             for b, n in enumerate(kv_lens)]
    counts = np.array([len(p) for p in pages])
    last = [int(n) - (c - 1) * page_size for n, c in zip(kv_lens, counts)]
    nd = tables.num_decodes
    assert nd == 3
    assert tables.decode["kv_indptr"].tolist() == np.concatenate([[0], np.cumsum(counts[:nd])]).tolist()
    assert tables.decode["kv_indices"].tolist() == sum(pages[:nd], [])
    assert tables.decode["kv_indices"].dtype == torch.int32
    assert tables.decode["kv_last_page_len"].tolist() == last[:nd]
    assert tables.prefill["kv_indptr"].tolist() == np.concatenate([[0], np.cumsum(counts[nd:])]).tolist()
    assert tables.prefill["kv_indices"].tolist() == sum(pages[nd:], [])
    assert tables.prefill["kv_last_page_len"].tolist() == last[nd:]

    fill_new(lambda s, k, v: (kbuf.index_put_((s,), k), vbuf.index_put_((s,), v)), qo_lens, ks, vs, locs)
    q = torch.randn(int(qo_lens.sum()), HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    n = kbuf.shape[0] // page_size
    kv = (kbuf[: n * page_size].unflatten(0, (n, page_size)), vbuf[: n * page_size].unflatten(0, (n, page_size)))
    torch.testing.assert_close(through_tables(tables, page_size, q, kv), dense(qo_lens, kv_lens, ks, vs, q),
                               rtol=0, atol=0)


def test_sglang_decode_step_has_one_token_a_request():
    r2t = torch.arange(20, dtype=torch.int32).view(4, 5)
    tables = sglang_tables(req_to_token=r2t, req_pool_indices=torch.tensor([2, 0]), seq_lens=[3, 5])
    assert tables.num_decodes == 2 and tables.prefill is None
    assert tables.decode["kv_indices"].tolist() == [10, 11, 12, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("kwargs, match", [
    ({"block_table": torch.zeros(2, 1, dtype=torch.int32)}, r"block_table: 1 columns of 16 tokens .* seq_lens\[1\] = 20"),
    ({"block_table": torch.zeros(1, 4, dtype=torch.int32)}, r"block_table: has 1 rows, fewer than the 2"),
    ({"block_table": torch.zeros(2, 4, dtype=torch.float32)}, r"block_table: expected an int32"),
    ({"block_table": torch.zeros(2, 4, 1, dtype=torch.int32)}, r"block_table: expected an int32"),
    ({"query_start_loc": [0, 1]}, r"query_start_loc: has 2 entries, expected batch_size \+ 1 = 3"),
    ({"query_start_loc": [1, 2, 3]}, r"query_start_loc: starts at 1"),
    ({"query_start_loc": [0, 3, 2]}, r"query_start_loc: decreases at 1"),
    ({"seq_lens": [5, -1]}, r"seq_lens: seq_lens\[1\] = -1"),
    ({"query_start_loc": [0, 1, 30]}, r"seq_lens: seq_lens\[1\] = 20 is shorter than request 1's 29 query tokens"),
])
def test_vllm_bad_metadata_names_the_argument(kwargs, match):
    args = {"query_start_loc": [0, 1, 2], "seq_lens": [5, 20], "block_table": torch.zeros(2, 4, dtype=torch.int32),
            "block_size": 16, **kwargs}
    with pytest.raises(PlanError, match=match):
        vllm_tables(**args)


@pytest.mark.parametrize("cache, match", [
    (torch.zeros(4, 16, 2, 64), r"kv_cache: expected \[num_blocks, 2, block_size"),
    (torch.zeros(4, 3, 16, 2, 64), r"kv_cache: expected \[num_blocks, 2, block_size"),
    ((torch.zeros(4, 16, 2, 64),), r"kv_cache: expected one"),
    ((torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2)), r"kv_cache: expected one"),
])
def test_vllm_bad_cache_names_kv_cache(cache, match):
    backend = VLLMAttention(num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    with pytest.raises(ValueError, match=match):
        backend.run(torch.zeros(1, 4, 64), cache)
    with pytest.raises(ValueError, match=match):
        backend.write_kv(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), cache, torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize("kwargs, match", [
    ({"req_to_token": torch.zeros(4, dtype=torch.int32)}, r"req_to_token: expected an int32 \[max_reqs, max_context\]"),
    ({"req_to_token": torch.zeros(4, 8)}, r"req_to_token: expected an int32"),
    ({"seq_lens": [3, 9]}, r"seq_lens: seq_lens\[1\] = 9 exceeds req_to_token's max_context = 8"),
    ({"req_pool_indices": torch.tensor([0])}, r"req_pool_indices: expected an int tensor of \[2\]"),
    ({"extend_seq_lens": [1]}, r"extend_seq_lens: has 1 entries, expected 2"),
    ({"extend_seq_lens": [1, 6]}, r"seq_lens: seq_lens\[1\] = 5 is shorter than request 1's 6 query tokens"),
    ({"page_size": 0}, r"page_size: got 0"),
])
def test_sglang_bad_metadata_names_the_argument(kwargs, match):
    args = {"req_to_token": torch.zeros(4, 8, dtype=torch.int32), "req_pool_indices": torch.tensor([0, 1]),
            "seq_lens": [3, 5], **kwargs}
    with pytest.raises(PlanError, match=match):
        sglang_tables(**args)


def test_sglang_bad_buffer_names_it():
    backend = SGLangAttention(num_qo_heads=4, num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match=r"k_buffer: expected a token buffer \[num_slots, num_kv_heads, head_dim\]"):
        backend.run(torch.zeros(1, 4, 64), torch.zeros(8, 1, 2, 64), torch.zeros(8, 2, 64))
    with pytest.raises(ValueError, match=r"v_buffer: expected a token buffer"):
        backend.write_kv(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), torch.zeros(8, 2, 64), torch.zeros(8, 2),
                         torch.zeros(1, dtype=torch.long))


def test_run_before_plan_is_an_error():
    backend = VLLMAttention(num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    with pytest.raises(RuntimeError, match="plan"):
        backend.run(torch.zeros(1, 4, 64), torch.zeros(4, 2, 16, 2, 64))
