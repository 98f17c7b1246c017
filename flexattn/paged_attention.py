"""PagedAttention: many sequences in one physical KV cache, through a page table.

The cache is cut into ``n_pages`` pages of ``page_size`` token slots, shape
``[1, H_kv, n_pages * page_size, D]``. Each sequence (a row ``b`` of the page table, up to
``max_batch_size``) owns a list of pages: its logical page ``j`` (tokens ``j * page_size`` onwards)
lives in physical page ``page_table[b, j]``. Pages are handed out by :meth:`PagedAttention.reserve`
and returned by :meth:`PagedAttention.erase`, so sequences of very different lengths share memory
without padding each to the longest.

Attention runs unchanged over the physical cache: :meth:`convert_logical_block_mask` maps the
key blocks of a BlockMask written for logical positions to the physical blocks that hold them, and
its mask_mod (like :meth:`get_mask_mod` / :meth:`get_score_mod`) translates each physical key index
back to the logical one before calling your mod. Every mask and score variant therefore runs paged
with no kernel change. Method names and arguments follow torch's
``torch.nn.attention.experimental._paged_attention.PagedAttention``; the differences are listed in
docs/decoding.md.

[Note] Page sizes
A kernel reads a key block as KV_BLOCK consecutive slots of the cache, so a physical block must lie
inside one page. When page_size is a multiple of the mask's KV_BLOCK, a page holds
page_size / KV_BLOCK whole blocks and the mask keeps its block size. When KV_BLOCK is a multiple of
page_size, each logical block is split into KV_BLOCK / page_size blocks of one page each (the
converted mask has ``BLOCK_SIZE = (Q_BLOCK, page_size)``). Other pairs raise.

[Note] Host work
The page allocator lives on the host (Python lists, as in torch), so ``reserve`` and ``erase`` never
read the device; they write a few table entries from the host (a small host-to-device copy each).
``assign`` and ``convert_logical_block_mask`` — the per-step path — never read a device tensor back
and make no data-dependent shapes. Passing ``batch_idx`` or ``seq_len`` to ``reserve``/``erase`` as
device tensors costs one ``.item()`` each (pass ints to avoid it).

[Note] Table checks
``page_table`` and ``physical_to_logical`` are the allocator's to write. An entry written by hand
that points at another sequence's page, at a free page or past the cache would send a kernel to
the wrong keys: partial blocks ask the mask_mod, which checks ownership, but full blocks skip it,
and a page past the cache is read past its end. So every method that reads the tables to place
keys (``assign``, ``convert_logical_block_mask``, ``get_mask_mod``, ``get_score_mod``) first
compares them with the host allocator's lists and raises InvalidInputError naming the sequence,
the page and what reserve gave it. That comparison reads the tables back (a host sync), so it runs
only when they may have changed outside ``reserve``/``erase``: the object and version counter of
each table are stamped after the allocator's own writes, and an in-place write or a replaced
tensor fails the stamp once (as BlockMask's [Note] Derived data). A decoding step over tables only
the allocator wrote costs one comparison of two ints per table. Beside it, the conversion keeps on
the device only blocks whose page lies in the cache and is owned by the row at that logical page
(``physical_to_logical``): no sync, and nothing is read from the wrong place even where the host
check cannot see a write (under torch.compile, or through ``.data``), where such blocks are dropped.
"""

from __future__ import annotations

import math
import operator
from typing import Optional, Union

import torch

from .errors import FlexAttentionError, InvalidInputError
from .masks.block_mask import TABLES_IN_RANGE, BlockMask, as_block_mask, version_of
from .masks.decoding import check_on_device, index_tensor
from .masks.layout import cdiv, dense_to_ordered, device_argument, ordered_to_dense, positive_int
from .mods import MaskMod, ScoreMod, identity_score_mod, mod_factory, mod_name, noop_mask

__all__ = ["PagedAttention", "OutOfPagesError"]

