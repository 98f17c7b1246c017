"""The forward kernel's merge into a running result (MergingForwardKernel; [Note] Merging into the
running result in flexattn/templates/forward.py.jinja) against ``merge_into``, the merge context
parallelism otherwise runs with torch ops (flexattn/distributed/step.py).

Each case is two steps of one row of queries: keys of step 1, then keys of step 2 merged into step
1's float32 result, once by the kernel and once by ``merge_into`` of step 2's returned output.
Rows that keep no key in step 1, in step 2 or in both are in every case; the float64 reference
over both steps' keys is the golden value. On the CPU the kernels run in Triton's interpreter.
"""

import dataclasses

import pytest
import torch

from flexattn import create_block_mask
from flexattn.codegen import render
from flexattn.dispatch import forward_into, run_forward, sm90_forward_choice
from flexattn.distributed.step import merge_into
from flexattn.kernels import merging_forward_kernel
from flexattn.reference import reference_attention
from flexattn.request import build_call
from flexattn.trace import trace_mod
from flexattn.variants import CATALOGUE

pytestmark = pytest.mark.usefixtures("one_thread")

L, S1, S2, E, EV = 80, 64, 48, 16, 24  # L is no multiple of the tiles: the boundary rows are masked
BLOCK = 16


# Rows r % 5 == 0 keep no key of step 1, == 1 none of step 2, == 2 none of either; rows 0..15 (a
# whole query block, which step 2's tables list no key block for) keep none of step 2 either.
def step1_mask(b, h, q, kv):
    return (q % 5 != 0) & (q % 5 != 2) & (kv <= q)


def step2_mask(b, h, q, kv):
    return (q % 5 != 1) & (q % 5 != 2) & (kv % 3 != 0) & (q >= 16)


def no_key_in_step2(rows):
    return (rows % 5 == 1) | (rows % 5 == 2) | (rows < 16)


class Step:
    """One step's keys, its BlockMask and the Call a context-parallel step builds for it."""

    def __init__(self, q, k, v, mask_mod, score_mod, options, need_max):
        self.k, self.v = k, v
        self.block_mask = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device=q.device,
                                            BLOCK_SIZE=BLOCK)
        score, self.score_captured = trace_mod(score_mod, "score_mod") if score_mod else (None, [])
        mask, mask_captured = trace_mod(mask_mod, "mask_mod")
        self.call = build_call(q, k.shape[2], self.block_mask, score, mask, mask_captured, options,
                               q.shape[-1] ** -0.5, False, need_max)

    def forward(self, q, need_max):
        return run_forward(self.call, q, self.k, self.v, self.score_captured, True, need_max)


def two_steps(dtype, heads, kv_heads, score_mod, need_max, transposed=False, options=None, device="cpu",
              dims=(E, EV)):
    torch.manual_seed(0)
    e, ev = dims
    q = torch.randn(1, heads, L, e)
    if transposed:  # q cut from a [B, L, H, E] projection: the output (and the running one) [B, L, H, Ev]
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    k1, k2 = torch.randn(1, kv_heads, S1, e), torch.randn(1, kv_heads, S2, e)
    v1, v2 = torch.randn(1, kv_heads, S1, ev), torch.randn(1, kv_heads, S2, ev)
    q, k1, k2, v1, v2 = (t.to(device=device, dtype=dtype) for t in (q, k1, k2, v1, v2))
    options = {"BACKEND": "TRITON"} if options is None else options
    return q, Step(q, k1, v1, step1_mask, score_mod, options, need_max), Step(q, k2, v2, step2_mask, score_mod,
                                                                                options, need_max)


def running_of(result):
    """The running result a context-parallel rank keeps after a step: float32, its own copies."""
    out, lse, mx = result
    return out.float().clone(), lse.clone(), None if mx is None else mx.clone()


def golden(q, first, second, score_mod, gqa, scale=E ** -0.5):
    """The float64 reference over both steps' keys (step masks side by side)."""
    k = torch.cat([first.k, second.k], 2).double()
    v = torch.cat([first.v, second.v], 2).double()

    def both(b, h, q_idx, kv_idx):
        in_first = kv_idx < S1
        return torch.where(in_first, step1_mask(b, h, q_idx, kv_idx), step2_mask(b, h, q_idx, kv_idx - S1))

    def score(s, b, h, q_idx, kv_idx):
        return score_mod(s, b, h, q_idx, torch.where(kv_idx < S1, kv_idx, kv_idx - S1))

    return reference_attention(q.double(), k, v, score_mod=score if score_mod else None, mask_mod=both,
                               enable_gqa=gqa, scale=scale)


def rel_err(actual, expected):
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(actual))
    diff = (actual.double() - expected.double())[finite]
    return (diff.norm() / expected.double()[finite].norm().clamp_min(1e-30)).item()


BIAS = torch.randn(4, L)  # a score_mod's captured tensor (per head and query)


