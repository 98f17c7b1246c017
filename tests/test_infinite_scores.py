"""Rows with infinite scores, from a query or key holding +-inf: out and lse as torch gives them.

torch's eager flex_attention (its math path: ``logsumexp`` and ``_safe_softmax`` over the dense
scores) is the oracle: a row with a +inf score has lse +inf and output NaN, a row with a NaN score
(``inf - inf`` inside q . k) lse NaN, a row whose every score is -inf output 0 and lse -inf. The
float64 reference must say the same, and so must every backend (issue 50, item 10; [Note] Infinite
scores in flexattn/templates/forward.py.jinja).
"""

import math
import os
import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as tfa
from numerics import rel_err

import flexattn.kernels.decode
from flexattn import AuxRequest, create_block_mask, flex_attention
from flexattn.reference import reference_attention

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="Triton on CPU tensors needs TRITON_INTERPRET=1"
)
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]  # NaN is the point

H, E, S = 2, 16, 128  # 128 keys: the mask-less forward walks whole blocks, unchecked
ROW, KEY = 40, 5  # the query row and the key that hold the infinities
CASES = ["q_plus_inf", "q_minus_inf", "k_plus_inf", "k_minus_inf", "nan_and_inf", "all_minus_inf"]


def with_infinities(case, q, k):
    """q [1, H, L, E] and k [1, H, S, E] with the case's infinities written into head 0."""
    q, k = q.clone(), k.clone()
    row = ROW if q.shape[2] > ROW else 1
    if case.startswith("q"):
        q[0, 0, row, 3] = math.inf if "plus" in case else -math.inf  # +-inf times k's signs: both infinities
    elif case.startswith("k"):
        k[0, 0, KEY, 3] = math.inf if "plus" in case else -math.inf
        # Rows alternate the signs, so some score +inf at KEY and some -inf.
        sign = torch.tensor([1.0, -1.0], device=q.device, dtype=q.dtype).repeat(q.shape[2] // 2)
        q[0, 0, :, 3] = sign * (q[0, 0, :, 3].abs() + 0.1)
    elif case == "nan_and_inf":  # inf * k3 - inf * k4 is NaN where k3 and k4 share a sign
        q[0, 0, row, 3], q[0, 0, row, 4] = math.inf, -math.inf
    else:  # "all_minus_inf": -inf times a positive column is -inf for every key
        q[0, 0, row, 3] = -math.inf
        k[0, 0, :, 3] = k[0, 0, :, 3].abs() + 0.1
    return q, k


def shifted_causal(offset):
    def causal(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    return causal


def alibi(score, b, h, q_idx, kv_idx):
    return score - 0.25 * (h + 1) * (q_idx - kv_idx).abs()


def mods(config, L):
    mask_mod = None if config == "dense" else shifted_causal(S - L)
    return (alibi if config == "causal_alibi" else None), mask_mod


def torch_eager(q, k, v, score_mod, mask_mod):
    """torch's own flex_attention, eager on the CPU: its math path."""
    block_mask = None
    if mask_mod is not None:
        block_mask = tfa.create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": the eager path is the point
        out, aux = tfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                      return_aux=tfa.AuxRequest(lse=True))
    return out, aux.lse


def assert_same(actual, expected, tol, what):
    """The same NaN and +-inf entries, and close finite ones."""
    actual = actual.double()
    expected = expected.double()
    assert torch.equal(actual.isnan(), expected.isnan()), f"{what}: NaN at other places"
    assert torch.equal(actual.isposinf(), expected.isposinf()), f"{what}: +inf at other places"
    assert torch.equal(actual.isneginf(), expected.isneginf()), f"{what}: -inf at other places"
    finite = expected.isfinite()
    assert rel_err(actual[finite], expected[finite]) < tol, what


def check(case, config, L, options, expect_decode=False):
    q, k, v = torch.randn(1, H, L, E), torch.randn(1, H, S, E), torch.randn(1, H, S, E)
    q, k = with_infinities(case, q, k)
    score_mod, mask_mod = mods(config, L)
    out_t, lse_t = torch_eager(q, k, v, score_mod, mask_mod)
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, L, S, device="cpu",
                                                                 BLOCK_SIZE=16)
    launches = flexattn.kernels.decode.launches
    out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options=options,
                              return_aux=AuxRequest(lse=True))
    assert (flexattn.kernels.decode.launches > launches) == expect_decode
    assert_same(out, out_t, 1e-5, "out")
    assert_same(aux.lse, lse_t, 1e-5, "lse")
    assert not lse_t.isfinite().all(), "no row's lse is infinite or NaN: the case tests nothing"


@pytest.mark.parametrize("config", ["dense", "causal", "causal_alibi"])
@pytest.mark.parametrize("case", CASES)
def test_reference_gives_torch_out_and_lse(case, config):
    q, k, v = torch.randn(1, H, S, E), torch.randn(1, H, S, E), torch.randn(1, H, S, E)
    q, k = with_infinities(case, q, k)
    score_mod, mask_mod = mods(config, S)
    out_t, lse_t = torch_eager(q, k, v, score_mod, mask_mod)
    out, lse, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=score_mod, mask_mod=mask_mod)
    assert_same(out, out_t, 1e-5, "out")
    assert_same(lse, lse_t, 1e-5, "lse")
    assert not lse_t.isfinite().all(), "no row's lse is infinite or NaN: the case tests nothing"


@pytest.mark.parametrize("config", ["dense", "causal", "causal_alibi"])
@pytest.mark.parametrize("case", CASES)
def test_pytorch_backend_gives_torch_out_and_lse(case, config):
    check(case, config, S, {"BACKEND": "PYTORCH"})


