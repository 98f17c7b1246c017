"""The dense eager oracle: what flex_attention means, computed the obvious way.

Every other implementation in flexattn (the blockwise PyTorch path, the Triton kernels) is checked
against this function. It takes the user's own ``score_mod`` and ``mask_mod`` callables, not a
re-written copy, and applies them to the full ``[B, Hq, L, S]`` score matrix with four nested
``torch.vmap`` calls, one per index (b, h, q_idx, kv_idx). The cost is memory quadratic in the
sequence length, so it is meant for tests and small problems only.

Semantics, which the other paths must reproduce:

* ``scores = scale * q @ k^T`` (``scale`` defaults to ``1/sqrt(E)``), then
  ``post = where(mask_mod(b, h, q_idx, kv_idx), score_mod(scores, b, h, q_idx, kv_idx), -inf)``.
  ``h`` is the *query* head; with GQA query head ``h`` reads kv head ``h // (Hq // Hkv)``.
  The index arguments are int64, so integer arithmetic on them is exact, like Python integers
  (``q_idx * KV_LEN + kv_idx`` at 128k tokens does not wrap). The kernels and the other paths
  promise the same: int32 where that is exact at the call's lengths, int64 where it is not.
* The working precision is float64 for float64 inputs and float32 otherwise (half inputs are
  upcast; the output is cast back to the input dtype).
* Fully masked rows: output 0, lse -inf, max_scores -inf, and no NaN in the backward either
  (see the note in ``_safe_softmax_with_lse``).
* Rows with a +inf score (q or k holding infinities, or a score_mod returning +inf): lse +inf and
  output NaN, as torch's ``logsumexp`` and ``_safe_softmax`` give them; a NaN score makes the row's
  lse NaN (see [Note] Infinite scores in ``_safe_softmax_with_lse``).
* lse is the natural-log log-sum-exp of ``post`` per row; max_scores is its row maximum. Both are in
  the working precision (float32, or float64 for float64 inputs); max_scores carries no gradient.

The function is plain autograd all the way through, so tests take float64 gradients from it, including
gradients into tensors the score_mod captures.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from .trace import GathersReadZero

__all__ = ["reference_attention", "working_dtype"]

INDEX_DTYPE = torch.int64  # the oracle: Python-integer semantics for index arithmetic


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision scores and statistics are computed in: float64 stays, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _vmap_bhqkv(fn: Callable, with_score: bool) -> Callable:
    """Map ``fn`` over 1-D index tensors b, h, q_idx, kv_idx (and a [B, H, L, S] score tensor).

    The innermost vmap maps kv_idx, then q_idx, then h, then b. A score tensor is mapped at every
    level: at each one its leading dimension is the index being mapped.
    """
    score_dims = (0,) if with_score else ()
    for index_dims in [(None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)]:
        fn = torch.vmap(fn, in_dims=score_dims + index_dims)
    return fn


def _check_shapes(query, key, value, enable_gqa: bool) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("query, key and value must be 4-D: [B, H, L, E], [B, Hkv, S, E], [B, Hkv, S, Ev]")
    B, Hq, _, E = query.shape
    Bkv, Hkv, S, Ek = key.shape
    if Ek != E:
        raise ValueError(f"query and key head dims differ: {E} vs {Ek}")
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must agree on [B, Hkv, S]")
    if Bkv != B and Bkv != 1:
        raise ValueError(f"key/value batch {Bkv} must equal the query batch {B} or be 1 (broadcast)")
    if Hq != Hkv and not enable_gqa:
        raise ValueError(f"query has {Hq} heads and key/value {Hkv}; pass enable_gqa=True for grouped-query attention")
    if Hq % Hkv != 0:
        raise ValueError(f"grouped-query attention needs Hq % Hkv == 0, got Hq={Hq}, Hkv={Hkv}")


def _safe_softmax_with_lse(post: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax and log-sum-exp over the last dim that stay finite on rows that are all -inf.

    [Note] Fully masked rows: the row maximum is -inf there, so it is replaced by 0 before the
    subtraction (``exp(-inf - 0) = 0``), and the zero row sum is replaced by 1 before the division
    and the log. Replacing *inside* the log (not ``where`` around it) matters for the backward: a
    ``where`` after ``log(0)`` would still send ``0 * inf = NaN`` into the unselected branch.

    [Note] Infinite scores: a row whose maximum is +inf has lse +inf, torch.logsumexp's value, where
    ``max + log(sum(exp(post - max)))`` gives ``inf - inf = NaN``; its probabilities stay NaN at the
    +inf scores and 0 elsewhere, as torch's ``_safe_softmax``, so its output is NaN. A NaN score
    makes the maximum NaN (amax propagates it), so that row's lse stays NaN, as torch's does.
    """
    row_max = post.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    unnormalized = torch.exp(post - row_max)
    row_sum = unnormalized.sum(dim=-1, keepdim=True)
    empty = row_sum == 0
    safe_sum = torch.where(empty, torch.ones_like(row_sum), row_sum)
    probs = unnormalized / safe_sum
    lse = torch.where(empty, torch.full_like(row_sum, -math.inf), row_max + torch.log(safe_sum))
    lse = torch.where(torch.isposinf(row_max), row_max, lse)  # see [Note] Infinite scores
    return probs, lse.squeeze(-1)


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense FlexAttention: returns ``(out, lse, max_scores)``.

    ``query`` [B, Hq, L, E], ``key`` [Bkv, Hkv, S, E], ``value`` [Bkv, Hkv, S, Ev] with Bkv equal to B
    or 1. ``out`` is [B, Hq, L, Ev] in the query's dtype; ``lse`` and ``max_scores`` are [B, Hq, L] in
    the working precision (see the module docstring). ``mask_mod`` is applied to every position (the
    reference needs no BlockMask).
    """
    _check_shapes(query, key, value, enable_gqa)
    B, Hq, L, E = query.shape
    Hkv = key.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(E)
    dtype = working_dtype(query.dtype)
    device = query.device

    # GQA: query head h reads kv head h // group. Batch 1 of key/value broadcasts over the queries' batch.
    group = Hq // Hkv
    key = key.repeat_interleave(group, dim=1).expand(B, -1, -1, -1)
    value = value.repeat_interleave(group, dim=1).expand(B, -1, -1, -1)

    scores = (query.to(dtype) @ key.to(dtype).transpose(-2, -1)) * scale
    S = scores.shape[-1]
    b = torch.arange(B, device=device, dtype=INDEX_DTYPE)
    h = torch.arange(Hq, device=device, dtype=INDEX_DTYPE)
    q_idx = torch.arange(L, device=device, dtype=INDEX_DTYPE)
    kv_idx = torch.arange(S, device=device, dtype=INDEX_DTYPE)

    with GathersReadZero():  # tensor[idx] inside the mods must stay a gather under vmap
        if score_mod is not None:
            scores = _vmap_bhqkv(score_mod, with_score=True)(scores, b, h, q_idx, kv_idx).to(dtype)
        if mask_mod is not None:
            keep = _vmap_bhqkv(mask_mod, with_score=False)(b, h, q_idx, kv_idx)
            keep = keep.expand(B, Hq, L, S)  # a mod that ignores all its arguments returns a smaller tensor
            scores = torch.where(keep, scores, torch.tensor(-math.inf, dtype=dtype, device=device))

    max_scores = scores.detach().amax(dim=-1)
    probs, lse = _safe_softmax_with_lse(scores)
    out = probs @ value.to(dtype)
    return out.to(query.dtype), lse, max_scores
