"""Python numbers a mod reads, as runtime inputs of its graph and its kernels.

[Note] Numbers are inputs, not constants
A mask or score_mod usually reads a few Python numbers besides its arguments: a window size, a
prefix length, a soft-cap, a temperature, an attribute of a config object. Baking them into the
graph would make every new value a new trace and a new kernel, and under torch.compile, where
Dynamo turns a number that keeps changing into a symbolic value, it returned an earlier value's
result. Instead each int, float and bool that the search of its reads (reads.py) finds at a
location the mod reads (a closure cell, a global, a default, an object's attribute, a list or dict
item, a tuple inside one of those) is a *leaf*, and tracing runs with a TracedNumber standing in
for it there:

* arithmetic on stand-ins records an expression (``window // 2``), so what finally reaches a torch
  op is a number computed from the leaves, evaluated again from the leaves at every call;
* a stand-in that reaches a torch op as data (an operand of an elementwise op, a fill value) becomes
  a graph input of the mod (``CapturedNumber``), which the kernels take as a scalar argument;
* anything else Python does with a stand-in (``if window > 0``, ``range(n)``, ``int(n)``, a shape,
  a dict key, ``math.sqrt(d)``) needs its value: the value is given, and the leaves it came from are
  *specialized*: the trace holds only for calls where they have the same values, which the caches
  check (a changed value traces again, as a changed constant did before).

So a new window size reuses the traced graph and the compiled kernels, eagerly and under
torch.compile, where the value arrives as whatever Dynamo made of it (compile/registry.py). A literal in the
mod's code stays a constant of the graph, as it should: it cannot change without new code.

What cannot be told apart falls to the safe side: a stand-in whose value equals another number of
the same torch call (``torch.clamp(x, 0, n)`` with n == 0) is specialized, as is one the op does not
take as a plain number (``torch.tensor(n)``, an index ``bias[n]``), and a mod that fails to trace
with stand-ins is traced with every number specialized. Tracing writes the stand-ins into the
locations and puts the originals back before it returns; a mod running at that moment in another
thread would see them (tracing happens once per mod, on its first call).
"""

from __future__ import annotations

import functools
import operator
import threading
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch

__all__ = ["TracedNumber", "NUMBER_TYPES", "evaluate", "leaves_of", "substituted", "data_positions"]

NUMBER_TYPES = (int, float, bool)  # exact types: subclasses (IntEnum) stay constants


def _pow_not_traced(a, b):  # pragma: no cover - never called: see TracedNumber.__pow__
    raise AssertionError


_OPS: dict[str, Callable] = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "and": operator.and_, "or": operator.or_,
    "xor": operator.xor, "lshift": operator.lshift, "rshift": operator.rshift, "lt": operator.lt,
    "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq, "ne": operator.ne,
    "neg": operator.neg, "pos": operator.pos, "abs": abs, "invert": operator.invert,
}  # fmt: skip


def evaluate(expr: tuple, leaves, tensors=()) -> Any:
    """The value of a number's expression for these values of the leaves and these tensors found
    by the search (``("size", position, dim)``: a size of one of them, ``t.shape[0]``)."""
    tag = expr[0]
    if tag == "leaf":
        return leaves[expr[1]]
    if tag == "const":
        return expr[1]
    if tag == "size":
        return tensors[expr[1]].shape[expr[2]]
    return _OPS[tag](*(evaluate(arg, leaves, tensors) for arg in expr[1:]))


def leaves_of(expr: tuple) -> set[int]:
    if expr[0] == "leaf":
        return {expr[1]}
    if expr[0] in ("const", "size"):
        return set()
    return set().union(*(leaves_of(arg) for arg in expr[1:]))


# How a mod reads a tensor's sizes: ``t.shape``, ``t.size()``, ``t.size(d)`` (stand-ins: a size is a
# number the graph can take, read afresh at each call) and ``len(t)``, ``t.numel()`` (plain ints:
# Python insists on an int from __len__; the reads' key holds tensors' shapes, so a new shape traces anew).
_SHAPE_GETTER = torch.Tensor.shape.__get__
SIZE_QUERIES = (_SHAPE_GETTER, torch.Tensor.size)


def sizes_of(func, args, position: int, trace: "NumberTrace"):
    """``t.shape`` / ``t.size(...)`` of the tensor found at ``position`` as stand-ins."""
    tensor = args[0]
    stand_ins = tuple(TracedNumber(("size", position, d), s, trace) for d, s in enumerate(tensor.shape))
    if func is torch.Tensor.size and len(args) > 1:
        return stand_ins[args[1]]
    return stand_ins


