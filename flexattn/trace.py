"""Tracing: a score_mod or mask_mod callable becomes an aten-level torch.fx graph.

Stage 1 of the pipeline (trace -> lowering -> codegen -> kernels). It imports no Triton. One idea
in one module, longer than most: the walk that finds what a mod reads and the trace that records
it share their caches and their rules for what counts as the same mod.

The mod is run once on 0-d meta tensors under a recording dispatch mode, so every torch call is
recorded as an aten op and any use of a tensor's *value* in Python (``if score > 0``, ``.item()``,
``int(q_idx)``) fails at trace time instead of silently baking one branch into the kernel.
docs/tracing.md says why we chose this over ``torch.fx.symbolic_trace``, ``make_fx`` and Dynamo.

Every tensor the mod can read (through closure cells, defaults, globals, helper functions, objects,
modules and nn.Modules) is found by walking the callable and *lifted*: it becomes a graph
placeholder after the mod's own arguments, read afresh on each call, so the same graph serves every
call whatever the current values, and gradients reach captured tensors that require grad. Graphs
are cached by the content of everything the mod can read (see [Note] Cache keys); a warm call with
the same callable object re-reads the locations its last walk read instead of walking again.
"""

from __future__ import annotations

import dis
import enum
import copy
import functools
import inspect
import operator
import os
import sys
import sysconfig
import traceback
import types
import warnings
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
from .errors import describe_mod as _describe_mod
from .graphs import copied_outside_graph_pools, may_keep_allocations

__all__ = [
    "SCORE_MOD_ARGS",
    "MASK_MOD_ARGS",
    "CapturedInput",
    "TracedMod",
    "trace_mod",
    "GetItemToIndex",
    "GathersReadZero",
    "gather_or_zero",
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


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: the trace caches keep one per graph
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

    def fixed_values_on(self, device: torch.device) -> tuple[Optional[torch.Tensor], ...]:
        """The constants this mod builds itself (frozen on the CPU when it was traced), one per
        captured input (None for the user's tensors), on ``device``: copied once per device and kept
        on this object, so no launch copies them again (nor during CUDA-graph capture). The
        constants are this object's own clones; the version check guards a copy anyway."""
        device = torch.device(device)
        copies = self.__dict__.setdefault("_fixed_on_device", {})
        # flexattn's own clones: nothing else writes them, so one made under inference_mode (no
        # version counter) is kept as it is.
        versions = tuple(None if c.fixed_value is None else 0 if c.fixed_value.is_inference() else c.fixed_value._version
                         for c in self.captured)
        entry = copies.get(device)
        if entry is None or entry[0] != versions:
            constants = tuple(c.fixed_value for c in self.captured)
            if may_keep_allocations(device):
                values = tuple(None if t is None else t.to(device) for t in constants)
            elif device.type != "cuda" or not torch.cuda.is_current_stream_capturing():  # a warm-up (graphs.py)
                values = copied_outside_graph_pools(constants, device)
            else:  # inside a capture with no copy kept from before: for this call only
                return tuple(None if t is None else t.to(device) for t in constants)
            entry = copies[device] = (versions, values)
        return entry[1]

    def signature_text(self) -> str:
        """A stable text of the graph, for cache keys of generated kernels."""
        return self.graph_module.code

    def graph_module_on(self, device: torch.device) -> torch.fx.GraphModule:
        """The graph with its factory calls (``b.new_ones(())``, ``torch.full(..., device=b.device)``)
        placed on ``device``: tracing ran on CPU tensors, so the graph records ``device=cpu``, and a
        PyTorch-backend run on a GPU would mix devices. One copy per device, kept on this object."""
        device = torch.device(device)
        if device.type == "cpu":
            return self.graph_module
        copies = self.__dict__.setdefault("_graph_on_device", {})
        gm = copies.get(device)
        if gm is None:
            gm = copy.deepcopy(self.graph_module)
            for node in gm.graph.nodes:
                placed = node.kwargs.get("device")
                if isinstance(placed, torch.device) and placed.type == "cpu":
                    node.kwargs = {**node.kwargs, "device": device}
            gm.recompile()
            copies[device] = gm
        return gm


# --------------------------------------------------------------------------------------------
# Walking a callable: everything it can read, as a content key and a list of locations
# --------------------------------------------------------------------------------------------
#
# [Note] Cache keys
# A traced graph depends on the mod's code and on everything that code can read: closure cells,
# defaults, the globals its code names, the attributes of objects it reaches, container items. Every
# cache in this module (_CACHE, _GRAPHS, _FAST) keeps three rules; a new cache must keep them too.
#   1. A key covers everything that can change the graph or its inputs. The walk (_Walker) records
#      code objects, plain values with their type, tensors' dtype/shape/device/requires_grad and
#      which walked tensors are one object, the types of the objects it looks into and what it
#      finds there. A Python function is keyed by its code and what it can read, wherever it was
#      defined (torch's or_masks returns a closure over user mods). Only what cannot hold user data
#      is keyed by name: builtins, aten ops, library modules and classes, and closure-free functions
#      at the top level of a library (torch, triton, numpy, sympy, flexattn, the standard library).
#   2. No key holds the id() of an object that can die: a freed object's id comes back for another
#      one. Keys hold content, or objects themselves (code objects, user classes), which keeps them
#      alive. The warm-call table holds its objects weakly and drops an entry when its object dies.
#      (Maps that live for one walk or one trace may key by id(): they keep what they key alive.)
#   3. Derived data is keyed by content (_CACHE by the walk's key, _GRAPHS by the graph's text), or
#      re-validated before each use (a _FAST entry re-reads every location its walk read). What the
#      walk cannot look into (objects with neither __dict__ nor __slots__, such as C objects) and
#      tensors the mod reaches by paths the walk does not follow are never cached: the mod is traced
#      again on each call, with a warning, rather than risk a stale graph or a stale tensor.

# Top-level packages whose modules, classes and closure-free functions are keyed by name, with
# the standard library's (see _is_library_package).
_LIBRARY_PACKAGES = frozenset({"torch", "triton", "numpy", "sympy", "flexattn", "functorch", "jinja2"})
_STDLIB_DIRS = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})


