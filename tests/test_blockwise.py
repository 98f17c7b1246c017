"""The blockwise PyTorch backend (flexattn/blockwise.py) against the dense float64 reference.

Each numeric check is three-way (see ``_assert_close``): the float64 reference is the golden value,
the reference run in the test dtype shows how much error that dtype costs anyway, and the blockwise
result must stay within a small multiple of that plus a per-dtype budget.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from numerics import rel_err

from flexattn import blockwise
from flexattn.masks import BlockMask, create_block_mask
from flexattn.blockwise import BlockwiseMods, blockwise_backward, blockwise_forward
from flexattn import flex_attention
from flexattn.reference import reference_attention
from flexattn.trace import trace_mod
from flexattn.variants import CATALOGUE, causal_mask, generate_alibi_bias

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Budget on the norm-wise relative error against the float64 golden value, per dtype. float64 only
# reorders sums; float32 accumulates over a few hundred keys; half dtypes round inputs and output.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# The blockwise path may be at most twice as far from float64 as the dense reference in the same
# dtype (flash-attn's "at most twice the error of a PyTorch implementation"): both accumulate in
# float32, but the blockwise path sums in a different order (per chunk, rescaled).
FUDGE = 2.0


pytestmark = pytest.mark.usefixtures("one_thread")




def _assert_close(actual, golden, same_dtype_ref, dtype, what: str) -> None:
    err = rel_err(actual, golden)
    budget = FUDGE * (rel_err(same_dtype_ref, golden) if same_dtype_ref is not None else 0.0) + TOLERANCE[dtype]
    assert err <= budget, f"{what}: relative error {err:.3g} > budget {budget:.3g} ({dtype})"


def _traced(score_mod, mask_mod):
    """The graph modules and captured tensors the API layer hands to the blockwise functions."""
    score, score_captured = trace_mod(score_mod, "score_mod") if score_mod is not None else (None, [])
    mask, mask_captured = trace_mod(mask_mod, "mask_mod") if mask_mod is not None else (None, [])
    return (
        score.graph_module if score is not None else None, score_captured,
        mask.graph_module if mask is not None else None, mask_captured,
    )


def _forward(q, k, v, score_mod, mask_mod, block_mask, scale=None):
    score, score_captured, mask, mask_captured = _traced(score_mod, mask_mod)
    return blockwise_forward(q, k, v, block_mask, scale, BlockwiseMods(score, score_captured, mask, mask_captured),
                             need_max=True)


def _backward(q, k, v, out, lse, grad_out, grad_lse, score_mod, mask_mod, block_mask, scale=None):
    score, score_captured, mask, mask_captured = _traced(score_mod, mask_mod)
    mods = BlockwiseMods(score, score_captured, mask, mask_captured)
    return blockwise_backward(q, k, v, out, lse, grad_out, grad_lse, block_mask, scale, mods)


def _inputs(B, Hq, Hkv, L, S, E, Ev, dtype, Bkv=None):
    Bkv = B if Bkv is None else Bkv
    return (
        torch.randn(B, Hq, L, E).to(dtype),
        torch.randn(Bkv, Hkv, S, E).to(dtype),
        torch.randn(Bkv, Hkv, S, Ev).to(dtype),
    )


def _reference_grads(q, k, v, score_mod, mask_mod, grad_out, grad_lse=None, extra=(), scale=None):
    """out, lse, max_scores and gradients (q, k, v, *extra) of the dense reference, in q's dtype."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    enable_gqa = q.shape[1] != k.shape[1]
    out, lse, max_scores = reference_attention(*leaves, score_mod, mask_mod, scale=scale, enable_gqa=enable_gqa)
    loss = (out.to(grad_out.dtype) * grad_out).sum()
    if grad_lse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * grad_lse.to(lse.dtype)).sum()
    grads = torch.autograd.grad(loss, leaves + list(extra))
    return out.detach(), lse.detach(), max_scores, grads


