"""The kernels' caches: what a launch plan is keyed by, data derived from a BlockMask, lowering variants,
and block sizes the Triton backend can and cannot tile (see [Note] Cache keys in flexattn/kernels/family.py).

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py), so shapes are small.
"""

import gc
import os

import pytest
import torch
from numerics import rel_err

import flexattn.kernels.forward as rt
from flexattn import BlockMask, create_block_mask, flex_attention
from flexattn.errors import InvalidInputError
from flexattn.kernels.tables import block_mask_row_stats
from flexattn.reference import reference_attention
from flexattn.variants import causal_mask

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="the Triton backend on CPU tensors needs TRITON_INTERPRET=1",
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = {"BACKEND": "TRITON"}
L, BLOCK = 256, 32


def every_other_block(b, h, q_idx, kv_idx):
    # Full blocks 0, 2, 4, ... in every row: not consecutive (CONSECUTIVE_FULL is False), unlike causal.
    return ((kv_idx // BLOCK) % 2 == 0) | (q_idx == kv_idx)


def qkv(L=L, D=32, H=2, dtype=torch.float32):
    return tuple(torch.randn(1, H, L, D, device=DEVICE, dtype=dtype) for _ in range(3))


def check(out, q, k, v, mask_mod, score_mod=None, tol=2e-5):
    ref, _, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=score_mod, mask_mod=mask_mod)
    assert rel_err(out, ref) < tol


def _tables(mask_mod):
    bm = create_block_mask(mask_mod, 1, 1, L, L, device=DEVICE, BLOCK_SIZE=BLOCK)
    return bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices


def mask_from_table(allowed: torch.Tensor):
    """One mask_mod per table, all sharing one traced graph (and so one kernel and its plans)."""

    def from_table(b, h, q_idx, kv_idx):
        return allowed[q_idx, kv_idx]

    return from_table


def _dense(mask_mod) -> torch.Tensor:
    positions = torch.arange(L, device=DEVICE)
    return mask_mod(0, 0, positions[:, None], positions[None, :])


@pytest.mark.skipif(DEVICE == "cuda", reason="relies on CPython handing a freed BlockMask's id to the next one, "
                    "which CUDA allocations upset; tests/test_gpu.py and tests/test_differential.py cover the GPU")
def test_masks_rebuilt_every_step_with_recycled_ids_get_their_own_plans(one_thread, collect_new_objects_only):
    # Issue 8, item 2: a loop that frees its BlockMask and builds the next one gets the freed
    # mask's id back, and with an id-keyed plan the freed mask's CONSECUTIVE_* constexprs.
    patterns = [mask_from_table(_dense(causal_mask)), mask_from_table(_dense(every_other_block))]
    tables = [_tables(m) for m in patterns]
    flags = [block_mask_row_stats(BlockMask.from_kv_blocks(*t, BLOCK_SIZE=BLOCK)) for t in tables]
    assert flags[0].consecutive_full and not flags[1].consecutive_full  # the patterns differ where it matters
    q, k, v = qkv()
    # The first call compiles and traces; let its temporaries come and go before the loop.
    flex_attention(q, k, v, block_mask=create_block_mask(patterns[0], 1, 1, L, L, device=DEVICE, BLOCK_SIZE=BLOCK),
                   kernel_options=TRITON)
    ids, bm = [], BlockMask.__new__(BlockMask)
    for step in range(6):
        pattern = step % 2  # the consecutive pattern first, so a stale plan would be the wrong one
        gc.collect()
        del bm
        # A new object allocated right after the old one is freed takes its memory, so its id:
        # what the issue saw after many steps on a GPU happens here at every step.
        bm = BlockMask.__new__(BlockMask)
        bm.__init__((L, L), *tables[pattern], None, None, None, None, BLOCK_SIZE=BLOCK, mask_mod=patterns[pattern])
        ids.append(id(bm))
        out = flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON)
        check(out, q, k, v, patterns[pattern])
    crossed = [(i, j) for i in range(len(ids)) for j in range(i) if ids[i] == ids[j] and (i - j) % 2]
    assert crossed, f"no id was handed from one pattern to the other ({ids}): the test did not exercise the bug"


