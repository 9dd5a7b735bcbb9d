"""Page tables for ``plan()`` in both forms, and the per-token write coordinates of an append, built from the
sequences' page lists (host int32 arrays; one numpy pass each, no per-token Python loop)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch


@dataclass(frozen=True)
class PageTables:
    """A batch's page tables, in batch order (host int32 CPU tensors unless noted).

    CSR: ``kv_indptr [batch + 1]``, ``kv_indices [kv_indptr[-1]]`` (on ``device`` when one was asked for, else
    the host tensor), ``kv_last_page_len [batch]``. Block table: ``block_table [batch, max_pages]`` padded with
    -1 (on ``device`` when asked for), ``seq_lens [batch]``. ``kv_indices_host``/``block_table_host``: the host
    copies. ``csr()`` and ``blocks()`` give the keyword arguments of ``wrapper.plan``.

    >>> wrapper.plan(**tables.csr(), num_qo_heads=32, num_kv_heads=8)  # doctest: +SKIP
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    kv_indices_host: torch.Tensor
    block_table_host: torch.Tensor

    def csr(self) -> dict:
        return {"kv_indptr": self.kv_indptr, "kv_indices": self.kv_indices, "kv_last_page_len": self.kv_last_page_len}

    def blocks(self) -> dict:
        return {"block_table": self.block_table, "seq_lens": self.seq_lens}


@dataclass(frozen=True)
class WriteCoords:
    """Where an append writes each new token (host int32 CPU tensors, tokens in batch order).

    ``slot_mapping [n]``: ``page * page_size + offset`` (vLLM); ``batch_indices [n]`` and ``positions [n]``: the
    token's request in the batch and its position in that request's KV (FlashInfer); ``append_indptr
    [batch + 1]``: the new tokens of request ``b`` are rows ``append_indptr[b]:append_indptr[b + 1]``.
    """

    slot_mapping: torch.Tensor
    batch_indices: torch.Tensor
    positions: torch.Tensor
    append_indptr: torch.Tensor


def build_tables(page_lists: list[list[int]], lens: list[int], page_size: int,
                 device: torch.device | str | None = None) -> PageTables:
    """The page tables of sequences with pages ``page_lists[b]`` and KV lengths ``lens[b]``."""
    counts = np.fromiter(map(len, page_lists), dtype=np.int64, count=len(page_lists))
    indptr = np.zeros(len(page_lists) + 1, dtype=np.int32)
    np.cumsum(counts, out=indptr[1:])
    indices = np.fromiter(chain.from_iterable(page_lists), dtype=np.int32, count=int(indptr[-1]))
    seq_lens = np.asarray(lens, dtype=np.int32)
    last = np.where(counts > 0, seq_lens - (counts - 1) * page_size, 0).astype(np.int32)
    width = int(counts.max(initial=0))
    table = np.full((len(page_lists), width), -1, dtype=np.int32)
    rows = np.repeat(np.arange(len(page_lists)), counts)
    cols = np.arange(indices.size) - np.repeat(indptr[:-1], counts)
    table[rows, cols] = indices
    indices_t, table_t = torch.from_numpy(indices), torch.from_numpy(table)
    on_device = device is not None and torch.device(device).type != "cpu"
    return PageTables(
        kv_indptr=torch.from_numpy(indptr), kv_last_page_len=torch.from_numpy(last), seq_lens=torch.from_numpy(seq_lens),
        kv_indices=indices_t.to(device) if on_device else indices_t,
        block_table=table_t.to(device) if on_device else table_t,
        kv_indices_host=indices_t, block_table_host=table_t)


def build_write_coords(page_lists: list[list[int]], lens: list[int], num_new: list[int], page_size: int
                       ) -> WriteCoords:
    """Coordinates of the last ``num_new[b]`` tokens of each sequence (already allocated)."""
    new = np.asarray(num_new, dtype=np.int64)
    indptr = np.zeros(new.size + 1, dtype=np.int64)
    np.cumsum(new, out=indptr[1:])
    batch = np.repeat(np.arange(new.size), new)
    positions = np.arange(int(indptr[-1])) - np.repeat(indptr[:-1], new) + np.repeat(np.asarray(lens, np.int64) - new, new)
    page_starts = np.zeros(new.size + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, page_lists), dtype=np.int64, count=new.size), out=page_starts[1:])
    flat = np.fromiter(chain.from_iterable(page_lists), dtype=np.int64, count=int(page_starts[-1]))
    pages = flat[page_starts[batch] + positions // page_size] if positions.size else positions
    slots = pages * page_size + positions % page_size
    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
    return WriteCoords(as_t(slots), as_t(batch), as_t(positions), as_t(indptr))
