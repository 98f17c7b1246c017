"""BlockMask and create_block_mask: same tables as torch's, bounded memory, honest sparsity.

torch's eager ``create_block_mask`` (which builds the dense mask) is the oracle for the tables.
Mask parameters (window sizes, document lengths, per-head and per-batch limits, random tile
patterns) are drawn fresh for every run from the per-test seed of conftest.py.
"""

import doctest
import json
import os
import subprocess
import sys
import textwrap
import traceback

import inspect

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

import flexattn.masks.block_mask as block_mask_module
import flexattn.masks.create as create_module
from flexattn import BlockMask, and_masks, create_block_mask, create_mask, or_masks
from flexattn.errors import InvalidInputError, ModTraceError
from flexattn.variants import (
    causal_mask,
    document_ids,
    generate_document_mask,
    generate_prefix_lm,
    generate_sliding_window,
    split_lengths,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = "cpu"


# --------------------------------------------------------------------------------------------
# Mask mods with fresh random parameters
# --------------------------------------------------------------------------------------------


def _randint(low: int, high: int) -> int:
    """A random int in [low, high)."""
    return int(torch.randint(low, high, ()))


def random_tile_pattern(q_len: int, kv_len: int, cell: int = 64) -> torch.Tensor:
    """A bool [q_len, kv_len] table made of cell x cell squares that are all kept, all masked, or sparse.

    Mostly-kept cells make some 64- and 128-blocks full; sparse cells make partial blocks with few
    kept pairs, the case a wrong "any" reduction would miss.
    """
    rows, cols = -(-q_len // cell), -(-kv_len // cell)
    kind = torch.multinomial(torch.tensor([0.3, 0.6, 0.1]), rows * cols, replacement=True).view(rows, cols)
    table = torch.rand(rows * cell, cols * cell) < 0.01  # kind 2: sparse
    table |= (kind == 1).repeat_interleave(cell, 0).repeat_interleave(cell, 1)
    table &= (kind != 0).repeat_interleave(cell, 0).repeat_interleave(cell, 1)
    return table[:q_len, :kv_len].contiguous()


def make_mask(name: str, q_len: int, kv_len: int):
    """(mask_mod, B, H) for one catalogue entry; B or H None means the mask broadcasts."""
    if name == "causal":
        return causal_mask, None, None
    if name == "sliding_window":
        return generate_sliding_window(_randint(1, kv_len)), None, None
    if name == "prefix_lm":
        return generate_prefix_lm(_randint(1, kv_len)), None, None
    if name == "document":
        # Exactly max(q_len, kv_len) ids: a mod called past the end would index out of range.
        total = max(q_len, kv_len)
        doc = document_ids(split_lengths(total, _randint(2, 7), seed=_randint(0, 2**31)))
        return generate_document_mask(doc), None, None
    if name == "per_head":
        windows = torch.randint(1, kv_len, (3,), dtype=torch.int32)

        def per_head_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= windows[h])

        return per_head_window, None, 3
    if name == "per_batch":
        valid_keys = torch.randint(1, kv_len + 1, (2,), dtype=torch.int32)

        def per_batch_padding(b, h, q_idx, kv_idx):
            return kv_idx < valid_keys[b]

        return per_batch_padding, 2, None
    if name == "random_tiles":
        table = random_tile_pattern(q_len, kv_len)

        def random_tiles(b, h, q_idx, kv_idx):
            return table[q_idx, kv_idx]

        return random_tiles, None, None
    raise KeyError(name)


MASK_NAMES = ["causal", "sliding_window", "prefix_lm", "document", "per_head", "per_batch", "random_tiles"]
LENGTHS = [(256, 256), (300, 517), (1000, 1000)]
BLOCK_SIZES = [128, 64, (128, 64)]


# --------------------------------------------------------------------------------------------
# Comparison helpers
# --------------------------------------------------------------------------------------------


def dense_by_loop(num_blocks: torch.Tensor, indices: torch.Tensor, num_cols: int) -> torch.Tensor:
    """The format's definition, written as the plain loop of the module docstring."""
    B, H, rows = num_blocks.shape
    dense = torch.zeros(B, H, rows, num_cols, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            for row in range(rows):
                for j in range(int(num_blocks[b, h, row])):
                    dense[b, h, row, indices[b, h, row, j]] = 1
    return dense


def assert_same_tables(ours_num, ours_idx, torch_num, torch_idx, label: str) -> None:
    """Counts equal, the used prefix of every row equal, padding entries valid block indices."""
    assert ours_num.dtype == torch.int32 and ours_idx.dtype == torch.int32, label
    assert ours_idx.shape == torch_idx.shape, f"{label}: {tuple(ours_idx.shape)} vs {tuple(torch_idx.shape)}"
    assert torch.equal(ours_num, torch_num.to(torch.int32)), f"{label}: num_blocks differ"
    used = torch.arange(ours_idx.shape[-1]) < ours_num.unsqueeze(-1)
    assert torch.equal(ours_idx[used], torch_idx[used].to(torch.int32)), f"{label}: ordered indices differ"
    assert bool(((ours_idx >= 0) & (ours_idx < ours_idx.shape[-1])).all()), f"{label}: padding outside [0, COLS)"


def assert_same_as_torch(ours: BlockMask, theirs) -> None:
    assert ours.seq_lengths == tuple(theirs.seq_lengths)
    assert ours.BLOCK_SIZE == tuple(theirs.BLOCK_SIZE)
    cols = theirs.kv_indices.shape[-1]
    # Partial and full maps separately, through the definition loop (not through to_dense).
    assert torch.equal(
        dense_by_loop(ours.kv_num_blocks, ours.kv_indices, cols),
        dense_by_loop(theirs.kv_num_blocks, theirs.kv_indices, cols),
    ), "partial tiles differ"
    assert_same_tables(ours.kv_num_blocks, ours.kv_indices, theirs.kv_num_blocks, theirs.kv_indices, "kv")
    assert_same_tables(ours.q_num_blocks, ours.q_indices, theirs.q_num_blocks, theirs.q_indices, "q")
    if theirs.full_kv_num_blocks is None:
        assert ours.full_kv_num_blocks is None and ours.full_q_num_blocks is None
        return
    assert torch.equal(
        dense_by_loop(ours.full_kv_num_blocks, ours.full_kv_indices, cols),
        dense_by_loop(theirs.full_kv_num_blocks, theirs.full_kv_indices, cols),
    ), "full tiles differ"
    assert_same_tables(
        ours.full_kv_num_blocks, ours.full_kv_indices, theirs.full_kv_num_blocks, theirs.full_kv_indices, "full_kv"
    )
    assert_same_tables(
        ours.full_q_num_blocks, ours.full_q_indices, theirs.full_q_num_blocks, theirs.full_q_indices, "full_q"
    )


def sparsity_from_pairs(block_map: torch.Tensor, block_size, q_len: int, kv_len: int) -> float:
    """Sparsity at pair resolution: expand each visited tile to its pairs and crop to the lengths."""
    q_block, kv_block = block_size
    pairs = block_map.bool().repeat_interleave(q_block, dim=-2).repeat_interleave(kv_block, dim=-1)
    return 100.0 * (1.0 - pairs[..., :q_len, :kv_len].double().mean().item())


# --------------------------------------------------------------------------------------------
# Same tables as torch
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=str)
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda ls: f"{ls[0]}x{ls[1]}")
@pytest.mark.parametrize("name", MASK_NAMES)
def test_matches_torch(name, lengths, block_size):
    q_len, kv_len = lengths
    mask_mod, B, H = make_mask(name, q_len, kv_len)
    ours = create_block_mask(mask_mod, B, H, q_len, kv_len, device=CPU, BLOCK_SIZE=block_size)
    theirs = torch_flex.create_block_mask(mask_mod, B, H, q_len, kv_len, device=CPU, BLOCK_SIZE=block_size)
    assert_same_as_torch(ours, theirs)
    assert ours.shape == (B or 1, H or 1, q_len, kv_len)
    sparsity = ours.sparsity()
    assert 0.0 <= sparsity <= 100.0
    expected = sparsity_from_pairs(ours.to_dense(), ours.BLOCK_SIZE, q_len, kv_len)
    assert sparsity == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("block_size", [(64, 128), (16, 12), (300, 8)], ids=str)
