"""The lowering table: one entry per aten op, each a small function that returns Triton source.

This is tinygrad's ``code_for_op`` (tinygrad/renderer/cstyle.py) for aten graphs::

    aten.where: call("tl.where", inputs=WHERE),
    aten.ge:    infix(">=", CMP, inputs=COMMON),

An entry's ``fn`` receives its tensor operands as ``Operand`` strings: Triton source already cast to
the dtype the entry asks for (``inputs``) and already in parentheses where its place in the result
needs them (``prec`` and ``left``). Python numbers arrive as ``Operand`` literals carrying ``.value``;
other arguments (``rounding_mode``, ``alpha``, ``None``) arrive unchanged. ``fn`` returns the
expression, or ``(expression, prec)`` where one entry writes different shapes of expression.

The operands' dtypes are the kernel's (calls.py): torch's promotion, int64 where the bounds analysis
widens an index computation. Entries whose result can be a bool say what they mean on bools
(``on_bools``: torch's ``True + True`` is ``True``).

A few entries are *structural* (``kind`` other than "expr"): gathers, casts, constants, views and
reductions do not become one expression of their operands, and the walk builds them (calls.py,
gathers.py). They are
listed here all the same, so this file is the one place that says what flexattn can lower.

Users add entries with ``register_lowering`` (exported from ``flexattn.lowering``).
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from .index import ADD, ATOM, BAND, BOR, BXOR, CMP, MUL, SHIFT, UNARY, floor_div, py_mod, sympy

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
    ``value`` the Python number for a constant operand (None otherwise), ``number`` whether it is a
    Python number the mod reads (a scalar argument of the kernel, trace/numbers.py).
    """

    raw: str
    prec: int
    dtype: torch.dtype
    value: Any
    number: bool  # a Python number the mod reads: one scalar kernel argument for the whole tile

    def __new__(cls, text: str, raw: str, prec: int, dtype: torch.dtype, value: Any = None, number: bool = False):
        self = super().__new__(cls, text)
        self.raw, self.prec, self.dtype, self.value, self.number = raw, prec, dtype, value, number
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
    on_bools: what the op means when its operands and result are bools, as torch defines it:
        "|" (``True + True`` is True: add, maximum), "&" (mul, minimum), "=" (the operand itself:
        floor, abs), "fn" (``fn`` is right for bools too: bitwise ops). None: not an op on bools.
    kind: "expr", or a structural kind built by the walk (calls.py): "constant", "cast", "identity",
        "gather", "select", "view" (reshapes, transposes and slices), "reduce" (``fn`` names the
        reduction: "sum", "any", ...; over a small vector of loaded values).
    """

    fn: Optional[Fn] = None
    prec: Optional[int] = ATOM
    inputs: str = RESULT
    left: tuple[int, ...] = (0,)
    sym: Optional[Callable[..., Optional[sympy.Expr]]] = None
    reuses: bool = False
    on_bools: Optional[str] = None
    kind: str = "expr"


def literal(value: Any) -> tuple[str, int]:
    """Triton source of a Python constant, and how tightly it binds."""
    if isinstance(value, bool):
        return str(value), ATOM
    if isinstance(value, int):
        if not -(2**31) <= value < 2**31:
            # Triton gives a bare integer the dtype of the tensor it meets, and an int32 tensor cannot
            # take 2**33 ("Scalar out of range for type int32"): write it as an int64 tensor.
            return f"tl.full([], {value}, tl.int64)", ATOM
        return str(value), (ATOM if value >= 0 else UNARY)
    value = float(value)
    if math.isnan(value):
        return 'float("nan")', ATOM
    if math.isinf(value):
        return ('float("inf")' if value > 0 else 'float("-inf")'), ATOM
    return repr(value), (ATOM if math.copysign(1.0, value) > 0 else UNARY)


def _at(x: Operand, need: int) -> str:
    return x.raw if x.prec >= need else f"({x.raw})"


def _is_float(x: Operand) -> bool:
    return x.dtype.is_floating_point


# -- entry builders ----------------------------------------------------------------------------


def infix(op: str, prec: int, *, inputs: str = RESULT, left=(0,), sym=None, on_bools=None) -> Lowering:
    return Lowering(lambda a, b: f"{a} {op} {b}", prec, inputs, left, sym, on_bools=on_bools)


def call(name: str, *, inputs: str = RESULT, on_bools=None) -> Lowering:
    return Lowering(lambda *xs: f"{name}({', '.join(xs)})", ATOM, inputs, on_bools=on_bools)


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
        if b.number and a.dtype == b.dtype == torch.float32:
            # [Note] Dividing by a number argument. A float32 division by a literal compiles to one
            # multiply (the compiler folds the reciprocal); by a kernel argument it is a reciprocal
            # and range scaling per element: in the soft-cap backward, 45% more multiplies in the
            # dK/dV kernel and 62% in the dQ kernel (SASS for sm_90, Triton 3.6). The correctly
            # rounded reciprocal, one per use and the same for every element, then one multiply is
            # what the literal does. A reciprocal overflows only for a divisor under 2**-126,
            # which the GPU flushes to zero in a division too.
            return f"{a} * tl.math.div_rn(1.0, {b.raw})", MUL
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
        x = base.raw if base.prec >= ATOM else f"({base.raw})"  # calls.py names non-trivial bases
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


_BITS = {torch.int8: 8, torch.uint8: 8, torch.int16: 16, torch.int32: 32, torch.int64: 64}


def _shift(op: str) -> Fn:
    """``a << s`` / ``a >> s`` as torch computes them: a shift by the width or more (or by a negative
    amount) gives 0 (-1 for a negative ``a >> s``), where Triton's shifts are undefined."""
    helper = "torch_shift_left" if op == "<<" else "torch_shift_right"

    def fn(a, s):
        bits = _BITS[a.dtype]
        if s.value is not None and 0 <= int(s.value) < bits:
            return f"{_at(a, SHIFT)} {op} {int(s.value)}", SHIFT
        if s.value is not None and op == "<<":
            return f"tl.zeros_like({a.raw})", ATOM
        if s.value is not None:
            return f"{_at(a, SHIFT)} >> {bits - 1}", SHIFT  # -1 for negatives, 0 otherwise
        return f"{helper}({a.raw}, {s.raw}, {bits})", ATOM

    return fn


