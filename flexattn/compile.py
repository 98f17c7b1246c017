"""flex_attention inside ``torch.compile``: the custom ops Dynamo, AOTAutograd and Inductor see, and
the part of a call that Dynamo traces in place of the eager path.

[Note] flex_attention under torch.compile
The eager path traces a mod by walking the callable (trace.py), which Dynamo cannot follow: it broke a
compiled layer into 19 graphs. Under Dynamo a call takes another route, in three parts:

1. **The mods, traced outside the graph.** ``register_call`` (called by api.py from a function marked
   as ``torch.compiler.assume_constant_result`` marks, so Dynamo runs it as plain Python on the real
   callables and keeps only its result) traces both mods with flexattn's own tracer, registers the
   TracedMods under a key made from their content, and returns that key: a string constant in the
   graph. The same mods in another process give the same key, so Inductor's caches stay valid (the
   key is registered when Dynamo traces the call, so a graph needs Dynamo to have run in the process:
   torch.export's programs, loaded on their own, do not carry the mods). A mod made inside the
   compiled function by a ``mod_factory`` reaches it as the factory call (``described``), made again
   on zero tensors of the same shapes (``_rebuilt``).
2. **What the mods read, found by Dynamo.** ``collected_tensors`` runs the mod once on empty probe
   tensors under a TorchFunctionMode that notes every tensor reaching a torch function that the mod
   did not make itself. Dynamo inlines that run like any user code: it guards everything the mod
   reads (a float in a closure, a global it calls, the code of a closure) and turns each tensor the
   mod reads into a graph value, an input or an intermediate, whose gradient flows. So a new closure
   of the same code over new tensors, or new contents, reuses the graph; a changed constant or
   another mod recompiles. ``register_call`` runs the same probe eagerly on the real callable and
   matches what it notes, by identity, with the TracedMod's captured inputs: Python runs the mod the
   same way in both, so the i-th tensor noted under Dynamo is the i-th noted eagerly. The probes are
   empty, so the probe's ops read nothing at run time (and are dead code the compiler drops).
3. **One custom op per pass.** ``flexattn::flex_attention`` and ``flexattn::flex_attention_backward``
   (defined with ``torch.library``, [Note] The ops' registration) take the query, key, value, the BlockMask's tables, the captured
   tensors and the key. Their fake implementations give the real outputs' shapes, dtypes and
   strides; the forward's autograd formula calls the backward op. Inductor calls them as extern
   kernels, and CUDA graphs capture their launches.

Inside the op the tables are trusted (``BlockMask.from_launch_tables``): a BlockMask's own tables are
ascending and in range by construction (create_block_mask, from_kv_blocks, decode_block_mask,
PagedAttention), and checking them would read them back to the host on every call, which neither a
compiled step nor a CUDA graph can afford. Their row statistics are those checked once for the first
mask of each shape ([Note] What a compiled call's mask derives, kept), else fixed (no consecutive-block
fast path), as for decoding masks ([Note] Tables in range by construction in masks/block_mask.py).

A closure created inside the compiled function over a tensor, not by a mod_factory, has no Python
object outside the graph to trace: Dynamo refuses it at compile time ("failed to convert closure
cell"); docs/compile.md says to define it outside or make it with a factory. Inside activation
checkpointing that Dynamo traces, entering the probe's mode counts as a side effect to replay;
docs/compile.md gives the setting that lets it pass.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import types
import weakref
from contextlib import ExitStack, nullcontext
from typing import Callable, NamedTuple, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

from .dispatch import (
    Call, backward_relaunch, compile_ahead, forward_relaunch, prepare_backward, run_backward, run_forward,
)
from .errors import InvalidInputError
from .cuda_graphs import capturing, may_keep_allocations
from .kernels import ahead, interpreter_enabled, output_layout
from .kernels.tables import (
    BACKWARD_TABLES, PROGRAM_WALKS, LaunchTables, RowStats, assume_groups_differ, checked_launch_tables,
    launch_tables, preset_row_stats,
)
from .masks import BlockMask, dense_block_mask, version_of
from .mods import FACTORY_ATTRIBUTE
from .request import build_call, check_captured_devices
from .trace import TracedMod, TracedNumber, trace_mod, with_stand_ins, with_values

__all__ = ["register_call", "probe", "described", "flex_attention_op", "registered_call", "mod_inputs"]


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


def _rebuilt(x, made: Optional[dict] = None):
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
        return x[1](*_rebuilt(x[2], made), **_rebuilt(x[3], made))
    if isinstance(x, tuple) and len(x) == 4 and x[0] == _METHOD:
        return types.MethodType(x[1], _object_of(x[2], x[3]))
    if isinstance(x, tuple) and len(x) == 2 and x[0] == _FLOAT:
        return float.fromhex(x[1])
    if isinstance(x, tuple) and len(x) == 4 and x[0] == _PARTIAL:
        return functools.partial(_rebuilt(x[1], made), *_rebuilt(x[2], made), **_rebuilt(x[3], made))
    if isinstance(x, (tuple, list)):
        items = [_rebuilt(item, made) for item in x]
        return tuple(items) if isinstance(x, tuple) else items
    if isinstance(x, dict):
        return {key: _rebuilt(value, made) for key, value in x.items()}
    return x


# ------------------------------------------------------------------------------------ the registry

# [Note] Numbers under torch.compile
# A Python number a mod reads is an input of its traced graph (trace/numbers.py). Under Dynamo it
# reaches the op as the probe notes it: every number the mod's torch calls take, in order, a
# constant where Dynamo specialised it and a symbolic value where it did not (a closure int that
# keeps changing), so a new value runs the graph compiled for the last one, with the new value, and
# no stale constant. register_call runs the same probe eagerly with the mod's numbers replaced by
# stand-ins, which says for each position what it holds (``ModLayout.numbers``): an input of the
# graph, or a constant of the trace (a literal of the mod's code, or a number the trace used in
# Python, which its graph depends on). The op body checks the constants against what the graph
# passes at every call: a mismatch (Dynamo kept symbolic a value the trace baked in, such as
# ``math.sqrt(n)``) traces the mod again for what it reads now, rather than run a stale graph.

class ModLayout(NamedTuple):
    """Where the op finds one mod's inputs among what the probe noted: ``tensors``, per captured
    tensor the user's code holds, its position among the noted tensors and the dtype and number of
    dims it must have; ``numbers``, per noted number, ``("input", i)`` for the graph's i-th number,
    or ``("constant", value)``."""

    tensors: tuple
    numbers: tuple


class RegisteredMod(NamedTuple):
    traced: TracedMod
    layout: ModLayout
    fn: Callable  # the callable traced: traced again when the graph passes other constants


class RegisteredCall(NamedTuple):
    """What a graph's call runs besides its tensors, under the key the graph holds."""

    score: Optional[RegisteredMod]
    mask: Optional[RegisteredMod]
    options: dict


