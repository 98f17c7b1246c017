"""Warm eager calls launch what the long way worked out once ([Note] Prepared eager launches in
flexattn/kernels/forward.py). Each test warms a problem up, then changes one thing the prepared
launch's key leaves out (or that comes back under the same key, id or shape) and checks that the
next call computes the new problem, not the prepared one's.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py), so shapes are tiny.
"""

import gc
import os

import pytest
import torch
from numerics import rel_err

import flexattn.kernels.forward as rt
from flexattn import BlockMask, create_block_mask, flex_attention
from flexattn.reference import reference_attention

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="the Triton backend on CPU tensors needs TRITON_INTERPRET=1",
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = {"BACKEND": "TRITON"}
L, D, BLOCK = 32, 16, 16


def qkv(dtype=torch.float32, H=2):
    return tuple(torch.randn(1, H, L, D, device=DEVICE, dtype=dtype) for _ in range(3))


def check(out, q, k, v, *, score_mod=None, mask_mod=None, scale=None, tol=2e-5):
    ref, _, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=score_mod, mask_mod=mask_mod,
                                    scale=scale)
    assert rel_err(out, ref) < tol


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def warm(*args, times=3, **kwargs):
    """Enough calls for the problem's launch to be prepared and served."""
    for _ in range(times):
        out = flex_attention(*args, **kwargs)
    return out


@pytest.fixture
def launched(monkeypatch):
    """The keyword arguments of each forward launch (recorded, then launched as usual)."""
    seen = []
    real = rt.launch

    def recording_launch(jit_fn, grid, args, constexprs):
        seen.append(dict(zip(jit_fn.arg_names, args)))
        return real(jit_fn, grid, args, constexprs)

    monkeypatch.setattr(rt, "launch", recording_launch)
    return seen


def _served(kernel) -> int:
    return len(kernel._prepared)


def test_warm_calls_are_served_prepared_and_give_the_long_ways_result(one_thread):
    q, k, v = qkv()
    bm = create_block_mask(causal, 1, 1, L, L, device=DEVICE, BLOCK_SIZE=BLOCK)
    flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON)
    kernel = rt._kernels[next(reversed(rt._kernels))]
    kernel._prepared.clear()  # the kernel may serve earlier tests' problems too
    first = flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON)
    assert _served(kernel) == 1  # prepared after the long way ran
    again = flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON)
    assert torch.equal(first, again)
    check(again, q, k, v, mask_mod=causal)


def test_a_new_scale_of_the_same_sign_is_launched(one_thread, launched):
    q, k, v = qkv()
    warm(q, k, v, scale=0.5, kernel_options=TRITON)
    out = flex_attention(q, k, v, scale=0.125, kernel_options=TRITON)
    assert launched[-1]["SM_SCALE"] == 0.125
    check(out, q, k, v, scale=0.125)
    # 0.0 and -0.0 compare equal but are different arguments: each is launched as given.
    warm(q, k, v, scale=0.0, kernel_options=TRITON)
    flex_attention(q, k, v, scale=-0.0, kernel_options=TRITON)
    assert str(launched[-1]["SM_SCALE"]) == "-0.0"


def test_index_tables_of_another_width_under_the_same_key(one_thread, launched):
    # Two masks with the same row table and statistics (so the same plan key), one with a wider
    # index table: IDX_COLS must be the call's own.
    q, k, v = qkv()
    bm = create_block_mask(causal, 1, 1, L, L, device=DEVICE, BLOCK_SIZE=BLOCK)
    warm(q, k, v, block_mask=bm, kernel_options=TRITON)
    assert launched[-1]["IDX_COLS"] == bm.kv_indices.shape[3]
    pad = torch.zeros_like(bm.kv_indices)
    wide = BlockMask.from_kv_blocks(bm.kv_num_blocks, torch.cat([bm.kv_indices, pad], -1), bm.full_kv_num_blocks,
                                    torch.cat([bm.full_kv_indices, pad], -1), BLOCK_SIZE=BLOCK, mask_mod=causal,
                                    seq_lengths=(L, L))
    out = flex_attention(q, k, v, block_mask=wide, kernel_options=TRITON)
    assert launched[-1]["IDX_COLS"] == wide.kv_indices.shape[3] == 2 * bm.kv_indices.shape[3]
    check(out, q, k, v, mask_mod=causal)


def test_a_replaced_plan_is_launched_not_the_prepared_one(one_thread):
    q, k, v = qkv()
    warm(q, k, v, kernel_options=TRITON)
    kernel = rt._kernels[next(reversed(rt._kernels))]
    key, plan = next((k_, p) for k_, p in kernel._plans.items() if p is kernel.last_plan)
    assert key in kernel._prepared
    smaller = kernel._smaller_plan(plan, {})  # what the resource fallback puts in its place
    kernel._plans[key] = smaller
    out = flex_attention(q, k, v, kernel_options=TRITON)
    assert kernel.last_plan is smaller
    check(out, q, k, v)


