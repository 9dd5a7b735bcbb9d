"""BatchDecodeWrapper: plan once per batch shape, run every layer (CUDA-graph safe)."""

from __future__ import annotations

import math

import numpy as np
import torch

from ..codegen import family
from ..codegen.decode import KV_BYTES, TILE_KV, decode_ctas_per_sm, decode_smem_bytes, decode_stages
from ..plan import PlanError, plan_decode
from ..spec import AttentionSpec, RoPE, SlidingWindow
from .checks import check_tensor
from .device import current_stream
from .kv_inputs import TORCH_DTYPES, kv_view, page_ids_pointer, page_table
from .staging import DeviceBuffer, HostStaging

_NULL = 0


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
    ``max_batch_size`` rows; page-table device tensors must keep their addresses).

    ``workspace`` is accepted for FlashInfer-style call sites and not used: the wrapper sizes its own
    buffers (fixed at the first plan in CUDA-graph mode).
    """

    def __init__(self, spec: AttentionSpec, workspace: torch.Tensor | None = None, use_cuda_graph: bool = False,
                 max_batch_size: int | None = None, device: torch.device | int | None = None,
                 num_sms: int | None = None):
        self.spec = family("decode").project(spec)
        family("decode").check(self.spec)
        if use_cuda_graph and not max_batch_size:
            raise ValueError("max_batch_size: required with use_cuda_graph=True (the graph's fixed capacity)")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.use_cuda_graph, self.max_batch_size = use_cuda_graph, max_batch_size
        self.num_sms = num_sms or torch.cuda.get_device_properties(self.device).multi_processor_count
        fixed = use_cuda_graph
        self._plan_buf = DeviceBuffer(torch.int32, self.device, fixed)
        self._staging = HostStaging(self.device)
        self._pages_buf = DeviceBuffer(torch.int32, self.device, fixed)
        self._tmp_o = DeviceBuffer(torch.float32, self.device, fixed)
        self._tmp_lse = DeviceBuffer(torch.float32, self.device, fixed)
        self._counters = None  # int32 [max_total_q * num_qo_heads], zero; the kernel leaves it zero
        self._kernel = None
        self._planned = None
        self._kv_memo: dict = {}
        self._dtype = TORCH_DTYPES[self.spec.dtype]
        self._kv_bytes = KV_BYTES[self.spec.kv_dtype]

    # ------------------------------------------------------------------------------------------ plan

    def plan(self, *, num_qo_heads: int, num_kv_heads: int, kv_indptr=None, kv_indices=None, kv_last_page_len=None,
             block_table=None, seq_lens=None, sm_scale: float | None = None, rope_theta: float | None = None,
             rope_scale: float | None = None, window_left: int | None = None, soft_cap: float | None = None,
             num_pages: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
             enable_split: bool = True) -> None:
        """Plan a batch. Lengths (``kv_indptr``, ``kv_last_page_len``, ``seq_lens``) are host arrays: planning
        never synchronises with the GPU. Page ids (``kv_indices`` or ``block_table``) may be device int32
        tensors, read in place by the kernel, or host arrays, then validated and copied to the device.

        Runtime values default to the spec's: ``sm_scale`` (1/sqrt(head_dim)), RoPE ``rope_theta`` and
        ``rope_scale``, the window's ``window_left``, ``soft_cap``. ``num_pages`` (the pool size) bounds host
        page ids here; without it they are checked against the cache at ``run()``. ``k_scale``/``v_scale``:
        per-tensor scales of fp8 K/V (the cache holds K/k_scale and V/v_scale).
        """
        if num_qo_heads % num_kv_heads:
            raise PlanError(f"num_qo_heads: {num_qo_heads} is not a multiple of num_kv_heads = {num_kv_heads}")
        table = page_table(self.spec, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=kv_last_page_len,
                           block_table=block_table, seq_lens=seq_lens, num_pages=num_pages)
        batch = table.kv_lens.size
        if self.use_cuda_graph and batch > self.max_batch_size:
            raise PlanError(f"kv_lens: batch_size {batch} exceeds max_batch_size = {self.max_batch_size}")
        options = {"max_batch_size": self.max_batch_size} if self.use_cuda_graph else {}
        slots = self.num_sms * decode_ctas_per_sm(self.spec.head_dim, self.spec.head_dim_vo, self._kv_bytes)
        plan = self._staging.plan(lambda host: plan_decode(
            table.kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, tile_rows=16,
            kv_granularity=TILE_KV, num_sms=slots, enable_split=enable_split, host_buffer=host, **options))
        info = plan.info
        extras = {} if table.kv_indptr_host is None else {"kv_indptr": self._indptr_extra(table.kv_indptr_host)}
        views = self._staging.upload(plan, extras, self._plan_buf)  # one host-to-device copy
        indptr_ptr = views["kv_indptr"].data_ptr() if extras else _NULL
        pages_ptr, bt_stride, self._page_ids_held = page_ids_pointer(table, self.device, self._upload_pages)
        tmp_o = self._tmp_o.get(info.partial_capacity * num_qo_heads * self.spec.head_dim_vo, "tmp_o")
        tmp_lse = self._tmp_lse.get(info.partial_capacity * num_qo_heads, "tmp_lse")
        counters = self._counter_buffer(info.max_total_q * num_qo_heads)
        if self._kernel is None:
            self._load_kernel()
        rows = batch if not self.use_cuda_graph else self.max_batch_size
        tables = (indptr_ptr, pages_ptr if table.block_table is None else 0,
                  pages_ptr if table.block_table is not None else 0)
        plan_ptrs = tuple(views[n].data_ptr() for n in ("qo_indptr", "kv_len", "request_idx", "qo_tile_idx",
                                                         "chunk_idx", "kv_start", "kv_end", "merge_indptr",
                                                         "num_chunks"))
        self._planned = {
            "info": info, "num_kv_heads": num_kv_heads, "max_page": table.max_page,
            "page_ids": "kv_indices" if table.block_table is None else "block_table",
            "q_shape": torch.Size((rows, num_qo_heads, self.spec.head_dim)),
            "out_shape": torch.Size((rows, num_qo_heads, self.spec.head_dim_vo)),
            # more than one wave: kv head fastest, for DRAM locality; one wave: item fastest (decode.cuh)
            "grid": ((info.capacity * num_kv_heads, 1, 1) if info.capacity * num_kv_heads > slots
                     else (info.capacity, num_kv_heads, 1)),
            # the params struct between (q, k, v, o, lse) and the KV strides, then the scalars after them
            "args": (tmp_o.data_ptr(), tmp_lse.data_ptr(), *tables, *plan_ptrs, counters.data_ptr()),
            "scalars": (bt_stride, num_qo_heads, num_qo_heads // num_kv_heads) + self._runtime(
                sm_scale, rope_theta, rope_scale, window_left, soft_cap, k_scale) + (float(v_scale),),
        }
        self._kv_memo = {}

    def _counter_buffer(self, numel: int) -> torch.Tensor:
        if self._counters is None or self._counters.numel() < numel:
            if self._counters is not None and self.use_cuda_graph:
                raise PlanError(f"counters: needs {numel}, more than sized by the first plan (raise max_batch_size)")
            self._counters = torch.zeros(max(numel, 1), dtype=torch.int32, device=self.device)
        return self._counters

    def _indptr_extra(self, indptr: np.ndarray) -> np.ndarray:
        """kv_indptr for the device; in CUDA-graph mode padded to a fixed length (max_batch_size + 1)."""
        if not self.use_cuda_graph:
            return indptr
        return np.concatenate([indptr, np.full(self.max_batch_size + 1 - indptr.size, indptr[-1], indptr.dtype)])

    def _upload_pages(self, host: torch.Tensor) -> int:
        buf = self._pages_buf.get(host.numel(), "page ids", "make the first plan the one with the most page ids")
        buf[: host.numel()].copy_(host.pin_memory(), non_blocking=True)
        return buf.data_ptr()

    def _runtime(self, sm_scale, rope_theta, rope_scale, window_left, soft_cap, k_scale) -> tuple:
        spec = self.spec
        rope = spec.pos_encoding if isinstance(spec.pos_encoding, RoPE) else RoPE()
        theta = rope.theta if rope_theta is None else rope_theta
        scale = rope.scale if rope_scale is None else rope_scale
        window = spec.mask.left if isinstance(spec.mask, SlidingWindow) and window_left is None else (window_left or 0)
        cap = spec.soft_cap if soft_cap is None else soft_cap
        if spec.soft_cap is None and soft_cap is not None:
            raise PlanError("soft_cap: this spec has no soft-cap (set AttentionSpec.soft_cap to enable it)")
        if self._kv_bytes == 2 and k_scale != 1.0:
            raise PlanError("k_scale: per-tensor scales apply to fp8 K/V only")
        # q.(k * k_scale) = (q.k) * k_scale: the K scale folds into sm_scale, before any logits transform
        scale_qk = float(spec.default_sm_scale if sm_scale is None else sm_scale) * float(k_scale)
        return (int(window), scale_qk, float(cap or 0.0), 1.0 / float(scale), math.log2(float(theta)))

    def _load_kernel(self) -> None:
        from ..jit import build

        kernel = build(self.spec, "decode", device=self.device.index)
        self._decode = kernel["decode"]
        stages = decode_stages(self.spec.head_dim, self.spec.head_dim_vo, self._kv_bytes)
        self._smem = decode_smem_bytes(self.spec.head_dim, self.spec.head_dim_vo, stages, self._kv_bytes)
        self._decode.set_max_dynamic_shared_memory(self._smem)
        self._kernel = kernel

    # ------------------------------------------------------------------------------------------ run

    def run(self, q: torch.Tensor, kv_cache, out: torch.Tensor | None = None, return_lse: bool = False):
        """Attend ``q [batch, num_qo_heads, head_dim]`` over the planned batch of ``kv_cache``.

        Returns ``out [batch, num_qo_heads, head_dim_vo]`` (q's dtype), and with ``return_lse`` also
        ``lse [batch, num_qo_heads]`` fp32 (natural log; -inf for an empty request).
        """
        planned = self._planned
        if planned is None:
            raise RuntimeError("run: call plan() first")
        if q.shape != planned["q_shape"] or q.dtype != self._dtype or not q.is_contiguous() or not q.is_cuda:
            self._bad_q(q)
        kv_args = self._kv_args(kv_cache)
        if out is None:
            out = torch.empty(planned["out_shape"], dtype=q.dtype, device=q.device)
        elif out.shape != planned["out_shape"] or out.dtype != q.dtype or not out.is_contiguous():
            check_tensor("out", out, dtypes=(q.dtype,), ndim=3, device=self.device)
            raise ValueError(f"out: expected shape {planned['out_shape']}, got {tuple(out.shape)}")
        lse = torch.empty(planned["out_shape"][:2], dtype=torch.float32, device=q.device) if return_lse else None
        self._decode.launch(planned["grid"], (128, 1, 1), self._smem, current_stream(self.device.index),
                            q.data_ptr(), kv_args[0], kv_args[1], out.data_ptr(), 0 if lse is None else lse.data_ptr(),
                            *planned["args"], kv_args[2], kv_args[3], kv_args[4], *planned["scalars"])
        return (out, lse) if return_lse else out

    def _bad_q(self, q) -> None:
        check_tensor("q", q, dtypes=(self._dtype,), ndim=3, device=self.device)
        raise ValueError(f"q: expected shape {self._planned['q_shape']}, got {tuple(q.shape)}")

    def _kv_args(self, kv_cache) -> tuple:
        """(k ptr, v ptr, stride_page, stride_token, stride_head) of a cache; a cache seen before (the same
        tensor objects: one per layer in an inference loop) costs a dict lookup, not a re-check."""
        key = (id(kv_cache[0]), id(kv_cache[1])) if isinstance(kv_cache, (tuple, list)) else id(kv_cache)
        hit = self._kv_memo.get(key)
        if hit is not None and _same_cache(hit[0], kv_cache):
            return hit[1]
        planned = self._planned
        kv = kv_view(self.spec, kv_cache, planned["num_kv_heads"])
        if planned["max_page"] >= kv.num_pages:
            raise ValueError(f"{planned['page_ids']}: page id {planned['max_page']} is outside kv_cache's {kv.num_pages} pages")
        args = (kv.k.data_ptr(), kv.v.data_ptr(), kv.stride_page, kv.stride_token, kv.stride_head)
        if len(self._kv_memo) >= 256:  # the memo holds the caches it has seen: bounded, and cleared by plan()
            self._kv_memo.clear()
        held = tuple(kv_cache) if isinstance(kv_cache, (tuple, list)) else kv_cache
        self._kv_memo[key] = (held, args)
        return args


def _same_cache(held, kv_cache) -> bool:
    if isinstance(held, tuple):
        return isinstance(kv_cache, (tuple, list)) and held[0] is kv_cache[0] and held[1] is kv_cache[1]
    return held is kv_cache
