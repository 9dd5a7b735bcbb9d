"""A case's inputs: its page table on the host (numpy, from the seed), and its tensors on a device (CPU or CUDA),
written into pools that are allocated once per process.

The cache of a case is a view at the head of a flat pool (K in the first half, V in the second, or K and V as one
``[pages, 2, ...]`` tensor from the start), filled with fresh random values; every slot no request owns (spare
pages, the tail of each last page, rows past a ragged batch) holds NaN, so a read of one shows in the output.
A graph group's cache is the same view every time (address and shape fixed), refilled per case.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flashgen.spec import Paged
from flashgen.testing.masks import as_form, make_masks

from .cases import GENERATOR_VERSION, POOL, Q_POOL, VARIANTS, Case, GraphGroup

NAN = float("nan")


@dataclass
class HostBatch:
    """The host side of a case: ``qo_indptr``, ``kv_lens``; ``pages``: pages (rows, ragged) of its cache view;
    paged: the CSR table (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``) and the same pages as a block
    table (``block_table [batch, width]``, ``seq_lens``); ragged: ``kv_indptr`` (token offsets); ``valid``: the
    slots in use of each page of the view (ragged: ``[rows]``, 1 where a request owns the row)."""

    qo_indptr: np.ndarray
    kv_lens: np.ndarray
    pages: int
    kv_indptr: np.ndarray
    kv_indices: np.ndarray | None
    kv_last_page_len: np.ndarray | None
    block_table: np.ndarray | None
    seq_lens: np.ndarray | None
    valid: np.ndarray


def host_batch(c: Case, group: GraphGroup | None = None) -> HostBatch:
    """The page table of case ``c``, drawn from its seed: pages shuffled over the cache view (``spare`` pages
    more than the batch's, or a graph group's ``pool``)."""
    spec = VARIANTS[c.variant].spec
    kv = np.asarray(c.kv_lens, np.int64)
    qo_indptr = np.concatenate([[0], np.cumsum(c.qo_lens)]).astype(np.int32)
    rng = np.random.default_rng([GENERATOR_VERSION, c.seed, 1])
    if not isinstance(spec.kv_layout, Paged):
        indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
        rows = group.pool if group is not None else int(indptr[-1]) + c.spare
        valid = (np.arange(rows) < indptr[-1]).astype(np.int64)
        return HostBatch(qo_indptr, kv, rows, indptr, None, None, None, None, valid)
    page_size = spec.kv_layout.page_size
    npages = -(-kv // page_size)
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    total = int(indptr[-1])
    pages = group.pool if group is not None else total + c.spare
    indices = rng.permutation(pages)[:total].astype(np.int32)
    last = np.where(npages > 0, kv - (npages - 1) * page_size, 0).astype(np.int32)
    valid = np.zeros(pages, np.int64)
    valid[indices] = page_size
    ends = indptr[1:][npages > 0] - 1
    valid[indices[ends]] = last[npages > 0]
    width = group.width if group is not None else int(npages.max(initial=0)) + c.bt_pad
    table = np.full((kv.size, max(width, 1)), c.bt_fill, np.int32)
    for b in range(kv.size):
        table[b, : npages[b]] = indices[indptr[b]: indptr[b + 1]]
    return HostBatch(qo_indptr, kv, pages, indptr, indices, last, table, kv.astype(np.int32), valid)


def masks_of(c: Case) -> list[torch.Tensor] | None:
    """The custom masks of a CustomMask case (bool ``[qo_len, kv_len]`` a request, CPU, from its seed), else None."""
    if c.mask_kind is None:
        return None
    return make_masks(c.mask_kind, c.qo_lens, c.kv_lens, torch.Generator().manual_seed(c.seed))


def mask_argument(masks: list[torch.Tensor], form: str, device: torch.device):
    """``masks`` as plan()'s ``custom_mask`` in ``form``; on a CPU device the device forms become host bits."""
    if device.type != "cuda" and form in ("device", "device_unaligned"):
        form = "host"
    return as_form(masks, form)


