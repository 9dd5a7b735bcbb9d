"""The portable prefill backend (family ``prefill``, mma.sync, any GPU flashgen targets): split-KV plans, the
custom mask's tile lists, the params struct by name, the launch. Also the page-table and split-KV params that
the decode backend shares with it.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from ..plan import SplitPolicy, plan_prefill
from ..plan.mask_tiles import split_plan_mask_tiles
from ..spec import CustomMask, NoMask
from .custom_mask import custom_mask_bits, device_mask, mask_extras
from .device import current_stream
from .kv_inputs import KVView, PageTable, device_page_ids
from .staging import DeviceBuffer
from .variant_args import variant_args
from .wrapper import Runtime, WrapperCore, rope_scaling_params

# the params written at run(): the tensors and the cache's strides (the KV memo's arguments)
RUNTIME_FIELDS = ("q", "k", "v", "o", "lse", "stride_page", "stride_token", "stride_head")
# host page ids and mask data travel with the plan: their size follows the batch's KV, not max_batch_size
HOST_ARRAYS_HINT = ("page ids or a custom mask on the host travel with the plan: pass max_num_pages (or "
                    "max_pages_per_request) to the CUDA-graph wrapper, make the first plan the one with the most "
                    "page ids and mask bits, or pass them on the device")


def table_extras(table: PageTable, max_batch_size: int | None) -> tuple[dict, np.ndarray | None]:
    """``({"kv_indptr": ...} or {}, host page ids or None)``: the page table's arrays that travel with the plan.
    ``kv_indptr`` (CSR and ragged) has a fixed length (``max_batch_size + 1``) in CUDA-graph mode, so that the
    arrays after it keep their places from plan to plan."""
    extras = {}
    if table.kv_indptr_host is not None:
        indptr = table.kv_indptr_host
        if max_batch_size is not None:
            indptr = np.concatenate([indptr, np.full(max_batch_size + 1 - indptr.size, indptr[-1], indptr.dtype)])
        extras["kv_indptr"] = indptr
    ids = table.block_table if table.block_table is not None else table.kv_indices
    if ids is None or ids.is_cuda:
        return extras, None
    return extras, ids.numpy().reshape(-1)  # int64 ids become int32 as they are written into the staging buffer


def host_ids_reserve(core: WrapperCore, table: PageTable, pages_host: np.ndarray | None) -> int:
    """int32 elements a CUDA-graph wrapper's plan buffer keeps, at its first sizing, for the host page ids of
    later plans: up to ``max_num_pages`` (CSR) or ``max_batch_size x max_pages_per_request`` (block table), past
    this plan's own. 0 outside graph mode, for device ids, or when the wrapper was given neither."""
    ids = core.page_ids
    if pages_host is None or not core.fixed or ids is None:
        return 0
    if table.block_table is not None:
        room = core.max_batch_size * ids.max_pages_per_request if ids.max_pages_per_request else 0
    else:
        room = ids.max_num_pages or 0
    return max(room - pages_host.size, 0)


def page_fields(table: PageTable, device: torch.device, addresses: Mapping[str, int]) -> tuple[dict, object]:
    """``kv_indptr``, ``kv_indices``, ``block_table`` and ``block_table_stride`` of the params, and the device
    page table the plan reads in place (to be held while the plan is used), if any."""
    ids = table.block_table if table.block_table is not None else table.kv_indices
    held, stride, pages = None, 0, 0
    if ids is not None and ids.is_cuda:
        (pages, stride), held = device_page_ids(ids, device), ids
    elif ids is not None:
        pages, stride = addresses["pages"], (ids.shape[1] if ids.dim() == 2 else 0)
    block_table = table.block_table is not None
    return {"kv_indptr": addresses.get("kv_indptr", 0), "kv_indices": 0 if block_table else pages,
            "block_table": pages if block_table else 0, "block_table_stride": stride}, held


