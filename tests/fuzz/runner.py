"""Runs fuzz cases on a GPU against the fp64 reference (which runs on the GPU too), as the wrapper tests do:
NaN-poisoned outputs, NaN in every cache slot no request owns, ``assert_matches_reference``'s dtype-aware bound.

Non-graph cases share one wrapper per (variant, num_sms): each case re-plans it (other heads, lengths, page
tables, runtime values). A graph case runs in its graph group (``cases.graph_group``): the group's wrapper is
planned with the warm-up batch, run once, captured once; each case then writes its inputs into the captured q,
cache and page-id storage, re-plans and replays. Page ids of a group are on the host (capacity-sized arrays),
copied into the group's device tensor ("reused"), or in a new device tensor every plan ("fresh": the captured
graph must not keep reading the tensor of an earlier plan; the tensors of earlier plans are kept alive, so a
graph that does reads stale but valid page ids and shows as a mismatch, never as a fault).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import flashgen
from flashgen.api.backends import kernels_for, select
from flashgen.kernels import family
from flashgen.testing.check import assert_matches_reference, nan_out, poison_allocator

from .cases import VARIANTS, Case, GraphGroup, Variant, graph_group, summary, warmup_case
from .inputs import (HostBatch, Pools, fill, host_batch, host_ids, kv_views, mask_argument, masks_of, plan_table,
                     q_view, reference_table)

NAN = float("nan")
FRESH_HELD = 3  # fresh page-id tensors of a graph group kept alive besides its warm-up's


def kernels(v: Variant, capability: tuple[int, int], graph: bool = False) -> list[tuple[str, object]]:
    """The ``(op, spec)`` kernels a variant runs on a device of ``capability`` (``graph``: in a graph group,
    where the auto backend may pick another kernel)."""
    if v.decode:
        return [("decode", family("decode").project(v.spec))]
    spec = family("prefill").project(v.spec)
    backend = "portable" if v.backend == "portable" else select(spec, "auto", capability, graph=graph)
    return list(kernels_for(spec, backend))


def needed_kernels(cases: list[Case], capability: tuple[int, int]) -> list[tuple[str, object]]:
    """Every kernel ``cases`` run, once each (graph groups included)."""
    seen: dict[tuple, None] = {}
    for c in cases:
        for job in kernels(VARIANTS[c.variant], capability, c.graph):
            seen.setdefault(job, None)
    return list(seen)


def compile_kernels(jobs: list[tuple[str, object]], threads: int = 16) -> float:
    """Compile ``jobs`` into the kernel cache in parallel (nvcc runs in subprocesses); returns the seconds."""
    from flashgen.jit import ensure_compiled

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        list(pool.map(lambda job: ensure_compiled(job[1], job[0]), jobs))
    return time.perf_counter() - start


def make_wrapper(v: Variant, num_sms: int | None = None, group: GraphGroup | None = None, device=None):
    """The wrapper of a variant (a graph group's: ``use_cuda_graph=True`` with its capacities)."""
    graph = {} if group is None else {"use_cuda_graph": True, "max_batch_size": group.max_batch_size}
    if v.decode:
        return flashgen.BatchDecodeWrapper(v.spec, num_sms=num_sms, device=device, **graph)
    if group is not None:
        graph["max_total_q"] = group.max_total_q
    return flashgen.BatchPrefillWrapper(v.spec, backend=v.backend, num_sms=num_sms, device=device, **graph)


def plan(wrapper, c: Case, batch: HostBatch, table: dict, custom_mask) -> None:
    """``wrapper.plan`` of a case: its heads, page table, split choice and runtime values."""
    runtime = dict(c.runtime)
    if VARIANTS[c.variant].decode:
        wrapper.plan(num_qo_heads=c.num_qo_heads, num_kv_heads=c.num_kv_heads, enable_split=c.enable_split,
                     **table, **runtime)
    else:
        wrapper.plan(qo_indptr=batch.qo_indptr, num_qo_heads=c.num_qo_heads, num_kv_heads=c.num_kv_heads,
                     custom_mask=custom_mask, enable_split=c.enable_split, **table, **runtime)


def check(c: Case, batch: HostBatch, q: torch.Tensor, kv, out: torch.Tensor, lse: torch.Tensor, masks) -> None:
    """Assert ``out`` / ``lse`` (their first total_q rows) against the fp64 reference of the case's inputs."""
    n = int(batch.qo_indptr[-1])
    assert_matches_reference(VARIANTS[c.variant].spec, q[:n], kv, out[:n], lse[:n], qo_indptr=batch.qo_indptr,
                             custom_mask=masks, **reference_table(c, batch), **dict(c.runtime))


class GraphState:
    """One captured graph group: its wrapper, the q / cache / page-id storage the capture reads, out and lse."""

    def __init__(self, runner: "Runner", g: GraphGroup):
        self.runner, self.group, self.variant = runner, g, VARIANTS[g.variant]
        warm = warmup_case(g)
        self.wrapper = make_wrapper(self.variant, None, g, runner.device)
        rows = g.max_batch_size if self.variant.decode else g.max_total_q
        self.q = q_view(runner.pools, warm, rows)
        self.kv, self.k, self.v = kv_views(runner.pools, warm, g.pool)
        self.ids_buffer = (torch.zeros(self.ids_shape(), dtype=torch.int32, device=runner.device)
                           if g.ids == "reused" else None)
        self.held: list[torch.Tensor] = []  # the warm-up's fresh page ids, kept for the group's lifetime
        self.fresh: deque = deque(maxlen=FRESH_HELD)
        self._load(warm, keep=True)
        runner.launch(self.wrapper, self.q, self.kv, None)  # compile, load, tensor maps: outside the capture
        self.graph, (self.out, self.lse) = runner.capture(lambda: runner.launch(self.wrapper, self.q, self.kv, None))

    def _ids(self, c: Case, batch: HostBatch):
        """The page ids of a case as the group gives them (see the module docstring)."""
        g, device = self.group, self.runner.device
        if g.form == "ragged":
            return None
        table = batch.kv_indices if g.form == "csr" else batch.block_table
        if g.form == "csr":  # capacity-sized: the same length every plan
            padded = np.zeros(g.pool, np.int32)
            padded[: table.size] = table
            table = padded
        if g.ids == "host":
            return host_ids(c, table)
        rows = table.shape[0]
        if g.ids == "reused":
            self.ids_buffer[:rows].copy_(torch.from_numpy(table))
            return self.ids_buffer if g.form == "csr" else self.ids_buffer[:rows]
        fresh = torch.zeros(self.ids_shape(), dtype=torch.int32, device=device)
        fresh[:rows].copy_(torch.from_numpy(table))
        return fresh if g.form == "csr" else fresh[:rows]

    def ids_shape(self) -> tuple[int, ...]:
        """The group's device page-id storage: ``[pool]`` (CSR) or ``[max_batch_size, width]`` (block table)."""
        g = self.group
        return (g.pool,) if g.form == "csr" else (g.max_batch_size, g.width)

    def _load(self, c: Case, keep: bool = False) -> HostBatch:
        batch = host_batch(c, self.group)
        fill(c, batch, self.q, self.k, self.v, int(batch.qo_indptr[-1]))
        ids = self._ids(c, batch)
        if self.group.ids == "fresh":
            (self.held.append if keep else self.fresh.append)(ids)
        plan(self.wrapper, c, batch, plan_table(c, batch, self.runner.device, ids), None)
        self.runner.current = (c, batch)
        return batch

    def replay(self, c: Case) -> None:
        batch = self._load(c)
        self.out.fill_(NAN)
        self.lse.fill_(NAN)
        self.graph.replay()
        check(c, batch, self.q, self.kv, self.out, self.lse, None)


class Runner:
    """Runs cases on one GPU: ``run(case) -> result dict`` (``status`` "ok", "mismatch", "error" or "fatal": a
    CUDA error that leaves the context unusable; the process must end after it)."""

    def __init__(self, device: torch.device | None = None, pools: Pools | None = None):
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.pools = pools or Pools(self.device)
        self._wrappers: dict[tuple, object] = {}
        self._graphs: dict[tuple, GraphState] = {}
        self.current: tuple | None = None  # the (case, host batch) being run

    def launch(self, wrapper, q: torch.Tensor, kv, out: torch.Tensor | None):
        """``wrapper.run`` (into ``out``, if given): ``(out, lse)``."""
        return wrapper.run(q, kv, out=out, return_lse=True)

    def capture(self, run):
        """``(graph, run's result)``: ``run()`` captured in a CUDA graph."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = run()
        return graph, result

    def _wrapper(self, v: Variant, num_sms: int | None):
        key = (v.index, num_sms)
        if key not in self._wrappers:
            self._wrappers[key] = make_wrapper(v, num_sms, None, self.device)
        return self._wrappers[key]

    def _eager(self, c: Case, v: Variant) -> str:
        batch = host_batch(c)
        n = int(batch.qo_indptr[-1])
        q = q_view(self.pools, c, n)
        kv, k, vv = kv_views(self.pools, c, batch.pages)
        fill(c, batch, q, k, vv, n)
        masks = masks_of(c)
        wrapper = self._wrapper(v, c.num_sms)
        mask_arg = mask_argument(masks, c.mask_form, self.device) if masks is not None else None
        plan(wrapper, c, batch, plan_table(c, batch, self.device), mask_arg)
        out = nan_out(v.spec, q, device=self.device)
        poison_allocator((n, c.num_qo_heads), torch.float32, self.device)
        self.current = (c, batch)
        got, lse = self.launch(wrapper, q, kv, out)
        if got.data_ptr() != out.data_ptr():
            raise AssertionError("out: run() returned a tensor other than the poisoned buffer it was given")
        check(c, batch, q, kv, out, lse, masks)
        return getattr(wrapper, "backend", "decode")

    def _graph(self, c: Case, v: Variant) -> str:
        g = graph_group(c.variant, c.ids)
        state = self._graphs.get(g.key)
        if state is None:
            state = self._graphs[g.key] = GraphState(self, g)
        state.replay(c)
        return getattr(state.wrapper, "backend", "decode")

    def run(self, c: Case) -> dict:
        v = VARIANTS[c.variant]
        start = time.perf_counter()
        result = {"seed": c.seed, "variant": v.name, "backend": v.backend, "graph": c.ids if c.graph else None,
                  "status": "ok", "error": None, "summary": summary(c)}
        try:
            result["backend"] = self._graph(c, v) if c.graph else self._eager(c, v)
            self.synchronize()
        except AssertionError as exc:
            result.update(status="mismatch", error=str(exc))
        except Exception as exc:  # noqa: BLE001 - every failure is a finding, reported with its case
            result.update(status="error", error=f"{type(exc).__name__}: {exc}")
            try:
                self.synchronize()
            except Exception:  # noqa: BLE001
                result["status"] = "fatal"
        result["seconds"] = round(time.perf_counter() - start, 4)
        return result

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
