"""The lowering table: one entry per aten op, each a small function that returns Triton source.

This is tinygrad's ``code_for_op`` (see docs: style.md, section E) for aten graphs::

    aten.where: call("tl.where", inputs=WHERE),
    aten.ge:    infix(">=", CMP, inputs=COMMON),

An entry's ``fn`` receives its tensor operands as ``Operand`` strings: Triton source already cast to
the dtype the entry asks for (``inputs``) and already in parentheses where its place in the result
needs them (``prec`` and ``left``). Python numbers arrive as ``Operand`` literals carrying ``.value``;
other arguments (``rounding_mode``, ``alpha``, ``None``) arrive unchanged. ``fn`` returns the
expression, or ``(expression, prec)`` where one entry writes different shapes of expression.

A few entries are *structural* (``kind`` other than "expr"): gathers, casts, constants and views do
not become one expression of their operands, and ``emit.py`` builds them. They are listed here all
the same, so this file is the one place that says what flexattn can lower.

Users add entries with ``register_lowering`` (exported from ``flexattn.lowering``).
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import sympy
import torch

from .index import ADD, ATOM, BAND, BOR, BXOR, CMP, MUL, UNARY, FloorDiv, PyMod

__all__ = [
    "Lowering",
    "Operand",
    "LOWERINGS",
    "APPROX_TANH",
    "register_lowering",
    "lookup",
    "literal",
    "TL_DTYPES",
    "RESULT",
    "COMMON",
    "BOOL",
    "WHERE",
    "KEEP",
]

aten = torch.ops.aten
prims = torch.ops.prims

# How an entry wants its tensor operands cast before ``fn`` sees them.
RESULT = "result"  # to the op's output dtype (float outputs: float32), e.g. add, where's branches
COMMON = "common"  # to the promoted dtype of the operands (comparisons: their output is bool)
BOOL = "bool"  # to bool, with `x != 0` (logical ops)
WHERE = "where"  # the condition to bool, the other operands to the output dtype
KEEP = "keep"  # unchanged: ints keep their dtype, floats are float32 (the default for user entries)

TL_DTYPES = {
    torch.bool: "tl.int1",
    torch.int8: "tl.int8",
    torch.uint8: "tl.uint8",
    torch.int16: "tl.int16",
    torch.int32: "tl.int32",
    torch.int64: "tl.int64",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
}


class Operand(str):
    """Triton source of one operand, plus what an entry may need to know about it.

    ``raw`` is the source without the parentheses added for the entry's position, ``prec`` how
    tightly ``raw`` binds, ``dtype`` the torch dtype of the value in the kernel (floats: float32),
    ``value`` the Python number for a constant operand (None otherwise).
    """

    raw: str
    prec: int
    dtype: torch.dtype
    value: Any

    def __new__(cls, text: str, raw: str, prec: int, dtype: torch.dtype, value: Any = None):
        self = super().__new__(cls, text)
        self.raw, self.prec, self.dtype, self.value = raw, prec, dtype, value
        return self


Fn = Callable[..., Union[str, tuple]]


@dataclass(frozen=True)
class Lowering:
    """One table entry.

    fn: operands -> Triton expression (or ``(expression, prec)``); for ``kind="constant"`` it
        returns the constant's Python value instead.
    prec: binding strength of the expression ``fn`` writes (``index.ATOM`` for calls); operands are
        parenthesised to suit it. None: every operand arrives as an atom and the result's strength
        is read from the returned source (used for user entries).
    inputs: RESULT / COMMON / BOOL / WHERE / KEEP, see above.
    left: positions of operands written leftmost in an infix expression (they may bind as loosely
        as ``prec``); other operands must bind tighter. Comparisons use () because they chain.
    sym: the same op on sympy integers, for index arithmetic (see index.py); may return None.
    reuses: ``fn`` writes an operand more than once (``x * x``): non-trivial operands are named first.
    kind: "expr", or a structural kind built by emit.py: "constant", "cast", "identity",
        "gather", "select".
    """

    fn: Optional[Fn] = None
    prec: Optional[int] = ATOM
    inputs: str = RESULT
    left: tuple[int, ...] = (0,)
    sym: Optional[Callable[..., Optional[sympy.Expr]]] = None
    reuses: bool = False
    kind: str = "expr"


def literal(value: Any) -> tuple[str, int]:
    """Triton source of a Python constant, and how tightly it binds."""
    if isinstance(value, bool):
        return str(value), ATOM
    if isinstance(value, int):
        return str(value), (ATOM if value >= 0 else UNARY)
    value = float(value)
    if math.isnan(value):
        return 'float("nan")', ATOM
    if math.isinf(value):
        return ('float("inf")' if value > 0 else 'float("-inf")'), ATOM
    return repr(value), (ATOM if math.copysign(1.0, value) > 0 else UNARY)


def _atom(x: Operand) -> str:
    """``x`` fit to stand anywhere: bare if it is an atom, else in parentheses."""
    return x.raw if x.prec >= ATOM else f"({x.raw})"


def _at(x: Operand, need: int) -> str:
    return x.raw if x.prec >= need else f"({x.raw})"


def _is_float(x: Operand) -> bool:
    return x.dtype.is_floating_point


# -- entry builders ----------------------------------------------------------------------------


def infix(op: str, prec: int, *, inputs: str = RESULT, left=(0,), sym=None) -> Lowering:
    return Lowering(lambda a, b: f"{a} {op} {b}", prec, inputs, left, sym)


def call(name: str, *, inputs: str = RESULT) -> Lowering:
    return Lowering(lambda *xs: f"{name}({', '.join(xs)})", ATOM, inputs)


def _with_alpha(fmt: Callable[[str, str], str], scaled: int) -> Fn:
    """``a + alpha * b`` style ops: ``scaled`` is the position that alpha multiplies."""

    def fn(*xs, alpha=1):
        xs = list(xs)
        if alpha != 1:
            xs[scaled] = f"{literal(alpha)[0]} * {_at(xs[scaled], MUL + 1)}"
        return fmt(*xs)

    return fn


# -- entries whose source depends on dtypes or constant operands -----------------------------------


def _maximum(a: str, b: str, floating: bool) -> str:
    # torch.maximum/minimum/clamp return NaN when either input is NaN; tl.maximum does not by default.
    return f"torch_maximum({a}, {b})" if floating else f"tl.maximum({a}, {b})"


def _minimum(a: str, b: str, floating: bool) -> str:
    return f"torch_minimum({a}, {b})" if floating else f"tl.minimum({a}, {b})"


def _clamp(x, min=None, max=None):
    out = x.raw
    if min is not None:
        out = _maximum(out, min.raw, _is_float(x))
    if max is not None:
        out = _minimum(out, max.raw, _is_float(x))
    return out, (ATOM if (min is not None or max is not None) else x.prec)


def _floor_divide(a, b):
    if _is_float(a):
        return f"py_floordiv_float({a.raw}, {b.raw})", ATOM
    return f"py_floordiv({a.raw}, {b.raw})", ATOM


def _div(a, b, rounding_mode=None):
    if rounding_mode is None:
        return f"{a} / {b}", MUL
    if rounding_mode == "floor":
        return _floor_divide(a, b)
    if rounding_mode == "trunc":
        if _is_float(a):
            return f"trunc_div({a.raw}, {b.raw})", ATOM
        return f"{a} // {b}", MUL  # Triton's integer // truncates toward zero, like C
    raise NotImplementedError(f"rounding_mode={rounding_mode!r}")


def _pow(base, exp):
    """``base ** exp``: small constant exponents become multiplies and square roots."""
    floating = _is_float(base) or _is_float(exp)
    if base.value is None and exp.value is not None:
        e = exp.value
        x = base.raw if base.prec >= ATOM else f"({base.raw})"  # emit.py names non-trivial bases
        if e == 0:
            return ("1.0" if floating else "1"), ATOM
        if e == 1:
            return base.raw, base.prec
        if e == int(e) and 2 <= e <= 4:
            return " * ".join([x] * int(e)), MUL
        if floating and e == 0.5:
            return f"tl.sqrt_rn({base.raw})", ATOM
        if floating and e == -0.5:
            return f"tl.rsqrt({base.raw})", ATOM
        if floating and e == -1:
            return f"1.0 / {x}", MUL
        if floating and e == -2:
            return f"1.0 / ({x} * {x})", MUL
        if floating:
            return f"pow_float({base.raw}, {exp.raw})", ATOM
        raise NotImplementedError(f"integer pow with exponent {e}; use repeated multiplication")
    if not floating:
        raise NotImplementedError("integer pow with a tensor exponent")
    if base.value is not None:
        b = float(base.value)
        if b == 2:
            return f"tl.exp2({exp.raw})", ATOM
        if b == 1:
            return "1.0", ATOM
        if b > 0:  # b ** y == 2 ** (y * log2(b))
            return f"tl.exp2({_at(exp, MUL)} * {literal(math.log2(b))[0]})", ATOM
        return f"pow_float(tl.zeros_like({exp.raw}) + {base.raw}, {exp.raw})", ATOM
    return f"pow_float({base.raw}, {exp.raw})", ATOM


def _floor_or_ceil(name: str) -> Fn:
    def fn(x):
        if _is_float(x):
            return f"tl.{name}({x.raw})", ATOM
        return x.raw, x.prec  # integers are already whole

    return fn


def _bitwise_not(x):
    return f"~{_at(x, UNARY)}", UNARY


_FLOAT_FUNCTIONS = {
    aten.exp: "tl.exp",
    aten.exp2: "tl.exp2",
    aten.log: "tl.log",
    aten.log2: "tl.log2",
    aten.sqrt: "tl.sqrt_rn",  # correctly rounded, like torch.sqrt (tl.sqrt may be approximate)
    aten.rsqrt: "tl.rsqrt",
    aten.sin: "tl.sin",
    aten.cos: "tl.cos",
    aten.sigmoid: "tl.sigmoid",
    aten.erf: "tl.erf",
    # tl.math has no tanh in Triton 3.x and libdevice's cannot run under TRITON_INTERPRET=1:
    # precise_tanh is an exp-based helper (mod_helpers.py.jinja); APPROX_TANH swaps in tanh.approx.f32.
    aten.tanh: "precise_tanh",
}


def _constant(value_of: Callable[..., Any]) -> Lowering:
    return Lowering(fn=value_of, kind="constant")


_IDENTITY = Lowering(kind="identity")
_CAST = Lowering(kind="cast")

# -- the table -----------------------------------------------------------------------------------
# Keys are OpOverloadPackets (every overload of the op: add.Tensor and add.Scalar alike) or single
# OpOverloads; ``lookup`` tries the overload first.

LOWERINGS: dict[Any, Lowering] = {
    # arithmetic; integer results also build sympy index expressions
    aten.add: Lowering(_with_alpha(lambda a, b: f"{a} + {b}", 1), ADD, sym=lambda a, b, alpha=1: a + alpha * b),
    aten.sub: Lowering(_with_alpha(lambda a, b: f"{a} - {b}", 1), ADD, sym=lambda a, b, alpha=1: a - alpha * b),
    aten.rsub: Lowering(
        _with_alpha(lambda a, b: f"{b} - {a}", 0), ADD, left=(1,), sym=lambda a, b, alpha=1: b - alpha * a
    ),
    aten.mul: infix("*", MUL, sym=operator.mul),
    aten.div: Lowering(
        _div, MUL, sym=lambda a, b, rounding_mode=None: FloorDiv(a, b) if rounding_mode == "floor" else None
    ),
    aten.neg: Lowering(lambda a: f"-{a}", UNARY, sym=operator.neg),
    aten.floor_divide: Lowering(_floor_divide, ATOM, sym=FloorDiv),
    aten.remainder: Lowering(lambda a, b: f"py_remainder({a}, {b})", ATOM, sym=PyMod),
    aten.fmod: infix("%", MUL),  # Triton's % is C's fmod: the sign of the dividend, like torch.fmod
    aten.reciprocal: Lowering(lambda a: f"1.0 / {a}", MUL, left=()),
    aten.square: Lowering(lambda a: f"{a} * {a}", MUL, reuses=True),
    aten.pow: Lowering(_pow, ATOM, reuses=True),
    aten.abs: call("tl.abs"),
    aten.floor: Lowering(_floor_or_ceil("floor")),
    aten.ceil: Lowering(_floor_or_ceil("ceil")),
    **{op: call(name) for op, name in _FLOAT_FUNCTIONS.items()},
    # min / max
    aten.minimum: Lowering(lambda a, b: _minimum(a, b, _is_float(a))),
    aten.maximum: Lowering(lambda a, b: _maximum(a, b, _is_float(a))),
    aten.clamp: Lowering(_clamp),
    aten.clamp_min: Lowering(lambda x, lo: _clamp(x, min=lo)),
    aten.clamp_max: Lowering(lambda x, hi: _clamp(x, max=hi)),
    # comparisons: operands promoted together, result bool
    aten.eq: infix("==", CMP, inputs=COMMON, left=()),
    aten.ne: infix("!=", CMP, inputs=COMMON, left=()),
    aten.lt: infix("<", CMP, inputs=COMMON, left=()),
    aten.le: infix("<=", CMP, inputs=COMMON, left=()),
    aten.gt: infix(">", CMP, inputs=COMMON, left=()),
    aten.ge: infix(">=", CMP, inputs=COMMON, left=()),
    # logic on bools and bits on ints (`&` on two bools is a logical and)
    aten.logical_and: infix("&", BAND, inputs=BOOL),
    aten.logical_or: infix("|", BOR, inputs=BOOL),
    aten.logical_xor: infix("^", BXOR, inputs=BOOL),
    aten.logical_not: Lowering(_bitwise_not, UNARY, inputs=BOOL),
    aten.bitwise_and: infix("&", BAND),
    aten.bitwise_or: infix("|", BOR),
    aten.bitwise_xor: infix("^", BXOR),
    aten.bitwise_not: Lowering(_bitwise_not, UNARY),
    aten.where: call("tl.where", inputs=WHERE),
    # dtype casts: the target is the node's output dtype (see emit.py for float16/bfloat16 rounding)
    aten._to_copy: _CAST,
    aten.to: _CAST,
    prims.convert_element_type: _CAST,
    # constants (0-d only)
    aten.scalar_tensor: _constant(lambda value, **_: value),
    aten.full: _constant(lambda size, value, **_: value),
    aten.full_like: _constant(lambda x, value, **_: value),
    aten.ones_like: _constant(lambda x, **_: 1),
    aten.zeros_like: _constant(lambda x, **_: 0),
    aten.ones: _constant(lambda size, **_: 1),
    aten.zeros: _constant(lambda size, **_: 0),
    # views and copies of a value are the value
    aten.detach: _IDENTITY,
    aten.clone: _IDENTITY,
    aten.alias: _IDENTITY,
    aten.lift_fresh_copy: _IDENTITY,
    aten.lift_fresh: _IDENTITY,
    # reads of captured tensors: `bias[h, q_idx - kv_idx]`, `intervals[doc[kv_idx]][0]`
    aten.index.Tensor: Lowering(kind="gather"),
    aten.select.int: Lowering(kind="select"),
}

# Overrides for lower(..., tanh_approx=True), as tinygrad's backends override ``code_for_op``.
APPROX_TANH = {aten.tanh: call("tanh_approx")}


def lookup(target: Any, table: dict) -> Optional[Lowering]:
    """The entry for an fx node's target: its overload's own entry, else its op's."""
    entry = table.get(target)
    if entry is None:
        entry = table.get(getattr(target, "overloadpacket", None))
    return entry


