"""Attention for one engine step: decode rows (one query token each) and prefill chunks (causal, aligned to the
end of each request's KV), planned once per step and run once per layer.

Two backends behind one interface: ``WrapperAttention`` (the GPU kernels: ``BatchDecodeWrapper`` or
``CascadeWrapper`` for the decode rows, ``BatchPrefillWrapper`` with a paged causal spec for the chunks) and
``ReferenceAttention`` (the same page tables and the same levels through
``flashgen.testing.reference.reference_attention``, fp64, on any machine). Rows of a step are ordered decode
rows first, then the prefill chunks.

The decode rows' route (``route``, ``route.route_decode``): requests that share leading pages (a system prompt
from the prefix cache, forks of one prompt) sit next to each other, so the cascade's derived levels
(``flashgen.plan.derive_levels``) find the shared pages; the rows go through the cascade ("cascade") where its
step, host and GPU time together, is estimated shorter than the flat one's ("flat": one decode), else flat. The
engine replays either route from a CUDA graph where it can (``graphs.DecodeGraphs``). The levels the route
derived are the ones the cascade then plans (explicit levels: nothing derived twice). No GPU sync.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kvcache import PageTables
from ..plan.cascade import CascadeLevel, LevelTable
from ..plan.cascade_cost import CascadePolicy, check_policy
from ..spec import AttentionSpec, Causal, Paged
from .route import CASCADE_LEVELS, HostCosts, attention_shape, cascade_levels, route_decode


def specs(head_dim: int, page_size: int, dtype: str) -> tuple[AttentionSpec, AttentionSpec]:
    """The decode and prefill specs of the loop: paged NHD, no positional encoding (the cache holds rotated K)."""
    decode = AttentionSpec(head_dim, dtype=dtype, kv_layout=Paged(page_size))
    prefill = AttentionSpec(head_dim, dtype=dtype, kv_layout=Paged(page_size), mask=Causal())
    return decode, prefill


def cascade_tables(decode: PageTables, spec: AttentionSpec, num_qo_heads: int, num_kv_heads: int,
                   policy: CascadePolicy | None = None) -> list[LevelTable] | None:
    """The levels the cascade would run for decode rows ``decode`` (shared levels, then the per-request one),
    or None when the cost model folds every shared level (or nothing is shared): attend flat. GPU time only;
    the route (``route.route_decode``) weighs the step's host time too.

    >>> tables = cascade_tables(cache.page_tables(ids), spec, 32, 8)  # doctest: +SKIP
    """
    found = cascade_levels(decode, spec, attention_shape(spec, num_qo_heads, num_kv_heads), check_policy(policy))
    return None if found is None else found[0]


def cascade_plan_levels(tables: list[LevelTable]) -> list[CascadeLevel]:
    """Levels as the route derived them, as ``CascadeWrapper.plan(levels=...)`` takes them (host page ids)."""
    return [CascadeLevel(t.qo_indptr, t.kv_indptr, t.kv_indices, t.kv_last_page_len) for t in tables]


class StepPlan:
    """One step's batch: ``decode`` (page tables of the decode rows' requests, or None) and ``prefill``
    (``(qo_indptr [batch + 1] int32, tables)`` of the chunked requests, or None); ``layers``: the layers it runs
    through; ``graph``: the step would replay a CUDA graph, flat or through the cascade (``graphs.DecodeGraphs``:
    decode-only, a bucket holds it), which the route weighs."""

    def __init__(self, decode: PageTables | None, prefill: tuple[np.ndarray, PageTables] | None, layers: int = 1,
                 graph: bool = False):
        self.decode, self.prefill = decode, prefill
        self.layers, self.graph = layers, graph
        self.num_decode = 0 if decode is None else int(decode.seq_lens.numel())


class ReferenceAttention:
    """fp64 reference attention over the manager's CSR tables (CPU or GPU tensors; slow, exact). Decode rows
    that the cascade would run take its levels here too, each level's state merged as the kernels merge."""

    name = "fp64 reference"

    def __init__(self, head_dim: int, page_size: int, num_qo_heads: int, num_kv_heads: int,
                 cascade_policy: CascadePolicy | None = None, host_costs: HostCosts | None = None):
        # the reference reads the layout and the mask of a spec, not its dtype: fp64 math over any K/V dtype
        self.decode_spec, self.prefill_spec = specs(head_dim, page_size, "bfloat16")
        self.num_qo_heads, self.num_kv_heads = num_qo_heads, num_kv_heads
        self.cascade_policy = check_policy(cascade_policy)
        self.host_costs = host_costs
        self._plan: StepPlan | None = None
        self._levels: list[LevelTable] | None = None

    def route(self, step: StepPlan) -> str:
        """"cascade" or "flat" for the decode rows ("" without any), as the GPU loop routes them (the same
        model: ``route.route_decode``); remembered for ``plan``."""
        self._levels = None
        if step.decode is None:
            return ""
        found = route_decode(step.decode, self.decode_spec, self.num_qo_heads, self.num_kv_heads, layers=step.layers,
                             graph=step.graph, policy=self.cascade_policy, host_costs=self.host_costs,
                             max_levels=CASCADE_LEVELS if step.graph else None)
        self._levels = found.levels
        return found.name

    @property
    def levels(self) -> list[LevelTable] | None:
        """The cascade's levels of the last routed step (None when flat)."""
        return self._levels

    def plan(self, step: StepPlan, num_pages: int) -> None:
        self._plan = step

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``q [rows, num_qo_heads, head_dim]`` (decode rows, then prefill rows) -> out, q's dtype and shape."""
        step, parts = self._plan, []
        if step.decode is not None:
            n = step.num_decode
            if self._levels is None:
                out, _ = _reference(self.prefill_spec, q[:n], kv, np.arange(n + 1, dtype=np.int32), step.decode)
            else:
                out = _reference_levels(self.decode_spec, q[:n], kv, self._levels)
            parts.append(out)
        if step.prefill is not None:
            qo_indptr, tables = step.prefill
            out, _ = _reference(self.prefill_spec, q[step.num_decode:], kv, qo_indptr, tables)
            parts.append(out)
        return torch.cat(parts).to(q.dtype)