@functools.lru_cache(maxsize=None)  # keyed by package names
def _is_library_package(top: str) -> bool:
    if top in _LIBRARY_PACKAGES:
        return True
    if top not in sys.stdlib_module_names:
        return False
    # A user package can share a standard module's name ("test", "config"): trust where it lives.
    if top in sys.builtin_module_names:
        return True
    path = getattr(sys.modules.get(top), "__file__", None)
    if path is None:  # not imported yet (or a namespace package): walking it is the safe side
        return False
    path = os.path.realpath(path)
    return path.startswith(_STDLIB_DIRS) and not any(d in path for d in ("site-packages", "dist-packages"))


def _is_library(module_name: Any) -> bool:
    return isinstance(module_name, str) and _is_library_package(module_name.partition(".")[0])


# Opcodes that look a name up in a function's globals (LOAD_NAME and friends only in class bodies).
_GLOBAL_OPCODES = frozenset({"LOAD_NAME", "STORE_NAME", "DELETE_NAME"})


@functools.lru_cache(maxsize=4096)  # keyed by code objects, which compare by content
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The global names a code object (with the lambdas and comprehensions inside it) looks up."""
    names = dict.fromkeys(
        ins.argval for ins in dis.get_instructions(code) if "GLOBAL" in ins.opname or ins.opname in _GLOBAL_OPCODES
    )
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(dict.fromkeys(_global_names(const)))
    return tuple(names)


@functools.lru_cache(maxsize=4096)
def _attribute_names(code: types.CodeType) -> frozenset[str]:
    """Attribute names a code object may read: its names and identifier-like strings
    (``getattr(self, "table")``), nested code included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _attribute_names(const)
        elif isinstance(const, str) and const.isidentifier():
            names.add(const)
    return frozenset(names)


