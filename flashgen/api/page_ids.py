"""Device page ids (``kv_indices`` or ``block_table`` CUDA tensors) in CUDA-graph mode and in the debug check.

Outside both, the kernels read a device page table in place: no copy, no sync (the fast path).

CUDA-graph mode: the params a graph captures hold the page table's address (and a block table's row stride) by
value, so ids read in place would tie every replay to the first plan's tensor: a later plan's fresh tensor would
be ignored, silently. ``PageIds`` copies each plan's device ids into a buffer the wrapper owns, whose address and
row stride never change (one device-to-device ``copy_`` on torch's current stream, at plan time, stream-ordered
after the replays already queued), and the kernels read the buffer. Its size is set by the wrapper's
``max_num_pages`` (CSR: the most page ids, ``kv_indptr[-1]``, one plan may hold) or ``max_pages_per_request``
(block table: its columns; the buffer is ``max_batch_size x max_pages_per_request``), or at the first plan (that
plan's ``kv_indices.numel()``, or its block table's width); a later plan that needs more is a ``PlanError``
naming the argument. FlashInfer sizes the same buffer with ``paged_kv_indices_buffer``.

``check_indices`` (the wrappers' flag; ``FLASHGEN_CHECK_INDICES=1`` flips its default): each plan checks the
device ids its requests use on the GPU (``kv_indices[:kv_indptr[-1]]``; a block table's first
``ceil(seq_lens[b] / page_size)`` columns of row ``b``) against ``[0, num_pages)`` (``num_pages`` given to plan(),
else ``>= 0`` and, at ``run()``, below the cache's page count), naming the first bad position. It synchronises
with the GPU, so it is a debugging aid, refused during CUDA-graph capture.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import knobs
from ..plan import PlanError
from ..spec import AttentionSpec, Paged
from .checks import check_count
from .device import capturing
from .kv_inputs import PageTable, device_page_ids


class PageIds:
    """The device page ids of a wrapper's plans: copied into fixed buffers (``graph_rows``: max_batch_size of a
    CUDA-graph wrapper, else None) and / or checked on the device (``check``)."""

    def __init__(self, device: torch.device, page_size: int, graph_rows: int | None, max_num_pages: int | None,
                 max_pages_per_request: int | None, check: bool):
        self.device, self.page_size, self.rows, self.check = device, page_size, graph_rows, check
        self.max_num_pages, self.max_pages_per_request = max_num_pages, max_pages_per_request
        self._csr: torch.Tensor | None = None  # [max_num_pages]
        self._table: torch.Tensor | None = None  # [max_batch_size, max_pages_per_request]
        self.checked: tuple | None = None  # (name, ids, kv_lens, kv_indptr[-1]) of the last checked plan

    def take(self, table: PageTable, num_pages: int | None) -> None:
        """Check (``check``) and copy (CUDA-graph mode) ``table``'s device ids, pointing ``table`` at the copy."""
        self.checked = None
        block = table.block_table is not None
        ids = table.block_table if block else table.kv_indices
        if ids is None or not ids.is_cuda:
            return
        device_page_ids(ids, self.device)
        name = "block_table" if block else "kv_indices"
        total = 0 if block else int(table.kv_indptr_host[-1])
        if self.check:
            table.max_page = self._check(name, ids, table.kv_lens, total, num_pages)
            self.checked = (name, ids, table.kv_lens, total)  # for run()'s error, which reads them again
        if self.rows is not None:
            if block:
                table.block_table = self._copy_table(ids, table.kv_lens)
            else:
                table.kv_indices = self._copy_csr(ids, total)

    # ------------------------------------------------------------------------------------------ CUDA graphs

    def _copy_csr(self, ids: torch.Tensor, total: int) -> torch.Tensor:
        buf = self._csr
        if buf is None:
            size = self.max_num_pages if self.max_num_pages is not None else max(ids.numel(), total, 1)
            buf = self._csr = device_ids_buffer((size,), self.device)
        if total > buf.numel():
            how = "max_num_pages" if self.max_num_pages is not None else "sized by the first plan; raise max_num_pages"
            raise PlanError(f"kv_indices: the plan uses {total} page ids (kv_indptr[-1]), more than the {buf.numel()} "
                            f"of the CUDA-graph wrapper's page-id buffer ({how})")
        if total:
            (buf if total == buf.numel() else buf[:total]).copy_(ids if total == ids.numel() else ids[:total])
        return buf

    def _copy_table(self, ids: torch.Tensor, kv_lens: np.ndarray) -> torch.Tensor:
        batch, width = ids.shape
        if batch > self.rows:
            raise PlanError(f"block_table: batch_size {batch} exceeds max_batch_size = {self.rows} (the CUDA-graph "
                            "capacity)")
        buf = self._table
        if buf is None:
            cols = self.max_pages_per_request if self.max_pages_per_request is not None else max(width, 1)
            buf = self._table = device_ids_buffer((self.rows, cols), self.device)
        cols = buf.shape[1]
        if width > cols:  # a wider table fits if the columns its requests use do
            need = -(-int(kv_lens.max(initial=0)) // self.page_size)
            if need > cols:
                b = int(np.argmax(kv_lens))
                how = ("max_pages_per_request" if self.max_pages_per_request is not None
                       else "sized by the first plan's block_table width; raise max_pages_per_request")
                raise PlanError(f"block_table: request {b} uses {need} pages (seq_lens[{b}] = {int(kv_lens[b])}), "
                                f"more than the {cols} columns of the CUDA-graph wrapper's page-id buffer ({how})")
            ids, width = ids[:, :cols], cols
        if batch:
            buf[:batch, :width].copy_(ids)
        return buf

    # ------------------------------------------------------------------------------------------ the debug check

    def _check(self, name: str, ids: torch.Tensor, kv_lens: np.ndarray, total: int, num_pages: int | None) -> int:
        """The largest id the plan uses (-1: none), after checking them all ``>= 0`` and below ``num_pages``."""
        if capturing():
            raise PlanError(f"check_indices: plan() checks {name} on the GPU and synchronises, which a CUDA-graph "
                            "capture does not allow (plan outside the capture, or turn check_indices / "
                            "FLASHGEN_CHECK_INDICES off)")
        if ids.dim() == 1:
            if not total:
                return -1
            lo, hi = torch.aminmax(ids[:total])
        else:
            if not ids.numel():
                return -1
            used = used_columns(ids, kv_lens, self.page_size)
            lo, hi = torch.where(used, ids, 0).min(), torch.where(used, ids, -1).max()
        lo, hi = torch.stack((lo, hi)).tolist()  # the sync
        if lo < 0 or (num_pages is not None and hi >= num_pages):
            pool = "[0, inf)" if num_pages is None else f"[0, {num_pages})"
            raise PlanError(f"{first_bad(name, ids, kv_lens, self.page_size, total, num_pages)} is outside the page "
                            f"pool {pool} (check_indices)")
        return hi

    def run_error(self, held: int) -> str | None:
        """The first page id of the last checked plan outside a cache of ``held`` pages, as an error message."""
        if self.checked is None:
            return None
        name, ids, kv_lens, total = self.checked
        return f"{first_bad(name, ids, kv_lens, self.page_size, total, held)} is outside kv_cache's {held} pages"


def page_ids_for(spec: AttentionSpec, device: torch.device, graph_rows: int | None, max_num_pages,
                 max_pages_per_request, check_indices: bool | None) -> PageIds | None:
    """The ``PageIds`` of a wrapper, or None where it has nothing to do (not paged, or neither a CUDA-graph
    wrapper nor checking); the arguments checked (``ValueError`` naming them). ``check_indices`` None: the
    ``FLASHGEN_CHECK_INDICES`` knob."""
    max_num_pages = check_count("max_num_pages", max_num_pages)
    max_pages_per_request = check_count("max_pages_per_request", max_pages_per_request)
    check = knobs.check_indices() if check_indices is None else check_indices
    if not isinstance(check, bool):
        raise ValueError(f"check_indices: got {check_indices!r}, expected True, False or None (the "
                         "FLASHGEN_CHECK_INDICES default)")
    if not isinstance(spec.kv_layout, Paged) or (graph_rows is None and not check):
        return None
    return PageIds(device, spec.kv_layout.page_size, graph_rows, max_num_pages, max_pages_per_request, check)


def device_ids_buffer(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A wrapper-owned int32 buffer for device page ids (tests/stub_cuda.py swaps in a stand-in)."""
    return torch.empty(shape, dtype=torch.int32, device=device)


def used_columns(table: torch.Tensor, kv_lens: np.ndarray, page_size: int) -> torch.Tensor:
    """Bool ``[batch, width]`` on the table's device: the entries request ``b`` reads, its first
    ``ceil(kv_lens[b] / page_size)``."""
    blocks = torch.from_numpy(-(-kv_lens.astype(np.int64) // page_size)).to(table.device)
    return torch.arange(table.shape[1], device=table.device)[None, :] < blocks[:, None]


def first_bad(name: str, ids: torch.Tensor, kv_lens: np.ndarray, page_size: int, total: int,
              num_pages: int | None) -> str:
    """``"name[i] = id"`` (``"block_table[b, j] = id"``) of the first used id outside ``[0, num_pages)``
    (``num_pages`` None: the first negative one), in row-major order; reads ids back (a sync)."""
    if ids.dim() == 1:
        used = ids[:total]
        bad = (used < 0) if num_pages is None else (used < 0) | (used >= num_pages)
        i = int(bad.nonzero()[0, 0])
        return f"{name}[{i}] = {int(used[i])}"
    bad = (ids < 0) if num_pages is None else (ids < 0) | (ids >= num_pages)
    b, j = bad.logical_and_(used_columns(ids, kv_lens, page_size)).nonzero()[0].tolist()
    return f"{name}[{b}, {j}] = {int(ids[b, j])}"
