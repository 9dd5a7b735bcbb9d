"""BatchPrefillWrapper (plan once per batch shape, run every layer; CUDA-graph safe) and one-shot attention().

Two backends run a plan. ``portable`` is the mma.sync kernel (family ``prefill``): every spec the family
accepts, split-KV plans, any GPU flashgen targets. ``sm90`` is the Hopper kernel (family ``prefill_sm90``,
runner in ``flashgen.api.sm90``): wgmma + TMA, sm_90a only, the specs ``check_sm90_backend`` accepts
(so far ragged KV or pages of a multiple of 8 tokens, NoMask / Causal / SlidingWindow / CustomMask, ALiBi,
soft-cap, RoPE through a pre-pass outside CUDA graphs, fp16 / bf16, head_dim == head_dim_vo in 64 / 128 / 256),
unsplit plans. The
wrapper owns what both share (argument checks, page-table intake, runtime values, q / out / lse, the memo of
validated KV caches); a backend owns its plan buffers and its launch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from ..codegen import family
from ..codegen.prefill_sm90 import check_sm90_backend  # (importing it registers prefill_sm90 and rope_gather)
from ..codegen.prefill import (
    prefill_ctas_per_sm, prefill_smem_bytes, prefill_stages, prefill_tile_q, prefill_tiles,
)
from ..plan import PlanError, host_array, plan_prefill
from ..plan.mask_tiles import split_plan_mask_tiles
from ..spec import AttentionSpec, Causal, CustomMask, NoMask, Ragged, RoPE, SlidingWindow, SpecError
from .checks import check_tensor
from .custom_mask import custom_mask_bits
from .device import current_stream
from .kv_inputs import TORCH_DTYPES, KVView, PageTable, kv_view, page_ids_pointer, page_table
from .staging import DeviceBuffer

_NULL = 0
# what sizes the host-copied buffers of a CUDA-graph wrapper beyond max_batch_size: the first plan's page ids and
# mask (its bits and tile lists grow with the KV lengths, which the wrapper has no bound for)
_FIRST_PLAN = "make the first plan the one with the longest KV"
_GRAPH_HINTS = {"pages": "make the first plan the one with the most page ids", "mask": _FIRST_PLAN,
                "tiles": _FIRST_PLAN}
BACKENDS = ("auto", "portable", "sm90")
SM90_CAPABILITY = (9, 0)  # the sm90 kernel is built for sm_90a (H100, H200, H20)


def _select_backend(spec: AttentionSpec, backend: str, capability, graph: bool = False) -> str:
    """The backend that runs ``spec``: ``"portable"`` or ``"sm90"``. ``capability``: the device's compute
    capability ``(major, minor)``, or a function returning it (called only when the answer depends on it).

    ``"auto"`` picks sm90 on a compute-capability 9.0 device when ``check_sm90_backend`` accepts the spec
    (``graph``: in CUDA-graph mode), else portable. ``"sm90"`` on a spec it cannot run raises ``SpecError``, on another device
    ``ValueError``; both messages name ``backend`` and say why.

    >>> _select_backend(AttentionSpec(128, kv_layout=Ragged(), mask=Causal()), "auto", (9, 0))
    'sm90'
    >>> _select_backend(AttentionSpec(128, kv_layout=Ragged(), mask=Causal()), "auto", (8, 0))
    'portable'
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: got {backend!r}, expected one of {', '.join(map(repr, BACKENDS))}")
    if backend == "portable":
        return backend
    try:
        check_sm90_backend(spec, graph)
    except SpecError as exc:
        if backend == "auto":
            return "portable"
        raise SpecError(f"backend: 'sm90' cannot run this spec ({exc})") from exc
    major, minor = capability() if callable(capability) else capability
    if (major, minor) != SM90_CAPABILITY:
        if backend == "auto":
            return "portable"
        raise ValueError(f"backend: 'sm90' needs a GPU of compute capability 9.0 (sm_90a: H100, H200), this one "
                         f"has {major}.{minor}")
    return "sm90"


def _resolve_device(device: torch.device | int | None) -> torch.device:
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if device.index is None else device


class Runtime(NamedTuple):
    """Runtime values of a plan, in the order of the kernels' params structs."""

    window_left: int
    sm_scale: float
    soft_cap: float
    rope_rcp_scale: float
    rope_log2_theta: float


