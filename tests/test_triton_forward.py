"""The generated Triton forward kernel against the float64 reference.

Without a GPU these run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so
shapes are small; tests/test_gpu.py repeats the important cases at realistic sizes on a GPU.
"""

import math

import pytest
import torch
from numerics import rel_err

import flexattn
from flexattn import AuxRequest, create_block_mask, flex_attention
from flexattn.reference import reference_attention
from flexattn.variants import CATALOGUE, causal_mask, generate_alibi_bias, generate_sliding_window

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = {"BACKEND": "TRITON"}
# Norm-wise relative error budgets against float64, per input dtype.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}




def qkv(B, Hq, Hkv, L, S, E, Ev, dtype, kv_batch=None):
    kv_batch = B if kv_batch is None else kv_batch
    q = torch.randn(B, Hq, L, E, device=DEVICE, dtype=dtype)
    k = torch.randn(kv_batch, Hkv, S, E, device=DEVICE, dtype=dtype)
    v = torch.randn(kv_batch, Hkv, S, Ev, device=DEVICE, dtype=dtype)
    return q, k, v


def check_against_reference(q, k, v, score_mod, mask_mod, *, block_size=128, gqa=False, options=None):
    B, Hq, L, _ = q.shape
    S = k.shape[2]
    bm = create_block_mask(mask_mod, B, Hq, L, S, device=q.device, BLOCK_SIZE=block_size) if mask_mod else None
    out, aux = flex_attention(
        q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa, kernel_options={**TRITON, **(options or {})},
        return_aux=AuxRequest(lse=True, max_scores=True),
    )
    ref_out, ref_lse, ref_max = reference_attention(
        q.double(), k.double(), v.double(), score_mod=score_mod, mask_mod=mask_mod, enable_gqa=gqa
    )
    tol = TOLERANCE[q.dtype]
    assert out.dtype == q.dtype and out.shape == ref_out.shape
    assert not torch.isnan(out).any(), "NaN in the output (an element the kernel never wrote?)"
    assert rel_err(out, ref_out) < tol
    assert rel_err(aux.lse, ref_lse) < max(tol, 1e-5)
    assert rel_err(aux.max_scores, ref_max) < max(tol, 1e-5)
    return out, aux


@pytest.mark.parametrize("variant", list(CATALOGUE))
def test_catalogue_variants(variant):
    B, H, L = 2, 2, 256
    q, k, v = qkv(B, H, H, L, L, 64, 64, torch.float32)
    score_mod, mask_mod = CATALOGUE[variant].build(B, H, L, L, DEVICE)
    check_against_reference(q, k, v, score_mod, mask_mod)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes_odd_lengths_gqa(dtype):
    # Q_LEN=300, KV_LEN=517: neither is a block multiple; 4 query heads share 2 key/value heads.
    q, k, v = qkv(1, 4, 2, 300, 517, 64, 64, dtype)
    check_against_reference(q, k, v, generate_alibi_bias(4, DEVICE), causal_mask, gqa=True)


@pytest.mark.parametrize("head_dim", [16, 48, 64, 80, 128])
def test_head_dims(head_dim):
    q, k, v = qkv(1, 2, 2, 200, 200, head_dim, head_dim, torch.float16)
    check_against_reference(q, k, v, None, causal_mask)


def test_value_head_dim_differs():
    q, k, v = qkv(1, 2, 2, 130, 190, 64, 32, torch.float32)
    check_against_reference(q, k, v, generate_alibi_bias(2, DEVICE), None)


@pytest.mark.parametrize("block_size", [64, (128, 64), (64, 128)])
def test_block_sizes(block_size):
    q, k, v = qkv(1, 2, 2, 256, 320, 32, 32, torch.float32)
    sliding = CATALOGUE["sliding_window"].build(1, 2, 256, 320, DEVICE)[1]
    check_against_reference(q, k, v, None, sliding, block_size=block_size)


def test_block_table_row_stats():
    # What the launcher reads from a BlockMask (see [Note] Consecutive blocks in the template).
    from flexattn.kernels.tables import block_mask_row_stats

    causal = block_mask_row_stats(create_block_mask(causal_mask, 1, 1, 512, 512, device=DEVICE, BLOCK_SIZE=64))
    assert causal.consecutive_partial and causal.consecutive_full
    assert causal.mean_blocks == sum(range(1, 9)) / 8
    # A window of 128 keys: each row's partial blocks are the diagonal and the far edge, apart.
    window = block_mask_row_stats(create_block_mask(generate_sliding_window(128), 1, 1, 512, 512, device=DEVICE,
                                                    BLOCK_SIZE=64))
    assert not window.consecutive_partial and window.consecutive_full


@pytest.mark.parametrize("variant", ["noop", "causal", "sliding_window", "document_mask"])
def test_several_tiles_per_block(variant):
    # BLOCK_N = 32 inside 128-key blocks: each block is walked as 4 tiles, from the block table or,
    # for consecutive blocks, from the row's first block. KV_LEN = 300 ends inside a block.
    L = 300
    q, k, v = qkv(1, 2, 2, L, L, 32, 32, torch.float32)
    score_mod, mask_mod = CATALOGUE[variant].build(1, 2, L, L, DEVICE)
    check_against_reference(q, k, v, score_mod, mask_mod, options={"BLOCK_M": 64, "BLOCK_N": 32})