def _check_forward_and_backward(q, k, v, score_mod, mask_mod, block_mask, dtype, *, grad_lse=False, check_backward=True):
    """Blockwise forward and backward in ``dtype`` vs the float64 reference (golden) and the same-dtype one."""
    grad_out = torch.randn(q.shape[:-1] + (v.shape[-1],))
    lse_grad = torch.randn(q.shape[:-1]) if grad_lse else None
    golden = _reference_grads(q.double(), k.double(), v.double(), score_mod, mask_mod, grad_out.double(),
                              lse_grad.double() if grad_lse else None)
    ref = None
    if dtype != torch.float64:
        ref = _reference_grads(q, k, v, score_mod, mask_mod, grad_out.to(dtype), lse_grad)

    out, lse, max_scores = _forward(q, k, v, score_mod, mask_mod, block_mask)
    assert out.dtype == dtype and out.shape == q.shape[:-1] + (v.shape[-1],)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    _assert_close(out, golden[0], ref and ref[0], dtype, "out")
    _assert_close(lse, golden[1], ref and ref[1], dtype, "lse")
    _assert_close(max_scores, golden[2], ref and ref[2], dtype, "max_scores")
    if not check_backward:
        return
    grads = _backward(q, k, v, out, lse, grad_out.to(dtype), lse_grad, score_mod, mask_mod, block_mask)
    for name, g, gold, r, like in zip("qkv", grads[:3], golden[3], ref[3] if ref else [None] * 3, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype
        _assert_close(g, gold, r, dtype, f"d{name}")


def _variant(name, B, H, L, S):
    score_mod, mask_mod = CATALOGUE[name].build(B, H, L, S, "cpu")
    block_mask = create_block_mask(mask_mod, None, None, L, S, device="cpu") if mask_mod is not None else None
    return score_mod, mask_mod, block_mask


# ---------------------------------------------------------------------------------------------
# Every catalogue variant, odd lengths, GQA, Ev != E
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", list(CATALOGUE))
def test_catalogue_forward_and_backward(name, dtype):
    # Q_LEN 300 and KV_LEN 517 are not multiples of 128; the document mask packs one sequence (Q == KV).
    L, S = (517, 517) if CATALOGUE[name].square_only else (300, 517)
    score_mod, mask_mod, block_mask = _variant(name, 2, 4, L, S)
    q, k, v = _inputs(2, 4, 2, L, S, 64, 48, dtype)
    _check_forward_and_backward(q, k, v, score_mod, mask_mod, block_mask, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["causal", "alibi", "softcap"])
def test_half_dtypes(name, dtype):
    score_mod, mask_mod, block_mask = _variant(name, 1, 4, 300, 517)
    q, k, v = _inputs(1, 4, 4, 300, 517, 64, 64, dtype)
    _check_forward_and_backward(q, k, v, score_mod, mask_mod, block_mask, dtype)


@pytest.mark.parametrize("E, Ev", [(16, 32), (48, 16), (64, 48), (128, 64)])
def test_head_dims(E, Ev):
    score_mod, mask_mod, block_mask = _variant("alibi", 1, 2, 300, 517)
    q, k, v = _inputs(1, 2, 1, 300, 517, E, Ev, torch.float32)
    _check_forward_and_backward(q, k, v, score_mod, mask_mod, block_mask, torch.float32)


# ---------------------------------------------------------------------------------------------
# BlockMask layouts: block sizes, per-(batch, head) lists, K/V batch broadcast
# ---------------------------------------------------------------------------------------------


def varied_window(b, h, q_idx, kv_idx):
    """A window whose width depends on the head and whose causal offset depends on the batch."""
    return (kv_idx <= q_idx + 40 * b) & (q_idx - kv_idx <= 60 + 90 * h)


@pytest.mark.parametrize("per_batch_head", [True, False], ids=["mask_BxH", "mask_1x1"])
@pytest.mark.parametrize("block_size", [(128, 128), (64, 128), (128, 64)])
def test_block_sizes_and_mask_broadcast(block_size, per_batch_head):
    B, Hq, Hkv = 2, 4, 2
    mask_mod = varied_window if per_batch_head else causal_mask
    mB, mH = (B, Hq) if per_batch_head else (None, None)
    block_mask = create_block_mask(mask_mod, mB, mH, 300, 517, device="cpu", BLOCK_SIZE=block_size)
    q, k, v = _inputs(B, Hq, Hkv, 300, 517, 32, 16, torch.float64)
    _check_forward_and_backward(q, k, v, generate_alibi_bias(Hq), mask_mod, block_mask, torch.float64)


@pytest.mark.parametrize("per_batch_head", [True, False], ids=["mask_BxH", "mask_1x1"])
def test_kv_batch_broadcast(per_batch_head):
    # K/V of batch 1 serve 3 query batches: dK/dV must sum over them (and over the GQA group).
    B, Hq, Hkv = 3, 4, 2
    mask_mod = varied_window if per_batch_head else causal_mask
    mB, mH = (B, Hq) if per_batch_head else (None, None)
    block_mask = create_block_mask(mask_mod, mB, mH, 200, 333, device="cpu", BLOCK_SIZE=(64, 64))
    q, k, v = _inputs(B, Hq, Hkv, 200, 333, 32, 24, torch.float64, Bkv=1)
    _check_forward_and_backward(q, k, v, None, mask_mod, block_mask, torch.float64)


def test_no_block_mask_is_dense():
    q, k, v = _inputs(2, 2, 2, 300, 517, 32, 32, torch.float64)
    _check_forward_and_backward(q, k, v, generate_alibi_bias(2), None, None, torch.float64)


def test_torch_block_mask_objects_work_too():
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    block_mask = torch_create_block_mask(varied_window, 2, 4, 300, 517, device="cpu", BLOCK_SIZE=(64, 128))
    q, k, v = _inputs(2, 4, 2, 300, 517, 32, 16, torch.float64)
    _check_forward_and_backward(q, k, v, None, varied_window, block_mask, torch.float64)


def test_selective_activation_checkpointing_gives_the_gradients_of_no_checkpointing():
    # torch's selective activation checkpointing (torchtitan's default) keeps the outputs of the
    # matmuls it is told to save and hands them back, in call order, when the backward recomputes
    # the forward. A forward that then changed such an output in place (scaling q @ k^T, say) would
    # recompute from the changed values: matmul returns an _unsafe_view of its bmm, whose in-place
    # changes torch's mutation check does not see, so the gradients were silently wrong.
    import functools

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    save_matmuls = functools.partial(create_selective_checkpoint_contexts,
                                     [torch.ops.aten.bmm.default, torch.ops.aten.mm.default])
    block_mask = create_block_mask(causal_mask, 2, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
    q, k, v = _inputs(2, 4, 4, 256, 256, 16, 16, torch.float32)
    weight = torch.randn(16, 16)

    def layer(q, k, v, weight):  # the projection's mm is saved too, as in a model
        return flex_attention(q @ weight, k, v, block_mask=block_mask)

    def gradients(checkpointed: bool):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, weight)]
        if checkpointed:
            out = checkpoint(layer, *leaves, use_reentrant=False, context_fn=save_matmuls)
        else:
            out = layer(*leaves)
        out.square().sum().backward()
        return [t.grad for t in leaves]

    for name, got, want in zip(("dq", "dk", "dv", "dweight"), gradients(True), gradients(False)):
        # The same operations in the same order: the same bits.
        assert torch.equal(got, want), f"{name}: max difference {(got - want).abs().max():.3g}"


