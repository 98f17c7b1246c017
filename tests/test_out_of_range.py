"""Out-of-range gathers: one rule on every backend (issue 19).

``t[i]`` with ``i`` in ``[-n, n)`` reads what torch reads (negative indices wrap); any other ``i``
reads 0 (False from a bool tensor) where torch would raise IndexError, and adds nothing to ``t``'s
gradient. The Triton kernels (forward, backward, decode; run in Triton's interpreter here), the
PyTorch backend, create_block_mask and the float64 reference all follow it. Each is compared with
mods that spell the rule out with a clamp and torch.where, which never index out of range.
"""

import os

import pytest
import torch
from numerics import rel_err

from flexattn import create_block_mask, create_mask, flex_attention
from flexattn.errors import ModTraceError
from flexattn.reference import reference_attention
from flexattn.trace import GathersReadZero, gather_or_zero

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="Triton on CPU tensors needs TRITON_INTERPRET=1"
)
BACKENDS = ["PYTORCH", pytest.param("TRITON", marks=needs_interpreter)]

L = S = 96
REL = torch.randn(40)  # read at q_idx - kv_idx + 10, from -85 to 105: wraps down to -40, 0 beyond either end
DOC = torch.arange(64) // 16  # 64 document ids for 96 positions: the last 32 read document 0
ALLOWED = torch.rand(80) > 0.2  # a bool table of 80 keys: keys 80 and up read False


def _rel_index(q_idx, kv_idx):
    return q_idx - kv_idx + 10


def make_score_mods(rel):
    def far(score, b, h, q_idx, kv_idx):
        return score + rel[_rel_index(q_idx, kv_idx)] * (h + 1)

    def far_spelled_out(score, b, h, q_idx, kv_idx):
        i = _rel_index(q_idx, kv_idx)
        inside = (i >= -40) & (i < 40)
        return score + torch.where(inside, rel[i.clamp(-40, 39)], 0.0) * (h + 1)

    return far, far_spelled_out


def same_doc(b, h, q_idx, kv_idx):
    return (DOC[q_idx] == DOC[kv_idx]) & ALLOWED[kv_idx]


def same_doc_spelled_out(b, h, q_idx, kv_idx):
    doc_q = torch.where(q_idx < 64, DOC[q_idx.clamp(max=63)], 0)
    doc_kv = torch.where(kv_idx < 64, DOC[kv_idx.clamp(max=63)], 0)
    return (doc_q == doc_kv) & (kv_idx < 80) & ALLOWED[kv_idx.clamp(max=79)]


def test_gather_or_zero_is_torch_in_range_and_zero_outside():
    table = torch.arange(1.0, 13.0).reshape(3, 4)
    rows = torch.tensor([-4, -3, -1, 0, 2, 3, 7])
    cols = torch.tensor([[0], [-5], [3], [4]])  # broadcast against rows: a [4, 7] result
    got = gather_or_zero(table, [rows, cols])
    inside = ((rows >= -3) & (rows < 3)) & ((cols >= -4) & (cols < 4))
    want = torch.where(inside, table[rows.clamp(-3, 2), cols.clamp(-4, 3)], 0.0)
    assert torch.equal(got, want) and got.shape == (4, 7)
    # One index of a 2-D table: the rows read whole, zero rows where out of range.
    assert torch.equal(gather_or_zero(table, [rows]), torch.where(inside[0, :, None], table[rows.clamp(-3, 2)], 0.0))
    flags = torch.tensor([True, False, True])
    assert gather_or_zero(flags, [torch.tensor([0, 3, -4, -1])]).tolist() == [True, False, False, True]
    ints = torch.arange(10, 15, dtype=torch.int32)
    assert gather_or_zero(ints, [torch.tensor([-6, -5, 4, 5], dtype=torch.int32)]).tolist() == [0, 10, 14, 0]
    # More indices than dimensions: torch's own error, from tensor[...] in a mod too.
    with pytest.raises(IndexError, match="too many indices for tensor of dimension 1"):
        gather_or_zero(ints, [torch.tensor(1), torch.tensor(2)])
    with GathersReadZero(), pytest.raises(IndexError, match="too many indices for tensor of dimension 1"):
        ints[torch.tensor(1), 2]


def test_gather_or_zero_under_vmap_and_autograd():
    table = torch.randn(5, requires_grad=True)
    index = torch.arange(-8, 8)
    got = torch.vmap(lambda i: gather_or_zero(table, [i]))(index)
    inside = (index >= -5) & (index < 5)
    assert torch.equal(got, torch.where(inside, table[index.clamp(-5, 4)], 0.0))
    (grad,) = torch.autograd.grad(got.sum(), table)
    assert grad.tolist() == [2.0] * 5  # -5..-1 and 0..4 each read every element once; -8..-6 and 5..7 nothing


