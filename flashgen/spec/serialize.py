"""Specs to and from plain dicts (JSON), for AOT build plans and the command line."""

from __future__ import annotations

from dataclasses import fields

from .append import AppendSpec
from .attention import AttentionSpec, MergeSpec
from .parts import KV_LAYOUTS, MASKS, POS_ENCODINGS, ROPE_SCALINGS, SpecError
from .variant import Variant

_PARTS = {cls.__name__: cls for cls in (*KV_LAYOUTS, *MASKS, *POS_ENCODINGS, *ROPE_SCALINGS, Variant)}
_SPECS = {cls.__name__: cls for cls in (AttentionSpec, AppendSpec, MergeSpec)}


def _part_to_dict(part: object) -> object:
    if isinstance(part, Variant):  # hooks as their canonical CUDA text: a traced hook reloads as a snippet
        return {"type": "Variant", **part.to_dict()}
    if part is None or not hasattr(part, "__dataclass_fields__"):
        return part
    return {"type": type(part).__name__, **{f.name: _part_to_dict(getattr(part, f.name)) for f in fields(part)}}


def spec_to_dict(spec: object) -> dict:
    """``{"type": "AttentionSpec", "head_dim": 128, "kv_layout": {"type": "Paged", "page_size": 16, ...}, ...}``"""
    return {"type": type(spec).__name__, **{f.name: _part_to_dict(getattr(spec, f.name)) for f in fields(spec)}}


def _part_from_dict(field: str, value: object) -> object:
    if not isinstance(value, dict):
        return value
    kind = value.get("type")
    if kind not in _PARTS:
        raise SpecError(f"{field}.type: got {kind!r}, expected one of {', '.join(sorted(_PARTS))}")
    try:
        return _PARTS[kind](**{k: _part_from_dict(f"{field}.{k}", v) for k, v in value.items() if k != "type"})
    except TypeError as exc:
        raise SpecError(f"{field}: {exc}") from exc


def spec_from_dict(data: dict) -> object:
    kind = data.get("type", "AttentionSpec")
    if kind not in _SPECS:
        raise SpecError(f"type: got {kind!r}, expected one of {', '.join(sorted(_SPECS))}")
    values = {k: _part_from_dict(k, v) for k, v in data.items() if k != "type"}
    try:
        return _SPECS[kind](**values)
    except TypeError as exc:
        raise SpecError(f"{kind}: {exc}") from exc
