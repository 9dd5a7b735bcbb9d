"""Trace a Python hook (Flex's ``score_mod`` / ``mask_mod`` style) once into a typed expression, and emit it
as CUDA.

The hook is called once with symbolic proxies (``Sym``) for its inputs and the variant's declared tensors and
scalars; operator overloading records an expression tree of ``Node``s. Every node has one of three types:
``float`` (C ``float``), ``int`` (C ``long long``, or ``int`` where its value provably fits: ``_Emitter``)
or ``bool``. Python's semantics are kept where C's differ:
``//`` and ``%`` on ints floor (``fg_floordiv`` / ``fg_mod``, not C's truncation), ``/`` is true division
(a float), ``%`` on floats takes the sign of the divisor, ``&`` / ``|`` on bools evaluate both sides
(``fg_and`` / ``fg_or``, not C's short-circuit ``&&`` / ``||``). Shifts by 64 or more and int overflow are undefined,
as in C (Python's ints are unbounded).

Anything the tracer cannot turn into an expression -- an ``if`` on a proxy, a loop over one, ``math.exp`` on
one, an unknown attribute or call, a name the hook does not declare -- raises ``SpecError`` naming the hook
and the line of the user's source.
"""

from __future__ import annotations

import inspect
import linecache
import math
import os
from dataclasses import dataclass

from .parts import SpecError

TYPES = ("bool", "int", "float")  # promotion order
C_TYPES = {"bool": "bool", "int": "long long", "float": "float"}
TILE_EMPTY, TILE_PARTIAL, TILE_FULL = 0, 1, 2  # what a ``mask_tile`` hook returns


@dataclass(frozen=True)
class Node:
    """One expression node. ``op``: ``const`` (``value``), ``input`` / ``scalar`` (``value`` = name),
    ``load`` (``value`` = tensor name, ``args`` = indices), ``cast``, a unary / binary operator symbol,
    ``where``, or a function name (``exp``, ``minimum``, ...)."""

    op: str
    type: str
    args: tuple["Node", ...] = ()
    value: object = None


# ---------------------------------------------------------------------------------------------- errors

def _internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path == os.path.abspath(__file__) or "/torch/" in path or path.endswith(os.sep + "variant_ops.py")


class _Context:
    hook: str = "?"


_CTX = _Context()


def _user_line(frames: list) -> str:
    """``file:line: source`` of the innermost frame outside the tracer (and torch's dispatch)."""
    for filename, lineno in frames:
        if _internal(filename):
            continue
        text = linecache.getline(filename, lineno).strip()
        return f"{filename}:{lineno}" + (f": {text}" if text else "")
    return "unknown line"


def _fail(message: str) -> SpecError:
    frame, frames = inspect.currentframe(), []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return SpecError(f"variant hook {_CTX.hook!r}, {_user_line(frames)}: {message}")


# ---------------------------------------------------------------------------------------------- building nodes

def _promote(*types: str) -> str:
    return max(types, key=TYPES.index)


def _cast(node: Node, type_: str) -> Node:
    if node.type == type_:
        return node
    if node.op == "const":
        return Node("const", type_, value={"bool": bool, "int": int, "float": float}[type_](node.value))
    return Node("cast", type_, (node,))


def lift(value: object) -> Node:
    """A proxy's node, or a constant for a Python bool / int / float."""
    if isinstance(value, Sym):
        return value.node
    if isinstance(value, bool):
        return Node("const", "bool", value=value)
    if isinstance(value, int):
        if not -(2 ** 63) <= value < 2 ** 63:
            raise _fail(f"the constant {value} does not fit a 64-bit int")
        return Node("const", "int", value=value)
    if isinstance(value, float):
        return Node("const", "float", value=value)
    raise _fail(f"got {type(value).__name__} {value!r} in an expression; a hook computes with its inputs, "
                "declared tensors and scalars, and Python numbers")


