"""Random engine steps in vLLM's and SGLang's cache layouts, with the dense K/V they hold (for the reference).

A step has ``num_decodes`` decoding requests (one new token) first, then prefill / extend requests; each
request's KV is ``kv_lens[b]`` tokens, the last ``qo_lens[b]`` of them new. Pages are handed out shuffled from
a pool with spare pages; every slot no request owns holds NaN, so a kernel reading one shows.
"""

from __future__ import annotations

import numpy as np
import torch

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


def lengths(page_size: int, rng: np.random.Generator, num_decodes: int = 3, num_prefills: int = 2):
    """(qo_lens, kv_lens): decodes first, KV lengths around a few pages, one empty-prefix prefill."""
    span = max(3 * page_size, 40)
    kv = rng.integers(1, span, size=num_decodes + num_prefills)
    qo = np.ones_like(kv)
    qo[num_decodes:] = [max(1, int(n) // (i + 1)) for i, n in enumerate(kv[num_decodes:])]
    if num_prefills:
        qo[num_decodes] = kv[num_decodes]  # a whole prompt
    return qo.astype(np.int64), kv.astype(np.int64)


def dense_kv(kv_lens, gen: torch.Generator, dtype=torch.bfloat16):
    ks = [torch.randn(int(n), KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for n in kv_lens]
    vs = [torch.randn(int(n), KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for n in kv_lens]
    return ks, vs


def vllm_step(page_size: int, qo_lens, kv_lens, gen: torch.Generator, *, spare_rows: int = 2, spare_cols: int = 2,
              dtype=torch.bfloat16):
    """A vLLM-style step: ``(cache [num_blocks, 2, P, H, D], block_table [rows, cols] int32, slot_mapping of the
    new tokens, ks, vs)``. The cache holds every request's context tokens; the new ones are only in ks / vs
    (the caller writes them through ``slot_mapping``). Unused block-table entries are -1 or a garbage id."""
    ks, vs = dense_kv(kv_lens, gen, dtype)
    blocks = -(-np.asarray(kv_lens) // page_size)
    num_blocks = int(blocks.sum()) + 3
    perm = torch.randperm(num_blocks, generator=gen).numpy()
    cols = int(blocks.max()) + spare_cols
    table = np.full((len(kv_lens) + spare_rows, cols), -1, dtype=np.int32)
    table[:, -1] = num_blocks + 7  # never read: past every request's blocks
    cache = torch.full((num_blocks, 2, page_size, KV_HEADS, HEAD_DIM), float("nan"), dtype=torch.float32).to(dtype)
    slots, at = [], 0
    for b, (n, q) in enumerate(zip(kv_lens, qo_lens)):
        ids = perm[at: at + blocks[b]]
        at += blocks[b]
        table[b, : blocks[b]] = ids
        pos = np.arange(int(n))
        slot = ids[pos // page_size] * page_size + pos % page_size
        ctx = int(n - q)
        flat = cache.view(num_blocks * 2, page_size, KV_HEADS, HEAD_DIM)
        for t in range(ctx):
            flat[2 * (slot[t] // page_size), slot[t] % page_size] = ks[b][t]
            flat[2 * (slot[t] // page_size) + 1, slot[t] % page_size] = vs[b][t]
        slots.append(slot[ctx:])
    return cache, torch.from_numpy(table), torch.from_numpy(np.concatenate(slots)).long(), ks, vs


def sglang_step(page_size: int, qo_lens, kv_lens, gen: torch.Generator, *, max_reqs: int = 9, dtype=torch.bfloat16):
    """An SGLang-style step: ``(req_to_token [max_reqs, max_context] int32, req_pool_indices [batch] int64,
    k_buffer, v_buffer [num_slots, H, D], out_cache_loc of the new tokens, ks, vs)``. Each request's slots
    are page-aligned runs of ``page_size`` in shuffled pages (one-token pages for page_size 1); slot 0 is
    SGLang's padding slot and no request's."""
    ks, vs = dense_kv(kv_lens, gen, dtype)
    blocks = -(-np.asarray(kv_lens) // page_size)
    num_pages = int(blocks.sum()) + 3
    perm = torch.randperm(num_pages - 1, generator=gen).numpy() + 1
    max_context = int(blocks.max()) * page_size + 5
    req_to_token = torch.randint(0, num_pages * page_size, (max_reqs, max_context), generator=gen, dtype=torch.int32)
    rows = torch.randperm(max_reqs, generator=gen)[: len(kv_lens)]
    kbuf = torch.full((num_pages * page_size, KV_HEADS, HEAD_DIM), float("nan"), dtype=torch.float32).to(dtype)
    vbuf = kbuf.clone()
    locs, at = [], 0
    for b, (n, q) in enumerate(zip(kv_lens, qo_lens)):
        ids = perm[at: at + blocks[b]]
        at += blocks[b]
        pos = np.arange(int(n))
        slot = ids[pos // page_size] * page_size + pos % page_size
        req_to_token[rows[b], : int(n)] = torch.from_numpy(slot.astype(np.int32))
        ctx = int(n - q)
        kbuf[slot[:ctx]] = ks[b][:ctx]
        vbuf[slot[:ctx]] = vs[b][:ctx]
        locs.append(slot[ctx:])
    return req_to_token, rows, kbuf, vbuf, torch.from_numpy(np.concatenate(locs)).long(), ks, vs


def ragged(qo_lens, kv_lens, ks, vs):
    """The dense batch the reference reads: ``(k, v)`` ragged and the indptrs."""
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    return (torch.cat(ks), torch.cat(vs)), qo_indptr, kv_indptr


def new_tokens(qo_lens, ks, vs):
    """The new tokens' K / V, in step order: the last qo_lens[b] rows of each request."""
    k = torch.cat([x[x.shape[0] - int(q):] for x, q in zip(ks, qo_lens)])
    v = torch.cat([x[x.shape[0] - int(q):] for x, q in zip(vs, qo_lens)])
    return k, v
