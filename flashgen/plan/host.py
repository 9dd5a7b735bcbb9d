"""Host-array intake for the planner: everything it reads must already live on the host.

Planning never synchronises with a GPU. A CUDA tensor handed to a planning call would force a
device-to-host copy (a sync), so it is refused with an error that names the argument instead.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch


_INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
_INT_DTYPE_SET = frozenset(_INT_DTYPES)
_INT32_64 = frozenset(np.dtype(t).char for t in (np.int32, np.int64))  # numpy's own int32 / int64 (no copy needed)


class PlanError(ValueError):
    """A planning input is invalid; the message names the argument (and position, where there is one)."""


def host_array(name: str, value: object, ndim: int = 1, error: type[PlanError] = PlanError) -> np.ndarray:
    """Return ``value`` as an int32 or int64 numpy array with ``ndim`` dimensions, without touching a GPU.

    Accepts numpy arrays, Python sequences and CPU torch tensors of an integer dtype; raises ``error``.

    >>> host_array("kv_indptr", [0, 2, 5])
    array([0, 2, 5])
    """
    if type(value) is np.ndarray and value.dtype.char in _INT32_64 and value.ndim == ndim:
        return value  # the common case, taken first (a plan() passes several such arrays)
    if isinstance(value, torch.Tensor):
        # a plain tensor's is_cpu is its device; a subclass may say otherwise in its device
        if not (value.is_cpu and type(value) is torch.Tensor) and (value.is_cuda or value.device.type != "cpu"):
            raise _on_device(name, value, error)
        dtype = value.dtype
        if dtype not in _INT_DTYPE_SET:
            raise error(f"{name}: dtype {value.dtype}, expected an integer dtype")
        array = value.numpy()
        if array.ndim != ndim:
            raise error(f"{name}: has shape {tuple(array.shape)}, expected {ndim} dimension(s)")
        return array if dtype is torch.int32 or dtype is torch.int64 else array.astype(np.int64)
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        if array.size == 0 and array.dtype.kind == "f":
            array = array.astype(np.int64)
        else:
            raise error(f"{name}: dtype {array.dtype}, expected an integer dtype")
    if array.ndim != ndim:
        raise error(f"{name}: has shape {tuple(array.shape)}, expected {ndim} dimension(s)")
    return array if array.dtype.kind == "i" and array.itemsize in (4, 8) else array.astype(np.int64)



def _on_device(name: str, value: torch.Tensor, error: type[Exception]) -> Exception:
    return error(f"{name}: is a {value.device.type} tensor; planning reads host arrays only (pass the CPU copy "
                 f"you built it from, so that planning never synchronises with the device)")


def host_values(name: str, value: object, error: type[PlanError] = PlanError) -> np.ndarray:
    """``value`` as a numpy array of any dtype (a CPU tensor's own memory), without touching a GPU: a device
    tensor raises ``error`` naming ``name``. Shapes and dtypes are the caller's to check (``host_array`` checks
    integer vectors itself).

    >>> host_values("page_mask", torch.tensor([True, False])).tolist()
    [True, False]
    """
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise _on_device(name, value, error)
        return value.numpy()
    return np.asarray(value)


def is_int_vector(value: object) -> bool:
    """Whether ``value`` is a 1-D integer CPU tensor, which ``host_array`` takes as it is (then its ``tolist()``
    costs less than its numpy view's: ~1 us a call on a small host)."""
    return type(value) is torch.Tensor and value.is_cpu and value.dtype in _INT_DTYPE_SET and value.dim() == 1


def host_list(name: str, value: object, error: type[PlanError] = PlanError) -> list:
    """``host_array(name, value).tolist()``, with its checks and errors.

    >>> host_list("kv_lens", torch.tensor([3, 9], dtype=torch.int32))
    [3, 9]
    """
    return value.tolist() if is_int_vector(value) else host_array(name, value, 1, error).tolist()


def check_int(name: str, value: object, minimum: int, *, optional: bool = False, note: str = "",
              error: type[Exception] = PlanError) -> int | None:
    """``value`` as an int >= ``minimum`` (numpy's ints too; a bool or a float is refused), or ``error`` naming
    it (``note`` ends its message); with ``optional``, None passes through. The one check of the planners' and
    wrappers' sizes and counts.

    >>> check_int("num_sms", 132, 1), check_int("capacity", None, 0, optional=True)
    (132, None)
    """
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise error(f"{name}: got {value!r}, expected {'None or ' if optional else ''}an int >= {minimum}{note}")
    return int(value)


def check_heads(num_qo_heads: object, num_kv_heads: object) -> None:
    """``PlanError`` unless the head counts are ints >= 1 and ``num_kv_heads`` divides ``num_qo_heads``."""
    if (type(num_qo_heads) is int and type(num_kv_heads) is int and num_qo_heads > 0 and num_kv_heads > 0
            and not num_qo_heads % num_kv_heads):
        return
    check_int("num_qo_heads", num_qo_heads, 1)
    check_int("num_kv_heads", num_kv_heads, 1)
    if num_qo_heads % num_kv_heads:
        raise PlanError(f"num_qo_heads: {num_qo_heads} is not a multiple of num_kv_heads = {num_kv_heads}")