def _float_or_same(helper: str) -> Fn:
    """A float function that is the identity on integers (torch.round, trunc of an int tensor)."""

    def fn(x):
        if _is_float(x):
            return f"{helper}({x.raw})", ATOM
        return x.raw, x.prec

    return fn


def _round(x, decimals=0):
    if not _is_float(x):
        return x.raw, x.prec
    if decimals == 0:
        return f"round_half_even({x.raw})", ATOM
    # torch: nearbyint(x * 10**d) / 10**d, or nearbyint(x / 10**-d) * 10**-d for negative d
    scale = literal(float(10 ** abs(decimals)))[0]
    if decimals > 0:
        return f"round_half_even({_at(x, MUL)} * {scale}) / {scale}", MUL
    return f"round_half_even({_at(x, MUL)} / {scale}) * {scale}", MUL


def _sign(x):
    if x.dtype == torch.bool:
        return x.raw, x.prec
    if _is_float(x):
        return f"torch_sign({x.raw})", ATOM
    tl_dtype = TL_DTYPES[x.dtype]
    return f"(({x} > 0).to({tl_dtype}) - ({x} < 0).to({tl_dtype}))", ATOM


def _relu(x):
    return (f"torch_maximum({x.raw}, 0.0)" if _is_float(x) else f"tl.maximum({x.raw}, 0)"), ATOM


def _gelu(x, approximate="none"):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate={approximate!r}")
    return f"{'gelu_tanh' if approximate == 'tanh' else 'gelu_erf'}({x.raw})", ATOM


def _number(v) -> Any:
    """The Python number of an argument that arrives as a constant Operand or as a default."""
    return v.value if isinstance(v, Operand) else v


def _softplus(x, beta=1, threshold=20):
    # torch: x where x * beta > threshold, else log1p(exp(x * beta)) / beta
    beta, threshold = _number(beta), _number(threshold)
    if beta is None or threshold is None:
        raise NotImplementedError("softplus with a tensor beta or threshold")
    t = literal(float(threshold))[0]
    if beta == 1:
        return f"tl.where({_at(x, CMP + 1)} > {t}, {x.raw}, torch_log1p(tl.exp({x.raw})))", ATOM
    b = literal(float(beta))[0]
    return f"tl.where({_at(x, MUL)} * {b} > {t}, {x.raw}, torch_log1p(tl.exp({_at(x, MUL)} * {b})) / {b})", ATOM


