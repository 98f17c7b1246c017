"""FP8 on the GPU (run on the device; skipped without CUDA): the compiled FP8 products, where P is
rounded to FP8 too, against float64 and against torch's compiled flex_attention on the same FP8
tensors; an FP8 cache read by the decode kernels. tests/test_fp8.py covers the rest on the CPU.
"""

import math

import pytest
import torch
from numerics import rel_err

import flexattn.kernels.decode
from flexattn import create_block_mask, flex_attention
from flexattn.reference import reference_attention
from flexattn.variants import CATALOGUE

pytestmark = pytest.mark.gpu

E4M3 = torch.float8_e4m3fn
REF_ROWS = 512  # query rows of the last (batch, head) checked against float64


def quantize(t, dtype=E4M3):
    scale = t.abs().amax().float() / torch.finfo(dtype).max
    return (t / scale).to(dtype), scale


def need_fp8_products():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 products need compute capability 8.9 or newer")


def last_rows_reference(q, k, v, score_mod, mask_mod, scale):
    """float64 attention of the last (batch, head), last REF_ROWS queries, through the reference
    with the queries' positions shifted to where they sit."""
    L = q.shape[2]
    offset = L - REF_ROWS
    b, h = q.shape[0] - 1, q.shape[1] - 1
    kv_h = h // (q.shape[1] // k.shape[1])

    def score(s, bb, hh, q_idx, kv_idx):
        return score_mod(s, bb + b, hh + h, q_idx + offset, kv_idx)

    def mask(bb, hh, q_idx, kv_idx):
        return mask_mod(bb + b, hh + h, q_idx + offset, kv_idx)

    out, _, _ = reference_attention(
        q[b:, h:h + 1, offset:].double(), k[b:, kv_h:kv_h + 1].double(), v[b:, kv_h:kv_h + 1].double(),
        score if score_mod else None, mask if mask_mod else None, scale=scale)
    return out[0, 0]


@pytest.mark.parametrize("variant", ["noop", "causal", "alibi", "softcap", "document_mask"])
@pytest.mark.parametrize("D", [64, 128])
def test_fp8_forward_error_equals_torch_flex_on_the_same_fp8_tensors(variant, D):
    need_fp8_products()
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    B, H, L = 2, 4, 2048
    q, k, v = (torch.randn(B, H, L, D, device="cuda") for _ in range(3))
    score_mod, mask_mod = CATALOGUE[variant].build(B, H, L, L, "cuda")
    (q8, sq), (k8, sk), (v8, sv) = quantize(q), quantize(k), quantize(v)
    scale = float(sq * sk) / math.sqrt(D)
    bm = create_block_mask(mask_mod, None, None, L, L, device="cuda") if mask_mod else None
    ours = flex_attention(q8, k8, v8, score_mod=score_mod, block_mask=bm, scale=scale)
    assert ours.dtype == E4M3
    ref = last_rows_reference(q8.float(), k8.float(), v8.float(), score_mod, mask_mod, scale)
    mine = rel_err(ours[-1, -1, -REF_ROWS:], ref)
    rounded = rel_err(ref.to(E4M3), ref)  # what any FP8 output pays
    assert mine <= 2 * rounded, (mine, rounded)
    tbm = torch_block_mask(mask_mod, None, None, L, L, device="cuda") if mask_mod else None
    try:
        theirs = torch.compile(torch_flex)(q8, k8, v8, score_mod=score_mod, block_mask=tbm, scale=scale)
    except Exception:  # noqa: BLE001 - torch 2.11's template does not compile FP8 with soft-capping
        assert variant == "softcap"
    else:
        torch_err = rel_err(theirs[-1, -1, -REF_ROWS:], ref)
        assert mine <= 1.1 * torch_err + 1e-3, (mine, torch_err)
    # Scaled back, against the unquantized inputs: the same order as the rounding of the output.
    exact = last_rows_reference(q, k, v, score_mod, mask_mod, 1 / math.sqrt(D))
    assert rel_err(ours[-1, -1, -REF_ROWS:].double() * float(sv), exact) < 0.08


def test_fp8_value_row_major_is_copied_and_gives_the_same_bits():
    need_fp8_products()
    q, k, v = (torch.randn(1, 2, 1024, 128, device="cuda").to(E4M3) for _ in range(3))
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 1024, 1024, device="cuda")
    column_major = v.transpose(-2, -1).contiguous().transpose(-2, -1)
    assert torch.equal(flex_attention(q, k, v, block_mask=mask).float(),
                       flex_attention(q, k, column_major, block_mask=mask).float())


@pytest.mark.parametrize("kv_dtype", [E4M3, torch.float8_e5m2])
def test_fp8_cache_decoding_equals_the_converted_cache(kv_dtype):
    q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(8, 8, 16384, 128, device="cuda").to(kv_dtype) for _ in range(2))
    before = flexattn.kernels.decode.launches
    out = flex_attention(q, k, v, enable_gqa=True)
    assert flexattn.kernels.decode.launches > before, "the decode kernels did not run"
    # The products run in float16 ([Note] An FP8 cache read by a bfloat16 query): P is rounded more
    # finely than the converted call's bfloat16 P, so the two differ by about bfloat16's rounding.
    converted = flex_attention(q, k.bfloat16(), v.bfloat16(), enable_gqa=True)
    assert rel_err(out, converted) < 4e-3
    ref = reference_attention(q[-1:].double(), k[-1:].double(), v[-1:].double(), enable_gqa=True)[0]
    assert rel_err(out[-1:], ref) < 1e-2 and rel_err(out[-1:], ref) <= 1.05 * rel_err(converted[-1:], ref)
