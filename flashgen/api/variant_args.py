"""A variant's ``run()`` keywords: checked at the API edge, packed into the kernel params' ``VariantParams``.

A spec with a ``Variant`` declares tensors and scalars by name; every ``run()`` of its wrapper takes each of them
by keyword (``wrapper.run(q, kv, doc_ids=ids, bias=0.5)``). ``VariantArgs.write`` checks them (the set of names;
a tensor's dtype, rank and device; a scalar's type and range: a ``TypeError`` / ``ValueError`` naming the
argument) and packs them with one ``pack_into`` at the offset of the params' ``variant`` field, after the rest of
the params were written for the launch. Scalars are runtime values: a new value is a new pack, never a new
kernel. Cost: a few attribute compares per declaration, no torch call beyond ``data_ptr`` / ``stride``.

Under a CUDA graph the values packed when the graph was captured are the ones it replays (kernel params are
captured by value): keep the tensors at their addresses and re-capture for new scalars.
"""

from __future__ import annotations

import math
import operator
import struct

import torch

from ..kernels import VARIANT_FIELD, ParamsLayout, variant_layout
from ..spec import Variant

TORCH = {"bool": torch.bool, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
         "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_INT_RANGE = {"int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1)}
_F32_MAX = 3.4028234663852886e38


class VariantArgs:
    """The checks and the packing of one variant's ``run()`` keywords for one kernel's params ``layout``.

    >>> args = VariantArgs(spec.variant, kernel.params["prefill"], torch.device("cuda", 0))
    >>> args.write(bound.buffer, {"doc_ids": ids})   # ids: int32 [n] on cuda:0
    """

    __slots__ = ("variant", "device", "_packer", "_offset", "_names", "_tensors", "_scalars", "_empty")

    def __init__(self, variant: Variant, layout: ParamsLayout, device: torch.device):
        self.variant, self.device = variant, device
        self._packer = struct.Struct(variant_layout(variant).format)
        self._offset = variant_offset(layout)
        self._tensors = tuple((t.name, TORCH[t.dtype], t.rank) for t in variant.tensors)
        self._scalars = tuple((s.name, s.dtype) for s in variant.scalars)
        self._names = frozenset(n for n, *_ in (*self._tensors, *self._scalars))
        self._empty = not self._names

    def write(self, buffer, kwargs: dict) -> None:
        """Check ``kwargs`` (the declared names exactly) and pack them into the params ``buffer``."""
        if kwargs.keys() != self._names:
            raise TypeError(self._names_error(kwargs))
        if self._empty:
            return
        values = []
        for name, dtype, rank in self._tensors:
            t = kwargs[name]
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != rank or t.device != self.device:
                raise self._tensor_error(name, t, dtype, rank)
            values.append(t.data_ptr())
            values.extend(t.stride())
        for name, dtype in self._scalars:
            values.append(_scalar(name, kwargs[name], dtype))
        self._packer.pack_into(buffer, self._offset, *values)

    def _names_error(self, kwargs: dict) -> str:
        declared = ", ".join(sorted(self._names)) or "none"
        missing = sorted(self._names - kwargs.keys())
        unknown = sorted(kwargs.keys() - self._names)
        parts = ([f"missing the variant's argument(s) {', '.join(missing)}"] if missing else []) + (
            [f"got unexpected keyword argument(s) {', '.join(unknown)}"] if unknown else [])
        return f"run(): {'; '.join(parts)} (variant {self.variant.uri} declares: {declared})"

    def _tensor_error(self, name: str, t, dtype: torch.dtype, rank: int) -> Exception:
        want = f"a {str(dtype).replace('torch.', '')} tensor of rank {rank} on {self.device}"
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{name}: got {type(t).__name__}, expected {want} (a variant tensor)")
        return ValueError(f"{name}: got a {str(t.dtype).replace('torch.', '')} tensor of rank {t.dim()} on "
                          f"{t.device}, expected {want} (a variant tensor)")


def _scalar(name: str, value, dtype: str):
    """A declared scalar's value as its C type takes it, or an error naming it."""
    if dtype == "float32":
        try:
            if isinstance(value, (bool, str, bytes)):
                raise TypeError
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{name}: got {value!r}, expected a number (a float32 variant scalar)") from None
        if not math.isfinite(number) or abs(number) > _F32_MAX:
            raise ValueError(f"{name}: got {value!r}, expected a finite float32 (a variant scalar)")
        return number
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: got {value!r}, expected an int (an {dtype} variant scalar)") from None
    lo, hi = _INT_RANGE[dtype]
    if not lo <= number <= hi:
        raise ValueError(f"{name}: got {number}, expected an int in [{lo}, {hi}] (an {dtype} variant scalar)")
    return number


def variant_offset(layout: ParamsLayout) -> int:
    """The byte offset of a kernel params ``layout``'s ``VariantParams`` field."""
    return layout.offsets[layout.names().index(VARIANT_FIELD)]


def variant_size(variant: Variant) -> int:
    """The bytes of ``variant``'s ``VariantParams`` (what ``VariantArgs.write`` packs)."""
    return struct.calcsize(variant_layout(variant).format)


def variant_args(spec, layout: ParamsLayout, device: torch.device) -> VariantArgs | None:
    """``VariantArgs`` of ``spec``'s variant for a kernel's params ``layout``, or None without a variant."""
    return None if spec.variant is None else VariantArgs(spec.variant, layout, device)


def write_variant(args: VariantArgs | None, buffer, kwargs: dict) -> None:
    """``args.write``; without a variant, any keyword is refused by name."""
    if args is not None:
        args.write(buffer, kwargs)
    elif kwargs:
        raise TypeError(f"run(): got unexpected keyword argument(s) {', '.join(sorted(kwargs))} (the spec has no "
                        "variant: only a Variant's declared tensors and scalars are passed by keyword)")
