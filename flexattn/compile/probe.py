"""What a mod reads, found by running it: the probe Dynamo inlines in a compiled call (and
register_call runs eagerly), and mods made inside the graph passed to register_call by their parts
(``described``) and made again outside it (``rebuilt``). [Note] flex_attention under torch.compile
in compile/__init__.py."""

from __future__ import annotations

import ctypes
import functools
import types
from typing import Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..mods import FACTORY_ATTRIBUTE
from ..trace import TracedNumber

__all__ = ["probe", "described", "rebuilt"]


# ------------------------------------------------------------------------------------ probing a mod

# The probe's bookkeeping: Dynamo traces a TorchFunctionMode's __torch_function__ but not attributes
# set on the mode, so the state of the probe running now lives here, one entry per probe.
_PROBES: list = []
_NUMBERS = (bool, int, float)  # under Dynamo, its symbolic ints and floats are these too


class _NoteReads(TorchFunctionMode):
    """Notes, in order of first use, each tensor that reaches a torch function making a tensor and
    that the probe did not make (an argument, or the result of an earlier call); and, in order, every
    number such a call takes (the mod's literals, and the numbers it reads: [Note] Numbers under
    torch.compile)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        made, read, numbers, sizes = _PROBES[-1]
        if sizes is not None:  # register_call's eager probe: sizes of what the mod reads as stand-ins
            stand_ins = sizes(func, args)
            if stand_ins is not None:
                return stand_ins
        flat, spec = tree_flatten((args, kwargs))
        if any(isinstance(item, TracedNumber) for item in flat):  # register_call's eager probe
            plain = [item.value if isinstance(item, TracedNumber) else item for item in flat]
            result = func(*tree_unflatten(plain, spec)[0], **tree_unflatten(plain, spec)[1])
        else:
            result = func(*args, **kwargs)
        outputs = [item for item in tree_flatten(result)[0] if isinstance(item, torch.Tensor)]
        # Only calls that make tensors: Dynamo answers metadata (t.shape, t.dim()) itself, without
        # the mode, so noting those would order the reads differently in the two runs.
        if outputs:
            for item in flat:
                if isinstance(item, torch.Tensor):
                    if not any(item is t for t in made) and not any(item is t for t in read):
                        read.append(item)
                elif isinstance(item, (TracedNumber, *_NUMBERS)):
                    numbers.append(item)
        made.extend(outputs)
        return result


def probe(fn: Optional[Callable], kind: str, device: torch.device, sizes=None) -> tuple[list, list]:
    """``(tensors, numbers)``: the tensors ``fn`` reads, in the order it first uses them, and the
    numbers its torch calls take, in order, from one run on empty probes.

    Runs under Dynamo (which then guards what the mod reads and gives its tensors and its symbolic
    numbers as graph values) and eagerly in register_call (whose order matches: see [Note]
    flex_attention under torch.compile), there with ``sizes`` (trace.with_stand_ins)."""
    if fn is None:
        return [], []
    index = torch.empty(0, dtype=torch.int32, device=device)
    args = [index, index.clone(), index.clone(), index.clone()]
    if kind == "score_mod":
        args = [torch.empty(0, dtype=torch.float32, device=device)] + args
    made, read, numbers = list(args), [], []
    _PROBES.append((made, read, numbers, sizes))
    try:
        with torch.no_grad(), _NoteReads():
            fn(*args, *_defaults_beyond(fn, len(args)), **_keyword_defaults(fn))
    finally:
        _PROBES.pop()
    return read, numbers


def _defaults_beyond(fn, given: int) -> tuple:
    """A plain function's defaults for its parameters after the mod's arguments, passed explicitly
    by the probe: Dynamo (torch 2.11) binds defaults it finds itself as constants it does not guard,
    so a default changed in place (``mod.__defaults__ = (w,)``) ran the graph compiled for the old
    value; read here, from the function, it is guarded or symbolic like any other number."""
    if not isinstance(fn, types.FunctionType):
        return ()
    defaults = fn.__defaults__
    extra = fn.__code__.co_argcount - given
    if not defaults or extra <= 0 or extra > len(defaults):
        return ()
    return tuple(defaults[len(defaults) - extra:])


def _keyword_defaults(fn) -> dict:
    """A plain function's keyword-only defaults, passed explicitly for the same reason."""
    if not isinstance(fn, types.FunctionType) or not fn.__code__.co_kwonlyargcount:
        return {}
    return dict(fn.__kwdefaults__ or {})


# ------------------------------------------------------------------------------------ mods made in the graph


# Tags of the tuples described() makes (plain tuples: Dynamo passes them to a constant function as
# they are, which it does not do for NamedTuples): a tensor by what tracing needs of it (and its
# number, so that one tensor passed twice stays one), the same tensor again, a mod made by a
# mod_factory (mods.py) as the call that made it, a bound method as its function and object,
# and a functools.partial as its parts.
_STAND_IN = "flexattn: tensor (number, dims, dtype, device, requires_grad)"
_SAME = "flexattn: the tensor numbered"
_REBUILD = "flexattn: a mod_factory call (factory, args, kwargs)"
_METHOD = "flexattn: a bound method (function, id of the object, its type)"
_PARTIAL = "flexattn: a functools.partial (function, args, keywords)"
_FLOAT = "flexattn: a float (hex)"


