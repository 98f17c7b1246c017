"""Compiled Triton kernels on a real GPU at realistic sizes (run on the device; skipped without CUDA)."""

import pytest
import torch
from numerics import rel_err

from flexattn import AuxRequest, create_block_mask, flex_attention
from flexattn.reference import reference_attention
from flexattn.variants import CATALOGUE, causal_mask, generate_alibi_bias, generate_tanh_softcap

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float32: 5e-3}  # fp32 may use tf32




@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", [name for name, v in CATALOGUE.items() if v.paper])  # all: test_variants.py
def test_variants_realistic(variant, head_dim, dtype):
    B, H, L = 2, 4, 2048
    q, k, v = (torch.randn(B, H, L, head_dim, device="cuda", dtype=dtype) for _ in range(3))
    score_mod, mask_mod = CATALOGUE[variant].build(B, H, L, L, "cuda")
    bm = create_block_mask(mask_mod, None, None, L, L, device="cuda") if mask_mod else None
    out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_aux=AuxRequest(lse=True))
    ref, ref_lse, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=score_mod, mask_mod=mask_mod)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert rel_err(aux.lse, ref_lse) < 1e-3


@pytest.mark.parametrize("head_dim", [16, 48, 80, 96, 192, 256])
def test_head_dims_and_odd_lengths(head_dim):
    q = torch.randn(1, 8, 1000, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 1531, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, 1531, head_dim, device="cuda", dtype=torch.bfloat16)
    bm = create_block_mask(causal_mask, None, None, 1000, 1531, device="cuda")
    alibi = generate_alibi_bias(8, "cuda")
    out = flex_attention(q, k, v, score_mod=alibi, block_mask=bm, enable_gqa=True)
    ref, _, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=alibi, mask_mod=causal_mask, enable_gqa=True)
    assert rel_err(out, ref) < 2e-2


def test_float32_follows_matmul_precision():
    q, k, v = (torch.randn(1, 2, 512, 64, device="cuda") for _ in range(3))
    ref, _, _ = reference_attention(q.double(), k.double(), v.double())
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert rel_err(flex_attention(q, k, v), ref) < 1e-5
        torch.set_float32_matmul_precision("high")
        assert rel_err(flex_attention(q, k, v), ref) < 5e-3
    finally:
        torch.set_float32_matmul_precision(old)


def _lowered_score_mod_text(score_mod, tanh_approx: bool) -> str:
    # The score_mod as lowered for the latest launch of its kernel (forward_kernel's key).
    import flexattn.kernels.forward as rt
    from flexattn.trace import trace_mod

    lowered = rt._kernels[(trace_mod(score_mod, "score_mod")[0], None, tanh_approx)].last_plan.compiled.spec.score_mod
    return lowered.body + "\n" + lowered.result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tanh_approx_accuracy(dtype):
    # TANH_APPROX=False must run the exact tanh even where the hardware one is the default (16-bit
    # inputs): assert which one each call lowered, then compare both with float64.
    q, k, v = (torch.randn(1, 4, 1024, 64, device="cuda", dtype=dtype) * 3 for _ in range(3))
    softcap = generate_tanh_softcap(20.0)
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # fp32: no tf32 rounding to hide the tanh's error
    try:
        # The portable forward's lowering is the one inspected (BACKEND='TRITON': no Gluon kernel).
        exact = flex_attention(q, k, v, score_mod=softcap, kernel_options={"BACKEND": "TRITON", "TANH_APPROX": False})
        approx = flex_attention(q, k, v, score_mod=softcap, kernel_options={"BACKEND": "TRITON", "TANH_APPROX": True})
    finally:
        torch.set_float32_matmul_precision(old)
    exact_text, approx_text = _lowered_score_mod_text(softcap, False), _lowered_score_mod_text(softcap, True)
    assert "precise_tanh(" in exact_text and "tanh_approx" not in exact_text
    assert "tanh_approx(" in approx_text
    ref, _, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=softcap)
    if dtype == torch.float32:
        # tanh.approx.f32 is good to about 2^-11: far above float32's rounding, which the exact one keeps.
        assert rel_err(exact, ref) < 1e-5
        assert 1e-5 < rel_err(approx, ref) < 2e-3
    else:
        assert rel_err(exact, ref) < 2e-2
        assert rel_err(approx, ref) < 2e-2


