"""Building blocks for score_mod and mask_mod callables, and the checks of their signatures.

A score_mod is ``score_mod(score, b, h, q_idx, kv_idx) -> score`` and a mask_mod is
``mask_mod(b, h, q_idx, kv_idx) -> bool``. Every argument is a 0-d tensor: the functions are written
for one (query, key) pair and flexattn applies them to whole tiles (by tracing for the kernels, by
``torch.vmap`` for the PyTorch backend and the reference).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import torch

from .errors import InvalidInputError, ModTraceError, definition_site, describe_mod

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = [
    "ScoreMod", "MaskMod", "identity_score_mod", "noop_mask", "and_masks", "or_masks", "mod_name", "check_mask_mod",
    "arity_mistake", "mod_factory", "FACTORY_ATTRIBUTE",
]

# Where a mod made by a mod_factory keeps how it was made: (factory, args, kwargs).
FACTORY_ATTRIBUTE = "__flexattn_factory__"


def mod_factory(factory: Callable) -> Callable:
    """Mark a function that returns a score_mod or mask_mod, so that the mods it makes inside a
    ``torch.compile``'d function may close over tensors made there (docs/compile.md).

    A closure created inside a compiled function has no Python object outside the graph for flexattn
    to trace; the mod remembers the call that made it, and flexattn traces the same call made again
    with tensors of the same shapes and dtypes. Everything the factory does must follow from its
    arguments (no other state). flexattn's own factories are marked::

        @flexattn.mod_factory
        def shifted(mask_mod, offset):          # offset: a tensor computed in the compiled step
            def mod(b, h, q_idx, kv_idx):
                return mask_mod(b, h, q_idx + offset, kv_idx)
            return mod
    """

    @functools.wraps(factory)
    def make(*args, **kwargs):
        mod = factory(*args, **kwargs)
        setattr(mod, FACTORY_ATTRIBUTE, (factory, args, kwargs))
        return mod

    return make


def identity_score_mod(score, b, h, q_idx, kv_idx):
    """The score_mod used when none is given: the score unchanged."""
    return score


def noop_mask(b, h, q_idx, kv_idx):
    """The mask_mod that keeps every (query, key) pair."""
    return q_idx >= 0  # a tensor, so vmap and tracing see a boolean tile rather than a Python bool


def _check_callables(name: str, mods) -> None:
    for i, mod in enumerate(mods):
        if not callable(mod):
            raise TypeError(f"{name}: argument {i} must be a mask_mod callable, got {type(mod).__name__}")
        # A mod of the wrong arity would fail only when the combination runs, at the call inside it.
        mistake = arity_mistake(mod, "mask_mod", name)
        if mistake:
            raise InvalidInputError(mistake)


def _kept_by(mod: MaskMod, combinator: str, b, h, q_idx, kv_idx) -> torch.Tensor:
    """``mod``'s result inside ``combinator``, checked: ``&`` and ``|`` would turn an integer result
    into an integer combination and fail on a float one, and the error would name the combination."""
    keep = mod(b, h, q_idx, kv_idx)
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
        got = keep.dtype if isinstance(keep, torch.Tensor) else f"{type(keep).__name__} ({keep!r})"
        # ModTraceError: what tracing raises for the same mistake, and lets through unchanged.
        raise ModTraceError(
            f"{describe_mod(mod, 'mask_mod')}, combined by {combinator}, must return a bool tensor (True = "
            f"attend), got {got}; compare instead, e.g. `q_idx >= kv_idx`, or use `.bool()` on a 0/1 result"
        )
    return keep


@mod_factory
def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod that keeps a pair only where every one of ``mask_mods`` keeps it."""
    _check_callables("and_masks", mask_mods)

    def and_mask(b, h, q_idx, kv_idx):
        keep = q_idx >= 0
        for mod in mask_mods:
            keep = keep & _kept_by(mod, "and_masks", b, h, q_idx, kv_idx)
        return keep

    and_mask.__name__ = "and_" + "_".join(getattr(m, "__name__", "mask") for m in mask_mods)
    return and_mask