_ARITH = {"+", "-", "*", "/", "//", "%", "**"}
_CMP = {"<", "<=", ">", ">=", "==", "!="}
_BITS = {"&", "|", "^", "<<", ">>"}


def binary(op: str, a: object, b: object) -> "Sym":
    x, y = lift(a), lift(b)
    if op in _CMP:
        t = _promote(x.type, y.type, "int")
        return Sym(Node(op, "bool", (_cast(x, t), _cast(y, t))))
    if op in _BITS:
        if "float" in (x.type, y.type):
            raise _fail(f"'{op}' takes bools or ints, got {x.type} and {y.type}")
        if op in ("&", "|", "^") and x.type == y.type == "bool":
            return Sym(Node(op, "bool", (x, y)))
        return Sym(Node(op, "int", (_cast(x, "int"), _cast(y, "int"))))
    t = "float" if op == "/" else _promote(x.type, y.type, "int")
    return Sym(Node(op, t, (_cast(x, t), _cast(y, t))))


def call(name: str, *args: object) -> "Sym":
    nodes = [lift(a) for a in args]
    if name == "where":
        cond, a, b = nodes
        t = _promote(a.type, b.type)
        return Sym(Node("where", t, (_cast(cond, "bool"), _cast(a, t), _cast(b, t))))
    if name in ("minimum", "maximum"):
        t = _promote(nodes[0].type, nodes[1].type, "int")
        return Sym(Node(name, t, tuple(_cast(n, t) for n in nodes)))
    if name == "floor":  # a float to the int below it (Python's math.floor)
        return Sym(Node("floor", "int", (_cast(nodes[0], "float"),)))
    if name == "abs":
        t = _promote(nodes[0].type, "int")
        return Sym(Node("abs", t, (_cast(nodes[0], t),)))
    return Sym(Node(name, "float", tuple(_cast(n, "float") for n in nodes)))


FUNCTIONS = ("where", "exp", "log", "tanh", "sigmoid", "sqrt", "minimum", "maximum", "abs", "floor")


class Sym:
    """A symbolic value seen by a traced hook; every operation records a ``Node``."""

    __slots__ = ("node",)

    def __init__(self, node: Node):
        self.node = node

    # arithmetic, comparisons, bits
    def __add__(self, o): return binary("+", self, o)
    def __radd__(self, o): return binary("+", o, self)
    def __sub__(self, o): return binary("-", self, o)
    def __rsub__(self, o): return binary("-", o, self)
    def __mul__(self, o): return binary("*", self, o)
    def __rmul__(self, o): return binary("*", o, self)
    def __truediv__(self, o): return binary("/", self, o)
    def __rtruediv__(self, o): return binary("/", o, self)
    def __floordiv__(self, o): return binary("//", self, o)
    def __rfloordiv__(self, o): return binary("//", o, self)
    def __mod__(self, o): return binary("%", self, o)
    def __rmod__(self, o): return binary("%", o, self)
    def __pow__(self, o): return binary("**", self, o)
    def __rpow__(self, o): return binary("**", o, self)
    def __lt__(self, o): return binary("<", self, o)
    def __le__(self, o): return binary("<=", self, o)
    def __gt__(self, o): return binary(">", self, o)
    def __ge__(self, o): return binary(">=", self, o)
    def __eq__(self, o): return binary("==", self, o)  # noqa: E704
    def __ne__(self, o): return binary("!=", self, o)
    def __and__(self, o): return binary("&", self, o)
    def __rand__(self, o): return binary("&", o, self)
    def __or__(self, o): return binary("|", self, o)
    def __ror__(self, o): return binary("|", o, self)
    def __xor__(self, o): return binary("^", self, o)
    def __rxor__(self, o): return binary("^", o, self)
    def __lshift__(self, o): return binary("<<", self, o)
    def __rlshift__(self, o): return binary("<<", o, self)
    def __rshift__(self, o): return binary(">>", self, o)
    def __rrshift__(self, o): return binary(">>", o, self)

    def __neg__(self):
        t = _promote(self.node.type, "int")
        return Sym(Node("neg", t, (_cast(self.node, t),)))

    def __pos__(self):
        return self

    def __abs__(self):
        return call("abs", self)

    def __invert__(self):
        if self.node.type == "float":
            raise _fail("'~' takes a bool or an int, got a float")
        return Sym(Node("not" if self.node.type == "bool" else "~", self.node.type, (self.node,)))

    __hash__ = None

    # what cannot be traced
    def __bool__(self):
        raise _fail("Python control flow on a traced value (if / and / or / not / a chained comparison such "
                    "as a < b < c) cannot be traced; use where(cond, a, b) and & | ~")

    def __iter__(self):
        raise _fail("a traced value cannot be iterated (no loops over hook inputs)")

    def __len__(self):
        raise _fail("a traced value has no len()")

    def __float__(self):
        raise _fail("a traced value cannot become a Python float (math.* functions take numbers); use "
                    "flashgen.variant_ops (exp, log, tanh, sigmoid, sqrt, ...)")

    __int__ = __index__ = __complex__ = __float__

    def __getattr__(self, name):
        raise _fail(f"a traced value has no attribute {name!r}")

    def __getitem__(self, index):
        raise _fail("only declared tensors can be indexed")

    def __call__(self, *args, **kwargs):
        raise _fail("a traced value cannot be called")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        aliases = {"clamp_min": "maximum", "clamp_max": "minimum"}
        name = aliases.get(name, name)
        if name in FUNCTIONS and not kwargs:
            return call(name, *args)
        raise _fail(f"torch.{name} cannot be traced; the hook may call {', '.join(FUNCTIONS)}")