def _runtime(spec: AttentionSpec, sm_scale, rope_theta, rope_scale, window_left, soft_cap) -> Runtime:
    rope = spec.pos_encoding if isinstance(spec.pos_encoding, RoPE) else RoPE()
    theta = rope.theta if rope_theta is None else rope_theta
    scale = rope.scale if rope_scale is None else rope_scale
    window = spec.mask.left if isinstance(spec.mask, SlidingWindow) and window_left is None else (window_left or 0)
    if spec.soft_cap is None and soft_cap is not None:
        raise PlanError("soft_cap: this spec has no soft-cap (set AttentionSpec.soft_cap to enable it)")
    cap = spec.soft_cap if soft_cap is None else soft_cap
    if spec.soft_cap is not None and not float(cap) > 0.0:
        raise PlanError(f"soft_cap: got {cap}, expected a positive value (the logits are capped at +-soft_cap)")
    return Runtime(int(window), float(spec.default_sm_scale if sm_scale is None else sm_scale), float(cap or 0.0),
                   1.0 / float(scale), math.log2(float(theta)))


class _Planned(NamedTuple):
    """What run() checks against the current plan."""

    q_shape: torch.Size
    out_shape: torch.Size
    num_kv_heads: int
    kv_need: int  # tokens (ragged) or pages (paged, host page ids) the cache must hold
    kv_short: str  # the error when it holds fewer (formatted with the number it holds)


def _kv_need(spec: AttentionSpec, table: PageTable) -> tuple[int, str]:
    if isinstance(spec.kv_layout, Ragged):
        total = int(table.kv_indptr_host[-1])
        return total, f"kv_cache: {{}} tokens, fewer than kv_indptr[-1] = {total}"
    name = "block_table" if table.block_table is not None else "kv_indices"
    return table.max_page + 1, f"{name}: page id {table.max_page} is outside kv_cache's {{}} pages"


