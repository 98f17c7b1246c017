"""Building blocks for score_mod and mask_mod callables.

A score_mod is ``score_mod(score, b, h, q_idx, kv_idx) -> score`` and a mask_mod is
``mask_mod(b, h, q_idx, kv_idx) -> bool``. Every argument is a 0-d tensor: the functions are written
for one (query, key) pair and flexattn applies them to whole tiles (by tracing for the kernels, by
``torch.vmap`` for the PyTorch backend and the reference).
"""

from __future__ import annotations

from typing import Callable

import torch

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = ["ScoreMod", "MaskMod", "identity_score_mod", "noop_mask", "and_masks", "or_masks"]


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


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod that keeps a pair only where every one of ``mask_mods`` keeps it."""
    _check_callables("and_masks", mask_mods)

    def and_mask(b, h, q_idx, kv_idx):
        keep = q_idx >= 0
        for mod in mask_mods:
            keep = keep & mod(b, h, q_idx, kv_idx)
        return keep

    and_mask.__name__ = "and_" + "_".join(getattr(m, "__name__", "mask") for m in mask_mods)
    return and_mask


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod that keeps a pair where any one of ``mask_mods`` keeps it."""
    _check_callables("or_masks", mask_mods)

    def or_mask(b, h, q_idx, kv_idx):
        keep = q_idx < 0
        for mod in mask_mods:
            keep = keep | mod(b, h, q_idx, kv_idx)
        return keep

    or_mask.__name__ = "or_" + "_".join(getattr(m, "__name__", "mask") for m in mask_mods)
    return or_mask
