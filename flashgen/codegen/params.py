"""Kernel parameter structs: declared once in Python, rendered into C++, packed on the host.

Each entry point takes one ``const __grid_constant__ Params`` argument. Python decides its fields; the
template renders the struct with a ``static_assert`` on every offset and the size, so a host/device layout
mismatch fails at compile time, not as a wrong answer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

# C++ type -> (struct-module code, size, alignment) for the x86-64 / CUDA ABI
_CTYPES = {
    "ptr": ("Q", 8, 8),  # any pointer, passed as an integer address
    "int64_t": ("q", 8, 8),
    "uint64_t": ("Q", 8, 8),
    "int32_t": ("i", 4, 4),
    "uint32_t": ("I", 4, 4),
    "float": ("f", 4, 4),
    "double": ("d", 8, 8),
    # TMA descriptor (cuda.h), filled with the 128 opaque bytes of cuTensorMapEncodeTiled; 128-byte aligned as
    # CUDA 13's cuda.h declares it (CUDA 12's says 64): a struct holding one is rendered alignas(128), so its size
    # is the same under either toolkit
    "CUtensorMap": ("128s", 128, 128),
}


@dataclass(frozen=True)
class Param:
    """One field. ``ctype`` is a C++ type; pointer fields spell it in full (``const float*``)."""

    name: str
    ctype: str

    @property
    def kind(self) -> str:
        return "ptr" if self.ctype.endswith("*") else self.ctype


@dataclass(frozen=True)
class ParamsLayout:
    """Field offsets and the packed size of a params struct, with the ``struct`` format that fills it."""

    struct_name: str
    fields: tuple[Param, ...]
    offsets: tuple[int, ...]
    size: int
    format: str
    align: int = 8

    @classmethod
    def of(cls, struct_name: str, fields: tuple[Param, ...]) -> "ParamsLayout":
        offset, max_align, fmt, offsets = 0, 1, "<", []
        for field in fields:
            if field.kind not in _CTYPES:
                raise ValueError(f"param {field.name}: unsupported C type {field.ctype!r}")
            code, size, align = _CTYPES[field.kind]
            pad = -offset % align
            fmt += "x" * pad + code
            offset += pad
            offsets.append(offset)
            offset += size
            max_align = max(max_align, align)
        size = offset + (-offset % max_align)
        fmt += "x" * (size - offset)
        return cls(struct_name, tuple(fields), tuple(offsets), size, fmt, max_align)

    def packer(self) -> struct.Struct:
        return struct.Struct(self.format)

    def context(self) -> dict:
        """What ``templates/params.j2`` needs to render the struct and its static_asserts."""
        return {
            "struct_name": self.struct_name,
            "fields": [{"name": f.name, "ctype": f.ctype, "offset": o} for f, o in zip(self.fields, self.offsets)],
            "size": self.size,
            "align": self.align,
        }
