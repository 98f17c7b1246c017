"""The Hopper Gluon forward (kernels/hopper/forward.py) on a real H100-class GPU: output and LSE against the
float64 reference under the flash-attention rule, fully masked rows, GQA, a transposed layout, the
backward after it, and which calls take it. Skipped without CUDA; skipped where the kernel does not
apply (another GPU, another Triton), since there the portable forward is the one tested elsewhere.

The rule (as tests/test_gpu_backward.py): the norm-wise error against float64 must be at most
``FACTOR`` times the error of the same attention written in plain PyTorch in the same dtype, plus
``SLACK``. Every output buffer is NaN-filled before the kernel writes it (poisoned), so a row the
kernel skipped shows up as NaN.
"""

from __future__ import annotations

import pytest
import torch
from numerics import rel_err
from test_gpu_backward import SLACK, check_flash_rule, qkv_leaves, same_dtype_attention

import flexattn.kernels.launch as launch_module
import flexattn.kernels.hopper.forward as hopper_forward
from flexattn import AuxRequest, create_block_mask, flex_attention
from flexattn.errors import InvalidInputError
from flexattn.reference import reference_attention
from flexattn.variants import CATALOGUE

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
FACTOR = 2.0
GLUON = {"BACKEND": "GLUON"}


@pytest.fixture(autouse=True)
def hopper_and_poisoned(monkeypatch):
    probe = torch.empty(1, 1, 128, 64, device=DEVICE, dtype=torch.bfloat16)
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 128, 128, device=DEVICE)
    reason = hopper_forward.problem_reason(probe, probe, probe, mask, need_max=False)
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setattr(launch_module, "_POISON_OUTPUTS", True)


def check_forward(q, k, v, score_mod=None, mask_mod=None, *, gqa=False, mask_heads=False, options=GLUON):
    """flexattn's out and LSE (through the Gluon kernel: its launch counter must grow) vs float64,
    against PyTorch's same-dtype error. Returns {name: (ours, PyTorch's)}."""
    B, Hq, L, _ = q.shape
    S = k.shape[2]
    block_mask = create_block_mask(mask_mod, B if mask_heads else None, Hq if mask_heads else None, L, S,
                                   device=DEVICE) if mask_mod else None
    before = hopper_forward.launches
    out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa,
                              kernel_options=options, return_aux=AuxRequest(lse=True))
    torch.cuda.synchronize()
    assert hopper_forward.launches == before + 1, "the Gluon kernel did not run"
    assert not torch.isnan(out).any() and not torch.isnan(aux.lse).any(), "a row was never written"
    gold_out, gold_lse, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=score_mod,
                                                mask_mod=mask_mod, enable_gqa=gqa)
    base_out, base_lse = same_dtype_attention(q, k, v, score_mod, mask_mod, enable_gqa=gqa)
    errors = {"out": (rel_err(out, gold_out), rel_err(base_out, gold_out)),
              "lse": (rel_err(aux.lse, gold_lse), rel_err(base_lse, gold_lse))}
    failures = [f"{name}: {ours:.2e} vs {theirs:.2e} in PyTorch at {q.dtype}"
                for name, (ours, theirs) in errors.items() if ours > FACTOR * theirs + SLACK]
    print({name: f"{ours:.2e} (PyTorch {theirs:.2e})" for name, (ours, theirs) in errors.items()})
    assert not failures, "error against float64 above the flash-attention rule: " + "; ".join(failures)
    return errors


def qkv(B, Hq, Hkv, L, E, dtype):
    return tuple(torch.randn(B, h, L, E, device=DEVICE, dtype=dtype) for h in (Hq, Hkv, Hkv))


def qkv_in_layout(B, Hq, Hkv, L, layout, dtype=torch.bfloat16):
    """Head dim 64 in [B, H, N, D] storage ("bhnd") or [B, N, H, D] storage seen as [B, H, N, D]."""
    if layout == "bhnd":
        return qkv(B, Hq, Hkv, L, 64, dtype)
    return tuple(torch.randn(B, L, h, 64, device=DEVICE, dtype=dtype).transpose(1, 2) for h in (Hq, Hkv, Hkv))


