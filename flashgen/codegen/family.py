"""Kernel families: what an ``op`` name means to codegen.

A family turns a spec into everything its template needs (the context), names its entry points and
declares each entry point's params struct. Families register themselves by op name; ``render`` and
``build`` look them up here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import AttentionSpec, SpecError
from .params import Param, ParamsLayout
from .render import render_template


@dataclass(frozen=True)
class EntryPoint:
    """An ``extern "C" __global__`` function of a family and the params struct it takes."""

    name: str
    params: ParamsLayout


class KernelFamily:
    """Base class. Subclasses set ``op`` and ``template`` and implement the three hooks."""

    op: str = ""
    template: str = ""

    def project(self, spec: object) -> object:
        """The spec this family compiles: reduce a general spec to the fields the family depends on."""
        return spec

    def check(self, spec: object) -> None:
        """Raise ``SpecError`` for specs this family cannot compile (names the field and why)."""

    def context(self, spec: object) -> dict:
        raise NotImplementedError

    def entry_points(self, spec: object) -> tuple[EntryPoint, ...]:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ shared

    def uri(self, spec: object) -> str:
        return f"{self.op}_{spec.uri}"

    def render(self, spec: object) -> str:
        spec = self.project(spec)
        self.check(spec)
        context = dict(self.context(spec))
        context["uri"] = self.uri(spec)
        entries = self.entry_points(spec)
        structs = {e.params.struct_name: e.params for e in entries}
        context["structs"] = [layout.context() for layout in structs.values()]
        context["entry_points"] = [{"name": e.name, "struct_name": e.params.struct_name} for e in entries]
        return render_template(self.template, context, self.uri(spec))



class AttentionFamily(KernelFamily):
    """A family compiled from an ``AttentionSpec`` (decode, prefill, prefill_sm90): ``project`` refuses
    anything else; subclasses that drop fields call it first."""

    def project(self, spec: object) -> AttentionSpec:
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec: got {type(spec).__name__}, expected AttentionSpec")
        return spec

_FAMILIES: dict[str, KernelFamily] = {}


def register(family: KernelFamily) -> KernelFamily:
    _FAMILIES[family.op] = family
    return family


def family(op: str) -> KernelFamily:
    if op not in _FAMILIES:
        raise SpecError(f"op: got {op!r}, expected one of {', '.join(sorted(_FAMILIES))}")
    return _FAMILIES[op]


def ops() -> tuple[str, ...]:
    return tuple(sorted(_FAMILIES))


def struct(name: str, *fields: tuple[str, str]) -> ParamsLayout:
    """``struct("MergeParams", ("const float*", "s"), ...)``: a params layout from (ctype, name) pairs."""
    return ParamsLayout.of(name, tuple(Param(n, t) for t, n in fields))
