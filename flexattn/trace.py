"""Tracing: a score_mod or mask_mod callable becomes an aten-level torch.fx graph.

Stage 1 of the pipeline (trace -> lowering -> codegen -> runtime). It imports no Triton.

The mod is run once on 0-d meta tensors under a recording dispatch mode, so every torch call is
recorded as an aten op and any use of a tensor's *value* in Python (``if score > 0``, ``.item()``,
``int(q_idx)``) fails at trace time instead of silently baking one branch into the kernel.
docs/tracing.md says why we chose this over ``torch.fx.symbolic_trace``, ``make_fx`` and Dynamo.

Tensors the mod closes over (closure cells, globals, bound modules, nested helper functions) are
*lifted*: each becomes a graph placeholder after the mod's own arguments, so the same graph serves
every call whatever the current values, and gradients reach captured tensors that require grad.
Graphs are cached by a signature of the callable (code objects, plain captured values, captured
tensor metadata), so a second call with the same mod costs a walk over its closure and no re-trace.
"""

from __future__ import annotations

import functools
import inspect
import operator
import os
import sys
import traceback
import types
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .errors import InvalidInputError, ModTraceError

__all__ = [
    "SCORE_MOD_ARGS",
    "MASK_MOD_ARGS",
    "CapturedInput",
    "TracedMod",
    "trace_mod",
    "source_line_of",
    "GetItemToIndex",
]

SCORE_MOD_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_MOD_ARGS = ("b", "h", "q_idx", "kv_idx")
_ARGS_OF_KIND = {"score_mod": SCORE_MOD_ARGS, "mask_mod": MASK_MOD_ARGS}

# Index tensors are int32, as in the kernels; scores are float32, the kernels' working precision.
INDEX_DTYPE = torch.int32
SCORE_DTYPE = torch.float32

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)


@dataclass(frozen=True)
class CapturedInput:
    """A tensor the mod reads that is not one of its arguments: a graph input after the mod's args."""

    name: str  # readable, from the closure variable or global it was found under ("doc_id")
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    walk_index: Optional[int]  # position among the tensors found in the callable, None if fixed
    fixed_value: Optional[torch.Tensor] = None  # a tensor the mod builds itself, frozen at trace time


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: the trace cache keeps one per mod
class TracedMod:
    """One traced mod: an fx graph with placeholders ``arg_names + captured``, all 0-d but gathers."""

    kind: str  # "score_mod" or "mask_mod"
    name: str  # the callable's __name__, used in errors and kernel cache keys
    fn: Callable
    graph_module: torch.fx.GraphModule
    arg_names: tuple[str, ...]
    captured: tuple[CapturedInput, ...]

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    def captured_values(self, walked: list[torch.Tensor]) -> list[torch.Tensor]:
        """The graph's captured inputs for this call, from the tensors found in the callable now."""
        return [c.fixed_value if c.walk_index is None else walked[c.walk_index] for c in self.captured]

    def signature_text(self) -> str:
        """A stable text of the graph, for cache keys of generated kernels."""
        return self.graph_module.code


# --------------------------------------------------------------------------------------------
# Walking a callable: its tensors and a hashable signature of everything that shapes its graph
# --------------------------------------------------------------------------------------------


def _global_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # lambdas and comprehensions inside the mod
            names.extend(_global_names(const))
    return names


def _is_library_function(fn: Any) -> bool:
    module = getattr(fn, "__module__", None) or ""
    return module == "torch" or module.startswith(("torch.", "triton", "numpy", "sympy"))


