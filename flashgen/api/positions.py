"""Explicit true positions for the decode and portable prefill wrappers (``kernel_options={"positions": True}``).

A wrapper built with the option takes, at every plan, ``kv_page_pos`` (int32, parallel to ``kv_indices``: the
true position of each page's first token; a token's own for ``Ragged()``) and ``q_pos`` (int32, one a query
token: its true position). Key ``t`` of request ``b`` (its place in the page list) then sits at
``kv_page_pos[kv_indptr[b] + t // page_size] + t % page_size``; masks (causal: ``k_pos <= q_pos``, window:
``q_pos - k_pos <= window_left``), RoPE and ALiBi (``k_pos - q_pos``) use these positions. Both travel with the
plan in its one upload (after ``kv_indptr``, before host page ids); in CUDA-graph mode each is padded to a
fixed size, so the arrays after them keep their places from plan to plan.
"""

from __future__ import annotations

import numpy as np

from ..plan import PlanError
from ..plan.host import host_array

MAX_POSITION = 2**30  # plans hold int32 positions; the kernels add offsets below a page to them


def wants_positions(options: dict | None) -> bool:
    """Whether kernel ``options`` turn explicit positions on (the families check the value)."""
    return bool(options) and options.get("positions", False) is True


class Positions:
    """The position arrays of one wrapper's plans. ``q_rows``: the fixed length of ``q_pos`` in CUDA-graph mode
    (None outside it); ``max_num_pages``: the fixed length of ``kv_page_pos`` there (default: the first plan's)."""

    def __init__(self, q_rows: int | None, max_num_pages: int | None):
        self.q_rows = q_rows
        self.page_rows = max_num_pages

    def extras(self, extras: dict, kv_indptr: np.ndarray | None, total_q: int, kv_page_pos, q_pos) -> None:
        """Check ``kv_page_pos`` and ``q_pos`` and add them to a plan's ``extras`` (``PlanError`` naming the
        argument). One numpy pass over each array, no per-element Python."""
        if kv_page_pos is None or q_pos is None:
            raise PlanError("kv_page_pos: a wrapper built with kernel_options={'positions': True} takes kv_page_pos "
                            "(per page-table entry) and q_pos (per query token) at every plan")
        if kv_indptr is None:
            raise PlanError("kv_page_pos: explicit positions take a CSR page table (kv_indptr, kv_indices, "
                            "kv_last_page_len), not block_table")
        total_kv = int(kv_indptr[-1])
        pages = _positions("kv_page_pos", kv_page_pos, total_kv, "kv_indptr[-1]", 0, exact=False)
        queries = _positions("q_pos", q_pos, total_q, "the total query count", -MAX_POSITION, exact=True)
        if self.q_rows is not None:
            if self.page_rows is None:
                self.page_rows = max(total_kv, 1)
            if total_kv > self.page_rows:
                raise PlanError(f"kv_page_pos: {total_kv} entries, more than the {self.page_rows} this CUDA-graph "
                                "wrapper keeps (pass max_num_pages, or make the first plan the largest)")
            queries = _padded(queries, self.q_rows)
            pages = _padded(pages, self.page_rows)
        extras["q_pos"] = queries
        extras["kv_page_pos"] = pages


def refuse_positions(kv_page_pos, q_pos) -> None:
    """``PlanError`` when positions are passed to a wrapper built without the option."""
    if kv_page_pos is not None or q_pos is not None:
        name = "kv_page_pos" if kv_page_pos is not None else "q_pos"
        raise PlanError(f"{name}: explicit positions need a wrapper built with kernel_options={{'positions': True}}")


def _positions(name: str, value, size: int, what: str, low: int, exact: bool) -> np.ndarray:
    """``value`` checked: ``size`` entries (at least, unless ``exact``) in ``[low, 2**30)``. Queries may sit
    before position 0 (a request with fewer keys than queries, as flat attention places its first ones)."""
    array = host_array(name, value)
    if array.size < size or (exact and array.size != size):
        raise PlanError(f"{name}: has {array.size} entries, expected {'' if exact else 'at least '}{what} = {size}")
    array = array[:size]
    if size and (int(array.min()) < low or int(array.max()) >= MAX_POSITION):
        i = int(np.flatnonzero((array < low) | (array >= MAX_POSITION))[0])
        bound = "0" if low == 0 else "-2**30"
        raise PlanError(f"{name}[{i}] = {int(array[i])}, expected a position in [{bound}, 2**30)")
    return array


def _padded(array: np.ndarray, rows: int) -> np.ndarray:
    if array.size == rows:
        return array
    out = np.zeros(rows, np.int32)
    out[: array.size] = array
    return out
