"""Decoding with a KV cache: query offsets, valid cache lengths, and the BlockMask of one step.

When a model decodes token t, its query is one row (or a few) but the keys are the whole cache, so
a mod written for full sequences must see the query at its *absolute* position ``t``, not at 0, and
cache slots past a sequence's valid length must not be attended to (the FlexAttention paper,
section 5.2). This module builds both from the mods you already have:

* :func:`offset_mask_mod` / :func:`offset_score_mod`: the mod called with ``q_idx + offset``
  (``offset[b]`` when the offset is per batch), and cache slots ``kv_idx >= kv_lengths[b]`` masked.
* :func:`decode_block_mask`: the step's BlockMask from the full-length one: the rows that hold the
  step's positions, ``seq_lengths = (q_len, kv_len)``, blocks past the valid lengths dropped, and
  the shifted mask_mod.

[Note] Offsets are tensors
The offset and lengths are tensors that the mods *read* (captured tensors, graph inputs of the
traced mod), never Python numbers baked into it: a new position gives the same graph, the same
generated kernel and no new trace (``flexattn.trace.counts.traces`` stays put). Pass your own tensor
and update it in place between steps (``pos += 1``) and the same mod objects serve every step,
which is what a captured CUDA graph needs. A Python int is turned into a 0-d tensor on the device
with ``torch.full`` (a fill, not a host-to-device copy).

Nothing in this module reads a device tensor back: no ``.item()``, no data-dependent shapes, so no
host synchronisation in a decoding step. Offsets out of range cannot be checked on the host without
one: on the CPU they raise InvalidInputError, on an accelerator a device-side assert
(``torch._assert_async``) reports them.
"""

from __future__ import annotations

import math
import operator
from typing import Callable, Optional, Union

import torch

from ..errors import InvalidInputError
from ..mods import MaskMod, ScoreMod, arity_mistake, check_mask_mod, identity_score_mod, mod_factory, mod_name, noop_mask
from .block_mask import TABLES_IN_RANGE, BlockMask, as_block_mask, sliced_rows_mask_mod
from .layout import cdiv, default_device, dense_to_ordered, device_argument, ordered_to_dense, positive_int

__all__ = ["offset_mask_mod", "offset_score_mod", "decode_block_mask"]

IntOrTensor = Union[int, torch.Tensor]


# --------------------------------------------------------------------------------------------
# Offsets and lengths as tensors the mods read
# --------------------------------------------------------------------------------------------


def index_tensor(name: str, value: IntOrTensor, device: Union[str, torch.device, None]) -> torch.Tensor:
    """``value`` as an integer tensor of 0 or 1 dims: yours unchanged (so in-place updates reach the
    mods), or a Python int as a 0-d int32 tensor (int64 when it needs it) on ``device``."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
            raise InvalidInputError(f"{name} must be an int or an integer tensor, got a {value.dtype} tensor")
        if value.dim() > 1:
            raise InvalidInputError(
                f"{name} must be an int, a 0-d tensor (same for every sequence) or a 1-d tensor [B] (one per "
                f"sequence), got shape {tuple(value.shape)}"
            )
        return value
    if isinstance(value, bool):
        raise InvalidInputError(f"{name} must be an int or an integer tensor, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidInputError(f"{name} must be an int or an integer tensor, got {type(value).__name__}") from None
    if number < 0:
        raise InvalidInputError(f"{name} must be >= 0, got {number}")
    dtype = torch.int32 if number < 2**31 else torch.int64
    return torch.full((), number, dtype=dtype, device=default_device() if device is None else device)


def check_on_device(condition: torch.Tensor, message: str) -> None:
    """Raise InvalidInputError unless ``condition`` (a bool tensor) is all true, without a host sync
    on an accelerator: there a device-side assert reports it at a later launch."""
    condition = condition.all()
    if condition.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(condition):
            raise InvalidInputError(message)
    else:
        torch._assert_async(condition, message)


def _absolute_position(offset: torch.Tensor) -> Callable:
    """``(b, q_idx) -> q_idx + offset`` (or ``+ offset[b]``): the query's position in the sequence."""
    if offset.dim() == 0:
        def absolute(b, q_idx):
            return q_idx + offset
    else:
        def absolute(b, q_idx):
            return q_idx + offset[b]
    return absolute