def test_backward_through_triton_forward():
    q, k, v = (torch.randn(1, 2, 512, 64, device="cuda", dtype=torch.float32, requires_grad=True) for _ in range(3))
    alibi = generate_alibi_bias(2, "cuda")
    bm = create_block_mask(causal_mask, None, None, 512, 512, device="cuda")
    torch.set_float32_matmul_precision("highest")
    out = flex_attention(q, k, v, score_mod=alibi, block_mask=bm)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _, _ = reference_attention(q64, k64, v64, score_mod=alibi, mask_mod=causal_mask)
    ref_grads = torch.autograd.grad(ref.sum(), (q64, k64, v64))
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-4


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("head_dim,length", [(64, 4096), (80, 1000), (128, 1531), (64, 1000)])
def test_tma_loads_match(head_dim, length, host):
    # Q, K, V and O through descriptors; odd lengths end in partial tiles the copy engine clips.
    q, k, v = (torch.randn(2, 4, length, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bm = create_block_mask(causal_mask, None, None, length, length, device="cuda")
    alibi = generate_alibi_bias(4, "cuda")
    plain = flex_attention(q, k, v, score_mod=alibi, block_mask=bm, kernel_options={"USE_TMA": False})
    tma = flex_attention(q, k, v, score_mod=alibi, block_mask=bm, kernel_options={"USE_TMA": True, "HOST_DESCRIPTORS": host})
    ref, _, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=alibi, mask_mod=causal_mask)
    assert rel_err(tma, ref) < 2e-2
    assert rel_err(tma, plain) < 1e-2
    if _hopper():
        assert _constexprs_of(alibi, causal_mask)["HOST_DESCRIPTORS"] == host


def _constexprs_of(score_mod, mask_mod):
    # What the latest launch of the bf16/fp16 kernel for these mods used (forward_kernel's key).
    import flexattn.kernels.forward as rt
    from flexattn.trace import trace_mod

    score = trace_mod(score_mod, "score_mod")[0] if score_mod else None
    return rt._kernels[(score, trace_mod(mask_mod, "mask_mod")[0], True)].last_plan.constexprs("forward")


@pytest.mark.parametrize("layout", ["gqa", "sequence_major", "kv_batch_broadcast", "kv_expanded", "odd_length"])
def test_host_descriptors_layouts(layout):
    # See [Note] Host descriptors: 4-D descriptors index (batch, head, row); GQA maps query heads
    # to key heads; a key/value batch of 1 is broadcast by the kernel, while an expanded one has
    # stride 0, which descriptors cannot encode, so it goes through in-kernel descriptors.
    B, H, L, D = 2, 4, 2048 if layout != "odd_length" else 1990, 64
    hkv = 2 if layout == "gqa" else H
    if layout == "sequence_major":
        q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    else:
        q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
        kv_b = 1 if layout in ("kv_batch_broadcast", "kv_expanded") else B
        k, v = (torch.randn(kv_b, hkv, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        if layout == "kv_expanded":
            k, v = k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)
    doc = CATALOGUE["document_mask"].build(B, H, L, L, "cuda")[1]
    for mask_mod in (causal_mask, doc):
        bm = create_block_mask(mask_mod, None, None, L, L, device="cuda")
        out, aux = flex_attention(q, k, v, block_mask=bm, enable_gqa=layout == "gqa", return_aux=AuxRequest(lse=True),
                                  kernel_options={"USE_TMA": True, "HOST_DESCRIPTORS": True})
        k_ref, v_ref = (t.expand(B, -1, -1, -1) for t in (k, v))
        ref, ref_lse, _ = reference_attention(q.double(), k_ref.double(), v_ref.double(), mask_mod=mask_mod,
                                              enable_gqa=layout == "gqa")
        assert rel_err(out, ref) < 2e-2
        assert rel_err(aux.lse, ref_lse) < 1e-3
        if _hopper():
            used = _constexprs_of(None, mask_mod)["HOST_DESCRIPTORS"]
            assert used == (layout != "kv_expanded")


def _hopper():
    return torch.cuda.get_device_capability() == (9, 0)


def _last_plan_constexprs():
    # The kernel without mods for 16-bit inputs (forward_kernel's key: score, mask, tanh_approx).
    import flexattn.kernels.forward as rt

    kernel = rt._kernels[(None, None, True)]
    return kernel.last_plan.constexprs("forward")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "gqa", "sequence_major"])
