"""Differential fuzzer: random mods from a small grammar, every backend, against the float64 reference.

Each case is one seed. From it the fuzzer writes the Python source of a ``score_mod`` and/or a
``mask_mod`` (integer arithmetic with negative intermediates, ``//`` and ``%``, comparisons, bool
arithmetic with ``&``, ``|`` and ``+``, casts, gathers at derived and negative indices), and the
tables they read: captured tensors of every dtype reached through a closure, a module global, an
attribute of a plain object, an ``nn.Module`` (buffer, parameter or plain attribute), a bound
method's ``self`` or a default argument. It then runs, on odd shapes with GQA:

1. the mods as built;
2. the same mod objects after the tables were updated in place (or an attribute replaced);
3. the factory called again with new tables: the same code objects in new closures;

each through every backend, against ``reference_attention`` in float64.

Semantics the oracle follows (the contract of issue 8): integer expressions of ``b``, ``h``,
``q_idx``, ``kv_idx`` and Python constants are exact, as Python integers are, so the oracle hands the
mods int64 indices; values read from tables follow torch's dtype rules, so the grammar keeps every
expression that involves a read value inside its dtype's range. Scores are never compared with a
threshold (float32 and float64 scores may fall on either side of it).

A seeded, bounded run is part of the suite. By hand::

    FLEXATTN_FUZZ_CASES=500 python -m pytest -q tests/test_fuzz.py      # a longer run
    FLEXATTN_FUZZ_SEED=1234 FLEXATTN_FUZZ_CASES=1 python -m pytest -q tests/test_fuzz.py  # replay one

A failure prints the case's seed and the generated source.
"""

from __future__ import annotations

import gc
import linecache
import os
import random
import re
import textwrap
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch
from numerics import rel_err

from flexattn import AuxRequest, create_block_mask, flex_attention
from flexattn.reference import reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["PYTORCH"]
if DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    BACKENDS.append("TRITON")
NUM_CASES = int(os.environ.get("FLEXATTN_FUZZ_CASES", "12"))
BASE_SEED = int(os.environ.get("FLEXATTN_FUZZ_SEED", "0"))
TOLERANCE = 2e-5  # float32 inputs against the float64 reference, norm-wise

