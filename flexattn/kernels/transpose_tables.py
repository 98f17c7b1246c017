"""The backward's tables from the forward's, on the GPU in two small kernels.

The backward walks the BlockMask by key-block columns: for each column, the query-block rows that
visit it. ``transposed_tables`` computes them from the forward's row tables:

1. ``_mark_visits``: each row writes a 1 into a zeroed ``[B*H, COLS, ROWS]`` map for every column
   its first ``num`` entries list;
2. ``_list_rows``: each column reads its map row back and writes the rows it holds, ascending, then
   the others, ascending (the layout ``dense_to_ordered`` makes, and torch's).

Three launches (a memset and the two kernels) where the same computation in torch ops takes about
sixteen (scatter, arange, compare, a segmented sort...). That count matters under CUDA graphs: a
captured training step cannot keep transposed tables across replays (the mask's contents may change
between them), so every layer's backward transposes its mask again (about 0.75 ms of a 4k step of
the 12-layer model in small kernels, docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch

__all__ = ["transposed_tables"]


@triton.jit
def _mark_visits(NUM, IDX, VISITS, ROWS, COLS, NUM_ROWS_ALL, WIDTH, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    bh = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < ROWS
    count = tl.load(NUM + bh * NUM_ROWS_ALL + rows, mask=row_ok, other=0)
    for w0 in range(0, WIDTH, BLOCK_W):
        slots = w0 + tl.arange(0, BLOCK_W)
        used = row_ok[:, None] & (slots[None, :] < count[:, None])
        cols = tl.load(IDX + (bh * NUM_ROWS_ALL + rows[:, None]).to(tl.int64) * WIDTH + slots[None, :],
                       mask=used, other=0)
        ok = used & (cols >= 0) & (cols < COLS)  # checked tables are in range; never write outside
        target = (bh * COLS + cols).to(tl.int64) * ROWS + rows[:, None]
        tl.store(VISITS + target, tl.full([BLOCK_R, BLOCK_W], 1, tl.int8), mask=ok)


@triton.jit
def _list_rows(VISITS, Q_NUM, Q_IDX, ROWS, COLS, BLOCK_R: tl.constexpr):
    bh = tl.program_id(0)
    col = tl.program_id(1)
    base = (bh * COLS + col).to(tl.int64) * ROWS
    total = tl.zeros([BLOCK_R], dtype=tl.int32)
    for r0 in range(0, ROWS, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        total += tl.load(VISITS + base + rows, mask=rows < ROWS, other=0).to(tl.int32)
    kept_total = tl.sum(total, axis=0)
    before = tl.sum(tl.zeros([BLOCK_R], dtype=tl.int32), axis=0)  # visiting rows in earlier chunks
    for r0 in range(0, ROWS, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        in_range = rows < ROWS
        kept = tl.load(VISITS + base + rows, mask=in_range, other=0).to(tl.int32)
        kept_before = before + tl.cumsum(kept, axis=0) - kept  # visiting rows before this one
        # Visiting rows first, in order; then the others, in order, after all visiting ones.
        slot = tl.where(kept != 0, kept_before, kept_total + rows - kept_before)
        tl.store(Q_IDX + base + slot, rows.to(tl.int32), mask=in_range)
        before += tl.sum(kept, axis=0)
    tl.store(Q_NUM + bh * COLS + col, kept_total)


def transposed_tables(num: torch.Tensor, idx: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_num_blocks [B, H, cols], q_indices [B, H, cols, rows])``, int32, from checked, contiguous
    int32 row tables ``num [B, H, R]`` and ``idx [B, H, R, W]`` (R >= rows; rows past ``rows`` are
    left out, as the backward's crop does)."""
    B, H, rows_all = num.shape
    width = idx.shape[-1]
    q_num = torch.empty((B, H, cols), dtype=torch.int32, device=num.device)
    q_idx = torch.empty((B, H, cols, rows), dtype=torch.int32, device=num.device)
    if B * H == 0 or cols == 0 or rows == 0:
        return q_num.zero_(), q_idx
    visits = torch.zeros((B * H, cols, rows), dtype=torch.int8, device=num.device)
    block_r = min(128, max(16, triton.next_power_of_2(rows)))
    launch(_mark_visits, (B * H, triton.cdiv(rows, block_r), 1),
           (num, idx, visits, rows, cols, rows_all, width), dict(BLOCK_R=block_r, BLOCK_W=32, num_warps=4))
    launch(_list_rows, (B * H, cols, 1), (visits, q_num, q_idx, rows, cols), dict(BLOCK_R=block_r, num_warps=4))
    return q_num, q_idx
