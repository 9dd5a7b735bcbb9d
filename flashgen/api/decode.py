"""BatchDecodeWrapper: plan once per batch shape, run every layer (CUDA-graph safe).

The wrapper is the core (``wrapper.WrapperCore``) over the decode backend below: one kernel (family
``decode``), split-KV partials merged in the kernel by the last CTA of a request.
"""

from __future__ import annotations

import torch

from ..kernels import APPEND_RUNTIME_FIELDS, dequantises_k, family
from ..plan import PlanError, SplitPolicy, plan_decode
from ..plan.host import check_heads
from ..spec import AttentionSpec
from . import handles
from .checks import check_count
from .device import current_stream
from .fused_append import append_fields, check_new_rows, wants_append
from .kv_inputs import PageTable, kv_view, page_table
from .page_ids import page_ids_for
from .positions import Positions, refuse_positions, wants_positions
from .portable import (HOST_ARRAYS_HINT, RUNTIME_FIELDS, SplitKVLaunch, host_ids_reserve, page_fields, split_kv_fields,
                       table_extras)
from .staging import DeviceBuffer
from .variant_args import variant_args, write_variant
from .wrapper import Runtime, WrapperCore, fp8_scaled, graph_capacity, resolve_device


class BatchDecodeWrapper:
    """Batch decode (one query token per request) over a paged or ragged KV cache.

    Example::

        wrapper = flashgen.BatchDecodeWrapper(AttentionSpec(128, kv_layout=Paged(16)))
        wrapper.plan(kv_indptr=indptr_cpu, kv_indices=indices_gpu, kv_last_page_len=last_cpu,
                     num_qo_heads=32, num_kv_heads=8)
        for layer in range(num_layers):
            out = wrapper.run(q[layer], kv_cache[layer])   # q [batch, 32, 128] -> out [batch, 32, 128]

    ``use_cuda_graph=True`` with ``max_batch_size``: every buffer and the grid are sized for that batch, so a
    graph captured around ``run()`` replays correctly after ``plan()`` of any batch up to it (q and out of
    ``max_batch_size`` rows, the KV cache at the captured address). Device page ids are copied at each plan into
    a buffer the wrapper owns (``page_ids.PageIds``), so each plan may pass a fresh tensor; its size:
    ``max_num_pages``, the most page ids one plan uses (``kv_indptr[-1]``), or for a block table
    ``max_pages_per_request``, the columns kept of each row (the buffer is ``max_batch_size x
    max_pages_per_request``); by default the first plan's ``kv_indices.numel()`` or block-table width. Both are
    used in CUDA-graph mode only. Outside it, device page ids are read in place (no copy).

    ``check_indices=True`` (default: ``FLASHGEN_CHECK_INDICES=1``): plan() checks device page ids on the GPU
    (a debugging aid: it synchronises, and is refused during a CUDA-graph capture): ids a request uses lie in
    ``[0, num_pages)`` (``num_pages`` given to plan(), else ``>= 0`` there and below the cache's page count at
    run()), the error naming the first bad position. Host page ids are always checked in full.

    ``kernel_options={"positions": True}``: keys and queries at explicit true positions; every plan() then takes
    ``kv_page_pos`` and ``q_pos`` (``flashgen.api.positions``), with a CSR page table.

    ``kernel_options={"append": True}``: fused append + decode. Every ``run()`` then takes the new token's
    ``k_new`` and ``v_new`` and, in the one launch, writes them into each request's cache slot at place
    ``kv_len - 1`` (the plan's lengths count the new token; its page must be in the page table) and attends over
    the whole cache: the same result and cache bytes as ``flashgen.append_kv`` then ``run()``. K is rotated on the
    way in when the spec's RoPE has ``k_rotated=True`` (the cache holds rotated K); otherwise it is stored as
    given and rotated as it is read. fp8 caches are written ``fp8(x / scale)`` with plan()'s ``k_scale`` and
    ``v_scale``. Paged caches only.

    ``workspace`` is accepted for FlashInfer-style call sites and not used: the wrapper sizes its own
    buffers (fixed at the first plan in CUDA-graph mode).
    """

    def __init__(self, spec: AttentionSpec, workspace: torch.Tensor | None = None, use_cuda_graph: bool = False,
                 max_batch_size: int | None = None, device: torch.device | int | None = None,
                 num_sms: int | None = None, max_num_pages: int | None = None,
                 max_pages_per_request: int | None = None, check_indices: bool | None = None,
                 kernel_options: dict | None = None):
        self.spec = family("decode").project(spec)
        family("decode", kernel_options).check(self.spec)
        max_batch_size = check_count("max_batch_size", max_batch_size)
        if use_cuda_graph and not max_batch_size:
            raise ValueError("max_batch_size: required with use_cuda_graph=True (the graph's fixed capacity)")
        self.device = resolve_device(device)
        self.use_cuda_graph, self.max_batch_size = use_cuda_graph, max_batch_size
        graph = graph_capacity(use_cuda_graph, max_batch_size, max_batch_size)
        page_ids = page_ids_for(self.spec, self.device, max_batch_size if graph else None, max_num_pages,
                                max_pages_per_request, check_indices)
        self._core = WrapperCore(self.spec, self.device, num_sms, graph, align=0, page_ids=page_ids)
        self.num_sms = self._core.num_sms
        self._impl = DecodeBackend(self._core, kernel_options)
        self._positions = Positions(max_batch_size if graph else None, max_num_pages) if wants_positions(
            kernel_options) else None
        self._fp8 = self.spec.kv_dtype.startswith("float8")
        self._dequant_k = dequantises_k(self.spec)  # a k_transform over fp8 K: k_scale is a param, not in sm_scale
        self._append = wants_append(kernel_options)
        self.op_handle = handles.assign(self)  # how flashgen.ops names this wrapper

    def plan(self, *, num_qo_heads: int, num_kv_heads: int, kv_indptr=None, kv_indices=None, kv_last_page_len=None,
             block_table=None, seq_lens=None, sm_scale: float | None = None, rope_theta: float | None = None,
             rope_scale: float | None = None, window_left: int | None = None, soft_cap: float | None = None,
             num_pages: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
             enable_split: bool = True, split_policy: SplitPolicy | None = None, kv_page_pos=None,
             q_pos=None) -> None:
        """Plan a batch. Lengths (``kv_indptr``, ``kv_last_page_len``, ``seq_lens``) are host arrays: planning
        never synchronises with the GPU (unless ``check_indices``). Page ids (``kv_indices`` or ``block_table``)
        may be device int32 tensors, read in place by the kernel (copied into the wrapper's buffer in CUDA-graph
        mode), or host arrays, then validated and copied to the device.

        Runtime values default to the spec's: ``sm_scale`` (1/sqrt(head_dim)), RoPE ``rope_theta`` and
        ``rope_scale``, the window's ``window_left``, ``soft_cap``; numbers must be finite and > 0,
        ``window_left=-1`` means no window and ``soft_cap=0`` no cap, as in FlashInfer
        (``wrapper.runtime_values``). ``num_pages`` (the pool size) bounds host page ids here; without it they
        are checked against the cache at ``run()``. ``k_scale``/``v_scale``: per-tensor scales of fp8 K/V (the
        cache holds K/k_scale and V/v_scale; 1.0 for other caches). ``split_policy``: the planner's split policy
        (``flashgen.plan.SplitPolicy``; default ``DEFAULT_SPLIT_POLICY``). ``kv_page_pos [>= kv_indptr[-1]]``,
        ``q_pos [batch]``: host int arrays, the true positions of each page's first token and of each request's
        query, for a wrapper built with ``kernel_options={"positions": True}`` (refused otherwise).
        """
        check_heads(num_qo_heads, num_kv_heads)
        table = page_table(self.spec, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=kv_last_page_len,
                           block_table=block_table, seq_lens=seq_lens, num_pages=num_pages)
        batch = table.kv_lens.size
        if self.use_cuda_graph and batch > self.max_batch_size:
            name = "seq_lens" if block_table is not None else "kv_indptr"
            raise PlanError(f"{name}: batch_size {batch} exceeds max_batch_size = {self.max_batch_size} (the "
                            "CUDA-graph capacity)")
        if self._core.page_ids is not None:
            self._core.page_ids.take(table, num_pages)
        runtime, v_scale = fp8_scaled(self._core.runtime(sm_scale, rope_theta, rope_scale, window_left, soft_cap),
                                      self._fp8, k_scale, v_scale, not self._dequant_k)
        positions = {}
        if self._positions is not None:
            self._positions.extras(positions, table.kv_indptr_host, batch, kv_page_pos, q_pos)
        else:
            refuse_positions(kv_page_pos, q_pos)
        self._impl.plan(table, num_qo_heads, num_kv_heads, runtime, float(v_scale), enable_split, split_policy,
                        positions, float(k_scale))
        rows = batch if not self.use_cuda_graph else self.max_batch_size
        self._core.set_planned(rows, num_qo_heads, num_kv_heads, table)

    def run(self, q: torch.Tensor, kv_cache, out: torch.Tensor | None = None, return_lse: bool = False, *,
            k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None, **variant):
        """Attend ``q [batch, num_qo_heads, head_dim]`` over the planned batch of ``kv_cache``.

        Returns ``out [batch, num_qo_heads, head_dim_vo]`` (q's dtype), and with ``return_lse`` also
        ``lse [batch, num_qo_heads]`` fp32 (natural log; -inf for an empty request).

        ``k_new [batch, num_kv_heads, head_dim]``, ``v_new [batch, num_kv_heads, head_dim_vo]`` (q's dtype and
        device, rows contiguous and 16-byte aligned; token and head strides free, so slices of a fused QKV
        projection work): the new token of each request, for a wrapper built with
        ``kernel_options={"append": True}`` (required there, refused otherwise). Example::

            out = wrapper.run(q, kv_cache, k_new=k, v_new=v)   # == append_kv(k, v, kv_cache, ...); run(q, kv_cache)

        ``**variant``: the tensors and scalars the spec's ``Variant`` declares, each by its name (all of them,
        nothing else; tensors of the declared dtype and rank on the wrapper's device: ``variant_args``). The hooks
        see ``batch`` = the request, ``qo_idx`` = the query's position (``kv_len - 1``, or ``q_pos``), ``kv_idx`` =
        each key's. Example: ``wrapper.run(q, kv_cache, sinks=sinks)`` for ``flashgen.variants.examples.SINK``.
        """
        core = self._core
        out, lse = core.outputs(q, out, return_lse)
        write_variant(self._impl.variant, self._impl.params_buffer, variant)
        kv = core.kv_args(kv_cache, kv_view, self._impl.kv_args)
        if self._append or k_new is not None or v_new is not None:
            new = check_new_rows(self._append, k_new, v_new, q, core.planned.num_kv_heads, self.spec)
            self._impl.launch_fused(q, kv, out, lse, new)
        else:
            self._impl.launch(q, kv, out, lse)
        return (out, lse) if return_lse else out


