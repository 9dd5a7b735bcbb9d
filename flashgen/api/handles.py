"""Integer handles for wrappers: how a ``torch.library`` op (``flashgen.ops``) names the wrapper whose plan it runs.

A wrapper registers itself when it is made (``op_handle``, an int): a compiled graph holds that int as a constant
and the op looks the wrapper up when it runs. Handles are never reused in a process, and the registry holds
wrappers weakly, so a handle outliving its wrapper fails with a clear error instead of running another's plan.
"""

from __future__ import annotations

import itertools
import weakref

_next = itertools.count(1)
_held: dict[int, weakref.ref] = {}


def assign(obj: object) -> int:
    """A new handle for ``obj`` (held weakly: the entry goes when ``obj`` does)."""
    handle = next(_next)
    _held[handle] = weakref.ref(obj, lambda _, h=handle: _held.pop(h, None))
    return handle


def lookup(handle: int) -> object:
    """The live object of ``handle``, or ``ValueError`` naming it."""
    ref = _held.get(handle)
    obj = None if ref is None else ref()
    if obj is None:
        raise ValueError(f"handle: {handle!r} names no live flashgen wrapper (pass a wrapper to flashgen.ops, or "
                         "its op_handle while the wrapper is alive)")
    return obj
