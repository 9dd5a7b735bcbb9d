"""What a traced variant hook may call besides operators: ``where``, ``exp``, ``log``, ``tanh``, ``sigmoid``,
``sqrt``, ``minimum``, ``maximum``, ``abs``, ``floor`` (``torch.where``, ``torch.exp``, ... on traced values work too), and the
``mask_tile`` results ``TILE_EMPTY`` / ``TILE_PARTIAL`` / ``TILE_FULL``.

Example::

    from flashgen import variant_ops as ops
    softcap = lambda score: 30.0 * ops.tanh(score / 30.0)
"""

from __future__ import annotations

from .spec.trace import TILE_EMPTY, TILE_FULL, TILE_PARTIAL, call


def where(cond, a, b):
    """``a`` where ``cond`` holds, else ``b`` (C's ``?:``; both sides are computed)."""
    return call("where", cond, a, b)


def exp(x):
    return call("exp", x)


def log(x):
    return call("log", x)


def tanh(x):
    return call("tanh", x)


def sigmoid(x):
    return call("sigmoid", x)


def sqrt(x):
    return call("sqrt", x)


def floor(x):
    """The int at or below ``x`` (Python's ``math.floor``): how a float becomes an index."""
    return call("floor", x)


def minimum(a, b):
    return call("minimum", a, b)


def maximum(a, b):
    return call("maximum", a, b)


def abs(x):  # noqa: A001 (the name users expect)
    return call("abs", x)


__all__ = ["where", "exp", "log", "tanh", "sigmoid", "sqrt", "minimum", "maximum", "abs", "floor",
           "TILE_EMPTY", "TILE_PARTIAL", "TILE_FULL"]
