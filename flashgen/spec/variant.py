"""Variant: user-defined attention hooks, written as CUDA snippets or as Python functions traced once.

A hook is either a CUDA snippet (the body of a device function over the hook's named inputs and the variant's
declared tensors and scalars; a lone expression without ``;`` means ``return <expression>;``) or a Python
function whose parameters are named after those inputs (Flex's spellings ``score``, ``b``, ``h``, ``q_idx``
are accepted) and which ``flashgen.spec.trace`` turns into CUDA. Either way the variant keeps the hook's
canonical CUDA text, and that text with the declarations is all that enters the kernel key. Scalars are runtime
parameters and never enter it; whether ``run()`` was given every declared tensor and scalar is checked there.

Hooks (inputs -> result; indices are ``int``, ``logit``/``value``/``distance`` are ``float``):

=============  =========================================================================  ==================
``score``      logit, batch, qo_idx, kv_idx, qo_head, kv_head, distance: the logit after      float
               ``sm_scale``
``mask``       batch, qo_idx, kv_idx, qo_head, kv_head, distance: True keeps the pair         bool
``mask_tile``  batch, qo_head, kv_head, qo_begin, qo_end, kv_begin, kv_end (half-open)        int: TILE_EMPTY /
               -- optional; must agree with ``mask`` on every pair of the tile               PARTIAL / FULL
``q_transform``  value, batch, qo_idx, qo_head, dim: an element of q at load                  float
``k_transform``  value, batch, kv_idx, kv_head, dim: an element of k at load                  float
``output``     value, batch, qo_idx, qo_head, dim: an element of the normalised output        float
``sink``       batch, qo_idx, qo_head: a logit added to the softmax denominator only          float
=============  =========================================================================  ==================

``distance`` (the pair hooks only) is ``kv_idx - qo_idx`` as a float, which the kernels form as a row's part
plus a key's part, each converted once (one add a pair): a hook that reads it pays no int -> float conversion a
pair, where ``static_cast<float>(kv_idx - qo_idx)`` costs one (a traced hook's ``float(kv_idx - q_idx)``, either
order, becomes ``distance`` or ``-distance`` by itself). It is exact while ``|kv_idx - qo_idx|`` stays below
2^24 less a tile of keys (contexts under 16M tokens); beyond, within about one float ulp (two roundings).

``q_transform`` / ``k_transform`` see each raw element as it is loaded, at the query's / key's true position
(``qo_idx``, ``kv_idx``: as the pair hooks see them), and their result is rounded to q's dtype (fp16 where the
kernel multiplies fp8 K): before the spec's RoPE (the rotation turns the transformed vector), before
``sm_scale``; fp8 K is dequantised first (the hook sees the code times ``k_scale``). Decode and the portable
prefill run both; so does the Hopper prefill, over 16-bit K/V (its fp8 K/V take no variant) and not under RoPE,
whose pre-pass rotates q and K before its kernel (``backend='portable'`` for those).

``classify_tiles`` (default True) applies to a ``mask`` hook without ``mask_tile``: the Hopper prefill then classifies
each KV tile itself, by evaluating the mask hook over the tile's pairs in a pre-pass, and skips empty tiles and
runs full ones without the hook (a predicate is then optional, for speed: it spares that pre-pass).
``classify_tiles=False`` turns the pre-pass off for a mask that keeps most tiles partial (a tree mask over a short
draft), where it would cost time and skip nothing.

``softmax=False`` (sigmoid attention) makes the score hook's result the weight itself: ``o = sum_j w_j v_j``
over the unmasked keys, with no normaliser (and no sink).
"""

from __future__ import annotations

import hashlib
import json
import re
import textwrap
from dataclasses import dataclass, field

from .parts import SpecError
from .trace import Node, Sym, TensorSym, to_cuda, trace

_INDEX = ("batch", "qo_idx", "kv_idx", "qo_head", "kv_head")
_PAIR = tuple((n, "int") for n in _INDEX) + (("distance", "float"),)  # the pair hooks' inputs


