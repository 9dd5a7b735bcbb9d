"""An SGLang-style attention backend over SGLang's token pool, read and written in place.

SGLang's layouts (``sglang/srt/mem_cache/memory_pool.py``, ``layers/attention/flashinfer_backend.py``):

- ``req_to_token [max_reqs, max_context]`` int32 (device): row ``r`` holds the KV slots of pool request ``r``'s
  tokens, in order;
- per step: ``req_pool_indices [batch]`` (device: each request's row of ``req_to_token``), ``seq_lens [batch]``
  (KV tokens of each request, the new ones included; ``plan()`` needs them on the host: SGLang's
  ``seq_lens_cpu``), and for an extend (prefill) step ``extend_seq_lens [batch]`` (new tokens of each request,
  host: ``extend_seq_lens_cpu``); ``out_cache_loc [num_tokens]`` (the new tokens' slots) for the write;
- per layer: K and V buffers ``[num_slots, num_kv_heads, head_dim]`` (``k_buffer[layer]``, ``v_buffer[layer]``).

SGLang's token pool has pages of one token (``page_size=1``); its paged allocators keep a request's tokens in
page-aligned runs of ``page_size`` slots, which ``page_size > 1`` reads as pages (slot ``s`` is token ``s %
page_size`` of page ``s // page_size``): the buffers are viewed as ``[num_slots // page_size, page_size,
num_kv_heads, head_dim]``, no copy.

Page ids: ``kv_indices`` is gathered from ``req_to_token`` on ``req_to_token``'s device (a few torch ops over
the step's pages, as SGLang's own ``create_flashinfer_kv_indices_triton``), after one small host-to-device
copy of the page counts; nothing is read back. Example::

    backend = SGLangAttention(num_qo_heads=32, num_kv_heads=8, head_dim=128)
    backend.plan(req_to_token=req_to_token, req_pool_indices=req_pool_indices, seq_lens=seq_lens_cpu)  # decode
    for layer in range(num_layers):
        backend.write_kv(k, v, k_buffer[layer], v_buffer[layer], out_cache_loc)
        out = backend.run(q, k_buffer[layer], v_buffer[layer])       # q [batch, 32, 128]
"""

from __future__ import annotations

import numpy as np
import torch

from ..plan import PlanError, host_array
from .common import PagedStepAttention, StepTables, check_lens, check_queries_fit, split_csr, split_step


def sglang_tables(*, req_to_token: torch.Tensor, req_pool_indices, seq_lens, extend_seq_lens=None,
                  page_size: int = 1) -> StepTables:
    """SGLang's per-step metadata as flashgen ``plan()`` arguments: a CSR page table whose ``kv_indices`` are
    built on ``req_to_token``'s device.

    ``seq_lens`` and ``extend_seq_lens`` (None: a decode step, one new token a request): host int arrays.
    ``req_pool_indices``: an int tensor on ``req_to_token``'s device (or a host array). Raises ``PlanError``
    naming the argument: a ``req_to_token`` that is not 2-D int32 / int64, a request longer than its
    ``max_context`` columns, a ``req_pool_indices`` of the wrong length, more new tokens than KV tokens.

    >>> r2t = torch.arange(12, dtype=torch.int32).view(2, 6).flip(0)   # request 1's slots are 0..5
    >>> t = sglang_tables(req_to_token=r2t, req_pool_indices=torch.tensor([1]), seq_lens=[4])
    >>> t.decode["kv_indices"].tolist()
    [0, 1, 2, 3]
    """
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise PlanError(f"page_size: got {page_size!r}, expected an int >= 1")
    lens = check_lens("seq_lens", seq_lens)
    batch = lens.size
    if not isinstance(req_to_token, torch.Tensor) or req_to_token.dim() != 2 or req_to_token.dtype not in (
            torch.int32, torch.int64):
        got = (f"{req_to_token.dtype} {tuple(req_to_token.shape)}" if isinstance(req_to_token, torch.Tensor)
               else type(req_to_token).__name__)
        raise PlanError(f"req_to_token: expected an int32 [max_reqs, max_context] tensor, got {got}")
    if int(lens.max(initial=0)) > req_to_token.shape[1]:
        b = int(np.argmax(lens))
        raise PlanError(f"seq_lens: seq_lens[{b}] = {int(lens[b])} exceeds req_to_token's max_context = "
                        f"{req_to_token.shape[1]} columns")
    device = req_to_token.device
    rows = req_pool_indices if isinstance(req_pool_indices, torch.Tensor) else torch.as_tensor(
        host_array("req_pool_indices", req_pool_indices))
    if rows.dim() != 1 or rows.numel() != batch or rows.dtype.is_floating_point or rows.dtype == torch.bool:
        raise PlanError(f"req_pool_indices: expected an int tensor of [{batch}] (one row of req_to_token a request "
                        f"of seq_lens), got {rows.dtype} {tuple(rows.shape)}")
    if extend_seq_lens is None:
        qo_lens = np.ones(batch, dtype=np.int64)
    else:
        qo_lens = check_lens("extend_seq_lens", extend_seq_lens)
        if qo_lens.size != batch:
            raise PlanError(f"extend_seq_lens: has {qo_lens.size} entries, expected {batch} (one a request of "
                            "seq_lens)")
    check_queries_fit(qo_lens, lens, "extend_seq_lens" if extend_seq_lens is not None else "decode", "seq_lens")
    qo_indptr = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum(qo_lens, out=qo_indptr[1:])
    table = csr_from_req_to_token(req_to_token, rows.to(device, non_blocking=True), lens, page_size)
    return split_step(qo_indptr, qo_lens, table, split_csr)


