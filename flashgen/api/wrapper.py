"""The wrapper core under every plan/run wrapper (decode, prefill; cascade, sparse and cache writes to come).

A wrapper is this core plus a backend (``backends.Backend``): the core owns what every kernel shares — the
device and its SM count, the runtime values (``Runtime``), q / out / lse checks, the memo of validated KV
caches, the counters of in-kernel split merges, and the plan upload (``HostStaging``: the plan and its extra
arrays written into one of two reused pinned buffers, one async copy into one reused device buffer); a
backend owns its planner call, its params and its launch.

Cost model of ``plan()`` (host time on the H200 host; measured 2026-12): the planner itself (``flashgen.plan``)
is 15-60 µs; every torch call costs several µs there (a ``non_blocking`` ``copy_`` of a pinned tensor ~5 µs,
``torch.empty`` on the device ~3-5 µs, ``torch.zeros`` more, ``pin_memory()`` tens of µs, a
``get_device_properties`` ~10 µs) against ~0.1 µs for a dict or attribute access, ~1 µs for a small numpy
write and ~1 µs for a driver call through cuda-python. So a plan makes no torch call in the steady state: the
upload is one driver copy and one driver event that guards the staging buffer; device buffers, counters and
pinned buffers are sized on the first plan and grow only when a batch outgrows them; device facts are read
once per process; the params struct is packed once, by name (``BoundParams``). ``run()`` (~8-10 µs) checks
q / out with attribute compares, looks the cache up in the memo, writes the run-time params and launches.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Mapping, NamedTuple

import numpy as np
import torch

from ..plan import Plan, PlanError
from ..spec import AttentionSpec, Paged, RoPE, SlidingWindow
from .append import rope_scaling_fields
from .checks import check_count, check_tensor
from .kv_inputs import TORCH_DTYPES, KVView, PageTable
from .page_ids import PageIds
from .staging import DeviceBuffer, HostStaging

KV_MEMO_HELD = 256  # validated caches remembered before the memo starts over (a loop has one per layer)
F32_MAX = 3.4028234663852886e38  # the runtime values are fp32 kernel params
WINDOW_NONE = 2**30  # a window at least this wide is none: plans hold KV positions < 2**30 (fast_paths.MAX_KV_LEN)


def resolve_device(device: torch.device | int | None) -> torch.device:
    """``device`` as ``cuda:<index>`` (default: torch's current device)."""
    if isinstance(device, torch.device) and device.index is not None:
        return device
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if device.index is None else device


@functools.lru_cache(maxsize=None)
def device_sms(index: int) -> int:
    """Streaming multiprocessors of GPU ``index`` (read once per process)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


class Runtime(NamedTuple):
    """Runtime values of a plan (numbers that do not change the kernel), in the kernels' units."""

    window_left: int
    sm_scale: float
    soft_cap: float
    rope_rcp_scale: float
    rope_log2_theta: float


def runtime_values(spec: AttentionSpec, sm_scale=None, rope_theta=None, rope_scale=None, window_left=None,
                   soft_cap=None) -> Runtime:
    """The plan's runtime values, defaulting to the spec's, checked (``PlanError`` names the argument).

    ``sm_scale``, ``rope_theta``, ``rope_scale``: finite numbers > 0 (fp32: the kernels' type). ``window_left``:
    an int, the keys a query sees to its left under a ``SlidingWindow`` mask; -1 means no window (FlashInfer's
    convention; a window past 2**30, the longest KV a plan holds, is none either); a spec without a window takes
    only -1. ``soft_cap``: a finite number > 0 for a spec with a soft-cap; 0 means off and is all a spec without
    one takes (the cap is structural: ``AttentionSpec.soft_cap``).

    >>> runtime_values(AttentionSpec(128, mask=SlidingWindow(64))).window_left
    64
    """
    rope = spec.pos_encoding if isinstance(spec.pos_encoding, RoPE) else RoPE()
    theta = positive("rope_theta", rope.theta if rope_theta is None else rope_theta)
    scale = positive("rope_scale", rope.scale if rope_scale is None else rope_scale)
    if scale < 1.0 / F32_MAX:
        raise PlanError(f"rope_scale: got {rope_scale!r}, expected a finite number > 0 whose inverse is a finite fp32")
    scale_qk = positive("sm_scale", spec.default_sm_scale if sm_scale is None else sm_scale)
    window = _window(spec, window_left)
    if spec.soft_cap is None:
        if soft_cap is not None and soft_cap != 0:
            raise PlanError(f"soft_cap: got {soft_cap!r}, but this spec has no soft-cap (0 or None: off; set "
                            "AttentionSpec.soft_cap to enable it)")
        cap = 0.0
    else:
        cap = positive("soft_cap", spec.soft_cap if soft_cap is None else soft_cap,
                        " (the logits are capped at +-soft_cap; the spec's cap is structural: 0 cannot turn it off)")
    return Runtime(window, scale_qk, cap, 1.0 / scale, math.log2(theta))


def rope_scaling_params(spec: AttentionSpec, runtime: Runtime) -> dict:
    """The params fields of the spec's RoPE scaling (``family.ROPE_SCALING_FIELDS``) at the plan's theta, or {}
    without a scaling (the kernel then has no such fields): what the prefills fill at ``plan()``."""
    rope = spec.pos_encoding
    if not isinstance(rope, RoPE) or rope.scaling is None:
        return {}
    return _scaling_fields(rope, 2.0 ** runtime.rope_log2_theta, spec.head_dim)


@functools.lru_cache(maxsize=64)
def _scaling_fields(rope: RoPE, theta: float, head_dim: int) -> dict:
    return rope_scaling_fields(rope.rope_terms(head_dim, theta))


def positive(name: str, value, note: str = "") -> float:
    """``value`` (a number: numpy's and one-element tensors' too) as a float, or ``PlanError`` unless it is a
    finite number > 0 (fp32)."""
    number = value
    if type(value) is not float:
        try:
            if isinstance(value, (bool, str, bytes)):
                raise TypeError
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            number = math.nan
    if not 0.0 < number <= F32_MAX:  # NaN fails both compares
        raise PlanError(f"{name}: got {value!r}, expected a finite number > 0{note}")
    return number


def fp8_scaled(runtime: Runtime, fp8: bool, k_scale, v_scale, fold_k: bool = True) -> tuple[Runtime, float]:
    """``(runtime, v_scale)`` with fp8 K's per-tensor scale folded into sm_scale (q.(k * k_scale) = (q.k) * k_scale,
    before any logits transform; V's the kernel applies to its output). Both must be finite numbers > 0, and 1.0
    unless the cache is fp8 (``fp8``); ``PlanError`` names the argument. O(1): called by every plan().
    ``fold_k=False`` (a variant's k_transform over fp8 K, ``kernels.dequantises_k``): the kernel dequantises K by
    its ``k_scale`` param before the hook, so sm_scale is left as it is.

    >>> fp8_scaled(runtime_values(AttentionSpec(128)), True, 0.5, 2.0)[0].sm_scale == 0.5 / math.sqrt(128)
    True
    """
    if k_scale == 1.0 and v_scale == 1.0:
        return runtime, 1.0
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if value != 1.0 and not fp8:
            raise PlanError(f"{name}: got {value!r}; per-tensor scales apply to fp8 K/V only (expected 1.0)")
        positive(name, value)
    if not fold_k:
        return runtime, float(v_scale)
    sm_scale = positive("k_scale", runtime.sm_scale * float(k_scale), " (sm_scale * k_scale must be a finite fp32)")
    return runtime._replace(sm_scale=sm_scale), float(v_scale)


def _window(spec: AttentionSpec, window_left) -> int:
    """``window_left`` for the kernels: the window's keys to the left of a query (0 without a window)."""
    windowed = isinstance(spec.mask, SlidingWindow)
    if window_left is None:
        return min(spec.mask.left, WINDOW_NONE) if windowed else 0
    try:
        if isinstance(window_left, bool):
            raise TypeError
        window_left = operator.index(window_left)  # ints, numpy's, one-element integer tensors; not 1.5
    except TypeError:
        raise PlanError(f"window_left: got {window_left!r}, expected an int >= -1 (-1: no window)") from None
    if window_left < -1:
        raise PlanError(f"window_left: got {window_left}, expected >= -1 (keys visible to the left of a query; "
                        "-1: no window)")
    if not windowed:
        if window_left != -1:
            raise PlanError(f"window_left: got {window_left}, but this spec has no sliding window (-1 or None: "
                            "none; mask=SlidingWindow(left) enables one)")
        return 0
    return WINDOW_NONE if window_left == -1 else min(window_left, WINDOW_NONE)


def kv_key(kv_cache, num_kv_heads: int) -> tuple | None:
    """Memo key of a cache: what its validation and kernel arguments depend on (addresses, shapes, strides,
    dtypes); None for anything that is not one tensor or a pair of tensors (validated every time)."""
    if type(kv_cache) is tuple or type(kv_cache) is list:
        if len(kv_cache) == 2:
            k, v = kv_cache
            if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
                return (num_kv_heads, k.data_ptr(), v.data_ptr(), k.shape, v.shape, k.stride(), v.stride(),
                        k.dtype, v.dtype)
        return None
    if isinstance(kv_cache, torch.Tensor):
        return (num_kv_heads, kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
    return None


class Planned(NamedTuple):
    """What run() checks against the current plan."""

    q_shape: torch.Size
    out_shape: torch.Size
    num_kv_heads: int
    kv_need: int  # tokens (ragged) or pages (paged, host page ids) the cache must hold
    kv_short: tuple  # the error when it holds fewer: (format, its arguments but the number it holds)


def kv_need(spec: AttentionSpec, table: PageTable) -> tuple[int, tuple]:
    if not isinstance(spec.kv_layout, Paged):
        total = int(table.kv_indptr_host[-1])
        return total, (_RAGGED_SHORT, total)
    name = "block_table" if table.block_table is not None else "kv_indices"
    return table.max_page + 1, (_PAGED_SHORT, name, table.max_page)


def kv_short_error(kv_short: tuple, held: int) -> ValueError:
    """The error of a cache that holds ``held`` tokens or pages, fewer than the plan needs (``Planned``)."""
    return ValueError(kv_short[0].format(*kv_short[1:], held))


_RAGGED_SHORT = "kv_cache: {1} tokens, fewer than kv_indptr[-1] = {0}"
_PAGED_SHORT = "{0}: page id {1} is outside kv_cache's {2} pages"


class WrapperCore:
    """Device, capacity, buffers, KV memo and run-time checks of one wrapper; ``backend`` plans and launches.

    ``graph``: ``(max_batch_size, max_total_q)`` of a CUDA-graph wrapper (every buffer sized once, at the first
    plan, and never moved), or None.
    """

    def __init__(self, spec: AttentionSpec, device: torch.device, num_sms: int | None,
                 graph: tuple[int, int] | None, align: int, page_ids: PageIds | None = None):
        self.spec, self.device = spec, device
        self.page_ids = page_ids  # device page ids copied (CUDA graphs) or checked (check_indices), else None
        num_sms = check_count("num_sms", num_sms)
        self.num_sms = device_sms(device.index) if num_sms is None else num_sms
        self.graph = graph
        self.fixed = graph is not None
        self.max_batch_size, self.max_total_q = graph or (None, None)
        self.align = align  # byte alignment run() requires of q and out (0: none)
        self.staging = HostStaging(device)
        self.plan_buffer = DeviceBuffer(torch.int32, device, self.fixed)
        self._counters: torch.Tensor | None = None
        self._counters_numel = self._counters_address = 0
        self._kv_memo: dict[tuple, tuple] = {}
        self.dtype = TORCH_DTYPES[spec.dtype]
        self.planned: Planned | None = None
        self._default_runtime: Runtime | None = None

    # ------------------------------------------------------------------------------------------ plan

    def upload(self, plan: Plan, extras: dict[str, np.ndarray], hint: str = "raise max_batch_size",
               reserve: int = 0) -> Mapping[str, int]:
        """The plan and ``extras`` to the device in one async copy (``HostStaging.upload``); their device
        addresses (read-only, shared by plans of one layout)."""
        return self.staging.upload(plan, extras, self.plan_buffer, hint, reserve)

    def counters(self, numel: int, hint: str) -> int:
        """The address of a zeroed int32 buffer of at least ``numel`` (the split merges' semaphores; kernels leave
        it zero)."""
        if self._counters_numel < numel:
            if self._counters is not None and self.fixed:
                raise PlanError(f"counters: needs {numel}, more than sized by the first plan ({hint})")
            self._counters = torch.zeros(max(numel, 1), dtype=torch.int32, device=self.device)
            self._counters_numel, self._counters_address = self._counters.numel(), self._counters.data_ptr()
        return self._counters_address

    def runtime(self, sm_scale, rope_theta, rope_scale, window_left, soft_cap) -> Runtime:
        """``runtime_values`` of the spec, memoised for the defaults (what an inference loop passes each step)."""
        if sm_scale is None and rope_theta is None and rope_scale is None and window_left is None and soft_cap is None:
            if self._default_runtime is None:
                self._default_runtime = runtime_values(self.spec)
            return self._default_runtime
        return runtime_values(self.spec, sm_scale, rope_theta, rope_scale, window_left, soft_cap)

    def set_planned(self, rows: int, num_qo_heads: int, num_kv_heads: int, table: PageTable) -> None:
        spec = self.spec
        need, short = kv_need(spec, table)
        planned = self.planned
        if (planned is not None and planned.q_shape[0] == rows and planned.q_shape[1] == num_qo_heads
                and planned.num_kv_heads == num_kv_heads and planned.kv_need == need and planned.kv_short == short):
            return  # the same shapes as the last plan (a decode loop): keep its record
        self.planned = Planned(torch.Size((rows, num_qo_heads, spec.head_dim)),
                               torch.Size((rows, num_qo_heads, spec.head_dim_vo)), num_kv_heads, need, short)

    # ------------------------------------------------------------------------------------------ run

    def outputs(self, q: torch.Tensor, out: torch.Tensor | None, return_lse: bool):
        """Check q (and out, if given) against the plan; ``(out, lse or None)``."""
        planned = self.planned
        if planned is None:
            raise RuntimeError("run: call plan() first")
        if (not isinstance(q, torch.Tensor) or q.shape != planned.q_shape or q.dtype != self.dtype
                or not q.is_contiguous() or q.device != self.device or (self.align and q.data_ptr() % self.align)):
            self._bad_tensor("q", q, planned.q_shape, self.dtype)
        if out is None:
            out = torch.empty(planned.out_shape, dtype=q.dtype, device=q.device)
        elif (not isinstance(out, torch.Tensor) or out.shape != planned.out_shape or out.dtype != q.dtype
              or not out.is_contiguous() or out.device != q.device or (self.align and out.data_ptr() % self.align)):
            self._bad_tensor("out", out, planned.out_shape, q.dtype)
        lse = torch.empty(planned.out_shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
        return out, lse

    def _bad_tensor(self, name: str, t, shape: torch.Size, dtype: torch.dtype) -> None:
        check_tensor(name, t, dtypes=(dtype,), ndim=3, device=self.device, align=self.align)
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")

    def kv_args(self, kv_cache, view, backend_args) -> tuple:
        """The backend's kernel arguments for a cache (``backend_args(KVView)``), validated on first sight
        (``view(spec, kv_cache, num_kv_heads)``) and then memoised by ``kv_key``: the memo holds no tensors."""
        planned = self.planned
        key = kv_key(kv_cache, planned.num_kv_heads)
        hit = self._kv_memo.get(key)
        if hit is None:
            kv: KVView = view(self.spec, kv_cache, planned.num_kv_heads)
            if kv.k.device != self.device:
                raise ValueError(f"kv_cache: expected tensors on {self.device}, got them on {kv.k.device}")
            hit = (kv.num_pages, backend_args(kv))
            if key is not None:
                if len(self._kv_memo) >= KV_MEMO_HELD:
                    self._kv_memo.clear()
                self._kv_memo[key] = hit
        if hit[0] < planned.kv_need:
            found = self.page_ids.run_error(hit[0]) if self.page_ids is not None else None
            raise ValueError(found) if found else kv_short_error(planned.kv_short, hit[0])
        return hit[1]


def graph_capacity(use_cuda_graph: bool, max_batch_size: int | None, max_total_q: int | None) -> tuple | None:
    return (max_batch_size, max_total_q) if use_cuda_graph else None
