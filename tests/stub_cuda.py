"""Wrappers on a machine without a GPU: the CUDA calls a wrapper's plan() makes (pinned allocation, events, the
stream, kernel loading) stubbed, so that plan() runs on the CPU. For tests of what plan() packs and uploads, and
for benchmarks/experiments/plan_host_stubbed.py (plan()'s host time without a GPU)."""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from unittest import mock

import torch

from flashgen import jit
from flashgen.api import decode, prefill, staging
from flashgen.kernels import family


class _Function:
    def set_max_dynamic_shared_memory(self, nbytes):
        pass

    def launch_params(self, *args):
        pass


def fake_build(spec, op, device=None, arch=None, options=None):
    """A loaded-kernel stand-in: the family's launch config and params layouts, functions that do nothing."""
    fam = family(op, options)
    projected = fam.project(spec)
    entries = fam.entry_points(projected)
    return jit.Kernel(op, fam.uri(projected), "sm_90a", 0, None, {e.name: _Function() for e in entries},
                      fam.launch(projected), {e.name: e.params for e in entries})


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
    no-ops, kernels fakes."""
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        return real_empty(*args, **kwargs)

    cpu = lambda device=None: torch.device("cpu")  # noqa: E731
    with mock.patch.object(decode, "resolve_device", cpu), mock.patch.object(prefill, "resolve_device", cpu), \
            mock.patch.object(staging.torch, "empty", empty), \
            mock.patch.object(torch.cuda, "Event", _Event), \
            mock.patch.object(staging.driver, "StreamEvent", _Event), \
            mock.patch.object(staging.driver, "copy_to_device_async", _copy_to_device_async), \
            mock.patch.object(staging, "current_stream", lambda index: 0), \
            mock.patch.object(torch.cuda, "current_stream", lambda device=None: None), \
            mock.patch.object(jit, "build", fake_build):
        yield
