"""Walk a traced mod's fx graph once and write it as Triton statements.

One idea in one module, longer than most: the three kinds of value below and the walk that turns
nodes into them; each op's own Triton form lives in ops.py's table.

The walk follows tinygrad's renderer (tinygrad/renderer/cstyle.py): one pass over the nodes in order, each
node's source built by its entry in ``ops.LOWERINGS``; a value used more than once is given a name
(``sm_t0 = ...``), a value used once is written inline where it is used.

Values in the walk are

* ``Val``: a Triton expression with the dtype it has in the kernel. Integer values built by
  ``+ - * // %`` also carry a sympy expression (``sym``), which later integer ops extend and
  simplify (index.py);
* ``Gather``: a captured tensor with some dimensions indexed, kept as a sympy offset from its
  pointer plus the dimensions still open (each a size and a stride, so slices and transposes of the
  tensor are offsets and strides too). The load is written when no dimension is left, so
  ``intervals[doc_id[kv_idx]][0]`` becomes one ``tl.load`` at ``row * stride0``;
* ``Vec``: a small tensor of values (the row ``qe[q_idx]`` of a captured ``[L, 8]`` table), one
  ``Val`` per element, for elementwise ops and reductions such as ``torch.dot``, unrolled.

Dtypes (docs/lowering.md has the full rules). Every float is float32 in the kernel, whatever torch
computes it in: loads of float16, bfloat16 and float64 tensors are converted to float32, float64
arithmetic runs in float32, and float16/bfloat16 arithmetic runs in float32 without rounding each
step (as Inductor does). An explicit cast to float16/bfloat16 (``x.half()``) still rounds, through
``.to(tl.float16).to(tl.float32)`` or ``round_to_bfloat16(x)``. Integers and bools follow torch's
promotion (``node.meta["val"].dtype``), with one difference: integer values derived from the index
arguments and Python constants are exact, so a node the bounds analysis (ranges.py) marks wide is
computed in int64 from its first operation on, and a value keeps the wider dtype of its operands.
An int32 expression that enters an int64 one is first computed on its own and then widened (a cast
starts a new value), so values read from captured tensors wrap exactly where torch wraps them.
Bool ``+``/``*`` are a logical or/and, as in torch.
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
from ..trace import CapturedInput, TracedMod
from .index import ADD, ATOM, BAND, BOR, BXOR, CMP, MUL, print_index, wrap_int
from .ops import (
    BOOL,
    COMMON,
    KEEP,
    LOWERINGS,
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
from .ranges import CONSERVATIVE_BOUNDS, LoweringVariant, graph_key, lowering_variant
from .sites import describe_site

__all__ = ["ModInputs", "LoweredMod", "lower", "VECTOR_LIMIT"]

aten = torch.ops.aten

# Most elements a small tensor inside a mod may have (each becomes its own load and arithmetic).
VECTOR_LIMIT = 128


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
        ``{prefix}N_stride{d}`` for each of its dims d (the launcher passes ``t, *t.stride()``), then
        per captured number N, ``{prefix}N`` (the launcher passes its value).
    captured: ``TracedMod.captured``, one entry per group of tensor parameters.
    number_params: the numbers' parameters (the last of ``kernel_params``): scalars the kernels
        are not specialised on, so a new value reuses the compiled kernel (trace/numbers.py).
    """

    lines: tuple[str, ...]
    result: str
    kernel_params: tuple[str, ...]
    captured: tuple[CapturedInput, ...]
    number_params: tuple[str, ...] = ()

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
    weak: bool = False  # a Python number argument: it does not decide the result dtype (torch's rule)

    @property
    def weak_example(self) -> Union[bool, int, float]:
        """A Python number of this weak value's kind, for torch's promotion rules."""
        if self.value is not None:
            return self.value
        return False if self.dtype == torch.bool else 0 if self.dtype in _INTS else 0.0

    @property
    def trivial(self) -> bool:
        """A name or a constant: never worth a temporary."""
        return self.value is not None or (self.text.isidentifier() and not keyword.iskeyword(self.text))


@dataclass(frozen=True)
class View:
    """One open dimension of a gather: its size and its stride (a sympy multiple of a stride parameter)."""

    size: int
    stride: sympy.Expr


@dataclass(frozen=True)
class Gather:
    """Captured tensor ``index`` read at ``ptr + offset``, with dimensions ``dims`` not yet indexed."""

    index: int
    offset: sympy.Expr
    dims: tuple[View, ...]
    casts: tuple[torch.dtype, ...] = ()  # casts of the whole tensor (DOC.float()), applied after the load
    checks: tuple[str, ...] = ()  # names of the in-range tests of indices not proved in range
    wide: bool = False  # the tensor is too large for int32 offsets


@dataclass(frozen=True)
class Vec:
    """A small tensor of values: ``items`` in row-major order, ``shape`` as torch has it."""

    items: tuple[Val, ...]
    shape: tuple[int, ...]


