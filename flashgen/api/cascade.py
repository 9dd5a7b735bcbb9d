"""CascadeWrapper: attention over a paged cache whose requests share KV prefixes, each shared prefix read once per
group of requests instead of once per request (FlashInfer's ``MultiLevelCascadeAttentionWrapper`` in flashgen's
terms).

It composes the tested wrappers: each shared level runs as a prefill (``BatchPrefillWrapper`` with the mask off:
every query of a group lies after its shared prefix) over its groups' pages; the last level runs as decode
(``BatchDecodeWrapper``) when every request has one query, else as a prefill with the spec's mask; the levels'
states merge into ``out`` with ``merge_state_in_place``, level by level (a group with no KV gives ``lse = -inf``,
weight 0). The host side (levels given or derived, the cost model, folding) is ``flashgen.plan.cascade`` and
``flashgen.plan.cascade_cost``.

Which prefill kernel runs a level (``prefill_backend="auto"``): the Hopper kernel plans every request unsplit,
one CTA per (group, 128-row q tile, kv head), so the shared level of a decode batch gives few CTAs (128 queries
x group 4 = 4 tiles x 8 kv heads = 32 CTAs for a 32k prefix on 132 SMs), while the portable kernel's split-KV
plan fills the GPU. So on a compute-capability 9.0 GPU that runs the spec, the Hopper kernel runs a level whose
grid fills the SMs (q tiles x kv heads >= SMs) as it is, and a shared level whose grid does not, split over its
keys: ``plan.cascade_split.choose_chunks`` cuts each group's pages into S chunks of whole pages (each at least
``CascadePolicy.min_chunk_tokens`` keys) so that q tiles x kv heads x S fills one or two waves; each chunk is
attended by the group's queries as a request of its own (q copied S times into a buffer the wrapper keeps), and
the S chunk states merge into the other levels' in one launch (``merge_states_in_place``). Where no split fills
``SPLIT_MIN_FILL`` (60 %) of the SMs (short prefixes), the portable kernel runs the level. ``CascadePolicy.chunks``
fixes S instead (1: never split). The last level never splits. A split takes a CSR level with host page ids, or
one group (device ids are then re-cut, not gathered). ``prefill_backend="sm90"`` splits by the same rule,
whatever the fill. CUDA-graph wrappers run the portable kernel (the choice may not change between plans) unless
``"sm90"`` is forced, and never split (S, and so q's copy and the merge, would change the captured launches).

Positions: a spec with RoPE, ALiBi or a sliding window runs every level with explicit true positions
(``kernel_options={"positions": True}`` on the inner wrappers: either prefill kernel, and decode): each
level's pages start where its tokens' keys of the earlier levels end and each query sits at its place in its
whole sequence (``plan.cascade.level_positions``), so the answer is flat attention's over the whole sequence;
a window then also masks the shared levels. NoMask / Causal specs without an encoding keep the position-free
kernels (shared levels unmasked, the last level causal at its own KV end).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..kernels import family, launch_config
from ..plan import PlanError
from ..plan.cascade import LevelTable, check_causal, check_levels, derive_levels, empty_level, level_positions
from ..plan.cascade_cost import CascadePolicy, Shape, check_policy, choose_levels
from ..plan.cascade_split import SPLIT_MIN_FILL, choose_chunks, split_level, splittable
from ..plan.host import check_heads
from ..plan.page_table import block_table_to_csr
from ..spec import ALiBi, AttentionSpec, Causal, NoMask, Paged, RoPE, SlidingWindow, SpecError
from . import handles
from . import wrapper as core
from .backends import BACKENDS, kernels_for, select
from .checks import check_count
from .decode import BatchDecodeWrapper
from .kv_inputs import TORCH_DTYPES
from .merge import merge_state_in_place, merge_states_in_place
from .prefill import BatchPrefillWrapper
from .wrapper import resolve_device


class LevelRecord(NamedTuple):
    """What ``plan()`` decided for one level (``CascadeWrapper.levels``, in level order, the last level last).

    ``groups`` and ``kv_tokens`` (the keys its groups hold, each read once) are those of the level as it runs
    (with any folded pages) or, folded, as it was given or derived. ``runs``: ``"portable"`` or ``"sm90"``
    (a prefill), ``"decode"``, ``"folded"`` (its pages joined the next level's groups) or ``"empty"`` (no KV).
    ``flat_us`` / ``cascade_us``: the cost model's estimates for a shared level (None for the last).
    ``chunks``: the chunks its keys were split into for the Hopper kernel (1: not split; module docstring).
    """

    level: int
    groups: int
    kv_tokens: int
    runs: str
    flat_us: float | None = None
    cascade_us: float | None = None
    chunks: int = 1


def check_cascade_spec(spec: AttentionSpec) -> None:
    """``SpecError`` unless a cascade runs ``spec`` exactly: a paged layout; NoMask, Causal or SlidingWindow
    (a custom mask's bits have no place in the levels); K/V in q's dtype."""
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec: got {type(spec).__name__}, expected AttentionSpec")
    if not isinstance(spec.kv_layout, Paged):
        raise SpecError(f"kv_layout: CascadeWrapper shares pages, so it takes a Paged(...) layout, got "
                        f"{spec.kv_layout!r}")
    if not isinstance(spec.mask, (NoMask, Causal, SlidingWindow)):
        raise SpecError(f"mask: CascadeWrapper takes NoMask(), Causal() or SlidingWindow(left), got {spec.mask!r} "
                        "(use BatchPrefillWrapper over the whole sequences for a custom mask)")
    if spec.kv_dtype != spec.dtype:
        raise SpecError(f"kv_dtype: CascadeWrapper takes K/V in q's dtype ({spec.dtype}), got {spec.kv_dtype} (its "
                        "plan() takes no fp8 k_scale / v_scale yet; BatchPrefillWrapper and BatchDecodeWrapper do)")


def needs_positions(spec: AttentionSpec) -> bool:
    """Whether a cascade of ``spec`` runs its levels with explicit true positions: RoPE, ALiBi or a window."""
    return spec.pos_encoding is not None or isinstance(spec.mask, SlidingWindow)


class CascadeWrapper:
    """Attention over a paged KV cache whose requests share prefixes: each shared prefix is read once per group.

    Example (128 requests decoding after one shared prompt; levels derived from the page tables)::

        wrapper = flashgen.CascadeWrapper(AttentionSpec(128, kv_layout=Paged(16), mask=Causal()))
        wrapper.plan(qo_indptr=range(129), kv_indptr=indptr_cpu, kv_indices=indices_cpu,
                     kv_last_page_len=last_cpu, num_qo_heads=32, num_kv_heads=8)
        out = wrapper.run(q, kv_cache)      # q [128, 32, 128] -> out [128, 32, 128]
        wrapper.levels                      # what ran: a LevelRecord a level (H200, 32k prefix:
                                            # runs="sm90", chunks=4 for it; runs="decode" for the suffixes)

    ``plan()`` takes the levels one of two ways. Derived: per-request ``qo_indptr`` and a host page table
    (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``, or ``block_table`` + ``seq_lens``); consecutive requests
    that start with the same page ids share those pages (``flashgen.plan.derive_levels``: a prefix tree, one level
    per branching depth, then each request's own pages). Explicit: ``levels=[CascadeLevel(...), ...]``, the last
    level one group per request (FlashInfer's ``MultiLevelCascadeAttentionWrapper.plan`` arrays, a record a level).
    Either way a cost model (``flashgen.plan.CascadePolicy``, ``policy=``) folds a shared level that would not pay
    for its launch into the next level (its pages prepended to each group there; host page ids only), so a short
    prefix is attended flat. ``wrapper.levels`` records the decisions.

    Specs: paged (any page size, NHD / HND), NoMask, Causal or SlidingWindow (a causal plan needs every shared key
    before each request's first query: last-level ``kv_len >= qo_len - 1``, which derived levels satisfy by
    construction), RoPE, ALiBi, soft-cap and sm_scale. RoPE, ALiBi and windows run every level with true
    positions (module docstring) on the prefill kernels (the Hopper one included) and decode, the same answer as
    flat attention over each whole sequence; their levels take CSR
    page tables (not block tables). ``plan()`` takes their runtime values (``window_left``, ``rope_theta``,
    ``rope_scale``) as ``BatchPrefillWrapper.plan`` does. CustomMask raises ``SpecError``.

    ``num_levels``: the most levels (shared + last) a plan runs: deeper shared pages of derived levels stay in the
    last level, explicit plans may give no more. ``use_cuda_graph=True`` needs ``num_levels`` and
    ``max_batch_size`` (``max_total_q`` defaults to it: a decode graph, whose last level is ``BatchDecodeWrapper``;
    a larger ``max_total_q`` makes it a prefill): every level always launches (a folded or missing level with no
    KV), so one graph captured around ``run()`` replays after ``plan()`` of any batch within capacity, with q and
    out of ``max_total_q`` rows. Pass ``max_num_pages``, the most page ids one level holds (``kv_indptr[-1]`` of
    the per-request table bounds every derived level), or make the first plan the largest. ``prefill_backend``:
    ``"auto"`` (module docstring: on Hopper a shared level too small in q for the GPU splits over its keys),
    ``"portable"`` or ``"sm90"`` for the prefill levels. ``workspace`` is accepted
    for FlashInfer-style call sites; the inner wrappers own their buffers.
    """

    def __init__(self, spec: AttentionSpec, num_levels: int | None = None, use_cuda_graph: bool = False,
                 max_batch_size: int | None = None, max_total_q: int | None = None,
                 device: torch.device | int | None = None, num_sms: int | None = None,
                 max_num_pages: int | None = None, prefill_backend: str = "auto",
                 workspace: torch.Tensor | None = None):
        check_cascade_spec(spec)
        if spec.variant is not None:  # its inner wrappers would run the hooks without their arguments
            raise SpecError(f"variant: CascadeWrapper does not run variants yet (got {spec.variant.uri}); "
                            "BatchPrefillWrapper and BatchDecodeWrapper do")
        self.spec = spec
        # shared levels: every query lies after their keys, so causal needs no mask there; a window does
        self._shared_spec = spec if isinstance(spec.mask, SlidingWindow) else spec.replace(mask=NoMask())
        self._positions = needs_positions(spec)
        self._options = {"positions": True} if self._positions else None
        prefill = family("prefill")
        prefill.check(prefill.project(spec))
        try:
            family("decode").check(family("decode").project(spec))
            self._decode_ok = True
        except SpecError:
            self._decode_ok = False  # the last level runs as a prefill
        self.num_levels = check_count("num_levels", num_levels)
        max_batch_size = check_count("max_batch_size", max_batch_size)
        max_total_q = check_count("max_total_q", max_total_q)
        self._num_sms = check_count("num_sms", num_sms)
        self.max_num_pages = check_count("max_num_pages", max_num_pages)
        if prefill_backend not in BACKENDS:
            raise ValueError(f"prefill_backend: got {prefill_backend!r}, expected one of "
                             f"{', '.join(map(repr, BACKENDS))}")
        if use_cuda_graph:
            if not (num_levels and max_batch_size):
                raise ValueError("num_levels: num_levels and max_batch_size are required with use_cuda_graph=True "
                                 "(every level launches in the captured graph)")
            max_total_q = max_total_q or max_batch_size
        self.use_cuda_graph, self.max_batch_size, self.max_total_q = use_cuda_graph, max_batch_size, max_total_q
        self.device = resolve_device(device)
        self.prefill_backend = prefill_backend
        self._capability = lambda: torch.cuda.get_device_capability(self.device)
        if prefill_backend == "sm90":  # raises now where it cannot run
            for s in (self._shared_spec, spec):
                select(s, "sm90", self._capability, graph=use_cuda_graph, options=self._options)
        self._decode_graph = use_cuda_graph and max_total_q == max_batch_size and self._decode_ok
        self._tile_rows = launch_config(self._shared_spec, "prefill").tile_q
        self._kv_bytes = TORCH_DTYPES[spec.kv_dtype].itemsize
        self._sm90: dict[AttentionSpec, int] = {}  # spec -> the Hopper kernel's q tile rows, 0 where it cannot run
        self._inner: dict[tuple, object] = {}
        self._runs: tuple | None = None
        self._split: tuple[ChunkedRun, ...] = ()  # shared levels split over their keys, merged after the others
        self._chunked: dict[int, ChunkedRun] = {}
        self._run_tables: tuple = ()
        self._scratch: torch.Tensor | None = None
        self.levels: tuple[LevelRecord, ...] = ()
        self.op_handle = handles.assign(self)  # how flashgen.ops names this wrapper

    # ------------------------------------------------------------------------------------------ plan

    def plan(self, *, num_qo_heads: int, num_kv_heads: int, levels=None, qo_indptr=None, kv_indptr=None,
             kv_indices=None, kv_last_page_len=None, block_table=None, seq_lens=None, sm_scale: float | None = None,
             soft_cap: float | None = None, num_pages: int | None = None, policy=None,
             window_left: int | None = None, rope_theta: float | None = None,
             rope_scale: float | None = None) -> None:
        """Plan a batch: the levels, which of them run, and each level's inner plan.

        Derived levels: ``qo_indptr [batch + 1]`` and a host page table, ``kv_indptr [batch + 1]``, ``kv_indices``,
        ``kv_last_page_len [batch]`` or ``block_table [batch, max_blocks]`` + ``seq_lens [batch]``. Explicit
        levels: ``levels``, a list of ``flashgen.CascadeLevel`` (or 4-tuples ``(qo_indptr, kv_indptr, kv_indices,
        kv_last_page_len)``, or mappings), level 0 first and the per-request level last; every level's
        ``qo_indptr`` ends at the same ``total_q``; page ids may be device tensors (such levels are never
        folded). ``sm_scale``, ``soft_cap``, ``window_left``, ``rope_theta``, ``rope_scale`` and ``num_pages``
        (the pool size, bounding host page ids) are as ``BatchDecodeWrapper.plan`` takes them. ``policy``: a
        ``flashgen.plan.CascadePolicy`` (rates, ``fold="cost" | "never" | "always"``, and the split of shared levels
        for the Hopper kernel: ``min_chunk_tokens``, ``chunks``). Errors name the argument and, for a level,
        ``levels[l]``.
        """
        self._runs = None  # a plan that fails leaves nothing to run
        check_heads(num_qo_heads, num_kv_heads)
        policy = check_policy(policy)
        page_size = self.spec.kv_layout.page_size
        derived = levels is None
        flat = None
        if derived:
            tables, flat = self._derive(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, block_table, seq_lens,
                                        num_pages)
        else:
            if any(x is not None for x in (qo_indptr, kv_indptr, kv_indices, kv_last_page_len, block_table, seq_lens)):
                raise PlanError("levels: give either levels (explicit) or qo_indptr with a page table (derived), "
                                "not both")
            tables = check_levels(levels, page_size, num_pages)
            if self.num_levels is not None and len(tables) > self.num_levels:
                raise PlanError(f"levels: {len(tables)} levels, more than num_levels = {self.num_levels}")
        if self.spec.is_causal:
            check_causal(tables)
        shape = Shape(num_qo_heads, num_kv_heads, self.spec.head_dim, self.spec.head_dim_vo, self._kv_bytes,
                      TORCH_DTYPES[self.spec.dtype].itemsize, self._tile_rows)
        kept, runs_tables, choices = choose_levels(tables, shape, page_size, policy, self.use_cuda_graph, flat)
        last = runs_tables[-1]
        decode = self._decode_last(last)
        common = {"num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads, "sm_scale": sm_scale,
                  "soft_cap": soft_cap, "num_pages": num_pages, "rope_theta": rope_theta, "rope_scale": rope_scale}
        if window_left is not None:
            common["window_left"] = window_left
        shared = list(zip(kept[:-1], runs_tables[:-1]))
        if self.use_cuda_graph:  # every level launches: the ones not run get no KV
            shared += [(None, empty_level(int(last.qo_indptr[-1])))] * (self.num_levels - 1 - len(shared))
        positions = self._level_positions([t for _, t in shared] + [last])
        runs, split, ran = [], [], {}
        for slot, (index, table) in enumerate(shared):
            run, ran[index] = self._plan_shared(slot, index, table, positions[slot], policy, derived, common)
            (split if isinstance(run, ChunkedRun) else runs).append(run)
        backend = "decode" if decode else self._backend(last, self.spec, num_qo_heads, num_kv_heads)[0]
        runs.append(self._planned(("last", backend), self.spec, backend, len(tables) - 1, derived, last,
                                  {**common, **positions[-1]}))
        self._runs, self._split = tuple(runs), tuple(split)
        # (spec, table) of each run, in run order: what the levels compute (the tests' CPU check reads it)
        self._run_tables = tuple((self._shared_spec, t) for _, t in shared) + ((self.spec, last),)
        self.levels = self._records(tables, dict(zip(kept, runs_tables)), choices, ran, backend)

    def _plan_shared(self, slot: int, index: int | None, table: LevelTable, place: dict, policy: CascadePolicy,
                     derived: bool, common: dict) -> tuple[object, tuple[str, int]]:
        """Shared slot ``slot`` (level ``index``) planned over ``table`` at positions ``place``: ``(its run: the
        inner wrapper, or a ChunkedRun where it splits, (backend, chunks))``."""
        backend, chunks = self._backend(table, self._shared_spec, common["num_qo_heads"], common["num_kv_heads"],
                                        policy)
        if chunks == 1:
            inner = self._planned(("shared", slot, backend), self._shared_spec, backend, index, derived, table,
                                  {**common, **place})
            return inner, (backend, 1)
        chunked = split_level(table, chunks, self.spec.kv_layout.page_size)
        if place:
            place = dict(zip(("kv_page_pos", "q_pos"), chunked.positions(place["kv_page_pos"], place["q_pos"])))
        inner = self._planned(("shared", slot, backend), self._shared_spec, backend, index, derived, chunked.table,
                              {**common, **place})
        return self._chunked_run(slot, inner, table, chunked, place), (backend, chunks)

    def _level_positions(self, tables: list[LevelTable]) -> list[dict]:
        """Each run's ``kv_page_pos`` / ``q_pos`` plan arguments (empty dicts for position-free specs)."""
        if not self._positions:
            return [{}] * len(tables)
        pages, q_pos = level_positions(tables, self.spec.kv_layout.page_size)
        return [{"kv_page_pos": p, "q_pos": q_pos} for p in pages]

    def _derive(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, block_table, seq_lens,
                num_pages) -> tuple[list[LevelTable], LevelTable]:
        if qo_indptr is None:
            raise PlanError("qo_indptr: required (with a per-request page table, to derive the levels), or give levels")
        if block_table is not None:
            if any(x is not None for x in (kv_indptr, kv_indices, kv_last_page_len)) or seq_lens is None:
                raise PlanError("block_table: give block_table with seq_lens, and no CSR arrays")
            kv_indptr, kv_indices, kv_last_page_len = block_table_to_csr(block_table, seq_lens,
                                                                         self.spec.kv_layout.page_size)
        elif kv_indptr is None or kv_indices is None or kv_last_page_len is None:
            raise PlanError("kv_indptr: derived levels take kv_indptr, kv_indices and kv_last_page_len (host), or "
                            "block_table and seq_lens")
        return derive_levels(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, self.spec.kv_layout.page_size,
                             causal=self.spec.is_causal, max_levels=self.num_levels, num_pages=num_pages,
                             with_table=True)

    def _decode_last(self, last: LevelTable) -> bool:
        """Whether the last level runs as decode: one query a request (fixed in CUDA-graph mode)."""
        one_each = bool((np.diff(last.qo_indptr) == 1).all())
        if self.use_cuda_graph:
            if self._decode_graph and not one_each:
                raise PlanError("qo_indptr: this CUDA-graph CascadeWrapper runs its last level as decode "
                                "(max_total_q == max_batch_size), so every request takes one query; build it with "
                                "max_total_q > max_batch_size for longer queries")
            return self._decode_graph
        return one_each and self._decode_ok

    def _backend(self, table: LevelTable, spec: AttentionSpec, num_qo_heads: int, num_kv_heads: int,
                 policy: CascadePolicy | None = None) -> tuple[str, int]:
        """``(prefill kernel, chunks)`` of a level: the Hopper kernel where its unsplit grid fills the SMs or, for a
        shared level (``policy`` given), where a split over its keys does (module docstring)."""
        forced = self.prefill_backend == "sm90"
        if self.use_cuda_graph or self.prefill_backend == "portable":
            return ("sm90" if forced else "portable"), 1
        tile = self._sm90.get(spec)
        if tile is None:
            runs = select(spec, "auto", self._capability, options=self._options) == "sm90"
            kernel_spec = kernels_for(spec, "sm90")[-1][1]  # RoPE: the kernel of its ragged twin
            tile = self._sm90[spec] = launch_config(kernel_spec, "prefill_sm90", self._options).tile_q if runs else 0
        if not tile:
            return "portable", 1
        tiles = int((-(-(np.diff(table.qo_indptr) * (num_qo_heads // num_kv_heads)) // tile)).sum())
        sms = self._num_sms or core.device_sms(self.device.index)
        chunks = 1
        if policy is not None and splittable(table):
            if policy.chunks is not None:
                chunks = int(policy.chunks)
            else:
                max_pages = int(np.diff(table.kv_indptr).max(initial=0))
                chunks = choose_chunks(tiles, num_kv_heads, max_pages, self.spec.kv_layout.page_size, sms,
                                       min_chunk_tokens=policy.min_chunk_tokens,
                                       min_fill=0.0 if forced else SPLIT_MIN_FILL)
        if forced or chunks > 1 or tiles * num_kv_heads >= sms:
            return "sm90", chunks
        return "portable", 1

    def _chunked_run(self, slot: int, inner, source: LevelTable, chunked, positions: dict) -> "ChunkedRun":
        """The kept ``ChunkedRun`` of shared slot ``slot`` (its buffers reused from plan to plan), set to ``inner``
        planned over ``chunked`` (the ``ChunkedLevel`` of ``source``) at ``positions`` (its plan arguments, or
        empty)."""
        run = self._chunked.get(slot)
        if run is None:
            run = self._chunked[slot] = ChunkedRun()
        run.inner, run.chunks, run.source, run.level, run.positions = inner, chunked.chunks, source, chunked, positions
        return run

    def _planned(self, key: tuple, spec: AttentionSpec, backend: str, index: int | None, derived: bool,
                 table: LevelTable, common: dict):
        """The inner wrapper of ``key`` (made on first use), planned over ``table``."""
        inner = self._inner.get(key)
        if inner is None:
            graph = {"use_cuda_graph": self.use_cuda_graph, "device": self.device, "num_sms": self._num_sms,
                     "max_num_pages": self.max_num_pages}
            if backend == "decode":
                inner = BatchDecodeWrapper(spec, max_batch_size=self.max_total_q if self.use_cuda_graph else None,
                                           kernel_options=self._options, **graph)
            else:
                capacity = (self.max_batch_size, self.max_total_q) if self.use_cuda_graph else (None, None)
                inner = BatchPrefillWrapper(spec, max_batch_size=capacity[0], max_total_q=capacity[1],
                                            backend=backend, kernel_options=self._options, **graph)
            self._inner[key] = inner
        try:
            if backend == "decode":
                inner.plan(**table.table(), **common)
            else:
                inner.plan(qo_indptr=table.qo_indptr, **table.table(), **common)
        except PlanError as exc:
            where = "a level with no KV" if index is None else f"levels[{index}]{' (derived)' if derived else ''}"
            raise type(exc)(f"{where}: {exc}") from exc
        return inner

    def _records(self, tables, ran_tables, choices, ran, last_backend) -> tuple[LevelRecord, ...]:
        records = []
        for index, table in enumerate(tables):
            table = ran_tables.get(index, table)
            kv = int(table.kv_lens.sum())
            if index == len(tables) - 1:
                records.append(LevelRecord(index, table.groups, kv, last_backend))
                continue
            choice = choices[index]
            runs, chunks = ran[index] if choice.decision == "run" else (choice.decision, 1)
            cost = choice.cost or (None, None)
            records.append(LevelRecord(index, table.groups, kv, runs, *cost, chunks))
        return tuple(records)

    # ------------------------------------------------------------------------------------------ run

    def run(self, q: torch.Tensor, kv_cache, out: torch.Tensor | None = None, return_lse: bool = False):
        """Attend ``q [total_q, num_qo_heads, head_dim]`` (``max_total_q`` rows in CUDA-graph mode) over the
        planned levels of ``kv_cache`` (one ``[pages, 2, ...]`` tensor or a ``(k, v)`` pair, as the decode wrapper
        takes it). Returns ``out [total_q, num_qo_heads, head_dim_vo]`` (q's dtype), with ``return_lse`` also
        ``lse [total_q, num_qo_heads]`` fp32 (natural log of the whole sequence's softmax sum; -inf for a row
        that sees no key). Host time: each level's run and, after the first, a merge launch; a level split over
        its keys adds q's copy (its run and merge are one each).
        """
        runs = self._runs
        if runs is None:
            raise RuntimeError("run: call plan() first")
        out, lse = runs[0].run(q, kv_cache, out=out, return_lse=True)
        if len(runs) > 1:
            scratch = self._scratch
            if (scratch is None or scratch.shape != out.shape or scratch.dtype != out.dtype
                    or scratch.device != out.device):
                scratch = self._scratch = torch.empty_like(out, memory_format=torch.contiguous_format)
            for inner in runs[1:]:
                part, part_lse = inner.run(q, kv_cache, out=scratch, return_lse=True)
                merge_state_in_place(out, lse, part, part_lse)
        for split in self._split:
            split.run(q, kv_cache, out, lse)
        return (out, lse) if return_lse else out


class ChunkedRun:
    """A shared level split over its keys into ``chunks`` (``plan.cascade_split``), planned in ``inner`` (a
    ``BatchPrefillWrapper`` on the Hopper kernel) as ``chunks x groups`` requests over q repeated ``chunks``
    times. ``run`` copies q into a buffer kept from run to run (``[chunks, total_q, heads, head_dim]``), attends,
    and merges the ``chunks`` states into ``(out, lse)`` in one launch. ``source`` (the level's table), ``level``
    (its ``ChunkedLevel``) and ``positions`` (``kv_page_pos`` / ``q_pos``, or empty) record what ``inner`` was
    planned over."""

    def __init__(self):
        self.inner, self.chunks, self.source, self.level, self.positions = None, 1, None, None, {}
        self._q: torch.Tensor | None = None
        self._out: torch.Tensor | None = None

    def run(self, q: torch.Tensor, kv_cache, out: torch.Tensor, lse: torch.Tensor) -> None:
        shape = (self.chunks, *q.shape)
        buf = self._q
        if buf is None or buf.shape != shape or buf.dtype != q.dtype or buf.device != q.device:
            buf = self._q = torch.empty(shape, dtype=q.dtype, device=q.device)
        parts = self._out
        if parts is None or parts.shape[1:] != out.shape or parts.shape[0] != self.chunks or parts.dtype != out.dtype \
                or parts.device != out.device:
            parts = self._out = torch.empty((self.chunks, *out.shape), dtype=out.dtype, device=out.device)
        buf.copy_(q.unsqueeze(0).expand(shape))
        _, parts_lse = self.inner.run(buf.view(-1, *q.shape[1:]), kv_cache, out=parts.view(-1, *out.shape[1:]),
                                      return_lse=True)
        merge_states_in_place(out, lse, parts, parts_lse.view(self.chunks, *lse.shape))
