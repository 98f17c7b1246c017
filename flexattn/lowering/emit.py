"""Walk a traced mod's fx graph once and write it as Triton statements.

The walk follows tinygrad's renderer (style.md, section E): one pass over the nodes in order, each
node's source built by its entry in ``ops.LOWERINGS``; a value used more than once is given a name
(``sm_t0 = ...``), a value used once is written inline where it is used.

Values in the walk are either

* ``Val``: a Triton expression with the dtype it has in the kernel. Integer values built from
  ``b``/``h``/``q_idx``/``kv_idx``/constants by ``+ - * // %`` also carry a sympy expression
  (``sym``), which later integer ops extend and simplify (index.py); or
* ``Gather``: a captured tensor with some leading dimensions indexed, kept as a sympy offset from
  its pointer plus the dimensions still open. The load is written only when no dimension is left,
  so ``intervals[doc_id[kv_idx]][0]`` becomes one ``tl.load`` at ``row * stride0 + 0 * stride1``.

Dtypes. Every float is float32 in the kernel, whatever torch computes it in: loads of float16,
bfloat16 and float64 tensors are converted to float32, float64 arithmetic runs in float32 (kernels
are fp32 throughout), and float16/bfloat16 arithmetic runs in float32 without rounding each step
(as Inductor does). An explicit cast to float16/bfloat16 (``x.half()``) still rounds, through
``.to(tl.float16).to(tl.float32)`` or ``round_to_bfloat16(x)``. Integers and bools keep torch's
dtypes: before each op its operands are cast to the dtype torch would compute in
(``node.meta["val"].dtype``), so an int32 index plus an int64 captured value is an int64 sum, and
``int / int`` is a float32 division. Comparisons give ``tl.int1``. Integer index arithmetic is
assumed not to overflow (sympy may reorder it).
"""

from __future__ import annotations

import difflib
import keyword
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import sympy
import torch
import torch.fx

from ..errors import UnsupportedOpError
from ..trace import CapturedInput, TracedMod, source_line_of
from .index import ADD, ATOM, BAND, BOR, BXOR, CMP, print_index
from .ranges import LoweringVariant
from .ops import (
    BOOL,
    COMMON,
    KEEP,
    RESULT,
    TL_DTYPES,
    WHERE,
    Lowering,
    Operand,
    literal,
    lookup,
    precedence_of,
    supported_op_names,
    with_options,
)

__all__ = ["ModInputs", "LoweredMod", "lower"]


@dataclass(frozen=True)
class ModInputs:
    """Names of the mod's arguments inside the kernel."""

    score: str = "qk"  # float32 tile [BLOCK_M, BLOCK_N] (score_mod only)
    b: str = "off_z"  # scalar int32 program value (batch)
    h: str = "off_hq"  # scalar int32 (query head)
    q_idx: str = "q_idx"  # int32 [BLOCK_M, 1]
    kv_idx: str = "kv_idx"  # int32 [1, BLOCK_N]


@dataclass(frozen=True)
class LoweredMod:
    """A mod as Triton source, to paste at a hook point of a kernel template.

    lines: statements, unindented, that define the temporaries ``{prefix}t0, {prefix}t1, ...``.
    result: an expression for the mod's value: float32 for a score_mod, ``tl.int1`` for a mask_mod.
        Its shape is whatever the inputs it reads broadcast to ([], [BLOCK_M, 1], [1, BLOCK_N] or
        [BLOCK_M, BLOCK_N]; [1, 1] for a constant), so the kernel broadcasts it to the tile.
    kernel_params: extra kernel parameters, in order: per captured input N, ``{prefix}N_ptr`` then
        ``{prefix}N_stride{d}`` for each of its dims d. The launcher passes ``t, *t.stride()``.
    captured: ``TracedMod.captured``, one entry per group of ``kernel_params``.
    """

    lines: tuple[str, ...]
    result: str
    kernel_params: tuple[str, ...]
    captured: tuple[CapturedInput, ...]

    @property
    def body(self) -> str:
        """The lines as one block of source (handy for templates and for reading)."""
        return "\n".join(self.lines)