def _in_cache(lengths: torch.Tensor) -> Callable:
    """``(b, kv_idx) -> kv_idx < lengths`` (or ``lengths[b]``): the slot holds a real key."""
    if lengths.dim() == 0:
        def in_cache(b, kv_idx):
            return kv_idx < lengths
    else:
        def in_cache(b, kv_idx):
            return kv_idx < lengths[b]
    return in_cache


def _device_of(*values) -> Optional[torch.device]:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.device
    return None


@mod_factory
def offset_mask_mod(
    mask_mod: Optional[MaskMod],
    offset: IntOrTensor,
    kv_lengths: Optional[IntOrTensor] = None,
    *,
    device: Union[str, torch.device, None] = None,
) -> MaskMod:
    """``mask_mod`` seen from queries that start at position ``offset``, in a cache of valid lengths.

    The new mask_mod calls ``mask_mod(b, h, q_idx + offset, kv_idx)`` (``offset[b]`` for a per-batch
    offset), and with ``kv_lengths`` also masks ``kv_idx >= kv_lengths`` (``kv_lengths[b]``).

    Args:
        mask_mod: written for the full sequence (absolute positions); None means keep every pair.
        offset: the absolute position of query row 0: an int, a 0-d integer tensor, or a 1-d integer
            tensor ``[B]`` with one position per sequence.
        kv_lengths: valid cache length per sequence (same forms as ``offset``), or None.
        device: where an int offset or length is placed (default: the device of the other argument
            if it is a tensor, else "cuda" when available, else "cpu"). It must be the query's.

    Tensors are used as they are, never copied: update them in place between steps and the same mod
    serves every step with no new trace (see [Note] Offsets are tensors).
    """
    if mask_mod is None:
        mask_mod = noop_mask
    check_mask_mod(mask_mod, "offset_mask_mod")
    device = device_argument(device, "offset_mask_mod") if device is not None else _device_of(offset, kv_lengths)
    absolute = _absolute_position(index_tensor("offset", offset, device))
    if kv_lengths is None:
        def shifted(b, h, q_idx, kv_idx):
            return mask_mod(b, h, absolute(b, q_idx), kv_idx)
    else:
        in_cache = _in_cache(index_tensor("kv_lengths", kv_lengths, device))

        def shifted(b, h, q_idx, kv_idx):
            return mask_mod(b, h, absolute(b, q_idx), kv_idx) & in_cache(b, kv_idx)
    shifted.__name__ = f"{mod_name(mask_mod)}_at_offset"
    return shifted


@mod_factory
def offset_score_mod(
    score_mod: Optional[ScoreMod],
    offset: IntOrTensor,
    kv_lengths: Optional[IntOrTensor] = None,
    *,
    device: Union[str, torch.device, None] = None,
) -> ScoreMod:
    """``score_mod`` seen from queries that start at position ``offset``; see :func:`offset_mask_mod`.

    The new score_mod returns ``score_mod(score, b, h, q_idx + offset, kv_idx)``, and ``-inf`` where
    ``kv_idx >= kv_lengths`` when lengths are given (needed without a BlockMask; with one from
    :func:`decode_block_mask` the mask already does it). None means the identity.
    """
    if score_mod is None:
        score_mod = identity_score_mod
    if not callable(score_mod):
        raise TypeError(f"offset_score_mod: score_mod must be callable, got {type(score_mod).__name__}")
    mistake = arity_mistake(score_mod, "score_mod", "offset_score_mod")
    if mistake:
        raise InvalidInputError(mistake)
    device = device_argument(device, "offset_score_mod") if device is not None else _device_of(offset, kv_lengths)
    absolute = _absolute_position(index_tensor("offset", offset, device))
    if kv_lengths is None:
        def shifted(score, b, h, q_idx, kv_idx):
            return score_mod(score, b, h, absolute(b, q_idx), kv_idx)
    else:
        in_cache = _in_cache(index_tensor("kv_lengths", kv_lengths, device))

        def shifted(score, b, h, q_idx, kv_idx):
            return torch.where(in_cache(b, kv_idx), score_mod(score, b, h, absolute(b, q_idx), kv_idx), -math.inf)
    shifted.__name__ = f"{mod_name(score_mod)}_at_offset"
    return shifted


