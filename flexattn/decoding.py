"""Deprecated: decoding masks and offsets moved to :mod:`flexattn.masks`."""

from ._deprecated import warn_moved
from .masks import decode_block_mask, offset_mask_mod, offset_score_mod

warn_moved("flexattn.decoding", "flexattn.masks (or flexattn)")

__all__ = ["offset_mask_mod", "offset_score_mod", "decode_block_mask"]
