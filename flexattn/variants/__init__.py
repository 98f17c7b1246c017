"""The catalogue of attention variants: factories users call, and one registry the tests, the CLI,
the notebook and the docs walk.

A *factory* (``generate_alibi_bias``, ``generate_sliding_window``, ...) is the public building block:
it returns a ``score_mod`` or ``mask_mod`` a user passes to ``flex_attention`` / ``create_block_mask``.
Its docstring says the idea, its inputs, where it comes from, and shows its picture at a tiny size
(:func:`picture` for masks, :func:`bias_picture` for biases; tests re-render every one).
A registry entry (:class:`Variant`) wraps factories into a runnable case at given sizes
(:meth:`Variant.make` -> :class:`Instance`), so every entry can be run, checked against the float64
reference, timed and drawn the same way.

One module per family: :mod:`.causal` (full, causal, prefix LM), :mod:`.windows` (sliding, dilated,
Longformer), :mod:`.documents` (packed documents, shared prefix), :mod:`.blocks` (chunked, block
diffusion), :mod:`.multimodal` (text-to-image cross-attention), :mod:`.spatial` (NATTEN and
sliding-tile attention in 2-D and 3-D), :mod:`.biases` (ALiBi, soft-cap, T5, Graphormer,
temperature) and :mod:`.sinks` (attention sinks). To add a variant, write its factory in the family
module (or a new one), add a ``Variant`` to that module's ``VARIANTS``, and list the module below;
tests/test_variants.py then runs it on every backend.
"""

from __future__ import annotations

import dataclasses

from . import biases, blocks, causal, documents, multimodal, sinks, spatial, windows
from ._pictures import bias_picture, picture
from ._registry import Instance, Variant, apply_sinks
from .biases import (
    alibi_slopes,
    generate_alibi_bias,
    generate_graphormer_bias,
    generate_head_temperature,
    generate_t5_bias,
    generate_tanh_softcap,
    graph_distances,
    t5_bucket,
)
from .blocks import generate_block_diffusion_mask, generate_chunked_causal
from .causal import causal_mask, full_mask, generate_prefix_lm
from .documents import (
    branch_ids,
    document_ids,
    document_ids_from_offsets,
    generate_document_mask,
    generate_packed_document_mask,
    generate_shared_prefix_mask,
    split_lengths,
)
from .multimodal import generate_text_to_image_mask, interleaved_layout
from .sinks import generate_sinks
from .spatial import generate_natten_mask, generate_sliding_tile_mask, grid_2d, grid_3d, layout_coordinates, tile_for
from .windows import generate_dilated_sliding_window, generate_longformer_mask, generate_sliding_window

FAMILY_MODULES = (causal, windows, documents, blocks, multimodal, spatial, biases, sinks)

# The paper's seven first, in the paper's order (the benchmark's tables follow it), then the rest by family.
_PAPER_ORDER = ("noop", "causal", "alibi", "sliding_window", "prefix_lm", "softcap", "document_mask")


def _collect() -> dict:
    entries = {}
    for module in FAMILY_MODULES:
        for variant in module.VARIANTS:
            if variant.name in entries:
                raise RuntimeError(f"two catalogue entries are named {variant.name!r}")
            entries[variant.name] = dataclasses.replace(variant, module=module.__name__)
    ordered = {name: entries.pop(name) for name in _PAPER_ORDER}
    ordered.update(entries)
    return ordered


CATALOGUE: dict[str, Variant] = _collect()

__all__ = [
    "CATALOGUE",
    "FAMILY_MODULES",
    "Instance",
    "Variant",
    "alibi_slopes",
    "apply_sinks",
    "bias_picture",
    "branch_ids",
    "causal_mask",
    "document_ids",
    "document_ids_from_offsets",
    "full_mask",
    "generate_alibi_bias",
    "generate_block_diffusion_mask",
    "generate_chunked_causal",
    "generate_dilated_sliding_window",
    "generate_document_mask",
    "generate_graphormer_bias",
    "generate_head_temperature",
    "generate_longformer_mask",
    "generate_natten_mask",
    "generate_packed_document_mask",
    "generate_prefix_lm",
    "generate_shared_prefix_mask",
    "generate_sinks",
    "generate_sliding_tile_mask",
    "generate_sliding_window",
    "generate_t5_bias",
    "generate_tanh_softcap",
    "generate_text_to_image_mask",
    "graph_distances",
    "grid_2d",
    "grid_3d",
    "interleaved_layout",
    "layout_coordinates",
    "picture",
    "split_lengths",
    "t5_bucket",
    "tile_for",
]