# Key -> RegisteredCall. Never evicted: a compiled graph holds its key for as long as it lives, and
# the keys come from content, so there is one entry per distinct pair of traced mods and options.
_CALLS: dict[str, RegisteredCall] = {}


def _content_key(traced: Optional[TracedMod]) -> str:
    if traced is None:
        return "none"
    return f"{traced.name}-{hashlib.sha256(traced.content_text().encode()).hexdigest()[:16]}"


def _layout(fn: Callable, kind: str, traced: TracedMod, values: list, device: torch.device) -> ModLayout:
    """Where the op will find ``traced``'s inputs among what the probe notes (see ModLayout)."""
    with with_stand_ins(fn) as sizes:
        noted, numbers = probe(fn, kind, device, sizes)
    tensors = []
    for captured, value in zip(traced.captured, values):
        if captured.walk_index is None:
            continue
        position = next((i for i, t in enumerate(noted) if t is value), None)
        if position is None:
            raise InvalidInputError(
                f"{kind} '{traced.name}' reads the tensor '{captured.name}' in a way flexattn cannot follow under "
                "torch.compile (it reaches no torch function when the mod runs); read captured tensors by indexing "
                "them in the mod, e.g. bias[h]"
            )
        tensors.append((position, value.dtype, value.dim()))
    inputs = {n.expr: i for i, n in enumerate(traced.numbers)}
    layout = tuple(("input", inputs[x.expr]) if isinstance(x, TracedNumber) and x.expr in inputs
                   else ("constant", x.value if isinstance(x, TracedNumber) else x) for x in numbers)
    missing = set(range(len(traced.numbers))) - {i for what, i in layout if what == "input"}
    if missing:
        name = traced.numbers[min(missing)].name
        raise InvalidInputError(
            f"{kind} '{traced.name}' reads the number '{name}' in a way flexattn cannot follow under torch.compile "
            "(it reaches no torch function when the mod runs on its own); please report this with the mod's code"
        )
    return ModLayout(tuple(tensors), layout)


# [Note] Stale compiled graphs. Inductor and AOTAutograd keep compiled graphs on disk, keyed by the
# graph's code, not by the code of the ops in it: a graph compiled under an older flexattn would come
# back with that version's idea of the op's outputs (Inductor checks each output's strides against
# the fake implementation's, so a changed layout fails there, e.g. when the output took the query's
# layout). The call key is a constant of every graph that calls the op, so it carries this number:
# bump it whenever what the ops' fake implementations return changes, and old entries stop matching.
OP_CONTRACT = 3


def _register_mod(fn: Optional[Callable], kind: str, device: torch.device) -> Optional[RegisteredMod]:
    if fn is None:
        return None
    traced, values = trace_mod(fn, kind)
    check_captured_devices(traced, values, device)  # as an eager call checks them, with the names the trace found
    return RegisteredMod(traced, _layout(fn, kind, traced, values, device), fn)


def register_call(score_mod: Optional[Callable], mask_mod: Optional[Callable], options: dict,
                  device: torch.device) -> str:
    """Trace the mods with flexattn's tracer and register them under a key made from their content.
    The mods come as ``described`` gives them.

    Called once per compile of a call site, on the real callables (see [Note] flex_attention under
    torch.compile), never per call."""
    score = _register_mod(_rebuilt(score_mod), "score_mod", device)
    mask = _register_mod(_rebuilt(mask_mod), "mask_mod", device)
    parts = [_content_key(m.traced if m else None) + repr(m.layout if m else None) for m in (score, mask)]
    key = "|".join([f"v{OP_CONTRACT}"] + parts + [repr(sorted(options.items()))])
    _CALLS.setdefault(key, RegisteredCall(score, mask, dict(options)))
    return key


def registered_call(key: str) -> RegisteredCall:
    call = _CALLS.get(key)
    if call is None:
        raise RuntimeError(
            f"flexattn: no mods registered under {key!r}. A compiled graph's flex_attention key is registered "
            "when Dynamo traces the call in this process; run the compiled function itself, not a graph "
            "loaded on its own"
        )
    return call


# Traces of a registered mod made again for what a graph passes (see mod_inputs), per (mod, what
# its trace depends on: the captured tensors' shapes, dtypes and requires_grad, the constants).
_RETRACED: dict = {}
_RETRACED_KEPT = 256


def mod_inputs(registered: Optional[RegisteredMod], tensors, numbers, device: torch.device) -> tuple:
    """``(traced mod, its layout, its captured values)`` for one call of the op: the user's tensors
    the probe noted, the constants the mod builds itself (on ``device``), then its numbers.

    A graph Dynamo compiled for one closure serves every closure of the same code (it guards the
    code, and passes what the closure reads), so the traced mod is checked against what this call
    passes: its tensors' shapes, dtypes and requires_grad, and the numbers the trace holds as
    constants ([Note] Numbers under torch.compile). A mismatch traces the mod again, reading this
    call's tensors and numbers (_retraced)."""
    if registered is None:
        return None, None, []
    traced, layout = registered.traced, registered.layout
    if not _holds(traced, layout, tensors, numbers):
        traced, layout = _retraced(registered, tensors, numbers, device)
    given = [tensors[position] for position, _, _ in layout.tensors]
    values = _all_captured(traced, given, device)
    by_input = {}
    for (what, i), given_number in zip(layout.numbers, numbers):
        if what == "input":
            by_input.setdefault(i, given_number)
    values.extend(by_input[i] for i in range(len(traced.numbers)))
    return traced, layout, values


def _holds(traced: TracedMod, layout: ModLayout, tensors, numbers) -> bool:
    """The trace is right for what the op was given (see mod_inputs)."""
    if len(numbers) != len(layout.numbers):
        return False
    for (what, value), given in zip(layout.numbers, numbers):
        if what == "constant" and not _same_value(value, given):
            return False
    users = [c for c in traced.captured if c.walk_index is not None]
    for c, (position, _, _) in zip(users, layout.tensors):
        t = tensors[position] if position < len(tensors) else None
        if t is None or t.dtype != c.dtype or tuple(t.shape) != c.shape or t.requires_grad != c.requires_grad:
            return False
    return True