def test_warp_specialized_loop(dtype, layout):
    # The default for d=128 without mods on Hopper and Triton 3.6 (configs._HOPPER_WS_CONFIG).
    B, H, L, D = 2, 8, 4096, 128
    if layout == "sequence_major":  # [B, L, H, D] storage viewed as [B, H, L, D]
        q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(3))
    else:
        hkv = 2 if layout == "gqa" else H
        q = torch.randn(B, H, L, D, device="cuda", dtype=dtype)
        k, v = (torch.randn(B, hkv, L, D, device="cuda", dtype=dtype) for _ in range(2))
    gqa = layout == "gqa"
    from flexattn.kernels.configs import warp_specialization_validated

    ref, ref_lse, _ = reference_attention(q.double(), k.double(), v.double(), enable_gqa=gqa)
    forced = flex_attention(q, k, v, enable_gqa=gqa, kernel_options={"USE_TMA": True, "WARP_SPECIALIZE": True})
    assert _last_plan_constexprs()["WARP_SPECIALIZE"]
    out = flex_attention(q, k, v, enable_gqa=gqa, kernel_options={"BACKEND": "TRITON"})  # the portable default
    assert _last_plan_constexprs()["WARP_SPECIALIZE"] == (_hopper() and warp_specialization_validated())
    # Under Triton 3.6's warp specialisation a pointer store of the LSE loses half the rows; the
    # kernel stores it through a descriptor, which needs Q_LEN % 4 == 0.
    with_lse, aux = flex_attention(q, k, v, enable_gqa=gqa, return_aux=AuxRequest(lse=True),
                                   kernel_options={"WARP_SPECIALIZE": True})
    assert _last_plan_constexprs()["WARP_SPECIALIZE"]
    for result in (forced, out, with_lse):
        assert rel_err(result, ref) < TOLERANCE[dtype]
    assert rel_err(aux.lse, ref_lse) < 1e-3
    q_odd = q[:, :, : L - 2]
    odd, odd_aux = flex_attention(q_odd, k, v, enable_gqa=gqa, return_aux=AuxRequest(lse=True),
                                  kernel_options={"WARP_SPECIALIZE": True})
    assert not _last_plan_constexprs()["WARP_SPECIALIZE"]
    assert rel_err(odd, ref[:, :, : L - 2]) < TOLERANCE[dtype]
    assert rel_err(odd_aux.lse, ref_lse[:, :, : L - 2]) < 1e-3


def test_load_path_defaults():
    from flexattn.kernels.configs import select_config, warp_specialization_validated

    dev = torch.device("cuda")
    bf16 = torch.bfloat16
    noop128 = select_config(dev, bf16, 128, 128, 128, 128, tma_ok=True)
    masked128 = select_config(dev, bf16, 128, 128, 128, 128, has_mask_mod=True, blocks_per_row=64, tma_ok=True)
    sparse64 = select_config(dev, bf16, 64, 64, 128, 128, has_mask_mod=True, blocks_per_row=2, tma_ok=True)
    sparse128_host = select_config(dev, bf16, 128, 128, 128, 128, has_mask_mod=True, blocks_per_row=2, tma_ok=True,
                                   host_descriptors_ok=True)
    long64_host = select_config(dev, bf16, 64, 64, 128, 128, has_mask_mod=True, blocks_per_row=64, tma_ok=True,
                                host_descriptors_ok=True)
    long128_host = select_config(dev, bf16, 128, 128, 128, 128, has_mask_mod=True, blocks_per_row=64, tma_ok=True,
                                 host_descriptors_ok=True)
    odd128 = select_config(dev, bf16, 128, 128, 128, 128, tma_ok=True, even_n=False)
    lse128 = select_config(dev, bf16, 128, 128, 128, 128, tma_ok=True, row_stats=True)
    assert not sparse64.USE_TMA and not masked128.WARP_SPECIALIZE
    assert not odd128.WARP_SPECIALIZE and not lse128.WARP_SPECIALIZE
    assert not select_config(dev, bf16, 128, 128, 128, 128, tma_ok=False).USE_TMA
    assert not long128_host.HOST_DESCRIPTORS  # Triton loads 4-D descriptors of 256-byte rows slowly
    if _hopper():
        assert noop128.USE_TMA and masked128.USE_TMA
        assert sparse128_host.USE_TMA and sparse128_host.HOST_DESCRIPTORS
        assert long64_host.USE_TMA and long64_host.HOST_DESCRIPTORS
        assert noop128.WARP_SPECIALIZE == warp_specialization_validated()