@dataclass(frozen=True)
class HookSig:
    inputs: tuple[tuple[str, str], ...]  # (name, trace type) in C parameter order
    returns: str  # trace type
    aliases: tuple[tuple[str, str], ...] = (("b", "batch"), ("h", "qo_head"), ("q_idx", "qo_idx"))


HOOKS: dict[str, HookSig] = {
    "score": HookSig((("logit", "float"),) + _PAIR, "float",
                     (("score", "logit"), ("b", "batch"), ("h", "qo_head"), ("q_idx", "qo_idx"))),
    "mask": HookSig(_PAIR, "bool"),
    "mask_tile": HookSig(tuple((n, "int") for n in ("batch", "qo_head", "kv_head", "qo_begin", "qo_end",
                                                     "kv_begin", "kv_end")), "int"),
    "q_transform": HookSig((("value", "float"),) + tuple((n, "int") for n in ("batch", "qo_idx", "qo_head", "dim")),
                           "float", (("x", "value"), ("b", "batch"), ("h", "qo_head"), ("q_idx", "qo_idx"))),
    "k_transform": HookSig((("value", "float"),) + tuple((n, "int") for n in ("batch", "kv_idx", "kv_head", "dim")),
                           "float", (("x", "value"), ("b", "batch"), ("h", "kv_head"))),
    "output": HookSig((("value", "float"),) + tuple((n, "int") for n in ("batch", "qo_idx", "qo_head", "dim")),
                      "float", (("x", "value"), ("b", "batch"), ("h", "qo_head"), ("q_idx", "qo_idx"))),
    "sink": HookSig(tuple((n, "int") for n in ("batch", "qo_idx", "qo_head")), "float",
                    (("b", "batch"), ("h", "qo_head"), ("q_idx", "qo_idx"))),
}
INPUT_NAMES = frozenset(n for sig in HOOKS.values() for n, _ in sig.inputs)

TENSOR_DTYPES = ("bool", "uint8", "int32", "int64", "float16", "bfloat16", "float32")
SCALAR_DTYPES = ("int32", "int64", "float32")
C_DTYPES = {"bool": "bool", "uint8": "uint8_t", "int32": "int32_t", "int64": "int64_t", "float16": "__half",
            "bfloat16": "__nv_bfloat16", "float32": "float"}
_TRACE_TYPE = {"bool": "bool", "uint8": "int", "int32": "int", "int64": "int", "float16": "float",
               "bfloat16": "float", "float32": "float"}
MAX_RANK = 4

C_KEYWORDS = frozenset("""
    auto bool break case char const constexpr continue default do double else enum extern false float for goto if
    inline int long return short signed sizeof static static_cast reinterpret_cast struct switch true typedef
    unsigned void volatile while nullptr __restrict__ __device__ __forceinline__ int8_t int16_t int32_t int64_t
    uint8_t uint16_t uint32_t uint64_t size_t half __half __nv_bfloat16 INFINITY NAN
    TILE_EMPTY TILE_PARTIAL TILE_FULL""".split())