def _same_value(a, b) -> bool:
    if type(a) is float or type(b) is float:
        return float(a) == float(b) or (a != a and b != b)
    return a == b


def _retraced(registered: RegisteredMod, tensors, numbers, device: torch.device) -> tuple:
    """The mod traced again reading this call's tensors and numbers: written, for the trace, where
    the registered callable reads its own (trace.with_values): the tensors at the captured inputs'
    places, each number the graph takes as a plain leaf at its leaf. A number the first trace used
    in Python (a constant of its graph) that Dynamo passes as another value can only be checked:
    when the trace still disagrees, the call raises rather than run a stale graph."""
    traced, layout = registered.traced, registered.layout
    kind = traced.kind
    users = [c for c in traced.captured if c.walk_index is not None]
    if len(tensors) < len(layout.tensors) or any(p >= len(tensors) for p, _, _ in layout.tensors):
        raise RuntimeError(f"flexattn: under torch.compile, {kind} '{traced.name}' read its tensors in another order "
                           "than when it ran eagerly; please report this with the mod's code")
    key = (registered, tuple((t.shape, t.dtype, t.requires_grad) for t in tensors),
           tuple((what, repr(given) if what == "constant" else type(given)) for (what, _), given
                 in zip(layout.numbers, numbers)), device)
    found = _RETRACED.get(key)
    if found is not None:
        return found
    by_walk = {c.walk_index: tensors[position] for c, (position, _, _) in zip(users, layout.tensors)}
    leaves = {}
    for (what, i), given in zip(layout.numbers, numbers):
        expr = traced.numbers[i].expr if what == "input" else None
        if expr is not None and expr[0] == "leaf":
            leaves[expr[1]] = given
    try:
        with with_values(registered.fn, by_walk, leaves):
            new, values = trace_mod(registered.fn, kind)
            new_layout = _layout(registered.fn, kind, new, values, device)
    except ValueError as err:
        raise InvalidInputError(f"{kind} '{traced.name}' under torch.compile: {err}") from err
    if not _holds(new, new_layout, tensors, numbers):
        constant = next(((value, given) for (what, value), given in zip(new_layout.numbers, numbers)
                         if what == "constant" and not _same_value(value, given)), None)
        what = (f"a number its graph holds as the constant {constant[0]!r} is {constant[1]!r} in this call"
                if constant else "the tensors it reads changed in a way its trace cannot follow")
        raise InvalidInputError(
            f"{kind} '{traced.name}' under torch.compile: {what}. The mod uses a number it reads in Python "
            "(an if, int(), math.sqrt(), a shape) that Dynamo keeps symbolic; compute that value outside the "
            "mod, or make the number static for Dynamo (torch._dynamo.mark_static, or a global constant)"
        )
    found = (new, new_layout)
    if len(_RETRACED) >= _RETRACED_KEPT:
        _RETRACED.clear()
    _RETRACED[key] = found
    return found


# ------------------------------------------------------------------------------------ the ops

# The dispatch state of plain eager code, taken when flexattn is imported.
_DISPATCH_STATE = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())
_NOTHING_TO_ENTER = nullcontext()
try:
    from torch._ops import _len_torch_dispatch_stack_pre_dispatch as _pre_dispatch_modes
except ImportError:  # pragma: no cover - every supported torch has it; without it, always enter
    def _pre_dispatch_modes() -> int:
        return 1


def _as_kernel():
    """The ops' bodies run as eager code, as in an eager call: no dispatch mode around them sees the
    ops inside, and the dispatch state is plain eager's. An op's body is called below autograd (the
    PyTorch backend's backward takes torch.autograd.grad of the score_mod, which needs autograd), and
    a dispatch mode calls ops with the functorch keys off (its torch.vmap fails; AOTAutograd wraps a
    graph's first run in such a mode, its check that a custom op's outputs do not alias its inputs).
    Grad mode stays the caller's: the forward's body runs without grad. Where that state holds
    already (a compiled graph's call, on the steady state's path) nothing is entered."""
    if (not torch._C._len_torch_dispatch_stack() and not _pre_dispatch_modes()
            and torch._C._dispatch_tls_local_include_set() == _DISPATCH_STATE[0]
            and torch._C._dispatch_tls_local_exclude_set() == _DISPATCH_STATE[1]):
        return _NOTHING_TO_ENTER
    stack = ExitStack()
    stack.enter_context(torch.utils._python_dispatch._disable_current_modes())
    stack.enter_context(torch._C._ForceDispatchKeyGuard(*_DISPATCH_STATE))
    return stack


def _all_captured(traced: Optional[TracedMod], given: list, device: torch.device) -> list:
    """The traced mod's captured inputs in graph order: the user's tensors given to the op, and the
    constants the mod builds itself (kept on the TracedMod, on ``device``)."""
    if traced is None or not traced.captured:
        return []
    fixed = traced.fixed_values_on(device) if device.type != "cpu" else [c.fixed_value for c in traced.captured]
    given = iter(given)
    return [next(given) if c.walk_index is not None else f for c, f in zip(traced.captured, fixed)]


def _block_mask(query, key, tables, block_size, seq_lengths, group: int, stats: Optional[RowStats] = None) -> BlockMask:
    """The op's tables as a BlockMask, with what earlier calls derived from them; ``stats``: row
    statistics to assume instead (for stand-in tables, whose contents mean nothing)."""
    L, S = query.shape[2], key.shape[2]
    if tables[0] is None:
        return dense_block_mask(L, S, query.device)
    tables = [None if t is None else t.contiguous() for t in tables]
    # What this call derives is kept for the next calls on its tables where allocations may be kept
    # (cuda_graphs.py): not in a CUDA-graph tree's warm-up, whose allocations are the graph's.
    mask = BlockMask.from_launch_tables(tuple(seq_lengths), *tables, BLOCK_SIZE=tuple(block_size), one_call=True,
                                        derived_kept=may_keep_allocations(query.device))
    kept = None if stats is not None else _kept(mask) or _checked(mask)
    if stats is not None:
        preset_row_stats(mask, stats)
    elif kept is not None:
        if kept.stats is not None:
            preset_row_stats(mask, kept.stats)
        if kept.backward is not None:
            mask.preset_derived(BACKWARD_TABLES, kept.backward)
        if kept.walks is not None:
            mask.preset_derived(PROGRAM_WALKS, kept.walks)
    else:
        hint = _SHAPES_CHECKED.get(_shape_of(mask))
        if hint is not None:  # see [Note] What a compiled call's mask derives, kept
            preset_row_stats(mask, RowStats(hint, False, False))
    assume_groups_differ(mask, group)
    return mask


