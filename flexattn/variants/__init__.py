"""The catalogue of attention variants: factories users call, and one registry the tests, the gym,
the CLI and the docs walk.

A *factory* (``generate_alibi_bias``, ``generate_sliding_window``, ...) is the public building block:
it returns a ``score_mod`` or ``mask_mod`` a user passes to ``flex_attention`` / ``create_block_mask``.
A registry entry (:class:`Variant`) wraps factories into a runnable case at given sizes
(:meth:`Variant.make` -> :class:`Instance`), so every entry can be run, checked against the float64
reference, timed and drawn the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..block_mask import BlockMask, create_block_mask
from ..reference import reference_attention


@dataclass
class Instance:
    """One variant built at one size: its mods and the tensors they read.

    ``learnable`` lists captured tensors that require grad (their gradients are part of the check).
    ``sinks`` is a per-query-head extra logit (attention sinks); when set, :meth:`attend` and
    :meth:`reference` fold it in through the log-sum-exp, and it is learnable too.
    """

    score_mod: Optional[Callable] = None
    mask_mod: Optional[Callable] = None
    learnable: tuple = ()
    sinks: Optional[torch.Tensor] = None

    def block_mask(self, B, H, Q_LEN: int, KV_LEN: int, device) -> Optional[BlockMask]:
        if self.mask_mod is None:
            return None
        return create_block_mask(self.mask_mod, B, H, Q_LEN, KV_LEN, device=device)

    def attend(self, q, k, v, block_mask=None, kernel_options=None, enable_gqa=False) -> torch.Tensor:
        """The variant through ``flexattn.flex_attention``."""
        from ..api import flex_attention

        if self.sinks is None:
            return flex_attention(q, k, v, score_mod=self.score_mod, block_mask=block_mask,
                                  enable_gqa=enable_gqa, kernel_options=kernel_options)
        out, lse = flex_attention(q, k, v, score_mod=self.score_mod, block_mask=block_mask,
                                  enable_gqa=enable_gqa, kernel_options=kernel_options, return_lse=True)
        return _fold_sinks(out, lse, self.sinks)

    def reference(self, q, k, v, enable_gqa=False) -> torch.Tensor:
        """The float64 oracle for :meth:`attend` (inputs are promoted by the caller)."""
        out, lse, _ = reference_attention(q, k, v, score_mod=self.score_mod, mask_mod=self.mask_mod,
                                          enable_gqa=enable_gqa)
        if self.sinks is None:
            return out
        return _fold_sinks(out, lse, self.sinks.to(lse.dtype))


def _fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    # A sink is one more logit in each row's softmax with a zero value vector: it only grows the
    # denominator, from exp(lse) to exp(lse) + exp(sink), so the output shrinks by sigmoid(lse - sink).
    weight = torch.sigmoid(lse - sinks.view(1, -1, 1).to(lse.dtype))
    return (out * weight.unsqueeze(-1).to(out.dtype)).to(out.dtype)


@dataclass(frozen=True)
class Variant:
    """A registry entry.

    ``make(B, H, Q_LEN, KV_LEN, device)`` builds an :class:`Instance`. ``square_only``: the variant
    needs Q_LEN == KV_LEN (a packed sequence). ``decode``: it makes sense with a short query against
    a long cache. ``paper``: one of the FlexAttention paper's benchmark variants.
    """

    name: str
    make: Callable[..., Instance]
    summary: str
    family: str = "mask"  # "mask", "score" or "both": what the variant contributes
    square_only: bool = False
    decode: bool = True
    paper: bool = False
    tags: frozenset = field(default_factory=frozenset)

    def build(self, B, H, Q_LEN, KV_LEN, device="cpu") -> tuple:
        """``(score_mod, mask_mod)`` at these sizes (for callers that need only the mods)."""
        inst = self.make(B, H, Q_LEN, KV_LEN, device)
        return inst.score_mod, inst.mask_mod


from ._paper import (  # noqa: E402  (the registry's entries need the classes above)
    CATALOGUE,
    causal_mask,
    document_ids,
    generate_alibi_bias,
    generate_document_mask,
    generate_prefix_lm,
    generate_sliding_window,
    generate_tanh_softcap,
    split_lengths,
)

__all__ = [
    "CATALOGUE",
    "Instance",
    "Variant",
    "causal_mask",
    "document_ids",
    "generate_alibi_bias",
    "generate_document_mask",
    "generate_prefix_lm",
    "generate_sliding_window",
    "generate_tanh_softcap",
    "split_lengths",
]