def test_tables_changed_in_place_or_replaced_are_seen(one_thread):
    q, k, v = qkv()
    causal, other = mask_from_table(_dense(causal_mask)), mask_from_table(_dense(every_other_block))
    bm = create_block_mask(causal, 1, 1, L, L, device=DEVICE, BLOCK_SIZE=BLOCK)
    check(flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON), q, k, v, causal)
    # In place: same tensor objects, new contents (their version counters move).
    nb, idx, fnb, fidx = _tables(other)
    bm.kv_num_blocks.copy_(nb)
    bm.kv_indices.copy_(idx)
    bm.full_kv_num_blocks.copy_(fnb)
    bm.full_kv_indices.copy_(fidx)
    bm.mask_mod = other
    check(flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON), q, k, v, other)
    # Replaced: new tensor objects.
    bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices = _tables(causal)
    bm.mask_mod = causal
    check(flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON), q, k, v, causal)


def test_tables_edited_out_of_order_or_out_of_range(one_thread):
    q, k, v = qkv()

    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 40

    bm = create_block_mask(window, 1, 1, L, L, device=DEVICE, BLOCK_SIZE=BLOCK, separate_full_blocks=False)
    flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON)
    # Reverse every row's used entries in place: the kernel needs them ascending (boundary block).
    rows = bm.kv_indices[0, 0]
    for r in range(rows.shape[0]):
        n = int(bm.kv_num_blocks[0, 0, r])
        rows[r, :n] = rows[r, :n].flip(0)
    check(flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON), q, k, v, window)
    bm.kv_indices[0, 0, 0, 0] = L // BLOCK  # one past the last key block
    with pytest.raises(InvalidInputError, match=r"key block outside \[0, 8\)"):
        flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON)


def test_full_block_tables_edited_in_place_are_checked_again(one_thread):
    # Each of the four tables' version counters is in the stamp of what is derived from them
    # (BlockMask.derived): here only the full blocks' index table changes.
    q, k, v = qkv()
    bm = create_block_mask(causal_mask, 1, 1, L, L, device=DEVICE, BLOCK_SIZE=BLOCK)
    check(flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON), q, k, v, causal_mask)
    row = int(torch.nonzero(bm.full_kv_num_blocks[0, 0])[0])  # a row with a full block
    bm.full_kv_indices[0, 0, row, 0] = L // BLOCK  # one past the last key block
    with pytest.raises(InvalidInputError, match=r"key block outside \[0, 8\)"):
        flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON)


def test_kernels_are_chosen_per_lowering_variant(monkeypatch, tmp_path, one_thread):
    # Contract with the lowering: lowering_variant(traced, IndexBounds) is asked once per plan, and
    # lower(..., variant=) once per distinct variant; warm calls ask nothing. An empty kernel index:
    # an entry from an earlier run of this test would serve its kernels without lowering them.
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path))
    import flexattn.kernels.family as family
    import flexattn.lowering as lowering
    import flexattn.lowering.ranges as ranges

    asked, lowered = [], []
    real_lower = lowering.lower

    def lowering_variant(traced, bounds):
        asked.append((traced.name, bounds.Q_LEN, bounds.KV_LEN))
        return ("wide", bounds.Q_LEN * bounds.KV_LEN >= 1 << 15)

    def lower(traced, inputs=lowering.ModInputs(), prefix="sm_", *, tanh_approx=False, variant=None):
        lowered.append((traced.name, variant))
        return real_lower(traced, inputs, prefix, tanh_approx=tanh_approx)

    monkeypatch.setattr(ranges, "lowering_variant", lowering_variant)
    monkeypatch.setattr(family, "lower", lower)
    monkeypatch.setattr(rt, "_kernels", type(rt._kernels)())

    def shifted_causal(b, h, q_idx, kv_idx):  # a mod of its own: no kernel of it exists yet
        return q_idx + 1 > kv_idx

    for length in (128, 256, 256, 128):
        q, k, v = qkv(L=length)
        bm = create_block_mask(shifted_causal, 1, 1, length, length, device=DEVICE, BLOCK_SIZE=BLOCK)
        check(flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON), q, k, v, shifted_causal)
    assert asked == [("shifted_causal", 128, 128), ("shifted_causal", 256, 256)]  # one plan per shape
    assert lowered == [("shifted_causal", ("wide", False)), ("shifted_causal", ("wide", True))]
    (kernel,) = rt._kernels.values()
    assert kernel.last_plan.compiled.variants == (None, ("wide", False))