def test_any_strides_and_kv_batch_broadcast():
    # q laid out [B, L, H, E] and transposed (non-contiguous heads); K/V batch 1 broadcast to B=3.
    q = torch.randn(3, 200, 2, 64, device=DEVICE).transpose(1, 2)
    k = torch.randn(1, 2, 64, 150, device=DEVICE).transpose(2, 3)  # stride 1 along the sequence
    v = torch.randn(1, 2, 150, 64, device=DEVICE)
    check_against_reference(q, k, v, generate_alibi_bias(2, DEVICE), causal_mask)


def test_fully_masked_rows_give_zero_and_minus_inf_lse():
    def late_start(b, h, q_idx, kv_idx):
        return (q_idx >= 40) & (kv_idx <= q_idx)

    q, k, v = qkv(1, 1, 1, 160, 160, 32, 32, torch.float32)
    out, aux = check_against_reference(q, k, v, None, late_start)
    assert torch.all(out[:, :, :40] == 0)
    assert torch.all(aux.lse[:, :, :40] == -math.inf)


def test_per_batch_and_head_masks():
    def per_head(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 16 * h) & ((q_idx + b) % 3 != 0)

    q, k, v = qkv(2, 3, 3, 150, 150, 32, 32, torch.float32)
    check_against_reference(q, k, v, None, per_head)


def test_captured_tensors_and_gathers():
    # A bias table indexed by relative position, and document ids gathered for query and key.
    L = 192
    bias = torch.randn(2, 2 * L, device=DEVICE)
    doc = torch.randint(0, 3, (L,), device=DEVICE).sort().values

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + L]

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    q, k, v = qkv(1, 2, 2, L, L, 32, 32, torch.float32)
    check_against_reference(q, k, v, rel_bias, same_doc)


def test_matches_torch_flex_attention():
    from torch.nn.attention.flex_attention import create_block_mask as torch_cbm
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    q, k, v = qkv(1, 2, 2, 256, 256, 64, 64, torch.float32)
    alibi = generate_alibi_bias(2, DEVICE)
    ours = flex_attention(q, k, v, score_mod=alibi, block_mask=create_block_mask(causal_mask, 1, 1, 256, 256, device=DEVICE), kernel_options=TRITON)
    with torch.no_grad():
        theirs = torch_flex(q, k, v, score_mod=alibi, block_mask=torch_cbm(causal_mask, 1, 1, 256, 256, device=DEVICE))
    assert rel_err(ours, theirs) < 2e-5


def test_warm_call_does_not_retrace_or_rerender():
    import flexattn.codegen.source
    from flexattn import codegen, trace

    q, k, v = qkv(1, 1, 1, 128, 128, 32, 32, torch.float32)
    bm = create_block_mask(causal_mask, 1, 1, 128, 128, device=DEVICE)
    alibi = generate_alibi_bias(1, DEVICE)
    flex_attention(q, k, v, score_mod=alibi, block_mask=bm, kernel_options=TRITON)
    traces, modules = trace.counts.traces, len(codegen.source._loaded)
    # A new closure over a new tensor of the same shape: same graph, same kernel.
    flex_attention(q, k, v, score_mod=generate_alibi_bias(1, DEVICE), block_mask=bm, kernel_options=TRITON)
    assert trace.counts.traces == traces
    assert len(codegen.source._loaded) == modules


def test_triton_backend_on_cpu_without_interpreter_says_how(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = qkv(1, 1, 1, 16, 16, 16, 16, torch.float32)
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    with pytest.raises(flexattn.errors.BackendUnavailableError, match="TRITON_INTERPRET=1"):
        flex_attention(q, k, v, kernel_options=TRITON)


def test_rendered_source_parses_and_is_on_disk():
    import ast

    from flexattn.kernels import forward_kernel
    from flexattn.trace import trace_mod

    score, _ = trace_mod(generate_alibi_bias(2), "score_mod")
    mask, _ = trace_mod(causal_mask, "mask_mod")
    compiled = forward_kernel(score, mask).compiled()  # lowered for any lengths
    ast.parse(compiled.source)
    assert compiled.module.__file__.endswith(".py")
    with open(compiled.module.__file__) as f:
        assert f.read() == compiled.source


def test_hand_built_mask_in_any_order_with_a_boundary_block():
    # Rows list their key blocks in descending order and the last block crosses KV_LEN (=300): the
    # kernel must still bounds-check exactly that block (BlockMask stores rows ascending).
    L, S, block = 128, 300, 64
    rows, cols = L // block, -(-S // block)
    order = torch.arange(cols - 1, -1, -1, dtype=torch.int32, device=DEVICE).expand(1, 1, rows, cols).contiguous()
    num = torch.full((1, 1, rows), cols, dtype=torch.int32, device=DEVICE)
    bm = flexattn.BlockMask.from_kv_blocks(num, order, BLOCK_SIZE=block, seq_lengths=(L, S))
    q, k, v = qkv(1, 2, 2, L, S, 32, 32, torch.float32)
    out = flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON)
    ref, _, _ = reference_attention(q.double(), k.double(), v.double())
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