AUTOTUNE_CHILD = r"""
import json, sys, time, torch, flexattn, flexattn.kernels.configs
from flexattn.variants import causal_mask
q, k, v = (torch.randn(2, 8, 2048, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
bm = flexattn.create_block_mask(causal_mask, None, None, 2048, 2048, device="cuda")
t0 = time.perf_counter()
out = flexattn.flex_attention(q, k, v, block_mask=bm, kernel_options={"AUTOTUNE": True})
torch.cuda.synchronize()
print(json.dumps({"seconds": time.perf_counter() - t0, "finite": bool(torch.isfinite(out).all()),
                  "searches": flexattn.kernels.configs.tuned_configs.searches}))
"""


def test_autotuned_choice_persists_across_processes(tmp_path):
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "FLEXATTN_CACHE_DIR": str(tmp_path), "PYTHONPATH": root}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", AUTOTUNE_CHILD], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    table = json.loads((tmp_path / "autotune.json").read_text())
    assert len(table) == 1 and all(r["finite"] for r in runs)
    # The second process reads the stored choice instead of timing candidates again.
    assert [r["searches"] for r in runs] == [1, 0]


def _mask_from_table(allowed: torch.Tensor):
    """One mask_mod per table, all sharing one traced graph (and so one kernel and its launch plans)."""

    def from_table(b, h, q_idx, kv_idx):
        return allowed[q_idx, kv_idx]

    return from_table