def split_kv_fields(addresses: Mapping[str, int], tmp_o: int, tmp_lse: int, counters: int, num_qo_heads: int,
                    num_kv_heads: int, runtime: Runtime, spec) -> dict:
    """The split-KV plan's params shared by decode and the portable prefill (names of ``SPLIT_KV_SCHEMA``, and
    ``spec``'s RoPE scaling's where it has one)."""
    fields = {name: addresses[name] for name in ("qo_indptr", "kv_len", "request_idx", "qo_tile_idx", "chunk_idx",
                                                  "kv_start", "kv_end", "merge_indptr", "num_chunks")}
    fields.update(tmp_o=tmp_o, tmp_lse=tmp_lse, counters=counters, num_qo_heads=num_qo_heads,
                  group_size=num_qo_heads // num_kv_heads, window_left=runtime.window_left,
                  sm_scale=runtime.sm_scale, soft_cap=runtime.soft_cap, rope_rcp_scale=runtime.rope_rcp_scale,
                  rope_log2_theta=runtime.rope_log2_theta)
    fields.update(rope_scaling_params(spec, runtime))
    return fields


class SplitKVLaunch:
    """``kv_args`` and ``launch`` of the backends whose params take the cache's k, v and strides (decode, the
    portable prefill): ``run()`` writes ``RUNTIME_FIELDS`` into the params packed at ``plan()`` and launches.
    A subclass sets ``core``, ``_params`` (bound to ``RUNTIME_FIELDS``), ``_fn``, ``_launch`` and ``_grid``."""

    def kv_args(self, kv: KVView) -> tuple:
        return (kv.k.data_ptr(), kv.v.data_ptr(), kv.stride_page, kv.stride_token, kv.stride_head)

    def launch(self, q: torch.Tensor, kv: tuple, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        if not self._grid[0]:  # no work item (no request has a query): nothing to write, and no grid of 0 CTAs
            return
        params = self._params
        params.set(q.data_ptr(), kv[0], kv[1], out.data_ptr(), 0 if lse is None else lse.data_ptr(), kv[2], kv[3],
                   kv[4])
        self._fn.launch_params(self._grid, self._launch.block, self._launch.smem_bytes,
                               current_stream(self.core.device.index), params.address)


class PortablePrefill(SplitKVLaunch):
    """The mma.sync prefill kernel behind ``BatchPrefillWrapper``: plan, upload, params, launch. ``options``:
    the family's kernel options (``{"tiles": "kv32"}``)."""

    def __init__(self, core: WrapperCore, options: dict | None = None):
        self.core, self.spec, self.options = core, core.spec, options
        self._tmp_o = DeviceBuffer(torch.float32, core.device, core.fixed)
        self._tmp_lse = DeviceBuffer(torch.float32, core.device, core.fixed)
        self._masks = DeviceBuffer(torch.uint8, core.device, True) if core.fixed else None  # graph mode: mask copies
        self._kernel = None
        self._fp8 = self.spec.kv_dtype.startswith("float8")
        self._held = (None, None)  # a device page table and a device mask, read in place
        self.last_plan = None
        self.variant = None  # the variant's run() keywords (variant_args), once the kernel is loaded
        self.params_buffer = None

    def _load(self) -> None:
        from ..jit import build

        self._kernel = build(self.spec, "prefill", device=self.core.device.index, options=self.options)
        self._fn = self._kernel["prefill"]
        self._launch = self._kernel.launch_config
        self._params = self._kernel.params["prefill"].bind(RUNTIME_FIELDS)
        self.variant = variant_args(self.spec, self._kernel.params["prefill"], self.core.device)
        self.params_buffer = self._params.buffer

    def plan(self, qo: np.ndarray, table: PageTable, num_qo_heads: int, num_kv_heads: int, runtime: Runtime,
             custom_mask, enable_split: bool, split_policy: SplitPolicy | None = None,
             positions: dict | None = None, v_scale: float | None = None, k_scale: float | None = None) -> int:
        """Plan and upload; returns the rows of q and out (total_q, or max_total_q in CUDA-graph mode).
        ``positions``: the ``q_pos`` and ``kv_page_pos`` extras of a wrapper with explicit positions. ``v_scale``:
        fp8 V's per-tensor scale (the params field of fp8 kernels; 1.0 when not given); ``k_scale``: fp8 K's, the
        params field of kernels whose k_transform dequantises K (``kernels.dequantises_k``)."""
        core = self.core
        if self._kernel is None:
            self._load()
        cfg, dv = self._launch, self.spec.head_dim_vo
        options = {"max_batch_size": core.max_batch_size, "max_total_q": core.max_total_q} if core.fixed else {}
        plan = core.staging.plan(lambda host: plan_prefill(
            qo, table.kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, tile_rows=cfg.tile_q,
            kv_granularity=cfg.tile_kv, num_sms=core.num_sms * cfg.ctas_per_sm, enable_split=enable_split,
            balance_tail=enable_split and isinstance(self.spec.mask, NoMask), split_policy=split_policy,
            host_buffer=host, **options))
        info = plan.info
        self.last_plan = plan  # the Plan (host view) that the current params point into
        extras, pages_host = table_extras(table, core.max_batch_size)
        if positions:
            extras.update(positions)  # before the page ids, which may grow in a CUDA-graph buffer
        mask_held, reserve = None, 0
        if isinstance(self.spec.mask, CustomMask):
            extras, mask_held, reserve = self._mask_extras(plan, qo, table.kv_lens, custom_mask, extras, pages_host)
        elif pages_host is not None:
            extras["pages"] = pages_host
        hint = HOST_ARRAYS_HINT if len(extras) > ("kv_indptr" in extras) else "raise max_batch_size"
        addresses = core.upload(plan, extras, hint, reserve + host_ids_reserve(core, table, pages_host))
        fields, page_held = page_fields(table, core.device, addresses)
        tmp_o = self._tmp_o.address_of(info.partial_capacity * num_qo_heads * dv, "tmp_o")
        tmp_lse = self._tmp_lse.address_of(info.partial_capacity * num_qo_heads, "tmp_lse")
        counters = core.counters(info.max_total_q * num_qo_heads, "raise max_total_q")
        fields.update(split_kv_fields(addresses, tmp_o, tmp_lse, counters, num_qo_heads, num_kv_heads, runtime,
                                      self.spec))
        if isinstance(self.spec.mask, CustomMask):  # bits (a host mask's) and tile lists from the plan buffer
            fields.update(custom_mask=mask_held.data_ptr() if mask_held is not None else addresses["base"],
                          mask_offset=addresses["mask_offset"], tile_indptr=addresses["tile_indptr"],
                          tiles=addresses["base"])
        else:
            fields.update(custom_mask=0, mask_offset=0, tile_indptr=0, tiles=0)
        if positions:
            fields.update(kv_page_pos=addresses["kv_page_pos"], q_pos=addresses["q_pos"])
        if self._fp8:
            fields["v_scale"] = 1.0 if v_scale is None else v_scale
        if k_scale is not None:
            fields["k_scale"] = k_scale
        if self.variant is not None:
            fields["variant"] = b""  # packed by run() (variant_args)
        self._params.pack(fields)
        self._held = (page_held, mask_held)
        self._grid = (info.capacity * num_kv_heads, 1, 1)  # block x: item capacity - 1 - x / H, kv head x % H
        return info.max_total_q

    def _mask_extras(self, plan, qo: np.ndarray, kv_lens: np.ndarray, custom_mask, extras: dict,
                     pages_host: np.ndarray | None):
        """The custom mask's arrays after ``extras`` (``mask_extras``), the device mask the kernel reads (or
        None; ``device_mask``: in place, or its copy in CUDA-graph mode), and the room a CUDA-graph buffer keeps
        for later masks: each item's tile list is its chunk's tiles that some row sees (``split_plan_mask_tiles``);
        a device mask lists every tile (partial)."""
        bits = custom_mask_bits(custom_mask, qo, kv_lens)
        tile_kv = self._launch.tile_kv
        indptr, entries = split_plan_mask_tiles(plan, bits.host, bits.offsets, kv_lens, tile_kv=tile_kv)
        n = plan.info.num_items
        start, end = plan.numpy("kv_start")[:n].astype(np.int64), plan.numpy("kv_end")[:n].astype(np.int64)
        dense = int(np.maximum(-(-end // tile_kv) - start // tile_kv, 0).sum())  # the most any mask lists
        out = mask_extras(plan.numel, bits, indptr, entries, extras, pages_host, self.core.max_batch_size)
        return out, device_mask(bits, self._masks), max(dense - entries.size, 0)
