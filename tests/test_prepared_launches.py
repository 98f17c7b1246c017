"""Warm eager calls launch what the long way worked out once ([Note] Prepared eager launches in
flexattn/kernels/family.py): the forward, the backward and the decode. Each test warms a problem
up, then changes one thing the prepared launch's key leaves out (or that comes back under the same
key, id or shape) and checks that the next call computes the new problem, not the prepared one's.
The decode's kept scratch ([Note] Kept scratch in flexattn/kernels/launch.py) is tested at the end.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py), so shapes are tiny.
"""

import gc
import os
import threading

import pytest
import torch
from numerics import rel_err

import flexattn.kernels.backward as bw
import flexattn.kernels.decode as dk
import flexattn.kernels.forward as rt
import flexattn.kernels.launch as kl
from flexattn import (AuxRequest, BlockMask, PagedAttention, create_block_mask, decode_block_mask, flex_attention,
                      offset_mask_mod, offset_score_mod)
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


def check(out, q, k, v, *, score_mod=None, mask_mod=None, scale=None, lse=None, tol=2e-5):
    """``out`` (and ``lse``, if given) against the float64 reference; GQA where q has more heads."""
    ref, ref_lse, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=score_mod,
                                          mask_mod=mask_mod, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    assert out.dtype == q.dtype and out.shape == ref.shape
    assert rel_err(out, ref) < tol
    if lse is not None:
        assert rel_err(lse, ref_lse) < max(tol, 1e-5)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def warm(*args, times=3, call=flex_attention, **kwargs):
    """Enough calls for the problem's launch to be prepared and served."""
    for _ in range(times):
        out = call(*args, **kwargs)
    return out


def record_launches(monkeypatch, module) -> list:
    """The keyword arguments of each launch through ``module.launch`` (recorded, then launched as
    usual)."""
    seen = []
    real = module.launch

    def recording_launch(jit_fn, grid, args, constexprs):
        seen.append(dict(zip(jit_fn.arg_names, args)))
        return real(jit_fn, grid, args, constexprs)

    monkeypatch.setattr(module, "launch", recording_launch)
    return seen


@pytest.fixture
def launched(monkeypatch):
    """The keyword arguments of each forward launch."""
    return record_launches(monkeypatch, rt)


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


# ------------------------------------------------------------------------------------ the decode
# [Note] Prepared decode launches in flexattn/kernels/decode.py: a decode key is prepared after its
# second long-way call, so three calls reach the prepared launch.

DECODE = {"BACKEND": "TRITON_DECODE"}
TWO_SPLITS = {"BACKEND": "TRITON_DECODE", "DECODE_NUM_SPLITS": 2}  # a merge launch too


def decode_inputs(Hq=4, Hkv=2, S=80, dtype=torch.float32, L=1):
    q = torch.randn(1, Hq, L, D, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(1, Hkv, S, D, device=DEVICE, dtype=dtype) for _ in range(2))
    return q, k, v


def decode(q, k, v, options=TWO_SPLITS, lse=False, **kwargs):
    """``out``, or ``(out, lse)``, of the decode kernels (checked to be them)."""
    before = dk.launches
    out = flex_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], kernel_options=options,
                         return_aux=AuxRequest(lse=True) if lse else None, **kwargs)
    assert dk.launches == before + 1, "the decode kernels did not run"
    if lse:
        assert out[1].lse is not None, "no LSE for a call that asked for it"
        return out[0], out[1].lse
    return out


def warm_decode(*args, times=3, **kwargs):
    return warm(*args, times=times, call=decode, **kwargs)


def latest_decode_kernel():
    return next(reversed(dk._kernels.values()))


@pytest.fixture
def decode_launched(monkeypatch):
    """The keyword arguments of each decode launch."""
    return record_launches(monkeypatch, dk)


