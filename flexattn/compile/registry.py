"""The mods' registry: register_call traces both mods with flexattn's tracer and registers them
under a key made from their content (the string constant a compiled graph holds); each call of the
ops finds them again by that key and checks the trace against what the graph passes
(``mod_inputs``), tracing again when it no longer holds. [Note] flex_attention under torch.compile
in compile/__init__.py."""

from __future__ import annotations

import hashlib
from typing import Callable, NamedTuple, Optional

import torch

from ..errors import InvalidInputError
from ..request import check_captured_devices
from ..trace import TracedMod, TracedNumber, trace_mod, with_stand_ins, with_values
from .probe import probe, rebuilt

__all__ = ["ModLayout", "RegisteredMod", "RegisteredCall", "OP_CONTRACT", "register_call", "registered_call",
           "mod_inputs"]


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
    score = _register_mod(rebuilt(score_mod), "score_mod", device)
    mask = _register_mod(rebuilt(mask_mod), "mask_mod", device)
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


def _all_captured(traced: Optional[TracedMod], given: list, device: torch.device) -> list:
    """The traced mod's captured inputs in graph order: the user's tensors given to the op, and the
    constants the mod builds itself (kept on the TracedMod, on ``device``)."""
    if traced is None or not traced.captured:
        return []
    fixed = traced.fixed_values_on(device) if device.type != "cpu" else [c.fixed_value for c in traced.captured]
    given = iter(given)
    return [next(given) if c.walk_index is not None else f for c, f in zip(traced.captured, fixed)]
