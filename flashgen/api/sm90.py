"""Hopper prefill (``prefill_sm90``) behind ``BatchPrefillWrapper(backend="sm90")``: TMA descriptors built on
the host, plan buffers and the launch.

``BatchPrefillWrapper`` selects it by itself (``backend="auto"``, ``backends.select``) on a compute-capability
9.0 GPU for what ``PrefillSM90Family.check`` accepts (Ragged or paged KV, NoMask / Causal / SlidingWindow / CustomMask, fp16 /
bf16, fp8 K/V (dequantised by the rope_gather pre-pass, or in CUDA-graph mode by the kernel under TMA-loaded
pages), head_dim == head_dim_vo in 64 / 128 / 256); it plans every request unsplit (one item per (request,
128-row q tile), its whole KV). A custom mask becomes a tile list per item (``plan.mask_tiles``): a host mask
is classified on the host (fully masked tiles skipped, fully visible ones unmasked); a device mask is read
in place with every tile treated as partial (no sync, no skipping). A variant's mask (``kernels.sm90_tile_lists``)
becomes tile lists on the device, in a buffer sized at ``plan()`` (``plan.mask_tiles.tile_list_indptr``): by its
``mask_tile`` predicate in the kernel itself (its producer warp 3), or by the mask hook over each tile's pairs in the
kernel's pre-pass (``prefill_sm90_tiles``), which ``run()`` launches ahead of it on the same stream; no host sync
either way, and CUDA-graph capture keeps working.
"""

from __future__ import annotations

from typing import Mapping

import ctypes
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..kernels import (TILE_HOOK_THREADS, prepass_threads, rotates, sm90_qo_tma, sm90_tile_heads, sm90_tile_lists,
                       sm90_tile_prepass)
from ..plan import plan_prefill
from ..plan.mask_tiles import plan_mask_tiles, tile_list_indptr
from ..spec import AttentionSpec, CustomMask, Paged, RoPE
from .backends import kernels_for
from .custom_mask import custom_mask_bits, device_mask, mask_extras
from .device import current_stream
from .fastdiv import fast_div
from .kv_inputs import TORCH_DTYPES, KVView, PageTable
from .positions import wants_positions
from .portable import HOST_ARRAYS_HINT, host_ids_reserve, page_fields, table_extras
from .staging import DeviceBuffer
from .variant_args import variant_args, variant_offset, variant_size
from .wrapper import Runtime, WrapperCore, rope_scaling_params

_TMA_DTYPES = {torch.bfloat16: "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", torch.float16: "CU_TENSOR_MAP_DATA_TYPE_FLOAT16",
               torch.float8_e4m3fn: "CU_TENSOR_MAP_DATA_TYPE_UINT8", torch.float8_e5m2: "CU_TENSOR_MAP_DATA_TYPE_UINT8"}
TMA_BOX_COLS = 64  # 64 16-bit values = the 128-byte swizzle span; a head_dim of 128 is two boxes
O_WARP_ROWS = 16  # packed rows of a consumer warp: one TMA store box of O (the kernel's O_WARP_ROWS)
NO_MAP = bytes(128)  # a CUtensorMap param the kernel does not read (q_tma / o_tma off)
MAPS_HELD = 64  # q / out tensor maps memoised (by address, shape, strides, group) before the memo starts over
# a CUDA-graph wrapper's tile-list buffer (a variant's mask) is sized by its first plan
TILE_LISTS_HINT = "make the first plan the one with the most KV tiles summed over its q tiles"