VARIANTS = ("noop", "causal", "sliding_window", "document_mask", "prefix_lm")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", VARIANTS)
def test_catalogue_masks(variant, head_dim, dtype):
    B, H, L = 2, 4, 2048
    score_mod, mask_mod = CATALOGUE[variant].build(B, H, L, L, DEVICE)
    check_forward(*qkv(B, H, H, L, head_dim, dtype), score_mod, mask_mod)


@pytest.mark.parametrize("variant", ["causal", "document_mask"])
def test_gqa_8_2(variant):
    B, L = 2, 2048
    score_mod, mask_mod = CATALOGUE[variant].build(B, 8, L, L, DEVICE)
    check_forward(*qkv(B, 8, 2, L, 128, torch.bfloat16), score_mod, mask_mod, gqa=True, mask_heads=True)


@pytest.mark.parametrize("variant", ["alibi", "softcap"])
def test_score_mods(variant):
    B, H, L = 2, 4, 2048
    score_mod, mask_mod = CATALOGUE[variant].build(B, H, L, L, DEVICE)
    check_forward(*qkv(B, H, H, L, 64, torch.bfloat16), score_mod, mask_mod)


def launched_steps(monkeypatch) -> list:
    """The forward steps the Gluon family launches from now on (a list that fills as it runs), the long
    way's and the prepared launches' ([Note] Prepared Gluon forward launches)."""
    steps = []
    real = hopper_forward.HopperForwardKernel._launch
    real_prepared = hopper_forward.PreparedHopperForward.run

    def launch(self, plan, *args):
        steps.append(plan.steps["forward"])
        return real(self, plan, *args)

    def prepared(self, problem):
        result = real_prepared(self, problem)
        if result is not None:
            steps.append(self.plan.steps["forward"])
        return result

    monkeypatch.setattr(hopper_forward.HopperForwardKernel, "_launch", launch)
    monkeypatch.setattr(hopper_forward.PreparedHopperForward, "run", prepared)
    return steps


