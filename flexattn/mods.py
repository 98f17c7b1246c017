"""Deprecated: the mod types and mask combinators moved to :mod:`flexattn.masks`."""

from ._deprecated import warn_moved
from .masks import MaskMod, ScoreMod, and_masks, identity_score_mod, noop_mask, or_masks

warn_moved("flexattn.mods", "flexattn.masks (or flexattn)")

__all__ = ["ScoreMod", "MaskMod", "identity_score_mod", "noop_mask", "and_masks", "or_masks"]
