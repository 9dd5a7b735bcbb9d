"""A CPU executor for plans: runs every work item with the reference math and merges the partials.

It does what a kernel does with a plan, item by item (kv heads as the second grid dimension), in fp64:
each item attends its qo tile's packed rows over its KV chunk and writes either the output (unsplit) or a
partial state (split); then the merge schedule combines the partials. It also checks that every output
row and every partial row is written exactly once, so a wrong partition fails loudly even where the
numbers would happen to agree. Agreement with ``reference_attention`` proves the partition on a CPU.
"""

from __future__ import annotations

import numpy as np
import torch

from flashgen.plan import Plan
from flashgen.spec import AttentionSpec, CustomMask, NoMask, Paged

from .layouts import request_kv
from .reference import _extra_masks, attend, merge_states_ref, request_positions, runtime_params


class PlanExecutionError(AssertionError):
    """A plan wrote an output or partial row twice, or never."""


def _item_rows(plan: Plan, item: int, qo_len: int):
    info = plan.info
    g = info.group_size
    p0 = int(plan.numpy("qo_tile_idx")[item]) * info.tile_rows
    p1 = min(p0 + info.tile_rows, qo_len * g)
    packed = np.arange(p0, p1)
    tokens = packed // g  # [n]
    heads = np.arange(info.num_kv_heads)[:, None] * g + packed[None, :] % g  # [num_kv_heads, n]
    return tokens, heads


def _run_split_kv(plan: Plan, spec: AttentionSpec, params, q: torch.Tensor, requests, extras):
    """Execute a split-KV plan over per-request dense K/V; returns (out, lse) fp64."""
    info = plan.info
    qo_indptr, merge_indptr = plan.numpy("qo_indptr").astype(np.int64), plan.numpy("merge_indptr").astype(np.int64)
    heads_q, dv = q.shape[1], spec.head_dim_vo
    out = torch.zeros(q.shape[0], heads_q, dv, dtype=torch.float64)
    lse = torch.full((q.shape[0], heads_q), float("-inf"), dtype=torch.float64)
    tmp_o = torch.full((info.partial_rows, heads_q, dv), float("nan"), dtype=torch.float64)
    tmp_lse = torch.full((info.partial_rows, heads_q), float("nan"), dtype=torch.float64)
    written = np.zeros((q.shape[0], heads_q), np.int64)
    partial_written = np.zeros((info.partial_rows, heads_q), np.int64)
    request_idx, chunk_idx = plan.numpy("request_idx"), plan.numpy("chunk_idx")
    kv_start, kv_end = plan.numpy("kv_start"), plan.numpy("kv_end")
    for item in range(info.capacity):
        r = int(request_idx[item])
        if r < 0:
            if item < info.num_items or kv_start[item] != kv_end[item]:
                raise PlanExecutionError(f"item {item}: a padding item inside the batch or with a KV range")
            continue
        first, qo_len = int(qo_indptr[r]), int(qo_indptr[r + 1] - qo_indptr[r])
        k, v = requests[r]
        tokens, heads = _item_rows(plan, item, qo_len)
        t0, t1 = int(tokens[0]), int(tokens[-1]) + 1
        a, b = int(kv_start[item]), int(kv_end[item])
        q_pos, k_pos = request_positions(qo_len, k.shape[0])
        extra = None if extras[r] is None else extras[r][t0:t1, a:b]
        o, s = attend(spec, params, q[first + t0: first + t1].double(), k[a:b].double(), v[a:b].double(),
                      q_pos[t0:t1], k_pos[a:b], extra)
        rows = np.broadcast_to(tokens, heads.shape)
        if chunk_idx[item] < 0:
            out[first + rows, heads] = o[rows - t0, heads]
            lse[first + rows, heads] = s[rows - t0, heads]
            np.add.at(written, (first + rows, heads), 1)
        else:
            prow = merge_indptr[first + rows] + int(chunk_idx[item])
            tmp_o[prow, heads] = o[rows - t0, heads]
            tmp_lse[prow, heads] = s[rows - t0, heads]
            np.add.at(partial_written, (prow, heads), 1)
    _merge(merge_indptr[: q.shape[0] + 1], tmp_o, tmp_lse, out, lse, written)
    if (written != 1).any() or (partial_written != 1).any():
        bad = np.argwhere(written != 1)
        where = f"output (token, head) {tuple(bad[0])} written {written[tuple(bad[0])]} times" if bad.size else \
            f"partial (row, head) {tuple(np.argwhere(partial_written != 1)[0])} not written exactly once"
        raise PlanExecutionError(f"plan coverage: {where}")
    return out, lse


def _merge(merge_indptr, tmp_o, tmp_lse, out, lse, written) -> None:
    counts = np.diff(merge_indptr)
    for count in np.unique(counts[counts > 0]):
        tokens = np.flatnonzero(counts == count)
        rows = merge_indptr[tokens][:, None] + np.arange(count)[None, :]
        out[tokens], lse[tokens] = merge_states_ref(tmp_o[rows], tmp_lse[rows])
        written[tokens] += 1