def test_masks_rebuilt_every_step_match_the_reference():
    # Issue 8, item 2: on an H200, a 40-step loop alternating two block patterns, building a new
    # BlockMask each step and freeing the old one, gave 0.46 relative error at the steps whose mask
    # got a freed mask's id (and with it that mask's CONSECUTIVE_* constexprs).
    import gc

    from flexattn import BlockMask

    L, block = 1024, 128
    pos = torch.arange(L, device="cuda")
    causal = pos[:, None] >= pos[None, :]
    every_other = ((pos[None, :] // block) % 2 == 0) | (pos[:, None] == pos[None, :])  # full blocks not consecutive
    patterns = [_mask_from_table(causal), _mask_from_table(every_other)]
    q, k, v = (torch.randn(1, 4, L, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    refs = [reference_attention(q.double(), k.double(), v.double(), mask_mod=p)[0] for p in patterns]
    # Whether CPython hands a freed mask's id to the next one depends on the allocator's state (under
    # pytest-xdist it often did not): half the steps free the mask and build a new one, the other half
    # re-initialise one kept object, whose id() is then the same for both patterns by construction.
    kept = BlockMask.__new__(BlockMask)
    bm = None
    for step in range(40):
        pattern = step % 2
        fresh = create_block_mask(patterns[pattern], None, None, L, L, device="cuda")
        tables = (fresh.kv_num_blocks, fresh.kv_indices, fresh.full_kv_num_blocks, fresh.full_kv_indices)
        del fresh
        if step % 4 < 2:
            del bm
            gc.collect()
            bm = BlockMask.__new__(BlockMask)  # allocated right after the free: may take the freed mask's id
        else:
            bm = kept
        bm.__init__((L, L), *tables, None, None, None, None, BLOCK_SIZE=block, mask_mod=patterns[pattern])
        out = flex_attention(q, k, v, block_mask=bm)
        assert rel_err(out, refs[pattern]) < 2e-2, f"step {step}"


def test_linearised_index_mod_at_128k_tokens():
    # Issue 8, item 3: q_idx * L + kv_idx leaves int32 at L = 131072 (relative error 1.13 on an
    # H200 when it wrapped). The full reference is too large: compare a sample of query rows with
    # a float64 computation for those rows only, the mask evaluated with exact integers.
    L, D = 131072, 64

    def linearised(b, h, q_idx, kv_idx):
        return ((q_idx * L + kv_idx) % 3 == 0) | (q_idx == kv_idx)

    q, k, v = (torch.randn(1, 1, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bm = create_block_mask(linearised, None, None, L, L, device="cuda")
    out = flex_attention(q, k, v, block_mask=bm)
    rows = torch.cat([torch.arange(0, 8), torch.randint(0, L, (56,)), torch.arange(L - 8, L)]).to("cuda")
    kv = torch.arange(L, device="cuda", dtype=torch.int64)
    keep = ((rows[:, None].to(torch.int64) * L + kv[None, :]) % 3 == 0) | (rows[:, None] == kv[None, :])
    scores = (q[0, 0, rows].double() @ k[0, 0].double().T) / D**0.5
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    ref = probs @ v[0, 0].double()
    assert rel_err(out[0, 0, rows], ref) < 2e-2


def test_a_mods_own_constant_table_is_read_from_one_device_copy():
    def table_bias(score, b, h, q_idx, kv_idx):
        table = torch.tensor([0.5, -1.0, 2.0, 0.25])  # built by the mod, on the CPU
        return score + table[(q_idx + kv_idx) % 4]

    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda") for _ in range(3))
    mask = create_block_mask(causal_mask, None, None, 300, 300, device="cuda")
    # The float64 reference evaluates the mod eagerly: on the CPU, where the mod builds its table.
    q64, k64, v64 = (t.double().cpu().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, score_mod=table_bias, mask_mod=causal_mask)[0]
    ref.sum().backward()
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        for _ in range(2):  # the second call reuses the device copy
            assert rel_err(flex_attention(q, k, v, score_mod=table_bias, block_mask=mask).cpu(), ref) < 1e-4
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        flex_attention(qg, kg, vg, score_mod=table_bias, block_mask=mask).sum().backward()  # the backward reads it too
        for mine, expected in ((qg.grad, q64.grad), (kg.grad, k64.grad), (vg.grad, v64.grad)):
            assert rel_err(mine.cpu(), expected) < 1e-4
        last = q[:, :, -1:]
        dec = flex_attention(last, k, v, score_mod=table_bias, kernel_options={"BACKEND": "TRITON_DECODE"})
        dec_ref = reference_attention(last.double().cpu(), k.double().cpu(), v.double().cpu(), score_mod=table_bias)[0]
        assert rel_err(dec.cpu(), dec_ref) < 1e-4
    finally:
        torch.set_float32_matmul_precision(old)


def _misaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """The same values, shape and strides, at an address that is not 16-byte aligned."""
    buf = torch.empty(t.numel() + 16, dtype=t.dtype, device=t.device)
    view = buf[1:1 + t.numel()].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 and view.stride() == t.stride()
    return view


def test_direct_launches_stay_correct_when_alignment_and_captured_tensors_change():
    # flexattn.kernels.launch calls a compiled kernel directly once Triton's own launch chose it for the same
    # specialisation facts. The same shapes and strides must still reach a kernel specialised for
    # what each call passes: a misaligned view, a new (misaligned) learnable table, a new mask.
    import flexattn.kernels.launch

    B, H, L, D = 1, 4, 320, 64
    torch.manual_seed(0)
    bias = torch.randn(H, device="cuda")

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (q_idx - kv_idx)

    mask = create_block_mask(causal_mask, None, None, L, L, device="cuda")
    before = flexattn.kernels.launch.fast_launches
    for step in range(6):
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
        if step >= 3:  # same shapes and strides as the earlier steps, new facts
            q, k, v, dout = (_misaligned_copy(t) for t in (q, k, v, dout))
        if step == 4:
            bias = _misaligned_copy(torch.randn(H, device="cuda"))
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        ref = reference_attention(q64, k64, v64, score_mod=head_bias, mask_mod=causal_mask)[0]
        ref.backward(dout.double())
        qg, kg, vg = (t.clone().requires_grad_() if t.data_ptr() % 16 == 0 else _misaligned_copy(t).requires_grad_()
                      for t in (q, k, v))
        out = flex_attention(qg, kg, vg, score_mod=head_bias, block_mask=mask)
        out.backward(dout)
        assert rel_err(out, ref) < 2e-2, f"step {step}"
        for mine, expected in ((qg.grad, q64.grad), (kg.grad, k64.grad), (vg.grad, v64.grad)):
            assert rel_err(mine, expected) < 2e-2, f"step {step}"
        last = q[:, :, -1:]  # decode: one query row against the cache
        dec = flex_attention(last, k, v, score_mod=head_bias, kernel_options={"BACKEND": "TRITON_DECODE"})
        dec_ref = reference_attention(last.double(), k.double(), v.double(), score_mod=head_bias)[0]
        assert rel_err(dec, dec_ref) < 2e-2, f"step {step}"
    assert flexattn.kernels.launch.fast_launches > before  # the direct path ran


def test_direct_launches_with_host_descriptors_follow_new_tensors(monkeypatch):
    # The portable forward reads Q, K, V and writes the output through host tensor descriptors on
    # Hopper; launches with the same facts go straight to the launcher, which encodes each call's
    # descriptors from that call's tensors (new addresses every step here).
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("host tensor descriptors need Hopper")
    import flexattn.kernels.forward as forward_module
    import flexattn.kernels.launch

    # Descriptors are built (host_descriptors) on the long way and copied over each call's tensors
    # (descriptor_over) by a prepared launch: either way, over that call's own tensors.
    described = []
    real_build, real_over = forward_module.host_descriptors, forward_module.descriptor_over

    def build(q, k, v, out, constexprs):
        described.extend(t.data_ptr() for t in (q, k, v))
        return real_build(q, k, v, out, constexprs)

    def over(template, base):
        described.append(base.data_ptr())
        return real_over(template, base)

    monkeypatch.setattr(forward_module, "host_descriptors", build)
    monkeypatch.setattr(forward_module, "descriptor_over", over)
    B, H, L, D = 2, 4, 1024, 64
    mask = create_block_mask(causal_mask, None, None, L, L, device="cuda")
    before = flexattn.kernels.launch.fast_launches
    for step in range(4):
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        described.clear()
        out = flex_attention(q, k, v, block_mask=mask, kernel_options={"USE_TMA": True, "HOST_DESCRIPTORS": True})
        assert {t.data_ptr() for t in (q, k, v)} <= set(described), f"step {step}: descriptors not over this step's tensors"
        ref = reference_attention(q.double(), k.double(), v.double(), mask_mod=causal_mask)[0]
        assert rel_err(out, ref) < 1e-2, f"step {step}"
    assert flexattn.kernels.launch.fast_launches >= before + 3  # every launch after the first


@pytest.mark.parametrize("variant, head_dim", [("longformer", 64), ("graphormer", 64), ("graphormer", 128), ("t5_bias", 128)])
def test_default_tiles_the_compiler_made_costly_are_replaced(variant, head_dim):
    """[Note] Tiles the compiler made costly: after the first call of a problem, a default plan whose
    kernel spilled or staged gathered tiles is replaced by a cheaper one, step by step, and every
    call stays equal to the float64 reference. On the H100 with Triton 3.6 each of these entries
    starts from such a kernel (the census in kernels/family.py); elsewhere the test checks what happened."""
    import flexattn.kernels.family as family
    import flexattn.kernels.forward as rt
    from flexattn.kernels.launch import spilled_bytes

    B, H, L = 1, 4, 2048
    q, k, v = (torch.randn(B, H, L, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    inst = CATALOGUE[variant].make(B, H, L, L, "cuda")
    bm = inst.block_mask(None, None, L, L, "cuda")
    ref, _, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=inst.score_mod, mask_mod=inst.mask_mod)
    launched = []
    real = rt.launch

    def spy(*args):
        launched.append(real(*args))
        return launched[-1]

    rt.launch, plans = spy, []
    try:
        for _ in range(6):
            out = flex_attention(q, k, v, score_mod=inst.score_mod, block_mask=bm, kernel_options={"BACKEND": "TRITON"})
            assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
            kernel = list(rt._kernels.values())[-1]
            plans.append(dict(kernel.last_plan.constexprs("forward")))
    finally:
        rt.launch = real
    first, last = launched[0], launched[-1]
    roles = rt.ForwardKernel.TILE_ROLES["forward"]
    costly_first = (spilled_bytes(first) > family.SPILL_LIMIT_BYTES
                    or first.metadata.shared - family._tile_bytes(plans[0], roles, 2) >= family.STAGED_GATHER_BYTES)
    if costly_first:
        assert plans[-1] != plans[0]
    assert spilled_bytes(last) <= family.SPILL_LIMIT_BYTES or min(plans[-1]["BLOCK_M"], plans[-1]["BLOCK_N"]) == 32
    assert (last.metadata.shared - family._tile_bytes(plans[-1], roles, 2) < family.STAGED_GATHER_BYTES
            or plans[-1]["num_stages"] == 1)
    assert plans[-1] == plans[-2]  # settled
