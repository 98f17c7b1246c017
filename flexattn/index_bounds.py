"""The index lengths of one call, and what the lowering's range analysis says about them.

A mod's integer arithmetic on ``b``, ``h``, ``q_idx`` and ``kv_idx`` is exact, like Python
integers: int64 wherever a value can leave int32 at the call's lengths, int32 otherwise (so common
mods keep their speed). ``flexattn.lowering`` decides both per call from its sympy ranges:

* ``lowering_variant(traced, bounds)``: which source the kernels get (runtime caches kernels by it);
* ``needs_wide_indices(traced, bounds)``: whether the vmap-based paths (the BlockMask builder and
  the PyTorch backend) must pass int64 index tensors.

Everything outside the lowering asks through this module, which also caches the vmap paths'
answer per (traced mods, bounds).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional

import torch

from . import lowering
from .trace import TracedMod, trace_mod

__all__ = ["index_bounds", "lowering_variant", "needs_wide_indices", "index_dtype", "mod_index_dtype"]


def index_bounds(B: int, H: int, Q_LEN: int, KV_LEN: int) -> lowering.IndexBounds:
    """The exclusive upper bounds of b, h, q_idx and kv_idx in a call of these sizes."""
    return lowering.IndexBounds(B=B, H=H, Q_LEN=Q_LEN, KV_LEN=KV_LEN)


def lowering_variant(traced: TracedMod, bounds: lowering.IndexBounds) -> Hashable:
    """The bound-dependent lowering decisions for this call (runtime keys its kernels by them)."""
    return lowering.lowering_variant(traced, bounds)  # looked up per call: tests may stub it


def needs_wide_indices(traced: TracedMod, bounds: lowering.IndexBounds) -> bool:
    """True when the mod's integer arithmetic can leave int32 at these bounds."""
    return bool(lowering.needs_wide_indices(traced, bounds))


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
