"""Walk a traced mod's fx graph once and write it as Triton statements.

The walk that turns nodes into the three kinds of value below lives here; the values themselves are
in values.py, the reads of captured tensors and their views in gathers.py, one op node in calls.py
(both methods of the walk, as mixins), and each op's own Triton form in ops.py's table.

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
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch
import torch.fx

from ..errors import UnsupportedOpError
from ..trace import CapturedInput, TracedMod
from .calls import CallLowering
from .gathers import GatherLowering
from .index import ATOM, CMP, print_index, wrap_int, sympy
from .ops import TL_DTYPES, supported_op_names, with_options
from .ranges import CONSERVATIVE_BOUNDS, LoweringVariant, graph_key, lowering_variant
from .sites import describe_site
from .values import (
    INDEX_FIRST, INDEX_INTS, INTS, VECTOR_LIMIT, Gather, Val, Vec, View, constant, flat_nodes, kernel_dtype, numel,
    paren,
)

__all__ = ["ModInputs", "LoweredMod", "lower", "VECTOR_LIMIT"]


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
        for used in flat_nodes((node.args, node.kwargs)):
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


class _Emitter(CallLowering, GatherLowering):
    """One walk over a traced mod's graph: the nodes in order, their values, the lines written."""

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
            raise self.unsupported(node, f"a result of shape {value.shape}", INDEX_FIRST)
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
            return constant(c.fixed_value.item(), c.dtype)
        dims = tuple(View(int(size), self.stride(i, d)) for d, size in enumerate(c.shape))
        # Offsets of a tensor with 2**31 elements or more do not fit int32 (with any strides).
        return Gather(i, sympy.Integer(0), dims, wide=numel(c.shape) >= 2**31)

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
        if v.dtype not in INDEX_INTS:  # int8 + int8 wraps in int8: widen before sympy reorders it
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
            return constant(int(expr), dtype)
        text, prec = print_index(
            expr, self.names, frozenset(self.strides), dtypes=self.sym_dtypes, wide=dtype == torch.int64
        )
        return Val(text, dtype, prec, sym=expr)

    # -- dtype conversions -----------------------------------------------------------------------

    def coerce(self, v: Val, dtype: torch.dtype) -> Val:
        """``v`` as kernel dtype ``dtype`` (a plain conversion; floats are all float32)."""
        if v.value is not None:
            return constant(v.value, dtype)
        if v.dtype == dtype:
            return v
        if dtype == torch.bool:
            return Val(f"{paren(v, CMP + 1)} != 0", torch.bool, CMP)
        text = f"{paren(v, ATOM)}.to({TL_DTYPES[dtype]})"
        widening = v.dtype in INTS and dtype in INDEX_INTS and torch.promote_types(v.dtype, dtype) == dtype
        if widening and v.sym is not None and v.sym.is_Symbol:
            return Val(text, dtype, ATOM, sym=v.sym)  # the printer widens the symbol where it needs to
        return Val(text, dtype, ATOM)

    def convert(self, v: Val, dtype: torch.dtype) -> Val:
        """``v.to(dtype)`` as torch computes it: a cast to float16/bfloat16 rounds, a narrowing
        integer cast wraps."""
        if v.value is not None:
            return constant(v.value, dtype)
        if dtype == torch.float16:
            return Val(f"{paren(v, ATOM)}.to(tl.float16).to(tl.float32)", torch.float32, ATOM)
        if dtype == torch.bfloat16:  # see round_to_bfloat16 in mod_helpers.py.jinja for why not .to()
            return Val(f"round_to_bfloat16({self.coerce(v, torch.float32).text})", torch.float32, ATOM)
        return self.coerce(v, kernel_dtype(dtype))

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