# What a read finds where nothing is; and the stand-in for a warm-call entry's own object in its
# reads, so that the entry does not keep its object alive.
_MISSING = object()
_ANCHOR = object()

# Kinds of locations a walk reads (see _read): a closure cell, a mapping's key, an attribute, a
# list's item, a container's length, a mutable set's contents.
_CELL, _ITEM, _ATTR, _INDEX, _LEN, _SET = range(6)


def _read(kind: int, container: Any, key: Any) -> Any:
    if kind == _ITEM:
        return container.get(key, _MISSING)
    if kind == _CELL:
        try:
            return container.cell_contents
        except ValueError:  # a cell not yet filled (a recursive definition)
            return _MISSING
    if kind == _ATTR:
        return getattr(container, key, _MISSING)
    if kind == _INDEX:
        return container[key]
    if kind == _LEN:
        return len(container)
    return frozenset(_content_key(item) for item in container)  # _SET


def _tensor_meta(t: torch.Tensor) -> tuple:
    return (t.dtype, t.shape, t.requires_grad, t.device)


def _alias_pattern(tensors) -> tuple[int, ...]:
    """For each tensor, the position of the first tensor that is the same object."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t), i) for i, t in enumerate(tensors))


# Immutable values keyed by themselves (with their type: 1, 1.0 and True hash alike but trace to
# different graphs). Floats by repr, so -0.0 and 0.0 differ and a NaN equals itself.
_PLAIN_TYPES = (bool, int, float, complex, str, bytes, range, torch.dtype, torch.device, torch.layout,
                torch.memory_format, torch.finfo, torch.iinfo, enum.Enum, type(Ellipsis), type(NotImplemented))
_OP_TYPES = tuple(
    t for t in (getattr(torch._ops, n, None) for n in ("OpOverload", "OpOverloadPacket", "HigherOrderOperator")) if t
)
_DESCRIPTOR_TYPES = (types.MethodDescriptorType, types.WrapperDescriptorType, types.ClassMethodDescriptorType,
                     types.GetSetDescriptorType, types.MemberDescriptorType)
# Looked up on the class of every object the walk enters: Python calls them implicitly.
_IMPLICIT_METHODS = ("__call__", "__getattr__", "__getattribute__", "__getitem__")
# Looked up on every instance the walk enters: what a decorator (functools.lru_cache) wraps.
_OBJECT_NAMES = frozenset({"__wrapped__"})
# Looked up on every nn.Module the walk enters: calling one runs its hooks and forward.
_MODULE_NAMES = frozenset({"forward", "_forward_hooks", "_forward_pre_hooks"})
_MODULE_STORES = ("_parameters", "_buffers", "_modules")
_MODULE_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList, torch.nn.ParameterDict,
                      torch.nn.Sequential)


def _plain_key(obj: Any) -> tuple:
    if isinstance(obj, (float, complex, enum.Enum, torch.finfo, torch.iinfo)):
        return (type(obj), repr(obj))
    return (type(obj), obj)


def _content_key(obj: Any) -> Optional[tuple]:
    """The key of a dict key or set item: plain values and tuples of them; None for anything else."""
    if obj is None or isinstance(obj, _PLAIN_TYPES):
        return _plain_key(obj)
    if isinstance(obj, tuple):
        items = tuple(_content_key(item) for item in obj)
        return None if None in items else (type(obj), items)
    return None


def _name_key(obj: Any) -> Optional[tuple]:
    """The key of something that cannot hold user data, by its name; None for anything else."""
    if isinstance(obj, types.ModuleType):
        return ("module", obj.__name__) if _is_library(obj.__name__) else None
    if isinstance(obj, type):
        return ("class", obj.__module__, obj.__qualname__) if _is_library(obj.__module__) else None
    if isinstance(obj, (types.BuiltinFunctionType, types.MethodWrapperType)):
        owner = getattr(obj, "__self__", None)
        if owner is None or isinstance(owner, types.ModuleType) or (isinstance(owner, type) and _is_library(owner.__module__)):
            return ("builtin", getattr(obj, "__module__", None), getattr(owner, "__name__", None), obj.__qualname__)
        return None  # a C method bound to an object (tensor.add): walk the object
    if isinstance(obj, _DESCRIPTOR_TYPES):
        return ("descriptor", obj.__objclass__.__module__, obj.__qualname__)
    if isinstance(obj, _OP_TYPES):
        return ("op", type(obj).__name__, str(obj))
    if isinstance(obj, types.FunctionType):
        module = obj.__globals__.get("__name__")  # where it really lives: __module__ can be copied by wraps
        if obj.__closure__ is None and "<locals>" not in obj.__qualname__ and _is_library(module):
            return ("library function", module, obj.__qualname__)
    return None


def _has_slots(cls: type) -> bool:
    return any("__slots__" in vars(klass) for klass in cls.__mro__[:-1])


class _Walker:
    """One walk over everything a callable can read (see [Note] Cache keys).

    ``signature``: the content key, a flat list of tagged entries. ``tensors``: every tensor found,
    in walk order, named by where it was found (``tensor_names``). ``reads``: every mutable location
    read, as ``[kind, container, key, value, tensor position or -1]``, for the warm-call path.
    ``opaque``: the first object the walk could not look into, if any. Objects are looked into for
    the attribute names in ``names``; ``code_names`` collects those of every code object reached,
    and _walk repeats the walk until the two agree.
    """

    def __init__(self, names: frozenset[str]):
        self.names = sorted(names)
        self.object_names = sorted(names | _OBJECT_NAMES)
        self.module_names = sorted(names | _OBJECT_NAMES | _MODULE_NAMES)
        self.code_names: set[str] = set()
        self.entered_objects = False
        self.signature: list = []
        self.tensors: list[torch.Tensor] = []
        self.tensor_names: list[str] = []
        self.reads: list[list] = []
        self.opaque: Optional[str] = None
        self._ordinal: dict[int, int] = {}  # id -> visit order, for objects kept alive in _visited
        self._visited: list = []
        self._first_position: dict[int, int] = {}  # id(tensor) -> its first position in tensors

    def note(self, kind: int, container: Any, key: Any) -> Any:
        """Record a read the warm path must repeat; the value is walked by the caller."""
        value = _read(kind, container, key)
        self.reads.append([kind, container, key, value, -1])
        return value

    def read(self, kind: int, container: Any, key: Any, name: str) -> Any:
        """Record a read and walk its value."""
        value = self.note(kind, container, key)
        if value is _MISSING:
            self.signature.append(("missing",))
        else:
            self.value(value, name, read=len(self.reads) - 1)
        return value

    def value(self, obj: Any, name: str, read: Optional[int] = None) -> None:
        sig = self.signature
        if isinstance(obj, torch.Tensor):
            position = len(self.tensors)
            first = self._first_position.setdefault(id(obj), position)
            self.tensors.append(obj)
            self.tensor_names.append(name)
            if read is not None:
                self.reads[read][4] = position
            sig.append(("tensor", *_tensor_meta(obj), first))
            return
        if obj is None or isinstance(obj, _PLAIN_TYPES):
            sig.append(_plain_key(obj))
            return
        if isinstance(obj, (tuple, slice)):  # immutable: their items cannot be replaced
            items = (obj.start, obj.stop, obj.step) if isinstance(obj, slice) else obj
            sig.append((type(obj), len(items)))
            for i, item in enumerate(items):
                self.value(item, f"{name}_{i}")
            return
        named = _name_key(obj)
        if named is not None:
            sig.append(named)
            return
        ordinal = self._ordinal.get(id(obj))
        if ordinal is not None:  # seen before in this walk (shared, or a cycle)
            sig.append(("seen", ordinal))
            return
        self._ordinal[id(obj)] = len(self._ordinal)
        self._visited.append(obj)
        if isinstance(obj, types.FunctionType):
            self.function(obj)
        elif isinstance(obj, types.MethodType):
            sig.append(("method",))
            self.value(obj.__func__, name)
            self.value(obj.__self__, name)
        elif isinstance(obj, functools.partial):
            sig.append(("partial", type(obj)))
            self.read(_ATTR, obj, "func", name)
            self.read(_ATTR, obj, "args", name)
            self.read(_ATTR, obj, "keywords", "")
        elif isinstance(obj, list):
            sig.append((type(obj), len(obj)))
            self.note(_LEN, obj, None)
            for i in range(len(obj)):
                self.read(_INDEX, obj, i, f"{name}_{i}")
        elif isinstance(obj, (dict, types.MappingProxyType)):
            self.mapping(obj, name)
        elif isinstance(obj, (set, frozenset)):
            items = frozenset(_content_key(item) for item in obj)
            if None in items:
                self.cannot_see(obj)
                return
            sig.append((type(obj), items))
            if isinstance(obj, set):
                self.note(_SET, obj, None)
        elif isinstance(obj, (types.BuiltinFunctionType, types.MethodWrapperType)):
            sig.append(("bound builtin", obj.__name__))  # bound to an object: walk the object
            self.value(obj.__self__, name)
        else:
            self.object(obj, name)

    def function(self, fn: types.FunctionType) -> None:
        code = self.note(_ATTR, fn, "__code__")
        self.signature.append(("function", code))
        self.code_names |= _attribute_names(code)
        defaults = self.note(_ATTR, fn, "__defaults__")
        if defaults:  # a tuple: each default is named after its parameter
            params = code.co_varnames[code.co_argcount - len(defaults) : code.co_argcount]
            self.signature.append(("defaults", len(defaults)))
            for param, value in zip(params, defaults):
                self.value(value, param)
        self.read(_ATTR, fn, "__kwdefaults__", "")  # a dict: walked key by key
        for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
            self.read(_CELL, cell, None, var)
        fn_globals = fn.__globals__
        for var in _global_names(code):  # absent ones too: defining one later changes the mod
            self.read(_ITEM, fn_globals, var, var)
        self.signature.append(("end",))

    def mapping(self, mapping, name: str) -> None:
        keys = list(mapping)
        key_of = {id(key): _content_key(key) for key in keys}
        if None in key_of.values():
            self.cannot_see(mapping)
            return
        keys.sort(key=lambda key: repr(key_of[id(key)]))
        self.signature.append((type(mapping), len(keys)))
        self.note(_LEN, mapping, None)
        for key in keys:
            self.signature.append(("key", key_of[id(key)]))
            self.read(_ITEM, mapping, key, f"{name}_{key}" if name else str(key))

    def object(self, obj: Any, name: str) -> None:
        """An instance, a user class or a user module: its type, then each attribute the code reached
        can name, found where Python would find it (instance, class, nn.Module's stores)."""
        cls = type(obj)
        is_class = isinstance(obj, type)
        instance_dict = None
        if not is_class:
            try:  # not getattr: a user __getattr__ would run for objects without a __dict__
                instance_dict = object.__getattribute__(obj, "__dict__")
            except AttributeError:
                pass
        if not is_class and not isinstance(instance_dict, dict) and not _has_slots(cls):
            self.cannot_see(obj)
            return
        self.entered_objects = True
        self.signature.append(("object", obj if is_class else cls))
        if isinstance(obj, _MODULE_CONTAINERS):  # indexed by position or key: everything they hold
            names = sorted(_MODULE_STORES + tuple(self.module_names))
        elif isinstance(obj, torch.nn.Module):
            names = self.module_names
        elif is_class or isinstance(obj, types.ModuleType):
            names = self.names
        else:
            names = self.object_names
        for attr in names:
            self.attribute(obj, attr, instance_dict, is_class)
        if not is_class and not isinstance(obj, types.ModuleType):
            for attr in _IMPLICIT_METHODS:
                self.class_attribute(obj, attr, cls.__mro__, record=False)
        self.signature.append(("end",))

    def attribute(self, obj: Any, attr: str, instance_dict: Optional[dict], is_class: bool) -> None:
        if instance_dict is not None:
            value = self.note(_ITEM, instance_dict, attr)  # absent ones too: setting one shadows the class
            if value is not _MISSING:
                self.signature.append(("attr", attr))
                self.value(value, attr, read=len(self.reads) - 1)
                return
        if isinstance(obj, types.ModuleType):
            return
        if self.class_attribute(obj, attr, obj.__mro__ if is_class else type(obj).__mro__, record=True):
            return
        if isinstance(obj, torch.nn.Module):  # what nn.Module.__getattr__ finds
            for store in _MODULE_STORES:
                if store in instance_dict:
                    value = self.note(_ITEM, instance_dict[store], attr)
                    if value is not _MISSING:
                        self.signature.append(("attr", attr, store))
                        self.value(value, attr, read=len(self.reads) - 1)
                        return

    def class_attribute(self, obj: Any, attr: str, mro, record: bool) -> bool:
        """Look ``attr`` up in the classes of ``mro``. Reads of user classes' dicts are recorded (the
        ones where it is absent too, when ``record``: setting it there later would change the mod);
        library classes do not change."""
        for klass in mro:
            class_dict = klass.__dict__
            user = not _is_library(klass.__module__)
            if attr not in class_dict:
                if record and user:
                    self.note(_ITEM, class_dict, attr)
                continue
            value = self.note(_ITEM, class_dict, attr) if user else class_dict[attr]
            read = len(self.reads) - 1 if user else None
            self.signature.append(("class attr", attr))
            if isinstance(value, (staticmethod, classmethod)):
                self.value(value.__func__, attr)
            elif isinstance(value, property):
                self.value(value.fget, attr)
            elif isinstance(value, types.MemberDescriptorType) and not isinstance(obj, type):
                self.read(_ATTR, obj, attr, attr)  # a __slots__ attribute of the instance
            else:
                self.value(value, attr, read=read)
            return True
        return False

    def cannot_see(self, obj: Any) -> None:
        cls = type(obj)
        self.opaque = self.opaque or f"a {cls.__module__}.{cls.__qualname__} object"
        self.signature.append(("opaque", cls))


def _code_of(fn: Callable) -> Optional[types.CodeType]:
    """The code object of a function, bound method or partial; None for other callables."""
    while isinstance(fn, (types.MethodType, functools.partial)):
        fn = fn.__func__ if isinstance(fn, types.MethodType) else fn.func
    code = getattr(fn, "__code__", None) if isinstance(fn, types.FunctionType) else None
    return code


walk_count = 0  # how many full walks ran in this process (warm calls with the same callable skip it)


def _walk(fn: Callable) -> _Walker:
    """Walk ``fn`` with the attribute names of all the code it reaches (a fixed point: looking into
    an object can reach more code, whose names can reach more of the objects)."""
    global walk_count
    walk_count += 1
    code = _code_of(fn)
    names = _attribute_names(code) if code is not None else frozenset()
    while True:
        walker = _Walker(names)
        walker.value(fn, getattr(fn, "__name__", "mod"))
        if not walker.entered_objects or walker.code_names <= names:
            return walker
        names = names | walker.code_names


# --------------------------------------------------------------------------------------------
# Tracing
# --------------------------------------------------------------------------------------------


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

    The rule of every backend (the kernels' guarded loads in lowering/emit.py do the same): negative
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
        if path.startswith(_TORCH_DIR) or path == _THIS_FILE or frame.filename.startswith("<frozen"):
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
# torch.tensor(...) inside a mod: the op's input is a constant the mod builds, frozen in the graph.
_LIFT_FRESH = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


class _GraphRecorder(TorchDispatchMode):
    """Runs the mod once on 0-d tensors and records every aten op it reaches into an fx graph.

    A tensor reaching an op that the recorder has not produced itself is one the mod reads (found by
    the walk, or by a path the walk does not follow: ``untracked``) or builds (``torch.tensor(2.0)``,
    a fixed constant): it becomes a placeholder after the mod's own arguments. Reads of a tensor's
    value into Python raise at once.

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
        self._captured_by_key: dict = {}
        self.untracked: list[torch.Tensor] = []  # tensors found while tracing, not by the walk
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

    def _source_of(self, tensor: torch.Tensor, constant: bool) -> Optional[int]:
        """The position of ``tensor`` among the walked tensors (then the untracked ones), None for
        a constant the mod builds itself."""
        live = self._walked + self.untracked
        position = next((i for i, t in enumerate(live) if t is tensor), None)
        if position is None:  # the same tensor under another Python object (``.data``)
            position = next((i for i, t in enumerate(self._walked) if _same_tensor(t, tensor)), None)
        if position is None and not constant:
            # The mod reached it by a path the walk does not follow: an input of this call only.
            position = len(live)
            self.untracked.append(tensor)
        return position

    def _capture(self, tensor: torch.Tensor, constant: bool = False) -> torch.fx.Node:
        walk_index = self._source_of(tensor, constant)
        key = walk_index if walk_index is not None else id(tensor)
        node = self._captured_by_key.get(key)
        if node is None:
            if walk_index is None:
                base = f"const{len(self.captured)}"
            elif walk_index < len(self._walked):
                base = self._walked_names[walk_index]
            else:
                base = "untracked"
            name = _unique_name(base, {c.name for c in self.captured})
            with self.graph.inserting_after(self._last_placeholder):
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
                    walk_index=walk_index,
                    fixed_value=None if walk_index is not None else tensor.detach().clone(),
                )
            )
        self._node_of[id(tensor)] = node
        self._alive.append(tensor)  # its id keys _node_of: it must not be freed during the trace
        return node

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
    return recorder.finish(result), recorder.captured, recorder.untracked


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


def _trace(fn: Callable, kind: str, tensors: list[torch.Tensor], names: list[str]) -> tuple[TracedMod, list]:
    """The traced mod, and the tensors it read that the walk did not find (inputs of this call)."""
    _check_arity(fn, kind)  # once per distinct mod: later calls hit the cache
    try:
        try:
            gm, captured, untracked = _record_graph(fn, kind, tensors, names, on_meta=False)
        except (ModTraceError, _DataDependentRead):
            raise
        except Exception:  # the example values did not suit this mod: trace without values
            gm, captured, untracked = _record_graph(fn, kind, tensors, names, on_meta=True)
    except ModTraceError:
        raise
    except Exception as err:  # any failure here means "this mod does not trace": say where and why
        raise _trace_error(fn, kind, err) from err
    _check_output(gm, fn, kind)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    traced = TracedMod(
        kind=kind,
        name=getattr(fn, "__name__", type(fn).__name__),
        fn=fn,
        graph_module=gm,
        arg_names=_ARGS_OF_KIND[kind],
        captured=tuple(captured),
    )
    return traced, untracked


# The caches (see [Note] Cache keys). _CACHE: (kind, the walk's signature) -> TracedMod. _GRAPHS: the
# graph's content -> its one TracedMod, so a mod traced again (on every call, when the walk cannot
# see all it reads) keeps one TracedMod, and the kernels built for it. _FAST: the warm-call table,
# callable (held weakly) -> {(kind, method's function): _FastEntry}.
_CACHE: "OrderedDict[tuple, TracedMod]" = OrderedDict()
_GRAPHS: "OrderedDict[tuple, TracedMod]" = OrderedDict()
_FAST: "OrderedDict[weakref.ref, dict]" = OrderedDict()
_CACHE_SIZE = 512
_FAST_SIZE = 512
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
    walker = _walk(fn)
    key = None if walker.opaque else (kind, tuple(walker.signature))
    traced = _CACHE.get(key) if key is not None else None
    if traced is not None:
        _CACHE.move_to_end(key)
        _remember(fn, kind, walker, traced)
        return traced, traced.captured_values(walker.tensors)
    traced, untracked = _trace(fn, kind, walker.tensors, walker.tensor_names)
    trace_count += 1
    traced = _one_per_graph(traced)
    if key is not None and not untracked:
        _CACHE[key] = traced
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
        _remember(fn, kind, walker, traced)
    else:
        what = walker.opaque or "a tensor by a path the walk does not follow (a function attribute, a C object)"
        warnings.warn(
            f"{_describe_mod(fn, kind)} reads {what}: flexattn cannot tell when it changes, so the mod is "
            "traced again on every call (slow, still correct). Keep what the mod reads in closure variables, "
            "globals, default arguments, or attributes of plain objects, modules or nn.Modules.",
            stacklevel=3,
        )
    return traced, traced.captured_values(walker.tensors + untracked)


def _one_per_graph(traced: TracedMod) -> TracedMod:
    """The TracedMod already made for this very graph, or this one."""
    fixed = tuple(
        None if c.fixed_value is None else (c.fixed_value.dtype, c.fixed_value.cpu().flatten().tolist())
        for c in traced.captured
    )
    spec = tuple((c.name, c.shape, c.dtype, c.requires_grad, c.walk_index) for c in traced.captured)
    # Where the mod is defined too: errors from later stages name its lines (lowering/sites.py).
    code = _code_of(traced.fn)
    where = (code.co_filename, code.co_firstlineno) if code is not None else type(traced.fn)
    key = (traced.kind, traced.name, where, traced.signature_text(), spec, fixed)
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


class _FastEntry:
    """What one walk of a callable read, to answer its next call without walking (see _fast_lookup)."""

    __slots__ = ("reads", "tensors", "meta", "aliases", "traced")

    def __init__(self, reads, tensors, meta, aliases, traced):
        self.reads, self.tensors, self.meta, self.aliases, self.traced = reads, tensors, meta, aliases, traced


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


def _remember(fn: Callable, kind: str, walker: _Walker, traced: TracedMod) -> None:
    anchor, func = _fast_anchor(fn)
    if anchor is None:
        return
    try:
        ref = weakref.ref(anchor, _forget)
    except TypeError:  # no weak references to it: no warm path
        return
    reads = tuple(
        (kind_, _ANCHOR if container is anchor else container, key, value, position)
        for kind_, container, key, value, position in walker.reads
    )
    tensors = tuple(walker.tensors)
    aliases = _alias_pattern(tensors) if len(tensors) > 1 else None
    entry = _FastEntry(reads, tensors, tuple(_tensor_meta(t) for t in tensors), aliases, traced)
    entries = _FAST.get(ref)
    if entries is None:
        entries = _FAST[ref] = {}
        if len(_FAST) > _FAST_SIZE:
            _FAST.popitem(last=False)
    entries[(kind, func)] = entry


def _fast_lookup(fn: Callable, kind: str):
    """The cached trace of this very callable, if nothing its walk read has changed since.

    Re-reads every location the walk read (cells, globals, defaults, attributes, container items and
    lengths): plain values must be the same objects; tensors may be other objects, with the same
    dtype, shape, device and requires_grad (checked again for every tensor: in-place resizes count)
    and the same pattern of which ones are one object.
    """
    anchor, func = _fast_anchor(fn)
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
    for read_kind, container, key, expected, position in entry.reads:
        if container is _ANCHOR:
            container = anchor
        # _read, inlined: this loop is most of a warm call's cost.
        if read_kind == _CELL:
            try:
                now = container.cell_contents
            except ValueError:
                now = _MISSING
        elif read_kind == _ATTR:
            now = getattr(container, key, _MISSING)
        elif read_kind == _ITEM:
            now = container.get(key, _MISSING)
        elif read_kind == _INDEX:
            now = container[key]
        else:  # _LEN, _SET: compared by value
            if _read(read_kind, container, key) != expected:
                return None
            continue
        if now is not expected:
            if position < 0 or not isinstance(now, torch.Tensor):
                return None
            tensors[position] = now
    for tensor, meta in zip(tensors, entry.meta):
        if (tensor.dtype, tensor.shape, tensor.requires_grad, tensor.device) != meta:
            return None
    if entry.aliases is not None and _alias_pattern(tensors) != entry.aliases:
        return None
    _FAST.move_to_end(ref)
    return entry.traced, entry.traced.captured_values(tensors)
