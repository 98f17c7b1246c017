"""BlockMask: which (query block, key block) tiles a kernel visits, and whether it must mask them.

The sequence is cut into blocks of ``Q_BLOCK`` query rows and ``KV_BLOCK`` key columns, giving a
grid of ``ROWS x COLS`` tiles per (batch, head). Each tile is one of:

* **empty**: the mask_mod keeps no pair in it. It is not stored, so the kernels never touch it.
* **partial**: some pairs are kept. It goes in ``kv_num_blocks`` / ``kv_indices`` and the kernels
  evaluate the mask_mod on every pair.
* **full**: every pair is kept. It goes in ``full_kv_num_blocks`` / ``full_kv_indices`` and the
  kernels skip the mask_mod there (cheaper: for causal masks most visited tiles are full).

Per row of blocks, ``kv_num_blocks[b, h, row]`` says how many tiles the row visits and the first
that many entries of ``kv_indices[b, h, row, :]`` say which key blocks, in ascending order. Entries
after that are padding: always a valid block index, never meaningful. The tiles of a row can be
read back like this (the same loop works for the full pair)::

    >>> import torch
    >>> from flexattn import create_block_mask
    >>> def causal(b, h, q_idx, kv_idx):
    ...     return q_idx >= kv_idx
    >>> bm = create_block_mask(causal, 1, 1, 512, 512, device="cpu", BLOCK_SIZE=128)
    >>> ROWS, COLS = bm.kv_indices.shape[-2:]
    >>> dense = torch.zeros(ROWS, COLS, dtype=torch.int32)
    >>> for row in range(ROWS):
    ...     for j in range(bm.kv_num_blocks[0, 0, row]):
    ...         dense[row, bm.kv_indices[0, 0, row, j]] = 1
    >>> dense  # partial tiles: the diagonal
    tensor([[1, 0, 0, 0],
            [0, 1, 0, 0],
            [0, 0, 1, 0],
            [0, 0, 0, 1]], dtype=torch.int32)
    >>> bm.full_kv_num_blocks[0, 0]  # full tiles: everything below it
    tensor([0, 1, 2, 3], dtype=torch.int32)

The backward pass walks the same grid by columns, so ``q_num_blocks`` / ``q_indices`` (and the
``full_q_*`` pair) hold the transposed layout: for each key block, which query blocks visit it.

``create_block_mask`` builds all this from a mask_mod by evaluating it tile by tile with
``torch.vmap``, so memory stays bounded at any sequence length (docs/block_mask.md has figures).
Names and semantics follow ``torch.nn.attention.flex_attention``; the differences are listed in
docs/block_mask.md.
"""

from __future__ import annotations

import itertools
import operator
import sys
from typing import Any, Callable, Hashable, NamedTuple, Optional, Union

import torch
import torch.utils._pytree as pytree

from ..cuda_graphs import StreamMark, mark_stream
from ..errors import InvalidInputError
from ..mods import MaskMod, check_mask_mod, mod_name, noop_mask
from .layout import (
    DEFAULT_BLOCK_SIZE, INDEX_DTYPE, BlockSize, as_4d, as_block_size, ascending, cdiv, check_visited_once,
    checked_indices, checked_table, dense_to_ordered, ordered_to_dense, positive_int, transposed_tables, widened,
)

__all__ = ["BlockMask", "DerivedKey", "TABLES_IN_RANGE", "EVERY_BLOCK_FULL", "as_block_mask", "torch_counterpart", "sliced_rows_mask_mod",
           "version_of"]


class DerivedKey(NamedTuple):
    """The key of one kind of data derived from a BlockMask's tables (see [Note] Derived data).

    Each module that derives data from masks owns its keys, as module constants; ``param``
    distinguishes the instances of one kind (a GQA group size, say)."""

    name: str
    param: Hashable = None


# [Note] Tables in range by construction. Masks that flexattn builds from dense tile maps for a
# decoding step (decode_block_mask, PagedAttention) have ascending rows with every entry in range;
# their builders store True under this key, and the kernels' launch tables then skip the checks
# that would read the tables back to the host (kernels/tables.py).
TABLES_IN_RANGE = DerivedKey("tables ascending and in range by construction")
# The mask of a call that passes none (masks/create.py dense_block_mask) also knows its rows: every
# row lists every key block as full, in order. Stored True under this key beside TABLES_IN_RANGE,
# it gives the launch tables the row statistics the checks would compute, without reading the tables.
EVERY_BLOCK_FULL = DerivedKey("every row lists every key block as full, in order, by construction")


def sliced_rows_mask_mod(b, h, q_idx, kv_idx):
    """Stand-in mask_mod of a BlockMask whose query-block rows were selected with ``[]``."""
    raise RuntimeError(
        "This BlockMask was made by selecting query-block rows (block_mask[b, h, rows]), so query "
        "index 0 of the new mask is no longer query index 0 of the original: the original mask_mod "
        "would be evaluated at the wrong positions, and flexattn does not guess the offset.\n"
        "Build the step's mask with the query offset instead (docs/decoding.md):\n"
        "\n  Incorrect:\n"
        "    step_mask = base_mask[:, :, pos // base_mask.BLOCK_SIZE[0]]\n"
        "    flex_attention(q, k, v, block_mask=step_mask)    # q_idx 0 is taken as position 0\n"
        "\n  Correct:\n"
        "    # pos: the absolute position of the first query you pass (an int, or a tensor you update)\n"
        "    step_mask = flexattn.decode_block_mask(base_mask, pos, q_len=q.shape[2])\n"
        "\n  or by hand, as with torch:\n"
        "    step_mask = base_mask[:, :, pos // base_mask.BLOCK_SIZE[0]]\n"
        "    step_mask.mask_mod = flexattn.offset_mask_mod(base_mask.mask_mod, pos)  # base_mask's, not step_mask's\n"
        "    step_mask.seq_lengths = (q_len, kv_len)             # the lengths you will call it with\n"
    )


