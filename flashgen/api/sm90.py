"""Hopper prefill runner (``prefill_sm90``): TMA descriptors built on the host and a plan/run wrapper.

Not yet behind ``BatchPrefillWrapper``: it is selected there once its GPU tests pass on an H200. v1 supports
what ``PrefillSM90Family.check`` accepts (Ragged KV, NoMask / Causal, fp16 / bf16, head_dim 64 / 128 / 256) and
plans every request unsplit (one item per (request, 128-row q tile), its whole KV).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ..codegen import family
from ..codegen import prefill_sm90 as _family  # noqa: F401  (registers the prefill_sm90 family)
from ..codegen.prefill_sm90 import THREADS, TILE_Q, sm90_smem_bytes, sm90_tile_kv
from ..plan import PlanError, host_array, plan_prefill
from ..spec import AttentionSpec
from .checks import check_tensor
from .device import current_stream
from .kv_inputs import TORCH_DTYPES, kv_view, page_table
from .staging import DeviceBuffer, HostStaging

_TMA_DTYPES = {torch.bfloat16: "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", torch.float16: "CU_TENSOR_MAP_DATA_TYPE_FLOAT16"}
TMA_BOX_COLS = 64  # 64 16-bit values = the 128-byte swizzle span; a head_dim of 128 is two boxes


def kv_tensor_map(t: torch.Tensor, rows: int, tile_kv: int) -> bytes:
    """The 128-byte TMA descriptor of ``t [total_kv, num_kv_heads, head_dim]`` (fp16/bf16, rows contiguous,
    16-byte aligned strides) seen as a 3-D tensor ``{head_dim, num_kv_heads, rows}`` (innermost first) with
    boxes of ``{64, 1, tile_kv}`` landing 128B-swizzled. ``rows`` (>= 1) bounds the tensor: a box reaching past
    it reads zeros, so the last tile of the batch never reads rows no request owns.

    >>> desc = kv_tensor_map(k, int(kv_indptr[-1]), 128)   # pack into a CUtensorMap params field
    """
    from cuda.bindings import driver as cu

    from ..runtime.driver import check, ensure_context

    ensure_context(t.device.index)
    u64, u32 = cu.cuuint64_t, cu.cuuint32_t
    elem = t.element_size()
    dims = [u64(t.shape[2]), u64(t.shape[1]), u64(max(rows, 1))]
    strides = [u64(t.stride(1) * elem), u64(t.stride(0) * elem)]
    box = [u32(TMA_BOX_COLS), u32(1), u32(tile_kv)]
    tensor_map = check(cu.cuTensorMapEncodeTiled(
        getattr(cu.CUtensorMapDataType, _TMA_DTYPES[t.dtype]), 3, t.data_ptr(), dims, strides, box, [u32(1)] * 3,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    return ctypes.string_at(tensor_map.getPtr(), 128)


class PrefillSM90:
    """Batch prefill on Hopper over a ragged KV cache, the API of ``BatchPrefillWrapper`` (Ragged specs).

    Example::

        runner = PrefillSM90(AttentionSpec(128, kv_layout=Ragged(), mask=Causal()))
        runner.plan(qo_indptr=[0, 100, 612], kv_indptr=[0, 100, 612], num_qo_heads=32, num_kv_heads=8)
        out, lse = runner.run(q, (k, v), return_lse=True)  # q [612, 32, 128] bf16 -> out [612, 32, 128], lse fp32
    """

    def __init__(self, spec: AttentionSpec, device: torch.device | int | None = None, num_sms: int | None = None):
        self.spec = family("prefill_sm90").project(spec)
        family("prefill_sm90").check(self.spec)
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_sms = num_sms or torch.cuda.get_device_properties(self.device).multi_processor_count
        self._plan_buf = DeviceBuffer(torch.int32, self.device, False)
        self._staging = HostStaging(self.device)
        self._kernel = None
        self._planned = None
        self._maps: dict[tuple, bytes] = {}
        self._empty = None  # a one-row stand-in for an empty K / V (a tensor map needs a real address)

    def plan(self, *, qo_indptr, kv_indptr, num_qo_heads: int, num_kv_heads: int, sm_scale: float | None = None) -> None:
        """Plan a batch from host arrays ``qo_indptr [batch + 1]`` and ``kv_indptr [batch + 1]`` (token offsets)."""
        if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
            raise PlanError(f"num_qo_heads: {num_qo_heads} is not a multiple of num_kv_heads = {num_kv_heads}")
        table = page_table(self.spec, kv_indptr=kv_indptr)
        qo = host_array("qo_indptr", qo_indptr)
        if qo.size != table.kv_lens.size + 1:
            raise PlanError(f"qo_indptr: has {qo.size} entries, expected batch_size + 1 = {table.kv_lens.size + 1}")
        tile_kv = sm90_tile_kv(self.spec.head_dim)
        plan = self._staging.plan(lambda host: plan_prefill(
            qo, table.kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, tile_rows=TILE_Q,
            kv_granularity=tile_kv, num_sms=self.num_sms, enable_split=False, host_buffer=host))
        extras = {"kv_indptr": table.kv_indptr_host.astype(np.int32)}
        views = self._staging.upload(plan, extras, self._plan_buf)
        if self._kernel is None:
            self._load_kernel()
        scale = self.spec.default_sm_scale if sm_scale is None else sm_scale
        self._planned = {
            "info": plan.info, "num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads,
            "total_q": int(qo[-1]), "total_kv": int(table.kv_indptr_host[-1]),
            "ptrs": tuple(views[n].data_ptr() for n in ("qo_indptr", "kv_indptr", "kv_len", "request_idx",
                                                          "qo_tile_idx", "kv_start", "kv_end")),
            "scalars": (num_qo_heads, num_qo_heads // num_kv_heads, float(scale)),
        }
        self._keep = plan

    def _load_kernel(self) -> None:
        from ..jit import build

        self._kernel = build(self.spec, "prefill_sm90", device=self.device.index)
        self._fn = self._kernel["prefill_sm90"]
        self._smem = sm90_smem_bytes(self.spec.head_dim)
        self._fn.set_max_dynamic_shared_memory(self._smem)

    def _tensor_map(self, t: torch.Tensor, rows: int) -> bytes:
        if t.shape[0] == 0:
            if self._empty is None:
                self._empty = torch.zeros((1, *t.shape[1:]), dtype=t.dtype, device=t.device)
            t = self._empty
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, rows)
        desc = self._maps.get(key)
        if desc is None:
            if len(self._maps) > 64:
                self._maps.clear()
            desc = self._maps[key] = kv_tensor_map(t, rows, sm90_tile_kv(self.spec.head_dim))
        return desc

    def run(self, q: torch.Tensor, kv_cache, out: torch.Tensor | None = None, return_lse: bool = False):
        """``q [total_q, num_qo_heads, head_dim]`` over ``kv_cache = (k, v)``, each ``[total_kv, num_kv_heads,
        head_dim]`` (q's dtype). Returns ``out`` (q's shape and dtype), with ``return_lse`` also ``lse [total_q,
        num_qo_heads]`` fp32 (natural log; -inf for a row that sees no key)."""
        planned = self._planned
        if planned is None:
            raise RuntimeError("run: call plan() first")
        hq, d = planned["num_qo_heads"], self.spec.head_dim
        shape = (planned["total_q"], hq, d)
        check_tensor("q", q, dtypes=(TORCH_DTYPES[self.spec.dtype],), ndim=3, device=self.device)
        if tuple(q.shape) != shape or not q.is_contiguous():
            raise ValueError(f"q: expected a contiguous tensor of shape {shape}, got {tuple(q.shape)}")
        kv = kv_view(self.spec, kv_cache, planned["num_kv_heads"])
        if kv.k.shape[0] < planned["total_kv"]:
            raise ValueError(f"kv_cache: {kv.k.shape[0]} tokens, kv_indptr[-1] = {planned['total_kv']}")
        if out is None:
            out = torch.empty(shape, dtype=q.dtype, device=q.device)
        else:
            check_tensor("out", out, dtypes=(q.dtype,), ndim=3, device=self.device)
            if tuple(out.shape) != shape or not out.is_contiguous():
                raise ValueError(f"out: expected a contiguous tensor of shape {shape}, got {tuple(out.shape)}")
        lse = torch.empty(shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
        rows = planned["total_kv"]
        self._fn.launch((planned["info"].capacity, planned["num_kv_heads"], 1), (THREADS, 1, 1), self._smem,
                        current_stream(self.device.index), self._tensor_map(kv.k, rows), self._tensor_map(kv.v, rows),
                        q.data_ptr(), out.data_ptr(), lse.data_ptr() if lse is not None else 0, *planned["ptrs"],
                        *planned["scalars"])
        return (out, lse) if return_lse else out