def test_many_small_tiles_match_torch(monkeypatch, block_size):
    """Force tiles of a few blocks so batch, head, row and column tiling and padding all run.

    (16, 12) takes the bool any/all path (KV_BLOCK not a multiple of 8); (300, 8) sums rows in
    groups of 150 (the int64 lane counts hold at most 255).
    """
    q_len, kv_len = _randint(200, 700), _randint(200, 700)
    q_block, kv_block = block_size
    monkeypatch.setattr(create_module, "TILE_ELEMENTS", 3 * q_block * kv_block)
    windows = torch.randint(1, kv_len, (3,), dtype=torch.int32)
    valid_keys = torch.randint(1, kv_len + 1, (2,), dtype=torch.int32)
    table = random_tile_pattern(q_len, kv_len, cell=16)

    def mixed(b, h, q_idx, kv_idx):
        window = (q_idx >= kv_idx) & (q_idx - kv_idx <= windows[h])
        return (window | table[q_idx, kv_idx]) & (kv_idx < valid_keys[b])

    ours = create_block_mask(mixed, 2, 3, q_len, kv_len, device=CPU, BLOCK_SIZE=block_size)
    theirs = torch_flex.create_block_mask(mixed, 2, 3, q_len, kv_len, device=CPU, BLOCK_SIZE=block_size)
    assert_same_as_torch(ours, theirs)


@pytest.mark.skipif(
    "separate_full_blocks" not in inspect.signature(torch_flex.create_block_mask).parameters,
    reason="this torch's create_block_mask has no separate_full_blocks (added after 2.11)",
)
def test_without_separate_full_blocks_matches_torch():
    mask_mod, B, H = make_mask("sliding_window", 517, 517)
    ours = create_block_mask(mask_mod, B, H, 517, 517, device=CPU, BLOCK_SIZE=64, separate_full_blocks=False)
    theirs = torch_flex.create_block_mask(
        mask_mod, B, H, 517, 517, device=CPU, BLOCK_SIZE=64, separate_full_blocks=False
    )
    assert ours.full_kv_num_blocks is None and ours.full_kv_indices is None
    assert_same_as_torch(ours, theirs)
    with_full = create_block_mask(mask_mod, B, H, 517, 517, device=CPU, BLOCK_SIZE=64)
    assert torch.equal(ours.to_dense(), with_full.to_dense())
    assert ours.sparsity() == pytest.approx(with_full.sparsity())


