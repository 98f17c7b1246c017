"""The values the walk over a mod's graph makes (emit.py: ``Val``, ``Gather`` with its ``View``
dimensions, ``Vec``), the constants they are built from, and the rules the walk's parts share
(kernel dtypes, parentheses, how many elements a small tensor may have)."""

from __future__ import annotations

import keyword
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.fx

from .index import ATOM, BAND, BOR, BXOR, CMP, wrap_int, sympy
from .ops import literal

__all__ = ["Val", "View", "Gather", "Vec", "VECTOR_LIMIT", "INDEX_FIRST", "LOGIC_AND_CMP", "INTS", "INDEX_INTS",
           "kernel_dtype", "paren", "numel", "constant", "weak_number", "flat_nodes"]

# Most elements a small tensor inside a mod may have (each becomes its own load and arithmetic).
VECTOR_LIMIT = 128

INDEX_FIRST = (
    "Index captured tensors down to one element before computing with them: bias[h, q_idx] * 2, "
    "not (bias * 2)[h, q_idx]; a mod computes one value per (query, key) pair."
)


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
        return False if self.dtype == torch.bool else 0 if self.dtype in INTS else 0.0

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
LOGIC_AND_CMP = (BAND, BXOR, BOR, CMP)
INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
INDEX_INTS = (torch.int32, torch.int64)  # dtypes kept as sympy expressions (narrower ones are cast up)


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point else dtype


def paren(v: Val, need: int) -> str:
    return v.text if v.prec >= need else f"({v.text})"


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def constant(value: Any, dtype: torch.dtype) -> Val:
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


def weak_number(value: Union[bool, int, float]) -> Val:
    """A Python number argument (torch's "wrapped number": it does not decide the result dtype)."""
    dtype = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float32
    text, prec = literal(value)
    return Val(text, dtype, prec, value=value, weak=True)


def flat_nodes(args) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, found.append)
    return found

