"""Pictures of a variant's mask: the BlockMask as text, and a PNG of the token-level mask next to the
block-level map (full, partial and empty blocks in three colours).

matplotlib is imported only by :func:`write_png` (it comes with the ``cli`` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

import flexattn
from flexattn.masks import BlockMask

__all__ = ["variant_mask", "block_map", "text_picture", "write_png", "EMPTY", "PARTIAL", "FULL"]

EMPTY, PARTIAL, FULL = 0, 1, 2
_COLOURS = {EMPTY: "#f4f4f4", PARTIAL: "#f5a623", FULL: "#2c6db5"}  # light grey, amber, blue


def variant_mask(inst, L: int, KV: int, device="cpu") -> tuple[BlockMask, torch.Tensor]:
    """The BlockMask of batch 0, head 0 and its token-level bool mask ``[L, KV]``. A variant with no
    mask_mod attends everywhere: every block is full."""
    mask_mod = inst.mask_mod if inst.mask_mod is not None else flexattn.noop_mask
    bm = flexattn.create_block_mask(mask_mod, 1, 1, L, KV, device=device)
    tokens = flexattn.create_mask(mask_mod, 1, 1, L, KV, device=device)[0, 0]
    return bm, tokens


def _listed(num: Optional[torch.Tensor], idx: Optional[torch.Tensor], cols: int) -> Optional[torch.Tensor]:
    """Bool [B, H, ROWS, COLS]: the blocks a (num_blocks, indices) table lists."""
    if num is None or idx is None:
        return None
    listed = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
    dense = torch.zeros(*idx.shape[:-1], cols + 1, dtype=torch.bool, device=idx.device)
    # Unlisted slots write to a spare column that is dropped, so stale indices past num never count.
    dense.scatter_(-1, torch.where(listed, idx.long(), cols), True)
    return dense[..., :cols]


def block_map(bm: BlockMask) -> torch.Tensor:
    """Int ``[ROWS, COLS]`` for batch 0, head 0: EMPTY, PARTIAL (mask_mod runs) or FULL (it does not)."""
    L, KV = bm.seq_lengths
    cols = -(-KV // bm.BLOCK_SIZE[1])
    partial = _listed(bm.kv_num_blocks, bm.kv_indices, cols)[0, 0]
    full = _listed(bm.full_kv_num_blocks, bm.full_kv_indices, cols)
    result = torch.full(partial.shape, EMPTY, dtype=torch.int64)
    result[partial.cpu()] = PARTIAL
    if full is not None:
        result[full[0, 0].cpu()] = FULL
    return result


def text_picture(bm: BlockMask, max_cells: int = 32) -> str:
    rows, cols = block_map(bm).shape
    grid = -1 if max(rows, cols) <= max_cells else (max_cells, max_cells)
    return bm.to_string(grid_size=grid, limit=1)


def write_png(path: Path, title: str, tokens: torch.Tensor, bm: BlockMask) -> Path:
    """The token mask (left) and the block map (right) side by side."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    blocks = block_map(bm)
    L, KV = tokens.shape
    bq, bkv = bm.BLOCK_SIZE
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 5.2))
    # Antialiased: a long mask is shrunk to a few hundred pixels, and nearest-pixel sampling would
    # drop thin lines (a window's edge) at random; blending shows them grey.
    left.imshow(tokens.cpu().float().numpy(), cmap="Greys", vmin=0, vmax=1, interpolation="antialiased",
                extent=(0, KV, L, 0))
    left.set_title(f"token mask ({L} x {KV}): dark = attends")
    right.imshow(blocks.numpy(), cmap=ListedColormap([_COLOURS[EMPTY], _COLOURS[PARTIAL], _COLOURS[FULL]]),
                 vmin=0, vmax=2, interpolation="nearest", extent=(0, KV, L, 0))
    right.set_title(f"blocks ({bq} x {bkv}), sparsity {bm.sparsity():.1f}%")
    right.legend(handles=[Patch(color=_COLOURS[FULL], label="full: no mask_mod"),
                          Patch(color=_COLOURS[PARTIAL], label="partial: mask_mod runs"),
                          Patch(color=_COLOURS[EMPTY], label="empty: skipped")],
                 loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8, frameon=False)
    for ax in (left, right):
        ax.set_xlabel("kv_idx")
        ax.set_ylabel("q_idx")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
