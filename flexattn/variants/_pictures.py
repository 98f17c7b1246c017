"""Text pictures of masks and biases at tiny sizes: the docstrings show them, the CLI prints them,
and tests/test_variants.py re-renders each docstring's picture to keep it true.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..trace import GathersReadZero

KEEP, DROP = "#", "-"
LEVELS = "0123456789"


def _grid(fn: Callable, with_score: bool, b: int, h: int, Q_LEN: int, KV_LEN: int) -> torch.Tensor:
    # The mod over every (q_idx, kv_idx) pair at one (b, h), with int64 indices (Python semantics).
    q = torch.arange(Q_LEN)
    kv = torch.arange(KV_LEN)
    bt, ht = torch.tensor(b), torch.tensor(h)
    if with_score:
        def pair(qi, ki):
            return fn(torch.zeros((), dtype=torch.float64), bt, ht, qi, ki)
    else:
        def pair(qi, ki):
            return fn(bt, ht, qi, ki)
    with torch.no_grad(), GathersReadZero():
        return torch.vmap(torch.vmap(pair, in_dims=(None, 0)), in_dims=(0, None))(q, kv)


def picture(mask_mod: Optional[Callable], Q_LEN: int, KV_LEN: int, b: int = 0, h: int = 0) -> str:
    """The mask at ``(b, h)`` as text: one line per query (top: q_idx 0), one character per key
    (left: kv_idx 0), ``#`` where the query attends to the key and ``-`` where it does not.
    ``mask_mod=None`` (no mask) keeps every pair.

    >>> print(picture(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 3, 4))
    #---
    ##--
    ###-
    """
    if mask_mod is None:
        kept = torch.ones(Q_LEN, KV_LEN, dtype=torch.bool)
    else:
        kept = _grid(mask_mod, False, b, h, Q_LEN, KV_LEN).bool()
    return "\n".join("".join(KEEP if x else DROP for x in row) for row in kept.tolist())


def bias_picture(score_mod: Callable, Q_LEN: int, KV_LEN: int, b: int = 0, h: int = 0,
                 mask_mod: Optional[Callable] = None) -> str:
    """What ``score_mod`` adds to a zero score at ``(b, h)``, as digits: ``0`` at the smallest value
    of the picture, ``9`` at the largest, evenly spaced between (all ``0`` when constant), and
    ``-`` where ``mask_mod`` (if given) drops the pair or the bias is ``-inf``.

    >>> print(bias_picture(lambda s, b, h, q_idx, kv_idx: s + (kv_idx - q_idx).abs(), 3, 4))
    0369
    3036
    6303
    """
    bias = _grid(score_mod, True, b, h, Q_LEN, KV_LEN).double()
    keep = torch.isfinite(bias)
    if mask_mod is not None:
        keep &= _grid(mask_mod, False, b, h, Q_LEN, KV_LEN).bool()
    if keep.any():
        lo, hi = bias[keep].min(), bias[keep].max()
        span = (hi - lo).item()
        level = torch.zeros_like(bias) if span == 0 else (bias - lo) / span * (len(LEVELS) - 1)
        level = level.round().clamp(0, len(LEVELS) - 1).long()
    else:
        level = torch.zeros_like(bias, dtype=torch.long)
    rows = []
    for row_level, row_keep in zip(level.tolist(), keep.tolist()):
        rows.append("".join(LEVELS[lv] if k else DROP for lv, k in zip(row_level, row_keep)))
    return "\n".join(rows)
