"""The output's layout ([Note] The output's layout in flexattn/kernels/launch.py): the output is
stored as the query is, and a gradient in that layout reaches the kernels without a copy.

A model cuts q, k and v from one projection ([B, L, 3, H, E] storage) and reshapes the output back
to [B, L, H * E]: with the output in the query's layout that reshape is a view, and the backward's
gradient of the output arrives in the same layout."""

from __future__ import annotations

import pytest
import torch
from numerics import rel_err

import flexattn.kernels.backward as portable_backward
from flexattn import create_block_mask, flex_attention
from flexattn.reference import reference_attention
from flexattn.variants import causal_mask

pytestmark = pytest.mark.usefixtures("one_thread")

B, H, L, E = 2, 2, 64, 32
TRITON = {"BACKEND": "TRITON"}
PYTORCH = {"BACKEND": "PYTORCH"}


def projected(dtype=torch.float32):
    """q, k, v as a model makes them, and the projection's output (the leaf) they are views of."""
    qkv = torch.randn(B, L, 3, H, E, dtype=dtype).requires_grad_()
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    return qkv, q, k, v


def merged(out):
    """The model's next step: heads back into one row per token."""
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


@pytest.mark.parametrize("options", [TRITON, PYTORCH], ids=["triton", "pytorch"])
def test_output_is_stored_as_the_query_is(options):
    qkv, q, k, v = projected()
    bm = create_block_mask(causal_mask, 1, 1, L, L, device="cpu", BLOCK_SIZE=32)
    out = flex_attention(q, k, v, block_mask=bm, kernel_options=options)
    assert out.shape == (B, H, L, E)
    assert out.transpose(1, 2).is_contiguous(), out.stride()  # [B, L, H, E] storage
    y = merged(out)
    assert y.data_ptr() == out.data_ptr()  # a view, not a copy
    want = reference_attention(*(t.detach().double() for t in (q, k, v)), mask_mod=causal_mask)[0]
    assert rel_err(out, want) < 1e-5

    contiguous = flex_attention(q.contiguous(), k.contiguous(), v.contiguous(), block_mask=bm,
                                kernel_options=options)
    assert contiguous.is_contiguous()
    assert rel_err(contiguous, want) < 1e-5


def test_gradient_in_the_output_layout_reaches_the_kernels_uncopied(monkeypatch):
    seen = []
    call = portable_backward.BackwardKernel.__call__

    def spy(self, q, k, v, out, lse, grad_out, *args, **kwargs):
        seen.append((grad_out.stride(), out.stride()))
        return call(self, q, k, v, out, lse, grad_out, *args, **kwargs)

    monkeypatch.setattr(portable_backward.BackwardKernel, "__call__", spy)
    qkv, q, k, v = projected()
    weight = torch.randn(H * E, 16, dtype=torch.float64)
    bm = create_block_mask(causal_mask, 1, 1, L, L, device="cpu", BLOCK_SIZE=32)
    out = flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON)
    (merged(out).double() @ weight).sin().sum().backward()
    assert len(seen) == 1
    grad_stride, out_stride = seen[0]
    assert grad_stride == out_stride == (L * H * E, E, H * E, 1)

    gold = qkv.detach().double().requires_grad_()
    q64, k64, v64 = gold.permute(2, 0, 3, 1, 4)
    ref = reference_attention(q64, k64, v64, mask_mod=causal_mask)[0]
    (merged(ref) @ weight).sin().sum().backward()
    assert rel_err(qkv.grad, gold.grad) < 1e-4


@pytest.mark.parametrize("options", [TRITON, PYTORCH], ids=["triton", "pytorch"])
def test_an_expanded_gradient_is_still_right(options):
    # out.sum()'s gradient is one value expanded over every element (all strides 0): the kernels
    # cannot read it as rows, so it is copied first.
    qkv, q, k, v = projected()
    out = flex_attention(q, k, v, kernel_options=options)
    out.sum().backward()
    gold = qkv.detach().double().requires_grad_()
    reference_attention(*gold.permute(2, 0, 3, 1, 4))[0].sum().backward()
    assert rel_err(qkv.grad, gold.grad) < 1e-4


def test_compiled_graph_sees_the_kernels_strides():
    # Inductor checks an op's real output strides against its fake implementation's: they must be
    # the same, and the merge of heads after it must stay a view.
    qkv, q, k, v = projected()
    bm = create_block_mask(causal_mask, 1, 1, L, L, device="cpu", BLOCK_SIZE=32)
    weight = torch.randn(H * E, 16)

    def layer(qkv, bm):
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        out = flex_attention(q, k, v, block_mask=bm, kernel_options=TRITON)
        return merged(out) @ weight, out

    eager_y, eager_out = layer(qkv, bm)
    eager_y.sum().backward()
    expected = qkv.grad.clone()
    qkv.grad = None
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    y, out = compiled(qkv, bm)
    assert out.stride() == eager_out.stride() == (L * H * E, E, H * E, 1)
    y.sum().backward()
    assert rel_err(y, eager_y) < 1e-5
    assert rel_err(qkv.grad, expected) < 1e-5
