"""A vLLM-style attention backend over vLLM's own paged cache, read and written in place.

vLLM's layouts (``vllm/v1/attention/backends/flashinfer.py`` and ``flash_attn.py``; names as vLLM spells them):

- the cache of a layer: one tensor ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (the FlashInfer
  backend's shape; an HND stride order keeps that shape and is read through its strides) or a K/V pair of
  ``[num_blocks, block_size, num_kv_heads, head_dim]`` (the FlashAttention backend's ``[2, num_blocks, ...]``
  tensor is that pair: ``kv_cache.unbind(0)``);
- per step: ``query_start_loc [num_reqs + 1]`` (offsets of each request's query tokens; decoding requests
  first), ``seq_lens [num_reqs]`` (KV tokens of each request, the new ones included), ``block_table
  [num_reqs, max_blocks]`` int32 (rows past ``num_reqs`` are ignored) and ``slot_mapping [num_tokens]``
  (``block * block_size + offset`` of each new token, -1 for padding).

Example (one engine step; ``*_cpu`` are the host copies vLLM keeps of its metadata)::

    backend = VLLMAttention(num_qo_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
    backend.plan(query_start_loc=qsl_cpu, seq_lens=seq_lens_cpu, block_table=block_table_gpu)   # once a step
    for layer in range(num_layers):
        backend.write_kv(k, v, kv_caches[layer], slot_mapping)       # k, v [num_tokens, 8, 128]
        out = backend.run(q, kv_caches[layer])                       # q [num_tokens, 32, 128]
"""

from __future__ import annotations

import numpy as np
import torch

from ..plan import PlanError
from .common import (PagedStepAttention, StepTables, check_lens, check_queries_fit, check_query_start_loc,
                     split_block_table, split_step)


def vllm_tables(*, query_start_loc, seq_lens, block_table, block_size: int) -> StepTables:
    """vLLM's per-step metadata as flashgen ``plan()`` arguments (pure host work: lengths are read, page ids
    stay where they are).

    ``query_start_loc [num_reqs + 1]`` and ``seq_lens [num_reqs]``: host int arrays (vLLM's ``*_cpu`` copies;
    ``plan()`` reads lengths on the host so that it never waits for the GPU). ``block_table [>= num_reqs,
    max_blocks]`` int32, host or device: its first ``num_reqs`` rows are used, as views. Raises ``PlanError``
    naming the argument: offsets that do not start at 0 or decrease, a request with more query tokens than KV
    tokens, a block table with fewer rows than requests or too few columns for the longest request.

    >>> t = vllm_tables(query_start_loc=[0, 1, 2, 7], seq_lens=[9, 17, 5], block_table=torch.zeros(3, 2,
    ...                 dtype=torch.int32), block_size=16)
    >>> t.num_decodes, t.decode["seq_lens"].tolist(), t.prefill["qo_indptr"].tolist()
    (2, [9, 17], [0, 5])
    """
    lens = check_lens("seq_lens", seq_lens)
    qsl = check_query_start_loc("query_start_loc", query_start_loc, lens.size)
    qo_lens = np.diff(qsl)
    check_queries_fit(qo_lens, lens, "query_start_loc", "seq_lens")
    if not isinstance(block_table, torch.Tensor):
        block_table = torch.as_tensor(np.asarray(block_table))
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise PlanError(f"block_table: expected an int32 [num_reqs, max_blocks] tensor, got {block_table.dtype} "
                        f"{tuple(block_table.shape)}")
    if block_table.shape[0] < lens.size:
        raise PlanError(f"block_table: has {block_table.shape[0]} rows, fewer than the {lens.size} requests of "
                        "seq_lens")
    width = block_table.shape[1]
    longest = int(lens.max(initial=0))
    if longest > width * block_size:
        b = int(np.argmax(lens))
        raise PlanError(f"block_table: {width} columns of {block_size} tokens hold {width * block_size} tokens, "
                        f"but seq_lens[{b}] = {longest} needs {-(-longest // block_size)} columns")
    table = {"block_table": block_table[: lens.size], "seq_lens": lens}
    return split_step(qsl, qo_lens, table, split_block_table)


class VLLMAttention:
    """Attention over vLLM's paged cache: plan once a step from vLLM's metadata, run once a layer.

    ``block_size`` is any page size (1, 16, 17, 256 ...); ``layout``: ``"NHD"`` (vLLM's logical shape, also for
    an HND stride order) or ``"HND"`` for caches shaped ``[num_blocks, 2, num_kv_heads, block_size,
    head_dim]``. ``dtype``: q's (fp16 / bf16), ``kv_dtype``: the cache's (default q's). ``soft_cap``: a logits
    soft-cap (vLLM's ``logits_soft_cap``), ``sm_scale`` at plan() (vLLM's ``scale``).
    """

    def __init__(self, *, num_qo_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype="bfloat16", kv_dtype=None, layout: str = "NHD", soft_cap: float | None = None, device=None):
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.block_size, self.layout = block_size, layout
        self._attention = PagedStepAttention(head_dim=head_dim, page_size=block_size, dtype=dtype, kv_dtype=kv_dtype,
                                             layout=layout, soft_cap=soft_cap, device=device)
        self.tables: StepTables | None = None

    def plan(self, *, query_start_loc, seq_lens, block_table, sm_scale: float | None = None,
             num_blocks: int | None = None) -> StepTables:
        """Plan a step (``vllm_tables`` for the arguments; ``num_blocks``, the pool's size, bounds host block
        ids here). Returns the ``StepTables`` planned."""
        tables = vllm_tables(query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                             block_size=self.block_size)
        self._attention.plan(tables, num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                             sm_scale=sm_scale, num_pages=num_blocks)
        self.tables = tables
        return tables

    def run(self, q: torch.Tensor, kv_cache, out: torch.Tensor | None = None) -> torch.Tensor:
        """``q [num_tokens, num_qo_heads, head_dim]`` (contiguous; rows past the step's tokens are not read) over
        this layer's ``kv_cache`` (one tensor or a K/V pair, as vLLM holds it) -> ``out`` of q's shape."""
        return self._attention.run(q, self._cache(kv_cache), out)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache, slot_mapping: torch.Tensor) -> None:
        """Write the step's new ``key`` / ``value`` ``[num_tokens, num_kv_heads, head_dim]`` into ``kv_cache`` at
        ``slot_mapping`` (vLLM's ``reshape_and_cache_flash``; -1 skips a token): ``flashgen.append_kv``."""
        from ..api import append_kv

        append_kv(key, value, self._cache(kv_cache), slot_mapping=slot_mapping, kv_layout=self.layout)

    def _cache(self, kv_cache):
        """``kv_cache`` checked for vLLM's forms (rank and the K/V axis; the wrappers check the rest)."""
        if isinstance(kv_cache, (tuple, list)):
            if len(kv_cache) != 2 or any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in kv_cache):
                raise ValueError("kv_cache: expected one [num_blocks, 2, block_size, num_kv_heads, head_dim] tensor "
                                 "or a (k, v) pair of [num_blocks, block_size, num_kv_heads, head_dim] tensors")
            return tuple(kv_cache)
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            shape = tuple(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__
            raise ValueError(f"kv_cache: expected [num_blocks, 2, block_size, num_kv_heads, head_dim] (5 dims, K and V "
                             f"on dim 1) or a (k, v) pair, got {shape} (a [2, num_blocks, ...] cache: pass "
                             "kv_cache.unbind(0))")
        return kv_cache