@pytest.mark.parametrize("options", [DECODE, TWO_SPLITS], ids=["one split", "two splits"])
@pytest.mark.parametrize("lse", [False, True], ids=["out", "out and lse"])
def test_warm_decode_calls_are_served_prepared_with_the_long_ways_bits(one_thread, options, lse):
    q, k, v = decode_inputs()
    slopes = torch.randn(4, device=DEVICE)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    decode(q, k, v, options, lse, score_mod=alibi)
    kernel = latest_decode_kernel()
    kernel._plans.clear()  # the kernel may hold earlier tests' problems too
    kernel._prepared.clear()
    first = decode(q, k, v, options, lse, score_mod=alibi)
    assert not kernel._prepared  # one long-way call prepares nothing (a growing cache would not reuse it)
    second = decode(q, k, v, options, lse, score_mod=alibi)
    assert len(kernel._prepared) == 1
    served = kernel.prepared_calls
    third = decode(q, k, v, options, lse, score_mod=alibi)
    assert kernel.prepared_calls == served + 1, "the warm call did not take the prepared launch"
    for long_way in (first, second):
        for got, want in zip(third if lse else (third,), long_way if lse else (long_way,)):
            assert torch.equal(got, want)
    assert kernel.last_plan.constexprs("partial")["NUM_SPLITS"] == (2 if options is TWO_SPLITS else 1)
    check(third[0] if lse else third, q, k, v, score_mod=alibi, lse=third[1] if lse else None)


def test_a_new_decode_scale_of_the_same_sign_is_launched(one_thread, decode_launched):
    q, k, v = decode_inputs()
    warm_decode(q, k, v, scale=0.5)
    served = latest_decode_kernel().prepared_calls
    out = decode(q, k, v, scale=0.125)
    assert decode_launched[-2]["SM_SCALE"] == 0.125  # the partial launch (the merge follows)
    check(out, q, k, v, scale=0.125)
    assert latest_decode_kernel().prepared_calls == served  # not served: the long way ran
    # 0.0 and -0.0 compare equal but are different arguments: each is launched as given.
    warm_decode(q, k, v, scale=0.0)
    decode(q, k, v, scale=-0.0)
    assert str(decode_launched[-2]["SM_SCALE"]) == "-0.0"


def test_a_replaced_decode_plan_is_launched_not_the_prepared_one(one_thread):
    q, k, v = decode_inputs()
    warm_decode(q, k, v)
    kernel = latest_decode_kernel()
    key, plan = next((k_, p) for k_, p in kernel._plans.items() if p is kernel.last_plan)
    assert key in kernel._prepared
    smaller = kernel._smaller_plan(plan, {})  # what the resource fallback puts in its place
    kernel._plans[key] = smaller
    out = decode(q, k, v)
    assert kernel.last_plan is smaller
    check(out, q, k, v)


def test_a_decode_mods_number_and_tensors_changed_after_warm_calls(one_thread):
    q, k, v = decode_inputs()
    bias = {"slope": 0.5}
    table = torch.randn(4, device=DEVICE)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + bias["slope"] * table[h] * (kv_idx - q_idx)

    warm_decode(q, k, v, score_mod=alibi)
    kernel = latest_decode_kernel()
    served = kernel.prepared_calls
    bias["slope"] = -2.0  # a Python number in the closure
    check(decode(q, k, v, score_mod=alibi), q, k, v, score_mod=alibi)
    table.mul_(3)  # in place
    check(decode(q, k, v, score_mod=alibi), q, k, v, score_mod=alibi)
    table = torch.randn(4, device=DEVICE)  # another tensor under the same name
    check(decode(q, k, v, score_mod=alibi), q, k, v, score_mod=alibi)
    for _ in range(5):  # freed, then another one, often at the freed one's id and address
        old = id(table)
        table = None
        gc.collect()
        table = torch.randn(4, device=DEVICE)
        check(decode(q, k, v, score_mod=alibi), q, k, v, score_mod=alibi)
        if id(table) == old:
            break
    assert kernel.prepared_calls > served  # the same problem throughout: the checks ran on prepared launches