# Python orders & ^ | above comparisons, unlike C; mixed chains get parentheses so nobody has to know.
_LOGIC_AND_CMP = (BAND, BXOR, BOR, CMP)
_INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_INDEX_INTS = (torch.int32, torch.int64)  # dtypes kept as sympy expressions (narrower ones are cast up)


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point else dtype


def _paren(v: Val, need: int) -> str:
    return v.text if v.prec >= need else f"({v.text})"


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _const(value: Any, dtype: torch.dtype) -> Val:
    """A constant of torch dtype ``dtype``, as torch would store it (integers wrap, like torch's weak
    constants: ``int32_tensor + 2**32`` adds 0)."""
    if dtype in (torch.float32, torch.float64) and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)  # written as given (0.1, not 0.10000000149011612): Triton rounds it alike
    elif dtype.is_floating_point:
        value = torch.tensor(value, dtype=dtype).item()
    elif dtype == torch.bool:
        value = bool(value)
    elif dtype == torch.uint8:
        value = int(value) & 0xFF
    else:
        value = wrap_int(int(value), dtype)
    text, prec = literal(value)
    return Val(text, kernel_dtype(dtype), prec, value=value)


def _weak(value: Union[bool, int, float]) -> Val:
    """A Python number argument (torch's "wrapped number": it does not decide the result dtype)."""
    dtype = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float32
    text, prec = literal(value)
    return Val(text, dtype, prec, value=value, weak=True)


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
        ["cumsum", "cumprod", "cummax", "cummin", "sort", "argsort", "topk", "unique", "nonzero", "searchsorted",
         "argmax", "argmin"],
        "A mod sees one (query, key) pair at a time, so scans, sorts and searches over a tensor "
        "cannot run inside it. Compute them once outside the mod and capture the result, e.g. "
        "`offsets = lengths.cumsum(0)` outside and `offsets[doc_id[q_idx]]` inside.",
    ),  # fmt: skip
    "fmax": "torch.maximum (propagates NaN)",
    "fmin": "torch.minimum (propagates NaN)",
}

# What a reduction combines its elements with.
_REDUCE_JOIN = {"sum": aten.add, "mean": aten.add, "prod": aten.mul, "any": aten.bitwise_or,
                "all": aten.bitwise_and, "max": aten.maximum, "min": aten.minimum, "dot": aten.add}  # fmt: skip