# [Note] What a compiled call's mask derives, kept. Each call of the op makes a new BlockMask on the
# tables it is given, so what launches derive from a mask (BlockMask.derived) would be derived again
# at every call, for every layer. It is kept here instead, per table object, stamped like
# BlockMask.derived's data (the table objects, held weakly, their version counters, BLOCK_SIZE and
# the lengths), for the next calls on those very tables (every layer of a step, every step of a
# static mask):
# * the row statistics, which take reading the tables back: the first mask of each table shape that
#   a compiled call meets (outside a CUDA-graph capture) is checked once, at that call; a new mask of
#   a shape already met (one rebuilt every step) takes the trusted plan, without the forward's
#   consecutive-block path, so a step never waits for the GPU for its mask;
# * the backward's transposed tables (computed on the device), kept after a backward outside a
#   capture (inside one, they are written only when the graph replays);
# * the forward's program walks (kernels/hopper/forward.py [Note] Programs across query blocks, computed on
#   the device), kept after a forward that walked them (never inside a capture);
# * per table shape, the mean row length of the first mask checked: the density that the launch
#   choices (AUTO's Gluon or portable kernel, tile sizes) assume for a mask of that shape whose
#   contents the host does not know (one rebuilt every step, or the static copy a CUDA-graph capture
#   reads). Only speed depends on it: the consecutive-block flags, on which results depend, stay off.
_KEPT = WeakTensorKeyDictionary()  # kv_num_blocks -> _Kept
# table shape -> mean key blocks a row visits, of the first mask checked (None: its check raised)
_SHAPES_CHECKED: dict = {}
_SHAPES_KEPT = 1024  # lengths that keep changing (a decoding loop) must not pile up entries


class _Kept:
    # Warm entries (forward and backward) refer to it weakly.
    __slots__ = ("tables", "stamp", "stats", "backward", "walks", "__weakref__")

    def __init__(self, mask: BlockMask, stats: Optional[RowStats]):
        self.tables = _weak_refs((mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices))
        self.stamp = _stamp(mask)
        self.stats, self.backward, self.walks = stats, None, None


def _weak_refs(tables) -> tuple:
    return tuple(None if t is None else weakref.ref(t) for t in tables)


def _same_objects(refs: tuple, tables) -> bool:
    """Each table is the very object its weak reference was taken of (an id() that came back is not)."""
    return all((ref is None) == (t is None) and (ref is None or ref() is t) for ref, t in zip(refs, tables))


def _stamp(mask: BlockMask) -> tuple:
    tables = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)
    return tuple(-1 if t is None else version_of(t) for t in tables), mask.BLOCK_SIZE, mask.seq_lengths


def _kept(mask: BlockMask) -> Optional[_Kept]:
    """What was kept for these very tables, while its stamp holds."""
    kept = _KEPT.get(mask.kv_num_blocks)
    others = (mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)
    if kept is not None and kept.stamp == _stamp(mask) and _same_objects(kept.tables, others):
        return kept
    return None


def _shape_of(mask: BlockMask) -> tuple:
    nb = mask.kv_num_blocks
    return (tuple(nb.shape), tuple(mask.kv_indices.shape), mask.full_kv_num_blocks is not None, nb.device,
            mask.BLOCK_SIZE, mask.seq_lengths)


def _checked(mask: BlockMask) -> Optional[_Kept]:
    """The first mask of its table shape: checked now (one host sync) and kept, row statistics and all."""
    nb = mask.kv_num_blocks
    shape = _shape_of(mask)
    if shape in _SHAPES_CHECKED or capturing(nb):
        return None
    if len(_SHAPES_CHECKED) >= _SHAPES_KEPT:  # the oldest goes: a mask of its shape is checked again
        del _SHAPES_CHECKED[next(iter(_SHAPES_CHECKED))]
    _SHAPES_CHECKED[shape] = None
    checked = checked_launch_tables(mask)  # raises on tables out of range
    _SHAPES_CHECKED[shape] = checked.stats.mean_blocks
    same = (checked.kv_num_blocks is nb and checked.kv_indices is mask.kv_indices
            and (mask.full_kv_num_blocks is None or (checked.full_kv_num_blocks is mask.full_kv_num_blocks
                                                     and checked.full_kv_indices is mask.full_kv_indices)))
    # Reordered tables: the statistics are not those of the tables the op launches.
    kept = _KEPT[nb] = _Kept(mask, checked.stats if same else None)
    return kept


def _keep_backward_tables(mask: BlockMask) -> None:
    """After a backward on ``mask``: keep its transposed tables for the next calls on the same tables."""
    kept = _keep_derived(mask, BACKWARD_TABLES, lambda kept: kept.backward)
    if kept is not None:
        kept.backward = mask.peek_derived(BACKWARD_TABLES)


def _keep_program_walks(mask: BlockMask) -> None:
    """After a forward on ``mask``: keep the program walks it derived for the next calls on the same tables."""
    kept = _keep_derived(mask, PROGRAM_WALKS, lambda kept: kept.walks)
    if kept is not None:
        kept.walks = mask.peek_derived(PROGRAM_WALKS)


def _keep_derived(mask: BlockMask, key, held: Callable) -> Optional[_Kept]:
    """The record of ``mask``'s tables that should now hold what ``mask`` derived under ``key``
    (made if missing); None when nothing was derived, the record holds it already (no stream
    queries on the steady state's path), or nothing may be kept on the device now."""
    value = mask.peek_derived(key)
    kept = _kept(mask)
    if value is None or (kept is not None and held(kept) is value):
        return None
    if not may_keep_allocations(mask.kv_num_blocks.device):
        return None
    if kept is None:
        kept = _KEPT[mask.kv_num_blocks] = _Kept(mask, None)
    return kept


class _Mods(NamedTuple):
    """One op call's mods: the traced mods and their captured values (mod_inputs)."""

    options: dict
    score: Optional[TracedMod]
    score_layout: Optional[ModLayout]
    score_values: list
    mask: Optional[TracedMod]
    mask_values: list