def test_tables_changed_in_place_after_warm_calls(one_thread):
    q, k, v = qkv()
    bm = create_block_mask(causal, 1, 1, L, L, device=DEVICE, BLOCK_SIZE=BLOCK)
    warm(q, k, v, block_mask=bm, kernel_options=TRITON)

    def anti(b, h, q_idx, kv_idx):
        return q_idx <= kv_idx

    other = create_block_mask(anti, 1, 1, L, L, device=DEVICE, BLOCK_SIZE=BLOCK)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        getattr(bm, name).copy_(getattr(other, name))  # same objects, shapes and statistics; new contents
    bm.mask_mod = anti
    check(flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON), q, k, v, mask_mod=anti)


def test_a_mods_number_and_tensor_changed_after_warm_calls(one_thread):
    q, k, v = qkv()
    bias = {"slope": 0.5}
    table = torch.randn(2, device=DEVICE)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + bias["slope"] * table[h] * (kv_idx - q_idx)

    warm(q, k, v, score_mod=alibi, kernel_options=TRITON)
    bias["slope"] = -2.0
    check(flex_attention(q, k, v, score_mod=alibi, kernel_options=TRITON), q, k, v, score_mod=alibi)
    table.mul_(3)  # in place
    check(flex_attention(q, k, v, score_mod=alibi, kernel_options=TRITON), q, k, v, score_mod=alibi)
    table = torch.randn(2, device=DEVICE)  # another tensor of the same shape under the same name
    check(flex_attention(q, k, v, score_mod=alibi, kernel_options=TRITON), q, k, v, score_mod=alibi)


def test_freed_tensors_and_other_layouts_dtypes_and_grad_flags(one_thread, collect_new_objects_only):
    q, k, v = qkv()
    warm(q, k, v, kernel_options=TRITON)
    for _ in range(3):  # new tensors each step, often at a freed one's id and address
        del q, k, v
        gc.collect()
        q, k, v = qkv()
        check(flex_attention(q, k, v, kernel_options=TRITON), q, k, v)
    # The same shape in another layout: [B, L, H, E] storage seen as [B, H, L, E].
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    out = flex_attention(qt, kt, vt, kernel_options=TRITON)
    assert out.stride() == torch.empty(1, L, 2, D).transpose(1, 2).stride()
    check(out, q, k, v)
    # Another dtype.
    qh, kh, vh = (t.half() for t in (q, k, v))
    out = flex_attention(qh, kh, vh, kernel_options=TRITON)
    assert out.dtype == torch.float16
    check(out, qh, kh, vh, tol=2e-3)
    # requires_grad flipped on: the forward of training, then a correct backward.
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = flex_attention(qg, kg, vg, kernel_options=TRITON)
    check(out, q, k, v)
    out.backward(torch.ones_like(out))
    qd, kd, vd = (t.double().requires_grad_(True) for t in (q, k, v))
    ref, _, _ = reference_attention(qd, kd, vd)
    ref.backward(torch.ones_like(ref))
    for got, want in ((qg.grad, qd.grad), (kg.grad, kd.grad), (vg.grad, vd.grad)):
        assert rel_err(got, want) < 1e-4


# ------------------------------------------------------------------------------------ the backward

import flexattn.kernels.backward as bw  # noqa: E402


def grads_of(q, k, v, reference=False, **kwargs):
    """``(out, dq, dk, dv)`` for the gradient of out * weights, by flex_attention or the reference."""
    leaves = [t.detach().double() if reference else t.detach().clone() for t in (q, k, v)]
    for t in leaves:
        t.requires_grad_(True)
    if reference:
        out, _, _ = reference_attention(*leaves, **kwargs)
    else:
        out = flex_attention(*leaves, kernel_options=TRITON, **kwargs)
    weights = torch.linspace(-1, 1, out.numel(), device=DEVICE, dtype=out.dtype).view(out.shape)
    out.backward(weights)
    return (out, *(t.grad for t in leaves))


def check_grads(q, k, v, tol=1e-4, **kwargs):
    for got, want in zip(grads_of(q, k, v, **kwargs), grads_of(q, k, v, reference=True, **kwargs)):
        assert rel_err(got, want) < tol