def test_tall_blocks_and_chunked_rows(monkeypatch):
    # 512-query blocks are split into sub-rows of Q_TILE_MAX, and a tiny chunk budget cuts every row
    # into many key chunks, so the online softmax rescales across chunks many times.
    monkeypatch.setattr(blockwise, "TILE_ELEMENTS", 2 * 4 * 256 * 40)
    block_mask = create_block_mask(varied_window, 2, 4, 600, 700, device="cpu", BLOCK_SIZE=512)
    q, k, v = _inputs(2, 4, 2, 600, 700, 16, 16, torch.float64)
    _check_forward_and_backward(q, k, v, generate_alibi_bias(4), varied_window, block_mask, torch.float64)


def test_mask_mod_runs_on_partial_blocks_only():
    # A hand-made BlockMask that marks a block "full" although mask_mod would reject parts of it:
    # the blockwise path must trust the BlockMask there, as the kernels do.
    def reject_everything(b, h, q_idx, kv_idx):
        return q_idx < 0

    num = torch.tensor([[[1]]], dtype=torch.int32)
    idx = torch.tensor([[[[0]]]], dtype=torch.int32)
    block_mask = BlockMask.from_kv_blocks(num * 0, idx, num, idx, BLOCK_SIZE=64, mask_mod=reject_everything, seq_lengths=(64, 64))
    q, k, v = _inputs(1, 1, 1, 64, 64, 16, 16, torch.float64)
    out, lse, _ = _forward(q, k, v, None, reject_everything, block_mask)
    expected, expected_lse, _ = reference_attention(q, k, v)
    assert rel_err(out, expected) < 1e-12 and rel_err(lse, expected_lse) < 1e-12