def kv_tensor_map(spec: AttentionSpec, kv: KVView, t: torch.Tensor, tile_kv: int) -> bytes:
    """The 128-byte TMA descriptor of ``t`` (K or V of ``kv``: fp16/bf16 or fp8, rows contiguous, 16-byte aligned
    strides) as a 4-D tensor, innermost first, dims ordered by stride: paged NHD ``{head_dim, kv_heads,
    page_size, pages}``, paged HND ``{head_dim, page_size, kv_heads, pages}``, ragged ``{head_dim, kv_heads,
    rows, 1}``. Boxes are one head's 64 columns of ``min(page_size, tile_kv)`` rows (ragged: ``tile_kv`` rows, the
    kernel's KV tile, ``launch_config.tile_kv``),
    landing 128B-swizzled (fp8: unswizzled 64-byte rows, the staging stage the kernel converts from). The map is bounded by the tensor's own size, never a plan's: it is a kernel
    parameter, captured by value in a CUDA graph, so it must not depend on the plan; rows past the end read
    zeros.

    >>> desc = kv_tensor_map(spec, kv_view(spec, (k, v), 8), k, 128)   # pack into a CUtensorMap params field
    """
    from cuda.bindings import driver as cu

    from ..runtime.driver import check, ensure_context

    ensure_context(t.device.index)
    u64, u32 = cu.cuuint64_t, cu.cuuint32_t
    elem = t.element_size()
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
    swizzle = "CU_TENSOR_MAP_SWIZZLE_NONE" if elem == 1 else "CU_TENSOR_MAP_SWIZZLE_128B"
    tensor_map = check(cu.cuTensorMapEncodeTiled(
        getattr(cu.CUtensorMapDataType, _TMA_DTYPES[t.dtype]), 4, t.data_ptr(), [u64(x) for x in dims],
        [u64(x * elem) for x in strides], [u32(TMA_BOX_COLS), *(u32(x) for x in box), u32(1)], [u32(1)] * 4,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, getattr(cu.CUtensorMapSwizzle, swizzle),
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
    """The ``prefill_sm90`` kernel behind ``BatchPrefillWrapper(backend="sm90")``: plan, tensor maps, params by
    name, launch. In CUDA-graph mode the plan buffer is sized at the first plan and never moves; padding items
    have ``request_idx = -1``, which the kernel skips."""

    def __init__(self, core: WrapperCore, options: dict | None = None):
        spec = core.spec
        self.core, self.spec, self.device, self.num_sms = core, spec, core.device, core.num_sms
        # explicit positions (kernel_options={"positions": True}): both kernels take them; with RoPE the pre-pass
        # also writes each scratch key's position, which the kernel reads as a ragged cache's kv_page_pos
        self.positions = wants_positions(options)
        self._options = {"positions": True} if self.positions else None
        self.last_plan = None
        self.max_batch_size = core.max_batch_size
        # RoPE over unrotated K, a k_transform or fp8 K/V: the rope_gather pre-pass writes K (through the hook,
        # rotated) and V, ragged, into scratch (when it turns, also q, rotated), and the kernel of the spec's ragged
        # twin attends over it (backends.check_sm90 refuses the pre-pass in CUDA-graph mode); RoPE over rotated K:
        # the kernel turns q itself
        self._kernels = dict(kernels_for(spec, "sm90", core.fixed))  # {"prefill_sm90": spec[, "rope_gather": spec]}
        self.prepass = "rope_gather" in self._kernels  # the pre-pass runs (public: tests and tools ask)
        self._q_copied = rotates(spec)  # it writes q too (RoPE over rotated K: the kernel turns q)
        self._dequantises = self.prepass and spec.kv_dtype != spec.dtype  # fp8 K/V into the 16-bit scratch
        self.kernel_spec = self._kernels["prefill_sm90"]
        self._scratch = DeviceBuffer(TORCH_DTYPES[spec.dtype], core.device, False) if self.prepass else None
        self._key_pos = DeviceBuffer(torch.int32, core.device, False) if self.prepass and self.positions else None
        self._variant_copy = None  # (kernel offset, pre-pass offset, size): the run() arguments both read
        self._maps: dict[tuple, bytes] = {}  # q / out tensor maps (_qo_map)
        self._heads: dict[tuple, tuple] = {}  # (num_qo_heads, num_kv_heads) -> _head_fields
        self._kernel = None
        self._mask_held: torch.Tensor | None = None  # a device custom mask (in place, or its graph-mode copy)
        self._masks = DeviceBuffer(torch.uint8, core.device, True) if core.fixed else None
        self._page_ids_held: torch.Tensor | None = None  # a device page table, read in place
        self._empty: dict[tuple, torch.Tensor] = {}  # one-row stand-ins for an empty K / V (a map needs an address)
        self.variant = None  # the variant's run() keywords (variant_args), once the kernel is loaded
        self.params_buffer = None
        # a variant's mask: the items' tile lists, their buffer, and for a mask hook without a tile predicate the
        # pre-pass that writes them (a CTA a work item: each kv head's, or kv head 0's alone where one list serves
        # every kv head, sm90_tile_heads); a predicate's lists are written in the kernel (sm90_tile_prepass)
        self.tile_lists = sm90_tile_lists(self.kernel_spec, self.positions)
        self._tile_prepass = sm90_tile_prepass(self.kernel_spec, self.positions)
        self._tile_heads = self.tile_lists and sm90_tile_heads(self.kernel_spec)
        self._tiles_block = (TILE_HOOK_THREADS, 1, 1)
        self._tile_buffer = DeviceBuffer(torch.int32, core.device, core.fixed) if self.tile_lists else None
        self._tiles_fn = None

    def _load(self) -> None:
        from ..compile.toolchain import device_arch
        from ..jit import build, ensure_compiled

        index = self.device.index
        arch = device_arch(index)
        if self.prepass and arch is not None:  # a first use compiles the pass and the kernel side by side
            jobs = (("rope_gather", self._kernels["rope_gather"]), ("prefill_sm90", self.kernel_spec))
            with ThreadPoolExecutor(len(jobs)) as pool:
                list(pool.map(lambda job: ensure_compiled(job[1], job[0], arch=arch, options=self._options), jobs))
        if self.prepass:
            rope = build(self._kernels["rope_gather"], "rope_gather", device=index, options=self._options)
            self._rope_fn, self._rope_block = rope["rope_gather"], rope.launch_config.block
            self._rope_params = rope.params["rope_gather"].bind(
                ("q", "k", "v", "stride_page", "stride_token", "stride_head"))
            self._rope_layout = rope.params["rope_gather"]
        self._kernel = build(self.kernel_spec, "prefill_sm90", device=index, options=self._options)
        self._fn = self._kernel["prefill_sm90"]
        if self._tile_prepass:
            self._tiles_fn = self._kernel["prefill_sm90_tiles"]
        cfg = self._launch = self._kernel.launch_config
        self.gather, self._o_staged, self._tile_kv = cfg.gather, cfg.o_staged, cfg.tile_kv
        layout = self._kernel.params["prefill_sm90"]
        names = layout.names()
        self._params = layout.bind(names[: names.index("lse") + 1])  # tensor maps, K / V, q, o, lse: at run()
        self.variant = variant_args(self.kernel_spec, layout, self.device)
        self.params_buffer = self._params.buffer
        pre = self._kernels.get("rope_gather")
        if pre is not None and pre.variant is not None:  # the pre-pass's hooks read the run() arguments too
            if self.variant is None:  # the kernel runs none of the hooks: the arguments go to the pre-pass alone
                self.variant = variant_args(pre, self._rope_layout, self.device)
                self.params_buffer = self._rope_params.buffer
            else:  # the same declarations, so the same bytes: copied at run() (launch)
                self._variant_copy = (variant_offset(layout), variant_offset(self._rope_layout),
                                      variant_size(self.kernel_spec.variant))

    def plan(self, qo: np.ndarray, table: PageTable, num_qo_heads: int, num_kv_heads: int, runtime: Runtime,
             custom_mask, enable_split: bool, split_policy=None, positions: dict | None = None,
             v_scale: float | None = None, k_scale: float | None = None) -> int:
        """Plan unsplit (``enable_split`` and ``split_policy`` are ignored) and upload; returns the rows of q and
        out (total_q, or max_total_q in CUDA-graph mode). ``custom_mask``: CustomMask specs only (the wrapper
        checked). ``positions``: the ``q_pos`` and ``kv_page_pos`` extras of a wrapper with explicit positions.
        ``v_scale``: fp8 V's per-tensor scale (k_scale is in ``runtime.sm_scale``, or, under a k_transform, given
        as ``k_scale``): the kernel's param, or with the pre-pass the pass's (it dequantises into the scratch)."""
        core = self.core
        if self._kernel is None:
            self._load()
        options = {"max_batch_size": core.max_batch_size, "max_total_q": core.max_total_q} if core.fixed else {}
        plan = core.staging.plan(lambda host: plan_prefill(
            qo, table.kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, tile_rows=self._launch.tile_q,
            kv_granularity=self._tile_kv, num_sms=self.num_sms, enable_split=False, host_buffer=host, **options))
        self.last_plan = plan  # the Plan (host view) that the current params point into
        extras, pages_host = table_extras(table, core.max_batch_size)
        if "kv_indptr" not in extras:  # a block table needs no offsets; the kernel reads a (zero) array anyway
            extras["kv_indptr"] = np.zeros(qo.size if not core.fixed else core.max_batch_size + 1, np.int32)
        if self.prepass:  # the kernel reads the ragged scratch; the pre-pass reads the cache through its own table
            extras = {"kv_indptr": _ragged_indptr(table.kv_lens, extras["kv_indptr"].size),
                      "src_indptr": extras["kv_indptr"]}
        if positions:
            extras.update(positions)  # before the page ids, which may grow in a CUDA-graph buffer
        custom = isinstance(self.spec.mask, CustomMask)
        if custom:
            extras = self._mask_extras(plan, qo, table.kv_lens, custom_mask, extras, pages_host)
        else:
            if self.tile_lists:  # a fixed length in CUDA-graph mode: before the page ids, as positions
                extras["tile_indptr"] = tile_list_indptr(plan.numpy("kv_start"), plan.numpy("kv_end"), self._tile_kv)
            if pages_host is not None:
                extras["pages"] = pages_host
        fixed = ("kv_indptr" in extras) + ("src_indptr" in extras) + 2 * bool(positions) + self.tile_lists
        hint = HOST_ARRAYS_HINT if len(extras) > fixed else "raise max_batch_size"
        addresses = core.upload(plan, extras, hint, host_ids_reserve(core, table, pages_host))
        tables, self._page_ids_held = page_fields(table, core.device, addresses)
        if self.prepass:
            scales = {"k_scale": k_scale or 1.0, "v_scale": v_scale or 1.0} if self._dequantises else {}
            self._plan_rope(addresses, int(qo[-1]), int(table.kv_lens.sum()), int(table.kv_lens.size), num_qo_heads,
                            num_kv_heads, runtime, tables, positions, scales)
            tables.update(kv_indices=0, block_table=0, block_table_stride=0)  # the kernel's KV: the ragged scratch
        tables["kv_indptr"] = addresses["kv_indptr"]
        # persistent CTAs, one an SM, walk the capacity x num_kv_heads work items (the kernel strides over them)
        self._grid = (max(1, min(plan.info.capacity * num_kv_heads, self.num_sms)), 1, 1)
        base = addresses["base"]  # tile_indptr and host mask offsets count from here
        heads = self._heads.get((num_qo_heads, num_kv_heads))
        if heads is None:
            heads = self._heads[(num_qo_heads, num_kv_heads)] = self._head_fields(num_qo_heads, num_kv_heads)
        self._group, self._q_tma, self._o_tma = heads[1]
        fields = {name: addresses[name] for name in ("qo_indptr", "kv_len", "request_idx", "qo_tile_idx",
                                                      "kv_start", "kv_end")}
        fields.update(tables)
        fields.update(heads[0], sm_scale=runtime.sm_scale, num_items=plan.info.capacity,
                      window_left=runtime.window_left, soft_cap=runtime.soft_cap)
        if isinstance(self.kernel_spec.pos_encoding, RoPE):  # the kernel turns q (a cache of rotated K)
            fields.update(rope_rcp_scale=runtime.rope_rcp_scale, rope_log2_theta=runtime.rope_log2_theta,
                          **rope_scaling_params(self.kernel_spec, runtime))
        tiles = base if custom else self._tile_lists_at(extras, num_kv_heads, plan.info.capacity)
        fields.update(custom_mask=(self._mask_held.data_ptr() if self._mask_held is not None else base) if custom else 0,
                      mask_offset=addresses["mask_offset"] if custom else 0,
                      tile_indptr=addresses["tile_indptr"] if custom or self.tile_lists else 0, tiles=tiles)
        if positions:  # with RoPE the keys' positions are the pre-pass's, one a scratch row
            fields.update(kv_page_pos=self._key_pos_at if self.prepass else addresses["kv_page_pos"],
                          q_pos=addresses["q_pos"])
        if self.kernel_spec.variant is not None:
            fields["variant"] = b""  # packed by run() (variant_args)
        if v_scale is not None and not self._dequantises:  # else the pass's
            fields["v_scale"] = v_scale
        self._params.pack(fields)
        return plan.info.max_total_q

    def _tile_lists_at(self, extras: dict, num_kv_heads: int, capacity: int) -> int:
        """The address of the tile-list buffer of a variant's mask (0 without lists), sized for this plan's items;
        with the mask hook's pre-pass its grid, a CTA a work item, of kv head 0 only where its list serves every
        kv head."""
        if not self.tile_lists:
            return 0
        self._tiles_grid = (max(1, capacity * (num_kv_heads if self._tile_heads else 1)), 1, 1)
        return self._tile_buffer.address_of(num_kv_heads * int(extras["tile_indptr"][-1]), "tile lists",
                                            TILE_LISTS_HINT)

    def _head_fields(self, num_qo_heads: int, num_kv_heads: int) -> tuple[dict, tuple]:
        """The params that follow from the head counts (memoised per wrapper: a loop plans with the same ones),
        and ``(group, q_tma, o_tma)``."""
        group = num_qo_heads // num_kv_heads
        q_tma, o_tma = sm90_qo_tma(group, self._o_staged)
        magic, shift = fast_div(group)
        return ({"num_qo_heads": num_qo_heads, "group_size": group, "group_magic": magic, "group_shift": shift,
                 "q_tma": int(q_tma), "o_tma": int(o_tma), "num_kv_heads": num_kv_heads}, (group, q_tma, o_tma))

    def _mask_extras(self, plan, qo: np.ndarray, kv_lens: np.ndarray, custom_mask, extras: dict,
                     pages_host: np.ndarray | None) -> dict:
        """``extras`` followed by a custom mask's (``custom_mask.mask_extras``): a host mask is classified into
        tile lists (``plan_mask_tiles``, which re-orders the plan's items); a device mask is held and read in
        place (``device_mask``: its copy in CUDA-graph mode), every tile partial."""
        bits = custom_mask_bits(custom_mask, qo, kv_lens)
        self._mask_held = device_mask(bits, self._masks)
        indptr, entries = plan_mask_tiles(plan, bits.host, bits.offsets, kv_lens, tile_kv=self._tile_kv)
        return mask_extras(plan.numel, bits, indptr, entries, extras, pages_host, self.max_batch_size)

    def _plan_rope(self, addresses: Mapping[str, int], total_q: int, total_kv: int, batch: int, num_qo_heads: int,
                   num_kv_heads: int, runtime: Runtime, tables: dict, positions: dict | None = None,
                   scales: dict | None = None) -> None:
        """Scratch for rotated q, K and V (and with ``positions`` the scratch keys' positions); the scratch K / V
        tensor maps; the pre-pass's plan-time params."""
        d = self.spec.head_dim
        if not self._q_copied:  # no RoPE: the kernel reads the caller's q (and runs any q_transform itself)
            total_q = 0
        q_n, kv_n = total_q * num_qo_heads * d, max(total_kv, 1) * num_kv_heads * d
        flat = self._scratch.get(q_n + 2 * kv_n + 64, "pre-pass scratch")  # 64: 128-byte alignment of each part
        align = 128 // flat.element_size()
        k_at = -(-q_n // align) * align
        v_at = k_at + -(-kv_n // align) * align
        self._q_out = flat[:q_n].view(total_q, num_qo_heads, d)
        k_out = flat[k_at: k_at + kv_n].view(max(total_kv, 1), num_kv_heads, d)
        v_out = flat[v_at: v_at + kv_n].view(max(total_kv, 1), num_kv_heads, d)
        view = KVView(k_out, v_out, 0, num_kv_heads * d, d, k_out.shape[0])
        self._scratch_maps = (kv_tensor_map(self.kernel_spec, view, k_out, self._tile_kv),
                              kv_tensor_map(self.kernel_spec, view, v_out, self._tile_kv))
        threads = prepass_threads(total_q * num_qo_heads + total_kv * num_kv_heads, d)
        extra = {}
        if positions:
            self._key_pos_at = self._key_pos.address_of(max(total_kv, 1), "pre-pass key positions")
            extra = {"kv_page_pos": addresses["kv_page_pos"], "q_pos": addresses["q_pos"],
                     "kv_pos_out": self._key_pos_at}
        self._rope_grid = (max(1, -(-threads // self._rope_block[0])), 1, 1)
        self._rope_params.pack({
            "q_out": self._q_out.data_ptr(), "k_out": k_out.data_ptr(), "v_out": v_out.data_ptr(),
            "qo_indptr": addresses["qo_indptr"], "kv_indptr": addresses["src_indptr"],
            "kv_indices": tables["kv_indices"], "block_table": tables["block_table"], "kv_len": addresses["kv_len"],
            "kv_out_indptr": addresses["kv_indptr"], "total_q": total_q, "total_kv_out": total_kv,
            "block_table_stride": tables["block_table_stride"], "batch": batch, "num_qo_heads": num_qo_heads,
            "num_kv_heads": num_kv_heads, "rope_rcp_scale": runtime.rope_rcp_scale,
            "rope_log2_theta": runtime.rope_log2_theta, **extra, **(scales or {}),
            **(rope_scaling_params(self.spec, runtime) if self._q_copied else {}),
            **({"variant": b""} if self._kernels["rope_gather"].variant is not None else {})})  # run(): launch

    def kv_args(self, kv: KVView) -> tuple:
        """The TMA descriptors of K and V, bounded by the tensors' own size (the wrapper memoises them); for a
        gathered page size (``launch_config.gather``) or RoPE, the cache's addresses and element strides (k, v,
        stride_page, stride_token, stride_head: the kernel's params, or with RoPE the pre-pass's, the kernel
        then reading the scratch)."""
        if self.prepass or self.gather:
            return (kv.k.data_ptr(), kv.v.data_ptr(), kv.stride_page, kv.stride_token, kv.stride_head)
        if kv.k.shape[0] == 0:  # a map needs an address: an empty cache is read through a one-row stand-in
            key = (tuple(kv.k.shape[1:]), kv.k.dtype)
            if key not in self._empty:
                self._empty[key] = torch.zeros((1, *kv.k.shape[1:]), dtype=kv.k.dtype, device=kv.k.device)
            stand_in = self._empty[key]
            return (kv_tensor_map(self.spec, kv, stand_in, self._tile_kv),
                    kv_tensor_map(self.spec, kv, stand_in, self._tile_kv))
        return kv_tensor_map(self.spec, kv, kv.k, self._tile_kv), kv_tensor_map(self.spec, kv, kv.v, self._tile_kv)

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
        if self.prepass:  # the kernel reads the scratch K / V (with RoPE the rotated q there too)
            rope = self._rope_params
            rope.set(q.data_ptr(), kv[0], kv[1], *kv[2:])
            if self._variant_copy is not None:
                at, to, size = self._variant_copy
                rope.buffer[to: to + size] = self._params.buffer[at: at + size]
            self._rope_fn.launch_params(self._rope_grid, self._rope_block, 0, stream, rope.address)
            kv = self._scratch_maps
            if self._q_copied:
                q = self._q_out
        maps = (self._qo_map(q, self._launch.tile_q // self._group) if self._q_tma else NO_MAP,)
        if self._o_staged:
            maps += (self._qo_map(out, O_WARP_ROWS // self._group) if self._o_tma else NO_MAP,)
        params = self._params
        params.set(*maps, *kv, q.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr())
        if self._tiles_fn is not None:  # the items' tile lists, ahead of the kernel that reads them (same params)
            self._tiles_fn.launch_params(self._tiles_grid, self._tiles_block, 0, stream, params.address)
        self._fn.launch_params(self._grid, self._launch.block, self._launch.smem_bytes, stream, params.address)


def _ragged_indptr(kv_lens: np.ndarray, size: int) -> np.ndarray:
    """Token offsets of the ragged scratch (the RoPE pre-pass's output), ``size`` long (padded in graph mode)."""
    out = np.zeros(size, np.int64)
    np.cumsum(kv_lens, out=out[1: kv_lens.size + 1])
    out[kv_lens.size + 1:] = out[kv_lens.size]
    return out
