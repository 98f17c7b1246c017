"""Which block of which (batch, head) pair each program of an attention kernel takes: the launch order.

[Note] Launch order. The attention kernels' grids are (blocks, heads, batch): a program owns one
block of rows (queries in the forward and dQ, keys in dK/dV) of one (batch, head) pair. The GPU
starts programs in launch order, the block index fastest, as SMs free up. Under a causal-like mask
the blocks of a pair differ in work by up to the number of blocks (the last query block sees every
key block, the first sees one), so the order decides how long the launch's tail is: a heavy
program started late runs on alone while the other SMs have nothing left.

The kernels take each pair's heaviest block first. Across pairs that is not enough: the pairs come
one after another, so the last pair's heaviest block starts near the end of the launch. Simulated
list scheduling (132 SMs, one program each, a program's cost its number of blocks) puts a causal
launch of 48 pairs of 32 blocks (4 x 4k tokens, 12 heads) at 1.09x the shortest possible.

So the last TAIL_PAIRS pairs interleave: their programs take rank 0 (the heaviest block) of each of
those pairs, then rank 1, and so on, and the light blocks of many pairs end the launch. The tail
holds at least PROGRAMS_PER_SM programs an SM, so its heavy blocks start early enough to fill the
GPU with the rest of the launch behind them. The pairs before it keep the grid's order, so their
programs still run side by side, reading one pair's keys and values (or queries) at about the same
time from L2.

Measured against the grid's order (``python -m benchmarks.launch_order``; docs/benchmarks_log.md,
"Launch order: the last pairs of a launch interleave"): faster for causal masks, documents and a sliding
window, forward and backward, up to 8k tokens, and within noise at 16k. Tails of one, two and four
programs an SM, and interleaving every pair in groups of the rule's size, were measured too: four an SM
was the best, or level with the best, in every case under 16k tokens. A mask whose rows all visit every
block (no mask_mod) keeps the grid's order: no block is heavier than another.

``tail_pairs`` works TAIL_PAIRS out on the host from the grid, the device and whether the mask's
rows are alike; the kernels' shared ``launch_order`` helper (templates/common.py.jinja) maps a
program's grid coordinates to its (rank, pair). TAIL_PAIRS = 1 is the old order. Every order
computes each output from the same tiles in the same sequence, so the results do not depend on it,
bit for bit (tests/test_launch_order.py). The deterministic backward's slot turns follow the
programs' launch order, which does not change.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["tail_pairs", "rows_alike", "sm_count", "PROGRAMS_PER_SM", "INTERPRETER_SMS"]

PROGRAMS_PER_SM = 4  # the tail's programs per SM, at least (see the Note)
INTERPRETER_SMS = 4  # what the rule assumes off the GPU, where programs run one by one and order costs nothing


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tail(blocks: int, pairs: int, sms: int) -> int:
    return min(pairs, max(1, math.ceil(PROGRAMS_PER_SM * sms / max(blocks, 1))))


@functools.lru_cache(maxsize=4096)
def _cached_tail(blocks: int, pairs: int, device_type: str, device_index) -> int:
    if device_type != "cuda":
        return _tail(blocks, pairs, INTERPRETER_SMS)
    return _tail(blocks, pairs, _sm_count(torch.cuda.current_device() if device_index is None else device_index))


def sm_count(device: torch.device) -> int:
    """The multiprocessors of CUDA ``device`` (its MIG slice's, under MIG), read once per device."""
    return _sm_count(torch.cuda.current_device() if device.index is None else device.index)


def tail_pairs(grid: tuple, device: torch.device, rows_alike: bool) -> int:
    """TAIL_PAIRS for a launch of ``grid`` = (blocks, heads, batch) on ``device``: how many of the
    last (batch, head) pairs interleave their blocks, heaviest first ([Note] Launch order). 1 (the
    grid's own order) when every row of the mask visits every block (``rows_alike``): then no block
    is heavier than another."""
    if rows_alike:
        return 1
    blocks, heads, batch = grid
    return _cached_tail(blocks, heads * batch, device.type, device.index)


def rows_alike(tables, kv_len: int, kv_block: int) -> bool:
    """Whether every row of the mask's forward tables (kernels/tables.py LaunchTables) visits every
    key block, as without a mask_mod; then every column is visited by every row as well."""
    return tables.stats.mean_blocks >= -(-kv_len // kv_block)