def _hardtanh(x, min_val=-1.0, max_val=1.0):
    def bound(v):  # a default arrives as a plain float
        if isinstance(v, Operand):
            return v
        text, prec = literal(float(v))
        return Operand(text, text, prec, torch.float32, float(v))

    return _clamp(x, min=bound(min_val), max=bound(max_val))


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


def _undefined_constant(*args, **kwargs):
    raise ValueError("its elements are uninitialised (torch.empty): use torch.zeros or torch.full")


_IDENTITY = Lowering(kind="identity")
_CAST = Lowering(kind="cast")
_VIEW = Lowering(kind="view")


def _reduce(name: str) -> Lowering:
    return Lowering(fn=name, kind="reduce")

# -- the table -----------------------------------------------------------------------------------
# Keys are OpOverloadPackets (every overload of the op: add.Tensor and add.Scalar alike) or single
# OpOverloads; ``lookup`` tries the overload first.

LOWERINGS: dict[Any, Lowering] = {
    # arithmetic; integer results also build sympy index expressions
    aten.add: Lowering(
        _with_alpha(lambda a, b: f"{a} + {b}", 1), ADD, sym=lambda a, b, alpha=1: a + alpha * b, on_bools="|"
    ),
    aten.sub: Lowering(_with_alpha(lambda a, b: f"{a} - {b}", 1), ADD, sym=lambda a, b, alpha=1: a - alpha * b),
    aten.rsub: Lowering(
        _with_alpha(lambda a, b: f"{b} - {a}", 0), ADD, left=(1,), sym=lambda a, b, alpha=1: b - alpha * a
    ),
    aten.mul: infix("*", MUL, sym=operator.mul, on_bools="&"),
    aten.div: Lowering(
        _div, MUL, sym=lambda a, b, rounding_mode=None: floor_div(a, b) if rounding_mode == "floor" else None
    ),
    aten.neg: Lowering(lambda a: f"-{a}", UNARY, sym=operator.neg),
    aten.floor_divide: Lowering(_floor_divide, ATOM, sym=floor_div),
    aten.remainder: Lowering(lambda a, b: f"py_remainder({a}, {b})", ATOM, sym=py_mod),
    aten.fmod: infix("%", MUL),  # Triton's % is C's fmod: the sign of the dividend, like torch.fmod
    aten.reciprocal: Lowering(lambda a: f"1.0 / {a}", MUL, left=()),
    aten.square: Lowering(lambda a: f"{a} * {a}", MUL, reuses=True, on_bools="="),
    aten.pow: Lowering(_pow, ATOM, reuses=True),
    aten.abs: call("tl.abs", on_bools="="),
    aten.floor: Lowering(_floor_or_ceil("floor"), on_bools="="),
    aten.ceil: Lowering(_floor_or_ceil("ceil"), on_bools="="),
    aten.round: Lowering(_round, on_bools="="),  # half to even, like torch (not floor(x + 0.5))
    aten.trunc: Lowering(_float_or_same("trunc_float"), on_bools="="),
    aten.fix: Lowering(_float_or_same("trunc_float"), on_bools="="),
    aten.sign: Lowering(_sign, reuses=True, on_bools="="),
    aten.sgn: Lowering(_sign, reuses=True, on_bools="="),
    **{op: call(name) for op, name in _FLOAT_FUNCTIONS.items()},
    aten.log1p: call("torch_log1p"),
    aten.expm1: call("torch_expm1"),
    aten.gelu: Lowering(_gelu),
    aten.silu: call("silu"),
    aten.softplus: Lowering(_softplus, reuses=True),
    aten.relu: Lowering(_relu, on_bools="="),
    aten.hardtanh: Lowering(_hardtanh),
    # min / max
    aten.minimum: Lowering(lambda a, b: _minimum(a, b, _is_float(a)), on_bools="&"),
    aten.maximum: Lowering(lambda a, b: _maximum(a, b, _is_float(a)), on_bools="|"),
    aten.min.other: Lowering(lambda a, b: _minimum(a, b, _is_float(a)), on_bools="&"),
    aten.max.other: Lowering(lambda a, b: _maximum(a, b, _is_float(a)), on_bools="|"),
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
    aten.bitwise_and: infix("&", BAND, on_bools="fn"),
    aten.bitwise_or: infix("|", BOR, on_bools="fn"),
    aten.bitwise_xor: infix("^", BXOR, on_bools="fn"),
    aten.bitwise_not: Lowering(_bitwise_not, UNARY, on_bools="fn"),
    aten.__lshift__: Lowering(_shift("<<")),
    aten.bitwise_left_shift: Lowering(_shift("<<")),
    aten.__rshift__: Lowering(_shift(">>")),
    aten.bitwise_right_shift: Lowering(_shift(">>")),
    aten.where: call("tl.where", inputs=WHERE),
    # dtype casts: the target is the node's output dtype (see emit.py for float16/bfloat16 rounding)
    aten._to_copy: _CAST,
    aten.to: _CAST,
    prims.convert_element_type: _CAST,
    # constants: torch's and_masks / or_masks / noop_mask start from `b.new_ones((), dtype=torch.bool)`
    aten.scalar_tensor: _constant(lambda value, **_: value),
    aten.full: _constant(lambda size, value, **_: value),
    aten.full_like: _constant(lambda x, value, **_: value),
    aten.ones_like: _constant(lambda x, **_: 1),
    aten.zeros_like: _constant(lambda x, **_: 0),
    aten.ones: _constant(lambda size, **_: 1),
    aten.zeros: _constant(lambda size, **_: 0),
    aten.new_zeros: _constant(lambda x, size, **_: 0),
    aten.new_ones: _constant(lambda x, size, **_: 1),
    aten.new_full: _constant(lambda x, size, fill_value, **_: fill_value),
    aten.new_empty: _constant(_undefined_constant),
    aten.empty_like: _constant(_undefined_constant),
    # copies of a value are the value
    aten.detach: _IDENTITY,
    aten.clone: _IDENTITY,
    aten.alias: _IDENTITY,
    aten.lift_fresh_copy: _IDENTITY,
    aten.lift_fresh: _IDENTITY,
    aten.contiguous: _IDENTITY,
    # reads of captured tensors: `bias[h, q_idx - kv_idx]`, `intervals[doc[kv_idx]][0]`
    aten.index.Tensor: Lowering(kind="gather"),
    aten.select.int: Lowering(kind="select"),
    # views: of a captured tensor they change the offset and strides of its reads (`table.T[kv, q]`,
    # `table[:, 1:]`); of a value with one element they change nothing (`kv_tile.unsqueeze(-1)`)
    aten.unsqueeze: _VIEW,
    aten.squeeze: _VIEW,
    aten.view.default: _VIEW,
    aten.reshape: _VIEW,
    aten._unsafe_view: _VIEW,
    aten.expand: _VIEW,
    aten.permute: _VIEW,
    aten.transpose: _VIEW,
    aten.t: _VIEW,
    aten.numpy_T: _VIEW,
    aten.slice.Tensor: _VIEW,
    # reductions over a small vector read from a captured tensor, unrolled (`torch.dot(qe[q], ke[kv])`)
    aten.sum: _reduce("sum"),
    aten.mean: _reduce("mean"),
    aten.prod: _reduce("prod"),
    aten.any: _reduce("any"),
    aten.all: _reduce("all"),
    aten.amax: _reduce("max"),
    aten.amin: _reduce("min"),
    aten.max.default: _reduce("max"),
    aten.min.default: _reduce("min"),
    aten.dot: _reduce("dot"),
    aten.vdot: _reduce("dot"),
}

