"""A decoding step captured in a CUDA graph and replayed (issue 10, item 4). GPU only.

The step reads everything that changes between tokens from tensors (the query, the cache, the
position of the token, each sequence's valid length), so one capture serves every later step: the
replay must give what an eager call gives on the same inputs.
"""

import pytest
import torch
from numerics import rel_err

from flexattn import BlockMask, flex_attention
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


def test_decode_step_replays_from_a_cuda_graph_like_eager():
    torch.manual_seed(0)
    q, k, v, lengths, alibi, in_cache, block_mask = _decode_step_problem()

    def step():
        return flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask, enable_gqa=True)

    # Warm-up on a side stream (tracing, compilation and launch plans happen here, never in the capture).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

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
