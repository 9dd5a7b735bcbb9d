"""Kernel parameter structs: declared once in Python, rendered into C++, packed on the host by name.

Each entry point takes one ``const __grid_constant__ Params`` argument. Python decides its fields; the
template renders the struct with a ``static_assert`` on every offset and the size, so a host/device layout
mismatch fails at compile time, not as a wrong answer. Values are packed by field name (``BoundParams``):
``plan()`` gives every plan-time field by name, checked against the layout, and ``run()`` writes only the
run-time fields (tensor addresses, tensor maps) at their offsets, so no value can land in its neighbour's
slot.
"""

from __future__ import annotations

import ctypes
import operator
import struct
from dataclasses import dataclass
from typing import Mapping, Sequence

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
# the value a run-time field holds in the plan-time packing, until run() writes it
_ZERO = {"float": 0.0, "double": 0.0, "CUtensorMap": b""}


@dataclass(frozen=True)
class Param:
    """One field. ``ctype`` is a C++ type; pointer fields spell it in full (``const float*``). ``blob``: ``(size,
    align)`` of a struct the host packs as opaque bytes (a variant's ``VariantParams``), else empty."""

    name: str
    ctype: str
    blob: tuple = ()

    @property
    def kind(self) -> str:
        return "blob" if self.blob else "ptr" if self.ctype.endswith("*") else self.ctype

    @property
    def code(self) -> tuple[str, int, int]:
        """(struct-module code, size, alignment)."""
        return (f"{self.blob[0]}s", *self.blob) if self.blob else _CTYPES[self.kind]


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
            if field.kind not in _CTYPES and not field.blob:
                raise ValueError(f"param {field.name}: unsupported C type {field.ctype!r}")
            code, size, align = field.code
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

    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def bind(self, runtime: Sequence[str]) -> "BoundParams":
        """A params buffer of this layout whose ``runtime`` fields (in declaration order) are written at run()
        and every other field at plan(), by name (``BoundParams``)."""
        return BoundParams(self, tuple(runtime))


