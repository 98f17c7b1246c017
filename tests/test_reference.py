"""The dense oracle (flexattn/reference.py) against torch's own FlexAttention and a hand-written softmax.

torch's eager ``flex_attention`` runs its unfused math path on CPU, so every catalogue variant is
compared with it in float64 (where both should agree to rounding). Fully masked rows and gradients
into captured tensors are checked separately, because every other test leans on them.
"""

import math
import warnings

import pytest
import torch

from numerics import rel_err
from torch.nn.attention import flex_attention as torch_flex

from flexattn.reference import reference_attention
from flexattn.variants import CATALOGUE

FP64_TOL = 1e-10


pytestmark = pytest.mark.usefixtures("one_thread")




def _torch_flex(q, k, v, score_mod, mask_mod, enable_gqa):
    L, S = q.shape[-2], k.shape[-2]
    block_mask = torch_flex.create_block_mask(mask_mod, None, None, L, S, device="cpu") if mask_mod else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        out, aux = torch_flex.flex_attention(
            q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa,
            return_aux=torch_flex.AuxRequest(lse=True),
        )
    return out, aux.lse


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_matches_torch_flex_attention(name):
    # Odd lengths and GQA (4 query heads on 2 kv heads); the document mask packs one sequence, so Q == KV.
    L, S = (517, 517) if CATALOGUE[name].square_only else (300, 517)
    B, Hq, Hkv = 2, 4, 2
    score_mod, mask_mod = CATALOGUE[name].build(B, Hq, L, S, "cpu")
    q = torch.randn(B, Hq, L, 64, dtype=torch.float64)
    k = torch.randn(B, Hkv, S, 64, dtype=torch.float64)
    v = torch.randn(B, Hkv, S, 48, dtype=torch.float64)

    out, lse, max_scores = reference_attention(q, k, v, score_mod, mask_mod, enable_gqa=True)
    torch_out, torch_lse = _torch_flex(q, k, v, score_mod, mask_mod, enable_gqa=True)

    assert out.shape == (B, Hq, L, 48) and out.dtype == torch.float64
    assert lse.dtype == torch.float64 and max_scores.dtype == torch.float64
    assert rel_err(out, torch_out) < FP64_TOL
    assert rel_err(lse, torch_lse) < FP64_TOL
    assert torch.all(max_scores <= lse)  # the row max never exceeds the log-sum-exp


def test_noop_is_plain_softmax_attention():
    q = torch.randn(2, 3, 37, 16, dtype=torch.float64)
    k = torch.randn(2, 3, 53, 16, dtype=torch.float64)
    v = torch.randn(2, 3, 53, 24, dtype=torch.float64)
    scale = 0.3
    out, lse, max_scores = reference_attention(q, k, v, scale=scale)
    scores = q @ k.transpose(-1, -2) * scale
    assert rel_err(out, torch.softmax(scores, dim=-1) @ v) < FP64_TOL
    assert rel_err(lse, torch.logsumexp(scores, dim=-1)) < FP64_TOL
    assert torch.equal(max_scores, scores.amax(dim=-1))
    # The default scale is 1/sqrt(E).
    default_out, _, _ = reference_attention(q, k, v)
    expected = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(16), dim=-1) @ v
    assert rel_err(default_out, expected) < FP64_TOL


def test_mods_see_query_head_and_int64_indices():
    seen = {}

    def record(score, b, h, q_idx, kv_idx):
        seen["dtypes"] = (b.dtype, h.dtype, q_idx.dtype, kv_idx.dtype)
        return score + h * 100.0 + b * 1000.0  # constant per row: softmax unchanged, lse shifted

    q = torch.randn(2, 4, 5, 8, dtype=torch.float64)
    k, v = torch.randn(1, 2, 7, 8, dtype=torch.float64), torch.randn(1, 2, 7, 8, dtype=torch.float64)
    _, lse, _ = reference_attention(q, k, v, score_mod=record, enable_gqa=True)
    _, plain_lse, _ = reference_attention(q, k, v, enable_gqa=True)
    shift = torch.arange(4, dtype=torch.float64).view(1, 4, 1) * 100 + torch.arange(2, dtype=torch.float64).view(2, 1, 1) * 1000
    assert rel_err(lse - plain_lse, shift.expand_as(lse)) < FP64_TOL
    assert seen["dtypes"] == (torch.int64,) * 4


