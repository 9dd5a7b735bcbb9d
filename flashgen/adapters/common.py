"""What the engine adapters share: a step's page tables split into decode and prefill parts, and the two
wrappers that run them over an engine's cache in place.

An engine step is a batch of requests, each with ``qo_len`` new query tokens (1 for a decoding request) at the
end of its ``kv_len`` KV tokens (the new tokens included). Engines put decoding requests first (vLLM reorders
its batch so; a batch that does not is still right, it only runs every request through the prefill kernel):
the leading requests with one query token run through ``BatchDecodeWrapper``, the rest through a causal
``BatchPrefillWrapper``, both planned once a step and run once a layer, each writing its rows of one ``out``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..plan import PlanError, host_array
from ..spec import AttentionSpec, Causal, Paged


@dataclass(frozen=True)
class StepTables:
    """A step's ``plan()`` arguments, split at ``num_decodes``.

    ``decode``: keyword arguments of ``BatchDecodeWrapper.plan`` for requests ``[0, num_decodes)`` (their page
    table), or None; ``prefill``: those of ``BatchPrefillWrapper.plan`` for the rest (``qo_indptr`` rebased to
    0 and their page table), or None. Query rows ``[0, num_decodes)`` are the decode rows, ``[num_decodes,
    num_tokens)`` the prefill rows.
    """

    num_decodes: int
    num_tokens: int
    decode: dict | None
    prefill: dict | None


def leading_decodes(qo_lens: np.ndarray) -> int:
    """How many leading requests have exactly one query token (one numpy pass)."""
    other = np.flatnonzero(qo_lens != 1)
    return int(other[0]) if other.size else int(qo_lens.size)


def check_query_start_loc(name: str, value, batch: int) -> np.ndarray:
    """``value`` as host int64 offsets ``[batch + 1]`` that start at 0 and never decrease (``PlanError`` naming
    ``name``)."""
    qsl = host_array(name, value)
    if qsl.size != batch + 1:
        raise PlanError(f"{name}: has {qsl.size} entries, expected batch_size + 1 = {batch + 1} (seq_lens has "
                        f"{batch})")
    if qsl.size and qsl[0] != 0:
        raise PlanError(f"{name}: starts at {int(qsl[0])}, expected 0")
    steps = np.diff(qsl)
    if steps.size and int(steps.min()) < 0:
        b = int(np.argmax(steps < 0))
        raise PlanError(f"{name}: decreases at {b} ({int(qsl[b])} -> {int(qsl[b + 1])}), expected offsets of each "
                        "request's query tokens")
    return qsl


def check_lens(name: str, value) -> np.ndarray:
    lens = host_array(name, value)
    if lens.size and int(lens.min()) < 0:
        b = int(np.argmax(lens < 0))
        raise PlanError(f"{name}: {name}[{b}] = {int(lens[b])}, expected >= 0")
    return lens


def check_queries_fit(qo_lens: np.ndarray, kv_lens: np.ndarray, qo_name: str, kv_name: str) -> None:
    """Every request's query tokens are among its KV tokens (the new tokens are written before attention)."""
    if qo_lens.size and bool((qo_lens > kv_lens).any()):
        b = int(np.argmax(qo_lens > kv_lens))
        raise PlanError(f"{kv_name}: {kv_name}[{b}] = {int(kv_lens[b])} is shorter than request {b}'s "
                        f"{int(qo_lens[b])} query tokens ({qo_name}); the KV length counts the new tokens too")


def split_step(qo_indptr: np.ndarray, qo_lens: np.ndarray, table: dict, split_table) -> StepTables:
    """``StepTables`` of a batch whose page table is ``table`` (plan() keyword arguments); ``split_table(table,
    start, stop)`` gives the table of requests ``[start, stop)``."""
    batch = qo_lens.size
    nd = leading_decodes(qo_lens)
    decode = split_table(table, 0, nd) if nd else None
    prefill = None
    if nd < batch:
        prefill = {"qo_indptr": qo_indptr[nd:] - qo_indptr[nd], **split_table(table, nd, batch)}
    return StepTables(nd, int(qo_indptr[-1]), decode, prefill)


