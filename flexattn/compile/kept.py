"""What a compiled call's mask derives, kept per table: each call of the ops makes a new BlockMask on
the tables it is given (``op_block_mask``), and what launches derive from those tables (checked row
statistics, the backward's transposed tables, the Hopper forward's program walks) is kept here for
the next calls on the very same tables ([Note] What a compiled call's mask derives, kept)."""

from __future__ import annotations

import weakref
from typing import Callable, Optional

from torch.utils.weak import WeakTensorKeyDictionary

from ..cuda_graphs import capturing, may_keep_allocations, stream_key
from ..kernels.tables import (
    BACKWARD_TABLES, PROGRAM_WALKS, RowStats, assume_groups_differ, checked_launch_tables, preset_row_stats,
)
from ..masks import BlockMask, dense_block_mask, version_of

__all__ = ["op_block_mask", "kept_record", "current_record", "keep_backward_tables", "keep_program_walks",
           "weak_refs", "same_objects"]


def op_block_mask(query, key, tables, block_size, seq_lengths, group: int,
                  stats: Optional[RowStats] = None) -> BlockMask:
    """The op's tables as a BlockMask, with what earlier calls derived from them; ``stats``: row
    statistics to assume instead (for stand-in tables, whose contents mean nothing)."""
    L, S = query.shape[2], key.shape[2]
    if tables[0] is None:
        return dense_block_mask(L, S, query.device)
    tables = [None if t is None else t.contiguous() for t in tables]
    # What this call derives is kept for the next calls on its tables where allocations may be kept
    # (cuda_graphs.py): not in a CUDA-graph tree's warm-up, whose allocations are the graph's.
    mask = BlockMask.from_launch_tables(tuple(seq_lengths), *tables, BLOCK_SIZE=tuple(block_size), one_call=True,
                                        derived_kept=may_keep_allocations(query.device))
    kept = None if stats is not None else kept_record(mask) or _checked(mask)
    if stats is not None:
        preset_row_stats(mask, stats)
    elif kept is not None:
        if kept.stats is not None:
            preset_row_stats(mask, kept.stats)
        if kept.backward is not None:
            mask.preset_derived(BACKWARD_TABLES, kept.backward)
        if kept.walks is not None:
            mask.preset_derived(PROGRAM_WALKS, kept.walks)
    else:
        hint = _SHAPES_CHECKED.get(_shape_of(mask))
        if hint is not None:  # see [Note] What a compiled call's mask derives, kept
            preset_row_stats(mask, RowStats(hint, False, False))
    assume_groups_differ(mask, group)
    return mask


# [Note] What a compiled call's mask derives, kept. Each call of the op makes a new BlockMask on the
# tables it is given, so what launches derive from a mask (BlockMask.derived) would be derived again
# at every call, for every layer. It is kept here instead, per table object, stamped like
# BlockMask.derived's data (the table objects, held weakly, their version counters, BLOCK_SIZE and
# the lengths), for the next calls on those very tables (every layer of a step, every step of a
# static mask):
# * the row statistics, which take reading the tables back: the first mask of each table shape that
#   a compiled call meets (outside a CUDA-graph capture) is checked once, at that call; a new mask of
#   a shape already met (one rebuilt every step) takes the trusted plan, without the forward's
#   consecutive-block path, so a step never waits for the GPU for its mask;
# * the backward's transposed tables (computed on the device), kept after a backward outside a
#   capture (inside one, they are written only when the graph replays);
# * the forward's program walks (kernels/hopper/forward.py [Note] Programs across query blocks, computed on
#   the device), kept after a forward that walked them (never inside a capture);
# * per table shape, the mean row length of the first mask checked: the density that the launch
#   choices (AUTO's Gluon or portable kernel, tile sizes) assume for a mask of that shape whose
#   contents the host does not know (one rebuilt every step, or the static copy a CUDA-graph capture
#   reads). Only speed depends on it: the consecutive-block flags, on which results depend, stay off.
# * per stream (flexattn/cuda_graphs.py): what a call on one stream derived on the device is read by
#   the next calls on that stream, after it by stream order; a call on another stream derives its own.
_KEPT = WeakTensorKeyDictionary()  # kv_num_blocks -> {stream key: _Kept}
# table shape -> mean key blocks a row visits, of the first mask checked (None: its check raised)
_SHAPES_CHECKED: dict = {}
_SHAPES_KEPT = 1024  # lengths that keep changing (a decoding loop) must not pile up entries