# --------------------------------------------------------------------------------------------
# The BlockMask of one decoding step
# --------------------------------------------------------------------------------------------


def _batch_size(block_mask_batch: int, **per_batch: torch.Tensor) -> int:
    """The step mask's batch: the mask's, or the length of the per-sequence offsets/lengths."""
    sizes = {"block_mask": block_mask_batch}
    sizes.update({name: t.shape[0] for name, t in per_batch.items() if t is not None and t.dim() == 1})
    batch = max(sizes.values())
    wrong = {name: n for name, n in sizes.items() if n not in (1, batch)}
    if wrong:
        raise InvalidInputError(
            "decode_block_mask: the batch sizes of " + ", ".join(f"{k} ({v})" for k, v in sizes.items())
            + " must agree (or be 1 to broadcast)"
        )
    return batch


def _is_row_slice_stub(mask_mod) -> bool:
    if mask_mod is sliced_rows_mask_mod:
        return True
    return getattr(mask_mod, "__name__", "") == "_sliced_mask_mod_error"  # torch's stand-in


def decode_block_mask(
    block_mask: BlockMask,
    offset: IntOrTensor,
    q_len: int = 1,
    kv_len: Optional[int] = None,
    kv_lengths: Optional[IntOrTensor] = None,
) -> BlockMask:
    """The BlockMask of one decoding step, cut from the mask of the full sequence.

    Args:
        block_mask: built for the whole sequence, e.g. ``create_block_mask(causal, B, H, MAX_LEN,
            MAX_LEN)``, with its mask_mod (flexattn's or torch's BlockMask; not a row-sliced one).
        offset: the absolute position of the step's first query: an int, a 0-d integer tensor, or
            ``[B]`` (one per sequence, e.g. sequences of different lengths in one batch). Positions
            ``offset .. offset + q_len - 1`` must lie inside the mask's Q_LEN.
        q_len: how many queries the step passes (1 for plain decoding, more for speculative steps).
        kv_len: the key length of the call (the cache size); at most the mask's KV_LEN, which is the
            default.
        kv_lengths: valid cache length per sequence (int, 0-d or ``[B]``), or None: key blocks wholly
            past it are dropped (never read) and the mask_mod masks the rest.

    Returns a mask with ``seq_lengths = (q_len, kv_len)``: for each row of ``q_len`` queries, the key
    blocks any of its positions visits in ``block_mask`` (full only where full for all of them), and
    ``mask_mod = offset_mask_mod(block_mask.mask_mod, offset, kv_lengths)``. Its batch is the mask's,
    or B for per-sequence offsets or lengths. It has no transposed tables (inference only; the
    backward derives its own).

    Every step costs a few small tensor ops on the mask's device and no host sync when ``offset``
    and ``kv_lengths`` are tensors there (see [Note] Offsets are tensors). Keep them as tensors you
    update in place and the mods the steps produce share one trace and one kernel.
    """
    bm = as_block_mask(block_mask)
    if _is_row_slice_stub(bm.mask_mod):
        raise InvalidInputError(
            "decode_block_mask needs the full-length BlockMask with its mask_mod, not one whose rows were "
            "already selected with block_mask[:, :, rows]: pass the mask you built for the whole sequence"
        )
    q_block, kv_block = bm.BLOCK_SIZE
    mask_q_len, mask_kv_len = bm.seq_lengths
    q_len = positive_int("q_len", q_len)
    kv_len = mask_kv_len if kv_len is None else positive_int("kv_len", kv_len)
    if q_len > mask_q_len or kv_len > mask_kv_len:
        raise InvalidInputError(
            f"decode_block_mask(q_len={q_len}, kv_len={kv_len}): the block_mask was built for Q_LEN={mask_q_len}, "
            f"KV_LEN={mask_kv_len}; build it for the longest sequence the cache holds"
        )
    device = bm.kv_num_blocks.device
    offset_t = index_tensor("offset", offset, device)
    lengths_t = None if kv_lengths is None else index_tensor("kv_lengths", kv_lengths, device)
    for name, t in (("offset", offset_t), ("kv_lengths", lengths_t)):
        if t is not None and t.device != device:
            raise InvalidInputError(
                f"decode_block_mask: {name} is on {t.device} but the block_mask is on {device}; create it there"
            )
    if not isinstance(offset, torch.Tensor) and offset + q_len > mask_q_len:
        raise InvalidInputError(
            f"decode_block_mask: queries at positions {offset}..{offset + q_len - 1} are past the block_mask's "
            f"Q_LEN={mask_q_len}"
        )
    check_on_device(
        (offset_t >= 0) & (offset_t + q_len <= mask_q_len),
        f"decode_block_mask: offset + q_len ({q_len}) must lie in [0, Q_LEN={mask_q_len}] for every sequence",
    )
    mask_batch, heads, rows = bm.kv_num_blocks.shape
    batch = _batch_size(mask_batch, offset=offset_t, kv_lengths=lengths_t)

    # The original rows each step row covers: its first and its last position's (equal when aligned).
    step_rows = cdiv(q_len, q_block)
    starts = torch.arange(step_rows, device=device) * q_block
    ends = (starts + q_block).clamp(max=q_len) - 1
    first = offset_t.reshape(-1, 1).long() + starts  # [1 or B, step_rows]
    last = offset_t.reshape(-1, 1).long() + ends
    # The clamp keeps a bad offset (reported above) from reading outside the tables.
    src = torch.stack([first // q_block, last // q_block], dim=-1).clamp(0, rows - 1)
    src = src.reshape(-1, 1, 2 * step_rows).expand(batch, heads, 2 * step_rows)
    cols = bm._num_cols()

    def rows_of(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        num = num.expand(batch, heads, rows).gather(2, src)
        width = idx.shape[-1]
        idx = idx.expand(batch, heads, rows, width).gather(2, src.unsqueeze(-1).expand(-1, -1, -1, width))
        return ordered_to_dense(num, idx, cols).view(batch, heads, step_rows, 2, cols).bool()

    visited = rows_of(bm.kv_num_blocks, bm.kv_indices)
    full = None
    if bm.full_kv_num_blocks is not None:
        full_rows = rows_of(bm.full_kv_num_blocks, bm.full_kv_indices)
        visited = visited | full_rows
        full = full_rows.all(dim=3)
    visited = visited.any(dim=3)

    # Key blocks: those inside kv_len and the valid length; the one the limit cuts is partial.
    step_cols = cdiv(kv_len, kv_block)
    limit = torch.full((), kv_len, device=device) if lengths_t is None else lengths_t.clamp(max=kv_len)
    limit = limit.reshape(-1, 1, 1, 1)
    col_start = torch.arange(step_cols, device=device) * kv_block
    visited = visited[..., :step_cols] & (col_start < limit)
    mask_mod = offset_mask_mod(bm.mask_mod, offset_t, lengths_t)
    if full is None:
        num, idx = dense_to_ordered(visited)
        step = BlockMask((q_len, kv_len), num, idx, None, None, None, None, None, None,
                         BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=mask_mod)
    else:
        full = full[..., :step_cols] & visited & (col_start + kv_block <= limit)
        num, idx = dense_to_ordered(visited & ~full)
        full_num, full_idx = dense_to_ordered(full)
        step = BlockMask((q_len, kv_len), num, idx, full_num, full_idx, None, None, None, None,
                         BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=mask_mod)
    # Its tables come from dense maps, ascending and in range: the kernels' launch tables need no
    # checking, so the step costs no host sync there either ([Note] Tables in range by construction).
    step.preset_derived(TABLES_IN_RANGE, True)
    return step