class NumberTrace:
    """The numbers of one trace: which leaves were specialized. Stand-ins of a finished trace (one
    that user code kept) give their value without recording anything."""

    def __init__(self, leaf_types: list):
        self.leaf_types = leaf_types
        self.specialized: set[int] = set()
        self.active = True

    def force(self, number: "TracedNumber") -> Any:
        if self.active:
            self.specialized |= leaves_of(number.expr)
        return number.value


def _binary(tag: str, reflected: bool = False):
    def method(self, other):
        if isinstance(other, TracedNumber):
            other_expr, other_value = other.expr, other.value
        elif type(other) in NUMBER_TYPES:
            other_expr, other_value = ("const", other), other
        else:  # a tensor (its own reflected method takes over), or something Python must ask
            return NotImplemented
        if reflected:
            return TracedNumber((tag, other_expr, self.expr), _OPS[tag](other_value, self.value), self.trace)
        return TracedNumber((tag, self.expr, other_expr), _OPS[tag](self.value, other_value), self.trace)

    return method


def _unary(tag: str):
    def method(self):
        return TracedNumber((tag, self.expr), _OPS[tag](self.value), self.trace)

    return method


def _forcing(convert: Callable):
    def method(self, *args):
        return convert(self.trace.force(self), *args)

    return method


class TracedNumber:
    """A Python number standing in for a leaf while a mod is traced (see the module's note).

    Not a subclass of int or float on purpose: C code reads a subclass's value without asking it
    (``math.sqrt(n)``), which would bake the value in unnoticed; a plain object is asked through its
    methods, each of which either keeps the expression or specializes."""

    __slots__ = ("expr", "value", "trace")

    def __init__(self, expr: tuple, value: Any, trace: NumberTrace):
        self.expr, self.value, self.trace = expr, value, trace

    @property
    def kind(self) -> type:
        return type(self.value)

    __add__, __radd__ = _binary("add"), _binary("add", True)
    __sub__, __rsub__ = _binary("sub"), _binary("sub", True)
    __mul__, __rmul__ = _binary("mul"), _binary("mul", True)
    __truediv__, __rtruediv__ = _binary("truediv"), _binary("truediv", True)
    __floordiv__, __rfloordiv__ = _binary("floordiv"), _binary("floordiv", True)
    __mod__, __rmod__ = _binary("mod"), _binary("mod", True)
    __and__, __rand__ = _binary("and"), _binary("and", True)
    __or__, __ror__ = _binary("or"), _binary("or", True)
    __xor__, __rxor__ = _binary("xor"), _binary("xor", True)
    __lshift__, __rlshift__ = _binary("lshift"), _binary("lshift", True)
    __rshift__, __rrshift__ = _binary("rshift"), _binary("rshift", True)
    __lt__, __le__, __gt__, __ge__ = _binary("lt"), _binary("le"), _binary("gt"), _binary("ge")
    __eq__, __ne__ = _binary("eq"), _binary("ne")
    __neg__, __pos__, __abs__, __invert__ = _unary("neg"), _unary("pos"), _unary("abs"), _unary("invert")

    # Python decides with these: the value is given, and the leaves behind it specialized. (``**``
    # too: its result's type depends on the values, int or float.)
    __bool__ = _forcing(bool)
    __int__ = _forcing(int)
    __float__ = _forcing(float)
    __complex__ = _forcing(complex)
    __index__ = _forcing(operator.index)
    __hash__ = _forcing(hash)
    __str__ = _forcing(str)
    __repr__ = _forcing(repr)
    __format__ = _forcing(format)
    __round__ = _forcing(round)
    __trunc__ = _forcing(lambda v: v.__trunc__())
    __floor__ = _forcing(lambda v: v.__floor__())
    __ceil__ = _forcing(lambda v: v.__ceil__())
    __pow__ = _forcing(lambda v, other: v ** (other.trace.force(other) if isinstance(other, TracedNumber) else other))
    __rpow__ = _forcing(lambda v, other: other ** v)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Reached only outside a trace's mode (a stand-in user code kept): plain values.
        unwrap = lambda x: x.trace.force(x) if isinstance(x, TracedNumber) else x  # noqa: E731
        args = torch.utils._pytree.tree_map(unwrap, args)
        kwargs = torch.utils._pytree.tree_map(unwrap, kwargs or {})
        return func(*args, **kwargs)