@dataclass(frozen=True)
class Val:
    """A value in the kernel: Triton source and the dtype it has there (floats: float32)."""

    text: str
    dtype: torch.dtype
    prec: int = ATOM  # binding strength of text's outer operator (index.py)
    sym: Optional[sympy.Expr] = None  # the same integer as a sympy expression, for index arithmetic
    value: Any = None  # the Python number, when the value is a constant

    @property
    def trivial(self) -> bool:
        """A name or a constant: never worth a temporary."""
        return self.value is not None or (self.text.isidentifier() and not keyword.iskeyword(self.text))


@dataclass(frozen=True)
class Gather:
    """Captured tensor ``index`` read at ``ptr + offset``, with dimensions ``dims`` not yet indexed."""

    index: int
    offset: sympy.Expr
    dims: tuple[int, ...]
    casts: tuple[torch.dtype, ...] = ()  # casts of the whole tensor (DOC.float()), applied after the load


# Python orders & ^ | above comparisons, unlike C; mixed chains get parentheses so nobody has to know.
_LOGIC_AND_CMP = (BAND, BXOR, BOR, CMP)
_INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_INDEX_INTS = (torch.int32, torch.int64)  # dtypes kept as sympy expressions (narrower ones are cast up)


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point else dtype


def _paren(v: Val, need: int) -> str:
    return v.text if v.prec >= need else f"({v.text})"


def _const(value: Any, dtype: torch.dtype) -> Val:
    """A constant of torch dtype ``dtype``, rounded as torch would store it."""
    if dtype in (torch.float32, torch.float64) and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)  # written as given (0.1, not 0.10000000149011612): Triton rounds it alike
    else:
        value = torch.tensor(value, dtype=dtype).item()
    text, prec = literal(value)
    return Val(text, kernel_dtype(dtype), prec, value=value)


def _weak(value: Union[bool, int, float]) -> Val:
    """A Python number argument (torch's "wrapped number": it does not decide the result dtype)."""
    dtype = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float32
    text, prec = literal(value)
    return Val(text, dtype, prec, value=value)


def _flat_nodes(args) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, found.append)
    return found


def _hashable(arg, canonical):
    if isinstance(arg, torch.fx.Node):
        return canonical[arg]
    if isinstance(arg, (list, tuple)):
        return tuple(_hashable(a, canonical) for a in arg)
    if isinstance(arg, dict):
        return tuple(sorted((k, _hashable(v, canonical)) for k, v in arg.items()))
    return (type(arg), arg)


def _common_subexpressions(graph: torch.fx.Graph):
    """Map each node to the first node computing the same thing, and count uses of those.

    make_fx records ``doc_id[q_idx]`` twice when the user writes it twice; reading it once keeps
    the kernel from loading it twice. (The traced graph is shared and cached, so it is not edited.)
    """
    canonical: dict[torch.fx.Node, torch.fx.Node] = {}
    first: dict[Any, torch.fx.Node] = {}
    uses: Counter = Counter()
    for node in graph.nodes:
        canonical[node] = node
        if node.op == "call_function":
            try:
                key = (node.target, _hashable(node.args, canonical), _hashable(node.kwargs, canonical))
                hash(key)
            except TypeError:
                key = None
            if key is not None:
                if key in first:
                    canonical[node] = first[key]
                    continue
                first[key] = node
        for used in _flat_nodes((node.args, node.kwargs)):
            uses[canonical[used]] += 1
    return canonical, uses


def _node_text(node: torch.fx.Node) -> str:
    def show(a):
        if isinstance(a, torch.fx.Node):
            return a.name
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(show(x) for x in a) + "]"
        return repr(a)

    args = [show(a) for a in node.args] + [f"{k}={show(v)}" for k, v in node.kwargs.items()]
    return f"{node.name} = {node.target}({', '.join(args)})"


_INDEX_FIRST = (
    "Index captured tensors down to one element before computing with them: bias[h, q_idx] * 2, "
    "not (bias * 2)[h, q_idx]; a mod computes one value per (query, key) pair."
)

