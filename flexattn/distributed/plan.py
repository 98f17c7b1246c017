"""The plan of context-parallel attention: which rank holds which tokens, which K/V shards each rank
needs, in which order they travel, and the BlockMask of every (query shard, K/V shards) step.

[Note] The plan
Every rank builds the same plan from the same global BlockMask (ContextParallel first checks that
the ranks' masks agree), with no communication: tile counts are integers, ties are broken by
index, so equal inputs give equal plans.

1. Units and layouts (sharding.py). The sequence is cut into units of ``lcm(Q_BLOCK, KV_BLOCK)``
   tokens, padded to a whole number of units per rank (2 units per rank for zigzag), and dealt to
   ranks by the balance mode; queries and keys are dealt alike (one sequence: a layer's output
   shard is the next layer's input shard). When the query and key lengths do not pad to the same
   number of units (cross-attention), queries (units of Q_BLOCK) follow the balance mode and keys
   (units of KV_BLOCK) are contiguous.
2. Tiles per pair. Every visited tile (b, h, row, col) of the global tables belongs to the pair
   (owner of row's query unit, owner of col's key unit). ``full_tiles[i, j]`` and
   ``partial_tiles[i, j]`` count them; rank i *needs* shard j when the pair has any. A tile that
   sticks out past Q_LEN or KV_LEN counts as partial, and is partial in the step masks: the shards
   are padded, so the kernels no longer see the sequence's end, and the wrapped mask_mod masks the
   padding instead (see step 4).
3. Schedules. ``"ring"``: in round s (1..R-1) rank i sends its shard to i+s if i+s needs it and
   receives i-s's shard if it needs it, so every round is a permutation, a rank never receives a
   shard it does not need, nobody sends one that is not needed, and each rank holds its own shard
   and at most two others (the one being computed, the one arriving). ``"allgather"``: every needed
   shard in one round, one kernel over all of them (short sequences, where fixed costs per step
   dominate). ``"auto"`` asks the cost model (cost.py) with the call's sizes.
4. Steps. Per rank, a step is one kernel call: the rank's queries against the K/V of some source
   ranks (one in the ring; all needed in the gather). Its BlockMask is the global tables restricted
   to the rank's query rows and the sources' key blocks, renumbered locally; its mask_mod (and the
   call's score_mod, wrapped per call) reads the global positions of the local indices from
   captured position tables (``q_pos[q_idx]``, ``kv_pos[kv_idx]``), as the decoding offset mods
   read their offsets: tensors, so no step or rank retraces or compiles a new kernel. The mask_mod
   also masks padded queries and keys (``q_pos < Q_LEN``, ``kv_pos < KV_LEN``). Positions are int32,
   or int64 where the mods' index arithmetic needs it at the *global* lengths (the lowering's range
   analysis, as for a single-GPU call).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import InvalidInputError
from ..lowering import mod_index_dtype
from ..masks import TABLES_IN_RANGE, BlockMask, as_block_mask, sliced_rows_mask_mod
from ..masks.layout import cdiv, dense_to_ordered, ordered_to_dense, transposed_tables
from ..mods import mod_name, noop_mask
from .agreement import entries_digest
from .cost import CostModel, Problem, StepCost, gather_seconds, ring_seconds
from .sharding import (
    BALANCE_MODES, Layout, contiguous_units, imbalance, mask_balanced_units, padded_units, zigzag_units,
)

__all__ = ["SCHEDULES", "Plan", "RankPlan", "Round", "Step", "tiles_digest", "global_mask_mod", "global_score_mod"]

SCHEDULES = ("auto", "ring", "allgather")

# Tile tables are read in slices of query-block rows of about this many entries, so the scans stay
# small at a million tokens.
_SCAN_ENTRIES = 1 << 22


def global_mask_mod(mask_mod, q_pos: torch.Tensor, kv_pos: torch.Tensor, q_len: Optional[int], kv_len: Optional[int]):
    """``mask_mod`` at the global positions of local indices; positions from ``q_len`` / ``kv_len``
    on are padding and masked (None: the shard holds no padding on that side)."""

    def at_global_positions(b, h, q_idx, kv_idx):
        q, kv = q_pos[q_idx], kv_pos[kv_idx]
        keep = mask_mod(b, h, q, kv)
        if q_len is not None:
            keep = keep & (q < q_len)
        if kv_len is not None:
            keep = keep & (kv < kv_len)
        return keep

    at_global_positions.__name__ = f"{mod_name(mask_mod)}_global"
    return at_global_positions


def global_score_mod(score_mod, q_pos: torch.Tensor, kv_pos: torch.Tensor, first_head: Optional[int] = None):
    """``score_mod`` at the global positions of local indices, and at head ``first_head + h`` for a
    chunk of heads (None: all heads)."""

    def at_global_positions(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_pos[q_idx], kv_pos[kv_idx])

    def at_global_heads(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h + first_head, q_pos[q_idx], kv_pos[kv_idx])

    wrapped = at_global_positions if first_head is None else at_global_heads
    wrapped.__name__ = f"{mod_name(score_mod)}_global"
    return wrapped


def heads_mask_mod(mask_mod, first_head: int):
    """``mask_mod`` of a chunk of heads: local head h is head ``first_head + h``. The offset is a
    Python number the mod reads, so every chunk shares one trace and one kernel ([Note] Numbers are
    inputs, not constants, in trace/numbers.py)."""

    def at_global_heads(b, h, q_idx, kv_idx):
        return mask_mod(b, h + first_head, q_idx, kv_idx)

    at_global_heads.__name__ = f"{mod_name(mask_mod)}_heads"
    return at_global_heads


class Round:
    """One exchange of K/V shards: whom this rank sends its shard to, whose shards it receives."""

    __slots__ = ("send_to", "recv_from")

    def __init__(self, send_to: tuple[int, ...], recv_from: tuple[int, ...]) -> None:
        self.send_to, self.recv_from = send_to, recv_from

    def __repr__(self) -> str:
        return f"Round(send_to={self.send_to}, recv_from={self.recv_from})"


@dataclass(eq=False)
class Step:
    """One kernel call of a rank: its queries against the K/V shards of ``sources`` (concatenated in
    that order). ``round``: the index of the round that delivers them (None: the own shard only).
    ``block_mask``: local tables, mask_mod at global positions. Positions are on the mask's device."""

    sources: tuple[int, ...]
    round: Optional[int]
    block_mask: BlockMask
    full_tiles: int
    partial_tiles: int
    q_positions: torch.Tensor
    kv_positions: torch.Tensor
    first_head: Optional[int] = None  # a chunk's step ([Note] Head chunks in ring.py): its first query head

    def positions(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The position tables in ``dtype`` (int32 or int64), kept for the next call (the key
        leaves out the tables: they are this step's own, never written)."""
        cache = self.__dict__.setdefault("_positions", {})
        if dtype not in cache:
            cache[dtype] = (self.q_positions.to(dtype), self.kv_positions.to(dtype))
        return cache[dtype]

    def score_mod_at(self, score_mod, dtype: torch.dtype):
        """``score_mod`` at this step's global positions. The wrappers of the last few score_mods are
        kept, so a training loop passes the same objects every call (the trace cache's fast path)."""
        # Keyed by the callable itself (held here, so its id cannot come back for another) and the
        # position dtype. What the key leaves out: everything the callable reads. Safe: the wrapper
        # calls it, so each trace reads it as it is now, and ContextParallel's per-call agreement
        # hashes its graph and captured inputs before any step runs.
        kept = self.__dict__.setdefault("_score_mods", [])
        for fn, kept_dtype, wrapped in kept:
            if fn is score_mod and kept_dtype == dtype:
                return wrapped
        wrapped = global_score_mod(score_mod, *self.positions(dtype), self.first_head)
        kept.insert(0, (score_mod, dtype, wrapped))
        del kept[4:]
        return wrapped

    def on_heads(self, first: int, count: int) -> "Step":
        """This step for query heads ``first .. first + count - 1`` only: the mods see global heads,
        tables with a head dim keep the chunk's rows. Kept, so later calls reuse the wrappers (and
        their traces)."""
        kept = self.__dict__.setdefault("_on_heads", {})
        if (first, count) not in kept:
            bm = self.block_mask
            if bm.kv_num_blocks.shape[1] > 1:  # a table per head: the chunk's heads only
                bm = bm[:, first:first + count]
            chunk_mask = BlockMask(bm.seq_lengths, bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                                   bm.full_kv_indices, bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks,
                                   bm.full_q_indices, BLOCK_SIZE=bm.BLOCK_SIZE,
                                   mask_mod=heads_mask_mod(self.block_mask.mask_mod, first))
            chunk_mask.preset_derived(TABLES_IN_RANGE, True)
            kept[(first, count)] = dataclasses.replace(self, block_mask=chunk_mask, first_head=first)
        return kept[(first, count)]


@dataclass(eq=False)
class RankPlan:
    """What one rank runs: its rounds of exchanges and its steps, in order."""

    rank: int
    schedule: str
    rounds: list
    steps: list

    def received_shards(self) -> int:
        return sum(len(r.recv_from) for r in self.rounds)

    def sent_shards(self) -> int:
        return sum(len(r.send_to) for r in self.rounds)


def tiles_digest(num: torch.Tensor, idx: torch.Tensor, cols: int) -> int:
    """A digest of the set of used entries (b, h, row, col) of one table (``num``, ``idx``).

    What it leaves out, and why that is safe: the padding past each row's count and the order of a
    row's entries. Neither changes which tiles a kernel visits, and the plan reads the tables only
    through dense maps (``_row_maps``), where both are gone."""
    B, H, rows, width = idx.shape
    total = torch.zeros((), dtype=torch.int64, device=idx.device)
    step = max(1, _SCAN_ENTRIES // max(1, B * H * width))
    batch_head = torch.arange(B * H, device=idx.device).view(B, H, 1, 1)
    for start in range(0, rows, step):
        n, i = num[:, :, start:start + step], idx[:, :, start:start + step].long()
        used = torch.arange(width, device=i.device) < n.unsqueeze(-1)
        row = torch.arange(start, start + n.shape[2], device=i.device).view(1, 1, -1, 1)
        total += entries_digest(((batch_head * rows + row) * cols + i)[used])
    return int(total)


class Plan:
    """The plan of context-parallel attention for one global BlockMask and ``world_size`` ranks.

    Pure: it needs no process group, so tests and the benchmark build plans for any number of
    ranks in one process. See [Note] The plan.

    Attributes:
        q_layout, kv_layout: the :class:`~flexattn.distributed.sharding.Layout` of queries and of
            keys/values (the same object when Q_LEN == KV_LEN).
        full_tiles, partial_tiles: int64 ``[R, R]``, the tiles rank i computes against rank j's
            K/V shard (summed over the mask's batch and heads).
        needs: bool ``[R, R]``, ``needs[i, j]``: rank i's queries visit rank j's keys.
        unit_imbalance: the largest distance of a rank's full or partial tile count from the even
            share (0.5 is as even as odd totals allow).
        schedule: the schedule that ran last ("ring" or "allgather"); the requested one when it
            is not "auto"; None before the first call of an "auto" plan.
    """

    def __init__(self, block_mask, world_size: int, balance: str = "mask", schedule: str = "auto",
                 cost_model: Optional[CostModel] = None) -> None:
        bm = as_block_mask(block_mask)
        if bm.mask_mod is sliced_rows_mask_mod:
            raise InvalidInputError(
                "ContextParallel needs the global BlockMask of the whole sequence, not one whose rows were "
                "selected with block_mask[:, :, rows]"
            )
        if balance not in BALANCE_MODES:
            raise InvalidInputError(f"ContextParallel: balance must be one of {BALANCE_MODES}, got {balance!r}")
        if schedule not in SCHEDULES:
            raise InvalidInputError(f"ContextParallel: schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.block_mask = bm
        self.world_size = world = int(world_size)
        self.balance = balance
        self.requested_schedule = schedule
        self.schedule = None if schedule == "auto" else schedule
        self.cost_model = cost_model if cost_model is not None else CostModel.for_device(bm.kv_num_blocks.device)
        self.device = bm.kv_num_blocks.device
        q_len, kv_len = bm.seq_lengths
        q_block, kv_block = bm.BLOCK_SIZE
        self.rows, self.cols = cdiv(q_len, q_block), cdiv(kv_len, kv_block)

        row_full, row_partial = self._row_tiles()
        multiple = 2 * world if balance == "zigzag" else world
        unit = math.lcm(q_block, kv_block)
        n_q, n_kv = padded_units(q_len, unit, multiple), padded_units(kv_len, unit, multiple)
        if n_q == n_kv:  # queries and keys dealt alike
            full, partial = self._unit_tiles(row_full, row_partial, unit // q_block, n_q)
            units = self._deal(n_q, full, partial, unit, shared=True)
            self.q_layout = Layout(q_len, unit, units)
            self.kv_layout = self.q_layout if kv_len == q_len else Layout(kv_len, unit, units)
        else:
            n_q = padded_units(q_len, q_block, multiple)
            n_kv = padded_units(kv_len, kv_block, world)
            self.kv_layout = Layout(kv_len, kv_block, contiguous_units(n_kv, world))
            full, partial = self._unit_tiles(row_full, row_partial, 1, n_q)
            self.q_layout = Layout(q_len, q_block, self._deal(n_q, full, partial, q_block, shared=False))
        self.full_tiles, self.partial_tiles = self._pair_tiles(self.q_layout, self.kv_layout)
        self.needs = (self.full_tiles + self.partial_tiles) > 0
        self.unit_imbalance = imbalance(self.q_layout.units, full, partial)
        # The dtype mods see positions in: what their index arithmetic needs at the global lengths.
        B, H = bm.kv_num_blocks.shape[:2]
        self.mask_position_dtype = mod_index_dtype(bm.mask_mod, "mask_mod", B, H, q_len, kv_len)
        self._rank_plans: dict = {}
        self._choices: dict = {}

    # ------------------------------------------------------------------------------ tiles

    def _visited(self):
        """Per slice of query-block rows: ``(rows, idx, as_full, as_partial)`` for each table, where
        ``rows`` are the slice's row ids, ``idx`` its entries ``[B, H, rows, W]``, and the two masks
        say which entries count as full and which as partial tiles. A tile that sticks out past the
        lengths counts as partial; listed blocks past the lengths are ignored (they hold no token).
        Dense masks rather than selected entries: a million tokens are tens of millions of tiles."""
        bm = self.block_mask
        q_len, kv_len = bm.seq_lengths
        q_cut, kv_cut = q_len % bm.BLOCK_SIZE[0] != 0, kv_len % bm.BLOCK_SIZE[1] != 0
        tables = [(bm.kv_num_blocks, bm.kv_indices, False)]
        if bm.full_kv_num_blocks is not None:
            tables.append((bm.full_kv_num_blocks, bm.full_kv_indices, True))
        B, H, table_rows, width = bm.kv_indices.shape
        rows = min(self.rows, table_rows)
        step = max(1, _SCAN_ENTRIES // max(1, B * H * width))
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            row_ids = torch.arange(start, stop, device=self.device)
            for num, idx, full in tables:
                idx = idx[:, :, start:stop]
                used = (torch.arange(idx.shape[-1], device=idx.device) < num[:, :, start:stop].unsqueeze(-1))
                used &= idx < self.cols
                if not full:
                    yield row_ids, idx, None, used
                    continue
                cut = torch.zeros_like(used)
                if kv_cut:
                    cut |= idx == self.cols - 1
                if q_cut and stop == self.rows:
                    cut[:, :, -1] = True
                yield row_ids, idx, used & ~cut, used & cut

    def _row_tiles(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full and partial tiles of each query-block row (int64 ``[rows]``, CPU)."""
        full = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        partial = torch.zeros_like(full)
        for row_ids, _, as_full, as_partial in self._visited():
            partial[row_ids] += as_partial.sum((0, 1, 3))
            if as_full is not None:
                full[row_ids] += as_full.sum((0, 1, 3))
        return full.cpu(), partial.cpu()

    def _unit_tiles(self, row_full, row_partial, rows_per_unit: int, n_units: int):
        padded = n_units * rows_per_unit
        full = torch.nn.functional.pad(row_full, (0, padded - self.rows)).view(n_units, -1).sum(1)
        partial = torch.nn.functional.pad(row_partial, (0, padded - self.rows)).view(n_units, -1).sum(1)
        return full, partial

    def _pair_tiles(self, q_layout: Layout, kv_layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        world = self.world_size
        q_owner = q_layout.owners(self.block_mask.BLOCK_SIZE[0]).to(self.device)
        kv_owner = kv_layout.owners(self.block_mask.BLOCK_SIZE[1])
        # Entries past the keys weigh nothing; the lookup only has to cover them.
        width = self.block_mask.kv_indices.shape[-1]
        kv_owner = torch.nn.functional.pad(kv_owner, (0, max(0, width - kv_owner.numel()))).to(self.device)
        bins = world * world + 1  # the last bin takes the entries that are not tiles of that kind
        full = torch.zeros(bins, dtype=torch.long, device=self.device)
        partial = torch.zeros_like(full)
        for row_ids, idx, as_full, as_partial in self._visited():
            pair = (q_owner[row_ids] * world).view(1, 1, -1, 1) + kv_owner[idx]
            if as_full is not None:
                full += torch.bincount(torch.where(as_full, pair, bins - 1).reshape(-1), minlength=bins)
            partial += torch.bincount(torch.where(as_partial, pair, bins - 1).reshape(-1), minlength=bins)
        return full[:-1].view(world, world).cpu(), partial[:-1].view(world, world).cpu()

    def _deal(self, n_units: int, full, partial, unit: int, shared: bool) -> torch.Tensor:
        world = self.world_size
        if self.balance == "contiguous":
            return contiguous_units(n_units, world)
        if self.balance == "zigzag":
            return zigzag_units(n_units, world)
        q_len, kv_len = self.block_mask.seq_lengths

        def pairs_needed(units: torch.Tensor) -> int:
            q_layout = Layout(q_len, unit, units)
            kv_layout = Layout(kv_len, unit, units) if shared else self.kv_layout
            f, p = self._pair_tiles(q_layout, kv_layout)
            return int(((f + p) > 0).sum())

        return mask_balanced_units(full, partial, world, pairs_needed)

    # ------------------------------------------------------------------------------ schedules

    def rank_tiles(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full and partial tiles each rank's queries compute (int64 ``[R]`` each)."""
        return self.full_tiles.sum(1), self.partial_tiles.sum(1)

    def _ring_rounds(self, rank: int) -> list:
        world, needs = self.world_size, self.needs
        rounds = []
        for s in range(1, world):
            to, frm = (rank + s) % world, (rank - s) % world
            rounds.append(Round((to,) if needs[to, rank] else (), (frm,) if needs[rank, frm] else ()))
        return rounds

    def _gather_rounds(self, rank: int) -> list:
        world, needs = self.world_size, self.needs
        send_to = tuple((rank + s) % world for s in range(1, world) if needs[(rank + s) % world, rank])
        recv_from = tuple((rank - s) % world for s in range(1, world) if needs[rank, (rank - s) % world])
        return [Round(send_to, recv_from)]

    def _step_groups(self, rank: int, schedule: str) -> list:
        """(sources, round index) of each step of ``rank``, in order."""
        own = [((rank,), None)] if self.needs[rank, rank] else []
        if schedule == "ring":
            return own + [(r.recv_from, i) for i, r in enumerate(self._ring_rounds(rank)) if r.recv_from]
        received = self._gather_rounds(rank)[0].recv_from
        if not received:
            return own
        return [(((rank,) if own else ()) + received, 0)]

    def step_costs(self, rank: int, schedule: str) -> list:
        """The :class:`StepCost` of each step of ``rank`` (what the cost model reads)."""
        costs = []
        for sources, round_index in self._step_groups(rank, schedule):
            full = sum(int(self.full_tiles[rank, s]) for s in sources)
            partial = sum(int(self.partial_tiles[rank, s]) for s in sources)
            costs.append(StepCost(full, partial, round_index is not None))
        return costs

    def predicted_seconds(self, problem: Problem, schedule: str, backward: bool = False,
                          model: Optional[CostModel] = None) -> list:
        """The cost model's time of each rank for ``schedule`` ("ring" or "allgather"), by the
        plan's model or ``model``."""
        model, block = model or self.cost_model, self.block_mask.BLOCK_SIZE
        q_length, kv_length = self.q_layout.local_length, self.kv_layout.local_length
        seconds = []
        for rank in range(self.world_size):
            steps = self.step_costs(rank, schedule)
            if schedule == "ring":
                seconds.append(ring_seconds(model, problem, block, q_length, kv_length, steps, backward))
            else:
                received = len(self._gather_rounds(rank)[0].recv_from)
                full, partial = sum(s.full for s in steps), sum(s.partial for s in steps)
                seconds.append(gather_seconds(model, problem, block, kv_length, full, partial, received, backward))
        return seconds

    def choose_schedule(self, problem: Problem, model: Optional[CostModel] = None) -> str:
        """The schedule for a call of these sizes: the requested one, or the cost model's choice
        (the gather only where its K/V fit ``gather_limit_bytes``). The same on every rank."""
        if self.requested_schedule != "auto":
            return self.requested_schedule
        model = model or self.cost_model
        # The key leaves out the tiles and layouts: this plan's own, fixed. The model is a frozen
        # dataclass, compared by value; ranks with different models may choose differently, which
        # ContextParallel's per-call agreement catches (the choice is one of its facts).
        choice = self._choices.get((problem, model))
        if choice is None:
            most_received = max(len(self._gather_rounds(r)[0].recv_from) for r in range(self.world_size))
            gather_bytes = (most_received + 1) * problem.shard_bytes(self.kv_layout.local_length)
            ring = max(self.predicted_seconds(problem, "ring", model=model))
            gather = max(self.predicted_seconds(problem, "allgather", model=model))
            fits = gather_bytes <= model.gather_limit_bytes
            choice = self._choices[(problem, model)] = "allgather" if fits and gather < ring else "ring"
        return choice

    # ------------------------------------------------------------------------------ one rank's steps

    def rank_plan(self, rank: int, schedule: str) -> RankPlan:
        """``rank``'s rounds and steps for ``schedule``, with their BlockMasks (built once, kept)."""
        # The key leaves out the tables: a schedule's step masks are built from them at its first
        # call. Tables written in place after ContextParallel agreed on them are not supported (nor
        # on one GPU, where a BlockMask's derived data keeps them); the mask_mod's captured
        # tensors are read, and agreed on, at every call.
        key = (rank, schedule)
        plan = self._rank_plans.get(key)
        if plan is None:
            rounds = self._ring_rounds(rank) if schedule == "ring" else self._gather_rounds(rank)
            maps = self._row_maps(rank)
            steps = [self._step(rank, maps, sources, round_index)
                     for sources, round_index in self._step_groups(rank, schedule)]
            plan = self._rank_plans[key] = RankPlan(rank, schedule, rounds, steps)
        return plan

    def _row_maps(self, rank: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Partial and full tile maps of ``rank``'s query rows against every key block, int32
        ``[B, H, local rows, cols + 1]``: the last column stands for blocks past the keys (always
        empty); rows past the queries are empty; tiles that stick out past a length are partial."""
        bm = self.block_mask
        q_len, kv_len = bm.seq_lengths
        rows = self.q_layout.blocks(rank, bm.BLOCK_SIZE[0]).to(self.device)
        real = (rows < min(self.rows, bm.kv_indices.shape[2])).view(1, 1, -1, 1)
        rows = rows.clamp(max=min(self.rows, bm.kv_indices.shape[2]) - 1)

        def dense(num, idx):
            idx = idx.index_select(2, rows)
            idx = torch.where(idx < self.cols, idx, self.cols)
            return ordered_to_dense(num.index_select(2, rows), idx, self.cols + 1) * real

        partial = dense(bm.kv_num_blocks, bm.kv_indices)
        partial[..., self.cols] = 0
        if bm.full_kv_num_blocks is None:
            return partial, None
        full = dense(bm.full_kv_num_blocks, bm.full_kv_indices)
        full[..., self.cols] = 0
        cut = torch.zeros_like(full, dtype=torch.bool)
        if kv_len % bm.BLOCK_SIZE[1]:
            cut[..., self.cols - 1] = True
        if q_len % bm.BLOCK_SIZE[0]:
            cut |= (self.q_layout.blocks(rank, bm.BLOCK_SIZE[0]) == self.rows - 1).to(self.device).view(1, 1, -1, 1)
        partial = partial | (full & cut.to(full.dtype))
        full = full.masked_fill(cut, 0)
        return partial, full

    def _step(self, rank: int, maps: tuple, sources: tuple, round_index: Optional[int]) -> Step:
        bm = self.block_mask
        kv_block = bm.BLOCK_SIZE[1]
        partial, full = maps
        cols = torch.cat([self.kv_layout.blocks(s, kv_block) for s in sources]).clamp(max=self.cols).to(self.device)
        partial, full = partial[..., cols], (None if full is None else full[..., cols])
        q_pos = self.q_layout.positions(rank).to(self.device)
        kv_pos = torch.cat([self.kv_layout.positions(s) for s in sources]).to(self.device)
        q_len, kv_len = bm.seq_lengths
        dtype = self.mask_position_dtype
        mask_mod = global_mask_mod(
            bm.mask_mod if bm.mask_mod is not None else noop_mask, q_pos.to(dtype), kv_pos.to(dtype),
            q_len if self.q_layout.padded_length > q_len else None,
            kv_len if self.kv_layout.padded_length > kv_len else None,
        )
        num, idx = dense_to_ordered(partial)
        full_num = full_idx = None
        if full is not None:
            full_num, full_idx = dense_to_ordered(full)
        step_mask = BlockMask(
            (q_pos.numel(), kv_pos.numel()), num, idx, full_num, full_idx, *transposed_tables(partial, full),
            BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=mask_mod,
        )
        step_mask.preset_derived(TABLES_IN_RANGE, True)  # from dense maps: ascending and in range
        return Step(
            sources, round_index, step_mask,
            int(sum(self.full_tiles[rank, s] for s in sources)), int(sum(self.partial_tiles[rank, s] for s in sources)),
            q_pos, kv_pos,
        )

    def describe(self) -> str:
        """One line: layouts, balance, and the shards each rank receives."""
        full, partial = self.rank_tiles()
        received = [int(self.needs[r].sum()) - int(self.needs[r, r]) for r in range(self.world_size)]
        return (
            f"{self.world_size} ranks, balance={self.balance}: {self.q_layout.local_length} queries and "
            f"{self.kv_layout.local_length} keys per rank (padded to {self.q_layout.padded_length} / "
            f"{self.kv_layout.padded_length}); full tiles per rank {full.tolist()}, partial {partial.tolist()}; "
            f"K/V shards received per rank {received} of {self.world_size - 1}"
        )