def test_backward_warm_calls_and_what_their_key_leaves_out(one_thread, monkeypatch):
    seen = []
    real = bw.launch

    def recording_launch(jit_fn, grid, args, constexprs):
        seen.append(dict(zip(jit_fn.arg_names, args)))
        return real(jit_fn, grid, args, constexprs)

    monkeypatch.setattr(bw, "launch", recording_launch)
    q, k, v = qkv()
    bm = create_block_mask(causal, 1, 1, L, L, device=DEVICE, BLOCK_SIZE=BLOCK)
    for _ in range(3):
        grads_of(q, k, v, block_mask=bm, scale=0.5)
    kernel = bw._kernels[next(reversed(bw._kernels))]
    assert kernel._prepared, "the warm calls were not prepared: the test would not exercise them"
    before = bw.launches
    grads_of(q, k, v, block_mask=bm, scale=0.5)
    assert bw.launches == before + 1  # the prepared launches count as the long way's do

    def check_masked(bm, mask_mod, scale=0.5):
        for got, want in zip(grads_of(q, k, v, block_mask=bm, scale=scale),
                             _reference_grads(q, k, v, mask_mod, scale)):
            assert rel_err(got, want) < 1e-4

    check_masked(bm, causal, scale=0.25)  # a new scale of the same sign
    assert seen[-1]["SM_SCALE"] == 0.25
    # Wider index tables under the same plan key.
    pad = torch.zeros_like(bm.kv_indices)
    wide = BlockMask.from_kv_blocks(bm.kv_num_blocks, torch.cat([bm.kv_indices, pad], -1), bm.full_kv_num_blocks,
                                    torch.cat([bm.full_kv_indices, pad], -1), BLOCK_SIZE=BLOCK, mask_mod=causal,
                                    seq_lengths=(L, L))
    check_masked(wide, causal, scale=0.25)  # the scale of the call before: only the widths differ
    assert seen[-1]["IDX_COLS"] == wide.kv_indices.shape[3]
    # Tables changed in place: the transposed tables are derived again, the launch reads them.

    def anti(b, h, q_idx, kv_idx):
        return q_idx <= kv_idx

    other = create_block_mask(anti, 1, 1, L, L, device=DEVICE, BLOCK_SIZE=BLOCK)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        getattr(bm, name).copy_(getattr(other, name))
    bm.mask_mod = anti
    check_masked(bm, anti)
    # A replaced plan (of the family of the mask's new mask_mod, the latest used).
    kernel = bw._kernels[next(reversed(bw._kernels))]
    key, plan = next((k_, p) for k_, p in kernel._plans.items() if p is kernel.last_plan)
    assert key in kernel._prepared
    kernel._plans[key] = other_plan = plan._replace()  # another object: what a fallback or the replan rule puts there
    check_masked(bm, anti)
    assert kernel.last_plan is other_plan


def _reference_grads(q, k, v, mask_mod, scale):
    return grads_of(q, k, v, reference=True, mask_mod=mask_mod, scale=scale)


def test_backward_with_a_mods_tensor_changed_and_then_learnt(one_thread):
    q, k, v = qkv()
    table = torch.randn(2, device=DEVICE)

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[h] * (kv_idx - q_idx)

    for _ in range(3):
        grads_of(q, k, v, score_mod=bias)
    table.mul_(-2)  # in place
    check_grads(q, k, v, score_mod=bias)
    table = torch.randn(2, device=DEVICE, requires_grad=True)  # now learnt: its gradient too
    out = flex_attention(q, k, v, score_mod=bias, kernel_options=TRITON)
    out.sum().backward()
    ref_table = table.detach().double().requires_grad_(True)

    def ref_bias(score, b, h, q_idx, kv_idx):
        return score + ref_table[h] * (kv_idx - q_idx)

    ref, _, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=ref_bias)
    ref.sum().backward()
    assert rel_err(table.grad, ref_table.grad) < 1e-4


def test_a_prepared_launch_the_compiler_refuses_steps_down_the_long_way(one_thread, monkeypatch):
    # [Note] Resource fallback: a prepared launch that runs out of resources is dropped, and the long
    # way plans smaller tiles, as at a first launch.
    from triton.runtime.errors import OutOfResources

    q, k, v = qkv()
    warm(q, k, v, scale=0.3, kernel_options=TRITON)
    kernel = rt._kernels[next(reversed(rt._kernels))]
    refused = kernel.last_plan.constexprs("forward")
    real = rt.launch

    def tight(jit_fn, grid, args, constexprs):
        if constexprs is refused:
            raise OutOfResources(400_000, 232_448, "shared memory")
        return real(jit_fn, grid, args, constexprs)

    monkeypatch.setattr(rt, "launch", tight)
    out = flex_attention(q, k, v, scale=0.3, kernel_options=TRITON)
    assert kernel.last_plan.constexprs("forward") is not refused
    check(out, q, k, v, scale=0.3)
