"""Attention for one engine step: decode rows (one query token each) and prefill chunks (causal, aligned to the
end of each request's KV), planned once per step and run once per layer.

Two backends behind one interface: ``WrapperAttention`` (the GPU kernels: ``BatchDecodeWrapper`` for the
decode rows, ``BatchPrefillWrapper`` with a paged causal spec for the chunks) and ``ReferenceAttention`` (the
same page tables through ``flashgen.testing.reference.reference_attention``, fp64, on any machine). Rows of a
step are ordered decode rows first, then the prefill chunks.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kvcache import PageTables
from ..spec import AttentionSpec, Causal, Paged


def specs(head_dim: int, page_size: int, dtype: str) -> tuple[AttentionSpec, AttentionSpec]:
    """The decode and prefill specs of the loop: paged NHD, no positional encoding (the cache holds rotated K)."""
    decode = AttentionSpec(head_dim, dtype=dtype, kv_layout=Paged(page_size))
    prefill = AttentionSpec(head_dim, dtype=dtype, kv_layout=Paged(page_size), mask=Causal())
    return decode, prefill


class StepPlan:
    """One step's batch: ``decode`` (page tables of the decode rows' requests, or None) and ``prefill``
    (``(qo_indptr [batch + 1] int32, tables)`` of the chunked requests, or None)."""

    def __init__(self, decode: PageTables | None, prefill: tuple[np.ndarray, PageTables] | None):
        self.decode, self.prefill = decode, prefill
        self.num_decode = 0 if decode is None else int(decode.seq_lens.numel())


class ReferenceAttention:
    """fp64 reference attention over the manager's CSR tables (CPU or GPU tensors; slow, exact)."""

    name = "fp64 reference"

    def __init__(self, head_dim: int, page_size: int, num_qo_heads: int, num_kv_heads: int):
        # the reference reads the layout and the mask of a spec, not its dtype: fp64 math over any K/V dtype
        self.decode_spec, self.prefill_spec = specs(head_dim, page_size, "bfloat16")
        self.num_qo_heads, self.num_kv_heads = num_qo_heads, num_kv_heads
        self._plan: StepPlan | None = None

    def plan(self, step: StepPlan, num_pages: int) -> None:
        self._plan = step

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``q [rows, num_qo_heads, head_dim]`` (decode rows, then prefill rows) -> out, q's dtype and shape."""
        step, parts = self._plan, []
        if step.decode is not None:
            n = step.num_decode
            out, _ = _reference(self.prefill_spec, q[:n], kv, np.arange(n + 1, dtype=np.int32), step.decode)
            parts.append(out)
        if step.prefill is not None:
            qo_indptr, tables = step.prefill
            out, _ = _reference(self.prefill_spec, q[step.num_decode:], kv, qo_indptr, tables)
            parts.append(out)
        return torch.cat(parts).to(q.dtype)


def _reference(spec: AttentionSpec, q: torch.Tensor, kv, qo_indptr: np.ndarray, tables: PageTables):
    from ..testing.reference import reference_attention

    return reference_attention(spec, q, kv, qo_indptr=qo_indptr, kv_indptr=tables.kv_indptr,
                               kv_indices=tables.kv_indices_host, kv_last_page_len=tables.kv_last_page_len)


class WrapperAttention:
    """The GPU path: one ``BatchDecodeWrapper`` and one ``BatchPrefillWrapper`` (paged causal), each planned
    once per step (host lengths, device page ids) and run once per layer."""

    name = "flashgen wrappers"

    def __init__(self, head_dim: int, page_size: int, num_qo_heads: int, num_kv_heads: int, dtype: str = "bfloat16",
                 device: torch.device | str = "cuda"):
        from ..api import BatchDecodeWrapper, BatchPrefillWrapper

        self.decode_spec, self.prefill_spec = specs(head_dim, page_size, dtype)
        self.num_qo_heads, self.num_kv_heads = num_qo_heads, num_kv_heads
        self.decode = BatchDecodeWrapper(self.decode_spec, device=device)
        self.prefill = BatchPrefillWrapper(self.prefill_spec, device=device)
        self._plan: StepPlan | None = None

    def plan(self, step: StepPlan, num_pages: int) -> None:
        heads = {"num_qo_heads": self.num_qo_heads, "num_kv_heads": self.num_kv_heads, "num_pages": num_pages}
        if step.decode is not None:
            self.decode.plan(**step.decode.csr(), **heads)
        if step.prefill is not None:
            qo_indptr, tables = step.prefill
            self.prefill.plan(qo_indptr=qo_indptr, **tables.csr(), **heads)
        self._plan = step

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        step, parts = self._plan, []
        if step.decode is not None:
            parts.append(self.decode.run(q[: step.num_decode], kv))
        if step.prefill is not None:
            parts.append(self.prefill.run(q[step.num_decode:], kv))
        return torch.cat(parts) if len(parts) > 1 else parts[0]
