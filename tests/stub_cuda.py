"""Wrappers on a machine without a GPU: the CUDA calls a wrapper's plan() makes (pinned allocation, events, the
stream, kernel loading) stubbed, so that plan() runs on the CPU. For tests of what plan() packs and uploads, and
for benchmarks/experiments/plan_host_stubbed.py (plan()'s host time without a GPU)."""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from unittest import mock

import torch

from flashgen import jit
from flashgen.api import (block_sparse, decode, merge, page_ids, portable, prefill, sm90, staging,
                          variable_block_sparse, wrapper)
from flashgen.kernels import family


class _Function:
    def set_max_dynamic_shared_memory(self, nbytes):
        pass

    def launch_params(self, *args):
        pass

    def launch(self, *args):
        pass


def fake_build(spec, op, device=None, arch=None, options=None):
    """A loaded-kernel stand-in: the family's launch config and params layouts, functions that do nothing."""
    fam = family(op, options)
    projected = fam.project(spec)
    entries = fam.entry_points(projected)
    return jit.Kernel(op, fam.uri(projected), "sm_90a", 0, None, {e.name: _Function() for e in entries},
                      fam.launch(projected), {e.name: e.params for e in entries})


class DeviceTensor(torch.Tensor):
    """A CPU tensor that the wrappers take for a device one (``is_cuda``): page ids or a mask read in place."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    is_cuda = True


def on_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a CPU tensor) as a ``DeviceTensor``, sharing its storage."""
    return torch.Tensor._make_subclass(DeviceTensor, t)


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


def _copy_to_device_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    ctypes.memmove(dst, src, nbytes)  # "device" buffers are CPU tensors here


@contextmanager
def stubbed_cuda():
    """Wrappers on the CPU: pinned buffers become plain ones, the plan upload a memmove, events and streams
    no-ops, 132 SMs, kernels fakes (so run() and merge check their arguments and launch nothing, given
    ``DeviceTensor`` q, caches and states); the CUDA-graph page-id buffer a ``DeviceTensor``; a compute-capability
    8.0 device, so ``backend="auto"`` picks the portable kernel (patch ``torch.cuda.get_device_capability`` to
    ``(9, 0)`` inside this context for the Hopper one)."""
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        return real_empty(*args, **kwargs)

    cpu = lambda device=None: torch.device("cpu")  # noqa: E731
    with mock.patch.object(decode, "resolve_device", cpu), mock.patch.object(prefill, "resolve_device", cpu), \
            mock.patch.object(decode, "current_stream", lambda index: 0), \
            mock.patch.object(block_sparse, "resolve_device", cpu), \
            mock.patch.object(variable_block_sparse, "resolve_device", cpu), \
            mock.patch.object(staging.torch, "empty", empty), \
            mock.patch.object(torch.cuda, "Event", _Event), \
            mock.patch.object(staging.driver, "StreamEvent", _Event), \
            mock.patch.object(staging.driver, "copy_to_device_async", _copy_to_device_async), \
            mock.patch.object(staging, "current_stream", lambda index: 0), \
            mock.patch.object(torch.cuda, "current_stream", lambda device=None: None), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (8, 0)), \
            mock.patch.object(jit, "build", fake_build), \
            mock.patch.object(portable, "current_stream", lambda index: 0), \
            mock.patch.object(wrapper, "device_sms", lambda index: 132), \
            mock.patch.object(sm90, "current_stream", lambda index: 0), \
            mock.patch.object(merge, "current_stream", lambda index: 0), \
            mock.patch.object(merge, "_functions", {}), mock.patch.object(prefill, "_WRAPPERS", {}), \
            mock.patch.object(page_ids, "device_ids_buffer", lambda shape, device: on_device(
                real_empty(shape, dtype=torch.int32))):
        yield
