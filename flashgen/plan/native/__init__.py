"""The native planner: the split-KV list paths (``list_paths``) of a small batch as one C++ call.

``plan_split_kv`` and ``plan_decode`` with the default split policy call ``plan_prefill`` / ``plan_decode``
here first: the native module reads the batch (numpy arrays, CPU tensors, lists), resolves the sizes, chooses
the split and writes the plan's fields into the host buffer, ~2 us where the Python list paths take 20-35 on a
fast host. It returns the same plans, byte for byte (tests/plan/test_plan_native.py), and None wherever the
Python paths have the say (inputs they refuse or convert, PlanErrors, batches past the list paths' bounds):
those plan (or raise) as before.

The module is built on the first plan (``flashgen.jit_native.ensure_built``: a one-time ~1-3 s compile with the host C++
compiler, cached, or loaded from the cache or an AOT cache of ``flashgen build``). Where it cannot be built or
loaded, plans take the Python list paths, the same plans, and one ``warnings.warn`` says why. ``use(False)``
turns it off (tests compare the two paths with it):

    >>> from flashgen.plan import native, plan_decode
    >>> with native.use(False):
    ...     python_plan = plan_decode([300, 9000], num_qo_heads=32, num_kv_heads=8)
    >>> python_plan.info == plan_decode([300, 9000], num_qo_heads=32, num_kv_heads=8).info
    True
"""

from __future__ import annotations

import importlib
import threading
import warnings

from ..fast_paths import split_kv_layout
from ..plan import Plan, _new_host_buffer, host_storage, host_view, host_views
from ..request import SplitKVInfo

_UNLOADED = object()  # the module is loaded at the first plan
_module = None  # the loaded module (None: not loaded, or unavailable)
_entry = None  # its cache entry
_failure: str | None = None  # why it is unavailable
_enabled = True
_active = _UNLOADED  # what plans use: the module, None (off or unavailable), or _UNLOADED
_lock = threading.Lock()


class NativeBuildError(RuntimeError):
    """The native planner cannot be built or loaded; the message says why."""


_loader = None  # () -> (cache entry, module): flashgen.jit_native.ensure_built, registered at its import
# imported by name at the first plan when nothing registered a loader (``import flashgen`` imports no module
# eagerly), so that this package keeps no import of the cache or the toolchain
_DEFAULT_LOADER_MODULE = "flashgen.jit_native"


def set_loader(loader) -> None:
    """Register the function that builds or loads the module (``flashgen.jit_native`` does, on import): the
    planner package itself imports nothing of the cache or the toolchain."""
    global _loader
    _loader = loader


class use:
    """``use(False)``: plans take the Python list paths; ``use(True)``: the native planner where it is available
    (the default). Either way, as a context manager it restores the previous setting on exit."""

    def __init__(self, enabled: bool):
        global _enabled
        self.previous = _enabled
        _enabled = bool(enabled)
        _refresh()

    def __enter__(self) -> "use":
        return self

    def __exit__(self, *exc) -> None:
        global _enabled
        _enabled = self.previous
        _refresh()


def _refresh() -> None:
    global _active
    _active = None if not _enabled else _module if (_module is not None or _failure is not None) else _UNLOADED


def planner():
    """The loaded native module, built or loaded on the first call; None where it is unavailable (``failure()``
    says why; a warning said so once)."""
    global _module, _entry, _failure
    with _lock:
        if _module is None and _failure is None:
            try:
                if _loader is None:
                    importlib.import_module(_DEFAULT_LOADER_MODULE)  # registers its loader
                if _loader is None:
                    raise NativeBuildError(f"no loader is registered ({_DEFAULT_LOADER_MODULE} registers one "
                                           "when it is imported)")
                _entry, _module = _loader()
                _module.set_info_type(SplitKVInfo)
            except Exception as exc:  # noqa: BLE001 - whatever stops it, the Python paths plan the same
                _entry, _module = None, None
                _failure = str(exc) if isinstance(exc, NativeBuildError) else f"{type(exc).__name__}: {exc}"
                warnings.warn(f"flashgen: the native planner is unavailable, plans use the Python list paths "
                              f"(the same plans, slower): {_failure}", RuntimeWarning, stacklevel=3)
        _refresh()
    return _module


def entry():
    """The cache entry (``flashgen.cache.Entry``) the loaded planner came from, or None."""
    return _entry


def failure() -> str | None:
    """Why the native planner is unavailable (None when it loaded, or before the first plan)."""
    return _failure


def available() -> bool:
    """Whether plans use the native planner (loading it now if it was not)."""
    return _enabled and planner() is not None


def plan_prefill(qo_indptr, kv_lens, host_buffer, num_qo_heads, num_kv_heads, tile_rows, kv_granularity, num_sms,
                 item_overhead, enable_split, balance_tail, split_min_waves, max_batch_size, max_total_q,
                 capacity) -> Plan | None:
    """``list_paths.plan_lists(small_inputs(...))``'s plan natively (``plan_split_kv``'s arguments), or None for
    the Python paths to plan."""
    module = _active if _active is not _UNLOADED else planner() and _active
    if module is None:
        return None
    return _plan(module.prefill, (qo_indptr, kv_lens), host_buffer,
                 (num_qo_heads, num_kv_heads, tile_rows, kv_granularity, num_sms, item_overhead, enable_split,
                  balance_tail, split_min_waves, max_batch_size, max_total_q, capacity))


def plan_decode(kv_lens, host_buffer, num_qo_heads, num_kv_heads, tile_rows, kv_granularity, num_sms, item_overhead,
                enable_split, max_batch_size, max_total_q, capacity) -> Plan | None:
    """``list_paths.plan_decode_lists``'s plan natively (``plan_decode``'s arguments), or None for the Python paths
    to plan."""
    module = _active if _active is not _UNLOADED else planner() and _active
    if module is None:
        return None
    return _plan(module.decode, (kv_lens,), host_buffer,
                 (num_qo_heads, num_kv_heads, tile_rows, kv_granularity, num_sms, item_overhead, enable_split,
                  max_batch_size, max_total_q, capacity))


def _plan(call, batch: tuple, host_buffer, options: tuple) -> Plan | None:
    # call(*batch, flat, *options): the module's prefill or decode. Without a host_buffer the plan gets a buffer of
    # its own, of the size a first call (flat None) asks for.
    if host_buffer is None:
        numel = call(*batch, None, *options)
        host = None if numel is None else _new_host_buffer(numel)
        flat = None if host is None else host.numpy()
    else:
        host = host_views(host_buffer)
        flat = None if host is None else host[1]  # (not a 1-D int32 CPU tensor: the Python path raises)
    if flat is None:
        return None
    return _finish(call(*batch, flat, *options), host_buffer, host)


def _finish(info, host_buffer, host) -> Plan | None:
    # info: the SplitKVInfo of the plan written, the numel it needs (too small a host_buffer), or None; host: the
    # plan's own buffer, or host_buffer's views (host_views)
    if type(info) is int:
        host_storage(info, host_buffer)  # raises the "host_buffer:" PlanError that api/staging grows on
        return None
    if info is None:
        return None
    schema, numel, _ = split_kv_layout(info[1], info[3], info[5])
    return Plan("split_kv", schema, host if host_buffer is None else host_view(host_buffer, host, numel), info)
