"""Argument checks at the API edge: every error names the argument and what was expected."""

from __future__ import annotations

import torch

from ..plan.host import check_int


def check_tensor(name: str, t: object, *, dtypes: tuple[torch.dtype, ...] | None = None, ndim: int | None = None,
                 device: torch.device | None = None, contiguous: bool = True, align: int = 0) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    if device is None and not t.is_cuda:
        raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (strides {t.stride()} for shape {tuple(t.shape)})")
    if align and t.numel() and t.data_ptr() % align:
        raise ValueError(f"{name}: expected data aligned to {align} bytes (a view with an odd storage offset?)")
    return t


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def check_count(name: str, value, minimum: int = 1) -> int | None:
    """None, or ``value`` as an int >= ``minimum`` (numpy ints included), else ``ValueError`` naming it: the
    wrappers' constructor arguments (sizes, capacities)."""
    return check_int(name, value, minimum, optional=True, error=ValueError)