class _Walker:
    def __init__(self):
        self.signature: list = []
        self.tensors: list[torch.Tensor] = []
        self.tensor_names: list[str] = []
        self._seen: set[int] = set()
        # For the warm-call fast path: every read of mutable state (a closure cell, a global), and
        # for each tensor the read it came from. False once anything else mutable is walked.
        self.reads: list[tuple] = []
        self.tensor_reads: list[Optional[int]] = []
        self.cacheable = True
        self._current_read: Optional[int] = None

    def read(self, container, key, value, name: str) -> None:
        self.reads.append((container, key, value))
        self._current_read = len(self.reads) - 1
        self.value(value, name)
        self._current_read = None

    def value(self, obj: Any, name: str) -> None:
        sig = self.signature
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            self.tensor_names.append(name)
            self.tensor_reads.append(self._current_read)
            self._current_read = None
            sig.append(("tensor", obj.dtype, tuple(obj.shape), obj.requires_grad, obj.device.type))
            return
        # The type is part of the key: 1, 1.0 and True hash alike but trace to different graphs.
        if obj is None or isinstance(obj, (bool, int, float, complex, str, torch.dtype, torch.device)):
            sig.append((type(obj).__name__, obj))
            return
        if isinstance(obj, (types.ModuleType, type, types.BuiltinFunctionType)) or _is_library_function(obj):
            sig.append(("lib", getattr(obj, "__qualname__", None) or repr(obj)))
            return
        if id(obj) in self._seen:
            sig.append(("seen", id(obj)))
            return
        self._seen.add(id(obj))
        self._current_read = None  # only a tensor read directly from a cell or global is re-read
        if isinstance(obj, types.FunctionType):
            self.function(obj)
        elif isinstance(obj, functools.partial):
            sig.append("partial")
            self.value(obj.func, name)
            for i, arg in enumerate(obj.args):
                self.value(arg, f"{name}_arg{i}")
            for key in sorted(obj.keywords):
                sig.append(key)
                self.value(obj.keywords[key], key)
        elif isinstance(obj, types.MethodType):
            sig.append("method")
            self.value(obj.__func__, name)
            self.value(obj.__self__, name)
        elif isinstance(obj, (list, tuple)):
            self.cacheable = self.cacheable and isinstance(obj, tuple)
            sig.append((type(obj).__name__, len(obj)))
            for i, item in enumerate(obj):
                self.value(item, f"{name}_{i}")
        elif isinstance(obj, dict):
            self.cacheable = self.cacheable and isinstance(obj, types.MappingProxyType)
            sig.append(("dict", len(obj)))
            for key in sorted(obj, key=repr):
                sig.append(repr(key))
                self.value(obj[key], f"{name}_{key}")
        elif isinstance(obj, torch.nn.Module):
            self.cacheable = False
            sig.append(("module", type(obj)))
            for attr, tensor in list(obj.named_parameters()) + list(obj.named_buffers()):
                sig.append(attr)
                self.value(tensor, attr.replace(".", "_"))
            self.value(getattr(type(obj), "__call__", None), name)
        elif callable(obj) and hasattr(obj, "__call__") and isinstance(obj.__call__, types.MethodType):
            self.cacheable = False
            sig.append(("callable", type(obj)))
            self.value(obj.__call__, name)
            self.value(vars(obj) if hasattr(obj, "__dict__") else None, name)
        else:
            # Unknown objects: identity is the only safe key (a new object means a fresh trace).
            self.cacheable = False
            sig.append(("object", type(obj).__qualname__, id(obj)))

    def function(self, fn: types.FunctionType) -> None:
        code = fn.__code__
        self.signature.append(code)
        self.value(fn.__defaults__, "default")
        self.value(fn.__kwdefaults__, "kwdefault")
        for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:  # a cell not yet filled (recursive definition)
                contents = None
            self.read(cell, None, contents, var)
        fn_globals = fn.__globals__
        for var in _global_names(code):
            if var in fn_globals:
                self.signature.append(var)
                self.read(fn_globals, var, fn_globals[var], var)


def walk_callable(fn: Callable) -> tuple[tuple, list[torch.Tensor], list[str]]:
    """Signature, tensors and tensor names of everything ``fn`` can read."""
    walker = _Walker()
    walker.value(fn, getattr(fn, "__name__", "mod"))
    return tuple(walker.signature), walker.tensors, walker.tensor_names