# ---------------------------------------------------------------------------------------------
# Gradients into captured tensors and through the lse
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_gradient_into_captured_learnable_bias(dtype):
    B, Hq, Hkv, L, S = 2, 4, 2, 300, 517
    bias = torch.randn(Hq, L, S, dtype=torch.float64, requires_grad=True)  # golden copy
    rel_pos = torch.randn(Hq, L + S, dtype=torch.float64, requires_grad=True)

    def build(bias, rel_pos):
        def learned_bias(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx, kv_idx] + rel_pos[h, q_idx - kv_idx + S]

        return learned_bias

    q, k, v = _inputs(B, Hq, Hkv, L, S, 32, 32, dtype)
    grad_out = torch.randn(B, Hq, L, 32)

    gold_mod = build(bias, rel_pos)
    *_, golden = _reference_grads(
        q.double(), k.double(), v.double(), gold_mod, causal_mask, grad_out.double(), extra=[bias, rel_pos]
    )
    bias_d = bias.detach().to(dtype).requires_grad_()
    rel_d = rel_pos.detach().to(dtype).requires_grad_()
    same_dtype_mod = build(bias_d, rel_d)
    ref = None
    if dtype != torch.float64:
        *_, ref = _reference_grads(q, k, v, same_dtype_mod, causal_mask, grad_out.to(dtype), extra=[bias_d, rel_d])

    block_mask = create_block_mask(causal_mask, None, None, L, S, device="cpu")
    out, lse, _ = _forward(q, k, v, same_dtype_mod, causal_mask, block_mask)
    dq, dk, dv, captured_grads = _backward(q, k, v, out, lse, grad_out.to(dtype), None, same_dtype_mod, causal_mask, block_mask)
    # The captured values are the two tensors, then the number S the mod reads (no gradient).
    assert len(captured_grads) == 3 and captured_grads[2] is None
    captured_grads = captured_grads[:2]
    assert all(g is not None and g.dtype == dtype for g in captured_grads)
    names = ["dq", "dk", "dv", "d_bias", "d_rel_pos"]
    for name, g, gold, r in zip(names, [dq, dk, dv, *captured_grads], golden, ref or [None] * 5):
        _assert_close(g, gold, r, dtype, name)


def test_captured_tensor_without_grad_gets_none():
    slopes = torch.rand(4)  # does not require grad

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    q, k, v = _inputs(1, 4, 4, 100, 100, 16, 16, torch.float32)
    out, lse, _ = _forward(q, k, v, alibi, None, None)
    *_, captured_grads = _backward(q, k, v, out, lse, torch.randn_like(out), None, alibi, None, None)
    assert captured_grads == [None]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_grad_lse(dtype):
    score_mod, mask_mod, block_mask = _variant("sliding_window", 2, 4, 300, 517)
    q, k, v = _inputs(2, 4, 2, 300, 517, 32, 48, dtype)
    _check_forward_and_backward(q, k, v, score_mod, mask_mod, block_mask, dtype, grad_lse=True)


