"""The cascade's cost model: which shared levels pay for their own launch, and the folding of those that do not.

A shared level read flat costs every request re-reading the level's pages. Run as its own level it costs its
pages read once, the prefill's matrix work (every query of a group against the group's keys, q tiles padded
to the kernel's tile rows), two launches (the prefill and the merge) and the merge's bytes (the level's
output written and read back, the running output read and written). A level that does not pay is folded
into the next one (``cascade.fold_level``: its pages prepended to each group of the next level), so the
cascade is never estimated slower than flat attention. Levels are decided top-down: a folded level's pages
count in the next level's decision.

Rates are parameters (``CascadePolicy``); the defaults are the H200's: a 4.3 TB/s copy rate (bytes read plus
written, measured), 300 TFLOP/s for the prefill on these shapes (the portable kernel reaches ~390 on large
prefills; docs/performance.md), 5 µs a launch. In CUDA-graph mode every level launches anyway (a folded level
runs with no KV), so the launches and the merge cost nothing extra there.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .cascade import LevelTable, fold_lens, fold_level
from .host import PlanError

FOLDS = ("cost", "never", "always")


class CascadePolicy(NamedTuple):
    """How ``CascadeWrapper.plan`` decides which shared levels run.

    ``fold``: ``"cost"`` (default) folds the levels the cost model finds slower than flat; ``"never"`` runs every
    level that has KV; ``"always"`` folds every level it can (flat attention over the whole sequences, as one
    decode or prefill). Rates: ``copy_gbps`` (bytes read plus written per second, GB/s), ``matrix_tflops``
    (the prefill's rate), ``launch_us`` (GPU time a launch adds). ``min_chunk_tokens``: the fewest keys a chunk
    of a shared level split for the Hopper kernel holds (``cascade_split.choose_chunks``; whole pages).
    ``chunks``: None (the rule decides), or the chunks every shared level the Hopper kernel can split is cut
    into (1: none split; more: also where the rule would keep the portable kernel).
    """

    fold: str = "cost"
    copy_gbps: float = 4300.0
    matrix_tflops: float = 300.0
    launch_us: float = 5.0
    min_chunk_tokens: int = 2048
    chunks: int | None = None


def check_policy(policy: object) -> CascadePolicy:
    """``policy`` (None: the default) checked, or ``PlanError`` naming the field."""
    if policy is None:
        return CascadePolicy()
    if not isinstance(policy, CascadePolicy):
        raise PlanError(f"policy: expected a CascadePolicy, got {type(policy).__name__}")
    if policy.fold not in FOLDS:
        raise PlanError(f"policy.fold: got {policy.fold!r}, expected one of {', '.join(map(repr, FOLDS))}")
    for name in ("copy_gbps", "matrix_tflops"):
        value = getattr(policy, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise PlanError(f"policy.{name}: got {value!r}, expected a finite number > 0")
    if isinstance(policy.launch_us, bool) or not isinstance(policy.launch_us, (int, float)) or \
            not 0 <= policy.launch_us < float("inf"):
        raise PlanError(f"policy.launch_us: got {policy.launch_us!r}, expected a finite number >= 0")
    chunk = policy.min_chunk_tokens
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise PlanError(f"policy.min_chunk_tokens: got {chunk!r}, expected an int >= 1")
    chunks = policy.chunks
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1):
        raise PlanError(f"policy.chunks: got {chunks!r}, expected None or an int >= 1")
    return policy


class Shape(NamedTuple):
    """The attention's sizes the model reads: heads, head dims, bytes of a KV and an output element, and the
    prefill's q tile (packed rows, ``LaunchConfig.tile_q``)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int = 128
    head_dim_vo: int = 128
    kv_bytes: int = 2
    out_bytes: int = 2
    tile_rows: int = 128


def flat_read_us(kv_tokens: int, shape: Shape, policy: CascadePolicy = CascadePolicy()) -> float:
    """µs that attention reading ``kv_tokens`` keys and values once takes at the copy rate: flat decode's GPU
    time, and a bound on what a cascade of those rows can save.

    >>> round(flat_read_us(128 * 32768, Shape(32, 8)), 1)   # 128 requests of 32k keys: 17.2 GB
    3995.3
    """
    token_bytes = shape.num_kv_heads * (shape.head_dim + shape.head_dim_vo) * shape.kv_bytes
    return float(kv_tokens) * token_bytes / (policy.copy_gbps * 1e3)


class LevelCost(NamedTuple):
    """Estimated µs of a shared level: read flat by every request, or run as its own level."""

    flat_us: float
    cascade_us: float

    @property
    def pays(self) -> bool:
        return self.cascade_us < self.flat_us


def level_cost(kv_lens, qo_lens, readers, shape: Shape, policy: CascadePolicy = CascadePolicy(),
               fixed_launches: bool = False) -> LevelCost:
    """The cost of a shared level of groups with ``kv_lens`` keys, ``qo_lens`` query tokens and ``readers``
    requests (with queries) each, ``[groups]`` int arrays. ``fixed_launches``: the level launches anyway (CUDA
    graphs), so only its bytes and matrix work count.

    Batch 128 decoding over one shared prefix, bf16, 32 q / 8 kv heads, d 128 (4096 bytes of K+V a token). At
    32k keys flat reads 17.2 GB (3995 µs); the level reads 134 MB once (31 µs), its 512 q rows a kv head do
    68.7 GFLOP (229 µs), plus 10 µs of launches and 4.3 MB merged (1 µs): it pays, by 15x. At 1k keys: 125 µs
    flat against 19 µs. Two requests sharing one page of 16 tokens: 0.03 µs flat against 10 µs of launches.

    >>> shape = Shape(32, 8)
    >>> [tuple(round(x, 1) for x in level_cost([n], [128], [128], shape)) for n in (32768, 1024)]
    [(3995.3, 271.3), (124.9, 19.1)]
    >>> level_cost([16], [2], [2], shape).pays
    False
    """
    kv_lens = np.asarray(kv_lens, np.int64)
    qo_lens = np.asarray(qo_lens, np.int64)
    token_bytes = shape.num_kv_heads * (shape.head_dim + shape.head_dim_vo) * shape.kv_bytes
    per_us = policy.copy_gbps * 1e3  # bytes a µs
    flat_us = flat_read_us(float(kv_lens @ np.asarray(readers, np.int64)), shape, policy)
    group = shape.num_qo_heads // shape.num_kv_heads
    rows = -(-(qo_lens * group) // shape.tile_rows) * shape.tile_rows  # packed q rows a kv head, whole tiles
    flops = 2.0 * (shape.head_dim + shape.head_dim_vo) * float(rows @ kv_lens) * shape.num_kv_heads
    read_once = float(kv_lens.sum()) * token_bytes
    merged = 0.0 if fixed_launches else 4.0 * float(qo_lens.sum()) * shape.num_qo_heads * (
        shape.head_dim_vo * shape.out_bytes + 4)
    launches = 0.0 if fixed_launches else 2 * policy.launch_us
    cascade_us = (read_once + merged) / per_us + flops / (policy.matrix_tflops * 1e6) + launches
    return LevelCost(flat_us, cascade_us)


class LevelChoice(NamedTuple):
    """What the planner decided for one shared level: ``run`` (its own launch), ``"folded"`` (into the next
    level) or ``"empty"`` (no KV: nothing to run); the estimate, where one was made."""

    decision: str
    cost: LevelCost | None


def choose_levels(levels: list[LevelTable], shape: Shape, page_size: int, policy: CascadePolicy = CascadePolicy(),
                  fixed_launches: bool = False, flat: LevelTable | None = None
                  ) -> tuple[list[int], list[LevelTable], list[LevelChoice]]:
    """Decide the shared levels of ``levels`` (the last is the per-request level) top-down; returns ``(indices
    of the levels that run, their tables (the last included, with any folded pages), one LevelChoice a shared
    level)``. A level that should fold but cannot (``fold_level``: device page ids, groups that do not nest)
    runs. ``flat``: the per-request table derived levels came from, which is the last level when every shared
    level folds (saving the copy of every page id).

    >>> from flashgen.plan.cascade import derive_levels
    >>> levels = derive_levels([0, 1, 2], [0, 1, 2], [3, 3], [16, 16], page_size=16)   # one shared page
    >>> indices, tables, choices = choose_levels(levels, Shape(32, 8), 16)
    >>> indices, [c.decision for c in choices], tables[-1].kv_indices.tolist()
    ([1], ['folded'], [3, 3])
    """
    tables = list(levels)
    final = len(tables) - 1
    last = tables[final]
    starts = last.qo_indptr[:-1][np.diff(last.qo_indptr) > 0]  # first tokens of the requests with queries
    kept, choices = [], []
    for index in range(final):
        table = tables[index]
        if not table.kv_lens.any():
            choices.append(LevelChoice("empty", None))
            continue
        readers = np.searchsorted(starts, table.qo_indptr[1:]) - np.searchsorted(starts, table.qo_indptr[:-1])
        cost = level_cost(table.kv_lens, np.diff(table.qo_indptr), readers, shape, policy, fixed_launches)
        folded = None
        if policy.fold == "always" or (policy.fold == "cost" and not cost.pays):
            if index + 1 == final and not kept and flat is not None:
                folded = flat if fold_lens(table, last, page_size) is not None else None
            else:
                folded = fold_level(table, tables[index + 1], page_size)
        if folded is not None:
            tables[index + 1] = folded
            choices.append(LevelChoice("folded", cost))
        else:
            kept.append(index)
            choices.append(LevelChoice("run", cost))
    kept.append(final)
    return kept, [tables[i] for i in kept], choices
