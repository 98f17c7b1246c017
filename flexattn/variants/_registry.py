"""The registry's two types: :class:`Variant` (an entry) and :class:`Instance` (an entry built at
one size). Every family module lists its entries as ``VARIANTS``; ``flexattn.variants`` collects
them into ``CATALOGUE``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..masks import BlockMask, create_block_mask
from ..reference import reference_attention


@dataclass
class Instance:
    """One variant built at one size: its mods and the tensors they read.

    ``learnable`` lists captured tensors that require grad (their gradients are part of the check).
    ``sinks`` is a per-query-head extra logit (attention sinks); when set, :meth:`attend` and
    :meth:`reference` fold it in through the log-sum-exp (:func:`flexattn.variants.apply_sinks`),
    and it is learnable too.
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
        from ..options import AuxRequest

        if self.sinks is None:
            return flex_attention(q, k, v, score_mod=self.score_mod, block_mask=block_mask,
                                  enable_gqa=enable_gqa, kernel_options=kernel_options)
        out, aux = flex_attention(q, k, v, score_mod=self.score_mod, block_mask=block_mask, enable_gqa=enable_gqa,
                                  kernel_options=kernel_options, return_aux=AuxRequest(lse=True))
        return apply_sinks(out, aux.lse, self.sinks)

    def reference(self, q, k, v, enable_gqa=False) -> torch.Tensor:
        """The float64 oracle for :meth:`attend` (inputs are promoted by the caller)."""
        out, lse, _ = reference_attention(q, k, v, score_mod=self.score_mod, mask_mod=self.mask_mod,
                                          enable_gqa=enable_gqa)
        if self.sinks is None:
            return out
        return apply_sinks(out, lse, self.sinks.to(lse.dtype))


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Fold attention sinks into an attention output, given the rows' log-sum-exp.

    A sink is one more logit per query head, ``sinks[h]``, in every row's softmax, with a zero value
    vector: it only grows the denominator from ``exp(lse)`` to ``exp(lse) + exp(sinks[h])``, so the
    output shrinks by ``sigmoid(lse - sinks[h])``. A fully masked row (``lse = -inf``) stays 0.
    ``out``: ``[B, H, L, Ev]``; ``lse``: ``[B, H, L]`` (``flex_attention(...,
    return_aux=AuxRequest(lse=True))``);
    ``sinks``: ``[H]``. Differentiable in all three.
    """
    weight = torch.sigmoid(lse - sinks.view(1, -1, 1).to(lse.dtype))
    return (out * weight.unsqueeze(-1).to(out.dtype)).to(out.dtype)


@dataclass(frozen=True)
class Variant:
    """A registry entry.

    ``make(B, H, Q_LEN, KV_LEN, device)`` builds an :class:`Instance`. ``family``: what the variant
    contributes ("mask", "score" or "both"). ``square_only``: the variant needs Q_LEN == KV_LEN (one
    sequence indexed by both). ``decode``: it makes sense with a short query at the end of a long
    cache (autoregressive decoding). ``paper``: one of the FlexAttention paper's benchmark variants.
    ``factories``: the public functions the entry is built from; their docstrings say the idea,
    the inputs, the source and show the picture. ``module``: the family module that defines it.
    """

    name: str
    make: Callable[..., Instance]
    summary: str
    family: str = "mask"  # "mask", "score" or "both": what the variant contributes
    square_only: bool = False
    decode: bool = True
    paper: bool = False
    tags: frozenset = field(default_factory=frozenset)
    factories: tuple = ()
    module: str = ""

    def build(self, B, H, Q_LEN, KV_LEN, device="cpu") -> tuple:
        """``(score_mod, mask_mod)`` at these sizes (for callers that need only the mods; attention
        sinks, if the entry has them, are in :meth:`make`'s Instance only)."""
        inst = self.make(B, H, Q_LEN, KV_LEN, device)
        return inst.score_mod, inst.mask_mod

    @property
    def doc(self) -> str:
        """The docstring of the entry's first factory (the idea, inputs, source and picture)."""
        return (self.factories[0].__doc__ or "") if self.factories else ""
