"""flexattn/autograd.py: gradients taken with ``create_graph=True`` (issue 50, item 5).

A first-order gradient taken with ``create_graph=True`` must be the ordinary gradient, whatever
subset of the inputs requires grad; only differentiating that gradient again (a double backward)
is refused, with the error docs/limitations.md describes. Both backends are covered: the PyTorch
one and the Triton kernels (in Triton's interpreter on CPU).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from numerics import expect_triton_backward, rel_err

from flexattn import flex_attention
from flexattn.reference import reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Norm-wise relative error budget of a float32 gradient against float64 (as in test_triton_backward.py).
GRAD_TOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")

# (kv batch, kv heads) next to queries [2, 4, L, E]: the same shape, a key/value batch of 1 that
# broadcasts over the queries' batch, and GQA (two query heads per kv head).
LAYOUTS = {"plain": (2, 4), "kv_batch_1": (1, 4), "gqa": (2, 2)}


def _expect_backend(backend: str):
    """On the Triton backend, fails unless the generated backward kernels ran."""
    return expect_triton_backward() if backend == "TRITON" else contextlib.nullcontext()


def _double_backward_refused(grad: torch.Tensor, leaf: torch.Tensor) -> None:
    """Differentiating the gradient again raises the documented error (docs/limitations.md)."""
    assert grad.requires_grad, "create_graph=True must give a gradient that refuses differentiation loudly"
    refused = "flex_attention does not support double backward"
    with pytest.raises(RuntimeError, match=refused):
        torch.autograd.grad(grad, leaf, torch.randn_like(grad))  # a gradient penalty's form
    with pytest.raises(RuntimeError, match=refused):
        grad.backward(torch.randn_like(grad))


@pytest.mark.parametrize("backend", ["PYTORCH", "TRITON"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("leaf", ["q", "k", "v"])
def test_create_graph_with_one_input_requiring_grad(backend, layout, leaf):
    # The bug: with one input requiring grad the gradient lost its leading dimension
    # ("got [4, 64, 16] but expected [2, 4, 64, 16]") at the first backward.
    kv_batch, kv_heads = LAYOUTS[layout]
    L, E = 64, 16
    inputs = {
        "q": torch.randn(2, 4, L, E, device=DEVICE),
        "k": torch.randn(kv_batch, kv_heads, L, E, device=DEVICE),
        "v": torch.randn(kv_batch, kv_heads, L, E, device=DEVICE),
    }
    inputs[leaf].requires_grad_()
    gqa = kv_heads != 4
    out = flex_attention(*inputs.values(), enable_gqa=gqa, kernel_options={"BACKEND": backend})
    upstream = torch.randn_like(out)
    with _expect_backend(backend):
        (grad,) = torch.autograd.grad(out, inputs[leaf], upstream, create_graph=True)

    gold = {name: t.detach().double().requires_grad_(name == leaf) for name, t in inputs.items()}
    ref_out, _, _ = reference_attention(*gold.values(), enable_gqa=gqa)
    (expected,) = torch.autograd.grad(ref_out, gold[leaf], upstream.double())
    assert grad.shape == inputs[leaf].shape
    assert rel_err(grad, expected) < GRAD_TOL

    _double_backward_refused(grad, inputs[leaf])


@pytest.mark.parametrize("backend", ["PYTORCH", "TRITON"])
def test_create_graph_with_only_a_learnable_captured_tensor(backend):
    # The score_mod's captured tensor is the only input that requires grad: one gradient again.
    q, k, v = (torch.randn(1, 2, 32, 16, device=DEVICE) for _ in range(3))
    slopes = torch.randn(2, device=DEVICE, requires_grad=True)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    out = flex_attention(q, k, v, score_mod=alibi, kernel_options={"BACKEND": backend})
    upstream = torch.randn_like(out)
    with _expect_backend(backend):
        (grad,) = torch.autograd.grad(out, slopes, upstream, create_graph=True)

    slopes64 = slopes.detach().double().requires_grad_()

    def alibi64(score, b, h, q_idx, kv_idx):
        return score + slopes64[h] * (kv_idx - q_idx)

    ref_out, _, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=alibi64)
    (expected,) = torch.autograd.grad(ref_out, slopes64, upstream.double())
    assert grad.shape == slopes.shape
    # A captured tensor's gradient sums many cancelling terms: test_triton_backward.py's wider budget.
    assert rel_err(grad, expected) < 1e-3
    _double_backward_refused(grad, slopes)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("leaf", ["q", "k", "v"])
def test_create_graph_gradient_equals_torch_flex_attention(layout, leaf):
    # torch's own FlexAttention has no backward on CPU, so this comparison runs on the GPU only.
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

    kv_batch, kv_heads = LAYOUTS[layout]
    L, E = 256, 64
    inputs = {
        "q": torch.randn(2, 4, L, E, device="cuda"),
        "k": torch.randn(kv_batch, kv_heads, L, E, device="cuda"),
        "v": torch.randn(kv_batch, kv_heads, L, E, device="cuda"),
    }
    inputs[leaf].requires_grad_()
    gqa = kv_heads != 4
    out = flex_attention(*inputs.values(), enable_gqa=gqa)
    upstream = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, inputs[leaf], upstream, create_graph=True)
    # torch takes a key/value batch of 1 for a query batch of 2 only with a BlockMask (a full one here).
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    full = torch_create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, 2, None, L, L, device="cuda")
    theirs = torch_flex_attention(*inputs.values(), block_mask=full, enable_gqa=gqa)
    (expected,) = torch.autograd.grad(theirs, inputs[leaf], upstream)
    assert grad.shape == expected.shape
    # Both float32 with their own summation orders; each is within 1e-4 of float64 (GRAD_TOL).
    assert rel_err(grad, expected) < 2 * GRAD_TOL
    _double_backward_refused(grad, inputs[leaf])