# --------------------------------------------------------------------------------------------
# Tracing
# --------------------------------------------------------------------------------------------


class GetItemToIndex(TorchFunctionMode):
    """Turn ``tensor[idx]`` with tensor indices into ``aten.index``.

    Plain ``__getitem__`` with a 0-d integer tensor would call ``__index__`` on it (a data-dependent
    read); ``aten.index`` keeps it a gather, which tiles, vmaps and lowers to a load.
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
                items = [i if isinstance(i, torch.Tensor) else torch.tensor(i, dtype=INDEX_DTYPE) for i in items]
                return torch.ops.aten.index.Tensor(tensor, items)
        return func(*args, **(kwargs or {}))


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
        if path.startswith(_TORCH_DIR) or path == _THIS_FILE or frame.filename.startswith("<frozen"):
            continue
        return frame
    return None


def _where(frame: Optional[traceback.FrameSummary]) -> str:
    if frame is None:
        return "at an unknown line"
    line = (frame.line or "").strip()
    return f"at {frame.filename}:{frame.lineno} (in {frame.name}): {line}"


def _describe_mod(fn: Callable, kind: str) -> str:
    name = getattr(fn, "__name__", type(fn).__name__)
    code = getattr(fn, "__code__", None)
    where = f" defined at {code.co_filename}:{code.co_firstlineno}" if code is not None else ""
    return f"{kind} '{name}'{where}"


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
    return ModTraceError(f"Cannot trace {_describe_mod(fn, kind)}\n  {_where(frame)}\n  {hint}")


def _check_output(gm: torch.fx.GraphModule, fn: Callable, kind: str) -> None:
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    result = out.args[0]
    val = result.meta.get("val") if isinstance(result, torch.fx.Node) else result
    if not isinstance(val, torch.Tensor):
        expected = "a bool tensor such as `q_idx >= kv_idx`" if kind == "mask_mod" else "a float tensor"
        raise ModTraceError(
            f"{_describe_mod(fn, kind)} must return {expected} computed from its arguments, "
            f"got {type(val).__name__} ({val!r})"
        )
    if val.dim() != 0:
        raise ModTraceError(
            f"{_describe_mod(fn, kind)} must return one value per (query, key) pair (a 0-d tensor), "
            f"got shape {tuple(val.shape)}; index every dimension of the captured tensors it reads"
        )
    if kind == "mask_mod" and val.dtype != torch.bool:
        raise ModTraceError(
            f"{_describe_mod(fn, kind)} must return a bool tensor, got {val.dtype}; "
            "compare instead, e.g. `(q_idx - kv_idx) >= 0`"
        )
    if kind == "score_mod" and not val.dtype.is_floating_point:
        raise ModTraceError(
            f"{_describe_mod(fn, kind)} must return a floating-point score, got {val.dtype}; "
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


class _GraphRecorder(TorchDispatchMode):
    """Runs the mod once on 0-d tensors and records every aten op it reaches into an fx graph.

    A tensor reaching an op that the recorder has not produced itself is one the mod closes over
    (or builds, like ``torch.tensor(2.0)``): it becomes a placeholder after the mod's own
    arguments. Reads of a tensor's value into Python raise at once.

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

    def __init__(self, walked: list[torch.Tensor], walked_names: list[str], on_meta: bool):
        super().__init__()
        self.graph = torch.fx.Graph()
        self.captured: list[CapturedInput] = []
        self._walked, self._walked_names, self._on_meta = walked, walked_names, on_meta
        self._node_of: dict[int, torch.fx.Node] = {}
        self._run_value: dict[int, torch.Tensor] = {}  # node name -> the tensor the ops run on
        self._captured_by_key: dict = {}
        self._alive: list[torch.Tensor] = []  # keeps every traced tensor alive, so ids stay unique
        self._last_placeholder: Optional[torch.fx.Node] = None

    def add_argument(self, name: str, example: torch.Tensor) -> None:
        node = self.graph.placeholder(name)
        self._record(example, node)
        self._last_placeholder = node

    def _record(self, tensor: torch.Tensor, node: torch.fx.Node) -> None:
        node.meta["val"] = tensor
        self._node_of[id(tensor)] = node
        self._alive.append(tensor)

    def _capture(self, tensor: torch.Tensor) -> torch.fx.Node:
        walk_index = next((i for i, t in enumerate(self._walked) if _same_tensor(t, tensor)), None)
        key = walk_index if walk_index is not None else id(tensor)
        node = self._captured_by_key.get(key)
        if node is None:
            base = self._walked_names[walk_index] if walk_index is not None else f"const{len(self.captured)}"
            name = _unique_name(base, {c.name for c in self.captured})
            with self.graph.inserting_after(self._last_placeholder):
                node = self.graph.placeholder(name)
            value = tensor.detach()
            if self._on_meta:
                value = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
            node.meta["val"] = value
            self._alive.append(tensor)
            self._last_placeholder = node
            self._captured_by_key[key] = node
            self.captured.append(
                CapturedInput(
                    name=name,
                    shape=tuple(tensor.shape),
                    dtype=tensor.dtype,
                    requires_grad=bool(tensor.requires_grad),
                    walk_index=walk_index,
                    fixed_value=None if walk_index is not None else tensor.detach().clone(),
                )
            )
        self._node_of[id(tensor)] = node
        return node

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _VALUE_READS:
            raise _DataDependentRead(f"{func} reads a tensor's value")
        flat, spec = tree_flatten((args, kwargs or {}))
        run_flat, node_flat = [], []
        for item in flat:
            if isinstance(item, torch.Tensor):
                node = self._node_of.get(id(item)) or self._capture(item)
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
        node_args, node_kwargs = tree_unflatten(node_flat, spec)
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