class _Emitter:
    def __init__(self, traced: TracedMod, inputs: ModInputs, prefix: str, table: dict, variant: LoweringVariant):
        self.traced = traced
        self.inputs = inputs
        self.prefix = prefix
        self.table = table
        self.variant = variant
        self.lines: list[str] = []
        self.env: dict[torch.fx.Node, Union[Val, Gather, Vec]] = {}
        self.vecs: dict[torch.fx.Node, Vec] = {}  # gathers with open dimensions, read element by element
        self.guarded: dict[tuple, tuple[Val, Optional[str]]] = {}  # wrapped / checked indices, by source
        self.names: dict[sympy.Symbol, tuple[str, int]] = {}  # symbols standing for inline source
        self.sym_dtypes: dict[sympy.Symbol, torch.dtype] = {}
        self.strides: set[sympy.Symbol] = set()
        self.n_temps = 0

    # -- the walk --------------------------------------------------------------------------------

    # Inputs after the mod's arguments and captured tensors (gradient.py adds the incoming gradient).
    extra_inputs = 0

    def run(self) -> LoweredMod:
        result = self.walk()
        numbers = self.number_params()
        return LoweredMod(
            lines=tuple(self.lines),
            result=result,
            kernel_params=tuple(p for i in range(len(self.traced.captured)) for p in self.params(i)) + numbers,
            captured=tuple(self.traced.captured),
            number_params=numbers,
        )

    def walk(self):
        """Lower every node in order; returns what ``result`` makes of the output node."""
        graph = self.traced.graph
        self.canonical, self.uses = _common_subexpressions(graph)
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        n_args = len(self.traced.arg_names)
        n_tensors, n_numbers = len(self.traced.captured), len(self.traced.numbers)
        if len(placeholders) != n_args + n_tensors + n_numbers + self.extra_inputs:
            raise ValueError(f"graph of {self.traced.name} has {len(placeholders)} inputs, expected "
                             f"{n_args} arguments, {n_tensors} captured tensors and {n_numbers} numbers")  # fmt: skip
        result = None
        for node in graph.nodes:
            if self.canonical[node] is not node:
                continue
            if node.op == "placeholder":
                position = placeholders.index(node)
                if position < n_args:
                    value = self.argument(self.traced.arg_names[position])
                elif position < n_args + n_tensors:
                    value = self.captured_input(position - n_args)
                elif position < n_args + n_tensors + n_numbers:
                    value = self.number_input(position - n_args - n_tensors)
                else:
                    value = self.extra_input(position - n_args - n_tensors - n_numbers)
            elif node.op == "call_function":
                value = self.call(node)
            elif node.op == "output":
                result = self.result(node)
                continue
            else:
                raise self.unsupported(node, f"a graph node of kind {node.op!r} ({node.target})")
            self.env[node] = self.settle_node(node, value)
        return result

    def extra_input(self, position: int):
        raise ValueError(f"graph of {self.traced.name} has more inputs than its mod's arguments and captured tensors")

    def settle_node(self, node: torch.fx.Node, value):
        return self.settle(value, self.uses[node])

    def settle(self, value, uses: int):
        """Load a fully indexed gather; name a value that more than one node reads."""
        if isinstance(value, Gather):
            if not value.dims:
                value = self.load(value)
            elif uses > 1:  # each read writes the offset again: name what it loads first
                value = replace(value, offset=self.name_inline_symbols(value.offset))
        if isinstance(value, Val) and uses > 1 and not value.trivial:
            value = self.temp(value)
        if isinstance(value, Vec) and uses > 1:
            value = Vec(tuple(v if v.trivial else self.temp(v) for v in value.items), value.shape)
        return value

    def result(self, node: torch.fx.Node) -> str:
        (out,) = node.args
        return self.result_text(out, node)

    def result_text(self, out, node: torch.fx.Node) -> str:
        value = self.value_of(out, node)
        if isinstance(value, Vec):
            raise self.unsupported(node, f"a result of shape {value.shape}", _INDEX_FIRST)
        if value.value is not None:  # a constant: make it a tensor the kernel can broadcast
            shown = str(value.value) if isinstance(value.value, int) and not isinstance(value.value, bool) else value.text
            return f"tl.full([1, 1], {shown}, {TL_DTYPES[value.dtype]})"
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
        dims = tuple(View(int(size), self.stride(i, d)) for d, size in enumerate(c.shape))
        # Offsets of a tensor with 2**31 elements or more do not fit int32 (with any strides).
        return Gather(i, sympy.Integer(0), dims, wide=_numel(c.shape) >= 2**31)

    def number_input(self, i: int) -> Val:
        """A Python number the mod reads: a scalar argument of the kernel, weak as a Python number
        is in torch (its operands' dtype decides the result's). An int fits int32 (the trace cache
        sends larger values to a trace that makes them constants), so it is held in int32."""
        number = self.traced.numbers[i]
        name = self.number_params()[i]
        if number.kind is bool:
            return Val(name, torch.bool, weak=True)
        if number.kind is int:
            return Val(name, torch.int32, sym=self.symbol(name, torch.int32), weak=True)
        return Val(name, torch.float32, weak=True)

    def number_params(self) -> tuple[str, ...]:
        return tuple(f"{self.prefix}{n.name}" for n in self.traced.numbers)

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

    def named(self, value: Val) -> Val:
        """``value`` as a name or constant, so it can be written more than once."""
        return value if value.trivial else self.temp(value)

    def name_inline_symbols(self, expr: sympy.Expr) -> sympy.Expr:
        """Replace symbols that stand for inline source (a load) by temporaries."""
        subs = {}
        for s in sorted(expr.free_symbols, key=lambda s: s.name):
            if s in self.names:
                text, prec = self.names[s]
                subs[s] = self.temp(Val(text, self.sym_dtypes[s], prec, sym=s)).sym
        return expr.xreplace(subs) if subs else expr

    # -- sympy <-> source --------------------------------------------------------------------------

    def leaf(self, v: Val) -> sympy.Symbol:
        """A symbol standing for ``v`` computed on its own, in its own dtype."""
        if v.sym is not None and v.sym.is_Symbol:
            return v.sym
        if v.dtype not in _INDEX_INTS:  # int8 + int8 wraps in int8: widen before sympy reorders it
            v = self.coerce(v, torch.int32)
            if v.sym is not None and v.sym.is_Symbol:
                return v.sym
        if v.trivial:
            return self.symbol(v.text, v.dtype)
        s = sympy.Symbol(f"_inline{len(self.names)}", integer=True)
        self.names[s] = (v.text, v.prec)
        self.sym_dtypes[s] = v.dtype
        return s

    def to_sym(self, v: Val, dtype: torch.dtype) -> sympy.Expr:
        """``v`` as a term of an integer expression computed in ``dtype``."""
        if v.value is not None:
            return sympy.Integer(wrap_int(int(v.value), dtype))  # torch reduces constants to the dtype
        if v.sym is not None and v.dtype == dtype:
            return v.sym
        # A narrower expression inside a wider one is computed on its own first (then widened), as
        # torch computes it; merging it would change where it wraps.
        return self.leaf(v)

    def sym_val(self, expr: sympy.Expr, dtype: torch.dtype) -> Val:
        expr = sympy.sympify(expr)
        if expr.is_Integer:
            return _const(int(expr), dtype)
        text, prec = print_index(
            expr, self.names, frozenset(self.strides), dtypes=self.sym_dtypes, wide=dtype == torch.int64
        )
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
        text = f"{_paren(v, ATOM)}.to({TL_DTYPES[dtype]})"
        widening = v.dtype in _INTS and dtype in _INDEX_INTS and torch.promote_types(v.dtype, dtype) == dtype
        if widening and v.sym is not None and v.sym.is_Symbol:
            return Val(text, dtype, ATOM, sym=v.sym)  # the printer widens the symbol where it needs to
        return Val(text, dtype, ATOM)

    def convert(self, v: Val, dtype: torch.dtype) -> Val:
        """``v.to(dtype)`` as torch computes it: a cast to float16/bfloat16 rounds, a narrowing
        integer cast wraps."""
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
            wide = g.wide or any(self.sym_dtypes.get(s) == torch.int64 for s in g.offset.free_symbols)
            text, prec = print_index(g.offset, self.names, frozenset(self.strides), dtypes=self.sym_dtypes, wide=wide)
            address = f"{ptr} + {text if prec > ADD else f'({text})'}"
        text = f"tl.load({address})"
        if g.checks:  # an index the bounds analysis could not prove in range reads 0, never outside the tensor
            text = f"tl.where({' & '.join(g.checks)}, {text}, 0)"
        if c.dtype == torch.bool:  # bool tensors hold one byte per element: compare, don't trust the bits
            v = Val(f"{text} != 0", torch.bool, CMP)
        elif c.dtype.is_floating_point:
            v = Val(text if c.dtype == torch.float32 else f"{text}.to(tl.float32)", torch.float32)
        else:
            v = Val(text, c.dtype)
        for dtype in g.casts:
            v = self.convert(v, dtype)
        return v

    def index_term(self, node: torch.fx.Node, position: int, view: View, index) -> tuple[sympy.Expr, list[str]]:
        """The offset term of one index, wrapped and checked as the bounds analysis decided."""
        v = self.value_of(index, node)
        if isinstance(v, Vec):
            raise self.unsupported(node, "an index with more than one element", _INDEX_FIRST)
        if v.dtype not in _INTS:
            raise self.unsupported(
                node, f"an index of dtype {index.meta['val'].dtype if isinstance(index, torch.fx.Node) else type(index).__name__} "
                "(a boolean mask, not a position)",
                "Index with integer positions; for a boolean condition use torch.where(cond, a, b).",
            )  # fmt: skip
        if v.value is not None:
            position_value = int(v.value) + (view.size if int(v.value) < 0 else 0)
            if not 0 <= position_value < view.size:
                # A constant tensor out of range reads 0 at every pair, as on every backend (a Python
                # int index out of range is already an IndexError when the mod is traced).
                return sympy.Integer(0), ["False"]
            return sympy.Integer(position_value) * view.stride, []
        check = self.variant.gather_check(node.name, position)
        if not (check.wrap or check.masked):
            return self.leaf(v) * view.stride, []
        if v.dtype not in _INDEX_INTS:  # an int8 index plus the size would wrap in int8
            v = self.coerce(v, torch.int32)
        v = self.named(v)
        key = (v.text, view.size, check)
        size = literal(view.size)[0]
        if key not in self.guarded:  # intervals[doc[q], 0] and intervals[doc[q], 1] guard doc[q] once
            inside = None
            if check.wrap:  # torch reads rel[-1] as the last element
                v = Val(f"tl.where({_paren(v, CMP + 1)} < 0, {_paren(v, ADD)} + {size}, {v.text})", v.dtype)
                if check.masked:
                    v = self.temp(v)
            if check.masked:
                # Read at 0 where the index is outside the dimension, and give 0 there (see load). Not a
                # masked tl.load: the interpreter mishandles a mask broadcast from a scalar condition.
                tests = ([f"({v.text} >= 0)"] if check.low else []) + ([f"({v.text} < {size})"] if check.high else [])
                inside = self.temp(Val(" & ".join(tests), torch.bool, BAND if len(tests) > 1 else ATOM)).text
                v = self.temp(Val(f"tl.where({inside}, {v.text}, 0)", v.dtype))
            self.guarded[key] = (v, inside)
        v, inside = self.guarded[key]
        return self.leaf(v) * view.stride, ([inside] if inside else [])

    def gather(self, node: torch.fx.Node) -> Gather:
        src, indices = node.args[0], node.args[1]
        g = self.gather_of(src, node)
        if len(indices) > len(g.dims):
            raise self.unsupported(node, f"{len(indices)} indices for a tensor with {len(g.dims)} dimensions left")
        offset, checks = g.offset, list(g.checks)
        for position, (view, index) in enumerate(zip(g.dims, indices)):
            if index is None:
                raise self.unsupported(
                    node, "indexing with slices, None or Ellipsis",
                    "Index every leading dimension with an integer or an index tensor: bias[h, q_idx - kv_idx].",
                )  # fmt: skip
            term, conditions = self.index_term(node, position, view, index)
            offset = offset + term
            checks.extend(conditions)
        return replace(g, offset=offset, dims=g.dims[len(indices):], checks=tuple(checks))

    def gather_of(self, arg, node: torch.fx.Node) -> Gather:
        g = self.env.get(self.canonical.get(arg)) if isinstance(arg, torch.fx.Node) else None
        if not isinstance(g, Gather):
            raise self.unsupported(node, "indexing a value computed inside the mod",
                                   "Only captured tensors can be indexed: index first, then compute.")  # fmt: skip
        return g

    def elements(self, g: Gather, node: torch.fx.Node) -> Vec:
        """A gather with open dimensions read element by element (a small slice of a captured tensor)."""
        shape = tuple(v.size for v in g.dims)
        n = _numel(shape)
        if n > VECTOR_LIMIT:
            raise self.unsupported(
                node, f"a captured tensor used with dimensions of size {shape} not indexed",
                f"{_INDEX_FIRST} (Reading up to {VECTOR_LIMIT} elements, e.g. for torch.dot of two table "
                "rows, is unrolled; more is not.)",
            )  # fmt: skip
        base = self.name_inline_symbols(g.offset) if n > 1 else g.offset  # each element's load shares it
        items = []
        for flat in range(n):
            offset, rest = base, flat
            for view in reversed(g.dims):
                offset = offset + (rest % view.size) * view.stride
                rest //= view.size
            items.append(self.load(replace(g, offset=offset, dims=())))
        return Vec(tuple(items), shape)

    # -- views ---------------------------------------------------------------------------------------

    def view(self, node: torch.fx.Node):
        src = node.args[0]
        value = self.env[self.canonical[src]] if isinstance(src, torch.fx.Node) else self.value_of(src, node)
        out_shape = tuple(node.meta["val"].shape)
        if isinstance(value, Gather):
            return self.gather_view(value, node, out_shape)
        if isinstance(value, Val):
            if _numel(out_shape) == 1:
                return value  # views of one element change nothing in the kernel
            value = Vec((value,), ())
        return self.vec_view(value, node, out_shape)

    def gather_view(self, g: Gather, node: torch.fx.Node, out_shape: tuple) -> Gather:
        packet = node.target.overloadpacket
        dims = list(g.dims)
        rank = len(dims)

        def axis(d, extra=0):
            return d + rank + extra if d < 0 else d

        args = list(node.args[1:])
        kwargs = dict(node.kwargs)
        offset = g.offset
        if packet is aten.unsqueeze:
            dims.insert(axis(args[0], 1), View(1, sympy.Integer(0)))
        elif packet is aten.squeeze:
            chosen = args[0] if args else list(range(rank))
            chosen = {axis(d) for d in (chosen if isinstance(chosen, (list, tuple)) else [chosen])}
            dims = [v for i, v in enumerate(dims) if not (i in chosen and v.size == 1)]
        elif packet in (aten.permute,):
            dims = [dims[axis(d)] for d in args[0]]
        elif packet is aten.transpose:
            a, b = axis(args[0]), axis(args[1])
            dims[a], dims[b] = dims[b], dims[a]
        elif packet is aten.t:
            dims = dims[::-1] if rank == 2 else dims
        elif packet is aten.numpy_T:
            dims = dims[::-1]
        elif packet is aten.slice:
            dim = axis(args[0] if args else kwargs.get("dim", 0))
            start = args[1] if len(args) > 1 else kwargs.get("start")
            end = args[2] if len(args) > 2 else kwargs.get("end")
            step = args[3] if len(args) > 3 else kwargs.get("step", 1)
            size = dims[dim].size
            start, end, step = slice(start, end, step).indices(size)
            length = len(range(start, end, step))
            offset = offset + start * dims[dim].stride
            dims[dim] = View(length, dims[dim].stride * step)
        elif packet is aten.expand:
            lead = len(out_shape) - rank
            new = [View(int(s), sympy.Integer(0)) for s in out_shape[:lead]]
            for v, s in zip(dims, out_shape[lead:]):
                new.append(v if v.size == s else View(int(s), sympy.Integer(0)))  # only size-1 dims expand
            dims = new
        else:  # view / reshape: only adding or removing dimensions of size 1 keeps the strides meaningful
            kept = [v for v in dims if v.size != 1]
            if [s for s in out_shape if s != 1] != [v.size for v in kept]:
                raise self.unsupported(node, f"a reshape of a captured tensor from {tuple(v.size for v in dims)} to {out_shape}",
                                       "Reshape the tensor outside the mod and capture the result.")  # fmt: skip
            it = iter(kept)
            dims = [View(1, sympy.Integer(0)) if s == 1 else next(it) for s in out_shape]
        if tuple(v.size for v in dims) != out_shape:
            raise self.unsupported(node, f"a view of shape {out_shape} (computed {tuple(v.size for v in dims)})")
        return replace(g, offset=offset, dims=tuple(dims))

    def vec_view(self, vec: Vec, node: torch.fx.Node, out_shape: tuple):
        """Any view of a small tensor, by applying it to the positions of its elements."""
        positions = torch.arange(len(vec.items)).reshape(vec.shape)
        args = [positions] + list(node.args[1:])
        moved = node.target(*args, **node.kwargs).reshape(-1).tolist()
        items = tuple(vec.items[i] for i in moved)
        if _numel(out_shape) == 1:
            return items[0]
        if len(set(moved)) < len(moved):  # an element written more than once (expand): name it
            items = tuple(self.named(v) for v in items)
        return Vec(items, out_shape)

    # -- one op ----------------------------------------------------------------------------------

    def value_of(self, arg, node: torch.fx.Node):
        """The Val (or Vec) of a node argument (Python numbers become constants)."""
        if isinstance(arg, torch.fx.Node):
            canonical = self.canonical[arg]
            v = self.env[canonical]
            if isinstance(v, Gather):
                if canonical not in self.vecs:
                    vec = self.elements(v, node)
                    if self.uses[canonical] > 1:
                        vec = Vec(tuple(self.named(x) for x in vec.items), vec.shape)
                    self.vecs[canonical] = vec
                return self.vecs[canonical]
            if isinstance(v, Vec) and _numel(v.shape) == 1:
                return v.items[0]
            return v
        if isinstance(arg, (bool, int, float)):
            return _weak(arg)
        raise self.unsupported(node, f"an argument of type {type(arg).__name__} ({arg!r})")

    def call(self, node: torch.fx.Node):
        rule = lookup(node.target, self.table)
        if rule is None:
            folded = self.fold_unknown(node)
            if folded is not None:
                return folded
            raise self.unknown_op(node)
        if rule.kind == "gather":
            return self.gather(node)
        if rule.kind == "select":
            return self.select(node)
        if rule.kind == "view":
            return self.view(node)
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
            if isinstance(value, Vec):
                return Vec(tuple(self.convert(v, out.dtype) for v in value.items), value.shape)
            return self.convert(value, out.dtype)
        if rule.kind == "constant":
            try:
                value = rule.fn(*node.args, **node.kwargs)
            except (TypeError, ValueError) as err:
                raise self.unsupported(node, f"these arguments ({err})") from err
            if isinstance(value, torch.fx.Node):  # a number the mod reads (torch.full_like(x, cap))
                return self.broadcast_const(self.convert(self.value_of(value, node), out.dtype), node,
                                            tuple(out.shape))
            if not isinstance(value, (bool, int, float)):
                raise self.unsupported(node, "a constant that is not a Python number")
            const = _const(value, out.dtype)
            return self.broadcast_const(const, node, tuple(out.shape))
        if rule.kind == "reduce":
            return self.reduce(node, rule.fn)
        return self.expression(node, rule)

    def select(self, node: torch.fx.Node):
        src, dim, position = node.args[:3]
        value = self.env.get(self.canonical.get(src)) if isinstance(src, torch.fx.Node) else None
        if isinstance(value, Vec):
            return self.vec_view(value, node, tuple(node.meta["val"].shape))
        if isinstance(value, Val):  # x.view(1)[0]: the one element
            return value
        g = self.gather_of(src, node)
        if not isinstance(position, int) or not isinstance(dim, int):
            raise self.unsupported(node, "select with a symbolic index")
        dim = dim + len(g.dims) if dim < 0 else dim
        view = g.dims[dim]
        position = position + view.size if position < 0 else position
        offset = g.offset + position * view.stride
        return replace(g, offset=offset, dims=g.dims[:dim] + g.dims[dim + 1:])

    def broadcast_const(self, const: Val, node: torch.fx.Node, shape: tuple):
        n = _numel(shape)
        if n == 1:
            return const
        if n > VECTOR_LIMIT:
            raise self.unsupported(node, f"a tensor of shape {shape} built inside the mod",
                                   _INDEX_FIRST + " Build other tensors outside the mod and capture them.")  # fmt: skip
        return Vec((const,) * n, shape)

    def kernel_out(self, node: torch.fx.Node, out: torch.dtype, vals: list[Val]) -> torch.dtype:
        """The dtype the kernel computes an elementwise op in: torch's, widened by operands the kernel
        already holds wider, and int64 where the bounds analysis says the value needs it."""
        if out.is_floating_point:
            return torch.float32
        if out == torch.bool:
            return torch.bool
        dtype = out
        for v in vals:
            if not v.weak and v.dtype in _INTS:
                dtype = torch.promote_types(dtype, v.dtype)
        if self.variant.is_wide(node.name) and dtype in _INDEX_INTS:
            dtype = torch.int64
        return dtype

    def expression(self, node: torch.fx.Node, rule: Lowering):
        """An elementwise op: on values, or element by element on small tensors."""
        args = [a if a is None or isinstance(a, (str, torch.dtype)) else self.value_of(a, node) for a in node.args]
        kwargs = {k: self.value_of(v, node) if isinstance(v, torch.fx.Node) else v for k, v in node.kwargs.items()}
        out = node.meta["val"]
        if not any(isinstance(a, Vec) for a in list(args) + list(kwargs.values())):
            return self.scalar_expression(node, rule, out.dtype, args, kwargs)
        shape = tuple(out.shape)
        n = _numel(shape)
        if n > VECTOR_LIMIT:
            raise self.unsupported(node, f"a tensor of shape {shape}", _INDEX_FIRST)

        def spread(a):  # each element's operand: a Vec broadcast to the result, a value repeated
            if isinstance(a, Vec):
                picks = torch.arange(len(a.items)).reshape(a.shape).broadcast_to(shape).reshape(-1).tolist()
                return [a.items[i] for i in picks]
            if isinstance(a, Val):
                return [self.named(a)] * n
            return [a] * n

        columns = [spread(a) for a in args]
        kw_columns = {k: spread(v) for k, v in kwargs.items()}
        items = [
            self.scalar_expression(node, rule, out.dtype, [c[i] for c in columns], {k: c[i] for k, c in kw_columns.items()})
            for i in range(n)
        ]
        return items[0] if n == 1 else Vec(tuple(items), shape)

    def scalar_expression(self, node: torch.fx.Node, rule: Lowering, out_dtype: torch.dtype, args, kwargs) -> Val:
        vals = [a for a in list(args) + list(kwargs.values()) if isinstance(a, Val)]
        out = self.kernel_out(node, out_dtype, vals)

        if all(v.value is not None for v in vals):
            folded = self.fold(node, args, kwargs, out)
            if folded is not None:
                return folded

        if out == torch.bool and rule.inputs == RESULT and rule.prec is not None:
            bools = self.on_bools(node, rule, [a for a in args if isinstance(a, Val)])
            if bools is not None:
                return bools

        if rule.sym is not None and out in _INDEX_INTS and all(v.dtype in _INTS for v in vals):
            expr = rule.sym(*(self.to_sym(a, out) if isinstance(a, Val) else a for a in args),
                            **{k: self.to_sym(v, out) if isinstance(v, Val) else v for k, v in kwargs.items()})  # fmt: skip
            if expr is not None:
                return self.sym_val(expr, out)

        targets = self.input_dtypes(rule.inputs, node, out, args)
        args = [self.coerce(a, t) if isinstance(a, Val) and t is not None else a for a, t in zip(args, targets)]
        kwargs = {k: self.coerce(v, targets[-1]) if isinstance(v, Val) and targets[-1] is not None else v
                  for k, v in kwargs.items()}  # fmt: skip
        if rule.reuses:
            args = [self.named(a) if isinstance(a, Val) else a for a in args]

        operands = [self.operand(a, i, rule) for i, a in enumerate(args)]
        kw_operands = {k: self.operand(v, -1, rule) for k, v in kwargs.items()}
        try:
            written = rule.fn(*operands, **kw_operands)
        except (TypeError, NotImplementedError, ValueError, KeyError) as err:
            raise self.unsupported(node, f"these arguments ({err})") from err
        if isinstance(written, tuple):
            text, prec = written
        else:
            text, prec = written, (rule.prec if rule.prec is not None else precedence_of(written))
        return Val(text, out, prec)

    def on_bools(self, node: torch.fx.Node, rule: Lowering, operands: list[Val]) -> Optional[Val]:
        """Arithmetic whose result is a bool, as torch defines it (``True + True`` is True)."""
        if rule.on_bools == "fn":
            return None
        if rule.on_bools == "=":
            return self.coerce(operands[0], torch.bool)
        join = {"|": aten.bitwise_or, "&": aten.bitwise_and}.get(rule.on_bools)
        if join is None:
            raise self.unsupported(node, "bool operands", "torch refuses most arithmetic on bools too; "
                                   "cast first, e.g. cond.to(torch.int32).")  # fmt: skip
        return self.combine(LOWERINGS[join], [self.coerce(v, torch.bool) for v in operands], torch.bool)

    def combine(self, rule: Lowering, items: list[Val], dtype: torch.dtype) -> Val:
        """``items[0] op items[1] op ...`` for an infix or call entry of the table, left to right."""
        acc = items[0]
        for item in items[1:]:
            written = rule.fn(self.operand(acc, 0, rule), self.operand(item, 1, rule))
            text, prec = written if isinstance(written, tuple) else (written, rule.prec)
            acc = Val(text, dtype, prec)
        return acc

    def reduce(self, node: torch.fx.Node, how: str):
        """sum / mean / prod / any / all / amax / amin / dot over a small tensor, unrolled."""
        out = node.meta["val"]
        if how == "dot":
            a, b = (self.as_vec(x, node) for x in node.args[:2])
            products = [self.scalar_expression(node, LOWERINGS[aten.mul], out.dtype, [x, y], {})
                        for x, y in zip(a.items, b.items)]  # fmt: skip
            source, dims = Vec(tuple(products), a.shape), None
        else:
            # keepdim only adds size-1 dims, which the output's shape (out.shape, below) carries.
            source = self.as_vec(node.args[0], node)
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        rank = len(source.shape)
        if dims is None or dims == []:
            reduced = list(range(rank))
        else:
            reduced = sorted({d % max(rank, 1) for d in (dims if isinstance(dims, (list, tuple)) else [dims])})
        kept = [d for d in range(rank) if d not in reduced]
        positions = torch.arange(len(source.items)).reshape(source.shape).permute(kept + reduced)
        groups = positions.reshape(_numel([source.shape[d] for d in kept]), -1).tolist()
        dtype = kernel_dtype(out.dtype)
        join = LOWERINGS[_REDUCE_JOIN[how]]
        if how in ("max", "min"):
            join = Lowering(lambda a, b, f=join.fn: f(a, b), ATOM)
        results = []
        for group in groups:
            items = [self.coerce(source.items[i], dtype) for i in group]
            acc = self.combine(join, items, dtype)
            if how == "mean":
                acc = Val(f"{_paren(acc, MUL)} / {literal(float(len(group)))[0]}", dtype, MUL)
            results.append(acc)
        shape = tuple(out.shape)
        return results[0] if _numel(shape) == 1 else Vec(tuple(results), shape)

    def as_vec(self, arg, node: torch.fx.Node) -> Vec:
        v = self.value_of(arg, node)
        return v if isinstance(v, Vec) else Vec((v,), ())

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

    def input_dtypes(self, policy: str, node: torch.fx.Node, out: torch.dtype, args) -> list[Optional[torch.dtype]]:
        n = max(len(args), 1)
        if policy == RESULT:
            return [out] * n
        if policy == BOOL:
            return [torch.bool] * n
        if policy == WHERE:
            return [torch.bool] + [out] * (n - 1)
        if policy == COMMON:
            # torch's promotion over the dtypes the kernel holds the operands in (an int32 index
            # compared with an int64 value compares in int64); Python numbers do not promote.
            examples = [a.weak_example if a.weak else torch.empty((), dtype=a.dtype) for a in args if isinstance(a, Val)]
            common = examples[0] if isinstance(examples[0], torch.Tensor) else torch.empty((), dtype=torch.float32)
            for other in examples[1:]:
                common = torch.empty((), dtype=torch.result_type(common, other))
            dtype = kernel_dtype(common.dtype)
            if self.variant.is_wide(node.name) and dtype in _INDEX_INTS:
                dtype = torch.int64
            return [dtype] * n
        assert policy == KEEP, policy
        return [None] * n

    def fold(self, node: torch.fx.Node, args, kwargs, out: torch.dtype) -> Optional[Val]:
        """Evaluate an op whose operands are all constants, with torch itself."""

        def real(arg, v):
            if isinstance(v, Val) and not v.weak:
                dtype = arg.meta["val"].dtype if isinstance(arg, torch.fx.Node) else v.dtype
                if out == torch.int64 and dtype in _INTS:
                    dtype = torch.int64  # index-derived constants are exact
                return torch.tensor(v.value, dtype=dtype)
            return v.value if isinstance(v, Val) else v

        try:
            result = node.target(
                *[real(a, v) for a, v in zip(node.args, args)],
                **{k: real(node.kwargs[k], v) for k, v in kwargs.items()},
            )
        except Exception:  # an op torch cannot run on CPU constants: lower it normally
            return None
        if not isinstance(result, torch.Tensor) or result.numel() != 1:
            return None
        return _const(result.item(), out)

    def fold_unknown(self, node: torch.fx.Node):
        """An op without a table entry whose inputs are all constants (torch.arange(4)): its value."""
        if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            return None
        inputs = _flat_nodes((node.args, node.kwargs))
        values = {}
        for arg in inputs:
            v = self.env.get(self.canonical[arg])
            if not isinstance(v, Val) or v.value is None:
                return None
            values[arg] = torch.tensor(v.value, dtype=arg.meta["val"].dtype)
        try:
            result = node.target(*torch.fx.node.map_arg(node.args, values.get),
                                 **torch.fx.node.map_arg(node.kwargs, values.get))  # fmt: skip
        except Exception:
            return None
        if not isinstance(result, torch.Tensor) or result.dtype not in TL_DTYPES or result.numel() > VECTOR_LIMIT:
            return None
        items = tuple(_const(x, result.dtype) for x in result.reshape(-1).tolist())
        return items[0] if result.numel() == 1 else Vec(items, tuple(result.shape))

    # -- errors ----------------------------------------------------------------------------------

    def where(self, node: torch.fx.Node) -> list[str]:
        return [f"  {line}" for line in describe_site(self.traced, node)]

    def unsupported(self, node: torch.fx.Node, problem: str, hint: Optional[str] = None) -> UnsupportedOpError:
        lines = [
            f"Cannot lower {self.traced.kind} '{self.traced.name}' to Triton: {node.target} with {problem}.",
            *self.where(node),
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
            *self.where(node),
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
    ``variant`` is ``lowering_variant(traced, bounds)`` for the lengths of this call: which integer
    values need int64 and which gathers need a wrap or a mask. None: nothing is known of the lengths,
    and the source is right for any lengths an int32-indexed kernel can see (int64 wherever a sum of
    two indices could leave int32, every gather masked).
    Raises UnsupportedOpError, naming the op and the mod's source line, for ops with no entry.
    """
    if not prefix.isidentifier():
        raise ValueError(f"prefix must start a Python identifier, got {prefix!r}")
    if variant is None:
        variant = lowering_variant(traced, CONSERVATIVE_BOUNDS)
    elif not isinstance(variant, LoweringVariant):
        raise TypeError(f"variant must come from lowering_variant(traced, bounds), got {type(variant).__name__}")
    elif variant.graph is not None and variant.graph != graph_key(traced):
        raise ValueError(f"variant was computed for another mod than {traced.kind} '{traced.name}': "
                         "pass lowering_variant(traced, bounds) of this traced mod")  # fmt: skip
    return _Emitter(traced, inputs, prefix, with_options(tanh_approx=tanh_approx), variant).run()
