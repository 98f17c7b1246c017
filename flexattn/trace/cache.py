"""``trace_mod``: a mod's traced graph and the values of its inputs for this call, through three
caches (see [Note] Cache keys in reads.py): the content key of its reads, the graph's text, and
the warm-call table that answers a repeated callable without searching its reads again."""

from __future__ import annotations

import types
import warnings
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from .numbers import SIZE_QUERIES, NumberTrace, TracedNumber, sizes_of, substituted, value_at
from .reads import (
    ANCHOR, ATTR, CELL, INDEX, ITEM, MISSING, Reads, alias_pattern, code_of, find_reads, read, tensor_meta,
)
from ..errors import describe_mod
from .record import trace
from .traced import ARGS_OF_KIND, NUMBER_INT_LIMIT, TracedMod, counts

__all__ = ["trace_mod", "with_stand_ins", "with_values"]

# The caches (see [Note] Cache keys). _CACHE: (kind, the reads' signature) -> the TracedMods traced
# for it, one per set of values of its specialized numbers. _GRAPHS: the graph's content -> its one
# TracedMod, so a mod traced again (on every call, when the search cannot see all it reads) keeps one
# TracedMod, and the kernels built for it. _FAST: the warm-call table, callable (held weakly) ->
# {(kind, method's function): _FastEntry}.
_CACHE: "OrderedDict[tuple, list]" = OrderedDict()
_GRAPHS: "OrderedDict[tuple, TracedMod]" = OrderedDict()
_FAST: "OrderedDict[weakref.ref, dict]" = OrderedDict()
_CACHE_SIZE = 512
_FAST_SIZE = 512
_SPECIALIZED_KEPT = 16  # traces of one reads key for other values of its specialized numbers

def _same_number(a: Any, b: Any) -> bool:
    """One value for a specialized number: same type, and floats by repr (0.0 and -0.0 differ, a
    NaN equals itself)."""
    if type(a) is not type(b):
        return False
    return repr(a) == repr(b) if type(a) is float else a == b


def _holds(traced: TracedMod, leaves: tuple) -> bool:
    """The trace is right for these values of the numbers it reads: its specialized ones have the
    values it was traced at."""
    return all(_same_number(leaves[i], value) for i, _, value in traced.specialized)


def _fits(traced: TracedMod, values: list) -> bool:
    """Every number has the type it was traced with, and every int is within NUMBER_INT_LIMIT (the
    lowering's decisions assume it, see traced.py); a larger value is traced as a constant instead."""
    start = len(traced.captured)
    for number, value in zip(traced.numbers, values[start:]):
        if type(value) is not number.kind or (number.kind is int and not -NUMBER_INT_LIMIT <= value <= NUMBER_INT_LIMIT):
            return False
    return True


def trace_mod(fn: Callable, kind: str) -> tuple[TracedMod, list]:
    """The traced graph of ``fn`` and the values of its captured inputs for this call: its tensors,
    then its numbers (TracedMod.captured_values).

    ``kind`` is "score_mod" or "mask_mod" (taken from the keyword the user passed it under, never
    from the callable's arity).
    """
    if kind not in ARGS_OF_KIND:
        raise ValueError(f"kind must be 'score_mod' or 'mask_mod', got {kind!r}")
    if not callable(fn):
        raise TypeError(f"{kind} must be callable, got {type(fn).__name__}")
    hit = _fast_lookup(fn, kind)
    if hit is not None:
        return hit
    reads = find_reads(fn)
    leaves = reads.leaf_values()
    key = None if reads.opaque else (kind, tuple(reads.signature))
    for traced in _CACHE.get(key, ()) if key is not None else ():
        if _holds(traced, leaves):
            values = traced.captured_values(reads.tensors, leaves)
            if _fits(traced, values):
                _CACHE.move_to_end(key)
                _remember(fn, kind, reads, traced)
                return traced, values
    numbers = (reads.locations, reads.leaves, leaves, reads.leaf_names)
    traced, untracked = trace(fn, kind, reads.tensors, reads.tensor_names, numbers)
    values = traced.captured_values(reads.tensors + untracked, leaves)
    if not _fits(traced, values):  # an int too large for the kernels' int32: a constant of the graph
        traced, untracked = trace(fn, kind, reads.tensors, reads.tensor_names, None)
        traced = _specialized_all(traced, reads.leaf_types, leaves)
        values = traced.captured_values(reads.tensors + untracked, leaves)
    counts.traces += 1
    traced = _one_per_graph(traced)
    if key is not None and not untracked:
        _store(key, traced)
        _remember(fn, kind, reads, traced)
    else:
        what = reads.opaque or "a tensor by a path the search does not follow (a function attribute, a C object)"
        warnings.warn(
            f"{describe_mod(fn, kind)} reads {what}: flexattn cannot tell when it changes, so the mod is "
            "traced again on every call (slow, still correct). Keep what the mod reads in closure variables, "
            "globals, default arguments, or attributes of plain objects, modules or nn.Modules.",
            stacklevel=3,
        )
    return traced, values


