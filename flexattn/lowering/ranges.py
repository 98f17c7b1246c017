"""Value ranges of a traced mod's integers at given index bounds, and the lowering decisions they fix.

A mod sees ``0 <= b < B``, ``0 <= h < H``, ``0 <= q_idx < Q_LEN`` and ``0 <= kv_idx < KV_LEN``. One
forward pass of interval arithmetic over the fx graph gives every integer value a range, from which
two kinds of decisions follow (docs/lowering.md, "Integer dtypes" and "Gathers"):

* **int32 or int64.** Integer values built only from ``b``, ``h``, ``q_idx``, ``kv_idx`` and Python
  constants ("index-derived") are exact, like Python integers: a node whose value can leave int32 at
  these bounds is computed in int64; every other node keeps the dtype torch gives it, so common mods
  keep their int32 source. Partial sums and products need no check of their own: int32 ``+ - *``
  wrap modulo 2**32 in any order, so a sum that sympy reorders is right whenever its value fits,
  and every value that enters a non-ring operation (``//``, ``%``, a comparison, a load) is a
  node's value. Values read from captured tensors have no known range and follow torch's dtype
  rules (an int32 product of two loaded values wraps as in torch).
* **Gather checks.** An index not provably inside ``[0, size)`` is wrapped where it can be negative
  (torch's ``rel[-1]`` is the last element) and masked where it can still fall outside (the load
  reads 0 there instead of memory outside the tensor).

``lowering_variant`` returns those decisions as a hashable ``LoweringVariant``; ``lower(...,
variant=...)`` reads nothing else about the bounds, so equal variants give identical source and the
kernels are cached by variant, not by shape. The pass is plain Python over the graph's nodes
(tens of microseconds for common mods), run once per new shape.

Everything outside the lowering asks through the last section of this module: ``index_bounds`` (the
bounds of one call), ``lowering_variants`` (both mods' variants, remembered per call shape; every
kernel family keys its compiled sources by them) and ``index_dtype`` / ``mod_index_dtype`` (the
index dtype of the vmap-based paths: the BlockMask builder and the PyTorch backend).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx

from ..trace import NUMBER_INT_LIMIT, TracedMod, trace_mod
from .ops import LOWERINGS, lookup

__all__ = [
    "IndexBounds",
    "GatherCheck",
    "LoweringVariant",
    "IntFact",
    "analyze",
    "lowering_variant",
    "needs_wide_indices",
    "CONSERVATIVE_BOUNDS",
    "graph_key",
    "index_bounds",
    "lowering_variants",
    "index_dtype",
    "mod_index_dtype",
]

aten = torch.ops.aten
prims = torch.ops.prims

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_DTYPE_RANGE = {
    torch.bool: (0, 1),
    torch.uint8: (0, 2**8 - 1),
    torch.int8: (-(2**7), 2**7 - 1),
    torch.int16: (-(2**15), 2**15 - 1),
    torch.int32: (INT32_MIN, INT32_MAX),
    torch.int64: (INT64_MIN, INT64_MAX),
}
# Dtypes an index-derived value is widened from when it needs more. Narrower integers are the user's
# explicit choice (`x.to(torch.int8)`): arithmetic in them wraps as in torch (still data-independent).
_WIDENED_DTYPES = (torch.int32,)


@dataclass(frozen=True)
class IndexBounds:
    """Exclusive upper bounds of a mod's index arguments in one call:
    0 <= b < B, 0 <= h < H, 0 <= q_idx < Q_LEN, 0 <= kv_idx < KV_LEN."""

    B: int
    H: int
    Q_LEN: int
    KV_LEN: int

    def __post_init__(self):
        for name in ("B", "H", "Q_LEN", "KV_LEN"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**31:
                raise ValueError(f"IndexBounds.{name} must be an int in [0, 2**31], got {value!r}")


# What lower(..., variant=None) assumes: any lengths an int32-indexed kernel can see.
CONSERVATIVE_BOUNDS = IndexBounds(B=2**31, H=2**31, Q_LEN=2**31, KV_LEN=2**31)


@dataclass(frozen=True)
class GatherCheck:
    """How one index of one gather is guarded (all False: provably in range, a plain load)."""

    wrap: bool = False  # the index can be negative: add the dimension's size there, as torch does
    low: bool = False  # it can still be negative after the wrap: mask the load there
    high: bool = False  # it can be >= the dimension's size: mask the load there

    @property
    def masked(self) -> bool:
        return self.low or self.high


IN_RANGE = GatherCheck()


@dataclass(frozen=True)
class LoweringVariant:
    """The bound-dependent decisions of one lowering; equal variants give identical source.

    wide: names of integer nodes computed in int64 although torch types them int32: index-derived
        values that can leave int32 at the bounds (or meet a constant outside it), and, when that makes
        the vmap paths use int64 indices, the int32 values computed from data and indices together.
    gathers: ``(node name, index position, check)`` for every index that is not provably in range.
    torch_overflow: torch evaluating the mod with int32 index tensors would overflow (wrap) an
        index-derived value: the vmap paths must pass int64 indices (``needs_wide_indices``).
    """

    wide: frozenset = frozenset()
    gathers: tuple = ()
    torch_overflow: bool = False
    # Which graph (and captured shapes) the decisions are about, so lower() can refuse a variant
    # computed for another mod; not part of equality (equal decisions give equal source).
    graph: Optional[int] = field(default=None, compare=False)

    def is_wide(self, node_name: str) -> bool:
        return node_name in self.wide

    def gather_check(self, node_name: str, position: int) -> GatherCheck:
        for name, pos, check in self.gathers:
            if name == node_name and pos == position:
                return check
        return IN_RANGE

    def __repr__(self) -> str:
        # Stable across processes (the kernel index keys on it): wide sorted, the graph hash left out.
        return f"LoweringVariant(wide={sorted(self.wide)!r}, gathers={self.gathers!r}, torch_overflow={self.torch_overflow})"


@dataclass(frozen=True)
class IntFact:
    """What the analysis knows of one integer (or bool) node.

    lo, hi: inclusive range of the value. exact: index-derived (no integer read from a captured
    tensor), so computed exactly, in int64 where it needs it. dtype: the dtype the kernel holds it in.
    """

    lo: int
    hi: int
    exact: bool
    dtype: torch.dtype
    # torch types it int32 only because the indices are int32: with int64 index tensors (the vmap
    # paths' choice when needs_wide_indices) it would be int64.
    follows_index: bool = False
    weak: bool = False  # a Python number the mod reads: it decides no dtype


def _fits(lo: int, hi: int, dtype: torch.dtype) -> bool:
    dlo, dhi = _DTYPE_RANGE[dtype]
    return dlo <= lo and hi <= dhi


def _promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return torch.promote_types(a, b)


def _corners(fn: Callable[[int, int], int], a: tuple, b: tuple) -> tuple[int, int]:
    values = [fn(x, y) for x in a for y in b]
    return min(values), max(values)


def _trunc_div(x: int, y: int) -> int:
    q = abs(x) // abs(y)
    return q if (x >= 0) == (y > 0) else -q


def _bit_span(lo: int, hi: int) -> int:
    """Smallest n with -2**n <= lo and hi < 2**n."""
    return max(lo.bit_length() if lo >= 0 else (-lo - 1).bit_length(), hi.bit_length() if hi >= 0 else (-hi - 1).bit_length())


# -- interval functions: (operand ranges, constants) -> range, or None (unknown) ----------------------


def _add(a, b, alpha=1):
    b = (b[0] * alpha, b[1] * alpha) if alpha >= 0 else (b[1] * alpha, b[0] * alpha)
    return a[0] + b[0], a[1] + b[1]


def _sub(a, b, alpha=1):
    return _add(a, b, -alpha)


def _floordiv(a, b):
    if b[0] > 0 or b[1] < 0:  # floor division is monotone in each argument on either side of 0
        return _corners(lambda x, y: x // y, a, b)
    return None  # a division by zero is possible: no range


def _truncdiv(a, b):
    if b[0] > 0 or b[1] < 0:
        return _corners(_trunc_div, a, b)
    return None


def _remainder(a, b):
    if b[0] > 0:
        if a[0] >= 0 and a[1] < b[0]:
            return a
        return 0, b[1] - 1
    if b[1] < 0:
        if a[1] <= 0 and a[0] > b[1]:
            return a
        return b[0] + 1, 0
    return None


def _fmod(a, b):
    if not (b[0] > 0 or b[1] < 0):
        return None
    m = max(abs(b[0]), abs(b[1])) - 1
    return max(a[0], -m) if a[0] < 0 else 0, min(a[1], m) if a[1] > 0 else 0


def _abs(a):
    if a[0] >= 0:
        return a
    if a[1] <= 0:
        return -a[1], -a[0]
    return 0, max(-a[0], a[1])


def _clamp(x, lo=None, hi=None):
    out = x
    if lo is not None:
        out = max(out[0], lo[0]), max(out[1], lo[1])
    if hi is not None:
        out = min(out[0], hi[0]), min(out[1], hi[1])
    return out


def _pow(a, e):
    if e[0] != e[1] or not 0 <= e[0] <= 64:
        return None
    k = e[0]
    lo, hi = _corners(lambda x, _: x**k, a, (k,))
    if k % 2 == 0 and a[0] < 0 < a[1]:
        lo = 0
    return lo, hi


def _bitwise_and(a, b):
    if a[0] >= 0 and b[0] >= 0:
        return 0, min(a[1], b[1])
    if a[0] >= 0:
        return 0, a[1]
    if b[0] >= 0:
        return 0, b[1]
    n = _bit_span(min(a[0], b[0]), max(a[1], b[1]))
    return -(2**n), 2**n - 1


def _bitwise_or_xor(a, b):
    n = _bit_span(min(a[0], b[0]), max(a[1], b[1]))
    if a[0] >= 0 and b[0] >= 0:
        return 0, 2**n - 1
    return -(2**n), 2**n - 1


def _shift_left(a, s):
    if not 0 <= s[0] <= s[1] < 64:
        return None  # amounts past the width (or negative) follow torch's dtype rules
    return _corners(lambda x, k: x << k, a, s)  # monotone in each argument: corners bound it


def _shift_right(a, s):
    if not 0 <= s[0] <= s[1] < 64:
        return None
    return _corners(lambda x, k: x >> k, a, s)


def _where(c, a, b):
    return min(a[0], b[0]), max(a[1], b[1])


def _sign(a):
    return (a[0] > 0) - (a[0] < 0), (a[1] > 0) - (a[1] < 0)


_INTERVALS: dict[Any, Callable] = {
    aten.add: _add,
    aten.sub: _sub,
    aten.rsub: lambda a, b, alpha=1: _sub(b, a, alpha),
    aten.mul: lambda a, b: _corners(lambda x, y: x * y, a, b),
    aten.neg: lambda a: (-a[1], -a[0]),
    aten.floor_divide: _floordiv,
    aten.remainder: _remainder,
    aten.fmod: _fmod,
    aten.abs: _abs,
    aten.minimum: lambda a, b: (min(a[0], b[0]), min(a[1], b[1])),
    aten.maximum: lambda a, b: (max(a[0], b[0]), max(a[1], b[1])),
    aten.min.other: lambda a, b: (min(a[0], b[0]), min(a[1], b[1])),
    aten.max.other: lambda a, b: (max(a[0], b[0]), max(a[1], b[1])),
    aten.clamp: _clamp,
    aten.clamp_min: lambda x, lo: _clamp(x, lo=lo),
    aten.clamp_max: lambda x, hi: _clamp(x, hi=hi),
    aten.where: _where,
    aten.pow: _pow,
    aten.square: lambda a: _pow(a, (2, 2)),
    aten.bitwise_and: _bitwise_and,
    aten.bitwise_or: _bitwise_or_xor,
    aten.bitwise_xor: _bitwise_or_xor,
    aten.bitwise_not: lambda a: (-a[1] - 1, -a[0] - 1),
    aten.bitwise_left_shift: _shift_left,
    aten.__lshift__: _shift_left,
    aten.bitwise_right_shift: _shift_right,
    aten.__rshift__: _shift_right,
    aten.sign: _sign,
    aten.sgn: _sign,
    aten.relu: lambda a: (max(a[0], 0), max(a[1], 0)),
    # integers are already whole
    aten.round: lambda a, **_: a,
    aten.trunc: lambda a: a,
    aten.floor: lambda a: a,
    aten.ceil: lambda a: a,
}

# Ops whose integer result is a value already computed (views, copies, 0-d reshapes).
_SAME_VALUE = {
    aten.detach, aten.clone, aten.alias, aten.lift_fresh, aten.lift_fresh_copy, aten.unsqueeze,
    aten.squeeze, aten.view, aten.reshape, aten._unsafe_view, aten.expand, aten.contiguous,
}  # fmt: skip
_CASTS = {aten._to_copy, aten.to, prims.convert_element_type}
_GATHERS = {aten.index}


class _Analysis:
    def __init__(self, traced: TracedMod, bounds: IndexBounds):
        self.traced = traced
        self.bounds = bounds
        self.facts: dict[torch.fx.Node, Optional[IntFact]] = {}
        self.wide: set[str] = set()
        self.gathers: list[tuple[str, int, GatherCheck]] = []
        self.torch_overflow = False
        # int32 values computed from loaded data and index values (doc[q_idx] * q_idx): int64 when the
        # vmap paths take int64 indices, so that every backend computes what torch does with them.
        self.mixed: set[str] = set()

    def run(self) -> "_Analysis":
        limits = {"b": self.bounds.B, "h": self.bounds.H, "q_idx": self.bounds.Q_LEN, "kv_idx": self.bounds.KV_LEN}
        n_args = len(self.traced.arg_names)
        position = 0
        n_tensors = len(self.traced.captured)
        for node in self.traced.graph.nodes:
            if node.op == "placeholder":
                if position < n_args:
                    name = self.traced.arg_names[position]
                    hi = max(limits.get(name, 1), 1) - 1
                    self.facts[node] = IntFact(0, hi, True, torch.int32, True) if name in limits else None
                elif position < n_args + n_tensors:
                    self.facts[node] = self.captured_constant(position - n_args)
                else:
                    self.facts[node] = self.number(position - n_args - n_tensors)
                position += 1
            elif node.op == "call_function":
                try:
                    self.facts[node] = self.visit(node)
                except (TypeError, ValueError, IndexError, KeyError):
                    self.facts[node] = self.unknown(node)  # the lowering reports what it cannot write
        if self.torch_overflow:
            self.wide |= self.mixed
        return self

    # -- operands ------------------------------------------------------------------------------

    def captured_constant(self, index: int) -> Optional[IntFact]:
        """A 0-d constant the mod builds itself (torch.tensor(3)) is written into the kernel as a literal."""
        c = self.traced.captured[index]
        if c.fixed_value is not None and len(c.shape) == 0 and c.dtype in _DTYPE_RANGE:
            v = int(c.fixed_value.item())
            return IntFact(v, v, True, c.dtype)
        return None

    def number(self, index: int) -> Optional[IntFact]:
        """A Python number the mod reads (trace/numbers.py): its value is not known here, so the
        decisions hold for every value the kernels take (an int: |n| <= NUMBER_INT_LIMIT, which the
        trace cache ensures; a larger one is traced as a constant), and one kernel serves them all."""
        if index >= len(self.traced.numbers):
            return None
        kind = self.traced.numbers[index].kind
        if kind is bool:
            return IntFact(0, 1, True, torch.bool, weak=True)
        if kind is int:
            return IntFact(-NUMBER_INT_LIMIT, NUMBER_INT_LIMIT, True, torch.int32, weak=True)
        return None

    def operand(self, arg) -> Optional[IntFact]:
        if isinstance(arg, torch.fx.Node):
            return self.facts.get(arg)
        if isinstance(arg, bool):
            return IntFact(int(arg), int(arg), True, torch.bool)
        if isinstance(arg, int):
            return IntFact(arg, arg, True, torch.int64)  # weak: decides no dtype
        return None

    def unknown(self, node) -> Optional[IntFact]:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype not in _DTYPE_RANGE:
            return None
        lo, hi = _DTYPE_RANGE[val.dtype]
        return IntFact(lo, hi, False, val.dtype)

    # -- one node ------------------------------------------------------------------------------

    def visit(self, node: torch.fx.Node) -> Optional[IntFact]:
        target = node.target
        packet = getattr(target, "overloadpacket", target)
        if packet in _GATHERS:
            self.check_gather(node)
            return self.unknown(node)
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype not in _DTYPE_RANGE:
            return None
        out = val.dtype
        if val.numel() != 1:  # a small vector of loaded values
            return self.unknown(node)
        args = list(node.args) + list(node.kwargs.values())
        if packet in _SAME_VALUE and target is not aten.view.dtype:  # (view.dtype reinterprets bits)
            return self.operand(node.args[0]) or self.unknown(node)
        if packet in _CASTS:
            return self.cast(node, out)
        rule = lookup(target, LOWERINGS)
        if rule is not None and rule.kind == "constant":
            value = rule.fn(*node.args, **node.kwargs)
            if isinstance(value, (bool, int)):
                v = int(value)
                return IntFact(v, v, True, out)
            return self.unknown(node)
        operands = [self.operand(a) for a in args]
        node_operands = [self.operand(a) for a in args if isinstance(a, torch.fx.Node)]
        if out == torch.bool:  # comparisons and logic: the value is a bool, the inputs may be wide
            exact = all(f is not None and f.exact for f in node_operands if f is None or f.dtype != torch.bool)
            if exact and any(f is not None for f in node_operands):
                self.mark_wide_constants(node, operands)
            return IntFact(0, 1, exact, torch.bool)
        if any(f is None for f in node_operands):  # an integer made from a float: unknown
            return self.unknown(node)

        dtype = out
        for f in node_operands:
            if f.dtype != torch.bool and not f.weak:
                dtype = _promote(dtype, f.dtype)
        # Bools (conditions, comparisons) are 0 or 1 wherever they come from; an integer is exact when
        # every integer it is computed from is.
        exact = all(f.exact for f in node_operands if f.dtype != torch.bool)
        interval = self.interval(node, packet)
        if interval is None:  # undefined (a division by zero) or not tracked: torch's rules
            exact = False
            lo, hi = _DTYPE_RANGE[dtype]
        else:
            lo, hi = interval
        if exact and dtype in _WIDENED_DTYPES and (not _fits(lo, hi, torch.int32) or self.has_wide_constant(operands)):
            self.wide.add(node.name)
            dtype = torch.int64
            if out == torch.int32:
                self.torch_overflow = True  # torch, with int32 indices, would wrap this value (or constant)
        follows_index = out == torch.int32 and any(f.follows_index for f in node_operands)
        if not exact and follows_index and dtype == torch.int32:
            self.mixed.add(node.name)
        if not _fits(lo, hi, dtype):
            # It wraps in the kernel's dtype as in torch (an int8 sum, a loaded int32 product): any value.
            # Still data-independent when exact, so a later int32 computation with it stays exact.
            lo, hi = _DTYPE_RANGE[dtype]
        return IntFact(lo, hi, exact, dtype, follows_index)

    def interval(self, node, packet) -> Optional[tuple[int, int]]:
        fn = _INTERVALS.get(node.target) or _INTERVALS.get(packet)
        if packet is aten.div:
            mode = node.kwargs.get("rounding_mode", node.args[2] if len(node.args) > 2 else None)
            fn = {"floor": _floordiv, "trunc": _truncdiv}.get(mode)
        if fn is None:
            return None
        args = []
        for a in node.args:
            if isinstance(a, (torch.fx.Node, bool, int)):
                f = self.operand(a)
                if f is None:
                    return None
                args.append((f.lo, f.hi))
            elif a is None:
                args.append(None)
            elif isinstance(a, str):
                continue  # rounding_mode
            else:
                return None
        kwargs = {}
        for k, a in node.kwargs.items():
            if k == "rounding_mode":
                continue
            if isinstance(a, torch.fx.Node) or (isinstance(a, int) and k != "alpha"):
                f = self.operand(a)
                if f is None:
                    return None
                kwargs[k] = (f.lo, f.hi)
            else:
                kwargs[k] = a
        return fn(*args, **kwargs)

    def has_wide_constant(self, operands) -> bool:
        return any(f is not None and f.lo == f.hi and not _fits(f.lo, f.hi, torch.int32) for f in operands)

    def mark_wide_constants(self, node, operands) -> None:
        """A comparison of index values with a constant outside int32 compares in int64 (torch would wrap it)."""
        ints = [f for f in operands if f is not None and f.dtype != torch.bool]
        if ints and self.has_wide_constant(operands) and all(f.dtype != torch.int64 or f.lo == f.hi for f in ints):
            self.wide.add(node.name)
            self.torch_overflow = True

    def cast(self, node, out: torch.dtype) -> Optional[IntFact]:
        f = self.operand(node.args[0])
        if f is None:  # from a float: any value of the target dtype
            return self.unknown(node)
        if out == torch.bool:
            return IntFact(int(f.lo > 0 or f.hi < 0), int(f.lo != 0 or f.hi != 0), f.exact, torch.bool)
        if out == f.dtype:  # the kernel already holds it in this dtype: the same expression
            return f
        lo, hi = (f.lo, f.hi) if _fits(f.lo, f.hi, out) else _DTYPE_RANGE[out]  # a narrowing cast wraps
        return IntFact(lo, hi, f.exact, out)

    # -- gathers -------------------------------------------------------------------------------

    def check_gather(self, node) -> None:
        src, indices = node.args[0], node.args[1]
        shape = src.meta["val"].shape if isinstance(src, torch.fx.Node) and "val" in src.meta else None
        if shape is None:
            return
        for position, index in enumerate(indices):
            if not isinstance(index, torch.fx.Node) or position >= len(shape):
                continue
            f = self.facts.get(index)
            if f is None or f.dtype == torch.bool:
                continue  # not an integer position: the lowering reports it
            check = gather_check(f.lo, f.hi, int(shape[position]))
            if check != IN_RANGE:
                self.gathers.append((node.name, position, check))

    def variant(self) -> LoweringVariant:
        return LoweringVariant(
            wide=frozenset(self.wide), gathers=tuple(sorted(self.gathers, key=lambda g: (g[0], g[1]))),
            torch_overflow=self.torch_overflow, graph=graph_key(self.traced),
        )  # fmt: skip


def graph_key(traced: TracedMod) -> int:
    """Identifies a traced graph with its captured shapes (what the decisions depend on besides bounds)."""
    return hash((traced.graph_module.code, tuple((c.shape, c.dtype) for c in traced.captured),
                 tuple(n.kind for n in traced.numbers)))


def gather_check(lo: int, hi: int, size: int) -> GatherCheck:
    """The guard an index in [lo, hi] needs for a dimension of ``size``."""
    wrap = lo < 0
    if wrap:  # after the wrap, negatives sit in [lo + size, size - 1]
        low = lo + size < 0
        high = hi >= size
    else:
        low, high = False, hi >= size
    return GatherCheck(wrap=wrap, low=low, high=high)


def analyze(traced: TracedMod, bounds: IndexBounds) -> _Analysis:
    """Facts for every node of ``traced`` at ``bounds`` (``.facts``), and the variant (``.variant()``)."""
    return _Analysis(traced, bounds).run()


def lowering_variant(traced: TracedMod, bounds: IndexBounds) -> LoweringVariant:
    """The bound-dependent lowering decisions for this call (which integer nodes must be int64 at these
    lengths, which gathers need a wrap or a mask). Cheap, deterministic, hashable; equal variants give
    identical lowered source, so the kernels are cached by it."""
    if not isinstance(bounds, IndexBounds):
        raise TypeError(f"bounds must be an IndexBounds, got {type(bounds).__name__}")
    return analyze(traced, bounds).variant()


def needs_wide_indices(traced: TracedMod, bounds: IndexBounds) -> bool:
    """True when integer arithmetic on the index arguments can leave int32 at these bounds; the
    vmap-based paths (BlockMask builder, PyTorch backend) then pass int64 index tensors."""
    if not isinstance(bounds, IndexBounds):
        raise TypeError(f"bounds must be an IndexBounds, got {type(bounds).__name__}")
    return analyze(traced, bounds).variant().torch_overflow


# ------------------------------------------------------------------------------------ per call
# [Note] Cache keys (flexattn/kernels/family.py): the caches below are keyed by the TracedMod objects
# themselves (immutable, compared by identity, kept alive by the key, so an id cannot be reused) and
# plain-int bounds; both are bounded. The analysis reads nothing else (graph, captured shapes and
# dtypes, constants frozen into the TracedMod), so an entry can never describe other contents.


def index_bounds(B: int, H: int, Q_LEN: int, KV_LEN: int) -> IndexBounds:
    """The exclusive upper bounds of b, h, q_idx and kv_idx in a call of these sizes."""
    return IndexBounds(B=B, H=H, Q_LEN=Q_LEN, KV_LEN=KV_LEN)


# The analysis walks the whole graph (about 0.1 ms): remembered per (TracedMods, bounds).
_VARIANTS: "OrderedDict[tuple, tuple]" = OrderedDict()
_VARIANTS_KEPT = 512


def lowering_variants(score: Optional[TracedMod], mask: Optional[TracedMod], bounds: Optional[IndexBounds]) -> tuple:
    """The (score_mod, mask_mod) lowering variants for calls within ``bounds``; None entries mean
    "correct at any lengths" (also for ``bounds=None``). Every kernel family keys its compiled
    sources by this pair."""
    if bounds is None:
        return (None, None)
    key = (score, mask, bounds)
    variants = _VARIANTS.get(key)
    if variants is None:
        variants = (lowering_variant(score, bounds) if score is not None else None,
                    lowering_variant(mask, bounds) if mask is not None else None)
        _VARIANTS[key] = variants
        if len(_VARIANTS) > _VARIANTS_KEPT:
            _VARIANTS.popitem(last=False)
    else:
        _VARIANTS.move_to_end(key)
    return variants


_WIDE: "OrderedDict[tuple, bool]" = OrderedDict()
_WIDE_KEPT = 256


def index_dtype(*traced: Optional[TracedMod], bounds: IndexBounds) -> torch.dtype:
    """int64 when any of these traced mods needs wide indices at ``bounds``, else int32."""
    key = (traced, bounds)
    wide = _WIDE.get(key)
    if wide is None:
        wide = any(needs_wide_indices(t, bounds) for t in traced if t is not None)
        _WIDE[key] = wide
        if len(_WIDE) > _WIDE_KEPT:
            _WIDE.popitem(last=False)
    return torch.int64 if wide else torch.int32


def mod_index_dtype(fn, kind: str, B: int, H: int, Q_LEN: int, KV_LEN: int) -> torch.dtype:
    """The index dtype for evaluating the callable ``fn`` with vmap at these lengths.

    A mod that cannot be traced (it may still run under vmap) keeps int32.
    """
    try:
        traced, _ = trace_mod(fn, kind)
    except Exception:
        return torch.int32
    return index_dtype(traced, bounds=index_bounds(B, H, Q_LEN, KV_LEN))