@pytest.mark.parametrize("block_size", [48, 80, 96, (48, 96), (96, 48)])
def test_block_sizes_that_are_not_powers_of_two(block_size, one_thread):
    # Tiles of 16 or 32 walk each block (48 = 3 x 16, 80 = 5 x 16, 96 = 3 x 32).
    q, k, v = qkv(L=200)

    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 70

    bm = create_block_mask(window, 1, 1, 200, 200, device=DEVICE, BLOCK_SIZE=block_size)
    check(flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON), q, k, v, window)
    pinned = flex_attention(q, k, v, block_mask=bm, kernel_options={**TRITON, "BLOCK_M": 16, "BLOCK_N": 16})
    check(pinned, q, k, v, window)


@pytest.mark.parametrize("block_size", [100, 24, 8, (128, 40)])
def test_block_sizes_without_a_power_of_two_tile_are_refused_before_launch(block_size, one_thread):
    q, k, v = qkv(L=200)
    bm = create_block_mask(causal_mask, 1, 1, 200, 200, device=DEVICE, BLOCK_SIZE=block_size)
    with pytest.raises(InvalidInputError, match=r"block size \(BLOCK_SIZE\) is \d+: the Triton backend walks each"):
        flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON)
    # The PyTorch backend takes any block size.
    check(flex_attention(q, k, v, block_mask=bm, kernel_options={"BACKEND": "PYTORCH"}), q, k, v, causal_mask)


def test_pinned_tile_must_divide_a_block_that_is_not_a_power_of_two(one_thread):
    q, k, v = qkv(L=96)
    bm = create_block_mask(causal_mask, 1, 1, 96, 96, device=DEVICE, BLOCK_SIZE=48)
    with pytest.raises(InvalidInputError, match=r"kernel_options\['BLOCK_N'\] must be a power of two >= 16"):
        flex_attention(q, k, v, block_mask=bm, kernel_options={**TRITON, "BLOCK_N": 32})


def test_default_mask_cache_is_bounded_and_keeps_recent_lengths():
    from flexattn.masks import create as api

    for length in range(1, 80):
        q = torch.randn(1, 1, length, 8)
        flex_attention(q, q, q, kernel_options={"BACKEND": "PYTORCH"})
    assert len(api._dense_masks) <= 64
    assert (79, 79, q.device, None) in api._dense_masks  # None: no stream off CUDA


# ------------------------------------------------------------------------------ resources


def _launch_through(monkeypatch, kernel, launcher):
    """Plans made from now on launch through ``launcher`` instead of the compiled kernel."""
    import dataclasses
    import types

    def compiled(bounds):
        real = original(bounds)
        return dataclasses.replace(real, module=types.SimpleNamespace(flex_attention_forward=launcher))


    original = kernel.compiled
    monkeypatch.setattr(kernel, "compiled", compiled)
    kernel._plans.clear()