def _reference_levels(spec: AttentionSpec, q: torch.Tensor, kv, levels: list[LevelTable]) -> torch.Tensor:
    """The cascade's math in fp64: each level attended by its groups (every query of a group sees the whole
    group's keys: the shared keys precede it), the states merged level by level."""
    from ..testing.reference import merge_state_ref, reference_attention

    out = lse = None
    for table in levels:
        o, s = reference_attention(spec, q, kv, qo_indptr=table.qo_indptr, **table.table())
        out, lse = (o, s) if out is None else merge_state_ref(out, lse, o, s)
    return out


def _reference(spec: AttentionSpec, q: torch.Tensor, kv, qo_indptr: np.ndarray, tables: PageTables):
    from ..testing.reference import reference_attention

    return reference_attention(spec, q, kv, qo_indptr=qo_indptr, kv_indptr=tables.kv_indptr,
                               kv_indices=tables.kv_indices_host, kv_last_page_len=tables.kv_last_page_len)


class WrapperAttention:
    """The GPU path: one ``BatchDecodeWrapper``, one ``CascadeWrapper`` (decode rows that share pages, where its
    cost model says so) and one ``BatchPrefillWrapper`` (paged causal), each planned once per step (host
    lengths, device page ids) and run once per layer. ``graphs_ok``: the engine may replay decode-only steps
    from CUDA graphs (``graphs.DecodeGraphs``)."""

    name = "flashgen wrappers"
    graphs_ok = True

    def __init__(self, head_dim: int, page_size: int, num_qo_heads: int, num_kv_heads: int, dtype: str = "bfloat16",
                 device: torch.device | str = "cuda", cascade_policy: CascadePolicy | None = None,
                 host_costs: HostCosts | None = None):
        from ..api import BatchDecodeWrapper, BatchPrefillWrapper, CascadeWrapper

        self.decode_spec, self.prefill_spec = specs(head_dim, page_size, dtype)
        self.num_qo_heads, self.num_kv_heads = num_qo_heads, num_kv_heads
        self.device = torch.device(device)
        self.decode = BatchDecodeWrapper(self.decode_spec, device=device)
        self.cascade = CascadeWrapper(self.decode_spec, device=device)
        self.prefill = BatchPrefillWrapper(self.prefill_spec, device=device)
        self.cascade_policy = check_policy(cascade_policy)
        self.host_costs = host_costs
        self._plan: StepPlan | None = None
        self._route = ""
        self._levels: list[LevelTable] | None = None

    def route(self, step: StepPlan) -> str:
        """"cascade" or "flat" for the decode rows ("" without any; ``route.route_decode``); remembered, with
        the cascade's levels, for ``plan``."""
        self._route, self._levels = "", None
        if step.decode is not None:
            found = route_decode(step.decode, self.decode_spec, self.num_qo_heads, self.num_kv_heads,
                                 layers=step.layers, graph=step.graph, policy=self.cascade_policy,
                                 host_costs=self.host_costs, max_levels=CASCADE_LEVELS if step.graph else None)
            self._route, self._levels = found.name, found.levels
        return self._route

    @property
    def levels(self) -> list[LevelTable] | None:
        """The cascade's levels of the last routed step (None when flat): what a replayed cascade step plans."""
        return self._levels

    def plan(self, step: StepPlan, num_pages: int) -> None:
        heads = {"num_qo_heads": self.num_qo_heads, "num_kv_heads": self.num_kv_heads, "num_pages": num_pages}
        if step.decode is not None:
            if self._route == "cascade":  # the levels the route derived, explicit: host page ids
                self.cascade.plan(levels=cascade_plan_levels(self._levels), policy=self.cascade_policy, **heads)
            else:
                self.decode.plan(**step.decode.csr(), **heads)
        if step.prefill is not None:
            qo_indptr, tables = step.prefill
            self.prefill.plan(qo_indptr=qo_indptr, **tables.csr(), **heads)
        self._plan = step

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        step, parts = self._plan, []
        if step.decode is not None:
            inner = self.cascade if self._route == "cascade" else self.decode
            parts.append(inner.run(q[: step.num_decode], kv))
        if step.prefill is not None:
            parts.append(self.prefill.run(q[step.num_decode:], kv))
        return torch.cat(parts) if len(parts) > 1 else parts[0]