def biased(score, b, h, q_idx, kv_idx):
    return score + BIAS[h, q_idx]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,score_mod,need_max,transposed", [
    (2, 2, None, False, False),
    (4, 2, None, True, False),  # GQA and the row maxima
    (4, 4, biased, True, True),  # a captured tensor, and the [B, L, H, Ev] output layout
], ids=["plain", "gqa-max", "captured-transposed"])
def test_fused_merge_is_merge_into(dtype, heads, kv_heads, score_mod, need_max, transposed):
    q, first, second = two_steps(dtype, heads, kv_heads, score_mod, need_max, transposed)
    running = running_of(first.forward(q, need_max))
    before = tuple(None if t is None else t.clone() for t in running)
    separate = running_of(first.forward(q, need_max))

    assert forward_into(second.call, q, second.k, second.v, second.score_captured, running)
    out, lse, mx = second.forward(q, need_max)
    merge_into(separate[0], separate[1], out, lse)
    if need_max:
        torch.maximum(separate[2], mx, out=separate[2])

    fused_out, fused_lse, fused_max = running
    assert fused_out.dtype == torch.float32 and fused_out.stride() == before[0].stride()
    assert not torch.isnan(fused_out).any() and not torch.isnan(fused_lse).any()
    rows = torch.arange(L)
    # Rows that keep no key in step 2 keep step 1's values, bit for bit; rows of neither step are 0, -inf.
    kept = no_key_in_step2(rows)
    assert torch.equal(fused_out[:, :, kept], before[0][:, :, kept])
    assert torch.equal(fused_lse[:, :, kept], before[1][:, :, kept])
    empty = rows % 5 == 2
    assert torch.isneginf(fused_lse[:, :, empty]).all() and (fused_out[:, :, empty] == 0).all()
    assert torch.isneginf(before[1][:, :, rows % 5 == 0]).all()  # step 1 left -inf rows to merge into
    # Against merge_into: in float32 to rounding; in 16 bits merge_into reads step 2's output rounded
    # to the inputs' dtype, the kernel unrounded, so both are held to the float64 golden value.
    assert rel_err(fused_lse, separate[1]) < 1e-6
    if need_max:
        assert torch.equal(fused_max, separate[2])
    if dtype == torch.float32:
        assert rel_err(fused_out, separate[0]) < 1e-5
    else:
        want_out, want_lse, _ = golden(q, first, second, score_mod, heads != kv_heads)
        fused, unfused = rel_err(fused_out, want_out), rel_err(separate[0], want_out)
        assert fused <= unfused * 1.1 + 1e-6, (fused, unfused)
        assert rel_err(fused_lse, want_lse) < 1e-5


def test_rows_that_keep_no_key_in_either_step_stay_zero_without_nan():
    # Both sides -inf: the merged LSE is -inf, and the weights exp(-inf - 0) are 0 (no NaN).
    q, first, second = two_steps(torch.float32, 2, 2, None, False)
    running = running_of(first.forward(q, False))
    running[0].fill_(0.0)
    running[1].fill_(-float("inf"))
    nothing = Step(q, second.k, second.v, lambda b, h, q_idx, kv_idx: q_idx < 0, None, {"BACKEND": "TRITON"}, False)
    assert forward_into(nothing.call, q, nothing.k, nothing.v, [], running)
    assert torch.equal(running[0], torch.zeros_like(running[0]))
    assert torch.isneginf(running[1]).all()


def test_backends_without_the_merge_run_nothing():
    # The PyTorch backend returns its result for merge_into; so does a float64 running result.
    q, first, second = two_steps(torch.float32, 2, 2, None, False, options={"BACKEND": "PYTORCH"})
    running = running_of(first.forward(q, False))
    copy = tuple(t.clone() for t in running[:2])
    assert not forward_into(second.call, q, second.k, second.v, [], running)
    assert torch.equal(running[0], copy[0]) and torch.equal(running[1], copy[1])
    q, first, second = two_steps(torch.float32, 2, 2, None, False)
    out, lse, _ = running_of(first.forward(q, False))
    assert not forward_into(second.call, q, second.k, second.v, [], (out.double(), lse, None))


def test_the_merging_kernel_is_a_kernel_of_its_own():
    # The option renders another module (fwd_merge_*); the plain kernel's source has none of it.
    instance = CATALOGUE["alibi"].make(1, 2, 128, 128, "cpu")
    score, mask = trace_mod(instance.score_mod, "score_mod")[0], trace_mod(instance.mask_mod, "mask_mod")[0]
    merging = merging_forward_kernel(score, mask).compiled(None)
    assert merging.readable_name.startswith("fwd_merge_")
    assert "def merge_into_running(" in merging.source
    plain = render(dataclasses.replace(merging.spec, merge_into_running=False))
    assert "merge_into_running" not in plain


@pytest.mark.gpu
def test_on_a_gpu_the_gluon_forward_falls_back_and_the_portable_one_merges():
    # Where run_forward takes the Hopper Gluon forward (no merging epilogue), forward_into runs nothing
    # and the ring merges with merge_into; BACKEND='TRITON' merges in the portable kernel.
    for options in ({}, {"BACKEND": "TRITON"}):
        q, first, second = two_steps(torch.bfloat16, 2, 2, None, False, options=options, device="cuda",
                                     dims=(128, 128))
        running = running_of(first.forward(q, False))
        before = running[0].clone()
        gluon, reason = sm90_forward_choice(second.call, q, second.k, second.v, False)
        takes_gluon = not options and gluon is not None and reason is None
        merged = forward_into(second.call, q, second.k, second.v, [], running)
        assert merged is not takes_gluon
        if not merged:
            assert torch.equal(running[0], before)
            out, lse, _ = second.forward(q, False)
            merge_into(running[0], running[1], out, lse)
        want_out, want_lse, _ = golden(q, first, second, None, False, scale=128 ** -0.5)
        assert rel_err(running[0], want_out) < 1e-2 and rel_err(running[1], want_lse) < 1e-4
