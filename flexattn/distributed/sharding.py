"""How a sequence is cut into units and dealt to the ranks: the three balance modes.

A *unit* is the smallest piece of the sequence a rank holds: a whole number of query blocks and of
key blocks of the BlockMask, so every tile of the mask lies in one (query shard, K/V shard) pair.
A :class:`Layout` lists, for every rank, the units it holds in its local order; a rank's shard is
those units' tokens, concatenated. Every rank holds the same number of units, so every shard has
the same length and the ranks exchange buffers of one shape.

* ``"contiguous"``: rank r holds units ``r*n .. r*n + n - 1``.
* ``"zigzag"``: the sequence is cut into 2R chunks and rank r holds chunks r and 2R-1-r, the classic
  head-tail split that evens out causal work.
* ``"mask"``: units are dealt from the mask's own tile counts (:func:`mask_balanced_units`), so that
  the full and partial tiles each rank computes are as even as the units allow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..errors import InvalidInputError
from ..masks.layout import cdiv

__all__ = ["BALANCE_MODES", "Layout", "padded_units", "contiguous_units", "zigzag_units", "mask_balanced_units",
           "imbalance"]

BALANCE_MODES = ("mask", "zigzag", "contiguous")


@dataclass(frozen=True, eq=False)
class Layout:
    """One sequence cut into ``unit``-token units and dealt to the ranks.

    ``length``: tokens of the sequence before padding. ``units``: int64 ``[world, per_rank]`` (on the
    CPU), the global unit ids each rank holds, in its local order. Units past ``length`` are padding.
    """

    length: int
    unit: int
    units: torch.Tensor

    @property
    def world(self) -> int:
        return self.units.shape[0]

    @property
    def per_rank(self) -> int:
        return self.units.shape[1]

    @property
    def padded_length(self) -> int:
        return self.units.numel() * self.unit

    @property
    def local_length(self) -> int:
        return self.per_rank * self.unit

    def positions(self, rank: int) -> torch.Tensor:
        """Global token positions of ``rank``'s shard, in its local order (int64, CPU); positions
        from ``length`` on are padding."""
        return (self.units[rank].unsqueeze(1) * self.unit + torch.arange(self.unit)).reshape(-1)

    def blocks(self, rank: int, block: int) -> torch.Tensor:
        """Global ids of the ``block``-token blocks of ``rank``'s shard, in its local order (int64)."""
        per_unit = self.unit // block
        return (self.units[rank].unsqueeze(1) * per_unit + torch.arange(per_unit)).reshape(-1)

    def owners(self, block: int) -> torch.Tensor:
        """The rank that holds each global ``block``-token block (int64 ``[padded_length // block]``)."""
        per_unit = self.unit // block
        owner = torch.empty(self.units.numel(), dtype=torch.long)
        owner[self.units.reshape(-1)] = torch.arange(self.world).repeat_interleave(self.per_rank)
        return owner.repeat_interleave(per_unit)


def padded_units(length: int, unit: int, multiple: int) -> int:
    """How many units hold ``length`` tokens, rounded up to a multiple of ``multiple``."""
    return cdiv(cdiv(length, unit), multiple) * multiple


def contiguous_units(n_units: int, world: int) -> torch.Tensor:
    return torch.arange(n_units).reshape(world, -1)


def zigzag_units(n_units: int, world: int) -> torch.Tensor:
    """Rank r holds chunks r and 2*world-1-r of 2*world equal chunks (n_units % (2*world) == 0)."""
    chunks = torch.arange(n_units).reshape(2 * world, -1)
    return torch.cat([chunks[:world], chunks[world:].flip(0)], dim=1)