@contextmanager
def with_stand_ins(fn: Callable):
    """For the block, the Python numbers ``fn`` reads replaced by stand-ins (TracedNumber) where its
    traces see them, with the same leaf numbers as trace_mod's TracedMod, so code that runs the mod
    meanwhile (compile/probe.py's probe) can tell which numbers it passes are which graph inputs. What the
    stand-ins are asked in Python is answered with their values and recorded nowhere. Yields
    ``sizes(func, args)``: for a size query of a tensor the search found (``t.shape``), its sizes as
    stand-ins, as tracing gives them; None for anything else."""
    reads = find_reads(fn)
    trace = NumberTrace(reads.leaf_types)
    stand_ins = [TracedNumber(("leaf", i), v, trace) for i, v in enumerate(reads.leaf_values())]

    def sizes(func, args):
        if func not in SIZE_QUERIES or not args:
            return None
        position = next((i for i, t in enumerate(reads.tensors) if t is args[0]), None)
        return None if position is None else sizes_of(func, args, position, trace)

    try:
        with substituted(reads.locations, list(zip(reads.leaves, stand_ins))):
            yield sizes
    finally:
        trace.active = False


@contextmanager
def with_values(fn: Callable, tensors: dict, leaves: dict):
    """For the block, ``fn`` reading other tensors and numbers where it read its own: ``tensors``
    maps a captured tensor's position among the tensors found (CapturedInput.walk_index) to the
    tensor to read there, ``leaves`` a number's leaf to its value. What a trace of ``fn`` then makes
    is the trace of a mod of the same code reading those (compile/registry.py: the op of a compiled graph
    reused for another closure of the same code)."""
    reads = find_reads(fn)
    first: dict = {}
    for position, tensor in enumerate(reads.tensors):
        first.setdefault(id(tensor), position)
    writes = []
    for position, (tensor, site) in enumerate(zip(reads.tensors, reads.tensor_sites)):
        new = tensors.get(first[id(tensor)])
        if new is not None and new is not tensor:
            if site is None:
                raise ValueError(f"cannot replace the tensor '{reads.tensor_names[position]}' where the mod reads it")
            writes.append((site, new))
    writes += [(reads.leaves[leaf], value) for leaf, value in leaves.items() if leaf < len(reads.leaves)]
    with substituted(reads.locations, writes):
        yield


def _specialized_all(traced: TracedMod, types_: list, leaves: tuple) -> TracedMod:
    """A trace made with every number a constant, marked as holding only for these values."""
    return replace(traced, specialized=tuple((i, t, v) for i, (t, v) in enumerate(zip(types_, leaves))))


def _store(key: tuple, traced: TracedMod) -> None:
    entries = _CACHE.get(key)
    if entries is None:
        entries = _CACHE[key] = []
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    if traced not in entries:
        entries.insert(0, traced)
        del entries[_SPECIALIZED_KEPT:]


