"""fp64 references of the shipped variants, and an evaluator of a traced hook's expression on tensors.

``evaluate(expr, env)`` computes a ``flashgen.spec.trace.Node`` with torch (floats in fp64, ints in int64),
broadcasting the inputs given in ``env`` (hook inputs, declared scalars, declared tensors by name); its int
``//`` and ``%`` floor as the CUDA helpers do. The ``*_ref`` functions compute each example's math directly,
over a grid of ``[heads, qo, kv]`` (or ``[heads]``), independently of the tracer.
"""

from __future__ import annotations

import math

import torch

from ..spec.trace import Node

_DTYPE = {"float": torch.float64, "int": torch.int64, "bool": torch.bool}
_BIN = {"+": torch.add, "-": torch.sub, "*": torch.mul, "/": torch.true_divide, "<": torch.lt, "<=": torch.le,
        ">": torch.gt, ">=": torch.ge, "==": torch.eq, "!=": torch.ne, "&": torch.bitwise_and,
        "|": torch.bitwise_or, "^": torch.bitwise_xor, "<<": torch.bitwise_left_shift,
        ">>": torch.bitwise_right_shift, "minimum": torch.minimum, "maximum": torch.maximum}
_UN = {"exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sqrt": torch.sqrt,
       "abs": torch.abs, "neg": torch.neg, "not": torch.logical_not, "~": torch.bitwise_not}


def evaluate(expr: Node, env: dict) -> torch.Tensor:
    """The value of a traced expression; ``env`` maps input / scalar / tensor names to tensors or numbers."""
    op, args = expr.op, expr.args
    if op == "const":
        return torch.tensor(expr.value, dtype=_DTYPE[expr.type])
    if op in ("input", "scalar"):
        return torch.as_tensor(env[expr.value]).to(_DTYPE[expr.type])
    vals = [evaluate(a, env) for a in args]
    if op == "load":
        table = torch.as_tensor(env[expr.value])
        index = torch.broadcast_tensors(*vals)
        return table[tuple(i.long() for i in index)].to(_DTYPE[expr.type])
    if op == "cast":
        return vals[0].to(_DTYPE[expr.type])
    if op == "where":
        return torch.where(*vals)
    if op == "floor":
        return torch.floor(vals[0]).to(torch.int64)
    if op == "//":
        return torch.floor_divide(*vals) if expr.type == "int" else torch.floor(vals[0] / vals[1])
    if op == "%":
        return torch.remainder(*vals)
    if op == "**":
        return torch.pow(*vals)
    if op in _BIN:
        return _BIN[op](*vals)
    return _UN[op](vals[0])


def _grid(heads: int, qo_len: int, kv_len: int):
    h = torch.arange(heads).view(-1, 1, 1)
    q = torch.arange(qo_len).view(1, -1, 1)
    k = torch.arange(kv_len).view(1, 1, -1)
    return h, q, k


def sink_ref(sinks: torch.Tensor) -> torch.Tensor:
    """[heads]: the logit each head adds to its softmax denominator."""
    return sinks.double()


def document_ref(doc_ids: torch.Tensor, qo_len: int, kv_len: int) -> torch.Tensor:
    """[qo, kv] bool: same document."""
    return doc_ids[:qo_len].view(-1, 1) == doc_ids[:kv_len].view(1, -1)


def tree_ref(ancestors: torch.Tensor, qo_len: int, kv_len: int) -> torch.Tensor:
    """[qo, kv] bool: bit kv of ancestors[qo]."""
    bits = [[bool((int(ancestors[i]) >> j) & 1) for j in range(kv_len)] for i in range(qo_len)]
    return torch.tensor(bits, dtype=torch.bool)


def t5_bucket_ref(rel: int, num_buckets: int = 32, max_distance: int = 128) -> int:
    """T5's bidirectional bucket of one relative position, in plain Python (fp64)."""
    half = num_buckets // 2
    exact = half // 2
    n = abs(rel)
    if n < exact:
        bucket = n
    else:
        large = exact + math.log((n + 1e-6) / exact) / math.log(max_distance / exact) * (half - exact)
        bucket = int(math.floor(min(max(large, 0.0), half - 1.0)))
    return (half if rel > 0 else 0) + bucket


def t5_bias_ref(logits: torch.Tensor, rel_bias: torch.Tensor) -> torch.Tensor:
    """[heads, qo, kv] logits plus ``rel_bias[h, bucket(kv - qo)]``."""
    heads, qo_len, kv_len = logits.shape
    buckets = torch.tensor([[t5_bucket_ref(k - q) for k in range(kv_len)] for q in range(qo_len)])
    return logits.double() + rel_bias.double()[:, buckets]


def alibi_ref(logits: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
    """[heads, qo, kv] logits plus ``slopes[h] * (kv - qo)``."""
    h, q, k = _grid(*logits.shape)
    return logits.double() + slopes.double()[h] * (k - q)


def sigmoid_ref(logits: torch.Tensor, bias: float) -> torch.Tensor:
    """[heads, qo, kv] weights ``sigmoid(logit + bias)``."""
    return torch.sigmoid(logits.double() + bias)


def prefix_lm_ref(prefix_len: int, qo_len: int, kv_len: int) -> torch.Tensor:
    """[qo, kv] bool: causal, and the prefix sees itself both ways."""
    q = torch.arange(qo_len).view(-1, 1)
    k = torch.arange(kv_len).view(1, -1)
    return (k <= q) | (k < prefix_len)