_C_TYPES = frozenset("""auto bool char double float int long short signed unsigned int8_t int16_t int32_t int64_t
    uint8_t uint16_t uint32_t uint64_t size_t half __half __nv_bfloat16""".split())
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _dtype(value: object, where: str, allowed: tuple[str, ...]) -> str:
    name = str(value)
    name = name[len("torch."):] if name.startswith("torch.") else name
    name = {"int": "int32", "float": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(name, name)
    if name not in allowed:
        raise SpecError(f"{where}: dtype got {value!r}, expected one of {', '.join(allowed)}")
    return name


def _decl_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise SpecError(f"{where}: name got {name!r}, expected a C identifier")
    if name in C_KEYWORDS or name in INPUT_NAMES or name.startswith(("fg_", "__")) or name == "params":
        raise SpecError(f"{where}: name {name!r} is reserved (a C keyword, a hook input such as "
                        f"{', '.join(sorted(INPUT_NAMES))}, 'params', or an fg_/__ prefix)")
    return name


@dataclass(frozen=True)
class Tensor:
    """A declared extra tensor, passed to ``run()`` by keyword: ``Tensor("doc_ids", "int32", 1)``. A hook reads
    it by index (``doc_ids[qo_idx]`` for rank 1; ``bits(i, j)`` in CUDA, ``bits[i, j]`` in Python, for rank 2).
    Indices are not wrapped: -1 is not the last element."""

    name: str
    dtype: str
    rank: int = 1

    def __post_init__(self) -> None:
        where = f"variant.tensors[{self.name!r}]"
        object.__setattr__(self, "name", _decl_name(self.name, where))
        object.__setattr__(self, "dtype", _dtype(self.dtype, where, TENSOR_DTYPES))
        if type(self.rank) is not int or not 1 <= self.rank <= MAX_RANK:
            raise SpecError(f"{where}: rank got {self.rank!r}, expected an int from 1 to {MAX_RANK}")


@dataclass(frozen=True)
class Scalar:
    """A declared runtime scalar, passed to ``run()`` by keyword: ``Scalar("bias_scale", "float32")``. Its value
    never enters the kernel key."""

    name: str
    dtype: str = "float32"

    def __post_init__(self) -> None:
        where = f"variant.scalars[{self.name!r}]"
        object.__setattr__(self, "name", _decl_name(self.name, where))
        object.__setattr__(self, "dtype", _dtype(self.dtype, where, SCALAR_DTYPES))


@dataclass(frozen=True)
class Hook:
    """One hook as canonical CUDA text (the body of its device function). ``expr`` (the traced expression) and
    ``origin`` (where a traced hook was written) do not take part in equality, hashing or the key."""

    name: str
    body: str
    expr: Node | None = field(default=None, compare=False, repr=False)
    origin: str = field(default="cuda", compare=False)


# ---------------------------------------------------------------------------------------------- snippets

def canonical_snippet(text: str) -> str:
    """Newlines normalised, dedented, trailing spaces and blank edge lines dropped; a lone expression (no ``;``)
    becomes ``return <expression>;``."""
    text = textwrap.dedent(text.replace("\r\n", "\n").replace("\r", "\n").expandtabs(4))
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    body = "\n".join(lines)
    if ";" not in body and body:
        body = f"return {body.strip()};"
    return body


def _blank(match: re.Match) -> str:
    return re.sub(r"[^\n]", " ", match.group(0))


_TOKEN = re.compile(r"[A-Za-z_]\w*|\d[\w.]*(?:[eEpP][+-]\d+)?\w*|\.\d\w*(?:[eE][+-]\d+)?\w*|->|::|\n|\S")
_STRIP = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S)


def snippet_names(body: str) -> list[tuple[str, int]]:
    """The free names a snippet uses, with their line (1-based): identifiers not followed by ``(`` or ``::``,
    not after ``.``, ``->`` or ``::``, not C keywords or types, and not declared in the snippet as locals
    (``float x = ...``, ``for (int i = 0; ...)``, ``int a = 1, b = 2;``)."""
    tokens, line = [], 1
    for tok in _TOKEN.findall(_STRIP.sub(_blank, body)):
        if tok == "\n":
            line += 1
        else:
            tokens.append((tok, line))
    local, free, pending, depth, decl_depth = set(), [], False, 0, None
    for i, (tok, ln) in enumerate(tokens):
        prev = tokens[i - 1][0] if i else ""
        nxt = tokens[i + 1][0] if i + 1 < len(tokens) else ""
        if tok in "([{":
            depth += 1
        elif tok in ")]}":
            depth -= 1
        if tok in _C_TYPES:
            pending = True
            continue
        if not (tok[0].isalpha() or tok[0] == "_"):
            if tok == ";":
                decl_depth = None
            elif tok == "," and decl_depth == depth:
                pending = True
                continue
            if tok not in ("*", "&") and not (tok == "," and pending):
                pending = False
            continue
        if tok in C_KEYWORDS or prev in (".", "->", "::") or nxt == "::":
            continue
        if pending and nxt != "(":
            local.add(tok)
            pending, decl_depth = False, depth
            continue
        pending = False
        if nxt != "(" and tok not in local:
            free.append((tok, ln))
    return free


def hook_tokens(body: str) -> list[str]:
    """A hook's text as C tokens, outside comments and string literals (newlines dropped)."""
    return [t for t in _TOKEN.findall(_STRIP.sub(_blank, body)) if t != "\n"]


