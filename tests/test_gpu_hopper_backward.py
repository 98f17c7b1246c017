"""The Hopper Gluon backward (kernels/hopper/backward.py) on a real H100-class GPU: dQ, dK and dV
against the float64 reference under the flash-attention rule (tests/test_gpu_backward.py's
check_flash_rule), the paper's variants at both head dims and in both 16-bit dtypes, GQA, the LSE's
gradient, a transposed layout, fully masked rows, two masks of one shape, both head dims with dQ in
the dK/dV kernel and in its own, bit-identical reruns of the two-kernel form, and which calls take
it. Skipped without CUDA and where the kernels do not apply (another GPU, another Triton): there the
portable backward is the one tested elsewhere.

Every output buffer is NaN-filled before the kernels write it (poisoned), so a row a kernel
skipped shows up as NaN.
"""

from __future__ import annotations

import pytest
import torch
from numerics import rel_err
from test_gpu_backward import check_flash_rule, plain, qkv_leaves

import flexattn.kernels.backward as portable_backward
import flexattn.kernels.launch as launch_module
import flexattn.kernels.hopper.backward as hopper_backward
from flexattn.kernels import ahead
from flexattn import create_block_mask, flex_attention
from flexattn.errors import InvalidInputError
from flexattn.reference import reference_attention
from flexattn.variants import CATALOGUE

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
GLUON = {"BACKEND": "GLUON"}
PAPER = [name for name, variant in CATALOGUE.items() if variant.paper]


@pytest.fixture(autouse=True)
def hopper_and_poisoned(monkeypatch):
    probe = torch.empty(1, 1, 128, 64, device=DEVICE, dtype=torch.bfloat16)
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 128, 128, device=DEVICE)
    reason = hopper_backward.problem_reason(probe, probe, probe, mask)
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setattr(launch_module, "_POISON_OUTPUTS", True)


def gluon_gradients(leaves, build, mask_mod=None, **kwargs):
    """check_flash_rule through the Gluon backward (its launch counter must grow, the portable one's not)."""
    before, portable = hopper_backward.launches, portable_backward.launches
    errors = check_flash_rule(leaves, build, mask_mod, options=kwargs.pop("options", GLUON), **kwargs)
    assert hopper_backward.launches > before, "the Gluon backward did not run"
    assert portable_backward.launches == portable, "the portable backward ran instead"
    return errors


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", PAPER)
def test_paper_variants_bf16(variant, head_dim):
    B, H, L = 2, 4, 1024
    score_mod, mask_mod = CATALOGUE[variant].build(B, H, L, L, DEVICE)
    gluon_gradients(qkv_leaves(B, H, H, L, L, head_dim), plain(score_mod), mask_mod)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", ["noop", "causal", "alibi"])
def test_fp16(variant, head_dim):
    B, H, L = 2, 4, 1024
    score_mod, mask_mod = CATALOGUE[variant].build(B, H, L, L, DEVICE)
    gluon_gradients(qkv_leaves(B, H, H, L, L, head_dim, torch.float16), plain(score_mod), mask_mod)


@pytest.mark.parametrize("variant, head_dim", [("causal", 128), ("document_mask", 64)])
def test_gqa_8_2_and_the_lse_gradient(variant, head_dim):
    B, Hq, Hkv, L = 2, 8, 2, 1024
    score_mod, mask_mod = CATALOGUE[variant].build(B, Hq, L, L, DEVICE)
    gluon_gradients(qkv_leaves(B, Hq, Hkv, L, L, head_dim), plain(score_mod), mask_mod, gqa=True, use_lse=True)


