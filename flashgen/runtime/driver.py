"""Leaf service: the CUDA driver through cuda-python. Load cubins, look up entry points, launch.

Modules are loaded into torch's context for the device (the primary context, which torch uses), and
launches go on the stream the caller passes (``torch.cuda.current_stream().cuda_stream``), so they order
with torch's work and are recorded by CUDA-graph capture.

The launch path is kept short: the params struct is packed with one ``struct.pack_into`` into a buffer
allocated once, and the driver receives the address of a one-pointer array pointing at that buffer.
``cuLaunchKernel`` copies the parameters before returning, so the buffer may be reused at once.
"""

from __future__ import annotations

import ctypes
import struct
import threading

try:  # cuda-python >= 12.8 / cuda-bindings
    from cuda.bindings import driver as _cu
except ImportError:  # pragma: no cover - older cuda-python layout
    from cuda import cuda as _cu  # type: ignore[no-redef]


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


_SUCCESS = _cu.CUresult.CUDA_SUCCESS
_init_lock = threading.Lock()
_initialised = False


def check(result: tuple, what: str):
    err = result[0]
    if err != _SUCCESS:
        _, name = _cu.cuGetErrorName(err)
        name = name.decode() if isinstance(name, bytes) else str(name)
        raise CudaError(f"{what} failed: {name}")
    return result[1] if len(result) == 2 else result[1:]


def ensure_context(device: int) -> None:
    """Make torch's (primary) context of ``device`` current on this thread."""
    global _initialised
    with _init_lock:
        if not _initialised:
            check(_cu.cuInit(0), "cuInit")
            _initialised = True
    ctx = check(_cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    dev = check(_cu.cuDeviceGet(device), "cuDeviceGet")
    primary = check(_cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    if int(ctx) != int(primary):
        check(_cu.cuCtxSetCurrent(primary), "cuCtxSetCurrent")


_streams: dict[int, object] = {}


def stream_handle(stream: int):
    """A cached ``CUstream`` for a raw stream address (building one per launch costs a microsecond)."""
    handle = _streams.get(stream)
    if handle is None:
        handle = _streams[stream] = _cu.CUstream(stream)
    return handle


def copy_to_device_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``nbytes`` from host address ``src`` (pinned, for the copy to be asynchronous) to device address ``dst`` on
    the raw stream ``stream``: one driver call (~1 µs), where a torch ``copy_`` of tensor views dispatches for
    several. The caller keeps the host memory unchanged and alive until the copy has executed."""
    err = _cu.cuMemcpyHtoDAsync(dst, src, nbytes, _streams.get(stream) or stream_handle(stream))[0]
    if err != _SUCCESS:
        check((err,), "cuMemcpyHtoDAsync")


class StreamEvent:
    """A CUDA event without timing, recorded on a raw stream and waited on from the host (the driver's calls,
    cheaper than ``torch.cuda.Event``'s). Made in torch's context of ``device``."""

    __slots__ = ("handle", "_destroy")

    def __init__(self, device: int):
        ensure_context(device)
        self.handle = check(_cu.cuEventCreate(_cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        self._destroy = _cu.cuEventDestroy

    def record(self, stream: int) -> None:
        err = _cu.cuEventRecord(self.handle, _streams.get(stream) or stream_handle(stream))[0]
        if err != _SUCCESS:
            check((err,), "cuEventRecord")

    def synchronize(self) -> None:
        err = _cu.cuEventSynchronize(self.handle)[0]
        if err != _SUCCESS:
            check((err,), "cuEventSynchronize")

    def __del__(self):
        try:
            self._destroy(self.handle)
        except Exception:  # interpreter shutdown: the driver may be gone
            pass


class Function:
    """One entry point of a loaded module, with its params packer."""

    __slots__ = ("name", "handle", "_packer", "_buffer", "_arg_array", "_arg_address", "_launch")

    def __init__(self, name: str, handle, params_format: str, params_size: int):
        self.name = name
        self.handle = handle
        self._packer = struct.Struct(params_format)
        if self._packer.size != params_size:
            raise ValueError(f"{name}: params format packs {self._packer.size} bytes, struct has {params_size}")
        self._buffer = (ctypes.c_char * max(params_size, 8))()
        self._arg_array = (ctypes.c_void_p * 1)(ctypes.addressof(self._buffer))
        self._arg_address = ctypes.addressof(self._arg_array)
        self._launch = _cu.cuLaunchKernel

    def set_max_dynamic_shared_memory(self, nbytes: int) -> None:
        attr = _cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(_cu.cuFuncSetAttribute(self.handle, attr, nbytes), f"cuFuncSetAttribute({self.name})")

    def attribute(self, name: str) -> int:
        attr = getattr(_cu.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name.upper()}")
        return check(_cu.cuFuncGetAttribute(attr, self.handle), f"cuFuncGetAttribute({self.name})")

    def launch_params(self, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int, stream: int,
                      params_address: int) -> None:
        """Launch with a params struct packed elsewhere: ``params_address`` is the address of a one-pointer
        array pointing at it (``BoundParams.address``)."""
        handle = _streams.get(stream) or stream_handle(stream)
        err = self._launch(self.handle, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared_mem,
                           handle, params_address, 0)[0]
        if err != _SUCCESS:
            check((err,), f"cuLaunchKernel({self.name})")

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int, stream: int,
               *params) -> None:
        """Launch with the params struct's fields in declaration order (pointers as integer addresses)."""
        self._packer.pack_into(self._buffer, 0, *params)
        handle = _streams.get(stream) or stream_handle(stream)
        err = self._launch(self.handle, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared_mem,
                           handle, self._arg_address, 0)[0]
        if err != _SUCCESS:
            check((err,), f"cuLaunchKernel({self.name})")


class Module:
    """A cubin loaded into the current context of one device."""

    def __init__(self, cubin: bytes, device: int):
        ensure_context(device)
        self.device = device
        self._image = cubin  # the driver reads the image during the call only; keep it for clarity
        self.handle = check(_cu.cuModuleLoadData(cubin), "cuModuleLoadData")

    def function(self, name: str, params_format: str, params_size: int) -> Function:
        handle = check(_cu.cuModuleGetFunction(self.handle, name.encode()), f"cuModuleGetFunction({name})")
        return Function(name, handle, params_format, params_size)