# ---------------------------------------------------------------------------------------------
# Fully masked rows
# ---------------------------------------------------------------------------------------------


def holes(b, h, q_idx, kv_idx):
    """No keys at all for the first 128 queries (an empty BlockMask row) nor for every 7th query."""
    return (q_idx >= 128) & (q_idx % 7 != 0) & (kv_idx <= q_idx)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_fully_masked_rows(dtype):
    L, S = 300, 517
    block_mask = create_block_mask(holes, None, None, L, S, device="cpu")
    assert int(block_mask.kv_num_blocks[0, 0, 0]) == 0 and int(block_mask.full_kv_num_blocks[0, 0, 0]) == 0
    score_mod = generate_alibi_bias(4)
    q, k, v = _inputs(2, 4, 2, L, S, 32, 32, dtype)
    out, lse, max_scores = _forward(q, k, v, score_mod, holes, block_mask)
    empty = (torch.arange(L) < 128) | (torch.arange(L) % 7 == 0)
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    assert torch.isneginf(lse[:, :, empty]).all() and torch.isneginf(max_scores[:, :, empty]).all()
    assert torch.isfinite(lse[:, :, ~empty]).all() and not torch.isnan(out).any()

    grads = _backward(q, k, v, out, lse, torch.randn_like(out), torch.randn_like(lse), score_mod, holes, block_mask)
    assert all(torch.isfinite(g).all() for g in grads[:3])
    assert torch.equal(grads[0][:, :, empty], torch.zeros_like(grads[0][:, :, empty]))
    _check_forward_and_backward(q, k, v, score_mod, holes, block_mask, dtype, grad_lse=True)


# ---------------------------------------------------------------------------------------------
# Memory: a 32k-token causal forward stays far from quadratic
# ---------------------------------------------------------------------------------------------

_MEMORY_SCRIPT = textwrap.dedent(
    """
    import resource, sys, time
    import torch
    from flexattn.masks import BlockMask
    from flexattn.blockwise import BlockwiseMods, blockwise_forward
    from flexattn.trace import trace_mod

    N, BLOCK = 32768, 128
    rows = N // BLOCK
    # The causal BlockMask written down directly (create_block_mask would evaluate 2^30 pairs):
    # row r has the diagonal block as its one partial block and blocks 0..r-1 as full blocks.
    r = torch.arange(rows, dtype=torch.int32)
    partial_num = torch.ones(1, 1, rows, dtype=torch.int32)
    partial_idx = r.view(1, 1, rows, 1).contiguous()
    full_num = r.view(1, 1, rows).clone()
    full_idx = r.view(1, 1, 1, rows).expand(1, 1, rows, rows).contiguous()

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                          mask_mod=causal, seq_lengths=(N, N), compute_q_blocks=False)
    mask, mask_captured = trace_mod(causal, "mask_mod")
    q, k, v = (torch.randn(1, 1, N, 64) for _ in range(3))
    mods = BlockwiseMods(None, [], mask.graph_module, mask_captured)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    out, lse, _ = blockwise_forward(q, k, v, block_mask, None, mods)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # Spot check a few rows against plain softmax attention over their prefix.
    for i in (0, 1, 4097, N - 1):
        s = (q[0, 0, i] @ k[0, 0, : i + 1].T) / 8.0
        expected = torch.softmax(s.double(), -1) @ v[0, 0, : i + 1].double()
        assert torch.allclose(out[0, 0, i].double(), expected, atol=1e-4), i
    print(f"before_kib={before} peak_kib={peak} seconds={seconds:.2f} threads={torch.get_num_threads()}")
    """
)


