"""The blockwise PyTorch backend: FlashAttention-2 in plain PyTorch, driven by a BlockMask.

It runs on any device torch runs on (it is the default path on CPU, where it also trains) and keeps
memory linear in the sequence length: scores are only ever held for one row chunk at a time.

Sub notation for this module:
    B: query batch, Bkv: key/value batch (B or 1), Hq: query heads, Hkv: key/value heads,
    G = Hq // Hkv: query heads per kv head (GQA group), L: queries, S: keys/values,
    E: query/key head dim, Ev: value head dim.
    row: one query block of the BlockMask (Q_BLOCK queries), split into sub-rows of at most
         Q_TILE_MAX queries when the block is very tall.
    chunk: the keys of a row that are scored together: the row's listed KV blocks, padded to the
         longest list over (b, h) and cut into pieces of at most TILE_ELEMENTS scores.
    partial / full blocks: partial blocks get score_mod and mask_mod, full blocks score_mod only.
    m_i, l_i, acc: running row max, row sum of exp(score - m_i), and unnormalised output (FA-2).

Forward, for each row and each chunk of its partial, then its full blocks:
    gather the chunk's keys and values from the block lists (every (b, h) at once),
    s = scale * q @ k^T, then score_mod, then -inf where masked, out of range or padding,
    m_new = max(m_i, rowmax(s)); p = exp(s - m_new); l_i = l_i * exp(m_i - m_new) + rowsum(p);
    acc = acc * exp(m_i - m_new) + p @ v.
At the end of the row: out = acc / l_i, lse = m_i + log(l_i).

Backward (FA-2 style) recomputes p = exp(s - lse) per chunk from the saved lse and uses
delta = rowsum(dO * O) - dlse:
    dV += p^T dO,  dP = dO V^T,  dS = p * (dP - delta),
then pushes dS back through score_mod with ``torch.autograd.grad`` (this also yields the gradients
of captured tensors that require grad) and through ``scale * q @ k^T`` with two matmuls. dK and dV
of the gathered keys are scatter-added into place, so GQA groups and a broadcast K/V batch sum.

Mods are the traced graph modules (``gm(score, b, h, q_idx, kv_idx, *captured)`` and
``gm(b, h, q_idx, kv_idx, *captured)``) or any callable with that signature. Each mod is applied
once per chunk, with ``torch.vmap`` over every tile dimension. Index tensors are int32, or int64
when the caller says the mods' integer arithmetic needs it at these lengths (``index_dtype``, from
flexattn/lowering/ranges.py): arithmetic on the indices is exact, as in the kernels.

Nothing here is an autograd.Function: ``blockwise_forward`` and ``blockwise_backward`` are plain
functions that the API layer wraps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from .trace import GathersReadZero

__all__ = ["BlockwiseMods", "blockwise_forward", "blockwise_backward", "TILE_ELEMENTS", "Q_TILE_MAX"]


class BlockwiseMods(NamedTuple):
    """The mods as this backend runs them: each a callable (an fx GraphModule: the trace's graph)
    that takes its captured tensors after its arguments, with those tensors."""

    score_mod: Optional[Callable]
    score_captured: Sequence[torch.Tensor]
    mask_mod: Optional[Callable]
    mask_captured: Sequence[torch.Tensor]

TILE_ELEMENTS = 1 << 22  # scores per chunk (16 MiB in float32); a chunk holds a handful of tiles this big
Q_TILE_MAX = 256  # queries per sub-row: taller BlockMask rows (e.g. one block for everything) are split
DENSE_BLOCK = 128  # block size used when no BlockMask is given
INDEX_DTYPE = torch.int32  # dtype of b, h, q_idx, kv_idx as the mods see them, unless index_dtype says int64


def _working_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------
# Layout: which K/V slice and which block list each (batch, head) reads
# --------------------------------------------------------------------------------------------


@dataclass
class _BlockLists:
    """One kind (partial or full) of a BlockMask's KV block lists."""

    num: torch.Tensor  # [Bm, Hm, ROWS] int
    indices: torch.Tensor  # [Bm, Hm, ROWS, COLS] int
    max_per_row: list[int]  # longest list of each row over (b, h)


@dataclass
class _Layout:
    """Sizes and the index tensors used to gather keys of every (batch, kv head, group head) at once.

    Gathered K/V tiles have shape [Bg, Hkv, Gg, T, D]: Bg is 1 when every query batch reads the same
    K/V with the same block lists (K/V batch 1 and a batch-broadcast mask), and Gg is 1 when the
    block lists are the same for all query heads of a GQA group (a head-broadcast mask), so the
    group shares one gathered tile.
    """

    B: int
    Hq: int
    Hkv: int
    G: int
    L: int
    S: int
    E: int
    Ev: int
    Bg: int
    Gg: int
    q_block: int
    kv_block: int
    scale: float
    dtype: torch.dtype  # working precision
    kv_batch: torch.Tensor  # [Bg, 1, 1, 1] long: K/V batch of gathered batch i
    kv_head: torch.Tensor  # [1, Hkv, 1, 1] long
    mask_batch: torch.Tensor  # [Bg, 1, 1] long: BlockMask batch of gathered batch i
    mask_head: torch.Tensor  # [1, Hkv, Gg] long: BlockMask head of (kv head, group head)
    index_dtype: torch.dtype  # of the mods' index arguments: int32, or int64 where they need it
    b_arg: torch.Tensor  # [B, 1, 1, 1, 1] index_dtype, the mods' b
    h_arg: torch.Tensor  # [1, Hkv, G, 1, 1] index_dtype, the mods' h (the query head)
    partial: Optional[_BlockLists]
    full: Optional[_BlockLists]


def _block_lists(num, indices) -> Optional[_BlockLists]:
    if num is None:
        return None
    return _BlockLists(num=num, indices=indices, max_per_row=num.amax(dim=(0, 1)).tolist())


def _dense_block_lists(L: int, S: int, device) -> tuple[_BlockLists, int, int]:
    """Every KV block of every row listed as full: what "no BlockMask" means."""
    rows, cols = max(1, -(-L // DENSE_BLOCK)), max(1, -(-S // DENSE_BLOCK))
    num = torch.full((1, 1, rows), cols, dtype=torch.int32, device=device)
    indices = torch.arange(cols, dtype=torch.int32, device=device).expand(1, 1, rows, cols)
    return _block_lists(num, indices), DENSE_BLOCK, DENSE_BLOCK


def _make_layout(q, k, v, block_mask, scale, index_dtype: torch.dtype = INDEX_DTYPE) -> _Layout:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k and v must be 4-D: [B, Hq, L, E], [Bkv, Hkv, S, E], [Bkv, Hkv, S, Ev]")
    B, Hq, L, E = q.shape
    Bkv, Hkv, S, _ = k.shape
    Ev = v.shape[-1]
    if k.shape[-1] != E or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Bkv not in (1, B):
        raise ValueError(f"key/value batch {Bkv} must equal the query batch {B} or be 1")
    if Hq % Hkv != 0:
        raise ValueError(f"query heads {Hq} must be a multiple of key/value heads {Hkv}")
    G = Hq // Hkv
    device = q.device

    if block_mask is None:
        partial, (full, q_block, kv_block) = None, _dense_block_lists(L, S, device)
    else:
        q_block, kv_block = block_mask.BLOCK_SIZE
        partial = _block_lists(block_mask.kv_num_blocks, block_mask.kv_indices)
        full = _block_lists(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        rows = block_mask.kv_num_blocks.shape[-1]
        if rows * q_block < L:
            raise ValueError(
                f"the BlockMask covers {rows * q_block} queries (rows of {q_block}) but the query has {L}; "
                "create the BlockMask with Q_LEN equal to the query length"
            )
    Bm, Hm = (partial or full).num.shape[:2]
    if B % Bm != 0 or Hq % Hm != 0:
        raise ValueError(f"a BlockMask of batch {Bm} and heads {Hm} does not broadcast to batch {B}, heads {Hq}")

    Bg = 1 if (Bkv == 1 and Bm == 1) else B
    Gg = 1 if Hm == 1 else G
    long = dict(dtype=torch.long, device=device)
    query_heads = torch.arange(Hkv * G, **long).view(Hkv, G)[:, :Gg]  # the first head of each group when Gg == 1
    return _Layout(
        B=B, Hq=Hq, Hkv=Hkv, G=G, L=L, S=S, E=E, Ev=Ev, Bg=Bg, Gg=Gg,
        q_block=q_block, kv_block=kv_block,
        scale=1.0 / math.sqrt(E) if scale is None else float(scale),
        dtype=_working_dtype(q.dtype),
        kv_batch=(torch.arange(Bg, **long) % Bkv).view(Bg, 1, 1, 1),
        kv_head=torch.arange(Hkv, **long).view(1, Hkv, 1, 1),
        mask_batch=(torch.arange(Bg, **long) % Bm).view(Bg, 1, 1),
        mask_head=(query_heads % Hm).view(1, Hkv, Gg),
        index_dtype=index_dtype,
        b_arg=torch.arange(B, dtype=index_dtype, device=device).view(B, 1, 1, 1, 1),
        h_arg=torch.arange(Hq, dtype=index_dtype, device=device).view(1, Hkv, G, 1, 1),
        partial=partial,
        full=full,
    )


@dataclass
class _RowKeys:
    """The keys one row visits for one kind of block, for every gathered (batch, kv head, group head)."""

    tokens: torch.Tensor  # [Bg, Hkv, Gg, T] long key positions (0 where not valid)
    valid: torch.Tensor  # [Bg, Hkv, Gg, T] bool: a listed block and a position < S
    all_valid: bool


def _row_keys(lists: Optional[_BlockLists], row: int, lay: _Layout) -> Optional[_RowKeys]:
    if lists is None or row >= len(lists.max_per_row) or lists.max_per_row[row] == 0:
        return None
    n = lists.max_per_row[row]
    blocks = lists.indices[:, :, row, :n][lay.mask_batch, lay.mask_head].long()  # [Bg, Hkv, Gg, n]
    count = lists.num[:, :, row][lay.mask_batch, lay.mask_head]  # [Bg, Hkv, Gg]
    listed = torch.arange(n, device=blocks.device) < count.unsqueeze(-1)
    # A block larger than the whole sequence (torch's "empty" mask uses 2**30) only needs S positions.
    width = min(lay.kv_block, lay.S)
    tokens = blocks.unsqueeze(-1) * lay.kv_block + torch.arange(width, device=blocks.device)
    valid = listed.unsqueeze(-1) & (tokens < lay.S)
    tokens = torch.where(valid, tokens, torch.zeros_like(tokens)).flatten(-2)
    valid = valid.flatten(-2)
    return _RowKeys(tokens=tokens, valid=valid, all_valid=bool(valid.all()))


def _chunks(keys: _RowKeys, rows_in_tile: int, lay: _Layout):
    """Pieces of a row's keys, each small enough that its score tile has at most TILE_ELEMENTS scores."""
    T = keys.tokens.shape[-1]
    width = max(1, TILE_ELEMENTS // (lay.B * lay.Hq * rows_in_tile))
    for start in range(0, T, width):
        stop = min(T, start + width)
        yield keys.tokens[..., start:stop], keys.valid[..., start:stop]


def _query_tiles(lay: _Layout):
    """(start, stop, partial keys, full keys) of each query tile, one BlockMask row after another."""
    step = min(lay.q_block, Q_TILE_MAX)
    for row_start in range(0, lay.L, lay.q_block):
        row = row_start // lay.q_block
        partial_keys, full_keys = _row_keys(lay.partial, row, lay), _row_keys(lay.full, row, lay)
        row_stop = min(lay.L, row_start + lay.q_block)
        for start in range(row_start, row_stop, step):
            yield start, min(row_stop, start + step), partial_keys, full_keys


# --------------------------------------------------------------------------------------------
# Tile arithmetic. Query-side tiles are [B, Hkv, G, Mq, D]; gathered K/V tiles are [Bg, Hkv, Gg, T, D].
# When Gg == 1 the G query heads of a group are folded into the rows, so a matmul sees each
# gathered K/V tile once instead of G broadcast copies.
# --------------------------------------------------------------------------------------------


def _q_rows(x: torch.Tensor, start: int, stop: int, lay: _Layout) -> torch.Tensor:
    """Rows [start, stop) of a [B, Hq, L, D] tensor as a working-precision [B, Hkv, G, Mq, D] tile."""
    rows = x[:, :, start:stop].to(lay.dtype)
    return rows.reshape(lay.B, lay.Hkv, lay.G, stop - start, x.shape[-1])


def _gather(x: torch.Tensor, tokens: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """Keys (or values) at ``tokens`` [Bg, Hkv, Gg, T] from x [Bkv, Hkv, S, D]: [Bg, Hkv, Gg, T, D]."""
    return x[lay.kv_batch, lay.kv_head, tokens].to(lay.dtype)


def _fold(x: torch.Tensor, lay: _Layout) -> torch.Tensor:
    if lay.Gg == lay.G:
        return x
    B, Hkv, G, M, D = x.shape
    return x.reshape(B, Hkv, 1, G * M, D)


def _times_kv_t(x: torch.Tensor, kv: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """x [B, Hkv, G, Mq, D] @ kv^T with kv [Bg, Hkv, Gg, T, D]: [B, Hkv, G, Mq, T]."""
    out = torch.matmul(_fold(x, lay), kv.transpose(-1, -2))
    return out.view(x.shape[:-1] + (kv.shape[-2],))


def _times_kv(p: torch.Tensor, kv: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """p [B, Hkv, G, Mq, T] @ kv [Bg, Hkv, Gg, T, D]: [B, Hkv, G, Mq, D]."""
    out = torch.matmul(_fold(p, lay), kv)
    return out.view(p.shape[:-1] + (kv.shape[-1],))


def _t_times(p: torch.Tensor, x: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """p^T @ x for p [B, Hkv, G, Mq, T], x [B, Hkv, G, Mq, D], summed to a gathered [Bg, Hkv, Gg, T, D]."""
    out = torch.matmul(_fold(p, lay).transpose(-1, -2), _fold(x, lay))
    if lay.Bg != lay.B:
        out = out.sum(dim=0, keepdim=True)
    return out


# --------------------------------------------------------------------------------------------
# Mods over a tile
# --------------------------------------------------------------------------------------------


def _vmap_over_tile(fn: Callable, tile_args: Sequence[torch.Tensor], captured: Sequence[torch.Tensor]) -> torch.Tensor:
    """Apply a per-element ``fn(*tile_args, *captured)`` to broadcastable tile tensors.

    ``tile_args`` all have the same number of dims and broadcast against each other. One vmap is
    nested per dimension of the broadcast shape that is longer than 1; an argument is mapped on a
    dimension only where it is not of size 1, so it is never expanded to the whole tile (an index
    like ``h`` stays small and ``slopes[h]`` is one gather per head). Captured tensors are unmapped.
    """
    shape = torch.broadcast_shapes(*(a.shape for a in tile_args))
    levels = [d for d, size in enumerate(shape) if size != 1]
    squeezed = [a.reshape([a.shape[d] for d in levels if a.shape[d] != 1]) for a in tile_args]
    for d in reversed(levels):  # the innermost vmap maps the last dimension
        in_dims = tuple(0 if a.shape[d] != 1 else None for a in tile_args) + (None,) * len(captured)
        fn = torch.vmap(fn, in_dims=in_dims)
    if any(a.dim() == 0 for a in squeezed):
        # An argument mapped at no level would reach the mod as a plain 0-d tensor, and torch's
        # vmap then promotes it like a 0-d tensor against a batched one: `q_idx <= t8[h]` in a
        # one-row tile compared in int8 (row 128 became -128). One extra level of size 1 that maps
        # every argument keeps each one a batched value, promoted as torch promotes per element.
        squeezed = [a.unsqueeze(0) for a in squeezed]
        fn = torch.vmap(fn, in_dims=(0,) * len(tile_args) + (None,) * len(captured))
    with GathersReadZero():
        out = fn(*squeezed, *captured)
    return out.reshape(shape)


def _index_args(lay: _Layout, start: int, stop: int, tokens: torch.Tensor) -> tuple:
    """b, h, q_idx, kv_idx of a [B, Hkv, G, Mq, T] tile, each broadcastable to it (lay.index_dtype)."""
    q_idx = torch.arange(start, stop, dtype=lay.index_dtype, device=tokens.device).view(1, 1, 1, -1, 1)
    kv_idx = tokens.to(lay.index_dtype).unsqueeze(-2)
    return lay.b_arg, lay.h_arg, q_idx, kv_idx


def _keep(mask_mod, mask_captured, index_args, valid, all_valid) -> Optional[torch.Tensor]:
    """Where a tile's scores are kept (mask_mod, list padding and positions >= S); None for all."""
    keep = None if all_valid else valid.unsqueeze(-2)
    if mask_mod is not None:
        allowed = _vmap_over_tile(mask_mod, index_args, mask_captured)
        keep = allowed if keep is None else keep & allowed
    return keep


def _scores(raw, score_mod, score_captured, index_args, dtype) -> torch.Tensor:
    if score_mod is None:
        return raw
    s = _vmap_over_tile(score_mod, (raw,) + tuple(index_args), score_captured).to(dtype)
    # The forward updates scores in place, so a broadcast result (from a mod that ignores its
    # inputs: vmap expands unbatched outputs) is copied first.
    return s if s.is_contiguous() else s.contiguous()


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


# [Note] Selective activation checkpointing
# torch.utils.checkpoint's selective mode (torchtitan's default activation checkpointing) records
# the outputs of the ops its policy saves (matmuls, typically) during the forward, and when the
# backward recomputes the forward it hands each such op its recorded output instead of running it.
# So the forward must never change a matmul's output in place: the recomputation would be handed
# the changed tensor. torch checks for that through version counters, but matmul of batched inputs
# returns an _unsafe_view of its bmm, which has a version counter of its own: the change went unseen
# and the gradients were silently wrong. Every in-place update below acts on a tensor the forward
# made itself (the scaled scores, the running accumulators).


def blockwise_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask,
    scale: Optional[float],
    mods: BlockwiseMods,
    *,
    need_max: bool = False,
    index_dtype: torch.dtype = INDEX_DTYPE,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Attention output [B, Hq, L, Ev] (q's dtype), lse [B, Hq, L] and, with ``need_max``, max_scores.

    lse and max_scores are natural-log float32 (float64 for float64 q); both are -inf on fully masked
    rows, where the output is 0. ``block_mask`` None means dense attention; otherwise only the blocks
    it lists are visited and ``mask_mod`` is applied on its partial blocks only. ``index_dtype``:
    the dtype of the mods' index arguments (int64 where their arithmetic would leave int32).
    """
    lay = _make_layout(q, k, v, block_mask, scale, index_dtype)
    B, Hq, L = lay.B, lay.Hq, lay.L
    out = torch.empty(B, Hq, L, lay.Ev, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, L, dtype=lay.dtype, device=q.device)
    max_scores = torch.empty(B, Hq, L, dtype=lay.dtype, device=q.device) if need_max else None
    score_mod, mask_mod = mods.score_mod, mods.mask_mod
    score_captured, mask_captured = list(mods.score_captured), list(mods.mask_captured)

    with torch.no_grad():
        for start, stop, partial_keys, full_keys in _query_tiles(lay):
            q_tile = _q_rows(q, start, stop, lay)
            Mq = stop - start
            m_i = torch.full((B, lay.Hkv, lay.G, Mq), -math.inf, dtype=lay.dtype, device=q.device)
            l_i = torch.zeros_like(m_i)
            acc = torch.zeros(B, lay.Hkv, lay.G, Mq, lay.Ev, dtype=lay.dtype, device=q.device)

            for keys, is_partial in ((partial_keys, True), (full_keys, False)):
                if keys is None:
                    continue
                for tokens, valid in _chunks(keys, Mq, lay):
                    # -- compute qk ----
                    k_tile = _gather(k, tokens, lay)
                    # Out of place: see [Note] Selective activation checkpointing.
                    raw = _times_kv_t(q_tile, k_tile, lay) * lay.scale
                    index_args = _index_args(lay, start, stop, tokens)
                    s = _scores(raw, score_mod, score_captured, index_args, lay.dtype)
                    keep = _keep(mask_mod if is_partial else None, mask_captured, index_args, valid, keys.all_valid)
                    if keep is not None:
                        s.masked_fill_(~keep, -math.inf)
                    # -- update m_i, l_i and acc ----
                    m_new = torch.maximum(m_i, s.amax(dim=-1))
                    m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)  # see Note below
                    alpha = torch.exp(m_i - m_safe)
                    p = s.sub_(m_safe.unsqueeze(-1)).exp_()
                    l_i = l_i * alpha + p.sum(dim=-1)
                    acc = acc.mul_(alpha.unsqueeze(-1)).add_(_times_kv(p, _gather(v, tokens, lay), lay))
                    m_i = m_new
                    del s, p, raw, keep

            # [Note] Fully masked rows: m_i stays -inf, so it is replaced by 0 before any subtraction
            # (exp(-inf - 0) = 0 rather than NaN), l_i stays 0, and the row ends as out 0, lse -inf.
            empty = l_i == 0
            l_safe = torch.where(empty, torch.ones_like(l_i), l_i)
            row_out = acc / l_safe.unsqueeze(-1)
            row_lse = torch.where(empty, torch.full_like(l_i, -math.inf), m_i + torch.log(l_safe))
            # A +inf score: exp(inf - inf) left l_i NaN, and torch's LSE is +inf (its output NaN, as
            # here). A NaN score made m_i NaN (amax and maximum propagate it), so the LSE stays NaN.
            row_lse = torch.where(torch.isposinf(m_i), m_i, row_lse)
            out[:, :, start:stop] = row_out.reshape(B, Hq, Mq, lay.Ev).to(q.dtype)
            lse[:, :, start:stop] = row_lse.reshape(B, Hq, Mq)
            if need_max:
                max_scores[:, :, start:stop] = m_i.reshape(B, Hq, Mq)
    return out, lse, max_scores


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------


def blockwise_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_lse: Optional[torch.Tensor],
    block_mask,
    scale: Optional[float],
    mods: BlockwiseMods,
    *,
    index_dtype: torch.dtype = INDEX_DTYPE,
    float32_kv_grads: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Optional[torch.Tensor]]]:
    """Gradients ``(dq, dk, dv, grads of score_captured)`` of the attention computed by blockwise_forward.
    ``float32_kv_grads``: dk and dv stay in the working precision (float32, float64 for float64).

    ``out`` and ``lse`` are blockwise_forward's outputs; ``grad_lse`` may be None. dk and dv have the
    shapes of k and v (summed over GQA groups and a broadcast K/V batch). The list has one entry per
    captured tensor of the score_mod: its gradient if it requires grad, else None. ``index_dtype`` as
    in blockwise_forward.
    """
    lay = _make_layout(q, k, v, block_mask, scale, index_dtype)
    B, Hq, Hkv, G = lay.B, lay.Hq, lay.Hkv, lay.G
    dtype = lay.dtype
    score_mod, score_captured, mask_mod = mods.score_mod, mods.score_captured, mods.mask_mod
    mask_captured = list(mods.mask_captured)
    # Captured tensors that require grad are replaced by detached leaves: the local autograd.grad
    # calls then stop at them and never walk into the graph that produced them.
    trainable = [i for i, c in enumerate(score_captured) if isinstance(c, torch.Tensor) and c.requires_grad]
    captured_leaves = [c.detach().requires_grad_() if i in trainable else c for i, c in enumerate(score_captured)]
    captured_grads = [
        torch.zeros(c.shape, dtype=dtype, device=c.device) if i in trainable else None
        for i, c in enumerate(score_captured)
    ]

    with torch.no_grad():
        # delta = rowsum(dO * O) - dlse: d lse / d s = p, so the lse gradient enters as dS += p * dlse.
        delta = (grad_out.to(dtype) * out.to(dtype)).sum(dim=-1)
        if grad_lse is not None:
            delta = delta - grad_lse.to(dtype)
        # Fully masked rows have lse -inf; any finite value gives p = exp(-inf - value) = 0 there.
        lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).to(dtype)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
        dv = torch.zeros(v.shape, dtype=dtype, device=v.device)

        for start, stop, partial_keys, full_keys in _query_tiles(lay):
            Mq = stop - start
            q_tile = _q_rows(q, start, stop, lay)
            do_tile = _q_rows(grad_out, start, stop, lay)
            lse_tile = lse_safe[:, :, start:stop].reshape(B, Hkv, G, Mq, 1)
            delta_tile = delta[:, :, start:stop].reshape(B, Hkv, G, Mq, 1)
            dq_tile = torch.zeros_like(q_tile)

            for keys, is_partial in ((partial_keys, True), (full_keys, False)):
                if keys is None:
                    continue
                for tokens, valid in _chunks(keys, Mq, lay):
                    k_tile = _gather(k, tokens, lay)
                    v_tile = _gather(v, tokens, lay)
                    index_args = _index_args(lay, start, stop, tokens)
                    # -- recompute scores (score_mod under autograd, to push dS back through it) ----
                    raw = _times_kv_t(q_tile, k_tile, lay).mul_(lay.scale)
                    if score_mod is not None:
                        with torch.enable_grad():
                            raw.requires_grad_()
                            s = _scores(raw, score_mod, captured_leaves, index_args, dtype)
                    else:
                        s = raw
                    keep = _keep(mask_mod if is_partial else None, mask_captured, index_args, valid, keys.all_valid)
                    # -- p from the saved lse ----
                    p = s.detach().sub(lse_tile)
                    if keep is not None:
                        p = p.masked_fill_(~keep, -math.inf)
                    p = p.exp_()
                    # -- dV += p^T dO; dS = p * (dO V^T - delta) ----
                    dv_tile = _t_times(p, do_tile, lay)
                    ds = _times_kv_t(do_tile, v_tile, lay).sub_(delta_tile).mul_(p)
                    del p
                    # -- dS back through score_mod ----
                    if score_mod is not None:
                        wanted = [raw] + [captured_leaves[i] for i in trainable]
                        draw, *captured_tile_grads = torch.autograd.grad(s, wanted, grad_outputs=ds, allow_unused=True)
                        if draw is None:  # the score_mod ignores the score
                            draw = torch.zeros_like(ds)
                        if keep is not None:  # a mod's derivative may be inf/NaN where it was masked
                            draw = draw.masked_fill(~keep, 0.0)
                        for i, g in zip(trainable, captured_tile_grads):
                            if g is not None:
                                captured_grads[i] += g.to(dtype)
                        del s, raw
                    else:
                        draw = ds
                    # -- dS back through scale * q @ k^T ----
                    dq_tile += _times_kv(draw, k_tile, lay).mul_(lay.scale)
                    dk_tile = _t_times(draw, q_tile, lay).mul_(lay.scale)
                    dk.index_put_((lay.kv_batch, lay.kv_head, tokens), dk_tile, accumulate=True)
                    dv.index_put_((lay.kv_batch, lay.kv_head, tokens), dv_tile, accumulate=True)
                    del ds, draw, keep

            dq[:, :, start:stop] = dq_tile.reshape(B, Hq, Mq, lay.E)

    captured_out = [
        g.to(c.dtype) if g is not None else None for g, c in zip(captured_grads, score_captured)
    ]
    kv_grad_dtype = _working_dtype(k.dtype) if float32_kv_grads else k.dtype
    return dq.to(q.dtype), dk.to(kv_grad_dtype), dv.to(kv_grad_dtype), captured_out
