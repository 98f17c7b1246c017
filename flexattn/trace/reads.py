"""What a callable can read (its reads): found in one pass over everything a mod reaches, as a
content key (the trace caches' key), a list of the locations it read (the warm-call path re-reads
them), the tensors it found, and the Python numbers it found (numbers.py: they become runtime inputs
of the graph)."""

from __future__ import annotations

import dis
import enum
import functools
import os
import sys
import sysconfig
import types
from typing import Any, Callable, Optional

import torch

from .numbers import ATTR, CELL, INDEX, ITEM, NUMBER_TYPES, rebuildable, value_at, writable
from .traced import counts

__all__ = ["Reads", "find_reads", "read", "tensor_meta", "alias_pattern", "content_key", "code_of", "MISSING", "ANCHOR",
           "CELL", "ITEM", "ATTR", "INDEX", "LEN", "SET"]

# [Note] Cache keys
# A traced graph depends on the mod's code and on everything that code can read: closure cells,
# defaults, the globals its code names, the attributes of objects it reaches, container items. Every
# cache in this module (_CACHE, _GRAPHS, _FAST) keeps three rules; a new cache must keep them too.
#   1. A key covers everything that can change the graph or its inputs. The reads (Reads) record
#      code objects, plain values with their type, tensors' dtype/shape/device/requires_grad and
#      which found tensors are one object, the types of the objects it looks into and what it
#      finds there. A Python function is keyed by its code and what it can read, wherever it was
#      defined (torch's or_masks returns a closure over user mods). Only what cannot hold user data
#      is keyed by name: builtins, aten ops, library modules and classes, and closure-free functions
#      at the top level of a library (torch, triton, numpy, sympy, flexattn, the standard library).
#   2. No key holds the id() of an object that can die: a freed object's id comes back for another
#      one. Keys hold content, or objects themselves (code objects, user classes), which keeps them
#      alive. The warm-call table holds its objects weakly and drops an entry when its object dies.
#      (Maps that live for one search or one trace may key by id(): they keep what they key alive.)
#   3. Derived data is keyed by content (_CACHE by the reads' key, _GRAPHS by the graph's text), or
#      re-validated before each use (a _FAST entry re-reads every location its reads hold). What the
#      search cannot look into (objects with neither __dict__ nor __slots__, such as C objects) and
#      tensors the mod reaches by paths the search does not follow are never cached: the mod is traced
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
    if path is None:  # not imported yet (or a namespace package): looking into it is the safe side
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
MISSING = object()
ANCHOR = object()

# Kinds of locations a callable reads (see read): a closure cell, a mapping's key, an attribute, a list's
# item (numbers.py, which writes them), a container's length, a mutable set's contents.
LEN, SET = 4, 5


def read(kind: int, container: Any, key: Any) -> Any:
    if kind == ITEM:
        return container.get(key, MISSING)
    if kind == CELL:
        try:
            return container.cell_contents
        except ValueError:  # a cell not yet filled (a recursive definition)
            return MISSING
    if kind == ATTR:
        return getattr(container, key, MISSING)
    if kind == INDEX:
        return container[key]
    if kind == LEN:
        return len(container)
    return frozenset(content_key(item) for item in container)  # SET


def tensor_meta(t: torch.Tensor) -> tuple:
    return (t.dtype, t.shape, t.requires_grad, t.device)


def alias_pattern(tensors) -> tuple[int, ...]:
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
# Looked up on the class of every object the search enters: Python calls them implicitly.
_IMPLICIT_METHODS = ("__call__", "__getattr__", "__getattribute__", "__getitem__")
# Looked up on every instance the search enters: what a decorator (functools.lru_cache) wraps.
_OBJECT_NAMES = frozenset({"__wrapped__"})
# Looked up on every nn.Module the search enters: calling one runs its hooks and forward.
_MODULE_NAMES = frozenset({"forward", "_forward_hooks", "_forward_pre_hooks"})
_MODULE_STORES = ("_parameters", "_buffers", "_modules")
_MODULE_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList, torch.nn.ParameterDict,
                      torch.nn.Sequential)