# Ops users reach for that have no entry, and what to write instead.
_HINTS = {
    **dict.fromkeys(
        ["cumsum", "cumprod", "cummax", "cummin", "sort", "argsort", "topk", "sum", "mean", "prod", "amax",
         "amin", "max", "min", "argmax", "argmin", "any", "all", "unique", "nonzero", "searchsorted"],
        "A mod sees one (query, key) pair at a time, so reductions, scans and sorts over a tensor "
        "cannot run inside it. Compute them once outside the mod and capture the result, e.g. "
        "`offsets = lengths.cumsum(0)` outside and `offsets[doc_id[q_idx]]` inside.",
    ),  # fmt: skip
    "fmax": "torch.maximum (propagates NaN)",
    "fmin": "torch.minimum (propagates NaN)",
    "round": "torch.floor(x + 0.5)",
    "trunc": "torch.div(a, b, rounding_mode='trunc') for a quotient",
    "log1p": "torch.log(1 + x)",
    "expm1": "torch.exp(x) - 1",
    "sign": "torch.where(x > 0, 1, 0) - torch.where(x < 0, 1, 0)",
    "softplus": "torch.log(1 + torch.exp(x))",
    "relu": "torch.clamp_min(x, 0)",
    "hardtanh": "torch.clamp(x, lo, hi)",
    "bitwise_left_shift": "multiplication by a power of two",
}