def test_index_arithmetic_is_exact_like_python_integers():
    # q_idx * 2**28 leaves int32 at q_idx >= 8: the oracle computes it as Python would.
    L = 24
    allowed = torch.tensor([[(qi * 2**28 + ki) % 3 == 0 or qi == ki for ki in range(L)] for qi in range(L)])

    def linearised(b, h, q_idx, kv_idx):
        return ((q_idx * 2**28 + kv_idx) % 3 == 0) | (q_idx == kv_idx)

    def from_table(b, h, q_idx, kv_idx):
        return allowed[q_idx, kv_idx]

    q, k, v = (torch.randn(1, 2, L, 8, dtype=torch.float64) for _ in range(3))
    out, lse, _ = reference_attention(q, k, v, mask_mod=linearised)
    expected, expected_lse, _ = reference_attention(q, k, v, mask_mod=from_table)
    assert rel_err(out, expected) < FP64_TOL and rel_err(lse, expected_lse) < FP64_TOL


def test_gqa_and_kv_batch_broadcast_match_repeated_kv():
    q = torch.randn(3, 6, 19, 16, dtype=torch.float64)
    k, v = torch.randn(1, 2, 23, 16, dtype=torch.float64), torch.randn(1, 2, 23, 8, dtype=torch.float64)
    out, lse, _ = reference_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: q_idx + 4 >= kv_idx, enable_gqa=True)
    k_full = k.repeat_interleave(3, dim=1).expand(3, -1, -1, -1)
    v_full = v.repeat_interleave(3, dim=1).expand(3, -1, -1, -1)
    expected, expected_lse, _ = reference_attention(q, k_full, v_full, mask_mod=lambda b, h, q_idx, kv_idx: q_idx + 4 >= kv_idx)
    assert rel_err(out, expected) < FP64_TOL and rel_err(lse, expected_lse) < FP64_TOL
    with pytest.raises(ValueError, match="enable_gqa"):
        reference_attention(q, k, v)


def test_fully_masked_rows_are_zero_and_have_finite_gradients():
    def every_third_row_empty(b, h, q_idx, kv_idx):
        return (q_idx % 3 != 0) & (kv_idx <= q_idx)

    bias = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    q = torch.randn(2, 4, 17, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 4, 21, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 4, 21, 16, dtype=torch.float64, requires_grad=True)
    out, lse, max_scores = reference_attention(q, k, v, head_bias, every_third_row_empty)
    empty = torch.arange(17) % 3 == 0
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    assert torch.all(torch.isneginf(lse[:, :, empty])) and torch.all(torch.isneginf(max_scores[:, :, empty]))
    assert torch.all(torch.isfinite(lse[:, :, ~empty]))

    finite_lse = torch.where(torch.isfinite(lse), lse, 0.0)
    loss = (out * torch.randn_like(out)).sum() + (finite_lse * torch.randn_like(lse)).sum()
    grads = torch.autograd.grad(loss, [q, k, v, bias])
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][:, :, empty], torch.zeros_like(grads[0][:, :, empty]))


def test_captured_bias_gradient_matches_hand_written_attention():
    L, S = 11, 13
    bias = torch.randn(3, L, S, dtype=torch.float64, requires_grad=True)

    def learned_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]

    q = torch.randn(2, 3, L, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, S, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, S, 8, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 3, L, 8, dtype=torch.float64)

    out, _, _ = reference_attention(q, k, v, score_mod=learned_bias)
    grads = torch.autograd.grad((out * grad_out).sum(), [q, k, v, bias])
    expected_out = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8) + bias, dim=-1) @ v
    expected = torch.autograd.grad((expected_out * grad_out).sum(), [q, k, v, bias])
    assert rel_err(out, expected_out) < FP64_TOL
    for g, e in zip(grads, expected):
        assert rel_err(g, e) < FP64_TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_compute_in_float32(dtype):
    q, k, v = (torch.randn(1, 2, 33, 16).to(dtype) for _ in range(3))
    out, lse, max_scores = reference_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    assert out.dtype == dtype and lse.dtype == torch.float32 and max_scores.dtype == torch.float32
    golden, golden_lse, _ = reference_attention(
        q.double(), k.double(), v.double(), mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    )
    assert rel_err(out, golden) < 1e-2  # only the final rounding to the half dtype
    assert rel_err(lse, golden_lse) < 1e-6
