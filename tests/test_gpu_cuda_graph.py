"""A decoding step captured in a CUDA graph and replayed (issue 10, item 4). GPU only.

The step reads everything that changes between tokens from tensors (the query, the cache, the
position of the token, each sequence's valid length), so one capture serves every later step: the
replay must give what an eager call gives on the same inputs.
"""

import pytest
import torch
from numerics import rel_err

from flexattn import BlockMask, create_block_mask, flex_attention
from flexattn.reference import reference_attention

pytestmark = pytest.mark.gpu


def _decode_step_problem(B=4, Hq=16, Hkv=2, S=4096, D=64):
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    lengths = torch.full((B,), S // 2, device="cuda", dtype=torch.int32)  # valid cache slots per sequence
    slopes = torch.exp2(-8.0 * torch.arange(1, Hq + 1, device="cuda", dtype=torch.float32) / Hq)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - (lengths[b] - 1))  # the query sits at position lengths[b] - 1

    def in_cache(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    # Every key block listed as partial, so in_cache runs on all of them: the valid length is read
    # from `lengths` at each call (a mask built from today's lengths would go stale as they grow).
    cols = S // 128
    block_mask = BlockMask.from_kv_blocks(
        torch.full((1, 1, 1), cols, device="cuda", dtype=torch.int32),
        torch.arange(cols, device="cuda", dtype=torch.int32).view(1, 1, 1, cols),
        BLOCK_SIZE=128, mask_mod=in_cache, seq_lengths=(1, S),
    )
    return q, k, v, lengths, alibi, in_cache, block_mask


def _captured(step):
    """``step`` warmed up on a side stream, then captured: the recipe of torch.cuda.graph's docs. A
    call without a BlockMask builds its all-full mask during the capture (one made there cannot be
    kept), with no read back to the host."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    return graph, static


def test_decode_step_replays_from_a_cuda_graph_like_eager():
    torch.manual_seed(0)
    q, k, v, lengths, alibi, in_cache, block_mask = _decode_step_problem()

    def step():
        return flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask, enable_gqa=True)

    # Warm-up on a side stream (tracing, compilation and launch plans happen here, never in the capture).
    graph, static_out = _captured(step)

    for trial, new_length in enumerate((100, 1500, 4096)):
        # The next token: new query, new cache contents, longer sequences; all written in place.
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
        lengths.copy_(torch.tensor([new_length - i for i in range(lengths.numel())], device="cuda"))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        assert torch.isfinite(static_out).all(), f"trial {trial}: the replay left elements unwritten"
        assert torch.equal(static_out, eager), f"trial {trial}: replay and eager differ"
        expected = reference_attention(q.double(), k.double(), v.double(), score_mod=alibi, mask_mod=in_cache,
                                       enable_gqa=True)[0]
        assert rel_err(static_out, expected) < 2e-2, f"trial {trial}"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_call_without_a_block_mask_replays_from_a_cuda_graph(head_dim):
    torch.manual_seed(0)
    B, H, L, S = 2, 4, 1000, 1200
    q, k, v = (torch.randn(B, H, n, head_dim, device="cuda", dtype=torch.bfloat16) for n in (L, S, S))
    slopes = torch.rand(H, device="cuda")

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    graph, static = _captured(lambda: (flex_attention(q, k, v), flex_attention(q, k, v, score_mod=alibi)))
    for trial in range(2):
        for t in (q, k, v, slopes):
            t.copy_(torch.rand_like(t) * 2 - 1)
        for out in static:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for out, score_mod in zip(static, (None, alibi)):
            assert torch.equal(out, flex_attention(q, k, v, score_mod=score_mod)), f"trial {trial}"
            expected = reference_attention(q.double(), k.double(), v.double(), score_mod=score_mod)[0]
            assert rel_err(out, expected) < 2e-2, f"trial {trial}"


def test_a_training_step_without_a_block_mask_replays_from_a_cuda_graph():
    torch.manual_seed(0)
    B, H, L, D = 2, 4, 1024, 64
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def step():
        for t in (q, k, v):
            t.grad = None
        out = flex_attention(q, k, v)
        out.backward(grad_out)
        return out

    graph, static = _captured(step)
    grads = (q.grad, k.grad, v.grad)  # the capture's gradients: replays write into these
    for trial in range(2):
        with torch.no_grad():
            for t in (q, k, v, grad_out):
                t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        replayed = [static.clone()] + [g.clone() for g in grads]
        expected = [step().detach()] + [t.grad for t in (q, k, v)]
        for name, got, want in zip(("out", "dq", "dk", "dv"), replayed, expected):
            if name == "dq":  # at head dim 64 dQ is summed by atomics: the order of additions varies
                assert rel_err(got, want) < 1e-2, f"trial {trial}: dq differs from an eager step"
            else:
                assert torch.equal(got, want), f"trial {trial}: {name} differs from an eager step"


def test_a_mask_that_needs_its_check_inside_a_capture_gets_a_clear_error():
    # A mask never used before (or one made under inference_mode, checked at every eager call) must
    # be read back once, which a capture forbids: flexattn's error says what to do, not CUDA's.
    from flexattn.errors import InvalidInputError

    q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 256, 256, device="cuda")
        with pytest.raises(Exception) as raised:  # ours, or one of ending the capture that carries ours
            _captured(lambda: flex_attention(q, q, q, block_mask=mask))  # the warm-up runs outside it
    chain, error = [], raised.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert any(isinstance(e, InvalidInputError) and "inference_mode" in str(e) for e in chain), chain
    torch.cuda.synchronize()


@pytest.mark.parametrize("backend, compiled", [("TRITON", False), ("GLUON", False), ("AUTO", True)])
def test_a_captured_training_step_follows_its_mask_rewritten_in_place(backend, compiled):
    # CUDA graphs' static-input recipe applied to the mask: one capture, and before each replay the
    # next batch's document ids and its mask's tables are copied into the captured ones. Each
    # replay's output and gradients must follow the tables as they are then, never as they were at
    # the capture ([Note] Tables read at each replay in kernels/tables.py): not the backward's
    # transposed tables, nor the forward's consecutive-block path (interleaved documents list
    # blocks that are not consecutive; the captured documents' blocks are). Compiled: the op's warm
    # launches, found before the capture, are not what it captures.
    torch.manual_seed(0)
    B, H, L, D = 1, 2, 2048, 64
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def document_ids(starts):
        ids = torch.zeros(L, dtype=torch.int32)
        for s in starts[1:]:
            ids[s:] += 1
        return ids.cuda()

    doc = document_ids([0, 700, 1500])

    def same_document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    mask = create_block_mask(same_document, None, None, L, L, device="cuda")
    options = {"BACKEND": backend}

    def attend(q, k, v, block_mask):
        return flex_attention(q, k, v, block_mask=block_mask, kernel_options=options)

    if compiled:
        options = {}
        attend = torch.compile(attend, fullgraph=True)

    def step():
        for t in (q, k, v):
            t.grad = None
        out = attend(q, k, v, mask)
        out.backward(grad_out)
        return out

    graph, static = _captured(step)
    grads = (q.grad, k.grad, v.grad)
    interleaved = (torch.arange(L, device="cuda") // 256 % 2).int()  # two documents of alternate 256-key runs
    for layout in ([0, 300, 1800], interleaved, [0, 1024], [0, 700, 1500]):
        starts = layout if isinstance(layout, list) else "interleaved"
        doc.copy_(document_ids(layout) if isinstance(layout, list) else layout)
        fresh = create_block_mask(same_document, None, None, L, L, device="cuda")
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            getattr(mask, name).copy_(getattr(fresh, name))
        graph.replay()
        torch.cuda.synchronize()
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        gold, _, _ = reference_attention(*leaves, mask_mod=same_document)
        gold.backward(grad_out.double())
        for name, got, want in zip(("out", "dq", "dk", "dv"), [static, *grads], [gold, *(t.grad for t in leaves)]):
            assert rel_err(got, want) < 2e-2, f"documents {starts}: {name} follows an earlier mask"