def _mods(call_key: str, score_captured, score_numbers, mask_captured, mask_numbers, device) -> _Mods:
    registered = registered_call(call_key)
    score, score_layout, score_values = mod_inputs(registered.score, score_captured, score_numbers, device)
    mask, _, mask_values = mod_inputs(registered.mask, mask_captured, mask_numbers, device)
    return _Mods(registered.options, score, score_layout, score_values, mask, mask_values)


def _call(mods: _Mods, query, key_t, tables, block_size, seq_lengths, scale, needs_grad, need_max,
          stats: Optional[RowStats] = None) -> Call:
    """The Call of one op call (request.build_call), on the op's tables as a BlockMask."""
    block_mask = _block_mask(query, key_t, tables, block_size, seq_lengths, query.shape[1] // key_t.shape[1], stats)
    return build_call(query, key_t.shape[2], block_mask, mods.score, mods.mask, mods.mask_values, mods.options, scale,
                      needs_grad, need_max)


# [Note] The ops' registration. The ops are defined with torch.library.Library and their bodies
# registered for CompositeExplicitAutograd directly, not through torch.library.custom_op: that
# wraps each body in a Dynamo-disabling context and an aliasing check, about 200 us a call on the
# H200 machine's host (an op body is 130 us), paid by every layer's forward and backward of a
# compiled step. The bodies return fresh tensors only, which is what that check checks.
_LIBRARY = torch.library.Library("flexattn", "DEF")
_LIBRARY.define(
    "flex_attention(Tensor query, Tensor key, Tensor value, Tensor? kv_num_blocks, Tensor? kv_indices, "
    "Tensor? full_kv_num_blocks, Tensor? full_kv_indices, Tensor[] score_captured, Tensor[] mask_captured, "
    "Scalar[] score_numbers, Scalar[] mask_numbers, str call_key, SymInt[] block_size, SymInt[] seq_lengths, "
    "float scale, bool needs_grad, bool need_max) -> (Tensor, Tensor, Tensor)")
_LIBRARY.define(
    "flex_attention_backward(Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, Tensor grad_out, "
    "Tensor? grad_lse, Tensor? kv_num_blocks, Tensor? kv_indices, Tensor? full_kv_num_blocks, "
    "Tensor? full_kv_indices, Tensor[] score_captured, Tensor[] mask_captured, Scalar[] score_numbers, "
    "Scalar[] mask_numbers, str call_key, SymInt[] block_size, SymInt[] seq_lengths, float scale, "
    "bool[] captured_grads) -> (Tensor, Tensor, Tensor, Tensor[])")


def _forward_body(query, key, value, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, score_captured,
                  mask_captured, score_numbers, mask_numbers, call_key, block_size, seq_lengths, scale, needs_grad,
                  need_max):
    """``(out, lse, max_scores)``; max_scores is empty unless asked for."""
    with _as_kernel():
        return _forward(query, key, value, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                        score_captured, mask_captured, score_numbers, mask_numbers, call_key, block_size, seq_lengths,
                        scale, needs_grad, need_max)


def _forward(query, key, value, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, score_captured,
             mask_captured, score_numbers, mask_numbers, call_key, block_size, seq_lengths, scale, needs_grad,
             need_max):
    tables = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    mods = _mods(call_key, score_captured, score_numbers, mask_captured, mask_numbers, query.device)
    problem = None
    if kv_num_blocks is not None:
        problem = _warm_problem(query, key, value, tables, score_captured, mask_captured, call_key, mods, block_size,
                                seq_lengths, scale, needs_grad, need_max)
        warm = None if problem is None else _WARM.get(problem)
        outputs = None
        if warm is not None and warm.tables.holds(tables):
            outputs = warm.run(query, key, value, tables, mods.score_values, mods.mask_values)
        if outputs is not None:
            return _forward_outputs(query, *outputs, need_max)
    call = _call(mods, query, key, tables, block_size, seq_lengths, scale, needs_grad, need_max)
    score = mods.score_values
    if needs_grad:
        prepare_backward(call, query, key, value, score)
    out, lse, mx = run_forward(call, query, key, value, score, True, need_max)
    if kv_num_blocks is not None:
        _keep_program_walks(call.block_mask)
    if problem is not None:
        _remember_warm(problem, call, query, key, value, tables, need_max)
    return _forward_outputs(query, out, lse, mx, need_max)


def _forward_outputs(query, out, lse, mx, need_max: bool):
    mx = mx.contiguous() if need_max else query.new_empty(0, dtype=torch.float32)
    return out, lse.contiguous(), mx  # out already in its layout (run_forward)


# [Note] Warm calls of the forward op. A compiled step calls the op once per layer with the same
# problem: the same mods and options (the call key), the same shapes, strides and dtypes, the same
# BlockMask tables. The first call decides (backend, Gluon or portable kernel, the plan) and prepares
# the backward; in a real step that took 350 to 650 us of host time per call on the H200 machine,
# where the GPU of a 16k-token layer needs about 1.5 ms and of a 4k one less, so the host fell behind
# in the forward of the first layers. Later calls of that problem launch the kept plan directly: new
# outputs, new descriptors, the launch. What a call's decisions read is its key (``_warm_problem``):
# * everything the op passes but the tensors' contents: the call key, lengths, block sizes, scale,
#   needs_grad and need_max, and for q, k, v and each captured tensor its shape, strides, dtype,
#   device, requires_grad and whether its address is 16-byte aligned (tensor descriptors need it);
# * the tables by identity, version counter, address, shape and strides: the launch's row
#   statistics (the consecutive-block flags change the kernel's results) were found for those very
#   tables at that version (kept or checked, [Note] What a compiled call's mask derives, kept). A
#   table freed and another made at the same id() is told apart by a weak reference to the first
#   (``_WarmTables.holds``); a table written in place has a new version: the call goes the long
#   way, and makes its own entry;
# * the process state the choices read: the interpreter switch, float32 matmul precision, torch's
#   determinism switch.
# None inside a CUDA-graph capture: its replays must read the tables as they are then, with no
# consecutive-block flags or transposed tables found before it (kernels/tables.py [Note] Tables read
# at each replay).
# Only a call that launched one settled plan of the portable or Gluon forward is kept (forward_relaunch
# in dispatch.py); the captured tensors' contents are read at launch, so new contents need no new entry.
_WARM: dict = {}  # problem -> _WarmForward
_WARM_KEPT = 512  # cleared when full: a new entry costs one call the long way


class _WarmTables(NamedTuple):
    """What a warm entry (forward or backward) keeps of its first call's tables and mods."""

    refs: tuple  # weak references to the op's four tables (None where absent)
    stats: RowStats  # what the first call's launch found in them
    has_full: bool
    plan_key: tuple
    score: Optional[TracedMod]
    mask: Optional[TracedMod]

    def holds(self, tables) -> bool:
        return _same_objects(self.refs, tables)

    def arguments(self, tables, score_values, mask_values) -> tuple:
        """``(launch tables, the score_mod's captured values, the mask_mod's)`` of a warm launch:
        the op's tables as the launch reads them, with what the first call found for them."""
        nb, idx, fnb, fidx = tables
        full = self.has_full
        launch = LaunchTables(nb, idx, fnb if full else nb, fidx if full else idx, full, self.stats, self.plan_key)
        return launch, score_values, mask_values


def _warm_tables(call: Call, tables) -> Optional[_WarmTables]:
    """The tables' part of a warm entry, from the launch that just ran; None when it read copies of
    the op's tables (tables made contiguous or reordered), not the tables themselves."""
    launched = launch_tables(call.block_mask)  # derived by that launch
    nb, idx, fnb, fidx = tables
    if not (launched.kv_num_blocks is nb and launched.kv_indices is idx and launched.has_full == (fnb is not None)
            and (fnb is None or (launched.full_kv_num_blocks is fnb and launched.full_kv_indices is fidx))):
        return None
    return _WarmTables(_weak_refs(tables), launched.stats, launched.has_full, launched.plan_key, call.score, call.mask)


def _keep_warm(entries: dict, problem: tuple, entry) -> None:
    if len(entries) >= _WARM_KEPT:
        entries.clear()
    entries[problem] = entry


class _WarmForward(NamedTuple):
    tables: _WarmTables
    relaunch: Callable
    walks_of: Optional[weakref.ref]  # a launch of program walks: the _Kept that holds the tables' walks

    def run(self, query, key, value, tables, score_values, mask_values):
        """``(out, lse, max or None)``, or None when the walks kept for the tables are gone (the long
        way then)."""
        arguments = self.tables.arguments(tables, score_values, mask_values)
        if self.walks_of is None:
            return self.relaunch(query, key, value, *arguments)
        kept = self.walks_of()
        if kept is None or kept.walks is None or _KEPT.get(tables[0]) is not kept:
            return None
        return self.relaunch(query, key, value, *arguments, walks=kept.walks)


def _warm_problem(query, key, value, tables, score_captured, mask_captured, call_key: str, mods: _Mods, block_size,
                  seq_lengths, scale, needs_grad, need_max) -> Optional[tuple]:
    """The key of [Note] Warm calls of the forward op; None for tables without a version counter. The
    traced mods as well as the call key: the constants among the numbers chose them (mod_inputs);
    the numbers' values are read at launch ([Note] Numbers under torch.compile)."""
    return _warm_key([call_key, mods.score, mods.mask, tuple(block_size), tuple(seq_lengths), scale, needs_grad,
                      need_max], (query, key, value, *score_captured, *mask_captured), tables)


def _warm_key(parts: list, tensors: tuple, tables: tuple, grad_flags: bool = True) -> Optional[tuple]:
    """``parts`` with the process state the choices read, the facts of each tensor (None allowed;
    ``grad_flags``: requires_grad among them, which the forward's choices read and the backward's
    do not) and the tables' identities: a key of [Note] Warm calls of the forward op and of the
    backward's."""
    if tables[0] is not None and capturing(tables[0]):
        return None  # a capture takes the long way: kernels/tables.py [Note] Tables read at each replay
    parts += [interpreter_enabled(), torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled()]
    for t in tensors:
        parts.append(None if t is None else (t.shape, t.stride(), t.dtype, t.device, grad_flags and t.requires_grad,
                                             t.data_ptr() & 15))
    for t in tables:
        if t is not None and t.is_inference():
            return None  # no version counter to follow (masks/block_mask.py version_of)
        parts.append(None if t is None else (id(t), t._version, t.data_ptr(), t.shape, t.stride(), t.dtype, t.device))
    return tuple(parts)


def _remember_warm(problem: tuple, call: Call, query, key, value, tables, need_max: bool) -> None:
    warm_tables = _warm_tables(call, tables)
    relaunch = None if warm_tables is None else forward_relaunch(call, query, key, value, need_max)
    if relaunch is None:
        return
    walks_of = None
    if getattr(relaunch, "takes_walks", False):
        kept = _kept(call.block_mask)
        if kept is None or kept.walks is None:
            return  # the walks could not be kept: later calls derive them, the long way
        walks_of = weakref.ref(kept)
    _keep_warm(_WARM, problem, _WarmForward(warm_tables, relaunch, walks_of))


_LIBRARY.impl("flex_attention", _forward_body, "CompositeExplicitAutograd")
flex_attention_op = torch.ops.flexattn.flex_attention


@torch.library.register_fake("flexattn::flex_attention", lib=_LIBRARY)
def _(query, key, value, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, score_captured,
      mask_captured, score_numbers, mask_numbers, call_key, block_size, seq_lengths, scale, needs_grad, need_max):
    _compile_ahead_while_tracing(query, key, value, (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices),
                                 score_captured, mask_captured, score_numbers, mask_numbers, call_key, block_size,
                                 seq_lengths, scale, needs_grad)
    B, Hq, L, _ = query.shape
    shape, dims = output_layout(query, value.shape[3])  # the layout the kernels write, strides and all
    out = query.new_empty(shape).permute(dims)
    lse = query.new_empty((B, Hq, L), dtype=torch.float32)
    mx = query.new_empty((B, Hq, L) if need_max else (0,), dtype=torch.float32)
    return out, lse, mx


# [Note] Kernels compiled while the graph is traced. The fake implementation is the first place a
# compiled call's shapes are known: Dynamo calls it while tracing, seconds before Inductor has
# compiled the graph and the op first runs. There, once per problem, the op's forward and backward
# run on stand-ins with their launches recorded ([Note] Kernels compiled ahead in kernels/ahead.py),
# so that worker processes compile the kernels while Inductor works. The stand-ins: empty q, k, v
# with the real sizes, strides and dtype (allocated for that moment: the kernels' choices read
# their layout and alignment), zero tables of the real shapes with the row statistics assumed of
# tables whose contents are not known (every row visits every listed column), and zero captured
# tensors. A guess that differs from the real call (the real tables' statistics choose other
# kernels) costs a worker's time, never a result: the real call compiles what it launches.
_TRACED_AHEAD: set = set()


def _compile_ahead_while_tracing(query, key, value, tables, score_captured, mask_captured, score_numbers,
                                 mask_numbers, call_key, block_size, seq_lengths, scale, needs_grad) -> None:
    if query.device.type != "cuda" or not ahead.enabled():
        return
    given = [query, key, value, *[t for t in tables if t is not None], *score_captured, *mask_captured]
    if not all(isinstance(s, int) for t in given for s in (*t.shape, *t.stride())):  # dynamic shapes
        return
    if not all(type(n) in (bool, int, float) for n in (*score_numbers, *mask_numbers)):  # symbolic numbers
        return
    problem = (call_key, tuple((tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad) for t in given),
               tuple(t is None for t in tables), tuple(block_size), tuple(seq_lengths), scale > 0, needs_grad,
               query.device)
    if problem in _TRACED_AHEAD:
        return
    if len(_TRACED_AHEAD) >= 1024:
        _TRACED_AHEAD.clear()
    _TRACED_AHEAD.add(problem)
    try:
        with _as_kernel(), torch.no_grad():
            def like(t):
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)

            def zeros(t):
                return None if t is None else torch.zeros(t.shape, dtype=t.dtype, device=t.device)

            q, k, v = like(query), like(key), like(value)
            stand_in = [zeros(t) for t in tables]
            stats = None if tables[1] is None else RowStats(float(tables[1].shape[-1]), False, False)
            mods = _mods(call_key, [zeros(t).requires_grad_(t.requires_grad) for t in score_captured], score_numbers,
                         [zeros(t) for t in mask_captured], mask_numbers, q.device)
            call = _call(mods, q, k, stand_in, block_size, seq_lengths, scale, needs_grad, False, stats)
            compile_ahead(call, q, k, v, mods.score_values, forward=True, backward=needs_grad)
    except Exception:  # noqa: BLE001 - only the head start is lost (an out-of-memory GPU, a mod's probe)
        return