def hook_names(body: str) -> frozenset[str]:
    """Every identifier a hook's text reads, outside comments and string literals and not as a member (after
    ``.``, ``->`` or ``::``): a superset of the inputs it uses (a local that shadows an input counts as the input),
    so that a name absent from it is certainly unused. A preprocessor directive (``#``: token pasting can spell a
    name without writing it) makes it every input name."""
    tokens = hook_tokens(body)
    if "#" in tokens:
        return INPUT_NAMES | frozenset(tokens)
    return frozenset(t for i, t in enumerate(tokens) if (t[0].isalpha() or t[0] == "_")
                     and (i == 0 or tokens[i - 1] not in (".", "->", "::")))


def check_snippet(hook: str, body: str, declared: tuple[str, ...]) -> None:
    """``SpecError`` naming the hook and the line (within the hook) of a name that is neither an input of the
    hook nor a declared tensor or scalar, or of a body with no ``return``."""
    inputs = [n for n, _ in HOOKS[hook].inputs]
    known = set(inputs) | set(declared)
    for name, line in snippet_names(body):
        if name not in known:
            text = body.split("\n")[line - 1].strip()
            raise SpecError(f"variant hook {hook!r}, line {line} ({text!r}): {name!r} is not an input of this hook "
                            f"({', '.join(inputs)}) nor a declared tensor or scalar "
                            f"({', '.join(declared) or 'none declared'})")
    if not re.search(r"\breturn\b", _STRIP.sub(_blank, body)):
        raise SpecError(f"variant hook {hook!r}: the snippet has no 'return'; write the body of a function "
                        f"returning {HOOKS[hook].returns}, or a lone expression")


# ---------------------------------------------------------------------------------------------- Variant

