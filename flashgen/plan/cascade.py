"""Cascade plans: a batch whose requests share KV prefixes, split into levels.

Level 0 is typically one group (the prefix all requests share), level 1 groups of requests (a prefix per
group), the last level one group per request (its unique suffix). Every level covers all ``total_q`` query
tokens: its ``qo_indptr`` cuts the batch's tokens into that level's groups (a group's requests must be
consecutive) and its ``kv_lens`` are the groups' own KV lengths over that level's pages. So a shared
prefix is read once per group, not once per request.

Each level is an ordinary split-KV plan (fields prefixed ``level{l}.``) whose result for token ``t`` is one
state of ``t``: ``level_o [total_q, num_levels, num_qo_heads, head_dim_vo]``, ``level_lse [total_q,
num_levels, num_qo_heads]``. The merge schedule is fixed: every token merges its ``num_levels`` states
along dim 1 (``merge_states``); a group with no KV contributes ``lse = -inf`` (weight 0).
Masks and positions: levels before the last see all of their KV (no mask); the last level applies the
spec's causal mask aligned to its own KV end, which equals causal attention over the whole sequence as
long as each request's queries lie in its unique suffix (last-level ``kv_len >= qo_len``).
"""

from __future__ import annotations

from typing import NamedTuple
from typing import Sequence

import numpy as np
import torch

from .host import PlanError
from .plan import Plan
from .heuristics import choose_kv_chunk, default_tile_rows
from .split_kv import SplitKVInfo, _batch_inputs, _check_options, split_kv_arrays


class CascadeInfo(NamedTuple):
    """Sizes of a cascade plan: ``levels[l]`` describes the split-KV plan of level ``l``."""

    num_levels: int
    total_q: int
    levels: tuple[SplitKVInfo, ...]


def plan_cascade(levels: Sequence[tuple[object, object]], *, num_qo_heads: int, num_kv_heads: int,
                 tile_rows: int | None = None, kv_granularity: int = 16, num_sms: int = 132,
                 item_overhead: int = 64, host_buffer: torch.Tensor | None = None) -> Plan:
    """Plan a cascade: ``levels[l] = (qo_indptr [groups_l + 1], kv_lens [groups_l])``, host ints.

    All levels' ``qo_indptr`` must end at the same ``total_q``. Returns a ``Plan`` of kind ``"cascade"``:
    fields ``level{l}.<SPLIT_KV_SCHEMA name>`` and a ``CascadeInfo``; ``plan.level(l)`` gives level ``l``
    as a split-KV plan over the same buffer.

    >>> plan = plan_cascade([([0, 6], [4096]), ([0, 2, 6], [100, 37])], num_qo_heads=8, num_kv_heads=2)
    >>> plan.info.num_levels, plan.level(1)["kv_len"].tolist()
    (2, [100, 37])
    """
    _check_options(num_qo_heads, num_kv_heads, tile_rows, kv_granularity, num_sms, item_overhead)
    if not levels:
        raise PlanError("levels: empty, expected at least one (qo_indptr, kv_lens) level")
    group_size = num_qo_heads // num_kv_heads
    arrays: dict[str, np.ndarray] = {}
    infos = []
    total_q = None
    for level, (qo_indptr, kv_lens) in enumerate(levels):
        qo, lens = _batch_inputs(qo_indptr, kv_lens)
        if total_q is None:
            total_q = int(qo[-1])
        elif qo[-1] != total_q:
            raise PlanError(f"levels[{level}]: qo_indptr[-1] = {int(qo[-1])}, expected total_q = {total_q} "
                            f"(every level covers all query tokens)")
        rows = default_tile_rows(int(np.diff(qo).max(initial=0)) * group_size) if tile_rows is None else tile_rows
        tiles = -(-(np.diff(qo) * group_size) // rows)
        chunk = choose_kv_chunk(lens, tiles, num_kv_heads, num_sms=num_sms, granularity=kv_granularity,
                                item_overhead=item_overhead)
        level_arrays, info = split_kv_arrays(qo, lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                             tile_rows=rows, kv_chunk=chunk, max_batch_size=qo.size - 1,
                                             max_total_q=total_q, capacity=None)
        for key, values in level_arrays.items():
            names = tuple(f"level{level}.{name}" for name in (key if isinstance(key, tuple) else (key,)))
            arrays[names if isinstance(key, tuple) else names[0]] = values
        infos.append(info)
    return Plan.pack("cascade", arrays, CascadeInfo(len(levels), total_q, tuple(infos)), host_buffer)