class TensorSym:
    """A declared tensor inside a traced hook: indexing it (one index per dimension) is a load."""

    def __init__(self, name: str, dtype: str, rank: int, type_: str):
        self.name, self.dtype, self.rank, self.type = name, dtype, rank, type_

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != self.rank:
            raise _fail(f"tensor {self.name!r} has rank {self.rank}, indexed with {len(index)} index(es)")
        nodes = tuple(lift(i) for i in index)
        if any(n.type == "float" for n in nodes):
            raise _fail(f"tensor {self.name!r} indexed with a float")
        nodes = tuple(_cast(n, "int") for n in nodes)
        return Sym(Node("load", self.type, nodes, value=self.name))

    def __getattr__(self, name):
        raise _fail(f"declared tensor {self.name!r}: only indexing is traced, not .{name}")

    def __bool__(self):
        raise _fail(f"declared tensor {self.name!r} used as a condition")


# ---------------------------------------------------------------------------------------------- tracing

def _source_line(fn) -> str:
    try:
        lines, start = inspect.getsourcelines(fn)
        return f"{inspect.getsourcefile(fn)}:{start}: {lines[0].strip()}"
    except (OSError, TypeError):
        return getattr(fn, "__qualname__", repr(fn))


def trace(hook: str, fn, inputs: dict[str, str], aliases: dict[str, str], declared: dict[str, object],
          returns: str) -> Node:
    """Call ``fn`` once with proxies and return its expression, cast to ``returns``.

    ``inputs``: input name -> type; ``aliases``: parameter spellings (Flex's ``b``, ``h``, ``score``) -> input
    name; ``declared``: a declared name -> ``Sym`` (scalar) or ``TensorSym``. Parameters bind by name."""
    _CTX.hook = hook
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as exc:
        raise SpecError(f"variant hook {hook!r}: cannot read the signature of {fn!r}: {exc}") from exc
    kwargs = {}
    for name, param in params.items():
        key = aliases.get(name, name)
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise SpecError(f"variant hook {hook!r}, {_source_line(fn)}: *{name} is not traced; name each input")
        if key in inputs:
            kwargs[name] = Sym(Node("input", inputs[key], value=key))
        elif name in declared:
            kwargs[name] = declared[name]
        else:
            known = sorted({*inputs, *(a for a, k in aliases.items() if k in inputs), *declared})
            raise SpecError(f"variant hook {hook!r}, {_source_line(fn)}: parameter {name!r} is neither an "
                            f"input of this hook nor a declared tensor/scalar; expected names from {known}")
    try:
        result = fn(**kwargs)
    except SpecError:
        raise
    except Exception as exc:  # an error of the user's code itself: name its line
        frames = [(f.filename, f.lineno) for f in reversed(inspect.getinnerframes(exc.__traceback__))]
        raise SpecError(f"variant hook {hook!r}, {_user_line(frames)}: "
                        f"{type(exc).__name__}: {exc}") from exc
    if isinstance(result, (TensorSym, type(None))) or not isinstance(result, (Sym, bool, int, float)):
        raise SpecError(f"variant hook {hook!r}, {_source_line(fn)}: returned {type(result).__name__}, "
                        f"expected a {returns} expression")
    node = lift(result)
    if returns == "bool" and node.type != "bool":
        raise SpecError(f"variant hook {hook!r}, {_source_line(fn)}: returns {node.type}, expected a bool "
                        "(a comparison, or & | ~ of comparisons)")
    if returns == "int" and node.type == "float":
        raise SpecError(f"variant hook {hook!r}, {_source_line(fn)}: returns a float, expected an int")
    return _cast(node, returns)