def _backward_body(query, key, value, out, lse, grad_out, grad_lse, kv_num_blocks, kv_indices, full_kv_num_blocks,
                   full_kv_indices, score_captured, mask_captured, score_numbers, mask_numbers, call_key, block_size,
                   seq_lengths, scale, captured_grads):
    """``(dq, dk, dv, [gradient of each score_mod tensor marked in captured_grads])``."""
    with _as_kernel():
        return _backward_impl(query, key, value, out, lse, grad_out, grad_lse, kv_num_blocks, kv_indices,
                              full_kv_num_blocks, full_kv_indices, score_captured, mask_captured, score_numbers,
                              mask_numbers, call_key, block_size, seq_lengths, scale, captured_grads)


def _backward_impl(query, key, value, out, lse, grad_out, grad_lse, kv_num_blocks, kv_indices, full_kv_num_blocks,
                   full_kv_indices, score_captured, mask_captured, score_numbers, mask_numbers, call_key, block_size,
                   seq_lengths, scale, captured_grads):
    tables = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    # Saved tensors come back without requires_grad; the PyTorch backend reads it to know which
    # gradients to compute.
    score_captured = [t.detach().requires_grad_(wanted) for t, wanted in zip(score_captured, captured_grads)]
    mods = _mods(call_key, score_captured, score_numbers, mask_captured, mask_numbers, query.device)
    problem = None
    if kv_num_blocks is not None and not any(captured_grads):
        problem = _warm_key([call_key, mods.score, mods.mask, tuple(block_size), tuple(seq_lengths), scale, "backward"],
                            (query, key, value, out, lse, grad_out, grad_lse, *score_captured, *mask_captured), tables,
                            grad_flags=False)  # the first backward of a compiled graph may see other flags
        warm = None if problem is None else _WARM_BACKWARD.get(problem)
        grads = None
        if warm is not None and warm.tables.holds(tables):
            grads = warm.run(query, key, value, out, lse, grad_out, grad_lse, tables, mods.score_values,
                             mods.mask_values)
        if grads is not None:
            dq, dk, dv = grads
            return dq.to(query.dtype).contiguous(), dk.to(key.dtype).contiguous(), dv.to(value.dtype).contiguous(), []
    call = _call(mods, query, key, tables, block_size, seq_lengths, scale, True, False)
    dq, dk, dv, d_all = run_backward(call, query, key, value, out, lse, grad_out, grad_lse, mods.score_values)
    if kv_num_blocks is not None:
        _keep_backward_tables(call.block_mask)
        if problem is not None:
            _remember_warm_backward(problem, call, query, key, value, out, grad_out, grad_lse, tables)
    # The gradients of the noted tensors the op was asked for, in the op's order: each from the
    # captured input it is (ModLayout.tensors), zero where the mod does not read it.
    traced = call.score
    d_noted: list = [None] * len(score_captured)
    if traced is not None:
        users = [(c, g) for c, g in zip(traced.captured, d_all) if c.walk_index is not None]
        for (captured, grad), (position, _, _) in zip(users, mods.score_layout.tensors):
            if captured_grads[position] and not captured.requires_grad:  # the traced mod would drop it
                raise RuntimeError(f"flexattn: score_mod '{traced.name}' was traced with '{captured.name}' not "
                                   "requiring grad, but the compiled graph passes it requiring grad")
            d_noted[position] = grad
    d_captured = [_gradient_like(g, t) for g, t, wanted in zip(d_noted, score_captured, captured_grads) if wanted]
    return dq.to(query.dtype).contiguous(), dk.to(key.dtype).contiguous(), dv.to(value.dtype).contiguous(), d_captured


