"""Building masks: ``create_block_mask`` evaluates a mask_mod tile by tile with ``torch.vmap``,
``create_mask`` gives the dense mask for debugging, and ``dense_block_mask`` is the mask of a call
that passes none.
"""

from __future__ import annotations

import inspect
import itertools
from collections import OrderedDict
from typing import Callable, Optional, Union

import torch

from ..cuda_graphs import may_keep_allocations, stream_key
from ..errors import FlexAttentionError, InvalidInputError, ModTraceError, describe_mod, raised_as_is_under_dynamo
from ..lowering.ranges import mod_index_dtype
from ..mods import MaskMod, check_mask_mod, mod_name
from ..trace import GathersReadZero, trace_mod
from .block_mask import EVERY_BLOCK_FULL, TABLES_IN_RANGE, BlockMask
from .layout import DEFAULT_BLOCK_SIZE, INDEX_DTYPE, BlockSize, as_block_size, cdiv, device_argument, positive_int

__all__ = ["create_block_mask", "create_mask", "dense_block_mask", "TILE_ELEMENTS"]

# How many (b, h, q, kv) pairs create_block_mask evaluates at once. A tile of 2**24 pairs is a
# 16 MiB bool tensor plus whatever the mask_mod allocates (a few int32/int64 temporaries of the
# same shape): large enough that per-tile Python and vmap overhead is small, small enough that
# peak memory stays in the hundreds of MiB whatever the sequence length.
TILE_ELEMENTS = 1 << 24


# --------------------------------------------------------------------------------------------
# Evaluating a mask_mod: tile by tile
# --------------------------------------------------------------------------------------------


# in_dims of the four vmaps over (b, h, q_idx, kv_idx), innermost first.
_BHQKV_IN_DIMS = [(None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)]


def _vmap_over_bhqkv(fn: Callable) -> Callable:
    """``fn(b, h, q_idx, kv_idx)`` on 0-d tensors -> a function of 1-D index tensors -> [b, h, q, kv].

    Innermost vmap maps kv_idx, then q_idx, h, b; a mod that ignores an index gets a broadcast
    (stride-0) result along it.
    """
    for in_dims in _BHQKV_IN_DIMS:
        fn = torch.vmap(fn, in_dims=in_dims, out_dims=0)
    return fn


