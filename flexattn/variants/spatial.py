"""Attention over images and videos flattened to 1-D: neighbourhood attention (NATTEN) and
sliding-tile attention, with the token layouts that make their block masks sparse.

[Note] Layouts and grids
A mask here reads the coordinates of each sequence position from a captured table ``coords``
(``[L, D]``, from :func:`layout_coordinates`), so one mask works for every layout: ``row``
(row-major), ``tiled`` (tile after tile, row-major inside a tile: every tile is a contiguous run
of tokens, so a query block meets few key blocks) and ``morton`` (Z-order: coordinates' bits
interleaved, which keeps 2-D and 3-D neighbours close in 1-D at every scale). The registry entries
derive the grid from the sequence length L: :func:`grid_2d` takes H = the largest divisor of L not
above sqrt(L) and W = L / H (so 1024 -> 32 x 32, 2048 -> 32 x 64, 192 -> 12 x 16; a prime L gives a
1 x L strip); :func:`grid_3d` takes F = the largest divisor of L not above L^(1/3) frames and
``grid_2d(L / F)`` for each frame (2048 -> 8 x 16 x 16). Tiles are the largest divisor of each
side not above a quarter of it (:func:`tile_for`).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ._registry import Instance, Variant


def _largest_divisor_at_most(n: int, bound: int) -> int:
    return max(d for d in range(1, max(1, bound) + 1) if n % d == 0)


def grid_2d(length: int) -> tuple:
    """``(H, W)`` with ``H * W == length``: H the largest divisor not above sqrt(length)."""
    rows = _largest_divisor_at_most(length, math.isqrt(length))
    return rows, length // rows


def grid_3d(length: int) -> tuple:
    """``(F, H, W)`` with ``F * H * W == length``: F the largest divisor not above the cube root,
    then :func:`grid_2d` of ``length / F``."""
    root = round(length ** (1 / 3))
    root = root - 1 if root ** 3 > length else root
    frames = _largest_divisor_at_most(length, root)
    return (frames, *grid_2d(length // frames))


def tile_for(canvas: Sequence[int]) -> tuple:
    """A tile per axis: the largest divisor of the side not above a quarter of it (at least 1)."""
    return tuple(_largest_divisor_at_most(n, n // 4) for n in canvas)


def _morton_key(coords: torch.Tensor) -> torch.Tensor:
    # Interleave the coordinates' bits, axis 0 the most significant inside each group of D bits.
    dims = coords.shape[1]
    bits = max(1, int(coords.max().item()).bit_length())
    key = torch.zeros(coords.shape[0], dtype=torch.int64)
    for bit in range(bits):
        for axis in range(dims):
            key |= ((coords[:, axis] >> bit) & 1) << (bit * dims + dims - 1 - axis)
    return key


def layout_coordinates(canvas: Sequence[int], order: str = "row", tile: Optional[Sequence[int]] = None, device="cpu"):
    """The coordinates of the token at each sequence position, for an image (``canvas = (H, W)``)
    or a video (``(F, H, W)``) flattened in the given ``order``: ``"row"`` (row-major),
    ``"tiled"`` (tiles of ``tile`` row-major, row-major inside each; edge tiles may be partial) or
    ``"morton"`` (Z-order; any canvas, cells sorted by their interleaved bits).
    Returns int32 ``[prod(canvas), len(canvas)]``.

    >>> layout_coordinates((2, 4), "tiled", (2, 2)).tolist()
    [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
    """
    canvas = tuple(int(n) for n in canvas)
    cells = torch.cartesian_prod(*[torch.arange(n) for n in canvas]).reshape(-1, len(canvas))
    if order == "row":
        key = torch.arange(cells.shape[0])
    elif order == "tiled":
        if tile is None or len(tile) != len(canvas):
            raise ValueError(f"layout_coordinates: order='tiled' needs a tile per axis of {canvas}, got {tile}")
        tile_t = torch.tensor(tile)
        tiles_per_axis = [math.ceil(n / t) for n, t in zip(canvas, tile)]
        tile_index = _ravel(cells // tile_t, tiles_per_axis)
        key = tile_index * math.prod(tile) + _ravel(cells % tile_t, tile)
    elif order == "morton":
        key = _morton_key(cells)
    else:
        raise ValueError(f"layout_coordinates: order must be 'row', 'tiled' or 'morton', got {order!r}")
    return cells[torch.argsort(key, stable=True)].to(device=device, dtype=torch.int32)


def _ravel(index: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    flat = torch.zeros(index.shape[0], dtype=torch.int64)
    for axis, size in enumerate(sizes):
        flat = flat * size + index[:, axis]
    return flat


def _window_mask(coords: torch.Tensor, canvas, tile, window, name: str):
    # A query's window: `window[a]` tiles along each axis, centred on the query's tile and shifted
    # inwards at the borders (so every query sees the same number of tiles).
    dims = len(canvas)
    if coords.dim() != 2 or coords.shape[1] != dims:
        raise ValueError(f"{name}: coords must be [L, {dims}] for a canvas of {dims} axes, got {tuple(coords.shape)}")
    tiles_per_axis = [math.ceil(n / t) for n, t in zip(canvas, tile)]
    for axis, (w, n) in enumerate(zip(window, tiles_per_axis)):
        if w % 2 != 1 or w > n:
            raise ValueError(f"{name}: the window along axis {axis} ({w}) must be odd and at most {n}")
    axes = [coords[:, a].contiguous() for a in range(dims)]

    def windowed(b, h, q_idx, kv_idx):
        keep = q_idx >= 0
        for a in range(dims):
            half = window[a] // 2
            centre = (axes[a][q_idx] // tile[a]).clamp(half, tiles_per_axis[a] - 1 - half)
            keep = keep & ((axes[a][kv_idx] // tile[a] - centre).abs() <= half)
        return keep

    return windowed


def generate_natten_mask(coords: torch.Tensor, canvas: Sequence[int], kernel: Sequence[int]):
    """Neighbourhood attention: each pixel (or voxel) sees the ``kernel`` neighbourhood around it,
    shifted inwards at the borders so every query sees exactly ``prod(kernel)`` keys.

    Inputs: ``coords`` (int tensor ``[L, D]``, captured: the coordinates of each sequence position,
    from :func:`layout_coordinates`: the layout decides the block sparsity, not the result),
    ``canvas`` (the grid, ``(H, W)`` or ``(F, H, W)``), ``kernel`` (odd size per axis, at most the
    canvas). One sequence: Q_LEN == KV_LEN == prod(canvas).
    Source: "Neighborhood Attention Transformer" (Hassani et al., CVPR 2023) and its NATTEN
    library; attention-gym's NATTEN example with tiled and Morton layouts.

    A 4 x 4 image, 3 x 3 kernel, row-major and then Morton (Z-order) layout:

    >>> canvas = (4, 4)
    >>> print(picture(generate_natten_mask(layout_coordinates(canvas, "row"), canvas, (3, 3)), 16, 16))
    ###-###-###-----
    ###-###-###-----
    -###-###-###----
    -###-###-###----
    ###-###-###-----
    ###-###-###-----
    -###-###-###----
    -###-###-###----
    ----###-###-###-
    ----###-###-###-
    -----###-###-###
    -----###-###-###
    ----###-###-###-
    ----###-###-###-
    -----###-###-###
    -----###-###-###
    >>> print(picture(generate_natten_mask(layout_coordinates(canvas, "morton"), canvas, (3, 3)), 16, 16))
    #####-#-##--#---
    #####-#-##--#---
    #####-#-##--#---
    #####-#-##--#---
    -#-#####-#--##--
    -#-#####-#--##--
    -#-#####-#--##--
    -#-#####-#--##--
    --##--#-#####-#-
    --##--#-#####-#-
    --##--#-#####-#-
    --##--#-#####-#-
    ---#--##-#-#####
    ---#--##-#-#####
    ---#--##-#-#####
    ---#--##-#-#####
    """
    kernel = tuple(kernel)
    mask = _window_mask(coords, tuple(canvas), (1,) * len(kernel), kernel, "generate_natten_mask")
    mask.__name__ = "natten_" + "x".join(map(str, kernel))
    return mask


def generate_sliding_tile_mask(coords: torch.Tensor, canvas: Sequence[int], tile: Sequence[int],
                               window: Sequence[int]):
    """Sliding-tile attention: neighbourhood attention at the granularity of tiles. Tokens are
    grouped into tiles (laid out contiguously, ``layout_coordinates(canvas, "tiled", tile)``) and
    every token of a tile sees the ``window`` tiles around its own (shifted inwards at the
    borders), so whole key blocks are either in or out: no partial blocks when a tile fills one.

    Inputs: ``coords`` (``[L, D]`` int tensor, captured), ``canvas`` (``(H, W)`` for images,
    ``(F, H, W)`` for video), ``tile`` (tile size per axis), ``window`` (odd number of tiles per
    axis, at most the tiles along it). One sequence: Q_LEN == KV_LEN == prod(canvas).
    Source: "Fast Video Generation with Sliding Tile Attention" (Zhang et al., 2025), for video
    diffusion transformers (HunyuanVideo).

    A 2 x 8 image in tiles of 1 x 2, a window of 1 x 3 tiles:

    >>> canvas, tile = (2, 8), (1, 2)
    >>> coords = layout_coordinates(canvas, "tiled", tile)
    >>> print(picture(generate_sliding_tile_mask(coords, canvas, tile, (1, 3)), 16, 16))
    ######----------
    ######----------
    ######----------
    ######----------
    --######--------
    --######--------
    --######--------
    --######--------
    --------######--
    --------######--
    --------######--
    --------######--
    ----------######
    ----------######
    ----------######
    ----------######

    A 4 x 2 x 2 video (frames first) in tiles of 1 x 2 x 1, a window of 3 x 1 x 1 tiles:

    >>> canvas, tile = (4, 2, 2), (1, 2, 1)
    >>> coords = layout_coordinates(canvas, "tiled", tile)
    >>> print(picture(generate_sliding_tile_mask(coords, canvas, tile, (3, 1, 1)), 16, 16))
    ##--##--##------
    ##--##--##------
    --##--##--##----
    --##--##--##----
    ##--##--##------
    ##--##--##------
    --##--##--##----
    --##--##--##----
    ----##--##--##--
    ----##--##--##--
    ------##--##--##
    ------##--##--##
    ----##--##--##--
    ----##--##--##--
    ------##--##--##
    ------##--##--##
    """
    mask = _window_mask(coords, tuple(canvas), tuple(tile), tuple(window), "generate_sliding_tile_mask")
    mask.__name__ = "sliding_tile_" + "x".join(map(str, window))
    return mask


def _natten(order):
    def make(B, H, Q, KV, device):
        canvas = grid_2d(KV)
        side = max(1, (min(canvas) // 2) | 1)  # an odd kernel, about half the shorter side
        coords = layout_coordinates(canvas, order, tile_for(canvas), device)
        return Instance(None, generate_natten_mask(coords, canvas, (side, side)))

    return make


def _sliding_tile(dims):
    def make(B, H, Q, KV, device):
        canvas = grid_2d(KV) if dims == 2 else grid_3d(KV)
        tile = tile_for(canvas)
        window = tuple(3 if math.ceil(n / t) >= 3 else 1 for n, t in zip(canvas, tile))
        coords = layout_coordinates(canvas, "tiled", tile, device)
        return Instance(None, generate_sliding_tile_mask(coords, canvas, tile, window))

    return make


VARIANTS = [
    Variant("natten_tiled", _natten("tiled"),
            "2-D neighbourhood attention, kernel ~half the shorter side, tiled layout (grid_2d(L), tile_for)",
            square_only=True, decode=False, tags=frozenset({"2d", "local", "vision"}),
            factories=(generate_natten_mask, layout_coordinates, grid_2d)),
    Variant("natten_morton", _natten("morton"),
            "2-D neighbourhood attention, kernel ~half the shorter side, Morton (Z-order) layout (grid_2d(L))",
            square_only=True, decode=False, tags=frozenset({"2d", "local", "vision"}),
            factories=(generate_natten_mask, layout_coordinates, grid_2d)),
    Variant("sliding_tile_2d", _sliding_tile(2),
            "sliding-tile attention on an image: 3 x 3 tiles around the query's (grid_2d(L), tile_for)",
            square_only=True, decode=False, tags=frozenset({"2d", "local", "vision", "tiles"}),
            factories=(generate_sliding_tile_mask, layout_coordinates, grid_2d)),
    Variant("sliding_tile_3d", _sliding_tile(3),
            "sliding-tile attention on a video: 3 x 3 x 3 tiles around the query's (grid_3d(L), tile_for)",
            square_only=True, decode=False, tags=frozenset({"3d", "local", "video", "tiles"}),
            factories=(generate_sliding_tile_mask, layout_coordinates, grid_3d)),
]