def _record_graph(fn: Callable, kind: str, tensors: list, names: list, on_meta: bool):
    recorder = _GraphRecorder(tensors, names, on_meta)
    example = _example_args(kind)
    if on_meta:
        example = [t.to("meta") for t in example]
    for name, arg in zip(_ARGS_OF_KIND[kind], example):
        recorder.add_argument(name, arg)
    with torch.no_grad(), GetItemToIndex(), recorder:
        result = fn(*example)
    return recorder.finish(result), recorder.captured


def _check_arity(fn: Callable, kind: str) -> None:
    """A mod must accept its arguments positionally (extra ones with defaults are fine)."""
    expected = len(_ARGS_OF_KIND[kind])
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
            f"({', '.join(_ARGS_OF_KIND[kind])}), it takes {len(required)} required"
        )


def _trace(fn: Callable, kind: str, tensors: list[torch.Tensor], names: list[str]) -> TracedMod:
    _check_arity(fn, kind)  # once per distinct mod: later calls hit the cache
    try:
        try:
            gm, captured = _record_graph(fn, kind, tensors, names, on_meta=False)
        except (ModTraceError, _DataDependentRead):
            raise
        except Exception:  # the example values did not suit this mod: trace without values
            gm, captured = _record_graph(fn, kind, tensors, names, on_meta=True)
    except ModTraceError:
        raise
    except Exception as err:  # any failure here means "this mod does not trace": say where and why
        raise _trace_error(fn, kind, err) from err
    _check_output(gm, fn, kind)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return TracedMod(
        kind=kind,
        name=getattr(fn, "__name__", type(fn).__name__),
        fn=fn,
        graph_module=gm,
        arg_names=_ARGS_OF_KIND[kind],
        captured=tuple(captured),
    )


_CACHE: "OrderedDict[tuple, TracedMod]" = OrderedDict()
# Warm calls with the same callable object skip the walk: id(fn) -> (weak ref, reads, tensor
# sources, traced). Entries are re-validated on every hit (see _fast_lookup).
_FAST: dict = {}
_CACHE_SIZE = 512
trace_count = 0  # how many real traces ran in this process (tests check that warm calls add none)


