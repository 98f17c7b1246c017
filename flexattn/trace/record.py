"""Recording a mod: run it once on 0-d tensors under a dispatch mode that writes every aten op it
reaches into an fx graph (the graph's inputs: the mod's arguments, then the tensors and the Python
numbers it reads). Also the torch-function modes that evaluate mods with torch elsewhere
(GetItemToIndex, GathersReadZero) and the errors a mod that cannot be traced gets.
"""

from __future__ import annotations

import inspect
import operator
import os
import traceback
from typing import Any, Callable, Optional

import torch
import torch.fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import InvalidInputError, ModTraceError, describe_mod
from .numbers import (
    NUMBER_TYPES, SIZE_QUERIES, NumberTrace, TracedNumber, data_positions, leaves_of, sizes_of, substituted,
)
from .traced import ARGS_OF_KIND, INDEX_DTYPE, SCORE_DTYPE, SCORE_MOD_ARGS, CapturedInput, CapturedNumber, TracedMod

__all__ = ["GetItemToIndex", "GathersReadZero", "gather_or_zero", "trace"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_PACKAGE = os.path.dirname(os.path.abspath(__file__))


class GetItemToIndex(TorchFunctionMode):
    """Turn ``tensor[idx]`` with tensor indices into ``aten.index``.

    Plain ``__getitem__`` with a 0-d integer tensor would call ``__index__`` on it (a data-dependent
    read); ``aten.index`` keeps it a gather, which tiles, vmaps and lowers to a load. Tracing uses
    this mode; code that evaluates mods with torch uses GathersReadZero.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            tensor, index = args
            items = index if isinstance(index, tuple) else (index,)
            if any(isinstance(i, torch.Tensor) for i in items):
                if not all(isinstance(i, (torch.Tensor, int)) and not isinstance(i, bool) for i in items):
                    raise ModTraceError(
                        "indexing a captured tensor with a mix of tensors and slices/None/Ellipsis is not "
                        f"supported (got index {index!r}); index every leading dimension with an integer "
                        "or an index tensor, e.g. bias[h, q_idx - kv_idx]"
                    )
                for dim, (i, size) in enumerate(zip(items, tensor.shape)):
                    # A constant is out of range at every position: a bug, which torch reports too.
                    if not isinstance(i, torch.Tensor) and not -size <= i < size:
                        raise IndexError(f"index {i} is out of bounds for dimension {dim} with size {size}")
                items = [i if isinstance(i, torch.Tensor) else torch.tensor(i, dtype=INDEX_DTYPE) for i in items]
                return self.gather(tensor, items)
        return func(*args, **(kwargs or {}))

    def gather(self, tensor: torch.Tensor, indices: list) -> torch.Tensor:
        return torch.ops.aten.index.Tensor(tensor, indices)


_POSITION_DTYPES = (torch.int32, torch.int64)  # what aten.index takes as positions (bool and uint8 are masks)


def gather_or_zero(tensor: torch.Tensor, indices: list) -> torch.Tensor:
    """``aten.index(tensor, indices)`` where a position outside ``[-n, n)`` of its dimension reads 0.

    The rule of every backend (the kernels' guarded loads in lowering/gathers.py do the same): negative
    indices down to ``-n`` wrap as in torch, anything further out reads 0 (False for a bool tensor)
    instead of raising. An out-of-range position reads at the nearest end, and that value is replaced
    by 0, so its gradient is 0: an out-of-range read adds nothing to a learnable tensor's gradient. Works on
    vmapped and on plain tensors. Indices that are not positions (bool masks) keep torch's meaning.
    """
    if (not indices or len(indices) > tensor.dim()  # aten.index reports too many indices its own way
            or any(i is None or i.dtype not in _POSITION_DTYPES for i in indices)):
        return torch.ops.aten.index.Tensor(tensor, indices)
    inside, safe = None, []
    for dim, index in enumerate(indices):
        size = tensor.shape[dim]
        clamped = index.clamp(-size, size - 1)  # in range: read there, then zeroed where it moved
        ok = clamped == index
        safe.append(clamped)
        inside = ok if inside is None else inside & ok
    out = torch.ops.aten.index.Tensor(tensor, safe)
    # inside has the indices' broadcast shape, which leads the result's; the dims not indexed follow.
    inside = inside.reshape(inside.shape + (1,) * (out.dim() - inside.dim()))
    return out & inside if out.dtype == torch.bool else torch.where(inside, out, 0)


class GathersReadZero(GetItemToIndex):
    """GetItemToIndex for evaluating mods with torch (the PyTorch backend, the float64 reference,
    the BlockMask builder, pictures): every gather, ``tensor[idx]`` in a callable or ``aten.index``
    in a traced graph, follows gather_or_zero, so an index out of range reads 0 as in the kernels."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.index.Tensor:
            return gather_or_zero(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)

    def gather(self, tensor: torch.Tensor, indices: list) -> torch.Tensor:
        return gather_or_zero(tensor, indices)


def _example_args(kind: str) -> list[torch.Tensor]:
    # Distinct tensors: the recorder tracks inputs by identity, so shared objects would merge them.
    # q_idx = kv_idx = 1: no integer division by zero, and gathers at small in-range indices.
    indices = [torch.tensor(v, dtype=INDEX_DTYPE) for v in (0, 0, 1, 1)]
    if kind == "score_mod":
        return [torch.tensor(0.5, dtype=SCORE_DTYPE)] + indices
    return indices


def _user_frame(frames) -> Optional[traceback.FrameSummary]:
    """The innermost frame that is neither torch nor this module: the line of the user's mod."""
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH_DIR) or os.path.dirname(path) == _THIS_PACKAGE or frame.filename.startswith("<frozen"):
            continue
        return frame
    return None


def _where(frame: Optional[traceback.FrameSummary]) -> str:
    if frame is None:
        return "at an unknown line"
    line = (frame.line or "").strip()
    return f"at {frame.filename}:{frame.lineno} (in {frame.name}): {line}"


_DATA_DEPENDENT_HINT = (
    "The mod uses the value of a tensor in Python (an if/while/and/or on a tensor, int(), float(), "
    ".item() or .tolist()). Mods run on whole tiles at once, so keep values as tensors: write "
    "torch.where(cond, a, b) instead of `a if cond else b`, `&`/`|` instead of and/or, and index "
    "captured tensors directly with the index tensors (bias[h, q_idx - kv_idx])."
)


def _trace_error(fn: Callable, kind: str, err: BaseException) -> ModTraceError:
    frame = _user_frame(traceback.extract_tb(err.__traceback__))
    name = type(err).__name__
    data_dependent = isinstance(err, _DataDependentRead) or "meta tensors" in str(err)
    hint = _DATA_DEPENDENT_HINT if data_dependent else f"{name}: {str(err).splitlines()[0] if str(err) else ''}"
    return ModTraceError(f"Cannot trace {describe_mod(fn, kind)}\n  {_where(frame)}\n  {hint}")


def _check_output(gm: torch.fx.GraphModule, fn: Callable, kind: str) -> None:
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    result = out.args[0]
    val = result.meta.get("val") if isinstance(result, torch.fx.Node) else result
    if not isinstance(val, torch.Tensor):
        expected = "a bool tensor such as `q_idx >= kv_idx`" if kind == "mask_mod" else "a float tensor"
        raise ModTraceError(
            f"{describe_mod(fn, kind)} must return {expected} computed from its arguments, "
            f"got {type(val).__name__} ({val!r})"
        )
    if val.dim() != 0:
        raise ModTraceError(
            f"{describe_mod(fn, kind)} must return one value per (query, key) pair (a 0-d tensor), "
            f"got shape {tuple(val.shape)}; index every dimension of the captured tensors it reads"
        )
    if kind == "mask_mod" and val.dtype != torch.bool:
        raise ModTraceError(
            f"{describe_mod(fn, kind)} must return a bool tensor, got {val.dtype}; "
            "compare instead, e.g. `(q_idx - kv_idx) >= 0`"
        )
    if kind == "score_mod" and not val.dtype.is_floating_point:
        raise ModTraceError(
            f"{describe_mod(fn, kind)} must return a floating-point score, got {val.dtype}; "
            "did you pass a mask_mod as score_mod? (a mask_mod goes into create_block_mask)"
        )


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    try:
        return (
            a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset()
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.dtype == b.dtype
        )
    except (RuntimeError, NotImplementedError):
        return False


def _unique_name(name: str, taken: set[str]) -> str:
    base = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name) or "buf"
    if base[0].isdigit():
        base = "t_" + base
    candidate, k = base, 1
    while candidate in taken or candidate in SCORE_MOD_ARGS:
        candidate, k = f"{base}_{k}", k + 1
    return candidate


