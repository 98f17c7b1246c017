"""Attention sinks: one extra learnable logit per head in every row's softmax."""

from __future__ import annotations

import torch

from ._registry import Instance, Variant, apply_sinks
from .windows import generate_sliding_window


def generate_sinks(num_heads: int, init: float = 0.0, device="cpu") -> torch.Tensor:
    """Learnable attention sinks: a logit per head (``[H]``, requires grad) that joins every row's
    softmax with a zero value vector, so a head can put weight "nowhere" instead of on real tokens.
    flex_attention has no sink argument; they are folded in afterwards through the row's
    log-sum-exp, exactly: ``apply_sinks(out, lse, sinks)`` with
    ``out, aux = flex_attention(..., return_aux=AuxRequest(lse=True))`` and ``lse = aux.lse``
    (gradients flow to q, k, v and the sinks).

    Inputs: ``num_heads``, ``init`` (the starting logit), ``device``. Source: "Efficient Streaming
    Language Models with Attention Sinks" (Xiao et al., ICLR 2024); learnable per-head sinks as
    in gpt-oss (OpenAI, 2025), with sliding-window layers.

    The picture: a row of two keys with equal scores (lse = log 2) and a sink at 0 keeps 2/3 of
    the output:

    >>> sinks = generate_sinks(1)
    >>> round(apply_sinks(torch.ones(1, 1, 1, 1), torch.full((1, 1, 1), 2.0).log(), sinks).item(), 4)
    0.6667
    """
    return torch.full((num_heads,), float(init), device=device).requires_grad_()


def _sinks(B, H, Q, KV, device):
    sinks = generate_sinks(H, device=device)
    with torch.no_grad():
        sinks.copy_(torch.linspace(-1.0, 1.0, H))  # a different sink per head
    return Instance(None, generate_sliding_window(max(16, min(128, KV // 4))), sinks=sinks)


VARIANTS = [
    Variant("attention_sinks", _sinks,
            "causal sliding window of KV_LEN/4 tokens (16 to 128) plus a learnable sink logit per head (gpt-oss)",
            family="both", tags=frozenset({"causal", "local", "sinks", "learnable"}),
            factories=(generate_sinks, apply_sinks)),
]