# ---------------------------------------------------------------------------------------------- CUDA

_C_FUNCS = {"exp": "expf", "log": "logf", "tanh": "tanhf", "sqrt": "sqrtf", "sigmoid": "fg_sigmoid"}


def _const(node: Node) -> str:
    if node.type == "bool":
        return "true" if node.value else "false"
    if node.type == "int":
        return f"{node.value}LL" if node.value != -(2 ** 63) else "(-9223372036854775807LL - 1)"
    v = node.value
    if math.isnan(v):
        return "NAN"
    if math.isinf(v):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    return f"{v!r}f" if ("e" in repr(v) or "." in repr(v)) else f"{v!r}.0f"


# ---------------------------------------------------------------------------------------------- value ranges

# An int of the hooks' inputs (batch, positions, heads, dim, tile bounds) is a C int index, never negative.
_INPUT_RANGE = (0, 2 ** 31 - 1)
_INT32 = (-(2 ** 31), 2 ** 31 - 1)
_ANY = (-math.inf, math.inf)
_NARROW = ("<", "<=", ">", ">=")


def _meet(r: tuple, lo: float, hi: float) -> tuple:
    return (max(r[0], lo), min(r[1], hi))


def _arith(op: str, x: tuple, y: tuple) -> tuple:
    if op == "+":
        return (x[0] + y[0], x[1] + y[1])
    if op == "-":
        return (x[0] - y[1], x[1] - y[0])
    if op == "*" and all(math.isfinite(v) for v in (*x, *y)):
        products = [a * b for a in x for b in y]
        return (min(products), max(products))
    return _ANY


