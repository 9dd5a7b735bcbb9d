"""The decode rows' route: flat (one decode launch a layer) or the cascade (shared pages read once a group), each
replayed from a CUDA graph where the engine can, chosen by the step's host and GPU time together.

The cascade's cost model (``flashgen.plan.choose_levels``) weighs GPU time only: the bytes a shared level saves
against its launches and matrix work. A serving step pays host time too, and the two routes differ there: the
cascade derives its levels from the page ids and plans one wrapper a level, and, eager, launches each level and
a merge a layer. A decode-only step that a bucket holds replays either route from a CUDA graph
(``graphs.DecodeGraphs``; a cascade graph runs ``CASCADE_LEVELS`` levels, so the route derives no more for such
a step); other steps run every layer's model ops eagerly. Per step, in µs (``HostCosts`` holds the constants)::

    flat, replayed      plan_us + replay_us                                          + layers * attention
    flat, eager         plan_us + layers * (layer_us + launch_us)                    + layers * attention
    cascade, replayed   derive + runs * plan_us + replay_us                          + layers * (attention - saving)
    cascade, eager      derive + runs * plan_us + layers * (layer_us + (2 runs - 1) * launch_us)
                                                                                     + layers * (attention - saving)

``runs``: the levels that run (shared ones and the last; a replayed cascade plans ``CASCADE_LEVELS``);
``saving``: the GPU µs a layer the running shared levels save (``flat_us - cascade_us`` of each, the cascade's
cost model); ``derive``: the level derivation (``derive_us``). The cascade is chosen where its host cost over
the flat path's is below ``layers * saving``. Host and GPU time add (the eager loop synchronizes around each
layer's attention, and at this size the host bounds the step); the model's GPU work outside attention is the
same on either route and is left out.

Before any page id past the first of each row is read, one bound settles most steps: rows share pages only
with neighbours that start with the same page, so a layer cannot save more than those pairs' reads
(``shared_tokens_bound``, at the copy rate); where ``layers`` times that is below the cascade's least extra host
cost (two levels), the rows go flat without deriving levels. ``flashgen demo`` on the H200 (8 layers, 32 q / 8 kv
heads x 128, bf16, up to 128 rows, a third of them after one 512-token system prompt): the neighbours' reads
are ~32k tokens, 30 µs a layer, 240 µs a step, against the cascade's least extra host cost of ~0.36 ms (its
derivation and a second plan; eager, also two more launches a layer: ~0.5 ms): flat. 128 requests after a
32k-token shared prefix: flat reads 17.2 GB a layer (4.0 ms), the shared level saves 3.7 ms of it, 30 ms a step
at 8 layers against ~0.6 ms of host replayed (~0.8 ms eager): the cascade.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from ..kvcache import PageTables
from ..plan.cascade import LevelTable, derive_levels
from ..plan.cascade_cost import CascadePolicy, Shape, check_policy, choose_levels, flat_read_us
from ..spec import AttentionSpec


CASCADE_LEVELS = 2  # the levels of a replayed cascade step: one shared level and the last (deeper pages stay there)


class HostCosts(NamedTuple):
    """Host µs of the serving loop's parts, for the route (module docstring); the defaults as each says.

    ``launch_us``: one launch through a wrapper's ``run()`` (8-11 µs measured on the H200 host; the bare
    ``cuLaunchKernel`` is 4.7 µs, docs/DESIGN.md). ``plan_us``: one wrapper ``plan()`` (the ~100 µs budget).
    ``replay_us``: a replayed step's own host work besides its plan (the inputs' copy and the graph launch).
    ``layer_us``: one layer's eager model ops besides attention: 58 torch ops counted on the CPU (RMSNorm,
    projections, RoPE on q, the o projection, the SwiGLU MLP), ~40 of which launch a kernel at ~6.9 µs each
    (a torch elementwise op, docs/DESIGN.md), and the ``append_kv`` write. ``derive_us`` +
    ``derive_ns_per_page`` x page ids: deriving the levels (``derive_levels`` from the block table, and
    ``choose_levels``), measured on the 2-core CI host (benchmarks/experiments/exp_cascade_route_host.py: 200-430
    µs for 128 rows of 4.6k-264k page ids), not yet on the H200 host.
    """

    launch_us: float = 10.0
    plan_us: float = 100.0
    replay_us: float = 20.0
    layer_us: float = 300.0
    derive_us: float = 250.0
    derive_ns_per_page: float = 1.0


class Route(NamedTuple):
    """The decode rows' route: ``name`` ("flat" or "cascade"), ``levels`` (the cascade's levels as they run,
    the last holding any folded pages; None when flat), and the step estimates (µs of host work plus
    attention's GPU time, None where the step model was not consulted) of each path."""

    name: str
    levels: list[LevelTable] | None = None
    flat_us: float | None = None
    cascade_us: float | None = None


def _check_costs(costs: object) -> HostCosts:
    if costs is None:
        return HostCosts()
    if not isinstance(costs, HostCosts):
        raise TypeError(f"host_costs: expected a HostCosts, got {type(costs).__name__}")
    for name, value in costs._asdict().items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise ValueError(f"host_costs.{name}: got {value!r}, expected a finite number >= 0")
    return costs


def step_host_us(route: str, layers: int, graph: bool, runs: int, pages: int, costs: HostCosts) -> float:
    """Host µs of a step's decode route (module docstring): ``"flat"`` or ``"cascade"`` with ``runs`` levels
    running over ``pages`` page ids, replayed from a graph when ``graph``.

    >>> costs = HostCosts()
    >>> [round(step_host_us(route, 8, graph, 2, 4582, costs)) for route in ("flat", "cascade")
    ...  for graph in (True, False)]
    [120, 2580, 475, 3095]
    """
    if route == "flat":
        return costs.plan_us + (costs.replay_us if graph else layers * (costs.layer_us + costs.launch_us))
    derive = costs.derive_us + costs.derive_ns_per_page * 1e-3 * pages
    if graph:
        return derive + CASCADE_LEVELS * costs.plan_us + costs.replay_us
    return derive + runs * costs.plan_us + layers * (costs.layer_us + (2 * runs - 1) * costs.launch_us)


@functools.lru_cache(maxsize=64)
def attention_shape(spec: AttentionSpec, num_qo_heads: int, num_kv_heads: int) -> Shape:
    """The cascade cost model's ``Shape`` of ``spec`` with these heads (made once: a step reads it)."""
    from ..kernels import launch_config

    return Shape(num_qo_heads, num_kv_heads, spec.head_dim, spec.head_dim_vo, getattr(torch, spec.kv_dtype).itemsize,
                 getattr(torch, spec.dtype).itemsize, launch_config(spec, "prefill").tile_q)


def shared_tokens_bound(decode: PageTables) -> int:
    """An upper bound on the key reads a cascade of decode rows ``decode`` saves, in tokens, from the rows' first
    page ids and lengths only (one numpy pass over the batch): rows share pages only with neighbours that start
    with the same page, and a group of ``r`` rows sharing ``s`` keys saves ``(r - 1) s`` reads, at most the sum of
    ``min(len_b, len_b+1)`` over its neighbouring pairs.

    >>> from flashgen.kvcache.tables import build_tables
    >>> shared_tokens_bound(build_tables([[7, 8, 1], [7, 8, 2], [9]], [40, 36, 5], 16))   # rows 0 and 1: 36
    36
    """
    indptr = decode.kv_indptr.numpy()
    ids = decode.kv_indices_host.numpy()
    lens = decode.seq_lens.numpy().astype(np.int64)
    if ids.size == 0 or lens.size < 2:
        return 0
    held = indptr[1:] > indptr[:-1]
    heads = np.where(held, ids[np.minimum(indptr[:-1], ids.size - 1)], -1)
    pairs = held[:-1] & held[1:] & (heads[:-1] == heads[1:])
    return int(np.minimum(lens[:-1], lens[1:])[pairs].sum())


def cascade_levels(decode: PageTables, spec: AttentionSpec, shape: Shape, policy: CascadePolicy,
                   max_levels: int | None = None):
    """``(levels as they run, the cost model's choices)`` of decode rows ``decode`` (levels derived from the
    host page ids, neighbours compared as block-table rows, at most ``max_levels``; those that do not pay
    folded), or None where nothing shared runs on its own."""
    batch = int(decode.seq_lens.numel())
    if batch < 2:
        return None
    page_size = spec.kv_layout.page_size
    levels, flat = derive_levels(np.arange(batch + 1), decode.kv_indptr.numpy(), decode.kv_indices_host.numpy(),
                                 decode.kv_last_page_len.numpy(), page_size, with_table=True,
                                 block_table=decode.block_table_host.numpy(), max_levels=max_levels)
    if len(levels) == 1:
        return None
    kept, tables, choices = choose_levels(levels, shape, page_size, policy, False, flat)
    return (tables, choices) if len(kept) > 1 else None


def route_decode(decode: PageTables, spec: AttentionSpec, num_qo_heads: int, num_kv_heads: int, *,
                 layers: int = 1, graph: bool = False, policy: CascadePolicy | None = None,
                 host_costs: HostCosts | None = None, max_levels: int | None = None) -> Route:
    """The route of a step's decode rows ``decode`` (page tables, host lengths and page ids) through ``layers``
    layers; ``graph``: the step would replay a CUDA graph (decode-only, a bucket holds it); ``max_levels``: the
    most levels the cascade may run (``CASCADE_LEVELS`` for a replayed one). ``policy.fold``
    ``"always"`` routes flat, ``"never"`` through the cascade wherever a shared level has keys, ``"cost"`` (the
    default) by the step model (module docstring). Host work: O(1) where the bound settles it, else one
    derivation of the levels (numpy passes over the page ids); no GPU sync.

    >>> route_decode(cache.page_tables(ids), spec, 32, 8, layers=8, graph=True).name  # doctest: +SKIP
    'flat'
    """
    policy = check_policy(policy)
    costs = _check_costs(host_costs)
    if isinstance(layers, bool) or not isinstance(layers, (int, np.integer)) or layers < 1:
        raise ValueError(f"layers: got {layers!r}, expected an int >= 1")
    if policy.fold == "always" or int(decode.seq_lens.numel()) < 2:
        return Route("flat")
    shape = attention_shape(spec, num_qo_heads, num_kv_heads)
    pages = int(decode.kv_indptr[-1])
    flat_host = step_host_us("flat", layers, graph, 1, pages, costs)
    attention = flat_read_us(int(decode.seq_lens.numpy().sum(dtype=np.int64)), shape, policy)
    flat_us = flat_host + layers * attention
    if policy.fold == "cost":
        bound = flat_read_us(shared_tokens_bound(decode), shape, policy)
        if layers * bound <= step_host_us("cascade", layers, graph, 2, pages, costs) - flat_host:
            return Route("flat", None, flat_us, None)
    found = cascade_levels(decode, spec, shape, policy, max_levels)
    if found is None:
        return Route("flat")
    tables, choices = found
    saving = sum(c.cost.flat_us - c.cost.cascade_us for c in choices if c.decision == "run")
    cascade_us = step_host_us("cascade", layers, graph, len(tables), pages, costs) + layers * (attention - saving)
    if policy.fold == "never" or cascade_us < flat_us:
        return Route("cascade", tables, flat_us, cascade_us)
    return Route("flat", None, flat_us, cascade_us)