def split_block_table(table: dict, start: int, stop: int) -> dict:
    """Rows ``[start, stop)`` of a ``block_table`` / ``seq_lens`` table (views: no copy)."""
    return {"block_table": table["block_table"][start:stop], "seq_lens": table["seq_lens"][start:stop]}


def split_csr(table: dict, start: int, stop: int) -> dict:
    """Requests ``[start, stop)`` of a CSR table: ``kv_indptr`` rebased, ``kv_indices`` a view of their ids."""
    indptr = table["kv_indptr"]
    lo, hi = int(indptr[start]), int(indptr[stop])
    return {"kv_indptr": indptr[start: stop + 1] - lo, "kv_indices": table["kv_indices"][lo:hi],
            "kv_last_page_len": table["kv_last_page_len"][start:stop]}


class PagedStepAttention:
    """The decode and prefill wrappers of one engine, over a paged cache of ``page_size`` tokens a page.

    ``plan(tables, ...)`` once a step (``StepTables``), ``run(q, kv_cache)`` once a layer: ``q [num_tokens,
    num_qo_heads, head_dim]`` (rows past ``num_tokens``, e.g. an engine's CUDA-graph padding, are not read)
    -> ``out`` of q's shape (rows past ``num_tokens`` are left as they were). ``kv_cache`` as the wrappers take
    it: one ``[pages, 2, ...]`` tensor or a ``(k, v)`` pair, read in place.
    """

    def __init__(self, *, head_dim: int, page_size: int, dtype="bfloat16", kv_dtype=None, layout: str = "NHD",
                 soft_cap: float | None = None, device=None):
        self.decode_spec = AttentionSpec(head_dim, dtype=str(dtype).removeprefix("torch."),
                                         kv_dtype=None if kv_dtype is None else str(kv_dtype).removeprefix("torch."),
                                         kv_layout=Paged(page_size, layout), soft_cap=soft_cap)
        self.prefill_spec = replace(self.decode_spec, mask=Causal())
        self.device = device
        self._decode = self._prefill = None  # built on the first plan that needs them (they need a GPU)
        self.tables: StepTables | None = None

    def plan(self, tables: StepTables, *, num_qo_heads: int, num_kv_heads: int, sm_scale: float | None = None,
             num_pages: int | None = None) -> None:
        from ..api import BatchDecodeWrapper, BatchPrefillWrapper

        common = {"num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads, "sm_scale": sm_scale,
                  "num_pages": num_pages}
        if tables.decode is not None:
            if self._decode is None:
                self._decode = BatchDecodeWrapper(self.decode_spec, device=self.device)
            self._decode.plan(**tables.decode, **common)
        if tables.prefill is not None:
            if self._prefill is None:
                self._prefill = BatchPrefillWrapper(self.prefill_spec, device=self.device)
            self._prefill.plan(**tables.prefill, **common)
        self.tables = tables

    def run(self, q: torch.Tensor, kv_cache, out: torch.Tensor | None = None) -> torch.Tensor:
        tables = self.tables
        if tables is None:
            raise RuntimeError("run: call plan() first")
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[0] < tables.num_tokens:
            shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"q: expected [num_tokens >= {tables.num_tokens}, num_qo_heads, head_dim], got {shape}")
        if out is None:
            out = torch.empty(q.shape[0], q.shape[1], self.decode_spec.head_dim_vo, dtype=q.dtype, device=q.device)
        nd, n = tables.num_decodes, tables.num_tokens
        if tables.decode is not None:
            self._decode.run(q[:nd], kv_cache, out=out[:nd])
        if tables.prefill is not None:
            self._prefill.run(q[nd:n], kv_cache, out=out[nd:n])
        return out
