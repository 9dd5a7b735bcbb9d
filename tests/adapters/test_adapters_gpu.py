"""GPU tests of the engine adapters against the fp64 reference: a fresh random cache in the engine's layout
(NaN in every slot no request owns), the step's new tokens written through the adapter (append_kv with the
engine's slots), attention into NaN-poisoned outputs, a mixed batch (decodes first, then prefills) at page
sizes 1, 16, 17 and 256."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashgen import AttentionSpec, Causal, Ragged
from flashgen.adapters import SGLangAttention, VLLMAttention
from flashgen.testing.check import check_attention

from engine_batches import HEAD_DIM, HEADS, KV_HEADS, lengths, new_tokens, ragged, sglang_step, vllm_step

pytestmark = pytest.mark.cuda
PAGE_SIZES = (1, 16, 17, 256)
REF_SPEC = AttentionSpec(HEAD_DIM, kv_layout=Ragged(), mask=Causal())


def check(run, qo_lens, kv_lens, ks, vs, gen):
    kv, qo_indptr, kv_indptr = ragged(qo_lens, kv_lens, ks, vs)
    q = torch.randn(int(qo_indptr[-1]), HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    check_attention(lambda out: run(q.cuda(), out), REF_SPEC, q, kv, lse=False, qo_indptr=qo_indptr,
                    kv_indptr=kv_indptr)


@pytest.mark.parametrize("form", ["combined", "pair"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("num_decodes, num_prefills", [(3, 2), (4, 0), (0, 3)])
def test_vllm_adapter_matches_reference(page_size, form, num_decodes, num_prefills):
    seed = int(np.random.randint(1 << 30))
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    qo_lens, kv_lens = lengths(page_size, rng, num_decodes, num_prefills)
    cache, table, slots, ks, vs = vllm_step(page_size, qo_lens, kv_lens, gen)
    cache = cache.cuda()
    kv_cache = cache if form == "combined" else (cache[:, 0].contiguous(), cache[:, 1].contiguous())
    backend = VLLMAttention(num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=page_size)
    k_new, v_new = new_tokens(qo_lens, ks, vs)
    backend.write_kv(k_new.cuda(), v_new.cuda(), kv_cache, slots.cuda())
    qsl = np.concatenate([[0], np.cumsum(qo_lens)])
    backend.plan(query_start_loc=qsl, seq_lens=kv_lens, block_table=table.cuda())
    check(lambda q, out: backend.run(q, kv_cache, out=out), qo_lens, kv_lens, ks, vs, gen)


def test_vllm_adapter_reads_an_hnd_stride_order_in_place():
    """vLLM's FlashInfer backend with HND keeps the logical [num_blocks, 2, block_size, H, D] shape over HND
    memory: read through its strides, no copy."""
    gen = torch.Generator().manual_seed(5)
    qo_lens, kv_lens = lengths(16, np.random.default_rng(5))
    cache, table, slots, ks, vs = vllm_step(16, qo_lens, kv_lens, gen)
    hnd = cache.permute(0, 1, 3, 2, 4).contiguous().cuda().permute(0, 1, 3, 2, 4)  # HND memory, NHD shape
    backend = VLLMAttention(num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=16)
    k_new, v_new = new_tokens(qo_lens, ks, vs)
    backend.write_kv(k_new.cuda(), v_new.cuda(), hnd, slots.cuda())
    backend.plan(query_start_loc=np.concatenate([[0], np.cumsum(qo_lens)]), seq_lens=kv_lens, block_table=table.cuda())
    check(lambda q, out: backend.run(q, hnd, out=out), qo_lens, kv_lens, ks, vs, gen)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("extend", [True, False])
def test_sglang_adapter_matches_reference(page_size, extend):
    seed = int(np.random.randint(1 << 30))
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    qo_lens, kv_lens = lengths(page_size, rng, 3, 2 if extend else 0)
    r2t, rows, kbuf, vbuf, locs, ks, vs = sglang_step(page_size, qo_lens, kv_lens, gen)
    kbuf, vbuf = kbuf.cuda(), vbuf.cuda()
    backend = SGLangAttention(num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=page_size)
    k_new, v_new = new_tokens(qo_lens, ks, vs)
    backend.write_kv(k_new.cuda(), v_new.cuda(), kbuf, vbuf, locs.cuda())
    backend.plan(req_to_token=r2t.cuda(), req_pool_indices=rows.cuda(), seq_lens=kv_lens,
                 extend_seq_lens=qo_lens if extend else None)
    check(lambda q, out: backend.run(q, kbuf, vbuf, out=out), qo_lens, kv_lens, ks, vs, gen)
