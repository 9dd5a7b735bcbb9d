"""The split-KV plan's types: its schema and info record, and the request every planning path takes."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from .heuristics import SplitPolicy

SPLIT_KV_SCHEMA = {
    # per request (length max_batch_size [+ 1]); padded requests have qo_len = kv_len = num_chunks = 0
    "qo_indptr": "[max_batch_size + 1] token offsets of each request's queries (padded with the last value)",
    "kv_len": "[max_batch_size] KV length in tokens",
    "num_chunks": "[max_batch_size] kv chunks (items per qo tile) of the uniform split; 1 = unsplit; 0 = no queries "
                  "or padding; a tile split for the last wave (balance_tail) has its tokens' merge range instead",
    # per output token (length max_total_q + 1)
    "merge_indptr": "[max_total_q + 1] token t's partial rows are merge_indptr[t] .. merge_indptr[t + 1]; "
                    "an empty range means the token was written directly (or is padding)",
    # per work item (length capacity); padding items have request_idx = -1 and kv_start = kv_end = 0
    "request_idx": "[capacity] request of the item, -1 for a padding item (a no-op: writes nothing)",
    "qo_tile_idx": "[capacity] qo tile of the item within its request",
    "chunk_idx": "[capacity] chunk number of a split request (partial row = merge_indptr[token] + chunk_idx), "
                 "-1 when the request is unsplit (write out[qo_indptr[request] + token] directly)",
    "kv_start": "[capacity] first KV position (token index within the request) of the chunk",
    "kv_end": "[capacity] one past the last KV position; kv_end == kv_start on a real item means empty KV: "
              "write out = 0, lse = -inf",
}
ITEM_FIELDS = ("request_idx", "qo_tile_idx", "chunk_idx", "kv_start", "kv_end")
ITEM_PADS = np.array([-1, 0, 0, 0, 0])  # a padding item, per item field


class SplitKVInfo(NamedTuple):
    """Host-side sizes of a split-KV plan, for a grid of ``capacity * num_kv_heads`` CTAs.

    ``partial_capacity`` is the number of partial rows the tmp buffers must hold: ``tmp_o [partial_capacity,
    num_qo_heads, head_dim_vo]`` fp32 and ``tmp_lse [partial_capacity, num_qo_heads]`` fp32 (natural log).
    """

    batch_size: int
    max_batch_size: int
    total_q: int
    max_total_q: int
    num_items: int
    capacity: int
    num_qo_heads: int
    num_kv_heads: int
    group_size: int
    tile_rows: int
    kv_chunk: int
    partial_rows: int
    partial_capacity: int
    fixed_capacity: bool

    @property
    def grid(self) -> tuple[int, int]:
        return (self.capacity, self.num_kv_heads)


class PlanRequest(NamedTuple):
    """One validated planning call, as every path takes it (``split_kv._plan_general``, the reference, and the
    fast paths): the batch, the sizes resolved from it (``split_kv._sizes``), and the caller's options.

    ``qo``, ``lens``, ``qo_len`` are numpy int arrays (int32 or int64) on the numpy paths and Python lists on
    the list paths; a decode request of one tile a request has ``qo = qo_len = None``. Built with
    ``new_request(batch + sizes + options)`` from three plain tuples in this order, without the Python-level
    ``__new__`` (a decode step plans once per step: ~1 us less).
    """

    # the batch (split_kv._checked_inputs, list_paths.small_inputs)
    qo: Any  # qo_indptr [batch + 1]
    lens: Any  # kv_lens [batch]
    qo_len: Any  # query tokens per request [batch]
    longest_q: int  # the longest query
    max_len: int  # the longest KV
    # the sizes (split_kv._sizes): per-request and per-token field lengths, packed q rows a tile, item slots and
    # partial rows; capacity = partial_capacity = None: exact, the batch's own
    max_batch_size: int
    max_total_q: int
    tile_rows: int
    capacity: int | None
    partial_capacity: int | None
    # the caller's options (plan_split_kv's keywords)
    num_qo_heads: int
    num_kv_heads: int
    kv_granularity: int
    num_sms: int
    item_overhead: int
    enable_split: bool
    balance_tail: bool
    split_min_waves: float | None
    policy: SplitPolicy
    host_buffer: Any  # torch.Tensor | None: an int32 CPU buffer to reuse


# PlanRequest's sections, to unpack one in one step (``max_batch_size, max_total_q, tile_rows, capacity,
# partial_capacity = request[SIZES]``): cheaper than an attribute access a field on the hot paths
BATCH, SIZES, OPTIONS = slice(0, 5), slice(5, 10), slice(10, 20)

# NamedTuple(...) without its Python-level __new__: a tuple of the fields in order
new_request = functools.partial(tuple.__new__, PlanRequest)
new_info = functools.partial(tuple.__new__, SplitKVInfo)
