"""Hopper prefill (``prefill_sm90``) behind ``BatchPrefillWrapper(backend="sm90")``: TMA descriptors built on
the host, plan buffers and the launch.

``BatchPrefillWrapper`` selects it by itself (``backend="auto"``) on a compute-capability 9.0 GPU for what
``PrefillSM90Family.check`` accepts (Ragged or paged KV, NoMask / Causal / SlidingWindow / CustomMask, fp16 /
bf16, head_dim == head_dim_vo in 64 / 128 / 256); it plans every request unsplit (one item per (request,
128-row q tile), its whole KV). A custom mask becomes a tile list per item (``plan.mask_tiles``): a host mask
is classified on the host (fully masked tiles skipped, fully visible ones unmasked); a device mask is read
in place with every tile treated as partial (no sync, no skipping).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ..codegen.prefill_sm90 import (THREADS, TILE_Q, sm90_gather, sm90_kernels, sm90_o_staged, sm90_qo_tma,
                                     sm90_smem_bytes, sm90_tile_kv)
from ..codegen.rope_gather import BLOCK_THREADS as ROPE_THREADS
from ..plan import PlanError, plan_prefill
from ..plan.mask_tiles import plan_mask_tiles
from ..spec import AttentionSpec, CustomMask, Paged, RoPE
from .custom_mask import custom_mask_bits
from .device import current_stream
from .fastdiv import fast_div
from .kv_inputs import TORCH_DTYPES, KVView, PageTable, device_page_ids
from .prefill import BatchPrefillWrapper, Runtime
from .staging import DeviceBuffer, HostStaging, extra_offsets

_TMA_DTYPES = {torch.bfloat16: "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", torch.float16: "CU_TENSOR_MAP_DATA_TYPE_FLOAT16"}
TMA_BOX_COLS = 64  # 64 16-bit values = the 128-byte swizzle span; a head_dim of 128 is two boxes
O_WARP_ROWS = 16  # packed rows of a consumer warp: one TMA store box of O
NO_MAP = bytes(128)  # a CUtensorMap param the kernel does not read (q_tma / o_tma off)
MAPS_HELD = 64  # q / out tensor maps memoised (by address, shape, strides, group) before the memo starts over


def kv_tensor_map(spec: AttentionSpec, kv: KVView, t: torch.Tensor) -> bytes:
    """The 128-byte TMA descriptor of ``t`` (K or V of ``kv``: fp16/bf16, rows contiguous, 16-byte aligned
    strides) as a 4-D tensor, innermost first, dims ordered by stride: paged NHD ``{head_dim, kv_heads,
    page_size, pages}``, paged HND ``{head_dim, page_size, kv_heads, pages}``, ragged ``{head_dim, kv_heads,
    rows, 1}``. Boxes are one head's 64 columns of ``min(page_size, tile_kv)`` rows (ragged: ``tile_kv`` rows),
    landing 128B-swizzled. The map is bounded by the tensor's own size, never a plan's: it is a kernel
    parameter, captured by value in a CUDA graph, so it must not depend on the plan; rows past the end read
    zeros.

    >>> desc = kv_tensor_map(spec, kv_view(spec, (k, v), 8), k)   # pack into a CUtensorMap params field
    """
    from cuda.bindings import driver as cu

    from ..runtime.driver import check, ensure_context

    ensure_context(t.device.index)
    u64, u32 = cu.cuuint64_t, cu.cuuint32_t
    elem, tile_kv = t.element_size(), sm90_tile_kv(spec.head_dim)
    if isinstance(spec.kv_layout, Paged):
        ps = spec.kv_layout.page_size
        heads = t.shape[2] if spec.kv_layout.order == "NHD" else t.shape[1]
        rows = min(ps, tile_kv)
        if spec.kv_layout.order == "NHD":
            dims, strides, box = [t.shape[3], heads, ps, t.shape[0]], [kv.stride_head, kv.stride_token, kv.stride_page], [1, rows]
        else:
            dims, strides, box = [t.shape[3], ps, heads, t.shape[0]], [kv.stride_token, kv.stride_head, kv.stride_page], [rows, 1]
    else:
        heads = t.shape[1]
        dims = [t.shape[2], heads, max(t.shape[0], 1), 1]
        strides, box = [kv.stride_head, kv.stride_token, kv.stride_token * max(t.shape[0], 1)], [1, tile_kv]
    tensor_map = check(cu.cuTensorMapEncodeTiled(
        getattr(cu.CUtensorMapDataType, _TMA_DTYPES[t.dtype]), 4, t.data_ptr(), [u64(x) for x in dims],
        [u64(x * elem) for x in strides], [u32(TMA_BOX_COLS), *(u32(x) for x in box), u32(1)], [u32(1)] * 4,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    return ctypes.string_at(tensor_map.getPtr(), 128)


def qo_tensor_map(t: torch.Tensor, group: int, tokens: int) -> bytes:
    """The 128-byte TMA descriptor of q or out ``t [rows, num_qo_heads, head_dim]`` (fp16/bf16) as a 3-D tensor,
    innermost first ``{head_dim, num_qo_heads, rows}`` with ``t``'s own strides; boxes ``{64, group, tokens}``
    (a kv head's ``group`` q heads for ``tokens`` tokens: the kernel's packed rows, row-major), 128B-swizzled.
    Bounded by the tensor: box rows past its end load zeros and are not stored. An empty ``t`` has no map (no
    item reads it): zeros.

    >>> desc = qo_tensor_map(q, 4, 128 // 4)   # q [total_q, 32, 128], 8 kv heads: an item's 128 packed rows
    """
    if t.numel() == 0:
        return NO_MAP
    elem = t.element_size()
    strides = (t.stride(1) * elem, t.stride(0) * elem)
    if t.stride(2) != 1 or t.data_ptr() % 16 or any(x % 16 for x in strides):
        raise ValueError(f"q / out: TMA needs 16-byte aligned data and row strides with contiguous rows, got address "
                         f"{t.data_ptr():#x}, strides {tuple(t.stride())} of {elem}-byte elements")
    from cuda.bindings import driver as cu

    from ..runtime.driver import check, ensure_context

    ensure_context(t.device.index)
    u64, u32 = cu.cuuint64_t, cu.cuuint32_t
    dims = (t.shape[2], t.shape[1], t.shape[0])
    tensor_map = check(cu.cuTensorMapEncodeTiled(
        getattr(cu.CUtensorMapDataType, _TMA_DTYPES[t.dtype]), 3, t.data_ptr(), [u64(x) for x in dims],
        [u64(x) for x in strides], [u32(TMA_BOX_COLS), u32(group), u32(tokens)], [u32(1)] * 3,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    return ctypes.string_at(tensor_map.getPtr(), 128)


class SM90Prefill:
    """The ``prefill_sm90`` kernel behind ``BatchPrefillWrapper(backend="sm90")``: plan buffers, tensor maps,
    launch. ``graph``: ``(max_batch_size, max_total_q)`` of a CUDA-graph wrapper (the plan buffer is sized at
    the first plan and never moves; padding items have ``request_idx = -1``, which the kernel skips), or None.
    """

    def __init__(self, spec: AttentionSpec, device: torch.device, num_sms: int, graph: tuple[int, int] | None):
        self.spec, self.device, self.num_sms = spec, device, num_sms
        self.max_batch_size, self.max_total_q = graph or (None, None)
        # RoPE: the rope_gather pre-pass writes rotated q, rotated K and V (ragged) into scratch, and the kernel of
        # the spec's ragged twin attends over it (check_sm90_backend refuses RoPE in CUDA-graph mode)
        self.rope = isinstance(spec.pos_encoding, RoPE)
        self._kernels = dict(sm90_kernels(spec))  # {"prefill_sm90": its spec[, "rope_gather": spec]}: what runs
        self.kernel_spec = self._kernels["prefill_sm90"]
        self._scratch = DeviceBuffer(TORCH_DTYPES[spec.dtype], device, False) if self.rope else None
        self._plan_buf = DeviceBuffer(torch.int32, device, graph is not None)
        self._staging = HostStaging(device)
        self._tile_kv = sm90_tile_kv(spec.head_dim)
        # pages TMA cannot take: the kernel gathers them from the cache's addresses and strides, no tensor maps
        layout = self.kernel_spec.kv_layout
        self.gather = isinstance(layout, Paged) and sm90_gather(layout.page_size, spec.head_dim)
        self._o_staged = sm90_o_staged(spec.head_dim, self.gather)  # the kernel takes an O tensor map
        self._maps: dict[tuple, bytes] = {}  # q / out tensor maps (_qo_map)
        self._kernel = None
        self._mask_held: torch.Tensor | None = None  # a device custom mask, read in place
        self._empty: dict[tuple, torch.Tensor] = {}  # one-row stand-ins for an empty K / V (a map needs an address)

    def plan(self, qo: np.ndarray, table: PageTable, num_qo_heads: int, num_kv_heads: int, runtime: Runtime,
             custom_mask, enable_split: bool) -> int:
        """Plan unsplit (``enable_split`` is ignored) and upload; returns the rows of q and out (total_q, or
        max_total_q in CUDA-graph mode). ``custom_mask``: CustomMask specs only (the wrapper checked)."""
        if not runtime.sm_scale > 0:
            raise PlanError(f"sm_scale: the sm90 backend needs sm_scale > 0, got {runtime.sm_scale} "
                            "(backend='portable' takes any value)")
        graph = self.max_batch_size is not None
        options = {"max_batch_size": self.max_batch_size, "max_total_q": self.max_total_q} if graph else {}
        plan = self._staging.plan(lambda host: plan_prefill(
            qo, table.kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, tile_rows=TILE_Q,
            kv_granularity=self._tile_kv, num_sms=self.num_sms, enable_split=False, host_buffer=host, **options))
        # token offsets (ragged) or page offsets (CSR); a block table needs none
        indptr = (table.kv_indptr_host if table.kv_indptr_host is not None else np.zeros(qo.size, np.int64)).astype(np.int32)
        if graph:  # a fixed length keeps the whole upload, and so every address, the same from plan to plan
            indptr = np.concatenate([indptr, np.full(self.max_batch_size + 1 - indptr.size, indptr[-1], np.int32)])
        ids = table.block_table if table.block_table is not None else table.kv_indices
        extras = {"kv_indptr": indptr}
        # host page ids travel with the plan after the fixed-length fields
        pages_host = ids.to(torch.int32).contiguous().numpy().ravel() if ids is not None and not ids.is_cuda else None
        if self.rope:  # the kernel reads the ragged scratch; the pre-pass reads the cache through its own table
            extras = {"kv_indptr": np.concatenate([[0], np.cumsum(table.kv_lens)]).astype(np.int32),
                      "src_indptr": indptr}
        custom = isinstance(self.spec.mask, CustomMask)
        if custom:
            extras = self._mask_extras(plan, qo, table.kv_lens, custom_mask, extras, pages_host)
        elif pages_host is not None:
            extras["pages"] = pages_host
        # host page ids and mask data travel with the plan: their size follows the batch's KV, not max_batch_size
        hint = ("page ids or a custom mask on the host travel with the plan: make the first plan the one with the "
                "most page ids and mask bits, or pass them on the device" if set(extras) - {"kv_indptr", "src_indptr"}
                else "raise max_batch_size")
        views = self._staging.upload(plan, extras, self._plan_buf, hint)
        if ids is None:
            pages, bt_stride, self._page_ids_held = 0, 0, None
        elif ids.is_cuda:
            (pages, bt_stride), self._page_ids_held = device_page_ids(ids, self.device), ids
        else:
            pages, bt_stride, self._page_ids_held = views["pages"].data_ptr(), (ids.shape[1] if ids.dim() == 2 else 0), None
        block_table = table.block_table is not None
        if self._kernel is None:
            self._load_kernel()
        if self.rope:
            self._plan_rope(views, int(qo[-1]), int(table.kv_lens.sum()), int(table.kv_lens.size), num_qo_heads,
                            num_kv_heads, runtime,
                            (0 if block_table else pages, pages if block_table else 0, bt_stride))
            pages, block_table, bt_stride = 0, False, 0  # the kernel's KV is the ragged scratch
        # persistent CTAs, one an SM, walk the capacity x num_kv_heads work items (the kernel strides over them)
        self._grid = (max(1, min(plan.info.capacity * num_kv_heads, self.num_sms)), 1, 1)
        base = self._plan_buf.tensor.data_ptr()  # tile_indptr and host mask offsets count from here
        mask_args = (0, 0, 0, 0) if not custom else (
            self._mask_held.data_ptr() if self._mask_held is not None else base,
            views["mask_offset"].data_ptr(), views["tile_indptr"].data_ptr(), base)
        # the params struct after (tma_q[, tma_o], tma_k, tma_v or a gathered cache's k, v and strides; q, o, lse)
        group = num_qo_heads // num_kv_heads
        self._group = group
        self._q_tma, self._o_tma = sm90_qo_tma(group, self._o_staged)
        self._args = tuple(views[n].data_ptr() for n in ("qo_indptr", "kv_indptr", "kv_len", "request_idx",
                                                         "qo_tile_idx", "kv_start", "kv_end")) + (
            0 if block_table else pages, pages if block_table else 0,
            num_qo_heads, group, *fast_div(group), int(self._q_tma), int(self._o_tma), runtime.sm_scale,
            plan.info.capacity, num_kv_heads, bt_stride,
            runtime.window_left, runtime.soft_cap) + mask_args
        self._keep = plan
        return plan.info.max_total_q

    def _mask_extras(self, plan, qo: np.ndarray, kv_lens: np.ndarray, custom_mask, extras: dict,
                     pages_host: np.ndarray | None) -> dict:
        """``extras`` followed by a custom mask's: per-request bit offsets and per-item ``tile_indptr`` (fixed
        lengths in CUDA-graph mode), the host page ids if any, then the tile lists (``plan_mask_tiles``, which
        re-orders the plan's items) and a host mask's bits. The last two move when re-planning changes the
        lengths before them, so tile_indptr and a host mask's bit offsets count from the start of the device
        plan buffer, whose address never changes in CUDA-graph mode. A device mask is held and read in place."""
        bits = custom_mask_bits(custom_mask, qo, kv_lens)
        self._mask_held = bits.device
        indptr, entries = plan_mask_tiles(plan, bits.host, bits.offsets, kv_lens, tile_kv=self._tile_kv)
        offsets = bits.offsets
        if self.max_batch_size is not None:
            offsets = np.concatenate([offsets, np.zeros(self.max_batch_size - offsets.size, np.int64)])
        out = {**extras, "mask_offset": offsets.astype("<i8").view(np.int32), "tile_indptr": indptr}
        if pages_host is not None:
            out["pages"] = pages_host
        out["tiles"] = entries
        if bits.host is not None:  # int32 words, the tail zero-filled (the kernel reads whole aligned words)
            words = np.zeros(-(-bits.host.size // 4) * 4, np.uint8)
            words[: bits.host.size] = bits.host
            out["mask"] = words.view("<i4")
        starts, _ = extra_offsets(plan.numel, {name: values.size for name, values in out.items()})
        out["tile_indptr"] = (indptr + starts["tiles"]).astype(np.int32)
        if bits.host is not None:
            out["mask_offset"] = (offsets + np.int64(starts["mask"]) * 32).astype("<i8").view(np.int32)
        return out

    def _plan_rope(self, views, total_q: int, total_kv: int, batch: int, num_qo_heads: int, num_kv_heads: int,
                   runtime: Runtime, tables: tuple[int, int, int]) -> None:
        """Scratch for rotated q, K and V; the scratch K / V tensor maps; the pre-pass's plan-side arguments."""
        d = self.spec.head_dim
        q_n, kv_n = total_q * num_qo_heads * d, max(total_kv, 1) * num_kv_heads * d
        flat = self._scratch.get(q_n + 2 * kv_n + 64, "rope scratch")  # 64: 128-byte alignment of each part
        align = 128 // flat.element_size()
        k_at = -(-q_n // align) * align
        v_at = k_at + -(-kv_n // align) * align
        self._q_out = flat[:q_n].view(total_q, num_qo_heads, d)
        k_out = flat[k_at: k_at + kv_n].view(max(total_kv, 1), num_kv_heads, d)
        v_out = flat[v_at: v_at + kv_n].view(max(total_kv, 1), num_kv_heads, d)
        view = KVView(k_out, v_out, 0, num_kv_heads * d, d, k_out.shape[0])
        self._scratch_maps = (kv_tensor_map(self.kernel_spec, view, k_out), kv_tensor_map(self.kernel_spec, view, v_out))
        pairs = (total_q * num_qo_heads + total_kv * num_kv_heads) * (d // 2)
        self._rope_grid = (max(1, -(-pairs // ROPE_THREADS)), 1, 1)
        self._rope_outs = (self._q_out.data_ptr(), k_out.data_ptr(), v_out.data_ptr())
        self._rope_tables = (views["qo_indptr"].data_ptr(), views["src_indptr"].data_ptr(), tables[0], tables[1],
                             views["kv_len"].data_ptr(), views["kv_indptr"].data_ptr())
        self._rope_scalars = (total_q, total_kv, tables[2], batch, num_qo_heads, num_kv_heads,
                              runtime.rope_rcp_scale, runtime.rope_log2_theta)

    def _load_kernel(self) -> None:
        from ..jit import build

        if self.rope:
            self._rope_fn = build(self._kernels["rope_gather"], "rope_gather", device=self.device.index)["rope_gather"]
        self._kernel = build(self.kernel_spec, "prefill_sm90", device=self.device.index)
        self._fn = self._kernel["prefill_sm90"]
        self._smem = sm90_smem_bytes(self.spec.head_dim, gather=self.gather)
        self._fn.set_max_dynamic_shared_memory(self._smem)

    def kv_args(self, kv: KVView) -> tuple:
        """The TMA descriptors of K and V, bounded by the tensors' own size (the wrapper memoises them); for a
        gathered page size (``sm90_gather``) or RoPE, the cache's addresses and element strides (k, v,
        stride_page, stride_token, stride_head: the kernel's params, or with RoPE the pre-pass's, the kernel then
        reading the scratch)."""
        if self.rope or self.gather:
            return (kv.k.data_ptr(), kv.v.data_ptr(), kv.stride_page, kv.stride_token, kv.stride_head)
        if kv.k.shape[0] == 0:  # a map needs an address: an empty cache is read through a one-row stand-in
            key = (tuple(kv.k.shape[1:]), kv.k.dtype)
            if key not in self._empty:
                self._empty[key] = torch.zeros((1, *kv.k.shape[1:]), dtype=kv.k.dtype, device=kv.k.device)
            stand_in = self._empty[key]
            return kv_tensor_map(self.spec, kv, stand_in), kv_tensor_map(self.spec, kv, stand_in)
        return kv_tensor_map(self.spec, kv, kv.k), kv_tensor_map(self.spec, kv, kv.v)

    def _qo_map(self, t: torch.Tensor, tokens: int) -> bytes:
        """``qo_tensor_map`` of q or out for the planned group, memoised by what it depends on, so that run() of
        tensors seen before does not encode again."""
        key = (t.data_ptr(), t.shape, t.stride(), self._group, tokens)
        hit = self._maps.get(key)
        if hit is None:
            if len(self._maps) >= MAPS_HELD:  # bounded: a caller allocating out afresh each run() keeps missing
                self._maps.clear()
            hit = self._maps[key] = qo_tensor_map(t, self._group, tokens)
        return hit

    def launch(self, q: torch.Tensor, kv: tuple, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        stream = current_stream(self.device.index)
        if self.rope:  # the kernel reads the rotated q in the scratch
            self._rope_fn.launch(self._rope_grid, (ROPE_THREADS, 1, 1), 0, stream, q.data_ptr(), kv[0], kv[1],
                                 *self._rope_outs, *self._rope_tables, *kv[2:], *self._rope_scalars)
            kv, q = self._scratch_maps, self._q_out
        maps = (self._qo_map(q, TILE_Q // self._group) if self._q_tma else NO_MAP,)
        if self._o_staged:
            maps += (self._qo_map(out, O_WARP_ROWS // self._group) if self._o_tma else NO_MAP,)
        self._fn.launch(self._grid, (THREADS, 1, 1), self._smem, stream, *maps, *kv,
                        q.data_ptr(), out.data_ptr(), lse.data_ptr() if lse is not None else 0, *self._args)


class PrefillSM90(BatchPrefillWrapper):
    """``BatchPrefillWrapper(spec, backend="sm90")``: the Hopper kernel or an error, never the portable one.

    Example::

        runner = PrefillSM90(AttentionSpec(128, kv_layout=Ragged(), mask=Causal()))
        runner.plan(qo_indptr=[0, 100, 612], kv_indptr=[0, 100, 612], num_qo_heads=32, num_kv_heads=8)
        out, lse = runner.run(q, (k, v), return_lse=True)  # q [612, 32, 128] bf16 -> out [612, 32, 128], lse fp32
    """

    def __init__(self, spec: AttentionSpec, device: torch.device | int | None = None, num_sms: int | None = None,
                 **options):
        super().__init__(spec, device=device, num_sms=num_sms, backend="sm90", **options)