# [Note] Warm calls of the backward op. The backward op is called once per layer with the same
# problem too, and its long way (the decisions, the transposed tables looked up, seven Gluon
# descriptors built and checked, three launches through Triton's own binding) took 400 to 700 us of
# host time a call at the 4k model's shape on the H200 machine's host. In a compiled step of 12 such
# layers that put the host's time per step (34 ms) close to the GPU's (38 ms), so any host
# slowness stalled the GPU. Later calls of a problem launch what the first kept
# (``backward_relaunch`` in dispatch.py, the families' ``warm_launch``), keyed like the forward's
# ([Note] Warm calls of the forward op) on everything the op passes but the tensors' contents: q, k,
# v, the output, LSE, its gradient, dLSE and the captured tensors (shape, strides, dtype, device,
# alignment), the tables by identity and version, the process state (determinism included: it
# decides whether dQ is fused). Two more conditions: no captured tensor wants a gradient (those
# calls take the long way), and the transposed tables the first call walked are the ones kept for
# these tables ([Note] What a compiled call's mask derives, kept); the entry holds that record
# weakly and checks it is still the current one, so tables that died or changed never lend theirs.
_WARM_BACKWARD: dict = {}  # problem -> _WarmBackward


class _WarmBackward(NamedTuple):
    tables: _WarmTables
    kept: weakref.ref  # the _Kept whose transposed tables the first call walked
    relaunch: Callable

    def run(self, query, key, value, out, lse, grad_out, grad_lse, tables, score_values, mask_values):
        """``(dq, dk, dv)``, or None when the kept transposed tables are gone (the long way then)."""
        kept = self.kept()
        if kept is None or kept.backward is None or _KEPT.get(tables[0]) is not kept:
            return None
        launch, score, mask = self.tables.arguments(tables, score_values, mask_values)
        return self.relaunch(query, key, value, out, lse, grad_out, grad_lse, launch, kept.backward, score, mask)


