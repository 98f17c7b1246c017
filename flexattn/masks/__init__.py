"""Masks: which (query, key) pairs a call attends to, as the kernels read it.

``layout`` (the tables' two forms and their checks) -> ``block_mask`` (the BlockMask, its derived
data and torch interop) -> ``create`` (``create_block_mask`` from a mask_mod) -> ``decoding`` (a
decoding step's mask and shifted mods). The mod types and the mask combinators they are built from
live in ``flexattn.mods``; ``PagedAttention``, built on these masks, in ``flexattn.paged_attention``.
"""

from .block_mask import (
    EVERY_BLOCK_FULL, TABLES_IN_RANGE, BlockMask, DerivedKey, as_block_mask, sliced_rows_mask_mod, torch_counterpart,
    version_of,
)
from .create import create_block_mask, create_mask, dense_block_mask
from .decoding import decode_block_mask, offset_mask_mod, offset_score_mod

__all__ = [
    "BlockMask", "DerivedKey", "EVERY_BLOCK_FULL", "TABLES_IN_RANGE", "as_block_mask", "sliced_rows_mask_mod", "torch_counterpart",
    "version_of", "create_block_mask", "create_mask", "dense_block_mask",
    "decode_block_mask", "offset_mask_mod", "offset_score_mod",
]