class _DataDependentRead(RuntimeError):
    """The mod asked for a tensor's value (``.item()``, ``bool()``, ``int()``) while tracing."""


# Ops that read a tensor's value into Python: tracing cannot know it.
_VALUE_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}
# torch.tensor(...) inside a mod: the op's input is a constant the mod builds, frozen in the graph.
_LIFT_FRESH = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


class _GraphRecorder(TorchDispatchMode):
    """Runs the mod once on 0-d tensors and records every aten op it reaches into an fx graph.

    A tensor reaching an op that the recorder has not produced itself is one the mod reads (found by
    the search of its reads, or by a path the search does not follow: ``untracked``) or builds
    (``torch.tensor(2.0)``, a fixed constant): it becomes a placeholder after the mod's own
    arguments. Reads of a tensor's value into Python raise at once. A stand-in for a Python number
    (numbers.py) that _NumbersMode says this op receives becomes a placeholder after the tensors'
    (``numbers``).

    The first attempt runs on real CPU tensors: each op costs microseconds. Some mods cannot run
    on example values (a gather whose index is out of range at q_idx = kv_idx = 1), so the second
    attempt runs on meta tensors, which carry no values; their Python meta kernels import Dynamo,
    over a second on the first use, which is why meta is not the first choice.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Recent torch wraps every mode's __torch_dispatch__ in a Dynamo guard, importing Dynamo on
        # first use. Tracing never runs under torch.compile, so opt out.
        return False

    def __init__(self, found: list[torch.Tensor], found_names: list[str], leaf_names: list[str], on_meta: bool):
        super().__init__()
        self.graph = torch.fx.Graph()
        self.captured: list[CapturedInput] = []
        self.numbers: list[CapturedNumber] = []
        self._found, self._found_names, self._leaf_names, self._on_meta = found, found_names, leaf_names, on_meta
        self._node_of: dict[int, torch.fx.Node] = {}
        self._captured_by_key: dict = {}
        self._number_nodes: dict[tuple, torch.fx.Node] = {}
        self.untracked: list[torch.Tensor] = []  # tensors found while tracing, not by the search
        self._alive: list[torch.Tensor] = []  # keeps every traced tensor alive, so ids stay unique
        self._last_placeholder: Optional[torch.fx.Node] = None  # the last argument or captured tensor
        self._last_number: Optional[torch.fx.Node] = None
        self.expected: list[TracedNumber] = []  # stand-ins the torch call being run passes as numbers
        self.received: set[int] = set()  # ids of those an op took

    def add_argument(self, name: str, example: torch.Tensor) -> None:
        node = self.graph.placeholder(name)
        self._record(example, node)
        self._last_placeholder = node

    def _record(self, tensor: torch.Tensor, node: torch.fx.Node) -> None:
        node.meta["val"] = tensor
        self._node_of[id(tensor)] = node
        self._alive.append(tensor)

    def _taken_names(self) -> set[str]:
        return {c.name for c in self.captured} | {n.name for n in self.numbers}

    def _source_of(self, tensor: torch.Tensor, constant: bool) -> Optional[int]:
        """The position of ``tensor`` among the tensors found (then the untracked ones), None for
        a constant the mod builds itself."""
        live = self._found + self.untracked
        position = next((i for i, t in enumerate(live) if t is tensor), None)
        if position is None:  # the same tensor under another Python object (``.data``)
            position = next((i for i, t in enumerate(self._found) if _same_tensor(t, tensor)), None)
        if position is None and not constant:
            # The mod reached it by a path the search does not follow: an input of this call only.
            position = len(live)
            self.untracked.append(tensor)
        return position

    def _capture(self, tensor: torch.Tensor, constant: bool = False) -> torch.fx.Node:
        position = self._source_of(tensor, constant)
        key = position if position is not None else id(tensor)
        node = self._captured_by_key.get(key)
        if node is None:
            if position is None:
                base = f"const{len(self.captured)}"
            elif position < len(self._found):
                base = self._found_names[position]
            else:
                base = "untracked"
            name = _unique_name(base, self._taken_names())
            with self.graph.inserting_after(self._last_placeholder):  # before the numbers
                node = self.graph.placeholder(name)
            value = tensor.detach()
            if self._on_meta:
                value = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
            elif value.device.type != "cpu":
                # An op on a GPU tensor reports a bad index (the example q_idx = 1 into a table of
                # one row) by a device-side assert, which ruins the process's CUDA context and no
                # exception reaches us. Trace on a CPU stand-in of the same shape and dtype instead:
                # zeros, expanded so it costs no memory, where a bad example index fails at once
                # and the meta attempt takes over.
                value = torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)
            node.meta["val"] = value
            self._last_placeholder = node
            self._captured_by_key[key] = node
            self.captured.append(
                CapturedInput(
                    name=name,
                    shape=tuple(tensor.shape),
                    dtype=tensor.dtype,
                    requires_grad=bool(tensor.requires_grad),
                    walk_index=position,
                    fixed_value=None if position is not None else tensor.detach().clone(),
                )
            )
        self._node_of[id(tensor)] = node
        self._alive.append(tensor)  # its id keys _node_of: it must not be freed during the trace
        return node

    # -- numbers ---------------------------------------------------------------------------------

    def _number_node(self, number: TracedNumber) -> torch.fx.Node:
        """The placeholder of a number the graph takes (one per expression)."""
        node = self._number_nodes.get(number.expr)
        if node is None:
            leaves = sorted(leaves_of(number.expr))
            if number.expr[0] == "size":
                base = f"{self._found_names[number.expr[1]]}_size{number.expr[2]}"
            else:
                base = self._leaf_names[leaves[0]] if leaves else "number"
            if number.expr[0] not in ("leaf", "size"):
                base = f"{base}_{number.expr[0]}"
            name = _unique_name(base, self._taken_names())
            with self.graph.inserting_after(self._last_number or self._last_placeholder):
                node = self.graph.placeholder(name)
            node.meta["val"] = number.value
            self._last_number = node
            self._number_nodes[number.expr] = node
            self.numbers.append(CapturedNumber(name=name, kind=type(number.value), expr=number.expr))
        return node

    def _received(self, item: Any):
        """The placeholder for a plain number an op got, when it is one of the expected stand-ins'
        values (of the same type: an int where a float was given would type the result otherwise)."""
        for number in self.expected:
            if type(item) is type(number.value) and item == number.value:
                self.received.add(id(number))
                return self._number_node(number)
        return item

    def _as_inputs(self, func, args, kwargs) -> tuple:
        """``args`` and ``kwargs`` for the graph's node: stand-ins' values replaced by their
        placeholders where the op takes them as data (numbers.data_positions)."""
        where = data_positions(func) if self.expected else None
        if where is None:
            return args, kwargs
        if where == "all":
            flat, spec = tree_flatten((args, kwargs))
            flat = [self._received(x) if type(x) in NUMBER_TYPES else x for x in flat]
            return tree_unflatten(flat, spec)
        position, name = where
        args, kwargs = list(args), dict(kwargs)
        if position < len(args) and type(args[position]) in NUMBER_TYPES:
            args[position] = self._received(args[position])
        elif type(kwargs.get(name)) in NUMBER_TYPES:
            kwargs[name] = self._received(kwargs[name])
        return tuple(args), kwargs

    # -- ops ---------------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _VALUE_READS:
            raise _DataDependentRead(f"{func} reads a tensor's value")
        flat, spec = tree_flatten((args, kwargs or {}))
        run_flat, node_flat = [], []
        for item in flat:
            if isinstance(item, torch.Tensor):
                node = self._node_of.get(id(item)) or self._capture(item, constant=func in _LIFT_FRESH)
                run_flat.append(node.meta["val"])
                node_flat.append(node)
            elif isinstance(item, torch.device) and item.type == "meta":
                # Factories inherit the meta device from the inputs; the graph runs on real
                # devices later, where 0-d CPU constants mix with any device.
                run_flat.append(item)
                node_flat.append(torch.device("cpu"))
            else:
                run_flat.append(item)
                node_flat.append(item)
        run_args, run_kwargs = tree_unflatten(run_flat, spec)
        out = func(*run_args, **run_kwargs)
        node_args, node_kwargs = self._as_inputs(func, *tree_unflatten(node_flat, spec))
        node = self.graph.call_function(func, tuple(node_args), dict(node_kwargs))
        if isinstance(out, torch.Tensor):
            out = self._on_device(out)
            self._record(out, node)
            return out
        if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
            # Several outputs (torch.sort, torch.max along a dim): one getitem node each.
            out = type(out)(self._on_device(o) for o in out)
            node.meta["val"] = out
            for i, item in enumerate(out):
                self._record(item, self.graph.call_function(operator.getitem, (node, i)))
            return out
        raise ModTraceError(f"{func} returned {type(out).__name__}; mods may only use ops that return tensors")

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        # A factory without a device (torch.full) runs on the CPU; on the meta attempt, continue on meta.
        return t.to("meta") if self._on_meta and not t.is_meta else t

    def finish(self, result) -> torch.fx.GraphModule:
        if isinstance(result, torch.Tensor):
            node = self._node_of.get(id(result)) or self._capture(result)
        else:
            node = result  # a plain value: _check_output reports it
        self.graph.output(node)
        return torch.fx.GraphModule(torch.nn.Module(), self.graph)


def _same_number(a: Any, b: Any) -> bool:
    return a == b or (a != a and b != b)  # NaN too: one can stand for the other at dispatch


class _NumbersMode(GetItemToIndex):
    """Tracing's torch-function mode: GetItemToIndex, and the stand-ins of Python numbers
    (numbers.py) handed to the ops as their values, with the recorder told which to expect. A
    stand-in the op does not receive as a plain number (``torch.tensor(n)``), or whose value
    another number of the same call shares (which one the op got cannot be told), or an index
    (``bias[n]``, a select whose value picks the element), is specialized. The sizes of a tensor the
    search found (``t.shape[0]``) are stand-ins too (numbers.sizes_of), when ``numbers`` is given."""

    def __init__(self, recorder: _GraphRecorder, numbers: Optional[NumberTrace]):
        super().__init__()
        self.recorder = recorder
        self.numbers = numbers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SIZE_QUERIES and self.numbers is not None and args:
            position = next((i for i, t in enumerate(self.recorder._found) if t is args[0]), None)
            if position is not None:
                return sizes_of(func, args, position, self.numbers)
        flat, spec = tree_flatten((args, kwargs))
        stand_ins: list[TracedNumber] = []
        for x in flat:
            if isinstance(x, TracedNumber) and not any(x is s for s in stand_ins):
                stand_ins.append(x)
        if not stand_ins:
            return super().__torch_function__(func, types, args, kwargs)
        literals = [x for x in flat if type(x) in NUMBER_TYPES]
        expected = []
        for number in stand_ins:
            shared = any(o is not number and _same_number(o.value, number.value) for o in stand_ins) or any(
                _same_number(lit, number.value) for lit in literals)
            if shared or func is torch.Tensor.__getitem__:
                number.trace.force(number)
            else:
                expected.append(number)
        args, kwargs = tree_unflatten([x.value if isinstance(x, TracedNumber) else x for x in flat], spec)
        recorder = self.recorder
        outer = recorder.expected, recorder.received
        recorder.expected, recorder.received = expected, set()
        try:
            return super().__torch_function__(func, types, args, kwargs)
        finally:
            for number in expected:
                if id(number) not in recorder.received:  # the value went into the graph as a constant
                    number.trace.force(number)
            recorder.expected, recorder.received = outer


def _record_graph(fn: Callable, kind: str, tensors: list, names: list, leaf_names: list, on_meta: bool,
                  numbers: Optional[NumberTrace] = None):
    recorder = _GraphRecorder(tensors, names, leaf_names, on_meta)
    example = _example_args(kind)
    if on_meta:
        example = [t.to("meta") for t in example]
    for name, arg in zip(ARGS_OF_KIND[kind], example):
        recorder.add_argument(name, arg)
    with torch.no_grad(), _NumbersMode(recorder, numbers), recorder:
        result = fn(*example)
    return recorder.finish(result), recorder.captured, recorder.numbers, recorder.untracked


def _check_arity(fn: Callable, kind: str) -> None:
    """A mod must accept its arguments positionally (extra ones with defaults are fine)."""
    expected = len(ARGS_OF_KIND[kind])
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins and some C callables have no signature: just try
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    variadic = any(p.kind == p.VAR_POSITIONAL for p in params)
    if not (len(required) <= expected and (len(positional) >= expected or variadic)):
        raise InvalidInputError(
            f"{kind} '{getattr(fn, '__name__', fn)}' must take {expected} positional arguments "
            f"({', '.join(ARGS_OF_KIND[kind])}), it takes {len(required)} required"
        )


def _record_either_way(fn, kind, tensors, names, leaf_names, numbers=None):
    try:
        return _record_graph(fn, kind, tensors, names, leaf_names, False, numbers)
    except (ModTraceError, _DataDependentRead):
        raise
    except Exception:  # the example values did not suit this mod: trace without values
        return _record_graph(fn, kind, tensors, names, leaf_names, True, numbers)


def trace(fn: Callable, kind: str, tensors: list[torch.Tensor], names: list[str], numbers=None) -> tuple[TracedMod, list]:
    """The traced mod, and the tensors it read that the search did not find (inputs of this call).

    ``numbers``: ``(reads, leaves, values, leaf names)`` of the leaves found (reads.Reads), traced
    with stand-ins (numbers.py); None traces every number the mod reads as a constant."""
    _check_arity(fn, kind)  # once per distinct mod: later calls hit the cache
    specialized: tuple = ()
    try:
        recorded = None
        if numbers is not None:
            reads, leaves, values, leaf_names = numbers
            numbers_trace = NumberTrace([type(v) for v in values])
            stand_ins = [TracedNumber(("leaf", i), v, numbers_trace) for i, v in enumerate(values)]
            try:
                with substituted(reads, list(zip(leaves, stand_ins))):
                    recorded = _record_either_way(fn, kind, tensors, names, leaf_names, numbers_trace)
                _check_output(recorded[0], fn, kind)
                specialized = tuple((i, type(values[i]), values[i]) for i in sorted(numbers_trace.specialized))
            except Exception:  # stand-ins the mod's code cannot take: every number a constant
                recorded = None
            finally:
                numbers_trace.active = False
            if recorded is None:
                specialized = tuple((i, type(v), v) for i, v in enumerate(values))
        if recorded is None:
            recorded = _record_either_way(fn, kind, tensors, names, [])
    except ModTraceError:
        raise
    except Exception as err:  # any failure here means "this mod does not trace": say where and why
        raise _trace_error(fn, kind, err) from err
    gm, captured, captured_numbers, untracked = recorded
    _check_output(gm, fn, kind)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    traced = TracedMod(
        kind=kind,
        name=getattr(fn, "__name__", type(fn).__name__),
        fn=fn,
        graph_module=gm,
        arg_names=ARGS_OF_KIND[kind],
        captured=tuple(captured),
        numbers=tuple(captured_numbers),
        specialized=specialized,
    )
    return traced, untracked