def _one_per_graph(traced: TracedMod) -> TracedMod:
    """The TracedMod already made for this very graph, or this one."""
    fixed = tuple(
        None if c.fixed_value is None else (c.fixed_value.dtype, c.fixed_value.cpu().flatten().tolist())
        for c in traced.captured
    )
    spec = tuple((c.name, c.shape, c.dtype, c.requires_grad, c.walk_index) for c in traced.captured)
    numbers = tuple((n.name, n.kind, n.expr) for n in traced.numbers)
    specialized = tuple((i, t, repr(v)) for i, t, v in traced.specialized)
    # Where the mod is defined too: errors from later stages name its lines (lowering/sites.py).
    code = code_of(traced.fn)
    where = (code.co_filename, code.co_firstlineno) if code is not None else type(traced.fn)
    key = (traced.kind, traced.name, where, traced.signature_text(), spec, fixed, numbers, specialized)
    try:
        existing = _GRAPHS.get(key)
    except TypeError:  # an unhashable constant: keep this one
        return traced
    if existing is not None:
        _GRAPHS.move_to_end(key)
        return existing
    _GRAPHS[key] = traced
    if len(_GRAPHS) > _CACHE_SIZE:
        _GRAPHS.popitem(last=False)
    return traced


# -- the warm-call table ---------------------------------------------------------------------------

_LEAFY = -2  # a read whose value is or holds numbers the graph takes (its position field)


class _FastEntry:
    """What one search of a callable read, to answer its next call without searching (see _fast_lookup).
    ``leaf_reads``: per read that found numbers, ``(type of the value found, ((path, type), ...))``;
    ``leaves``: the search's ``(read, path)`` per leaf."""

    __slots__ = ("reads", "tensors", "meta", "aliases", "traced", "leaf_reads", "leaves", "found_are_values")

    def __init__(self, reads, tensors, meta, aliases, traced, leaf_reads, leaves):
        self.reads, self.tensors, self.meta, self.aliases, self.traced = reads, tensors, meta, aliases, traced
        self.leaf_reads, self.leaves = leaf_reads, leaves
        # The graph's captured values are the tensors found, in their order (no constants of the
        # mod's own, no numbers): what TracedMod.captured_values would build, without building it.
        self.found_are_values = not traced.numbers and [c.walk_index for c in traced.captured] == list(
            range(len(tensors)))


def _fast_anchor(fn: Callable) -> tuple[Any, Any]:
    """The object a warm-call entry hangs on and the sub-key under it: a bound method is a new object
    at every attribute access, so its entry hangs on its object, under its function. Only objects
    compared and hashed by identity qualify (an __eq__ could make two objects one key)."""
    cls = type(fn)
    if cls is types.FunctionType:
        return fn, None
    if cls is types.MethodType:
        fn, func = fn.__self__, fn.__func__
        cls = type(fn)
    else:
        func = None
    if cls.__hash__ is object.__hash__ and cls.__eq__ is object.__eq__:
        return fn, func
    return None, None


def _forget(ref: weakref.ref) -> None:
    _FAST.pop(ref, None)  # the callable died: its entries go with it


def _remember(fn: Callable, kind: str, reads: Reads, traced: TracedMod) -> None:
    anchor, func = _fast_anchor(fn)
    if anchor is None:
        return
    try:
        ref = weakref.ref(anchor, _forget)
    except TypeError:  # no weak references to it: no warm path
        return
    leaf_reads: dict[int, tuple] = {}
    for (read_at, path), kind_ in zip(reads.leaves, reads.leaf_types):
        value = reads.locations[read_at][3]
        paths = leaf_reads.get(read_at, (type(value), ()))[1]
        leaf_reads[read_at] = (type(value), paths + ((path, kind_),))
    locations = tuple(
        (kind_, ANCHOR if container is anchor else container, key, value, _LEAFY if i in leaf_reads else position)
        for i, (kind_, container, key, value, position) in enumerate(reads.locations)
    )
    tensors = tuple(reads.tensors)
    aliases = alias_pattern(tensors) if len(tensors) > 1 else None
    entry = _FastEntry(locations, tensors, tuple(tensor_meta(t) for t in tensors), aliases, traced, leaf_reads,
                       tuple(reads.leaves))
    entries = _FAST.get(ref)
    if entries is None:
        entries = _FAST[ref] = {}
        if len(_FAST) > _FAST_SIZE:
            _FAST.popitem(last=False)
    entries[(kind, func)] = entry


