"""Calls on a stream of their own, as a serving loop runs them, and captures that outlive what was
kept (flexattn/cuda_graphs.py). GPU only."""

import pytest
import torch
from numerics import rel_err

from flexattn import create_block_mask, flex_attention
from flexattn.reference import reference_attention

pytestmark = pytest.mark.gpu


def _allocations_per_call(step, calls: int = 6) -> float:
    for _ in range(3):  # warm: traces, kernels, plans and what each stream keeps
        step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    return (torch.cuda.memory_stats()["allocation.all.allocated"] - before) / calls


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("case", ["no mask", "mask and score_mod", "training", "compiled training", "decode"])
def test_a_side_streams_steady_state_allocates_what_the_default_streams_does(case):
    torch.manual_seed(0)
    B, H, L, D = 2, 4, 1024, 128
    grad = case in ("training", "compiled training")
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
    block_mask = create_block_mask(_causal, None, None, L, L, device="cuda")
    def shifted(score, b, h, q_idx, kv_idx):
        return score + torch.tensor([0.25, -0.5, 0.75, 0.0])[h]  # the mod's own constant: copied to the device once

    attend = torch.compile(flex_attention, fullgraph=True) if case == "compiled training" else flex_attention

    # A decode step with two splits: its partials' scratch is kept per stream and thread ([Note] Kept
    # scratch in flexattn/kernels/launch.py).
    q1 = torch.randn(1, 16, 1, 64, device="cuda", dtype=torch.bfloat16)
    k1, v1 = (torch.randn(1, 2, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    decode = {"BACKEND": "TRITON_DECODE", "DECODE_NUM_SPLITS": 2}

    def step():
        if case == "no mask":
            return flex_attention(q, k, v)
        if case == "decode":
            return flex_attention(q1, k1, v1, enable_gqa=True, kernel_options=decode)
        out = attend(q, k, v, score_mod=shifted, block_mask=block_mask)
        if grad:
            out.sum().backward()
            for t in (q, k, v):
                t.grad = None
        return None

    on_default = _allocations_per_call(step)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = _allocations_per_call(step)
    torch.cuda.current_stream().wait_stream(side)
    assert on_side == on_default, f"{case}: {on_side} allocations per call on a side stream, {on_default} on the default"
    if case == "decode":
        assert on_default == 1, f"a decode step allocates its output only, got {on_default} allocations per call"


def test_a_capture_does_not_point_at_a_kept_mask_that_is_evicted_later():
    # A graph keeps raw pointers: the all-full mask a capture reads must be the graph's own, not one
    # kept for the stream, which other lengths evict (64 are kept) and whose memory is then reused.
    torch.manual_seed(0)
    B, H, L, D = 1, 2, 384, 64
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            flex_attention(q, k, v)  # keeps the all-full mask of (384, 384) for this stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            static = flex_attention(q, k, v)
        for n in range(70):  # other lengths evict the kept mask
            s = 128 + 16 * n
            flex_attention(q, k[:, :, :1].expand(B, H, s, D).contiguous(), v[:, :, :1].expand(B, H, s, D).contiguous())
        junk = [torch.full((1 << 16,), 123456789, dtype=torch.int32, device="cuda") for _ in range(64)]
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        static.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    del junk
    expected = reference_attention(q.double(), k.double(), v.double())[0]
    assert torch.isfinite(static).all()
    assert torch.equal(static, flex_attention(q, k, v))
    assert rel_err(static, expected) < 2e-2


def test_a_stream_does_not_read_tables_another_stream_is_still_deriving():
    # Two streams share a BlockMask. The first training call on stream A derives the backward's
    # transposed tables on A, behind a long kernel; a call on stream B right after must not read
    # them before A wrote them (BlockMask's derived data carries a StreamMark).
    torch.manual_seed(0)
    B, H, L, D = 2, 4, 2048, 64
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    block_mask = create_block_mask(_causal, None, None, L, L, device="cuda")
    with torch.no_grad():
        flex_attention(q, k, v, block_mask=block_mask)  # the forward's checks (a host sync) before the race
    torch.cuda.synchronize()
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(first):
        torch.cuda._sleep(200_000_000)  # about 0.1 s: the derivation queued behind it
        flex_attention(q, k, v, block_mask=block_mask).backward(grad_out)
    with torch.cuda.stream(second):
        q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
        flex_attention(q2, k2, v2, block_mask=block_mask).backward(grad_out)
    torch.cuda.synchronize()
    expected = reference_attention(q.double(), k.double(), v.double(), mask_mod=_causal)[0]
    want = torch.autograd.grad(expected, (q, k, v), grad_out.double())
    for name, got, ref in zip(("dq", "dk", "dv"), (q2.grad, k2.grad, v2.grad), want):
        assert rel_err(got, ref) < 2e-2, f"{name} on the second stream"
