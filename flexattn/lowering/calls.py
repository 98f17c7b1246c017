"""One op of the walk over a mod's graph: a ``call_function`` node lowered through its entry in
ops.LOWERINGS (elementwise on values or element by element on small tensors, casts, constants,
reductions), with torch's dtype rules and constant folding. Methods of the walk (emit.py's emitter),
kept here as a mixin."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.fx

from .index import ATOM, MUL
from .ops import (
    BOOL, COMMON, KEEP, LOWERINGS, RESULT, TL_DTYPES, WHERE, Lowering, Operand, literal, lookup, precedence_of,
)
from .values import (
    INDEX_FIRST, INDEX_INTS, INTS, LOGIC_AND_CMP, VECTOR_LIMIT, Gather, Val, Vec, constant, flat_nodes, kernel_dtype,
    numel, paren, weak_number,
)

__all__ = ["CallLowering"]

aten = torch.ops.aten

# What a reduction combines its elements with.
_REDUCE_JOIN = {"sum": aten.add, "mean": aten.add, "prod": aten.mul, "any": aten.bitwise_or,
                "all": aten.bitwise_and, "max": aten.maximum, "min": aten.minimum, "dot": aten.add}  # fmt: skip


class CallLowering:
    """The walk's lowering of one op node (see the module's docstring)."""

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
            if isinstance(v, Vec) and numel(v.shape) == 1:
                return v.items[0]
            return v
        if isinstance(arg, (bool, int, float)):
            return weak_number(arg)
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
            const = constant(value, out.dtype)
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
        n = numel(shape)
        if n == 1:
            return const
        if n > VECTOR_LIMIT:
            raise self.unsupported(node, f"a tensor of shape {shape} built inside the mod",
                                   INDEX_FIRST + " Build other tensors outside the mod and capture them.")  # fmt: skip
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
            if not v.weak and v.dtype in INTS:
                dtype = torch.promote_types(dtype, v.dtype)
        if self.variant.is_wide(node.name) and dtype in INDEX_INTS:
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
        n = numel(shape)
        if n > VECTOR_LIMIT:
            raise self.unsupported(node, f"a tensor of shape {shape}", INDEX_FIRST)

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

        if rule.sym is not None and out in INDEX_INTS and all(v.dtype in INTS for v in vals):
            expr = rule.sym(*(self.to_sym(a, out) if isinstance(a, Val) else a for a in args),
                            **{k: self.to_sym(v, out) if isinstance(v, Val) else v for k, v in kwargs.items()})  # fmt: skip
            if expr is not None:
                return self.sym_val(expr, out)

        targets = self.input_dtypes(rule.inputs, node, out, args)
        numbers = [isinstance(a, Val) and a.weak and a.value is None for a in args]  # before coerce drops weak
        args = [self.coerce(a, t) if isinstance(a, Val) and t is not None else a for a, t in zip(args, targets)]
        kwargs = {k: self.coerce(v, targets[-1]) if isinstance(v, Val) and targets[-1] is not None else v
                  for k, v in kwargs.items()}  # fmt: skip
        if rule.reuses:
            args = [self.named(a) if isinstance(a, Val) else a for a in args]

        operands = [self.operand(a, i, rule, number) for i, (a, number) in enumerate(zip(args, numbers))]
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
        groups = positions.reshape(numel([source.shape[d] for d in kept]), -1).tolist()
        dtype = kernel_dtype(out.dtype)
        join = LOWERINGS[_REDUCE_JOIN[how]]
        if how in ("max", "min"):
            join = Lowering(lambda a, b, f=join.fn: f(a, b), ATOM)
        results = []
        for group in groups:
            items = [self.coerce(source.items[i], dtype) for i in group]
            acc = self.combine(join, items, dtype)
            if how == "mean":
                acc = Val(f"{paren(acc, MUL)} / {literal(float(len(group)))[0]}", dtype, MUL)
            results.append(acc)
        shape = tuple(out.shape)
        return results[0] if numel(shape) == 1 else Vec(tuple(results), shape)

    def as_vec(self, arg, node: torch.fx.Node) -> Vec:
        v = self.value_of(arg, node)
        return v if isinstance(v, Vec) else Vec((v,), ())

    def operand(self, a, position: int, rule: Lowering, number: bool = False):
        if not isinstance(a, Val):
            return a
        if rule.prec is None:  # user entries: every operand an atom
            text = paren(a, ATOM)
        elif rule.prec >= ATOM:  # arguments of a call
            text = a.text
        else:
            need = rule.prec if position in rule.left else rule.prec + 1
            if rule.prec in LOGIC_AND_CMP and a.prec in LOGIC_AND_CMP:
                need = max(need, rule.prec if a.prec == rule.prec and position in rule.left else ATOM)
            text = paren(a, need)
        return Operand(text, a.text, a.prec, a.dtype, a.value, number)

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
            if self.variant.is_wide(node.name) and dtype in INDEX_INTS:
                dtype = torch.int64
            return [dtype] * n
        assert policy == KEEP, policy
        return [None] * n

    def fold(self, node: torch.fx.Node, args, kwargs, out: torch.dtype) -> Optional[Val]:
        """Evaluate an op whose operands are all constants, with torch itself."""

        def real(arg, v):
            if isinstance(v, Val) and not v.weak:
                dtype = arg.meta["val"].dtype if isinstance(arg, torch.fx.Node) else v.dtype
                if out == torch.int64 and dtype in INTS:
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
        return constant(result.item(), out)

    def fold_unknown(self, node: torch.fx.Node):
        """An op without a table entry whose inputs are all constants (torch.arange(4)): its value."""
        if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            return None
        inputs = flat_nodes((node.args, node.kwargs))
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
        items = tuple(constant(x, result.dtype) for x in result.reshape(-1).tolist())
        return items[0] if result.numel() == 1 else Vec(items, tuple(result.shape))

