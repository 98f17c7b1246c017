"""The Triton backward through the public API, against float64 gradients of the dense reference.

Every test calls ``flex_attention(..., kernel_options={"BACKEND": "TRITON"})``, takes gradients with
``loss.backward()`` for a random upstream gradient (never ``sum()``, whose uniform dO hides
transposed or misplaced rows), and compares each leaf's ``.grad`` with the one autograd gives through
``flexattn.reference.reference_attention`` on float64 copies of the same leaves. Each backward is
also checked to have run the Triton kernels (``expect_triton_backward``).

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
so shapes are small, with BlockMask blocks of 32 (or 16) so that every kernel walks several blocks;
tests/test_gpu_backward.py repeats the important cases at realistic sizes in bf16 on a GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Callable, Optional

import pytest
import torch
from numerics import expect_triton_backward, rel_err

from flexattn import AuxRequest, create_block_mask, flex_attention
from flexattn.errors import InvalidInputError
from flexattn.reference import reference_attention
from flexattn.variants import CATALOGUE, causal_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = {"BACKEND": "TRITON"}
PYTORCH = {"BACKEND": "PYTORCH"}
# Norm-wise relative error budgets of gradients against float64, per dtype (of the inputs, or of a
# captured tensor whose gradient is rounded to its own dtype). A captured tensor's gradient sums
# dS over many (query, key) pairs and the terms cancel (each row of dS sums to 0): learnable ALiBi
# slopes at random values lose up to ~1e-4 in float32 in any order of summation (the dense fp32
# reference itself is off by ~2e-5), hence the wider fp32 budget there.
GRAD_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
CAPTURED_TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}

pytestmark = pytest.mark.usefixtures("one_thread")


def randn(*shape, dtype=torch.float32, grad=True):
    """A fresh random leaf (never zeros) on the test device."""
    return torch.randn(*shape, device=DEVICE, dtype=dtype).requires_grad_(grad)


def plain(score_mod=None):
    """``build`` for tests whose leaves are q, k, v themselves."""
    return lambda t: (t["q"], t["k"], t["v"], score_mod)


class Upstream:
    """The random upstream gradients of one comparison, reused by a second run on the same inputs."""

    def __init__(self, out_shape, lse_shape, dtype):
        self.out = torch.randn(out_shape, device=DEVICE).to(dtype)
        self.lse = torch.randn(lse_shape, device=DEVICE)

    def loss(self, out, lse, use_out: bool, use_lse: bool):
        """<out, dO> + <lse, dLSE>, in float64. Fully masked rows have lse = -inf: they take no
        gradient (``where`` sends exactly 0 there)."""
        loss = (out.double() * self.out.double()).sum() if use_out else 0.0
        if use_lse:
            finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
            loss = loss + (finite.double() * self.lse.double()).sum()
        return loss


def check_grads(
    leaves: dict[str, torch.Tensor],
    build: Callable[[dict], tuple],
    mask_mod: Optional[Callable] = None,
    *,
    block_size=32,
    gqa: bool = False,
    options: Optional[dict] = None,
    use_out: bool = True,
    use_lse: bool = False,
    upstream: Optional[Upstream] = None,
) -> tuple[dict, Upstream]:
    """flexattn's gradients of every leaf against the float64 reference's.

    ``leaves``: name -> leaf tensor, each with the ``requires_grad`` the test wants.
    ``build(leaves) -> (q, k, v, score_mod)``: the call's inputs made from the leaves (views of
    them, closures over them). It is called again on float64 copies of the leaves for the reference,
    so captured learnable tensors get float64 gradients too.
    Returns ``({name: grad}, upstream)``; leaves that do not require grad must get no gradient.
    """
    options = TRITON if options is None else options
    q, k, v, score_mod = build(leaves)
    B, Hq, L, _ = q.shape
    S = k.shape[2]
    block_mask = (
        create_block_mask(mask_mod, B, Hq, L, S, device=DEVICE, BLOCK_SIZE=block_size) if mask_mod else None
    )
    upstream = upstream or Upstream((B, Hq, L, v.shape[-1]), (B, Hq, L), q.dtype)

    result = flex_attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa, kernel_options=options,
        return_aux=AuxRequest(lse=True) if use_lse else None,
    )
    out, lse = (result[0], result[1].lse) if use_lse else (result, None)
    assert not torch.isnan(out).any(), "NaN in the forward's output"
    ran_triton = options.get("BACKEND") == "TRITON"
    with expect_triton_backward() if ran_triton else contextlib.nullcontext():
        upstream.loss(out, lse, use_out, use_lse).backward()

    gold = {name: t.detach().double().requires_grad_(t.requires_grad) for name, t in leaves.items()}
    q64, k64, v64, score_mod64 = build(gold)
    ref_out, ref_lse, _ = reference_attention(q64, k64, v64, score_mod=score_mod64, mask_mod=mask_mod, enable_gqa=gqa)
    upstream.loss(ref_out, ref_lse, use_out, use_lse).backward()

    grads = {}
    for name, t in leaves.items():
        if not t.requires_grad:
            assert t.grad is None, f"{name} does not require grad but got a gradient"
            continue
        grad = grads[name] = t.grad
        assert grad is not None, f"{name} requires grad but got none"
        assert grad.shape == t.shape and grad.dtype == t.dtype, f"d{name}: {grad.dtype} {tuple(grad.shape)}"
        assert not torch.isnan(grad).any(), f"NaN in d{name}"
        budget = GRAD_TOL if name in ("q", "k", "v") else CAPTURED_TOL
        tol = max(budget[q.dtype], budget[t.dtype])
        expected = gold[name].grad
        if expected is None:  # the loss does not depend on it (v, for a loss of the LSE alone)
            expected = torch.zeros_like(gold[name])
        err = rel_err(grad, expected)
        if os.environ.get("FLEXATTN_TEST_PRINT_ERRORS"):
            print(f"d{name}: {err:.2e} (tol {tol:.0e})")
        assert err < tol, f"d{name}: relative error {err:.2e} against float64 >= {tol:.0e}"
    return grads, upstream


def qkv_leaves(B, Hq, Hkv, L, S, E, Ev=None, dtype=torch.float32, Bkv=None, grad="qkv"):
    Bkv, Ev = B if Bkv is None else Bkv, E if Ev is None else Ev
    return {
        "q": randn(B, Hq, L, E, dtype=dtype, grad="q" in grad),
        "k": randn(Bkv, Hkv, S, E, dtype=dtype, grad="k" in grad),
        "v": randn(Bkv, Hkv, S, Ev, dtype=dtype, grad="v" in grad),
    }


# ------------------------------------------------------------------------------ the catalogue


@pytest.mark.parametrize("variant", list(CATALOGUE))
def test_catalogue_fp32(variant):
    B, H, L = 2, 2, 128
    score_mod, mask_mod = CATALOGUE[variant].build(B, H, L, L, DEVICE)
    check_grads(qkv_leaves(B, H, H, L, L, 32), plain(score_mod), mask_mod)


@pytest.mark.parametrize(
    "variant, dtype_name",
    [("alibi", "bfloat16"), ("softcap", "float16"), ("document_mask", "bfloat16"), ("noop", "float16")],
)
def test_catalogue_half_precision(variant, dtype_name):
    B, H, L, dtype = 1, 2, 128, getattr(torch, dtype_name)
    score_mod, mask_mod = CATALOGUE[variant].build(B, H, L, L, DEVICE)
    check_grads(qkv_leaves(B, H, H, L, L, 32, dtype=dtype), plain(score_mod), mask_mod)


# ------------------------------------------------------------------------------ captured tensors that require grad


def learnable_alibi(H=4, L=96, E=32):
    """Leaves q, k, v and learnable per-head slopes, and the ``build`` of an ALiBi mod reading them."""
    leaves = {**qkv_leaves(1, H, H, L, L, E), "slopes": randn(H)}

    def build(t):
        slopes = t["slopes"]

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        return t["q"], t["k"], t["v"], alibi

    return leaves, build


def test_learnable_alibi_slopes():
    check_grads(*learnable_alibi(), causal_mask)


def test_learnable_relative_position_bias():
    H, L, S = 2, 80, 112
    leaves = {**qkv_leaves(2, H, H, L, S, 32), "bias": randn(H, L + S)}

    def build(t):
        bias = t["bias"]

        def rel_bias(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx - kv_idx + S]

        return t["q"], t["k"], t["v"], rel_bias

    check_grads(leaves, build, causal_mask)


def test_per_query_and_per_key_tables():
    # A per-(batch, head, query) temperature and a per-(head, key) bias: both tables need grads.
    B, H, L, S = 2, 2, 64, 96
    leaves = {**qkv_leaves(B, H, H, L, S, 32), "temp": randn(B, H, L), "key_bias": randn(H, S)}

    def build(t):
        temp, key_bias = t["temp"], t["key_bias"]

        def tables(score, b, h, q_idx, kv_idx):
            return score * temp[b, h, q_idx] + key_bias[h, kv_idx]

        return t["q"], t["k"], t["v"], tables

    check_grads(leaves, build)


@pytest.mark.parametrize("heads_last", [False, True])
def test_graphormer_bias_through_an_int_distance_table(heads_last):
    # Many (q, kv) pairs read the same bucket: its gradient is a sum over all of them. With the
    # heads last (as T5's and Graphormer's tables are laid out) one head's elements are H apart.
    H, L, buckets = 3, 96, 7
    dist = torch.randint(0, buckets, (L, L), device=DEVICE, dtype=torch.int32)
    leaves = {**qkv_leaves(1, H, H, L, L, 32), "spatial": randn(buckets, H) if heads_last else randn(H, buckets)}

    def build(t):
        spatial = t["spatial"]

        def graphormer(score, b, h, q_idx, kv_idx):
            if heads_last:
                return score + spatial[dist[q_idx, kv_idx], h]
            return score + spatial[h, dist[q_idx, kv_idx]]

        return t["q"], t["k"], t["v"], graphormer

    check_grads(leaves, build)


def test_learnable_tensor_read_twice_as_scale_and_bias():
    # torch's flex_attention rejects this; flexattn must sum both reads' gradients into w.
    H = 3
    leaves = {**qkv_leaves(1, H, H, 64, 64, 32), "w": randn(H + 1)}

    def build(t):
        w = t["w"]

        def scale_and_shift(score, b, h, q_idx, kv_idx):
            return w[h] * score + w[h + 1]

        return t["q"], t["k"], t["v"], scale_and_shift

    check_grads(leaves, build, causal_mask)


def test_learnable_tensor_read_at_query_and_key():
    L = 96
    leaves = {**qkv_leaves(2, 2, 2, L, L, 32), "a": randn(L)}

    def build(t):
        a = t["a"]

        def both_ends(score, b, h, q_idx, kv_idx):
            return score + a[q_idx] + a[kv_idx]

        return t["q"], t["k"], t["v"], both_ends

    check_grads(leaves, build, CATALOGUE["sliding_window"].build(2, 2, L, L, DEVICE)[1])


def test_bf16_learnable_bias():
    # The bias's gradient comes back in the bias's own dtype.
    H, L = 2, 64
    leaves = {**qkv_leaves(1, H, H, L, L, 32, dtype=torch.bfloat16), "bias": randn(H, 2 * L, dtype=torch.bfloat16)}

    def build(t):
        bias = t["bias"]

        def rel_bias(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx - kv_idx + L]

        return t["q"], t["k"], t["v"], rel_bias

    check_grads(leaves, build, causal_mask)


def test_fp32_learnable_bias_with_bf16_inputs():
    # Mixed precision as in training: bf16 activations, an fp32 parameter; its grad stays fp32.
    H, L = 2, 64
    leaves = {**qkv_leaves(1, H, H, L, L, 32, dtype=torch.bfloat16), "bias": randn(H, 2 * L)}

    def build(t):
        bias = t["bias"]

        def rel_bias(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx - kv_idx + L]

        return t["q"], t["k"], t["v"], rel_bias

    grads, _ = check_grads(leaves, build, causal_mask)
    assert grads["bias"].dtype == torch.float32


def test_non_contiguous_learnable_tensor():
    # The mod reads a transposed view of the leaf: strides (1, H), and the grad lands in the leaf.
    H, L = 2, 64
    leaves = {**qkv_leaves(1, H, H, L, L, 32), "bias_t": randn(2 * L, H)}

    def build(t):
        bias = t["bias_t"].t()
        assert not bias.is_contiguous()

        def rel_bias(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx - kv_idx + L]

        return t["q"], t["k"], t["v"], rel_bias

    check_grads(leaves, build, causal_mask)


def test_learnable_and_frozen_tensors_together():
    # A frozen table next to a learnable one: only the learnable one gets a gradient.
    H, L = 2, 64
    leaves = {**qkv_leaves(1, H, H, L, L, 32), "learned": randn(H), "frozen": randn(H, L, grad=False)}

    def build(t):
        learned, frozen = t["learned"], t["frozen"]

        def two_tables(score, b, h, q_idx, kv_idx):
            return score * learned[h] + frozen[h, kv_idx]

        return t["q"], t["k"], t["v"], two_tables

    check_grads(leaves, build, causal_mask)


# ------------------------------------------------------------------------------ shapes and layouts


@pytest.mark.parametrize("Hq, Hkv", [(4, 2), (6, 2)])
def test_gqa_with_learnable_slopes(Hq, Hkv):
    # dK/dV are sums over the query heads of each group; the slopes are per query head.
    leaves = {**qkv_leaves(2, Hq, Hkv, 64, 96, 32), "slopes": randn(Hq)}

    def build(t):
        slopes = t["slopes"]

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        return t["q"], t["k"], t["v"], alibi

    check_grads(leaves, build, causal_mask, gqa=True)


def test_kv_batch_broadcast():
    # K/V of batch 1 serve a query batch of 2: dK/dV sum over the query batch.
    check_grads(qkv_leaves(2, 2, 2, 64, 96, 32, Bkv=1), plain(), causal_mask)


@pytest.mark.parametrize("L, S", [(37, 83), (83, 37)])
def test_odd_lengths(L, S):
    # Neither length is a block multiple; Q_LEN != KV_LEN both ways.
    leaves = {**qkv_leaves(1, 2, 2, L, S, 32), "bias": randn(2, L + S)}

    def build(t):
        bias = t["bias"]

        def rel_bias(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx - kv_idx + S]

        return t["q"], t["k"], t["v"], rel_bias

    check_grads(leaves, build, causal_mask)


@pytest.mark.parametrize("E", [16, 80, 96, 128, 256])
def test_head_dims(E):
    check_grads(qkv_leaves(1, 2, 2, 64, 64, E), plain(), causal_mask)


def test_value_head_dim_differs():
    H = 2
    score_mod = CATALOGUE["alibi"].build(1, H, 64, 80, DEVICE)[0]
    check_grads(qkv_leaves(1, H, H, 64, 80, 32, Ev=48), plain(score_mod), causal_mask)


def test_non_contiguous_inputs():
    # q and v laid out [B, L, H, E] and transposed; k stored [B, H, E, S] (stride 1 along the sequence).
    B, H, L, S, E = 2, 2, 64, 96, 32
    leaves = {"q": randn(B, L, H, E), "k": randn(B, H, E, S), "v": randn(B, S, H, E)}

    def build(t):
        return t["q"].transpose(1, 2), t["k"].transpose(2, 3), t["v"].transpose(1, 2), None

    check_grads(leaves, build, causal_mask)


def test_fully_masked_rows_and_unseen_keys_get_zero_not_nan():
    # Queries 0..39 keep nothing (query block 0 has no key block at all); keys 32..63 are seen by
    # no query (key block 1 has no query block). Their gradients must be exactly 0.
    L, H = 96, 2

    def holes(b, h, q_idx, kv_idx):
        return (q_idx >= 40) & (kv_idx <= q_idx) & ((kv_idx < 32) | (kv_idx >= 64))

    leaves = {**qkv_leaves(1, H, H, L, L, 32), "slopes": randn(H)}

    def build(t):
        slopes = t["slopes"]

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        return t["q"], t["k"], t["v"], alibi

    grads, _ = check_grads(leaves, build, holes, use_lse=True)
    assert torch.all(grads["q"][:, :, :40] == 0)
    assert torch.all(grads["k"][:, :, 32:64] == 0) and torch.all(grads["v"][:, :, 32:64] == 0)


def test_block_size_16():
    # Smaller BlockMask blocks: more blocks per row and column for the kernels to walk.
    score_mod, mask_mod = CATALOGUE["prefix_lm"].build(1, 2, 80, 80, DEVICE)
    check_grads(qkv_leaves(1, 2, 2, 80, 80, 16), plain(score_mod), mask_mod, block_size=16)


# ------------------------------------------------------------------------------ the LSE's own gradient


@pytest.mark.parametrize("use_out", [True, False], ids=["out_and_lse", "lse_only"])
def test_lse_gradient(use_out):
    B, H, L = 2, 2, 96
    score_mod, mask_mod = CATALOGUE["alibi"].build(B, H, L, L, DEVICE)
    check_grads(qkv_leaves(B, H, H, L, L, 32), plain(score_mod), mask_mod,
                use_out=use_out, use_lse=True)


def test_lse_gradient_with_learnable_softcap_input():
    # The LSE's gradient reaches a captured tensor too.
    H, L = 2, 64
    leaves = {**qkv_leaves(1, H, H, L, L, 32), "temp": randn(H)}

    def build(t):
        temp = t["temp"]

        def softcap_temp(score, b, h, q_idx, kv_idx):
            return 10.0 * torch.tanh(score * temp[h] / 10.0)

        return t["q"], t["k"], t["v"], softcap_temp

    check_grads(leaves, build, causal_mask, use_lse=True)


# ------------------------------------------------------------------------------ partial requires_grad


@pytest.mark.parametrize("which", ["q", "kv", "k", "v"])
def test_only_some_of_q_k_v_require_grad(which):
    leaves = {**qkv_leaves(1, 2, 2, 64, 64, 32, grad=which), "slopes": randn(2, grad=False)}

    def build(t):
        slopes = t["slopes"]

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        return t["q"], t["k"], t["v"], alibi

    check_grads(leaves, build, causal_mask)


def test_only_a_captured_bias_requires_grad():
    L = 64
    leaves = {**qkv_leaves(1, 2, 2, L, L, 32, grad=""), "bias": randn(2, 2 * L)}

    def build(t):
        bias = t["bias"]

        def rel_bias(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx - kv_idx + L]

        return t["q"], t["k"], t["v"], rel_bias

    check_grads(leaves, build, causal_mask)


# ------------------------------------------------------------------------------ kernel_options of the backward


BWD_PINNED = {"BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 16, "bwd_num_warps": 2, "bwd_num_stages": 1}


def test_backward_kernel_options_give_the_same_numbers():
    B, H, L = 1, 2, 96
    score_mod, mask_mod = CATALOGUE["document_mask"].build(B, H, L, L, DEVICE)
    leaves = qkv_leaves(B, H, H, L, L, 32)
    default, upstream = check_grads(leaves, plain(score_mod), mask_mod)
    again = {name: t.detach().clone().requires_grad_() for name, t in leaves.items()}
    pinned, _ = check_grads(again, plain(score_mod), mask_mod, options={**TRITON, **BWD_PINNED},
                            upstream=upstream)
    for name in default:
        assert rel_err(pinned[name], default[name]) < 1e-5, name


@pytest.mark.parametrize("key, value", [("BLOCK_N1", 24), ("BLOCK_M1", 64), ("BLOCK_M2", 64), ("BLOCK_N2", 64)])
def test_bad_backward_block_sizes_are_named(key, value):
    # 24 is no power of two; 64 does not divide the BlockMask's blocks of 32.
    q, k, v = (randn(1, 2, 64, 32) for _ in range(3))
    block_mask = create_block_mask(causal_mask, 1, 2, 64, 64, device=DEVICE, BLOCK_SIZE=32)
    with pytest.raises(InvalidInputError, match=key):
        out = flex_attention(q, k, v, block_mask=block_mask, kernel_options={**TRITON, key: value})
        out.backward(torch.randn_like(out))


# ------------------------------------------------------------------------------ double backward


def test_double_backward_is_refused_clearly():
    q, k, v = (randn(1, 2, 32, 16) for _ in range(3))
    out = flex_attention(q, k, v, kernel_options=TRITON)
    with pytest.raises(Exception, match="(?i)double backward"):
        (dq,) = torch.autograd.grad(out, q, torch.randn_like(out), create_graph=True)
        dq.backward(torch.randn_like(dq))


# ------------------------------------------------------------------------------ same numbers as the PyTorch backend


@pytest.mark.parametrize("variant", ["alibi", "document_mask", "softcap"])
def test_triton_backward_equals_pytorch_backward(variant):
    B, H, L = 2, 2, 96
    score_mod, mask_mod = CATALOGUE[variant].build(B, H, L, L, DEVICE)
    leaves = qkv_leaves(B, H, H, L, L, 32)
    triton, upstream = check_grads(leaves, plain(score_mod), mask_mod, use_lse=True)
    again = {name: t.detach().clone().requires_grad_() for name, t in leaves.items()}
    launcher = importlib.import_module("flexattn.kernels.backward")
    before = launcher.launches
    pytorch, _ = check_grads(again, plain(score_mod), mask_mod, options=PYTORCH, use_lse=True,
                             upstream=upstream)
    assert launcher.launches == before, "the PyTorch backend's backward must not count as a Triton launch"
    for name in triton:
        assert rel_err(triton[name], pytorch[name]) < 1e-5, name


# ------------------------------------------------------------------------------ gradients that cannot be lowered


def test_unlowerable_gradient_fails_at_the_forward_call_before_any_kernel(monkeypatch):
    # A learnable table read as vectors: its gradient has no Triton lowering. The error must come
    # from flex_attention itself (before the forward kernel runs), not from loss.backward().
    import flexattn.kernels.forward as runtime
    from flexattn.errors import UnsupportedOpError

    emb = randn(64, 8)

    def dot_bias(score, b, h, q_idx, kv_idx):
        return score + torch.dot(emb[q_idx], emb[kv_idx])

    forward_calls = []
    real_call = runtime.ForwardKernel.__call__
    monkeypatch.setattr(runtime.ForwardKernel, "__call__",
                        lambda self, *a, **k: forward_calls.append(1) or real_call(self, *a, **k))
    q, k, v = (randn(1, 2, 64, 16) for _ in range(3))
    with pytest.raises(UnsupportedOpError, match="dot_bias") as info:
        flex_attention(q, k, v, score_mod=dot_bias, kernel_options=TRITON)
    assert not forward_calls
    assert "torch.dot(emb[q_idx], emb[kv_idx])" in str(info.value) and "PYTORCH" in str(info.value)
    # The PyTorch backend runs it, gradients included.
    out = flex_attention(q, k, v, score_mod=dot_bias, kernel_options={"BACKEND": "PYTORCH"})
    out.sum().backward()
    assert emb.grad is not None and torch.isfinite(emb.grad).all()


# ------------------------------------------------------------------------------ resource fallback


def _backward_plan(dkdv, dq, dkdv_grid=(16, 2, 1), dq_grid=(8, 2, 1), check_compiled=False):
    """A backward Plan of two steps with these constexprs, for 1000 queries and keys (bf16)."""
    from flexattn.codegen.params import BACKWARD_DKDV, BACKWARD_DQ
    from flexattn.kernels.family import Plan, Step

    return Plan(None, {"dkdv": Step(BACKWARD_DKDV, dkdv_grid, dkdv), "dq": Step(BACKWARD_DQ, dq_grid, dq)},
                (1000, 1000), 2, check_compiled=check_compiled)


def _backward_family(has_mods=True):
    import flexattn.kernels.backward as bw

    return bw.BackwardKernel(object() if has_mods else None, None, tanh_approx=False)


def test_smaller_backward_plans_step_down_to_16():
    def constexprs(M, N, stages):
        return dict(BLOCK_M=M, BLOCK_N=N, num_stages=stages, NUM_STAGES=stages, EVEN_M=True, EVEN_N=True)

    family = _backward_family()
    plan = _backward_plan(constexprs(64, 64, 2), constexprs(128, 128, 2))
    plan = family._smaller_plan(plan, {})
    assert plan.constexprs("dkdv")["num_stages"] == plan.constexprs("dq")["NUM_STAGES"] == 1
    plan = family._smaller_plan(plan, {})
    # The larger program (dQ, 128x128) loses half its walked tile (its keys) first.
    assert (plan.constexprs("dq")["BLOCK_M"], plan.constexprs("dq")["BLOCK_N"]) == (128, 64)
    plan = family._smaller_plan(plan, {})
    assert (plan.constexprs("dq")["BLOCK_M"], plan.constexprs("dq")["BLOCK_N"]) == (64, 64)
    assert plan.steps["dq"].grid == (16, 2, 1) and plan.constexprs("dq")["EVEN_M"] is False
    steps = 0
    while (smaller := family._smaller_plan(plan, {})) is not None:
        plan, steps = smaller, steps + 1
    for c in (plan.constexprs("dkdv"), plan.constexprs("dq")):
        assert c["BLOCK_M"] == c["BLOCK_N"] == 16
    assert plan.steps["dkdv"].grid == (63, 2, 1) and plan.constexprs("dkdv")["EVEN_N"] is False and steps == 8
    # Pinned tiles are never shrunk.
    assert family._smaller_plan(plan, {"BLOCK_M1": 16}) is None


# ------------------------------------------------------------------------------ costly tiles


def _backward_default_plan(stages=2):
    def constexprs(M, N):
        # 1000 queries and keys: no tile of 32 or more divides them.
        return dict(BLOCK_M=M, BLOCK_N=N, num_stages=stages, NUM_STAGES=stages, EVEN_M=False, EVEN_N=False,
                    QK_HEAD_DIM_P2=64, V_HEAD_DIM_P2=64)

    return _backward_plan(constexprs(64, 64), constexprs(64, 64), (16, 2, 1), (16, 16, 1), check_compiled=True)


def _compiled(spills=0, shared=0):
    from types import SimpleNamespace

    return SimpleNamespace(n_spills=spills, metadata=SimpleNamespace(shared=shared))


def _after(plan, dkdv_kernel, dq_kernel, has_mods=True):
    return _backward_family(has_mods)._plan_after_compile(plan, {"dkdv": dkdv_kernel, "dq": dq_kernel})


def test_a_spilling_backward_kernel_halves_its_walked_tile_then_its_owned_one():
    plan = _backward_default_plan()
    after = _after(plan, _compiled(spills=258), _compiled())
    # dK/dV walks queries: BLOCK_M first; its grid (one program per owned key tile) is unchanged.
    assert (after.constexprs("dkdv")["BLOCK_M"], after.constexprs("dkdv")["BLOCK_N"]) == (32, 64)
    assert after.constexprs("dq") == plan.constexprs("dq") and after.steps["dkdv"].grid == plan.steps["dkdv"].grid
    assert after.check_compiled
    after = _after(after, _compiled(spills=258), _compiled(spills=400))
    # Now its owned key tile (more programs, bounds checks on the last), and dQ's walked key tile.
    assert (after.constexprs("dkdv")["BLOCK_M"], after.constexprs("dkdv")["BLOCK_N"]) == (32, 32)
    assert after.steps["dkdv"].grid == (32, 2, 1) and after.constexprs("dkdv")["EVEN_N"] is False
    assert (after.constexprs("dq")["BLOCK_M"], after.constexprs("dq")["BLOCK_N"]) == (64, 32)
    assert after.steps["dq"].grid == (16, 16, 1)
    # Nothing below 32: the plan is kept and marked as seen.
    after = _after(after, _compiled(spills=500), _compiled())
    after = _after(after, _compiled(spills=500), _compiled())
    assert after.constexprs("dkdv")["BLOCK_M"] == after.constexprs("dkdv")["BLOCK_N"] == 32
    # A few spilled bytes keep the tiles.
    few = _after(plan, _compiled(spills=100), _compiled(spills=100))
    assert few.constexprs("dkdv") == plan.constexprs("dkdv") and not few.check_compiled


def test_staged_gathers_cost_the_backward_kernel_a_stage_for_mods_only():
    import flexattn.kernels.family as rt

    plan = _backward_default_plan()
    tiles = (64 + 2 * 64) * 128 * 2  # owned tiles once, walked ones per stage
    staged = _compiled(shared=tiles + rt.STAGED_GATHER_BYTES)
    after = _after(plan, _compiled(shared=tiles), staged)
    assert after.constexprs("dq")["num_stages"] == after.constexprs("dq")["NUM_STAGES"] == 1 and after.check_compiled
    assert after.constexprs("dkdv")["num_stages"] == 2
    near = _compiled(shared=tiles + rt.STAGED_GATHER_BYTES - 1)
    assert not _after(plan, near, near).check_compiled
    assert not _after(plan, staged, staged, has_mods=False).check_compiled


def test_the_interpreter_and_pinned_tiles_never_replan_the_backward():
    import flexattn.kernels.backward as bw

    for options in (TRITON, {**TRITON, "BLOCK_M1": 16}):
        q, k, v = (randn(1, 2, 64, 16) for _ in range(3))
        flex_attention(q, k, v, kernel_options=options).sum().backward()
        kernel = list(bw._kernels.values())[-1]
        assert kernel._plans and not any(plan.check_compiled for plan in kernel._plans.values())


def test_a_backward_out_of_resources_runs_again_with_smaller_tiles(monkeypatch):
    """A kernel the GPU cannot fit (raised here for the first dQ launch, after the dK/dV kernel has
    added into the learnable slopes' gradient) is retried with a smaller plan from fresh buffers,
    and the gradients still equal the float64 reference's."""
    import flexattn.kernels.backward as bw
    from triton.runtime.errors import OutOfResources

    real, failed = bw.launch, []

    def launch(jit_fn, grid, args, constexprs):
        if "dq" in getattr(jit_fn, "__name__", str(jit_fn)) and not failed:
            failed.append(constexprs)
            raise OutOfResources(300000, 232448, "shared memory")
        return real(jit_fn, grid, args, constexprs)

    monkeypatch.setattr(bw, "launch", launch)
    check_grads(*learnable_alibi(), causal_mask)
    assert failed and failed[0]["num_stages"] >= 1
    kernel = list(bw._kernels.values())[-1]
    assert any(plan.constexprs("dq") is not failed[0] and plan.constexprs("dq")["num_stages"] == 1
               for plan in kernel._plans.values())


def test_a_backward_that_fits_no_tile_or_was_pinned_says_so(monkeypatch):
    import flexattn.kernels.backward as bw
    from flexattn.errors import ResourceError
    from triton.runtime.errors import OutOfResources

    real = bw.launch

    def launch(jit_fn, grid, args, constexprs):
        if "preprocess" in getattr(jit_fn, "__name__", str(jit_fn)):
            return real(jit_fn, grid, args, constexprs)
        raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(bw, "launch", launch)
    for options in (TRITON, {**TRITON, "BLOCK_M1": 16, "BLOCK_N1": 16}):
        q, k, v = (randn(1, 2, 64, 16) for _ in range(3))
        out = flex_attention(q, k, v, kernel_options=options)
        with pytest.raises(ResourceError, match="does not fit this GPU"):
            out.sum().backward()