def _block_sparse_requests(plan: Plan, kv):
    from .layouts import split_kv
    k, v = split_kv(kv)
    page_size, n = plan.info.page_size, k.shape[0]
    pad = -n % page_size
    pages = [torch.cat([x, x.new_zeros(pad, *x.shape[1:])]).view(-1, page_size, *x.shape[1:]) for x in (k, v)]
    return request_kv(AttentionSpec(64, kv_layout=Paged(page_size)), tuple(pages),
                      kv_indptr=plan.numpy("kv_indptr"), kv_indices=plan.numpy("kv_indices"),
                      kv_last_page_len=plan.numpy("kv_last_page_len"))


def run_plan(plan: Plan, spec: AttentionSpec, q: torch.Tensor, kv: object, *, kv_indptr=None, kv_indices=None,
             kv_last_page_len=None, block_table=None, seq_lens=None, custom_mask=None, levels=None,
             **runtime) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``plan`` on the CPU with the reference math: ``(out [total_q, num_qo_heads, head_dim_vo], lse)`` fp64.

    Arguments as for ``reference_attention`` (``q``, ``kv`` in ``spec.kv_layout``, page table, custom mask,
    runtime values). Plan kinds: ``"split_kv"``; ``"block_sparse"`` (``kv`` is the dense ``(k, v)`` and the
    page table comes from the plan); ``"cascade"`` (``levels[l]`` is a dict with level ``l``'s page table,
    e.g. ``dict(kv_indptr=..., kv_indices=..., kv_last_page_len=...)``, all over the same ``kv`` pool).
    Raises ``PlanExecutionError`` when the plan writes an output or partial row other than once.

    Example::

        plan = plan_decode(kv_lens, num_qo_heads=8, num_kv_heads=2)
        out, lse = run_plan(plan, spec, q, kv, kv_indptr=kv_indptr, kv_indices=kv_indices,
                            kv_last_page_len=kv_last_page_len)
    """
    params = runtime_params(spec, **runtime)
    if plan.kind == "cascade":
        return _run_cascade(plan, spec, params, q, kv, levels)
    if plan.kind == "block_sparse":
        if not isinstance(spec.mask, NoMask) or spec.pos_encoding is not None:
            raise NotImplementedError("block-sparse plans use logical KV positions: no mask or positions")
        return _run_split_kv(plan.sub("", "split_kv", plan.info.split_kv), spec, params, q,
                             _block_sparse_requests(plan, kv), [None] * plan.info.split_kv.batch_size)
    requests = request_kv(spec, kv, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=kv_last_page_len,
                          block_table=block_table, seq_lens=seq_lens)
    batch = plan.info.batch_size
    qo_lens = np.diff(plan.numpy("qo_indptr")[: batch + 1]).tolist()
    if len(requests) != batch or sum(qo_lens) != q.shape[0]:
        raise ValueError(f"plan: {batch} requests, {sum(qo_lens)} query tokens; inputs: {len(requests)} "
                         f"requests, {q.shape[0]} query tokens")
    extras = _extra_masks(spec, custom_mask, None, qo_lens, [k.shape[0] for k, _ in requests]) \
        if isinstance(spec.mask, CustomMask) else [None] * batch
    return _run_split_kv(plan, spec, params, q, requests, extras)


def _run_cascade(plan: Plan, spec: AttentionSpec, params, q: torch.Tensor, kv, levels):
    info = plan.info
    if levels is None or len(levels) != info.num_levels:
        raise ValueError(f"levels: expected {info.num_levels} page tables, one per cascade level")
    if spec.pos_encoding is not None or not isinstance(spec.mask, NoMask) and not spec.is_causal:
        raise NotImplementedError("cascade plans take no positional encoding and a NoMask or Causal mask")
    last = plan.level(info.num_levels - 1)
    if spec.is_causal and (np.diff(last.numpy("qo_indptr")) > last.numpy("kv_len")).any():
        raise ValueError("levels: with a causal mask each request's queries must lie in its unique suffix "
                         "(last-level kv_len >= qo_len)")
    states = []
    for level in range(info.num_levels):
        level_spec = spec if level == info.num_levels - 1 else spec.replace(mask=NoMask())
        requests = request_kv(level_spec, kv, **levels[level])
        states.append(_run_split_kv(plan.level(level), level_spec, params, q, requests, [None] * len(requests)))
    return merge_states_ref(torch.stack([o for o, _ in states], 1), torch.stack([s for _, s in states], 1))


def coverage(plan: Plan) -> list[np.ndarray]:
    """How often each (query token, q head, kv position) is visited: one ``[qo_len, num_qo_heads, kv_len]``
    int array per request (a correct split-KV plan gives all ones). ``plan`` is a split-KV plan.
    """
    info = plan.info
    qo_indptr, kv_len = plan.numpy("qo_indptr"), plan.numpy("kv_len")
    counts = [np.zeros((int(qo_indptr[r + 1] - qo_indptr[r]), info.num_qo_heads, int(kv_len[r])), np.int64)
              for r in range(info.batch_size)]
    for item in range(info.capacity):
        r = int(plan.numpy("request_idx")[item])
        if r < 0:
            continue
        tokens, heads = _item_rows(plan, item, counts[r].shape[0])
        rows = np.broadcast_to(tokens, heads.shape)
        a, b = int(plan.numpy("kv_start")[item]), int(plan.numpy("kv_end")[item])
        counts[r][rows, heads, a:b] += 1
    return counts