class _Emitter:
    def __init__(self, traced: TracedMod, inputs: ModInputs, prefix: str, table: dict):
        self.traced = traced
        self.inputs = inputs
        self.prefix = prefix
        self.table = table
        self.lines: list[str] = []
        self.env: dict[torch.fx.Node, Union[Val, Gather]] = {}
        self.names: dict[sympy.Symbol, tuple[str, int]] = {}  # symbols standing for inline source
        self.sym_dtypes: dict[sympy.Symbol, torch.dtype] = {}
        self.strides: set[sympy.Symbol] = set()
        self.n_temps = 0

    # -- the walk --------------------------------------------------------------------------------

    def run(self) -> LoweredMod:
        graph = self.traced.graph
        self.canonical, uses = _common_subexpressions(graph)
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        n_args = len(self.traced.arg_names)
        if len(placeholders) != n_args + len(self.traced.captured):
            raise ValueError(f"graph of {self.traced.name} has {len(placeholders)} inputs, expected "
                             f"{n_args} arguments and {len(self.traced.captured)} captured tensors")  # fmt: skip
        result = None
        for node in graph.nodes:
            if self.canonical[node] is not node:
                continue
            if node.op == "placeholder":
                position = placeholders.index(node)
                if position < n_args:
                    value = self.argument(self.traced.arg_names[position])
                else:
                    value = self.captured_input(position - n_args)
            elif node.op == "call_function":
                value = self.call(node)
            elif node.op == "output":
                result = self.result(node)
                continue
            else:
                raise self.unsupported(node, f"a graph node of kind {node.op!r} ({node.target})")
            self.env[node] = self.settle(value, uses[node])
        return LoweredMod(
            lines=tuple(self.lines),
            result=result,
            kernel_params=tuple(p for i in range(len(self.traced.captured)) for p in self.params(i)),
            captured=tuple(self.traced.captured),
        )

    def settle(self, value: Union[Val, Gather], uses: int) -> Union[Val, Gather]:
        """Load a fully indexed gather; name a value that more than one node reads."""
        if isinstance(value, Gather):
            if not value.dims:
                value = self.load(value)
            elif uses > 1:  # each read writes the offset again: name what it loads first
                value = replace(value, offset=self.name_inline_symbols(value.offset))
        if isinstance(value, Val) and uses > 1 and not value.trivial:
            value = self.temp(value)
        return value

    def result(self, node: torch.fx.Node) -> str:
        (out,) = node.args
        value = self.value_of(out, node)
        if value.value is not None:  # a constant: make it a tensor the kernel can broadcast
            return f"tl.full([1, 1], {value.text}, {TL_DTYPES[value.dtype]})"
        return value.text

    # -- inputs ----------------------------------------------------------------------------------

    def argument(self, arg_name: str) -> Val:
        name = getattr(self.inputs, arg_name)  # ModInputs' fields are named after the mod's arguments
        if arg_name == "score":
            return Val(name, torch.float32)
        return Val(name, torch.int32, sym=self.symbol(name, torch.int32))

    def captured_input(self, i: int) -> Union[Val, Gather]:
        c = self.traced.captured[i]
        if c.dtype not in TL_DTYPES:
            raise UnsupportedOpError(
                f"Cannot lower {self.traced.kind} '{self.traced.name}' to Triton: captured tensor "
                f"'{c.name}' has dtype {c.dtype}; use one of {', '.join(str(d) for d in TL_DTYPES)}"
            )
        if c.fixed_value is not None and len(c.shape) == 0:
            # A constant the mod builds itself (torch.tensor(1), or the int of `x[doc, 1]`): its
            # value is fixed by the mod's code, so it is written into the kernel as a literal.
            return _const(c.fixed_value.item(), c.dtype)
        return Gather(i, sympy.Integer(0), tuple(range(len(c.shape))))

    def params(self, i: int) -> list[str]:
        c = self.traced.captured[i]
        return [f"{self.prefix}{c.name}_ptr"] + [f"{self.prefix}{c.name}_stride{d}" for d in range(len(c.shape))]

    def stride(self, i: int, dim: int) -> sympy.Symbol:
        s = self.symbol(self.params(i)[1 + dim], torch.int32)
        self.strides.add(s)
        return s

    # -- names -----------------------------------------------------------------------------------

    def symbol(self, name: str, dtype: torch.dtype) -> sympy.Symbol:
        s = sympy.Symbol(name, integer=True)
        self.sym_dtypes[s] = dtype
        return s

    def temp(self, value: Val) -> Val:
        name = f"{self.prefix}t{self.n_temps}"
        self.n_temps += 1
        self.lines.append(f"{name} = {value.text}")
        sym = self.symbol(name, value.dtype) if value.sym is not None else None
        return Val(name, value.dtype, ATOM, sym=sym)

    def name_inline_symbols(self, expr: sympy.Expr) -> sympy.Expr:
        """Replace symbols that stand for inline source (a load) by temporaries."""
        subs = {}
        for s in sorted(expr.free_symbols, key=lambda s: s.name):
            if s in self.names:
                text, prec = self.names[s]
                subs[s] = self.temp(Val(text, self.sym_dtypes[s], prec, sym=s)).sym
        return expr.xreplace(subs) if subs else expr

    # -- sympy <-> source --------------------------------------------------------------------------

    def to_sym(self, v: Val) -> sympy.Expr:
        if v.sym is not None:
            return v.sym
        if v.value is not None:
            return sympy.Integer(int(v.value))
        if v.dtype not in _INDEX_INTS:  # int8 + int8 wraps in int8: widen before sympy reorders it
            v = self.coerce(v, torch.int32)
        if v.trivial:
            return self.symbol(v.text, v.dtype)
        s = sympy.Symbol(f"_inline{len(self.names)}", integer=True)
        self.names[s] = (v.text, v.prec)
        self.sym_dtypes[s] = v.dtype
        return s

    def sym_val(self, expr: sympy.Expr, dtype: torch.dtype) -> Val:
        expr = sympy.sympify(expr)
        if expr.is_Integer:
            return _const(int(expr), dtype)
        text, prec = print_index(expr, self.names, frozenset(self.strides))
        natural = torch.int32
        for s in expr.free_symbols:
            natural = torch.promote_types(natural, self.sym_dtypes.get(s, torch.int32))
        if natural != dtype:
            text, prec = f"{text if prec >= ATOM else f'({text})'}.to({TL_DTYPES[dtype]})", ATOM
        return Val(text, dtype, prec, sym=expr)

    # -- dtype conversions -----------------------------------------------------------------------

    def coerce(self, v: Val, dtype: torch.dtype) -> Val:
        """``v`` as kernel dtype ``dtype`` (a plain conversion; floats are all float32)."""
        if v.value is not None:
            return _const(v.value, dtype)
        if v.dtype == dtype:
            return v
        if dtype == torch.bool:
            return Val(f"{_paren(v, CMP + 1)} != 0", torch.bool, CMP)
        if v.sym is not None and dtype in _INDEX_INTS:
            return self.sym_val(v.sym, dtype)
        return Val(f"{_paren(v, ATOM)}.to({TL_DTYPES[dtype]})", dtype, ATOM)

    def convert(self, v: Val, dtype: torch.dtype) -> Val:
        """``v.to(dtype)`` as torch computes it: a cast to float16/bfloat16 rounds."""
        if v.value is not None:
            return _const(v.value, dtype)
        if dtype == torch.float16:
            return Val(f"{_paren(v, ATOM)}.to(tl.float16).to(tl.float32)", torch.float32, ATOM)
        if dtype == torch.bfloat16:  # see round_to_bfloat16 in mod_helpers.py.jinja for why not .to()
            return Val(f"round_to_bfloat16({self.coerce(v, torch.float32).text})", torch.float32, ATOM)
        return self.coerce(v, kernel_dtype(dtype))

    # -- reads of captured tensors ---------------------------------------------------------------

    def load(self, g: Gather) -> Val:
        c = self.traced.captured[g.index]
        ptr = self.params(g.index)[0]
        if g.offset == 0:
            address = ptr
        else:
            text, prec = print_index(g.offset, self.names, frozenset(self.strides))
            address = f"{ptr} + {text if prec > ADD else f'({text})'}"
        text = f"tl.load({address})"
        if c.dtype == torch.bool:  # bool tensors hold one byte per element: compare, don't trust the bits
            v = Val(f"{text} != 0", torch.bool, CMP)
        elif c.dtype.is_floating_point:
            v = Val(text if c.dtype == torch.float32 else f"{text}.to(tl.float32)", torch.float32)
        else:
            v = Val(text, c.dtype)
        for dtype in g.casts:
            v = self.convert(v, dtype)
        return v

    def gather(self, node: torch.fx.Node) -> Gather:
        src, indices = node.args[0], node.args[1]
        g = self.gather_of(src, node)
        if len(indices) > len(g.dims):
            raise self.unsupported(node, f"{len(indices)} indices for a tensor with {len(g.dims)} dimensions left")
        shape = self.traced.captured[g.index].shape
        offset = g.offset
        for dim, index in zip(g.dims, indices):
            if not isinstance(index, torch.fx.Node):
                raise self.unsupported(
                    node, "indexing with slices, None or Ellipsis",
                    "Index every leading dimension with an integer or an index tensor: bias[h, q_idx - kv_idx].",
                )  # fmt: skip
            v = self.value_of(index, node)
            if v.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64):
                raise self.unsupported(
                    node, f"an index of dtype {index.meta['val'].dtype} (a boolean mask, not a position)",
                    "Index with integer positions; for a boolean condition use torch.where(cond, a, b).",
                )  # fmt: skip
            if v.value is not None:
                position = int(v.value)
                term = sympy.Integer(position + shape[dim] if position < 0 else position)
            else:
                term = self.to_sym(v)
            offset = offset + term * self.stride(g.index, dim)
        return replace(g, offset=offset, dims=g.dims[len(indices):])

    def select(self, node: torch.fx.Node) -> Gather:
        src, dim, position = node.args[:3]
        g = self.gather_of(src, node)
        if not isinstance(position, int) or not isinstance(dim, int):
            raise self.unsupported(node, "select with a symbolic index")
        dim = dim + len(g.dims) if dim < 0 else dim
        d = g.dims[dim]
        size = self.traced.captured[g.index].shape[d]
        position = position + size if position < 0 else position
        offset = g.offset + position * self.stride(g.index, d)
        return replace(g, offset=offset, dims=g.dims[:dim] + g.dims[dim + 1:])

    def gather_of(self, arg, node: torch.fx.Node) -> Gather:
        g = self.env.get(self.canonical.get(arg)) if isinstance(arg, torch.fx.Node) else None
        if not isinstance(g, Gather):
            raise self.unsupported(node, "indexing a value computed inside the mod",
                                   "Only captured tensors can be indexed: index first, then compute.")  # fmt: skip
        return g

    # -- one op ----------------------------------------------------------------------------------

    def value_of(self, arg, node: torch.fx.Node) -> Val:
        """The Val of a node argument (Python numbers become constants)."""
        if isinstance(arg, torch.fx.Node):
            v = self.env[self.canonical[arg]]
            if isinstance(v, Gather):
                shape = tuple(self.traced.captured[v.index].shape[d] for d in v.dims)
                raise self.unsupported(node, f"a captured tensor used with dimensions of size {shape} not indexed",
                                       _INDEX_FIRST)  # fmt: skip
            return v
        if isinstance(arg, (bool, int, float)):
            return _weak(arg)
        raise self.unsupported(node, f"an argument of type {type(arg).__name__} ({arg!r})")

    def call(self, node: torch.fx.Node) -> Union[Val, Gather]:
        rule = lookup(node.target, self.table)
        if rule is None:
            raise self.unknown_op(node)
        if rule.kind == "gather":
            return self.gather(node)
        if rule.kind == "select":
            return self.select(node)
        if rule.kind == "identity":
            (src, *_) = node.args
            if isinstance(src, torch.fx.Node):
                return self.env[self.canonical[src]]
            return self.value_of(src, node)
        out = node.meta["val"]
        if out.dtype not in TL_DTYPES:
            raise self.unsupported(node, f"a value of dtype {out.dtype}")
        if rule.kind == "cast":
            src = node.args[0]
            value = self.env[self.canonical[src]] if isinstance(src, torch.fx.Node) else self.value_of(src, node)
            if isinstance(value, Gather):
                return replace(value, casts=value.casts + (out.dtype,))
            return self.convert(value, out.dtype)
        if out.dim() != 0:
            raise self.unsupported(node, f"a tensor of shape {tuple(out.shape)} built inside the mod",
                                   _INDEX_FIRST + " Build other tensors outside the mod and capture them.")  # fmt: skip
        if rule.kind == "constant":
            try:
                value = rule.fn(*node.args, **node.kwargs)
            except TypeError as err:
                raise self.unsupported(node, f"these arguments ({err})") from err
            if not isinstance(value, (bool, int, float)):
                raise self.unsupported(node, "a constant that is not a Python number")
            return _const(value, out.dtype)
        return self.expression(node, rule, out.dtype)

    def expression(self, node: torch.fx.Node, rule: Lowering, out: torch.dtype) -> Val:
        args = [a if a is None or isinstance(a, (str, torch.dtype)) else self.value_of(a, node) for a in node.args]
        kwargs = {k: self.value_of(v, node) if isinstance(v, torch.fx.Node) else v for k, v in node.kwargs.items()}
        vals = [a for a in args + list(kwargs.values()) if isinstance(a, Val)]

        folded = self.fold(node, args, kwargs, out) if all(v.value is not None for v in vals) else None
        if folded is not None:
            return folded

        if rule.sym is not None and out in _INDEX_INTS and all(v.dtype in _INTS for v in vals):
            expr = rule.sym(*(self.to_sym(a) if isinstance(a, Val) else a for a in args),
                            **{k: self.to_sym(v) if isinstance(v, Val) else v for k, v in kwargs.items()})  # fmt: skip
            if expr is not None:
                return self.sym_val(expr, out)

        targets = self.input_dtypes(rule.inputs, node, kernel_dtype(out))
        args = [self.coerce(a, t) if isinstance(a, Val) and t is not None else a for a, t in zip(args, targets)]
        kwargs = {k: self.coerce(v, targets[-1]) if isinstance(v, Val) and targets[-1] is not None else v
                  for k, v in kwargs.items()}  # fmt: skip
        if rule.reuses:
            args = [self.temp(a) if isinstance(a, Val) and not a.trivial else a for a in args]

        operands = [self.operand(a, i, rule) for i, a in enumerate(args)]
        kw_operands = {k: self.operand(v, -1, rule) for k, v in kwargs.items()}
        try:
            written = rule.fn(*operands, **kw_operands)
        except (TypeError, NotImplementedError, ValueError) as err:
            raise self.unsupported(node, f"these arguments ({err})") from err
        if isinstance(written, tuple):
            text, prec = written
        else:
            text, prec = written, (rule.prec if rule.prec is not None else precedence_of(written))
        return Val(text, kernel_dtype(out), prec)

    def operand(self, a, position: int, rule: Lowering):
        if not isinstance(a, Val):
            return a
        if rule.prec is None:  # user entries: every operand an atom
            text = _paren(a, ATOM)
        elif rule.prec >= ATOM:  # arguments of a call
            text = a.text
        else:
            need = rule.prec if position in rule.left else rule.prec + 1
            if rule.prec in _LOGIC_AND_CMP and a.prec in _LOGIC_AND_CMP:
                need = max(need, rule.prec if a.prec == rule.prec and position in rule.left else ATOM)
            text = _paren(a, need)
        return Operand(text, a.text, a.prec, a.dtype, a.value)

    def input_dtypes(self, policy: str, node: torch.fx.Node, out: torch.dtype) -> list[Optional[torch.dtype]]:
        n = max(len(node.args), 1)
        if policy == RESULT:
            return [out] * n
        if policy == BOOL:
            return [torch.bool] * n
        if policy == WHERE:
            return [torch.bool] + [out] * (n - 1)
        if policy == COMMON:
            examples = [torch.empty((), dtype=a.meta["val"].dtype) if isinstance(a, torch.fx.Node) else a
                        for a in node.args if isinstance(a, (torch.fx.Node, bool, int, float))]  # fmt: skip
            common = examples[0] if isinstance(examples[0], torch.Tensor) else torch.empty((), dtype=torch.float32)
            for other in examples[1:]:
                common = torch.empty((), dtype=torch.result_type(common, other))
            return [kernel_dtype(common.dtype)] * n
        assert policy == KEEP, policy
        return [None] * n

    def fold(self, node: torch.fx.Node, args, kwargs, out: torch.dtype) -> Optional[Val]:
        """Evaluate an op whose operands are all constants, with torch itself."""

        def real(arg, v):
            if isinstance(arg, torch.fx.Node):
                return torch.tensor(v.value, dtype=arg.meta["val"].dtype)
            return v.value if isinstance(v, Val) else v

        try:
            result = node.target(
                *[real(a, v) for a, v in zip(node.args, args)],
                **{k: real(node.kwargs[k], v) for k, v in kwargs.items()},
            )
        except Exception:  # an op torch cannot run on CPU constants: lower it normally
            return None
        if not isinstance(result, torch.Tensor) or result.dim() != 0:
            return None
        return _const(result.item(), out)

    # -- errors ----------------------------------------------------------------------------------

    def unsupported(self, node: torch.fx.Node, problem: str, hint: Optional[str] = None) -> UnsupportedOpError:
        lines = [
            f"Cannot lower {self.traced.kind} '{self.traced.name}' to Triton: {node.target} with {problem}.",
            f"  {source_line_of(self.traced, node)}",
            f"  fx node: {_node_text(node)}",
        ]
        if hint:
            lines.append(f"  {hint}")
        return UnsupportedOpError("\n".join(lines))

    def unknown_op(self, node: torch.fx.Node) -> UnsupportedOpError:
        op = str(node.target)
        short = getattr(getattr(node.target, "overloadpacket", None), "__name__", op.split(".")[-1])
        lines = [
            f"Cannot lower {self.traced.kind} '{self.traced.name}' to Triton: {op} has no entry in "
            "flexattn's lowering table.",
            f"  {source_line_of(self.traced, node)}",
            f"  fx node: {_node_text(node)}",
        ]
        if short in _HINTS:
            hint = _HINTS[short]
            lines.append(f"  {'Instead use ' + hint if not hint.startswith('A mod') else hint}")
        close = difflib.get_close_matches(short, [n.split(".")[0] for n in supported_op_names(self.table)], n=4)
        if close:
            lines.append(f"  Supported ops with similar names: {', '.join(dict.fromkeys(close))}.")
        lines.append(
            "  SOLUTION: rewrite the mod with supported ops, or add a table entry: "
            f"flexattn.lowering.register_lowering(torch.ops.{op.rsplit('.', 1)[0]}, lambda x: f\"...{{x}}...\")"
        )
        return UnsupportedOpError("\n".join(lines))


def lower(
    traced: TracedMod,
    inputs: ModInputs = ModInputs(),
    prefix: str = "sm_",
    *,
    tanh_approx: bool = False,
    variant: Optional[LoweringVariant] = None,
) -> LoweredMod:
    """Triton source for a traced score_mod or mask_mod.

    ``prefix`` starts every name this mod adds to the kernel (temporaries ``{prefix}t0``, captured
    tensor parameters ``{prefix}{name}_ptr``), so a score_mod and a mask_mod can share a kernel
    (e.g. "sm_" and "mm_"). ``tanh_approx`` lowers torch.tanh to the hardware ``tanh.approx.f32``
    instruction (NVIDIA only, about 2^-11 relative error) instead of the precise exp-based helper.
    Raises UnsupportedOpError, naming the op and the mod's source line, for ops with no entry.
    """
    if not prefix.isidentifier():
        raise ValueError(f"prefix must start a Python identifier, got {prefix!r}")
    return _Emitter(traced, inputs, prefix, with_options(tanh_approx=tanh_approx)).run()