def test_create_mask_matches_torch():
    mask_mod, B, H = make_mask("per_head", 70, 90)
    ours = create_mask(mask_mod, 2, H, 70, 90, device=CPU)
    assert ours.dtype == torch.bool and ours.shape == (2, 3, 70, 90)
    assert torch.equal(ours, torch_flex.create_mask(mask_mod, 2, H, 70, 90, device=CPU))

    bias = torch.randn(90)

    def masking_score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(bias[kv_idx] > 0, score, -float("inf"))

    ours = create_mask(masking_score_mod, None, None, 70, 90, device=CPU)
    assert torch.equal(ours, torch_flex.create_mask(masking_score_mod, None, None, 70, 90, device=CPU))
    assert torch.equal(ours[0, 0, 5], bias > 0)

    with pytest.raises(InvalidInputError, match="3 required positional"):
        create_mask(lambda b, q_idx, kv_idx: q_idx >= kv_idx, 1, 1, 8, 8, device=CPU)


def test_docstring_example_runs():
    result = doctest.testmod(block_mask_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_default_device_and_broadcast_dims():
    bm = create_block_mask(causal_mask, None, None, 130, 130)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert bm.kv_num_blocks.device.type == expected
    assert bm.shape == (1, 1, 130, 130) and bm.kv_indices.shape == (1, 1, 2, 2)
    assert bm.numel() == 130 * 130


# --------------------------------------------------------------------------------------------
# Sparsity, pictures, repr
# --------------------------------------------------------------------------------------------


def test_sparsity_counts_only_the_area_inside_the_lengths():
    bm = create_block_mask(causal_mask, 1, 1, 300, 300, device=CPU, BLOCK_SIZE=128)
    # Causal 300x300 with 128-blocks visits the 6 tiles on or below the diagonal of a 3x3 grid.
    # Their in-range sizes: rows and columns are 128, 128 and 44 (= 300 - 256) long.
    side = [128, 128, 44]
    visited_area = sum(side[r] * side[c] for r in range(3) for c in range(r + 1))
    expected = 100.0 * (1.0 - visited_area / (300 * 300))
    assert bm.sparsity() == pytest.approx(expected)  # 30.72 %
    assert 0.0 <= bm.sparsity() <= 100.0
    # torch counts every tile at 128x128 and goes negative here: the difference we fix.
    assert torch_flex.create_block_mask(causal_mask, 1, 1, 300, 300, device=CPU).sparsity() < 0


def test_sparsity_of_random_masks_with_batch_and_heads():
    q_len, kv_len = _randint(100, 600), _randint(100, 600)
    tables = torch.rand(2, 3, q_len, kv_len) < torch.rand(2, 3, 1, 1) * 0.02

    def random_pairs(b, h, q_idx, kv_idx):
        return tables[b, h, q_idx, kv_idx]

    bm = create_block_mask(random_pairs, 2, 3, q_len, kv_len, device=CPU, BLOCK_SIZE=(64, 32))
    expected = sparsity_from_pairs(bm.to_dense(), bm.BLOCK_SIZE, q_len, kv_len)
    assert bm.sparsity() == pytest.approx(expected, abs=1e-9)
    assert 0.0 <= bm.sparsity() <= 100.0


def test_to_string_of_a_small_causal_mask():
    bm = create_block_mask(causal_mask, 1, 1, 32, 32, device=CPU, BLOCK_SIZE=8)
    assert bm.to_string() == "\n".join(
        [
            "batch 0, head 0",
            "░░      ",
            "██░░    ",
            "████░░  ",
            "██████░░",
        ]
    )
    # Downsampled to a 2x2 grid: the diagonal cells mix full, partial and empty tiles.
    assert bm.to_string(grid_size=2) == "batch 0, head 0\n░░  \n██░░"
    text = str(bm)
    assert text.startswith("BlockMask(shape=(1, 1, 32, 32), sparsity=37.50%,")  # 10 of 16 tiles visited
    assert "██████░░" in text


def test_to_string_draws_at_most_limit_pairs():
    bm = create_block_mask(causal_mask, 2, 3, 16, 16, device=CPU, BLOCK_SIZE=8)
    text = bm.to_string(limit=2)
    assert text.count("batch ") == 2 and "4 more (batch, head) pairs" in text
    assert bm.to_string(limit=10).count("batch ") == 6


def test_repr_is_short():
    bm = create_block_mask(causal_mask, 4, 8, 1024, 1024, device=CPU)
    text = repr(bm)
    assert text == (
        "BlockMask(shape=(4, 8, 1024, 1024), BLOCK_SIZE=(128, 128), sparsity=43.75%, "
        "full_blocks=separate, q_blocks=yes, mask_mod=causal_mask)"
    )


# --------------------------------------------------------------------------------------------
# Indexing, to(), adjust()
# --------------------------------------------------------------------------------------------


def _per_batch_and_head_mask(q_len: int, kv_len: int):
    windows = torch.randint(1, kv_len, (3, 4), dtype=torch.int32)

    def window_per_batch_and_head(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= windows[b, h])

    return window_per_batch_and_head


@pytest.mark.parametrize(
    "index, torch_index",
    [
        (1, 1),
        (-1, -1),
        ((1, 2), (1, 2)),
        ((slice(0, 2), slice(1, 3)), (slice(0, 2), slice(1, 3))),
        ((slice(None), -2), (slice(None), -2)),
        (torch.tensor([2, 0]), torch.tensor([2, 0])),
        ((2, torch.tensor(3)), (2, 3)),  # torch drops the dim of a 0-d tensor index; we keep it
        ((torch.tensor([True, False, True]), torch.tensor([1, 3])), (slice(0, 3, 2), slice(1, 4, 2))),
    ],
    ids=["int", "negative", "int_int", "slices", "head_only", "tensor", "int_0d_tensor", "bool_and_tensor"],
)
def test_getitem_batches_and_heads(index, torch_index):
    mask_mod = _per_batch_and_head_mask(400, 400)
    bm = create_block_mask(mask_mod, 3, 4, 400, 400, device=CPU, BLOCK_SIZE=64)
    theirs = torch_flex.create_block_mask(mask_mod, 3, 4, 400, 400, device=CPU, BLOCK_SIZE=64)[torch_index]
    sliced = bm[index]
    assert sliced.kv_num_blocks.dim() == 3 and sliced.kv_indices.dim() == 4  # ints keep their dim
    assert_same_as_torch(sliced, theirs)
    assert sliced.seq_lengths == (400, 400)
    # The mask_mod follows the selection: rebuilding from it gives the sliced tables back.
    B, H = sliced.kv_num_blocks.shape[:2]
    rebuilt = create_block_mask(sliced.mask_mod, B, H, 400, 400, device=CPU, BLOCK_SIZE=64)
    assert_same_as_torch(rebuilt, sliced)


def test_getitem_broadcast_dims_keep_the_mask_mod():
    bm = create_block_mask(causal_mask, None, 4, 256, 256, device=CPU, BLOCK_SIZE=64)
    assert bm[0].mask_mod is causal_mask  # a size-1 batch dim: nothing moved
    assert bm[:, :].mask_mod is causal_mask


def test_getitem_rows_replaces_the_mask_mod_with_an_explanation():
    bm = create_block_mask(causal_mask, 2, 2, 512, 512, device=CPU, BLOCK_SIZE=128)
    rows = torch.tensor([3, 1])
    sliced = bm[:, :, rows]
    theirs = torch_flex.create_block_mask(causal_mask, 2, 2, 512, 512, device=CPU)[:, :, rows]
    assert sliced.kv_num_blocks.shape == (2, 2, 2) and sliced.q_indices.shape == (2, 2, 4, 2)
    assert_same_as_torch(sliced, theirs)
    one_row = bm[0, 1, 2]
    assert one_row.kv_num_blocks.shape == (1, 1, 1)
    assert torch.equal(one_row.full_kv_num_blocks.flatten(), torch.tensor([2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="Correct:"):
        one_row.mask_mod(torch.tensor(0), torch.tensor(0), torch.tensor(0), torch.tensor(0))
    with pytest.raises(IndexError):
        bm[0, 0, 0, 0]
    with pytest.raises(IndexError):
        bm[5]


def test_to_returns_a_new_mask_on_the_device():
    bm = create_block_mask(_per_batch_and_head_mask(300, 300), 3, 4, 300, 300, device=CPU)
    moved = bm.to("meta")  # a real second device without a GPU
    assert moved is not bm and bm.kv_indices.device.type == "cpu"
    names = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
             "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"]
    for name in names:
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(moved, name).shape == getattr(bm, name).shape, name
    back = bm.to(torch.device("cpu"))
    assert back is not bm and back.mask_mod is bm.mask_mod and back.BLOCK_SIZE == bm.BLOCK_SIZE
    for name in names:
        assert torch.equal(getattr(back, name), getattr(bm, name)), name


def assert_is_crop_of(cropped: BlockMask, fresh, new_q: int, new_kv: int) -> None:
    """``cropped`` is ``fresh`` except that tiles cut by the new boundary may stay partial.

    Those tiles lost pairs the mask_mod kept, and adjust() does not call the mask_mod again to
    find out whether any kept pair is left; fresh may call them empty.
    """
    q_block, kv_block = cropped.BLOCK_SIZE
    cols = fresh.kv_indices.shape[-1]
    ours_partial = dense_by_loop(cropped.kv_num_blocks, cropped.kv_indices, cols).bool()
    their_partial = dense_by_loop(fresh.kv_num_blocks, fresh.kv_indices, cols).bool()
    ours_full = dense_by_loop(cropped.full_kv_num_blocks, cropped.full_kv_indices, cols)
    assert torch.equal(ours_full, dense_by_loop(fresh.full_kv_num_blocks, fresh.full_kv_indices, cols))
    cut = torch.zeros_like(ours_partial)
    if new_q % q_block:
        cut[..., -1, :] = True
    if new_kv % kv_block:
        cut[..., :, -1] = True
    assert torch.equal(ours_partial & ~cut, their_partial & ~cut)
    assert bool((their_partial <= ours_partial).all())
    # The backward tables describe the same (cropped) tiles.
    assert torch.equal(dense_by_loop(cropped.q_num_blocks, cropped.q_indices, cropped.q_indices.shape[-1]),
                       ours_partial.int().transpose(-2, -1))
    assert cropped.seq_lengths == (new_q, new_kv) and cropped.kv_indices.shape == fresh.kv_indices.shape


@pytest.mark.parametrize("name", ["causal", "sliding_window", "document", "per_head"])
def test_adjust_crops_to_the_new_lengths(name):
    q_len, kv_len = 1000, 1000
    block_size = (128, 64)
    mask_mod, B, H = make_mask(name, q_len, kv_len)
    bm = create_block_mask(mask_mod, B, H, q_len, kv_len, device=CPU, BLOCK_SIZE=block_size)
    # Lengths on block boundaries (and the original lengths) cut no tile: the tables are exact.
    for new_q, new_kv in [(1000, 1000), (512, 384), (128 * _randint(1, 8), 64 * _randint(1, 16))]:
        fresh = torch_flex.create_block_mask(mask_mod, B, H, new_q, new_kv, device=CPU, BLOCK_SIZE=block_size)
        assert_same_as_torch(bm.adjust(new_q, new_kv), fresh)
    for new_q, new_kv in [(700, 1000), (_randint(1, 1001), _randint(1, 1001)), (1, 1)]:
        fresh = torch_flex.create_block_mask(mask_mod, B, H, new_q, new_kv, device=CPU, BLOCK_SIZE=block_size)
        cropped = bm.adjust(new_q, new_kv)
        assert_is_crop_of(cropped, fresh, new_q, new_kv)
        assert cropped.mask_mod is mask_mod
        assert 0.0 <= cropped.sparsity() <= 100.0
    assert_same_as_torch(bm._adjust(300, 200), bm.adjust(300, 200))
    with pytest.raises(InvalidInputError, match="can only crop"):
        bm.adjust(1001, 1000)


def test_adjust_drops_blocks_past_the_new_end_in_any_order():
    # A row visiting key blocks 4 and 5 only, cropped to 5 key blocks (torch keeps a count of 2 here).
    row = BlockMask.from_kv_blocks(torch.tensor([[[2]]]), torch.tensor([[[[4, 5, 0, 1, 2, 3]]]]), BLOCK_SIZE=128)
    cropped = row.adjust(128, 640)
    assert cropped.kv_num_blocks.tolist() == [[[1]]] and cropped.kv_indices[0, 0, 0, 0] == 4
    assert cropped.kv_indices.shape == (1, 1, 1, 5) and bool((cropped.kv_indices < 5).all())


def test_adjust_demotes_full_tiles_cut_by_the_boundary():
    bm = create_block_mask(causal_mask, 1, 1, 256, 256, device=CPU, BLOCK_SIZE=128)
    assert bm.full_kv_num_blocks.tolist() == [[[0, 1]]]
    cropped = bm.adjust(200, 256)  # tile (1, 0) keeps all of its 72 remaining rows but is cut
    assert cropped.full_kv_num_blocks.tolist() == [[[0, 0]]]
    assert cropped.kv_num_blocks.tolist() == [[[1, 2]]]


# --------------------------------------------------------------------------------------------
# from_kv_blocks
# --------------------------------------------------------------------------------------------


def _random_tables(block_map: torch.Tensor, padding_high: int):
    """Unordered tables for a 0/1 map: used entries in a random order, random padding after them."""
    *batch, rows, cols = block_map.shape
    num_blocks = block_map.sum(-1).to(torch.int32)
    indices = torch.randint(0, padding_high, (*batch, rows, cols), dtype=torch.int64)
    flat_map, flat_idx = block_map.view(-1, cols), indices.view(-1, cols)
    for r in range(flat_map.shape[0]):
        kept = flat_map[r].nonzero().flatten()
        flat_idx[r, : kept.numel()] = kept[torch.randperm(kept.numel())]
    return num_blocks, indices


def test_from_kv_blocks_roundtrip():
    B, H, rows, cols = 2, 3, _randint(1, 9), _randint(1, 9)
    kind = torch.randint(0, 3, (B, H, rows, cols))  # 0 empty, 1 partial, 2 full
    partial, full = (kind == 1).to(torch.int32), (kind == 2).to(torch.int32)
    num, idx = _random_tables(partial, cols)
    full_num, full_idx = _random_tables(full, cols)

    bm = BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=(32, 16))
    assert bm.seq_lengths == (rows * 32, cols * 16) and bm.BLOCK_SIZE == (32, 16)
    assert bm.mask_mod is not None and bm.kv_indices.dtype == torch.int32  # int64 input stored as int32
    # Used entries are stored ascending (kernels rely on the boundary block coming last).
    used_kv = torch.arange(idx.shape[-1]) < num.unsqueeze(-1)
    expected = torch.where(used_kv, torch.where(used_kv, idx, 10**6).sort(dim=-1).values, idx).to(torch.int32)
    assert torch.equal(bm.kv_indices, expected)
    assert torch.equal(dense_by_loop(bm.kv_num_blocks, bm.kv_indices, cols), partial)
    assert torch.equal(dense_by_loop(bm.full_kv_num_blocks, bm.full_kv_indices, cols), full)
    assert torch.equal(bm.to_dense(), partial | full)
    # The transposed tables describe the transposed maps, in ascending order.
    assert torch.equal(dense_by_loop(bm.q_num_blocks, bm.q_indices, rows), partial.transpose(-2, -1))
    assert torch.equal(dense_by_loop(bm.full_q_num_blocks, bm.full_q_indices, rows), full.transpose(-2, -1))
    used = torch.arange(rows) < bm.q_num_blocks.unsqueeze(-1)
    ordered = torch.where(used, bm.q_indices, rows + 1)
    assert bool((ordered.diff(dim=-1)[used[..., 1:]] > 0).all())

    inference_only = BlockMask.from_kv_blocks(
        num, idx, BLOCK_SIZE=32, compute_q_blocks=False, seq_lengths=(rows * 32 - 5, cols * 32)
    )
    assert inference_only.q_num_blocks is None and inference_only.q_indices is None
    assert inference_only.full_kv_num_blocks is None and inference_only.BLOCK_SIZE == (32, 32)
    assert inference_only.seq_lengths == (rows * 32 - 5, cols * 32)


def test_from_kv_blocks_adds_batch_dims_and_cleans_padding():
    num = torch.tensor([1, 2], dtype=torch.int32)
    idx = torch.tensor([[1, 99], [0, 2]], dtype=torch.int32)  # 99: padding outside [0, 3)
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, seq_lengths=(32, 48))
    # Leading dims added; the table widened to COLS = ceil(48 / 16) = 3 key blocks.
    assert bm.kv_num_blocks.shape == (1, 1, 2) and bm.kv_indices.shape == (1, 1, 2, 3)
    assert bm.kv_indices[0, 0, 0].tolist() == [1, 0, 0]  # 99 replaced: kernels may prefetch padding
    assert torch.equal(bm.to_dense()[0, 0], torch.tensor([[0, 1, 0], [1, 0, 1]], dtype=torch.int32))
    assert bm.q_indices.shape == (1, 1, 3, 2)
    assert bm.sparsity() == pytest.approx(50.0)