@pytest.mark.slow
def test_32k_causal_forward_memory():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    fields = dict(item.split("=") for item in result.stdout.split())
    peak_gib = int(fields["peak_kib"]) / 2**20
    # Dense fp32 scores alone would be 4 GiB; the blockwise path holds one row chunk (16 MiB scores).
    assert peak_gib < 2.0, f"peak RSS {peak_gib:.2f} GiB ({result.stdout.strip()})"


def test_index_arithmetic_past_int32_is_exact():
    # q_idx * 2**28 leaves int32 from q_idx = 8: the mods get int64 indices where they need them.
    from flexattn import flex_attention

    def linearised(b, h, q_idx, kv_idx):
        return ((q_idx * 2**28 + kv_idx) % 3 == 0) | (q_idx == kv_idx)

    def offset_bias(score, b, h, q_idx, kv_idx):
        return score + ((q_idx * 2**28 + kv_idx) % 7) * 0.25

    L = 96
    q, k, v = _inputs(1, 2, 2, L, L, 16, 16, torch.float64)
    block_mask = create_block_mask(linearised, 1, 1, L, L, device="cpu", BLOCK_SIZE=32)
    out = flex_attention(q, k, v, score_mod=offset_bias, block_mask=block_mask)
    ref, _, _ = reference_attention(q, k, v, score_mod=offset_bias, mask_mod=linearised)
    assert rel_err(out, ref) < TOLERANCE[torch.float64]
    # The same through the module's own entry point, which takes the dtype from its caller.
    score, score_captured, mask, mask_captured = _traced(offset_bias, linearised)
    out, _, _ = blockwise_forward(q, k, v, block_mask, None, BlockwiseMods(score, score_captured, mask, mask_captured),
                                  index_dtype=torch.int64)
    assert rel_err(out, ref) < TOLERANCE[torch.float64]


def test_api_asks_the_lowering_for_the_index_dtype(monkeypatch):
    import flexattn.lowering.ranges as index_bounds
    import flexattn.lowering.ranges as lowering
    from flexattn import flex_attention

    seen = []

    def needs_wide_indices(traced, bounds):
        seen.append((traced.kind, bounds.B, bounds.H, bounds.Q_LEN, bounds.KV_LEN))
        return True

    monkeypatch.setattr(lowering, "needs_wide_indices", needs_wide_indices, raising=False)
    monkeypatch.setattr(index_bounds, "_WIDE", type(index_bounds._WIDE)())

    def wraps_in_int32(score, b, h, q_idx, kv_idx):
        return score + ((q_idx * 2**28 + kv_idx) % 7) * 0.25

    q, k, v = _inputs(2, 4, 2, 40, 56, 16, 16, torch.float64)
    out = flex_attention(q, k, v, score_mod=wraps_in_int32, enable_gqa=True)
    assert seen == [("score_mod", 2, 4, 40, 56)]  # query batch and heads, query and key lengths
    ref, _, _ = reference_attention(q, k, v, score_mod=wraps_in_int32, enable_gqa=True)
    assert rel_err(out, ref) < TOLERANCE[torch.float64]


def test_one_row_tile_promotes_like_torch(one_thread):
    # Found by tests/test_fuzz.py: in a query tile of one row (L = 129), q_idx reached the mod as a
    # plain 0-d int32 tensor and torch's vmap compared `q_idx <= table[h]` in the table's int8, so
    # row 128 read as -128.
    table = torch.tensor([3, 100], dtype=torch.int8)

    def by_head(b, h, q_idx, kv_idx):
        return torch.where(q_idx <= table[h], kv_idx < 7, kv_idx > 3)

    q, k, v = (torch.randn(1, 2, 129, 16, dtype=torch.float64) for _ in range(3))
    block_mask = create_block_mask(by_head, 1, 2, 129, 129, device="cpu")
    out = flex_attention(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": "PYTORCH"})
    expected = reference_attention(q, k, v, mask_mod=by_head)[0]
    assert rel_err(out, expected) < 1e-12