@pytest.mark.parametrize("variant, B, Hq, Hkv, L, layout", [
    ("noop", 2, 4, 4, 1280, "bhnd"),  # 20 slices of 64 rows: the last program repeats 64 rows
    ("noop", 1, 8, 2, 1152, "bhnd"),  # 18 slices: every program full; GQA 4:1
    ("softcap", 2, 4, 4, 640, "bnhd"),  # 10 slices: the last program repeats 128 rows
    ("alibi", 1, 4, 4, 128, "bnhd"),  # one program, two of its consumers on the same rows
    ("noop", 1, 2, 2, 4096, "bhnd"),  # 32 key blocks: three consumers under the rule as it is
])
def test_three_consumers_on_unmasked_calls(variant, B, Hq, Hkv, L, layout, monkeypatch):
    # [Note] Three consumers on an unmasked walk (kernels/hopper/forward.py): programs of 192 rows, the last of a
    # (batch, head) reaching past the queries; checked against float64, LSE included.
    steps = launched_steps(monkeypatch)
    monkeypatch.setattr(hopper_forward, "THREE_CONSUMERS_MIN_KEY_BLOCKS", 0)  # the short rows' programs too
    score_mod, _ = CATALOGUE[variant].build(B, Hq, L, L, DEVICE)
    q, k, v = qkv_in_layout(B, Hq, Hkv, L, layout)
    check_forward(q, k, v, score_mod, None, gqa=Hq != Hkv)
    assert steps[-1].constexprs["CONSUMERS"] == 3 and steps[-1].grid[0] == -(-L // 192)


@pytest.mark.parametrize("variant, B, Hq, Hkv, L, layout", [
    ("causal", 2, 4, 4, 1280, "bhnd"),  # 7 programs: the last one's three consumers in one query block
    ("causal", 1, 4, 4, 1280, "fp16"),  # the same in float16
    ("sliding_window", 1, 8, 2, 1152, "bhnd"),  # every program full; GQA 4:1
    ("document_mask", 2, 4, 4, 3200, "bnhd"),  # 17 programs, the last repeats 64 rows; per-batch documents
    ("prefix_lm", 1, 4, 4, 128, "bnhd"),  # one program, one query block
    ("alibi", 1, 4, 4, 1408, "bhnd"),  # a score_mod with the causal mask
    ("causal", 1, 2, 2, 6144, "bhnd"),  # 24.5 key blocks a row: three consumers under the rule as it is
])
def test_three_consumers_on_masked_calls(variant, B, Hq, Hkv, L, layout, monkeypatch):
    # [Note] Programs across query blocks (kernels/hopper/forward.py): a 192-row program walks the union of its
    # two query blocks' walks; the blocks not listed for a consumer's rows keep nothing there.
    steps = launched_steps(monkeypatch)
    if L < 6144:
        monkeypatch.setattr(hopper_forward, "THREE_CONSUMERS_MIN_KEY_BLOCKS", 0)  # the short rows' programs too
    score_mod, mask_mod = CATALOGUE[variant].build(B, Hq, L, L, DEVICE)
    if layout == "fp16":
        q, k, v = qkv_in_layout(B, Hq, Hkv, L, "bhnd", torch.float16)
    else:
        q, k, v = qkv_in_layout(B, Hq, Hkv, L, layout)
    check_forward(q, k, v, score_mod, mask_mod, gqa=Hq != Hkv, mask_heads=variant == "document_mask")
    step = steps[-1]
    assert step.constexprs["CONSUMERS"] == 3 and step.constexprs["UNION_WALK"] and step.grid[0] == -(-L // 192)


def test_three_consumers_follow_each_masks_walks(monkeypatch):
    # Two masks of one shape, and one mask's tables rewritten in place between calls: each call walks
    # its own mask's present tables (the program walks are derived again), never an earlier call's.
    steps = launched_steps(monkeypatch)
    monkeypatch.setattr(hopper_forward, "THREE_CONSUMERS_MIN_KEY_BLOCKS", 0)  # the narrow window's programs too
    B, H, L = 1, 2, 3072
    q, k, v = qkv(B, H, H, L, 64, torch.bfloat16)

    def window(w):
        return lambda b, h, qi, ki: (qi >= ki) & (qi - ki < w)

    masks = {w: create_block_mask(window(w), None, None, L, L, device=DEVICE) for w in (256, 2048)}
    for w in (256, 2048, 256):
        out = flex_attention(q, k, v, block_mask=masks[w], kernel_options=GLUON)
        gold, _, _ = reference_attention(q.double(), k.double(), v.double(), mask_mod=window(w))
        assert rel_err(out, gold) < 1e-2, f"window {w}"
    mask = masks[256]
    wide = masks[2048]
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        getattr(mask, name).copy_(getattr(wide, name))
    mask.mask_mod = wide.mask_mod
    out = flex_attention(q, k, v, block_mask=mask, kernel_options=GLUON)
    gold, _, _ = reference_attention(q.double(), k.double(), v.double(), mask_mod=window(2048))
    assert rel_err(out, gold) < 1e-2, "the rewritten tables"
    assert [step.constexprs["UNION_WALK"] for step in steps] == [True] * 4


def test_a_capture_walks_the_tables_as_they_are_at_each_replay(monkeypatch):
    # [Note] Programs across query blocks: walks derived before a capture would stay in its replays
    # whatever the tables hold by then, so a capture takes two consumers and the tables themselves.
    steps = launched_steps(monkeypatch)
    monkeypatch.setattr(hopper_forward, "THREE_CONSUMERS_MIN_KEY_BLOCKS", 0)  # the diagonal alone too, at the end
    B, H, L = 1, 2, 6144
    q, k, v = qkv(B, H, H, L, 64, torch.bfloat16)
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, L, device=DEVICE)

    def attend():
        return flex_attention(q, k, v, block_mask=mask, kernel_options=GLUON)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attend()
    torch.cuda.current_stream().wait_stream(side)
    assert steps[-1].constexprs["UNION_WALK"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = attend()
    assert not steps[-1].constexprs["UNION_WALK"] and steps[-1].constexprs["CONSUMERS"] == 2
    mask.full_kv_num_blocks.zero_()  # only the diagonal blocks are left
    graph.replay()
    gold, _, _ = reference_attention(q.double(), k.double(), v.double(),
                                     mask_mod=lambda b, h, qi, ki: (qi >= ki) & (qi // 128 == ki // 128))
    assert rel_err(static, gold) < 1e-2
    assert rel_err(attend(), gold) < 1e-2 and steps[-1].constexprs["UNION_WALK"]  # eager: derived again


def test_compiled_calls_walk_unions_and_follow_their_tables(monkeypatch):
    # compile/kept.py keeps the program walks per table ([Note] What a compiled call's mask derives, kept):
    # a compiled call's first launch derives them, its warm launches take the kept ones. A table
    # written in place, or a new mask of the same shape, is walked as it is: the walks are derived
    # again, never an earlier call's. Checked against float64, forward and backward.
    steps = launched_steps(monkeypatch)
    warm_steps = []
    real_warm = hopper_forward.WarmHopperForward.__call__

    def warm(self, *args, **kwargs):
        result = real_warm(self, *args, **kwargs)
        if result is not None:
            warm_steps.append(self.plan.steps["forward"])
        return result

    monkeypatch.setattr(hopper_forward.WarmHopperForward, "__call__", warm)
    B, H, L = 1, 2, 6144  # causal rows of 24.5 key blocks on average: three consumers under the rule
    q, k, v = (t.requires_grad_() for t in qkv(B, H, H, L, 64, torch.bfloat16))
    attend = torch.compile(lambda q, k, v, bm: flex_attention(q, k, v, block_mask=bm, kernel_options=GLUON),
                           fullgraph=True)

    def check(mask, mask_mod, what):
        q.grad = k.grad = v.grad = None
        out = attend(q, k, v, mask)
        out.backward(torch.ones_like(out))
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        gold, _, _ = reference_attention(*leaves, mask_mod=mask_mod)
        gold.backward(torch.ones_like(gold))
        for name, ours, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad),
                                    (gold, *(t.grad for t in leaves))):
            assert rel_err(ours, want) < 1e-2, f"{what}: {name}"

    def causal(b, h, qi, ki):
        return qi >= ki

    def diagonal(b, h, qi, ki):
        return (qi >= ki) & (qi // 128 == ki // 128)

    def window(b, h, qi, ki):
        return (qi >= ki) & (qi - ki < 1024)

    mask = create_block_mask(causal, None, None, L, L, device=DEVICE)
    for call in range(3):
        check(mask, causal, f"call {call}")
    assert steps and all(step.constexprs["UNION_WALK"] for step in steps)
    assert warm_steps and all(step.constexprs["UNION_WALK"] for step in warm_steps)
    mask.full_kv_num_blocks.zero_()  # only the diagonal blocks are left, in place
    for call in range(2):
        check(mask, diagonal, f"the tables written in place, call {call}")
    check(create_block_mask(window, None, None, L, L, device=DEVICE), window, "a new mask of the same shape")
    assert all(step.constexprs["UNION_WALK"] for step in steps + warm_steps)


def test_head_dim_128_or_short_rows_keep_two_consumers(monkeypatch):
    steps = launched_steps(monkeypatch)
    B, H, L = 1, 2, 1024
    score_mod, mask_mod = CATALOGUE["causal"].build(B, H, L, L, DEVICE)
    check_forward(*qkv(B, H, H, L, 64, torch.bfloat16), score_mod, mask_mod)
    check_forward(*qkv(B, H, H, L, 128, torch.bfloat16))
    check_forward(*qkv(B, H, H, L, 64, torch.bfloat16))  # 8 key blocks: too few for three
    assert [step.constexprs["CONSUMERS"] for step in steps] == [2, 2, 2]
    assert [step.grid[0] for step in steps] == [L // 128] * 3


def test_transposed_layout_and_broadcast_kv_batch():
    # [B, N, H, D] storage read as [B, H, N, D] (heads side by side in a row), K/V of batch 1.
    B, H, L, E = 2, 4, 1024, 64
    q = torch.randn(B, L, H, E, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(1, L, H, E, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    mask_mod = CATALOGUE["causal"].build(B, H, L, L, DEVICE)[1]
    check_forward(q, k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1), None, mask_mod)


def test_fully_masked_rows():
    # Odd query blocks see no key block at all (a row of the tables with no blocks), and odd rows of
    # the even blocks no key inside their partial blocks: out 0 and LSE -inf, as the portable forward.
    B, H, L = 1, 2, 1024

    def sparse_rows(b, h, q_idx, kv_idx):
        return ((q_idx // 128) % 2 == 0) & (q_idx % 2 == 0) & (kv_idx <= q_idx)

    q, k, v = qkv(B, H, H, L, 128, torch.bfloat16)
    block_mask = create_block_mask(sparse_rows, None, None, L, L, device=DEVICE)
    out, aux = flex_attention(q, k, v, block_mask=block_mask, kernel_options=GLUON, return_aux=AuxRequest(lse=True))
    empty = torch.arange(L, device=DEVICE)
    empty = ((empty // 128) % 2 == 1) | (empty % 2 == 1)
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    assert torch.isneginf(aux.lse[:, :, empty]).all()
    gold_out, gold_lse, _ = reference_attention(q.double(), k.double(), v.double(), mask_mod=sparse_rows)
    assert rel_err(out, gold_out) < 1e-2 and rel_err(aux.lse, gold_lse) < 1e-3


def test_two_masks_of_one_shape_reuse_no_stale_tables():
    # Same shapes, same mods (the plan cache's key), two BlockMasks of different content, in both
    # orders: each call must walk its own mask's tables, never the first call's.
    B, H, L = 1, 2, 2048
    q, k, v = qkv(B, H, H, L, 128, torch.bfloat16)
    windows = {w: create_block_mask(lambda b, h, qi, ki, w=w: (qi >= ki) & (qi - ki < w), None, None, L, L,
                                    device=DEVICE) for w in (256, 1024)}
    for w in (256, 1024, 256):
        before = hopper_forward.launches
        out = flex_attention(q, k, v, block_mask=windows[w], kernel_options=GLUON)
        assert hopper_forward.launches == before + 1
        gold, _, _ = reference_attention(q.double(), k.double(), v.double(),
                                         mask_mod=lambda b, h, qi, ki, w=w: (qi >= ki) & (qi - ki < w))
        assert rel_err(out, gold) < 1e-2, f"window {w}"


def test_direct_launches_follow_new_tensors_and_layouts():
    # After the first call, the Gluon kernels launch directly (kernels/launch.py: their descriptors
    # are specialised on dtype, block shape and layout only). Each later call, with new tensors, a
    # transposed layout of the same shape, and a new mask, must read its own inputs.
    B, H, L, E = 2, 4, 1024, 64
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, L, device=DEVICE)
    before = launch_module.fast_launches
    for transposed in (False, False, True, False, True):
        shape = (B, L, H, E) if transposed else (B, H, L, E)
        q, k, v = (torch.randn(shape, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
        if transposed:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        for t in (q, k, v):
            t.requires_grad_(True)
        out = flex_attention(q, k, v, block_mask=mask, kernel_options=GLUON)
        # The output is stored as q is ([Note] The output's layout), and so is its gradient here
        # (randn_like keeps the strides), which the Gluon backward reads as it is.
        assert out.transpose(1, 2).is_contiguous() if transposed else out.is_contiguous(), out.stride()
        grad = torch.randn_like(out)
        assert grad.stride() == out.stride()
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
        gold, _, _ = reference_attention(*leaves, mask_mod=lambda b, h, qi, ki: qi >= ki)
        gold_grads = torch.autograd.grad(gold, leaves, grad.double())
        assert rel_err(out, gold) < 1e-2, f"out (transposed={transposed})"
        for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), gold_grads):
            assert rel_err(got, want) < 2e-2, f"{name} (transposed={transposed})"
    assert launch_module.fast_launches > before, "the Gluon kernels never launched directly"


@pytest.mark.parametrize("variant, head_dim, gqa", [("causal", 128, False), ("document_mask", 64, False),
                                                    ("noop", 128, True)])
def test_backward_after_the_gluon_forward(variant, head_dim, gqa):
    B, L = 2, 2048
    Hq, Hkv = (8, 2) if gqa else (4, 4)
    score_mod, mask_mod = CATALOGUE[variant].build(B, Hq, L, L, DEVICE)
    before = hopper_forward.launches
    check_flash_rule(qkv_leaves(B, Hq, Hkv, L, L, head_dim), lambda t: (t["q"], t["k"], t["v"], score_mod), mask_mod,
                     gqa=gqa, use_lse=True, options=GLUON)
    assert hopper_forward.launches > before


def test_auto_takes_it_and_triton_pins_the_portable_forward():
    B, H, L = 1, 2, 1024
    q, k, v = qkv(B, H, H, L, 128, torch.float16)
    before = hopper_forward.launches
    auto = flex_attention(q, k, v)
    assert hopper_forward.launches == before + 1
    short = qkv(B, H, H, L, 64, torch.float16)
    flex_attention(*short)  # head dim 64, 8 blocks a row: AUTO's rule keeps the portable forward
    assert hopper_forward.launches == before + 1
    flex_attention(*short, kernel_options=GLUON)  # pinned: the rule does not apply
    assert hopper_forward.launches == before + 2
    portable = flex_attention(q, k, v, kernel_options={"BACKEND": "TRITON"})
    tuned = flex_attention(q, k, v, kernel_options={"BLOCK_M": 64})  # a portable tile: the portable kernel
    assert hopper_forward.launches == before + 2
    torch.testing.assert_close(auto, portable, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(tuned, portable, atol=2e-3, rtol=2e-3)


def test_auto_at_head_dim_64_takes_it_for_a_score_mod_alone():
    # AUTO's rule (kernels/hopper/forward.py): on long rows at head dim 64 a score_mod alone takes the Gluon
    # forward; a score_mod with a mask_mod (ALiBi) keeps the portable one.
    B, H, L = 1, 2, 4096
    q, k, v = qkv(B, H, H, L, 64, torch.bfloat16)
    softcap, _ = CATALOGUE["softcap"].build(B, H, L, L, DEVICE)
    before = hopper_forward.launches
    auto = flex_attention(q, k, v, score_mod=softcap)
    assert hopper_forward.launches == before + 1
    portable = flex_attention(q, k, v, score_mod=softcap, kernel_options={"BACKEND": "TRITON"})
    torch.testing.assert_close(auto, portable, atol=2e-2, rtol=2e-2)
    alibi, causal_mask = CATALOGUE["alibi"].build(B, H, L, L, DEVICE)
    flex_attention(q, k, v, score_mod=alibi, block_mask=create_block_mask(causal_mask, None, None, L, L, device=DEVICE))
    assert hopper_forward.launches == before + 1


def test_gluon_pinned_on_an_ineligible_call_names_the_reason():
    q, k, v = qkv(1, 2, 2, 1000, 64, torch.bfloat16)
    with pytest.raises(InvalidInputError, match="multiples of 128"):
        flex_attention(q, k, v, kernel_options=GLUON)
    before = hopper_forward.launches
    flex_attention(q, k, v)  # AUTO: the portable forward, no error
    assert hopper_forward.launches == before
