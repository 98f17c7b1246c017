"""The index lengths of one call, and what the lowering's range analysis says about them.

A mod's integer arithmetic on ``b``, ``h``, ``q_idx`` and ``kv_idx`` is exact, like Python
integers: int64 wherever a value can leave int32 at the call's lengths, int32 otherwise (so common
mods keep their speed). ``flexattn.lowering`` decides both per call from its sympy ranges:

* ``lowering_variant(traced, bounds)``: which source the kernels get (runtime caches kernels by it);
* ``needs_wide_indices(traced, bounds)``: whether the vmap-based paths (the BlockMask builder and
  the PyTorch backend) must pass int64 index tensors.

Everything outside the lowering asks through this module. A lowering that predates these two
functions gets the fallbacks below: no variant (one kernel, lowered for any lengths) and int64
index tensors whenever the mod multiplies or shifts integers, or adds them at lengths near 2**31.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Optional

import torch

from . import lowering
from .trace import TracedMod, trace_mod

__all__ = ["index_bounds", "lowering_variant", "needs_wide_indices", "index_dtype", "mod_index_dtype"]


@dataclass(frozen=True)
class _IndexBounds:
    """Exclusive upper bounds of a mod's index arguments in one call:
    0 <= b < B, 0 <= h < H, 0 <= q_idx < Q_LEN, 0 <= kv_idx < KV_LEN."""

    B: int
    H: int
    Q_LEN: int
    KV_LEN: int


def index_bounds(B: int, H: int, Q_LEN: int, KV_LEN: int):
    """The lowering's IndexBounds (this module's stand-in when the lowering has none)."""
    cls = getattr(lowering, "IndexBounds", _IndexBounds)
    return cls(B=B, H=H, Q_LEN=Q_LEN, KV_LEN=KV_LEN)


def lowering_variant(traced: TracedMod, bounds) -> Optional[Hashable]:
    """The bound-dependent lowering decisions for this call; None: one variant for every length."""
    decide = getattr(lowering, "lowering_variant", None)  # looked up per call: tests stub it
    return None if decide is None else decide(traced, bounds)


_GROWING_OPS = {
    torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar, torch.ops.aten.pow.Tensor_Scalar,
    torch.ops.aten.pow.Tensor_Tensor, torch.ops.aten.pow.Scalar, torch.ops.aten.__lshift__.Scalar,
    torch.ops.aten.__lshift__.Tensor, torch.ops.aten.bitwise_left_shift.Tensor,
    torch.ops.aten.bitwise_left_shift.Tensor_Scalar, torch.ops.aten.cumsum.default,
}
_ADDING_OPS = {
    torch.ops.aten.add.Tensor, torch.ops.aten.add.Scalar, torch.ops.aten.sub.Tensor,
    torch.ops.aten.sub.Scalar, torch.ops.aten.rsub.Scalar, torch.ops.aten.rsub.Tensor,
}


def _fallback_needs_wide(traced: TracedMod, bounds) -> bool:
    # Conservative stand-in for the lowering's range analysis: any integer product or shift may
    # leave int32; sums only when the lengths themselves come near it.
    near_limit = max(bounds.B, bounds.H, bounds.Q_LEN, bounds.KV_LEN) >= 1 << 29
    for node in traced.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype.is_floating_point or val.dtype == torch.bool:
            continue
        if node.target in _GROWING_OPS or (near_limit and node.target in _ADDING_OPS):
            return True
    return False


def needs_wide_indices(traced: TracedMod, bounds) -> bool:
    """True when the mod's integer arithmetic can leave int32 at these bounds."""
    decide = getattr(lowering, "needs_wide_indices", None)
    return bool((decide or _fallback_needs_wide)(traced, bounds))


# [Note] Cache keys: keyed by the TracedMod object itself (compared by identity, kept alive by
# the key, so its id cannot be reused) and the plain-int bounds; bounded.
_WIDE: "OrderedDict[tuple, bool]" = OrderedDict()
_WIDE_SIZE = 256


def index_dtype(*traced: Optional[TracedMod], bounds) -> torch.dtype:
    """int64 when any of these traced mods needs wide indices at ``bounds``, else int32."""
    key = (traced, bounds)
    wide = _WIDE.get(key)
    if wide is None:
        wide = any(needs_wide_indices(t, bounds) for t in traced if t is not None)
        _WIDE[key] = wide
        if len(_WIDE) > _WIDE_SIZE:
            _WIDE.popitem(last=False)
    return torch.int64 if wide else torch.int32


def mod_index_dtype(fn, kind: str, B: int, H: int, Q_LEN: int, KV_LEN: int) -> torch.dtype:
    """The index dtype for evaluating the callable ``fn`` with vmap at these lengths.

    A mod that cannot be traced (it may still run under vmap) keeps int32, as before.
    """
    try:
        traced, _ = trace_mod(fn, kind)
    except Exception:
        return torch.int32
    return index_dtype(traced, bounds=index_bounds(B, H, Q_LEN, KV_LEN))