def _remember_warm_backward(problem: tuple, call: Call, query, key, value, out, grad_out, grad_lse, tables) -> None:
    mask = call.block_mask
    kept = _kept(mask)
    if kept is None or kept.backward is None or kept.backward is not mask.peek_derived(BACKWARD_TABLES):
        return  # the transposed tables this call walked are not kept (a capture, a side stream)
    warm_tables = _warm_tables(call, tables)
    relaunch = None if warm_tables is None else backward_relaunch(call, query, key, value, out, grad_out, grad_lse)
    if relaunch is not None:
        _keep_warm(_WARM_BACKWARD, problem, _WarmBackward(warm_tables, weakref.ref(kept), relaunch))


def _gradient_like(grad: Optional[torch.Tensor], tensor: torch.Tensor) -> torch.Tensor:
    if grad is None:  # the mod's value does not depend on it
        return torch.zeros(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return grad.to(tensor.dtype).reshape(tensor.shape).contiguous()


_LIBRARY.impl("flex_attention_backward", _backward_body, "CompositeExplicitAutograd")
flex_attention_backward_op = torch.ops.flexattn.flex_attention_backward


@torch.library.register_fake("flexattn::flex_attention_backward", lib=_LIBRARY)
def _(query, key, value, out, lse, grad_out, grad_lse, kv_num_blocks, kv_indices, full_kv_num_blocks,
      full_kv_indices, score_captured, mask_captured, score_numbers, mask_numbers, call_key, block_size, seq_lengths,
      scale, captured_grads):
    d_captured = [t.new_empty(t.shape) for t, wanted in zip(score_captured, captured_grads) if wanted]
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), d_captured


def _setup_context(ctx, inputs, output):
    (query, key, value, nb, idx, fnb, fidx, score_captured, mask_captured, score_numbers, mask_numbers, call_key,
     block_size, seq_lengths, scale, needs_grad, need_max) = inputs
    out, lse, _ = output
    ctx.save_for_backward(query, key, value, out, lse, nb, idx, fnb, fidx, *score_captured, *mask_captured)
    ctx.counts = (len(score_captured), len(mask_captured))
    ctx.static = (score_numbers, mask_numbers, call_key, block_size, seq_lengths, scale)
    ctx.captured_grads = [t.requires_grad for t in score_captured]
    ctx.mark_non_differentiable(output[2])


def _backward(ctx, grad_out, grad_lse, grad_max):
    query, key, value, out, lse, nb, idx, fnb, fidx, *captured = ctx.saved_tensors
    n_score, n_mask = ctx.counts
    score_captured, mask_captured = captured[:n_score], captured[n_score:]
    score_numbers, mask_numbers, call_key, block_size, seq_lengths, scale = ctx.static
    dq, dk, dv, d_given = flex_attention_backward_op(
        query, key, value, out, lse, grad_out, grad_lse, nb, idx, fnb, fidx, score_captured, mask_captured,
        score_numbers, mask_numbers, call_key, block_size, seq_lengths, scale, ctx.captured_grads)
    d_given = iter(d_given)
    d_captured = [next(d_given) if wanted else None for wanted in ctx.captured_grads]
    # A list of numbers takes None (its structure to autograd: a leaf), an empty one the empty list.
    no_grad = [None if numbers else [] for numbers in (score_numbers, mask_numbers)]
    return (dq, dk, dv, None, None, None, None, d_captured, [None] * n_mask, *no_grad, None, None, None, None, None, None)


# [Note] The forward op's autograd kernel. A compiled graph calls the op with gradients off (the
# graph's own backward takes care of them), yet every call passes through the op's autograd kernel:
# the one torch.library.register_autograd installs checks for gradients in Python and then
# redispatches below autograd, a second trip through the dispatcher, C++ and back, before the body
# runs (about 80 us of the op's 340 us of host time on the H200 machine's host). So the kernel
# registered here calls the body itself when no gradient is needed and nothing sits between autograd
# and the device's own kernel: no tensor subclass or dispatch mode (fake tensors, functionalization:
# the Python key), no functionalization wrapper. Everything else, gradients included, goes through
# the kernel register_autograd would have made (torch._library.autograd.make_autograd_impl; where a
# torch release lacks it, register_autograd itself, without the shortcut).
_BODY_RUNS_ON = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)


def _register_forward_autograd() -> None:
    op = flex_attention_op.default
    try:
        from torch._library.autograd import Info, make_autograd_impl

        with_autograd = make_autograd_impl(op, Info(_backward, _setup_context))
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - a torch release without them
        torch.library.register_autograd("flexattn::flex_attention", _backward, setup_context=_setup_context)
        return
    after_autograd = torch._C._after_autograd_keyset
    in_place_or_view = torch._C.DispatchKey.ADInplaceOrView
    any_requires_grad = torch._C._any_requires_grad

    def autograd_kernel(keyset, *args):
        below = (keyset & after_autograd).remove(in_place_or_view)
        if (below.highestPriorityTypeId() in _BODY_RUNS_ON
                and not (torch.is_grad_enabled() and any_requires_grad(*args))):
            return _forward_body(*args)
        return with_autograd(keyset, *args)

    _LIBRARY.impl("flex_attention", autograd_kernel, "Autograd", with_keyset=True)


_register_forward_autograd()