# Full blocks without a score_mod run the forward kernel's unguarded loop, which cannot tell a NaN
# score from exp2(inf - inf) nor keep a row of -inf scores at 0 (docs/limitations.md).
UNGUARDED_GAP = pytest.mark.xfail(strict=True, reason="the forward's unguarded loop: docs/limitations.md")


@needs_interpreter
@pytest.mark.parametrize("config", ["dense", "causal", "causal_alibi"])
@pytest.mark.parametrize("case", CASES)
def test_triton_forward_gives_torch_out_and_lse(case, config, request):
    if config != "causal_alibi" and case in ("nan_and_inf", "all_minus_inf"):
        request.applymarker(UNGUARDED_GAP)
    check(case, config, S, {"BACKEND": "TRITON"})


@needs_interpreter
@pytest.mark.parametrize("config", ["dense", "causal", "causal_alibi"])
@pytest.mark.parametrize("case", CASES)
def test_decode_gives_torch_out_and_lse(case, config):
    # Four queries (the last four positions), three splits: a +inf in one split meets finite ones
    # in the merge.
    check(case, config, 4, {"BACKEND": "TRITON_DECODE", "DECODE_NUM_SPLITS": 3}, expect_decode=True)


@pytest.mark.parametrize("backend", ["PYTORCH", pytest.param("TRITON", marks=needs_interpreter)])
@pytest.mark.parametrize("case", ["q_plus_inf", "k_plus_inf"])
def test_backward_from_an_infinite_lse(case, backend):
    # torch's dense backward (sdpa_dense_backward, eager on a GPU; its CPU path has no backward)
    # recomputes p = exp(score - lse): with lse +inf that is 0 at finite scores and NaN at the +inf
    # ones, so a +inf row adds nothing to dV but NaN at the keys it scores +inf, while its
    # delta = rowsum(dO * O) is NaN, which makes dK wholly and that row of dQ NaN.
    q, k, v = torch.randn(1, H, S, E), torch.randn(1, H, S, E), torch.randn(1, H, S, E)
    q, k = with_infinities(case, q, k)
    grad_out = torch.randn(1, H, S, E)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, aux = flex_attention(*leaves, kernel_options={"BACKEND": backend}, return_aux=AuxRequest(lse=True))
    out.backward(grad_out)
    dq, dk, dv = (t.grad for t in leaves)

    scores = q @ k.transpose(-1, -2) / math.sqrt(E)
    inf_rows = aux.lse.detach().isposinf()  # [1, H, S]
    assert inf_rows.any() and torch.equal(inf_rows, scores.isposinf().any(-1))
    nan_keys = (scores.isposinf() & inf_rows[..., None]).any(-2)  # keys some +inf row scores +inf
    assert torch.equal(dv.isnan().all(-1), nan_keys) and not dv.isnan()[~nan_keys].any()
    # The finite rest of dV is the other rows' alone: the float64 reference over those rows, per head.
    for h in range(H):
        rows = ~inf_rows[0, h]
        v_h = v[:, h:h + 1].double().requires_grad_()
        out_h = reference_attention(q[:, h:h + 1, rows].double(), k[:, h:h + 1].double(), v_h)[0]
        out_h.backward(grad_out[:, h:h + 1, rows].double())
        keys = ~nan_keys[0, h]
        assert rel_err(dv[0, h, keys], v_h.grad[0, 0, keys]) < 1e-5, h
    # dK: NaN wherever a key head meets a +inf row; dQ: NaN in the +inf rows, and elsewhere only in
    # the columns where a key holds an infinity (dS = 0 times inf there, as in torch's formula).
    assert torch.equal(dk.isnan().all(-1), inf_rows.any(-1, keepdim=True).expand_as(inf_rows))
    infinite_key_columns = k.isinf().any(-2, keepdim=True)
    assert torch.equal(dq.isnan().all(-1), inf_rows)
    assert not (dq.isnan() & ~inf_rows[..., None] & ~infinite_key_columns).any()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["TRITON", "GLUON", "TRITON_DECODE"])
@pytest.mark.parametrize("config", ["dense", "causal", "causal_alibi"])
@pytest.mark.parametrize("case", ["q_plus_inf", "q_minus_inf", "k_plus_inf", "k_minus_inf"])
def test_gpu_kernels_give_the_reference_out_and_lse(case, config, backend):
    """The compiled kernels (the Hopper Gluon forward where it applies) in bfloat16 at d=64."""
    import flexattn.kernels.hopper.common as hopper_common

    device, L, D = "cuda", (4 if backend == "TRITON_DECODE" else 256), 64
    q = torch.randn(1, H, L, D, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(1, H, 256, D, device=device, dtype=torch.bfloat16) for _ in range(2))
    q, k = with_infinities(case, q, k)
    score_mod, mask_mod = mods(config, L)
    if mask_mod is not None:
        mask_mod = shifted_causal(256 - L)
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, L, 256, device=device)
    from flexattn.masks import dense_block_mask

    checked = block_mask if block_mask is not None else dense_block_mask(L, 256, device)  # what a call passes
    if backend == "GLUON" and hopper_common.problem_reason(q, k, v, checked, need_max=False) is not None:
        pytest.skip("the Gluon forward does not apply here")
    out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                              kernel_options={"BACKEND": backend}, return_aux=AuxRequest(lse=True))
    gold_out, gold_lse, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=score_mod,
                                                mask_mod=mask_mod)
    assert not gold_lse.isfinite().all()
    assert_same(out.cpu(), gold_out.cpu(), 2e-2, "out")
    assert_same(aux.lse.cpu(), gold_lse.cpu(), 2e-2, "lse")