def test_decode_tables_changed_in_place_after_warm_calls(one_thread):
    q, k, v = decode_inputs(S=64)

    def before(b, h, q_idx, kv_idx):
        return kv_idx < 40

    def after(b, h, q_idx, kv_idx):
        return kv_idx >= 24

    bm = create_block_mask(before, 1, 1, 1, 64, device=DEVICE, BLOCK_SIZE=BLOCK)
    warm_decode(q, k, v, block_mask=bm)
    other = create_block_mask(after, 1, 1, 1, 64, device=DEVICE, BLOCK_SIZE=BLOCK)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        getattr(bm, name).copy_(getattr(other, name))  # same objects and shapes; new contents
    bm.mask_mod = after
    check(decode(q, k, v, block_mask=bm), q, k, v, mask_mod=after)


def test_decode_index_tables_of_another_width_after_warm_calls(one_thread, decode_launched):
    # The same row table, a wider index table: IDX_COLS must be the call's own.
    q, k, v = decode_inputs(S=64)

    def near(b, h, q_idx, kv_idx):
        return kv_idx < 40

    bm = create_block_mask(near, 1, 1, 1, 64, device=DEVICE, BLOCK_SIZE=BLOCK)
    warm_decode(q, k, v, block_mask=bm)
    pad = torch.zeros_like(bm.kv_indices)
    wide = BlockMask.from_kv_blocks(bm.kv_num_blocks, torch.cat([bm.kv_indices, pad], -1), bm.full_kv_num_blocks,
                                    torch.cat([bm.full_kv_indices, pad], -1), BLOCK_SIZE=BLOCK, mask_mod=near,
                                    seq_lengths=(1, 64))
    out = decode(q, k, v, block_mask=wide)
    assert decode_launched[-2]["IDX_COLS"] == wide.kv_indices.shape[3] == 2 * bm.kv_indices.shape[3]
    check(out, q, k, v, mask_mod=near)


def test_decode_with_freed_tensors_other_layouts_and_dtypes(one_thread):
    q, k, v = decode_inputs()
    warm_decode(q, k, v)
    for _ in range(3):  # new tensors each step, often at a freed one's id and address
        del q, k, v
        gc.collect()
        q, k, v = decode_inputs()
        check(decode(q, k, v), q, k, v)
    # The same shapes in other layouts: q cut from [B, L, H, E] storage (the output follows it), and
    # a key/value cache stored [B, S, H, E]. Two query rows, so that the layouts differ.
    q, k, v = decode_inputs(L=2)
    warm_decode(q, k, v)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    for args in ((qt, k, v), (q, kt, vt), (qt, kt, vt), (q, k, v)):
        out = warm_decode(*args)
        assert (out.transpose(1, 2) if args[0] is qt else out).is_contiguous()
        check(out, *args)
    # Other dtypes of the same shapes: float16, bfloat16, then a float16 cache read by a bfloat16
    # query (mixed dtypes: converted as loaded).
    qh, kh, vh = (t.half() for t in (q, k, v))
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    for args, tol in (((qh, kh, vh), 2e-3), ((qb, kb, vb), 2e-2), ((qb, kh, vh), 2e-2)):
        out = warm_decode(*args)
        assert out.dtype == args[0].dtype
        check(out, args[0], args[1].to(args[0].dtype), args[2].to(args[0].dtype), tol=tol)
    assert latest_decode_kernel().prepared_calls > 0


def test_decode_gqa_heads_options_and_lse_after_warm_calls(one_thread):
    q, k, v = decode_inputs(Hq=4, Hkv=2)
    warm_decode(q, k, v)
    for Hkv in (4, 1):  # enable_gqa follows (decode passes it when the heads differ)
        _, k2, v2 = decode_inputs(Hq=4, Hkv=Hkv)
        check(warm_decode(q, k2, v2), q, k2, v2)
    # kernel_options: another split count is another plan.
    out = decode(q, k, v, {"BACKEND": "TRITON_DECODE", "DECODE_NUM_SPLITS": 3})
    assert latest_decode_kernel().last_plan.constexprs("partial")["NUM_SPLITS"] == 3
    check(out, q, k, v)
    warm_decode(q, k, v, DECODE)
    assert latest_decode_kernel().last_plan.constexprs("partial")["NUM_SPLITS"] == 1
    # return_aux: the LSE after warm calls without it, then none again.
    out, lse = decode(q, k, v, lse=True)
    check(out, q, k, v, lse=lse)
    out, lse = warm_decode(q, k, v, lse=True)
    check(out, q, k, v, lse=lse)
    out = decode(q, k, v)
    assert isinstance(out, torch.Tensor)
    check(out, q, k, v)


