"""Deprecated: the BlockMask and its builders moved to :mod:`flexattn.masks`."""

from ._deprecated import warn_moved
from .masks import BlockMask, arity_mistake, as_block_mask, create_block_mask, create_mask

warn_moved("flexattn.block_mask", "flexattn.masks (or flexattn)")

__all__ = ["BlockMask", "create_block_mask", "create_mask", "as_block_mask", "arity_mistake"]