def csr_from_req_to_token(req_to_token: torch.Tensor, rows: torch.Tensor, lens: np.ndarray, page_size: int) -> dict:
    """A CSR page table (host ``kv_indptr``, ``kv_last_page_len``; ``kv_indices`` int32 on ``req_to_token``'s
    device) of requests ``rows`` (device) with KV lengths ``lens`` (host): page ``j`` of request ``b`` is
    ``req_to_token[rows[b], j * page_size] // page_size``."""
    counts = -(-lens.astype(np.int64) // page_size)
    indptr = np.zeros(lens.size + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    last = np.where(counts > 0, lens - (counts - 1) * page_size, 0).astype(np.int32)
    total, device = int(indptr[-1]), req_to_token.device
    # one small pageable copy (it waits for no earlier GPU work); pinning it would cost more host time
    counts_d, starts_d = torch.from_numpy(np.stack((counts, indptr[:-1]))).to(device)
    per_page = torch.repeat_interleave(rows.long(), counts_d, output_size=total)
    cols = torch.arange(total, device=device) - torch.repeat_interleave(starts_d, counts_d, output_size=total)
    if page_size == 1:
        ids = req_to_token[per_page, cols]
    else:
        ids = torch.div(req_to_token[per_page, cols * page_size], page_size, rounding_mode="floor")
    return {"kv_indptr": indptr.astype(np.int32), "kv_indices": ids.to(torch.int32),
            "kv_last_page_len": last}


def token_pages(name: str, buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """A token buffer ``[num_slots, num_kv_heads, head_dim]`` as pages ``[num_slots // page_size, page_size,
    num_kv_heads, head_dim]`` (a view; trailing slots that fill no page are left out)."""
    if not isinstance(buffer, torch.Tensor) or buffer.dim() != 3:
        got = tuple(buffer.shape) if isinstance(buffer, torch.Tensor) else type(buffer).__name__
        raise ValueError(f"{name}: expected a token buffer [num_slots, num_kv_heads, head_dim] (3 dims), got {got}")
    pages = buffer.shape[0] // page_size
    return buffer[: pages * page_size].unflatten(0, (pages, page_size))


class SGLangAttention:
    """Attention over SGLang's token pool: plan once a step, run once a layer over that layer's K and V buffers.

    ``page_size``: 1 for SGLang's token pool (its default), or the page size of a paged allocator. ``dtype``:
    q's (fp16 / bf16), ``kv_dtype``: the buffers' (default q's). ``soft_cap``: a logits soft-cap;
    ``sm_scale`` at plan() (SGLang's ``layer.scaling``).
    """

    def __init__(self, *, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int = 1,
                 dtype="bfloat16", kv_dtype=None, soft_cap: float | None = None, device=None):
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size = page_size
        self._attention = PagedStepAttention(head_dim=head_dim, page_size=page_size, dtype=dtype, kv_dtype=kv_dtype,
                                             soft_cap=soft_cap, device=device)
        self.tables: StepTables | None = None

    def plan(self, *, req_to_token: torch.Tensor, req_pool_indices, seq_lens, extend_seq_lens=None,
             sm_scale: float | None = None) -> StepTables:
        """Plan a decode step (``extend_seq_lens`` None) or an extend step (``sglang_tables`` for the
        arguments). Returns the ``StepTables`` planned."""
        tables = sglang_tables(req_to_token=req_to_token, req_pool_indices=req_pool_indices, seq_lens=seq_lens,
                               extend_seq_lens=extend_seq_lens, page_size=self.page_size)
        self._attention.plan(tables, num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                             sm_scale=sm_scale)
        self.tables = tables
        return tables

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """``q [num_tokens, num_qo_heads, head_dim]`` (contiguous) over this layer's buffers ``[num_slots,
        num_kv_heads, head_dim]`` -> ``out`` of q's shape."""
        return self._attention.run(q, self._pages(k_buffer, v_buffer), out)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                 out_cache_loc: torch.Tensor) -> None:
        """Write the new tokens' ``k`` / ``v`` ``[num_tokens, num_kv_heads, head_dim]`` at slots ``out_cache_loc``
        (SGLang's ``set_kv_buffer``): ``flashgen.append_kv`` with the slots as its ``slot_mapping``."""
        from ..api import append_kv

        append_kv(k, v, self._pages(k_buffer, v_buffer), slot_mapping=out_cache_loc)

    def _pages(self, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_pages("k_buffer", k_buffer, self.page_size), token_pages("v_buffer", v_buffer, self.page_size)
