"""Tables the kernels read, derived from a BlockMask: checked, ascending and contiguous forward
tables with their row statistics (``launch_tables``), the backward's transposed tables
(``backward_tables``), the walks of Hopper forward programs that span two query blocks
(``program_walks``) and the decode kernels' check that a GQA group's heads list the same blocks
(``groups_share_tables``).

Each is kept on the mask under its own DerivedKey ([Note] Derived data in masks/block_mask.py), so a
rebuilt mask never inherits another's and a table changed in place or replaced is derived again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..cuda_graphs import capturing
from ..errors import InvalidInputError
from ..masks import EVERY_BLOCK_FULL, TABLES_IN_RANGE, BlockMask, DerivedKey
from ..masks.layout import ascending, dense_to_ordered, ordered_to_dense
from .ahead import recording

__all__ = [
    "RowStats", "LaunchTables", "LAUNCH_TABLES", "launch_tables", "checked_launch_tables", "preset_row_stats",
    "block_mask_row_stats", "ProgramWalks", "WALK_PARTIAL", "WALK_FULL", "program_walks", "PROGRAM_WALKS",
    "UNION_PROGRAM_ROWS", "UNION_CONSUMER_ROWS",
    "BackwardTables",
    "BACKWARD_TABLES", "backward_tables", "DqTurns", "DQ_TURNS", "dq_turns", "groups_share_tables", "assume_groups_differ",
]


class RowStats(NamedTuple):
    mean_blocks: float  # key blocks (partial and full) a query-block row visits, on average
    consecutive_partial: bool  # every row's partial blocks are first, first + 1, first + 2, ...
    consecutive_full: bool  # the same for the full blocks


class LaunchTables(NamedTuple):
    """A BlockMask's forward tables as the kernel reads them, and what launch choices need from them.

    Kept on the mask (BlockMask.derived), so a rebuilt mask never inherits another's and a table
    changed in place or replaced is checked again.
    """

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor  # kv_num_blocks when the mask has no full blocks
    full_kv_indices: torch.Tensor
    has_full: bool
    stats: RowStats
    plan_key: tuple  # everything in here a launch plan depends on


def _consecutive(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    steps = torch.arange(idx.shape[-1], device=idx.device, dtype=idx.dtype)
    used = steps < num.unsqueeze(-1)
    return ((idx == idx[..., :1] + steps) | ~used).all()


def _table_checks(num: torch.Tensor, idx: torch.Tensor, cols: int) -> list[torch.Tensor]:
    """[counts out of range, a used entry out of range, used entries not strictly ascending] (0-d)."""
    used = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
    bad_count = ((num < 0) | (num > idx.shape[-1])).any()
    bad_used = (used & ((idx < 0) | (idx >= cols))).any()
    unordered = (used[..., 1:] & (idx[..., 1:] <= idx[..., :-1])).any()
    return [bad_count, bad_used, unordered]


def _compute_launch_tables(block_mask: BlockMask) -> LaunchTables:
    """One host sync per mask: row statistics and the checks the kernel relies on."""
    nb, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    if capturing(nb):
        # CUDA's own error here ("operation not permitted when stream is capturing") says nothing of why.
        raise InvalidInputError(
            "block_mask: its tables must be read back to the host once to be checked, which a CUDA-graph "
            "capture cannot do. Call flex_attention with this mask once before capturing (the check is kept "
            "while the tables are unchanged); tables made under torch.inference_mode are checked at every "
            "eager call (they carry no version counter): build the mask under torch.no_grad() instead"
        )
    fnb, fidx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
    has_full = fnb is not None
    q_block, kv_block = block_mask.BLOCK_SIZE
    q_len, kv_len = block_mask.seq_lengths
    cols = -(-kv_len // kv_block)
    pairs = [("kv", nb, idx)] + ([("full_kv", fnb, fidx)] if has_full else [])
    for name, num, ind in pairs:
        if (num.dim() != 3 or ind.dim() != 4 or ind.shape[:3] != num.shape or num.device != nb.device
                or ind.device != nb.device or num.dtype.is_floating_point or ind.dtype.is_floating_point):
            raise InvalidInputError(
                f"block_mask.{name}_num_blocks {tuple(num.shape)} and block_mask.{name}_indices {tuple(ind.shape)} "
                "must be integer tensors [B, H, ROWS] and [B, H, ROWS, W] on one device"
            )
    if nb.shape[2] * q_block < q_len:
        raise InvalidInputError(
            f"block_mask.kv_num_blocks has {nb.shape[2]} rows of {q_block} queries, fewer than its Q_LEN "
            f"{q_len}; rebuild it with create_block_mask or BlockMask.from_kv_blocks"
        )
    total = nb.sum(dtype=torch.int64) + (fnb.sum(dtype=torch.int64) if has_full else 0)
    consecutive = [_consecutive(nb, idx), _consecutive(fnb, fidx) if has_full else _consecutive(nb, idx)]
    checks = [c for _, num, ind in pairs for c in _table_checks(num, ind, cols)]
    values = torch.stack([total, *(flag.to(torch.int64) for flag in consecutive + checks)]).tolist()
    total, partial, full, checks = values[0], bool(values[1]), bool(values[2]), values[3:]
    tables = {"kv": [nb, idx], "full_kv": [fnb, fidx]}
    reordered = False
    for i, (name, num, ind) in enumerate(pairs):
        bad_count, bad_used, unordered = checks[3 * i: 3 * i + 3]
        if bad_count or bad_used:
            raise InvalidInputError(
                f"block_mask.{name}_num_blocks / {name}_indices list a key block outside [0, {cols}) (the "
                f"mask's KV_LEN {kv_len} in blocks of {kv_block}) or more blocks than the table holds; the "
                "kernel would read outside the keys. Rebuild the mask (create_block_mask or from_kv_blocks check this)"
            )
        if unordered:
            # The kernel bounds-checks only a row's last block ([Note] Boundary block): keep rows
            # ascending (BlockMask's constructor does; a table changed in place may not be).
            tables[name][1] = ascending(num, ind)
            reordered = True
    if reordered:
        _check_no_repeats(pairs, tables)
    nb, idx = (t.contiguous() for t in tables["kv"])
    fnb, fidx = (t.contiguous() for t in tables["full_kv"]) if has_full else (nb, idx)
    stats = RowStats(total / max(1, nb.numel()), partial, full)
    return LaunchTables(nb, idx, fnb, fidx, has_full, stats, (tuple(nb.shape), has_full, stats))


def _check_no_repeats(pairs, tables) -> None:
    for name, num, _ in pairs:
        ind = tables[name][1]
        used = torch.arange(ind.shape[-1], device=ind.device) < num.unsqueeze(-1)
        if bool((used[..., 1:] & (ind[..., 1:] == ind[..., :-1])).any()):
            raise InvalidInputError(
                f"block_mask.{name}_indices lists a key block twice in one row; the kernel would count it twice"
            )


LAUNCH_TABLES = DerivedKey("launch tables")

# [Note] Tables read at each replay. A CUDA graph replays the kernels it captured, on the tensors it
# captured, whatever those hold by then: CUDA graphs' static-input recipe copies the next batch's
# mask into the captured mask's tables before each replay. What a call derived from the tables
# before the capture (kept on the mask, BlockMask.derived) would stay in every replay as it was.
# So inside a capture:
# - the kernels read the mask's own tables, or copies made inside the graph (contiguous and sorted
#   again at each replay), never copies kept from before;
# - the forward's consecutive-block flags, on which results depend, are off; the mean row length
#   measured before the capture steers speed only and is kept;
# - the backward's transposed tables are made inside the graph, at each replay;
# - decoding takes GQA groups as listing different blocks (always right), and the Hopper forward
#   does not walk the unions of two query blocks (kernels/hopper/forward.py [Note] Programs across query blocks).
# The checks of range and order ran once, before the capture, on the tables as they were then: a
# replay cannot read them back. The all-full mask of a call without one is marked so by construction
# and keeps its flags. A kernel the capture launches first (its flags off) compiles there: checked on
# a Hopper GPU with empty caches, portable and Gluon, forward and backward.


def launch_tables(block_mask: BlockMask) -> LaunchTables:
    """The checked tables and row statistics of ``block_mask``, computed once per table content
    (inside a CUDA-graph capture, tables read at each replay: [Note] Tables read at each replay)."""
    tables = block_mask.derived(LAUNCH_TABLES, _tables_for_launch)
    if capturing(block_mask.kv_num_blocks) and not block_mask.peek_derived(EVERY_BLOCK_FULL):
        return _read_at_replay(block_mask, tables)
    return tables


def _read_at_replay(block_mask: BlockMask, checked: LaunchTables) -> LaunchTables:
    """``checked`` as a capture may launch it: the mask's own tables (or copies made in the graph) and
    no consecutive-block flags."""
    nb, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    fnb, fidx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
    has_full = fnb is not None
    pairs = [(checked.kv_num_blocks, checked.kv_indices, nb, idx)]
    if has_full:
        pairs.append((checked.full_kv_num_blocks, checked.full_kv_indices, fnb, fidx))
    read = []
    for kept_num, kept_idx, num, ind in pairs:
        if kept_num is num and kept_idx is ind:
            read += [num, ind]  # the check found them contiguous and ascending: launched as they are
        else:  # copies: made again inside the graph, from the tables as they are at each replay
            num = num.contiguous()
            read += [num, ascending(num, ind).contiguous()]
    if not has_full:
        read += read[:2]
    stats = RowStats(checked.stats.mean_blocks, False, False)
    return LaunchTables(*read, has_full, stats, (tuple(read[0].shape), has_full, stats))


def _tables_for_launch(block_mask: BlockMask) -> LaunchTables:
    if block_mask.peek_derived(TABLES_IN_RANGE):
        return _trusted_launch_tables(block_mask)
    return _compute_launch_tables(block_mask)


def checked_launch_tables(block_mask: BlockMask) -> LaunchTables:
    """launch_tables' checks and row statistics (one host sync), whatever the mask says of itself and
    without keeping them on it: for a caller that keeps the statistics itself (compile/kept.py)."""
    return _compute_launch_tables(block_mask)


def preset_row_stats(block_mask: BlockMask, stats: RowStats) -> None:
    """Launch tables of ``block_mask`` as they are, with the row statistics checked earlier on these
    very tables (the caller stamps them by identity and version): no sync, and the launch plan of
    checked tables (compile/kept.py, for the masks of compiled calls)."""
    nb, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    fnb, fidx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
    has_full = fnb is not None
    block_mask.preset_derived(LAUNCH_TABLES, LaunchTables(
        nb, idx, fnb if has_full else nb, fidx if has_full else idx, has_full, stats, (tuple(nb.shape), has_full, stats)))


def _trusted_launch_tables(block_mask: BlockMask) -> LaunchTables:
    """Launch tables for a mask flexattn built from dense tile maps (see [Note] Tables in range by
    construction), set without the checks' host sync, so a decoding step that builds its mask each
    step never waits for the GPU. The row statistics are fixed (no consecutive-block fast path,
    mean = the table's width), so the step's launch plan is the same at every step; they only steer
    speed. The mask of a call without one (EVERY_BLOCK_FULL) gets the statistics the checks would
    compute, so its launch plan is the same whether it was checked or not."""
    nb, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    fnb, fidx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
    has_full = fnb is not None
    if has_full and block_mask.peek_derived(EVERY_BLOCK_FULL):
        # What the checks would find: every row visits all its blocks, listed in order.
        stats = RowStats(float(fidx.shape[-1]), True, True)
    else:
        stats = RowStats(float(idx.shape[-1]), False, False)
    return LaunchTables(nb, idx, fnb if has_full else nb, fidx if has_full else idx, has_full, stats,
                        (tuple(nb.shape), has_full, stats))


def block_mask_row_stats(block_mask: BlockMask) -> RowStats:
    """What launch choices need from a BlockMask's tables (see LaunchTables)."""
    return launch_tables(block_mask).stats


# ------------------------------------------------------------------------------------ program walks


class ProgramWalks(NamedTuple):
    """The key blocks a forward program of ``rows`` query rows walks when its rows span two of the
    BlockMask's query blocks (kernels/hopper/forward.py [Note] Programs across query blocks): the union of the
    two blocks' rows of the tables, ascending. Each entry is ``block << 4 | first << 2 | last``, where
    ``first`` and ``last`` say what the block is to the program's first and last query block: 0 not
    listed, 1 partial (the mask_mod runs), 2 full. Kept on the mask (BlockMask.derived)."""

    num: torch.Tensor  # [B, H, programs] int32: entries used in each row
    entries: torch.Tensor  # [B, H, programs, key blocks] int32


WALK_PARTIAL, WALK_FULL = 1, 2  # 0: not listed


def _compute_program_walks(block_mask: BlockMask, rows: int, sub_rows: int) -> ProgramWalks:
    tables = launch_tables(block_mask)
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE
    cols = -(-kv_len // kv_block)
    kinds = ordered_to_dense(tables.kv_num_blocks, tables.kv_indices, cols) * WALK_PARTIAL
    if tables.has_full:
        kinds = torch.maximum(kinds, ordered_to_dense(tables.full_kv_num_blocks, tables.full_kv_indices, cols)
                              * WALK_FULL)
    device = kinds.device
    starts = torch.arange(0, q_len, rows, device=device)
    # A program's first and last sub-blocks of rows (its consumers' rows; the last program's are
    # clamped to the queries, as the kernel clamps them) and the query blocks they lie in.
    first = torch.clamp(starts, max=q_len - sub_rows) // q_block
    last = torch.clamp(starts + rows - sub_rows, max=q_len - sub_rows) // q_block
    codes = (kinds[:, :, first] << 2) | kinds[:, :, last]  # [B, H, programs, cols]
    listed = codes != 0
    # Listed blocks first, ascending, then the others (a stable sort on "not listed").
    order = torch.argsort((~listed).to(torch.int8), dim=-1, stable=True)
    blocks = torch.arange(cols, device=device, dtype=torch.int32)
    entries = torch.gather((blocks << 4) | codes.to(torch.int32), -1, order)
    return ProgramWalks(listed.sum(-1, dtype=torch.int32).contiguous(), entries.to(torch.int32).contiguous())


def _walks_key(rows: int, sub_rows: int) -> DerivedKey:
    return DerivedKey("walks of programs across query blocks", (rows, sub_rows))


# The programs that walk unions: 192 query rows, three consumer warpgroups of 64 (kernels/hopper/forward.py).
UNION_PROGRAM_ROWS, UNION_CONSUMER_ROWS = 192, 64
PROGRAM_WALKS = _walks_key(UNION_PROGRAM_ROWS, UNION_CONSUMER_ROWS)


def program_walks(block_mask: BlockMask, rows: int = UNION_PROGRAM_ROWS,
                  sub_rows: int = UNION_CONSUMER_ROWS) -> ProgramWalks:
    """The walks of forward programs of ``rows`` query rows, made of sub-blocks of ``sub_rows`` that
    each lie in one query block (ProgramWalks); computed once per table content."""
    return block_mask.derived(_walks_key(rows, sub_rows),
                              lambda mask: _compute_program_walks(mask, rows, sub_rows))


# ------------------------------------------------------------------------------------ backward


class BackwardTables(NamedTuple):
    """The forward's tables transposed (per key block: the query blocks that see it), cropped to the
    blocks inside the lengths. Kept on the mask (BlockMask.derived), like the forward's."""

    q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    full_q_num_blocks: torch.Tensor  # q_num_blocks when the mask has no full blocks
    full_q_indices: torch.Tensor


def _compute_backward_tables(block_mask: BlockMask) -> BackwardTables:
    tables = launch_tables(block_mask)  # checked and ascending: exactly what the forward walked
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE
    rows, cols = -(-q_len // q_block), -(-kv_len // kv_block)

    def transposed(num, idx):
        if num.is_cuda and not recording():  # a recorded launch would not run: [Note] Kernels compiled ahead
            from .transpose_tables import transposed_tables  # imports Triton: only where it runs

            return transposed_tables(num, idx, rows, cols)
        dense = ordered_to_dense(num, idx, cols)[:, :, :rows]
        return dense_to_ordered(dense.transpose(-2, -1))

    qn, qi = transposed(tables.kv_num_blocks, tables.kv_indices)
    if tables.has_full:
        fqn, fqi = transposed(tables.full_kv_num_blocks, tables.full_kv_indices)
    else:
        fqn, fqi = qn, qi
    return BackwardTables(qn, qi, fqn, fqi)


BACKWARD_TABLES = DerivedKey("backward tables")


def backward_tables(block_mask: BlockMask) -> BackwardTables:
    """The transposed tables the backward walks, computed once per table content (inside a CUDA-graph
    capture, in the graph: [Note] Tables read at each replay)."""
    if capturing(block_mask.kv_num_blocks):
        return _compute_backward_tables(block_mask)
    return block_mask.derived(BACKWARD_TABLES, _compute_backward_tables)


class DqTurns(NamedTuple):
    """The order in which a deterministic backward adds the dQ parts of each query tile in the dK/dV
    kernel ([Note] Ordered dQ additions in templates/hopper_backward.py.jinja): where each key block's
    walk starts, and for each entry of the transposed tables (BackwardTables) its turn, the number
    of the query block's other key blocks that add before it. Entries past a column's count are 0."""

    walk_first: torch.Tensor  # [Z, H, COLS] int32: the walk's first entry (partial blocks, then full)
    q_turns: torch.Tensor  # like BackwardTables.q_indices, int32
    full_q_turns: torch.Tensor  # like BackwardTables.full_q_indices (q_turns when the mask has no full blocks)


def _compute_dq_turns(block_mask: BlockMask, bwd: BackwardTables) -> DqTurns:
    q_len = block_mask.seq_lengths[0]
    rows = -(-q_len // block_mask.BLOCK_SIZE[0])
    has_full = bwd.full_q_indices is not bwd.q_indices
    num, idx = bwd.q_num_blocks, bwd.q_indices
    parts = [(num, idx)] + ([(bwd.full_q_num_blocks, bwd.full_q_indices)] if has_full else [])
    length = sum(n for n, _ in parts)  # [Z, H, COLS]: entries in each key block's walk
    cols = length.shape[-1]
    device = idx.device
    # The walk's first entry: a key block's rank among the earlier ones whose walks begin at the same
    # query block (every key block of a document, or of a mask without mask_mod, begins at the same
    # one). Walks that begin alike then start apart and meet each query block a step after another.
    begins = torch.where(num > 0, idx[..., 0], bwd.full_q_indices[..., 0] if has_full else idx[..., 0])
    begins = torch.where(length > 0, begins, -1 - torch.arange(cols, device=device))
    earlier = torch.ones(cols, cols, dtype=torch.bool, device=device).tril(-1)
    rank = ((begins.unsqueeze(-1) == begins.unsqueeze(-2)) & earlier).sum(-1)
    walk_first = torch.where(length > 0, rank % length.clamp(min=1), 0)
    # Each entry's step in its walk; the query block's additions go by (step, key block).
    steps = []
    offset = torch.zeros_like(length)
    for n, ix in parts:
        position = offset.unsqueeze(-1) + torch.arange(ix.shape[-1], device=device)
        steps.append(torch.remainder(position - walk_first.unsqueeze(-1), length.clamp(min=1).unsqueeze(-1)))
        offset = offset + n
    key_block = torch.arange(cols, device=device).view(1, 1, cols, 1)
    never = (rows + 1) * cols  # past every key of a listed entry
    order = torch.full((*length.shape[:2], rows, cols), never, dtype=torch.long, device=device)
    for (n, ix), step in zip(parts, steps):
        used = torch.arange(ix.shape[-1], device=device) < n.unsqueeze(-1)
        key = torch.where(used, step.long() * cols + key_block, never)
        # order[z, h, m, c] = key of (c's entry for m); unused entries go to a spare row, then dropped.
        target = torch.where(used, ix.long(), rows)
        spare = torch.full((*length.shape[:2], rows + 1, cols), never, dtype=torch.long, device=device)
        spare.scatter_(-2, target.transpose(-2, -1), key.transpose(-2, -1))
        order = torch.minimum(order, spare[..., :rows, :])
    # A listed entry's turn: how many listed entries of its query block have a smaller key.
    turn_of = torch.argsort(torch.argsort(order, dim=-1), dim=-1).to(torch.int32)  # [Z, H, rows, cols]
    by_key_block = turn_of.transpose(-2, -1)  # [Z, H, cols, rows]

    def at_entries(n, ix):
        used = torch.arange(ix.shape[-1], device=device) < n.unsqueeze(-1)
        turns = torch.gather(by_key_block, -1, ix.long().clamp(0, rows - 1))
        return torch.where(used, turns, 0).to(torch.int32).contiguous()

    q_turns = at_entries(num, idx)
    full_q_turns = at_entries(bwd.full_q_num_blocks, bwd.full_q_indices) if has_full else q_turns
    return DqTurns(walk_first.to(torch.int32).contiguous(), q_turns, full_q_turns)


DQ_TURNS = DerivedKey("turns of ordered dQ additions")


def dq_turns(block_mask: BlockMask) -> DqTurns:
    """The turns of a deterministic backward's dQ additions (DqTurns), computed once per table content
    (inside a CUDA-graph capture, in the graph)."""
    if capturing(block_mask.kv_num_blocks):
        return _compute_dq_turns(block_mask, backward_tables(block_mask))
    return block_mask.derived(DQ_TURNS, lambda mask: _compute_dq_turns(mask, backward_tables(mask)))


# ------------------------------------------------------------------------------------ decode


def _groups_key(group: int) -> DerivedKey:
    return DerivedKey("GQA groups share their tables", group)


def assume_groups_differ(block_mask: BlockMask, group: int) -> None:
    """Let the decode kernels treat the GQA groups of ``block_mask`` as listing different blocks (always
    correct, if slower for groups that share them) without the check's host sync, for masks whose
    content is not known on the host (compiled calls). A mask with one head needs no check."""
    if group > 1 and block_mask.kv_num_blocks.shape[1] > 1:
        block_mask.preset_derived(_groups_key(group), False)


def groups_share_tables(block_mask: BlockMask, group: int) -> bool:
    """Whether the query heads of every GQA group list the same key blocks (per batch and row), so
    one program can walk them for the whole group. One host sync per mask content; inside a CUDA-graph
    capture, False for a mask of several heads ([Note] Tables read at each replay)."""
    if group == 1 or block_mask.kv_num_blocks.shape[1] == 1:
        return True  # one head per group, or one head's tables for all: nothing to compare, nothing kept
    if capturing(block_mask.kv_num_blocks):
        return False

    def compute(mask: BlockMask) -> bool:
        tables = launch_tables(mask)
        heads = tables.kv_num_blocks.shape[1]
        pairs = [(tables.kv_num_blocks, tables.kv_indices)]
        if tables.has_full:
            pairs.append((tables.full_kv_num_blocks, tables.full_kv_indices))
        checks = []
        for num, idx in pairs:
            used = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
            listed = torch.where(used, idx, -1)  # padding entries may differ: compare listed ones only
            num = num.reshape(num.shape[0], heads // group, group, *num.shape[2:])
            listed = listed.reshape(listed.shape[0], heads // group, group, *listed.shape[2:])
            checks += [(num == num[:, :, :1]).all(), (listed == listed[:, :, :1]).all()]
        return bool(torch.stack(checks).all())

    return block_mask.derived(_groups_key(group), compute)