def _tile_plan(B: int, H: int, rows: int, cols: int, block_area: int) -> tuple[int, int, int, int]:
    """How many (batches, heads, block rows, block cols) one tile spans, about TILE_ELEMENTS pairs.

    Tiles grow along kv first, then q, then heads, then batches. A tile is never smaller than one
    block, even when one block is larger than TILE_ELEMENTS.
    """
    budget = max(1, TILE_ELEMENTS // block_area)  # tiles of blocks
    cols_step = min(cols, budget)
    rows_step = min(rows, max(1, budget // cols_step))
    heads_step = min(H, max(1, budget // (cols_step * rows_step)))
    batch_step = min(B, max(1, budget // (cols_step * rows_step * heads_step)))
    return batch_step, heads_step, rows_step, cols_step


def _rows_per_group(q_block: int) -> int:
    """The largest divisor of q_block that is at most 255 (see _reduce_tile)."""
    return max(g for g in range(1, min(q_block, 255) + 1) if q_block % g == 0)


def _lanes_equal_to(count: int) -> int:
    """The int64 whose eight bytes all hold ``count`` (< 256), as a signed value."""
    word = int.from_bytes(bytes([count]) * 8, "little")
    return word - (1 << 64) if word >= 1 << 63 else word


def _reduce_tile(
    kept: torch.Tensor, rows: int, q_block: int, cols: int, kv_block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded bool tile ``[nb, nh, rows*q_block, cols*kv_block]`` -> (any kept, all kept) per block.

    Fast path (kv_block a multiple of 8): read each run of 8 bools as one int64 word of eight 0/1
    bytes ("lanes") and add the words of ``g <= 255`` consecutive query rows. No lane can exceed
    255, so no carry crosses lanes and each byte of the sum counts the kept pairs of one key
    column. A block keeps something iff some summed word is non-zero, and keeps everything iff
    every summed word has all lanes equal to g. An int64 sum over rows is one cheap vectorized
    pass, much faster than bool any/all over two strided dims. Bool storage holds only 0 and 1.
    """
    nb, nh = kept.shape[:2]
    if kv_block % 8 == 0:
        if kept.storage_offset() % 8 or not kept.is_contiguous():
            kept = kept.clone(memory_format=torch.contiguous_format)  # the int64 view needs aligned, dense storage
        group = _rows_per_group(q_block)
        words_per_row = cols * kv_block // 8
        words = kept.view(torch.uint8).view(torch.int64).view(-1, group, words_per_row)
        lane_counts = words.sum(dim=1)  # wraps into the sign bit at 128 per lane: the bits stay exact
        lane_counts = lane_counts.view(nb, nh, rows, q_block // group, cols, kv_block // 8)
        any_kept = (lane_counts != 0).any(dim=5).any(dim=3)
        all_kept = (lane_counts == _lanes_equal_to(group)).all(dim=5).all(dim=3)
        return any_kept, all_kept
    blocks = kept.reshape(nb, nh, rows, q_block, cols, kv_block)
    return blocks.any(dim=5).any(dim=3), blocks.all(dim=5).all(dim=3)


# [Note] A mod's mistakes under vmap
# create_block_mask and create_mask evaluate a mod with torch.vmap, whose errors for the common
# mistakes name neither the mod nor the line, and some ask the user to report a bug to PyTorch:
# "data-dependent control flow" for an if/and/or on a tensor, "calling .item()" for .item() and
# int(), "must only return Tensors" for a Python bool. flex_attention traces the same mod, and the
# trace tells these mistakes apart (trace.py: the mod, the line, the fix). So when vmap fails, the
# error is what tracing the mod finds wrong, if anything: the same message whichever function took
# the mod. Only on that path: a mod that vmap runs is not traced again. (A result of the wrong dtype
# or shape, which vmap returns, gets _check_tile's message.)


def _trace_mistake(mod: Callable, kind: str) -> Optional[Exception]:
    """What tracing ``mod`` finds wrong with it (flexattn's error, not raised), or None."""
    try:
        trace_mod(mod, kind)
    except (ModTraceError, InvalidInputError) as mistake:
        return mistake
    return None


def _check_tile(kept, mask_mod, expected_shape) -> None:
    if not isinstance(kept, torch.Tensor) or kept.dtype != torch.bool:
        got = kept.dtype if isinstance(kept, torch.Tensor) else type(kept).__name__
        raise InvalidInputError(
            f"{describe_mod(mask_mod, 'mask_mod')} must return a bool tensor (True = attend), got {got}; "
            "compare instead, e.g. `q_idx >= kv_idx`, or use `.bool()` on a 0/1 result"
        )
    if tuple(kept.shape) != expected_shape:
        raise InvalidInputError(
            f"{describe_mod(mask_mod, 'mask_mod')} must return one bool per (b, h, q_idx, kv_idx), i.e. a 0-d "
            f"tensor per call; under vmap it gave shape {tuple(kept.shape)} instead of {expected_shape}"
        )


def _evaluate(vmapped: Callable, mod: Callable, kind: str, *args: torch.Tensor) -> torch.Tensor:
    """``vmapped(*args)``; a failure is explained as [Note] A mod's mistakes under vmap says."""
    try:
        return vmapped(*args)
    except FlexAttentionError:
        raise  # flexattn's own explanation already (and_masks' check of each mod's result)
    except Exception as err:
        failure = err
    # Traced outside the handler, so that the trace's error does not carry vmap's (and its advice
    # of a bug report to PyTorch) as its context: the user sees what flex_attention shows.
    mistake = _trace_mistake(mod, kind)
    if mistake is not None:
        raise mistake
    failure.add_note(
        f"(while flexattn evaluated {kind} '{mod_name(mod)}' with torch.vmap over b, h, q_idx, "
        "kv_idx. Each argument is a 0-d integer tensor: use tensor ops only, torch.where instead of "
        "if/else on tensors, & and | instead of and/or, and no .item().)"
    )
    raise failure


def _block_maps(
    mask_mod: Callable, B: int, H: int, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device,
    index_dtype: torch.dtype = INDEX_DTYPE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool ``[B, H, ROWS, COLS]`` maps: does a tile keep any pair, does it keep all of them.

    Positions past q_len / kv_len are masked (the tile is padded with False), so a tile that
    sticks out past the end is never "all kept". The mask_mod is never called on such positions,
    so it may index tensors of length q_len / kv_len with q_idx / kv_idx.
    """
    rows, cols = cdiv(q_len, q_block), cdiv(kv_len, kv_block)
    any_kept = torch.zeros(B, H, rows, cols, dtype=torch.bool, device=device)
    all_kept = torch.zeros(B, H, rows, cols, dtype=torch.bool, device=device)
    b_range = torch.arange(B, dtype=index_dtype, device=device)
    h_range = torch.arange(H, dtype=index_dtype, device=device)
    q_range = torch.arange(q_len, dtype=index_dtype, device=device)
    kv_range = torch.arange(kv_len, dtype=index_dtype, device=device)
    vmapped = _vmap_over_bhqkv(mask_mod)
    b_step, h_step, r_step, c_step = _tile_plan(B, H, rows, cols, q_block * kv_block)

    with torch.no_grad(), GathersReadZero():  # tensor[idx] in the mod must stay a gather under vmap
        for b0, h0, r0, c0 in itertools.product(
            range(0, B, b_step), range(0, H, h_step), range(0, rows, r_step), range(0, cols, c_step)
        ):
            b1, h1, r1, c1 = min(b0 + b_step, B), min(h0 + h_step, H), min(r0 + r_step, rows), min(c0 + c_step, cols)
            q0, q1 = r0 * q_block, min(r1 * q_block, q_len)
            k0, k1 = c0 * kv_block, min(c1 * kv_block, kv_len)
            kept = _evaluate(vmapped, mask_mod, "mask_mod",
                             b_range[b0:b1], h_range[h0:h1], q_range[q0:q1], kv_range[k0:k1])
            _check_tile(kept, mask_mod, (b1 - b0, h1 - h0, q1 - q0, k1 - k0))
            pad_q, pad_kv = (r1 - r0) * q_block - (q1 - q0), (c1 - c0) * kv_block - (k1 - k0)
            if pad_q or pad_kv:
                kept = torch.nn.functional.pad(kept, (0, pad_kv, 0, pad_q), value=False)
            tile_any, tile_all = _reduce_tile(kept, r1 - r0, q_block, c1 - c0, kv_block)
            any_kept[b0:b1, h0:h1, r0:r1, c0:c1] = tile_any
            all_kept[b0:b1, h0:h1, r0:r1, c0:c1] = tile_all
    return any_kept, all_kept


def _refuse_inside_compile(name: str) -> None:
    """Under torch.compile. The builder evaluates the mask_mod tile by tile in a Python loop: not
    something to trace. Dynamo runs this function as plain Python (marked below), so the error reaches
    the user as its first line, with or without fullgraph (raised in the traced body, it was buried in
    Dynamo's "Observed exception" text, and without fullgraph the mask was built at a silent graph break)."""
    raise raised_as_is_under_dynamo(InvalidInputError(
        f"create_block_mask({name}, ...) was called inside a torch.compile'd function; build the BlockMask "
        "outside the compiled function (once per step, or once for every step with these lengths) and pass it "
        "in: the compiled graph takes a new mask of the same shapes without recompiling. (To build it there "
        "anyway, at a graph break, call torch.compiler.disable(create_block_mask)(...).)"
    ))


# What torch.compiler.assume_constant_result sets, as api._registered_call does (the decorator imports
# Dynamo at import time).
_refuse_inside_compile._dynamo_marked_constant = True


def create_block_mask(
    mask_mod: MaskMod,
    B: Optional[int],
    H: Optional[int],
    Q_LEN: int,
    KV_LEN: int,
    device: Union[str, torch.device, None] = None,
    BLOCK_SIZE: BlockSize = DEFAULT_BLOCK_SIZE,
    _compile: bool = False,
    separate_full_blocks: bool = True,
) -> BlockMask:
    """Build the BlockMask of ``mask_mod`` for a ``B x H x Q_LEN x KV_LEN`` attention.

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``, True where the query may attend
            to the key. It is called on 0-d integer tensors (vmapped), so it must use tensor ops
            only. They are int32, or int64 where the mod's arithmetic would leave int32 at these
            lengths (``q_idx * KV_LEN + kv_idx`` at 128k tokens): integer arithmetic on the indices
            is exact, like Python integers.
        B, H: batch size and number of query heads; None means 1 (the mask broadcasts over that dim,
            and the mask_mod is evaluated with index 0 only).
        Q_LEN, KV_LEN: sequence lengths.
        device: where the mask is evaluated and stored; default "cuda" if available, else "cpu".
        BLOCK_SIZE: tile size, an int or ``(Q_BLOCK, KV_BLOCK)``. The kernels' own block sizes must
            divide it.
        _compile: accepted for compatibility with torch's positional order and ignored: the eager
            builder already works tile by tile, in bounded memory.
        separate_full_blocks: put tiles where every pair is kept in ``full_kv_*`` so kernels skip the
            mask_mod there. False stores every visited tile as partial.

    The mask_mod is evaluated over tiles of about 16M (b, h, q, kv) pairs, each a whole number of
    blocks, and reduced to per-tile "any kept" / "all kept" before the next tile: the dense mask is
    never materialized. Positions past Q_LEN / KV_LEN count as masked, so the tiles at the end are
    never full when a length is not a multiple of the block size.

    Build it once and reuse it for every layer and step with the same lengths::

        block_mask = create_block_mask(causal, None, None, 4096, 4096, device="cuda")
        for layer in layers:
            x = layer(x, block_mask=block_mask)
    """
    del _compile  # nothing to compile: see the docstring
    if torch.compiler.is_compiling():
        _refuse_inside_compile(mod_name(mask_mod))
    check_mask_mod(mask_mod)
    B = 1 if B is None else positive_int("B", B)
    H = 1 if H is None else positive_int("H", H)
    Q_LEN = positive_int("Q_LEN", Q_LEN)
    KV_LEN = positive_int("KV_LEN", KV_LEN)
    q_block, kv_block = as_block_size(BLOCK_SIZE)
    device = device_argument(device, "create_block_mask")

    index_dtype = mod_index_dtype(mask_mod, "mask_mod", B, H, Q_LEN, KV_LEN)
    any_kept, all_kept = _block_maps(mask_mod, B, H, Q_LEN, KV_LEN, q_block, kv_block, device, index_dtype)
    if separate_full_blocks:
        partial_map, full_map = any_kept & ~all_kept, all_kept
    else:
        partial_map, full_map = any_kept, None
    return BlockMask._from_block_maps(partial_map, full_map, (q_block, kv_block), mask_mod, (Q_LEN, KV_LEN))


def _required_positional_count(fn: Callable) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as err:
        raise InvalidInputError(f"create_mask: cannot read the signature of {mod_name(fn)}") from err
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)


def create_mask(
    mod_fn: Callable,
    B: Optional[int],
    H: Optional[int],
    Q_LEN: int,
    KV_LEN: int,
    device: Union[str, torch.device, None] = None,
) -> torch.Tensor:
    """The dense bool mask ``[B, H, Q_LEN, KV_LEN]`` of a mask_mod or score_mod, for debugging.

    A function with 4 required positional arguments is a mask_mod (True = attend); one with 5 is a
    score_mod, and a pair is kept where ``score_mod(0.0, b, h, q_idx, kv_idx)`` is not -inf. (Only
    this helper tells the kinds apart by arity, as torch's does; everything else takes the kind
    from the argument name.) Memory is ``B * H * Q_LEN * KV_LEN`` bytes: use
    :func:`create_block_mask` for real sequence lengths.
    """
    if not callable(mod_fn):
        raise TypeError(f"create_mask: mod_fn must be a mask_mod or score_mod callable, got {type(mod_fn).__name__}")
    B = 1 if B is None else positive_int("B", B)
    H = 1 if H is None else positive_int("H", H)
    Q_LEN = positive_int("Q_LEN", Q_LEN)
    KV_LEN = positive_int("KV_LEN", KV_LEN)
    device = device_argument(device, "create_mask")
    arity = _required_positional_count(mod_fn)
    kind = "score_mod" if arity == 5 else "mask_mod"
    index_dtype = mod_index_dtype(mod_fn, kind, B, H, Q_LEN, KV_LEN) if arity in (4, 5) else INDEX_DTYPE
    indices = [torch.arange(n, dtype=index_dtype, device=device) for n in (B, H, Q_LEN, KV_LEN)]
    with torch.no_grad(), GathersReadZero():
        if arity == 4:
            kept = _evaluate(_vmap_over_bhqkv(mod_fn), mod_fn, "mask_mod", *indices)
            _check_tile(kept, mod_fn, (B, H, Q_LEN, KV_LEN))
            return kept.contiguous()
        if arity == 5:
            # The score tensor is mapped at every level (its leading dim is the index being mapped).
            with_score = mod_fn
            for index_dims in _BHQKV_IN_DIMS:
                with_score = torch.vmap(with_score, in_dims=(0,) + index_dims, out_dims=0)
            scores = torch.zeros(B, H, Q_LEN, KV_LEN, dtype=torch.float32, device=device)
            return ~torch.isneginf(_evaluate(with_score, mod_fn, "score_mod", scores, *indices))
    raise InvalidInputError(
        f"create_mask: {describe_mod(mod_fn, 'mod_fn')} takes {arity} required positional arguments; a mask_mod "
        "takes 4 (b, h, q_idx, kv_idx) and a score_mod 5 (score, b, h, q_idx, kv_idx)"
    )


# The mask of a call that passes none, keyed by content (lengths, device) and bounded: see [Note]
# Cache keys in flexattn/kernels/family.py.
_dense_masks: "OrderedDict[tuple, BlockMask]" = OrderedDict()
_DENSE_MASKS_KEPT = 64  # lengths that keep changing (decoding) must not pile up masks


def dense_block_mask(L: int, S: int, device: torch.device) -> BlockMask:
    """The mask used when none is given: every block full, so mask_mod never runs.

    Built from fills on the device and marked valid by construction (no checks, so no host sync),
    and kept per stream (flexattn/cuda_graphs.py). A call inside a CUDA-graph capture builds its own
    in the graph's pool: a kept mask may be evicted while the graph still points at it, and a
    capture may not read tables back to the host."""
    device = torch.device(device)
    in_capture = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    key = (L, S, device, stream_key(device))
    mask = None if in_capture else _dense_masks.get(key)
    if mask is None:
        block = DEFAULT_BLOCK_SIZE
        rows, cols = cdiv(L, block), cdiv(S, block)

        def every_block(lines: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            # (partial counts, partial indices, full counts, full indices) of `lines` rows that each
            # list all `width` blocks as full; the partial tables are zeros of the same width.
            full_num = torch.full((1, 1, lines), width, dtype=INDEX_DTYPE, device=device)
            full_idx = torch.arange(width, dtype=INDEX_DTYPE, device=device).expand(1, 1, lines, width).contiguous()
            zeros = torch.zeros((1, 1, lines), dtype=INDEX_DTYPE, device=device)
            return zeros, torch.zeros((1, 1, lines, width), dtype=INDEX_DTYPE, device=device), full_num, full_idx

        kv_num, kv_idx, full_kv_num, full_kv_idx = every_block(rows, cols)
        q_num, q_idx, full_q_num, full_q_idx = every_block(cols, rows)
        mask = BlockMask((L, S), kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx,
                         BLOCK_SIZE=(block, block))
        mask.preset_derived(TABLES_IN_RANGE, True)
        mask.preset_derived(EVERY_BLOCK_FULL, True)
        if not may_keep_allocations(device):  # a CUDA graph's pool: made for this call only
            return mask
        _dense_masks[key] = mask
        if len(_dense_masks) > _DENSE_MASKS_KEPT:
            _dense_masks.popitem(last=False)
    return mask