def test_from_kv_blocks_errors():
    num = torch.tensor([[[1, 2]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 0], [0, 1]]]], dtype=torch.int32)
    with pytest.raises(InvalidInputError, match="both full_kv_num_blocks and full_kv_indices"):
        BlockMask.from_kv_blocks(num, idx, full_kv_num_blocks=num)
    with pytest.raises(InvalidInputError, match="both full_kv_num_blocks and full_kv_indices"):
        BlockMask.from_kv_blocks(num, idx, full_kv_indices=idx)
    with pytest.raises(InvalidInputError, match="needs"):
        BlockMask.from_kv_blocks(num[..., :1], idx)
    with pytest.raises(InvalidInputError, match="integer tensor"):
        BlockMask.from_kv_blocks(num, idx.float())
    with pytest.raises(InvalidInputError, match="used entry outside"):
        BlockMask.from_kv_blocks(num, torch.tensor([[[[0, 0], [0, 2]]]]))
    with pytest.raises(InvalidInputError, match=r"must lie in \[0, 2\]"):
        BlockMask.from_kv_blocks(torch.tensor([[[3, 0]]]), idx)
    with pytest.raises(InvalidInputError, match="must match kv_indices"):
        BlockMask.from_kv_blocks(num, idx, torch.tensor([[[1]]]), torch.tensor([[[[0]]]]))
    with pytest.raises(InvalidInputError, match="BLOCK_SIZE"):
        BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=0)
    with pytest.raises(InvalidInputError, match="same key block twice"):
        BlockMask.from_kv_blocks(num, torch.tensor([[[[0, 0], [1, 1]]]]))
    with pytest.raises(InvalidInputError, match="both as partial"):
        BlockMask.from_kv_blocks(num, idx, torch.tensor([[[0, 1]]]), torch.tensor([[[[0, 0], [1, 0]]]]))