INT32_MAX = 2**31 - 1
INT_LIMIT = {"bool": 1, "int8": 127, "int16": 2**15 - 1, "int32": INT32_MAX, "int64": 2**63 - 1}
INT_RANK = {"bool": 0, "int8": 1, "int16": 2, "int32": 3, "int64": 4}
TABLE_DTYPES = ["bool", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32"]
# How a mod reaches a table. Functions: through a closure, a module global, an attribute of a plain
# object or of an nn.Module (buffer, parameter or plain attribute), or a default argument. Bound
# methods of an nn.Module: self's buffer or plain attribute, or a module global.
FUNCTION_ACCESS = ["closure", "global", "object", "module_buffer", "module_attribute", "default"]
METHOD_ACCESS = ["self_buffer", "self_attribute", "global"]


# ------------------------------------------------------------------------------------- expressions


@dataclass(frozen=True)
class Expr:
    """A generated expression: its source and what the grammar knows about its value.

    kind: "int", "bool" or "float". For ints, [lo, hi] bounds the exact value and dtype is torch's
    dtype for it (index arguments count as int32, the dtype the kernels see); ``loaded`` says a
    table value takes part, so the value must stay inside the dtype (no exactness contract there).
    For floats, ``bound`` bounds |value| and ``exact`` says float32 and float64 agree on it exactly
    (so comparing it is safe); ``half`` marks a 16-bit value that must meet a float32 one first.
    """

    src: str
    kind: str
    lo: int = 0
    hi: int = 0
    dtype: str = "int32"
    loaded: bool = False
    bound: float = 0.0
    exact: bool = False
    half: bool = False


@dataclass
class Table:
    name: str  # the attribute, global or parameter name
    dtype: str
    shape: tuple
    access: str
    ref: str = ""  # how the mod's source reads it: t0, G0, holder.t0, self.t0, ...
    first_dim: Optional[str] = None  # for 2-D tables: "b" or "h", the index of the leading dim

    def values(self, gen: torch.Generator) -> torch.Tensor:
        """Fresh contents: small integers (so read values cannot overflow), or floats in [-2, 2]."""
        if self.dtype == "bool":
            return torch.rand(self.shape, generator=gen) < 0.5
        if self.dtype.startswith("int"):
            return torch.randint(-8, 9, self.shape, generator=gen).to(getattr(torch, self.dtype))
        return (torch.rand(self.shape, generator=gen) * 4 - 2).to(getattr(torch, self.dtype))


@dataclass
class Shapes:
    B: int
    Hq: int
    Hkv: int
    L: int
    S: int
    E: int
    block: int


class Grammar:
    """Writes random expressions over the index arguments and the tables."""

    def __init__(self, rng: random.Random, shapes: Shapes, tables: list[Table], with_score: bool):
        self.rng = rng
        self.shapes = shapes
        self.tables = tables
        self.with_score = with_score
        self.index_bounds = {"b": shapes.B - 1, "h": shapes.Hq - 1, "q_idx": shapes.L - 1, "kv_idx": shapes.S - 1}

    # ---- integers

    def index(self) -> Expr:
        name = self.rng.choice(["q_idx", "kv_idx", "q_idx", "kv_idx", "b", "h"])
        return Expr(name, "int", 0, self.index_bounds[name])

    def int_expr(self, depth: int) -> Expr:
        rng = self.rng
        if depth <= 0:
            if depth < 0 or rng.random() < 0.8 or not self._int_tables():
                return self.index()
            return self.int_gather(-1)
        for _ in range(20):  # a production whose result would leave its dtype is skipped
            choice = rng.choice(["add", "sub", "mul_const", "mul", "floordiv", "mod", "where", "abs", "clamp",
                                 "minmax", "cast", "bool_to_int", "gather", "big_const"])
            expr = getattr(self, "_" + choice)(depth)
            if expr is not None and self._fits(expr):
                return expr
        return self.index()

    def _fits(self, e: Expr) -> bool:
        if e.loaded:
            return -INT_LIMIT[e.dtype] - 1 <= e.lo and e.hi <= INT_LIMIT[e.dtype]
        return -(2**62) <= e.lo and e.hi <= 2**62  # index arithmetic: exact by contract

    def _join(self, a: Expr, b: Expr) -> Optional[tuple[str, bool]]:
        """dtype and ``loaded`` of a binary op on two tensors; None if mixing would be ambiguous (an
        index expression past int32 meeting a read value, whose dtype would decide the wrap)."""
        if a.loaded != b.loaded:
            index_side = b if a.loaded else a
            if index_side.lo < -INT32_MAX or index_side.hi > INT32_MAX:
                return None
        dtype = a.dtype if INT_RANK[a.dtype] >= INT_RANK[b.dtype] else b.dtype
        return dtype, a.loaded or b.loaded

    def _binary(self, depth: int, op: str) -> Optional[Expr]:
        a, b = self.int_expr(depth - 1), self.int_expr(depth - 1)
        joined = self._join(a, b)
        if joined is None:
            return None
        dtype, loaded = joined
        if op == "+":
            lo, hi = a.lo + b.lo, a.hi + b.hi
        elif op == "-":
            lo, hi = a.lo - b.hi, a.hi - b.lo
        else:
            products = [a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi]
            lo, hi = min(products), max(products)
        return Expr(f"({a.src} {op} {b.src})", "int", lo, hi, dtype, loaded)

    def _add(self, depth):
        return self._binary(depth, "+")

    def _sub(self, depth):
        return self._binary(depth, "-")

    def _mul(self, depth):
        return self._binary(depth, "*") if depth <= 2 else None

    def _mul_const(self, depth):
        a = self.int_expr(depth - 1)
        c = self.rng.choice([-7, -3, -2, -1, 2, 3, 5, 7])
        lo, hi = sorted((a.lo * c, a.hi * c))
        return Expr(f"({a.src} * {c})", "int", lo, hi, a.dtype, a.loaded)

    def _big_const(self, depth):
        # Index arithmetic that can leave int32 at these lengths, reduced before it is used: exact
        # by contract (int64 in the kernel where needed), including after an int64 cast.
        a = self.int_expr(depth - 1)
        if a.loaded:
            return None
        c = self.rng.choice([100_003, 3_000_017, 2**33, -(2**31)])
        if max(abs(a.lo), abs(a.hi)) * abs(c) > 2**62:
            return None
        src = a.src if self.rng.random() < 0.5 else f"{a.src}.to(torch.int64)"
        m = self.rng.choice([3, 5, 7, 11, 1000])
        return Expr(f"(({src} * {c} + {self.rng.randint(-5, 5)}) % {m})", "int", 0, m - 1,
                    "int64" if "int64" in src or abs(c) > INT32_MAX else a.dtype, False)

    def _floordiv(self, depth):
        a = self.int_expr(depth - 1)
        c = self.rng.choice([-5, -3, -2, 2, 3, 4, 7, 16])
        lo, hi = (a.lo // c, a.hi // c) if c > 0 else (a.hi // c, a.lo // c)
        return Expr(f"({a.src} // {c})", "int", lo, hi, a.dtype, a.loaded)

    def _mod(self, depth):
        a = self.int_expr(depth - 1)
        c = self.rng.choice([-5, -3, 2, 3, 4, 7, 16])
        lo, hi = (0, c - 1) if c > 0 else (c + 1, 0)
        return Expr(f"({a.src} % {c})", "int", lo, hi, a.dtype, a.loaded)

    def _where(self, depth):
        cond, a, b = self.bool_expr(depth - 1), self.int_expr(depth - 1), self.int_expr(depth - 1)
        joined = self._join(a, b)
        if joined is None:
            return None
        dtype, loaded = joined
        return Expr(f"torch.where({cond.src}, {a.src}, {b.src})", "int", min(a.lo, b.lo), max(a.hi, b.hi),
                    dtype, loaded)

    def _abs(self, depth):
        a = self.int_expr(depth - 1)
        lo, hi = (a.lo, a.hi) if a.lo >= 0 else (-a.hi, -a.lo) if a.hi <= 0 else (0, max(-a.lo, a.hi))
        return Expr(f"{a.src}.abs()", "int", lo, hi, a.dtype, a.loaded)

    def _clamp(self, depth):
        a = self.int_expr(depth - 1)
        lo = self.rng.randint(-10, 10)
        hi = lo + self.rng.randint(0, 40)
        return Expr(f"{a.src}.clamp({lo}, {hi})", "int", max(min(a.lo, hi), lo), min(max(a.hi, lo), hi),
                    a.dtype, a.loaded)

    def _minmax(self, depth):
        a, b = self.int_expr(depth - 1), self.int_expr(depth - 1)
        joined = self._join(a, b)
        if joined is None:
            return None
        dtype, loaded = joined
        if self.rng.random() < 0.5:
            return Expr(f"torch.minimum({a.src}, {b.src})", "int", min(a.lo, b.lo), min(a.hi, b.hi), dtype, loaded)
        return Expr(f"torch.maximum({a.src}, {b.src})", "int", max(a.lo, b.lo), max(a.hi, b.hi), dtype, loaded)

    def _cast(self, depth):
        a = self.int_expr(depth - 1)
        if self.rng.random() < 0.5:
            return Expr(f"{a.src}.to(torch.int64)", "int", a.lo, a.hi, "int64", a.loaded)
        if a.lo < -INT32_MAX or a.hi > INT32_MAX:
            return None
        return Expr(f"{a.src}.to(torch.int32)", "int", a.lo, a.hi, "int32", a.loaded)

    def _bool_to_int(self, depth):
        c = self.bool_expr(depth - 1)
        if self.rng.random() < 0.5:
            return Expr(f"{c.src}.to(torch.int32)", "int", 0, 1, "int32", c.loaded)
        # bool * int is int64 in torch
        return Expr(f"({c.src} * {self.rng.choice([1, 3, -2])})", "int", -2, 3, "int64", c.loaded)

    def _gather(self, depth):
        return self.int_gather(depth - 1) if self._int_tables() else None

    # ---- gathers

    def _int_tables(self):
        return [t for t in self.tables if t.dtype.startswith("int")]

    def index_into(self, size: int, depth: int) -> str:
        """An index for a dimension of ``size``: derived from any integer expression (read values
        included), sometimes negative (torch wraps it), never outside [-size, size)."""
        a = self.int_expr(depth)
        if a.dtype not in ("int32", "int64"):  # torch indexes with int32 or int64 tensors only
            a = Expr(f"{a.src}.to(torch.int32)", "int", a.lo, a.hi, "int32", a.loaded)
        if -size <= a.lo and a.hi < size and self.rng.random() < 0.7:
            return a.src  # as it is, negative values included
        if self.rng.random() < 0.3:
            return f"({a.src} % {size} - {size})"  # in [-size, -1]: wraps to the end
        return f"({a.src} % {size})"

    def gather(self, table: Table, depth: int) -> str:
        size = table.shape[-1]
        if len(table.shape) == 1:
            # The relative-position form rel[q_idx - kv_idx] when the table is long enough for it.
            if size >= max(self.shapes.L, self.shapes.S) and self.rng.random() < 0.4:
                return f"{table.ref}[q_idx - kv_idx]"
            return f"{table.ref}[{self.index_into(size, depth)}]"
        return f"{table.ref}[{table.first_dim}, {self.index_into(size, depth)}]"

    def int_gather(self, depth: int) -> Expr:
        table = self.rng.choice(self._int_tables())
        return Expr(self.gather(table, depth), "int", -8, 8, table.dtype, True)

    # ---- booleans

    def bool_expr(self, depth: int) -> Expr:
        rng = self.rng
        choices = ["compare", "compare"]
        if depth > 0:
            choices += ["and", "or", "xor", "not", "bool_add", "where"]
        if any(t.dtype == "bool" for t in self.tables):
            choices.append("bool_gather")
        if self._float_tables():
            choices.append("float_compare")
        choice = rng.choice(choices)
        if choice == "compare":
            a, b = self.int_expr(max(depth - 1, 0)), self.int_expr(max(depth - 1, 0))
            op = rng.choice(["<", "<=", "==", "!=", ">", ">="])
            if self._join(a, b) is None:
                return Expr(f"({a.src} {op} {rng.randint(-3, 3)})", "bool", dtype="bool", loaded=a.loaded)
            return Expr(f"({a.src} {op} {b.src})", "bool", dtype="bool", loaded=a.loaded or b.loaded)
        if choice == "float_compare":
            a, b = self.exact_float(), self.exact_float()
            return Expr(f"({a.src} {rng.choice(['<', '>=', '!='])} {b.src})", "bool", dtype="bool", loaded=True)
        if choice == "bool_gather":
            table = rng.choice([t for t in self.tables if t.dtype == "bool"])
            return Expr(self.gather(table, max(depth - 1, 0)), "bool", dtype="bool", loaded=True)
        if choice == "not":
            a = self.bool_expr(depth - 1)
            return Expr(f"~{a.src}", "bool", dtype="bool", loaded=a.loaded)
        if choice == "where":
            c, a, b = (self.bool_expr(depth - 1) for _ in range(3))
            return Expr(f"torch.where({c.src}, {a.src}, {b.src})", "bool", dtype="bool", loaded=True)
        a, b = self.bool_expr(depth - 1), self.bool_expr(depth - 1)
        op = {"and": "&", "or": "|", "xor": "^", "bool_add": "+"}[choice]  # bool + bool: logical or in torch
        return Expr(f"({a.src} {op} {b.src})", "bool", dtype="bool", loaded=a.loaded or b.loaded)

    # ---- floats (score_mod only)

    def _float_tables(self):
        return [t for t in self.tables if t.dtype.startswith(("float", "bfloat"))]

    def exact_float(self) -> Expr:
        """A float32 value that float64 holds exactly too: a read value, or a small integer."""
        tables = self._float_tables()
        if tables and self.rng.random() < 0.6:
            table = self.rng.choice(tables)
            return Expr(f"{self.gather(table, 1)}.to(torch.float32)", "float", bound=2.0, exact=True)
        a = self.int_expr(1)
        if abs(a.lo) > 2**24 or abs(a.hi) > 2**24:
            a = Expr(f"({a.src} % 97)", "int", 0, 96)
        return Expr(f"{a.src}.to(torch.float32)", "float", bound=float(max(abs(a.lo), abs(a.hi))), exact=True)

    def float_expr(self, depth: int) -> Expr:
        rng = self.rng
        if depth <= 0:
            return self._float_leaf()
        choice = rng.choice(["leaf", "add", "mul", "where", "tanh", "sigmoid", "abs", "scale"])
        if choice == "leaf":
            return self._float_leaf()
        if choice in ("add", "mul"):
            a, b = self.float_expr(depth - 1), self.float_expr(depth - 1)
            if a.half and b.half:  # two 16-bit values: torch rounds the result, the kernel may not
                b = Expr("score", "float", bound=10.0)
            if choice == "mul" and a.bound * b.bound > 40:
                return Expr(f"({a.src} + {b.src})", "float", bound=a.bound + b.bound)
            op = "+" if choice == "add" else "*"
            bound = a.bound + b.bound if op == "+" else a.bound * b.bound
            return Expr(f"({a.src} {op} {b.src})", "float", bound=bound)
        if choice == "where":
            c, a, b = self.bool_expr(depth - 1), self.float32(depth - 1), self.float32(depth - 1)
            return Expr(f"torch.where({c.src}, {a.src}, {b.src})", "float", bound=max(a.bound, b.bound))
        a = self.float32(depth - 1)
        if choice == "tanh":
            return Expr(f"torch.tanh({a.src})", "float", bound=1.0)
        if choice == "sigmoid":
            return Expr(f"torch.sigmoid({a.src})", "float", bound=1.0)
        if choice == "abs":
            return Expr(f"{a.src}.abs()", "float", bound=a.bound)
        c = rng.choice([0.5, -0.25, 0.125, 2.0])
        return Expr(f"({a.src} * {c})", "float", bound=a.bound * abs(c))

    def float32(self, depth: int) -> Expr:
        e = self.float_expr(depth)
        return Expr(f"{e.src}.to(torch.float32)", "float", bound=e.bound) if e.half else e

    def _float_leaf(self) -> Expr:
        rng = self.rng
        choice = rng.choice(["score", "score", "int", "table"] if self._float_tables() else ["score", "score", "int"])
        if choice == "score":
            return Expr("score", "float", bound=10.0)
        if choice == "int":
            a = self.int_expr(2)
            if max(abs(a.lo), abs(a.hi)) > 400:
                a = Expr(f"({a.src} % 37)", "int", 0, 36)
            scale = rng.choice([0.01, -0.02, 0.05])
            return Expr(f"({a.src}.to(torch.float32) * {scale})", "float",
                        bound=max(abs(a.lo), abs(a.hi)) * abs(scale))
        table = rng.choice(self._float_tables())
        half = table.dtype in ("float16", "bfloat16")
        return Expr(self.gather(table, 1), "float", bound=2.0, half=half)

    def score_result(self) -> Expr:
        rng = self.rng
        f = self.float32(rng.randint(1, 3))
        form = rng.choice(["add", "add", "where", "scale"])
        if form == "add":
            return Expr(f"score + {f.src}", "float", bound=10 + f.bound)
        if form == "where":
            return Expr(f"torch.where({self.bool_expr(2).src}, score, {f.src})", "float", bound=max(10, f.bound))
        return Expr(f"score * 0.5 + {f.src}", "float", bound=5 + f.bound)


# ------------------------------------------------------------------------------------- one case


@dataclass
class Case:
    seed: int
    shapes: Shapes
    tables: list[Table]
    style: str  # "function" or "method"
    source: str
    score_bound: float  # bounds |score_mod(...)|: float32 rounding of the scores grows with it
    uses_batch_or_head: bool
    filename: str = ""
    namespace: dict = field(default_factory=dict)


def _pick_shapes(rng: random.Random) -> Shapes:
    Hkv = rng.choice([1, 2])
    Hq = Hkv * rng.choice([1, 1, 2, 3])  # GQA about half the time
    return Shapes(B=rng.choice([1, 2, 3]), Hq=Hq, Hkv=Hkv, L=rng.choice([1, 17, 40, 63, 64, 100, 129]),
                  S=rng.choice([1, 9, 33, 64, 90, 128]), E=rng.choice([16, 16, 24]), block=rng.choice([16, 32, 64]))


def _pick_tables(rng: random.Random, shapes: Shapes, style: str) -> list[Table]:
    tables = []
    longest = max(shapes.L, shapes.S)
    for i in range(rng.randint(1, 4)):
        dtype = rng.choice(TABLE_DTYPES)
        size = rng.choice([1, 2, 5, 13, longest, 2 * longest + 1])
        first_dim = rng.choice([None, None, "b", "h"])
        shape = (size,) if first_dim is None else ((shapes.B if first_dim == "b" else shapes.Hq), size)
        access = rng.choice(METHOD_ACCESS if style == "method" else FUNCTION_ACCESS)
        if access == "module_buffer" and rng.random() < 0.3 and dtype.startswith(("float", "bfloat")):
            access = "module_parameter"
        table = Table(f"t{i}", dtype, shape, access, first_dim=first_dim)
        table.ref = {"closure": f"t{i}", "default": f"t{i}", "global": f"G{i}", "object": f"holder.t{i}",
                     "module_buffer": f"module.t{i}", "module_parameter": f"module.t{i}",
                     "module_attribute": f"module.t{i}", "self_buffer": f"self.t{i}",
                     "self_attribute": f"self.t{i}"}[access]
        tables.append(table)
    return tables


def _mod_source(name: str, args: str, body: str, defaults: list[Table], method: bool) -> str:
    params = ("self, " if method else "") + args + "".join(f", {t.name}={t.name}" for t in defaults)
    return f"def {name}({params}):\n    return {body}\n"


def write_case(seed: int) -> Case:
    """The source of one case: ``build(<closure tables>, holder, module, method_self)`` in it returns
    (score_mod, mask_mod), plain functions or bound methods of its ``ModHolder`` module."""
    rng = random.Random(seed)
    shapes = _pick_shapes(rng)
    style = "method" if rng.random() < 0.25 else "function"
    tables = _pick_tables(rng, shapes, style)
    has_score, has_mask = rng.choice([(True, False), (False, True), (True, True)])
    score_expr = Grammar(rng, shapes, tables, with_score=True).score_result() if has_score else None
    score_body = score_expr.src if score_expr else None
    mask_body = Grammar(rng, shapes, tables, with_score=False).bool_expr(rng.randint(1, 3)).src if has_mask else None
    defaults = [t for t in tables if t.access == "default"]
    mods = []
    if score_body:
        mods.append(_mod_source("score_mod", "score, b, h, q_idx, kv_idx", score_body, defaults, style == "method"))
    if mask_body:
        mods.append(_mod_source("mask_mod", "b, h, q_idx, kv_idx", mask_body, defaults, style == "method"))
    closure_names = [t.name for t in tables if t.access in ("closure", "default")]
    lines = [f"# flexattn fuzz case, seed {seed}", "import torch", ""]
    if style == "method":
        lines += ["class ModHolder(torch.nn.Module):", textwrap.indent("\n".join(mods), "    "), ""]
    lines += [f"def build({', '.join(closure_names + ['holder', 'module', 'method_self'])}):"]
    if style == "method":
        score = "method_self.score_mod" if score_body else "None"
        mask = "method_self.mask_mod" if mask_body else "None"
    else:
        lines.append(textwrap.indent("\n".join(mods), "    "))
        score = "score_mod" if score_body else "None"
        mask = "mask_mod" if mask_body else "None"
    lines.append(f"    return {score}, {mask}")
    source = "\n".join(lines) + "\n"
    # A mask that reads b or h needs a BlockMask over every batch and head; others may broadcast.
    uses_bh = bool(mask_body and re.search(r"\b[bh]\b", mask_body))
    return Case(seed, shapes, tables, style, source, score_expr.bound if score_expr else 10.0, uses_bh)


def _assign(case: Case, table: Table, value: torch.Tensor, holder, module, method_self, tensors: dict) -> None:
    """Put ``value`` where the mod reads ``table`` from (a new binding, not an in-place update)."""
    tensors[table.name] = value
    if table.access == "global":
        case.namespace[f"G{table.name[1:]}"] = value
    elif table.access == "object":
        setattr(holder, table.name, value)
    elif table.access in ("module_buffer", "self_buffer"):
        owner = module if table.access == "module_buffer" else method_self
        if table.name in owner._buffers:
            setattr(owner, table.name, value)
        else:
            owner.register_buffer(table.name, value)
    elif table.access == "module_parameter":
        setattr(module, table.name, torch.nn.Parameter(value))
        tensors[table.name] = getattr(module, table.name)
    elif table.access in ("module_attribute", "self_attribute"):
        # A plain attribute (nn.Module.__setattr__ keeps a tensor that is no buffer in __dict__).
        setattr(module if table.access == "module_attribute" else method_self, table.name, value)


class Instance:
    """The live objects of a case: its tables where the mods read them, and the mods."""

    def __init__(self, case: Case, gen: torch.Generator):
        self.case = case
        self.holder = type("Holder", (), {})()
        self.module = torch.nn.Module()
        self.tensors: dict[str, torch.Tensor] = {}
        if not case.namespace:
            case.filename = f"<flexattn-fuzz-{case.seed}>"
            # Registered with linecache so tracebacks and flexattn's errors can show the mod's lines.
            linecache.cache[case.filename] = (len(case.source), None, case.source.splitlines(True), case.filename)
            exec(compile(case.source, case.filename, "exec"), case.namespace)
        self.method_self = case.namespace["ModHolder"]() if case.style == "method" else None
        for table in case.tables:
            _assign(case, table, table.values(gen).to(DEVICE), self.holder, self.module, self.method_self,
                    self.tensors)
        closure_args = [self.tensors[t.name] for t in case.tables if t.access in ("closure", "default")]
        self.score_mod, self.mask_mod = case.namespace["build"](*closure_args, self.holder, self.module,
                                                                self.method_self)

    def update(self, gen: torch.Generator, rng: random.Random) -> list[str]:
        """New contents for every table: in place, or (where the mod reads an attribute or a global)
        sometimes a new tensor bound in its place. Returns what was done, for the report."""
        done = []
        for table in self.case.tables:
            fresh = table.values(gen).to(DEVICE)
            rebindable = table.access not in ("closure", "default")
            if rebindable and rng.random() < 0.3:
                _assign(self.case, table, fresh, self.holder, self.module, self.method_self, self.tensors)
                done.append(f"{table.name} replaced")
            else:
                with torch.no_grad():
                    self.tensors[table.name].copy_(fresh)
                done.append(f"{table.name} updated in place")
        return done


def _wide_indices(mod, with_score: bool):
    """The oracle's view of a mod: int64 index arguments, so index arithmetic is exact."""
    if mod is None:
        return None
    if with_score:
        return lambda score, b, h, q_idx, kv_idx: mod(score, b.long(), h.long(), q_idx.long(), kv_idx.long())
    return lambda b, h, q_idx, kv_idx: mod(b.long(), h.long(), q_idx.long(), kv_idx.long())


def _describe(case: Case) -> str:
    s = case.shapes
    tables = ", ".join(f"{t.name}: {t.dtype}{list(t.shape)} via {t.access} ({t.ref})" for t in case.tables)
    return (f"seed {case.seed} (replay: FLEXATTN_FUZZ_SEED={case.seed} FLEXATTN_FUZZ_CASES=1 "
            f"python -m pytest -q tests/test_fuzz.py)\n"
            f"B={s.B} Hq={s.Hq} Hkv={s.Hkv} L={s.L} S={s.S} E={s.E} BLOCK_SIZE={s.block}; tables: {tables}\n"
            f"--- generated source ---\n{case.source}------------------------")


def run_case(seed: int) -> list[str]:
    """Runs one case through every backend in three rounds; returns the failures (empty: passed)."""
    case = write_case(seed)
    s = case.shapes
    rng = random.Random(seed ^ 0x5EED)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s.B, s.Hq, s.L, s.E, generator=gen).to(DEVICE)
    k = torch.randn(s.B, s.Hkv, s.S, s.E, generator=gen).to(DEVICE)
    v = torch.randn(s.B, s.Hkv, s.S, s.E, generator=gen).to(DEVICE)
    gqa = s.Hq != s.Hkv
    broadcast = not case.uses_batch_or_head and rng.random() < 0.5
    # Scores of magnitude M carry float32 rounding of about M * 6e-8 into the exponent.
    tolerance = TOLERANCE * max(1.0, case.score_bound / 10)
    failures = []
    instance = Instance(case, gen)
    for round_name in ("as built", "after updating the tables", "factory called again"):
        if round_name == "after updating the tables":
            round_name += f" ({', '.join(instance.update(gen, rng))})"
        elif round_name == "factory called again":
            instance = Instance(case, gen)
        try:
            ref_out, ref_lse, _ = reference_attention(
                q.double(), k.double(), v.double(), score_mod=_wide_indices(instance.score_mod, True),
                mask_mod=_wide_indices(instance.mask_mod, False), enable_gqa=gqa)
        except Exception as err:  # the generated mod itself is at fault: a grammar bug
            raise AssertionError(f"the oracle failed on a generated mod: {err!r}\n{_describe(case)}") from err
        block_mask = None
        if instance.mask_mod is not None:
            B, H = (None, None) if broadcast else (s.B, s.Hq)
            block_mask = create_block_mask(instance.mask_mod, B, H, s.L, s.S, device=DEVICE, BLOCK_SIZE=s.block)
        for backend in BACKENDS:
            try:
                out, aux = flex_attention(q, k, v, score_mod=instance.score_mod, block_mask=block_mask,
                                          enable_gqa=gqa, kernel_options={"BACKEND": backend},
                                          return_aux=AuxRequest(lse=True))
                errors = (rel_err(out.detach(), ref_out), rel_err(aux.lse.detach(), ref_lse))
            except Exception as err:
                failures.append(f"{round_name}, {backend}: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
                continue
            if not max(errors) < tolerance:
                failures.append(f"{round_name}, {backend}: relative error out {errors[0]:.2e}, lse {errors[1]:.2e}")
        del block_mask
        gc.collect()
    if failures:
        failures.append(_describe(case))
    return failures


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_fuzz_case(case, one_thread, collect_new_objects_only):
    seed = BASE_SEED + case
    failures = run_case(seed)
    assert not failures, "\n".join(failures)
