"""Integer index arithmetic as sympy expressions, printed as Triton source.

Integer values that come from ``b``, ``h``, ``q_idx``, ``kv_idx``, integer constants, loaded
integers and stride parameters through ``+ - * //`` and ``%`` are kept as sympy expressions while the
graph is walked. sympy folds what the user's code leaves in (``q_idx - kv_idx + 255 - 255`` is
``q_idx - kv_idx``; ``intervals[doc[q], 1]`` adds ``1 * stride1``, i.e. ``stride1``) and the printer
below writes the result back as Triton source. Float math never enters sympy: rounding makes its
algebra unsound.

``FloorDiv`` and ``PyMod`` are PyTorch's (and Python's) integer ``//`` and ``%``: they round toward
negative infinity and give the remainder the divisor's sign. Triton's own ``//`` and ``%`` truncate
like C, so they print as calls to the ``py_floordiv`` / ``py_remainder`` helpers of
``templates/mod_helpers.py.jinja``.

An expression is printed in one dtype: int32, or int64 (``wide``) when the bounds analysis says its
value can leave int32. Every symbol carries its own dtype (a loaded int64 value, an int32 index), and
a wide expression starts each sum and product from an int64 operand, so nothing is formed in int32
first. Reordering by sympy is safe in int32 too: ``+ - *`` wrap modulo 2**32 whatever the order, and
the expression's value is known to fit.
"""

from __future__ import annotations

from typing import Mapping

import torch

__all__ = ["FloorDiv", "PyMod", "floor_div", "py_mod", "print_index", "wrap_int", "sympy", "ATOM", "UNARY", "MUL", "ADD", "SHIFT"]


class _Sympy:
    """sympy, imported at the first use of one of its names."""

    def __getattr__(self, name: str):
        import sympy as module

        return getattr(module, name)


# Importing sympy costs about 0.9 s, half of `import flexattn` on top of torch, and only lowering a mod
# uses it: a process whose kernels come from the kernel index never does. The lowering's modules take
# sympy from here, and FloorDiv and PyMod are made at their first use (below). Not importlib's
# LazyLoader: a lazy module in sys.modules is loaded by anything that scans sys.modules (inspect does,
# when torch.library registers an op).
sympy = _Sympy()

# Binding strength of the outermost operator of an expression, as in Python's grammar (higher binds
# tighter). An operand is put in parentheses when it binds more loosely than its position needs.
ATOM = 100  # names, literals, calls, subscripts, parenthesised expressions
UNARY = 80  # -x, ~x
MUL = 70  # * / // %
ADD = 60  # + -
SHIFT = 55  # << >>
BAND = 50  # &
BXOR = 45  # ^
BOR = 40  # |
CMP = 30  # == != < <= > >= (these chain in Python, so a comparison never takes a bare comparison)


def _divides(divisor: sympy.Integer, expr: sympy.Expr) -> bool:
    """True when every term of ``expr`` has an integer coefficient that ``divisor`` divides."""
    for term in sympy.Add.make_args(expr):
        coeff, _ = term.as_coeff_Mul()
        if not coeff.is_Integer or int(coeff) % int(divisor) != 0:
            return False
    return True


