"""The ``Plan`` type: named int32 arrays packed in one host buffer, copied to the device in one async copy.

A plan is a schema (field name -> offset and length in int32 elements) over one flat int32 host tensor,
plus a small frozen ``info`` record of Python ints (sizes, grid) that wrappers read on the host. Field
offsets are aligned to 4 elements (16 bytes) so kernels may use vector loads.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, NamedTuple

import numpy as np
import torch

from .host import PlanError

_ALIGN = 4


class PlanField(NamedTuple):
    """One array of a plan: ``host[offset : offset + length]``."""

    name: str
    offset: int
    length: int


def _new_host_buffer(numel: int) -> torch.Tensor:
    # pinned memory makes the copy truly asynchronous; without CUDA a plain CPU tensor is all there is
    if torch.cuda.is_available():
        return torch.empty(numel, dtype=torch.int32, pin_memory=True)
    return torch.empty(numel, dtype=torch.int32)


def host_storage(numel: int, host_buffer: torch.Tensor | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """``(host, flat)``: a ``numel``-element int32 host tensor and a numpy view of it to fill.

    ``host_buffer`` (an int32 CPU tensor, pinned ideally, at least ``numel`` long) is reused when given;
    otherwise a buffer is allocated (pinned when CUDA is available, which costs far more than planning).
    The numpy view of a reused buffer is kept on the buffer (``_plan_views``: its data pointer, the view,
    whether it is contiguous, and the last ``numel`` with its tensor view), so that a decode step's plan does
    not pay for ``numpy()``, the checks and the view again.
    """
    if host_buffer is None:
        host = _new_host_buffer(numel)
        return host, host.numpy()
    cached = host_views(host_buffer)
    if cached is None:
        raise PlanError(f"host_buffer: needs a 1-D int32 CPU tensor of at least {numel} elements, got "
                        f"{host_buffer.dtype} {host_buffer.device} of shape {tuple(host_buffer.shape)}")
    flat = cached[1]
    if flat.size < numel or host_buffer.numel() < numel:
        raise PlanError(f"host_buffer: needs an int32 CPU tensor of at least {numel} elements, got "
                        f"{host_buffer.dtype} {host_buffer.device} with {host_buffer.numel()}")
    return host_view(host_buffer, cached, numel), flat


def host_views(host_buffer: torch.Tensor) -> list | None:
    """The views ``host_storage`` keeps on a reused ``host_buffer`` (``_plan_views``: its data pointer, its numpy
    view, whether it is contiguous, and the last ``numel`` with its tensor view), or None where it is not a
    1-D int32 CPU tensor."""
    cached = getattr(host_buffer, "_plan_views", None)
    if cached is None or cached[0] != host_buffer.data_ptr():
        if host_buffer.dtype != torch.int32 or not host_buffer.is_cpu or host_buffer.dim() != 1:
            return None
        contiguous = host_buffer.is_contiguous()
        cached = host_buffer._plan_views = [host_buffer.data_ptr(), host_buffer.numpy(), contiguous, -1, None]
    return cached


def host_view(host_buffer: torch.Tensor, cached: list, numel: int) -> torch.Tensor:
    """The first ``numel`` elements of ``host_buffer`` (at least that long) as a tensor, kept in ``cached``
    (``host_views``) for the next plan of that size."""
    if cached[3] != numel:
        # as_strided is a cheaper view than slicing on a small host; a strided buffer is sliced
        cached[3:] = numel, (host_buffer.as_strided((numel,), (1,)) if cached[2] else host_buffer[:numel])
    return cached[4]


@functools.lru_cache(maxsize=64)
def schema_for(layout: tuple[tuple[tuple[str, ...], int], ...]) -> tuple[dict[str, PlanField], int]:
    """The schema (name -> ``PlanField``) and total length of ``((names, length), ...)``, fields in order.

    Equal-length names of one entry are consecutive, ``length`` rounded up to 4 elements apart. Cached:
    never mutate the returned schema.
    """
    schema = {}
    offset = 0
    for names, length in layout:
        for name in names:
            schema[name] = PlanField(name, offset, length)
            offset += -(-length // _ALIGN) * _ALIGN
    return schema, offset


class Plan:
    """Planner output: ``kind``, a typed ``schema``, one int32 ``host`` buffer and an ``info`` record.

    Read a field on the host with ``plan["request_idx"]`` (an int32 torch view) or ``plan.numpy(name)``;
    ``plan.to_device(buf)`` copies the whole buffer with one ``copy_(non_blocking=True)`` and returns
    named views of ``buf``. Nothing here synchronises with a device.

    Example::

        plan = plan_decode(kv_lens=[100, 5000], num_qo_heads=32, num_kv_heads=8)
        dev = torch.empty(plan.numel, dtype=torch.int32, device="cuda")
        views = plan.to_device(dev)        # views["kv_start"] is a device int32 tensor
    """

    def __init__(self, kind: str, schema: Mapping[str, PlanField], host: torch.Tensor, info: Any):
        self.kind = kind
        self.schema = schema  # shared between plans of one shape: never mutate
        self.host = host
        self.info = info

    @classmethod
    def pack(cls, kind: str, arrays: Mapping[Any, Any], info: Any, host_buffer: torch.Tensor | None = None) -> "Plan":
        """Pack ``arrays`` into one int32 host buffer, in the mapping's order.

        A value is a 1-D integer numpy array, or ``(values, length, pad)``: a field of ``length`` elements
        holding ``values`` and then ``pad``. A key may also be a tuple of names with a 2-D ``values``
        (one row per name) and a ``pad`` per row: equal-length fields written in one go. ``host_buffer``:
        an int32 CPU tensor (pinned, ideally) to reuse, at least ``numel`` long; without one a buffer is
        allocated (pinned when CUDA is available, which costs far more than planning itself).
        """
        fills = []
        layout = []
        for key, value in arrays.items():
            values, length, pad = value if isinstance(value, tuple) else (value, value.size, 0)
            names = key if isinstance(key, tuple) else (key,)
            layout.append((names, length))
            fills.append((values, length, pad))
        schema, numel = schema_for(tuple(layout))
        host, flat = host_storage(numel, host_buffer)
        for (names, length), (values, _, pad) in zip(layout, fills):
            start = schema[names[0]].offset
            size = values.shape[-1]
            if size > length:
                raise PlanError(f"{names[0]}: {size} values do not fit its length {length}")
            if len(names) == 1:
                flat[start: start + size] = values
                if length > size:
                    flat[start + size: start + length] = pad
                continue
            stride = -(-length // _ALIGN) * _ALIGN
            block = flat[start: start + stride * len(names)].reshape(len(names), stride)
            block[:, :size] = values
            if length > size:
                block[:, size:length] = np.reshape(pad, (-1, 1))
        return cls(kind, schema, host, info)

    # -------------------------------------------------------------------------------------- host access

    @property
    def numel(self) -> int:
        """Number of int32 elements in the buffer (what a device buffer must hold)."""
        return self.host.numel()

    def __getitem__(self, name: str) -> torch.Tensor:
        field = self.schema[name]
        return self.host[field.offset: field.offset + field.length]

    def numpy(self, name: str) -> np.ndarray:
        """A numpy (int32) view of field ``name`` of the host buffer."""
        field = self.schema[name]
        return self.host.numpy()[field.offset: field.offset + field.length]

    def sub(self, prefix: str, kind: str, info: Any) -> "Plan":
        """The fields named ``prefix + name`` as a plan of their own (sharing this host buffer)."""
        schema = {name[len(prefix):]: PlanField(name[len(prefix):], f.offset, f.length)
                  for name, f in self.schema.items() if name.startswith(prefix)}
        return Plan(kind, schema, self.host, info)

    def level(self, level: int) -> "Plan":
        """Level ``level`` of a cascade plan, as a split-KV plan sharing this host buffer."""
        if self.kind != "cascade":
            raise PlanError(f"level: a {self.kind} plan has no levels")
        return self.sub(f"level{level}.", "split_kv", self.info.levels[level])

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}[{f.length}]" for n, f in self.schema.items())
        return f"Plan({self.kind}: {fields}; {self.info})"

    # -------------------------------------------------------------------------------------- device copy

    def to_device(self, device_buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copy the plan into ``device_buffer`` (int32, >= ``numel``) with one async copy; return named views.

        The copy is ``device_buffer[:numel].copy_(host, non_blocking=True)`` on the current stream; with a
        pinned host buffer it does not block the host. Keep the host buffer alive (and unmodified) until
        the stream has consumed it.
        """
        if device_buffer.dtype != torch.int32 or device_buffer.numel() < self.numel:
            raise PlanError(f"device_buffer: needs int32 with at least {self.numel} elements, got "
                            f"{device_buffer.dtype} with {device_buffer.numel()}")
        device_buffer[: self.numel].copy_(self.host, non_blocking=True)
        return {name: device_buffer[f.offset: f.offset + f.length] for name, f in self.schema.items()}
