"""fp64 references of the shipped variants, and an evaluator of a traced hook's expression on tensors.

``evaluate(expr, env)`` computes a ``flashgen.spec.trace.Node`` with torch (floats in fp64, ints in int64),
broadcasting the inputs given in ``env`` (hook inputs, declared scalars, declared tensors by name; ``distance``,
unless given, from ``kv_idx`` and ``qo_idx``); its int
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
    if op == "input" and expr.value == "distance" and "distance" not in env:  # kv_idx - qo_idx, exact in fp64
        return torch.as_tensor(env["kv_idx"]).double() - torch.as_tensor(env["qo_idx"]).double()
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


def tile_class(variant, qo_begin: int, qo_end: int, kv_begin: int, kv_end: int, args: dict) -> int:
    """The class ``variant.mask_tile`` (traced) gives the tile ``[qo_begin, qo_end) x [kv_begin, kv_end)`` of batch 0,
    head 0 with the declared tensors and scalars ``args``, after checking it against ``variant.mask`` over the
    tile's pairs: ``AssertionError`` naming the tile where TILE_EMPTY (0) keeps a pair or TILE_FULL (2) hides one."""
    env = {"qo_begin": qo_begin, "qo_end": qo_end, "kv_begin": kv_begin, "kv_end": kv_end, "batch": 0,
           "qo_head": 0, "kv_head": 0, **args}
    cls = int(evaluate(variant.mask_tile.expr, env))
    keep = evaluate(variant.mask.expr, {**env, "qo_idx": torch.arange(qo_begin, qo_end).view(-1, 1),
                                        "kv_idx": torch.arange(kv_begin, kv_end).view(1, -1)})
    tile = f"q [{qo_begin}, {qo_end}) x kv [{kv_begin}, {kv_end})"
    assert cls != 0 or not keep.any(), f"mask_tile says EMPTY for {tile}, where the mask keeps a pair"
    assert cls != 2 or keep.all(), f"mask_tile says FULL for {tile}, where the mask hides a pair"
    return cls


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


# ---------------------------------------------------------------------------------------------- attention

EXAMPLE_NAMES = ("sink", "document", "document_tiled", "tree", "t5_bias", "alibi", "sigmoid", "prefix_lm", "qk_gain")
GAIN_DIM = 256  # the qk_gain example's tables cover head dims up to this


def example_args(name: str, *, heads: int, max_kv: int, batch: int, generator=None, device="cpu") -> dict:
    """Fresh random ``run()`` arguments of shipped example ``name`` (``flashgen.variants.examples.EXAMPLES``):
    per-head tables for ``heads`` q heads, per-position tensors for positions below ``max_kv``, per-request ones
    for ``batch`` requests. The tree example's ancestor bits cover positions below 64 (``max_kv <= 64``)."""
    g = generator
    if name == "sink":
        args = {"sinks": torch.randn(heads, generator=g) * 2.0}
    elif name in ("document", "document_tiled"):  # ids non-decreasing; documents of 1 .. 24 tokens, or (tiled)
        # 1 .. 150, so that whole tiles fall inside one document (TILE_FULL) as well as before it (TILE_EMPTY)
        lengths = torch.randint(1, 25 if name == "document" else 151, (max_kv,), generator=g)
        args = {"doc_ids": torch.repeat_interleave(torch.arange(max_kv), lengths)[:max_kv].int()}
    elif name == "tree":  # bit j of row i: j <= i and a random ancestor relation (every token sees itself)
        if max_kv > 64:
            raise ValueError(f"max_kv: got {max_kv}, the tree example's bits cover 64 positions")
        bits = (torch.rand(max_kv, max_kv, generator=g) < 0.5).tril() | torch.eye(max_kv, dtype=torch.bool)
        words = torch.zeros(max_kv, dtype=torch.int64)
        for j in range(max_kv):  # bit 63 is the sign bit of the int64 word
            words |= bits[:, j].long() << j
        args = {"ancestors": words}
    elif name == "t5_bias":
        # distances 16, 32 and 64 sit on bucket edges (the log lands on an integer: 10, 12, 14 in fp64, where fp32
        # may floor one lower), so those bucket pairs share their bias: the check does not hinge on a rounding
        table = torch.randn(heads, 32, generator=g)
        for edge in (10, 12, 14):
            table[:, edge - 1] = table[:, edge]
            table[:, 16 + edge - 1] = table[:, 16 + edge]
        args = {"rel_bias": table}
    elif name == "alibi":
        args = {"slopes": torch.rand(heads, generator=g) * 0.5}
    elif name == "sigmoid":
        args = {"bias": float(torch.tensor(-math.log(max_kv), dtype=torch.float32))}  # an fp32 value, as run() packs
    elif name == "prefix_lm":
        args = {"prefix_len": torch.randint(0, max_kv + 1, (batch,), generator=g).int()}
    elif name == "qk_gain":  # gains in [0.25, 1.75) a (head, dim); k's table has a row for every q head (>= kv heads)
        args = {"q_gain": torch.rand(heads, GAIN_DIM, generator=g) * 1.5 + 0.25,
                "k_gain": torch.rand(heads, GAIN_DIM, generator=g) * 1.5 + 0.25}
    else:
        raise ValueError(f"name: got {name!r}, expected one of {', '.join(EXAMPLE_NAMES)}")
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def qk_gain_ref(q: torch.Tensor, k: torch.Tensor, q_gain: torch.Tensor, k_gain: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The qk_gain example's loads: ``q [n, Hq, D] * q_gain[h, d]`` and ``k [n, Hkv, D] * k_gain[h_kv, d]``, in
    fp64 (fp32 for a lower dtype), each returned in its input's dtype (the kernels round a transformed element to
    it)."""
    def scaled(x, gain):
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        return (x.to(work) * gain[: x.shape[1], : x.shape[2]].to(x.device, work)).to(x.dtype)
    return scaled(q, q_gain), scaled(k, k_gain)


def _square(fn, n: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Rows ``q_pos``, columns ``k_pos`` of ``fn(n)``: a reference over positions 0 .. n - 1 (``[..., n, n]``)."""
    return fn(n)[..., q_pos.long(), :][..., k_pos.long()]