def _floor_div_eval(cls, a, b):
    if b == 1:
        return a
    if a.is_Integer and b.is_Integer and b != 0:
        return sympy.Integer(int(a) // int(b))
    if b.is_Integer and b != 0 and _divides(b, a):  # (4*x + 8) // 4 == x + 2, exactly
        return sympy.expand(a / b)
    return None


def _py_mod_eval(cls, a, b):
    if b == 1 or b == -1:
        return sympy.Integer(0)
    if a.is_Integer and b.is_Integer and b != 0:
        return sympy.Integer(int(a) % int(b))
    if b.is_Integer and b != 0 and _divides(b, a):
        return sympy.Integer(0)
    return None


_FUNCTIONS: dict = {}


def _sympy_functions() -> dict:
    """FloorDiv (``a // b`` rounding toward negative infinity) and PyMod (``a % b`` with the sign of
    ``b``), integer sympy functions, made once: subclassing sympy.Function imports sympy."""
    if not _FUNCTIONS:
        for name, doc, eval_ in (("FloorDiv", "``a // b`` rounding toward negative infinity, for integers.", _floor_div_eval),
                                 ("PyMod", "``a % b`` with the sign of ``b``, for integers.", _py_mod_eval)):
            _FUNCTIONS[name] = type(name, (sympy.Function,), {
                "__doc__": doc, "__module__": __name__, "is_integer": True, "eval": classmethod(eval_)})
    return _FUNCTIONS


def floor_div(a, b):
    """``FloorDiv(a, b)``, for tables that must not make the class at import."""
    return _sympy_functions()["FloorDiv"](a, b)


def py_mod(a, b):
    """``PyMod(a, b)``, for tables that must not make the class at import."""
    return _sympy_functions()["PyMod"](a, b)


def __getattr__(name: str):
    if name in ("FloorDiv", "PyMod"):
        return _sympy_functions()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _paren(text_prec: tuple[str, int], need: int) -> str:
    text, prec = text_prec
    return text if prec >= need else f"({text})"


def wrap_int(value: int, dtype: torch.dtype) -> int:
    """``value`` reduced to ``dtype``'s range as two's complement arithmetic does (torch wraps weak
    constants this way: ``int32_tensor + 2**32`` adds 0)."""
    bits = _BITS[dtype]
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


_BITS = {torch.int8: 8, torch.uint8: 8, torch.int16: 16, torch.int32: 32, torch.int64: 64}


class _Printer:
    """sympy integer expression -> (Triton source, binding strength).

    ``names`` gives the source text for each symbol (a kernel variable, or an inlined expression
    such as a load), ``dtypes`` its dtype (int32 when absent). Symbols in ``last`` (stride
    parameters) are written after the other factors of a product, so offsets read ``index * stride``.

    ``wide``: write the expression so that it is computed in int64 from its first operation on: the
    first tensor operand of every sum and product is an int64 value (an int64 symbol, or an int32 one
    cast with ``.to(tl.int64)``), so no partial sum or product is formed in int32. Otherwise every
    constant is reduced to int32 (int32 sums and products wrap alike in any order, so this is what
    torch computes).
    """

    def __init__(self, names, last: frozenset, dtypes, wide: bool):
        self.names = names
        self.last = last
        self.dtypes = dtypes
        self.wide = wide

    def int(self, value: int) -> tuple[str, int]:
        value = wrap_int(value, torch.int64 if self.wide else torch.int32)
        return str(value), (ATOM if value >= 0 else UNARY)

    def print(self, expr: sympy.Expr, force: bool = False) -> tuple[str, int]:
        """``force``: (wide mode) the value written must itself be an int64 tensor."""
        if expr.is_Integer:
            return self.int(int(expr))
        if expr.is_Symbol:
            shown = self.names.get(expr, (expr.name, ATOM))
            if force and self.dtypes.get(expr, torch.int32) != torch.int64:
                return f"{_paren(shown, ATOM)}.to(tl.int64)", ATOM
            return shown
        if expr.is_Add:
            return self._add(expr)
        if expr.is_Mul or expr.is_Pow:
            return self._mul(expr, force)
        functions = _sympy_functions()
        if isinstance(expr, (functions["FloorDiv"], functions["PyMod"])):
            name = "py_floordiv" if isinstance(expr, functions["FloorDiv"]) else "py_remainder"
            a, b = (self.print(arg, force=self.wide)[0] for arg in expr.args)
            return f"{name}({a}, {b})", ATOM
        raise NotImplementedError(f"cannot print {sympy.srepr(expr)} as Triton index arithmetic")

    def _add(self, expr: sympy.Add) -> tuple[str, int]:
        const, rest = expr.as_coeff_Add()

        def order(term):  # positive terms first, offset terms in the order of their strides
            strides = tuple(sorted(s.name for s in term.free_symbols if s in self.last))
            # wide: products first, so the sum starts int64 there and later plain symbols need no cast
            lone = self.wide and term.is_Symbol
            return (term.could_extract_minus_sign(), lone, strides, sympy.default_sort_key(term))

        terms = sorted(sympy.Add.make_args(rest), key=order)
        parts: list[str] = []
        if const > 0 and all(t.could_extract_minus_sign() for t in terms):
            parts.append(self.int(int(const))[0])  # 2 - q_idx rather than -q_idx + 2
            const = sympy.Integer(0)
        for i, term in enumerate(terms):
            negative = term.could_extract_minus_sign()
            written = -term if (negative and parts) else term
            # wide: the first term starts the int64 sum; later products must not overflow on their own
            force = self.wide and (i == 0 or not written.is_Symbol)
            shown = self.print(written, force)
            if not parts:
                parts.append(_paren(shown, ADD))  # a shift or a bitwise op binds more loosely than +
            else:
                parts.append(("- " if negative else "+ ") + _paren(shown, ADD + 1))
        if const != 0:
            value = int(self.int(int(const))[0])
            parts.append(f"- {-value}" if value < 0 else f"+ {value}")
        return " ".join(parts), ADD

    def _mul(self, expr: sympy.Expr, force: bool) -> tuple[str, int]:
        coeff, rest = expr.as_coeff_Mul()
        factors: list[sympy.Expr] = []
        for factor in sympy.Mul.make_args(rest):
            base, exp = factor.as_base_exp()
            if not (exp.is_Integer and int(exp) >= 1):
                raise NotImplementedError(f"cannot print {factor} as Triton index arithmetic")
            factors.extend([base] * int(exp))
        factors.sort(key=lambda f: (f in self.last, sympy.default_sort_key(f)))
        if self.wide:  # an int64 factor first, if there is one, saves a cast
            first = next((i for i, f in enumerate(factors) if self.dtypes.get(f) == torch.int64), 0)
            factors.insert(0, factors.pop(first))
        shown = []
        for i, f in enumerate(factors):
            f_force = self.wide and ((i == 0 and force) or not f.is_Symbol)
            shown.append(_paren(self.print(f, f_force), MUL if i == 0 else MUL + 1))
        coeff_value = int(self.int(int(coeff))[0])
        if coeff_value == -1:
            return "-" + " * ".join(shown), MUL
        if coeff_value != 1:
            shown.insert(0, str(coeff_value))
        return " * ".join(shown), MUL


def print_index(
    expr: sympy.Expr,
    names: Mapping[sympy.Symbol, tuple[str, int]] = {},
    last: frozenset = frozenset(),
    *,
    dtypes: Mapping[sympy.Symbol, torch.dtype] = {},
    wide: bool = False,
) -> tuple[str, int]:
    """Triton source for an integer sympy expression, and how tightly its outer operator binds.

    ``wide``: computed in int64 throughout (see ``_Printer``); otherwise in int32.
    """
    return _Printer(names, last, dtypes, wide).print(expr, force=wide)
