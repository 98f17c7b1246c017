"""Reads of captured tensors in the walk over a mod's graph: an index becomes a sympy offset term
(wrapped and checked as the bounds analysis decided), a fully indexed ``Gather`` one ``tl.load``,
and views (slices, transposes, reshapes by size-1 dimensions) new offsets and strides. Methods of
the walk (emit.py's emitter), kept here as a mixin."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx

from .index import ADD, ATOM, BAND, CMP, print_index, sympy
from .ops import literal
from .values import INDEX_FIRST, INDEX_INTS, INTS, VECTOR_LIMIT, Gather, Val, Vec, View, numel, paren

__all__ = ["GatherLowering"]

aten = torch.ops.aten


class GatherLowering:
    """The walk's reads of captured tensors and their views (see the module's docstring)."""

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
            raise self.unsupported(node, "an index with more than one element", INDEX_FIRST)
        if v.dtype not in INTS:
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
        if v.dtype not in INDEX_INTS:  # an int8 index plus the size would wrap in int8
            v = self.coerce(v, torch.int32)
        v = self.named(v)
        key = (v.text, view.size, check)
        size = literal(view.size)[0]
        if key not in self.guarded:  # intervals[doc[q], 0] and intervals[doc[q], 1] guard doc[q] once
            inside = None
            if check.wrap:  # torch reads rel[-1] as the last element
                v = Val(f"tl.where({paren(v, CMP + 1)} < 0, {paren(v, ADD)} + {size}, {v.text})", v.dtype)
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
        n = numel(shape)
        if n > VECTOR_LIMIT:
            raise self.unsupported(
                node, f"a captured tensor used with dimensions of size {shape} not indexed",
                f"{INDEX_FIRST} (Reading up to {VECTOR_LIMIT} elements, e.g. for torch.dot of two table "
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
            if numel(out_shape) == 1:
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
        if numel(out_shape) == 1:
            return items[0]
        if len(set(moved)) < len(moved):  # an element written more than once (expand): name it
            items = tuple(self.named(v) for v in items)
        return Vec(items, out_shape)