# Overrides for lower(..., tanh_approx=True), as tinygrad's backends override ``code_for_op``.
APPROX_TANH = {aten.tanh: call("tanh_approx")}


# Custom ops of libraries that mean an aten op: attention-gym's softcap(approx=True) calls
# `approx::tanh`, its way of asking for the hardware tanh (which lower(..., tanh_approx=True) gives).
ALIASES = {"approx::tanh": aten.tanh}


def lookup(target: Any, table: dict) -> Optional[Lowering]:
    """The entry for an fx node's target: its overload's own entry, else its op's (or its alias's)."""
    entry = table.get(target)
    if entry is None:
        entry = table.get(getattr(target, "overloadpacket", None))
    if entry is None:
        schema = getattr(target, "_schema", None)
        alias = ALIASES.get(getattr(schema, "name", None))
        if alias is not None:
            entry = table.get(alias)
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
            ast.Add: ADD, ast.Sub: ADD, ast.LShift: SHIFT, ast.RShift: SHIFT, ast.BitAnd: BAND,
            ast.BitXor: BXOR, ast.BitOr: BOR,
        }.get(type(node.op), 0)  # fmt: skip
    if isinstance(node, ast.Compare):
        return CMP
    return 0


# How many entries register_lowering added or replaced in this process.
user_entries = 0


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
    global user_entries
    user_entries += 1  # the kernel index (codegen/source.py) no longer serves this process
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