def test_a_growing_kv_cache_is_a_new_decode_problem_at_each_step(one_thread, decode_launched):
    # A cache of 96 slots, read as its first S (views with the cache's strides): the KV length is all
    # that changes from step to step.
    q, k_cache, v_cache = decode_inputs(S=96)
    slopes = torch.randn(4, device=DEVICE)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    for S in (40, 40, 40, 41, 41, 41, 57, 96):
        k, v = k_cache[:, :, :S], v_cache[:, :, :S]
        out = decode(q, k, v, score_mod=alibi)
        assert decode_launched[-2]["KV_LEN"] == S
        check(out, q, k, v, score_mod=alibi)
        q = torch.randn_like(q)
    assert latest_decode_kernel().prepared_calls > 0


def test_a_paged_cache_decodes_prepared_with_its_tables_read_at_each_step(one_thread):
    # A decoding loop over a paged cache (tests/test_paged_attention.py): the cache's shape stays, so
    # steps share a key, while pages are reserved, erased and reassigned under it.
    H, page_size, max_len, slots = 2, 16, 64, 12 * 16
    lengths = [13, 29]  # both cross into a new page and key block at step 3
    rows = torch.tensor([1, 0])
    B = len(lengths)
    q_all, k_all, v_all = (torch.randn(B, H, max_len, D) for _ in range(3))
    paged = PagedAttention(n_pages=12, page_size=page_size, max_batch_size=3, device="cpu")
    k_cache, v_cache = torch.randn(1, H, slots, D), torch.randn(1, H, slots, D)

    def write(row, b, start, end):
        paged.reserve(row, end)
        pos = torch.arange(start, end)[None]
        paged.assign(torch.tensor([row]), pos, k_all[b:b + 1, :, start:end], v_all[b:b + 1, :, start:end],
                     k_cache, v_cache)

    for b, (row, length) in enumerate(zip(rows.tolist(), lengths)):
        write(row, b, 0, length)
    logical = create_block_mask(causal, None, None, max_len, max_len, device="cpu", BLOCK_SIZE=BLOCK)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - 0.1 * (h + 1) * (q_idx - kv_idx).abs()

    pos = torch.tensor(lengths)
    kernel = None
    for step in range(7):
        if step == 5:  # sequence 0 starts again on other pages: erased, its pages taken by row 2, new ones
            paged.erase(int(rows[0]))
            paged.reserve(2, 2 * page_size)
            k_all[0].normal_()
            v_all[0].normal_()
            write(int(rows[0]), 0, 0, int(pos[0]))
        for b, row in enumerate(rows.tolist()):
            write(row, b, int(pos[b]), int(pos[b]) + 1)
        kv_len = pos + 1
        mask = paged.convert_logical_block_mask(decode_block_mask(logical, pos, kv_lengths=kv_len), rows, kv_len)
        score = paged.get_score_mod(offset_score_mod(alibi, pos), batch_idx=rows)
        q = torch.stack([q_all[b][:, pos[b]] for b in range(B)])[:, :, None]
        out = decode(q, k_cache, v_cache, DECODE, score_mod=score, block_mask=mask)
        for b in range(B):
            ref, _, _ = reference_attention(
                q[b:b + 1].double(), k_all[b:b + 1, :, :kv_len[b]].double(), v_all[b:b + 1, :, :kv_len[b]].double(),
                score_mod=offset_score_mod(alibi, pos[b]), mask_mod=offset_mask_mod(causal, pos[b]))
            assert rel_err(out[b:b + 1], ref) < 2e-5, (step, b)
        kernel = latest_decode_kernel()
        pos += 1
    assert kernel.prepared_calls > 0, "the steps never took the prepared launch: the test would not exercise it"


