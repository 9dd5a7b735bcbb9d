"""Wrapper buffers: device buffers that grow (or stay fixed for CUDA graphs), and plan uploads through pinned
host buffers reused in turn (one host-to-device copy per plan, no device sync). Every backend uploads its plan
and the arrays that travel with it (kv_indptr, host page ids, custom-mask bits and tile lists) this way."""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import torch

from ..plan import Plan, PlanError
from ..runtime import driver
from .device import current_stream

_ALIGN = 4  # int32 elements: 16-byte aligned extra arrays


def extra_offsets(plan_numel: int, sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Where ``HostStaging.upload`` puts extras of these sizes (int32 elements), in order after the plan, each
    16-byte aligned: ``({name: offset}, end)``, offsets from the start of the buffer.

    >>> extra_offsets(10, {"a": 3, "b": 5})
    ({'a': 12, 'b': 16}, 24)
    """
    offset = -(-plan_numel // _ALIGN) * _ALIGN
    starts = {}
    for name, size in sizes.items():
        starts[name] = offset
        offset += -(-size // _ALIGN) * _ALIGN
    return starts, offset


class DeviceBuffer:
    """A device buffer that grows on demand, or (CUDA-graph mode) is sized once and never moves. Its size and
    address are kept as ints (``numel``, ``address``): a plan reads them without a torch call."""

    def __init__(self, dtype: torch.dtype, device: torch.device, fixed: bool):
        self.dtype, self.device, self.fixed, self.tensor = dtype, device, fixed, None
        self.numel = self.address = 0

    def get(self, numel: int, what: str, hint: str = "raise max_batch_size") -> torch.Tensor:
        """At least ``numel`` elements; ``what`` and ``hint`` (how to make room) name the buffer in the error a
        fixed buffer raises when a later plan needs more than the first plan sized."""
        self.address_of(numel, what, hint)
        return self.tensor

    def address_of(self, numel: int, what: str, hint: str = "raise max_batch_size") -> int:
        """``get(numel, what, hint).data_ptr()``."""
        if self.numel < numel or self.tensor is None:
            self._grow(numel, what, hint)
        return self.address

    def _grow(self, numel: int, what: str, hint: str) -> None:
        if self.tensor is not None and self.fixed:
            raise PlanError(f"{what}: needs {numel} elements, more than the {self.numel} sized by the "
                            f"first plan of this CUDA-graph wrapper ({hint})")
        self.tensor = torch.empty(max(numel, 1), dtype=self.dtype, device=self.device)
        self.numel, self.address = self.tensor.numel(), self.tensor.data_ptr()


class HostStaging:
    """Two pinned int32 host buffers used in turn. A buffer is written again only after the copy that last
    read it has executed (an event recorded after that copy, two plans ago: in an inference loop it has
    long completed, so the wait is a no-op, but re-planning can never race an upload still queued)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list[driver.StreamEvent | None] = [None, None]  # made once each, recorded at every upload
        self._recorded = [False, False]
        self._addresses: dict[tuple, tuple] = {}  # (schema id, device base, extras) -> (schema, addresses)
        self._layouts: dict[tuple, tuple] = {}  # (plan numel, extras' names and sizes) -> extra_offsets
        self._host_views: list[tuple | None] = [None, None]  # a turn's (host buffer, its address, numpy view)
        self._sizes = [0, 0]  # elements of each turn's buffer
        self._turn = 0

    def _take(self, numel: int) -> torch.Tensor:
        if self._recorded[self._turn]:
            self._events[self._turn].synchronize()
        buf = self._buffers[self._turn]
        if self._sizes[self._turn] < numel:
            buf = self._buffers[self._turn] = torch.empty(max(numel, 4096), dtype=torch.int32, pin_memory=True)
            self._sizes[self._turn] = buf.numel()
        return buf

    def plan(self, planner) -> Plan:
        """``planner(host_buffer)`` -> Plan, packed into this turn's buffer (grown when a batch needs more)."""
        numel = self._sizes[self._turn] or 4096
        for _ in range(8):
            try:
                return planner(self._take(numel))
            except PlanError as exc:
                if not str(exc).startswith("host_buffer:"):
                    raise
                numel *= 4
        raise PlanError("host_buffer: the plan did not fit a staging buffer of 4**8 times the initial size")

    def upload(self, plan: Plan, extras: dict[str, np.ndarray], device_buffer,
               hint: str = "raise max_batch_size", reserve: int = 0) -> MappingProxyType:
        """Append ``extras`` (int32-convertible 1-D arrays) after the plan in its host buffer and copy both to
        the device in one async copy; returns the device address of every plan field and extra (and
        ``"base"``, the buffer's start), a read-only mapping shared by the plans of one layout. The extras land
        where ``extra_offsets`` says. ``hint``: how to make room, for the error of a fixed (CUDA-graph) buffer
        that a later plan outgrows (extras sized by the batch's KV, not by max_batch_size, need their own);
        ``reserve``: int32 elements the first sizing of a fixed buffer adds (room for what later plans may
        append; the extras' alignment padding that such growth brings is added to it)."""
        sizes = tuple([(name, values.size) for name, values in extras.items()])
        layout = self._layouts.get((plan.numel, sizes))
        if layout is None:
            if len(self._layouts) >= 64:
                self._layouts.clear()
            layout = self._layouts[(plan.numel, sizes)] = extra_offsets(plan.numel, dict(sizes))
        starts, offset = layout
        host = self._buffers[self._turn]
        if self._sizes[self._turn] < offset:  # grow, keeping the plan already written
            grown = torch.empty(offset * 2, dtype=torch.int32, pin_memory=True)
            grown[: plan.numel].copy_(host[: plan.numel])
            host = self._buffers[self._turn] = grown
            self._sizes[self._turn] = offset * 2
        address, flat = self._host_view(host)
        for name, values in extras.items():
            start = starts[name]
            flat[start: start + values.size] = values
        if device_buffer.tensor is None and device_buffer.fixed:
            # extras that grow into the reserve may also grow their 16-byte alignment padding, by up to 3 each
            device_buffer.get(offset + (reserve + (_ALIGN - 1) * len(extras) if reserve else 0), "plan", hint)
        base = device_buffer.address_of(offset, "plan", hint)
        stream = current_stream(self.device.index)
        # one driver call: the host buffer stays untouched until this turn's event (below) has passed
        driver.copy_to_device_async(base, address, 4 * offset, stream)
        event = self._events[self._turn]
        if event is None:
            event = self._events[self._turn] = driver.StreamEvent(self.device.index)
        event.record(stream)
        self._recorded[self._turn] = True
        self._turn ^= 1
        return self._device_addresses(plan, base, starts)

    def _host_view(self, host: torch.Tensor) -> tuple[int, np.ndarray]:
        """``(address, numpy view)`` of this turn's host buffer, made once per buffer (torch calls cost more than
        the lookup). One entry a turn: a grown buffer is let go at that turn's next upload."""
        cached = self._host_views[self._turn]
        if cached is None or cached[0] is not host:
            cached = self._host_views[self._turn] = (host, host.data_ptr(), host.numpy())
        return cached[1], cached[2]

    def _device_addresses(self, plan: Plan, base: int, starts: dict[str, int]) -> MappingProxyType:
        """Device address of every plan field, extra and ``"base"``; made once per (schema, base, extras' places)
        and shared, read-only (a ``MappingProxyType``: copying a dict of ~15 entries each plan costs more)."""
        key = (id(plan.schema), base, tuple(starts.items()))  # schemas are shared between plans, never mutated
        cached = self._addresses.get(key)
        if cached is None or cached[0] is not plan.schema:
            if len(self._addresses) >= 64:
                self._addresses.clear()
            addresses = {name: base + 4 * f.offset for name, f in plan.schema.items()}
            for name, start in starts.items():
                addresses[name] = base + 4 * start
            addresses["base"] = base
            cached = self._addresses[key] = (plan.schema, MappingProxyType(addresses))
        return cached[1]