@mod_factory
def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod that keeps a pair where any one of ``mask_mods`` keeps it."""
    _check_callables("or_masks", mask_mods)

    def or_mask(b, h, q_idx, kv_idx):
        keep = q_idx < 0
        for mod in mask_mods:
            keep = keep | _kept_by(mod, "or_masks", b, h, q_idx, kv_idx)
        return keep

    or_mask.__name__ = "or_" + "_".join(getattr(m, "__name__", "mask") for m in mask_mods)
    return or_mask


# --------------------------------------------------------------------------------------------
# Signatures: a mask_mod takes 4 arguments, a score_mod 5
# --------------------------------------------------------------------------------------------


def mod_name(fn) -> str:
    """The name errors and generated kernels use for a mod."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def check_mask_mod(mask_mod, where: str = "create_block_mask") -> None:
    if not callable(mask_mod):
        raise TypeError(
            f"mask_mod must be a callable mask_mod(b, h, q_idx, kv_idx) -> bool tensor, got {type(mask_mod).__name__}"
        )
    mistake = arity_mistake(mask_mod, "mask_mod", where)
    if mistake:
        raise InvalidInputError(mistake)


_MOD_ARGS = {"mask_mod": ("b", "h", "q_idx", "kv_idx"), "score_mod": ("score", "b", "h", "q_idx", "kv_idx")}


def _positional_arity(fn: Callable) -> Optional[tuple[int, int, bool, list[str]]]:
    """(required, accepted, takes *args, parameter names) of fn's positional parameters; None if unknown."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some C callables: nothing to check
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    variadic = any(p.kind == p.VAR_POSITIONAL for p in params)
    return len(required), len(positional), variadic, [p.name for p in positional]


def arity_mistake(fn: Callable, kind: str, where: str) -> Optional[str]:
    """What is wrong when ``fn``, passed as a ``kind`` ("mask_mod" or "score_mod"), cannot take that
    kind's arguments, and where ``fn`` is defined; None when it can (or its signature cannot be read)."""
    mistake = _arity_mistake(fn, kind, where)
    site = definition_site(fn)
    return f"{mistake}; {mod_name(fn)} is defined at {site}" if mistake and site else mistake


def _arity_mistake(fn: Callable, kind: str, where: str) -> Optional[str]:
    arity = _positional_arity(fn)
    if arity is None:
        return None
    required, accepted, variadic, names = arity
    expected = len(_MOD_ARGS[kind])
    if required <= expected and (accepted >= expected or variadic):
        return None
    name = mod_name(fn)
    took = f"{name}({', '.join(names)})"
    other = "score_mod" if kind == "mask_mod" else "mask_mod"
    if required == len(_MOD_ARGS[other]):  # the other kind of mod, passed in the wrong place
        if kind == "mask_mod":
            return (
                f"{where} got {took}, which takes 5 arguments: that is a score_mod (score, b, h, q_idx, "
                "kv_idx), and a mask_mod takes 4 (b, h, q_idx, kv_idx) and returns a bool tensor. Pass a "
                f"score_mod to flex_attention(q, k, v, score_mod={name}); to skip positions, write a "
                "mask_mod that returns True where a query may attend, e.g. "
                "`def causal(b, h, q_idx, kv_idx): return q_idx >= kv_idx`, and build the BlockMask from it"
            )
        return (
            f"{where} got score_mod={took}, which takes 4 arguments: that is a mask_mod (b, h, q_idx, "
            "kv_idx), and a score_mod takes 5 (score, b, h, q_idx, kv_idx) and returns the new score. Pass "
            f"a mask_mod as a BlockMask: flex_attention(q, k, v, block_mask=create_block_mask({name}, B, H, "
            "Q_LEN, KV_LEN))"
        )
    signature = ", ".join(_MOD_ARGS[kind])
    return (
        f"{where} got {kind} {took}, which takes {required} required positional argument"
        f"{'s' if required != 1 else ''}; a {kind} takes exactly {expected}: ({signature}). Fix: "
        f"def {name}({signature}): ... (extra parameters need default values)"
    )