def test_reference_and_block_masks_follow_the_rule():
    far, spelled = make_score_mods(REL)
    q, k, v = (torch.randn(1, 2, L, 16, dtype=torch.float64) for _ in range(3))
    for got, want in zip(reference_attention(q, k, v, score_mod=far, mask_mod=same_doc),
                         reference_attention(q, k, v, score_mod=spelled, mask_mod=same_doc_spelled_out)):
        assert torch.equal(got, want)
    for block in (16, 32):  # create_block_mask evaluates the mask_mod with vmap, tile by tile
        got = create_block_mask(same_doc, 1, 1, L, S, device="cpu", BLOCK_SIZE=block)
        want = create_block_mask(same_doc_spelled_out, 1, 1, L, S, device="cpu", BLOCK_SIZE=block)
        assert torch.equal(got.to_dense(), want.to_dense())
        assert torch.equal(got.full_kv_num_blocks, want.full_kv_num_blocks)
    assert torch.equal(create_mask(same_doc, 1, 1, L, S, device="cpu"),
                       create_mask(same_doc_spelled_out, 1, 1, L, S, device="cpu"))
    assert torch.equal(create_mask(far, 1, 2, L, S, device="cpu"), create_mask(spelled, 1, 2, L, S, device="cpu"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_backward_read_zero_out_of_range(backend, one_thread):
    rel = REL.clone().requires_grad_()
    far, spelled = make_score_mods(rel)
    q, k, v = (torch.randn(2, 2, L, 16, requires_grad=True) for _ in range(3))
    bm = create_block_mask(same_doc, 2, 1, L, S, device="cpu", BLOCK_SIZE=32)
    out = flex_attention(q, k, v, score_mod=far, block_mask=bm, kernel_options={"BACKEND": backend})
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, rel), grad)

    q64, k64, v64, rel64 = (t.detach().double().requires_grad_() for t in (q, k, v, rel))
    _, spelled64 = make_score_mods(rel64)
    ref, _, _ = reference_attention(q64, k64, v64, score_mod=spelled64, mask_mod=same_doc_spelled_out)
    want = torch.autograd.grad(ref, (q64, k64, v64, rel64), grad.double())
    assert rel_err(out, ref) < 1e-5
    for name, g, w in zip(("q", "k", "v"), got, want):
        assert rel_err(g, w) < 1e-5, name
    # Element by element: an out-of-range read is made at an element in range (the kernels use 0, the
    # PyTorch backend the nearest end) and then zeroed; none of its gradient may reach that element.
    torch.testing.assert_close(got[3].double(), want[3], atol=1e-5, rtol=1e-4)

    # The same call with the rule spelled out, on the same backend: the same numbers.
    same = flex_attention(q, k, v, score_mod=spelled, block_mask=bm, kernel_options={"BACKEND": backend})
    assert rel_err(out, same) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_reads_that_are_all_out_of_range_add_nothing(backend, one_thread):
    # rel[q_idx - kv_idx + 50] is in range only where kv_idx > q_idx + 10, which causal masking drops:
    # every pair kept reads out of range, so the bias is 0 and rel gets exactly no gradient.
    rel = torch.randn(40, requires_grad=True)

    def ahead(score, b, h, q_idx, kv_idx):
        return score + rel[q_idx - kv_idx + 50]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    q, k, v = (torch.randn(1, 2, L, 16, requires_grad=True) for _ in range(3))
    bm = create_block_mask(causal, 1, 1, L, S, device="cpu", BLOCK_SIZE=32)
    options = {"BACKEND": backend}
    out = flex_attention(q, k, v, score_mod=ahead, block_mask=bm, kernel_options=options)
    (d_rel,) = torch.autograd.grad(out.sum(), rel)
    assert not d_rel.any()
    assert rel_err(out, flex_attention(q, k, v, block_mask=bm, kernel_options=options)) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_constant_indices(backend, one_thread):
    # A Python int out of range is a bug at every position: an error when the mod is traced, naming
    # the line, as torch raises; a constant tensor out of range follows the rule and reads 0.
    table = torch.randn(2, 3)

    def python_int(score, b, h, q_idx, kv_idx):
        return score + table[h, 5]

    def constant_tensor(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.tensor(5)] * 100 + table[h, torch.tensor(-1)] * q_idx

    def spelled_out(score, b, h, q_idx, kv_idx):
        return score + table[h, 2] * q_idx

    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    options = {"BACKEND": backend}
    with pytest.raises(ModTraceError, match=r"table\[h, 5\]\n.*IndexError: index 5 is out of bounds for dimension 1 "
                                            r"with size 3"):
        flex_attention(q, k, v, score_mod=python_int, kernel_options=options)
    got = flex_attention(q, k, v, score_mod=constant_tensor, kernel_options=options)
    assert rel_err(got, flex_attention(q, k, v, score_mod=spelled_out, kernel_options=options)) < 1e-6


@needs_interpreter
def test_decode_kernels_read_zero_out_of_range(one_thread):
    far, spelled = make_score_mods(REL)
    q = torch.randn(2, 4, 8, 16)
    k, v = (torch.randn(2, 2, S, 16) for _ in range(2))
    bm = create_block_mask(same_doc, 2, 1, 8, S, device="cpu", BLOCK_SIZE=(8, 32))
    outs = {backend: flex_attention(q, k, v, score_mod=far, block_mask=bm, enable_gqa=True,
                                    kernel_options={"BACKEND": backend})
            for backend in ("TRITON_DECODE", "PYTORCH")}
    ref, _, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=spelled,
                                    mask_mod=same_doc_spelled_out, enable_gqa=True)
    for backend, out in outs.items():
        assert rel_err(out, ref) < 1e-5, backend