class _Ranges:
    """Bounds of each int and float node's value (NaN aside), a ``where`` narrowing its operand of a comparison
    with a constant on each side (``where(n < 8, n, ...)``: n <= 7 in the first branch). ``of`` keeps, per node,
    the union over every context it was reached in."""

    def __init__(self, root: Node):
        self.of: dict[int, tuple] = {}
        self._memo: dict[tuple, tuple] = {}
        self._envs: list[dict] = []  # alive while memoised by id
        self._visit(root, {})

    def _visit(self, node: Node, env: dict) -> tuple:
        key = (id(node), id(env))
        if key not in self._memo:
            self._memo[key] = env.get(id(node)) or self._compute(node, env)
        r = self._memo[key]
        old = self.of.get(id(node))
        self.of[id(node)] = r if old is None else (min(old[0], r[0]), max(old[1], r[1]))
        return r

    def _compute(self, node: Node, env: dict) -> tuple:
        op, a = node.op, node.args
        if op == "where":
            self._visit(a[0], env)
            return self._where(a, env)
        args = [self._visit(x, env) for x in a]
        if op == "const":
            v = node.value
            return _ANY if isinstance(v, float) and math.isnan(v) else (v, v)
        if op == "input":
            return _INPUT_RANGE if node.type == "int" else _ANY
        if op == "cast":
            return args[0] if a[0].type != "bool" else (0, 1)
        if op in ("+", "-", "*") and node.type != "bool":
            return _arith(op, *args)
        if op == "neg":
            return (-args[0][1], -args[0][0])
        if op == "abs":
            lo, hi = args[0]
            return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
        if op in ("minimum", "maximum"):
            f = min if op == "minimum" else max
            return (f(args[0][0], args[1][0]), f(args[0][1], args[1][1]))
        if op == "floor":
            return tuple(math.floor(v) if math.isfinite(v) else v for v in args[0])
        return (0, 1) if node.type == "bool" else _ANY

    def _where(self, a: tuple, env: dict) -> tuple:
        cond, envs = a[0], (env, env)
        if cond.op in _NARROW and cond.args[1].op == "const" and cond.args[0].op != "const":
            x, c = cond.args[0], cond.args[1].value
            r = env.get(id(x)) or self.of[id(x)]
            inf, step = math.inf, 1 if x.type == "int" else 0
            yes = {"<": (-inf, c - step), "<=": (-inf, c), ">": (c + step, inf), ">=": (c, inf)}[cond.op]
            no = {"<": (c, inf), "<=": (c + step, inf), ">": (-inf, c), ">=": (-inf, c - step)}[cond.op]
            envs = ({**env, id(x): _meet(r, *yes)},
                    {**env, id(x): _meet(r, *no)} if step else env)  # a float's NaN fails every comparison
            self._envs += envs
        t, f = self._visit(a[1], envs[0]), self._visit(a[2], envs[1])
        return (min(t[0], f[0]), max(t[1], f[1]))


def to_cuda(node: Node, distance: bool = False) -> str:
    """A C++ expression for ``node`` (fully parenthesised; helpers from ``flashgen/common/variant.cuh``).
    ``distance``: the hook has the float input ``distance`` (``kv_idx - qo_idx``, the pair hooks): a conversion to
    float of ``kv_idx - qo_idx`` is then ``distance`` (of ``qo_idx - kv_idx``, ``-distance``), which the kernels
    compute without an int -> float conversion a pair; the int difference used as an int stays as it is."""
    return _Emitter(node, distance).emit(node)[0]


def _distance_sign(node: Node) -> int:
    """1 for the int ``kv_idx - qo_idx`` of the two position inputs, -1 for ``qo_idx - kv_idx``, else 0."""
    if node.op != "-" or node.type != "int" or any(x.op != "input" for x in node.args):
        return 0
    return {("kv_idx", "qo_idx"): 1, ("qo_idx", "kv_idx"): -1}.get(tuple(x.value for x in node.args), 0)