class BoundParams:
    """One packed params struct: plan-time fields by name (``pack``), run-time fields by position (``set``).

    ``pack(fields)`` checks the names once (exactly the layout's fields but the run-time ones, else a
    ``ValueError`` naming the missing and unexpected ones) and packs all of them with one ``pack_into``;
    ``set(*values)`` writes the run-time fields, in declaration order, with one ``pack_into`` per run of
    adjacent run-time fields (decode: two, q..lse and the KV strides). ``address`` is what
    ``cuLaunchKernel`` takes as its kernel-parameter array (``Function.launch_params``); the driver copies the
    struct at launch, so ``set`` may rewrite it for the next launch at once.

    >>> layout = ParamsLayout.of("P", (Param("q", "const float*"), Param("n", "int32_t"), Param("s", "float")))
    >>> bound = layout.bind(("q",))
    >>> bound.pack({"n": 3, "s": 0.5}); bound.set(4096)
    >>> struct.unpack(layout.format, bytes(bound.buffer))
    (4096, 3, 0.5)
    """

    __slots__ = ("layout", "runtime", "buffer", "address", "set", "_plan_names", "_expected", "_packer",
                 "_plan_packer", "_args", "_take")

    def __init__(self, layout: ParamsLayout, runtime: tuple[str, ...]):
        names = layout.names()
        unknown = [n for n in runtime if n not in names]
        if unknown:
            raise ValueError(f"{layout.struct_name}: run-time fields {unknown} are not fields of the struct")
        if list(runtime) != [n for n in names if n in runtime]:
            raise ValueError(f"{layout.struct_name}: run-time fields {list(runtime)} are not in declaration order")
        self.layout, self.runtime = layout, runtime
        self._plan_names = tuple(n for n in names if n not in runtime)
        self._expected = frozenset(self._plan_names)
        self._packer = struct.Struct(layout.format)
        self._plan_packer = self._plan_struct()
        names = self._plan_names
        self._take = (operator.itemgetter(*names) if len(names) > 1 else
                      (lambda fields: (fields[names[0]],)) if names else (lambda fields: ()))
        self.buffer = (ctypes.c_char * max(layout.size, 8))()
        self._args = (ctypes.c_void_p * 1)(ctypes.addressof(self.buffer))
        self.address = ctypes.addressof(self._args)
        self.set = self._setter()

    def _groups(self) -> list[tuple[struct.Struct, int, int]]:
        """``(packer, offset, count)`` for each run of adjacent run-time fields."""
        groups, fields, offsets = [], self.layout.fields, self.layout.offsets
        i = 0
        while i < len(fields):
            if fields[i].name not in self.runtime:
                i += 1
                continue
            j, fmt, end = i, "<", offsets[i]
            while j < len(fields) and fields[j].name in self.runtime:
                fmt += "x" * (offsets[j] - end) + fields[j].code[0]
                end = offsets[j] + fields[j].code[1]
                j += 1
            groups.append((struct.Struct(fmt), offsets[i], j - i))
            i = j
        return groups

    def _setter(self):
        buf, groups = self.buffer, self._groups()
        if not groups:
            return lambda: None
        if len(groups) == 1:
            pack_a, at_a = groups[0][0].pack_into, groups[0][1]
            return lambda *values: pack_a(buf, at_a, *values)
        if len(groups) == 2:
            (a, at_a, n), (b, at_b, _) = groups
            pack_a, pack_b = a.pack_into, b.pack_into

            def set_two(*values):
                pack_a(buf, at_a, *values[:n])
                pack_b(buf, at_b, *values[n:])
            return set_two

        def set_many(*values):
            start = 0
            for packer, at, count in groups:
                packer.pack_into(buf, at, *values[start: start + count])
                start += count
        return set_many

    def pack(self, fields: Mapping[str, object]) -> None:
        """Pack the plan-time ``fields`` (name -> value: pointers as integer addresses, tensor maps as 128
        bytes); the run-time fields are zeroed until ``set``."""
        if fields.keys() != self._expected:
            missing = sorted(self._expected - fields.keys())
            extra = sorted(fields.keys() - self._expected)
            raise ValueError(f"{self.layout.struct_name}: plan-time fields do not match the struct (missing "
                             f"{missing}, unexpected {extra}; run-time fields {list(self.runtime)})")
        values = self._take(fields)
        try:
            self._plan_packer.pack_into(self.buffer, 0, *values)
        except struct.error as exc:
            kinds = {f.name: f for f in self.layout.fields}
            bad = [f"{name}={v!r}" for name, v in zip(self._plan_names, values) if not _fits(kinds[name], v)]
            raise ValueError(f"{self.layout.struct_name}: {exc} ({', '.join(bad) or 'a value of the wrong type'})")

    def _plan_struct(self) -> struct.Struct:
        """The layout's ``struct`` with every run-time field as pad bytes: one ``pack_into`` of the plan-time
        values, in declaration order, writes the whole struct, zeros in the run-time fields (``set`` fills them)."""
        fmt, end = "<", 0
        for field, offset in zip(self.layout.fields, self.layout.offsets):
            code, size, _ = field.code
            fmt += "x" * (offset - end) + (code if field.name in self._expected else f"{size}x")
            end = offset + size
        packer = struct.Struct(fmt + "x" * (self.layout.size - end))
        assert packer.size == self.layout.size, (self.layout.struct_name, packer.size, self.layout.size)
        return packer

    def values(self) -> dict[str, object]:
        """Every field's value as packed now, by name (``struct.unpack`` of the buffer): for tests and debugging."""
        return dict(zip(self.layout.names(), self._packer.unpack(bytes(self.buffer)[: self.layout.size])))


def _fits(field: Param, value: object) -> bool:
    code = field.code[0]
    try:
        struct.pack("<" + code, value)
        return True
    except struct.error:
        return False
