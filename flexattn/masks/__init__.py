"""Masks: which (query, key) pairs a call attends to, as the kernels read it.

``mods`` (the mod types and the mask combinators) -> ``layout`` (the tables' two forms and their
checks) -> ``block_mask`` (the BlockMask, its derived data and torch interop) -> ``create``
(``create_block_mask`` from a mask_mod) -> ``decoding`` (a decoding step's mask and shifted mods)
-> ``paged`` (``PagedAttention``: one physical KV cache for many sequences).
"""

from .block_mask import (
    EVERY_BLOCK_FULL, TABLES_IN_RANGE, BlockMask, DerivedKey, as_block_mask, sliced_rows_mask_mod, torch_counterpart,
    version_of,
)
from .create import create_block_mask, create_mask, dense_block_mask
from .decoding import decode_block_mask, offset_mask_mod, offset_score_mod
from .mods import (
    FACTORY_ATTRIBUTE, MaskMod, ScoreMod, and_masks, arity_mistake, identity_score_mod, mod_factory, mod_name, noop_mask,
    or_masks,
)
from .paged import OutOfPagesError, PagedAttention

__all__ = [
    "BlockMask", "DerivedKey", "EVERY_BLOCK_FULL", "TABLES_IN_RANGE", "as_block_mask", "sliced_rows_mask_mod", "torch_counterpart",
    "version_of", "create_block_mask", "create_mask", "dense_block_mask",
    "decode_block_mask", "offset_mask_mod", "offset_score_mod",
    "MaskMod", "ScoreMod", "mod_factory", "FACTORY_ATTRIBUTE", "and_masks", "or_masks", "noop_mask", "identity_score_mod", "arity_mistake", "mod_name",
    "OutOfPagesError", "PagedAttention",
]