def example_attention(name: str, args: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      k_pos: torch.Tensor, visible: torch.Tensor, sm_scale: float, batch: int = 0,
                      low_precision: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One request of attention with shipped example ``name`` on top: ``q [nq, Hq, D]``, ``k [nk, Hkv, D]``,
    ``v [nk, Hkv, Dv]`` at positions ``q_pos [nq]``, ``k_pos [nk]`` (ints, on the CPU), ``visible [nq, nk]`` the
    spec's own mask; ``args`` its ``run()`` arguments; ``batch`` the request. Returns ``(out [nq, Hq, Dv],
    lse [nq, Hq])`` fp64, built from the ``*_ref`` functions above (not from the traced hooks). The sink joins the
    softmax denominator; sigmoid's weights are summed with no normaliser (its lse is 0). ``low_precision``: the
    matrix products in q's dtype and the softmax in fp32 (the same-dtype error yardstick)."""
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    work = torch.float32 if low_precision else torch.float64
    if not low_precision:
        q, k, v = q.double(), k.double(), v.double()
    if name == "qk_gain":
        q, k = qk_gain_ref(q, k, args["q_gain"].cpu(), args["k_gain"].cpu())
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q, k).to(work) * sm_scale
    n = int(max(int(q_pos.max()) if q_pos.numel() else 0, int(k_pos.max()) if k_pos.numel() else 0)) + 1
    zeros = lambda size: torch.zeros(heads, size, size, dtype=torch.float64)  # noqa: E731
    visible = visible.clone()
    sink = None
    if name == "sink":
        sink = sink_ref(args["sinks"].cpu())
    elif name in ("document", "document_tiled"):
        visible &= _square(lambda m: document_ref(args["doc_ids"].cpu(), m, m), n, q_pos, k_pos)
    elif name == "tree":
        visible &= _square(lambda m: tree_ref(args["ancestors"].cpu(), m, m), n, q_pos, k_pos)
    elif name == "t5_bias":
        logits = logits + _square(lambda m: t5_bias_ref(zeros(m), args["rel_bias"].cpu()), n, q_pos, k_pos).to(work)
    elif name == "alibi":
        logits = logits + _square(lambda m: alibi_ref(zeros(m), args["slopes"].cpu()), n, q_pos, k_pos).to(work)
    elif name == "prefix_lm":
        visible &= _square(lambda m: prefix_lm_ref(int(args["prefix_len"][batch]), m, m), n, q_pos, k_pos)
    if name == "sigmoid":
        w = sigmoid_ref(logits, args["bias"]).to(work).masked_fill(~visible[None], 0.0)
        out = torch.einsum("hqk,khd->qhd", w.to(v.dtype), v)
        return out.to(torch.float64), torch.zeros(q.shape[0], heads, dtype=torch.float64)
    logits = logits.masked_fill(~visible[None], float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True) if logits.shape[-1] else torch.full(
        logits.shape[:-1] + (1,), float("-inf"), dtype=work)
    if sink is not None:
        row_max = torch.maximum(row_max, sink.to(work).view(-1, 1, 1))
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(logits - shift)
    total = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink.to(work).view(-1, 1, 1) - shift)
    lse = (torch.log(total) + shift).squeeze(-1).transpose(0, 1)
    p = p / torch.where(total > 0, total, torch.ones_like(total))
    out = torch.einsum("hqk,khd->qhd", p.to(v.dtype), v)
    return out.to(torch.float64), lse.to(torch.float64)
