"""The compiled decode kernels on a GPU at decoding sizes (run on the device; skipped without CUDA).

B=8 sequences, 16k and 32k cached keys, GQA 16:2 and 12:2, head dims 64 and 128, bf16. The
float64 reference runs on a slice of the batch (its expanded K/V would not fit otherwise).
"""

import pytest
import torch
from numerics import rel_err

import flexattn.kernels.decode
from flexattn import AuxRequest, create_block_mask, flex_attention
from flexattn.reference import reference_attention
from flexattn.variants import CATALOGUE, causal_mask, generate_sliding_window

pytestmark = pytest.mark.gpu

REF_BATCH = 2  # sequences checked against the float64 reference


def shifted(score_mod, mask_mod, offset):
    """Mods of the full sequence as seen by queries at positions offset, offset + 1, ..."""
    score = mask = None
    if score_mod is not None:
        def score(s, b, h, q_idx, kv_idx):
            return score_mod(s, b, h, q_idx + offset, kv_idx)
    if mask_mod is not None:
        def mask(b, h, q_idx, kv_idx):
            return mask_mod(b, h, q_idx + offset, kv_idx)
    return score, mask


def run_and_check(q, k, v, score_mod, mask_mod, options=None):
    B, Hq, L, _ = q.shape
    S = k.shape[2]
    bm = create_block_mask(mask_mod, None, None, L, S, device="cuda") if mask_mod else None
    before = flexattn.kernels.decode.launches
    out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True, kernel_options=options,
                              return_aux=AuxRequest(lse=True))
    assert flexattn.kernels.decode.launches > before, "the decode kernels did not run"
    ref, ref_lse, _ = reference_attention(q[:REF_BATCH].double(), k[:REF_BATCH].double(), v[:REF_BATCH].double(),
                                          score_mod=score_mod, mask_mod=mask_mod, enable_gqa=True)
    assert rel_err(out[:REF_BATCH], ref) < 2e-2
    assert rel_err(aux.lse[:REF_BATCH], ref_lse) < 1e-3
    # Every sequence of the batch against the forward kernel (same mods, fp32 accumulation).
    forward = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True,
                             kernel_options={"BACKEND": "TRITON"})
    assert rel_err(out, forward) < 1e-2
    return out


@pytest.mark.parametrize("variant", ["noop", "alibi", "softcap"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_len", [16384, 32768])
@pytest.mark.parametrize("heads", [(16, 2), (12, 2)])
def test_decode_one_token(heads, kv_len, head_dim, variant):
    Hq, Hkv = heads
    B = 8
    q = torch.randn(B, Hq, 1, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, kv_len, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, kv_len, head_dim, device="cuda", dtype=torch.bfloat16)
    score_mod, mask_mod = CATALOGUE[variant].build(B, Hq, kv_len, kv_len, "cuda")
    score_mod, mask_mod = shifted(score_mod, mask_mod, kv_len - 1)
    run_and_check(q, k, v, score_mod, mask_mod)  # AUTO: q_len 1 takes the decode kernels


@pytest.mark.parametrize("q_len", [4, 16])
def test_decode_several_tokens_odd_length_window(q_len):
    B, Hq, Hkv, S, d = 8, 12, 2, 16384 + 77, 128
    q = torch.randn(B, Hq, q_len, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, S, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, S, d, device="cuda", dtype=torch.bfloat16)
    _, mask_mod = shifted(None, generate_sliding_window(4096), S - q_len)
    run_and_check(q, k, v, None, mask_mod, options={"BACKEND": "TRITON_DECODE"})
    _, mask_mod = shifted(None, causal_mask, S - q_len)
    run_and_check(q, k, v, None, mask_mod)


def test_per_batch_lengths():
    B, Hq, Hkv, S, d = 8, 16, 2, 32768, 64
    lengths = torch.randint(1, S + 1, (B,), device="cuda")

    def valid(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    q = torch.randn(B, Hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, S, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, S, d, device="cuda", dtype=torch.bfloat16)
    bm = create_block_mask(valid, B, None, 1, S, device="cuda")
    before = flexattn.kernels.decode.launches
    out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert flexattn.kernels.decode.launches > before
    ref, _, _ = reference_attention(q[:REF_BATCH].double(), k[:REF_BATCH].double(), v[:REF_BATCH].double(),
                                    mask_mod=valid, enable_gqa=True)
    assert rel_err(out[:REF_BATCH], ref) < 2e-2


@pytest.mark.parametrize("q_len", [17, 40, 64])
@pytest.mark.parametrize("shape", [(8, 16, 2, 16384 + 77, 128), (8, 16, 16, 16384, 64), (1, 12, 2, 65536, 64)])
def test_automatic_choice_up_to_64_query_rows(shape, q_len):
    # The shapes of the q_len measurement behind decode.MAX_AUTO_QUERY_LEN (docs/benchmarks.md):
    # AUTO takes the decode kernels up to 64 rows, cut into row tiles of at most 64 on the GPU.
    B, Hq, Hkv, S, d = shape
    q = torch.randn(B, Hq, q_len, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, S, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, S, d, device="cuda", dtype=torch.bfloat16)
    score_mod, mask_mod = CATALOGUE["alibi"].build(B, Hq, S, S, "cuda")
    score_mod, _ = shifted(score_mod, None, S - q_len)
    _, mask_mod = shifted(None, causal_mask, S - q_len)
    run_and_check(q, k, v, score_mod, mask_mod)