def _same_shape(expected: Any, now: Any, slots: tuple) -> bool:
    """``now`` may stand where the search found ``expected``: a number of the same type, or a tuple of
    the same type whose numbers at ``slots`` have their types and whose other items are the same
    objects."""
    kind, paths = slots
    if type(now) is not kind:
        return False
    if not paths or paths[0][0] == ():
        return True
    if len(now) != len(expected):
        return False
    leaf_paths = {path for path, _ in paths}
    for path, leaf_type in paths:
        if type(value_at(now, path)) is not leaf_type:
            return False
    return _same_besides(expected, now, leaf_paths, ())


def _same_besides(expected: Any, now: Any, leaf_paths: set, at: tuple) -> bool:
    if at in leaf_paths:
        return True
    if not any(p[: len(at)] == at and len(p) > len(at) for p in leaf_paths):
        return now is expected
    items_e = (expected.start, expected.stop, expected.step) if type(expected) is slice else expected
    items_n = (now.start, now.stop, now.step) if type(now) is slice else now
    if type(expected) is not type(now) or len(items_e) != len(items_n):
        return False
    return all(_same_besides(e, n, leaf_paths, at + (i,)) for i, (e, n) in enumerate(zip(items_e, items_n)))


def _fast_lookup(fn: Callable, kind: str):
    """The cached trace of this very callable, if nothing its reads hold has changed since but the
    values of the numbers the graph takes.

    Re-reads every location the search read (cells, globals, defaults, attributes, container items and
    lengths): plain values must be the same objects; numbers the graph takes may be other numbers of
    the same type (its specialized ones the same value); tensors may be other objects, with the same
    dtype, shape, device and requires_grad (checked again for every tensor: in-place resizes count)
    and the same pattern of which ones are one object.
    """
    # _fast_anchor's answer for a plain function (most mods), without the call.
    anchor, func = (fn, None) if type(fn) is types.FunctionType else _fast_anchor(fn)
    if anchor is None:
        return None
    try:
        ref = weakref.ref(anchor)
    except TypeError:
        return None
    entries = _FAST.get(ref)
    entry = entries.get((kind, func)) if entries is not None else None
    if entry is None:
        return None
    tensors = list(entry.tensors)
    found: Optional[dict] = None  # values now of reads that hold numbers, where they changed
    for i, (read_kind, container, key, expected, position) in enumerate(entry.reads):
        if container is ANCHOR:
            container = anchor
        # read, inlined: this loop is most of a warm call's cost.
        if read_kind == CELL:
            try:
                now = container.cell_contents
            except ValueError:
                now = MISSING
        elif read_kind == ATTR:
            now = getattr(container, key, MISSING)
        elif read_kind == ITEM:
            now = container.get(key, MISSING)
        elif read_kind == INDEX:
            now = container[key]
        else:  # LEN, SET: compared by value
            if read(read_kind, container, key) != expected:
                return None
            continue
        if now is not expected:
            if position == _LEAFY:
                if not _same_shape(expected, now, entry.leaf_reads[i]):
                    return None
                if found is None:
                    found = {}
                found[i] = now
                continue
            if position < 0 or not isinstance(now, torch.Tensor):
                return None
            tensors[position] = now
    for tensor, meta in zip(tensors, entry.meta):
        if (tensor.dtype, tensor.shape, tensor.requires_grad, tensor.device) != meta:
            return None
    if entry.aliases is not None and alias_pattern(tensors) != entry.aliases:
        return None
    traced = entry.traced
    if entry.leaves:
        reads = entry.reads
        leaves = tuple(value_at(found[r] if found is not None and r in found else reads[r][3], path)
                       for r, path in entry.leaves)
        if traced.specialized and not _holds(traced, leaves):
            return None
    else:
        leaves = ()
    values = tensors if entry.found_are_values else traced.captured_values(tensors, leaves)
    if traced.numbers and not _fits(traced, values):
        return None
    _FAST.move_to_end(ref)
    return traced, values