@dataclass(frozen=True)
class Variant:
    """User-defined attention: hooks plus the extra tensors and scalars they read.

    Each hook (``score``, ``mask``, ``mask_tile``, ``q_transform``, ``k_transform``, ``output``, ``sink``) is
    ``None``, a CUDA snippet ``str``, or a Python function traced once into CUDA. ``tensors``: ``Tensor``\\ s (or
    ``(name, dtype, rank)`` tuples); ``scalars``: ``Scalar``\\ s (or ``(name, dtype)`` tuples). Frozen and
    hashable; equal hook texts and declarations give equal variants and one kernel key.

    The logit a ``score`` hook sees is ``q.k * sm_scale`` after the spec's own ALiBi and soft-cap; the spec's
    mask and the ``mask`` hook both apply (a pair is kept when both keep it). Those built-ins are hooks too
    (``flashgen.spec.builtins``; ``flashgen.variants.alibi()``, ``soft_cap(cap)``, ... spell them), computed by
    each kernel family's own fast path.

    Example (a document mask, written both ways)::

        doc = Variant(mask=lambda b, h, q_idx, kv_idx, doc_ids: doc_ids[q_idx] == doc_ids[kv_idx],
                      tensors=[Tensor("doc_ids", "int32", 1)])
        same = Variant(mask="return doc_ids[qo_idx] == doc_ids[kv_idx];", tensors=[("doc_ids", "int32", 1)])
        AttentionSpec(128, variant=doc).uri  # '..._nocap_var<12 hex digits>'; ``same`` has other text, other key
    """

    score: object = None
    mask: object = None
    mask_tile: object = None
    q_transform: object = None
    k_transform: object = None
    output: object = None
    sink: object = None
    tensors: tuple = ()
    scalars: tuple = ()
    softmax: bool = True
    classify_tiles: bool = True

    def __post_init__(self) -> None:
        tensors = tuple(t if isinstance(t, Tensor) else Tensor(*t) for t in _seq(self.tensors, "tensors"))
        scalars = tuple(s if isinstance(s, Scalar) else Scalar(*s) for s in _seq(self.scalars, "scalars"))
        object.__setattr__(self, "tensors", tensors)
        object.__setattr__(self, "scalars", scalars)
        names = [d.name for d in (*tensors, *scalars)]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise SpecError(f"variant: names declared twice: {dup}")
        if not isinstance(self.softmax, bool):
            raise SpecError(f"variant.softmax: got {self.softmax!r}, expected True or False")
        for name in HOOKS:
            object.__setattr__(self, name, self._hook(name, getattr(self, name)))
        if not any(getattr(self, name) is not None for name in HOOKS):
            raise SpecError(f"variant: no hook given; set at least one of {', '.join(HOOKS)}")
        if self.mask_tile is not None and self.mask is None:
            raise SpecError("variant.mask_tile: a tile predicate needs the mask hook it summarises")
        if not isinstance(self.classify_tiles, bool):
            raise SpecError(f"variant.classify_tiles: got {self.classify_tiles!r}, expected True or False")
        if not self.classify_tiles and (self.mask is None or self.mask_tile is not None):
            raise SpecError("variant.classify_tiles: False turns off classifying tiles by the mask hook, which "
                            "applies to a mask hook without mask_tile only")
        if not self.softmax and self.sink is not None:
            raise SpecError("variant.sink: a sink adds to the softmax denominator; softmax=False has none")

    def _hook(self, name: str, value: object) -> Hook | None:
        if value is None or isinstance(value, Hook) and value.name == name:
            return value
        declared = tuple(d.name for d in (*self.tensors, *self.scalars))
        if isinstance(value, Hook):
            value = value.body
        if isinstance(value, str):
            body = canonical_snippet(value)
            check_snippet(name, body, declared)
            return Hook(name, body)
        if callable(value):
            sig = HOOKS[name]
            syms = {t.name: TensorSym(t.name, t.dtype, t.rank, _TRACE_TYPE[t.dtype]) for t in self.tensors}
            syms.update({s.name: Sym(Node("scalar", _TRACE_TYPE[s.dtype], value=s.name)) for s in self.scalars})
            expr = trace(name, value, dict(sig.inputs), dict(sig.aliases), syms, sig.returns)
            origin = getattr(value, "__qualname__", "function")
            return Hook(name, f"return {to_cuda(expr, 'distance' in dict(sig.inputs))};", expr, origin)
        raise SpecError(f"variant.{name}: got {type(value).__name__}, expected None, a CUDA snippet (str) or a "
                        "Python function")

    @property
    def hooks(self) -> tuple[Hook, ...]:
        """The hooks given, in the fixed order of ``HOOKS``."""
        return tuple(h for h in (getattr(self, name) for name in HOOKS) if h is not None)

    def canonical(self) -> dict:
        """What identifies the variant's code: hook texts, declarations, softmax on/off, and ``classify_tiles``
        where it is off (so that the default leaves every variant's digest as it was)."""
        data = {
            "hooks": {h.name: h.body for h in self.hooks},
            "tensors": [[t.name, t.dtype, t.rank] for t in self.tensors],
            "scalars": [[s.name, s.dtype] for s in self.scalars],
            "softmax": self.softmax,
        }
        if not self.classify_tiles:
            data["classify_tiles"] = False
        return data

    @property
    def digest(self) -> str:
        """12 hex digits of a blake2b over ``canonical()`` (labelled JSON with sorted keys)."""
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(b"flashgen.variant\0" + text.encode(), digest_size=6).hexdigest()

    @property
    def uri(self) -> str:
        return f"var{self.digest}"

    def validate(self) -> None:
        for hook in self.hooks:
            check_snippet(hook.name, hook.body, tuple(d.name for d in (*self.tensors, *self.scalars)))

    def to_dict(self) -> dict:
        data = {h.name: h.body for h in self.hooks}
        data.update(self.canonical())
        del data["hooks"]
        return data

    def uses(self, hook: str, name: str) -> bool:
        """Whether hook ``hook``'s text names ``name`` (an input or a declaration; False for a hook not given)."""
        value = getattr(self, hook)
        return value is not None and name in hook_names(value.body)

    def missing(self, provided: dict) -> list[str]:
        """The declared tensors and scalars absent from ``provided`` (``run()``'s keywords), in declared order."""
        return [d.name for d in (*self.tensors, *self.scalars) if d.name not in provided]


def _seq(value: object, name: str) -> tuple:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise SpecError(f"variant.{name}: got {value!r}, expected a list of declarations")
    return tuple(value)