def test_transposed_layout_and_longer_keys():
    # [B, N, H, D] storage read as [B, H, N, D] (heads side by side in a row); 512 queries, 1024 keys.
    B, H, L, S, E = 2, 4, 512, 1024, 128
    leaves = {name: torch.randn(B, n, H, E, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
              for name, n in (("q", L), ("k", S), ("v", S))}
    mask_mod = CATALOGUE["sliding_window"].build(B, H, L, S, DEVICE)[1]
    gluon_gradients(leaves, plain(), mask_mod)


def test_fully_masked_rows():
    # Odd query blocks see no key block; odd rows of even blocks see nothing inside theirs.
    B, H, L = 1, 2, 1024

    def sparse_rows(b, h, q_idx, kv_idx):
        return ((q_idx // 128) % 2 == 0) & (q_idx % 2 == 0) & (kv_idx <= q_idx)

    # PyTorch's same-dtype softmax gives NaN on such rows, so the rule's baseline is out; float64 only.
    leaves = qkv_leaves(B, H, H, L, L, 128)
    grad_out = torch.randn(B, H, L, 128, device=DEVICE, dtype=torch.bfloat16)
    block_mask = create_block_mask(sparse_rows, None, None, L, L, device=DEVICE)
    before = hopper_backward.launches
    out = flex_attention(leaves["q"], leaves["k"], leaves["v"], block_mask=block_mask, kernel_options=GLUON)
    out.backward(grad_out)
    assert hopper_backward.launches == before + 1
    gold = {name: t.detach().double().requires_grad_() for name, t in leaves.items()}
    reference_attention(gold["q"], gold["k"], gold["v"], mask_mod=sparse_rows)[0].backward(grad_out.double())
    for name, t in leaves.items():
        assert rel_err(t.grad, gold[name].grad) < 2e-2, name
    empty = torch.arange(L, device=DEVICE)
    empty = ((empty // 128) % 2 == 1) | (empty % 2 == 1)
    assert torch.equal(leaves["q"].grad[:, :, empty], torch.zeros_like(leaves["q"].grad[:, :, empty]))


def test_two_masks_of_one_shape():
    # Same shapes and mods (the plan's key), different BlockMask content: each call walks its own tables.
    B, H, L = 1, 2, 2048
    leaves = qkv_leaves(B, H, H, L, L, 128)
    for w in (256, 1024, 256):
        gluon_gradients(leaves, plain(), lambda b, h, qi, ki, w=w: (qi >= ki) & (qi - ki < w))


@pytest.fixture
def plans(monkeypatch):
    """The steps of each Gluon backward launch, in order (not the runs whose launches were only
    recorded, to be compiled ahead: kernels/ahead.py)."""
    seen = []
    real = hopper_backward.HopperBackwardKernel._launch

    def recording(self, plan, *args):
        if not ahead.recording():
            seen.append(plan.steps)
        return real(self, plan, *args)

    monkeypatch.setattr(hopper_backward.HopperBackwardKernel, "_launch", recording)
    return seen


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant, gqa", [("alibi", 1), ("noop", 4), ("document_mask", 1)])
@pytest.mark.parametrize("ordered", [True, False])
def test_reruns_are_bit_identical(variant, gqa, ordered, head_dim, plans, monkeypatch):
    # (Pinned: by default only masks whose rows visit every key block take the ordered form.)
    # dQ added in the dK/dV kernel in a fixed order ([Note] Ordered dQ additions), and the two-kernel
    # form (every output row has one writer): three runs, the same bits. Enough programs at once
    # (B2 H8 4k: 256 dK/dV programs) that their order of arrival varies from run to run.
    monkeypatch.setattr(hopper_backward, "ORDERS_DQ", "always" if ordered else "never")
    B, H, L = 2, 8, 4096
    score_mod, mask_mod = CATALOGUE[variant].build(B, H, L, L, DEVICE)
    leaves = qkv_leaves(B, H, H // gqa, L, L, head_dim)
    block_mask = create_block_mask(mask_mod, B, None, L, L, device=DEVICE) if mask_mod else None
    grad_out = torch.randn(B, H, L, head_dim, device=DEVICE, dtype=torch.bfloat16)
    runs = []
    for _ in range(3):
        out = flex_attention(leaves["q"], leaves["k"], leaves["v"], score_mod=score_mod, block_mask=block_mask,
                             enable_gqa=gqa > 1, kernel_options={"DETERMINISTIC": True})
        runs.append(torch.autograd.grad(out, list(leaves.values()), grad_out))
    assert len(plans) == 3
    assert all(("dq" in steps) != ordered and steps["dkdv"].constexprs["ORDERED_DQ"] == ordered for steps in plans)
    for run in runs[1:]:
        for first, again in zip(runs[0], run):
            assert torch.equal(first, again)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", ["noop", "causal", "alibi", "softcap", "document_mask"])
def test_both_forms(variant, head_dim, plans):
    # [Note] dQ in the dK/dV kernel: the form without a dQ kernel (turns at head dim 64, each
    # consumer's columns at 128), AUTO's choice; the deterministic call's ordered additions ([Note]
    # Ordered dQ additions); and the two-kernel form it falls back to, each under the
    # flash-attention rule against float64.
    B, H, L = 2, 4, 1024
    score_mod, mask_mod = CATALOGUE[variant].build(B, H, L, L, DEVICE)
    leaves = qkv_leaves(B, H, H, L, L, head_dim)
    gluon_gradients(leaves, plain(score_mod), mask_mod)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hopper_backward, "ORDERS_DQ", "always")
        gluon_gradients(leaves, plain(score_mod), mask_mod, options={**GLUON, "DETERMINISTIC": True})
        patch.setattr(hopper_backward, "ORDERS_DQ", "never")
        gluon_gradients(leaves, plain(score_mod), mask_mod, options={**GLUON, "DETERMINISTIC": True})
    assert [("dq" in steps) for steps in plans] == [False, False, True]
    assert [steps["dkdv"].constexprs["ORDERED_DQ"] for steps in plans] == [False, True, False]


def test_auto_takes_it_and_triton_pins_the_portable_backward():
    B, H, L = 1, 2, 1024
    leaves = qkv_leaves(B, H, H, L, L, 128)
    grad_out = torch.randn(B, H, L, 128, device=DEVICE, dtype=torch.bfloat16)

    def grads(options):
        out = flex_attention(leaves["q"], leaves["k"], leaves["v"], kernel_options=options)
        return torch.autograd.grad(out, list(leaves.values()), grad_out)

    before, portable = hopper_backward.launches, portable_backward.launches
    auto = grads(None)
    assert (hopper_backward.launches, portable_backward.launches) == (before + 1, portable)
    pinned = grads({"BACKEND": "TRITON"})
    tuned = grads({"BLOCK_M1": 32})  # a portable backward tile: the portable kernels
    assert (hopper_backward.launches, portable_backward.launches) == (before + 1, portable + 2)
    for a, b, c in zip(auto, pinned, tuned):
        assert rel_err(a, b) < 1e-2 and rel_err(c, b) < 1e-2


def test_learnable_tensors_and_broadcast_batches_take_the_portable_backward():
    B, H, L = 2, 4, 1024
    score_mod, mask_mod = CATALOGUE["t5_bias"].build(B, H, L, L, DEVICE)
    leaves = qkv_leaves(B, H, H, L, L, 64)
    block_mask = create_block_mask(mask_mod, None, None, L, L, device=DEVICE) if mask_mod else None
    before = hopper_backward.launches
    out = flex_attention(leaves["q"], leaves["k"], leaves["v"], score_mod=score_mod, block_mask=block_mask)
    out.sum().backward()  # AUTO: the portable backward, no error
    assert hopper_backward.launches == before
    out = flex_attention(leaves["q"], leaves["k"], leaves["v"], score_mod=score_mod, block_mask=block_mask,
                         kernel_options=GLUON)
    with pytest.raises(InvalidInputError, match="learnable"):
        out.sum().backward()
    q = torch.randn(B, H, L, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, H, L, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = flex_attention(q, k, v)
    out.sum().backward()
    assert hopper_backward.launches == before
    gold = reference_attention(q.double(), k.double().expand(B, -1, -1, -1), v.double().expand(B, -1, -1, -1))[0]
    assert rel_err(out, gold) < 1e-2
