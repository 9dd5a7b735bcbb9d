"""BatchPrefillWrapper (plan once per batch shape, run every layer; CUDA-graph safe) and one-shot attention().

The wrapper is the core (``wrapper.WrapperCore``: argument checks, page-table intake, runtime values, q / out /
lse, the memo of validated KV caches, plan uploads) over one of two backends, chosen in ``backends.select``:
``portable`` (``portable.PortablePrefill``, the mma.sync kernel) or ``sm90`` (``sm90.SM90Prefill``, the Hopper
kernel: wgmma + TMA, sm_90a only, unsplit plans).
"""

from __future__ import annotations

import torch

from ..kernels import dequantises_k, family
from ..plan import PlanError, SplitPolicy, host_array
from ..plan.host import check_heads
from ..spec import AttentionSpec, Causal, CustomMask, NoMask, Ragged
from . import handles
from .backends import select
from .checks import check_count, check_tensor
from .kv_inputs import kv_view, page_table
from .page_ids import page_ids_for
from .portable import PortablePrefill
from .positions import Positions, refuse_positions, wants_positions
from .sm90 import SM90Prefill
from .variant_args import write_variant
from .wrapper import WrapperCore, fp8_scaled, graph_capacity, resolve_device


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
    batch up to them (q and out then have ``max_total_q`` rows; the KV cache must keep its addresses). Device
    page ids are copied at each plan into a buffer the wrapper owns, so each plan may pass a fresh tensor:
    ``max_num_pages`` (the most page ids one plan uses, ``kv_indptr[-1]``) or, for a block table,
    ``max_pages_per_request`` (the columns kept of each row) size it, by default the first plan's (see
    ``BatchDecodeWrapper``; CUDA-graph mode only). A device custom mask is copied the same way, into a buffer
    sized by the first plan's mask (plan the batch with the most mask bits first). ``check_indices``: plan()
    checks device page ids on the GPU, a debugging aid that synchronises (as ``BatchDecodeWrapper``'s).
    ``workspace`` is accepted for FlashInfer-style call sites; the wrapper owns its buffers.

    ``backend``: ``"auto"`` (default) runs the Hopper kernel (``"sm90"``) on a compute-capability 9.0 GPU
    when it supports the spec (``backends.check_sm90``; so far ragged KV or paged, NoMask / Causal /
    SlidingWindow / CustomMask, fp16 / bf16 or fp8 K/V, head_dim == head_dim_vo in 64 / 128 / 256, RoPE over
    a cache of rotated K (``k_rotated=True``) anywhere, over unrotated K outside CUDA graphs), else the
    ``"portable"`` kernel; naming one forces it (an ``"sm90"`` it cannot honour raises).
    ``wrapper.backend`` says which runs. ``kernel_options``: the portable kernel's options, e.g.
    ``{"tiles": "kv32"}`` (its tile preset; part of the kernel's uri), or ``{"positions": True}``: keys and
    queries at explicit true positions (either backend; every plan() then takes ``kv_page_pos`` and ``q_pos``,
    ``flashgen.api.positions``, with a CSR page table; causal / window masks, RoPE and ALiBi use them).
    """

    def __init__(self, spec: AttentionSpec, workspace: torch.Tensor | None = None, use_cuda_graph: bool = False,
                 max_batch_size: int | None = None, max_total_q: int | None = None,
                 device: torch.device | int | None = None, num_sms: int | None = None, backend: str = "auto",
                 kernel_options: dict | None = None, max_num_pages: int | None = None,
                 max_pages_per_request: int | None = None, check_indices: bool | None = None):
        self.spec = family("prefill").project(spec)
        positions = wants_positions(kernel_options)
        self.backend = select(self.spec, backend, lambda: torch.cuda.get_device_capability(resolve_device(device)),
                              graph=use_cuda_graph, options={"positions": True} if positions else None)
        if self.backend == "portable":
            family("prefill", kernel_options).check(self.spec)
        elif set(kernel_options or ()) - {"positions"}:
            raise ValueError(f"kernel_options: the sm90 backend takes only 'positions', got {kernel_options!r}")
        max_batch_size = check_count("max_batch_size", max_batch_size)
        max_total_q = check_count("max_total_q", max_total_q)
        if use_cuda_graph and not (max_batch_size and max_total_q):
            raise ValueError("max_batch_size: max_batch_size and max_total_q are required with use_cuda_graph=True "
                             "(the graph's fixed capacity)")
        self.device = resolve_device(device)
        self.use_cuda_graph, self.max_batch_size, self.max_total_q = use_cuda_graph, max_batch_size, max_total_q
        # rows are loaded and stored 16 bytes at a time (sm90: a TMA map's address): q and out 16-byte aligned
        graph = graph_capacity(use_cuda_graph, max_batch_size, max_total_q)
        page_ids = page_ids_for(self.spec, self.device, max_batch_size if graph else None, max_num_pages,
                                max_pages_per_request, check_indices)
        self._core = WrapperCore(self.spec, self.device, num_sms, graph, align=16, page_ids=page_ids)
        self.num_sms = self._core.num_sms
        self._impl = (SM90Prefill if self.backend == "sm90" else PortablePrefill)(self._core, kernel_options)
        self._positions = Positions(max_total_q if graph else None, max_num_pages) if positions else None
        self._fp8 = self.spec.kv_dtype.startswith("float8")  # k_scale / v_scale taken (both backends)
        self._view = prefill_kv_view  # run()'s view of kv_cache (BlockSparseWrapper's inner wrappers set their own)
        self.op_handle = handles.assign(self)  # how flashgen.ops names this wrapper

    # ------------------------------------------------------------------------------------------ plan

    def plan(self, *, qo_indptr, num_qo_heads: int, num_kv_heads: int, kv_indptr=None, kv_indices=None,
             kv_last_page_len=None, block_table=None, seq_lens=None, custom_mask=None, sm_scale: float | None = None,
             rope_theta: float | None = None, rope_scale: float | None = None, window_left: int | None = None,
             soft_cap: float | None = None, num_pages: int | None = None, enable_split: bool = True,
             split_policy: SplitPolicy | None = None, kv_page_pos=None, q_pos=None, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
        """Plan a batch. ``qo_indptr [batch + 1]`` and the lengths (``kv_indptr``, ``kv_last_page_len``,
        ``seq_lens``) are host arrays: planning never synchronises with the GPU (unless ``check_indices``). Page
        ids (``kv_indices`` or ``block_table``) may be device int32 tensors (read in place; in CUDA-graph mode
        copied into the wrapper's buffer) or host arrays (validated, copied).

        ``custom_mask`` (CustomMask specs): packed bits, uint8 ``[ceil(sum(qo_len * kv_len) / 8)]`` (each
        request's ``[qo_len, kv_len]`` mask row-major, requests concatenated, little-endian bits; host or
        device), or a list of bool ``[qo_len, kv_len]`` tensors, one a request. Runtime values default to the spec's
        and are checked as ``BatchDecodeWrapper.plan``'s.
        ``enable_split`` lets the portable backend split long KV ranges to fill the GPU; the sm90 backend
        ignores it (v1 plans every request unsplit: one work item per 128-row q tile, its whole KV), and so
        ``split_policy`` (``flashgen.plan.SplitPolicy``: how the portable backend's planner splits).
        ``kv_page_pos [>= kv_indptr[-1]]``, ``q_pos [qo_indptr[-1]]``: host int arrays, the true positions of each
        page's first token and of each query token, for a wrapper built with ``kernel_options={"positions":
        True}`` (refused otherwise). ``k_scale``/``v_scale``: per-tensor scales of fp8 K/V (the cache holds
        K/k_scale and V/v_scale; 1.0 for other caches), as ``BatchDecodeWrapper.plan``'s.
        """
        check_heads(num_qo_heads, num_kv_heads)
        spec = self.spec
        table = page_table(spec, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=kv_last_page_len,
                           block_table=block_table, seq_lens=seq_lens, num_pages=num_pages)
        qo = host_array("qo_indptr", qo_indptr)
        if qo.size != table.kv_lens.size + 1:
            raise PlanError(f"qo_indptr: has {qo.size} entries, expected batch_size + 1 = {table.kv_lens.size + 1}")
        if custom_mask is not None and not isinstance(spec.mask, CustomMask):
            raise PlanError("custom_mask: this spec's mask is not CustomMask()")
        if self._core.page_ids is not None:
            self._core.page_ids.take(table, num_pages)
        dequant_k = dequantises_k(spec)  # a k_transform over fp8 K: k_scale is a param, not in sm_scale
        runtime, v_scale = fp8_scaled(self._core.runtime(sm_scale, rope_theta, rope_scale, window_left, soft_cap),
                                      self._fp8, k_scale, v_scale, not dequant_k)
        positions = {}
        if self._positions is not None:
            self._positions.extras(positions, table.kv_indptr_host, int(qo[-1]), kv_page_pos, q_pos)
        else:
            refuse_positions(kv_page_pos, q_pos)
        rows = self._impl.plan(qo, table, num_qo_heads, num_kv_heads, runtime, custom_mask, enable_split,
                               split_policy, *((positions,) if positions else ()),
                               **({"v_scale": v_scale} if self._fp8 else {}),
                               **({"k_scale": float(k_scale)} if dequant_k else {}))
        self._core.set_planned(rows, num_qo_heads, num_kv_heads, table)

    # ------------------------------------------------------------------------------------------ run

    def run(self, q: torch.Tensor, kv_cache, out: torch.Tensor | None = None, return_lse: bool = False, **variant):
        """Attend ``q [total_q, num_qo_heads, head_dim]`` over the planned batch of ``kv_cache``.

        ``kv_cache``: the paged cache (one ``[pages, 2, ...]`` tensor or a ``(k, v)`` pair) or, for a Ragged
        spec, ``(k [total_kv, num_kv_heads, head_dim], v [total_kv, num_kv_heads, head_dim_vo])``. Returns
        ``out [total_q, num_qo_heads, head_dim_vo]`` (q's dtype), with ``return_lse`` also ``lse [total_q,
        num_qo_heads]`` fp32 (natural log; -inf for a row that sees no key). With ``use_cuda_graph`` ``total_q``
        is ``max_total_q``. A cache seen before (same addresses, shapes, strides) is not checked again.

        ``**variant``: the tensors and scalars the spec's ``Variant`` declares, each by its name (all of them,
        nothing else; tensors of the declared dtype and rank on the wrapper's device: ``variant_args``). The hooks
        see ``batch`` = the request, ``qo_idx`` = the query's position (``kv_len - qo_len + i``, or ``q_pos``),
        ``kv_idx`` = the key's. Example: ``wrapper.run(q, (k, v), doc_ids=ids)`` for
        ``flashgen.variants.examples.DOCUMENT``.
        """
        core = self._core
        out, lse = core.outputs(q, out, return_lse)
        write_variant(self._impl.variant, self._impl.params_buffer, variant)
        self._impl.launch(q, core.kv_args(kv_cache, self._view, self._impl.kv_args), out, lse)
        return (out, lse) if return_lse else out


def prefill_kv_view(spec: AttentionSpec, kv_cache, num_kv_heads: int):
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
              custom_mask=None, return_lse: bool = False, **variant):
    """One request: ``q [sq, num_qo_heads, head_dim]`` over ``k [sk, num_kv_heads, head_dim]``, ``v [sk,
    num_kv_heads, head_dim_vo]`` (same dtype, CUDA). The queries are the last ``sq`` positions (causal is
    aligned to the end of the KV). ``spec`` defaults to a Ragged spec from the shapes and ``causal``.
    ``**variant``: the spec's variant's tensors and scalars by name (``BatchPrefillWrapper.run``).

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
    return wrapper.run(q.contiguous(), (k, v), return_lse=return_lse, **variant)