def _load(units: torch.Tensor, full: torch.Tensor, partial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return full[units].sum(1), partial[units].sum(1)


def imbalance(units: torch.Tensor, full: torch.Tensor, partial: torch.Tensor) -> float:
    """The largest distance of a rank's full or partial tile count from the even share."""
    F, P = _load(units, full, partial)
    world = units.shape[0]
    return max(float((F * world - F.sum()).abs().max()) / world, float((P * world - P.sum()).abs().max()) / world)


def _sorted_snake(full: torch.Tensor, partial: torch.Tensor, world: int) -> torch.Tensor:
    """Units by decreasing work, dealt back and forth (0, 1, .., R-1, R-1, .., 0, ...): each rank gets
    one unit of every R consecutive in that order, the heavy and the light alike."""
    order = torch.sort(full + partial, descending=True, stable=True).indices.reshape(-1, world)
    order[1::2] = order[1::2].flip(1)
    return order.t().contiguous()


def _best_swap(units, full, partial, F, P, a: int, b: int, time_weight: int) -> Optional[tuple[int, int, int]]:
    """The swap of a unit of rank a with one of rank b that lowers the spread most, as (position in
    a, position in b, change), or None when none lowers it.

    The spread is ``sum((F - mean)^2 + (P - mean)^2 + w (F + P - mean)^2)`` over ranks, w the
    ``time_weight``. Swapping u (of a) for v (of b) changes it by ``(q(x, y) - q(x0, y0)) / 2``
    with ``x = 2 (f_v - f_u) + F_a - F_b``, ``y = 2 (p_v - p_u) + P_a - P_b``, ``(x0, y0)`` their
    values without a swap, and ``q(x, y) = x^2 + y^2 + w (x + y)^2``. For a fixed ``p_v`` (units
    of b grouped by partial count: few groups), q is a convex parabola in ``f_v``, so the best v
    of each u is one of the two whose ``f_v`` enclose the parabola's vertex: a sorted search, not
    all n^2 pairs. Integer arithmetic: every rank computes the same answer. Of equal changes, the
    swap of the nearest units wins: neighbours stay together, and so do the shards they need."""
    da, ea, w = int(F[a] - F[b]), int(P[a] - P[b]), time_weight
    fa, pa = full[units[a]], partial[units[a]]
    fb, pb = full[units[b]], partial[units[b]]
    order = torch.sort(pb * (int(fb.max()) + 1) + fb, stable=True).indices
    fb_sorted, pb_sorted = fb[order], pb[order]
    values, counts = torch.unique_consecutive(pb_sorted, return_counts=True)
    best_q, best_j = [], []
    start = 0
    for p_value, count in zip(values.tolist(), counts.tolist()):
        f_group = fb_sorted[start:start + count]
        y = 2 * (p_value - pa) + ea
        # The vertex in x, then the f_v it asks for.
        target = fa.double() + (-w * y.double() / (1 + w) - da) / 2
        at = torch.searchsorted(f_group.double(), target)
        for k in (at - 1, at):
            k = k.clamp(0, count - 1)
            x = 2 * (f_group[k] - fa) + da
            best_q.append((1 + w) * (x * x + y * y) + 2 * w * x * y)
            best_j.append(order[start + k])
        start += count
    q, j = torch.stack(best_q, dim=1), torch.stack(best_j, dim=1)
    q_none = (1 + w) * (da * da + ea * ea) + 2 * w * da * ea
    q_min = int(q.min())
    if q_min >= q_none:
        return None
    ties = (q == q_min).nonzero()
    i_ties, j_ties = ties[:, 0], j[ties[:, 0], ties[:, 1]]
    pick = int((units[b][j_ties] - units[a][i_ties]).abs().argmin())
    return int(i_ties[pick]), int(j_ties[pick]), (q_min - q_none) // 2


_EVERY_PAIR_ROUNDS = 16


def _refined(units: torch.Tensor, full: torch.Tensor, partial: torch.Tensor, max_swaps: int,
             time_weight: int = 0) -> torch.Tensor:
    """Local search: swap units between ranks while it evens the counts, until every rank is
    within one tile of even (of even total work with ``time_weight``). Each round tries the most
    and the least loaded ranks first (cheap); every pair of ranks, which costs R^2 / 2 searches,
    only when they have no useful swap, and at most ``_EVERY_PAIR_ROUNDS`` times."""
    units = units.clone()
    F, P = _load(units, full, partial)
    world = units.shape[0]

    def even() -> bool:
        if time_weight:
            return float(((F + P) * world - (F + P).sum()).abs().max()) <= world
        return max(float((F * world - F.sum()).abs().max()), float((P * world - P.sum()).abs().max())) <= world

    every_pair_rounds = 0
    for _ in range(max_swaps):
        if even():
            break
        load = F + P
        a, b = int(load.argmax()), int(load.argmin())
        swap = _best_swap(units, full, partial, F, P, a, b, time_weight) if a != b else None
        if swap is None:
            if every_pair_rounds == _EVERY_PAIR_ROUNDS:
                break
            every_pair_rounds += 1
            candidates = []
            for i in range(world):
                for j in range(i + 1, world):
                    found = _best_swap(units, full, partial, F, P, i, j, time_weight)
                    if found is not None:
                        candidates.append((found[2], i, j, found))
            if not candidates:
                break
            _, a, b, swap = min(candidates, key=lambda c: (c[0], c[1], c[2]))
        i, j, _ = swap
        ua, ub = int(units[a, i]), int(units[b, j])
        units[a, i], units[b, j] = ub, ua
        F[a] += full[ub] - full[ua]
        F[b] -= full[ub] - full[ua]
        P[a] += partial[ub] - partial[ua]
        P[b] -= partial[ub] - partial[ua]
    return units.sort(dim=1).values


def _time_spread(units: torch.Tensor, full: torch.Tensor, partial: torch.Tensor) -> float:
    F, P = _load(units, full, partial)
    T = (F + P).double()
    return float((T - T.mean()).abs().max())


def mask_balanced_units(
    full: torch.Tensor, partial: torch.Tensor, world: int, pairs_needed: Callable[[torch.Tensor], int],
    max_swaps: Optional[int] = None,
) -> torch.Tensor:
    """Units dealt to ranks so that each rank's full and partial tile counts are even.

    ``full``, ``partial``: int64 ``[n_units]``, the tiles of each unit's query rows (padding units
    count 0). Three starts are refined by swapping units (:func:`_refined`): contiguous, zigzag (when
    the units split into 2R chunks) and the units sorted by work and dealt back and forth. Of the
    results within one tile of even in both counts, the one whose ranks need the fewest K/V shards
    of each other (``pairs_needed``) wins: a sliding window stays near contiguous, and so near its
    neighbours. Equal shards cannot always be that even: a row that crosses a document boundary
    carries a lump of partial tiles (the earlier document's keys), which units of one or two tiles
    cannot offset, and a window's first rows are light. Then each start is refined further for
    even total work (full + partial), and of those within one tile of the most even total, the
    one that needs the fewest shards wins.
    """
    n_units = full.numel()
    if n_units % world:
        raise InvalidInputError(f"mask_balanced_units: {n_units} units do not split over {world} ranks")
    if max_swaps is None:
        max_swaps = min(4 * n_units, 256)
    starts = [contiguous_units(n_units, world)]
    if n_units % (2 * world) == 0:
        starts.append(zigzag_units(n_units, world))
    starts.append(_sorted_snake(full, partial, world))
    refined = [_refined(units, full, partial, max_swaps) for units in starts]
    candidates = [units for units in refined if imbalance(units, full, partial) <= 1.0]
    if not candidates:  # within one tile of the most even total
        refined = [_refined(units, full, partial, max_swaps, time_weight=2) for units in refined]
        spreads = [_time_spread(units, full, partial) for units in refined]
        candidates = [units for units, spread in zip(refined, spreads) if spread <= min(spreads) + 1.0]
    if len(candidates) == 1:
        return candidates[0]
    needed = [pairs_needed(units) for units in candidates]
    return candidates[needed.index(min(needed))]
