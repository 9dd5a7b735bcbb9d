"""The page pool: the K/V tensors in the layouts the wrappers read, a free list, and reference counts.

A page is in exactly one of three states: free (on the free list, refcount 0), referenced (refcount = the
number of sequence page tables holding it), or cached (refcount 0, kept by the prefix cache; ``prefix.py``).
This module owns the bytes and the counts; which page a sequence holds is the manager's business.

Layouts (``flashgen/api/kv_inputs.py``): ``kv_form="combined"``: one tensor ``[num_pages, 2, page_size,
num_kv_heads, head_dim]`` (NHD) or ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (HND);
``kv_form="pair"``: ``(k, v)``, each ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD) or
``[num_pages, num_kv_heads, page_size, head_dim]`` (HND).
"""

from __future__ import annotations

import torch

LAYOUTS = ("NHD", "HND")
KV_FORMS = ("combined", "pair")


class PagePool:
    """``num_pages`` pages of ``page_size`` tokens; ``kv`` is what ``wrapper.run(q, kv)`` takes."""

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 layout: str, kv_form: str, device: torch.device):
        self.num_pages, self.page_size = num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.layout, self.kv_form, self.device = dtype, layout, kv_form, device
        page = (page_size, num_kv_heads, head_dim) if layout == "NHD" else (num_kv_heads, page_size, head_dim)
        if kv_form == "combined":
            self.kv = torch.zeros((num_pages, 2, *page), dtype=dtype, device=device)
            k, v = self.kv[:, 0], self.kv[:, 1]
        else:
            k = torch.zeros((num_pages, *page), dtype=dtype, device=device)
            v = torch.zeros((num_pages, *page), dtype=dtype, device=device)
            self.kv = (k, v)
        self._k, self._v = k, v
        # NHD views [pages, page_size, heads, dim] of K and V: token writes index (page, offset) in both layouts
        self._k_nhd = k if layout == "NHD" else k.transpose(1, 2)
        self._v_nhd = v if layout == "NHD" else v.transpose(1, 2)
        # page 0 is taken first: a stack whose top is the end of the list
        self._free = list(range(num_pages - 1, -1, -1))
        self.refcount = [0] * num_pages

    # ------------------------------------------------------------------------------------------ free list

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_pages(self) -> list[int]:
        return list(self._free)

    def take(self, n: int) -> list[int]:
        """``n`` free pages, each with refcount 1. The caller has checked that ``n <= num_free``."""
        assert n <= len(self._free), (n, len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def give_back(self, page: int) -> None:
        """Put an unreferenced, uncached page on the free list."""
        assert self.refcount[page] == 0, (page, self.refcount[page])
        self._free.append(page)

    # ------------------------------------------------------------------------------------------ bytes

    def write_tokens(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: slice | None = None,
                     positions: torch.Tensor | None = None, rope=None) -> None:
        """Write new tokens' K/V (``k, v [n, heads, head_dim]``) at ``slots [n]`` (int32/int64, ``page *
        page_size + offset``, on the pool's device; -1 skips a token on the GPU) into the KV heads ``heads``
        (all when None). On a GPU pool of fp16/bf16 K/V this is one ``flashgen.append_kv`` launch (with
        ``rope``, a ``flashgen.RoPE``, K is rotated at ``positions [n]`` on the way, in the same launch); on
        the CPU one advanced-indexing scatter per tensor (no ``rope``: rotate K first)."""
        heads = slice(None) if heads is None else heads
        if self.device.type == "cuda" and k.dtype in (torch.float16, torch.bfloat16):
            from ..api.append import append_kv

            if self.layout == "NHD":
                cache = (self._k[:, :, heads], self._v[:, :, heads])
            else:
                cache = (self._k[:, heads], self._v[:, heads])
            append_kv(k, v, cache, slot_mapping=slots, positions=positions, rope=rope, kv_layout=self.layout)
            return
        if rope is not None:
            raise ValueError("rope: rotating K on the write needs the CUDA append kernel (a GPU pool of fp16/bf16 "
                             "K/V); on this pool rotate K before writing it")
        slots = slots.long()
        pages, offsets = slots // self.page_size, slots % self.page_size
        self._k_nhd[:, :, heads].index_put_((pages, offsets), k.to(self.dtype))
        self._v_nhd[:, :, heads].index_put_((pages, offsets), v.to(self.dtype))

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page ``src``'s K and V into page ``dst`` (copy-on-write)."""
        self._k[dst].copy_(self._k[src])
        self._v[dst].copy_(self._v[src])

    def save(self, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V of ``pages`` in host memory (pinned where the pool is on a GPU), ``[len(pages), ...]``
        in the pool's per-page layout."""
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        pinned = self.device.type == "cuda"
        out = []
        for src in (self._k, self._v):
            host = torch.empty((len(pages), *src.shape[1:]), dtype=self.dtype, pin_memory=pinned)
            host.copy_(src.index_select(0, idx))
            out.append(host)
        return out[0], out[1]

    def load(self, pages: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write saved K and V (``save``) into ``pages``, byte for byte."""
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        self._k.index_copy_(0, idx, k.to(self.device))
        self._v.index_copy_(0, idx, v.to(self.device))

    def gather(self, pages: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens' K and V through ``pages``: ``[length, num_kv_heads, head_dim]`` each."""
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        k = self._k_nhd.index_select(0, idx).flatten(0, 1)[:length]
        v = self._v_nhd.index_select(0, idx).flatten(0, 1)[:length]
        return k, v