def test_a_prepared_decode_launch_the_compiler_refuses_steps_down_the_long_way(one_thread, monkeypatch):
    from triton.runtime.errors import OutOfResources

    q, k, v = decode_inputs()
    warm_decode(q, k, v, scale=0.3)
    kernel = latest_decode_kernel()
    refused = kernel.last_plan.constexprs("partial")
    real = dk.launch

    def tight(jit_fn, grid, args, constexprs):
        if constexprs is refused:
            raise OutOfResources(400_000, 232_448, "shared memory")
        return real(jit_fn, grid, args, constexprs)

    monkeypatch.setattr(dk, "launch", tight)
    out = decode(q, k, v, scale=0.3)
    assert kernel.last_plan.constexprs("partial") is not refused
    check(out, q, k, v, scale=0.3)


# ------------------------------------------------------------------------------------ kept scratch


@pytest.fixture
def streams(monkeypatch):
    """The CUDA stream and capture queries of kernels/launch.py, stood in for on the CPU."""
    state = type("State", (), {"stream": 1, "capturing": False})()
    monkeypatch.setattr(kl, "stream_key", lambda device: state.stream)
    monkeypatch.setattr(kl, "may_keep_allocations", lambda device: not state.capturing)
    monkeypatch.setattr(kl._kept_scratch, "sets", {}, raising=False)
    return state


SHAPES = ((8, 16), (8,), (8,))


def test_scratch_is_kept_per_stream_and_shape(streams):
    first = kl.kept_scratch(SHAPES, torch.float32, "cpu")
    assert [tuple(t.shape) for t in first] == [(8, 16), (8,), (8,)]
    assert all(a is b for a, b in zip(first, kl.kept_scratch(SHAPES, torch.float32, "cpu")))
    other = kl.kept_scratch(((4, 16), (4,), (4,)), torch.float32, "cpu")
    assert not any(a.data_ptr() == b.data_ptr() for a in first for b in other)
    streams.stream = 2  # another stream runs unordered with the first: its own set
    on_two = kl.kept_scratch(SHAPES, torch.float32, "cpu")
    assert not any(a is b for a in first for b in on_two)
    streams.stream = 1
    assert kl.kept_scratch(SHAPES, torch.float32, "cpu")[0] is first[0]


def test_scratch_is_kept_per_thread(streams):
    # Two threads on one stream could interleave one call's partial launch and the other's merge.
    mine = kl.kept_scratch(SHAPES, torch.float32, "cpu")
    theirs = []
    worker = threading.Thread(target=lambda: theirs.append(kl.kept_scratch(SHAPES, torch.float32, "cpu")))
    worker.start()
    worker.join()
    assert not any(a is b for a in mine for b in theirs[0])


def test_no_scratch_is_kept_where_the_cuda_graph_rules_forbid_it(streams):
    streams.capturing = True  # a capture, or a graph tree's stream (flexattn/cuda_graphs.py)
    first = kl.kept_scratch(SHAPES, torch.float32, "cpu")
    again = kl.kept_scratch(SHAPES, torch.float32, "cpu")
    assert not any(a is b for a in first for b in again)
    assert not kl._kept_scratch.sets
    streams.capturing = False
    kept = kl.kept_scratch(SHAPES, torch.float32, "cpu")
    assert not any(a is b for a in first + again for b in kept)


def test_kept_scratch_is_poisoned_again_at_each_call(streams, monkeypatch):
    monkeypatch.setattr(kl, "_POISON_OUTPUTS", True)
    acc, m, l_ = kl.kept_scratch(SHAPES, torch.float32, "cpu")
    acc.zero_()
    m.zero_()
    again = kl.kept_scratch(SHAPES, torch.float32, "cpu")
    assert again[0] is acc and torch.isnan(acc).all() and torch.isnan(m).all()
