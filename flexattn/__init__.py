"""flexattn: fused FlexAttention kernels from a few lines of PyTorch, in plain eager mode.

The public API is a drop-in for ``torch.nn.attention.flex_attention``::

    from flexattn import flex_attention, create_block_mask
"""

__version__ = "0.1.0"  # the same as pyproject.toml's (tests/test_api.py checks)

from .api import flex_attention
from .masks import BlockMask, create_block_mask, create_mask, decode_block_mask, offset_mask_mod, offset_score_mod
from .mods import and_masks, mod_factory, noop_mask, or_masks
from .options import AuxOutput, AuxRequest, FlexKernelOptions
from .paged_attention import OutOfPagesError, PagedAttention

# The names the FlexAttention paper uses.
and_mask = and_masks
or_mask = or_masks

__all__ = [
    "AuxOutput",
    "AuxRequest",
    "BlockMask",
    "FlexKernelOptions",
    "OutOfPagesError",
    "PagedAttention",
    "and_mask",
    "and_masks",
    "create_block_mask",
    "create_mask",
    "decode_block_mask",
    "flex_attention",
    "mod_factory",
    "noop_mask",
    "offset_mask_mod",
    "offset_score_mod",
    "or_mask",
    "or_masks",
]