PAGE_INDEX_DTYPE = torch.int32  # page numbers and logical positions fit in int32 (checked in __init__)


class OutOfPagesError(FlexAttentionError, RuntimeError):
    """``reserve`` asked for more pages than are free."""


def _host_int(name: str, value) -> int:
    """An int from an int or a one-element tensor (``.item()``: a host sync for a device tensor)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise InvalidInputError(f"{name} must be an int or a one-element integer tensor, got {value.dtype} "
                                    f"{tuple(value.shape)}")
        return int(value.item())
    if isinstance(value, bool):
        raise InvalidInputError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidInputError(f"{name} must be an int or a one-element tensor, got {type(value).__name__}") from None


class PagedAttention:
    """A page table over one physical KV cache shared by up to ``max_batch_size`` sequences.

    Args:
        n_pages: pages in the physical cache.
        page_size: token slots per page. It must divide, or be a multiple of, the KV_BLOCK of the
            BlockMasks you convert (see [Note] Page sizes); a power of two of at least 16 suits the
            kernels.
        max_batch_size: rows of the page table (sequences that can hold pages at once).
        device: where the tables live, the cache's device; default "cuda" if available, else "cpu".

    Attributes (read them, do not write them):
        page_table: int32 ``[max_batch_size, n_pages]``, the physical page of each logical page, -1 if none.
        physical_to_logical: int32 ``[max_batch_size, n_pages]``, for each row, the logical page a
            physical page holds, -1 if the row does not own it.
        capacity: int64 ``[max_batch_size]``, reserved token slots per row.
        empty_pages: the free physical pages (a Python list; the next reserve takes from its end).

    Typical use: ``reserve`` each sequence's length (ahead of time, or as it grows), write new keys
    and values with ``assign``, convert the step's logical BlockMask with ``convert_logical_block_mask``
    and wrap the score_mod with ``get_score_mod``; then
    ``flex_attention(q, k_cache, v_cache, score_mod=..., block_mask=converted)``.
    """

    def __init__(self, n_pages: int, page_size: int, max_batch_size: int,
                 device: Union[str, torch.device, None] = None) -> None:
        self.n_pages = positive_int("n_pages", n_pages)
        self.page_size = positive_int("page_size", page_size)
        self.max_batch_size = positive_int("max_batch_size", max_batch_size)
        if self.n_pages * self.page_size >= 2**31:
            raise InvalidInputError(
                f"n_pages * page_size = {self.n_pages * self.page_size} token slots: flexattn keeps cache positions "
                "in int32, so the cache must hold fewer than 2**31 slots"
            )
        device = device_argument(device, "PagedAttention")
        self.page_table = torch.empty(0, device=device)
        device = self.page_table.device  # "cuda" names the current device as tensors do ("cuda:0"), so checks compare equal
        self.device = device
        shape = (self.max_batch_size, self.n_pages)
        # Normal tensors even under inference_mode: an inference tensor has no version counter, and
        # the table check would then read the tables back at every step ([Note] Table checks).
        with torch.inference_mode(False):
            self.page_table = torch.full(shape, -1, dtype=PAGE_INDEX_DTYPE, device=device)
            self.physical_to_logical = torch.full(shape, -1, dtype=PAGE_INDEX_DTYPE, device=device)
        self.capacity = torch.zeros(self.max_batch_size, dtype=torch.int64, device=device)
        self.empty_pages = list(range(self.n_pages - 1, -1, -1))  # page 0 is handed out first
        self._pages: list[list[int]] = [[] for _ in range(self.max_batch_size)]  # host copy of page_table
        self._stamp = self._tables_stamp()  # the tables as the allocator last left them

    def __repr__(self) -> str:
        used = self.n_pages - len(self.empty_pages)
        return (f"PagedAttention(n_pages={self.n_pages}, page_size={self.page_size}, "
                f"max_batch_size={self.max_batch_size}, pages_in_use={used}, device={self.device})")

    # ---------------------------------------------------------------------------- the allocator

    def _row(self, batch_idx) -> int:
        row = _host_int("batch_idx", batch_idx)
        if not 0 <= row < self.max_batch_size:
            raise InvalidInputError(f"batch_idx {row} is outside the page table's rows [0, {self.max_batch_size})")
        return row

    def reserve(self, batch_idx: Union[int, torch.Tensor], seq_len: Union[int, torch.Tensor]) -> None:
        """Make row ``batch_idx`` hold at least ``seq_len`` tokens, taking free pages as needed.

        Pages already held are kept (a sequence grows in place); asking for less does nothing.
        Raises OutOfPagesError when not enough pages are free.
        """
        row = self._row(batch_idx)
        seq_len = _host_int("seq_len", seq_len)
        pages = self._pages[row]
        if seq_len <= len(pages) * self.page_size:
            return
        self._check_table_objects("reserve")
        unchanged = self._tables_unchanged()
        need = cdiv(seq_len - len(pages) * self.page_size, self.page_size)
        if need > len(self.empty_pages):
            raise OutOfPagesError(
                f"reserve({row}, {seq_len}) needs {need} more pages of {self.page_size} tokens but only "
                f"{len(self.empty_pages)} of {self.n_pages} are free; erase finished sequences (erase(batch_idx)) or "
                "create the PagedAttention with more n_pages"
            )
        new = [self.empty_pages.pop() for _ in range(need)]
        first = len(pages)
        pages.extend(new)
        physical = torch.tensor(new, dtype=torch.long, device=self.device)
        self.page_table[row, first:first + need] = physical.to(PAGE_INDEX_DTYPE)
        self.physical_to_logical[row, physical] = torch.arange(
            first, first + need, dtype=PAGE_INDEX_DTYPE, device=self.device)
        self.capacity[row] = len(pages) * self.page_size
        if unchanged:  # a write by hand before this one stays to be checked
            self._stamp = self._tables_stamp()

    def erase(self, batch_idx: Union[int, torch.Tensor]) -> None:
        """Return every page of row ``batch_idx`` to the free list; the row then holds nothing."""
        row = self._row(batch_idx)
        self._check_table_objects("erase")
        unchanged = self._tables_unchanged()
        pages = self._pages[row]
        if pages:
            physical = torch.tensor(pages, dtype=torch.long, device=self.device)
            self.physical_to_logical[row, physical] = -1
        self.page_table[row] = -1
        self.capacity[row] = 0
        self.empty_pages.extend(reversed(pages))  # the row's first page is handed out again first
        self._pages[row] = []
        if unchanged:
            self._stamp = self._tables_stamp()

    # ---------------------------------------------------------------------------- the table check

    def _tables_stamp(self) -> tuple:
        """What the tables are now, as objects and version counters ([Note] Table checks)."""
        tables = (self.page_table, self.physical_to_logical)
        return tables + tuple(version_of(t) for t in tables)

    def _tables_unchanged(self) -> bool:
        """The tables are the objects last stamped, with no write since."""
        table, owner, table_version, owner_version = self._stamp
        return (table is self.page_table and owner is self.physical_to_logical
                and version_of(table) == table_version and version_of(owner) == owner_version)

    def _check_table_objects(self, caller: str) -> None:
        """The tables are still int32 ``[max_batch_size, n_pages]`` tensors on the cache's device."""
        shape = (self.max_batch_size, self.n_pages)
        for name in ("page_table", "physical_to_logical"):
            table = getattr(self, name)
            if not (isinstance(table, torch.Tensor) and tuple(table.shape) == shape
                    and table.dtype == PAGE_INDEX_DTYPE and table.device == self.device):
                got = (f"{table.dtype} {tuple(table.shape)} on {table.device}" if isinstance(table, torch.Tensor)
                       else type(table).__name__)
                raise InvalidInputError(
                    f"{caller}: PagedAttention.{name} must be the {PAGE_INDEX_DTYPE} tensor {shape} on {self.device} "
                    f"that reserve() and erase() write, got {got}; the tables are read-only")

    def _check_tables(self, caller: str) -> None:
        """Raise InvalidInputError where the tables differ from what reserve/erase wrote.

        Free while the stamp holds; otherwise one read of both tables to the host ([Note] Table checks).
        """
        if torch.compiler.is_compiling():
            return  # no host read in a graph; the conversion's device-side filter still holds
        if self._tables_unchanged():
            return
        self._check_table_objects(caller)
        stamp = self._tables_stamp()  # taken before the read: a later write is seen next time
        shape = (self.max_batch_size, self.n_pages)
        expected_table = torch.full(shape, -1, dtype=PAGE_INDEX_DTYPE)
        expected_owner = torch.full(shape, -1, dtype=PAGE_INDEX_DTYPE)
        holder: dict[int, tuple[int, int]] = {}  # physical page -> (row, logical page)
        for row, pages in enumerate(self._pages):
            if pages:
                physical = torch.tensor(pages, dtype=torch.long)
                expected_table[row, :len(pages)] = physical.to(PAGE_INDEX_DTYPE)
                expected_owner[row, physical] = torch.arange(len(pages), dtype=PAGE_INDEX_DTYPE)
                holder.update((page, (row, logical)) for logical, page in enumerate(pages))
        table, owner = self.page_table.cpu(), self.physical_to_logical.cpu()
        fix = ("page_table and physical_to_logical are written by reserve() and erase() only: undo the write, and "
               "give a sequence pages with reserve(batch_idx, seq_len)")
        bad = (table != expected_table).nonzero()
        if len(bad):
            row, logical = bad[0].tolist()
            page, reserved = int(table[row, logical]), int(expected_table[row, logical])
            held = len(self._pages[row])
            gave = (f"reserve gave it page {reserved}" if reserved >= 0
                    else f"sequence {row} holds {held} page{'' if held == 1 else 's'}, so the entry must be -1")
            if not -1 <= page < self.n_pages:
                what = f"{page} is not a page of the cache (pages are 0..{self.n_pages - 1}, -1 for none)"
            elif page == -1:
                what = "-1 drops a page the sequence holds"
            elif page not in holder:
                what = f"page {page} is free (reserved for no sequence)"
            elif holder[page][0] != row:
                what = f"page {page} belongs to sequence {holder[page][0]} (its logical page {holder[page][1]})"
            else:
                what = f"page {page} is sequence {row}'s logical page {holder[page][1]}"
            raise InvalidInputError(
                f"{caller}: page_table[{row}, {logical}] (sequence {row}, logical page {logical}) = {page}: {what}; "
                f"{gave}. {fix}")
        bad = (owner != expected_owner).nonzero()
        if len(bad):
            row, page = bad[0].tolist()
            value, reserved = int(owner[row, page]), int(expected_owner[row, page])
            owned = (f"sequence {row} holds page {page} as its logical page {reserved}" if reserved >= 0
                     else f"sequence {row} does not hold page {page}, so the entry must be -1")
            raise InvalidInputError(
                f"{caller}: physical_to_logical[{row}, {page}] (sequence {row}, page {page}) = {value}, but {owned}. "
                f"{fix}")
        self._stamp = stamp

    # ---------------------------------------------------------------------------- the cache

    def assign(
        self,
        batch_idx: torch.Tensor,
        input_pos: torch.Tensor,
        k_val: torch.Tensor,
        v_val: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        """Write keys and values at logical positions into the physical cache.

        Args:
            batch_idx: int tensor ``[B]``, the page-table row of each sequence in ``k_val``.
            input_pos: int tensor ``[B, S]``, the logical position of each new token.
            k_val, v_val: ``[B, H_kv, S, D]`` and ``[B, H_kv, S, D_v]``, no gradient.
            k_cache, v_cache: ``[1, H_kv, n_pages * page_size, D]`` (and ``D_v``), written in place.

        A position must lie in a reserved page: on the CPU another position raises
        InvalidInputError, on an accelerator a device-side assert reports it (no host sync).
        """
        if k_val.requires_grad or v_val.requires_grad:
            raise InvalidInputError("assign: k_val and v_val must not require grad (the cache is written in place); "
                                    "pass k_val.detach()")
        if k_val.dim() != 4 or v_val.dim() != 4:
            raise InvalidInputError(f"assign: k_val and v_val must be [B, H, S, D], got {tuple(k_val.shape)} and "
                                    f"{tuple(v_val.shape)}")
        B, H, S, _ = k_val.shape
        slots = self.n_pages * self.page_size
        batch_idx = torch.as_tensor(batch_idx, device=self.device)
        input_pos = torch.as_tensor(input_pos, device=self.device)
        checks = [
            (tuple(v_val.shape[:3]) == (B, H, S), f"v_val {tuple(v_val.shape)} must match k_val {tuple(k_val.shape)} "
                                                   "in batch, heads and length"),
            (tuple(batch_idx.shape) == (B,), f"batch_idx must have shape ({B},) (k_val's batch), got "
                                              f"{tuple(batch_idx.shape)}"),
            (tuple(input_pos.shape) == (B, S), f"input_pos must have shape ({B}, {S}) (k_val's batch and length), got "
                                                f"{tuple(input_pos.shape)}"),
        ]
        for name, cache, val in (("k_cache", k_cache, k_val), ("v_cache", v_cache, v_val)):
            checks.append((
                cache.dim() == 4 and cache.shape[0] == 1 and cache.shape[1] == H and cache.shape[2] == slots
                and cache.shape[3] == val.shape[3],
                f"{name} must have shape (1, {H}, {slots}, {val.shape[3]}) (1, k_val's heads, n_pages * page_size, "
                f"head dim), got {tuple(cache.shape)}",
            ))
            checks.append((cache.dtype == val.dtype, f"{name} is {cache.dtype} but the values are {val.dtype}"))
            checks.append((cache.device == self.device,
                           f"{name} is on {cache.device} but the page table is on {self.device}"))
        for ok, message in checks:
            if not ok:
                raise InvalidInputError(f"assign: {message}")
        if batch_idx.dtype.is_floating_point or input_pos.dtype.is_floating_point:
            raise InvalidInputError("assign: batch_idx and input_pos must be integer tensors")
        self._check_tables("assign")

        input_pos = input_pos.long()
        logical_page = input_pos // self.page_size
        in_table = (input_pos >= 0) & (logical_page < self.n_pages)
        rows = batch_idx.long()
        physical_page = self.page_table.index_select(0, rows).gather(1, torch.where(in_table, logical_page, 0)).long()
        check_on_device(
            in_table & (physical_page >= 0) & self._holds(rows[:, None], physical_page, logical_page),
            "assign: a position in input_pos lies in no page reserved for its batch row; call "
            "reserve(batch_idx, seq_len) first",
        )
        address = (physical_page * self.page_size + input_pos % self.page_size).reshape(-1)  # [B*S]
        # [B, H, S, D] -> [H, B*S, D], the token order of `address`.
        k_cache[0, :, address] = k_val.transpose(0, 1).reshape(H, B * S, -1)
        v_cache[0, :, address] = v_val.transpose(0, 1).reshape(H, B * S, -1)

    # ---------------------------------------------------------------------------- masks and mods

    def _holds(self, rows: torch.Tensor, physical_page: torch.Tensor, logical_page: torch.Tensor) -> torch.Tensor:
        """Where page-table row ``rows`` holds ``physical_page`` as ``logical_page`` (broadcast shapes;
        false for a page outside the cache). On the device: no sync ([Note] Table checks)."""
        page = physical_page.clamp(0, self.n_pages - 1)
        return (page == physical_page) & (self.physical_to_logical[rows, page] == logical_page)

    def _batch_rows(self, batch_idx, batch: int) -> Optional[torch.Tensor]:
        if batch_idx is None:
            if batch > self.max_batch_size:
                raise InvalidInputError(
                    f"the BlockMask has batch {batch} but the page table has {self.max_batch_size} rows; pass "
                    "batch_idx (the page-table row of each batch entry)")
            return None
        rows = torch.as_tensor(batch_idx, device=self.device)
        if rows.dim() != 1 or rows.dtype.is_floating_point or rows.dtype == torch.bool:
            raise InvalidInputError(f"batch_idx must be a 1-d integer tensor [B], got {rows.dtype} {tuple(rows.shape)}")
        return rows

    def _check_kv_len(self, kv_len) -> Optional[torch.Tensor]:
        return None if kv_len is None else index_tensor("kv_len", kv_len, self.device)

    def get_mask_mod(self, mask_mod: Optional[MaskMod], kv_len: Optional[torch.Tensor] = None, *,
                     batch_idx: Optional[torch.Tensor] = None, _limit: Optional[int] = None) -> MaskMod:
        """``mask_mod`` over physical key positions: it sees the logical position of each key.

        A key in a page its sequence does not own, or at ``kv_len[b]`` or later (when given), is
        masked. ``batch_idx`` maps query batch b to page-table row ``batch_idx[b]`` (default: row b),
        as in :meth:`convert_logical_block_mask`. ``b`` itself reaches ``mask_mod`` unchanged.
        """
        self._check_tables("get_mask_mod")
        return _paged_mask_mod(noop_mask if mask_mod is None else mask_mod, self.page_size, self.physical_to_logical,
                               self._batch_rows(batch_idx, 1), self._check_kv_len(kv_len), _limit)

    def get_score_mod(self, score_mod: Optional[ScoreMod], kv_len: Optional[torch.Tensor] = None, *,
                      batch_idx: Optional[torch.Tensor] = None) -> ScoreMod:
        """``score_mod`` over physical key positions; ``-inf`` where :meth:`get_mask_mod` masks.

        Pass the same ``batch_idx`` as to :meth:`convert_logical_block_mask`.
        """
        self._check_tables("get_score_mod")
        return _paged_score_mod(identity_score_mod if score_mod is None else score_mod, self.page_size,
                                self.physical_to_logical, self._batch_rows(batch_idx, 1), self._check_kv_len(kv_len))

    def _split(self, kv_block: int) -> tuple[int, int]:
        """(logical blocks split into, physical blocks per page) for a mask's KV_BLOCK ([Note] Page sizes)."""
        if kv_block % self.page_size == 0:
            return kv_block // self.page_size, 1
        if self.page_size % kv_block == 0:
            return 1, self.page_size // kv_block
        raise InvalidInputError(
            f"convert_logical_block_mask: page_size {self.page_size} and the BlockMask's KV block size {kv_block} "
            "must divide one another (a key block must lie inside one page); build the logical BlockMask with "
            f"BLOCK_SIZE=(Q_BLOCK, {self.page_size}) or a multiple of it"
        )

    def convert_logical_block_mask(
        self,
        block_mask: BlockMask,
        batch_idx: Optional[torch.Tensor] = None,
        kv_len: Optional[torch.Tensor] = None,
    ) -> BlockMask:
        """The BlockMask over the physical cache for a BlockMask over logical positions.

        Args:
            block_mask: logical mask ``[B or 1, H, ROWS, ...]`` with its mask_mod (flexattn's or torch's),
                e.g. a decoding step's from :func:`flexattn.decode_block_mask`.
            batch_idx: int tensor ``[B]``, the page-table row of each batch entry (default: row b for
                batch b; a mask of batch 1 is then converted for every row, giving batch
                ``max_batch_size``).
            kv_len: valid length per sequence (int tensor ``[B]`` or 0-d), or None.

        Each listed key block is replaced by the physical block(s) holding it; blocks in pages the
        sequence does not own, or past its valid length (kv_len and the mask's KV_LEN), are
        dropped, and a full block cut by that length becomes partial. The result has
        ``seq_lengths = (Q_LEN, n_pages * page_size)``, KV_BLOCK ``min(KV_BLOCK, page_size)``, the
        mask_mod of :meth:`get_mask_mod` (which also masks keys past the logical KV_LEN), and no
        transposed tables (the backward derives its own). No host sync.

        Convert again after ``reserve``/``erase``: the tables follow the pages owned at conversion.
        """
        self._check_tables("convert_logical_block_mask")
        bm = as_block_mask(block_mask)
        q_block, kv_block = bm.BLOCK_SIZE
        q_len, logical_kv_len = bm.seq_lengths
        split, blocks_per_page = self._split(kv_block)
        block = kv_block // split
        mask_batch, heads, rows = bm.kv_num_blocks.shape
        batch_rows = self._batch_rows(batch_idx, mask_batch)
        # A mask of batch 1 applies to every sequence; without batch_idx it is converted for every row
        # of the page table (converted for row 0 only and broadcast, other sequences would visit
        # row 0's pages: torch's behaviour, and a wrong result).
        batch = (self.max_batch_size if mask_batch == 1 else mask_batch) if batch_rows is None else batch_rows.shape[0]
        if mask_batch not in (1, batch):
            raise InvalidInputError(
                f"convert_logical_block_mask: the BlockMask has batch {mask_batch} and batch_idx has {batch} entries; "
                "they must match (or the mask's batch be 1)")
        kv_len_t = self._check_kv_len(kv_len)
        if kv_len_t is not None and kv_len_t.dim() == 1 and kv_len_t.shape[0] != batch:
            raise InvalidInputError(f"kv_len has {kv_len_t.shape[0]} entries for a batch of {batch}")
        if bm.kv_num_blocks.device != self.device:
            raise InvalidInputError(f"the BlockMask is on {bm.kv_num_blocks.device} but the page table is on "
                                    f"{self.device}; use block_mask.to({str(self.device)!r})")

        # Logical tile maps [batch, H, ROWS, COLS] in blocks of `block` keys.
        cols = bm._num_cols()
        visited = ordered_to_dense(bm.kv_num_blocks, bm.kv_indices, cols).bool()
        full = None
        if bm.full_kv_num_blocks is not None:
            full = ordered_to_dense(bm.full_kv_num_blocks, bm.full_kv_indices, cols).bool()
            visited = visited | full
        if split > 1:  # each logical block becomes `split` one-page blocks (expand: no sync, fixed shape)
            def split_cols(tile_map: torch.Tensor) -> torch.Tensor:
                return tile_map.unsqueeze(-1).expand(*tile_map.shape, split).flatten(-2)

            visited = split_cols(visited)
            full = None if full is None else split_cols(full)
        visited = visited.expand(batch, heads, rows, cols * split)
        logical_cols = torch.arange(cols * split, device=self.device)

        # Keep blocks that hold keys of the sequence: below its valid length, in a page it owns. Owned
        # is asked of physical_to_logical too, so that full blocks, which skip the mask_mod and its
        # ownership test, never read a page the row does not hold ([Note] Table checks).
        limit = torch.full((1,), logical_kv_len, device=self.device)
        if kv_len_t is not None:
            limit = kv_len_t.clamp(max=logical_kv_len).reshape(-1)
        limit = limit.reshape(-1, 1, 1, 1)
        rows_of_batch = torch.arange(batch, device=self.device) if batch_rows is None else batch_rows.long()
        page_of_col = logical_cols // blocks_per_page
        in_table = page_of_col < self.n_pages
        logical_page = torch.where(in_table, page_of_col, 0).expand(batch, -1)
        physical_page = self.page_table.index_select(0, rows_of_batch).gather(1, logical_page)  # [batch, cols]
        owned = in_table & self._holds(rows_of_batch[:, None], physical_page.long(), logical_page)
        visited = visited & (logical_cols * block < limit) & owned[:, None, None, :]
        if full is not None:
            full = full & visited & ((logical_cols + 1) * block <= limit)

        # Ordered tables in logical order, then each entry mapped to its physical block.
        physical_block = (physical_page * blocks_per_page + logical_cols % blocks_per_page).to(torch.int32)

        def to_physical(tile_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            num, idx = dense_to_ordered(tile_map)
            mapped = physical_block[:, None, None, :].expand(batch, heads, rows, -1).gather(3, idx.long())
            used = torch.arange(idx.shape[-1], device=self.device) < num.unsqueeze(-1)
            return num, torch.where(used, mapped, 0)  # the constructor sorts each row's used entries

        num, idx = to_physical(visited if full is None else visited & ~full)
        full_num = full_idx = None
        if full is not None:
            full_num, full_idx = to_physical(full)
        mask_mod = self.get_mask_mod(bm.mask_mod, kv_len_t, batch_idx=batch_rows, _limit=logical_kv_len)
        physical = BlockMask((q_len, self.n_pages * self.page_size), num, idx, full_num, full_idx, None, None, None,
                             None, BLOCK_SIZE=(q_block, block), mask_mod=mask_mod)
        # Built from dense maps over physical blocks each row owns once: ascending (the constructor
        # sorts) and in range by construction, so the launch tables skip the checks' host sync and a
        # paged decoding step never waits for the GPU ([Note] Tables in range by construction).
        physical.preset_derived(TABLES_IN_RANGE, True)
        return physical


# ---------------------------------------------------------------------------- the paged mods
# Module-level mod factories of tensors and numbers only (never the PagedAttention object): the mods
# read the live tables, and a step compiled with torch.compile can make them in the graph (see
# flexattn.mod_factory).


def _logical_position(page_size: int, physical_to_logical: torch.Tensor, batch_rows: Optional[torch.Tensor],
                      kv_len: Optional[torch.Tensor], limit: Optional[int]):
    """``(b, physical_kv_idx) -> (logical_kv_idx, valid)``; invalid positions read as logical 0."""
    per_batch_len = kv_len is not None and kv_len.dim() == 1

    def logical(b, physical_kv_idx):
        row = b if batch_rows is None else batch_rows[b]
        logical_page = physical_to_logical[row, physical_kv_idx // page_size]
        position = logical_page * page_size + physical_kv_idx % page_size
        valid = logical_page >= 0
        if limit is not None:
            valid = valid & (position < limit)
        if kv_len is not None:
            valid = valid & (position < (kv_len[b] if per_batch_len else kv_len))
        # The user's mod never sees a position outside its sequence (it may index tensors with it).
        return torch.where(valid, position, 0), valid

    return logical


@mod_factory
def _paged_mask_mod(mask_mod: MaskMod, page_size: int, physical_to_logical: torch.Tensor,
                    batch_rows: Optional[torch.Tensor], kv_len: Optional[torch.Tensor], limit: Optional[int]) -> MaskMod:
    logical = _logical_position(page_size, physical_to_logical, batch_rows, kv_len, limit)

    def paged_mask_mod(b, h, q_idx, physical_kv_idx):
        position, valid = logical(b, physical_kv_idx)
        return valid & mask_mod(b, h, q_idx, position)

    paged_mask_mod.__name__ = f"{mod_name(mask_mod)}_paged"
    return paged_mask_mod


@mod_factory
def _paged_score_mod(score_mod: ScoreMod, page_size: int, physical_to_logical: torch.Tensor,
                     batch_rows: Optional[torch.Tensor], kv_len: Optional[torch.Tensor]) -> ScoreMod:
    logical = _logical_position(page_size, physical_to_logical, batch_rows, kv_len, None)

    def paged_score_mod(score, b, h, q_idx, physical_kv_idx):
        position, valid = logical(b, physical_kv_idx)
        return torch.where(valid, score_mod(score, b, h, q_idx, position), -math.inf)

    paged_score_mod.__name__ = f"{mod_name(score_mod)}_paged"
    return paged_score_mod