# -- locations: writing stand-ins where the mod reads, and putting the originals back -----------

# Kinds of locations a callable reads (reads.py): a closure cell, a mapping's key, an attribute, a list's
# item. Defined here, where they are written.
CELL, ITEM, ATTR, INDEX = range(4)

_PARTIAL_FIELDS = {"func": 0, "args": 1, "keywords": 2}


def writable(kind: int, container: Any, key: Any) -> bool:
    """Whether tracing can put a stand-in at this location (and the original back)."""
    if kind == CELL:
        return True
    if kind == ITEM:
        return type(container) is dict
    if kind == INDEX:
        return type(container) is list
    if kind == ATTR:
        if type(container) is functools.partial:
            return key == "args"
        return key == "__defaults__" if callable(container) and hasattr(container, "__code__") else True
    return False


def rebuildable(value: Any) -> bool:
    """A container whose numbers a stand-in can replace in a copy: a tuple, a namedtuple, a slice."""
    return type(value) is tuple or type(value) is slice or (isinstance(value, tuple) and hasattr(value, "_make"))


def _write(kind: int, container: Any, key: Any, value: Any) -> None:
    if kind == CELL:
        container.cell_contents = value
    elif kind in (ITEM, INDEX):
        container[key] = value
    elif type(container) is functools.partial:
        state = list(container.__reduce__()[2])
        state[_PARTIAL_FIELDS[key]] = value
        container.__setstate__(tuple(state))
    elif callable(container) and hasattr(container, "__code__"):
        setattr(container, key, value)
    else:
        object.__setattr__(container, key, value)  # a __slots__ member (a class's __setattr__ aside)


def _item(value: Any, i: int) -> Any:
    return (value.start, value.stop, value.step)[i] if type(value) is slice else value[i]


def value_at(value: Any, path: tuple) -> Any:
    for i in path:
        value = _item(value, i)
    return value


def _replaced(value: Any, items: list) -> Any:
    """``value`` with the stand-in of each ``(path, stand_in)`` at its path (a copy of tuples)."""
    for path, stand_in in items:
        if not path:
            return stand_in
    fields = list((value.start, value.stop, value.step) if type(value) is slice else value)
    by_index: dict = {}
    for path, stand_in in items:
        by_index.setdefault(path[0], []).append((path[1:], stand_in))
    for i, sub in by_index.items():
        fields[i] = _replaced(fields[i], sub)
    if type(value) is slice:
        return slice(*fields)
    return tuple(fields) if type(value) is tuple else value._make(fields)


_LOCK = threading.RLock()  # one trace writes stand-ins at a time


@contextmanager
def substituted(reads: list, writes: list):
    """Other values at some of the locations a callable read, for the duration of the block (the
    originals back after it). ``writes``: ``((read, path), value)`` pairs, ``path`` the position
    inside the tuples that read gave (reads.Reads's leaves and tensor sites); ``reads``: the search's
    reads, ``[kind, container, key, value, ...]``."""
    by_read: dict = {}
    for (read, path), stand_in in writes:
        by_read.setdefault(read, []).append((path, stand_in))
    written = []
    with _LOCK:
        try:
            for read, items in by_read.items():
                kind, container, key, value = reads[read][:4]
                _write(kind, container, key, _replaced(value, items))
                written.append((kind, container, key, value))
            yield
        finally:
            for kind, container, key, value in reversed(written):
                _write(kind, container, key, value)


# -- which numbers of an aten op are data -------------------------------------------------------

aten = torch.ops.aten
# Ops that are not tagged pointwise but take plain numbers as data: every number argument, or the
# one named. (A pointwise op's numbers are all data: operands, alpha, clamp's bounds.)
_DATA_ARGUMENT = {
    aten.floor_divide: None, aten.rsub: None, aten.scalar_tensor: "s", aten.full: "fill_value",
    aten.full_like: "fill_value", aten.new_full: "fill_value", aten.fill: "value",
}


def data_positions(func) -> Optional[Any]:
    """Which numbers of an aten op's call a stand-in may be: ``"all"``, one argument's
    ``(position, name)``, or None (a size, a dim, an index: the value decides the result's shape
    or which elements it holds, so it is specialized)."""
    if torch.Tag.pointwise in getattr(func, "tags", ()):
        return "all"
    packet = getattr(func, "overloadpacket", None)
    if packet not in _DATA_ARGUMENT:
        return None
    name = _DATA_ARGUMENT[packet]
    if name is None:
        return "all"
    for position, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return (position, name)
    return None