def test_out_of_resources_retries_with_smaller_tiles(monkeypatch, one_thread):
    # See [Note] Resource fallback: the compiler's OutOfResources at the first launch (seen on an
    # H100 with a Graphormer edge bias) plans a smaller tile and keeps it; the result stays exact.
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(rt, "_kernels", type(rt._kernels)())
    q, k, v = qkv()
    block_mask = create_block_mask(causal_mask, 1, 1, L, L, device=q.device)
    flex_attention(q, k, v, block_mask=block_mask, kernel_options=TRITON)  # builds the kernel and a plan
    (kernel,) = rt._kernels.values()
    launch = kernel.last_plan.compiled.module.flex_attention_forward
    tiles = []

    class Tight:  # refuses tiles of more than 32 x 32 the way the compiler does
        def __getitem__(self, grid):
            def run(*args, **constexprs):
                tiles.append((constexprs["BLOCK_M"], constexprs["BLOCK_N"], constexprs["num_stages"]))
                if constexprs["BLOCK_M"] * constexprs["BLOCK_N"] > 32 * 32:
                    raise OutOfResources(400_000, 232_448, "shared memory")
                return launch[grid](*args, **constexprs)
            return run

    _launch_through(monkeypatch, kernel, Tight())
    out = flex_attention(q, k, v, block_mask=block_mask, kernel_options=TRITON)
    assert rel_err(out, reference_attention(q, k, v, mask_mod=causal_mask)[0]) < 1e-5
    assert tiles[-1][0] * tiles[-1][1] <= 32 * 32 and len(tiles) > 1
    tried = len(tiles)
    flex_attention(q, k, v, block_mask=block_mask, kernel_options=TRITON)
    assert len(tiles) == tried + 1  # the smaller plan was kept: one launch, no retries


def test_out_of_resources_at_the_smallest_tile_is_our_error(monkeypatch, one_thread):
    from triton.runtime.errors import OutOfResources

    from flexattn.errors import ResourceError

    monkeypatch.setattr(rt, "_kernels", type(rt._kernels)())
    q, k, v = qkv()
    flex_attention(q, k, v, kernel_options=TRITON)
    (kernel,) = rt._kernels.values()

    class Never:
        def __getitem__(self, grid):
            def run(*args, **constexprs):
                raise OutOfResources(400_000, 232_448, "shared memory")
            return run

    _launch_through(monkeypatch, kernel, Never())
    with pytest.raises(ResourceError, match="BACKEND': 'PYTORCH'"):
        flex_attention(q, k, v, kernel_options=TRITON)


def test_lowering_variants_are_remembered_per_traced_mods_and_bounds():
    # lowering_variants remembers the range analysis per (TracedMods, bounds): an entry must
    # never answer for other lengths, nor for a mod of the same code over a tensor of another size.
    import flexattn.lowering as lowering
    import flexattn.lowering.ranges as ranges
    from flexattn.lowering import index_bounds
    from flexattn.trace import trace_mod

    def over(table):
        def bias(score, b, h, q_idx, kv_idx):
            return score + table[kv_idx] + (q_idx * 70000 + kv_idx) % 7

        return bias

    short, long = (trace_mod(over(torch.randn(n)), "score_mod")[0] for n in (100, 1 << 20))
    small, large = index_bounds(1, 1, 64, 64), index_bounds(1, 1, 50000, 50000)
    seen = {}
    for _ in range(2):  # the second round answers from memory
        for traced in (short, long):
            for bounds in (small, large):
                got = ranges.lowering_variants(traced, None, bounds)
                assert got == (lowering.lowering_variant(traced, bounds), None)
                seen[(traced.graph_module.code, traced.captured[0].shape, bounds)] = got
    assert seen[(short.graph_module.code, (100,), small)] != seen[(short.graph_module.code, (100,), large)]
    assert len({v for v in seen.values()}) >= 3  # lengths and the table's size both change the answer
    assert len(ranges._VARIANTS) <= ranges._VARIANTS_KEPT


def test_a_mods_own_constants_are_copied_once_per_device_and_again_after_a_change():
    from flexattn.trace import trace_mod

    def table_bias(score, b, h, q_idx, kv_idx):
        table = torch.tensor([0.5, -1.0, 2.0])  # built by the mod: frozen on the CPU at trace time
        return score + table[h % 3]

    traced, _ = trace_mod(table_bias, "score_mod")
    (constant,) = [c.fixed_value for c in traced.captured]
    first = traced.fixed_values_on("meta")
    assert first[0].device.type == "meta" and first[0].shape == constant.shape
    assert traced.fixed_values_on(torch.device("meta"))[0] is first[0]  # kept: no copy per launch
    constant.mul_(2)  # cannot happen through the API (the constant is the TracedMod's own clone)
    assert traced.fixed_values_on("meta")[0] is not first[0]  # but a changed constant is copied again