def trace_mod(fn: Callable, kind: str) -> tuple[TracedMod, list[torch.Tensor]]:
    """The traced graph of ``fn`` and the values of its captured inputs for this call.

    ``kind`` is "score_mod" or "mask_mod" (taken from the keyword the user passed it under, never
    from the callable's arity).
    """
    global trace_count
    if kind not in _ARGS_OF_KIND:
        raise ValueError(f"kind must be 'score_mod' or 'mask_mod', got {kind!r}")
    if not callable(fn):
        raise TypeError(f"{kind} must be callable, got {type(fn).__name__}")
    hit = _fast_lookup(fn, kind)
    if hit is not None:
        return hit
    walker = _Walker()
    walker.value(fn, getattr(fn, "__name__", "mod"))
    signature, tensors, names = tuple(walker.signature), walker.tensors, walker.tensor_names
    key = (kind, signature)
    traced = _CACHE.get(key)
    if traced is None:
        traced = _trace(fn, kind, tensors, names)
        trace_count += 1
        _CACHE[key] = traced
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    if walker.cacheable:
        _remember(fn, kind, walker, traced)
    return traced, traced.captured_values(tensors)


def _remember(fn: Callable, kind: str, walker: _Walker, traced: TracedMod) -> None:
    try:
        ref = weakref.ref(fn)
    except TypeError:
        return
    meta = [None if i is None else _tensor_meta(walker.tensors[k]) for k, i in enumerate(walker.tensor_reads)]
    _FAST[(id(fn), kind)] = (ref, walker.reads, walker.tensor_reads, list(walker.tensors), meta, traced)


def _tensor_meta(t: torch.Tensor) -> tuple:
    return (t.dtype, t.shape, t.requires_grad, t.device)


def _fast_lookup(fn: Callable, kind: str):
    """The cached trace of this very callable object, if nothing it reads has changed since.

    Re-reads every closure cell and global the walk read: plain values must be the same objects,
    tensors may be new objects but with the same dtype, shape, device and requires_grad.
    """
    entry = _FAST.get((id(fn), kind))
    if entry is None:
        return None
    ref, reads, tensor_reads, tensors, meta, traced = entry
    if ref() is not fn:
        return None
    current = []
    for container, key, value in reads:
        now = container.cell_contents if key is None else container.get(key, _MISSING)
        if now is not value and not isinstance(value, torch.Tensor):
            return None
        current.append(now)
    tensors = list(tensors)
    for k, read in enumerate(tensor_reads):
        if read is not None:
            now = current[read]
            if now is not tensors[k]:
                if not isinstance(now, torch.Tensor) or _tensor_meta(now) != meta[k]:
                    return None
                tensors[k] = now
    return traced, traced.captured_values(tensors)


_MISSING = object()


# --------------------------------------------------------------------------------------------
# Source lines of graph nodes, for errors raised by later stages
# --------------------------------------------------------------------------------------------


class _RecordCallSites(TorchDispatchMode):
    def __init__(self, target, occurrence: int):
        super().__init__()
        self.target, self.occurrence, self.seen = target, occurrence, 0
        self.frame: Optional[traceback.FrameSummary] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.target:
            if self.seen == self.occurrence and self.frame is None:
                self.frame = _user_frame(traceback.extract_stack())
            self.seen += 1
        return func(*args, **(kwargs or {}))


def source_line_of(traced: TracedMod, node: torch.fx.Node) -> str:
    """Where in the user's source ``node`` came from, as "at file:line (in fn): text".

    Only used to build error messages: it re-runs the mod eagerly on 0-d tensors and stops at the
    matching call of the node's op.
    """
    occurrence = 0
    for other in traced.graph.nodes:
        if other is node:
            break
        if other.op == "call_function" and other.target is node.target:
            occurrence += 1
    recorder = _RecordCallSites(node.target, occurrence)
    try:
        with GetItemToIndex(), recorder:
            traced.fn(*_example_args(traced.kind))
    except Exception:
        pass
    return _where(recorder.frame)