# --------------------------------------------------------------------------------------------
# create_block_mask input checks
# --------------------------------------------------------------------------------------------


def test_create_block_mask_rejects_bad_inputs():
    with pytest.raises(TypeError, match="callable"):
        create_block_mask("causal", 1, 1, 128, 128, device=CPU)
    for bad in [0, -5, 12.5, True]:
        with pytest.raises(InvalidInputError, match="Q_LEN must be a positive int"):
            create_block_mask(causal_mask, 1, 1, bad, 128, device=CPU)
    with pytest.raises(InvalidInputError, match="H must be a positive int"):
        create_block_mask(causal_mask, 1, 0, 128, 128, device=CPU)
    for bad in [0, -128, (128,), (128, 0)]:
        with pytest.raises(InvalidInputError, match="BLOCK_SIZE"):
            create_block_mask(causal_mask, 1, 1, 128, 128, device=CPU, BLOCK_SIZE=bad)


def test_mask_mod_errors_name_the_mod():
    def distance_not_bool(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    with pytest.raises(InvalidInputError, match="'distance_not_bool' defined at .* must return a bool tensor"):
        create_block_mask(distance_not_bool, 1, 1, 64, 64, device=CPU)


# The common mistakes in a mask_mod (issue 50, item 6). Each entry: the mod, the text of the line the
# error must point at (its `def` line when the mistake is what it returns or takes), and the fix the
# message must give.
def _if_on_a_tensor(b, h, q_idx, kv_idx):
    if q_idx >= kv_idx:
        return q_idx >= 0
    return q_idx < 0


def _ternary_on_a_tensor(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx if q_idx > 3 else q_idx < 0


def _python_and(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) and (kv_idx >= 0)


def _python_or(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) or (kv_idx > 100)


def _item(b, h, q_idx, kv_idx):
    return q_idx.item() >= kv_idx


def _int(b, h, q_idx, kv_idx):
    return int(q_idx) >= kv_idx


def _python_bool(b, h, q_idx, kv_idx):
    return True


def _integer_result(b, h, q_idx, kv_idx):
    return q_idx - kv_idx


def _three_arguments(b, q_idx, kv_idx):
    return q_idx >= kv_idx


_DATA_DEPENDENT_FIX = "keep values as tensors"
MASK_MOD_MISTAKES = {
    "if": (_if_on_a_tensor, "if q_idx >= kv_idx:", "torch.where(cond, a, b)"),
    "ternary": (_ternary_on_a_tensor, "return q_idx >= kv_idx if q_idx > 3 else q_idx < 0", "torch.where(cond, a, b)"),
    "and": (_python_and, "return (q_idx >= kv_idx) and (kv_idx >= 0)", "`&`/`|` instead of and/or"),
    "or": (_python_or, "return (q_idx >= kv_idx) or (kv_idx > 100)", "`&`/`|` instead of and/or"),
    "item": (_item, "return q_idx.item() >= kv_idx", _DATA_DEPENDENT_FIX),
    "int": (_int, "return int(q_idx) >= kv_idx", _DATA_DEPENDENT_FIX),
    "python_bool": (_python_bool, "def _python_bool(", "`q_idx >= kv_idx`"),
    "integer_result": (_integer_result, "def _integer_result(", "`q_idx >= kv_idx`"),
    "arity": (_three_arguments, "def _three_arguments(", "(b, h, q_idx, kv_idx)"),
}
MASK_MOD_ENTRIES = {
    "create_block_mask": lambda mod: create_block_mask(mod, 2, 2, 64, 64, device=CPU, BLOCK_SIZE=32),
    "create_mask": lambda mod: create_mask(mod, 2, 2, 16, 16, device=CPU),
    "and_masks": lambda mod: create_block_mask(and_masks(causal_mask, mod), 2, 2, 64, 64, device=CPU, BLOCK_SIZE=32),
    "or_masks": lambda mod: create_mask(or_masks(mod, causal_mask), 2, 2, 16, 16, device=CPU),
}


@pytest.mark.parametrize("entry", list(MASK_MOD_ENTRIES))
@pytest.mark.parametrize("mistake", list(MASK_MOD_MISTAKES))
def test_mask_mod_mistakes_name_the_mod_the_line_and_the_fix(mistake, entry):
    # torch.vmap's own errors named neither the mod nor the line ("data-dependent control flow",
    # "calling .item()", "must only return Tensors"), and one asked for a bug report to PyTorch.
    mod, line_text, fix = MASK_MOD_MISTAKES[mistake]
    lines, first = inspect.getsourcelines(mod)
    (offset,) = [i for i, line in enumerate(lines) if line.strip().startswith(line_text)]
    with pytest.raises((InvalidInputError, ModTraceError)) as info:
        MASK_MOD_ENTRIES[entry](mod)
    message = str(info.value)
    assert mod.__name__ in message
    assert f"{__file__}:{first + offset}" in message, "the message must point at the mod's line"
    assert fix in message
    printed = "".join(traceback.format_exception(info.value))  # the chained errors too
    assert "vmap:" not in printed and "pytorch/issues" not in printed


def test_create_mask_names_a_score_mod_mistake_too():
    def branchy(score, b, h, q_idx, kv_idx):
        if q_idx >= kv_idx:
            return score
        return score - float("inf")

    with pytest.raises(ModTraceError, match=r"score_mod 'branchy'.*\n.*if q_idx >= kv_idx:\n.*torch.where"):
        create_mask(branchy, 1, 1, 16, 16, device=CPU)


def test_a_score_mod_or_a_mask_mod_of_the_wrong_arity_is_named():
    def alibi(score, b, h, q_idx, kv_idx):
        return score + (kv_idx - q_idx)

    with pytest.raises(InvalidInputError, match=r"create_block_mask got alibi\(score, b, h, q_idx, kv_idx\), "
                                                r"which takes 5 arguments: that is a score_mod.*score_mod=alibi"):
        create_block_mask(alibi, 1, 1, 64, 64, device=CPU)

    def three(b, q_idx, kv_idx):
        return q_idx >= kv_idx

    with pytest.raises(InvalidInputError, match=r"create_block_mask got mask_mod three\(b, q_idx, kv_idx\), which "
                                                r"takes 3 required positional arguments; a mask_mod takes exactly 4"):
        create_block_mask(three, 1, 1, 64, 64, device=CPU)
    with pytest.raises(InvalidInputError, match=r"from_kv_blocks got mask_mod three"):
        BlockMask.from_kv_blocks(torch.ones(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32),
                                 mask_mod=three)

    def with_default(b, h, q_idx, kv_idx, window=16):  # extra parameters with defaults are fine
        return (q_idx - kv_idx).abs() <= window

    create_block_mask(with_default, 1, 1, 64, 64, device=CPU, BLOCK_SIZE=16)


def _python_integer_block_maps(keep, q_len: int, kv_len: int, block: int):
    """(partial, full) block maps of a mask given as a Python predicate on ints (exact arithmetic)."""
    rows, cols = -(-q_len // block), -(-kv_len // block)
    partial = torch.zeros(1, 1, rows, cols, dtype=torch.bool)
    full = torch.zeros(1, 1, rows, cols, dtype=torch.bool)
    for r in range(rows):
        for c in range(cols):
            kept = [keep(qi, ki) for qi in range(r * block, min(q_len, (r + 1) * block))
                    for ki in range(c * block, min(kv_len, (c + 1) * block))]
            complete = (r + 1) * block <= q_len and (c + 1) * block <= kv_len
            full[0, 0, r, c] = all(kept) and complete
            partial[0, 0, r, c] = any(kept) and not full[0, 0, r, c]
    return partial, full


def test_index_arithmetic_past_int32_is_exact_in_the_builder():
    # q_idx * 2**28 leaves int32 from q_idx = 8: the builder must evaluate it in int64, as Python would.
    def linearised(b, h, q_idx, kv_idx):
        return ((q_idx * 2**28 + kv_idx) % 3 == 0) | (q_idx == kv_idx)

    L, block = 48, 8
    bm = create_block_mask(linearised, 1, 1, L, L, device=CPU, BLOCK_SIZE=block)
    partial, full = _python_integer_block_maps(lambda qi, ki: (qi * 2**28 + ki) % 3 == 0 or qi == ki, L, L, block)
    assert torch.equal(bm._partial_map().bool(), partial)
    assert torch.equal(bm._full_map().bool(), full)
    dense = create_mask(linearised, 1, 1, L, L, device=CPU)
    expected = torch.tensor([[(qi * 2**28 + ki) % 3 == 0 or qi == ki for ki in range(L)] for qi in range(L)])
    assert torch.equal(dense[0, 0], expected)

    def linearised_score(score, b, h, q_idx, kv_idx):
        return torch.where(((q_idx * 2**28 + kv_idx) % 3 == 0) | (q_idx == kv_idx), score, -float("inf"))

    assert torch.equal(create_mask(linearised_score, 1, 1, L, L, device=CPU)[0, 0], expected)


def test_builder_asks_the_lowering_for_the_index_dtype(monkeypatch):
    # The contract: needs_wide_indices(traced, IndexBounds) decides; a mod that cannot be traced keeps int32.
    import flexattn.lowering.ranges as lowering

    seen = []

    def needs_wide_indices(traced, bounds):
        seen.append((traced.name, bounds.B, bounds.H, bounds.Q_LEN, bounds.KV_LEN))
        return traced.name == "wide_one"

    monkeypatch.setattr(lowering, "needs_wide_indices", needs_wide_indices, raising=False)
    dtypes = {}

    def wide_one(b, h, q_idx, kv_idx):
        dtypes["wide_one"] = q_idx.dtype
        return q_idx >= kv_idx

    def narrow_one(b, h, q_idx, kv_idx):
        dtypes["narrow_one"] = q_idx.dtype
        return q_idx >= kv_idx

    create_block_mask(wide_one, 2, 3, 40, 56, device=CPU, BLOCK_SIZE=8)
    create_block_mask(narrow_one, None, None, 40, 56, device=CPU, BLOCK_SIZE=8)
    assert ("wide_one", 2, 3, 40, 56) in seen and ("narrow_one", 1, 1, 40, 56) in seen
    assert dtypes == {"wide_one": torch.int64, "narrow_one": torch.int32}


# --------------------------------------------------------------------------------------------
# Bounded memory at long sequence lengths
# --------------------------------------------------------------------------------------------

_LONG_BUILD = textwrap.dedent(
    """
    import json, resource, time
    import torch
    from flexattn import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    start = time.perf_counter()
    bm = create_block_mask(causal, 1, 1, 131072, 131072, device="cpu")
    seconds = time.perf_counter() - start
    print(json.dumps({
        "seconds": seconds,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
        "partial": int(bm.kv_num_blocks.sum()),
        "full": int(bm.full_kv_num_blocks.sum()),
        "sparsity": bm.sparsity(),
    }))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss is in KiB on Linux only")
def test_causal_128k_build_stays_under_2_gib():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run(
        [sys.executable, "-c", _LONG_BUILD], capture_output=True, text=True, env=env, timeout=600, check=True
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    blocks = 131072 // 128
    assert result["partial"] == blocks  # the diagonal
    assert result["full"] == blocks * (blocks - 1) // 2  # everything below it
    assert result["sparsity"] == pytest.approx(100.0 * (1 - (blocks * (blocks + 1) / 2) / blocks**2))
    # The dense mask alone would be 16 GiB; the tiles keep the whole process below 2 GiB.
    assert result["peak_rss_mib"] < 2048, result
    # A generous guard against falling back to something quadratic in Python (about 15-20 s measured).
    assert result["seconds"] < 120, result


@pytest.mark.parametrize("lengths", [(256, 256), (300, 1000), (1, 129)])
def test_the_mask_of_a_call_without_one_is_built_without_reading_tables_back(monkeypatch, lengths):
    # flex_attention(q, k, v) builds this mask; inside a CUDA-graph capture it is built anew and may
    # not read anything back to the host. It must also equal the checked mask, and give the launch
    # plan's row statistics the checks would compute.
    from flexattn.kernels.tables import checked_launch_tables, launch_tables
    from flexattn.masks import create

    L, S = lengths
    monkeypatch.setattr(create, "_dense_masks", create.OrderedDict())
    for name in ("tolist", "item", "__bool__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name: pytest.fail(f"Tensor.{_n} read the tables back"))
    mask = create.dense_block_mask(L, S, torch.device("cpu"))
    trusted = launch_tables(mask)
    monkeypatch.undo()

    rows, cols = -(-L // 128), -(-S // 128)
    checked = BlockMask.from_kv_blocks(
        torch.zeros(1, 1, rows, dtype=torch.int32), torch.zeros(1, 1, rows, 1, dtype=torch.int32),
        torch.full((1, 1, rows), cols, dtype=torch.int32),
        torch.arange(cols, dtype=torch.int32).expand(1, 1, rows, cols), seq_lengths=(L, S))
    for prefix in ("kv", "full_kv", "q", "full_q"):  # counts and listed entries (padding may differ)
        num, idx = getattr(mask, f"{prefix}_num_blocks"), getattr(mask, f"{prefix}_indices")
        assert torch.equal(num, getattr(checked, f"{prefix}_num_blocks")), prefix
        assert idx.shape == getattr(checked, f"{prefix}_indices").shape, prefix
        listed = torch.arange(idx.shape[-1]) < num.unsqueeze(-1)
        assert torch.equal(idx[listed], getattr(checked, f"{prefix}_indices")[listed]), prefix
    assert mask.seq_lengths == (L, S)
    assert trusted.stats == checked_launch_tables(checked).stats == checked_launch_tables(mask).stats