class _Kept:
    # Warm entries (forward and backward) refer to it weakly.
    __slots__ = ("tables", "stamp", "stats", "backward", "walks", "__weakref__")

    def __init__(self, mask: BlockMask, stats: Optional[RowStats]):
        self.tables = weak_refs((mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices))
        self.stamp = _stamp(mask)
        self.stats, self.backward, self.walks = stats, None, None


def weak_refs(tables) -> tuple:
    return tuple(None if t is None else weakref.ref(t) for t in tables)


def same_objects(refs: tuple, tables) -> bool:
    """Each table is the very object its weak reference was taken of (an id() that came back is not)."""
    return all((ref is None) == (t is None) and (ref is None or ref() is t) for ref, t in zip(refs, tables))


def _stamp(mask: BlockMask) -> tuple:
    tables = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)
    return tuple(-1 if t is None else version_of(t) for t in tables), mask.BLOCK_SIZE, mask.seq_lengths


def kept_record(mask: BlockMask) -> Optional[_Kept]:
    """What was kept for these very tables, while its stamp holds."""
    kept = current_record(mask.kv_num_blocks)
    others = (mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)
    if kept is not None and kept.stamp == _stamp(mask) and same_objects(kept.tables, others):
        return kept
    return None


def current_record(kv_num_blocks) -> Optional[_Kept]:
    """The record kept now for the tables of which ``kv_num_blocks`` is the first (a warm entry
    checks that the record it holds weakly is still this one), for the current stream."""
    records = _KEPT.get(kv_num_blocks)
    return None if records is None else records.get(stream_key(kv_num_blocks.device))


def _keep_record(mask: BlockMask, stats: Optional[RowStats]) -> _Kept:
    """A new record of ``mask``'s tables for the current stream (replacing that stream's old one)."""
    nb = mask.kv_num_blocks
    records = _KEPT.get(nb)
    if records is None:
        records = _KEPT[nb] = {}
    kept = records[stream_key(nb.device)] = _Kept(mask, stats)
    return kept


def _shape_of(mask: BlockMask) -> tuple:
    nb = mask.kv_num_blocks
    return (tuple(nb.shape), tuple(mask.kv_indices.shape), mask.full_kv_num_blocks is not None, nb.device,
            mask.BLOCK_SIZE, mask.seq_lengths)


def _checked(mask: BlockMask) -> Optional[_Kept]:
    """The first mask of its table shape: checked now (one host sync) and kept, row statistics and all."""
    nb = mask.kv_num_blocks
    shape = _shape_of(mask)
    if shape in _SHAPES_CHECKED or capturing(nb):
        return None
    if len(_SHAPES_CHECKED) >= _SHAPES_KEPT:  # the oldest goes: a mask of its shape is checked again
        del _SHAPES_CHECKED[next(iter(_SHAPES_CHECKED))]
    _SHAPES_CHECKED[shape] = None
    checked = checked_launch_tables(mask)  # raises on tables out of range
    _SHAPES_CHECKED[shape] = checked.stats.mean_blocks
    same = (checked.kv_num_blocks is nb and checked.kv_indices is mask.kv_indices
            and (mask.full_kv_num_blocks is None or (checked.full_kv_num_blocks is mask.full_kv_num_blocks
                                                     and checked.full_kv_indices is mask.full_kv_indices)))
    # Reordered tables: the statistics are not those of the tables the op launches.
    kept = _keep_record(mask, checked.stats if same else None)
    return kept


def keep_backward_tables(mask: BlockMask) -> None:
    """After a backward on ``mask``: keep its transposed tables for the next calls on the same tables."""
    kept = _keep_derived(mask, BACKWARD_TABLES, lambda kept: kept.backward)
    if kept is not None:
        kept.backward = mask.peek_derived(BACKWARD_TABLES)


def keep_program_walks(mask: BlockMask) -> None:
    """After a forward on ``mask``: keep the program walks it derived for the next calls on the same tables."""
    kept = _keep_derived(mask, PROGRAM_WALKS, lambda kept: kept.walks)
    if kept is not None:
        kept.walks = mask.peek_derived(PROGRAM_WALKS)


def _keep_derived(mask: BlockMask, key, held: Callable) -> Optional[_Kept]:
    """The record of ``mask``'s tables that should now hold what ``mask`` derived under ``key``
    (made if missing); None when nothing was derived, the record holds it already (no stream
    queries on the steady state's path), or nothing may be kept on the device now."""
    value = mask.peek_derived(key)
    kept = kept_record(mask)
    if value is None or (kept is not None and held(kept) is value):
        return None
    if not may_keep_allocations(mask.kv_num_blocks.device):
        return None
    if kept is None:
        kept = _keep_record(mask, None)
    return kept