def _constant_number(x):
    """A Python number as Dynamo can pass it to a constant function: a symbolic one is specialised
    here (the range's length, the hex string are constants; Dynamo guards the value, so a new one
    recompiles). Plain ``int(x)`` keeps a symbolic int symbolic."""
    if isinstance(x, bool):
        return True if x else False
    if isinstance(x, int):
        return len(range(x)) if x >= 0 else -len(range(-x))
    return (_FLOAT, float(x).hex())


def _object_of(oid: int, kind: type):
    """The object whose id() Dynamo passed (``described``, a bound method's object). Only called
    while Dynamo traces the call, where the traced frame holds the object: the id is live."""
    obj = ctypes.cast(oid, ctypes.py_object).value
    if type(obj) is not kind:  # pragma: no cover - the id is live, so this cannot happen
        raise RuntimeError(f"flexattn: a bound method's object is no longer a {kind.__qualname__}")
    return obj


def described(x, seen: Optional[list] = None):
    """A mod as register_call can take it under Dynamo: the mod itself; for a mod made by a
    mod_factory (which may close over tensors of the graph, with no object outside it), the call
    that made it with its tensors by shape, dtype and device; for a bound method or a
    functools.partial, its parts (Dynamo cannot pass those to a constant function whole). A Python
    number among a factory's or a partial's arguments is made a constant here, which Dynamo guards:
    a new value recompiles ([Note] Numbers under torch.compile). Traced by Dynamo."""
    seen = [] if seen is None else seen
    if isinstance(x, torch.Tensor):
        for number, tensor in enumerate(seen):
            if tensor is x:
                return (_SAME, number)
        seen.append(x)
        # Its number of dims, not its shape: a symbolic size cannot pass to a constant function
        # (and specialising it would recompile at every new length). The op traces the mod again
        # for the shapes it is given (mod_inputs).
        return (_STAND_IN, len(seen) - 1, x.dim(), x.dtype, x.device, x.requires_grad)
    if isinstance(x, (bool, int, float)):
        return _constant_number(x)
    if isinstance(x, (tuple, list)):
        items = [described(item, seen) for item in x]
        return tuple(items) if isinstance(x, tuple) else items
    if isinstance(x, dict):
        return {key: described(value, seen) for key, value in x.items()}
    if isinstance(x, types.MethodType):  # Dynamo passes neither a bound method nor every object whole
        return (_METHOD, x.__func__, id(x.__self__), type(x.__self__))
    if isinstance(x, functools.partial):
        return (_PARTIAL, described(x.func, seen), described(x.args, seen), described(x.keywords, seen))
    if callable(x):
        made = getattr(x, FACTORY_ATTRIBUTE, None)
        if made is not None:
            factory, args, kwargs = made
            return (_REBUILD, factory, described(args, seen), described(kwargs, seen))
    return x


def rebuilt(x, made: Optional[dict] = None):
    """The inverse of described, outside the graph: the same mod_factory calls, on zero tensors of
    the same dtype and number of dims, each of size 1 (they cost no memory; the op traces the mod
    again, reading its real tensors, at its first call: mod_inputs)."""
    made = {} if made is None else made
    if isinstance(x, tuple) and len(x) == 6 and x[0] == _STAND_IN:
        _, number, dims, dtype, device, requires_grad = x
        # requires_grad too: it decides which captured tensors the traced mod takes gradients for.
        stand_in = torch.zeros((), dtype=dtype, device=device).expand((1,) * dims)
        made[number] = stand_in.detach().requires_grad_(requires_grad)
        return made[number]
    if isinstance(x, tuple) and len(x) == 2 and x[0] == _SAME:
        return made[x[1]]
    if isinstance(x, tuple) and len(x) == 4 and x[0] == _REBUILD:
        return x[1](*rebuilt(x[2], made), **rebuilt(x[3], made))
    if isinstance(x, tuple) and len(x) == 4 and x[0] == _METHOD:
        return types.MethodType(x[1], _object_of(x[2], x[3]))
    if isinstance(x, tuple) and len(x) == 2 and x[0] == _FLOAT:
        return float.fromhex(x[1])
    if isinstance(x, tuple) and len(x) == 4 and x[0] == _PARTIAL:
        return functools.partial(rebuilt(x[1], made), *rebuilt(x[2], made), **rebuilt(x[3], made))
    if isinstance(x, (tuple, list)):
        items = [rebuilt(item, made) for item in x]
        return tuple(items) if isinstance(x, tuple) else items
    if isinstance(x, dict):
        return {key: rebuilt(value, made) for key, value in x.items()}
    return x