def _plain_key(obj: Any) -> tuple:
    if isinstance(obj, (float, complex, enum.Enum, torch.finfo, torch.iinfo)):
        return (type(obj), repr(obj))
    return (type(obj), obj)


def content_key(obj: Any) -> Optional[tuple]:
    """The key of a dict key or set item: plain values and tuples of them; None for anything else."""
    if obj is None or isinstance(obj, _PLAIN_TYPES):
        return _plain_key(obj)
    if isinstance(obj, tuple):
        items = tuple(content_key(item) for item in obj)
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
        return None  # a C method bound to an object (tensor.add): look into the object
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


class Reads:
    """Everything a callable can read, found in one search over what it reaches (see [Note] Cache
    keys).

    ``signature``: the content key, a flat list of tagged entries. ``tensors``: every tensor found,
    in the order found, named by where it was found (``tensor_names``). ``locations``: every mutable
    location read, as ``[kind, container, key, value, tensor position or -1]``, for the warm-call
    path. ``opaque``: the first object the search could not look into, if any. Objects are looked
    into for the attribute names in ``names``; ``code_names`` collects those of every code object
    reached, and find_reads searches again until the two agree.

    ``leaves``: the Python numbers found at locations tracing can write (numbers.py), each as
    ``(read, path)``: the read that found it, and its position inside the tuples that read gave
    (``()`` for the value itself). The key holds a leaf's type and position, not its value: the
    graph takes it as an input. With ``lift_numbers`` False every number is keyed by value (the
    fallback for a mod that cannot be traced with stand-ins).
    """

    def __init__(self, names: frozenset[str], lift_numbers: bool = True):
        self.names = sorted(names)
        self.lift_numbers = lift_numbers
        self.leaves: list[tuple[int, tuple]] = []
        self.leaf_types: list[type] = []
        self.leaf_names: list[str] = []
        self._leaf_at: dict[tuple, int] = {}  # (kind, id(container), key, path) -> leaf
        self.object_names = sorted(names | _OBJECT_NAMES)
        self.module_names = sorted(names | _OBJECT_NAMES | _MODULE_NAMES)
        self.code_names: set[str] = set()
        self.entered_objects = False
        self.signature: list = []
        self.tensors: list[torch.Tensor] = []
        self.tensor_names: list[str] = []
        self.tensor_sites: list[Optional[tuple]] = []  # per tensor, (read, path) where it can be written
        self.locations: list[list] = []
        self.opaque: Optional[str] = None
        self._ordinal: dict[int, int] = {}  # id -> visit order, for objects kept alive in _visited
        self._visited: list = []
        self._first_position: dict[int, int] = {}  # id(tensor) -> its first position in tensors

    def note(self, kind: int, container: Any, key: Any) -> Any:
        """Record a read the warm path must repeat; the caller looks into the value."""
        value = read(kind, container, key)
        self.locations.append([kind, container, key, value, -1])
        return value

    def read(self, kind: int, container: Any, key: Any, name: str) -> Any:
        """Record a read and look into its value."""
        value = self.note(kind, container, key)
        if value is MISSING:
            self.signature.append(("missing",))
        else:
            self.value(value, name, read=len(self.locations) - 1)
        return value

    def value(self, obj: Any, name: str, read: Optional[int] = None, path: Optional[tuple] = ()) -> None:
        """Look into ``obj``, found by read ``read`` at ``path`` inside what that read gave (None: not at a
        location tracing can write)."""
        sig = self.signature
        if type(obj) in NUMBER_TYPES and self.lift_numbers and read is not None and path is not None:
            leaf = self.leaf(read, path, type(obj), name)
            if leaf is not None:
                sig.append(("number", type(obj), leaf))
                return
        if isinstance(obj, torch.Tensor):
            position = len(self.tensors)
            first = self._first_position.setdefault(id(obj), position)
            self.tensors.append(obj)
            self.tensor_names.append(name)
            writable_site = read is not None and path is not None and writable(*self.locations[read][:3])
            self.tensor_sites.append((read, path) if writable_site else None)
            if read is not None and path == ():  # the warm path reads it there (a tuple's item: not)
                self.locations[read][4] = position
            sig.append(("tensor", *tensor_meta(obj), first))
            return
        if obj is None or isinstance(obj, _PLAIN_TYPES):
            sig.append(_plain_key(obj))
            return
        if isinstance(obj, (tuple, slice)):  # immutable: their items cannot be replaced
            items = (obj.start, obj.stop, obj.step) if isinstance(obj, slice) else obj
            sig.append((type(obj), len(items)))
            # A number inside is a leaf where tracing can put a copy of the tuple at the read.
            inner = read is not None and path is not None and rebuildable(obj)
            for i, item in enumerate(items):
                self.value(item, f"{name}_{i}", read, path + (i,) if inner else None)
            return
        named = _name_key(obj)
        if named is not None:
            sig.append(named)
            return
        ordinal = self._ordinal.get(id(obj))
        if ordinal is not None:  # seen before in this search (shared, or a cycle)
            sig.append(("seen", ordinal))
            return
        self._ordinal[id(obj)] = len(self._ordinal)
        self._visited.append(obj)
        if isinstance(obj, types.FunctionType):
            self.function(obj)
        elif isinstance(obj, types.MethodType):
            sig.append(("method",))
            self.value(obj.__func__, name, None)
            self.value(obj.__self__, name, None)
        elif isinstance(obj, functools.partial):
            sig.append(("partial", type(obj)))
            self.read(ATTR, obj, "func", name)
            self.read(ATTR, obj, "args", name)
            self.read(ATTR, obj, "keywords", "")
        elif isinstance(obj, list):
            sig.append((type(obj), len(obj)))
            self.note(LEN, obj, None)
            for i in range(len(obj)):
                self.read(INDEX, obj, i, f"{name}_{i}")
        elif isinstance(obj, (dict, types.MappingProxyType)):
            self.mapping(obj, name)
        elif isinstance(obj, (set, frozenset)):
            items = frozenset(content_key(item) for item in obj)
            if None in items:
                self.cannot_see(obj)
                return
            sig.append((type(obj), items))
            if isinstance(obj, set):
                self.note(SET, obj, None)
        elif isinstance(obj, (types.BuiltinFunctionType, types.MethodWrapperType)):
            sig.append(("bound builtin", obj.__name__))  # bound to an object: look into the object
            self.value(obj.__self__, name, None)
        else:
            self.object(obj, name)

    def function(self, fn: types.FunctionType) -> None:
        code = self.note(ATTR, fn, "__code__")
        self.signature.append(("function", code))
        self.code_names |= _attribute_names(code)
        defaults = self.note(ATTR, fn, "__defaults__")
        read_at = len(self.locations) - 1
        if defaults:  # a tuple: each default is named after its parameter
            params = code.co_varnames[code.co_argcount - len(defaults) : code.co_argcount]
            self.signature.append(("defaults", len(defaults)))
            for i, (param, value) in enumerate(zip(params, defaults)):
                self.value(value, param, read_at, (i,))
        self.read(ATTR, fn, "__kwdefaults__", "")  # a dict: looked into key by key
        for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
            self.read(CELL, cell, None, var)
        fn_globals = fn.__globals__
        for var in _global_names(code):  # absent ones too: defining one later changes the mod
            self.read(ITEM, fn_globals, var, var)
        self.signature.append(("end",))

    def leaf(self, read: int, path: tuple, kind: type, name: str) -> Optional[int]:
        """The leaf of the number found by ``read`` at ``path`` (one per location, however often it
        is read), or None where tracing cannot put a stand-in."""
        kind_, container, key = self.locations[read][:3]
        if not writable(kind_, container, key):
            return None
        location = (kind_, id(container), key, path)  # the container is kept alive by locations
        leaf = self._leaf_at.get(location)
        if leaf is None:
            leaf = self._leaf_at[location] = len(self.leaves)
            self.leaves.append((read, path))
            self.leaf_types.append(kind)
            self.leaf_names.append(name)
        return leaf

    def leaf_values(self) -> tuple:
        """The leaves' values now, as the search found them."""
        return tuple(value_at(self.locations[read][3], path) for read, path in self.leaves)

    def mapping(self, mapping, name: str) -> None:
        keys = list(mapping)
        key_of = {id(key): content_key(key) for key in keys}
        if None in key_of.values():
            self.cannot_see(mapping)
            return
        keys.sort(key=lambda key: repr(key_of[id(key)]))
        self.signature.append((type(mapping), len(keys)))
        self.note(LEN, mapping, None)
        for key in keys:
            self.signature.append(("key", key_of[id(key)]))
            self.read(ITEM, mapping, key, f"{name}_{key}" if name else str(key))

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
            value = self.note(ITEM, instance_dict, attr)  # absent ones too: setting one shadows the class
            if value is not MISSING:
                self.signature.append(("attr", attr))
                self.value(value, attr, read=len(self.locations) - 1)
                return
        if isinstance(obj, types.ModuleType):
            return
        if self.class_attribute(obj, attr, obj.__mro__ if is_class else type(obj).__mro__, record=True):
            return
        if isinstance(obj, torch.nn.Module):  # what nn.Module.__getattr__ finds
            for store in _MODULE_STORES:
                if store in instance_dict:
                    value = self.note(ITEM, instance_dict[store], attr)
                    if value is not MISSING:
                        self.signature.append(("attr", attr, store))
                        self.value(value, attr, read=len(self.locations) - 1)
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
                    self.note(ITEM, class_dict, attr)
                continue
            value = self.note(ITEM, class_dict, attr) if user else class_dict[attr]
            read = len(self.locations) - 1 if user else None
            self.signature.append(("class attr", attr))
            if isinstance(value, (staticmethod, classmethod)):
                self.value(value.__func__, attr)
            elif isinstance(value, property):
                self.value(value.fget, attr)
            elif isinstance(value, types.MemberDescriptorType) and not isinstance(obj, type):
                self.read(ATTR, obj, attr, attr)  # a __slots__ attribute of the instance
            else:
                self.value(value, attr, read=read)
            return True
        return False

    def cannot_see(self, obj: Any) -> None:
        cls = type(obj)
        self.opaque = self.opaque or f"a {cls.__module__}.{cls.__qualname__} object"
        self.signature.append(("opaque", cls))


def code_of(fn: Callable) -> Optional[types.CodeType]:
    """The code object of a function, bound method or partial; None for other callables."""
    while isinstance(fn, (types.MethodType, functools.partial)):
        fn = fn.__func__ if isinstance(fn, types.MethodType) else fn.func
    code = getattr(fn, "__code__", None) if isinstance(fn, types.FunctionType) else None
    return code


def find_reads(fn: Callable, lift_numbers: bool = True) -> Reads:
    """Everything ``fn`` can read, searched with the attribute names of all the code it reaches (a
    fixed point: looking into an object can reach more code, whose names can reach more of the
    objects)."""
    counts.searches += 1
    code = code_of(fn)
    names = _attribute_names(code) if code is not None else frozenset()
    while True:
        reads = Reads(names, lift_numbers)
        reads.value(fn, getattr(fn, "__name__", "mod"))
        if not reads.entered_objects or reads.code_names <= names:
            return reads
        names = names | reads.code_names