class Pools:
    """Flat q and KV buffers per dtype on ``device``, allocated once (their addresses never change, so a graph
    group may capture views of them). ``q_elements`` / ``kv_elements`` default to the bounds of ``cases``."""

    def __init__(self, device: torch.device, q_elements: int = Q_POOL, kv_elements: int = POOL):
        self.device, self.q_elements, self.kv_elements = device, q_elements, kv_elements
        self._q: dict[torch.dtype, torch.Tensor] = {}
        self._kv: dict[torch.dtype, torch.Tensor] = {}

    def q(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._q:
            self._q[dtype] = torch.empty(self.q_elements, dtype=dtype, device=self.device)
        return self._q[dtype]

    def kv(self, dtype: torch.dtype) -> torch.Tensor:
        """K in ``[0, kv_elements)``, V in ``[kv_elements, 2 * kv_elements)``."""
        if dtype not in self._kv:
            self._kv[dtype] = torch.empty(2 * self.kv_elements, dtype=dtype, device=self.device)
        return self._kv[dtype]


def q_view(pools: Pools, c: Case, rows: int) -> torch.Tensor:
    """``q [rows, num_qo_heads, head_dim]`` at the head of the q pool."""
    spec = VARIANTS[c.variant].spec
    n = rows * c.num_qo_heads * spec.head_dim
    if n > pools.q_elements:
        raise ValueError(f"q: {n} elements exceed the pool's {pools.q_elements}")
    return pools.q(getattr(torch, spec.dtype))[:n].view(rows, c.num_qo_heads, spec.head_dim)


def kv_views(pools: Pools, c: Case, pages: int):
    """The cache of a case over ``pages`` pages (rows, ragged): ``(k, v)`` or, ``combined``, one ``[pages, 2, ...]``
    tensor; returns ``(kv argument, k, v)``."""
    spec = VARIANTS[c.variant].spec
    flat = pools.kv(getattr(torch, spec.dtype))
    heads, d = c.num_kv_heads, spec.head_dim
    if isinstance(spec.kv_layout, Paged):
        ps = spec.kv_layout.page_size
        shape = (ps, heads, d) if spec.kv_layout.order == "NHD" else (heads, ps, d)
    else:
        shape = (heads, d)
    n = pages * int(np.prod(shape))
    if n > pools.kv_elements:
        raise ValueError(f"kv_cache: {n} elements exceed the pool's {pools.kv_elements}")
    if c.combined:
        kv = flat[: 2 * n].view(pages, 2, *shape)
        return kv, kv[:, 0], kv[:, 1]
    k = flat[:n].view(pages, *shape)
    v = flat[pools.kv_elements: pools.kv_elements + n].view(pages, *shape)
    return (k, v), k, v


def fill(c: Case, batch: HostBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, total_q: int) -> None:
    """Random q rows ``[:total_q]`` (NaN past them) and K / V, NaN in every slot no request owns."""
    gen = torch.Generator(device=q.device).manual_seed(c.seed)
    q[:total_q].normal_(generator=gen)
    q[total_q:].fill_(NAN)
    spec = VARIANTS[c.variant].spec
    valid = torch.from_numpy(batch.valid).to(k.device)
    for x in (k, v):
        x.normal_(generator=gen)
        if isinstance(spec.kv_layout, Paged):
            unused = torch.arange(spec.kv_layout.page_size, device=k.device)[None, :] >= valid[:, None]
            x.masked_fill_(unused[:, :, None, None] if spec.kv_layout.order == "NHD" else unused[:, None, :, None],
                           NAN)
        else:
            x.masked_fill_((valid == 0)[:, None, None], NAN)


def host_ids(c: Case, ids: np.ndarray):
    """Host page ids in the case's host form (``HOST_IDS``)."""
    if c.host_ids == "numpy":
        return ids
    return torch.from_numpy(ids.astype(np.int64 if c.host_ids == "int64" else np.int32))


def plan_table(c: Case, batch: HostBatch, device: torch.device, ids=None) -> dict:
    """plan()'s page-table arguments, the page ids given as ``ids`` (a graph group's) or else as the case places
    them (on the host in its host form, or in a new device tensor; on a CPU device always on the host)."""
    if c.form == "ragged":
        return {"kv_indptr": batch.kv_indptr}
    table = batch.kv_indices if c.form == "csr" else batch.block_table
    if ids is None:
        ids = host_ids(c, table) if c.ids == "host" or device.type != "cuda" else \
            torch.from_numpy(np.ascontiguousarray(table)).to(device)
    out = ({"kv_indptr": batch.kv_indptr, "kv_indices": ids, "kv_last_page_len": batch.kv_last_page_len}
           if c.form == "csr" else {"block_table": ids, "seq_lens": batch.seq_lens})
    if c.num_pages_arg and (c.ids == "host" or device.type != "cuda"):
        out["num_pages"] = batch.pages
    return out


def reference_table(c: Case, batch: HostBatch) -> dict:
    """The reference's page-table arguments (host arrays, exactly the batch's entries)."""
    if c.form == "ragged":
        return {"kv_indptr": batch.kv_indptr}
    if c.form == "csr":
        return {"kv_indptr": batch.kv_indptr, "kv_indices": batch.kv_indices,
                "kv_last_page_len": batch.kv_last_page_len}
    return {"block_table": batch.block_table, "seq_lens": batch.seq_lens}