def _kv_key(kv_cache, num_kv_heads: int) -> tuple | None:
    """Memo key of a cache: what its validation and kernel arguments depend on (addresses, shapes, strides,
    dtypes); None for anything that is not one tensor or a pair of tensors (validated every time)."""
    if isinstance(kv_cache, torch.Tensor):
        return (num_kv_heads, kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
    if isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2:
        k, v = kv_cache
        if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
            return (num_kv_heads, k.data_ptr(), v.data_ptr(), k.shape, v.shape, k.stride(), v.stride(), k.dtype,
                    v.dtype)
    return None


class BatchPrefillWrapper:
    """Batch prefill / append (several query tokens per request) over a ragged or paged KV cache.

    Example::

        wrapper = flashgen.BatchPrefillWrapper(AttentionSpec(128, kv_layout=Ragged(), mask=Causal()))
        wrapper.plan(qo_indptr=[0, 100, 612], kv_indptr=[0, 100, 612], num_qo_heads=32, num_kv_heads=8)
        out = wrapper.run(q, (k, v))   # q [612, 32, 128], k/v [612, 8, 128] -> out [612, 32, 128]
        wrapper.backend                # "sm90" on an H100 / H200, else "portable"

    Queries of request b are its last ``qo_len`` tokens: a causal mask is aligned to the end of its KV.
    ``use_cuda_graph=True`` with ``max_batch_size`` and ``max_total_q``: every buffer and the grid are
    sized for those maxima, so a graph captured around ``run()`` replays correctly after ``plan()`` of any
    batch up to them (q and out then have ``max_total_q`` rows; device page tables and the KV cache must keep
    their addresses). ``workspace`` is accepted for FlashInfer-style call sites; the wrapper owns its buffers.

    ``backend``: ``"auto"`` (default) runs the Hopper kernel (``"sm90"``) on a compute-capability 9.0 GPU
    when it supports the spec (``check_sm90_backend``; so far ragged KV or pages of a multiple of 8 tokens,
    NoMask / Causal / SlidingWindow / CustomMask, fp16 / bf16, head_dim == head_dim_vo in 64 / 128 / 256, RoPE
    outside CUDA graphs), else the ``"portable"`` kernel; naming one forces it (an ``"sm90"`` it cannot honour raises).
    ``wrapper.backend`` says which runs.
    """

    def __init__(self, spec: AttentionSpec, workspace: torch.Tensor | None = None, use_cuda_graph: bool = False,
                 max_batch_size: int | None = None, max_total_q: int | None = None,
                 device: torch.device | int | None = None, num_sms: int | None = None, backend: str = "auto"):
        self.spec = family("prefill").project(spec)
        self.backend = _select_backend(self.spec, backend,
                                       lambda: torch.cuda.get_device_capability(_resolve_device(device)),
                                       graph=use_cuda_graph)
        if self.backend == "portable":
            family("prefill").check(self.spec)
        if use_cuda_graph and not (max_batch_size and max_total_q):
            raise ValueError("max_batch_size: max_batch_size and max_total_q are required with use_cuda_graph=True "
                             "(the graph's fixed capacity)")
        self.device = _resolve_device(device)
        self.use_cuda_graph, self.max_batch_size, self.max_total_q = use_cuda_graph, max_batch_size, max_total_q
        self.num_sms = num_sms or torch.cuda.get_device_properties(self.device).multi_processor_count
        if self.backend == "sm90":
            from .sm90 import SM90Prefill as backend_class
        else:
            backend_class = _PortablePrefill
        graph = (max_batch_size, max_total_q) if use_cuda_graph else None
        self._impl = backend_class(self.spec, self.device, self.num_sms, graph)
        self._dtype = TORCH_DTYPES[self.spec.dtype]
        self._planned: _Planned | None = None
        self._kv_memo: dict[tuple, tuple] = {}

    # ------------------------------------------------------------------------------------------ plan

    def plan(self, *, qo_indptr, num_qo_heads: int, num_kv_heads: int, kv_indptr=None, kv_indices=None,
             kv_last_page_len=None, block_table=None, seq_lens=None, custom_mask=None, sm_scale: float | None = None,
             rope_theta: float | None = None, rope_scale: float | None = None, window_left: int | None = None,
             soft_cap: float | None = None, num_pages: int | None = None, enable_split: bool = True) -> None:
        """Plan a batch. ``qo_indptr [batch + 1]`` and the lengths (``kv_indptr``, ``kv_last_page_len``,
        ``seq_lens``) are host arrays: planning never synchronises with the GPU. Page ids (``kv_indices`` or
        ``block_table``) may be device int32 tensors (read in place) or host arrays (validated, copied).

        ``custom_mask`` (CustomMask specs): packed bits, uint8 ``[ceil(sum(qo_len * kv_len) / 8)]`` (each
        request's ``[qo_len, kv_len]`` mask row-major, requests concatenated, little-endian bits; host or
        device), or a list of bool ``[qo_len, kv_len]`` tensors. Runtime values default to the spec's.
        ``enable_split`` lets the portable backend split long KV ranges to fill the GPU; the sm90 backend
        ignores it (v1 plans every request unsplit: one work item per 128-row q tile, its whole KV).
        """
        if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
            raise PlanError(f"num_qo_heads: {num_qo_heads} is not a multiple of num_kv_heads = {num_kv_heads}")
        spec = self.spec
        table = page_table(spec, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=kv_last_page_len,
                           block_table=block_table, seq_lens=seq_lens, num_pages=num_pages)
        qo = host_array("qo_indptr", qo_indptr)
        if qo.size != table.kv_lens.size + 1:
            raise PlanError(f"qo_indptr: has {qo.size} entries, expected batch_size + 1 = {table.kv_lens.size + 1}")
        if custom_mask is not None and not isinstance(spec.mask, CustomMask):
            raise PlanError("custom_mask: this spec's mask is not CustomMask()")
        runtime = _runtime(spec, sm_scale, rope_theta, rope_scale, window_left, soft_cap)
        rows = self._impl.plan(qo, table, num_qo_heads, num_kv_heads, runtime, custom_mask, enable_split)
        self._planned = _Planned(torch.Size((rows, num_qo_heads, spec.head_dim)),
                                 torch.Size((rows, num_qo_heads, spec.head_dim_vo)), num_kv_heads,
                                 *_kv_need(spec, table))

    # ------------------------------------------------------------------------------------------ run

    def run(self, q: torch.Tensor, kv_cache, out: torch.Tensor | None = None, return_lse: bool = False):
        """Attend ``q [total_q, num_qo_heads, head_dim]`` over the planned batch of ``kv_cache``.

        ``kv_cache``: the paged cache (one ``[pages, 2, ...]`` tensor or a ``(k, v)`` pair) or, for a Ragged
        spec, ``(k [total_kv, num_kv_heads, head_dim], v [total_kv, num_kv_heads, head_dim_vo])``. Returns
        ``out [total_q, num_qo_heads, head_dim_vo]`` (q's dtype), with ``return_lse`` also ``lse [total_q,
        num_qo_heads]`` fp32 (natural log; -inf for a row that sees no key). With ``use_cuda_graph`` ``total_q``
        is ``max_total_q``. A cache seen before (same addresses, shapes, strides) is not checked again.
        """
        planned = self._planned
        if planned is None:
            raise RuntimeError("run: call plan() first")
        if (q.shape != planned.q_shape or q.dtype != self._dtype or not q.is_contiguous() or q.device != self.device
                or q.data_ptr() % 16):  # rows are loaded 16 bytes at a time (sm90: a TMA map's address)
            self._bad_tensor("q", q, planned.q_shape, self._dtype)
        kv = self._kv_args(kv_cache, planned)
        if out is None:
            out = torch.empty(planned.out_shape, dtype=q.dtype, device=q.device)
        elif (out.shape != planned.out_shape or out.dtype != q.dtype or not out.is_contiguous()
              or out.device != q.device or out.data_ptr() % 16):  # rows are stored 16 bytes at a time
            self._bad_tensor("out", out, planned.out_shape, q.dtype)
        lse = torch.empty(planned.out_shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
        self._impl.launch(q, kv, out, lse)
        return (out, lse) if return_lse else out

    def _bad_tensor(self, name: str, t, shape: torch.Size, dtype: torch.dtype) -> None:
        check_tensor(name, t, dtypes=(dtype,), ndim=3, device=self.device, align=16)
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")

    def _kv_args(self, kv_cache, planned: _Planned) -> tuple:
        """The backend's kernel arguments for a cache, validated on first sight and then memoised."""
        key = _kv_key(kv_cache, planned.num_kv_heads)
        hit = self._kv_memo.get(key)
        if hit is None:
            kv = _kv_view(self.spec, kv_cache, planned.num_kv_heads)
            if kv.k.device != self.device:
                raise ValueError(f"kv_cache: expected tensors on {self.device}, got them on {kv.k.device}")
            hit = (kv.num_pages, self._impl.kv_args(kv))
            if key is not None:
                if len(self._kv_memo) >= 256:  # bounded: entries hold no tensors, only what their keys imply
                    self._kv_memo.clear()
                self._kv_memo[key] = hit
        if hit[0] < planned.kv_need:
            raise ValueError(planned.kv_short.format(hit[0]))
        return hit[1]


class _PortablePrefill:
    """The mma.sync prefill kernel (family ``prefill``): plan buffers and launch. ``graph``: ``(max_batch_size,
    max_total_q)`` of a CUDA-graph wrapper (buffers fixed at the first plan), or None."""

    def __init__(self, spec: AttentionSpec, device: torch.device, num_sms: int, graph: tuple[int, int] | None):
        self.spec, self.device, self.num_sms, self.fixed = spec, device, num_sms, graph is not None
        self.max_batch_size, self.max_total_q = graph or (None, None)
        self._bufs = {name: DeviceBuffer(dtype, device, self.fixed) for name, dtype in (
            ("plan", torch.int32), ("kv_indptr", torch.int32), ("pages", torch.int32), ("tmp_o", torch.float32),
            ("tmp_lse", torch.float32), ("mask", torch.uint8), ("mask_offset", torch.int64),
            ("tile_indptr", torch.int32), ("tiles", torch.int32))}
        self._counters = None  # int32 [max_total_q * num_qo_heads], zero; the kernel leaves it zero
        self._kernel = None

    def plan(self, qo: np.ndarray, table: PageTable, num_qo_heads: int, num_kv_heads: int, runtime: Runtime,
             custom_mask, enable_split: bool) -> int:
        """Plan and upload; returns the rows of q and out (total_q, or max_total_q in CUDA-graph mode)."""
        d, dv = self.spec.head_dim, self.spec.head_dim_vo
        options = {"max_batch_size": self.max_batch_size, "max_total_q": self.max_total_q} if self.fixed else {}
        plan = plan_prefill(qo, table.kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                            tile_rows=prefill_tile_q(d, dv), kv_granularity=prefill_tiles(d, dv)[2],
                            num_sms=self.num_sms * prefill_ctas_per_sm(d, dv), enable_split=enable_split,
                            balance_tail=enable_split and isinstance(self.spec.mask, NoMask), **options)
        info = plan.info
        views = plan.to_device(self._bufs["plan"].get(plan.numel, "plan"))
        tmp_o = self._bufs["tmp_o"].get(info.partial_capacity * num_qo_heads * dv, "tmp_o")
        tmp_lse = self._bufs["tmp_lse"].get(info.partial_capacity * num_qo_heads, "tmp_lse")
        if self._kernel is None:
            self._load_kernel()
        pages_ptr, bt_stride, self._page_ids_held = page_ids_pointer(
            table, self.device, lambda host: self._copy("pages", host.numpy(), 0))
        tables = (self._copy("kv_indptr", table.kv_indptr_host, (self.max_batch_size or 0) + 1),
                  pages_ptr if table.block_table is None else 0, pages_ptr if table.block_table is not None else 0)
        plan_ptrs = tuple(views[n].data_ptr() for n in ("qo_indptr", "kv_len", "request_idx", "qo_tile_idx",
                                                        "chunk_idx", "kv_start", "kv_end", "merge_indptr",
                                                        "num_chunks"))
        counters = self._counter_buffer(info.max_total_q * num_qo_heads).data_ptr()
        self._grid = (info.capacity * num_kv_heads, 1, 1)  # block x: item capacity - 1 - x / H, kv head x % H
        # the params struct between (q, k, v, o, lse) and the KV strides, then the scalars after them
        self._args = (tmp_o.data_ptr(), tmp_lse.data_ptr(), *tables, *plan_ptrs, counters,
                      *self._custom_mask(plan, custom_mask, qo, table.kv_lens))
        self._scalars = (bt_stride, num_qo_heads, num_qo_heads // num_kv_heads, *runtime)
        self._keep = (plan, table)  # the host buffers stay alive until the copies have run
        return info.max_total_q

    def kv_args(self, kv: KVView) -> tuple:
        return (kv.k.data_ptr(), kv.v.data_ptr(), kv.stride_page, kv.stride_token, kv.stride_head)

    def launch(self, q: torch.Tensor, kv: tuple, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        self._prefill.launch(self._grid, self._block, self._smem, current_stream(self.device.index), q.data_ptr(),
                             kv[0], kv[1], out.data_ptr(), lse.data_ptr() if lse is not None else 0, *self._args,
                             kv[2], kv[3], kv[4], *self._scalars)

    def _counter_buffer(self, numel: int) -> torch.Tensor:
        if self._counters is None or self._counters.numel() < numel:
            if self._counters is not None and self.fixed:
                raise PlanError(f"counters: needs {numel}, more than sized by the first plan (raise max_total_q)")
            self._counters = torch.zeros(max(numel, 1), dtype=torch.int32, device=self.device)
        return self._counters

    def _copy(self, name: str, host: np.ndarray | None, capacity: int) -> int:
        """Copy a host array into the named device buffer (async, from pinned memory); its address."""
        if host is None:
            return _NULL
        src = torch.from_numpy(np.ascontiguousarray(host))
        buf = self._bufs[name].get(max(src.numel(), capacity if self.fixed else 0), name,
                                   _GRAPH_HINTS.get(name, "raise max_batch_size"))
        buf[: src.numel()].copy_(src.to(buf.dtype).pin_memory(), non_blocking=True)
        self._keep_host = getattr(self, "_keep_host", {})
        self._keep_host[name] = src
        return buf.data_ptr()

    def _custom_mask(self, plan, custom_mask, qo: np.ndarray, kv_lens: np.ndarray) -> tuple[int, int, int, int]:
        """The kernel's (custom_mask, mask_offset, tile_indptr, tiles). Each item's tile list (its chunk's
        tiles that some row sees, ``split_plan_mask_tiles``) lies in buffers of their own, which never move in
        CUDA-graph mode; ``tiles`` is sized there by the first plan's tiles without a mask, so any mask over
        the same lengths fits. A device mask is read in place, its tiles all partial (no sync)."""
        if not isinstance(self.spec.mask, CustomMask):
            return _NULL, _NULL, _NULL, _NULL  # (a mask given to another spec was refused by the wrapper)
        bits = custom_mask_bits(custom_mask, qo, kv_lens)
        if bits.device is not None:
            self._keep_mask, mask_ptr = bits.device, bits.device.data_ptr()
        else:
            mask_ptr = self._copy("mask", bits.host, 0)
        tile_kv = prefill_tiles(self.spec.head_dim, self.spec.head_dim_vo)[2]
        indptr, entries = split_plan_mask_tiles(plan, bits.host, bits.offsets, kv_lens, tile_kv=tile_kv)
        n = plan.info.num_items
        start, end = plan.numpy("kv_start")[:n].astype(np.int64), plan.numpy("kv_end")[:n].astype(np.int64)
        dense = int(np.maximum(-(-end // tile_kv) - start // tile_kv, 0).sum())  # the most any mask lists
        return (mask_ptr, self._copy("mask_offset", bits.offsets, self.max_batch_size or 0),
                self._copy("tile_indptr", indptr, 0), self._copy("tiles", entries, dense))

    def _load_kernel(self) -> None:
        from ..jit import build

        kernel = build(self.spec, "prefill", device=self.device.index)
        self._prefill = kernel["prefill"]
        d, dv = self.spec.head_dim, self.spec.head_dim_vo
        self._smem = prefill_smem_bytes(d, dv, prefill_stages(d, dv))
        self._block = (prefill_tiles(d, dv)[0] * 32, 1, 1)
        self._prefill.set_max_dynamic_shared_memory(self._smem)
        self._kernel = kernel


def _kv_view(spec: AttentionSpec, kv_cache, num_kv_heads: int):
    """kv_view, also for head_dim_vo != head_dim: K and V are then checked one by one, and V's strides must be
    K's scaled by head_dim_vo / head_dim (both tensors dense in their head dim), as the kernel addresses V."""
    if spec.head_dim == spec.head_dim_vo:
        return kv_view(spec, kv_cache, num_kv_heads)
    if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
        raise ValueError("kv_cache: expected a (k, v) pair when head_dim_vo != head_dim")
    k, v = kv_cache
    kview = kv_view(spec.replace(head_dim_vo=spec.head_dim), (k, k), num_kv_heads)
    kv_view(spec.replace(head_dim=spec.head_dim_vo), (v, v), num_kv_heads)
    d, dv = spec.head_dim, spec.head_dim_vo
    if any(sk % d or sk // d * dv != sv for sk, sv in zip(k.stride()[:-1], v.stride()[:-1])):
        raise ValueError(f"kv_cache (v): strides {v.stride()} are not k's {k.stride()} scaled by {dv}/{d} "
                         "(k and v must be dense in the head dim)")
    return type(kview)(k, v, kview.stride_page, kview.stride_token, kview.stride_head, kview.num_pages)


_WRAPPERS: dict[tuple, BatchPrefillWrapper] = {}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec | None = None, *,
              causal: bool = False, sm_scale: float | None = None, window_left: int | None = None,
              soft_cap: float | None = None, rope_theta: float | None = None, rope_scale: float | None = None,
              custom_mask=None, return_lse: bool = False):
    """One request: ``q [sq, num_qo_heads, head_dim]`` over ``k [sk, num_kv_heads, head_dim]``, ``v [sk,
    num_kv_heads, head_dim_vo]`` (same dtype, CUDA). The queries are the last ``sq`` positions (causal is
    aligned to the end of the KV). ``spec`` defaults to a Ragged spec from the shapes and ``causal``.

    >>> out = flashgen.attention(q, k, v, causal=True)   # [sq, Hq, Dv], q's dtype
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=3, dtypes=(torch.float16, torch.bfloat16), contiguous=False)
    if spec is None:
        spec = AttentionSpec(q.shape[-1], head_dim_vo=v.shape[-1], dtype=str(q.dtype), kv_layout=Ragged(),
                             mask=Causal() if causal else NoMask())
    elif not isinstance(spec.kv_layout, Ragged):
        raise ValueError(f"spec: attention() takes a Ragged() kv_layout, got {spec.kv_layout!r}")
    key = (spec, q.device.index)
    wrapper = _WRAPPERS.get(key)
    if wrapper is None:
        wrapper = _WRAPPERS[key] = BatchPrefillWrapper(spec, device=q.device)
    sq, sk = q.shape[0], k.shape[0]
    wrapper.plan(qo_indptr=[0, sq], kv_indptr=[0, sk], num_qo_heads=q.shape[1], num_kv_heads=k.shape[1],
                 custom_mask=custom_mask, sm_scale=sm_scale, window_left=window_left, soft_cap=soft_cap,
                 rope_theta=rope_theta, rope_scale=rope_scale)
    return wrapper.run(q.contiguous(), (k, v), return_lse=return_lse)