def _reindexed_mask_mod(
    mask_mod: MaskMod, batch_map: Optional[torch.Tensor], head_map: Optional[torch.Tensor]
) -> MaskMod:
    """``mask_mod`` seen through a batch/head selection: new index i reads original index map[i].

    The modulo mirrors how kernels broadcast a mask over a larger batch or head count.
    """

    def reindexed(b, h, q_idx, kv_idx):
        if batch_map is not None:
            b = batch_map[b % batch_map.shape[0]]
        if head_map is not None:
            h = head_map[h % head_map.shape[0]]
        return mask_mod(b, h, q_idx, kv_idx)

    reindexed.__name__ = f"{mod_name(mask_mod)}_reindexed"
    return reindexed


class BlockMask:
    """Block-sparse layout of an attention mask plus the mask_mod the kernels apply inside it.

    See the module docstring for the format. Build one with :func:`create_block_mask` (from a
    mask_mod) or :meth:`BlockMask.from_kv_blocks` (from block tables you computed yourself).

    Attributes:
        seq_lengths: ``(q_len, kv_len)`` the mask was built for.
        kv_num_blocks, kv_indices: partial tiles per query-block row, int32 ``[B, H, ROWS]`` and
            ``[B, H, ROWS, COLS]``.
        full_kv_num_blocks, full_kv_indices: full tiles, same shapes, or None (then every visited
            tile is treated as partial).
        q_num_blocks, q_indices, full_q_num_blocks, full_q_indices: the transposed layout for the
            backward pass, ``[B, H, COLS]`` and ``[B, H, COLS, ROWS]``; None for an inference-only
            mask (``compute_q_blocks=False``).
        BLOCK_SIZE: ``(Q_BLOCK, KV_BLOCK)``.
        mask_mod: the callable evaluated on partial tiles.

    torch code can take it too: ``as_tuple()`` has torch's field order and the class is a pytree
    node (``torch.utils._pytree``), like torch's BlockMask.
    """

    # torch's BlockMask carries deterministic-dQ metadata for its FLASH backward; flexattn has none.
    # The names exist so that torch code reading them (its flex_attention, as_tuple users) works.
    dq_write_order: Optional[torch.Tensor] = None
    dq_write_order_full: Optional[torch.Tensor] = None
    dq_kv_order: Optional[torch.Tensor] = None
    dq_kv_order_spt: Optional[bool] = None

    def __init__(
        self,
        seq_lengths: tuple[int, int],
        kv_num_blocks: torch.Tensor,
        kv_indices: torch.Tensor,
        full_kv_num_blocks: Optional[torch.Tensor],
        full_kv_indices: Optional[torch.Tensor],
        q_num_blocks: Optional[torch.Tensor],
        q_indices: Optional[torch.Tensor],
        full_q_num_blocks: Optional[torch.Tensor],
        full_q_indices: Optional[torch.Tensor],
        BLOCK_SIZE: tuple[int, int] = (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE),
        mask_mod: MaskMod = noop_mask,
    ) -> None:
        # The positional order matches torch's BlockMask.__init__. Use from_kv_blocks to get checks
        # and the transposed tables computed for you.
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise InvalidInputError("full_kv_num_blocks and full_kv_indices must be given together or both be None")
        if (full_q_num_blocks is None) != (full_q_indices is None):
            raise InvalidInputError("full_q_num_blocks and full_q_indices must be given together or both be None")
        self.seq_lengths = tuple(seq_lengths)
        # Kernels rely on contiguous tables (they index them from their shapes) and on each row's
        # used entries being ascending: the one key block that crosses kv_len then comes last, and
        # only it is bounds-checked (see the forward template).
        self.kv_num_blocks = kv_num_blocks.contiguous()
        self.kv_indices = ascending(kv_num_blocks, kv_indices).contiguous()
        self.full_kv_num_blocks = None if full_kv_num_blocks is None else full_kv_num_blocks.contiguous()
        self.full_kv_indices = (
            None if full_kv_indices is None else ascending(full_kv_num_blocks, full_kv_indices).contiguous()
        )
        self.q_num_blocks = q_num_blocks
        self.q_indices = q_indices
        self.full_q_num_blocks = full_q_num_blocks
        self.full_q_indices = full_q_indices
        self.BLOCK_SIZE = as_block_size(BLOCK_SIZE)
        self.mask_mod = mask_mod

    @property
    def serves_one_call(self) -> bool:
        """Whether the mask was made for one call (``from_launch_tables(..., one_call=True)``) and
        what is derived from it is dropped with it: not when its maker keeps that per table for the
        next calls on the same tables (``derived_kept=True``)."""
        return bool(self.__dict__.get("_one_call")) and not self.__dict__.get("_derived_kept")

    # ---------------------------------------------------------------------------- derived data

    def derived(self, key: DerivedKey, compute: Callable[["BlockMask"], Any]) -> Any:
        """``compute(self)``, kept on this mask under ``key`` until its forward tables change.

        [Note] Derived data: what later stages compute from the tables (row statistics, checked
        launch tables) lives on the mask itself, stamped with the table objects it was computed
        from, their version counters, BLOCK_SIZE and seq_lengths. A table replaced by assignment
        or changed in place (``bm.kv_indices[0, 0, 1] = 3`` bumps ``_version``) fails the stamp and
        the data is computed again. Never keyed by ``id(mask)``: a freed mask's id is handed to
        the next object, which would inherit its data (issue 8, item 2). Each kind of data has its
        own DerivedKey, owned by the module that computes it. The check costs about half a
        microsecond per call. A value computed on a CUDA stream may still be in the making on the
        GPU when a call on another stream reads it: it carries a StreamMark (cuda_graphs.py), and
        such a call waits for it first.
        """
        value = self.peek_derived(key)
        if value is None:
            value = compute(self)
            # Device work the value may still be waiting for: a call on another stream must not
            # read it before it is done (see StreamMark).
            self._store_derived(key, value, mark_stream(self.kv_num_blocks.device))
        return value

    def peek_derived(self, key: DerivedKey) -> Any:
        """The data stored under ``key`` while its stamp still holds, else None (derived values are
        never None)."""
        cache = self.__dict__.get("_derived")
        entry = None if cache is None else cache.get(key)
        if entry is not None:
            nb, idx, fnb, fidx, versions, block_size, seq_lengths, value, made_on = entry
            # Spelled out: this runs on every warm call. No versions: a mask for one call (from_launch_tables).
            if (nb is self.kv_num_blocks and idx is self.kv_indices and fnb is self.full_kv_num_blocks
                    and fidx is self.full_kv_indices
                    and (versions is None or _versions_hold(versions, nb, idx, fnb, fidx))
                    and block_size == self.BLOCK_SIZE and seq_lengths == self.seq_lengths):
                if made_on is not None and not made_on.done:
                    made_on.order_after(nb.device)
                return value
        return None

    def preset_derived(self, key: DerivedKey, value: Any) -> None:
        """Store ``value`` under ``key`` without computing it, stamped like a computed one: for
        masks whose builder knows the value by construction (decode_block_mask's tables are
        ascending and in range). A table replaced or changed in place later fails the stamp."""
        self._store_derived(key, value, None)

    def _store_derived(self, key: DerivedKey, value: Any, made_on: Optional[StreamMark]) -> None:
        if not isinstance(key, DerivedKey):
            raise TypeError(f"derived data is keyed by a DerivedKey, got {type(key).__name__}")
        cache = self.__dict__.get("_derived")
        if cache is None:
            cache = self.__dict__["_derived"] = {}
        tables = (self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices)
        versions = None if self.__dict__.get("_one_call") else _versions(*tables)
        cache[key] = (*tables, versions, self.BLOCK_SIZE, self.seq_lengths, value, made_on)

    # ---------------------------------------------------------------------------- torch interop

    def as_tuple(self, flatten: bool = True) -> tuple:
        """The fields in the order of torch's ``BlockMask.as_tuple``.

        torch 2.13: ``(q_len, kv_len, kv_num_blocks, kv_indices, full_kv_num_blocks,
        full_kv_indices, q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
        dq_write_order, dq_write_order_full, dq_kv_order, dq_kv_order_spt, Q_BLOCK, KV_BLOCK,
        mask_mod)``; the dq_* fields are always None here, and left out where the installed
        torch's BlockMask has none (older releases). ``flatten=False`` keeps ``seq_lengths`` and
        ``BLOCK_SIZE`` as pairs.
        """
        lengths = tuple(self.seq_lengths) if flatten else (tuple(self.seq_lengths),)
        block = tuple(self.BLOCK_SIZE) if flatten else (tuple(self.BLOCK_SIZE),)
        theirs = torch_counterpart("BlockMask")
        dq = (self.dq_write_order, self.dq_write_order_full, self.dq_kv_order, self.dq_kv_order_spt)
        if theirs is not None and "dq_write_order" not in getattr(theirs, "__annotations__", {}):
            dq = ()
        return (
            *lengths,
            self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
            self.q_num_blocks, self.q_indices, self.full_q_num_blocks, self.full_q_indices,
            *dq,
            *block,
            self.mask_mod,
        )

    # ---------------------------------------------------------------------------- construction

    @classmethod
    def from_kv_blocks(
        cls,
        kv_num_blocks: torch.Tensor,
        kv_indices: torch.Tensor,
        full_kv_num_blocks: Optional[torch.Tensor] = None,
        full_kv_indices: Optional[torch.Tensor] = None,
        BLOCK_SIZE: BlockSize = DEFAULT_BLOCK_SIZE,
        mask_mod: Optional[MaskMod] = None,
        seq_lengths: Optional[tuple[int, int]] = None,
        compute_q_blocks: bool = True,
    ) -> "BlockMask":
        """A BlockMask from per-row block tables you built yourself.

        Args:
            kv_num_blocks: ``[B, H, ROWS]`` (leading dims may be left out: they become 1) number of
                partial tiles per query-block row.
            kv_indices: ``[B, H, ROWS, W]`` key-block index of each of those tiles, first
                ``kv_num_blocks`` entries per row; the rest are padding.
            full_kv_num_blocks, full_kv_indices: the same for full tiles (mask_mod skipped), or both
                None.
            BLOCK_SIZE: ``Q_BLOCK = KV_BLOCK`` as an int, or a ``(Q_BLOCK, KV_BLOCK)`` pair.
            mask_mod: applied on partial tiles; defaults to ``noop_mask``.
            seq_lengths: ``(q_len, kv_len)``; defaults to ``(ROWS * Q_BLOCK, COLS * KV_BLOCK)``.
            compute_q_blocks: build the transposed tables the backward pass needs. False gives an
                inference-only mask.

        The number of key blocks COLS is the widest of the index tables and, when given,
        ``ceil(kv_len / KV_BLOCK)``. Used entries must lie in ``[0, COLS)``; padding entries outside
        that range are replaced by 0 so kernels may prefetch them. Tables are stored as int32,
        with leading dims added up to ``[B, H, ...]`` and narrower index tables padded to COLS.
        Each row's used entries are stored in ascending order (kernels rely on it).

        Raises:
            InvalidInputError: only one of the full_* tables given, shapes that disagree, non-integer
                tables, a used index outside ``[0, COLS)``, or (checked with compute_q_blocks) a tile
                listed twice in a row or listed as both partial and full, which kernels would visit
                twice.
        """
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise InvalidInputError(
                "from_kv_blocks: pass both full_kv_num_blocks and full_kv_indices (full tiles, mask_mod "
                "skipped) or neither; got only "
                + ("full_kv_num_blocks" if full_kv_indices is None else "full_kv_indices")
            )
        if mask_mod is not None:
            check_mask_mod(mask_mod, "from_kv_blocks")
        q_block, kv_block = as_block_size(BLOCK_SIZE)
        kv_num_blocks, kv_indices = checked_table("kv", kv_num_blocks, kv_indices)
        if full_kv_num_blocks is not None:
            full_kv_num_blocks, full_kv_indices = checked_table("full_kv", full_kv_num_blocks, full_kv_indices)
            if full_kv_indices.shape[:-1] != kv_indices.shape[:-1] or full_kv_indices.device != kv_indices.device:
                raise InvalidInputError(
                    f"from_kv_blocks: full_kv_indices {tuple(full_kv_indices.shape)} on {full_kv_indices.device} "
                    f"must match kv_indices {tuple(kv_indices.shape)} on {kv_indices.device} in every dim but the last"
                )
        rows = kv_indices.shape[-2]
        widths = [kv_indices.shape[-1]] + ([full_kv_indices.shape[-1]] if full_kv_indices is not None else [])
        if seq_lengths is None:
            num_cols = max(widths)
            seq_lengths = (rows * q_block, num_cols * kv_block)
        else:
            if len(seq_lengths) != 2:
                raise InvalidInputError(f"seq_lengths must be (q_len, kv_len), got {seq_lengths!r}")
            seq_lengths = tuple(positive_int(f"seq_lengths[{i}]", n) for i, n in enumerate(seq_lengths))
            num_cols = max(widths + [cdiv(seq_lengths[1], kv_block)])
        kv_indices = checked_indices("kv", kv_num_blocks, kv_indices, num_cols)
        if full_kv_indices is not None:
            full_kv_indices = checked_indices("full_kv", full_kv_num_blocks, full_kv_indices, num_cols)
            full_kv_indices = widened(full_kv_indices, num_cols)
        kv_indices = widened(kv_indices, num_cols)

        q_tables: list[Optional[torch.Tensor]] = [None, None, None, None]
        if compute_q_blocks:
            partial_map = ordered_to_dense(kv_num_blocks, kv_indices, num_cols)
            full_map = None
            if full_kv_indices is not None:
                full_map = ordered_to_dense(full_kv_num_blocks, full_kv_indices, num_cols)
            check_visited_once(kv_num_blocks, partial_map, full_kv_num_blocks, full_map)
            q_tables = transposed_tables(partial_map, full_map)
        return cls(
            seq_lengths,
            kv_num_blocks,
            kv_indices,
            full_kv_num_blocks,
            full_kv_indices,
            *q_tables,
            BLOCK_SIZE=(q_block, kv_block),
            mask_mod=mask_mod if mask_mod is not None else noop_mask,
        )

    @classmethod
    def from_launch_tables(
        cls,
        seq_lengths: tuple[int, int],
        kv_num_blocks: torch.Tensor,
        kv_indices: torch.Tensor,
        full_kv_num_blocks: Optional[torch.Tensor] = None,
        full_kv_indices: Optional[torch.Tensor] = None,
        BLOCK_SIZE: BlockSize = DEFAULT_BLOCK_SIZE,
        *,
        one_call: bool = False,
        derived_kept: bool = False,
    ) -> "BlockMask":
        """A forward-only BlockMask on tables taken as they are: int32, ``[B, H, ROWS(, W)]``, contiguous,
        each row's used entries ascending and in range, as a BlockMask's own tables are. Nothing is
        checked, sorted or copied, and the mask is marked in range ([Note] Tables in range by
        construction), so no call reads the tables back to the host: for the tables of a mask that was
        built and checked already, passed on where its content cannot be read (a compiled graph).

        ``one_call``: the mask serves one call and is dropped after it, and nothing writes its tables
        meanwhile, so what is derived from them holds for its whole life without version counters
        (tables made under ``torch.inference_mode`` have none: ``version_of``). ``derived_kept``: the
        maker keeps what calls derive from these tables, per table, for the next calls on them
        (compile/kept.py, [Note] What a compiled call's mask derives, kept), so deriving pays."""
        mask = cls.__new__(cls)
        if one_call:
            mask.__dict__["_one_call"] = True
        if derived_kept:
            mask.__dict__["_derived_kept"] = True
        mask.seq_lengths = tuple(seq_lengths)
        mask.kv_num_blocks, mask.kv_indices = kv_num_blocks, kv_indices
        mask.full_kv_num_blocks, mask.full_kv_indices = full_kv_num_blocks, full_kv_indices
        mask.q_num_blocks = mask.q_indices = mask.full_q_num_blocks = mask.full_q_indices = None
        mask.BLOCK_SIZE = as_block_size(BLOCK_SIZE)
        mask.mask_mod = noop_mask
        mask.preset_derived(TABLES_IN_RANGE, True)
        return mask

    @classmethod
    def _from_block_maps(
        cls,
        partial_map: torch.Tensor,
        full_map: Optional[torch.Tensor],
        block_size: tuple[int, int],
        mask_mod: MaskMod,
        seq_lengths: tuple[int, int],
        compute_q_blocks: bool = True,
    ) -> "BlockMask":
        """A BlockMask from 0/1 maps ``[B, H, ROWS, COLS]`` of partial and full tiles (no checks)."""
        kv_num_blocks, kv_indices = dense_to_ordered(partial_map)
        full_kv_num_blocks = full_kv_indices = None
        if full_map is not None:
            full_kv_num_blocks, full_kv_indices = dense_to_ordered(full_map)
        q_tables = transposed_tables(partial_map, full_map) if compute_q_blocks else [None] * 4
        return cls(
            seq_lengths, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, *q_tables,
            BLOCK_SIZE=block_size, mask_mod=mask_mod,
        )

    # ---------------------------------------------------------------------------- inspection

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, q_len, kv_len)``; B or H is 1 where the mask broadcasts."""
        B, H = self.kv_num_blocks.shape[:2]
        return (B, H, *self.seq_lengths)

    def numel(self) -> int:
        """Number of (b, h, q, kv) pairs the mask covers, ``B * H * q_len * kv_len``."""
        B, H, q_len, kv_len = self.shape
        return B * H * q_len * kv_len

    def _num_cols(self) -> int:
        # Tables may be narrower than the key blocks (a paged mask lists a few of many pages).
        widths = [self.kv_indices.shape[-1], cdiv(self.seq_lengths[1], self.BLOCK_SIZE[1])]
        if self.full_kv_indices is not None:
            widths.append(self.full_kv_indices.shape[-1])
        return max(widths)

    def _partial_map(self) -> torch.Tensor:
        return ordered_to_dense(self.kv_num_blocks, self.kv_indices, self._num_cols())

    def _full_map(self) -> Optional[torch.Tensor]:
        if self.full_kv_indices is None:
            return None
        return ordered_to_dense(self.full_kv_num_blocks, self.full_kv_indices, self._num_cols())

    def to_dense(self) -> torch.Tensor:
        """Int32 ``[B, H, ROWS, COLS]``: 1 where a tile is visited (partial or full), else 0."""
        dense = self._partial_map()
        full = self._full_map()
        return dense if full is None else dense | full

    def sparsity(self) -> float:
        """Percent of the ``q_len x kv_len`` area (per batch and head) that the kernels skip.

        Only the area inside ``seq_lengths`` counts: a tile that sticks out past the end counts
        for its in-range part. The result is in [0, 100]. (torch counts every visited tile at its
        full size, which goes negative when a length is not a multiple of the block size.)
        """
        q_block, kv_block = self.BLOCK_SIZE
        q_len, kv_len = self.seq_lengths
        device = self.kv_num_blocks.device
        rows, cols = self.kv_indices.shape[-2], self._num_cols()
        # In-range height of each query-block row and width of each key-block column.
        heights = (q_len - q_block * torch.arange(rows, device=device, dtype=torch.float64)).clamp(0, q_block)
        widths = (kv_len - kv_block * torch.arange(cols, device=device, dtype=torch.float64)).clamp(0, kv_block)
        covered = (self.to_dense().to(torch.float64) * widths).sum(-1)  # [B, H, ROWS]
        computed = (covered * heights).sum()
        B, H = self.kv_num_blocks.shape[:2]
        total = B * H * heights.sum() * widths.sum()
        return float(100.0 * (1.0 - computed / total))

    def to_string(self, grid_size: Union[int, tuple[int, int]] = (20, 20), limit: int = 4) -> str:
        """A picture of the tiles of each (batch, head): ``█`` full, ``░`` partial, blank empty.

        Large grids are downsampled to at most ``grid_size`` characters (rows, columns); a cell
        that merges tiles shows ``█`` only if all of them are full and blank only if all are empty.
        ``grid_size=-1`` draws one cell per tile. At most ``limit`` (batch, head) pairs are drawn.
        """
        partial = self._partial_map().bool()
        full = self._full_map()
        full = torch.zeros_like(partial) if full is None else full.bool()
        B, H, rows, cols = partial.shape
        if grid_size == -1:
            max_rows, max_cols = rows, cols
        elif isinstance(grid_size, int):
            max_rows = max_cols = grid_size
        else:
            max_rows, max_cols = grid_size
        row_step, col_step = max(1, cdiv(rows, max_rows)), max(1, cdiv(cols, max_cols))

        pictures = []
        for count, (b, h) in enumerate(itertools.product(range(B), range(H))):
            if count == limit:
                pictures.append(
                    f"... {B * H - limit} more (batch, head) pairs: pass limit=N to draw more, or index "
                    "block_mask[b, h] to draw one"
                )
                break
            lines = [f"batch {b}, head {h}"]
            for r in range(0, rows, row_step):
                line = ""
                for c in range(0, cols, col_step):
                    cell_full = full[b, h, r : r + row_step, c : c + col_step]
                    cell_any = cell_full | partial[b, h, r : r + row_step, c : c + col_step]
                    char = "█" if bool(cell_full.all()) else ("░" if bool(cell_any.any()) else " ")
                    line += char * 2  # two characters per cell keeps tiles roughly square
                lines.append(line)
            pictures.append("\n".join(lines))
        return "\n".join(pictures)

    def __str__(self) -> str:
        return f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%,\n{self.to_string()}\n)"

    def __repr__(self) -> str:
        full = "none" if self.full_kv_num_blocks is None else "separate"
        backward = "no" if self.q_indices is None else "yes"
        return (
            f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, sparsity={self.sparsity():.2f}%, "
            f"full_blocks={full}, q_blocks={backward}, mask_mod={mod_name(self.mask_mod)})"
        )

    # ---------------------------------------------------------------------------- new masks from this one

    def __getitem__(self, index) -> "BlockMask":
        """Select batches, heads and query-block rows: ``bm[b]``, ``bm[b, h]``, ``bm[b, h, rows]``.

        Each position takes an int, a slice or an index tensor and applies to its own dim (an int
        keeps its dim with size 1, as in torch, so the result stays ``[B, H, ...]``). The
        transposed tables are rebuilt and ``seq_lengths`` is kept, as in torch.

        The mask_mod follows the selection when only batches and heads are selected (new batch i
        reads the original batch picked at position i). Selecting query-block rows shifts query
        positions, so the new mask gets a mask_mod that raises and explains how to set a shifted one
        (torch does the same); :func:`flexattn.decode_block_mask` builds a decoding step's mask,
        shifted mask_mod included, in one call.

        Tensor indices on an accelerator are used without reading them back (no host sync, so
        ``bm[:, :, pos // Q_BLOCK]`` with a device tensor ``pos`` fits in a captured decoding step):
        an out-of-range one then fails in the device's index check instead of raising IndexError
        here. A bool index needs ``nonzero`` (a sync and a data-dependent shape).
        """
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3:
            raise IndexError(f"a BlockMask takes at most 3 indices (batch, head, query-block row), got {len(index)}")
        index = index + (slice(None),) * (3 - len(index))
        sizes = self.kv_num_blocks.shape[:3]
        device = self.kv_num_blocks.device
        selections = [_selection(i, n, device, name) for i, n, name in zip(index, sizes, ("batch", "head", "row"))]

        def pick(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if t is None:
                return None
            for dim, chosen in enumerate(selections):
                if chosen is not None:
                    t = t.index_select(dim, chosen)
            return t.contiguous()

        batch_map, head_map = _as_map(selections[0], sizes[0]), _as_map(selections[1], sizes[1])
        if selections[2] is not None:
            mask_mod = sliced_rows_mask_mod
        elif batch_map is None and head_map is None:
            mask_mod = self.mask_mod
        else:
            mask_mod = _reindexed_mask_mod(self.mask_mod, batch_map, head_map)

        # Pick first, then densify only what was picked: a decoding step picks one row of a mask
        # whose dense map can hold millions of tiles.
        num_blocks, indices = pick(self.kv_num_blocks), pick(self.kv_indices)
        full_num, full_indices = pick(self.full_kv_num_blocks), pick(self.full_kv_indices)
        q_tables: list[Optional[torch.Tensor]] = [None] * 4
        if self.q_indices is not None:
            cols = self._num_cols()
            partial = ordered_to_dense(num_blocks, indices, cols)
            full = None if full_num is None else ordered_to_dense(full_num, full_indices, cols)
            q_tables = transposed_tables(partial, full)
        return BlockMask(
            self.seq_lengths, num_blocks, indices, full_num, full_indices, *q_tables,
            BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=mask_mod,
        )

    def to(self, device: Union[torch.device, str]) -> "BlockMask":
        """A new BlockMask with every table on ``device`` (this one is unchanged)."""

        def move(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.to(device)

        return BlockMask(
            self.seq_lengths,
            move(self.kv_num_blocks), move(self.kv_indices),
            move(self.full_kv_num_blocks), move(self.full_kv_indices),
            move(self.q_num_blocks), move(self.q_indices),
            move(self.full_q_num_blocks), move(self.full_q_indices),
            BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod,
        )

    def adjust(self, new_q_len: int, new_kv_len: int) -> "BlockMask":
        """The top-left ``new_q_len x new_kv_len`` corner of this mask, e.g. for a shorter batch.

        Tiles outside the corner are dropped and the tables recounted; the mask_mod is not called
        again. A full tile that the new boundary cuts through becomes partial (positions past the
        end count as masked, as in create_block_mask). A partial tile cut by the boundary stays
        partial even when none of its remaining pairs are kept: the kernels apply the mask_mod
        there, so results are exact, just slightly less sparse than a fresh create_block_mask.
        Cropping is only right for mask_mods that do not depend on the lengths (causal, sliding
        window, documents; not "attend to the last 10 keys"). Growing a mask is an error: the
        tiles past its lengths were never evaluated.
        """
        new_q_len = positive_int("new_q_len", new_q_len)
        new_kv_len = positive_int("new_kv_len", new_kv_len)
        q_len, kv_len = self.seq_lengths
        if new_q_len > q_len or new_kv_len > kv_len:
            raise InvalidInputError(
                f"adjust({new_q_len}, {new_kv_len}) can only crop, and this mask was built for "
                f"({q_len}, {kv_len}); build a new mask with create_block_mask for longer sequences"
            )
        q_block, kv_block = self.BLOCK_SIZE
        rows, cols = cdiv(new_q_len, q_block), cdiv(new_kv_len, kv_block)
        partial = self._partial_map()[:, :, :rows, :cols]
        full = self._full_map()
        if full is not None:
            full = full[:, :, :rows, :cols].clone()
            # Tiles cut by the new boundary hold positions past the end, which count as masked.
            cut = torch.zeros_like(full, dtype=torch.bool)
            if new_q_len % q_block:
                cut[:, :, -1, :] = True
            if new_kv_len % kv_block:
                cut[:, :, :, -1] = True
            partial = partial | (full & cut.to(full.dtype))
            full = full.masked_fill(cut, 0)
        return BlockMask._from_block_maps(
            partial, full, self.BLOCK_SIZE, self.mask_mod, (new_q_len, new_kv_len),
            compute_q_blocks=self.q_indices is not None,
        )

    _adjust = adjust  # torch's (private) name for the same operation


_TABLE_NAMES = (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
)


def version_of(t: torch.Tensor):
    """``t``'s version counter, which every in-place change bumps, for stamping what was derived from
    its contents. A tensor made under ``torch.inference_mode`` has none (reading it raises), and can be
    changed in place there unseen: it gets a new object each time, equal to nothing, so what is
    derived from it is derived again at every use (docs/limitations.md). Dynamo traces ``_version``
    but not ``is_inference()``, and a traced mask is not an inference tensor's."""
    if not torch.compiler.is_compiling() and t.is_inference():
        return object()
    return t._version


def _versions_hold(versions: tuple, nb, idx, fnb, fidx) -> bool:
    """Whether each table's ``version_of`` equals its stamp in ``versions``: version_of spelled out
    for the four, so a warm call asks ``is_compiling()`` once, not four times (peek_derived)."""
    if torch.compiler.is_compiling():
        return (nb._version == versions[0] and idx._version == versions[1]
                and (fnb is None or (fnb._version == versions[2] and fidx._version == versions[3])))
    # An inference tensor's version_of equals nothing.
    return (not nb.is_inference() and nb._version == versions[0] and not idx.is_inference()
            and idx._version == versions[1]
            and (fnb is None or (not fnb.is_inference() and fnb._version == versions[2] and not fidx.is_inference()
                                 and fidx._version == versions[3])))


def _versions(*tables: Optional[torch.Tensor]) -> tuple:
    return tuple(-1 if t is None else version_of(t) for t in tables)


# A pytree node like torch's BlockMask: the tables are the leaves, the rest is context. Unflatten
# sets the fields directly (no re-sorting), so tree_map(lambda t: t.to(device), bm) round-trips.
def _pytree_flatten(bm: BlockMask):
    return [getattr(bm, name) for name in _TABLE_NAMES], (tuple(bm.seq_lengths), tuple(bm.BLOCK_SIZE), bm.mask_mod)


def _pytree_flatten_with_keys(bm: BlockMask):
    leaves, context = _pytree_flatten(bm)
    return [(pytree.GetAttrKey(name), leaf) for name, leaf in zip(_TABLE_NAMES, leaves)], context


def _pytree_unflatten(leaves, context) -> BlockMask:
    bm = BlockMask.__new__(BlockMask)
    for name, leaf in zip(_TABLE_NAMES, leaves):
        setattr(bm, name, leaf)
    bm.seq_lengths, bm.BLOCK_SIZE, bm.mask_mod = context
    return bm


pytree.register_pytree_node(
    BlockMask, _pytree_flatten, _pytree_unflatten,
    serialized_type_name="flexattn.block_mask.BlockMask", flatten_with_keys_fn=_pytree_flatten_with_keys,
)


def torch_counterpart(name: str):
    """torch's class of this name from torch.nn.attention.flex_attention, if that module is loaded.

    An object of such a class can only exist once torch's module is imported, so flexattn never
    imports it itself (it pulls in torch's compiler stack).
    """
    module = sys.modules.get("torch.nn.attention.flex_attention")
    return getattr(module, name, None) if module is not None else None


def as_block_mask(mask) -> BlockMask:
    """A flexattn BlockMask for ``mask``: ours unchanged, torch's converted.

    torch's BlockMask (from torch's create_block_mask, attention-gym helpers, or
    ``PagedAttention.convert_logical_block_mask``) has the same tables. The conversion is kept on
    the torch object, stamped like derived data (see [Note] Derived data): replacing or changing a
    table converts again; its mask_mod is read afresh on every call.
    """
    if isinstance(mask, BlockMask):
        return mask
    torch_block_mask = torch_counterpart("BlockMask")
    if torch_block_mask is None or not isinstance(mask, torch_block_mask):
        raise InvalidInputError(
            f"block_mask must be a flexattn.BlockMask (from flexattn.create_block_mask) or torch's "
            f"BlockMask, got {type(mask).__name__}"
        )
    tables = tuple(getattr(mask, name) for name in _TABLE_NAMES)
    stamp = (tables, _versions(*tables), tuple(mask.BLOCK_SIZE), tuple(mask.seq_lengths))
    cached = mask.__dict__.get("_flexattn_block_mask")
    if cached is not None and _same_stamp(cached[0], stamp):
        ours = cached[1]
    else:
        ours = _from_torch_tables(mask)
        try:
            mask.__dict__["_flexattn_block_mask"] = (stamp, ours)
        except (AttributeError, TypeError):  # an object without a __dict__: convert every call
            pass
    ours.mask_mod = mask.mask_mod if mask.mask_mod is not None else noop_mask
    return ours


def _same_stamp(a: tuple, b: tuple) -> bool:
    tables_a, versions_a, *plain_a = a
    tables_b, versions_b, *plain_b = b
    return all(x is y for x, y in zip(tables_a, tables_b)) and versions_a == versions_b and plain_a == plain_b


def _from_torch_tables(mask) -> BlockMask:
    def table(t: Optional[torch.Tensor], trailing: int) -> Optional[torch.Tensor]:
        return None if t is None else as_4d(t, trailing).to(INDEX_DTYPE)

    return BlockMask(
        tuple(int(n) for n in mask.seq_lengths),
        table(mask.kv_num_blocks, 1), table(mask.kv_indices, 2),
        table(mask.full_kv_num_blocks, 1), table(mask.full_kv_indices, 2),
        table(mask.q_num_blocks, 1), table(mask.q_indices, 2),
        table(mask.full_q_num_blocks, 1), table(mask.full_q_indices, 2),
        BLOCK_SIZE=tuple(mask.BLOCK_SIZE), mask_mod=mask.mask_mod if mask.mask_mod is not None else noop_mask,
    )


def _selection(index, size: int, device: torch.device, name: str) -> Optional[torch.Tensor]:
    """One position of a BlockMask index -> the chosen positions (int64), or None for "all".

    Built on ``device`` without host-to-device copies, and without reading a device tensor back
    (see BlockMask.__getitem__): a decoding step can slice rows with a tensor it never syncs on.
    """
    if isinstance(index, slice):
        chosen = range(size)[index]
        if chosen == range(size):
            return None
        return torch.arange(chosen.start, chosen.stop, chosen.step, dtype=torch.long, device=device)
    if isinstance(index, torch.Tensor):
        if index.dtype == torch.bool:
            if index.shape != (size,):
                raise IndexError(f"a bool index for the {name} dim must have shape ({size},), got {tuple(index.shape)}")
            return index.to(device).nonzero().flatten()
        if index.dtype.is_floating_point or index.dtype.is_complex or index.dim() > 1:
            raise IndexError(
                f"a tensor index for the {name} dim must be a 0-d or 1-d integer tensor, "
                f"got {index.dtype} {tuple(index.shape)}"
            )
        chosen = index.to(device=device, dtype=torch.long).reshape(-1)
        if chosen.device.type != "cpu" or torch.compiler.is_compiling():
            # Checking the range here would wait for the device (or, compiled, read a value in the
            # graph). Wrap negatives only, so an index out of range stays out of range and
            # index_select's own check rejects it.
            return torch.where(chosen < 0, chosen + size, chosen)
        if chosen.numel() and bool(((chosen < -size) | (chosen >= size)).any()):
            raise IndexError(f"index {index.tolist()!r} is out of range for the {name} dim of size {size}")
        return chosen % size  # negative positions count from the end
    try:
        position = operator.index(index)
    except TypeError:
        raise IndexError(f"cannot index the {name} dim of a BlockMask with {index!r}") from None
    if not -size <= position < size:
        raise IndexError(f"index {position} is out of range for the {name} dim of size {size}")
    return torch.full((1,), position % size, dtype=torch.long, device=device)


def _as_map(chosen: Optional[torch.Tensor], size: int) -> Optional[torch.Tensor]:
    """A selection as an int32 lookup table for the mask_mod, or None when nothing moves."""
    if chosen is None or size == 1:  # a size-1 dim broadcasts: every selection reads entry 0
        return None
    return chosen.to(INDEX_DTYPE)