class _Emitter:
    """C++ text of an expression and the C type each int is computed in: ``int`` where the node's value and
    every int it is computed from provably fit 32 bits (``_Ranges``), else ``long long``, so that a hook's
    index arithmetic, int compares and int <-> float conversions stay 32-bit (a 64-bit one is several
    instructions, a conversion from or to 64 bits a slow one) with the same values."""

    def __init__(self, root: Node, distance: bool = False):
        self.ranges = _Ranges(root).of
        self.distance = distance
        self._memo: dict[int, tuple[str, str]] = {}

    def _fits(self, node: Node, margin: int = 0) -> bool:
        r = self.ranges.get(id(node))
        return r is not None and _INT32[0] + margin <= r[0] and r[1] <= _INT32[1] - margin

    def _as(self, node: Node, ctype: str) -> str:
        text, have = self.emit(node)
        return text if have == ctype or node.op == "const" else f"static_cast<{ctype}>({text})"

    def _int_op(self, node: Node) -> str:
        """``int`` when node and its int operands fit, else ``long long``."""
        ints = [x for x in node.args if x.type == "int"]
        narrow = self._fits(node) and all(self.emit(x)[1] == "int" for x in ints)
        return "int" if narrow else "long long"

    def emit(self, node: Node) -> tuple[str, str]:
        if id(node) not in self._memo:
            self._memo[id(node)] = self._emit(node)
        return self._memo[id(node)]

    def _emit(self, node: Node) -> tuple[str, str]:
        op, a, t = node.op, node.args, node.type
        if op == "const":
            if t == "int" and self._fits(node):
                return (str(node.value) if node.value != -(2 ** 31) else "(-2147483647 - 1)"), "int"
            return _const(node), C_TYPES[t]
        if op in ("input", "scalar"):
            return node.value, ("int" if op == "input" and t == "int" else C_TYPES[t])
        if op == "load":  # as the node's type: a __half or int32 element must not pick a helper overload
            load = f"{node.value}({', '.join(self.emit(i)[0] for i in a)})"
            return (load if t == "bool" else f"static_cast<{C_TYPES[t]}>({load})"), C_TYPES[t]
        if op == "cast" and t == "float" and self.distance and _distance_sign(a[0]):
            return ("distance" if _distance_sign(a[0]) > 0 else "(-distance)"), "float"
        if op == "cast":
            ctype = self._int_op(node) if t == "int" else C_TYPES[t]
            return f"static_cast<{ctype}>({self.emit(a[0])[0]})", ctype
        if op == "floor":  # a float bounded by 2^30 (room for its operations' rounding) converts to an int
            ctype = "int" if self._fits(node, 2 ** 30) else "long long"
            return f"static_cast<{ctype}>(floorf({self.emit(a[0])[0]}))", ctype
        if t == "int" and op in ("neg", "where", "minimum", "maximum", "abs", "+", "-", "*"):
            ctype = self._int_op(node)
            args = [self._as(x, ctype) if x.type == "int" else self.emit(x)[0] for x in a]
        else:
            ctype = C_TYPES[t]
            args = [self.emit(x)[0] for x in a]
        if op in _CMP and a[0].type == "int":  # compared in the wider of the operands' types
            wide = "int" if all(self.emit(x)[1] == "int" for x in a) else "long long"
            args = [self._as(x, wide) for x in a]
        if op == "neg":
            return f"(-{args[0]})", ctype
        if op == "not":
            return f"(!{args[0]})", ctype
        if op == "~":
            return f"(~{args[0]})", ctype
        if op == "where":
            return f"({args[0]} ? {args[1]} : {args[2]})", ctype
        if op in ("//", "%", "**"):  # the long long overloads for ints
            name = {"//": "fg_floordiv", "%": "fg_mod", "**": "fg_pow"}[op]
            wide = [self._as(x, "long long") if x.type == "int" else args[i] for i, x in enumerate(a)]
            return f"{name}({wide[0]}, {wide[1]})", ctype
        if op in ("&", "|") and t == "bool":  # both sides, as Python's: no load of one under a branch
            return f"{'fg_and' if op == '&' else 'fg_or'}({args[0]}, {args[1]})", ctype
        if op in _BITS and t == "int":  # 64-bit, as the shift counts and masks of Python's ints need
            wide = [self._as(x, "long long") for x in a]
            return f"({wide[0]} {op} {wide[1]})", ctype
        if op in _ARITH or op in _CMP or op in _BITS:
            return f"({args[0]} {op} {args[1]})", ctype
        if op in ("minimum", "maximum"):
            return f"fg_{op[:3]}({args[0]}, {args[1]})", ctype
        if op == "abs":
            return f"fg_abs({args[0]})", ctype
        return f"{_C_FUNCS[op]}({', '.join(args)})", ctype
