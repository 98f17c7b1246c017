"""The layout of a BlockMask's tables, the conversions between its two forms, and the checks a
user's tables get.

A row of blocks is stored *ordered*: ``num_blocks[b, h, row]`` tiles, whose key-block indices are
the first entries of ``indices[b, h, row, :]`` in ascending order (the rest is padding, always a
valid index). The *dense* form is a 0/1 map ``[B, H, ROWS, COLS]``. Builders work on dense maps
(easy to combine) and kernels read ordered tables (one entry per visited tile); this module turns
one into the other, and checks tables that come from outside.
"""

from __future__ import annotations

import operator
from typing import Optional, Union

import torch

from ..errors import InvalidInputError

__all__ = [
    "DEFAULT_BLOCK_SIZE", "INDEX_DTYPE", "BlockSize", "cdiv", "positive_int", "as_block_size", "default_device",
    "device_argument",
    "dense_to_ordered", "ordered_to_dense", "as_4d", "ascending", "checked_table", "checked_indices",
    "check_visited_once", "widened", "transposed_tables",
]

DEFAULT_BLOCK_SIZE = 128
# The dtype of every block map, and of the index arguments mods receive unless their arithmetic
# needs int64 at the call's lengths (see flexattn/lowering/ranges.py).
INDEX_DTYPE = torch.int32

BlockSize = Union[int, tuple[int, int]]


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def positive_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise InvalidInputError(f"{name} must be a positive int, got {value!r}")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise InvalidInputError(f"{name} must be a positive int, got {type(value).__name__} {value!r}") from None
    if as_int <= 0:
        raise InvalidInputError(f"{name} must be a positive int, got {as_int}")
    return as_int


def as_block_size(block_size: BlockSize) -> tuple[int, int]:
    """``128`` or ``(Q_BLOCK, KV_BLOCK)`` -> ``(Q_BLOCK, KV_BLOCK)``."""
    if isinstance(block_size, (tuple, list)):
        if len(block_size) != 2:
            raise InvalidInputError(f"BLOCK_SIZE must be an int or a (Q_BLOCK, KV_BLOCK) pair, got {block_size!r}")
        q_block = positive_int("BLOCK_SIZE[0] (Q_BLOCK)", block_size[0])
        return (q_block, positive_int("BLOCK_SIZE[1] (KV_BLOCK)", block_size[1]))
    size = positive_int("BLOCK_SIZE", block_size)
    return (size, size)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_argument(device: Union[str, torch.device, None], where: str) -> torch.device:
    """A ``device=`` argument as a torch.device (None: CUDA if available, else the CPU). A CUDA device
    on a machine without one is refused here, naming the argument, rather than by torch's bare
    "Torch not compiled with CUDA enabled" from the first tensor made there."""
    if device is None:
        return default_device()
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(
            f"{where}: device={str(device)!r}, but CUDA is not available here (torch.cuda.is_available() is "
            "False); pass the device of your tensors (device=q.device), or device='cpu'"
        )
    return device


# --------------------------------------------------------------------------------------------
# Ordered (num_blocks, indices) <-> dense block maps
# --------------------------------------------------------------------------------------------