def precedence_of(source: str) -> int:
    """How tightly the outer operator of a Python expression binds (for user entries)."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except SyntaxError:
        return 0
    if isinstance(node, (ast.Name, ast.Constant, ast.Call, ast.Attribute, ast.Subscript)):
        return ATOM
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Invert, ast.UAdd)):
        return UNARY
    if isinstance(node, ast.BinOp):
        return {
            ast.Mult: MUL, ast.Div: MUL, ast.FloorDiv: MUL, ast.Mod: MUL,
            ast.Add: ADD, ast.Sub: ADD, ast.BitAnd: BAND, ast.BitXor: BXOR, ast.BitOr: BOR,
        }.get(type(node.op), 0)  # fmt: skip
    if isinstance(node, ast.Compare):
        return CMP
    return 0


def register_lowering(op: Any, fn: Optional[Fn] = None, *, inputs: str = KEEP):
    """Add (or replace) the table entry for ``op``, an aten OpOverload or OpOverloadPacket.

    ``fn`` gets one Triton expression string per argument of the aten op, in the op's argument
    order (Python numbers arrive as literal strings with a ``.value``; other arguments unchanged),
    and returns a Triton expression. Tensor operands arrive as names or constants (anything longer
    is given a temporary first), so ``fn`` may write them next to any operator, and more than once.
    With the default ``inputs="keep"`` floats arrive as float32 and ints keep their dtype;
    ``inputs="result"`` casts them to the op's output dtype first. The expression's dtype must be
    the op's output dtype (floats: float32).

    Usable as a decorator::

        @register_lowering(torch.ops.aten.log1p)
        def _(x):
            return f"tl.log(1.0 + {x})"

    Helpers the expression calls must be visible in the kernel module (``tl``, ``triton``, and the
    functions of templates/mod_helpers.py.jinja are).
    """
    if inputs not in (RESULT, COMMON, BOOL, WHERE, KEEP):
        raise ValueError(f"inputs must be one of 'result', 'common', 'bool', 'where', 'keep'; got {inputs!r}")
    if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        raise TypeError(f"op must be an aten op such as torch.ops.aten.erf (or .default), got {op!r}")

    def register(f: Fn) -> Fn:
        if not callable(f):
            raise TypeError(f"fn must be callable, got {type(f).__name__}")
        LOWERINGS[op] = Lowering(f, prec=None, inputs=inputs, reuses=True)
        return f

    return register if fn is None else register(fn)


def with_options(*, tanh_approx: bool) -> dict:
    """The table for one lower() call."""
    return {**LOWERINGS, **APPROX_TANH} if tanh_approx else LOWERINGS


def supported_op_names(table: dict) -> list[str]:
    """Short names of the ops in ``table`` ("add", "index.Tensor"), for error messages."""
    names = set()
    for key in table:
        text = str(key)
        names.add(text[len("aten."):] if text.startswith("aten.") else text)
    return sorted(names)