class DecodeBackend(SplitKVLaunch):
    """The decode kernel: plan (``plan_decode``, slots = SMs x CTAs an SM), upload, params by name, launch."""

    def __init__(self, core: WrapperCore, options: dict | None = None):
        self.core, self.spec, self.options = core, core.spec, options
        self._tmp_o = DeviceBuffer(torch.float32, core.device, core.fixed)
        self._tmp_lse = DeviceBuffer(torch.float32, core.device, core.fixed)
        self._kernel = None
        self._held = None  # a device page table, read in place
        self.variant = None  # the variant's run() keywords (variant_args), once the kernel is loaded
        self.params_buffer = None

    def _load(self) -> None:
        from ..jit import build

        self._kernel = build(self.spec, "decode", device=self.core.device.index, options=self.options)
        self._fn = self._kernel["decode"]
        self._launch = self._kernel.launch_config
        self._append = wants_append(self.options)
        self._params = self._kernel.params["decode"].bind(
            RUNTIME_FIELDS + (APPEND_RUNTIME_FIELDS if self._append else ()))
        self.variant = variant_args(self.spec, self._kernel.params["decode"], self.core.device)
        self.params_buffer = self._params.buffer

    def plan(self, table: PageTable, num_qo_heads: int, num_kv_heads: int, runtime: Runtime, v_scale: float,
             enable_split: bool, split_policy: SplitPolicy | None = None, positions: dict | None = None,
             k_scale: float = 1.0) -> None:
        core = self.core
        if self._kernel is None:
            self._load()
        cfg = self._launch
        slots = core.num_sms * cfg.ctas_per_sm
        options = {"max_batch_size": core.max_batch_size} if core.fixed else {}
        plan = core.staging.plan(lambda host: plan_decode(
            table.kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, tile_rows=cfg.tile_q,
            kv_granularity=cfg.tile_kv, num_sms=slots, enable_split=enable_split, split_policy=split_policy,
            host_buffer=host, **options))
        info = plan.info
        extras, pages_host = table_extras(table, core.max_batch_size)
        if positions:
            extras.update(positions)  # before the page ids, which may grow in a CUDA-graph buffer
        if pages_host is not None:
            extras["pages"] = pages_host
        addresses = core.upload(plan, extras, HOST_ARRAYS_HINT if pages_host is not None else "raise max_batch_size",
                                host_ids_reserve(core, table, pages_host))
        fields, self._held = page_fields(table, core.device, addresses)
        tmp_o = self._tmp_o.address_of(info.partial_capacity * num_qo_heads * self.spec.head_dim_vo, "tmp_o")
        tmp_lse = self._tmp_lse.address_of(info.partial_capacity * num_qo_heads, "tmp_lse")
        counters = core.counters(info.max_total_q * num_qo_heads, "raise max_batch_size")
        fields.update(split_kv_fields(addresses, tmp_o, tmp_lse, counters, num_qo_heads, num_kv_heads, runtime,
                                      self.spec))
        fields["v_scale"] = v_scale
        if dequantises_k(self.spec):  # a k_transform over fp8 K: the kernel dequantises K itself
            fields["k_scale"] = float(k_scale)
        if self._append:
            fields.update(append_fields(k_scale, v_scale))
        if positions:
            fields.update(kv_page_pos=addresses["kv_page_pos"], q_pos=addresses["q_pos"])
        if self.variant is not None:
            fields["variant"] = b""  # packed by run() (variant_args)
        self._params.pack(fields)
        # more than one wave: kv head fastest, for DRAM locality; one wave: item fastest (decode/kernel.cuh)
        items = info.capacity * num_kv_heads
        self._grid = (items, 1, 1) if items > slots else (info.capacity, num_kv_heads, 1)

    def launch_fused(self, q: torch.Tensor, kv: tuple, out: torch.Tensor, lse: torch.Tensor | None,
                     new: tuple) -> None:
        """``launch`` with the new rows' addresses and strides (``APPEND_RUNTIME_FIELDS``, ``check_new_rows``)."""
        if not self._grid[0]:
            return
        params = self._params
        params.set(q.data_ptr(), kv[0], kv[1], out.data_ptr(), 0 if lse is None else lse.data_ptr(), kv[2], kv[3],
                   kv[4], *new)
        self._fn.launch_params(self._grid, self._launch.block, self._launch.smem_bytes,
                               current_stream(self.core.device.index), params.address)