def dense_to_ordered(block_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 0/1 map ``[..., ROWS, COLS]`` -> per-row count and column indices, kept ones first.

    A stable descending argsort puts the kept columns first in ascending order, then the others in
    ascending order: the same layout torch produces, and the padding entries are valid indices.
    """
    block_map = block_map.to(INDEX_DTYPE)
    num_blocks = block_map.sum(dim=-1, dtype=INDEX_DTYPE)
    indices = torch.argsort(block_map, dim=-1, descending=True, stable=True)
    return num_blocks.contiguous(), indices.to(INDEX_DTYPE).contiguous()


def ordered_to_dense(num_blocks: torch.Tensor, indices: torch.Tensor, num_cols: int) -> torch.Tensor:
    """Per-row count and column indices -> int32 0/1 map ``[..., ROWS, num_cols]``."""
    slots = torch.arange(indices.shape[-1], device=indices.device)
    in_use = slots < num_blocks.unsqueeze(-1)
    # Unused slots write into one spare column past the end, which is then dropped.
    target = torch.where(in_use, indices.long(), num_cols)
    dense = torch.zeros(*indices.shape[:-1], num_cols + 1, dtype=INDEX_DTYPE, device=indices.device)
    dense.scatter_(-1, target, 1)
    return dense[..., :num_cols].contiguous()


def as_4d(t: torch.Tensor, trailing: int) -> torch.Tensor:
    """Prepend size-1 batch/head dims so a block tensor has the [B, H, ...] layout kernels expect."""
    while t.dim() < 2 + trailing:
        t = t.unsqueeze(0)
    return t


# --------------------------------------------------------------------------------------------
# Checking and normalising tables given by the caller
# --------------------------------------------------------------------------------------------


def ascending(num_blocks: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Each row's first ``num_blocks`` entries sorted ascending; padding entries keep their place."""
    if indices.numel() == 0 or indices.shape[-1] < 2:
        return indices
    used = torch.arange(indices.shape[-1], device=indices.device) < num_blocks.unsqueeze(-1)
    big = torch.iinfo(indices.dtype).max
    ordered = torch.where(used, indices, big).sort(dim=-1).values
    return torch.where(used, ordered, indices)


def checked_table(name: str, num_blocks: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shape and dtype checks of one (num_blocks, indices) pair; returns them int32 and 4-D."""
    for label, t in ((f"{name}_num_blocks", num_blocks), (f"{name}_indices", indices)):
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(f"from_kv_blocks: {label} must be a tensor, got {type(t).__name__}")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise InvalidInputError(f"from_kv_blocks: {label} must be an integer tensor, got {t.dtype}")
    if not 2 <= indices.dim() <= 4:
        raise InvalidInputError(
            f"from_kv_blocks: {name}_indices must be [B, H, ROWS, W] (B and H optional), "
            f"got shape {tuple(indices.shape)}"
        )
    if num_blocks.shape != indices.shape[:-1]:
        raise InvalidInputError(
            f"from_kv_blocks: {name}_num_blocks has shape {tuple(num_blocks.shape)} but {name}_indices "
            f"{tuple(indices.shape)} needs {tuple(indices.shape[:-1])}"
        )
    if num_blocks.device != indices.device:
        raise InvalidInputError(f"from_kv_blocks: {name}_num_blocks and {name}_indices are on different devices")
    num_blocks = as_4d(num_blocks, 1).to(INDEX_DTYPE).contiguous()
    indices = as_4d(indices, 2).to(INDEX_DTYPE).contiguous()
    return num_blocks, indices


def checked_indices(name: str, num_blocks: torch.Tensor, indices: torch.Tensor, num_cols: int) -> torch.Tensor:
    """Reject used entries outside [0, num_cols); replace padding entries outside it by 0."""
    slots = torch.arange(indices.shape[-1], device=indices.device)
    in_use = slots < num_blocks.unsqueeze(-1)
    outside = (indices < 0) | (indices >= num_cols)
    # One device->host copy for all three checks.
    bad_count = ((num_blocks < 0) | (num_blocks > indices.shape[-1])).any()
    bad_count, bad_used, bad_padding = torch.stack(
        [bad_count, (outside & in_use).any(), (outside & ~in_use).any()]
    ).tolist()
    if bad_count:
        raise InvalidInputError(
            f"from_kv_blocks: {name}_num_blocks must lie in [0, {indices.shape[-1]}] (the width of {name}_indices)"
        )
    if bad_used:
        raise InvalidInputError(
            f"from_kv_blocks: {name}_indices has a used entry outside [0, {num_cols}), the key blocks of this mask"
        )
    if bad_padding:
        indices = indices.masked_fill(outside, 0)
    return indices


def check_visited_once(
    num_blocks: torch.Tensor, partial_map: torch.Tensor, full_num_blocks: Optional[torch.Tensor], full_map
) -> None:
    """Each tile at most once per row, and never both partial and full: kernels would add it twice."""
    checks = [(partial_map.sum(-1) != num_blocks).any()]
    if full_map is not None:
        checks += [(full_map.sum(-1) != full_num_blocks).any(), (partial_map & full_map).any()]
    repeated, *rest = torch.stack(checks).tolist()  # one device->host copy
    if repeated or (rest and rest[0]):
        raise InvalidInputError("from_kv_blocks: a row of the index tables lists the same key block twice")
    if rest and rest[1]:
        raise InvalidInputError("from_kv_blocks: a tile is listed both as partial (kv_*) and as full (full_kv_*)")


def widened(indices: torch.Tensor, num_cols: int) -> torch.Tensor:
    """Pad an index table with zeros (valid padding) to one slot per key block.

    Every table of a BlockMask is then ``[B, H, ROWS, COLS]``, whatever width the caller used.
    """
    missing = num_cols - indices.shape[-1]
    return torch.nn.functional.pad(indices, (0, missing)) if missing > 0 else indices


def transposed_tables(partial_map: torch.Tensor, full_map: Optional[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    """(q_num_blocks, q_indices, full_q_num_blocks, full_q_indices) from the two tile maps."""
    q_num_blocks, q_indices = dense_to_ordered(partial_map.transpose(-2, -1))
    if full_map is None:
        return [q_num_blocks, q_indices, None, None]
    full_q_num_blocks, full_q_indices = dense_to_ordered(full_map.transpose(-2, -1))
    return [q_num_blocks, q_indices, full_q_num_blocks, full_q_indices]
